"""Overlap and collective volume per rank without numpy or pandas: the quick path for one question.

``quick_overlap(path)`` reads the same inputs as :func:`fsdpprof.analyze.run.load_run` (a trace file
``.json`` / ``.json.gz``, a folder of rank traces, an fsdpprof run directory) and returns, per rank, the
numbers of :func:`fsdpprof.analyze.comm.overlap.overall_overlap` and, per rank and collective, those of
:func:`fsdpprof.analyze.comm.volume.collective_volume` -- the same numbers, as plain Python objects,
importing only the standard library and msgspec (no numpy, pandas or torch): start-up is what a
scriptable check over many traces pays most.

It applies the rules of the full path (:mod:`fsdpprof.analyze.trace.rules`, :mod:`fsdpprof.analyze.vocab`:
which events are kept, what a name says, message sizes, bus factors) event by event, and reproduces the
full path's linking of comm kernels to their launching op (collective type, process group, sizes from the
op with the same External id) and of gloo work to its c10d call.  A trace the quick reader does not take
as it is -- not the typed layout of the decoder's fast path (odd types, ids beyond int64), non-string
names, thread ids that are not ints or strings, a multi-member gzip, more than QUICK_MAX_JSON_BYTES of
JSON, no duration event left, or anything unreadable -- is read by the full path instead (numpy and
pandas imported then), so the numbers and the error messages are the full path's; so is a trace on which the
quick reader fails in a way it did not foresee.

Times in microseconds (µs), sizes in bytes, bandwidths in GB/s (1e9 bytes/s).
"""
import os
import re
from bisect import bisect_right
from collections import Counter
from itertools import compress, repeat
from math import isfinite
from operator import add, attrgetter, is_not
from typing import Annotated, Any, Optional, Union

from fsdpprof.analyze import model as vocab
from fsdpprof.analyze.gc_pause import gc_paused
from fsdpprof.analyze.msgspec_import import import_msgspec
from fsdpprof.analyze.trace import rules
from fsdpprof.errors import UserError, unexpected_as_user_error

try:                                    # ISA-L's inflate (a dependency): same stream format as zlib, faster
    from isal import isal_zlib as _inflate
except ImportError:                     # pragma: no cover
    import zlib as _inflate

msgspec = import_msgspec()
QUICK_MAX_JSON_BYTES = 512 << 20        # a trace with more JSON than this is read by the full (streaming) path


# ----------------------------------------------------------------------------------------- results
# (msgspec structs: attributes, repr and equality like dataclasses, made faster at import)
class RankOverlap(msgspec.Struct):
    """One rank: compute_us (union of compute), comm_us (union of communication), overlapped_comm_us (of it,
    under compute), exposed_comm_us = comm_us - overlapped_comm_us (µs); comp_comm_overlap_pct = 100 x
    overlapped / comm (None for a rank without communication)."""

    rank: int
    compute_us: float
    comm_us: float
    overlapped_comm_us: float
    exposed_comm_us: float
    comp_comm_overlap_pct: float | None


class CollectiveVolume(msgspec.Struct):
    """One rank and collective: count (events), bytes (sum of the known sizes; None when none is known),
    time_us (sum of durations, µs), algbw_gbps = bytes / time, busbw_gbps = algbw x vocab.bus_factor (GB/s,
    over the events of known size; None when there are none)."""

    rank: int
    collective: str | None
    count: int
    bytes: float | None
    time_us: float
    algbw_gbps: float | None
    busbw_gbps: float | None


class QuickResult(msgspec.Struct):
    """What :func:`quick_overlap` found: ``overlap`` (per rank, sorted), ``volume`` (per rank and collective,
    sorted; collective None last), ``missing`` (rank or file label -> why it has no numbers), ``warnings``
    (one line each), ``full_path_ranks`` (ranks the full path read: see the module docstring)."""

    path: str
    overlap: list[RankOverlap]
    volume: list[CollectiveVolume]
    missing: dict = msgspec.field(default_factory=dict)
    warnings: list = msgspec.field(default_factory=list)
    full_path_ranks: list = msgspec.field(default_factory=list)

    def to_dict(self) -> dict:
        """Plain dicts and lists (JSON-ready: None where a number is not defined)."""
        return msgspec.to_builtins(self)


def _num(x: float) -> float | None:
    return None if x != x else x


# ----------------------------------------------------------------------------------------- reading
class _NotQuick(Exception):
    """This trace is read by the full path."""


# The types of the decoder's fast path (fsdpprof.analyze.trace.decode: FastEvent; rules.XArgs, shared), checked by msgspec as it
# decodes: a trace that fits them is read alike here; one that does not takes the full path.  The phases as the
# same tagged union: duration events (X) in full, stricter where strictness saves a pass in Python (names are
# strings, thread / process ids ints or strings of at most NAME_MAX_CHARS, ids within int64); instants and metadata
# as the fast path types them (none counts here, but what fails there must fail here); the other phases with their
# fields skipped, as there (a GPU trace's flow events, a third of its events, cost no struct of their own): both
# readers' unions take those from rules.OTHER_PHASE_TYPES.  What it accepts the fast path accepts too, with the
# same values.
_Key = Union[int, Annotated[str, msgspec.Meta(max_length=rules.NAME_MAX_CHARS)]]


