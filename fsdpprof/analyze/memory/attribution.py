"""Memory attribution per rank (:func:`memory_analysis`): peak, breakdown by category and FSDP unit, timeline,
fragmentation, OOM; from a CUDA snapshot when the rank has one, else the trace's ``[memory]`` events and
inventory.json.  Bytes, and µs on the source's clock (trace entry indices for a legacy snapshot).
"""
from __future__ import annotations

import os
import re
from dataclasses import dataclass, field
from dataclasses import replace as replace_dc

import numpy as np
import pandas as pd

from fsdpprof import options
from fsdpprof.analyze import model
from fsdpprof.analyze.memory import categorize as cz
from fsdpprof.analyze.memory import cpu_events, fsdp_units
from fsdpprof.analyze.memory.fragmentation import Fragmentation, fragmentation
from fsdpprof.analyze.memory import oom as oom_mod
from fsdpprof.analyze.memory.process import process_memory
from fsdpprof.analyze.trace import labels
from fsdpprof.analyze.model import MemoryCategory as MC
from fsdpprof.analyze.memory.snapshot import NEVER, NO_ADDRESS, SnapshotData, fmt_frames, load_snapshot
from fsdpprof.errors import UserError

CATEGORIES = cz.CATEGORIES
BEFORE_HISTORY = -1       # peak_seq of a peak at the moment before the history's first entry (alloc_seq of what was alive)


@dataclass
class MemoryResult:
    """One rank's memory attribution.  Bytes; times in µs (``timeline_unit`` "event_index": legacy snapshots)."""

    rank: int
    source: str                          # cuda_snapshot | cpu_trace
    peak_allocated_bytes: int
    peak_ts_us: float | None
    peak_stage: str | None
    baseline_bytes: int                  # alive before the window / history began
    breakdown_at_peak: pd.DataFrame      # category, bytes, pct
    by_unit_at_peak: pd.DataFrame        # unit, category, bytes
    timeline: pd.DataFrame | None        # ts_us + one column per MemoryCategory value
    top_allocations: pd.DataFrame        # addr, bytes, category, stage, unit, alloc_us, free_us, frames (str)
    coverage_pct: float                  # % of the peak in a named category (not model.UNNAMED_CATEGORIES)
    reserved_bytes: int | None           # snapshot: reserved at the peak
    fragmentation_pct: float | None      # reserved but not allocated at the peak, % of reserved
    oom: dict | None                     # requested_bytes, free_bytes, device, ts_us + oom.explain_oom's keys
    allocations: pd.DataFrame            # the categorised allocations frame
    warnings: list[str] = field(default_factory=list)
    device: int | None = None            # CUDA device of a snapshot
    timeline_unit: str = "us"
    peak_fsdp_phase: str | None = None
    peak_seq: int | None = None          # order key at the peak (alloc_seq; BEFORE_HISTORY: before the first entry)
    reserved_end_bytes: int | None = None  # snapshot: reserved at snapshot time
    input_warnings: list[str] = field(default_factory=list)  # malformed input left out (also in warnings)
    by_role_at_peak: pd.DataFrame | None = None  # unit, fsdp_role, bytes
    activation_by_unit: pd.DataFrame | None = None  # unit, activation_bytes (most alive at once), at_peak_bytes
    before_recording_sizes: pd.DataFrame | None = None  # bytes, count, total_bytes of before_recording at the peak
    fsdp_family: str | None = None       # fsdp2 / fsdp1 when the snapshot's frames show FSDP
    fsdp_units: list[str] = field(default_factory=list)  # units recovered from the all-gathers, forward order
    world_size: int | None = None        # FSDP shard group size read from the snapshot
    world_size_source: str | None = None
    rounding_end_bytes: int | None = None  # snapshot: allocator blocks minus requested bytes alive at the end
    fragmentation: Fragmentation | None = None
    process: dict | None = None          # the process's memory beside the allocator's (analyze.memory.process)
    device_peaks: dict[int, int] = field(default_factory=dict)  # snapshot of several devices: each one's peak
    device_choice: str | None = None     # snapshot: why ``device`` was analysed (DEVICE_CHOICE_*)


