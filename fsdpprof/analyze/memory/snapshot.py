"""CUDA memory snapshot (``torch.cuda.memory._snapshot()``) -> allocations frame, segments, OOMs.

Handles every layout seen in the wild: legacy (no ``time_us``), newer (``time_us``,
``compile_context``, ``user_metadata``), expandable segments (``segment_map``/``segment_unmap``),
``oom`` entries, several devices, gzipped files, and snapshots recorded without history
(segments only). Loading goes through :mod:`fsdpprof.analyze.safe_pickle` (no pickle globals).

Allocations frame columns (one row per allocation; bytes are the allocator block sizes):
  addr int64, bytes int64, alloc_us float64, free_us float64 (NaN = alive at snapshot end),
  alloc_seq int64 / free_seq int64 (order keys within the device's trace; -1 = before history,
  INT64_MAX = never freed), device int16, stream int64, before_trace bool (allocated before the
  trace's first entry), free_inferred bool (no free event; the free time is inferred), user_metadata str, frames object (list of {name, filename, line} dicts),
  phase / unit (filled later by categorize).
When a snapshot has no ``time_us`` (legacy), ``alloc_us``/``free_us`` hold the trace entry index
and ``SnapshotData.has_time`` is False.
"""
from __future__ import annotations

import os
from dataclasses import dataclass, field
from itertools import repeat
from operator import itemgetter

import numpy as np
import pandas as pd

from fsdpprof.analyze.memory import safe_pickle
from fsdpprof.errors import UserError

NEVER = np.iinfo(np.int64).max

ALLOC_COLUMNS = ["addr", "bytes", "alloc_us", "free_us", "alloc_seq", "free_seq", "device", "stream",
                 "before_trace", "free_inferred", "user_metadata", "frames"]
SEGMENT_COLUMNS = ["device", "address", "total_bytes", "allocated_bytes", "active_bytes", "stream",
                   "is_expandable", "n_blocks"]


@dataclass
class SnapshotData:
    """One snapshot file, all devices."""

    path: str
    allocations: pd.DataFrame          # ALLOC_COLUMNS, all devices
    segments: pd.DataFrame             # SEGMENT_COLUMNS, state at snapshot time
    ooms: list[dict]                   # device, requested_bytes, free_bytes, ts_us, frames
    annotations: pd.DataFrame          # device, name, start_us, end_us (external_annotations)
    segment_events: pd.DataFrame       # device, seq, delta_bytes: cudaMalloc/free and map/unmap in the trace
    has_history: dict[int, bool]       # device -> trace had alloc/free entries
    has_time: bool                     # trace entries carry time_us
    devices: list[int]                 # devices with segments or trace entries
    allocator_settings: dict = field(default_factory=dict)
    warnings: list[str] = field(default_factory=list)


def load_snapshot(path: str | os.PathLike) -> SnapshotData:
    """Read a snapshot pickle (plain or gzip) safely and turn it into :class:`SnapshotData`."""
    label = os.fspath(path)
    return parse_snapshot(safe_pickle.load(path), label)


def _empty_allocs() -> pd.DataFrame:
    return pd.DataFrame({
        "addr": pd.Series(dtype="int64"), "bytes": pd.Series(dtype="int64"),
        "alloc_us": pd.Series(dtype="float64"), "free_us": pd.Series(dtype="float64"),
        "alloc_seq": pd.Series(dtype="int64"), "free_seq": pd.Series(dtype="int64"),
        "device": pd.Series(dtype="int16"), "stream": pd.Series(dtype="int64"),
        "before_trace": pd.Series(dtype="bool"), "free_inferred": pd.Series(dtype="bool"),
        "user_metadata": pd.Series(dtype="object"),
        "frames": pd.Series(dtype="object")})