_NO_ARGS = rules.XArgs()


class _Event(rules.PhaseEvent, tag="X"):
    name: str = ""
    cat: Any = None
    pid: Optional[_Key] = None
    tid: Optional[_Key] = None
    ts: float = float("nan")
    dur: float = float("nan")
    args: rules.XArgs = _NO_ARGS


class _Doc(msgspec.Struct):
    traceEvents: list[Union[(_Event,) + rules.OTHER_PHASE_TYPES]]
    distributedInfo: Any = None
    deviceProperties: Any = None


_DOC_DEC = msgspec.json.Decoder(_Doc)
_KEY = b'"traceEvents"'
_ARRAY_OPEN = re.compile(rb"\s*:\s*\[")


def _json_bytes(path: str, max_bytes: Optional[int] = None) -> bytes:
    """The trace's JSON: a plain file as it is, a single-member gzip inflated in one piece.  More than
    QUICK_MAX_JSON_BYTES (or ``max_bytes``, the user's limit: the full path says it is exceeded) -> _NotQuick."""
    limit = QUICK_MAX_JSON_BYTES if max_bytes is None else min(QUICK_MAX_JSON_BYTES, max_bytes)
    with open(path, "rb") as fh:
        data = fh.read()
    if data[:2] != b"\x1f\x8b":
        if len(data) > limit:
            raise _NotQuick
        return data
    isize = int.from_bytes(data[-4:], "little")
    if isize > limit:
        raise _NotQuick
    d = _inflate.decompressobj(wbits=31)
    try:
        out = d.decompress(data, isize + 1)
    except Exception:                   # a bad gzip: the full path says what is wrong
        raise _NotQuick from None
    if not d.eof or len(out) != isize or d.unused_data.strip(b"\x00"):
        raise _NotQuick                 # another member follows, or the trailer does not tell the size
    return out


def _decode(data: bytes) -> _Doc:
    """The document, checked as the full decoder checks it (its header before "traceEvents" decodes alone)."""
    idx = data.find(_KEY)
    if idx < 0 or not _ARRAY_OPEN.match(data, idx + len(_KEY)):
        raise _NotQuick
    head = data[:idx].rstrip()
    if head.endswith(b","):
        head = head[:-1]
    if not head.lstrip().startswith(b"{"):
        raise _NotQuick
    try:
        msgspec.json.decode(head + b"}")
        return _DOC_DEC.decode(data)
    except (msgspec.DecodeError, RecursionError):      # (ValidationError is a DecodeError)
        raise _NotQuick from None


# ----------------------------------------------------------------------------------------- one rank
_DEVICE = vocab.DEVICE_EVENT_CATS
_RUNTIME = vocab.RUNTIME_CATS
_KEEP = rules.KEEP_CATS
_TMAX = rules.TIME_MAX_US
_ARGS_PREFIXES = rules.ARGS_NAME_PREFIXES
_ANNOT = frozenset(rules.ANNOTATION_CATS)
_CPU_OP = frozenset(rules.CPU_OP_CATS)
_NOT_COMPUTE_CATS = frozenset(rules.MEMCPY_CATS + rules.MEMSET_CATS + rules.SYNC_CATS)
_COMPUTE_CATS = _DEVICE - _NOT_COMPUTE_CATS
_NOT_COMPUTE_FLAGS = rules.N_MEMCPY | rules.N_MEMSET | rules.N_SYNC
_NAN = float("nan")


class _Row:
    """A row whose collective matters (a comm event, or an op that carries a collective)."""

    __slots__ = ("ts", "end", "dur", "tid", "lane", "on_gpu", "comm", "c10d_call", "gloo", "label", "ext",
                 "corr", "coll", "nbytes", "dtype", "gs", "pg", "seq", "shard", "launch_tid", "launch_ts")


_GET_NAME, _GET_CAT, _GET_TS, _GET_DUR, _GET_ARGS = (
    attrgetter(k) for k in ("name", "cat", "ts", "dur", "args"))
_GET_STREAM, _GET_CORR, _GET_EXT, _GET_COLL, _GET_INN = (
    attrgetter(k) for k in ("stream", "correlation", "ext_id", "coll_name", "in_nelems"))
# what a name can make an event: comm work, or an op that carries a collective (judged per distinct name)
_MAY_CARRY = rules.N_COMM | rules.N_GLOO | rules.N_C10D | rules.N_NCCL_OP


def _select(mask: list, *columns: list) -> list:
    return [list(compress(c, mask)) for c in columns]


