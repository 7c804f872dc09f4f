"""The per-event rules of reading and classifying a trace, in plain Python (stdlib and msgspec only).

One definition each, shared by the vectorised full path (:mod:`fsdpprof.analyze.trace.decode`,
:mod:`fsdpprof.analyze.trace.classify`, which apply them over numpy columns) and the quick path
(:mod:`fsdpprof.analyze.comm.quick`, which applies them event by event without numpy or pandas):
which events are kept, how names and ids are shown, what a name says (comm kernel, memcpy, gloo work,
c10d call ...), message sizes (bytes) from a comm op's args, plausible counts.
"""
from __future__ import annotations

import math
from itertools import repeat
from typing import Annotated, Any, ClassVar

from fsdpprof.analyze import model as vocab
from fsdpprof.analyze.msgspec_import import import_msgspec

msgspec = import_msgspec()

NAME_MAX_CHARS = 4096           # longer names (thread ids, process group names, ...) are cut: real kernel
                                # names reach 1,817 characters (C++ templates, hta-16rank-a100)
TIME_MAX_US = float(2 ** 53)    # |ts| and dur beyond this (285 years in us; floats lose whole us there) are not times
RANK_MAX = 1 << 24              # ranks / world sizes / group sizes beyond this are not real
NUMEL_MAX = 2.0 ** 53           # element / byte counts beyond this (8 Pi) are not real messages

# Event phases (``ph``) whose fields the typed readers (the decoder's fast path, the quick reader) skip; they decode
# duration events (X), instants (i, I) and metadata (M) (see PhaseEvent), and any other phase fails their validation
# (the lenient path reads such a trace).
SKIPPED_PHASES = tuple("BECbnestfPONDRcp()")

# Duration-event categories we keep; everything else (python_function, flows, overhead, ...) is skipped.
KEEP_CATS = frozenset({"cpu_op", "user_annotation", "gpu_user_annotation"}) | vocab.DEVICE_EVENT_CATS | vocab.RUNTIME_CATS
# categories of CPU ops and annotations, and the device-event categories that are copies, sets and waits
CPU_OP_CATS = ("cpu_op",)
ANNOTATION_CATS = ("user_annotation", "gpu_user_annotation")
MEMCPY_CATS, MEMSET_CATS, SYNC_CATS = ("gpu_memcpy", "Memcpy"), ("gpu_memset", "Memset"), ("cuda_sync",)
# CPU events whose args are read (beyond device events): communication ops
ARGS_NAME_PREFIXES = ("c10d::", "gloo:", "nccl:", "record_param_comms")


# an integer id (stream, correlation, External id) that fits int64: a bigger one fails msgspec's validation, and
# the trace is read by the lenient path (decode) / the full path (quick), which keep such ids as -1
Id64 = Annotated[int, msgspec.Meta(le=(1 << 63) - 1)]


class XArgs(msgspec.Struct, gc=False, frozen=True):
    """The args fields a duration event's columns use, decoded inline with the event by the typed readers
    (decode's fast path, the quick path).  A trace whose ids are not plain integers fails validation and is
    read by the lenient path."""

    stream: Id64 = -1
    correlation: Id64 = -1
    ext_id: Id64 = msgspec.field(default=-1, name="External id")
    coll_name: Any = msgspec.field(default=None, name="Collective name")
    in_nelems: Any = msgspec.field(default=None, name="In msg nelems")
    out_nelems: Any = msgspec.field(default=None, name="Out msg nelems")
    group_size: Any = msgspec.field(default=None, name="Group size")
    dtype: Any = None
    pg: Any = msgspec.field(default=None, name="Process Group Name")
    seq: Any = msgspec.field(default=None, name="Seq")
    input_dims: msgspec.Raw = msgspec.field(default=msgspec.Raw(b"null"), name="Input Dims")
    input_type: msgspec.Raw = msgspec.field(default=msgspec.Raw(b"null"), name="Input type")


