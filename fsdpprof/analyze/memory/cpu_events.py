"""CPU runs: the trace's ``[memory]`` events (+ inventory.json) -> allocations frame.

``Total Allocated`` in a CPU trace counts only what was allocated since profiling began, so memory
alive before the window (sharded params, optimizer state, maybe grads) is invisible to the events.
It comes from two places here: frees of memory allocated before the window (a free event with no
alloc) and the inventory's tensors that no window allocation accounts for. Absolute level =
baseline (alive at the window's start) + window. Bytes are allocator request sizes; times in µs.
"""
from __future__ import annotations

import numpy as np
import pandas as pd

from fsdpprof.analyze import vocab
from fsdpprof.analyze.frames import startswith
from fsdpprof.analyze.memory import categorize as cz
from fsdpprof.analyze.trace import labels
from fsdpprof.analyze.memory.snapshot import NEVER, pair_alloc_free
from fsdpprof.errors import UserError
from fsdpprof.runfmt import INVENTORY_SCHEMA

DEVICE_TYPE_CUDA = 1


def check_inventory(inventory: dict | None, rank: int, world_size: int | None, label: str) -> None:
    """Refuse an inventory.json that belongs to another run (schema, rank or world size mismatch)."""
    if inventory is None:
        return
    if not isinstance(inventory, dict) or inventory.get("schema") != INVENTORY_SCHEMA:
        raise UserError(f"{label}: inventory.json is not schema {INVENTORY_SCHEMA}; record the run again with "
                        f"this fsdpprof version")
    inv_rank, inv_ws = inventory.get("rank"), inventory.get("world_size")
    if inv_rank is not None and int(inv_rank) != int(rank):
        raise UserError(f"{label}: inventory.json is for rank {inv_rank} but the trace is rank {rank}; the rank "
                        f"folder mixes files from different runs, copy the folder from one run")
    if inv_ws is not None and world_size is not None and int(inv_ws) != int(world_size):
        raise UserError(f"{label}: inventory.json has world size {inv_ws} but the trace has {world_size}; it "
                        f"comes from another run, copy the rank folder from one run")


def inventory_tensors(inventory: dict | None, opt_starts: np.ndarray, opt_ends: np.ndarray,
                      t_end: float) -> pd.DataFrame:
    """Inventory tensors with the reference time (µs) at which each was captured.

    params: before the last optimizer step; optimizer state: after it; grads of optimizer step ``s``:
    before the optimizer step it belongs to (aligned from the last step in the window backwards).
    Tensors that share a storage are counted once (addr = storage address, bytes = storage bytes).
    """
    cols = ["addr", "bytes", "tensor_bytes", "category", "ref_us", "unit", "name", "role", "step"]
    tens = (inventory or {}).get("tensors") or []
    if not tens:
        return pd.DataFrame(columns=cols)
    t = pd.DataFrame(tens)
    for c in ("storage_ptr", "storage_nbytes", "bytes", "step", "unit", "name", "role", "device"):
        if c not in t:
            t[c] = None
    t = t[t["role"].isin(list(cz.ROLE_TO_CATEGORY))]
    last_opt = float(opt_starts[-1]) if len(opt_starts) else t_end
    last_opt_end = float(opt_ends[-1]) if len(opt_ends) else t_end
    ref = np.where(t["role"] == "optimizer_state", last_opt_end, last_opt).astype(float)
    g = (t["role"] == "grad").to_numpy()
    if g.any() and len(opt_starts):
        steps = pd.to_numeric(t.loc[g, "step"], errors="coerce")
        uniq = np.sort(steps.dropna().unique())
        # the k-th from last inventory step <-> the k-th from last optimizer step in the trace
        k_from_end = len(uniq) - 1 - np.searchsorted(uniq, steps.fillna(uniq[-1] if len(uniq) else 0).to_numpy())
        pos = len(opt_starts) - 1 - k_from_end
        ref_g = np.where(pos >= 0, opt_starts[np.clip(pos, 0, None)], np.nan)
        ref[g] = ref_g
    out = pd.DataFrame({
        "addr": pd.to_numeric(t["storage_ptr"], errors="coerce").fillna(-1).astype(np.int64).to_numpy(),
        "bytes": pd.to_numeric(t["storage_nbytes"], errors="coerce").fillna(t["bytes"]).astype(np.int64).to_numpy(),
        "tensor_bytes": pd.to_numeric(t["bytes"], errors="coerce").fillna(0).astype(np.int64).to_numpy(),
        "category": t["role"].map(cz.ROLE_TO_CATEGORY).to_numpy(object),
        "ref_us": ref, "unit": t["unit"].to_numpy(object), "name": t["name"].to_numpy(object),
        "role": t["role"].to_numpy(object), "step": pd.to_numeric(t["step"], errors="coerce").to_numpy()})
    out = out[(out["addr"] > 0) & np.isfinite(out["ref_us"])]
    # one storage, one label: FSDP1 views and tensors sharing a storage collapse to their storage
    return out.drop_duplicates(["addr", "ref_us", "category"]).reset_index(drop=True)