def parse_snapshot(snap, label: str = "<snapshot>") -> SnapshotData:
    """Turn an already-unpickled snapshot (dict, or bare list of segments) into SnapshotData."""
    if isinstance(snap, list):  # very old snapshots: just the segment list
        snap = {"segments": snap, "device_traces": []}
    if not isinstance(snap, dict) or "segments" not in snap:
        raise UserError(f"{label}: not a CUDA memory snapshot (no 'segments'); expected a pickle from "
                        f"torch.cuda.memory._dump_snapshot()")
    segments_raw = snap.get("segments") or []
    traces = snap.get("device_traces") or []
    if not isinstance(segments_raw, list) or not isinstance(traces, list):
        raise UserError(f"{label}: malformed CUDA memory snapshot ('segments'/'device_traces' are not lists)")
    warnings: list[str] = []

    # ---- segments (state at snapshot time) and the blocks alive then
    seg_rows = []
    live_blocks: dict[tuple[int, int], dict] = {}
    for s in segments_raw:
        dev = int(s.get("device", 0))
        blocks = s.get("blocks") or []
        seg_rows.append((dev, int(s.get("address", 0)), int(s.get("total_size", 0)),
                         int(s.get("allocated_size", 0)), int(s.get("active_size", 0)),
                         int(s.get("stream", 0)), bool(s.get("is_expandable", False)), len(blocks)))
        for b in blocks:
            if b.get("state") in ("active_allocated", "active_pending_free"):
                b2 = dict(b)
                b2["_stream"] = int(s.get("stream", 0))
                live_blocks[(dev, int(b["address"]))] = b2
    segments = pd.DataFrame(seg_rows, columns=SEGMENT_COLUMNS)

    # ---- device traces: one pass over each trace reads the actions; alloc/free entries are then
    # read column by column (numpy), segment and OOM entries (few) one by one
    has_time = False
    has_history: dict[int, bool] = {}
    ooms: list[dict] = []
    seg_ev: list[tuple] = []
    parts: list[dict] = []
    for dev, trace in enumerate(traces):
        trace = trace or []
        if trace and "time_us" in trace[0]:
            has_time = True
        code = np.fromiter(map(_ACTION_CODE.get, [e.get("action") for e in trace], repeat(0)),
                           dtype=np.int8, count=len(trace))
        has_history[dev] = bool((code == 1).any()) or bool(((code[:1000] == 2) | (code[:1000] == 3)).any())
        for i in np.flatnonzero(code >= _SEG_MAP).tolist():
            e = trace[i]
            if code[i] == _OOM:
                ooms.append({"device": dev, "requested_bytes": int(e.get("size", 0)),
                             "free_bytes": int(e.get("device_free", 0)) if e.get("device_free") is not None else None,
                             "ts_us": float(e.get("time_us", i)), "seq": i, "frames": e.get("frames") or []})
            else:
                seg_ev.append((dev, i, (1 if code[i] == _SEG_MAP else -1) * int(e.get("size", 0))))
        parts.append(_device_allocations(dev, trace, live_blocks, has_time, code))
    # devices that appear only in segments (no trace at all)
    for dev in sorted({d for d, _ in live_blocks} - set(range(len(traces)))):
        has_history[dev] = False
        parts.append(_device_allocations(dev, [], live_blocks, has_time))
    parts = [p for p in parts if len(p["addr"])]
    allocs = _allocs_frame({c: np.concatenate([p[c] for p in parts]) for c in ALLOC_COLUMNS}) if parts \
        else _empty_allocs()

    ann_rows = []
    open_ann: dict[tuple, float] = {}
    for a in snap.get("external_annotations") or []:
        key = (a.get("device", 0), a.get("name"))
        if a.get("stage") == "START":
            open_ann[key] = float(a.get("time_us", np.nan))
        elif a.get("stage") == "END" and key in open_ann:
            ann_rows.append((int(key[0]), str(key[1]), open_ann.pop(key), float(a.get("time_us", np.nan))))
    annotations = pd.DataFrame(ann_rows, columns=["device", "name", "start_us", "end_us"])

    devices = sorted(set(segments["device"].tolist()) | {d for d, h in has_history.items()
                                                          if h or (d < len(traces) and traces[d])})
    if not segments_raw and not any(traces):
        warnings.append(f"{label}: snapshot holds no CUDA memory at all (no segments, no trace): was it taken "
                        f"on the process that used the GPU?")
    elif not any(has_history.values()):
        warnings.append(f"{label}: snapshot was recorded without allocation history "
                        f"(torch.cuda.memory._record_memory_history was off): peak taken from segments, "
                        f"timeline unavailable")
    elif not has_time:
        warnings.append(f"{label}: legacy snapshot without time_us: times are trace entry indices")
    segment_events = pd.DataFrame(seg_ev, columns=["device", "seq", "delta_bytes"])
    return SnapshotData(path=label, allocations=allocs, segments=segments, segment_events=segment_events,
                        ooms=ooms, annotations=annotations,
                        has_history=has_history, has_time=has_time, devices=devices,
                        allocator_settings=dict(snap.get("allocator_settings") or {}), warnings=warnings)


