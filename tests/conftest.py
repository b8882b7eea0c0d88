"""Shared test set-up: the Triton interpreter where there is no GPU, each xdist worker's share of the cores,
dynamo's recompile limit, a bound on tests that could hang, which tests `make test` leaves to `make test-all`,
``--strategy NAME`` (the contract grid on one strategy, a user's own included), and the fixtures tests of several
folders share (a user's folder, a strategy whose loss turns NaN, headless Chromium)."""

import contextlib
import os
import signal
import sys
from pathlib import Path

import pytest
import torch

if not torch.cuda.is_available() and "TRITON_INTERPRET" not in os.environ:
    # Before detector.kernels.triton_giou is imported (it reads the variable once): the triton strategy's
    # kernel then runs as numpy on the CPU, so its tests run here too.
    os.environ["TRITON_INTERPRET"] = "1"
    print("no CUDA device: Triton kernels run in the interpreter (TRITON_INTERPRET=1)")

# pytest-xdist's workers share the machine's cores: each gives torch's CPU ops (and inductor's OpenMP kernels, and
# the commands a test starts) its share of them. Left at torch's default, 12 workers on a 16-core GPU host ran 16
# threads each, and a compiled strategy's CPU rows took minutes there against seconds on 2 cores.
WORKERS = int(os.environ.get("PYTEST_XDIST_WORKER_COUNT", "1"))
if WORKERS > 1 and "OMP_NUM_THREADS" not in os.environ:
    os.environ["OMP_NUM_THREADS"] = str(max(1, (os.cpu_count() or 1) // WORKERS))
    torch.set_num_threads(int(os.environ["OMP_NUM_THREADS"]))

# Kineto reads its log level once, as a process's first profiler starts: a command sets it before (the profile
# window's KINETO_LOG_LEVEL), and so does this process, where a test's own torch.profiler may come first. Started
# without it, Kineto printed its trace points (USDT: profiler_start/stop) on stderr at every later profile of the
# worker. A child process (child_env) is left to set it itself, as a user's command does.
KINETO_QUIETED = "KINETO_LOG_LEVEL" not in os.environ
os.environ.setdefault("KINETO_LOG_LEVEL", "6")

# The grid compiles the `compiled` strategy once per (dtype, shape) variant; keep them all compiled
# instead of letting dynamo fall back to eager after its default 8 recompilations.
torch._dynamo.config.recompile_limit = 64
# nested_compiled's graphs call nested_from_padded (torch.nested._internal), which AOTAutograd's cache does not know
# as safe: each of its ~30 variants in the suite traced its joint graph again in every worker and every run (about
# 1.1 s of its 1.4 s a variant). Marked cacheable, keyed by torch's version as torch's own example keys it, a variant
# compiled before (by the other worker, or an earlier run) is loaded from the cache: the same graph, compiled once.
torch._inductor.config.unsafe_marked_cacheable_functions = {
    "torch.nested._internal.nested_tensor.nested_from_padded": torch.__version__
}


# A profile samples the machine's load for SAMPLE_SECONDS (0.5 s) before its run and again after it: a second of
# sleep a run, and the suite makes dozens of runs in its processes. The tests read that a load was sampled (a number,
# or None where /proc cannot be read), not its value; the one that times the samples
# (test_the_last_line_says_where_the_runs_time_went_part_by_part) puts back REAL_SAMPLE_SECONDS. A command a test
# starts in a process of its own samples for the full time, as a user's does.
from detector.lab.measure import cpu_load  # noqa: E402 (after TRITON_INTERPRET and the threads are set)

REAL_SAMPLE_SECONDS = cpu_load.SAMPLE_SECONDS
cpu_load.SAMPLE_SECONDS = 0.05

ROOT = Path(__file__).resolve().parents[1]

# pytest's own, which names the test and its phase; the profiler window's, set for the process on purpose (it keeps
# Kineto's log lines out of ours and of every run's); TensorBoard's, which its program sets as it starts in the process
ENVIRONMENT_SET_ON_PURPOSE = ("PYTEST_CURRENT_TEST", "KINETO_LOG_LEVEL", "GCS_READ_CACHE_DISABLED")
# inductor's, which it sets for the whole process as it first compiles: where it keeps its and Triton's caches, the
# ptxas and libdevice it found, the CUDA it builds with (a GPU's first compile sets the Triton ones)
INDUCTOR_SETS_FOR_THE_PROCESS = (
    "TORCHINDUCTOR_CACHE_DIR",
    "TRITON_CACHE_DIR",
    "TRITON_PTXAS_PATH",
    "TRITON_LIBDEVICE_PATH",
    "CUDA_HOME",
    "CUBLAS_WORKSPACE_CONFIG",
    "KMP_DUPLICATE_LIB_OK",
    "TORCH_WARM_POOL",
)


@pytest.fixture(autouse=True)
def _environment_left_as_found():
    """A test leaves the process's environment as it found it: what it sets reaches every test after it in this
    worker and their subprocesses. The CLI called in a test's process with CUDA patched away set TRITON_INTERPRET=1,
    and on a GPU machine the kernels of the tests after it ran in Triton's interpreter."""
    before = dict(os.environ)
    yield
    changed = sorted(
        name
        for name in before.keys() | os.environ.keys()
        if before.get(name) != os.environ.get(name)
        and name not in ENVIRONMENT_SET_ON_PURPOSE
        and not (name in INDUCTOR_SETS_FOR_THE_PROCESS and name not in before)
        and not name.startswith("_")  # a library's private state (inductor's _TORCHINDUCTOR_PYOBJECT_TENSOR_DATA_PTR)
    )
    if changed:
        for name in changed:  # put back, for the tests after it
            if name in before:
                os.environ[name] = before[name]
            else:
                del os.environ[name]
        pytest.fail(f"the test changed the environment of the tests after it: {changed} (use monkeypatch.setenv)")


# `make test` leaves these to `make test-all` (CI runs both; `make gpu-check` runs all on a GPU): a browser,
# several processes, a command end to end, or minutes of training. What stays covers every strategy against the
# reference, the analysis, the record, the verdicts and the training step.
TEST_ALL = (
    "tests/board/test_browser.py",  # TensorBoard in headless Chromium
    "tests/board/test_traces_tab.py",
    "tests/board/test_traces_lanes.py",
    # the evaluation's picture in TensorBoard's Images tab, in Chromium; make test keeps what is ours of it: the
    # picture in the events at each evaluated step, no wider than the tab's card (test_export.py's
    # test_each_evaluation_draws_its_predictions_into_tensorboard), laid out to be read at that size (test_pictures.py)
    "tests/train/evaluate/test_export.py::test_the_evaluations_picture_shows_in_tensorboards_images_tab",
    "tests/test_pipeline.py",  # make profile from the Makefile, set-up included
    # make train in a child process, its worker killed
    "tests/train/run/test_data_worker_faults.py::test_a_worker_that_dies",
    "tests/train/run/test_data_worker_faults.py::test_kill_9",
    # kill -STOP of a worker of make train in a child process; make test keeps the stall named after the timeout and the
    # stopped worker killed (test_loader.py's test_a_stopped_worker_is_named...) and a worker's failure as train's one
    # line, exit status 2 and last checkpoint (test_data_worker_faults.py's test_a_worker_that_raises_stops_the_run...)
    "tests/train/run/test_data_worker_faults.py::test_a_stopped_data_worker_ends_the_run_in_one_line_naming_it_after_the_timeout",
    "tests/train/run/test_interrupt.py::test_ctrl_c_is_one_line_exit_130_and_the_run_resumes",
    "tests/train/distributed/test_multinode.py",  # several processes over gloo
    "tests/cli/test_launch.py",
    "tests/train/checkpoints/test_reshard.py",
    "tests/train/run/test_training_loop.py::test_ddp_",
    "tests/data/test_loader.py::test_workers_killed_at_random_points",  # worker processes killed and counted
    "tests/data/test_loader.py::test_workers_do_not_outlive",
    "tests/data/test_sampler.py::test_batches_are_identical_with_0_and_2_workers",
    "tests/data/test_sampler.py::test_sample_is_a_pure_function_of_seed_and_index_in_a_fresh_process",
    "tests/lab/test_report.py::test_report_runs",  # the standard set, part by part
    "tests/lab/test_report.py::test_a_stopped_report",
    "tests/bench/test_memory_bench.py::test_bench_memory_writes",  # bench memory's parts, each a process
    "tests/kernels/test_cuda_op.py::test_cuda_kernels_compile_with_nvcc",  # nvcc -c of every CUDA source
    "tests/train/test_optimizer.py::test_two_hundred_steps",  # 200 training steps, twice
    "tests/test_model.py::test_loss_falls_by_a_large_factor",
)


def pytest_collection_modifyitems(config, items):
    for item in items:
        if item.nodeid.startswith(TEST_ALL):
            item.add_marker(pytest.mark.slow)


def pytest_addoption(parser):
    parser.addoption(
        "--strategy",
        action="append",
        default=[],
        metavar="NAME",
        help="run tests/losses/test_strategies.py's contract grid on this strategy only: a registered name or "
        "my_module:my_loss, a loss in my_module.py (the folder pytest runs from, or PYTHONPATH); repeatable",
    )


def pytest_configure(config):
    """``--strategy`` names that no strategy answers to are a usage error, before any test is collected."""
    if not config.getoption("strategy", default=None):
        return
    from detector.errors import UserError
    from detector.losses import get_strategy

    for name in config.getoption("strategy"):
        try:
            get_strategy(name)
        except (KeyError, UserError) as err:
            raise pytest.UsageError(f"--strategy {name}: {err.args[0]}") from None


@pytest.hookimpl(trylast=True)
def pytest_runtest_logreport(report):
    """A failure named on stderr the moment its report comes in, not only in the summary at the end: a run cut by a
    time limit (a GPU machine's lease, a CI job's) still says which tests failed. With pytest-xdist the controller
    prints it (the workers' own output is not shown)."""
    if report.failed and not os.environ.get("PYTEST_XDIST_WORKER"):
        where = f" ({report.when})" if report.when != "call" else ""
        print(f"\nFAILED {report.nodeid}{where} after {report.duration:.1f} s", file=sys.stderr, flush=True)


@pytest.fixture
def user_dir(tmp_path, monkeypatch):
    """The folder a user runs from, first on sys.path (their own strategy module goes there); the strategies a test
    registers and the modules imported from its folder are removed after it (only those: a module of torch's
    imported for the first time during the test, and removed, would run again on its next import, and some of
    torch's register themselves once per process)."""
    from detector.losses import STRATEGIES

    monkeypatch.chdir(tmp_path)
    monkeypatch.syspath_prepend(str(tmp_path))  # restores sys.path after, the registry's addition included
    before, modules = set(STRATEGIES), set(sys.modules)
    yield tmp_path
    for name in set(STRATEGIES) - before:
        del STRATEGIES[name]
    for name in set(sys.modules) - modules:
        if str(getattr(sys.modules[name], "__file__", None) or "").startswith(str(tmp_path)):
            del sys.modules[name]


@pytest.fixture
def nan_from_step_4(monkeypatch):
    """A strategy whose loss turns NaN from its 4th call on (as a diverging run's does)."""
    from detector.losses import STRATEGIES, Strategy

    padded, calls = STRATEGIES["padded"], []

    def loss(pred, targets):
        calls.append(1)
        value = padded.fn(pred, targets)
        return value * float("nan") if len(calls) >= 4 else value

    monkeypatch.setitem(STRATEGIES, "nan_from_4", Strategy("nan_from_4", "padded", loss, "test: NaN from call 4"))
    return "nan_from_4"


@pytest.fixture
def browser(tmp_path):
    """Headless Chromium, offline (tests/browser_helpers.py); skipped where Debian's chromium is not installed."""
    from browser_helpers import CHROMIUM, Chromium

    if CHROMIUM is None:
        pytest.skip("chromium is not installed (Debian: apt-get install chromium)")
    chromium = Chromium(tmp_path / "chromium-profile", width=1950, height=1000)  # the timeline at actual size
    yield chromium
    chromium.close()


def child_env(**overrides: str) -> dict[str, str]:
    """The environment of a child Python process that imports this tree's detector: the repository first on
    PYTHONPATH, then whatever was there (packages a machine provides that way, e.g. wheels unpacked to a
    folder), and ``overrides``."""
    path = os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")]))
    env = {**os.environ, "PYTHONPATH": path}
    if KINETO_QUIETED:
        env.pop("KINETO_LOG_LEVEL", None)  # a test may have taken it out already
    return {**env, **overrides}


def stop_before_rename(monkeypatch, name: str) -> None:
    """A Ctrl-C the moment a file called ``name`` would be renamed into place (``os.replace``, write_atomically's
    last step): what a stop in the middle of its write leaves behind."""
    real = os.replace

    def replace(source, target):
        if Path(target).name == name:
            raise KeyboardInterrupt
        return real(source, target)

    monkeypatch.setattr(os, "replace", replace)


@contextlib.contextmanager
def fails_after(seconds: int):
    """A hang inside the block fails the test after ``seconds`` (SIGALRM) instead of blocking the suite."""

    def hung(signum, frame):
        raise TimeoutError(f"the test hung for {seconds} s")

    previous = signal.signal(signal.SIGALRM, hung)
    signal.alarm(seconds)
    try:
        yield
    finally:
        signal.alarm(0)
        signal.signal(signal.SIGALRM, previous)