def cpu_allocations(memory_events: pd.DataFrame, events: pd.DataFrame | None, inventory: dict | None,
                    label: str) -> tuple[pd.DataFrame, pd.DataFrame, list[str]]:
    """Pair a trace's memory events into allocations and add what was alive before the window.

    Returns (allocations annotated with phase/fsdp_phase/unit, inventory tensors with ref times, warnings).
    """
    warnings: list[str] = []
    me = memory_events
    if (me["device_type"] == DEVICE_TYPE_CUDA).any():
        me = me[me["device_type"] == DEVICE_TYPE_CUDA]
        warnings.append(f"{label}: GPU trace without a CUDA snapshot: memory taken from the trace's CUDA "
                        f"[memory] events (no frames, no segments)")
    me = me.sort_values("ts_us", kind="stable")
    ts = me["ts_us"].to_numpy(float)
    addr = me["addr"].to_numpy(np.int64)
    b = me["bytes"].to_numpy(np.int64)
    seq = np.arange(len(me), dtype=np.int64)
    pr = pair_alloc_free(seq, addr, b > 0, ts)
    ar, of = pr["alloc_rows"], pr["orphan_free_rows"]
    if pr["n_realloc"]:
        warnings.append(f"{label}: {pr['n_realloc']} address(es) allocated again without a free event between; "
                        f"the earlier allocation is taken as freed at the second")
    t0 = float(ts[0]) if len(ts) else 0.0
    dev = me["device_id"].to_numpy(np.int16)
    allocs = pd.DataFrame({
        "addr": np.concatenate([addr[ar], addr[of]]),
        "bytes": np.concatenate([b[ar], -b[of]]),
        "alloc_us": np.concatenate([ts[ar], np.full(len(of), t0)]),
        "free_us": np.concatenate([pr["free_us"], ts[of]]),
        "alloc_seq": np.concatenate([seq[ar], np.full(len(of), -1, np.int64)]),
        "free_seq": np.concatenate([pr["free_seq"], seq[of]]),
        "device": np.concatenate([dev[ar], dev[of]]).astype(np.int16),
        "stream": np.int64(0),
        "before_trace": np.concatenate([np.zeros(len(ar), bool), np.ones(len(of), bool)]),
        "free_inferred": np.concatenate([pr["free_inferred"], np.zeros(len(of), bool)]),
    })
    # reference times for the inventory: the optimizer steps in the window
    marks = labels.step_marks(events)
    opt = events[startswith(events["name"], (vocab.OPTIMIZER_PREFIX,))] if events is not None and len(events) else None
    opt_starts = np.sort(opt["ts_us"].to_numpy(float)) if opt is not None and len(opt) else np.array([])
    opt_ends = np.sort((opt["ts_us"] + opt["dur_us"]).to_numpy(float)) if opt is not None and len(opt) else np.array([])
    t_end = float(ts[-1]) if len(ts) else 0.0
    inv_t = inventory_tensors(inventory, opt_starts, opt_ends, t_end)
    if inventory is not None and not len(opt_starts):
        warnings.append(f"{label}: no Optimizer.step in the trace: inventory tensors matched at the end of the window")

    # inventory tensors that no allocation accounts for were alive since before the window
    if len(inv_t):
        matched = _matched_inventory(allocs, inv_t)
        extra = inv_t[~matched].drop_duplicates("addr")
        # an address may already be a pre-window allocation at another reference time: keep one
        extra = extra[~extra["addr"].isin(allocs.loc[allocs["before_trace"], "addr"])]
        if len(extra):
            allocs = pd.concat([allocs, pd.DataFrame({
                "addr": extra["addr"].to_numpy(np.int64), "bytes": extra["bytes"].to_numpy(np.int64),
                "alloc_us": t0, "free_us": np.nan, "alloc_seq": np.int64(-1), "free_seq": NEVER,
                "device": np.int16(0), "stream": np.int64(0), "before_trace": True, "free_inferred": False})],
                ignore_index=True)
    allocs["user_metadata"] = ""
    allocs["frames"] = pd.Series([None] * len(allocs), dtype=object)
    annotate_from_events(allocs, events, marks)
    n_lost, lost_bytes = _infer_lost_frees(allocs, ts, events, marks)
    if n_lost:
        warnings.append(f"{label}: {n_lost} FSDP all-gather / reduce-scatter buffer(s) ({lost_bytes / 2**20:.2f} MiB) "
                        f"have no free "
                        f"event in the window although the same unit's buffers are freed in every other step (a free "
                        f"probably on a communication thread the profiler did not record); taken as freed after "
                        f"their usual lifetime")
    return allocs, inv_t, warnings


