"""Typed, streaming decoder for PyTorch profiler (kineto) chrome traces: :func:`decode_trace` reads one trace
file (gzip or plain) in blocks, cuts ``traceEvents`` at event boundaries and turns each slice into numpy columns
at once (memory: about one slice plus the kept columns).  A typed fast path decodes the events a profiler
writes; a trace that does not fit its types takes the lenient path.  Times in µs (``ts_us``, ``dur_us``).
"""
from __future__ import annotations

import array
import os
import re
import sys
import zlib
from dataclasses import dataclass, field
from operator import attrgetter
from itertools import compress
from typing import Annotated, Any, ClassVar, Generic, TypeVar, Union

import msgspec
import numpy as np
import pandas as pd

try:                                    # ISA-L's inflate: same API and stream format as zlib, ~3x faster
    from isal import isal_zlib as _inflate_mod
except ImportError:                     # pragma: no cover - isal is a dependency; zlib is the fallback
    _inflate_mod = zlib
_INFLATE_ERRORS = (zlib.error, _inflate_mod.error)

from fsdpprof.analyze import model
from fsdpprof.analyze.load.frames import frame_of
from fsdpprof.analyze.load.memory_budget import default_max_trace_bytes, inflated_size, memory_warning
from fsdpprof.analyze.trace.names import per_name
from fsdpprof.errors import UserError

CHUNK_BYTES = 256 << 10         # decode the event array in slices of about this many bytes (faster than one piece)
READ_BYTES = 256 << 10          # bytes per read / inflated block
PROGRESS_MIN_BYTES = 64 << 20   # show a progress bar (auto mode) for files at least this big
SYNC_GZ_BYTES = 8 << 20         # bigger gzip files are inflated a few blocks ahead in a background thread
MEMORY_BYTES_MAX = 1 << 44      # a [memory] event of more than 16 TiB is not an allocation
NAME_MAX_CHARS = 4096           # longer names are cut (real kernel names reach 1,817 characters)
TIME_MAX_US = float(2 ** 53)    # |ts| and dur beyond this (285 years in µs) are not times
RANK_MAX = 1 << 24              # ranks / world sizes / group sizes beyond this are not real

# Duration-event categories we keep; everything else (python_function, flows, overhead, ...) is skipped.
KEEP_CATS = frozenset({"cpu_op", "user_annotation", "gpu_user_annotation"}) | model.DEVICE_EVENT_CATS | model.RUNTIME_CATS
# phases whose fields the fast path skips; it reads X, i, I and M, and any other phase sends a trace to the lenient path
SKIPPED_PHASES = tuple("BECbnestfPONDRcp()")


# --------------------------------------------------------------------------- what an event holds
Id64 = Annotated[int, msgspec.Meta(le=(1 << 63) - 1)]   # (a bigger id fails the fast path: the lenient one keeps -1)


class XArgs(msgspec.Struct, gc=False, frozen=True):
    """The args fields a duration event's columns use (the fast path decodes them inline)."""

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
    """Every args field we use: XArgs plus the [memory] and thread-name fields."""

    addr: Any = msgspec.field(default=None, name="Addr")
    nbytes: Any = msgspec.field(default=None, name="Bytes")
    total_alloc: Any = msgspec.field(default=None, name="Total Allocated")
    total_reserved: Any = msgspec.field(default=None, name="Total Reserved")
    device_type: Any = msgspec.field(default=None, name="Device Type")
    device_id: Any = msgspec.field(default=None, name="Device Id")
    name: Any = None


def _lenient(typed: type, name: str, only: tuple = ()) -> type:
    """``typed``'s fields (those in ``only``, else all), each taking any JSON value: the lenient path's args."""
    return msgspec.defstruct(name, [(f.name, msgspec.Raw if f.type is msgspec.Raw else Any,
                                     msgspec.field(default=f.default, name=f.encode_name))
                                    for f in msgspec.structs.fields(typed) if not only or f.name in only])


Args = _lenient(FastArgs, "Args")                             # decoded lazily, only for the events that need them
LinkArgs = _lenient(XArgs, "LinkArgs", only=("correlation",))  # what a runtime call needs


class Event(msgspec.Struct):
    """An event of any phase as the lenient path reads it (args kept as raw JSON)."""

    ph: Any = None
    name: Any = ""
    cat: Any = None
    pid: Any = None
    tid: Any = None
    ts: Any = None
    dur: Any = None
    args: msgspec.Raw = msgspec.Raw(b"null")


class PhaseEvent(msgspec.Struct, gc=False, tag_field="ph"):
    """The fast path's events, a union tagged by phase ``ph``; times in µs, NaN when absent."""

    cat: ClassVar[Any] = None        # only duration events decode their category


OTHER_CAT = object()                # the "category" of the instant and metadata events the fast path reads
_NO_X_ARGS = XArgs()


class FastEvent(PhaseEvent, tag="X"):
    name: Any = ""
    cat: Any = None
    pid: Any = None
    tid: Any = None
    ts: float = float("nan")
    dur: float = float("nan")
    args: XArgs = _NO_X_ARGS        # ("args": null fails validation: the lenient path takes it)


class FastInstant(PhaseEvent, tag="i"):
    cat: ClassVar[Any] = OTHER_CAT
    name: Any = ""
    pid: Any = None
    ts: float = float("nan")
    args: FastArgs | None = None


class FastInstantOld(FastInstant, tag="I"):
    pass


class FastMeta(PhaseEvent, tag="M"):
    cat: ClassVar[Any] = OTHER_CAT
    name: Any = ""
    pid: Any = None
    tid: Any = None
    args: FastArgs | None = None


class FastSkip(PhaseEvent):
    """A phase the fast path does not use: its fields skipped."""


_FAST_UNION = Union[(FastEvent, FastInstant, FastInstantOld, FastMeta) + tuple(
    type(f"FastSkip{ord(ph)}", (FastSkip,), {}, tag=ph) for ph in SKIPPED_PHASES)]
_EVENT = TypeVar("_EVENT")


class TailDoc(msgspec.Struct, Generic[_EVENT]):
    """The document from ``traceEvents`` on: its events and the keys we keep."""

    traceEvents: list[_EVENT]
    schemaVersion: Any = None
    distributedInfo: Any = None
    deviceProperties: Any = None
    baseTimeNanoseconds: Any = None
    displayTimeUnit: Any = None
    traceName: Any = None


# kept categories in a fixed order (a category's code is its position); _CAT_KEEP_CODE: category -> code + 1
_KEEP_ORDER = tuple(sorted(KEEP_CATS))
_CAT_KEEP_CODE = {**{c: i + 1 for i, c in enumerate(_KEEP_ORDER)}, OTHER_CAT: 0}
_IS_OTHER = frozenset({0})
_CAT_GPU = np.array([c in model.DEVICE_EVENT_CATS for c in _KEEP_ORDER], dtype=bool)
_CAT_RT = np.array([c in model.RUNTIME_CATS for c in _KEEP_ORDER], dtype=bool)

_CHUNK_DEC = msgspec.json.Decoder(list[Event])
_TAIL_DEC = msgspec.json.Decoder(TailDoc[Event])
_FAST_CHUNK_DEC = msgspec.json.Decoder(list[_FAST_UNION])
_FAST_TAIL_DEC = msgspec.json.Decoder(TailDoc[_FAST_UNION])
_ARGS_DEC = msgspec.json.Decoder(Args | None)
_LINK_DEC = msgspec.json.Decoder(LinkArgs | None)
_ARGS_LIST_DEC = msgspec.json.Decoder(list[Args | None])
_LINK_LIST_DEC = msgspec.json.Decoder(list[LinkArgs | None])
_NO_ARGS = Args()
# the last event boundary ('}', ',', '{' with blanks between) of a slice: '.*' jumps to the end and backtracks, in C
_LAST_SEP_RE = re.compile(rb".*\}\s*,\s*\{", re.S)
_KEY = b'"traceEvents"'
_HEADER_MAX_BYTES = 256 << 20     # the "traceEvents" key must come within this many bytes
_NOT_BLANK = re.compile(rb"[^ \t\n\r\x0b\x0c]")          # (what bytes.strip leaves)
_VALUE_START = frozenset(b'{["-0123456789tfn')    # the bytes a JSON value can start with