def _rank_numbers(path: str, rank: int, max_bytes: Optional[int] = None, defects: Optional[dict] = None
                  ) -> tuple[Optional[RankOverlap], list]:
    """One trace's overlap row (None when it has no event outside runtime calls) and volume rows; ``max_bytes``:
    the largest JSON accepted (a bigger trace goes to the full path, which says so); ``defects``: counts what
    was left out or cut, as the decoder counts it (kind -> events: rules.DEFECTS; [memory] events not read)."""
    defects = {} if defects is None else defects
    doc = _decode(_json_bytes(path, max_bytes))
    meta = {"distributedInfo": doc.distributedInfo} if doc.distributedInfo is not None else {}
    rules.check_distributed_info(meta, defects)
    props = doc.deviceProperties
    events = doc.traceEvents
    del doc

    # --- the kept duration events, as the decoder keeps them (column by column, in C where it can) ----------
    try:
        xs = list(compress(events, map(_KEEP.__contains__, map(_GET_CAT, events))))
    except TypeError:                                # a category that is a list or an object
        raise _NotQuick from None
    del events
    if not xs:
        raise _NotQuick                              # no duration event: the full path says so (or reads memory)
    cats = list(map(_GET_CAT, xs))
    ts = list(map(_GET_TS, xs))
    dur = list(map(_GET_DUR, xs))
    # implausible times left out (the sums are NaN / inf when one is NaN / inf)
    if not (isfinite(sum(ts)) and isfinite(sum(dur)) and -_TMAX <= min(ts) and max(ts) <= _TMAX
            and 0 <= min(dur) and max(dur) <= _TMAX):
        ok = [t == t and d == d and -_TMAX <= t <= _TMAX and 0 <= d <= _TMAX for t, d in zip(ts, dur)]
        missing = sum(t != t or d != d for t, d in zip(ts, dur))
        negative = sum(t == t and d == d and -_TMAX <= t <= _TMAX and d < 0 for t, d in zip(ts, dur))
        for kind, k in (("time_missing", missing), ("time_beyond", ok.count(False) - missing - negative),
                        ("negative_dur", negative)):
            if k:
                defects[kind] = defects.get(kind, 0) + k
        xs, cats, ts, dur = _select(ok, xs, cats, ts, dur)
        if not xs:
            raise _NotQuick
    # exact duplicates of an earlier event (every column the decoder compares) left out: only events that share
    # their start (and External id) with another can be one
    if len(set(ts)) < len(ts):
        ok = _first_of_duplicates(xs, cats, ts, dur)
        if ok is not None:
            defects["duplicate"] = defects.get("duplicate", 0) + ok.count(False)
            xs, cats, ts, dur = _select(ok, xs, cats, ts, dur)
    n = len(xs)
    names = list(map(_GET_NAME, xs))
    distinct = dict.fromkeys(names)
    if max(map(len, distinct)) <= rules.NAME_MAX_CHARS:
        labels = dict(zip(distinct, distinct))        # (names as they are: none is cut)
    else:
        labels = {x: rules.cut_text(x) for x in distinct}
        defects["long_name"] = defects.get("long_name", 0) + sum(len(x) > rules.NAME_MAX_CHARS for x in names)
    if len(set(labels.values())) != len(labels):
        raise _NotQuick                              # two names that read alike: the decoder numbers them (#1)
    flag_of = dict(zip(labels, rules.per_name(rules.name_flags_of, list(labels.values()))))

    # --- device type: only "cpu" changes what compute is ----------------------------------------------------
    is_rt = list(map(_RUNTIME.__contains__, cats))
    is_dev = list(map(_DEVICE.__contains__, cats))
    dev_idx = list(compress(range(n), is_dev))
    dev_args = list(map(_GET_ARGS, compress(xs, is_dev)))
    dev_streams = list(map(_GET_STREAM, dev_args))
    carries = {x: bool(f & _MAY_CARRY) or x.startswith(_ARGS_PREFIXES) for x, f in flag_of.items()}
    cand = list(compress(range(n), map(carries.__getitem__, names)))     # may be comm work or carry a collective
    device_cpu = max(dev_streams, default=-1) < 0 and not any(
        xs[i].args.stream >= 0 for i in cand if names[i].startswith(_ARGS_PREFIXES))
    if not device_cpu:
        rt_names = {labels[x] for x in set(compress(names, is_rt))}
        devs = [str(d.get("name", "")) for d in props if isinstance(d, dict)] if isinstance(props, list) else []
        device_cpu = vocab.device_type(set(cats), rt_names, devs) == vocab.DEVICE_CPU
    if is_rt.count(True) == n:
        return None, []                              # runtime calls only: no row in the events frame

    # --- classify (classify.classify_arrays, on the events that matter) ----------------------------------------
    rt_idx = list(compress(range(n), is_rt))
    rt_corr = list(map(_GET_CORR, map(_GET_ARGS, compress(xs, is_rt))))
    launch = dict(zip(reversed(rt_corr), reversed(rt_idx)))     # correlation -> its first runtime call
    # compute kernels: on a stream, a name that is no comm / memcpy / memset / sync, a category that is none
    # of those either (bools combined by min: all true)
    not_compute = _NOT_COMPUTE_FLAGS | rules.N_COMM
    computes = {x: not f & not_compute for x, f in flag_of.items()}
    kernels = list(compress(dev_idx, map(min, map((-1).__lt__, dev_streams),
                                         map(computes.__getitem__, compress(names, is_dev)),
                                         map(_COMPUTE_CATS.__contains__, compress(cats, is_dev)))))
    starts = list(map(ts.__getitem__, kernels))
    compute = list(zip(starts, map(add, starts, map(dur.__getitem__, kernels))))
    cand = set(cand)
    cand.update(compress(dev_idx, map(max, map(is_not, map(_GET_COLL, dev_args), repeat(None)),
                                      map(is_not, map(_GET_INN, dev_args), repeat(None)))))    # with comm args
    rows = []
    for i in sorted(cand):
        if not is_rt[i]:
            r = _row(xs[i], cats[i], flag_of[names[i]], labels)
            if r is not None:
                rows.append(r)
    for r in rows:
        if r.on_gpu and r.corr >= 0:
            j = launch.get(r.corr)
            if j is not None:
                r.launch_tid, r.launch_ts = _thread(xs[j].tid), ts[j]
    _type_from_launching_op(rows)
    _fill_from_cpu_side(rows)
    for r in rows:
        if r.on_gpu and r.comm and r.coll is None:
            r.coll = rules.unknown_type_label(r.label)
    if any(r.gloo for r in rows):
        _pair_gloo(rows)
        _gloo_group_sizes(rows, meta)
    default_gs = None
    comm_rows = [r for r in rows if r.comm]
    for r in comm_rows:
        if r.gs != r.gs:
            if default_gs is None:
                default_gs = rules.default_group_size(meta.get("distributedInfo") or {})
            r.gs = default_gs
        if r.shard:
            r.nbytes = r.nbytes * r.gs
    if device_cpu:
        c10d = rules.N_C10D
        ops = [(_thread(xs[i].tid), ts[i], ts[i] + dur[i], not flag_of[names[i]] & c10d)
               for i in compress(range(n), map(_CPU_OP.__contains__, cats))]
        compute += _cpu_compute(ops, {r.tid for r in rows if r.gloo})
    return _overlap_row(rank, compute, comm_rows), _volume_rows(rank, comm_rows)