def pair_alloc_free(seq: np.ndarray, addr: np.ndarray, is_alloc: np.ndarray, t: np.ndarray) -> dict:
    """Pair allocation and free events by address, vectorised.

    ``seq`` is each event's position in time order (ascending within an address), ``t`` its time.
    Returns ``alloc_rows`` (indices of alloc events), their ``free_seq`` (``NEVER`` when not freed),
    ``free_us`` (NaN) and ``free_inferred`` (no free event: ended by a second alloc at the address),
    and ``orphan_free_rows``: frees of memory allocated before the events began.
    """
    order = np.lexsort((seq, addr))        # by address, then time order
    a_s, alloc_s = addr[order], is_alloc[order]
    n = len(order)
    same_next = np.zeros(n, dtype=bool)
    same_next[:-1] = a_s[:-1] == a_s[1:]
    nxt_free = np.zeros(n, dtype=bool)
    nxt_free[:-1] = ~alloc_s[1:]
    paired = alloc_s & same_next & nxt_free
    # an address cannot be allocated twice: a second alloc ends the first (its free event was lost
    # or reordered); the free then happens at the second alloc
    realloc = alloc_s & same_next & ~nxt_free
    prev_paired = np.zeros(n, dtype=bool)
    prev_paired[1:] = paired[:-1]
    orphan = (~alloc_s) & ~prev_paired
    alloc_pos = np.flatnonzero(alloc_s)
    has_free = paired[alloc_pos] | realloc[alloc_pos]
    free_idx = np.where(has_free, order[np.minimum(alloc_pos + 1, n - 1)], 0)
    return {"alloc_rows": order[alloc_pos],
            "free_seq": np.where(has_free, seq[free_idx], NEVER).astype(np.int64),
            "free_us": np.where(has_free, t[free_idx], np.nan),
            "orphan_free_rows": order[np.flatnonzero(orphan)], "n_realloc": int(realloc.sum()),
            "free_inferred": realloc[alloc_pos]}


# trace actions as int8 codes: alloc/free pair up; >= _SEG_MAP are read one by one
_SEG_MAP, _SEG_UNMAP, _OOM = 4, 5, 6
_ACTION_CODE = {"alloc": 1, "free_requested": 2, "free_completed": 3, "segment_alloc": _SEG_MAP,
                "segment_map": _SEG_MAP, "segment_free": _SEG_UNMAP, "segment_unmap": _SEG_UNMAP, "oom": _OOM}


def _allocs_frame(cols: dict) -> pd.DataFrame:
    """The allocations DataFrame from its columns as arrays (ALLOC_COLUMNS order and dtypes)."""
    return pd.DataFrame({
        c: pd.Series(cols[c], dtype=object) if c in ("user_metadata", "frames") else cols[c] for c in ALLOC_COLUMNS})


