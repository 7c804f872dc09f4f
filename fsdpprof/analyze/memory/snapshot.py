"""CUDA memory snapshot (``torch.cuda.memory._snapshot()``, every layout: legacy without ``time_us``, expandable
segments, OOM entries, several devices, gzip, no history) -> allocations frame, segments, OOMs.

Allocations (ALLOC_COLUMNS, one row per allocation): requested bytes (torch's convention); alloc_us / free_us
(NaN: alive at the end; trace entry indices when ``has_time`` is False); alloc_seq / free_seq order keys in the
device's trace (-1: before the history, NEVER: never freed); frames / free_frames the stacks (lists of dicts).
"""
from __future__ import annotations

import os
from dataclasses import dataclass, field

import numpy as np
import pandas as pd

from fsdpprof import options
from fsdpprof.analyze.memory import safe_pickle
from fsdpprof.analyze.trace.decode import NAME_MAX_CHARS, TIME_MAX_US, cut_text
from fsdpprof.errors import UserError, unexpected_as_user_error

NEVER = np.iinfo(np.int64).max
NO_ADDRESS = np.int64(-1)   # addr of a row that is no one allocation (a CPU run's other threads' bytes)

ALLOC_DTYPES = {"addr": "int64", "bytes": "int64", "alloc_us": "float64", "free_us": "float64", "alloc_seq": "int64",
                "free_seq": "int64", "device": "int16", "stream": "int64", "before_trace": "bool",
                "free_inferred": "bool", "user_metadata": "object", "frames": "object", "free_frames": "object"}
ALLOC_COLUMNS = list(ALLOC_DTYPES)
SEGMENT_COLUMNS = ["device", "address", "total_bytes", "allocated_bytes", "active_bytes", "stream",
                   "is_expandable", "n_blocks", "requested_bytes"]
# every block of every segment at snapshot time (fragmentation.py reads the free ones): segment_type is the
# allocator's pool ("small": requests up to 1 MiB, "large"; "" when the snapshot does not say), state one of
# BLOCK_STATES
BLOCK_COLUMNS = ["device", "segment_address", "segment_type", "is_expandable", "address", "size", "state"]
BLOCK_STATES = ("active_allocated", "active_pending_free", "inactive")


@dataclass
class SnapshotData:
    """One snapshot file, all devices."""

    path: str
    allocations: pd.DataFrame          # ALLOC_COLUMNS, all devices
    segments: pd.DataFrame             # SEGMENT_COLUMNS, state at snapshot time
    ooms: list[dict]                   # device, requested_bytes, free_bytes, ts_us, frames
    segment_events: pd.DataFrame       # device, seq, delta_bytes, address, action: cudaMalloc/free and map/unmap
    has_history: dict[int, bool]       # device -> trace had alloc/free entries
    has_time: bool                     # trace entries carry time_us
    devices: list[int]                 # devices with segments or trace entries
    allocator_settings: dict = field(default_factory=dict)
    warnings: list[str] = field(default_factory=list)
    defects: list[str] = field(default_factory=list)   # the warnings about malformed input (also in warnings)
    objects_visited: int = 0           # segments, blocks, entries and frames the parse visited (see OBJECTS_PER_BYTE)
    blocks: pd.DataFrame = field(default_factory=lambda: pd.DataFrame(columns=BLOCK_COLUMNS))  # BLOCK_COLUMNS

    def reserved_at(self, device: int, seq: int | None = None) -> int | None:
        """Bytes in ``device``'s segments after trace entry ``seq`` (None: at snapshot time); None without any."""
        m = self.segments["device"].to_numpy() == device
        if not m.any():
            return None
        se = self.segment_events
        later = (se["device"].to_numpy() == device) & (se["seq"].to_numpy() > (NEVER if seq is None else seq))
        return int(self.segments["total_bytes"].to_numpy()[m].sum() - se["delta_bytes"].to_numpy()[later].sum())