# --------------------------------------------------------------------------- values as shown, defects counted
def cut_text(text: str) -> str:
    """``text`` cut to NAME_MAX_CHARS characters with a marker saying how long it was."""
    if len(text) <= NAME_MAX_CHARS:
        return text
    return f"{text[:NAME_MAX_CHARS]}... [cut: {len(text):,} characters]"


def as_text(value) -> str:
    """A trace value as text: a string as it is, anything else as its JSON text; cut to NAME_MAX_CHARS."""
    if type(value) is not str:
        try:
            value = msgspec.json.encode(value).decode()
        except (TypeError, ValueError, OverflowError, RecursionError, msgspec.EncodeError):
            value = f"<{type(value).__name__}>"
    return cut_text(value)


def unique_labels(labels: list[str]) -> list[str]:
    """Labels made unique (a repeat gets ``#1``, ``#2`` ...): distinct raw keys (1 and "1") can read alike."""
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


def _count(defects: dict, kind: str, n: int = 1) -> None:
    if n:
        defects[kind] = defects.get(kind, 0) + n


def check_distributed_info(meta: dict, defects: dict) -> None:
    """Leave out distributedInfo's rank / world_size and process groups' pg_size that are not plausible
    counts, in place; counted in ``defects``."""
    dist = meta.get("distributedInfo")
    if dist is None:
        return
    if not isinstance(dist, dict):
        meta.pop("distributedInfo")
        return _count(defects, "dist_info")
    dist = meta["distributedInfo"] = dict(dist)
    bad = 0
    for key, low in (("rank", 0), ("world_size", 1)):
        if dist.get(key) is not None and not plausible_count(dist[key], low):
            del dist[key]
            bad += 1
    if isinstance(dist.get("rank"), int) and isinstance(dist.get("world_size"), int) and dist["rank"] >= dist["world_size"]:
        del dist["rank"]
        bad += 1
    cfg = dist.get("pg_config")
    if cfg is not None:
        good = [g for g in cfg if isinstance(g, dict)] if isinstance(cfg, list) else []
        for g in good:
            if g.get("pg_size") is not None and not plausible_count(g["pg_size"]):
                del g["pg_size"]
                bad += 1
        bad += not isinstance(cfg, list) or len(good) != len(cfg)
        dist["pg_config"] = good
    _count(defects, "dist_info", bad)


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
_LEFT_OUT = ("time_missing", "time_beyond", "negative_dur", "duplicate", "duplicate_memory", "bad_memory")


def defect_warnings(path: str, defects: dict) -> list[str]:
    """One warning line per kind of defect found while decoding ``path``."""
    return [f"trace {path}: " + DEFECTS[k].format(n=defects[k], max=NAME_MAX_CHARS)
            for k in DEFECTS if defects.get(k)]


COMM_ARG_COLUMNS = ["idx", "coll_name", "in_nelems", "out_nelems", "group_size", "dtype", "pg", "seq",
                    "input_dims", "input_type"]


@dataclass
class RawTrace:
    """Decoded, unclassified trace: one row per kept duration event, as numpy columns.

    ``cols``: name/cat (int32/int8 codes into the lists ``name_cats``/``cat_cats``), tid_code/pid (int32 codes
    into ``tid_values``/``pid_values``, the original values), ts_us/dur_us (float64, µs), stream/correlation/
    ext_id (int64, -1 absent): 53 bytes a row (docs/architecture.md).  ``comm_rows``: one tuple (COMM_ARG_COLUMNS; idx is the row) per event with comm args."""

    path: str
    cols: dict
    comm_rows: list
    memory_events: pd.DataFrame
    meta: dict
    thread_names: dict = field(default_factory=dict)
    defects: dict = field(default_factory=dict)      # kind -> events left out or changed (defect_warnings)
    memory_pids: np.ndarray | None = None            # the process id of each row of memory_events (split_by_pid)


def _decode_many(list_dec, one_dec, raws: list) -> list:
    """Decode many args objects in one call; one by one (bad ones -> None) if the batch fails."""
    try:
        return list_dec.decode(b"[" + b",".join(raws) + b"]")
    except msgspec.DecodeError:
        return [_decode_args(one_dec, r) for r in raws]


def _decode_args(dec, raw):
    """Typed args, or None when they are absent or not an object (such args are ignored)."""
    try:
        return dec.decode(raw)
    except msgspec.DecodeError:
        return None


class _NotFast(Exception):
    """The typed fast path cannot take this chunk; decode it with the lenient path."""


def _key(v):
    """A trace value as a dictionary key: int, float, bool, None and strings kept, others as their JSON text."""
    return v if type(v) in (int, str, float, bool) or v is None else as_text(v)


def _hashable(values: list, defects: dict, what: str, cut: bool = True) -> list:
    """:func:`_key` of each value, counted in ``defects["type_" + what]``; strings cut to NAME_MAX_CHARS
    (``cut``, counted in ``defects["long_" + what]``)."""
    out = []
    for v in values:
        t = type(v)
        if t is str:
            if cut and len(v) > NAME_MAX_CHARS:
                v = cut_text(v)
                _count(defects, "long_" + what)
        elif not (t is int or t is float or t is bool or v is None):
            v = as_text(v)
            _count(defects, "type_" + what)
        out.append(v)
    return out


_GET_NAME, _GET_CAT, _GET_TID, _GET_PID = (attrgetter(k) for k in ("name", "cat", "tid", "pid"))
_GET_TS, _GET_DUR, _GET_ARGS = attrgetter("ts"), attrgetter("dur"), attrgetter("args")
_GET_STREAM, _GET_CORR, _GET_EXT = (attrgetter(k) for k in ("stream", "correlation", "ext_id"))


def _has_coll_args(a) -> bool:
    return a.coll_name is not None or a.in_nelems is not None


def _intern(table: dict, values: list, dtype, new: list | None = None) -> np.ndarray:
    """Codes of ``values`` in ``table`` (value -> code), new values added in order of first appearance (and
    appended to ``new``)."""
    try:                           # (most slices name nothing new: no pass over their distinct values)
        return np.fromiter(map(table.__getitem__, values), dtype=dtype, count=len(values))
    except KeyError:
        pass
    for v in dict.fromkeys(values):
        if v not in table:
            table[v] = len(table)
            if new is not None:
                new.append(v)
    return np.fromiter(map(table.__getitem__, values), dtype=dtype, count=len(values))


def _intern_ints(table: dict, values: list, defects: dict, what: str) -> np.ndarray:
    """_intern of thread / process ids, usually all plain ints: judged once per distinct value, the codes
    found with numpy; other values go through :func:`_hashable`."""
    try:
        uniq = dict.fromkeys(values)
    except TypeError:              # a list or an object
        uniq = None
    if uniq is not None and all(type(v) is int for v in uniq):
        for v in uniq:             # in order of first appearance
            if v not in table:
                table[v] = len(table)
        keys = sorted(uniq)
        try:
            # (equal values share a code, as in the table: 1 and True; every value is an int or equal to one)
            codes = np.searchsorted(np.array(keys, dtype=np.int64), np.array(values, dtype=np.int64))
        except OverflowError:      # beyond int64 (never seen in real traces)
            return np.fromiter(map(table.__getitem__, values), dtype=np.int32, count=len(values))
        return np.array([table[k] for k in keys], dtype=np.int32)[codes]
    return _intern(table, _hashable(values, defects, what), np.int32)


def _is_int64(v) -> bool:
    return type(v) is int and -(1 << 63) <= v < (1 << 63)


def _int64s(get, items: list) -> np.ndarray:
    """Integer ids ``get(item)`` as int64, -1 for those beyond int64."""
    try:
        return np.fromiter(map(get, items), dtype=np.int64, count=len(items))
    except OverflowError:
        return np.fromiter((v if -(1 << 63) <= v < (1 << 63) else -1 for v in map(get, items)), dtype=np.int64,
                           count=len(items))


def _x_args(a) -> XArgs:
    """Lenient args as the fast path's: ids that are not int64 read as -1."""
    if a is None:
        return _NO_X_ARGS
    ids = [v if _is_int64(v) else -1 for v in (a.stream, a.correlation, a.ext_id)]
    return XArgs(*ids, a.coll_name, a.in_nelems, a.out_nelems, a.group_size, a.dtype, a.pg, a.seq,
                 a.input_dims, a.input_type)


