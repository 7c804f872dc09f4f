"""Memory attribution per rank: peak, breakdown by category and FSDP unit, timeline, fragmentation, OOM.

``memory_analysis(rank)`` takes a :class:`fsdpprof.analyze.run.RankData` (run dir rank, bare trace
or bare CUDA snapshot). A CUDA snapshot is preferred when the rank has one; otherwise the trace's
``[memory]`` events plus inventory.json (CPU runs). All sizes in bytes, times in µs on the source's
clock (a legacy snapshot without ``time_us`` uses trace entry indices, see ``warnings``).
"""
from __future__ import annotations

import os
from dataclasses import dataclass, field

import numpy as np
import pandas as pd

from fsdpprof.analyze import categorize as cz
from fsdpprof.analyze import memory_trace
from fsdpprof.analyze.schema import MemoryCategory as MC
from fsdpprof.analyze.snapshot import NEVER, SnapshotData, load_snapshot
from fsdpprof.errors import UserError

CATEGORIES = cz.CATEGORIES


@dataclass
class MemoryResult:
    rank: int
    source: str                          # cuda_snapshot | cpu_trace
    peak_allocated_bytes: int
    peak_ts_us: float | None
    peak_phase: str | None
    baseline_bytes: int                  # alive before the window / history began
    breakdown_at_peak: pd.DataFrame      # category, bytes, pct
    by_unit_at_peak: pd.DataFrame        # unit, category, bytes
    timeline: pd.DataFrame | None        # ts_us + one column per MemoryCategory value (bytes)
    top_allocations: pd.DataFrame        # addr, bytes, category, phase, unit, alloc_us, free_us, frames (str)
    coverage_pct: float                  # % of bytes alive at the peak in a named category (not other)
    reserved_bytes: int | None           # snapshot: reserved (cudaMalloc'd) at the peak; None on CPU
    fragmentation_pct: float | None      # reserved but not allocated at the peak, % of reserved
    oom: dict | None                     # requested_bytes, free_bytes, device, ts_us
    allocations: pd.DataFrame            # the unified, categorised allocations frame
    warnings: list[str] = field(default_factory=list)
    device: int | None = None            # CUDA device of a snapshot
    timeline_unit: str = "us"            # "us", or "event_index" for legacy snapshots
    peak_fsdp_phase: str | None = None   # innermost FSDP annotation / tag at the peak
    peak_seq: int | None = None          # order key of the event at the peak (see allocations' alloc_seq)
    reserved_end_bytes: int | None = None  # snapshot: reserved at snapshot time (segments)


# --------------------------------------------------------------------------- entry point
def memory_analysis(rank, *, device: int | None = None, top_n: int = 20,
                    timeline_points: int = 2000) -> MemoryResult:
    """Memory attribution of one rank (RankData); see the module docstring."""
    r = int(getattr(rank, "rank", 0) or 0)
    info = getattr(rank, "info", None) or {}
    inventory = getattr(rank, "inventory", None)
    label = getattr(rank, "trace_path", None) or getattr(rank, "snapshot_path", None) or f"rank {r}"
    memory_trace.check_inventory(inventory, r, info.get("world_size"), os.path.dirname(str(label)) or str(label))
    snap_path = getattr(rank, "snapshot_path", None)
    if snap_path:
        snap = load_snapshot(snap_path)
        return snapshot_memory(snap, rank=r, device=device if device is not None else _info_device(info),
                               inventory=inventory, top_n=top_n, timeline_points=timeline_points)
    me = getattr(rank, "memory_events", None)
    if me is None and getattr(rank, "events", None) is None:
        raise UserError(f"rank {r}: no profiler trace and no CUDA snapshot: no memory data to analyse")
    if me is None or not len(me):
        raise UserError(f"{label}: the trace has no [memory] events (profile_memory was off); record with "
                        f"fsdpprof record (memory on) or torch.profiler.profile(profile_memory=True)")
    allocs, inv_t, warns = memory_trace.cpu_allocations(me, getattr(rank, "events", None), inventory, str(label))
    if inventory is None:
        warns.append(f"{label}: no inventory.json: memory alive before the profiling window is only seen when "
                     f"freed inside it; sharded params/grads/optimizer state come from lifetimes")
    df = cz.categorize(allocs, inv_tensors=inv_t)
    res = _summarise(df, r, "cpu_trace", top_n, timeline_points, has_history=True)
    marks = cz.step_marks(getattr(rank, "events", None))
    if res.peak_ts_us is not None:
        res.peak_phase = cz.coarse_phase(np.array([res.peak_ts_us]), marks)[0]
        res.peak_fsdp_phase = cz.paint(np.array([res.peak_ts_us]), cz.fsdp_annotations(getattr(rank, "events", None)),
                                       "fsdp_phase")[0]
    res.warnings = warns + res.warnings
    return res


