"""TensorBoard's event file of a run, the one writer of its scalars, images and text (``Board``): process 0's, from
the loop's start. Every other process holds one that writes nothing, and a run whose file the machine refused stops
writing to it (``refuse``), so that no part of the run asks whether it writes; the evaluation asks ``writes`` only to
skip drawing a picture that no one would see. TensorBoard's writer is imported only where a board writes."""

from __future__ import annotations

from pathlib import Path


class Board:
    """The run's TensorBoard writes: into ``run_dir``'s event file, from ``purge_step`` on (a resume's: the scalars
    past its checkpoint are purged), or nowhere (``run_dir`` None)."""

    def __init__(self, run_dir: Path | None = None, purge_step: int | None = None):
        self.writer = None
        self.refused = False
        if run_dir is not None:
            from torch.utils.tensorboard import SummaryWriter  # here alone: a second's import, on process 0

            self.writer = SummaryWriter(str(run_dir), purge_step=purge_step)

    @property
    def writes(self) -> bool:
        return self.writer is not None and not self.refused

    def scalar(self, tag: str, value: float, step: int) -> None:
        if self.writes:
            self.writer.add_scalar(tag, value, step)

    def scalars(self, values: dict[str, float], step: int) -> None:
        for tag, value in values.items():
            self.scalar(tag, value, step)

    def image(self, tag: str, image, step: int) -> None:
        """An image of height, width and channels (HWC)."""
        if self.writes:
            self.writer.add_image(tag, image, step, dataformats="HWC")

    def text(self, tag: str, text: str, step: int) -> None:
        if self.writes:
            self.writer.add_text(tag, text, step)

    def flush(self) -> None:
        if self.writes:
            self.writer.flush()

    def refuse(self) -> None:
        """The machine refused the event file (a full disk, a folder made read-only): the writer raises the same
        error at every later write, which would take the place of the run's own line; no write more. ``close`` still
        closes it, so that its thread ends."""
        self.refused = True

    def close(self) -> None:
        """The scalars so far, written; its thread ended. Raises what the writer raises (a full disk)."""
        if self.writer is not None:
            self.writer.close()