def _row(e, c: str, f: int, labels: dict) -> Optional[_Row]:
    """The row of one event when it is comm work or carries a collective (classify's kind, collective and the
    sizes of its comm args), else None."""
    a, name = e.args, e.name
    device = c in _DEVICE
    on_gpu = device and a.stream >= 0
    annot = c in _ANNOT
    comm = gloo = False
    if on_gpu:
        comm = bool(f & rules.N_COMM)
    elif annot and f & rules.N_GLOO:
        comm = gloo = True
    label = labels[name]
    coll = rules.collective_of_name(label) if comm or f & rules.N_C10D or (annot and f & rules.N_NCCL_OP) else None
    full = device or name.startswith(_ARGS_PREFIXES)
    info = None
    if full and (not device or a.coll_name is not None or a.in_nelems is not None):
        info = rules.comm_row_info(label, a.coll_name, a.in_nelems, a.out_nelems, a.group_size, a.dtype,
                                   a.pg, a.seq, bytes(a.input_dims), bytes(a.input_type))
        if info[0] is not None:
            coll = info[0]
    if not comm and coll is None:
        return None
    r = _Row()
    r.ts, r.dur, r.tid, r.on_gpu, r.comm, r.gloo = e.ts, e.dur, _thread(e.tid), on_gpu, comm, gloo
    r.end = e.ts + e.dur
    r.lane = f"thread:{e.tid}"
    r.c10d_call = bool(f & rules.N_C10D) and c in _CPU_OP
    r.label, r.ext, r.corr, r.coll = label, (a.ext_id if full else -1), a.correlation, coll
    if info is None:
        r.nbytes, r.dtype, r.gs, r.pg, r.seq, r.shard = _NAN, None, _NAN, None, _NAN, False
    else:
        _, r.nbytes, r.dtype, r.gs, r.pg, r.seq, r.shard = info
    r.launch_tid = r.launch_ts = None
    return r


def _thread(tid):
    """A thread id as the decoder tells threads apart (a missing one reads "None", as decode._as_key makes it)."""
    return "None" if tid is None else tid


