"""A hand-written Kineto trace whose every count is known: two steps of regions, launches, copies and syncs, for
the tests of the trace analysis (tests/lab/test_analysis.py) and of the Traces tab's extract."""

from detector.regions import LAB_SYNC

# AUTOGRAD: the autograd engine's thread. As in an H100 trace of the packed strategy, the trace names it twice,
# "pt_autograd_0" and then "python3": a reader that keeps the last name loses the backward's launches
PID, MAIN, AUTOGRAD = 100, 1, 2
LOAD = "enumerate(DataLoader)#_MultiProcessingDataLoaderIter.__next__"


# ----------------------------------------------------------------------------- a hand-written trace


def mark(name, ts, dur):
    return {"ph": "X", "cat": "user_annotation", "name": name, "pid": PID, "tid": MAIN, "ts": ts, "dur": dur}


def call(name, ts, dur, corr=None, tid=MAIN, cat="cuda_runtime"):
    args = {} if corr is None else {"correlation": corr}
    return {"ph": "X", "cat": cat, "name": name, "pid": PID, "tid": tid, "ts": ts, "dur": dur, "args": args}


def lab_sync(ts, dur, corr):
    """The lab's region-ending synchronize of profile.sync_regions=true: a call inside a "lab sync" label."""
    return [mark(LAB_SYNC, ts, dur), call("cudaDeviceSynchronize", ts, dur, corr)]


def op(name, ts, tid=MAIN, dur=1):
    return {"ph": "X", "cat": "cpu_op", "name": name, "pid": PID, "tid": tid, "ts": ts, "dur": dur}


def gpu(cat, name, ts, dur, corr, stream=7, nbytes=None):
    args = {"correlation": corr, "stream": stream} | ({} if nbytes is None else {"bytes": nbytes})
    return {"ph": "X", "cat": cat, "name": name, "pid": 0, "tid": stream, "ts": ts, "dur": dur, "args": args}


H2D, D2H_PINNED = "Memcpy HtoD (Pinned -> Device)", "Memcpy DtoH (Device -> Pinned)"
D2H_PAGEABLE, D2D = "Memcpy DtoH (Device -> Pageable)", "Memcpy DtoD (Device -> Device)"