def _device_allocations(dev: int, trace: list, live_blocks: dict, has_time: bool,
                        code: np.ndarray | None = None) -> dict:
    """Pair alloc/free entries of one device's trace by address (vectorised) and add the blocks
    alive at snapshot time that were allocated before the trace's first entry. Returns the
    ALLOC_COLUMNS as arrays (paired allocations, then frees without an alloc, then live blocks);
    ``code``: the entries' action codes when the caller has them."""
    n = len(trace)
    if code is None:
        code = np.fromiter(map(_ACTION_CODE.get, [e.get("action") for e in trace], repeat(0)),
                           dtype=np.int8, count=n)
    use_free = 3 if (code == 3).any() else 2
    keep = np.flatnonzero((code == 1) | (code == use_free))
    kept = [trace[i] for i in keep.tolist()]
    k_code = code[keep]
    addr = np.fromiter(map(itemgetter("addr"), kept), dtype=np.int64, count=len(kept))
    size = np.fromiter([e.get("size", 0) for e in kept], dtype=np.int64, count=len(kept))
    if has_time:
        t = np.fromiter([e.get("time_us", np.nan) for e in kept], dtype=np.float64, count=len(kept))
    else:
        t = keep.astype(np.float64)
    t0 = float(t[0]) if len(t) else 0.0

    pr = pair_alloc_free(keep, addr, k_code == 1, t)
    o_alloc, free_seq, free_us, of = pr["alloc_rows"], pr["free_seq"], pr["free_us"], pr["orphan_free_rows"]
    rows_idx = keep[o_alloc]
    alloc_entries = [kept[i] for i in o_alloc.tolist()]
    na = len(alloc_entries)
    # fromiter keeps each frame list one object (an array built from equal-length lists would be 2-D)
    meta = np.fromiter([e.get("user_metadata", "") or "" for e in alloc_entries], dtype=object, count=na)
    frames = np.fromiter([e.get("frames") for e in alloc_entries], dtype=object, count=na)
    cols = {"addr": [addr[o_alloc]], "bytes": [size[o_alloc]], "alloc_us": [t[o_alloc]], "free_us": [free_us],
            "alloc_seq": [rows_idx.astype(np.int64)], "free_seq": [free_seq.astype(np.int64)],
            "stream": [np.fromiter([e.get("stream", 0) for e in alloc_entries], dtype=np.int64, count=na)],
            "before_trace": [np.zeros(na, bool)], "free_inferred": [np.asarray(pr["free_inferred"], dtype=bool)],
            "user_metadata": [meta], "frames": [frames]}

    def add(**kw):
        for c, v in kw.items():
            cols[c].append(v)

    # allocations made before the history began: freed in the trace without an alloc entry ...
    if len(of):
        m = len(of)
        add(addr=addr[of], bytes=size[of], alloc_us=np.full(m, t0), free_us=t[of],
            alloc_seq=np.full(m, -1, dtype=np.int64), free_seq=keep[of].astype(np.int64),
            stream=np.array([kept[i].get("stream", 0) for i in of.tolist()], dtype=np.int64),
            before_trace=np.ones(m, bool), free_inferred=np.zeros(m, bool),
            user_metadata=np.full(m, "", dtype=object), frames=np.full(m, None, dtype=object))
    # ... or still alive at snapshot time (a live block with no open alloc entry)
    open_addrs = set(addr[o_alloc][free_seq == NEVER].tolist())
    pre = [(a, b) for (d, a), b in live_blocks.items() if d == dev and a not in open_addrs]
    if pre:
        m = len(pre)
        fr = np.fromiter([b.get("frames") or None for _, b in pre], dtype=object, count=m)
        add(addr=np.array([a for a, _ in pre], dtype=np.int64),
            bytes=np.array([int(b.get("size", 0)) for _, b in pre], dtype=np.int64),
            alloc_us=np.full(m, t0), free_us=np.full(m, np.nan), alloc_seq=np.full(m, -1, dtype=np.int64),
            free_seq=np.full(m, NEVER, dtype=np.int64), stream=np.array([b["_stream"] for _, b in pre], dtype=np.int64),
            before_trace=np.ones(m, bool), free_inferred=np.zeros(m, bool),
            user_metadata=np.full(m, "", dtype=object), frames=fr)
    out = {c: np.concatenate(v) if len(v) > 1 else v[0] for c, v in cols.items()}
    out["device"] = np.full(len(out["addr"]), dev, dtype=np.int16)
    return out