# the kept rows' columns as the decoder fills them: (name, array typecode, numpy dtype); bytes per row in all: 53
# (docs/architecture.md, "What a decoded event costs").  ext_id holds every row's External id until arrays() has
# found the duplicates, then only the device events' and comm ops'.
COLUMN_TYPES = (("name", "i", np.int32), ("cat", "b", np.int8), ("tid", "i", np.int32), ("pid", "i", np.int32),
                ("ts_us", "d", np.float64), ("dur_us", "d", np.float64), ("stream", "q", np.int64),
                ("correlation", "q", np.int64), ("ext_id", "q", np.int64))
# the [memory] events' columns, 45 bytes a row; ``pid`` is a code into _Columns.mem_pids
MEMORY_COLUMN_TYPES = (("ts_us", "d", np.float64), ("addr", "q", np.int64), ("bytes", "q", np.int64),
                       ("total_allocated_bytes", "q", np.int64), ("total_reserved_bytes", "q", np.int64),
                       ("device_type", "b", np.int8), ("device_id", "h", np.int16), ("pid", "i", np.int32))
_GET_MEMORY_ARGS = tuple(attrgetter(k) for k in ("addr", "nbytes", "total_alloc", "total_reserved", "device_type",
                                                 "device_id"))
# the runtime calls that launch device work (all but model.SYNC_CALLS, which stay events): only what ties a
# kernel to its launch, in a table of their own, 24 bytes a row (an implausible time or duration is left out as
# the chunk is decoded: no duration is kept)
LAUNCH_COLUMN_TYPES = (("tid", "i", np.int32), ("pid", "i", np.int32), ("ts_us", "d", np.float64),
                       ("correlation", "q", np.int64))