DEVICE_CHOICE_GIVEN = "given"            # --device N (or the run's device of the rank)
DEVICE_CHOICE_LARGEST = "largest peak"   # the snapshot's device with the largest peak (the default)
DEVICE_CHOICE_ONLY = "only device"       # the snapshot holds one device


# --------------------------------------------------------------------------- entry point
def memory_analysis(rank, *, device: int | None = None, top_n: int = 20,
                    timeline_points: int = 2000) -> MemoryResult:
    """Memory attribution of one rank (RankData: run dir rank, bare trace or bare CUDA snapshot)."""
    r = int(getattr(rank, "rank", 0) or 0)
    info = getattr(rank, "info", None) or {}
    inventory = getattr(rank, "inventory", None)
    label = getattr(rank, "trace_path", None) or getattr(rank, "snapshot_path", None) or f"rank {r}"
    cpu_events.check_inventory(inventory, r, info.get("world_size"), os.path.dirname(str(label)) or str(label))
    me, events = getattr(rank, "memory_events", None), getattr(rank, "events", None)
    if getattr(rank, "snapshot_path", None):
        res = snapshot_memory(load_snapshot(rank.snapshot_path), rank=r, inventory=inventory, top_n=top_n,
                              device=device if device is not None else _info_device(info),
                              timeline_points=timeline_points, world_size=info.get("world_size"),
                              device_required=device is not None or bool(info.get("device_chosen")))
    elif me is None and events is None:
        raise UserError(f"rank {r}: no profiler trace and no CUDA snapshot: no memory data to analyse")
    elif me is None or not len(me):
        raise UserError(f"{label}: the trace has no [memory] events (profile_memory was off); record with "
                        f"fsdpprof record (memory on) or torch.profiler.profile(profile_memory=True)")
    else:
        allocs, inv_t, warns = cpu_events.cpu_allocations(me, events, inventory, str(label))
        if inventory is None:
            warns.append(f"{label}: no inventory.json: memory alive before the profiling window is only seen when "
                         f"freed inside it; sharded params/grads/optimizer state come from lifetimes")
        res = _summarise(cz.categorize(allocs, inv_tensors=inv_t), r, "cpu_trace", top_n, timeline_points,
                         has_history=True)
        if res.peak_ts_us is not None:
            t = np.array([res.peak_ts_us])
            res.peak_stage = model.stage_at(t, labels.step_marks(events), outside=None)[0]
            res.peak_fsdp_phase = cz.paint(t, labels.fsdp_intervals(events), "fsdp_phase")[0]
        res.warnings = warns + res.warnings
    res.process, notes = process_memory(info, res.peak_allocated_bytes)
    res.warnings = list(res.warnings or []) + notes
    res.input_warnings = list(res.input_warnings) + notes       # (unreadable or contradictory: said in the terminal)
    return res


def choose_device(run, device):
    """``run`` with the CUDA device of its snapshots chosen (``device`` as options.parse_device reads it): None, each
    snapshot's default; N, cuda:N of every snapshot; 'all', every device of one snapshot file, each its own rank."""
    device = options.parse_device(device)
    if device is None:
        return run
    snaps = {r: rd for r, rd in run.ranks.items() if rd.snapshot_path}
    if not snaps:
        raise UserError(f"--device {device}: {run.path} holds no CUDA snapshot, and --device chooses the device of a "
                        f"snapshot; leave it out")
    if device == options.ALL_DEVICES:
        if len(run.ranks) != 1 or len(snaps) != 1:
            raise UserError(f"--device all: {run.path} holds a snapshot per rank, each analysed on its rank's device; "
                            f"--device all is for one snapshot file (give a file, or --device N)")
        (r, rd), = snaps.items()
        devs = load_snapshot(rd.snapshot_path).devices
        if len(devs) <= 1:
            device = devs[0] if devs else None
        else:
            ranks = {d: replace_dc(rd, rank=d, info={**rd.info, "rank": d, "device": f"cuda:{d}", "device_chosen": True},
                                   label=f"{rd.label} cuda:{d}") for d in devs}
            return replace_dc(run, ranks=ranks)
        if device is None:
            return run
    ranks = {r: replace_dc(rd, info={**(rd.info or {}), "device": f"cuda:{device}", "device_chosen": True})
             if rd.snapshot_path else rd for r, rd in run.ranks.items()}
    return replace_dc(run, ranks=ranks)