TRANSIENT_PHASES = ("all_gather", "foreach_all_gather")
# reduce phases: their buffers are transient when their peers die in the step that made them (the reduce-scatter
# input, held by the collective's work object, is freed wherever that object goes: often on gloo's thread);
# the new sharded gradient made there lives into the next step and is left alone
REDUCE_TRANSIENT_PHASES = ("post_backward_reduce", "foreach_reduce", "reduce_scatter", "post_backward")


def _infer_lost_frees(allocs: pd.DataFrame, ts: np.ndarray, events, marks) -> tuple[int, int]:
    """FSDP frees every all-gather output at the next unshard, and every reduce-scatter input within the
    backward that made it. One that is still alive at the end of the window while its peers (same FSDP
    phase, unit, coarse phase and size, other steps) were freed lost its free event: give it the peers'
    median lifetime. One whose free was only inferred from a later allocation at the same address (that
    may be steps later) gets the peers' lifetime too when that ends it earlier. Returns (count, bytes)
    fixed (in place)."""
    fp = allocs["fsdp_phase"].astype(object)
    gather = fp.isin(TRANSIENT_PHASES).to_numpy()
    reduce_ = fp.isin(REDUCE_TRANSIENT_PHASES).to_numpy()
    transient = (gather | reduce_) & ~allocs["before_trace"].to_numpy()
    never = allocs["free_seq"].to_numpy() == NEVER
    by_realloc = allocs["free_inferred"].to_numpy(bool) & ~never
    cand = transient & (never | by_realloc)
    if not cand.any():
        return 0, 0
    key = (fp.fillna("") + "|" + allocs["unit"].astype(object).fillna("<none>") + "|"
           + allocs["stage"].astype(object).fillna("") + "|" + allocs["bytes"].astype(str))
    same_step = (allocs["free_step_idx"] == allocs["step_idx"]).to_numpy()
    freed = transient & ~never & ~by_realloc & (gather | same_step)
    # a reduce-phase size whose peers outlive their step (the sharded gradient) is not transient
    outlives = pd.Series(reduce_ & ~never & ~by_realloc & ~same_step).groupby(key).any()
    cand &= ~(reduce_ & outlives.reindex(key).fillna(False).to_numpy(bool))
    life = (allocs["free_us"] - allocs["alloc_us"]).where(freed)
    med = life.groupby(key).median()
    n_peers = life.groupby(key).count()
    idx = np.flatnonzero(cand)
    k = key.iloc[idx]
    ok = (n_peers.reindex(k).fillna(0).to_numpy() >= 1)
    idx, k = idx[ok], k[ok]
    if not len(idx):
        return 0, 0
    free_us = allocs["alloc_us"].to_numpy(float)[idx] + med.reindex(k).to_numpy(float)
    pos = np.searchsorted(ts, free_us, side="left")
    # a free inferred from re-allocation stands unless the peers' lifetime ends the buffer earlier
    inside = (pos < len(ts)) & (never[idx] | (free_us < allocs["free_us"].to_numpy(float)[idx]))
    idx, free_us, pos = idx[inside], free_us[inside], pos[inside]
    if not len(idx):
        return 0, 0
    rows = allocs.index[idx]
    allocs.loc[rows, "free_us"] = free_us
    allocs.loc[rows, "free_seq"] = pos.astype(np.int64)  # just before the event at that time
    allocs.loc[rows, "free_inferred"] = True
    allocs.loc[rows, "free_stage"] = stage_at(free_us, marks)
    ann = labels.fsdp_intervals(events)
    allocs.loc[rows, "free_fsdp_phase"] = cz.paint(free_us, ann, "fsdp_phase")
    starts = marks["start_us"].to_numpy(float) if len(marks) else np.array([-np.inf])
    allocs.loc[rows, "free_step_idx"] = np.searchsorted(starts, free_us, side="right") - 1
    return len(idx), int(allocs.loc[rows, "bytes"].sum())