class _Columns:
    """Accumulates the kept rows in typed column buffers (``array.array``, grown in place: no per-chunk parts to
    join at the end); names/cats/tids/pids interned into integer codes; ``defects`` counts what was malformed
    (see :func:`defect_warnings`)."""

    def __init__(self) -> None:
        self.names: dict = {}
        self.threads: dict = {}
        self.pids: dict = {}
        self.bufs = {c: array.array(code) for c, code, _ in COLUMN_TYPES}
        self.launch_bufs = {c: array.array(code) for c, code, _ in LAUNCH_COLUMN_TYPES}
        # what tells two rows apart beyond the columns, once the lenient path has read a chunk (its args' text;
        # the External id of the fast path's rows); None while every row came from the fast path (ext_id tells)
        self.key_buf: array.array | None = None
        self.runtime_names: set[tuple[int, int]] = set()   # (pid code, name code) of the runtime calls
        self.name_sync = np.zeros(0, dtype=bool)   # per name code: a runtime call that blocks the host (SYNC_CALLS)
        self.comm_rows: list[tuple] = []
        # the [memory] events' columns (MEMORY_COLUMN_TYPES; only the plausible ones), their process ids interned in
        # mem_pids (process id -> code)
        self.mem_bufs = {c: array.array(code) for c, code, _ in MEMORY_COLUMN_TYPES}
        self.mem_pids: dict = {}
        self.mem_pid_values: list = []       # per code: the process id (a code's key may be (type, value))
        self.thread_names: dict = {}
        self.name_comm = np.zeros(0, dtype=bool)   # per name code: a collective op (model.is_collective_op)
        self.name_labels: list[str] = []     # per name code: the name as shown (cut, or a non-string's JSON text)
        self.bad_names: dict[int, str] = {}  # name code -> defect kind (long_name / type_name)
        self.defects: dict = {}
        self.n = 0

    def add(self, events: list[Event]) -> None:
        """The lenient path's events: args decoded only where used (device events, runtime calls, comm ops)."""
        self._add_other(e for e in events if e.ph != "X")
        keep = [e for e in events if e.ph == "X" and type(e.cat) is str and e.cat in KEEP_CATS]
        if not keep:
            return
        args = [_NO_X_ARGS] * len(keep)
        rt_idx = [i for i, e in enumerate(keep) if e.cat in model.RUNTIME_CATS]
        for i, a in zip(rt_idx, _decode_many(_LINK_LIST_DEC, _LINK_DEC, [keep[i].args for i in rt_idx])):
            if a is not None and _is_int64(a.correlation):
                args[i] = XArgs(correlation=a.correlation)
        full_idx = [i for i, e in enumerate(keep)
                    if e.cat in model.DEVICE_EVENT_CATS or model.is_collective_op(e.name)]
        for i, a in zip(full_idx, _decode_many(_ARGS_LIST_DEC, _ARGS_DEC, [keep[i].args for i in full_idx])):
            args[i] = _x_args(a)
        cat_codes = np.fromiter((_CAT_KEEP_CODE[e.cat] - 1 for e in keep), dtype=np.int8, count=len(keep))
        corr = np.fromiter(map(_GET_CORR, args), dtype=np.int64, count=len(keep))
        # (what tells two events apart beyond the columns, for finding exact duplicates: the args' text)
        key = np.fromiter((hash(bytes(e.args)) for e in keep), dtype=np.int64, count=len(keep))
        self._add_kept(keep, cat_codes, args, corr, _floats([e.ts for e in keep]), _floats([e.dur for e in keep]), key)

    def add_fast(self, events: list[FastEvent]) -> None:
        """Like :meth:`add` for the typed fast decoder's events (args inline), one C-level pass per column.
        Raises ``_NotFast`` (before changing any state) when a correlation id does not fit int64."""
        # one pass reads every category: kept ones map to their code + 1, instants / metadata to 0, the rest None
        try:
            cat_codes1 = list(map(_CAT_KEEP_CODE.get, map(_GET_CAT, events)))
        except TypeError:          # a category that is a list or an object: not one we keep
            cat_codes1 = [_CAT_KEEP_CODE.get(c) if type(c) is str or c is OTHER_CAT else None
                          for c in map(_GET_CAT, events)]
        keep = list(compress(events, cat_codes1))
        n = len(keep)
        args = list(map(_GET_ARGS, keep))
        try:
            corr = np.fromiter(map(_GET_CORR, args), dtype=np.int64, count=n)
        except OverflowError:
            raise _NotFast from None
        if n + cat_codes1.count(None) < len(events):        # instants / metadata
            self._add_other_fast(list(compress(events, map(_IS_OTHER.__contains__, cat_codes1))))
        if not n:
            return
        cat_codes = np.fromiter(filter(None, cat_codes1), dtype=np.int8, count=n)
        cat_codes -= 1
        del cat_codes1
        self._add_kept(keep, cat_codes, args, corr, np.fromiter(map(_GET_TS, keep), dtype=np.float64, count=n),
                       np.fromiter(map(_GET_DUR, keep), dtype=np.float64, count=n), None)

    def _add_kept(self, keep: list, cat_codes: np.ndarray, args: list, corr: np.ndarray, ts: np.ndarray,
                  dur: np.ndarray, args_key: np.ndarray | None) -> None:
        """The kept duration events' columns (``args``: XArgs-like, ``args_key``: what tells duplicates apart
        beyond the columns, None: the External id)."""
        n = len(keep)
        names = self.names
        name_list = list(map(_GET_NAME, keep))
        new: list = []             # the names first seen in this chunk
        try:
            name_codes = _intern(names, name_list, np.int32, new)
        except TypeError:          # a list or an object as a name (nothing was added: dict.fromkeys failed)
            name_codes = _intern(names, _hashable(name_list, self.defects, "name", cut=False), np.int32, new)
        del name_list
        self._label_new_names(new)
        tid_codes = _intern_ints(self.threads, list(map(_GET_TID, keep)), self.defects, "tid")
        pid_codes = _intern_ints(self.pids, list(map(_GET_PID, keep)), self.defects, "pid")
        if new:                    # (only the new names: each chunk's work stays proportional to the chunk)
            self.name_comm = np.append(self.name_comm, per_name(model.is_collective_op, new))
            self.name_sync = np.append(self.name_sync, [k in model.SYNC_CALLS for k in new])
        runtime = _CAT_RT[cat_codes]
        pos = None                 # the kept rows' positions in the chunk (None: all of them)
        ext_all = _int64s(_GET_EXT, args)
        if runtime.any():
            r = np.flatnonzero(runtime)
            self.runtime_names.update(zip(pid_codes[r].tolist(), name_codes[r].tolist()))
            launch = runtime & ~self.name_sync[name_codes]
            if launch.any():       # into the launch table; the rest of the chunk goes on as the kept rows
                r = np.flatnonzero(launch)
                r = r[self._plausible(ts[r], dur[r])]
                part = {"tid": tid_codes[r], "pid": pid_codes[r], "ts_us": ts[r], "correlation": corr[r]}
                for c, _, dtype in LAUNCH_COLUMN_TYPES:
                    self.launch_bufs[c].frombytes(np.ascontiguousarray(part[c], dtype=dtype).view(np.uint8))
                pos = np.flatnonzero(~launch)
                name_codes, tid_codes, pid_codes = name_codes[pos], tid_codes[pos], pid_codes[pos]
                cat_codes, corr, ts, dur, ext_all = cat_codes[pos], corr[pos], ts[pos], dur[pos], ext_all[pos]
                runtime = runtime[pos]
                if args_key is not None:
                    args_key = args_key[pos]
                n = len(pos)
                if not n:
                    return
        gpu = _CAT_GPU[cat_codes]
        full = gpu | self.name_comm[name_codes]
        # stream / External id kept on device events and comm ops, correlation also on runtime calls
        corr[~(full | runtime)] = -1
        stream = np.full(n, -1, dtype=np.int64)
        fidx = np.flatnonzero(full)
        if fidx.size:
            fpos = (fidx if pos is None else pos[fidx]).tolist()
            fargs = [args[i] for i in fpos]
            stream[fidx] = _int64s(_GET_STREAM, fargs)
            # comm rows: the comm ops (not device events) and the device events with collective args
            comm = ~gpu[fidx]
            comm |= np.fromiter(map(_has_coll_args, fargs), dtype=bool, count=len(fargs))
            for i, a in zip(fidx[comm].tolist(), compress(fargs, comm.tolist())):
                self.comm_rows.append((self.n + i, a.coll_name, a.in_nelems, a.out_nelems, a.group_size,
                                       a.dtype, a.pg, a.seq, bytes(a.input_dims), bytes(a.input_type)))
        if args_key is not None and self.key_buf is None:      # (the rows so far: their External ids)
            self.key_buf = array.array("q", self.bufs["ext_id"].tobytes())
        if self.key_buf is not None:
            self.key_buf.frombytes(np.ascontiguousarray(ext_all if args_key is None else args_key,
                                                        dtype=np.int64).view(np.uint8))
        part = {"name": name_codes, "cat": cat_codes, "tid": tid_codes, "pid": pid_codes, "ts_us": ts,
                "dur_us": dur, "stream": stream, "correlation": corr, "ext_id": ext_all}
        for c, _, dtype in COLUMN_TYPES:
            self.bufs[c].frombytes(np.ascontiguousarray(part[c], dtype=dtype).view(np.uint8))
        self.n += n

    def _label_new_names(self, new: list) -> None:
        """Labels of the names ``new`` (just interned): a string as it is or cut, others as JSON text."""
        for k in new:
            if type(k) is str:
                if len(k) > NAME_MAX_CHARS:
                    self.bad_names[len(self.name_labels)] = "long_name"
                    k = cut_text(k)
            else:
                self.bad_names[len(self.name_labels)] = "type_name"
                k = as_text(k)
            self.name_labels.append(k)

    def _add_other(self, events) -> None:
        """[memory] instants and thread_name metadata of the lenient path."""
        mem: list = []             # the [memory] instants: (event, its args)
        for e in events:
            meta = e.ph == "M"
            if not (meta or e.ph in ("i", "I")) or e.name != ("thread_name" if meta else "[memory]"):
                continue
            a = _decode_args(_ARGS_DEC, e.args)
            if a is None:
                continue
            if meta:
                self._add_thread_name(e, a)
            else:
                mem.append((e, a))
        if mem:
            self._add_memory(*zip(*mem))

    def _add_other_fast(self, events: list) -> None:
        """:meth:`_add_other` for the fast path's instants and metadata (args decoded inline)."""
        mem = [e for e in events if e.name == "[memory]" and e.args is not None and type(e) is not FastMeta]
        if mem:
            self._add_memory(mem, list(map(_GET_ARGS, mem)))
        if len(mem) < len(events):
            for e in events:
                if type(e) is FastMeta and e.name == "thread_name" and e.args is not None:
                    self._add_thread_name(e, e.args)

    def _add_thread_name(self, e, a) -> None:
        if a.name is not None:
            self.thread_names[(_key(e.pid), _key(e.tid))] = as_text(a.name)

    def _add_memory(self, events, args) -> None:
        """One chunk's [memory] instants into the memory columns: those whose time, address or size is missing
        or implausible left out (counted in ``defects``), other bad fields read as 0."""
        ts = _floats(list(map(_GET_TS, events)))
        ok = np.isfinite(ts) & (np.abs(ts) <= TIME_MAX_US)
        part = {"ts_us": ts}
        for (c, _, dtype), get in zip(MEMORY_COLUMN_TYPES[1:-1], _GET_MEMORY_ARGS):
            part[c], valid = _ints(map(get, args), dtype)
            if c in ("addr", "bytes"):
                ok &= valid
        ok &= np.abs(part["bytes"]) <= MEMORY_BYTES_MAX
        pids = list(map(_GET_PID, events))
        try:
            plain = all(type(v) is int or type(v) is str for v in dict.fromkeys(pids))
        except TypeError:          # a list or an object
            plain = False
        if not plain:              # (1, 1.0 and True kept apart; lists and objects as their JSON text: _key)
            pids = [(type(v), _key(v)) for v in pids]
        new: list = []
        part["pid"] = _intern(self.mem_pids, pids, np.int32, new)
        self.mem_pid_values += [k[1] if type(k) is tuple else k for k in new]
        bad = int(np.count_nonzero(~ok))
        if bad:
            _count(self.defects, "bad_memory", bad)
            rows = np.flatnonzero(ok)
            part = {c: v[rows] for c, v in part.items()}
        for c, _, dtype in MEMORY_COLUMN_TYPES:
            self.mem_bufs[c].frombytes(np.ascontiguousarray(part[c], dtype=dtype).view(np.uint8))

    def memory_frame(self) -> tuple[pd.DataFrame, np.ndarray]:
        """([memory] events as model.MEMORY_EVENT_COLUMNS, the process id of each row); exact duplicates left out
        (counted in ``defects``)."""
        out = {c: np.frombuffer(self.mem_bufs[c], dtype=dtype) for c, _, dtype in MEMORY_COLUMN_TYPES}
        self.mem_bufs = {}
        pid_codes = out.pop("pid")
        dup = _duplicate_rows(list(out.values()), np.ones(len(pid_codes), dtype=bool)) if len(pid_codes) else None
        if dup is not None:
            _count(self.defects, "duplicate_memory", int(np.count_nonzero(dup)))
            rows = np.flatnonzero(~dup)
            out = {c: v[rows] for c, v in out.items()}
            pid_codes = pid_codes[rows]
        out["rank"] = np.zeros(len(pid_codes), dtype=np.int32)
        values = np.empty(len(self.mem_pid_values), dtype=object)
        values[:] = self.mem_pid_values
        return frame_of(out, model.MEMORY_EVENT_COLUMNS), values[pid_codes]

    def arrays(self) -> dict:
        """The kept events as numpy columns (see RawTrace.cols), implausible events and exact duplicates left
        out (counted in ``defects``; ``comm_rows`` renumbered)."""
        # the buffers as they are (no copy; numpy's arrays keep them alive)
        cols = {c: np.frombuffer(self.bufs[c], dtype=dtype) for c, _, dtype in COLUMN_TYPES}
        self.bufs = {}
        # the launches first: only those whose correlation id a device event has stay (most runtime calls launch
        # nothing), before the rows' own temporaries are made
        device = _CAT_GPU[cols["cat"]] if len(cols["cat"]) else np.zeros(0, dtype=bool)
        launches = self._launch_arrays(np.unique(cols["correlation"][device]))
        del device
        key = np.frombuffer(self.key_buf, dtype=np.int64) if self.key_buf is not None else None
        self.key_buf = None
        # External ids stay on device events and comm ops only (after the duplicates are found: they tell)
        cols["ext_full"] = _CAT_GPU[cols["cat"]] | self.name_comm[cols["name"]] if len(cols["cat"]) else \
            np.zeros(0, dtype=bool)
        cols["cat"], cat_cats = _compact(cols["cat"], _KEEP_ORDER)     # categories in order of first appearance
        names = self.name_labels
        dropped = self._drop_implausible(cols, key)
        del key
        cols["ext_id"][~cols.pop("ext_full")] = -1
        if dropped or self.runtime_names:
            # names only the dropped events (or the launches, a table of their own) had are not categories of
            # what is left
            used = np.zeros(len(names), dtype=bool)
            used[cols["name"]] = True
            if not used.all():
                new_code = (np.cumsum(used) - 1).astype(np.int32)
                cols["name"] = new_code[cols["name"]]
                names = [k for k, u in zip(names, used.tolist()) if u]
                self.bad_names = {int(new_code[c]): v for c, v in self.bad_names.items() if used[c]}
        if self.bad_names:              # events whose name was cut or was not a string
            per_code = np.bincount(cols["name"], minlength=len(names))
            for code, kind in self.bad_names.items():
                _count(self.defects, kind, int(per_code[code]))
        cols["name_cats"] = unique_labels(list(names))
        cols["cat_cats"] = cat_cats
        # tid/pid: int32 codes into the original values (int or str), one code space for the rows and the launches
        n = len(cols["tid"])
        codes, cols["tid_values"] = _factorize_codes(np.concatenate([cols.pop("tid"), launches.pop("tid")]),
                                                     [_as_key(k) for k in self.threads])
        cols["tid_code"], launches["tid_code"] = codes[:n], codes[n:]
        del codes
        cols["launches"] = launches
        cols["pid_values"] = [_as_key(k) for k in self.pids]
        return cols

    def _launch_arrays(self, device_corr: np.ndarray) -> dict:
        """The launch table as numpy columns (tid, pid, ts_us, correlation), exact duplicates (the same thread,
        process, start and correlation) left out and counted in ``defects`` (implausible rows were as they came),
        then only the launches whose correlation id is in ``device_corr`` (sorted: the device events') kept; and
        ``runtime_names``: the (pid code, name) of every runtime call, for the device's type."""
        lc = {c: np.frombuffer(self.launch_bufs[c], dtype=dtype) for c, _, dtype in LAUNCH_COLUMN_TYPES}
        self.launch_bufs = {}
        n = len(lc["ts_us"])
        dup = _duplicate_rows([lc[c] for c in ("ts_us", "correlation", "tid", "pid")], np.ones(n, dtype=bool)) \
            if n else None
        if dup is not None:
            _count(self.defects, "duplicate", int(np.count_nonzero(dup)))
        keep = _in_sorted(lc["correlation"], device_corr) & (lc["correlation"] >= 0)
        if dup is not None:
            keep &= ~dup
        del dup
        if not keep.all():
            rows = np.flatnonzero(keep)
            lc = {c: v[rows] for c, v in lc.items()}
        lc["runtime_names"] = sorted((p, self.name_labels[k]) for p, k in self.runtime_names)
        return lc

    def _plausible(self, ts: np.ndarray, dur: np.ndarray) -> np.ndarray:
        """Rows whose time is there, finite and within TIME_MAX_US and whose duration is not negative; the others
        counted in ``defects``."""
        nan = np.isnan(ts) | np.isnan(dur)
        beyond = ~nan & ((np.abs(ts) > TIME_MAX_US) | (dur > TIME_MAX_US))    # (inf included)
        negative = ~nan & ~beyond & (dur < 0)
        for what, mask in (("time_missing", nan), ("time_beyond", beyond), ("negative_dur", negative)):
            _count(self.defects, what, int(np.count_nonzero(mask)))
        return ~(nan | beyond | negative)

    def _drop_implausible(self, cols: dict, key: np.ndarray | None) -> bool:
        """Leave out events whose time is missing, not finite or beyond TIME_MAX_US, whose duration is negative,
        and exact duplicates of an earlier event (``key``: what tells rows apart beyond the columns, None: the
        External id); in place, counted in ``defects``.  True when some were."""
        ts, dur = cols["ts_us"], cols["dur_us"]
        if not len(ts):
            return False
        keep = self._plausible(ts, dur)
        dup = _duplicate_rows([ts, dur, cols["ext_id"] if key is None else key] + [
            cols[c] for c in ("name", "tid", "pid", "cat", "stream", "correlation", "ext_id")], keep)
        if dup is not None:
            _count(self.defects, "duplicate", int(np.count_nonzero(dup)))
            keep &= ~dup
        if keep.all():
            return False
        rows = np.flatnonzero(keep)
        for c in list(cols):
            cols[c] = cols[c][rows]
        new_pos = np.cumsum(keep) - 1
        self.comm_rows = [(int(new_pos[r[0]]),) + r[1:] for r in self.comm_rows if keep[r[0]]]
        return True


