"""The one vocabulary of an FSDP step: every concept the analyses share is defined here, once.

Events frame (one row per duration event that matters, whatever the source: GPU kernels on device
streams, CPU ops and gloo work on threads):

=============  =========  ===========================================================
column         dtype      meaning
=============  =========  ===========================================================
rank           int32      global rank
lane           category   ``stream:7`` (device stream) or ``thread:1234`` (CPU thread)
kind           category   one of KINDS
name           category   event name (interned)
ts_us          float64    start, profiler clock, microseconds (the *execution* interval)
dur_us         float64    duration, microseconds
collective     category   one of COLLECTIVES, or UNKNOWN_COLLECTIVE for a comm kernel whose type is not told
bytes          float64    message size in bytes (NaN unknown); all_gather: the whole gathered
                          output, reduce_scatter: the whole input, others: the input
dtype          category   element dtype of the message when known
group_size     float64    process-group size (NaN unknown)
pg             category   process group name/id when known
seq            float64    collective sequence number within its group when known
step           float64    ProfilerStep number of the launch point (NaN outside any step)
stage          category   one of STAGES, from the *launch* point (see :func:`stage_at`)
fsdp_phase     category   innermost FSDP annotation around the launch point (see :func:`parse_fsdp`)
unit           category   FSDP unit fqn of that annotation ("" = the root unit) when known
launch_ts_us   float64    the launch point: a device event's runtime call, a gloo collective's
                          c10d call, a CPU op's own start; NaN when the launch is not in the trace
=============  =========  ===========================================================

Labels come from the launch, intervals from the execution: a device kernel takes step, stage,
FSDP phase, unit, collective type and process group from the CPU op that launched it; overlap
and exposure use its execution interval.  A kernel launched inside a collective op
(:func:`is_collective_op`) is communication (kind comm) whatever its name; a comm kernel whose launch is
not in the trace takes its type from its name (:func:`collective_of`), else UNKNOWN_COLLECTIVE.  The
runtime calls that block the host (SYNC_CALLS) are rows of kind cpu_op on their thread; the other
runtime calls are only used to find the launch points. The memory frames use the same ``stage``,
``fsdp_phase`` and ``unit`` columns with the same meanings (at the allocation; ``free_stage`` /
``free_fsdp_phase`` at the free).
"""
from __future__ import annotations

import enum
import re

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

STAGE_DATA = "data"              # in a step, before its forward (data loading, host-to-device copies), and the
                                 # collectives between the end of its forward and its backward (input
                                 # distribution: TorchRec's sparse data all-to-alls)
STAGE_FORWARD = "forward"
STAGE_BACKWARD = "backward"      # from the step's first backward marker
STAGE_OPTIMIZER = "optimizer"    # from the first Optimizer.step# to the end of the last one
STAGE_POST_STEP = "post_step"    # after the optimizer (zero_grad, logging)
STAGE_OUTSIDE = "outside_step"   # launched outside every ProfilerStep
STAGE_UNKNOWN = "unknown"        # a device kernel whose launch is not in the trace
STAGES = [STAGE_DATA, STAGE_FORWARD, STAGE_BACKWARD, STAGE_OPTIMIZER, STAGE_POST_STEP, STAGE_OUTSIDE, STAGE_UNKNOWN]
STEP_STAGES = STAGES[:5]         # the stages inside a step, in order
STEP_MARK_COLUMNS = ["step", "start_us", "end_us", "fwd_us", "fwd_end_us", "bwd_us", "opt_us", "opt_end_us"]


def stage_at(ts, marks, collective=None):
    """Stage (object array) of each CPU time ``ts`` (µs) from the step marks (columns STEP_MARK_COLUMNS,
    one row per ProfilerStep, sorted by start_us; NaN where a step lacks that marker):

    data before the step's first forward marker (none: the step starts in forward), forward until
    its first backward marker, backward until the first Optimizer.step#, optimizer until the end of
    the last one, post_step after it; ``outside_step`` outside every step.  ``collective`` (bool per
    time, optional): the time launches a collective; a collective launched after the step's forward ended
    (``fwd_end_us``: FORWARD_SPAN_MARKERS) and before its backward is data (input distribution), not
    forward."""
    import numpy as np

    return np.array(STAGES, dtype=object)[stage_codes_at(ts, marks, collective)]


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
        between = np.asarray(collective, dtype=bool) & (st == STAGES.index(STAGE_FORWARD)) & (ts >= fwd_end)
        st = np.where(between, STAGES.index(STAGE_DATA), st)
    out[inside] = st[inside]
    return out