def _info_device(info: dict) -> int | None:
    m = re.fullmatch(r"cuda:(\d+)", str(info.get("device") or ""))
    return int(m.group(1)) if m else None


# --------------------------------------------------------------------------- snapshots
def _like_column(values: np.ndarray) -> np.ndarray:
    """``values`` as a DataFrame column built from them gives them back: pandas stores an object
    array of strings (and missing) as ``str``, whose missing value reads back as NaN."""
    if values.dtype == object and len(values) and pd.api.types.infer_dtype(values, skipna=True) == "string":
        values = values.copy()
        values[pd.isna(values)] = np.nan
    return values


def _ffill(values: np.ndarray) -> np.ndarray:
    """Forward-fill missing entries of an object array (leading missing entries stay as they are)."""
    idx = np.where(pd.isna(values), -1, np.arange(len(values)))
    idx = np.maximum.accumulate(idx) if len(idx) else idx
    return np.where(idx >= 0, values[np.maximum(idx, 0)], values)


def annotate_columns(cols, stacks: tuple[np.ndarray, list] | None = None) -> dict[str, np.ndarray]:
    """Labels of snapshot allocations (``cols``: arrays of ALLOC_COLUMNS) from tags, then frames: fsdp_phase, unit,
    frame_sig, stage, free_stage, free_fsdp_phase, step_idx, free_step_idx, fsdp_role (missing as pandas reads it).
    ``stacks``: categorize.stack_codes of the frames."""
    n = len(cols["alloc_seq"])
    tag_phase, tag_unit = cz.parse_tags(np.asarray(cols["user_metadata"], dtype=object))
    sig = cz.signatures(np.asarray(cols["frames"], dtype=object), stacks)
    ph = cz.frame_rule(sig, model.STAGE_FRAME_RULES)
    # tags give the coarse phase; FSDP's own collectives show in the frames
    fsdp_ff = cz.frame_rule(sig, model.FSDP_PHASE_FRAME_RULES)
    tag_fine = _like_column(tag_phase).copy()
    tag_fine[cz._isin(tag_fine, model.STEP_STAGES)] = np.nan
    fsdp_phase = _like_column(np.where(pd.notna(fsdp_ff), fsdp_ff, tag_fine))
    tag_coarse = np.where(cz._isin(tag_phase, model.STEP_STAGES), tag_phase, None)
    ph = np.where(pd.notna(tag_coarse), tag_coarse, ph)
    for stage, pattern in model.PHASE_STAGE_PATTERNS:
        ph = np.where(pd.isna(ph) & cz._contains(fsdp_phase, pattern), stage, ph)
    # allocations with no frames while others have Python frames come from the autograd engine's
    # threads (no Python stack): backward
    py = cz._contains(sig, ".py", regex=False)
    before = np.asarray(cols["before_trace"], dtype=bool)
    if py.any():
        nof = (np.asarray(sig, dtype=object) == "") & ~before & pd.isna(ph)
        ph = np.where(nof, model.STAGE_BACKWARD, ph)
        # Python frames outside forward/backward/optimizer/data (e.g. the loss in the training loop)
        ph = np.where(pd.isna(ph) & py, model.STAGE_FORWARD, ph)
    ph = _like_column(np.where(before, None, ph))
    # stage at the free: the stage of the latest allocation at or before it (trace order)
    alloc_seq = np.asarray(cols["alloc_seq"])
    sel = np.flatnonzero(alloc_seq >= 0)
    order = sel[np.argsort(alloc_seq[sel], kind="quicksort")]
    seqs = alloc_seq[order]
    fs = np.asarray(cols["free_seq"])
    pos = np.searchsorted(seqs, fs, side="right") - 1
    ok = (pos >= 0) & (fs != NEVER)
    free_phase = np.full(n, None, dtype=object)
    free_fsdp = np.full(n, None, dtype=object)
    if len(seqs):
        free_phase[ok] = _ffill(ph[order])[pos[ok]]
        free_fsdp[ok] = _ffill(fsdp_phase[order])[pos[ok]]
    # where the trace recorded the free's own stack (context="all"), its frames say the stage
    ff = cols["free_frames"] if "free_frames" in cols else None
    if ff is not None and len(ff):
        ff = np.asarray(ff, dtype=object)
        has = np.flatnonzero(pd.notna(ff) & ok)
        if len(has):
            fsig = cz.signatures(ff[has])
            fst = cz.frame_rule(fsig, model.STAGE_FRAME_RULES)
            got = pd.notna(fst)
            free_phase[has[got]] = fst[got]
            # the FSDP phase of the free from its own frames (a tag, when there is one, lasts until the next)
            ffp = cz.frame_rule(fsig, model.FSDP_PHASE_FRAME_RULES)
            untagged = pd.isna(np.asarray(tag_fine, dtype=object)[has]) if len(tag_fine) else np.ones(len(has), bool)
            free_fsdp[has[untagged]] = ffp[untagged]
    # one snapshot is one window: no step boundaries (all allocations in step 0)
    return {"fsdp_phase": fsdp_phase, "unit": _like_column(tag_unit), "frame_sig": sig, "stage": ph,
            "free_stage": free_phase, "free_fsdp_phase": free_fsdp,
            "step_idx": np.where(before, -1, 0), "free_step_idx": np.where(fs == NEVER, 1 << 30, 0),
            "fsdp_role": cz.frame_fsdp_role(sig)}