_H_MUL = np.uint64(0x9E3779B97F4A7C15)


def _in_sorted(values: np.ndarray, keys: np.ndarray) -> np.ndarray:
    """Whether each of ``values`` is one of the sorted ``keys`` (bool per value): a binary search a block at a
    time (np.isin would argsort every value: 8 B a value more)."""
    hit = np.zeros(len(values), dtype=bool)
    if not len(keys):
        return hit
    for lo in range(0, len(values), model.BLOCK_ROWS):
        part = values[lo:lo + model.BLOCK_ROWS]
        k = np.minimum(np.searchsorted(keys, part), len(keys) - 1)
        hit[lo:lo + model.BLOCK_ROWS] = keys[k] == part
    return hit




def _duplicate_rows(columns: list[np.ndarray], among: np.ndarray, hashed: int = 4) -> np.ndarray | None:
    """Rows (of those in ``among``) equal on every column to an earlier row; None when there are none.  A 32-bit
    hash of each row's first ``hashed`` columns finds the candidates (4 B a row, made block by block), then they
    are compared exactly on every column."""
    n = len(among)
    h = np.empty(n, dtype=np.uint32)
    acc = None
    for lo in range(0, n, model.BLOCK_ROWS):
        hi = min(lo + model.BLOCK_ROWS, n)
        acc = np.zeros(hi - lo, dtype=np.uint64)
        for col in columns[:hashed]:
            v = col[lo:hi]
            v = v.view(np.uint64) if v.dtype.itemsize == 8 else v.astype(np.int64).view(np.uint64)
            np.bitwise_xor(acc, v, out=acc)
            np.multiply(acc, _H_MUL, out=acc)
            np.bitwise_xor(acc, acc >> np.uint64(29), out=acc)
        h[lo:hi] = acc >> np.uint64(32)
    del acc
    h[~among] = 0           # (rows left out: never candidates, see below)
    s = np.sort(h[among])
    same = s[1:] == s[:-1]
    if not same.any():
        return None
    dup = np.unique(s[1:][same])
    del s
    hit = _in_sorted(h, dup)
    del h
    rows = np.flatnonzero(among & hit)
    exact = pd.DataFrame({i: col[rows] for i, col in enumerate(columns)}).duplicated(keep="first").to_numpy()
    if not exact.any():
        return None
    out = np.zeros(len(among), dtype=bool)
    out[rows[exact]] = True
    return out


def _factorize_codes(codes: np.ndarray, values: list) -> tuple[np.ndarray, list]:
    """``pd.factorize(np.array(values, dtype=object)[codes])`` from the codes: (int32 codes by first appearance,
    the distinct values in that order); equal values (1 and True) share a code."""
    klass: dict = {}
    of_value = np.array([klass.setdefault(v, len(klass)) for v in values], dtype=np.int32)
    rows = of_value[codes] if len(codes) else np.empty(0, dtype=np.int32)
    out, used = _compact(rows, list(klass))
    return out.astype(np.int32, copy=False), used


def _compact(codes: np.ndarray, labels) -> tuple[np.ndarray, list]:
    """Codes into ``labels`` renumbered to the labels they use, in order of first use (linear in the rows when
    there are few labels, or when the codes already are in that order, as the decoder interns them)."""
    if not len(codes):
        return codes, []
    top = np.maximum.accumulate(codes)
    if top[0] == 0 and int(top[-1]) == len(labels) - 1 and (top[1:] - top[:-1] <= 1).all():
        return codes, list(labels)           # every label used, first uses in order: nothing to renumber
    del top
    if len(labels) <= _FEW_LABELS:
        used = np.flatnonzero(np.bincount(codes, minlength=len(labels)))
        first = np.array([np.argmax(codes == c) for c in used.tolist()], dtype=np.int64)
    else:
        used, first = np.unique(codes, return_index=True)
    order = used[np.argsort(first, kind="stable")]
    remap = np.zeros(max(len(labels), 1), dtype=codes.dtype)
    remap[order] = np.arange(len(order), dtype=codes.dtype)
    return remap[codes] if len(codes) else codes, [labels[i] for i in order.tolist()]


