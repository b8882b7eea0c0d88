"""`make train` (`python -m detector train`) enters a training run here: its processes, their group set up before the
run and torn down after it however it ends (``training_processes``), and the run's front door (``train``): the
settings that would train on held-out images refused, what the run allocates checked, its folder locked. The run itself
is training_loop.py's; the strategy sweep (detector/lab/sweep.py) runs one ``train`` a strategy in one
``training_processes``.
"""

from __future__ import annotations

import contextlib
import threading
from pathlib import Path

import torch
from omegaconf import DictConfig

from detector.config.device import context_ready
from detector.errors import UserError
from detector.train.checkpoints import Verification
from detector.train.distributed import processes as distributed
from detector.train.distributed.processes import DistEnv
from detector.train.observe import summary
from detector.train.observe.memory_estimate import check_run_memory
from detector.train.observe.wallclock import early
from detector.train.run import folder as run_folder
from detector.train.run.auto import Rank
from detector.train.run.training_loop import Run


def train(
    cfg: DictConfig,
    experiment: str,
    env: DistEnv,
    device: torch.device,
    checks: Verification | None = None,
    rank: Rank | None = None,
) -> summary.TrainingSummary:
    """One training run of ``cfg.train.strategy``; returns its summary (also written to summary.json). ``checks``:
    those of the checkpoint it will likely continue, begun already (run_folder.early_check). ``rank``: the ranking of
    the strategies train.strategy=auto times (train/run/auto.py), the command's."""
    tcfg = cfg.train
    global_batch = cfg.data.batch_size * env.world_size
    if tcfg.steps * global_batch > tcfg.eval_start:
        raise UserError(
            f"{tcfg.steps} steps x {global_batch} images reach past train.eval_start={tcfg.eval_start}: "
            "training would see held-out images"
        )
    check_run_memory(cfg, env.world_size, device)
    run_dir = Path(tcfg.out_dir) / experiment / run_folder.run_name(tcfg)
    with run_folder.locked(run_dir) if env.is_main else contextlib.nullcontext():
        if env.is_main:
            run_folder.reveal_hidden(run_dir)
        return Run(cfg, experiment, env, device, run_dir, checks, rank).go()


@contextlib.contextmanager
def training_processes(cfg: DictConfig):
    """(this process's DistEnv, its device) for the runs inside the block; the process group is torn down after."""
    env, device = distributed.setup(cfg)
    try:
        yield env, device
    except BaseException as err:
        # a stop every process agreed on ends them all at one step: the group's teardown meets every one of them. Any
        # other failure is this process's alone: the others may wait for it inside a step's collective, where the
        # teardown's barrier would wait for them in turn; it ends at once instead (cli/main.py), and they with it
        if env.world_size == 1 or getattr(err, "agreed", False):
            try:
                distributed.teardown(env)
            except Exception as teardown_err:
                # a peer gone before the teardown met it (a second signal ended it at once): the stop's own line
                # says what happened; the barrier's error would hide it behind a traceback
                if distributed.lost_peer(teardown_err) is None:
                    raise
        raise
    distributed.teardown(env)


BEGIN_HERE = object()  # run_training's checks where its caller began none: they begin with the run


def run_training(
    cfg: DictConfig,
    experiment: str | None = None,
    checks=BEGIN_HERE,
    rank: Rank | None = None,
    context: threading.Thread | None = None,
) -> list[summary.TrainingSummary]:
    """`python -m detector train`: one run of ``train.strategy``; returns [its summary]. ``train.strategy=all`` is
    the strategy sweep (detector/lab/sweep.py). ``checks``: those of the checkpoint it will likely continue, begun by
    the command before it imported this module (None: the command found none to begin); begun here otherwise.
    ``rank``: train.strategy=auto's ranking of the strategies (train/run/auto.py; the command hands in make shapes').
    ``context``: the thread making the CUDA context, begun by the command (detector.config.device ``begin_context``)."""
    if cfg.train.strategy == "all":
        raise UserError("train.strategy=all is the strategy sweep: run it with `python -m detector train` (make train)")
    begun = run_folder.early_check(cfg, experiment) if checks is BEGIN_HERE else contextlib.nullcontext(checks)
    with begun as checks:
        if context is not None:
            with early("CUDA context"):  # what is left of it once the imports are done
                context_ready(context)
        with training_processes(cfg) as (env, device):
            return [train(cfg, run_folder.experiment_name(experiment), env, device, checks, rank)]