def _first_of_duplicates(xs: list, cats: list, ts: list, dur: list) -> Optional[list]:
    """Per event, False when it equals an earlier one on every column the decoder compares (ids as it keeps them:
    stream / External id on device events and comm ops, correlation also on runtime calls, the External id as
    the args' key); None when there is no such event.  Only events that share their start and External id with
    another are compared."""
    first = list(zip(ts, map(_GET_EXT, map(_GET_ARGS, xs))))
    count = Counter(first)
    if len(count) == len(first):
        return None
    seen = set()
    keep = None
    for i in compress(range(len(first)), map((1).__lt__, map(count.__getitem__, first))):
        e, c = xs[i], cats[i]
        a = e.args
        full = c in _DEVICE or e.name.startswith(_ARGS_PREFIXES)
        key = (e.ts, e.dur, a.ext_id, e.name, e.tid, e.pid, c, a.stream if full else -1,
               a.correlation if full or c in _RUNTIME else -1, a.ext_id if full else -1)
        if key in seen:
            if keep is None:
                keep = [True] * len(ts)
            keep[i] = False
        else:
            seen.add(key)
    return keep


def _innermost(iv: list, q: list) -> list:
    """intervals.innermost in plain Python (the same depth-by-depth search, so the same answers on intervals
    that are not properly nested): per query time, the index in ``iv`` ((start, end) pairs) of the innermost
    interval with start <= t < end, or -1."""
    res = [-1] * len(q)
    if not iv or not q:
        return res
    order = sorted(range(len(iv)), key=lambda i: (iv[i][0], -iv[i][1]))
    s = [iv[i][0] for i in order]
    e = [iv[i][1] for i in order]
    ends_sorted = sorted(e)
    depth = [max(j - bisect_right(ends_sorted, s[j]), 0) for j in range(len(s))]
    by_depth: dict = {}
    for j, d in enumerate(depth):
        by_depth.setdefault(d, []).append(j)
    for d in sorted(by_depth):
        sel = by_depth[d]
        ds = [s[j] for j in sel]
        for qi, t in enumerate(q):
            k = bisect_right(ds, t) - 1
            if k >= 0:
                j = sel[k]
                if s[j] <= t < e[j]:
                    res[qi] = order[j]
    return res


def _type_from_launching_op(rows: list) -> None:
    """classify._type_from_launching_op: a comm kernel takes the collective (and process group, seq, group
    size) of the innermost op with a collective around its launch on the launching thread."""
    kernels = [r for r in rows if r.on_gpu and r.comm and r.launch_tid is not None]
    ops = [r for r in rows if not r.on_gpu and not r.comm and r.coll is not None]
    if not kernels or not ops:
        return
    ops_of: dict = {}
    for r in ops:
        ops_of.setdefault(r.tid, []).append(r)
    by_thread: dict = {}
    for r in kernels:
        by_thread.setdefault(r.launch_tid, []).append(r)
    for t, ks in by_thread.items():
        sel = ops_of.get(t)
        if not sel:
            continue
        found = _innermost([(o.ts, o.end) for o in sel], [k.launch_ts for k in ks])
        for k, j in zip(ks, found):
            if j < 0:
                continue
            src = sel[j]
            k.coll = src.coll
            if src.pg is not None:
                k.pg = src.pg
            if src.seq == src.seq:
                k.seq = src.seq
            if src.gs == src.gs:
                k.gs = src.gs


def _fill_from_cpu_side(rows: list) -> None:
    """classify._fill_from_cpu_side: a comm kernel's missing size, group, seq, dtype, pg and collective from the
    last CPU op with a collective and the same External id."""
    last: dict = {}
    for r in rows:
        if not r.on_gpu and r.ext >= 0 and r.coll is not None:
            last[r.ext] = r
    if not last:
        return
    for r in rows:
        if r.on_gpu and r.comm and r.ext >= 0:
            src = last.get(r.ext)
            if src is None:
                continue
            if r.nbytes != r.nbytes:
                r.nbytes = src.nbytes
            if r.gs != r.gs:
                r.gs = src.gs
            if r.seq != r.seq:
                r.seq = src.seq
            if r.dtype is None:
                r.dtype = src.dtype
            if r.pg is None:
                r.pg = src.pg
            if r.coll is None:
                r.coll = src.coll


def _in_time_order(items: list, key) -> tuple[list, list]:
    """Items sorted by start time (stable) and each one's rank in time within its key (0, 1, ...)."""
    items = sorted(items, key=lambda r: r.ts)
    seen: dict = {}
    ordinal = []
    for r in items:
        k = key(r)
        ordinal.append(seen.get(k, 0))
        seen[k] = seen.get(k, 0) + 1
    return items, ordinal