def _info_device(info: dict) -> int | None:
    d = str(info.get("device") or "")
    if d.startswith("cuda:"):
        try:
            return int(d.split(":")[1])
        except ValueError:
            return None
    return None


# --------------------------------------------------------------------------- snapshots
def annotate_snapshot(allocs: pd.DataFrame) -> pd.DataFrame:
    """phase, fsdp_phase, unit, free_phase, step_idx ... for snapshot allocations (tags, then frames)."""
    df = allocs.copy()
    tags = cz.parse_user_metadata(df["user_metadata"])
    df["fsdp_phase"] = tags["fsdp_phase"].to_numpy(object)
    df["unit"] = tags["unit"].to_numpy(object)
    df["frame_sig"] = cz.frame_signatures(df["frames"])
    ph = cz.frame_phase(df["frame_sig"])
    # tags give the coarse phase; FSDP's own collectives show in the frames
    fsdp_ff = cz.frame_fsdp_phase(df["frame_sig"])
    tag_fine = df["fsdp_phase"].where(~df["fsdp_phase"].isin(cz.COARSE_ORDER))
    df["fsdp_phase"] = np.where(pd.notna(fsdp_ff), fsdp_ff, tag_fine.to_numpy(object))
    tag_coarse = pd.Series(tags["fsdp_phase"].to_numpy(object))
    tag_coarse = tag_coarse.where(tag_coarse.isin(cz.COARSE_ORDER)).to_numpy(object)
    ph = np.where(pd.notna(tag_coarse), tag_coarse, ph)
    fp = df["fsdp_phase"].astype(object)
    ph = np.where(pd.isna(ph) & fp.str.contains("backward|reduce", na=False).to_numpy(), "backward", ph)
    ph = np.where(pd.isna(ph) & fp.str.contains("forward|all_gather|unshard", na=False).to_numpy(), "forward", ph)
    # allocations with no frames while others have Python frames come from the autograd engine's
    # threads (no Python stack): backward
    py = cz._contains(df["frame_sig"], ".py", regex=False)
    has_py = bool(py.any())
    nof = (df["frame_sig"].astype(object) == "").to_numpy() & ~df["before_trace"].to_numpy() & pd.isna(ph)
    if has_py:
        ph = np.where(nof, "backward", ph)
        # Python frames outside forward/backward/optimizer/data (e.g. the loss in the training loop)
        py_other = pd.isna(ph) & py
        ph = np.where(py_other, "forward", ph)
    ph = np.where(df["before_trace"].to_numpy(), None, ph)
    df["phase"] = ph
    # phase at the free: the phase of the latest allocation at or before it (trace order)
    order = df[df["alloc_seq"] >= 0].sort_values("alloc_seq")
    seqs = order["alloc_seq"].to_numpy()
    p_ff = pd.Series(order["phase"].to_numpy(object)).ffill().to_numpy(object)
    f_ff = pd.Series(order["fsdp_phase"].to_numpy(object)).ffill().to_numpy(object)
    fs = df["free_seq"].to_numpy()
    pos = np.searchsorted(seqs, fs, side="right") - 1
    ok = (pos >= 0) & (fs != NEVER)
    fp_arr = np.full(len(df), None, dtype=object)
    ffp_arr = np.full(len(df), None, dtype=object)
    if len(seqs):
        fp_arr[ok] = p_ff[pos[ok]]
        ffp_arr[ok] = f_ff[pos[ok]]
    df["free_phase"] = fp_arr
    df["free_fsdp_phase"] = ffp_arr
    # one snapshot is one window: no step boundaries (all allocations in step 0)
    df["step_idx"] = np.where(df["before_trace"], -1, 0)
    df["free_step_idx"] = np.where(fs == NEVER, 1 << 30, 0)
    return df