# --------------------------------------------------------------------------- FSDP phases and units
FSDP1_PREFIX = "FullyShardedDataParallel."
FSDP2_PREFIX = "FSDP::"
_FSDP2 = re.compile(r"^FSDP::(\w+)(?: \((.*)\)| for (.*))?$")
_FSDP1 = re.compile(r"^FullyShardedDataParallel\.(\w+)$")


def parse_fsdp(name: str) -> tuple[str | None, str | None, str | None]:
    """(fsdp_phase, unit, family) of an FSDP annotation name; (None, None, None) when it is not one.

    FSDP2 ``FSDP::<phase> (<fqn>)`` / ``FSDP::<phase>_prefetch for <fqn>`` / ``FSDP::<phase>`` (the
    root unit, fqn ""; ``root_*`` annotations name no unit); FSDP1 ``FullyShardedDataParallel._<phase>``
    whose phase drops the leading underscore and ``_hook`` (``_pre_backward_hook`` -> ``pre_backward``)
    and names no unit. family: ``fsdp2`` | ``fsdp1``."""
    if not isinstance(name, str):
        return None, None, None
    m = _FSDP2.match(name)
    if m:
        unit = m.group(2) if m.group(2) is not None else m.group(3)
        if unit is None and not m.group(1).startswith("root_"):
            unit = ""
        return m.group(1), unit, "fsdp2"
    m = _FSDP1.match(name)
    if m:
        return m.group(1).lstrip("_").replace("_hook", ""), None, "fsdp1"
    return None, None, None


# fine FSDP phases whose allocations are unsharded parameters / unsharded gradients (both families)
UNSHARDED_PARAM_PHASES = frozenset({"all_gather", "all_gather_copy_out", "unshard", "foreach_all_gather",
                                    "foreach_all_gather_copy_out"})
UNSHARDED_GRAD_PHASES = frozenset({"post_backward_reduce", "reduce_scatter", "foreach_reduce", "post_backward"})
# FSDP1 unshards (the padded flat parameter) inside these and frees it in a reshard
FSDP1_UNSHARD_PHASES = frozenset({"pre_forward", "pre_forward_prefetch", "pre_backward", "pre_backward_prefetch",
                                  "post_backward_prefetch"})
FSDP1_RESHARD_PHASES = frozenset({"post_forward", "post_backward", "post_backward_reshard_only", "reshard"})


# --------------------------------------------------------------------------- collectives
ALL_GATHER, REDUCE_SCATTER, ALL_REDUCE = "all_gather", "reduce_scatter", "all_reduce"
BROADCAST, ALL_TO_ALL, SEND_RECV, BARRIER = "broadcast", "all_to_all", "send_recv", "barrier"
COLLECTIVES = [ALL_GATHER, REDUCE_SCATTER, ALL_REDUCE, BROADCAST, ALL_TO_ALL, SEND_RECV, BARRIER]
# the type of a communication kernel that neither its launching op nor its name tells (never a kernel's name)
UNKNOWN_COLLECTIVE = "unknown collective"
# point-to-point: no matching across ranks, no skew, no straggler blame (their own table)
P2P = frozenset({SEND_RECV})

