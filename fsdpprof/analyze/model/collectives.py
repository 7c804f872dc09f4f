"""Collective types, the names communication goes by, and the bytes a collective moves (ring, bus, wire)."""
from __future__ import annotations

import re

__all__ = [
    "ALL_GATHER", "REDUCE_SCATTER", "ALL_REDUCE", "BROADCAST", "ALL_TO_ALL", "SEND_RECV", "BARRIER", "COLLECTIVES",
    "P2P", "UNKNOWN_COLLECTIVE", "C10D_PREFIX", "NCCL_OP_PREFIX", "GLOO_PREFIX", "RECORD_PARAM_COMMS",
    "FUNCTIONAL_PREFIXES", "COMM_KERNEL_LIBRARIES", "COMM_KERNEL_PREFIXES", "SYMM_MEM_PREFIX", "COMM_OP_PREFIXES",
    "is_collective_op", "collective_of", "kernel_name_tells_collective", "is_comm_kernel", "is_sync_kernel",
    "GLOO_RUNS_AS", "bus_factor", "ring_factor", "wire_factor",
]

ALL_GATHER, REDUCE_SCATTER, ALL_REDUCE = "all_gather", "reduce_scatter", "all_reduce"
BROADCAST, ALL_TO_ALL, SEND_RECV, BARRIER = "broadcast", "all_to_all", "send_recv", "barrier"
COLLECTIVES = [ALL_GATHER, REDUCE_SCATTER, ALL_REDUCE, BROADCAST, ALL_TO_ALL, SEND_RECV, BARRIER]
# point-to-point: no matching across ranks, no skew, no straggler blame (their own table)
P2P = frozenset({SEND_RECV})
# the type of a communication kernel that neither its launching op nor its name tells (never a kernel's name)
UNKNOWN_COLLECTIVE = "unknown collective"

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
COMM_KERNEL_LIBRARIES = ("nccl", "rccl")    # a device kernel of these is communication (is_comm_kernel)
COMM_KERNEL_PREFIXES = ("nccldevkernel_", "ncclkernel_", "rccl")      # cut before a kernel's collective type
SYMM_MEM_PREFIX = "symm_mem::"       # torch's symmetric-memory collectives: symm_mem::multimem_all_reduce_, ...
# CPU ops whose args say a collective's type and sizes: the decoder reads their args
COMM_OP_PREFIXES = (C10D_PREFIX, GLOO_PREFIX, NCCL_OP_PREFIX, RECORD_PARAM_COMMS, SYMM_MEM_PREFIX) + FUNCTIONAL_PREFIXES
# a library's own collective op, ``<namespace>::<op>`` (vllm::all_reduce, _C_custom_ar::all_reduce,
# trtllm::allreduce): an op of another namespace than these whose op name holds one of these words
_CUSTOM_COLLECTIVE_WORDS = ("allreduce", "allgather", "reducescatter", "alltoall")
_NOT_COLLECTIVE_NAMESPACES = frozenset({"aten", "prim", "profiler", "autograd", "cuda", "inductor", "triton"})


def is_collective_op(name) -> bool:
    """A CPU op that runs a collective (c10d, NCCL, gloo, functional, symm_mem and libraries' own ``ns::all_reduce``
    ops): a device kernel launched inside one is that collective's communication."""
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


# device kernels whose name does not tell the collective: NCCL runs all_to_all, gather, scatter and send/recv
# alike as ``SendRecv`` kernels, so only the CPU op that launched one says which
_KERNELS_OF_SEVERAL_COLLECTIVES = ("sendrecv",)


def kernel_name_tells_collective(name) -> bool:
    """Whether a comm kernel's name alone says its collective type (a ``SendRecv`` kernel's does not)."""
    s = _NON_ALPHA.sub("", str(name).split("(", 1)[0].lower())
    return not any(w in s for w in _KERNELS_OF_SEVERAL_COLLECTIVES)


def is_comm_kernel(names):
    """The one test of a communication kernel: a device kernel of NCCL or RCCL (its name starts with one of
    :data:`COMM_KERNEL_LIBRARIES`, any case; HTA's ``^nccl.*Kernel`` on real traces).  A name gives a bool, an
    array / Series of names a numpy bool array (non-strings: False)."""
    if isinstance(names, str):
        return names[:4].lower() in COMM_KERNEL_LIBRARIES
    import numpy as np  # (numpy stays out of `fsdpprof plan` and --help)

    arr = np.asarray(names, dtype=object).ravel()
    uniq, inv = np.unique(np.array([x if isinstance(x, str) else "" for x in arr], dtype=object), return_inverse=True)
    return np.array([u[:4].lower() in COMM_KERNEL_LIBRARIES for u in uniq], dtype=bool)[inv].reshape(
        np.shape(names))


def is_sync_kernel(name: str) -> bool:
    """A device event that waits (``... Sync ...``, case-sensitive as in HTA): neither compute nor communication."""
    return "Sync" in name


# bytes each rank sends per byte of the message (ring algorithms over n ranks), per collective:
# "frac" (n-1)/n, "2frac" 2(n-1)/n, or a constant
_RING_FACTOR = {ALL_GATHER: "frac", REDUCE_SCATTER: "frac", ALL_TO_ALL: "frac", ALL_REDUCE: "2frac",
                BROADCAST: 1.0, SEND_RECV: 1.0, BARRIER: 0.0}


# gloo has no reduce-scatter of its own: c10d runs one as gloo's all-reduce of the whole input (the work its trace
# shows, ``gloo:all_reduce``), then keeps the rank's chunk
GLOO_RUNS_AS = {REDUCE_SCATTER: ALL_REDUCE}


def bus_factor(collective, n: float) -> float:
    """Bytes each rank sends per message byte, ring algorithms over ``n`` ranks (nccl-tests' bus factor):
    (n-1)/n all_gather, reduce_scatter, all_to_all; 2(n-1)/n all_reduce; 1 broadcast, send_recv; 0 barrier; else NaN."""
    rule = _RING_FACTOR.get(collective) if isinstance(collective, str) else None
    if rule is None:
        return float("nan")
    if not isinstance(rule, str):
        return rule
    n = float(n)
    if n != n:
        return float("nan")
    frac = (n - 1) / n if n else float("-inf")        # (numpy's -1/0)
    return frac if rule == "frac" else 2 * frac


def ring_factor(collective, n):
    """:func:`bus_factor` over arrays (numpy): one factor per (collective, n)."""
    import numpy as np  # (numpy stays out of `fsdpprof plan` and --help)

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
    """:func:`ring_factor` as the backend runs the collective: on gloo a reduce-scatter is an all-reduce
    (:data:`GLOO_RUNS_AS`)."""
    import numpy as np

    if gloo:
        coll = np.asarray(collective, dtype=object)
        for c, runs_as in GLOO_RUNS_AS.items():
            coll = np.where(coll == c, runs_as, coll)
        collective = coll
    return ring_factor(collective, n)
