"""A training run's evaluations: the held-out set, drawn once, and each evaluation's line and scalars
(the measures themselves are detector/train/evaluate/metrics.py's)."""

from __future__ import annotations

import atexit
import multiprocessing
import os
import signal
import threading
import time

import torch
from omegaconf import DictConfig

from detector.train.evaluate.held_out import HeldOut
from detector.train.evaluate.metrics import evaluate
from detector.train.observe.board import Board


class Evaluation:
    """The held-out batches (``active``: on the processes that evaluate) and the evaluations so far, as
    (step, metrics), restored on resume; ``step``: the last evaluation's, or the step the run resumed at."""

    def __init__(self, cfg: DictConfig, device: torch.device, global_batch: int, evals: list, active: bool, step: int):
        self.device, self.evals, self.active, self.step = device, evals, active, step
        self.held_out = HeldOut(cfg, device, global_batch) if active else None
        self.drawing: threading.Thread | None = None
        self.painter: Painter | None = None

    def __call__(self, step: int, model, autocast, board: Board, say=print) -> dict:
        """Evaluate ``model`` at ``step``: one line, the eval/ scalars and the picture of its predictions (where the
        board writes: process 0's)."""
        start = time.perf_counter()
        metrics = evaluate(model, self.held_out.batches, self.device, autocast)
        self.evals.append((step, metrics))
        self.step = step
        board.scalars({f"eval/{name}": value for name, value in metrics.items() if name != "boxes"}, step)
        if board.writes:
            self.draw(model, autocast, step, board)
        say(
            f"eval   {step:6d}  mean IoU {metrics['mean_iou']:.3f}  recall@0.5 {metrics['recall50']:.3f}  "
            f"recall@[.5:.95] {metrics['recall50_95']:.3f}  (mean box: {metrics['trivial_mean_iou']:.3f}, "
            f"{metrics['trivial_recall50']:.3f})  loss {metrics['loss']:.4f}  on {metrics['boxes']} boxes  "
            f"({time.perf_counter() - start:.1f} s)",
            flush=True,
        )
        return metrics

    def watch(self, say) -> None:
        """Between steps: the held-out workers' deaths noticed while they draw (``HeldOut.watch``)."""
        if self.held_out is not None:
            self.held_out.watch(say)

    def start_painter(self) -> None:
        """Fork the process that draws the evaluations' pictures (``Painter``), with the held-out workers: before the
        run starts threads of its own, which a fork would copy mid-lock."""
        if self.held_out is not None and self.painter is None:
            self.painter = Painter()

    def draw(self, model, autocast, step: int, board: Board) -> None:
        """The first held-out images with their true boxes and the model's (pictures.py) into TensorBoard's Images:
        the model's boxes now; the picture drawn by the painter's process, and written by a thread that waits for it."""
        from detector.train.evaluate.pictures import SHOWN, predict

        self.close()  # the previous picture, drawn by now
        images, targets = self.held_out.batches[0]
        images, targets = images[:SHOWN], targets.to(self.device)
        pred = predict(model, images, self.device, autocast).cpu()
        images, counts, truth = images.cpu(), targets.counts[:SHOWN].cpu(), targets.boxes[:SHOWN].cpu()
        self.start_painter()  # a run whose loader never started it (a test's evaluation alone)
        drawn = self.painter.draw(images, pred, counts, truth, step)

        def picture() -> None:
            board.image("eval/predictions", drawn.get(PICTURE_SECONDS)[0], step)

        self.drawing = threading.Thread(target=picture, name="eval-picture", daemon=True)
        self.drawing.start()

    def close(self) -> None:
        """Wait for the picture being drawn, before the writer closes."""
        if self.drawing is not None:
            self.drawing.join()
            self.drawing = None

    def end(self) -> None:
        """The run's end: the last picture drawn, and the held-out workers stopped where they still draw."""
        self.close()
        if self.painter is not None:
            self.painter.close()
            self.painter = None
        if self.held_out is not None:
            self.held_out.close()


PICTURE_SECONDS = 120.0  # the most a picture may take to be drawn (a second or two): past it, its process is lost


class Painter:
    """A process of its own that draws the evaluations' pictures with matplotlib (pictures.py), forked once at the
    run's start (``Evaluation.start_painter``). Drawn in the run's process, a thread's import of matplotlib and its
    drawing (about a second of the interpreter, the first picture's the most, its fonts loaded) held the interpreter's
    lock against the loop's launches: on a GPU, where the host only just keeps ahead of the device, the steps beside
    the first picture slowed to about twice their time. The run's process never imports matplotlib now.

    One picture at a time (the evaluation waits for the previous before it asks the next): a request down a pipe, the
    pixels back. The process ignores the signals a stop sends the process group (the run stops it: ``close``)."""

    def __init__(self):
        context = multiprocessing.get_context("fork")  # nothing of the run is pickled; it never touches the device
        self.conn, theirs = context.Pipe()
        self.process = context.Process(target=paint_loop, args=(theirs,), name="eval-painter", daemon=True)
        self.process.start()
        theirs.close()
        # before multiprocessing's exit handler, which would SIGTERM it (ignored) and wait for it for good
        atexit.register(self.close)

    def draw(self, images, pred, counts, truth, step: int) -> Painter:
        """Ask for the picture of ``step``; ``get`` waits for it."""
        try:
            self.conn.send(([t.numpy() for t in (images, pred.float(), counts, truth.float())], step))
        except OSError:  # the painter is gone: its thread says so (``get``), the run goes on
            pass
        return self

    def get(self, seconds: float):
        """([H, W, 3] uint8 pixels, the painter's pid) of the picture asked for; an error where it could not be drawn
        (the painter's own, its death, or ``seconds`` gone)."""
        try:
            if not self.conn.poll(seconds):
                raise RuntimeError(f"the evaluation's picture was not drawn in {seconds:.0f} s")
            result = self.conn.recv()
        except (EOFError, OSError):
            self.process.join(1)
            raise RuntimeError(  # noqa: B904  the death is the error, not the pipe's EOF
                f"the process drawing the evaluation's pictures ended (exit code {self.process.exitcode})"
            )
        if isinstance(result, str):
            raise RuntimeError(f"the evaluation's picture could not be drawn: {result}")
        return result

    def close(self) -> None:
        """End the painter (any picture asked for was waited for by then); a second call does nothing."""
        atexit.unregister(self.close)
        if self.process.is_alive():
            self.process.kill()
        self.process.join()
        self.conn.close()


def paint_loop(conn) -> None:
    """The painter's process: matplotlib imported and its fonts found at once, then each request drawn."""
    for signum in (signal.SIGINT, signal.SIGTERM):  # both reach the process group: the run stops us
        signal.signal(signum, signal.SIG_IGN)
    import matplotlib.backends.backend_agg  # noqa: F401
    import matplotlib.font_manager

    from detector.train.evaluate.pictures import pixels, prediction_figure

    matplotlib.font_manager.findfont("DejaVu Sans")
    while True:
        try:
            arrays, step = conn.recv()
        except (EOFError, OSError):  # the run has gone
            return
        try:
            images, pred, counts, truth = (torch.from_numpy(a) for a in arrays)
            titles = [f"held-out {i}" for i in range(len(images))]
            fig = prediction_figure(
                images, pred, counts, truth, titles, f"step {step}: true boxes green, predicted red"
            )
            conn.send((pixels(fig), os.getpid()))
        except Exception as err:  # said by the run's thread that waits for the picture
            conn.send(f"{type(err).__name__}: {err}")