_COLL_PATTERNS = [  # order matters: "reducescatter" before "allreduce"/"reduce"
    ("allgather", ALL_GATHER), ("reducescatter", REDUCE_SCATTER), ("allreduce", ALL_REDUCE),
    ("alltoall", ALL_TO_ALL), ("broadcast", BROADCAST), ("sendrecv", SEND_RECV),
    ("isendirecv", SEND_RECV), ("send", SEND_RECV), ("recv", SEND_RECV), ("barrier", BARRIER),
]
_NON_ALPHA = re.compile(r"[^a-z]")
# the names of communication ops and work, by their prefix (each written here once)
C10D_PREFIX = "c10d::"               # c10d's calls on the issuing thread: c10d::allreduce_, c10d::_allgather_base_
NCCL_OP_PREFIX = "nccl:"             # NCCL's CPU-side ops: nccl:all_reduce, nccl:_all_gather_base
GLOO_PREFIX = "gloo:"                # gloo's work on its own threads: gloo:all_gather, gloo:all_reduce, ...
RECORD_PARAM_COMMS = "record_param_comms"    # the op c10d records around a collective, with its sizes in args
FUNCTIONAL_PREFIXES = ("c10d_functional::", "_c10d_functional::")     # functional collectives (DTensor, FSDP2)
COMM_KERNEL_PREFIXES = ("nccldevkernel_", "ncclkernel_", "rccl")      # device kernels (lower case)
SYMM_MEM_PREFIX = "symm_mem::"       # torch's symmetric-memory collectives: symm_mem::multimem_all_reduce_, ...
# CPU ops whose args say a collective's type and sizes: the decoder reads their args
COMM_OP_PREFIXES = (C10D_PREFIX, GLOO_PREFIX, NCCL_OP_PREFIX, RECORD_PARAM_COMMS, SYMM_MEM_PREFIX) + FUNCTIONAL_PREFIXES
# a library's own collective op, ``<namespace>::<op>`` (vllm::all_reduce, _C_custom_ar::all_reduce,
# trtllm::allreduce): an op of another namespace than these whose op name holds one of these words
_CUSTOM_COLLECTIVE_WORDS = ("allreduce", "allgather", "reducescatter", "alltoall")
_NOT_COLLECTIVE_NAMESPACES = frozenset({"aten", "prim", "profiler", "autograd", "cuda", "inductor", "triton"})


def is_collective_op(name) -> bool:
    """A CPU op that runs a collective: c10d's calls, NCCL's and gloo's ops, ``record_param_comms``, functional
    collectives, symmetric-memory ops (``symm_mem::*``) and libraries' own collectives (``vllm::all_reduce``):
    a device kernel launched inside one is that collective's communication, whatever the kernel is called."""
    if not isinstance(name, str):
        return False
    if name.startswith(COMM_OP_PREFIXES):
        return True
    ns, sep, op = name.partition("::")
    if not sep or ns.lower() in _NOT_COLLECTIVE_NAMESPACES:
        return False
    op = _NON_ALPHA.sub("", op.lower())
    return any(w in op for w in _CUSTOM_COLLECTIVE_WORDS)


# cut from a lower-cased name before its collective type is looked for (the first that matches)
_COLLECTIVE_NAME_PREFIXES = COMM_KERNEL_PREFIXES + (NCCL_OP_PREFIX, GLOO_PREFIX, C10D_PREFIX) + FUNCTIONAL_PREFIXES


def collective_of(name) -> str | None:
    """Collective type of a kernel / op / annotation / 'Collective name' string, or None."""
    if not isinstance(name, str) or not name:
        return None
    s = name.split("(", 1)[0].lower()
    for prefix in _COLLECTIVE_NAME_PREFIXES:
        if s.startswith(prefix):
            s = s[len(prefix):]
            break
    s = _NON_ALPHA.sub("", s.replace("_base", ""))
    for key, coll in _COLL_PATTERNS:
        if key in s:
            return coll
    return None


def is_comm_kernel(name: str) -> bool:
    """A device kernel of a communication library: NCCL (``ncclKernel_*``, ``ncclDevKernel_*``, which
    RCCL uses too) or RCCL's own ``rccl*`` names. HTA's ``^nccl.*Kernel`` is the same on real traces."""
    return name[:4].lower() in ("nccl", "rccl")


def is_sync_kernel(name: str) -> bool:
    """A device event that waits (``... Sync ...``, case-sensitive as in HTA, which counts it neither as
    compute nor as communication): not compute. ``recat_copy_async_kernel`` is compute."""
    return "Sync" in name