def _matched_inventory(allocs: pd.DataFrame, inv_t: pd.DataFrame) -> np.ndarray:
    a = allocs[["addr", "alloc_us", "free_us"]]
    m = inv_t.reset_index().merge(a, on="addr", how="inner")
    ok = (m["alloc_us"] <= m["ref_us"]) & (m["ref_us"] < m["free_us"].fillna(np.inf))
    hit = np.zeros(len(inv_t), bool)
    hit[m.loc[ok, "index"].to_numpy()] = True
    return hit


def annotate_from_events(allocs: pd.DataFrame, events: pd.DataFrame | None, marks: pd.DataFrame) -> None:
    """Add stage, fsdp_phase, unit, free_stage, free_fsdp_phase, step_idx, free_step_idx, frame_sig,
    fsdp_family from the trace's annotations at the allocation's and the free's time (in place)."""
    at, ft = allocs["alloc_us"].to_numpy(float), allocs["free_us"].to_numpy(float)
    pre = allocs["before_trace"].to_numpy(bool)
    ann = labels.fsdp_intervals(events)
    scopes = cz._pair_intervals(ann) if len(ann) else pd.DataFrame(columns=["ts_us", "end_us", "unit"])
    unit_iv = pd.concat([scopes, ann.loc[ann["unit"].notna(), ["ts_us", "end_us", "unit"]]], ignore_index=True)
    stage = stage_at(at, marks)
    stage[pre] = None
    allocs["stage"] = stage
    fp = cz.paint(at, ann, "fsdp_phase")
    fp[pre] = None
    allocs["fsdp_phase"] = fp
    un = cz.paint(at, unit_iv, "unit")
    un[pre] = None
    allocs["unit"] = un
    ftf = np.where(np.isnan(ft), -np.inf, ft)
    allocs["free_stage"] = stage_at(ftf, marks)
    allocs["free_fsdp_phase"] = cz.paint(ftf, ann, "fsdp_phase")
    starts = marks["start_us"].to_numpy(float) if len(marks) else np.array([-np.inf])
    sidx = np.searchsorted(starts, at, side="right") - 1
    sidx[pre] = -1
    allocs["step_idx"] = sidx
    allocs["free_step_idx"] = np.where(np.isnan(ft), 1 << 30, np.searchsorted(starts, ftf, side="right") - 1)
    allocs["frame_sig"] = ""
    fams = set(ann["family"].dropna()) if len(ann) else set()
    allocs["fsdp_family"] = "fsdp1" if "fsdp1" in fams else ("fsdp2" if "fsdp2" in fams else None)


def stage_at(ts: np.ndarray, marks: pd.DataFrame) -> np.ndarray:
    """vocab.stage_at for memory: outside every step (or before the window) there is no stage (None)."""
    st = vocab.stage_at(ts, marks)
    st[st == vocab.STAGE_OUTSIDE] = None
    return st
