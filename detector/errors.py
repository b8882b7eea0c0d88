"""The one exception type for a user's mistake: the CLI prints its message as one line and exits 2."""


class UserError(Exception):
    """A mistake the user can fix (a bad setting, a missing file, a corrupt checkpoint): no traceback."""