# bytes each rank sends per byte of the message (ring algorithms over n ranks), per collective:
# "frac" (n-1)/n, "2frac" 2(n-1)/n, or a constant
_RING_FACTOR = {ALL_GATHER: "frac", REDUCE_SCATTER: "frac", ALL_TO_ALL: "frac", ALL_REDUCE: "2frac",
                BROADCAST: 1.0, SEND_RECV: 1.0, BARRIER: 0.0}


# gloo has no reduce-scatter of its own: c10d runs one as gloo's all-reduce of the whole input (the work its trace
# shows, ``gloo:all_reduce``), then keeps the rank's chunk
GLOO_RUNS_AS = {REDUCE_SCATTER: ALL_REDUCE}


def ring_factor(collective, n):
    """Bytes each rank sends per byte of the message, ring algorithms over ``n`` ranks (numpy, one factor per
    (collective, n)); it is also nccl-tests' bus-bandwidth factor: all_gather, reduce_scatter, all_to_all
    (n-1)/n; all_reduce 2(n-1)/n; broadcast, send_recv 1; barrier 0; NaN for an unknown type (or n NaN where
    it counts)."""
    import numpy as np

    coll = np.asarray(collective, dtype=object)
    n = np.asarray(n, dtype=np.float64)
    with np.errstate(invalid="ignore", divide="ignore"):
        frac = (n - 1) / n
    rules = list(_RING_FACTOR.items())
    f = np.full(np.broadcast(coll, n).shape, np.nan)
    f = np.where(np.isin(coll, [c for c, r in rules if r == "frac"]), frac, f)
    f = np.where(np.isin(coll, [c for c, r in rules if r == "2frac"]), 2 * frac, f)
    for c, r in rules:
        if not isinstance(r, str):
            f = np.where(coll == c, r, f)
    return f


def wire_factor(collective, n, gloo: bool = False):
    """Bytes each rank moves per message byte, as the backend runs the collective (numpy, per element):
    :func:`ring_factor`, except on gloo, where a reduce-scatter moves what an all-reduce of its input moves
    (:data:`GLOO_RUNS_AS`: 2(n-1)/n, not (n-1)/n). What a collective's time is made of, as opposed to the
    ring traffic the ZeRO formulas count."""
    import numpy as np

    if gloo:
        coll = np.asarray(collective, dtype=object)
        for c, runs_as in GLOO_RUNS_AS.items():
            coll = np.where(coll == c, runs_as, coll)
        collective = coll
    return ring_factor(collective, n)


# --------------------------------------------------------------------------- dtypes
# spellings (traces, torch, the CLI) -> (torch name, bytes per element)
_DTYPES = {
    "float": ("float32", 4), "float32": ("float32", 4), "floatfloat": ("float32", 4), "fp32": ("float32", 4),
    "tf32": ("float32", 4), "double": ("float64", 8), "float64": ("float64", 8), "fp64": ("float64", 8),
    "half": ("float16", 2), "c10::half": ("float16", 2), "float16": ("float16", 2), "fp16": ("float16", 2),
    "bfloat16": ("bfloat16", 2), "c10::bfloat16": ("bfloat16", 2), "bf16": ("bfloat16", 2),
    "int": ("int32", 4), "int32": ("int32", 4),
    "long": ("int64", 8), "long int": ("int64", 8), "int64": ("int64", 8),
    "short": ("int16", 2), "short int": ("int16", 2), "int16": ("int16", 2),
    "byte": ("uint8", 1), "unsigned char": ("uint8", 1), "uint8": ("uint8", 1),
    "char": ("int8", 1), "signed char": ("int8", 1), "int8": ("int8", 1),
    "bool": ("bool", 1),
    "float8": ("float8_e4m3fn", 1), "fp8": ("float8_e4m3fn", 1),
    "float8_e4m3fn": ("float8_e4m3fn", 1), "c10::float8_e4m3fn": ("float8_e4m3fn", 1),
    "float8_e5m2": ("float8_e5m2", 1), "c10::float8_e5m2": ("float8_e5m2", 1),
}


