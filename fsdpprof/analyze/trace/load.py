"""One trace file -> the events frame of :mod:`fsdpprof.analyze.model`: decode, classify, label.  Times in µs."""
from __future__ import annotations

import os
from dataclasses import dataclass, field

import numpy as np
import pandas as pd

from fsdpprof.analyze.load.gc_pause import gc_paused
from fsdpprof.analyze.trace import classify, labels
from fsdpprof.analyze.trace.decode import decode_trace, defect_warnings, split_by_pid
from fsdpprof.errors import UserError, unexpected_as_user_error


CLASSIFY_ONLY = ("stream", "correlation", "ext_id", "cat", "cat_cats")   # classify_arrays' columns for itself


@dataclass
class TraceData:
    """One rank's trace: classified events, memory events and trace metadata."""

    path: str
    events: pd.DataFrame
    memory_events: pd.DataFrame
    meta: dict
    warnings: list[str] = field(default_factory=list)


def load_trace(path: str, *, rank: int | None = None, progress: bool | None = None,
               max_bytes: int | None = None) -> TraceData:
    """Decode, classify and label one trace file (``rank`` overrides distributedInfo's; ``max_bytes``: largest
    JSON accepted once decompressed).  Bad input raises UserError (one line); malformed events are left out and
    said so in ``TraceData.warnings``."""
    path = os.fspath(path)
    with unexpected_as_user_error(f"trace {path}"), gc_paused():
        return _load_trace(path, rank, progress, max_bytes)


def load_trace_parts(path: str, parts: dict, *, progress: bool | None = None,
                     max_bytes: int | None = None) -> dict:
    """A merged timeline decoded once, each rank's process loaded as that rank's trace.  ``parts``: pid -> (rank,
    that rank's trace metadata); returns rank -> TraceData, or the UserError saying why that rank is missing (its
    process holds no event: deleted from the file)."""
    path = os.fspath(path)
    with unexpected_as_user_error(f"trace {path}"), gc_paused():
        rt = decode_trace(path, progress=progress, max_bytes=max_bytes)
        out: dict[int, TraceData | UserError] = {}
        for pid, part in split_by_pid(rt, list(parts)).items():
            rank, meta = parts[pid]
            if not len(part.cols["ts_us"]) and not len(part.memory_events):
                out[rank] = UserError(
                    f"trace {path}: rank {rank} is missing: the merged timeline lists it (process {pid}) but holds "
                    f"no event of it (deleted or cut from the file); write the timeline again with fsdpprof timeline")
                continue
            part.meta = {**part.meta, **meta}
            out[rank] = _trace_data(part, rank)
        return out


def _load_trace(path: str, rank: int | None, progress: bool | None, max_bytes: int | None) -> TraceData:
    return _trace_data(decode_trace(path, progress=progress, max_bytes=max_bytes), rank)


def _trace_data(rt, rank: int | None) -> TraceData:
    warnings: list[str] = defect_warnings(rt.path, rt.defects)
    if rank is None:
        dist = rt.meta.get("distributedInfo") or {}
        rank = dist.get("rank") if isinstance(dist, dict) else None
        rank = rank if isinstance(rank, int) else 0
    c = classify.classify_arrays(rt)   # (releases rt.cols as soon as it has copied them)
    for k in CLASSIFY_ONLY:            # what labels and the frame do not read: freed before they run
        del c[k]
    c, w = labels.assign_arrays(c, rt)
    del c["tid"], c["launch_tid"]
    mem = rt.memory_events
    mem["rank"] = np.int32(rank)
    meta = {**rt.meta, "thread_names": labels.thread_name_records(rt.thread_names)}  # lanes' readable names
    return TraceData(path=rt.path, events=labels.events_frame(c, rank), memory_events=mem, meta=meta,
                     warnings=warnings + w)
