"""The batch loader (detector/data/loader.py): the same batches as the per-sample path whatever the number of
workers, order, resume and rank blocks, errors that surface, and nothing left behind (processes, memory)."""

import dataclasses
import gc
import multiprocessing
import os
import pickle
import random
import re
import signal
import subprocess
import sys
import textwrap
import threading
import time
from pathlib import Path

import numpy as np
import pytest
import torch
from conftest import ROOT, child_env, fails_after
from omegaconf import OmegaConf

from detector.config.schema import DataConfig
from detector.data import LAYOUTS, build_dataset, build_loader, collate_fn, loader_for, to_device
from detector.data.loader import DataWorkerDied, DataWorkerFailed, DataWorkerStalled, WorkerTraceback, page_unlock
from detector.data.worker import HEADER, host_arrays, unpack_targets
from detector.errors import UserError
from detector.regions import DATA_WAIT, LOADER_LABEL, region_of_label
from detector.train.run.rank_data import rank_loader


def data_cfg(**overrides):
    # crowded images (tail) and a prime size: every layout gets images with 0, few and many boxes
    base = {"image_size": 37, "batch_size": 4, "length": 22, "tail_fraction": 0.3, "num_workers": 0}
    return OmegaConf.merge(OmegaConf.structured(DataConfig), base | overrides)


@pytest.fixture(autouse=True)
def no_hang():
    """A hang fails the test after 60 s instead of blocking the suite."""
    with fails_after(60):
        yield


def assert_same_batch(batch, expected, layout):
    (images, targets), (images2, targets2) = batch, expected
    assert images.dtype == torch.uint8 and torch.equal(images, images2)
    assert targets.layout == layout and type(targets) is type(targets2)
    fields, fields2 = (targets.boxes, targets2.boxes) if layout == "list" else (targets, targets2)
    assert len(fields) == len(fields2)
    for a, b in zip(fields, fields2, strict=True):
        assert a.dtype == b.dtype and torch.equal(a, b)