def _snapshot_inventory(inventory: dict | None, df: pd.DataFrame) -> pd.DataFrame | None:
    """Inventory tensors with capture times on the snapshot's clock.

    With phase tags (our recorder) the optimizer steps show as runs of ``optimizer``-phase
    allocations: params are matched before the last run, optimizer state after it, grads of step
    ``s`` before their run (aligned from the last). Without them: at the latest allocation at each
    address (params and optimizer state alive at snapshot time)."""
    if not inventory:
        return None
    t_end = float(np.nanmax(df["alloc_us"].to_numpy())) + 1 if len(df) else 0.0
    order = df[df["alloc_seq"] >= 0].sort_values("alloc_seq")
    is_opt = (order["phase"] == "optimizer").to_numpy()
    if is_opt.any():
        t = order["alloc_us"].to_numpy(float)
        prev = np.concatenate([[False], is_opt[:-1]])
        nxt = np.concatenate([is_opt[1:], [False]])
        starts = t[is_opt & ~prev] - 1e-3          # just before the run's first allocation
        ends = t[is_opt & ~nxt] + 1e-3
        return memory_trace.inventory_tensors(inventory, starts, ends, t_end)
    inv_t = memory_trace.inventory_tensors(inventory, np.array([]), np.array([]), t_end)
    if not len(inv_t):
        return None
    last = df.sort_values("alloc_seq").drop_duplicates("addr", keep="last")[["addr", "alloc_us"]]
    inv_t = inv_t.drop(columns=["ref_us"]).merge(last, on="addr", how="left").rename(columns={"alloc_us": "ref_us"})
    return inv_t.dropna(subset=["ref_us"])


def snapshot_memory(snap: SnapshotData, *, rank: int = 0, device: int | None = None, inventory: dict | None = None,
                    top_n: int = 20, timeline_points: int = 2000) -> MemoryResult:
    """Memory attribution of one device of a CUDA snapshot."""
    a_all = snap.allocations
    devs = sorted(set(a_all["device"].unique().tolist())) or list(snap.devices) or [0]
    warnings = list(snap.warnings)
    if device is None or device not in devs:
        # the device with the largest peak (a rank's snapshot normally has one device in use)
        peaks = {d: _peak_only(a_all[a_all["device"] == d]) for d in devs}
        device = max(peaks, key=peaks.get) if peaks else 0
        if len(devs) > 1:
            others = ", ".join(f"cuda:{d} {peaks[d] / 2**20:.1f} MiB" for d in devs if d != device)
            warnings.append(f"{snap.path}: snapshot has {len(devs)} devices; analysed cuda:{device} (largest peak), "
                            f"others peak at {others}; pass device= for another")
    a = a_all[a_all["device"] == device].reset_index(drop=True)
    df = annotate_snapshot(a)
    cat = cz.categorize(df, inv_tensors=_snapshot_inventory(inventory, df))
    has_hist = bool(snap.has_history.get(device, False))
    res = _summarise(cat, rank, "cuda_snapshot", top_n, timeline_points, has_history=has_hist)
    res.device = device
    res.timeline_unit = "us" if snap.has_time else "event_index"
    seg = snap.segments[snap.segments["device"] == device]
    if len(seg):
        # reserved at the peak = reserved at snapshot time minus the segments mapped after the peak
        reserved_end = int(seg["total_bytes"].sum())
        se = snap.segment_events[snap.segment_events["device"] == device]
        after = int(se.loc[se["seq"] > res.peak_seq, "delta_bytes"].sum()) if res.peak_seq is not None else 0
        reserved = reserved_end - after
        res.reserved_end_bytes = reserved_end
        if reserved < res.peak_allocated_bytes:  # segment history incomplete (ring buffer): bound it
            reserved = max(res.peak_allocated_bytes, reserved)
        res.reserved_bytes = reserved
        res.fragmentation_pct = 100.0 * (reserved - res.peak_allocated_bytes) / reserved if reserved else None
    ooms = [o for o in snap.ooms if o["device"] == device]
    if ooms:
        o = ooms[0]
        res.oom = {"requested_bytes": o["requested_bytes"], "free_bytes": o["free_bytes"], "device": device,
                   "ts_us": o["ts_us"] if snap.has_time else None}
    res.warnings = warnings + res.warnings
    return res