def snapshot_inventory(inventory: dict | None, df: pd.DataFrame) -> pd.DataFrame | None:
    """Inventory tensors with capture times on the snapshot's clock: around the runs of optimizer-stage allocations
    (as cpu_events.inventory_tensors), else at the latest allocation at each address."""
    if not inventory:
        return None
    t_end = float(np.nanmax(df["alloc_us"].to_numpy())) + 1 if len(df) else 0.0
    order = df[df["alloc_seq"] >= 0].sort_values("alloc_seq")
    is_opt = (order["stage"] == model.STAGE_OPTIMIZER).to_numpy()
    if is_opt.any():
        t = order["alloc_us"].to_numpy(float)
        prev = np.concatenate([[False], is_opt[:-1]])
        nxt = np.concatenate([is_opt[1:], [False]])
        starts = t[is_opt & ~prev] - 1e-3          # just before the run's first allocation
        ends = t[is_opt & ~nxt] + 1e-3
        return cpu_events.inventory_tensors(inventory, starts, ends, t_end)
    inv_t = cpu_events.inventory_tensors(inventory, np.array([]), np.array([]), t_end)
    if not len(inv_t):
        return None
    last = df.sort_values("alloc_seq").drop_duplicates("addr", keep="last")[["addr", "alloc_us"]]
    inv_t = inv_t.drop(columns=["ref_us"]).merge(last, on="addr", how="left").rename(columns={"alloc_us": "ref_us"})
    return inv_t.dropna(subset=["ref_us"])


