"""Events, kinds, devices, steps and stages: what the events frame holds (see the package docstring).

Stage names are the run-directory format's (:mod:`fsdpprof.runfmt`: collect tags memory with them)."""
from __future__ import annotations

from fsdpprof.runfmt import (STAGE_BACKWARD, STAGE_DATA, STAGE_FORWARD, STAGE_OPTIMIZER, STAGE_OUTSIDE,
                             STAGE_POST_STEP, STAGE_UNKNOWN)

__all__ = [
    "EVENT_COLUMNS", "CATEGORICAL_EVENT_COLUMNS", "MEMORY_EVENT_COLUMNS",
    "KIND_COMPUTE", "KIND_COMM", "KIND_MEMCPY", "KIND_MEMSET", "KIND_SYNC", "KIND_CPU_OP", "KIND_ANNOTATION",
    "KINDS", "DEVICE_KINDS",
    "DEVICE_CUDA", "DEVICE_ROCM", "DEVICE_MTIA", "DEVICE_XPU", "DEVICE_CPU", "DEVICE_TYPES",
    "DEVICE_EVENT_CATS", "RUNTIME_CATS", "device_type", "device_of",
    "STEP_PREFIX", "OPTIMIZER_PREFIX", "ZERO_GRAD_PREFIX", "TENSOR_SUBCLASS_DISPATCH", "FORWARD_MARKERS",
    "FORWARD_SPAN_MARKERS", "BACKWARD_MARKERS", "SYNC_CALLS", "SCALAR_SYNC_OPS", "DATALOADER_PREFIX",
    "STAGE_DATA", "STAGE_FORWARD", "STAGE_BACKWARD", "STAGE_OPTIMIZER", "STAGE_POST_STEP", "STAGE_OUTSIDE",
    "STAGE_UNKNOWN", "STAGES", "STEP_STAGES", "STEP_MARK_COLUMNS", "stage_at", "stage_codes_at",
    "STAGE_FRAME_RULES", "BLOCK_ROWS",
]

# --------------------------------------------------------------------------- events frame
EVENT_COLUMNS = [
    "rank", "lane", "kind", "name", "ts_us", "dur_us", "collective", "bytes", "dtype",
    "group_size", "pg", "seq", "step", "stage", "fsdp_phase", "unit", "launch_ts_us",
]
CATEGORICAL_EVENT_COLUMNS = ("lane", "kind", "name", "collective", "dtype", "pg", "stage", "fsdp_phase", "unit")

# Columns of the memory-events frame (the trace's ``[memory]`` instant events), one row each:
#   rank int32, ts_us float64, addr int64, bytes int64 (negative on free),
#   total_allocated_bytes int64, total_reserved_bytes int64, device_type int8, device_id int16
MEMORY_EVENT_COLUMNS = [
    "rank", "ts_us", "addr", "bytes", "total_allocated_bytes", "total_reserved_bytes",
    "device_type", "device_id",
]

# --------------------------------------------------------------------------- kinds
KIND_COMPUTE = "compute"
KIND_COMM = "comm"
KIND_MEMCPY = "memcpy"
KIND_MEMSET = "memset"
KIND_SYNC = "sync"
KIND_CPU_OP = "cpu_op"
KIND_ANNOTATION = "annotation"
KINDS = [KIND_COMPUTE, KIND_COMM, KIND_MEMCPY, KIND_MEMSET, KIND_SYNC, KIND_CPU_OP, KIND_ANNOTATION]
# what occupies the device (GPU) or, on CPU runs, the rank's compute and gloo work
DEVICE_KINDS = [KIND_COMPUTE, KIND_COMM, KIND_MEMCPY, KIND_MEMSET, KIND_SYNC]

# --------------------------------------------------------------------------- device types
DEVICE_CUDA, DEVICE_ROCM, DEVICE_MTIA, DEVICE_XPU, DEVICE_CPU = "cuda", "rocm", "mtia", "xpu", "cpu"
DEVICE_TYPES = [DEVICE_CUDA, DEVICE_ROCM, DEVICE_MTIA, DEVICE_XPU, DEVICE_CPU]


# kineto event categories: events on a device (with a ``stream``) and the host-side runtime calls that
# launch them (linked by ``correlation``); MTIA, XPU and PrivateUse1 backends use their own names
DEVICE_EVENT_CATS = frozenset({"kernel", "gpu_memcpy", "gpu_memset", "cuda_sync", "Kernel", "Memcpy", "Memset",
                               "mtia_ccp_events"})