def dtype_size(value) -> tuple[str | None, float]:
    """(torch dtype name, bytes per element) of a dtype spelling (``torch.bfloat16``, ``c10::Half``,
    ``bf16``, ``float`` ...); (the text, NaN) when unknown, (None, NaN) when not a string."""
    if not isinstance(value, str):
        return None, float("nan")
    key = value.strip().lower()
    if key.startswith("torch."):
        key = key[6:]
    name, size = _DTYPES.get(key, (value, float("nan")))
    return name, float(size)


_BINARY_UNITS = (("GiB", 2.0 ** 30), ("MiB", 2.0 ** 20), ("KiB", 2.0 ** 10))
_DECIMAL_UNITS = (("GB", 1e9), ("MB", 1e6), ("kB", 1e3))


def fmt_bytes(x, *, missing: str = "-", decimal: bool = False) -> str:
    """Bytes as text, the one formatter of every page, table and message: binary units (GiB, MiB, KiB =
    2**30, 2**20, 2**10; ``decimal``: GB, MB, kB = 1e9, 1e6, 1e3) at three significant digits (1.23 GiB,
    12.3 MiB, 123 KiB, 1,023 MiB), whole bytes below; ``missing`` for None, NaN or what is not a number."""
    try:
        v = float(x)
    except (TypeError, ValueError):
        return missing
    if v != v:
        return missing
    for unit, scale in _DECIMAL_UNITS if decimal else _BINARY_UNITS:
        if abs(v) >= scale:
            m = v / scale
            a = abs(m)
            return f"{m:,.0f} {unit}" if a >= 100 else f"{m:.1f} {unit}" if a >= 10 else f"{m:.2f} {unit}"
    return f"{v:.0f} B"


def rank_list(ranks) -> str:
    """'rank 3', 'ranks 0-7', 'ranks 0-2, 5' (ranges of consecutive ranks)."""
    rs = sorted(set(int(r) for r in ranks))
    parts, i = [], 0
    while i < len(rs):
        j = i
        while j + 1 < len(rs) and rs[j + 1] == rs[j] + 1:
            j += 1
        parts.append(str(rs[i]) if i == j else f"{rs[i]}-{rs[j]}")
        i = j + 1
    return ("rank " if len(rs) == 1 else "ranks ") + ", ".join(parts)


# --------------------------------------------------------------------------- memory categories
class MemoryCategory(str, enum.Enum):
    """What an allocation holds, in FSDP's own terms."""

    SHARDED_PARAM = "sharded_param"
    UNSHARDED_PARAM = "unsharded_param"      # all-gather output
    SHARDED_GRAD = "sharded_grad"
    UNSHARDED_GRAD = "unsharded_grad"        # reduce-scatter input
    OPTIMIZER_STATE = "optimizer_state"
    ACTIVATION = "activation"
    TEMPORARY = "temporary"
    INPUT = "input"
    BEFORE_RECORDING = "before_recording"    # alive before the allocation history began, nothing says more
    OTHER = "other"


MEMORY_CATEGORIES = [c.value for c in MemoryCategory]
# categories that say nothing about what the memory holds: outside "named" (coverage_pct)
UNNAMED_CATEGORIES = frozenset({MemoryCategory.OTHER.value, MemoryCategory.BEFORE_RECORDING.value})
BEFORE_RECORDING_NOTE = ("allocated before the allocation history began (torch records no frames and no time "
                         "for it); the blocks' sizes are listed")
# categories that only exist when the model states are sharded (none on DDP / single-device inputs)
SHARDED_CATEGORIES = frozenset({MemoryCategory.UNSHARDED_PARAM.value, MemoryCategory.UNSHARDED_GRAD.value})
# how the categories of the rank's own model states read when nothing is sharded (DDP, one device)
REPLICATED_LABELS = {MemoryCategory.SHARDED_PARAM.value: "param", MemoryCategory.SHARDED_GRAD.value: "grad"}