def _peak_only(a: pd.DataFrame) -> int:
    lv, _, _ = _levels(a)
    return int(lv.max()) if len(lv) else 0


# --------------------------------------------------------------------------- peak, breakdown, timeline
def _levels(df: pd.DataFrame):
    """Allocated bytes after each alloc/free event in order: (levels, event seq, event index into df)."""
    base = int(df.loc[df["alloc_seq"] < 0, "bytes"].sum())
    ai = np.flatnonzero(df["alloc_seq"].to_numpy() >= 0)
    fi = np.flatnonzero(df["free_seq"].to_numpy() != NEVER)
    seq = np.concatenate([df["alloc_seq"].to_numpy()[ai], df["free_seq"].to_numpy()[fi]])
    b = df["bytes"].to_numpy(np.int64)
    delta = np.concatenate([b[ai], -b[fi]])
    row = np.concatenate([ai, fi])
    o = np.lexsort((np.concatenate([np.ones(len(ai)), np.zeros(len(fi))]), seq))  # frees first at a tie
    if not len(o):
        return np.array([base], dtype=np.int64), np.array([-1]), np.array([-1])
    return base + np.cumsum(delta[o]), seq[o], row[o]


def _fmt_frames(fr, limit: int = 6) -> str:
    if not fr:
        return ""
    keep = [f for f in fr if not str(f.get("filename", "")) == "??" or "autograd" in str(f.get("name", ""))]
    keep = [f for f in keep if "CUDACachingAllocator" not in str(f.get("name", ""))] or fr
    return " < ".join(f"{f.get('name', '')} ({os.path.basename(str(f.get('filename', '')))}:{f.get('line', 0)})"
                      if f.get("filename") not in (None, "??") else str(f.get("name", ""))[:80]
                      for f in keep[:limit])