def _pair_gloo(rows: list) -> None:
    """classify._pair_gloo: the k-th gloo work of an op type (in time) takes the values of the k-th c10d call
    that runs as that op, with the shift (0, 1, 2) that pairs the most work with a call starting no later
    than it (+1 µs)."""
    as_of = rules.GLOO_AS.get
    calls, _ = _in_time_order([r for r in rows if r.c10d_call and r.coll is not None],
                                     lambda r: as_of(r.coll, r.coll))
    as_by_name: dict = {}
    work = []
    for r in rows:
        if r.gloo:
            g = as_by_name.setdefault(r.label, vocab.collective_of(str(r.label)))
            if g is not None:
                work.append(r)
    work, work_ord = _in_time_order(work, lambda r: as_by_name[r.label])
    pairs = []
    for g in dict.fromkeys(as_by_name[r.label] for r in work):
        w = [i for i, r in enumerate(work) if as_by_name[r.label] == g]
        cg = [c for c in calls if as_of(c.coll, c.coll) == g]
        best: list = []
        for shift in (0, 1, 2):
            hits = []
            for i in w:
                k = work_ord[i] - shift
                if 0 <= k < len(cg) and cg[k].ts <= work[i].ts + 1.0:
                    hits.append((work[i], cg[k]))
            if len(hits) > len(best):
                best = hits
        pairs += best
    for dst, src in pairs:
        if src.coll is not None:
            dst.coll = src.coll
        if src.dtype is not None:
            dst.dtype = src.dtype
        if src.pg is not None:
            dst.pg = src.pg
        if src.nbytes == src.nbytes:
            dst.nbytes = src.nbytes
            dst.shard = False           # the call gave the whole array
        if src.gs == src.gs:
            dst.gs = src.gs
        if src.seq == src.seq:
            dst.seq = src.seq


def _gloo_group_sizes(rows: list, meta: dict) -> None:
    """classify._gloo_group_sizes: gloo work without a group size takes the most frequent known size of its
    thread (the smallest on ties), else rules.fallback_group_size; the only process group's name as pg."""
    sizes_of: dict = {}
    for r in rows:
        if r.gloo and r.gs == r.gs:
            counts = sizes_of.setdefault(r.lane, {})
            counts[r.gs] = counts.get(r.gs, 0) + 1
    known = {lane: min(c, key=lambda v: (-c[v], v)) for lane, c in sizes_of.items()}
    other_sizes, only_pg = rules.other_group_sizes(meta)
    fallback = rules.fallback_group_size(other_sizes, known.values())
    for r in rows:
        if r.gloo:
            if r.gs != r.gs:
                r.gs = known.get(r.lane, fallback)
            if only_pg is not None and r.pg is None:
                r.pg = only_pg


def _cpu_compute(cpu_ops: list, comm_threads: set) -> list:
    """CPU compute (classify: leaf cpu_ops on threads that run no gloo work, not comm calls): an op is a leaf
    when the next op of its thread, in (start, -end) order, starts at or after its end."""
    out = []
    by_thread: dict = {}
    for op in cpu_ops:
        by_thread.setdefault(op[0], []).append(op)
    for t, ops in by_thread.items():
        if t in comm_threads:
            continue
        ops.sort(key=lambda op: (op[1], -op[2]))
        last = len(ops) - 1
        for j, (_, s, e, candidate) in enumerate(ops):
            if candidate and (j == last or ops[j + 1][1] >= e):
                out.append((s, e))
    return out


# ----------------------------------------------------------------------------------------- the numbers
def _union(iv: list) -> list:
    """intervals.union: disjoint sorted (start, end) of intervals (those with end > start); touching ones merge."""
    out: list = []
    cur_s = cur_e = None
    for s, e in sorted(iv):
        if e <= s:
            continue
        if cur_e is not None and s <= cur_e:
            if e > cur_e:
                cur_e = e
        else:
            if cur_e is not None:
                out.append((cur_s, cur_e))
            cur_s, cur_e = s, e
    if cur_e is not None:
        out.append((cur_s, cur_e))
    return out


def _total(merged: list) -> float:
    from math import fsum

    return fsum(e - s for s, e in merged)


def _overlap_length(a: list, b: list) -> float:
    """Length of the intersection of two disjoint sorted interval lists (µs)."""
    from math import fsum

    i = j = 0
    na, nb = len(a), len(b)
    parts = []
    while i < na and j < nb:
        (a0, a1), (b0, b1) = a[i], b[j]
        s = a0 if a0 > b0 else b0
        e = a1 if a1 < b1 else b1
        if e > s:
            parts.append(e - s)
        if a1 < b1:
            i += 1
        else:
            j += 1
    return fsum(parts)


def _overlap_row(rank: int, compute: list, comm_rows: list) -> RankOverlap:
    """overlap.overall_overlap of one rank."""
    comp = _union(compute)
    comp_us = _total(comp)
    if not comm_rows:
        return RankOverlap(rank, comp_us, 0.0, 0.0, 0.0, None)
    comm = _union([(r.ts, r.end) for r in comm_rows])
    comm_us = _total(comm)
    ov = _overlap_length(comm, comp)
    return RankOverlap(rank, comp_us, comm_us, ov, comm_us - ov, 100.0 * ov / comm_us if comm_us > 0 else None)