_FEW_LABELS = 64        # _compact: up to this many labels, one pass per label finds its first use (no sort)


def _as_key(v):
    return v if isinstance(v, (int, str)) else str(v)


def _floats(values: list) -> np.ndarray:
    """Numbers as float64: NaN for what is not a number (a string or a bool too, whatever else ``values`` holds),
    inf for integers beyond float."""
    if _NUMBER_TYPES.issuperset(map(type, values)):
        try:
            return np.asarray(values, dtype=np.float64)
        except OverflowError:
            pass
    return np.fromiter(map(_to_float, values), dtype=np.float64, count=len(values))


_NUMBER_TYPES = frozenset({float, int, type(None)})   # what np.asarray reads as _to_float does (None: NaN)


def _to_float(v) -> float:
    t = type(v)
    if t is float:
        return v
    if t is int:
        try:
            return float(v)
        except OverflowError:
            return float("inf") if v > 0 else float("-inf")
    return float("nan")


class _Reader:
    """Block reader over a gzip or plain file, with an optional progress bar.  gzip is inflated in blocks of
    READ_BYTES as the decoder asks, a big file (more than SYNC_GZ_BYTES) in a background thread a few blocks
    ahead.  Blocks are (bytes, file offset); None at the end; a UserError when the file cannot be read."""

    GZ_IN = 1 << 20        # compressed bytes per inflate call

    def __init__(self, path: str, progress: bool | None, max_bytes: int | None = None) -> None:
        self.path = path
        self.limit_from_memory = max_bytes is None
        self.max_bytes = default_max_trace_bytes() if max_bytes is None else int(max_bytes)
        try:
            self.raw = open(path, "rb")
        except OSError as exc:
            raise UserError(f"cannot read trace {path}: {exc.strerror or exc}; check the path and permissions") from None
        self.gz = self.raw.read(2) == b"\x1f\x8b"
        self.raw.seek(0)
        self.size = size = os.fstat(self.raw.fileno()).st_size
        if not self.gz and size > self.max_bytes:
            self.raw.close()
            raise UserError(self._too_big_message())
        if size >= PROGRESS_MIN_BYTES:
            line = memory_warning(path, inflated_size(path))
            if line:
                print(f"fsdpprof: warning: {line}", file=sys.stderr, flush=True)
        if progress is None:
            progress = size >= PROGRESS_MIN_BYTES and sys.stderr.isatty()
        self.bar = None
        if progress:
            from tqdm import tqdm
            self.bar = tqdm(total=size, unit="B", unit_scale=True, desc=os.path.basename(path), leave=False)
        self._pos = 0
        self._queue = self._sync = self._last = None
        self._stop = False
        if self.gz and size <= SYNC_GZ_BYTES:
            # inflated here as the decoder asks: in one piece when the JSON is at most CHUNK_BYTES
            self._sync = self._blocks(0 if self._isize() <= CHUNK_BYTES else READ_BYTES)
        elif self.gz:
            import queue
            import threading
            self._queue = queue.Queue(maxsize=4)
            self._thread = threading.Thread(target=self._inflate, name="fsdpprof-gunzip", daemon=True)
            self._thread.start()

    def _isize(self) -> int:
        """Decompressed size of the last gzip member (bytes, mod 2**32) from the gzip trailer."""
        try:
            self.raw.seek(-4, os.SEEK_END)
            tail = self.raw.read(4)
        except OSError:
            tail = None
        self.raw.seek(0)
        return 1 << 62 if tail is None else int.from_bytes(tail, "little") if len(tail) == 4 else 0

    def _too_big_message(self) -> str:
        limit = "the limit this machine's available memory sets" if self.limit_from_memory else "the limit"
        return (f"trace {self.path} holds more than {self.max_bytes / 2**30:.3g} GiB of JSON once decompressed, {limit}; "
                f"if it is a real trace, raise the limit with `fsdpprof report --max-trace-bytes BYTES` "
                f"(Python: max_bytes=)")

    def _blocks(self, max_out: int):
        """Inflate the (possibly multi-member) gzip stream into blocks of at most ``max_out`` bytes (0: the whole
        file in one block when it is one small member, else READ_BYTES); more than ``max_bytes`` is an error."""
        total = 0
        try:
            d = _inflate_mod.decompressobj(wbits=31)
            pending = b""
            if not max_out:
                # one buffer of the trailer's size, when the file is one member (no second gzip header) that
                # inflates to exactly that size; else the loop below, from the start (the trailer may lie)
                pending = self.raw.read()
                isize = int.from_bytes(pending[-4:], "little")
                if pending.find(b"\x1f\x8b\x08", 1) < 0 and isize <= self.max_bytes:
                    try:
                        one = _inflate_mod.decompressobj(wbits=31)
                        out = one.decompress(pending, isize + 1)
                    except _INFLATE_ERRORS:
                        out = None
                    if out is not None and len(out) == isize and one.eof:
                        yield out, len(pending)
                        yield None
                        return
                    del out
                max_out = READ_BYTES
            while not self._stop:
                if not pending:
                    pending = self.raw.read(self.GZ_IN)
                    if not pending:                      # end of file
                        yield None if d.eof else UserError(
                            f"trace {self.path} is a truncated gzip file (the writer probably died); "
                            f"re-record or re-copy it")
                        return
                if d.eof:                                # a member ended and more bytes follow
                    if not pending.strip(b"\x00"):      # zero padding
                        pending = b""
                        continue
                    d = _inflate_mod.decompressobj(wbits=31)     # the next gzip member
                out = d.decompress(pending, max_out)
                pending = d.unused_data if d.eof else d.unconsumed_tail
                total += len(out)
                if total > self.max_bytes:
                    yield UserError(self._too_big_message())
                    return
                if out:
                    yield out, self.raw.tell()
        except _INFLATE_ERRORS as exc:
            yield UserError(f"trace {self.path} is not a valid gzip file ({exc}); re-export or re-copy it")
        except Exception as exc:  # I/O error
            yield UserError(f"cannot read trace {self.path}: {exc}")

    def _inflate(self) -> None:
        """Thread: inflate into blocks, a few ahead of the decoder."""
        import queue
        for item in self._blocks(READ_BYTES):
            while True:
                if self._stop:
                    return
                try:
                    self._queue.put(item, timeout=0.2)
                    break
                except queue.Full:
                    continue

    def read(self) -> bytes:
        """The next block of JSON; b"" at the end."""
        if self._queue is None and self._sync is None:
            try:
                data = self.raw.read(-1 if self.size <= CHUNK_BYTES else READ_BYTES)
            except OSError as exc:
                raise UserError(f"cannot read trace {self.path}: {exc}") from None
            pos = self.raw.tell() if self.bar is not None else 0
        else:
            item = self._last
            if item is None:
                item = next(self._sync) if self._sync is not None else self._queue.get()
                if type(item) is not tuple:
                    self._last = item or b""         # stay at the end / on the error for further reads
            if not item:
                return b""
            if isinstance(item, UserError):
                raise item
            data, pos = item
        if self.bar is not None:
            self.bar.update(pos - self._pos)
            self._pos = pos
        return data

    def close(self) -> None:
        self._stop = True
        if self._queue is not None:
            self._thread.join(timeout=5)
        if self.bar is not None:
            self.bar.close()
        self.raw.close()


_PREFIX = b'{"traceEvents":'
_P = len(_PREFIX)


def _decode_events(buf, cols: _Columns) -> int:
    """Decode a JSON array of events into ``cols`` (fast path, else lenient); how many it held.  Raises
    msgspec.DecodeError when ``buf`` is not valid JSON or an event fits no layout (nothing added then)."""
    try:
        events = _FAST_CHUNK_DEC.decode(buf)
        cols.add_fast(events)
        return len(events)
    except (msgspec.ValidationError, _NotFast):
        pass
    events = _CHUNK_DEC.decode(buf)
    cols.add(events)
    return len(events)


SEARCH_OVERLAP = 64      # bytes of the last round's slice searched again (a boundary cut by the read's end)
RETRY_GROWTH = 2         # after a round whose boundaries all failed, the next waits until the body is this much bigger
TRIES_FIRST, TRIES_LATER = 17, 2    # boundaries tried per round: a first round, a round after failed ones