def snapshot_memory(snap: SnapshotData, *, rank: int = 0, device: int | None = None, inventory: dict | None = None,
                    top_n: int = 20, timeline_points: int = 2000, world_size: int | None = None,
                    device_required: bool = False) -> MemoryResult:
    """Memory attribution of one device of a CUDA snapshot (None, or one it lacks: the largest peak's; with
    ``device_required`` a lacking one is a UserError).  Works on numpy columns; the DataFrame is built once."""
    a_all = snap.allocations
    dev_col = a_all["device"].to_numpy()
    devs = sorted(set(np.unique(dev_col).tolist())) or list(snap.devices) or [0]
    warnings = list(snap.warnings)
    if device_required and device is not None and device not in set(devs) | set(snap.devices):
        raise UserError(f"{snap.path}: the snapshot holds no cuda:{device} (it holds "
                        f"{', '.join(f'cuda:{d}' for d in sorted(set(devs) | set(snap.devices)))}); give one of those "
                        f"to --device")
    peaks = {d: _peak_only({c: a_all[c].to_numpy()[dev_col == d] for c in ("alloc_seq", "free_seq", "bytes")})
             for d in devs} if len(devs) > 1 else {}
    choice = DEVICE_CHOICE_GIVEN if device in devs else DEVICE_CHOICE_ONLY if len(devs) == 1 else DEVICE_CHOICE_LARGEST
    if device is None or device not in devs:
        # the device with the largest peak (a rank's snapshot normally has one device in use)
        device = max(peaks, key=peaks.get) if peaks else devs[0]
        if len(devs) > 1:
            others = ", ".join(f"cuda:{d} {model.fmt_bytes(peaks[d])}" for d in devs if d != device)
            warnings.append(f"{snap.path}: snapshot has {len(devs)} devices; analysed cuda:{device} (largest peak), "
                            f"others peak at {others}; --device N analyses cuda:N, --device all every device")
    mask = dev_col == device
    cols = {c: a_all[c].to_numpy()[mask] for c in a_all.columns}
    dtypes = a_all.dtypes
    ooms = [o for o in snap.ooms if o["device"] == device]
    n_real = len(cols["addr"])
    if ooms:    # the OOM's request, labelled like an allocation (zero bytes), dropped before the summary
        cols = _with_request_rows(cols, ooms)
    stacks = cz.stack_codes(np.asarray(cols["frames"], dtype=object))
    cols.update(annotate_columns(cols, stacks))
    fam = cz.fsdp_family_of_frames(cols["frame_sig"]) if len(cols["addr"]) else None
    rec = None
    if fam:
        inv_ws = (inventory or {}).get("shard_group_size") or (inventory or {}).get("world_size")
        rec = fsdp_units.recover_units(cols, np.asarray(cols["fsdp_role"], dtype=object), stacks, family=fam,
                                       inventory_units=(inventory or {}).get("units"), world_size=inv_ws or world_size,
                                       world_size_source="the inventory" if inv_ws else "the run")
        cols["fsdp_role"], cols["fsdp_role_source"] = rec.role, rec.role_source
        tag_unit = np.asarray(cols["unit"], dtype=object)
        cols["unit"] = _like_column(np.where(pd.isna(tag_unit), rec.unit, tag_unit))
        warnings += [f"{snap.path}: {x}" for x in rec.notes]
    else:
        cols["fsdp_role_source"] = np.full(len(cols["addr"]), None, dtype=object)
    inv_t = None
    if inventory:
        inv_t = snapshot_inventory(inventory, pd.DataFrame(
            {c: cols[c][:n_real] for c in ("addr", "alloc_us", "alloc_seq")} | {"stage": cols["stage"][:n_real]}))
    lab_cols = cols
    if ooms:
        # what the OOM's exception freed while unwinding was alive when the step died: labelled as alive
        oseq = min(o["seq"] for o in ooms)
        cut = (np.asarray(cols["alloc_seq"]) < oseq) & (np.asarray(cols["free_seq"]) > oseq) \
            & (np.asarray(cols["free_seq"]) != NEVER)
        if cut.any():
            lab_cols = dict(cols, free_step_idx=np.where(cut, 1 << 30, cols["free_step_idx"]),
                            free_stage=np.where(cut, None, cols["free_stage"]),
                            free_fsdp_phase=np.where(cut, None, cols["free_fsdp_phase"]))
    cat, src = cz.label_columns(lab_cols, inv_tensors=inv_t)
    request = {c: v[n_real] for c, v in cols.items()} if ooms else None
    cols = {c: v[:n_real] for c, v in cols.items()}
    # the snapshot's own columns keep their dtypes, the added ones are inferred as a column assignment would
    data = {c: pd.Series(cols[c], dtype=dtypes[c], copy=False) for c in a_all.columns}
    data.update({c: cols[c] for c in ("fsdp_phase", "unit", "frame_sig", "stage", "free_stage", "free_fsdp_phase",
                                      "step_idx", "free_step_idx", "fsdp_role")})
    data["category"] = pd.Categorical(cat[:n_real], categories=CATEGORIES)
    data["category_source"] = src[:n_real]
    df = pd.DataFrame(data)
    has_hist = bool(snap.has_history.get(device, False))
    res = _summarise(df, rank, "cuda_snapshot", top_n, timeline_points, has_history=has_hist)
    res.fsdp_family = fam
    if rec is not None:
        res.fsdp_units = list(rec.unit_names)
        res.world_size, res.world_size_source = rec.world_size, rec.world_size_source
    res.device, res.device_peaks, res.device_choice = device, peaks, choice
    res.timeline_unit = "us" if snap.has_time else "event_index"
    res.reserved_end_bytes = snap.reserved_at(device)
    if res.reserved_end_bytes is not None:
        # the segments mapped after the peak are not counted; an incomplete segment history (ring buffer) is bounded
        reserved = max(res.peak_allocated_bytes, snap.reserved_at(device, res.peak_seq))
        res.reserved_bytes = reserved
        res.fragmentation_pct = 100.0 * (reserved - res.peak_allocated_bytes) / reserved if reserved else None
        seg = snap.segments[snap.segments["device"].to_numpy() == device]
        res.rounding_end_bytes = int(seg["allocated_bytes"].sum() - seg["requested_bytes"].sum())
    res.fragmentation = fragmentation(snap, device, res.peak_seq)
    if ooms:
        o = ooms[0]
        res.oom = {"requested_bytes": o["requested_bytes"], "free_bytes": o["free_bytes"], "device": device,
                   "ts_us": o["ts_us"] if snap.has_time else None}
        res.oom.update(oom_mod.explain_oom(res, o, request, snap))
    res.warnings = warnings + res.warnings
    res.input_warnings = list(snap.defects)
    return res