RUNTIME_CATS = frozenset({"cuda_runtime", "cuda_driver", "Runtime", "Driver", "mtia_runtime", "xpu_runtime",
                          "xpu_driver", "privateuse1_runtime", "privateuse1_driver"})


def device_type(categories, runtime_names, device_names=()) -> str:
    """The device a trace ran on, from its event categories, the names of its runtime calls and the
    names in ``deviceProperties``: rocm (HIP runtime calls or an AMD device), mtia, xpu, cuda, else cpu."""
    cats = {str(c).lower() for c in categories}
    names = [str(n).lower() for n in runtime_names]
    devs = " ".join(str(d).lower() for d in device_names)
    if any(n.startswith("hip") for n in names) or "amd" in devs or "instinct" in devs or "hip_runtime" in cats:
        return DEVICE_ROCM
    if any(c.startswith("mtia") for c in cats):
        return DEVICE_MTIA
    if any(c.startswith("xpu") for c in cats) or any(n.startswith(("ur", "ze", "sycl")) for n in names):
        return DEVICE_XPU
    if cats & {"kernel", "gpu_memcpy", "gpu_memset", "cuda_runtime", "cuda_driver", "cuda_sync"}:
        return DEVICE_CUDA
    return DEVICE_CPU


def device_of(device_properties, device_id=None) -> tuple[str | None, int | None]:
    """(name, total memory in bytes) of the device a trace ran on, from its ``deviceProperties``: the entry
    whose ``id`` is ``device_id`` when given, else the one kind every entry shares; (None, None) when the trace
    does not say (no entries, or several kinds of device and no id)."""
    props = [p for p in device_properties if isinstance(p, dict)] if isinstance(device_properties, list) else []
    if device_id is not None:
        props = [p for p in props if p.get("id") == device_id] or props
    kinds = {(str(p.get("name") or "").strip() or None,
              p.get("totalGlobalMem") if isinstance(p.get("totalGlobalMem"), int) and p["totalGlobalMem"] > 0
              else None) for p in props}
    return next(iter(kinds)) if len(kinds) == 1 else (None, None)


# --------------------------------------------------------------------------- steps and stages
STEP_PREFIX = "ProfilerStep#"
OPTIMIZER_PREFIX = "Optimizer.step#"
ZERO_GRAD_PREFIX = "Optimizer.zero_grad#"
# the profiler's op for a tensor subclass's __torch_dispatch__: on FSDP2's parameters, DTensor dispatch
TENSOR_SUBCLASS_DISPATCH = "PythonSubclass"
# the first of these in a step starts its forward (before it: the data stage)
FORWARD_MARKERS = ("FSDP::root_pre_forward", "FSDP::pre_forward", "FullyShardedDataParallel._root_pre_forward",
                   "FullyShardedDataParallel._pre_forward", "FullyShardedDataParallel.forward",
                   "DistributedDataParallel.forward", "## forward ##")
# the forward markers that span a whole forward (not a hook at its start): the last end of one of these that
# starts before the step's backward ends its forward; FSDP2's markers are hooks, so its forward has no end
FORWARD_SPAN_MARKERS = ("FullyShardedDataParallel.forward", "DistributedDataParallel.forward", "## forward ##")
# the first of these in a step starts its backward
BACKWARD_MARKERS = ("autograd::engine::evaluate_function", "FSDP::pre_backward", "FSDP::post_backward",
                    "FullyShardedDataParallel._pre_backward", "FullyShardedDataParallel._post_backward",
                    "## backward ##")
# runtime calls that block the host until the device (a stream, an event) is done, and the ops that read a
# device scalar on the host (``tensor.item()``: a copy to the host and a stream synchronisation)
SYNC_CALLS = frozenset({"cudaStreamSynchronize", "cudaDeviceSynchronize", "cudaEventSynchronize",
                        "hipStreamSynchronize", "hipDeviceSynchronize", "hipEventSynchronize"})
SCALAR_SYNC_OPS = ("aten::_local_scalar_dense", "aten::item")
# torch.utils.data's annotation around each batch fetched: enumerate(DataLoader)#_SingleProcessDataLoaderIter.__next__
DATALOADER_PREFIX = "enumerate(DataLoader)#"

STAGES = [STAGE_DATA, STAGE_FORWARD, STAGE_BACKWARD, STAGE_OPTIMIZER, STAGE_POST_STEP, STAGE_OUTSIDE, STAGE_UNKNOWN]
STEP_STAGES = STAGES[:5]         # the stages inside a step, in order
STEP_MARK_COLUMNS = ["step", "start_us", "end_us", "fwd_us", "fwd_end_us", "bwd_us", "opt_us", "opt_end_us"]