def _volume_rows(rank: int, comm_rows: list) -> list[CollectiveVolume]:
    """volume.collective_volume of one rank: per collective (sorted, None last)."""
    from math import fsum, isfinite

    groups: dict = {}
    for r in comm_rows:
        groups.setdefault(r.coll, []).append(r)
    out = []
    for coll in sorted(groups, key=lambda c: (c is None, c or "")):
        rs = groups[coll]
        known = [r for r in rs if r.nbytes == r.nbytes]
        total = fsum(r.nbytes for r in known) if known else None
        known_t = fsum(r.dur for r in known)
        bus, bus_t = [], []
        for r in known:
            b = r.nbytes * vocab.bus_factor(coll, r.gs)
            if isfinite(b):
                bus.append(b)
                bus_t.append(r.dur)
        bus_t_sum = fsum(bus_t)
        out.append(CollectiveVolume(
            rank=rank, collective=coll, count=len(rs), bytes=total, time_us=fsum(r.dur for r in rs),
            algbw_gbps=total / (known_t * 1e3) if known_t > 0 else None,
            busbw_gbps=fsum(bus) / (bus_t_sum * 1e3) if bus_t_sum > 0 else None))
    return out


# ----------------------------------------------------------------------------------------- the input
def _full_path_rank(trace_path: str, rank: int, max_bytes: int | None):
    """One rank read by the full path (numpy, pandas): ('ok', overlap row or None, volume rows, warnings) or
    ('error', why)."""
    from fsdpprof.analyze.comm import overlap, volume
    from fsdpprof.analyze.run import parse_trace

    status, val = parse_trace(trace_path, rank, False, max_bytes)
    if status != "ok":
        return "error", val
    ev = val.events
    o = overlap.overall_overlap(ev)
    ov = None
    for x in o.itertuples(index=False):
        ov = RankOverlap(int(x.rank), float(x.compute_us), float(x.comm_us), float(x.overlapped_comm_us),
                         float(x.exposed_comm_us), _num(float(x.comp_comm_overlap_pct)))
    vol = []
    for x in volume.collective_volume(ev).itertuples(index=False):
        coll = x.collective if isinstance(x.collective, str) else None
        vol.append(CollectiveVolume(int(x.rank), coll, int(x.count), _num(float(x.bytes)), float(x.time_us),
                                    _num(float(x.algbw_gbps)), _num(float(x.busbw_gbps))))
    return "ok", ov, vol, list(val.warnings)


class _RankRead(msgspec.Struct, array_like=True):
    """What reading one rank by the quick path gave (sent back from a forked reader as msgpack):
    ``ok`` False when the full path must read it."""

    rank: int
    ok: bool
    overlap: Optional[RankOverlap] = None
    volume: list[CollectiveVolume] = []
    defects: dict = {}


_READS_ENC = msgspec.msgpack.Encoder()
_READS_DEC = msgspec.msgpack.Decoder(list[_RankRead])
PARALLEL_MIN_BYTES = 4 << 20     # read ranks in forked processes too (auto mode) when their traces hold this much JSON


def _read_ranks(jobs: list, max_bytes: Optional[int]) -> list:
    """``jobs``: (rank, trace path) -> one :class:`_RankRead` each, in this process."""
    out = []
    for r, path in jobs:
        defects: dict = {}
        try:
            with gc_paused():
                ov, vol = _rank_numbers(path, r, max_bytes, defects)
            out.append(_RankRead(r, True, ov, vol, defects))
        except Exception:            # _NotQuick, unreadable, or anything the quick reader did not foresee
            out.append(_RankRead(r, False))
    return out


def _no_other_thread() -> bool:
    """Does this process run Python code on one thread only?  (Forking a process with threads is unsafe.)"""
    import sys

    threading = sys.modules.get("threading")      # (not imported: no other thread runs)
    return threading is None or threading.active_count() == 1


def _shares(jobs: list, sizes: list, n: int) -> list[list]:
    """``jobs`` in ``n`` shares of about equal JSON bytes (largest first, each to the lightest share)."""
    shares, load = [[] for _ in range(n)], [0] * n
    for size, job in sorted(zip(sizes, jobs), key=lambda x: -x[0]):
        k = load.index(min(load))
        shares[k].append(job)
        load[k] += size
    return [sorted(s) for s in shares if s]


def _fork_reader(jobs: list, max_bytes: Optional[int]):
    """(pid, read end of a pipe) of a forked process that reads ``jobs`` and writes their reads as msgpack."""
    r_fd, w_fd = os.pipe()
    pid = os.fork()
    if pid == 0:                     # the child: read, write, leave at once (no atexit, no buffered output)
        code = 1
        try:
            os.close(r_fd)
            data = _READS_ENC.encode(_read_ranks(jobs, max_bytes))
            with os.fdopen(w_fd, "wb") as fh:
                fh.write(data)
            code = 0
        finally:
            os._exit(code)
    os.close(w_fd)
    return pid, r_fd