class FastArgs(XArgs, gc=False, frozen=True):
    """Every args field we use: XArgs plus the [memory] and thread-name fields of instant and metadata events."""

    addr: Any = msgspec.field(default=None, name="Addr")
    nbytes: Any = msgspec.field(default=None, name="Bytes")
    total_alloc: Any = msgspec.field(default=None, name="Total Allocated")
    total_reserved: Any = msgspec.field(default=None, name="Total Reserved")
    device_type: Any = msgspec.field(default=None, name="Device Type")
    device_id: Any = msgspec.field(default=None, name="Device Id")
    name: Any = None


class PhaseEvent(msgspec.Struct, gc=False, tag_field="ph"):
    """The typed readers' events (the decoder's fast path, the quick reader), decoded by their phase ``ph`` as a
    tagged union: each reader's duration event (X, a subclass of this) in full, OTHER_PHASE_TYPES for the rest,
    the same for both readers, so that what fails one's validation fails the other's.  A phase outside the
    chrome-trace spec fails validation (the lenient path reads such a trace).  Times in us, NaN when absent."""

    cat: ClassVar[Any] = None        # only duration events decode their category


OTHER_CAT = object()                # the "category" of the instant and metadata events the fast path reads


class FastInstant(PhaseEvent, tag="i"):
    """An instant ([memory] events): what the fast path reads of it."""

    cat: ClassVar[Any] = OTHER_CAT   # (not decoded: tells instants and metadata apart in one pass, see add_fast)
    name: Any = ""
    ts: float = float("nan")
    args: FastArgs | None = None


class FastInstantOld(FastInstant, tag="I"):
    pass


class FastMeta(PhaseEvent, tag="M"):
    """A metadata event (thread names): what the fast path reads of it."""

    cat: ClassVar[Any] = OTHER_CAT
    name: Any = ""
    pid: Any = None
    tid: Any = None
    args: FastArgs | None = None


class FastSkip(PhaseEvent):
    """A phase neither reader uses: its fields skipped."""


OTHER_PHASE_TYPES = (FastInstant, FastInstantOld, FastMeta) + tuple(
    type(f"FastSkip{ord(ph)}", (FastSkip,), {}, tag=ph) for ph in SKIPPED_PHASES)


def cut_text(text: str) -> str:
    """``text`` cut to NAME_MAX_CHARS characters with a marker saying how long it was."""
    if len(text) <= NAME_MAX_CHARS:
        return text
    return f"{text[:NAME_MAX_CHARS]}... [cut: {len(text):,} characters]"


def as_text(value) -> str:
    """A trace value shown as text: a string as it is, anything else as its JSON text; cut to
    NAME_MAX_CHARS."""
    if type(value) is not str:
        try:
            value = msgspec.json.encode(value).decode()
        except (TypeError, ValueError, OverflowError, RecursionError, msgspec.EncodeError):
            value = f"<{type(value).__name__}>"
    return cut_text(value)


def unique_labels(labels: list[str]) -> list[str]:
    """Labels made unique (a repeat gets ``#1``, ``#2`` ...): two distinct raw keys (1 and "1") can read alike."""
    seen: dict = {}
    out = []
    for c in labels:
        if c in seen:
            seen[c] += 1
            c = f"{c}#{seen[c]}"
        else:
            seen[c] = 0
        out.append(c)
    return out


def plausible_count(value, low: int = 1) -> bool:
    """An int (not a bool) in [low, RANK_MAX]: a world size, group size (low=1) or rank (low=0)."""
    return type(value) is int and low <= value <= RANK_MAX