class MemoryRole(str, enum.Enum):
    """What memory is for, whatever the strategy: the roles runs of different strategies are compared by
    (FSDP's sharded and gathered params are both params, as DDP's whole ones)."""

    PARAMS = "params"
    GRADS = "grads"
    OPTIMIZER_STATE = "optimizer_state"
    ACTIVATIONS = "activations"
    TEMPORARIES = "temporaries"
    OTHER = "other"


_C, _R = MemoryCategory, MemoryRole
# every category (and the replicated names) in exactly one role: the roles add up to the allocated bytes
ROLE_OF_CATEGORY = {
    _C.SHARDED_PARAM.value: _R.PARAMS, _C.UNSHARDED_PARAM.value: _R.PARAMS, "param": _R.PARAMS,
    _C.SHARDED_GRAD.value: _R.GRADS, _C.UNSHARDED_GRAD.value: _R.GRADS, "grad": _R.GRADS,
    _C.OPTIMIZER_STATE.value: _R.OPTIMIZER_STATE, _C.ACTIVATION.value: _R.ACTIVATIONS,
    _C.TEMPORARY.value: _R.TEMPORARIES,
    _C.INPUT.value: _R.OTHER, _C.BEFORE_RECORDING.value: _R.OTHER, _C.OTHER.value: _R.OTHER}
MEMORY_ROLES = [r.value for r in MemoryRole]


def memory_role(category) -> str:
    """The role (MemoryRole value) of a memory category; an unknown category is ``other``."""
    return ROLE_OF_CATEGORY.get(str(category), MemoryRole.OTHER).value

# --------------------------------------------------------------------------- what an input is
INPUT_KINDS = ["fsdp2", "fsdp1", "ddp", "distributed", "single_device", "unknown"]
DDP_MARKERS = ("DistributedDataParallel.", "Reducer::")
# DDP's reducer on the training thread (torch 2.x's record_function names): the gradient hooks' division by
# the world size (mul_out) and the copies out of the buckets after the all-reduce: DDP's own CPU work
DDP_REDUCER_PREFIXES = ("torch::distributed::reducer::", "torch.distributed.ddp.reducer::")


# --------------------------------------------------------------------------- FSDP in stack frames
# The source files of FSDP2 (torch/distributed/fsdp/_fully_shard/) and FSDP1 (torch/distributed/fsdp/)
# whose functions appear in the stack frames of a CUDA memory snapshot (torch 2.x; FSDP1's flat
# parameter file was flat_param.py before torch 2.1).  A snapshot with allocations under these
# frames comes from an FSDP2 / FSDP1 run.
FSDP2_FRAME_FILES = ("_fsdp_param_group.py", "_fsdp_collectives.py", "_fsdp_param.py", "_fsdp_state.py",
                     "_fully_shard.py")
FSDP1_FRAME_FILES = ("fully_sharded_data_parallel.py", "_flat_param.py", "flat_param.py", "_runtime_utils.py")