# Limits on what a snapshot file may make us do (real snapshots are far below them).
MAX_SNAPSHOT_BYTES = 8 << 30     # the pickle, decompressed
SIZE_MAX = 1 << 40               # bytes of one block / segment / allocation (1 TiB: more than any GPU has)
DEVICE_MAX = options.MAX_CUDA_DEVICE
# Objects visited (segments, blocks, entries, frames; each time reached, memo-shared or not): at most
# OBJECTS_PER_BYTE per byte of pickle (the densest real snapshot: 0.39), at least OBJECTS_MIN; a pickle bomb
# (entries sharing one huge frame list) is refused before any of them is visited.
OBJECTS_PER_BYTE = 20
OBJECTS_MIN = 2_000_000


def load_snapshot(path: str | os.PathLike, *, max_bytes: int | None = None,
                  max_objects: int | None = None) -> SnapshotData:
    """A snapshot pickle (plain or gzip) read safely; at most ``max_bytes`` decompressed (MAX_SNAPSHOT_BYTES) and
    ``max_objects`` visited (OBJECTS_PER_BYTE of them); bad input: a one-line UserError."""
    label = os.fspath(path)
    with unexpected_as_user_error(f"snapshot {label}"):
        snap, nbytes = safe_pickle.load_sized(path, max_bytes=MAX_SNAPSHOT_BYTES if max_bytes is None else max_bytes)
        limit = max(OBJECTS_MIN, OBJECTS_PER_BYTE * nbytes) if max_objects is None else max_objects
        return parse_snapshot(snap, label, max_objects=limit)


class _Checker:
    """Counts what a snapshot makes the parse visit (against ``limit``) and what was malformed."""

    def __init__(self, label: str, limit: int) -> None:
        self.label = label
        self.limit = limit
        self.visited = 0
        self.defects: dict[str, int] = {}
        self.names: dict[str, list[str]] = {}      # kind -> what was left out, where a warning names them

    def visit(self, n: int) -> None:
        self.visited += n
        if self.visited > self.limit:
            raise UserError(f"{self.label}: the snapshot makes more than {self.limit:,} objects to visit (entries, "
                            f"blocks, frames reached through shared references); refusing it as a pickle bomb or a "
                            f"corrupt file (load_snapshot(path, max_objects=N) raises the limit)")

    def bad(self, what: str, n: int = 1) -> None:
        if n:
            self.defects[what] = self.defects.get(what, 0) + n

    def warnings(self) -> list[str]:
        return [f"{self.label}: "
                + _SNAP_DEFECTS[k].format(n=n, max=NAME_MAX_CHARS, names=", ".join(self.names.get(k, [])))
                for k, n in self.defects.items() if n]


_SNAP_DEFECTS = {
    "segment": "{n:,} segment(s) malformed (not a dict, or an address / size / device that is missing or not a "
               "plausible integer): left out",
    "block": "{n:,} block(s) of segments malformed (not a dict, or an address / size that is missing or not a "
             "plausible integer): left out",
    "segment_size": "{n:,} segment(s) of 0 bytes, or with more bytes allocated / active than their size: left "
                    "out with their blocks",
    "segment_allocated": "{n:,} segment(s) say fewer bytes allocated than their blocks in use hold: the blocks' "
                         "sum taken",
    "segment_overlap": "{n:,} segment(s) overlapping another segment of their device: left out with their blocks",
    "block_empty": "{n:,} block(s) of segments of 0 bytes: left out",
    "block_outside": "{n:,} block(s) lying (partly) outside their segment: left out",
    "block_overlap": "{n:,} block(s) overlapping another block of their segment: left out",
    "flag": "{n:,} segment(s) whose is_expandable is not true / false: read as not expandable",
    "setting": "{n:,} allocator setting(s) that must be true / false and are not ({names}): left out",
    "block_size": "{n:,} live block(s) of segments have no size: the size their tensor requested taken instead "
                  "(the allocator's rounding up to 512 B unknown)",
    "trace": "{n:,} device trace(s) are not lists: read as empty",
    "entry": "{n:,} trace entries malformed (not a dict, no action, or an address / size / time that is missing "
             "or not a plausible number): left out",
    "field": "{n:,} trace entry field(s) of the wrong type (stream, frames, user_metadata, device_free): ignored",
    "long": "{n:,} user_metadata text(s) longer than {max:,} characters were cut",
}


def _int_ok(v, lo: int, hi: int) -> bool:
    return type(v) is int and lo <= v <= hi