def check_distributed_info(meta: dict, defects: dict) -> None:
    """Leave out distributedInfo's rank / world_size and process groups' pg_size that are not plausible
    numbers (a string, a negative or huge number, ...), in place; counted in ``defects``."""
    dist = meta.get("distributedInfo")
    if dist is None:
        return
    if not isinstance(dist, dict):
        meta.pop("distributedInfo")
        defects["dist_info"] = defects.get("dist_info", 0) + 1
        return
    dist = meta["distributedInfo"] = dict(dist)
    for key, low in (("rank", 0), ("world_size", 1)):
        if key in dist and dist[key] is not None and not plausible_count(dist[key], low):
            dist.pop(key)
            defects["dist_info"] = defects.get("dist_info", 0) + 1
    if isinstance(dist.get("rank"), int) and isinstance(dist.get("world_size"), int) and dist["rank"] >= dist["world_size"]:
        dist.pop("rank")
        defects["dist_info"] = defects.get("dist_info", 0) + 1
    cfg = dist.get("pg_config")
    if cfg is not None:
        good = [g for g in cfg if isinstance(g, dict)] if isinstance(cfg, list) else []
        for g in good:
            if "pg_size" in g and g["pg_size"] is not None and not plausible_count(g["pg_size"]):
                g.pop("pg_size")
                defects["dist_info"] = defects.get("dist_info", 0) + 1
        if not isinstance(cfg, list) or len(good) != len(cfg):
            defects["dist_info"] = defects.get("dist_info", 0) + 1
        dist["pg_config"] = good


# defect kind -> what the warning says (one line per kind and trace)
DEFECTS = {
    "time_missing": "{n:,} events without a timestamp or duration (missing or not a number) were left out",
    "time_beyond": "{n:,} events with an infinite or implausible timestamp or duration (beyond 2^53 us) were left out",
    "negative_dur": "{n:,} events with a negative duration were left out",
    "duplicate": "{n:,} duplicated events (identical to an earlier event) were left out",
    "duplicate_memory": "{n:,} duplicated [memory] events (same time, address, bytes and totals) were left out",
    "bad_memory": "{n:,} [memory] events with a missing or invalid time, address or size were left out",
    "type_name": "{n:,} event names were not strings: shown as their JSON text",
    "long_name": "{n:,} event names longer than {max:,} characters were cut",
    "type_tid": "{n:,} thread ids were lists or objects: shown as their JSON text",
    "long_tid": "{n:,} thread ids longer than {max:,} characters were cut",
    "type_pid": "{n:,} process ids were lists or objects: shown as their JSON text",
    "long_pid": "{n:,} process ids longer than {max:,} characters were cut",
    "dist_info": "distributedInfo holds {n:,} value(s) that are not plausible ranks or sizes: left out",
}
LEFT_OUT = ("time_missing", "time_beyond", "negative_dur", "duplicate", "duplicate_memory", "bad_memory")


def defect_warnings(path: str, defects: dict) -> list[str]:
    """One warning line per kind of defect found while decoding ``path``, the numbers computed without them."""
    return [f"trace {path}: " + DEFECTS[k].format(n=defects[k], max=NAME_MAX_CHARS)
            for k in DEFECTS if defects.get(k)]


# --------------------------------------------------------------------------- what a name says
# tests of an event name, judged once per distinct name and process (the ranks of a job share names)
_MISS = object()
NAME_MEMO: dict = {}
_MEMO_MAX = 200_000          # names remembered per test (then forgotten, all at once)


def per_name(fn, names: list) -> list:
    """``[fn(x) for x in names]``, each distinct name computed once per process (``fn`` must be pure)."""
    memo = NAME_MEMO.get(fn)
    if memo is None or len(memo) > _MEMO_MAX:
        memo = NAME_MEMO[fn] = {}
    out = list(map(memo.get, names, repeat(_MISS, len(names))))
    if out.count(_MISS):
        for i, v in enumerate(out):
            if v is _MISS:
                out[i] = memo[names[i]] = fn(names[i])
    return out


COMM_CPU_NAMES = ("record_param_comms",)
WAIT_NAMES = frozenset({"c10d::wait", "aten::wait", "_c10d_functional::wait_tensor", "c10d_functional::wait_tensor"})
N_COMM, N_MEMCPY, N_MEMSET, N_SYNC, N_GLOO, N_C10D, N_NCCL_OP = (1 << i for i in range(7))