def _with_request_rows(cols: dict, ooms: list[dict]) -> dict:
    """``cols`` with one zero-byte row per OOM request at its place in the trace (labelled by the same
    passes as the allocations, then taken off again)."""
    m = len(ooms)
    add = {"addr": np.zeros(m, np.int64), "bytes": np.zeros(m, np.int64),
           "alloc_us": np.array([o["ts_us"] for o in ooms], dtype=np.float64),
           "free_us": np.full(m, np.nan), "alloc_seq": np.array([o["seq"] for o in ooms], dtype=np.int64),
           "free_seq": np.full(m, NEVER, dtype=np.int64), "device": np.full(m, ooms[0]["device"], dtype=np.int16),
           "stream": np.zeros(m, np.int64), "before_trace": np.zeros(m, bool), "free_inferred": np.zeros(m, bool),
           "user_metadata": np.full(m, "", dtype=object),
           "frames": np.fromiter([o.get("frames") or None for o in ooms], dtype=object, count=m),
           "free_frames": np.full(m, None, dtype=object)}
    return {c: np.concatenate([np.asarray(v), add[c].astype(np.asarray(v).dtype, copy=False)]) for c, v in cols.items()}


def _peak_only(a) -> int:
    """The peak of the allocated bytes (never below what was alive before the history began)."""
    lv, _, _ = _levels(a)
    base = int(cz._col(a, "bytes")[cz._col(a, "alloc_seq") < 0].sum())
    return max(int(lv.max()), base) if len(lv) else base