def _summarise(df: pd.DataFrame, rank: int, source: str, top_n: int, points: int, has_history: bool) -> MemoryResult:
    warnings: list[str] = []
    base = int(df.loc[df["alloc_seq"] < 0, "bytes"].sum())
    levels, seqs, rows = _levels(df)
    if has_history and len(seqs) and seqs[0] >= 0:
        k = int(np.argmax(levels))
        peak_seq = int(seqs[k])
        peak_row = int(rows[k])
        peak_ts = float(df["alloc_us"].iat[peak_row]) if df["alloc_seq"].iat[peak_row] == peak_seq \
            else float(df["free_us"].iat[peak_row])
        peak_phase = df["phase"].iat[peak_row] if df["alloc_seq"].iat[peak_row] == peak_seq else None
        peak_fsdp = df["fsdp_phase"].iat[peak_row] if df["alloc_seq"].iat[peak_row] == peak_seq else None
        alive = (df["alloc_seq"].to_numpy() <= peak_seq) & (df["free_seq"].to_numpy() > peak_seq)
    else:
        peak_seq, peak_ts, peak_phase, peak_fsdp = None, None, None, None
        alive = df["free_seq"].to_numpy() == NEVER
    at = df[alive]
    peak = int(at["bytes"].sum())
    bd = at.groupby("category", observed=False)["bytes"].sum().reindex(CATEGORIES, fill_value=0)
    breakdown = pd.DataFrame({"category": bd.index.astype(str), "bytes": bd.to_numpy(np.int64)})
    breakdown["pct"] = 100.0 * breakdown["bytes"] / peak if peak else 0.0
    by_unit = (at.assign(unit=at["unit"].astype(object))
               .groupby(["unit", "category"], observed=True, dropna=False)["bytes"].sum().reset_index())
    by_unit = by_unit[by_unit["bytes"] > 0].sort_values("bytes", ascending=False).reset_index(drop=True)
    by_unit["category"] = by_unit["category"].astype(str)
    other = int(bd.get(MC.OTHER.value, 0))
    coverage = 100.0 * (peak - other) / peak if peak else 100.0
    top = at.nlargest(top_n, "bytes")
    top_allocs = pd.DataFrame({
        "addr": top["addr"].to_numpy(np.int64), "bytes": top["bytes"].to_numpy(np.int64),
        "category": top["category"].astype(str).to_numpy(), "phase": top["phase"].to_numpy(object),
        "unit": top["unit"].to_numpy(object), "alloc_us": top["alloc_us"].to_numpy(float),
        "free_us": top["free_us"].to_numpy(float),
        "frames": [_fmt_frames(f) for f in top["frames"]]})
    timeline = _timeline(df, points) if has_history and peak_seq is not None else None
    return MemoryResult(rank=rank, source=source, peak_allocated_bytes=peak, peak_ts_us=peak_ts,
                        peak_phase=peak_phase, baseline_bytes=base, breakdown_at_peak=breakdown,
                        by_unit_at_peak=by_unit, timeline=timeline, top_allocations=top_allocs,
                        coverage_pct=coverage, reserved_bytes=None, fragmentation_pct=None, oom=None,
                        allocations=df, warnings=warnings, peak_fsdp_phase=peak_fsdp, peak_seq=peak_seq)


def _timeline(df: pd.DataFrame, points: int) -> pd.DataFrame:
    """Stacked-by-category allocated bytes after every event, downsampled to at most ``points``
    (+2) rows by keeping each bin's highest total, so the peak survives. Memory O(events): one
    category's running sum at a time."""
    codes = df["category"].cat.codes.to_numpy()
    b = df["bytes"].to_numpy(np.int64)
    pre = df["alloc_seq"].to_numpy() < 0
    base = np.bincount(codes[pre], weights=b[pre], minlength=len(CATEGORIES)).astype(np.int64)
    ai = np.flatnonzero(~pre)
    fi = np.flatnonzero(df["free_seq"].to_numpy() != NEVER)
    seq = np.concatenate([df["alloc_seq"].to_numpy()[ai], df["free_seq"].to_numpy()[fi]])
    ts = np.concatenate([df["alloc_us"].to_numpy(float)[ai], df["free_us"].to_numpy(float)[fi]])
    cat = np.concatenate([codes[ai], codes[fi]])
    delta = np.concatenate([b[ai], -b[fi]])
    o = np.lexsort((np.concatenate([np.ones(len(ai)), np.zeros(len(fi))]), seq))  # frees first at a tie
    cat, delta, t = cat[o], delta[o], ts[o]
    n = len(o)
    total = np.cumsum(delta) + base.sum()
    if n > points:
        edges = np.linspace(0, n, points + 1).astype(int)
        bins = np.repeat(np.arange(points), np.diff(edges))
        order = np.lexsort((-total, bins))                 # within each bin, highest total first
        first = np.searchsorted(bins[order], np.arange(points))
        keep = np.unique(np.concatenate([[0, n - 1], order[first[first < n]]]))
    else:
        keep = np.arange(n)
    out = pd.DataFrame({"ts_us": t[keep]})
    for k, name in enumerate(CATEGORIES):
        d = np.where(cat == k, delta, 0)
        out[name] = (np.cumsum(d)[keep] + base[k]).astype(np.int64)
    return out