def _collect(pid: int, r_fd: int) -> list:
    """A forked reader's reads ([] when it failed: its ranks are read again here)."""
    status = 0
    try:
        with os.fdopen(r_fd, "rb") as fh:
            data = fh.read()
    finally:
        try:
            _, status = os.waitpid(pid, 0)
        except ChildProcessError:    # reaped already (SIGCHLD ignored): the data says whether it finished
            pass
    if status != 0:
        return []
    try:
        return _READS_DEC.decode(data)
    except msgspec.DecodeError:
        return []


def _read_all(jobs: list, max_bytes: Optional[int], workers: Optional[int]) -> dict:
    """rank -> :class:`_RankRead` for ``jobs`` ((rank, trace path)): in this process and, where it pays off
    (``workers`` None: at least PARALLEL_MIN_BYTES of JSON, more than one rank, usable cores, no other thread
    running, fork available), in forked processes as well; a rank a forked reader did not return is read here."""
    from fsdpprof.analyze.run import inflated_size, max_workers, usable_cores

    n, sizes = 1, []
    if len(jobs) > 1 and hasattr(os, "fork") and _no_other_thread() and workers != 1:
        sizes = [inflated_size(path) for _, path in jobs]
        if workers is not None:
            n = max_workers(workers, len(jobs))
        elif sum(sizes) >= PARALLEL_MIN_BYTES:
            n = min(len(jobs), usable_cores())
    if n <= 1:
        return {x.rank: x for x in _read_ranks(jobs, max_bytes)}
    own, *others = _shares(jobs, sizes, n)
    readers, left, reads = [], [], {}
    try:
        for share in others:
            try:
                readers.append((_fork_reader(share, max_bytes), share))
            except OSError:          # no process to be had: read it here
                left += share
        reads.update((x.rank, x) for x in _read_ranks(own, max_bytes))
    finally:                         # (also when this process's reading is interrupted: no reader left behind)
        for (pid, r_fd), share in readers:
            got = {x.rank: x for x in _collect(pid, r_fd)}
            for r, path in share:
                if r in got:
                    reads[r] = got[r]
                else:                # the reader failed: read it here
                    left.append((r, path))
    reads.update((x.rank, x) for x in _read_ranks(left, max_bytes))
    return reads


def quick_overlap(path, *, max_trace_bytes: int | None = None, workers: int | None = None) -> QuickResult:
    """Per rank, overall overlap of communication with compute and exposed communication (µs), and per rank
    and collective the volume (count, bytes, time µs, algbw / busbw GB/s) of a run directory, a folder of
    traces or one trace: the numbers of ``overall_overlap`` and ``collective_volume`` on
    ``load_run(path).events()``, without numpy or pandas (see the module docstring).  ``max_trace_bytes``:
    largest JSON accepted once decompressed (as load_run); ``workers``: processes reading ranks (None: more
    than one only for traces that hold PARALLEL_MIN_BYTES of JSON or more; 1: this process only).  Bad input
    raises :class:`fsdpprof.errors.UserError` (one line); a rank whose trace is bad is listed in ``missing``."""
    from fsdpprof.analyze.run import check_workers, find_files

    check_workers(workers)
    run = find_files(path)                   # (what load_run(path, lazy=True) finds, without its dataclasses)
    with unexpected_as_user_error(f"{os.fspath(path)}"):
        result = QuickResult(path=run.path, overlap=[], volume=[], missing=dict(run.missing),
                             warnings=list(run.warnings))
        ranks = [(r, rd) for r, rd in sorted(run.ranks.items()) if rd.trace_path]
        if not ranks:
            raise UserError(f"{run.path} holds no profiler trace (only CUDA snapshots or inventories): overlap and "
                            f"collective volume come from traces; give a trace file, a folder of traces or a run "
                            f"directory recorded with its trace")
        reads = _read_all([(r, rd.trace_path) for r, rd in ranks], max_trace_bytes, workers)
        for r, rd in ranks:
            read = reads[r]
            if read.ok:
                ov, vol = read.overlap, read.volume
                result.warnings += rules.defect_warnings(rd.trace_path, read.defects)
            else:                        # the full path reads that rank (its numbers, its one-line errors)
                got = _full_path_rank(rd.trace_path, r, max_trace_bytes)
                if got[0] != "ok":
                    result.missing[rd.label] = got[1]
                    continue
                _, ov, vol, warnings = got
                result.warnings += warnings
                result.full_path_ranks.append(r)
            if ov is not None:
                result.overlap.append(ov)
            result.volume += vol
        if not result.overlap and result.missing:
            first = next(iter(result.missing.values()))
            raise UserError(first if len(result.missing) == 1 else f"no usable trace in {run.path}: {first}")
        return result