def name_flags_of(x: str) -> int:
    """Bit set of what a name says: comm kernel, memcpy, memset, sync, gloo work, c10d call, nccl op."""
    low = x.lower()
    return ((N_COMM if vocab.is_comm_kernel(x) else 0) | (N_MEMCPY if low.startswith(("memcpy", "dma")) else 0)
            | (N_MEMSET if low.startswith("memset") else 0) | (N_SYNC if vocab.is_sync_kernel(x) else 0)
            | (N_GLOO if x.startswith(vocab.GLOO_PREFIX) else 0)
            | (N_C10D if x.startswith("c10d::") or x in COMM_CPU_NAMES or x in WAIT_NAMES else 0)
            | (N_NCCL_OP if low.startswith("nccl:") else 0))


def collective_of_name(name: str):
    """vocab.collective_of, memoised per distinct name."""
    return per_name(vocab.collective_of, [name])[0]


def unknown_type_label(name: str) -> str:
    """The collective shown for a comm kernel whose type neither its launch nor its name tells: its name."""
    return str(name).split("(", 1)[0][:80]


# --------------------------------------------------------------------------- message sizes (bytes)
# gloo op each c10d op runs as (for pairing)
GLOO_AS = vocab.GLOO_RUNS_AS


def numel(dims, depth: int = 0) -> float:
    """Elements of a tensor shape ``[d0, d1, ...]`` or, for a list of shapes (TensorList), their sum;
    NaN when it is neither (negative or huge sizes, nesting deeper than a TensorList)."""
    if not isinstance(dims, list) or not dims or depth > 2:
        return float("nan")
    if all(type(d) is int for d in dims):
        if min(dims) < 0:
            return float("nan")
        n = float(math.prod(float(d) for d in dims))
        return n if n <= NUMEL_MAX else float("nan")
    # list of tensors (TensorList): sum of their numels
    vals = [numel(d, depth + 1) for d in dims if isinstance(d, list)]
    vals = [v for v in vals if v == v]
    return float(sum(vals)) if vals else float("nan")


def c10d_sizes(coll: str | None, dims_raw: bytes, types_raw: bytes) -> tuple[float, str | None, float]:
    """(bytes of the whole array, dtype, group size implied by the shapes or NaN) from a c10d op's
    Input Dims / Input type (all_gather: output/input numel; reduce_scatter: input/output numel)."""
    try:
        dims = msgspec.json.decode(dims_raw) if dims_raw else None
        types = msgspec.json.decode(types_raw) if types_raw else None
    except (msgspec.DecodeError, RecursionError):
        return float("nan"), None, float("nan")
    if not isinstance(dims, list) or not dims:
        return float("nan"), None, float("nan")
    dtype, size = (None, float("nan"))
    if isinstance(types, list):
        for t in types:
            dtype, size = dtype_of(t)
            if size == size:
                break
    n0 = numel(dims[0])
    n1 = numel(dims[1]) if len(dims) > 1 and isinstance(dims[1], list) and dims[1] else float("nan")
    group = float("nan")
    if coll in ("all_gather", "reduce_scatter"):
        n = max(n0 if n0 == n0 else n1, n1 if n1 == n1 else n0)
        if n0 == n0 and n1 == n1 and min(n0, n1) > 0 and max(n0, n1) % min(n0, n1) == 0:
            group = max(n0, n1) / min(n0, n1)
    else:
        n = n0
    return n * size, dtype, group


def dtype_of(value) -> tuple[str | None, float]:
    """vocab.dtype_size of a trace's dtype text; an unknown one is kept, cut to a readable length."""
    name, size = vocab.dtype_size(value)
    return (cut_text(name) if isinstance(name, str) and size != size else name), size


def given(x, low: float = 0.0):
    """A number from the trace's args, or None when absent or not a plausible count (not a number, a
    bool, NaN, inf, below ``low`` or beyond NUMEL_MAX)."""
    t = type(x)
    if (t is int or t is float) and low <= x <= NUMEL_MAX:
        return x
    return None


