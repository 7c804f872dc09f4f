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

import numpy as np
import pandas as pd

from fsdpprof.analyze import safe_pickle
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

    # ---- device traces
    has_time = False
    has_history: dict[int, bool] = {}
    ooms: list[dict] = []
    seg_ev: list[tuple] = []
    frames_out = []
    for dev, trace in enumerate(traces):
        trace = trace or []
        if trace and "time_us" in trace[0]:
            has_time = True
        n_alloc = 0
        for e in trace:
            if e.get("action") == "alloc":
                n_alloc += 1
                break
        has_history[dev] = n_alloc > 0 or any(e.get("action") in ("free_requested", "free_completed") for e in trace[:1000])
        for i, e in enumerate(trace):
            act = e.get("action")
            if act in _SEG_SIGN:
                seg_ev.append((dev, i, _SEG_SIGN[act] * int(e.get("size", 0))))
            if act == "oom":
                ooms.append({"device": dev, "requested_bytes": int(e.get("size", 0)),
                             "free_bytes": int(e.get("device_free", 0)) if e.get("device_free") is not None else None,
                             "ts_us": float(e.get("time_us", i)), "seq": i, "frames": e.get("frames") or []})
        frames_out.append(_device_allocations(dev, trace, live_blocks, has_time))
    # devices that appear only in segments (no trace at all)
    for dev in sorted({d for d, _ in live_blocks} - set(range(len(traces)))):
        has_history[dev] = False
        frames_out.append(_device_allocations(dev, [], live_blocks, has_time))
    allocs = pd.concat([f for f in frames_out if len(f)], ignore_index=True) if any(len(f) for f in frames_out) \
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


_SEG_SIGN = {"segment_alloc": 1, "segment_map": 1, "segment_free": -1, "segment_unmap": -1}
_ACTION_CODE = {"alloc": 1, "free_requested": 2, "free_completed": 3}


def _device_allocations(dev: int, trace: list, live_blocks: dict, has_time: bool) -> pd.DataFrame:
    """Pair alloc/free entries of one device's trace by address (vectorised) and add the blocks
    alive at snapshot time that were allocated before the trace's first entry."""
    n = len(trace)
    code = np.fromiter((_ACTION_CODE.get(e.get("action"), 0) for e in trace), dtype=np.int8, count=n)
    use_free = 3 if (code == 3).any() else 2
    keep = np.flatnonzero((code == 1) | (code == use_free))
    k_code = code[keep]
    addr = np.fromiter((trace[i]["addr"] for i in keep), dtype=np.int64, count=len(keep))
    size = np.fromiter((trace[i].get("size", 0) for i in keep), dtype=np.int64, count=len(keep))
    if has_time:
        t = np.fromiter((trace[i].get("time_us", np.nan) for i in keep), dtype=np.float64, count=len(keep))
    else:
        t = keep.astype(np.float64)
    t0 = float(t[0]) if len(t) else 0.0

    pr = pair_alloc_free(keep, addr, k_code == 1, t)
    o_alloc, free_seq, free_us, of = pr["alloc_rows"], pr["free_seq"], pr["free_us"], pr["orphan_free_rows"]
    rows_idx = keep[o_alloc]
    streams = np.fromiter((trace[i].get("stream", 0) for i in rows_idx), dtype=np.int64, count=len(rows_idx))
    meta = [trace[i].get("user_metadata", "") or "" for i in rows_idx]
    frames = [trace[i].get("frames") for i in rows_idx]
    parts = [pd.DataFrame({
        "addr": addr[o_alloc], "bytes": size[o_alloc], "alloc_us": t[o_alloc], "free_us": free_us,
        "alloc_seq": rows_idx.astype(np.int64), "free_seq": free_seq.astype(np.int64),
        "device": np.int16(dev), "stream": streams, "before_trace": False, "free_inferred": pr["free_inferred"],
        "user_metadata": pd.Series(meta, dtype="object"), "frames": pd.Series(frames, dtype="object")})]

    # allocations made before the history began: freed in the trace without an alloc entry ...
    if len(of):
        parts.append(pd.DataFrame({
            "addr": addr[of], "bytes": size[of], "alloc_us": t0, "free_us": t[of], "alloc_seq": np.int64(-1),
            "free_seq": keep[of].astype(np.int64), "device": np.int16(dev),
            "stream": [trace[i].get("stream", 0) for i in keep[of]], "before_trace": True, "free_inferred": False,
            "user_metadata": "",
            "frames": pd.Series([None] * len(of), dtype="object")}))
    # ... or still alive at snapshot time (a live block with no open alloc entry)
    open_addrs = set(addr[o_alloc][free_seq == NEVER].tolist())
    pre = [(a, b) for (d, a), b in live_blocks.items() if d == dev and a not in open_addrs]
    if pre:
        parts.append(pd.DataFrame({
            "addr": np.array([a for a, _ in pre], dtype=np.int64),
            "bytes": np.array([int(b.get("size", 0)) for _, b in pre], dtype=np.int64),
            "alloc_us": t0, "free_us": np.nan, "alloc_seq": np.int64(-1), "free_seq": NEVER,
            "device": np.int16(dev), "stream": [b["_stream"] for _, b in pre], "before_trace": True,
            "free_inferred": False, "user_metadata": "", "frames": pd.Series([b.get("frames") or None for _, b in pre], dtype="object")}))
    out = pd.concat(parts, ignore_index=True) if len(parts) > 1 else parts[0]
    out["device"] = out["device"].astype("int16")
    out["before_trace"] = out["before_trace"].astype(bool)
    out["free_inferred"] = out["free_inferred"].astype(bool)
    return out