def per_sample_batches(cfg, layout, start=0):
    """The old path: sample by sample, collated as the torch DataLoader did, whole batches only."""
    dataset, b = build_dataset(cfg, start), cfg.batch_size
    return [
        collate_fn(layout, cfg.max_boxes)([dataset[i] for i in range(k * b, k * b + b)])
        for k in range(len(dataset) // b)
    ]


@pytest.mark.parametrize("layout", LAYOUTS)
def test_batches_match_the_per_sample_path_for_0_1_and_3_workers(layout):
    cfg = data_cfg()
    expected = per_sample_batches(cfg, layout, start=1000)
    assert len(expected) == 5  # 22 samples: 5 whole batches of 4, the last 2 samples dropped
    for workers in (0, 1, 3):
        loader = build_loader(data_cfg(num_workers=workers), layout, torch.device("cpu"), start=1000)
        batches = list(loader)
        assert len(loader) == len(batches) == 5, f"{workers} workers"
        for batch, reference in zip(batches, expected, strict=True):
            assert_same_batch(batch, reference, layout)


def test_resume_from_start_and_more_slots_than_batches():
    full = list(build_loader(data_cfg(num_workers=2, length=40), "padded", torch.device("cpu")))
    resumed = list(build_loader(data_cfg(num_workers=2, length=28), "padded", torch.device("cpu"), start=12))
    assert len(full) == 10 and len(resumed) == 7
    for batch, expected in zip(resumed, full[3:], strict=True):
        assert_same_batch(batch, expected, "padded")


def test_few_slots_many_batches_keep_the_order():
    cfg = data_cfg(num_workers=3, length=64, image_size=16)
    loader = build_loader(cfg, "packed", torch.device("cpu"))
    loader = dataclasses.replace(loader, slots=2)  # fewer slots than workers: they take turns
    for batch, expected in zip(loader, per_sample_batches(cfg, "packed"), strict=True):
        assert_same_batch(batch, expected, "packed")


def test_rank_loaders_read_the_blocks_of_the_global_batch():
    cfg = data_cfg(num_workers=1, length=24)  # 3 global batches of 2 x 4
    ranks = [list(rank_loader(cfg, "list", torch.device("cpu"), r, 2, start=8, steps=2)) for r in (0, 1)]
    global_batches = per_sample_batches(data_cfg(batch_size=8, length=16), "list", start=8)
    for step, (images, targets) in enumerate(global_batches):
        for r in (0, 1):
            block = (images[4 * r : 4 * r + 4], type(targets)(targets.boxes[4 * r : 4 * r + 4]))
            assert_same_batch(ranks[r][step], block, "list")


def test_a_generic_dataset_is_loaded_item_by_item():
    items = [
        (torch.full((1, 8, 8), i, dtype=torch.uint8), torch.tensor([[0, 0, i, i]], dtype=torch.uint8)) for i in range(9)
    ]
    batches = list(loader_for(items, data_cfg(image_size=8, num_workers=2), "padded", torch.device("cpu")))
    assert len(batches) == 2
    assert batches[1][0][:, 0, 0, 0].tolist() == [4, 5, 6, 7] and batches[1][1].boxes[:, 0, 2].tolist() == [4, 5, 6, 7]


class Failing:
    """Items 0-4 of a dataset; item 5 raises, kills its worker, or stops it (SIGSTOP, as kill -STOP)."""

    def __init__(self, how: str, length: int = 12):
        self.how, self.length = how, length

    def __len__(self):
        return self.length

    def __getitem__(self, i):
        if i == 5 and self.how == "raise":
            raise ValueError("sample 5 is broken")
        if i == 5 and self.how == "exit":
            os._exit(3)
        if i == 5 and self.how == "stop" and multiprocessing.parent_process() is not None:
            os.kill(os.getpid(), signal.SIGSTOP)
        return torch.zeros(1, 8, 8, dtype=torch.uint8), torch.zeros(0, 4, dtype=torch.uint8)


def worker_processes():
    return multiprocessing.active_children()  # the loader's workers are this process's only children


def test_a_worker_error_is_one_line_with_its_exception_and_its_traceback_as_the_cause():
    loader = loader_for(Failing("raise"), data_cfg(image_size=8, num_workers=2), "packed", torch.device("cpu"))
    with pytest.raises(DataWorkerFailed) as err:
        list(loader)
    pattern = r"data worker [12] of 2 \(pid \d+\) raised ValueError: sample 5 is broken drawing batch 1 of 3 "
    assert re.fullmatch(pattern + r"\(its traceback: --debug\)", str(err.value)), str(err.value)
    assert isinstance(err.value, DataWorkerDied) and isinstance(err.value, UserError)  # exit status 2 in the CLI
    cause = str(err.value.__cause__)  # the worker's own traceback, which --debug prints
    assert isinstance(err.value.__cause__, WorkerTraceback) and "Traceback (most recent call last)" in cause
    assert 'in __getitem__\n    raise ValueError("sample 5 is broken")' in cause
    assert not worker_processes()


@pytest.mark.skipif(not Path("/proc/self/stat").exists(), reason="names a stopped worker through Linux's /proc")
def test_a_stopped_worker_is_named_with_its_batch_once_it_has_delivered_nothing_for_the_timeout():
    """The worker drawing batch 1 stops itself (SIGSTOP, as kill -STOP would); the other draws every batch it can
    until the ring is full. The stall is reported once nothing has come for worker_timeout seconds, naming the
    stopped worker and the batch it holds, and the stopped worker is killed with the others."""
    cfg = data_cfg(image_size=8, num_workers=2, batch_size=4)
    loader = dataclasses.replace(loader_for(Failing("stop", 40), cfg, "packed", "cpu"), worker_timeout=1.5)
    batches = iter(loader)
    assert next(batches)[0].shape == (4, 1, 8, 8)  # batch 0
    pids = [p.pid for p in worker_processes()]
    start = time.monotonic()
    with pytest.raises(DataWorkerStalled) as err:
        next(batches)
    waited = time.monotonic() - start
    assert 1.5 <= waited < 5, waited
    pattern = (
        r"data worker [12] of 2 \(pid (\d+), stopped by a signal, as kill -STOP does\) delivered nothing for [1-4] s, "
        r"while drawing batch 1 of 10, with batch 1 due \(data.worker_timeout=1.5\): stopped or stuck"
    )
    named = re.fullmatch(pattern, str(err.value))
    assert named and int(named[1]) in pids, str(err.value)
    assert not worker_processes()  # the stopped worker too: killed as the iteration ended


def test_a_dead_worker_is_reported_not_waited_for():
    loader = loader_for(Failing("exit"), data_cfg(image_size=8, num_workers=2), "packed", torch.device("cpu"))
    with pytest.raises(DataWorkerDied, match=r"data worker \d of 2 \(pid \d+\) exited unexpectedly with code 3") as err:
        list(loader)
    assert "\n" not in str(err.value) and isinstance(err.value, UserError)  # one line, exit status 2 in the CLI
    assert not worker_processes()


# ----------------------------------------------------------------------------- filling the ring first


class Slow:
    """A dataset whose every sample takes ``seconds`` to draw (a slow disk, a slow decoder)."""

    def __init__(self, seconds: float, length: int = 40):
        self.seconds, self.length = seconds, length

    def __len__(self):
        return self.length

    def __getitem__(self, i):
        time.sleep(self.seconds)
        return torch.full((1, 8, 8), i, dtype=torch.uint8), torch.zeros(0, 4, dtype=torch.uint8)


def test_fill_waits_until_every_slot_holds_a_drawn_batch_and_changes_no_batch():
    cfg = data_cfg(num_workers=2, length=40)
    expected = list(build_loader(cfg, "padded", "cpu"))
    batches = iter(build_loader(cfg, "padded", "cpu"))
    assert batches.fill(30.0) == (6, 6)  # 2 workers: 2 slots each and 2 more, every one drawn and waiting
    for batch, reference in zip(batches, expected, strict=True):
        assert_same_batch(batch, reference, "padded")
    assert not worker_processes()  # the iteration ended: its workers with it
    few = iter(build_loader(data_cfg(num_workers=2, length=12), "padded", "cpu"))  # 3 batches for 6 slots
    assert few.fill(30.0) == (3, 3)
    next(few)
    assert few.fill(30.0) == (2, 2)
    # without workers each batch is drawn in its step: nothing to draw ahead
    assert iter(build_loader(data_cfg(num_workers=0), "padded", "cpu")).fill(30.0) == (0, 0)


def test_fill_gives_up_at_its_bound_and_the_iteration_goes_on():
    loader = loader_for(Slow(0.5), data_cfg(image_size=8, num_workers=1, batch_size=2), "packed", "cpu")
    batches = iter(loader)  # a batch takes its one worker a second
    start = time.monotonic()
    waiting, room = batches.fill(0.3)
    assert time.monotonic() - start < 3 and room == 4 and waiting < room
    images, _ = next(batches)
    assert images[:, 0, 0, 0].tolist() == [0, 1]
    del batches
    assert not worker_processes()


# ----------------------------------------------------------------------------- killed workers


def crowded_cfg(**overrides):
    """Batches whose result messages exceed a pipe's 64 KiB where the targets travel through it: 128 images of
    200-256 boxes each (~128 KiB of padded boxes, ~116 KiB packed)."""
    base = {"image_size": 32, "batch_size": 128, "max_boxes": 256, "tail_fraction": 1.0, "tail_min": 200}
    return data_cfg(**base | {"length": 128 * 1000, "num_workers": 2} | overrides)


def piped_loader(cfg, layout):
    """``build_loader``'s loader with no target area in its slots: the targets travel through the workers' pipes,
    as a dataset's of another box dtype do."""
    return dataclasses.replace(build_loader(cfg, layout, "cpu"), target_bytes=0)


def test_a_result_message_exceeds_a_pipe_buffer():
    cfg = crowded_cfg(num_workers=0)
    for layout in LAYOUTS:
        _, targets = next(iter(build_loader(cfg, layout, "cpu")))
        assert len(pickle.dumps(host_arrays(targets))) > 65536, layout


@pytest.mark.parametrize("layout", LAYOUTS)
def test_targets_travel_in_the_slot_as_the_images_do_and_the_pipe_carries_a_few_bytes(layout):
    cfg = crowded_cfg(num_workers=0)
    loader = build_loader(cfg, layout, "cpu")
    images, targets = next(iter(loader))
    area = torch.zeros(loader.target_bytes, dtype=torch.uint8)
    message = host_arrays(targets, area)
    assert len(pickle.dumps(message)) < 512  # its arrays' dtype, shape and offset alone
    again, _ = unpack_targets(message, torch.device("cpu"), area)
    area.fill_(255)  # the slot reused: the unpacked targets are the loader's own copies
    assert_same_batch((images, again), (images, targets), layout)
    # a dataset's boxes of a wider dtype than the area was sized for: through the pipe, by value
    wide = (
        type(targets)(*[t.double() for t in targets])
        if layout != "list"
        else targets._replace(boxes=[b.double() for b in targets.boxes])
    )
    assert all(isinstance(a, np.ndarray) for a in host_arrays(wide, area)[1])


@pytest.mark.parametrize("layout", LAYOUTS)
def test_batches_are_the_same_through_the_slot_and_through_the_pipe(layout):
    cfg = crowded_cfg(num_workers=2, length=128 * 4)
    for slot, pipe in zip(build_loader(cfg, layout, "cpu"), piped_loader(cfg, layout), strict=True):
        assert_same_batch(slot, pipe, layout)


def half_a_message_then_death(fd, message):
    """A worker killed half-way through writing a message larger than the pipe's buffer."""
    payload = pickle.dumps(message)
    os.write(fd, HEADER.pack(len(payload)) + payload[: len(payload) // 2])
    os.kill(os.getpid(), signal.SIGKILL)


def test_a_worker_killed_mid_message_is_reported_within_seconds(monkeypatch):
    monkeypatch.setattr("detector.data.worker.send", half_a_message_then_death)  # the forked workers inherit it
    batches = iter(piped_loader(crowded_cfg(), "padded"))
    start = time.monotonic()
    with pytest.raises(DataWorkerDied, match=r"was killed by SIGKILL, exit code -9 \(kill -9, or the kernel"):
        next(batches)
    assert time.monotonic() - start < 10
    del batches
    assert not worker_processes()


def test_a_death_is_noticed_when_every_batch_due_is_drawn_already():
    cfg = crowded_cfg(length=128 * 6)  # 6 batches, 6 slots: all drawn after the first
    batches = iter(build_loader(cfg, "packed", "cpu"))
    next(batches)
    assert batches.fill(30.0) == (5, 5)  # the workers have drawn the rest, and wait for tasks
    os.kill(worker_processes()[0].pid, signal.SIGKILL)
    time.sleep(0.2)
    with pytest.raises(DataWorkerDied, match="before batch 1 of 6 was loaded"):
        list(batches)


def test_workers_killed_at_random_points_never_hang_the_main_process():
    """Many iterations; in each, a random worker is killed at a random moment (drawing, writing a message
    larger than the pipe's buffer, waiting for a task) while the main process loads batches: every one ends
    with DataWorkerDied within seconds, naming the worker, and leaves no process behind."""
    rng = random.Random(27)
    cfg = crowded_cfg(num_workers=3)
    for trial in range(16):
        layout = LAYOUTS[trial % len(LAYOUTS)]
        batches = iter(piped_loader(cfg, layout))
        for _ in range(1 + rng.randrange(3)):  # the workers start with the first batch
            next(batches)
        victim = rng.choice(worker_processes())
        timer = threading.Timer(rng.uniform(0.0, 0.4), os.kill, (victim.pid, signal.SIGKILL))
        timer.start()
        start = time.monotonic()
        with pytest.raises(DataWorkerDied) as err:
            while True:
                next(batches)
                assert time.monotonic() - start < 15, f"trial {trial}: the death went unnoticed"
        assert time.monotonic() - start < 15, f"trial {trial}: {time.monotonic() - start:.1f} s"
        assert f"(pid {victim.pid}) was killed by SIGKILL" in str(err.value), str(err.value)
        timer.join()
        del batches
        assert not worker_processes(), f"trial {trial}"


def test_an_error_without_workers_is_the_error_itself():
    loader = loader_for(Failing("raise"), data_cfg(image_size=8), "packed", torch.device("cpu"))
    with pytest.raises(ValueError, match="sample 5 is broken"):
        list(loader)


def shared_mappings() -> int:
    """Anonymous shared mappings of this process: the loader's slots show as '/dev/zero (deleted)'."""
    return Path("/proc/self/maps").read_text().count("/dev/zero")


@pytest.mark.skipif(not Path("/proc/self/maps").exists(), reason="needs Linux's /proc")
def test_early_stop_returns_at_once_and_releases_everything():
    gc.collect()  # the rings of earlier tests' failed iterations, kept by their tracebacks
    shm_before, maps_before = set(os.listdir("/dev/shm")), shared_mappings()
    loader = build_loader(data_cfg(num_workers=3, length=4000, image_size=64, batch_size=64), "padded", "cpu")
    batches = iter(loader)
    next(batches)  # then dropped, as bench step's device_batch does
    pids = [p.pid for p in worker_processes()]
    assert len(pids) == 3 and shared_mappings() == maps_before + 1
    start = time.perf_counter()
    del batches
    assert time.perf_counter() - start < 5.0 and not worker_processes()
    assert shared_mappings() == maps_before
    leftover = set(os.listdir("/dev/shm")) - shm_before  # other test runs may share /dev/shm: only ours count
    assert not [name for name in leftover if any(f"_{pid}_" in name for pid in [os.getpid(), *pids])]


def alive(pid: int) -> bool:
    try:
        return "\nState:\tZ" not in Path(f"/proc/{pid}/status").read_text()  # a zombie has exited
    except FileNotFoundError:
        return False


CHILD = """
import os, signal, sys, time, torch
from omegaconf import OmegaConf
from detector.config.schema import DataConfig
from detector.data import build_loader
cfg = OmegaConf.merge(OmegaConf.structured(DataConfig), {{"image_size": 32, "batch_size": 8, "num_workers": 2}})
batches = iter(build_loader(cfg, "padded", torch.device("cpu")))
next(batches)
import multiprocessing
print(" ".join(str(p.pid) for p in multiprocessing.active_children()), flush=True)
{ending}
"""


@pytest.mark.skipif(not Path("/proc/self/maps").exists(), reason="needs Linux's /proc")
@pytest.mark.parametrize(
    "ending",
    [
        "os.kill(os.getpid(), signal.SIGKILL)",  # no clean-up at all: the workers notice they are orphans
        "while True: next(batches); time.sleep(0.01)",  # stopped by Ctrl-C (SIGINT to the process group)
    ],
)
def test_workers_do_not_outlive_the_main_process(ending):
    code = textwrap.dedent(CHILD.format(ending=ending))
    env = child_env()
    child = subprocess.Popen(
        [sys.executable, "-c", code],
        stdout=subprocess.PIPE,
        env=env,
        cwd=ROOT,
        start_new_session=True,
        # a Ctrl-C reaches a program started from a terminal; a shell's background job (e.g. a CI step run
        # with `&`) ignores SIGINT, and an ignored signal is inherited: give the child the terminal's default
        preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL),
    )
    pids = [int(p) for p in child.stdout.readline().split()]
    assert len(pids) == 2
    if "SIGKILL" not in ending:
        os.killpg(child.pid, signal.SIGINT)
    assert child.wait(timeout=30) != 0
    deadline = time.monotonic() + 10  # the workers' watchdog looks every second
    while any(map(alive, pids)) and time.monotonic() < deadline:
        time.sleep(0.1)
    assert not any(map(alive, pids))


def test_the_wait_is_profiled_as_data_wait():
    assert region_of_label(LOADER_LABEL) == DATA_WAIT


@pytest.mark.skipif(
    not torch.cuda.is_available(), reason="the page-locked slots and the copy stream need a CUDA device"
)
@pytest.mark.parametrize("workers", [0, 2])
def test_cuda_batches_are_copied_from_page_locked_slots(workers, monkeypatch):
    cfg = data_cfg(num_workers=workers)
    cuda = torch.device("cuda")
    registered = []
    monkeypatch.setattr(
        "detector.data.loader.page_unlock", lambda slots: registered.append(slots.is_pinned()) or page_unlock(slots)
    )
    for layout in LAYOUTS:
        batches = list(build_loader(cfg, layout, cuda, start=1000))
        torch.cuda.synchronize()
        for batch, expected in zip(batches, per_sample_batches(cfg, layout, start=1000), strict=True):
            assert batch[0].is_cuda and to_device(batch, cuda)[0] is batch[0]  # to_device: nothing left to copy
            assert_same_batch((batch[0].cpu(), batch[1].to("cpu")), expected, layout)
    assert registered == [True] * len(LAYOUTS)  # page-locked in place until the iteration ended