def comm_row_info(name: str, cname, inn, outn, gs, dt, pg, seq, dims: bytes, types: bytes) -> tuple:
    """What one event's comm args say: (collective or None, bytes or NaN, dtype or None, group_size or NaN,
    pg or None, seq or NaN, shard).  ``name``: the event's name as shown; the others: its args ``Collective
    name``, ``In msg nelems``, ``Out msg nelems``, ``Group size``, ``dtype``, ``Process Group Name``, ``Seq``
    and the raw JSON of ``Input Dims`` / ``Input type``.  shard: the bytes are one shard of the array (gloo
    all_gather work), to be multiplied by the group size once that is known."""
    coll = (collective_of_name(cname) if type(cname) is str else vocab.collective_of(cname)) or collective_of_name(name)
    dtype, size = dtype_of(dt)
    shard = False
    nbytes = float("nan")
    inn, outn, gs, seq = given(inn), given(outn), given(gs, 1), given(seq)
    if gs is not None and gs > RANK_MAX:
        gs = None
    if inn is not None or outn is not None:
        inn_f = float(inn) if inn is not None else float("nan")
        out_f = float(outn) if outn is not None else float("nan")
        if coll == "all_gather":
            n = out_f if out_f == out_f else inn_f
        elif coll == "reduce_scatter":
            n = inn_f if inn_f == inn_f else out_f
        else:
            n = inn_f if inn_f == inn_f else out_f
        nbytes = n * size
    elif name.startswith("c10d::"):
        nbytes, dtype2, group = c10d_sizes(coll, dims, types)
        dtype = dtype or dtype2
        if gs is None and group == group:
            gs = group
    elif name.startswith(vocab.GLOO_PREFIX):
        # the gloo work's own input: all_gather gets one shard (whole = shard * group size),
        # all_reduce (also what reduce_scatter runs as) the whole array
        nbytes, dtype2, _ = c10d_sizes(None, dims, types)
        dtype = dtype or dtype2
        shard = coll == "all_gather"  # only a shard here: times the group size once that is known
    pg = None if pg is None or (type(pg) is float and pg != pg) else as_text(pg)
    return (coll, nbytes, dtype, float("nan") if gs is None else float(gs), pg,
            float("nan") if seq is None else float(seq), shard)


def default_group_size(dist: dict) -> float:
    """Group size of a comm event that says none: the only process group's size, else the world size, else NaN."""
    if not isinstance(dist, dict):
        return float("nan")
    cfg = dist.get("pg_config")
    if isinstance(cfg, list) and len(cfg) == 1 and isinstance(cfg[0], dict) and plausible_count(cfg[0].get("pg_size")):
        return float(cfg[0]["pg_size"])
    ws = dist.get("world_size")
    return float(ws) if plausible_count(ws) else float("nan")


def other_group_sizes(meta: dict) -> tuple[list[float], object]:
    """(sizes of this rank's non-default process groups, the name of the only process group or None), from
    the trace's distributedInfo: what gloo work whose call told no size falls back on."""
    dist = meta.get("distributedInfo") if isinstance(meta.get("distributedInfo"), dict) else {}
    rank, cfg = dist.get("rank"), dist.get("pg_config")
    other_sizes: list[float] = []
    if isinstance(cfg, list) and len(cfg) > 1:
        for g in cfg:
            if not isinstance(g, dict) or g.get("pg_desc") == "default_pg" or not plausible_count(g.get("pg_size")):
                continue
            if isinstance(g.get("ranks"), list) and rank is not None and rank not in g["ranks"]:
                continue
            other_sizes.append(float(g["pg_size"]))
    only = None
    if isinstance(cfg, list) and len(cfg) == 1 and isinstance(cfg[0], dict) and cfg[0].get("pg_name") is not None:
        only = as_text(cfg[0]["pg_name"])
    return other_sizes, only


def fallback_group_size(other_sizes: list[float], known_sizes) -> float:
    """Group size of gloo work on a thread where no size is known: the one non-default size no other thread
    claimed (``known_sizes``: the sizes known on other threads), else the only non-default size, else NaN."""
    left = set(other_sizes) - set(known_sizes)
    return (left.pop() if len(left) == 1 else
            (other_sizes[0] if other_sizes and len(set(other_sizes)) == 1 else float("nan")))