# --------------------------------------------------------------------------- peak, breakdown, timeline
def _levels(df):
    """Allocated bytes after each alloc/free event in order: (levels, event seq, event index into df), one level
    per seq (after all its rows: a CPU run's other-threads row shares its seq with the event it shows at, and
    may be negative).  ``df``: the allocations DataFrame or a dict of its columns as arrays."""
    alloc_seq, free_seq = cz._col(df, "alloc_seq"), cz._col(df, "free_seq")
    b = cz._col(df, "bytes").astype(np.int64, copy=False)
    base = int(b[alloc_seq < 0].sum())
    ai = np.flatnonzero(alloc_seq >= 0)
    fi = np.flatnonzero(free_seq != NEVER)
    seq = np.concatenate([alloc_seq[ai], free_seq[fi]])
    delta = np.concatenate([b[ai], -b[fi]])
    row = np.concatenate([ai, fi])
    if not len(row):
        return np.array([base], dtype=np.int64), np.array([-1]), np.array([-1])
    levels, o = model.sweep(base, delta, seq, np.concatenate([np.ones(len(ai)), np.zeros(len(fi))]))  # frees first
    seq, row = seq[o], row[o]
    last = np.append(seq[1:] != seq[:-1], True)      # the last row of each seq
    return levels[last], seq[last], row[last]


def _by_unit(unit: np.ndarray, codes: np.ndarray, b: np.ndarray, cat_names: np.ndarray) -> pd.DataFrame:
    """Bytes per (unit, category) of the allocations given, largest first."""
    cat = pd.Categorical.from_codes(codes, categories=cat_names)
    g = pd.DataFrame({"unit": unit, "category": cat, "bytes": b}).groupby(
        ["unit", "category"], observed=True, dropna=False)["bytes"].sum()
    g = g[g > 0].reset_index().sort_values("bytes", ascending=False).reset_index(drop=True)
    return g.assign(category=g["category"].astype(str))


def _summarise(df: pd.DataFrame, rank: int, source: str, top_n: int, points: int, has_history: bool) -> MemoryResult:
    warnings: list[str] = []
    alloc_seq, free_seq = df["alloc_seq"].to_numpy(), df["free_seq"].to_numpy()
    b = df["bytes"].to_numpy(np.int64)
    base = int(b[alloc_seq < 0].sum())
    levels, seqs, rows = _levels(df)
    if has_history and len(seqs) and seqs[0] >= 0 and base > int(levels.max()):
        # the history only frees what was there before it (a legacy snapshot whose one entry is a free): the
        # peak is the moment before its first entry, never below the baseline
        peak_seq, peak_ts, peak_stage, peak_fsdp = BEFORE_HISTORY, float(df["alloc_us"].min()), None, None
        alive = alloc_seq < 0
    elif has_history and len(seqs) and seqs[0] >= 0:
        k = int(np.argmax(levels))
        peak_seq = int(seqs[k])
        peak_row = int(rows[k])
        at_alloc = alloc_seq[peak_row] == peak_seq
        peak_ts = float(df["alloc_us"].iat[peak_row]) if at_alloc else float(df["free_us"].iat[peak_row])
        peak_stage = df["stage"].iat[peak_row] if at_alloc else None
        peak_fsdp = df["fsdp_phase"].iat[peak_row] if at_alloc else None
        alive = (alloc_seq <= peak_seq) & (free_seq > peak_seq)
    else:
        peak_seq, peak_ts, peak_stage, peak_fsdp = None, None, None, None
        alive = free_seq == NEVER
    ai = np.flatnonzero(alive)
    b_at = b[ai]
    peak = int(b_at.sum())
    cat = df["category"]
    codes = cat.cat.codes.to_numpy()
    codes_at = codes[ai]
    bd = np.zeros(len(CATEGORIES), dtype=np.int64)
    np.add.at(bd, codes_at, b_at)                  # exact int64 sums per category
    cat_names = np.array(CATEGORIES, dtype=object)
    breakdown = pd.DataFrame({"category": cat_names, "bytes": bd,
                              "pct": 100.0 * bd / peak if peak else np.zeros(len(bd))})
    unit = df["unit"].to_numpy(object)
    by_unit = _by_unit(unit[ai], codes_at, b_at, cat_names)
    unnamed = int(sum(bd[CATEGORIES.index(c)] for c in model.UNNAMED_CATEGORIES))
    coverage = 100.0 * (peak - unnamed) / peak if peak else 100.0
    one = df["addr"].to_numpy(np.int64)[ai] != NO_ADDRESS   # (not a CPU run's rows of other threads' bytes)
    top = ai[one][np.argsort(-b_at[one], kind="stable")[:top_n]]     # = DataFrame.nlargest(top_n, "bytes")
    frames = df["frames"].to_numpy(object)
    top_allocs = pd.DataFrame({
        "addr": df["addr"].to_numpy(np.int64)[top], "bytes": b[top],
        "category": cat_names[codes[top]], "stage": df["stage"].to_numpy(object)[top],
        "unit": unit[top], "alloc_us": df["alloc_us"].to_numpy(float)[top],
        "free_us": df["free_us"].to_numpy(float)[top],
        "frames": [fmt_frames(f) for f in frames[top]]})
    timeline = _timeline(df, points) if has_history and peak_seq is not None else None
    br = codes_at == CATEGORIES.index(MC.BEFORE_RECORDING.value)
    sizes = pd.DataFrame({"bytes": b_at[br]}).groupby("bytes").size().rename("count").reset_index()
    sizes["total_bytes"] = sizes["bytes"] * sizes["count"]
    sizes = sizes.sort_values(["total_bytes", "bytes"], ascending=False, kind="stable").reset_index(drop=True)
    by_role = None
    if "fsdp_role" in df:
        role = df["fsdp_role"].to_numpy(object)[ai]
        has = pd.notna(role)
        if has.any():
            by_role = (pd.DataFrame({"unit": unit[ai][has], "fsdp_role": role[has], "bytes": b_at[has]})
                       .groupby(["unit", "fsdp_role"], dropna=False, sort=False)["bytes"].sum().reset_index()
                       .sort_values("bytes", ascending=False, kind="stable").reset_index(drop=True))
    return MemoryResult(rank=rank, source=source, peak_allocated_bytes=peak, peak_ts_us=peak_ts,
                        peak_stage=peak_stage, baseline_bytes=base, breakdown_at_peak=breakdown,
                        by_unit_at_peak=by_unit, timeline=timeline, top_allocations=top_allocs,
                        coverage_pct=coverage, reserved_bytes=None, fragmentation_pct=None, oom=None,
                        allocations=df, warnings=warnings, peak_fsdp_phase=peak_fsdp, peak_seq=peak_seq,
                        by_role_at_peak=by_role, activation_by_unit=activation_by_unit(df, peak_seq),
                        before_recording_sizes=sizes)