def synthetic_events() -> list[dict]:
    """Two steps (µs). Step 5: data wait, copy data, forward, calc loss, backward, each region closed by the
    lab's synchronize, then an .item() and a bare synchronize outside the regions. Step 6: "copy data" and
    a data wait that occurs twice."""
    names = [(MAIN, "thread 1 (python3)"), (AUTOGRAD, "thread 2 (pt_autograd_0)"), (AUTOGRAD, "thread 2 (python3)")]
    meta = [{"ph": "M", "name": "thread_name", "pid": PID, "tid": tid, "args": {"name": n}} for tid, n in names]
    step5 = [mark("ProfilerStep#5", 0, 1000), mark(LOAD, 10, 40)]
    # copy data [100, 200): two H2D copies; a memset that runs on into forward (170-230)
    step5 += [mark("copy data", 100, 100), call("cudaMemcpyAsync", 110, 5, 1), call("cudaMemcpyAsync", 120, 5, 2)]
    step5 += [call("cudaMemsetAsync", 160, 3, 4), *lab_sync(180, 15, 3)]
    step5 += [gpu("gpu_memcpy", H2D, 120, 30, 1, nbytes=1000), gpu("gpu_memcpy", H2D, 150, 10, 2, nbytes=24)]
    step5 += [gpu("gpu_memset", "Memset (Device)", 170, 60, 4)]
    # forward [200, 400): 5 launches (one a graph of 3 kernels) -> 7 kernels; kernels on two streams overlap;
    # the host runs ahead: the kernel launched at 290 runs during step 6 (1200-1300), still forward's
    step5 += [mark("forward", 200, 200), call("cudaLaunchKernel", 210, 4, 10), call("cudaLaunchKernelExC", 220, 4, 11)]
    step5 += [call("cuLaunchKernelEx", 230, 4, 12, cat="cuda_driver"), call("cudaMalloc", 240, 10)]
    step5 += [call("cuMemAlloc_v2", 242, 4, cat="cuda_driver")]  # nested in cudaMalloc: runtime counts 10 µs, not 14
    step5 += [call("cudaGraphLaunch", 260, 6, 15), call("cudaLaunchKernel", 290, 4, 17), *lab_sync(380, 18, 16)]
    step5 += [
        gpu("kernel", "k1", 220, 80, 10),
        gpu("kernel", "k2", 250, 70, 11, stream=8),
        gpu("kernel", "k3", 330, 10, 12),
        gpu("kernel", "late", 1200, 100, 17),
    ]
    step5 += [gpu("kernel", f"graph{i}", 350 + 10 * i, 10, 15) for i in range(3)]
    step5 += [op("aten::linear", 205, dur=5), op("aten::addmm", 206), op("aten::relu", 300)]  # addmm inside linear
    # calc loss [400, 600): 2 launches; syncs: .item() pair (1), D2H into pageable memory unpaired (1),
    # D2H into pinned memory without a sync (0), cudaMemcpy (1), cudaEventSynchronize (1), .cpu() pair: D2H
    # into pageable memory then cudaStreamSynchronize (1); a DtoD copy (on-device: GPU ms only)
    step5 += [mark("calc loss", 400, 200), call("cudaLaunchKernel", 410, 5, 20), gpu("kernel", "k4", 420, 10, 20)]
    step5 += [call("cudaMemcpyAsync", 440, 5, 21), call("cudaStreamSynchronize", 446, 10, 22)]
    step5 += [gpu("gpu_memcpy", D2H_PINNED, 450, 2, 21, nbytes=4)]
    step5 += [call("cudaMemcpyAsync", 470, 20, 23), gpu("gpu_memcpy", D2H_PAGEABLE, 475, 5, 23, nbytes=8)]
    step5 += [call("cudaLaunchKernel", 500, 5, 24), gpu("kernel", "k5", 505, 10, 24)]
    step5 += [call("cudaMemcpyAsync", 520, 3, 25), gpu("gpu_memcpy", D2H_PINNED, 525, 5, 25, nbytes=16)]
    step5 += [call("cudaMemcpyAsync", 530, 2, 27), gpu("gpu_memcpy", D2D, 531, 4, 27, nbytes=64)]
    step5 += [call("cudaMemcpy", 540, 5, 26), gpu("gpu_memcpy", D2H_PAGEABLE, 545, 5, 26, nbytes=32)]
    step5 += [call("cudaEventSynchronize", 560, 3)]
    step5 += [call("cudaMemcpyAsync", 565, 3, 29), gpu("gpu_memcpy", D2H_PAGEABLE, 566, 2, 29, nbytes=128)]
    step5 += [call("cudaStreamSynchronize", 570, 3, 35), *lab_sync(580, 10, 28)]
    # operators: 2 selects, a slice, an unbind (4 slices); .item() (2 ops, 1 host read); nonzero (1 host read)
    step5 += [
        op(name, 401 + i) for i, name in enumerate(["aten::select", "aten::select", "aten::slice", "aten::unbind"])
    ]
    step5 += [op("aten::item", 450), op("aten::_local_scalar_dense", 451), op("aten::nonzero", 455)]
    step5 += [op("autograd::engine::evaluate_function: X", 456)]  # not an aten:: operator: not counted
    # backward [600, 800): 1 launch on the main thread, 2 on the autograd thread (and one operator there)
    step5 += [mark("backward", 600, 200), call("cudaLaunchKernel", 610, 5, 30), gpu("kernel", "k6", 615, 5, 30)]
    step5 += [call("cudaLaunchKernel", 620, 5, 31, tid=AUTOGRAD), call("cudaLaunchKernel", 630, 5, 32, tid=AUTOGRAD)]
    step5 += [gpu("kernel", "k7", 640, 20, 31), gpu("kernel", "k8", 650, 20, 32, stream=8)]
    step5 += [op("aten::mul", 621, tid=AUTOGRAD), *lab_sync(780, 10, 34)]
    # outside the regions ("other"): the loss's .item() (one sync) and a bare device synchronize (one sync)
    step5 += [call("cudaMemcpyAsync", 900, 5, 40), call("cudaStreamSynchronize", 906, 4, 41)]
    step5 += [gpu("gpu_memcpy", D2H_PINNED, 910, 2, 40, nbytes=4), call("cudaDeviceSynchronize", 950, 5, 42)]
    step6 = [mark("ProfilerStep#6", 1000, 500), mark(LOAD, 1010, 10), mark(LOAD, 1030, 20)]
    step6 += [mark("copy data", 1100, 100), call("cudaMemcpyAsync", 1110, 5, 50)]
    step6 += [gpu("gpu_memcpy", H2D, 1120, 40, 50, nbytes=500), *lab_sync(1180, 10, 51)]
    return meta + step6[::-1] + step5  # out of order on purpose: the analysis sorts


# ----------------------------------------------------------------------------- memory events


def memory(ts, nbytes, total, reserved=4096, tid=MAIN, device=(1, 0)):
    """A profiler "[memory]" event: ``nbytes`` allocated (> 0) or freed (< 0) at ``ts``, ``total`` allocated after it,
    on ``device`` (c10's device type, index: (1, 0) is cuda:0, (0, -1) the CPU)."""
    args = {"Total Reserved": reserved, "Total Allocated": total, "Bytes": nbytes, "Addr": 1 << 40}
    args |= {"Device Type": device[0], "Device Id": device[1]}
    return {
        "ph": "i",
        "cat": "cpu_instant_event",
        "s": "t",
        "name": "[memory]",
        "pid": PID,
        "tid": tid,
        "ts": ts,
        "args": args,
    }


# (ts, bytes, total after, thread) of synthetic_memory(): 1000 B live before the first; the operator each falls in
MEMORY_EVENTS = [
    (110, 100, 1100, MAIN),  # copy data, outside any operator
    (206.6, 500, 1600, MAIN),  # forward: aten::empty inside aten::addmm inside aten::linear -> aten::addmm
    (300.5, 200, 1800, MAIN),  # forward: aten::relu
    (350, -500, 1300, MAIN),  # forward: a free outside any operator
    (401.5, 1000, 2300, MAIN),  # calc loss: aten::select
    (450.5, -1000, 1300, MAIN),  # calc loss: aten::item
    (621.5, 300, 1600, AUTOGRAD),  # backward, on the autograd thread: aten::mul
    (900, -600, 1000, MAIN),  # other
]


def synthetic_memory(events=MEMORY_EVENTS) -> list[dict]:
    """synthetic_events() with the caching allocator's events of ``events`` on cuda:0, an aten::empty inside
    aten::addmm, and a CPU tensor's allocation in forward that a GPU run's memory leaves out."""
    cuda = [memory(ts, nbytes, total, tid=tid) for ts, nbytes, total, tid in events]
    cpu = [memory(250, 9999, 9999, reserved=0, device=(0, -1))]
    return synthetic_events() + [op("aten::empty", 206.5, dur=0.2)] + cuda[::-1] + cpu