class _Search:
    """Where :func:`_decode_chunk` looks for event boundaries, kept between rounds so that decoding stays linear
    whatever the layout: ``lo`` (document byte) the first byte not searched yet, ``dead`` the boundaries (their
    '}') that failed, ``retry_len`` the body length the next round waits for after a round of failed tries."""

    __slots__ = ("lo", "retry_len", "dead")

    def __init__(self) -> None:
        self.lo = 0
        self.retry_len = 0
        self.dead: set[int] = set()


def _boundaries_backwards(body: bytearray, lo: int, hi: int):
    """(``}`` index, ``,`` index) of the event boundaries in ``body[lo:hi]``, the last first; each byte searched
    once, in C."""
    while True:
        hi = body.rfind(b"{", lo, hi) + 1
        if hi <= lo:
            return
        m = _LAST_SEP_RE.match(body, lo, hi)
        if m is None:
            return
        brace = m.end() - 1
        j = body.rfind(b"}", lo, brace)              # (only blanks and the ',' lie between it and the '{')
        yield j, body.index(b",", j + 1, brace)
        hi = j


def _release(*views: memoryview) -> None:
    """Release views of the read buffer now (so that it can shrink in place) unless something still uses them
    (e.g. a Dask worker's sampling profiler holding a frame): those go with their last user."""
    for v in views:
        try:
            v.release()
        except BufferError:
            pass


def _extend(body: bytearray, data) -> bytearray:
    """``body + data``, in place unless something still views ``body`` (then copied once)."""
    try:
        body += data
    except BufferError:
        body = bytearray(body)
        body += data
    return body


class _Refused(Exception):
    """What makes a whole trace unreadable, found in one slice: ``reason`` (msgspec's words), ``where`` (the
    document byte of a syntax error, or the event's path, e.g. ``$.traceEvents[1234].tid``; None: not named),
    ``layout`` (True: an event does not fit the chrome-trace layout)."""

    def __init__(self, reason: str, where, layout: bool) -> None:
        super().__init__(reason)
        self.reason, self.where, self.layout = reason, where, layout

    def said(self) -> str:
        if self.where is None:
            return self.reason
        return f"{self.reason} - at `{self.where}`" if self.layout else f"{self.reason} (byte {self.where})"

    def message(self, path: str) -> str:
        """The one-line error of :func:`decode_trace` (the same as a whole-document parse gives)."""
        if self.layout:
            return f"trace {path} does not have the chrome-trace event layout ({self.said()}); is it a PyTorch profiler trace?"
        return f"trace {path} is not valid JSON ({self.said()}); re-export or re-copy it"


_AT_BYTE = re.compile(r"^(JSON is malformed: .*) \(byte (\d+)\)$")
_AT_EVENT = re.compile(r"^(.*) - at `\$(?:\.traceEvents)?\[(\d+)\](.*)`$")    # (a slice: $[N]; the tail: $.traceEvents[N])


def _refused(exc: msgspec.DecodeError, base: int, first_event: int) -> _Refused | None:
    """msgspec's error on a slice starting at document byte ``base`` whose first event is the document's number
    ``first_event``, as the whole document's; None for anything else ("truncated": cut inside a string)."""
    if isinstance(exc, msgspec.ValidationError):
        m = _AT_EVENT.match(str(exc))
        return _Refused(m.group(1), f"$.traceEvents[{first_event + int(m.group(2))}]{m.group(3)}", True) if m else None
    m = _AT_BYTE.match(str(exc))
    return _Refused(m.group(1), base + int(m.group(2)), False) if m else None


def _decode_chunk(body: bytearray, cols: _Columns, base: int, first_event: int,
                  search: _Search) -> tuple[bytearray, int, int]:
    """``body`` is ``{"traceEvents":[`` + events..., its ``[`` at document byte ``base``, its first event the
    document's number ``first_event``: decode the longest run of whole events in place (the byte after the last
    '}' becomes ']', the separating ',' the next '['), then drop it.  Returns (body, base, first_event).  A syntax
    error before the slice's end, or an event that fits no layout, raises :class:`_Refused`."""
    n = len(body)
    if n < search.retry_len:
        return body, base, first_event
    lo = max(_P + 1, search.lo - base + _P)
    search.lo = base + n - _P - SEARCH_OVERLAP       # the next round: the bytes that come, and the last few of these
    if body.find(b",", lo) < 0 or body.find(b"{", lo) < 0:      # (no boundary can end here: found in C)
        return body, base, first_event
    limit = TRIES_LATER if search.retry_len else TRIES_FIRST
    tried = 0
    for j, comma in _boundaries_backwards(body, lo, n):
        if base + j - _P in search.dead:
            continue
        end = j + 1                                  # just after the closing brace
        saved = body[end]
        body[end] = 0x5D                             # ']'
        mv = memoryview(body)
        sub = mv[_P: end + 1]
        try:
            n_events = _decode_events(sub, cols)
        except msgspec.DecodeError as exc:
            _release(sub, mv)
            body[end] = saved
            bad = _refused(exc, base, first_event)
            if bad is not None and (bad.layout or bad.where < base + end - _P):     # (not at the ']' put there)
                raise bad from None
            search.dead.add(base + j - _P)
            tried += 1
            if tried >= limit:
                break
            continue
        finally:
            _release(sub, mv)
        body[comma] = 0x5B                           # '['
        base += comma - _P
        try:
            del body[_P:comma]
        except BufferError:                          # something still views the buffer: copy instead
            body = bytearray(_PREFIX) + body[comma:]
        search.retry_len = 0
        search.dead = {d for d in search.dead if d > base}
        return body, base, first_event + n_events
    if tried:
        search.retry_len = RETRY_GROWTH * n
    search.dead = {d for d in search.dead if d >= search.lo}
    return body, base, first_event


def decode_trace(path: str, *, progress: bool | None = None, max_bytes: int | None = None) -> RawTrace:
    """Decode one chrome-trace file into a raw frame (no classification).  UserError on bad input, also when
    the JSON is bigger than ``max_bytes`` (default: what the machine's memory can analyse, at least 8 GiB:
    memory_budget.default_max_trace_bytes) once decompressed; malformed events are
    left out or repaired and counted in ``RawTrace.defects``."""
    path = os.fspath(path)
    reader = _Reader(path, progress, max_bytes)
    try:
        return _decode(path, reader, _Columns())
    except RecursionError:
        raise UserError(f"trace {path} nests arrays or objects too deeply to be a profiler trace; re-export it") from None
    finally:
        reader.close()


_OLD_LIST_FORMAT = ("trace {} uses the old list format (a bare JSON array of events); re-export it with a recent "
                    "torch.profiler, or wrap it as {{\"traceEvents\": [...]}}")