# What an FSDP allocation is, from the function that made it (its frames): role -> MemoryCategory.
FSDP_ROLE_ALL_GATHER_INPUT = "all_gather_input"      # the shard cast to the all-gather dtype (mixed precision)
FSDP_ROLE_ALL_GATHER_OUTPUT = "all_gather_output"    # the flat all-gather output (FSDP1: the unsharded flat param)
FSDP_ROLE_COPY_OUT = "unsharded_param"               # FSDP2: the per-parameter unsharded tensors (copy-out)
FSDP_ROLE_COPY_OUT_TEMP = "copy_out_temp"            # FSDP2: scratch of the copy-out for Shard(dim != 0)
FSDP_ROLE_REDUCE_SCATTER = "reduce_scatter"          # FSDP2 foreach_reduce / FSDP1 _reduce_grad buffers
FSDP_ROLE_REDUCE_SCATTER_INPUT = "reduce_scatter_input"    # (the largest of one call: the padded unsharded grads)
FSDP_ROLE_REDUCE_SCATTER_OUTPUT = "reduce_scatter_output"  # (the others: the new sharded grad, its cast)
FSDP_ROLE_SHARDED_PARAM = "sharded_param"            # the shard itself (made at fully_shard / FSDP init)
FSDP_ROLE_CATEGORY = {
    FSDP_ROLE_ALL_GATHER_INPUT: MemoryCategory.TEMPORARY.value,
    FSDP_ROLE_ALL_GATHER_OUTPUT: MemoryCategory.UNSHARDED_PARAM.value,
    FSDP_ROLE_COPY_OUT: MemoryCategory.UNSHARDED_PARAM.value,
    FSDP_ROLE_COPY_OUT_TEMP: MemoryCategory.TEMPORARY.value,
    FSDP_ROLE_REDUCE_SCATTER_INPUT: MemoryCategory.UNSHARDED_GRAD.value,
    FSDP_ROLE_REDUCE_SCATTER_OUTPUT: MemoryCategory.SHARDED_GRAD.value,
    FSDP_ROLE_SHARDED_PARAM: MemoryCategory.SHARDED_PARAM.value,
}
# (role, functions, file) in the order they are tried: the first rule with one of ``functions`` defined
# in ``file`` somewhere in the stack decides.  Function names are torch's own (torch 2.13:
# _fully_shard/_fsdp_collectives.py foreach_all_gather -> all_gather_comm.allocate,
# _get_param_all_gather_inputs -> torch.empty; _fsdp_param.py alloc_all_gather_outputs -> alloc_storage;
# foreach_reduce -> reduce_scatter_comm.allocate; FSDP1 _flat_param.py _alloc_padded_unsharded_flat_param,
# _use_low_precision_shard; _runtime_utils.py _reduce_grad / _get_reduce_scatter_tensors).
FSDP_FRAME_ROLES = [
    (FSDP_ROLE_COPY_OUT, ("alloc_all_gather_outputs", "init_all_gather_outputs", "init_unsharded_param"),
     "_fsdp_param.py"),
    (FSDP_ROLE_COPY_OUT_TEMP, ("foreach_all_gather_copy_out",), "_fsdp_collectives.py"),
    (FSDP_ROLE_ALL_GATHER_INPUT, ("_get_param_all_gather_inputs",), "_fsdp_collectives.py"),
    (FSDP_ROLE_ALL_GATHER_INPUT, ("all_gather_inputs",), "_fsdp_param.py"),
    (FSDP_ROLE_ALL_GATHER_OUTPUT, ("foreach_all_gather",), "_fsdp_collectives.py"),
    (FSDP_ROLE_REDUCE_SCATTER, ("foreach_reduce",), "_fsdp_collectives.py"),
    (FSDP_ROLE_SHARDED_PARAM, ("_init_sharded_param", "reset_sharded_param", "_init_sharded_post_forward_param_metadata"),
     "_fsdp_param.py"),
    (FSDP_ROLE_ALL_GATHER_INPUT, ("_use_low_precision_shard",), "flat_param.py"),
    (FSDP_ROLE_ALL_GATHER_OUTPUT, ("_alloc_padded_unsharded_flat_param",), "flat_param.py"),
    (FSDP_ROLE_REDUCE_SCATTER, ("_reduce_grad", "_get_reduce_scatter_tensors", "_reduce_grad_no_shard"),
     "_runtime_utils.py"),
    (FSDP_ROLE_SHARDED_PARAM, ("_init_flat_param_and_metadata", "flatten_tensors_into_flat_param", "_shard",
                               "shard"), "flat_param.py"),
]
# Module calls in a stack (nn.Module.__call__): the innermost one in an all-gather's stack is the FSDP
# unit whose pre-forward hook unshards it.
MODULE_CALL_FUNCTIONS = ("_call_impl",)
MODULE_CALL_FILE = "torch/nn/modules/module.py"
# FSDP2's pre-forward hook of a unit of several modules (fully_shard([norm, output])): function and file in the
# all-gather's stack.  The unit runs from that all-gather (in its first module's call) to its post-forward (in its last
# module's), through sibling module calls
FSDP2_GROUP_PRE_HOOK = ("wrapped_pre_hook", "_fsdp_state.py")