def _time_ok(v) -> bool:
    return (type(v) is float or type(v) is int) and -TIME_MAX_US <= v <= TIME_MAX_US    # (NaN fails)


def _ints(values: list, lo: int, hi: int) -> tuple[np.ndarray, np.ndarray]:
    """(int64 array, valid) of ``values``: valid where an int in [lo, hi] (0 elsewhere)."""
    if values and set(map(type, values)) == {int}:
        try:
            arr = np.asarray(values, dtype=np.int64)
            ok = (arr >= lo) & (arr <= hi)
            return np.where(ok, arr, 0), ok
        except OverflowError:
            pass
    ok = np.fromiter((_int_ok(v, lo, hi) for v in values), dtype=bool, count=len(values))
    return np.fromiter((v if k else 0 for v, k in zip(values, ok.tolist())), dtype=np.int64, count=len(values)), ok


def _times(values: list) -> tuple[np.ndarray, np.ndarray]:
    """(float64 array, valid) of ``values``: valid where a finite number within TIME_MAX_US."""
    ok = np.fromiter(map(_time_ok, values), dtype=bool, count=len(values))
    return np.fromiter((float(v) if k else np.nan for v, k in zip(values, ok.tolist())), dtype=np.float64,
                       count=len(values)), ok


def _segments(segments_raw: list, chk: _Checker) -> tuple[list, dict, list]:
    """Segment rows (SEGMENT_COLUMNS), the blocks alive at snapshot time and every block's row (BLOCK_COLUMNS);
    what breaks the allocator's rules is left out, counted: a malformed segment or block, a segment of 0 bytes (or
    allocated / active bytes over its size) or overlapping another, a block of 0 bytes, outside its segment or
    overlapping another block."""
    kept: list[tuple] = []      # (device, address, end, its row, its blocks' rows, its live blocks)
    for s in segments_raw:
        if type(s) is not dict:
            chk.bad("segment")
            continue
        # (every torch version writes a segment's address and total size: one without them is malformed)
        dev, addr, stream = s.get("device", 0), s.get("address"), s.get("stream", 0)
        sizes = [s.get("total_size")] + [s.get(k, 0) for k in ("allocated_size", "active_size")]
        blocks = s.get("blocks") or []
        if not (_int_ok(dev, 0, DEVICE_MAX) and _int_ok(addr, 0, NEVER) and _int_ok(stream, -NEVER - 1, NEVER)
                and all(_int_ok(x, 0, SIZE_MAX) for x in sizes) and type(blocks) is list):
            chk.bad("segment")
            continue
        total = sizes[0]
        if total == 0 or sizes[1] > total or sizes[2] > total:
            chk.bad("segment_size")
            continue
        chk.visit(len(blocks))
        seg_type = s.get("segment_type") if s.get("segment_type") in ("small", "large") else ""
        flag = s.get("is_expandable")
        if flag is not None and type(flag) is not bool:         # ("yes please" is not true)
            chk.bad("flag")
        expandable = flag is True
        found = []              # (address, size, live, block) of the well-formed blocks
        b_addr = addr
        for b in blocks:
            if type(b) is not dict:
                chk.bad("block")
                continue
            # legacy blocks carry no address: torch's tools lay them out from the segment's address
            b_at = b.get("address", b_addr)
            b_size = b.get("size", 0)
            live = b.get("state") == "active_allocated"
            if "size" not in b and live:
                # no block size: the size its tensor requested stands for it (the allocator rounds it up to
                # 512 B; the peak counts requested sizes anyway)
                b_size = _requested_size(b, None)
                if b_size is not None:
                    chk.bad("block_size")
            if _int_ok(b_size, 0, SIZE_MAX):
                b_addr += b_size
            if not (_int_ok(b_at, 0, NEVER) and _int_ok(b_size, 0, SIZE_MAX)) \
                    or not (live or b.get("state") in BLOCK_STATES):
                chk.bad("block")
                continue
            found.append((b_at, b_size, live, b))
        rows, live_blocks = [], {}
        requested = 0
        pos = addr              # where the blocks kept so far end (in address order)
        for b_at, b_size, live, b in sorted(found, key=lambda x: x[0]):
            if b_size == 0:
                chk.bad("block_empty")
                continue
            if b_at < addr or b_at + b_size > addr + total:
                chk.bad("block_outside")
                continue
            if b_at < pos:
                chk.bad("block_overlap")
                continue
            pos = b_at + b_size
            if not live:
                rows.append((dev, addr, seg_type, expandable, b_at, b_size, b["state"]))
                continue
            fr = b.get("frames")
            if type(fr) is not list:
                fr = None if type(b.get("history")) is not list or not b["history"] \
                    or type(b["history"][0]) is not dict else b["history"][0].get("frames")
                fr = fr if type(fr) is list else None
            if fr is not None:
                chk.visit(len(fr))
            rows.append((dev, addr, seg_type, expandable, b_at, b_size, "active_allocated"))
            req = _requested_size(b, b_size)
            requested += req
            live_blocks[(dev, b_at)] = {"size": req, "block_size": b_size, "frames": fr, "_stream": stream}
        # the allocator's allocated bytes are its blocks in use: fewer contradicts them (the blocks' sum taken)
        allocated = sizes[1]
        in_use = sum(r[5] for r in rows if r[6] == "active_allocated")
        if in_use > allocated:
            chk.bad("segment_allocated")
            allocated = in_use
        seg_req = s.get("requested_size")
        row = (dev, addr, total, allocated, sizes[2], stream, expandable, len(blocks),
               seg_req if _int_ok(seg_req, 0, allocated) else requested)
        kept.append((dev, addr, addr + total, row, rows, live_blocks))
    # segments of one device that overlap: the first in address order kept
    ends: dict[int, int] = {}
    drop = set()
    for i in sorted(range(len(kept)), key=lambda i: (kept[i][0], kept[i][1])):
        dev, a, e = kept[i][:3]
        if a < ends.get(dev, -1):
            drop.add(i)
            continue
        ends[dev] = e
    chk.bad("segment_overlap", len(drop))
    seg_rows, block_rows, live = [], [], {}
    for i, (_, _, _, row, rows, lb) in enumerate(kept):
        if i not in drop:
            seg_rows.append(row)
            block_rows += rows
            live.update(lb)
    return seg_rows, live, block_rows


