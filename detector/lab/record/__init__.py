"""The lab's records: what it writes and reads again, as typed, versioned dataclasses, each read through one function
that refuses a file of the wrong shape in one line (detector/checked.py)."""