def stage_at(ts, marks, collective=None, outside=STAGE_OUTSIDE):
    """Stage (object array) of each CPU time ``ts`` (µs) from the step marks (STEP_MARK_COLUMNS, sorted by start):
    data before the first forward marker, forward until the first backward marker, backward until the first
    Optimizer.step#, optimizer until its last end, post_step after; ``outside`` outside every step.  A
    ``collective`` launched after the forward's end (``fwd_end_us``) and before backward is data."""
    import numpy as np  # (numpy and pandas stay out of `fsdpprof plan` and --help)

    st = np.array(STAGES, dtype=object)[stage_codes_at(ts, marks, collective)]
    if outside != STAGE_OUTSIDE:
        st[st == STAGE_OUTSIDE] = outside
    return st


# a pass over every row of a big trace takes this many at a time: its temporaries stay a few MB, not bytes a row
# (stage_codes_at, intervals.innermost, the decoder's duplicate hash and launch filter, classify's factorizing)
BLOCK_ROWS = 1 << 16


def stage_codes_at(ts, marks, collective=None):
    """:func:`stage_at` as int8 positions in STAGES (``marks``: a DataFrame or a dict of its columns; a
    missing ``fwd_end_us`` column: no forward ends before the backward)."""
    import numpy as np

    ts = np.asarray(ts, dtype=np.float64)
    out = np.full(ts.size, STAGES.index(STAGE_OUTSIDE), dtype=np.int8)
    if "start_us" not in marks or not len(marks["start_us"]) or not ts.size:
        return out
    n_marks = len(marks["start_us"])
    col = {c: (np.asarray(marks[c], dtype=np.float64) if c in marks else np.full(n_marks, np.nan))
           for c in STEP_MARK_COLUMNS}
    coll = None if collective is None else np.asarray(collective, dtype=bool)
    for lo in range(0, ts.size, BLOCK_ROWS):
        hi = lo + BLOCK_ROWS
        _stage_codes_block(ts[lo:hi], col, None if coll is None else coll[lo:hi], out[lo:hi])
    return out


def _stage_codes_block(ts, col: dict, collective, out) -> None:
    """stage_codes_at of some rows into ``out`` (a view of the result; ``col``: the step marks' columns)."""
    import numpy as np

    idx = np.searchsorted(col["start_us"], ts, side="right") - 1
    ii = np.maximum(idx, 0)
    inside = (idx >= 0) & (ts <= col["end_us"][ii])
    m = {c: v[ii] for c, v in col.items()}
    inf = np.inf
    fwd = np.where(np.isnan(m["fwd_us"]), m["start_us"], m["fwd_us"])
    bwd = np.where(np.isnan(m["bwd_us"]), inf, m["bwd_us"])
    opt = np.where(np.isnan(m["opt_us"]), inf, m["opt_us"])
    opt_end = np.where(np.isnan(m["opt_end_us"]), inf, m["opt_end_us"])
    st = np.select([ts < fwd, ts < bwd, ts < opt, ts <= opt_end],
                   [STAGES.index(x) for x in (STAGE_DATA, STAGE_FORWARD, STAGE_BACKWARD, STAGE_OPTIMIZER)],
                   STAGES.index(STAGE_POST_STEP))
    if collective is not None:
        fwd_end = np.where(np.isnan(m["fwd_end_us"]), inf, m["fwd_end_us"])
        between = collective & (st == STAGES.index(STAGE_FORWARD)) & (ts >= fwd_end)
        st = np.where(between, STAGES.index(STAGE_DATA), st)
    out[inside] = st[inside]


# The stage of an allocation from its stack frames (CUDA snapshots without tags), the first rule that
# matches: (stage, regex over the frame signature ``name@file|...`` in lower case, substrings one of which
# any match contains).
STAGE_FRAME_RULES = [
    (STAGE_OPTIMIZER, r"torch/optim/|optimizer\.step|_multi_tensor_adam|_single_tensor_adam",
     ("torch/optim/", "optimizer.step", "_multi_tensor_adam", "_single_tensor_adam")),
    (STAGE_BACKWARD, r"autograd::engine|evaluate_function|accumulategrad|python_engine|_engine_run_backward"
                     r"|(?:^|\|)backward@|::backward\b|backward0",
     ("autograd::engine", "evaluate_function", "accumulategrad", "python_engine", "_engine_run_backward",
      "backward@", "::backward", "backward0")),
    (STAGE_DATA, r"torch/utils/data|collate|pin_memory", ("torch/utils/data", "collate", "pin_memory")),
    (STAGE_FORWARD, r"(?:^|\|)forward@|_call_impl", ("forward@", "_call_impl"))]