def activation_by_unit(df: pd.DataFrame, peak_seq: int | None) -> pd.DataFrame:
    """Per FSDP unit: the most bytes of its activations alive at once (``activation_bytes``, what the
    unit's forward keeps for its backward: A_l of the peak formula) and those alive at the peak."""
    cols = ["unit", "activation_bytes", "at_peak_bytes"]
    act = (df["category"] == MC.ACTIVATION.value).to_numpy() & df["unit"].notna().to_numpy()
    if not act.any():
        return pd.DataFrame(columns=cols)
    a = df.loc[act, ["unit", "alloc_seq", "free_seq", "bytes"]]
    rows = []
    for u, g in a.groupby(a["unit"].astype(str), sort=False):
        lv, _, _ = _levels(g)
        at = int(g.loc[(g["alloc_seq"] <= peak_seq) & (g["free_seq"] > peak_seq), "bytes"].sum()) \
            if peak_seq is not None else int(g.loc[g["free_seq"] == NEVER, "bytes"].sum())
        rows.append((u, int(lv.max()) if len(lv) else 0, at))
    return pd.DataFrame(rows, columns=cols).sort_values("activation_bytes", ascending=False,
                                                         kind="stable").reset_index(drop=True)


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
    # at one event, what it takes away first (frees, and the other threads' negative rows), then what it adds: the
    # levels between never exceed the level after the event
    o = np.lexsort((delta > 0, seq))
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
    out = {"ts_us": t[keep]}
    for k, name in enumerate(CATEGORIES):
        d = np.where(cat == k, delta, 0)
        out[name] = (np.cumsum(d)[keep] + base[k]).astype(np.int64)
    return pd.DataFrame(out)