# allocator settings that are true / false in every torch that writes them
BOOL_SETTINGS = ("expandable_segments", "release_lock_on_cudamalloc", "pinned_use_cuda_host_register",
                 "graph_capture_record_stream_reuse")


def _settings(settings, chk: _Checker) -> dict:
    """The snapshot's allocator_settings ({} when not a dict); a BOOL_SETTINGS one that is not a bool left out."""
    if type(settings) is not dict:
        return {}
    bad = [k for k in BOOL_SETTINGS if k in settings and type(settings[k]) is not bool]
    chk.bad("setting", len(bad))
    chk.names["setting"] = bad
    return {k: v for k, v in settings.items() if k not in bad}


def _requested_size(b: dict, size: int | None) -> int | None:
    """Bytes a live block's tensor asked for, as torch's _memory_viz.py reads it: ``requested_size``, the first history
    entry's ``real_size`` (legacy), else ``size`` (None: the requested size alone, None without one)."""
    req = b.get("requested_size")
    if req is None and type(b.get("history")) is list and b["history"] and type(b["history"][0]) is dict:
        req = b["history"][0].get("real_size")
    if size is None:
        return req if _int_ok(req, 1, SIZE_MAX) else None
    return req if _int_ok(req, 0, size) and req > 0 else size


def parse_snapshot(snap, label: str = "<snapshot>", *, max_objects: int | None = None) -> SnapshotData:
    """An already-unpickled snapshot (dict, or bare list of segments) as SnapshotData.  Not a snapshot: UserError;
    malformed parts are left out (one counted warning per kind); at most ``max_objects`` objects are visited."""
    if isinstance(snap, list):  # very old snapshots: just the segment list
        snap = {"segments": snap, "device_traces": []}
    if not isinstance(snap, dict) or "segments" not in snap:
        raise UserError(f"{label}: not a CUDA memory snapshot (no 'segments'); expected a pickle from "
                        f"torch.cuda.memory._dump_snapshot()")
    segments_raw, traces = ([] if snap.get(k) is None else snap[k] for k in ("segments", "device_traces"))
    if not isinstance(segments_raw, list) or not isinstance(traces, list):
        raise UserError(f"{label}: malformed CUDA memory snapshot ('segments'/'device_traces' are not lists)")
    chk = _Checker(label, OBJECTS_MIN if max_objects is None else max_objects)
    chk.visit(len(segments_raw) + len(traces))
    good = [t if type(t) is list else [] for t in traces]
    chk.bad("trace", sum(1 for t, g in zip(traces, good) if t is not None and t is not g))
    traces = good
    chk.visit(sum(map(len, traces)))       # before any entry is read: shared-reference bombs stop here
    warnings: list[str] = []

    # ---- segments (state at snapshot time) and the blocks alive then
    seg_rows, live_blocks, block_rows = _segments(segments_raw, chk)

    # ---- device traces: one pass over each trace reads the actions; alloc/free entries are then
    # read column by column (numpy), segment and OOM entries (few) one by one
    has_history: dict[int, bool] = {}
    ooms: list[dict] = []
    seg_ev: list[tuple] = []
    parts: list[dict] = []
    first = next((t[0] for t in traces if t), None)
    has_time = type(first) is dict and "time_us" in first
    for dev, trace in enumerate(traces):
        n0 = len(trace)
        if set(map(type, trace)) - {dict}:
            trace = [e for e in trace if type(e) is dict]
        actions = [e.get("action") for e in trace]
        if set(map(type, actions)) - {str}:          # an entry without an action says nothing
            trace = [e for e, a in zip(trace, actions) if type(a) is str]
            actions = [e["action"] for e in trace]
        chk.bad("entry", n0 - len(trace))
        code = np.fromiter((_ACTION_CODE.get(a, 0) for a in actions), dtype=np.int8, count=len(trace))
        has_history[dev] = bool((code == 1).any()) or bool(((code[:1000] == 2) | (code[:1000] == 3)).any())
        for i in np.flatnonzero(code >= _SEG_MAP).tolist():
            e = trace[i]
            size = e.get("size", 0)
            t = e.get("time_us", i) if has_time else i
            if not (_int_ok(size, 0, SIZE_MAX) and _time_ok(t)):
                chk.bad("entry")
                continue
            if code[i] == _OOM:
                free = e.get("device_free")
                if free is not None and not _int_ok(free, 0, SIZE_MAX):
                    chk.bad("field")
                    free = None
                frames = e.get("frames")
                ooms.append({"device": dev, "requested_bytes": size, "free_bytes": free, "ts_us": float(t), "seq": i,
                             "frames": frames if type(frames) is list else []})
            else:       # (address -1: not a plausible one)
                seg_ev.append((dev, i, (1 if code[i] == _SEG_MAP else -1) * size,
                               e["addr"] if _int_ok(e.get("addr"), 0, NEVER) else -1, e.get("action")))
        parts.append(_device_allocations(dev, trace, live_blocks, has_time, code, chk))
    # devices that appear only in segments (no trace at all)
    for dev in sorted({d for d, _ in live_blocks} - set(range(len(traces)))):
        has_history[dev] = False
        parts.append(_device_allocations(dev, [], live_blocks, has_time, np.zeros(0, np.int8), chk))
    parts = [p for p in parts if len(p["addr"])]
    allocs = pd.DataFrame({c: pd.Series(np.concatenate([p[c] for p in parts]) if parts else [], dtype=t)
                           for c, t in ALLOC_DTYPES.items()})
    if float(allocs["bytes"].to_numpy().sum(dtype=np.float64)) >= 2.0 ** 62:
        raise UserError(f"{label}: the allocations add up to more than 4 EiB; the sizes are not real, is the file corrupt?")

    devices = sorted({r[0] for r in seg_rows} | {d for d, h in has_history.items()
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
    settings = _settings(snap.get("allocator_settings"), chk)
    n_items = len(segments_raw) + sum(map(len, traces))
    n_bad = sum(chk.defects.get(k, 0) for k in ("segment", "segment_size", "segment_overlap", "entry"))
    defects = chk.warnings()
    said = "; ".join(d[len(label) + 2:] for d in defects)       # what was malformed, without the label
    if n_bad and 2 * n_bad > n_items:
        raise UserError(f"{label}: {n_bad:,} of its {n_items:,} segments and trace entries are malformed ({said}); it "
                        f"is not a snapshot fsdpprof can read: is the file corrupt?")
    if len(allocs) == 0 and any(v for k, v in chk.defects.items() if k.startswith(("segment", "block", "entry"))):
        raise UserError(f"{label}: no allocation is left once its malformed parts are left out ({said}); it is not "
                        f"a snapshot fsdpprof can read: is the file corrupt?")
    segment_events = pd.DataFrame(seg_ev, columns=["device", "seq", "delta_bytes", "address", "action"])
    return SnapshotData(path=label, allocations=allocs, segments=pd.DataFrame(seg_rows, columns=SEGMENT_COLUMNS),
                        segment_events=segment_events,
                        ooms=ooms, has_history=has_history, has_time=has_time, devices=devices,
                        allocator_settings=settings,
                        warnings=defects + warnings, defects=defects, objects_visited=chk.visited,
                        blocks=pd.DataFrame(block_rows, columns=BLOCK_COLUMNS))


def pair_alloc_free(seq: np.ndarray, addr: np.ndarray, is_alloc: np.ndarray, t: np.ndarray) -> dict:
    """Alloc and free events (``seq``: order, ``t``: time) paired by address: ``alloc_rows`` with their ``free_seq``
    (NEVER), ``free_us`` (NaN) and ``free_inferred`` (ended by a second alloc at the address), ``n_realloc``, and
    ``orphan_free_rows``: frees of memory allocated before the events began."""
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


def _device_allocations(dev: int, trace: list, live_blocks: dict, has_time: bool, code: np.ndarray,
                        chk: _Checker) -> dict:
    """ALLOC_COLUMNS as arrays of one device: its trace's alloc / free entries (dicts, action ``code``) paired by
    address, then frees without an alloc, then blocks alive at snapshot time allocated before the trace."""
    use_free = 3 if (code == 3).any() else 2
    keep = np.flatnonzero((code == 1) | (code == use_free))
    kept = [trace[i] for i in keep.tolist()]
    addr, ok = _ints([e.get("addr") for e in kept], 0, NEVER)
    size, ok_size = _ints([e.get("size", 0) for e in kept], 0, SIZE_MAX)
    ok &= ok_size
    if has_time:
        t, ok_time = _times([e.get("time_us") for e in kept])
        ok &= ok_time
    stream, ok_stream = _ints([e.get("stream", 0) for e in kept], -NEVER - 1, NEVER)
    chk.bad("field", int(np.count_nonzero(~ok_stream)))
    if not ok.all():
        chk.bad("entry", int(np.count_nonzero(~ok)))
        sel = np.flatnonzero(ok)
        keep, addr, size, stream = keep[sel], addr[sel], size[sel], stream[sel]
        kept = [kept[i] for i in sel.tolist()]
        if has_time:
            t = t[sel]
    if not has_time:
        t = keep.astype(np.float64)
    k_code = code[keep]
    t0 = float(t[0]) if len(t) else 0.0

    pr = pair_alloc_free(keep, addr, k_code == 1, t)
    o_alloc, free_seq, free_us, of = pr["alloc_rows"], pr["free_seq"], pr["free_us"], pr["orphan_free_rows"]
    rows_idx = keep[o_alloc]
    alloc_entries = [kept[i] for i in o_alloc.tolist()]
    na = len(alloc_entries)
    # fromiter keeps each frame list one object (an array built from equal-length lists would be 2-D)
    meta = np.fromiter([_meta_text(e.get("user_metadata"), chk) for e in alloc_entries], dtype=object, count=na)
    frame_lists = [e.get("frames") for e in alloc_entries]
    if set(map(type, frame_lists)) - {list, type(None)}:
        chk.bad("field", sum(1 for f in frame_lists if f is not None and type(f) is not list))
        frame_lists = [f if type(f) is list else None for f in frame_lists]
    chk.visit(sum(map(len, filter(None, frame_lists))))
    frames = np.fromiter(frame_lists, dtype=object, count=na)
    free_frames = np.fromiter([_free_frames(trace, int(fs), int(a)) if fs != NEVER else None
                               for fs, a in zip(free_seq.tolist(), addr[o_alloc].tolist())], dtype=object, count=na)
    chk.visit(sum(map(len, filter(None, free_frames))))
    # allocations made before the history began: freed in the trace without an alloc entry, or still alive at
    # snapshot time (a live block with no open alloc entry)
    open_addrs = set(addr[o_alloc][free_seq == NEVER].tolist())
    pre = [(a, b) for (d, a), b in live_blocks.items() if d == dev and a not in open_addrs]
    m = len(of) + len(pre)
    fr_of = [_free_frames(trace, int(fs), int(a)) for fs, a in zip(keep[of].tolist(), addr[of].tolist())]
    out = {"addr": np.concatenate([addr[o_alloc], addr[of], np.array([a for a, _ in pre], dtype=np.int64)]),
           "bytes": np.concatenate([size[o_alloc], size[of], np.array([b.get("size", 0) for _, b in pre], np.int64)]),
           "alloc_us": np.concatenate([t[o_alloc], np.full(m, t0)]),
           "free_us": np.concatenate([free_us, t[of], np.full(len(pre), np.nan)]),
           "alloc_seq": np.concatenate([rows_idx, np.full(m, -1)]).astype(np.int64),
           "free_seq": np.concatenate([free_seq, keep[of], np.full(len(pre), NEVER)]).astype(np.int64),
           "device": np.full(na + m, dev, dtype=np.int16),
           "stream": np.concatenate([stream[o_alloc], stream[of], np.array([b["_stream"] for _, b in pre], np.int64)]),
           "before_trace": np.arange(na + m) >= na,
           "free_inferred": np.concatenate([np.asarray(pr["free_inferred"], dtype=bool), np.zeros(m, bool)]),
           "user_metadata": np.concatenate([meta, np.full(m, "", dtype=object)]),
           "frames": np.concatenate([frames, np.full(len(of), None, dtype=object),
                                     np.fromiter([b.get("frames") or None for _, b in pre], dtype=object,
                                                 count=len(pre))]),
           "free_frames": np.concatenate([free_frames, np.fromiter(fr_of + [None] * len(pre), dtype=object,
                                                                   count=m)])}
    return out


def _free_frames(trace: list, i: int, addr: int):
    """The stack of the free at trace entry ``i`` (the free_requested before a free_completed: where the
    program let the tensor go); None when the entry has none."""
    e = trace[i]
    if e.get("action") == "free_completed" and i > 0:
        p = trace[i - 1]
        if p.get("action") == "free_requested" and p.get("addr") == addr:
            e = p
    fr = e.get("frames")
    return fr if type(fr) is list and fr else None


def _meta_text(v, chk: _Checker) -> str:
    """An entry's user_metadata: "" when missing or not text (counted), cut to NAME_MAX_CHARS (counted)."""
    if type(v) is not str:
        chk.bad("field", int(v is not None))
        return ""
    if len(v) > NAME_MAX_CHARS:
        chk.bad("long")
        return cut_text(v)
    return v


def fmt_frames(fr, limit: int = 6) -> str:
    """The first ``limit`` telling frames of a stack as one line (unknown C frames and the allocator's
    own frames left out; all frames when none is telling). Stops reading at the ``limit``-th."""
    if not fr:
        return ""
    keep = []
    for f in fr:
        if type(f) is not dict:
            continue
        name = frame_text(f.get("name", ""))
        if (frame_text(f.get("filename", "")) != "??" or "autograd" in name) and "CUDACachingAllocator" not in name:
            keep.append(f)
            if len(keep) == limit:
                break
    return " < ".join(f"{frame_text(f.get('name', ''))} ({os.path.basename(frame_text(f.get('filename', '')))}:"
                      f"{frame_text(f.get('line', 0))})"
                      if f.get("filename") not in (None, "??") else frame_text(f.get("name", ""))[:80]
                      for f in (keep or [f for f in fr[:limit] if type(f) is dict]))


def frame_text(v) -> str:
    """A frame's name / filename / line as text of at most 1,024 characters (frames come from the file)."""
    if type(v) is str:
        return v[:1024]
    if type(v) in (int, float, bool) or v is None:
        return str(v)
    return f"<{type(v).__name__}>"