def _decode(path: str, reader: _Reader, cols: _Columns) -> RawTrace:
    buf = b""
    eof = False
    # 1. header: everything before the "traceEvents" key, each byte searched once (a bytes object while it is
    # the first block, which a small file is decoded from without a copy)
    searched = 0                                     # buf[:searched] holds no start of the key
    blank = 0                                        # buf[:blank] is blanks
    while True:
        idx = buf.find(_KEY, searched)
        if idx >= 0:
            break
        searched = max(0, len(buf) - len(_KEY) + 1)
        if eof:
            _raise_no_events_key(path, buf)
        if blank is not None and buf:                # a first byte that starts no JSON value: refused at once
            first = _NOT_BLANK.search(buf, blank)
            if first is None:
                blank = len(buf)
            else:
                blank = None
                if buf[first.start()] not in _VALUE_START:
                    _raise_no_events_key(path, buf)
        data = reader.read()
        if not data:
            eof = True
            if not buf.strip():
                raise UserError(f"trace {path} is empty; re-export it (torch.profiler export_chrome_trace)")
        if buf == b"" and re.match(rb"\s*\[", data):
            raise UserError(_OLD_LIST_FORMAT.format(path))
        if not buf:
            buf = data
        else:
            if type(buf) is bytes:
                buf = bytearray(buf)
            buf += data
        if len(buf) > _HEADER_MAX_BYTES and buf.find(_KEY, searched) < 0:
            raise UserError(f"trace {path} has no 'traceEvents' key in its first 256 MB; is it a profiler trace?")
    header = _decode_header(path, buf[:idx].rstrip())
    # 2. skip ':' and '['
    pat = re.compile(rb"\s*:\s*\[")
    while True:
        m = pat.match(buf, idx + len(_KEY))
        if m:
            break
        if eof or len(buf) - idx > 64:
            raise UserError(f"trace {path}: 'traceEvents' is not an array; is it a profiler trace?")
        data = reader.read()
        eof = not data
        buf += data
    more = b"" if eof else reader.read()
    tail_base, first_event = 0, 0                    # the tail's first byte and event in the document (less _P)
    if more:
        # 3. the body in slices, decoded in place: body[_P] is the '[' at document byte ``base``
        body = bytearray(_PREFIX)
        body += b"["
        base = m.end() - 1
        body += memoryview(buf)[m.end():]
        body += more
        del buf, more
        search = _Search()
        while True:
            data = reader.read()
            if not data:
                break
            body = _extend(body, data)
            del data
            if len(body) >= CHUNK_BYTES:
                try:
                    body, base, first_event = _decode_chunk(body, cols, base, first_event, search)
                except _Refused as bad:
                    raise UserError(bad.message(path)) from None
        buf, tail_base = body, base - _P             # 4. the rest of the array, then the document's trailing keys
        del body
    # (a small file: the whole document is in buf, decoded as it is, without a copy)
    try:
        tail = _FAST_TAIL_DEC.decode(buf)
        cols.add_fast(tail.traceEvents)
    except (msgspec.DecodeError, _NotFast):    # not the typed layout, not JSON, an id beyond int64: the lenient path
        try:
            tail = _TAIL_DEC.decode(buf)
        except msgspec.DecodeError as exc:          # (ValidationError too)
            layout = isinstance(exc, msgspec.ValidationError)
            bad = _refused(exc, tail_base, first_event) or _Refused(str(exc), None, layout)
            if not layout and not buf.rstrip().endswith((b"]", b"}")):
                raise UserError(f"trace {path} is truncated or not valid JSON ({bad.said()}); "
                                f"re-export or re-copy it") from None
            raise UserError(bad.message(path)) from None
        cols.add(tail.traceEvents)
    del buf
    meta = dict(header) if isinstance(header, dict) else {}
    for key in TailDoc.__struct_fields__[1:]:     # (the document's keys after traceEvents)
        val = getattr(tail, key)
        if val is not None:
            meta[key] = val
    arrays = cols.arrays()
    mem, mem_pids = cols.memory_frame()
    if len(arrays["ts_us"]) + len(arrays["launches"]["ts_us"]) == 0 and not len(mem):
        left_out = sum(v for k, v in cols.defects.items() if k in _LEFT_OUT)
        raise UserError(f"trace {path} has no events (traceEvents is empty or holds no duration events"
                        + (f"; {left_out:,} malformed events left out" if left_out else "")
                        + "); was the profiler window active? re-record with a longer window")
    check_distributed_info(meta, cols.defects)
    meta["device_type"] = _device_type(arrays, meta)
    return RawTrace(path=path, cols=arrays, comm_rows=cols.comm_rows, memory_events=mem, meta=meta,
                    thread_names=cols.thread_names, defects=cols.defects, memory_pids=mem_pids)


def _device_type(arrays: dict, meta: dict) -> str:
    """model.device_type of a decoded trace: its categories, runtime-call names and device names."""
    if not (arrays["stream"] >= 0).any():
        return model.DEVICE_CPU
    cats = arrays["cat_cats"]
    used = np.flatnonzero(np.bincount(arrays["cat"], minlength=len(cats))).tolist()
    rt_names = sorted({str(name) for _, name in arrays["launches"]["runtime_names"]})
    props = meta.get("deviceProperties")
    devs = [str(d.get("name", "")) for d in props if isinstance(d, dict)] if isinstance(props, list) else []
    return model.device_type([str(cats[i]) for i in used], rt_names, devs)


def _decode_header(path: str, text: bytes) -> dict:
    """The document's keys before ``traceEvents``."""
    text = text.rstrip()
    if text.endswith(b","):
        text = text[:-1]
    if not text.lstrip().startswith(b"{"):
        raise UserError(f"trace {path} is not a JSON object with 'traceEvents'; is it a profiler trace?")
    try:
        out = msgspec.json.decode(text + b"}")
    except msgspec.DecodeError as exc:
        raise UserError(f"trace {path} is not valid JSON before 'traceEvents' ({exc}); re-export or re-copy it") from None
    return out if isinstance(out, dict) else {}


def _raise_no_events_key(path: str, buf: bytes) -> None:
    try:
        doc = msgspec.json.decode(buf.strip())
    except msgspec.DecodeError as exc:
        raise UserError(f"trace {path} is not valid JSON ({exc}); re-export or re-copy it") from None
    if isinstance(doc, list):
        raise UserError(_OLD_LIST_FORMAT.format(path))
    raise UserError(f"trace {path} has no 'traceEvents' key; is it a PyTorch profiler chrome trace?")


def _ints(values, dtype) -> tuple[np.ndarray, np.ndarray]:
    """(integers as ``dtype``, valid) of trace values: 0 where a value is not an integer that fits."""
    info = np.iinfo(dtype)
    values = list(values)
    if values and set(map(type, values)) == {int}:
        try:
            arr = np.asarray(values, dtype=np.int64)
            valid = (arr >= info.min) & (arr <= info.max)
            return np.where(valid, arr, 0).astype(dtype), valid
        except OverflowError:
            pass
    ints = [v if type(v) is int and info.min <= v <= info.max else
            int(v) if type(v) is float and v.is_integer() and info.min <= v <= info.max else None for v in values]
    valid = np.fromiter((v is not None for v in ints), dtype=bool, count=len(ints))
    return np.fromiter((0 if v is None else v for v in ints), dtype=dtype, count=len(ints)), valid


def _rows_of(values: np.ndarray, pid) -> np.ndarray:
    return np.flatnonzero(np.fromiter((p == pid for p in values.tolist()), dtype=bool, count=len(values)))


def _rows_of_codes(codes: np.ndarray, values: list, pid) -> np.ndarray:
    """Rows whose code (into ``values``) names a value equal to ``pid``."""
    hit = np.fromiter((p == pid for p in values), dtype=bool, count=len(values))
    return np.flatnonzero(hit[codes]) if len(values) else np.empty(0, dtype=np.int64)


def split_by_pid(rt: RawTrace, pids: list) -> dict:
    """A decoded trace cut into one RawTrace per process id in ``pids`` (a merged timeline: one process a rank),
    codes renumbered as a trace of that process alone would have them; the defects counted on the first part."""
    cols = rt.cols
    out = {}
    for i, pid in enumerate(pids):
        rows = _rows_of_codes(cols["pid"], cols["pid_values"], pid)
        part = {k: (v[rows] if isinstance(v, np.ndarray) else v) for k, v in cols.items()}
        lc = cols["launches"]
        mine = np.fromiter((p == pid for p in cols["pid_values"]), dtype=bool, count=len(cols["pid_values"]))
        lrows = np.flatnonzero(mine[lc["pid"]]) if len(mine) else np.empty(0, dtype=np.int64)
        part["launches"] = launches = {k: v[lrows] for k, v in lc.items() if k != "runtime_names"}
        launches["runtime_names"] = [(p, n) for p, n in lc["runtime_names"] if mine[p]]
        for c, labels in (("name", "name_cats"), ("cat", "cat_cats")):
            part[c], part[labels] = _compact(part[c], list(cols[labels]))
        n = len(part["tid_code"])      # (one code space for the rows and the launches)
        codes, part["tid_values"] = _compact(np.concatenate([part["tid_code"], launches["tid_code"]]),
                                             list(cols["tid_values"]))
        part["tid_code"], launches["tid_code"] = codes[:n], codes[n:]
        keep = {int(r): k for k, r in enumerate(rows.tolist())}
        comm = [(keep[r[0]],) + tuple(r[1:]) for r in rt.comm_rows if r[0] in keep]
        mem_pids = rt.memory_pids
        mem_rows = _rows_of(mem_pids, pid) if mem_pids is not None else []
        meta = dict(rt.meta)
        meta["device_type"] = _device_type(part, meta)
        out[pid] = RawTrace(path=rt.path, cols=part, comm_rows=comm,
                            memory_events=rt.memory_events.iloc[mem_rows].reset_index(drop=True), meta=meta,
                            thread_names={k: v for k, v in rt.thread_names.items() if k[0] == pid},
                            defects=dict(rt.defects) if i == 0 else {},
                            memory_pids=mem_pids[mem_rows] if mem_pids is not None else None)
    return out
