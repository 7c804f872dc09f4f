"""Frees of FSDP all-gather buffers that a CPU trace lost, inferred by FSDP's own rules: a hand-built
allocations frame (the shape cpu_events.cpu_allocations builds) whose expected inference is exact."""
from __future__ import annotations

import numpy as np
import pandas as pd

from fsdpprof.analyze import model
from fsdpprof.analyze.memory.cpu_events import fsdp_free_bounds, infer_lost_frees
from fsdpprof.analyze.memory.snapshot import NEVER

MIB = 1 << 20


def _frame(rows: list[dict]) -> pd.DataFrame:
    """An allocations frame as annotate_from_events leaves it (one step, index 0)."""
    df = pd.DataFrame(rows)
    n = len(df)
    df["addr"] = np.arange(1, n + 1, dtype=np.int64) * 4096
    df["alloc_seq"] = df["alloc_seq"].astype(np.int64)
    df["free_seq"] = df["free_seq"].astype(np.int64)
    df["free_us"] = df["free_us"].astype(float)
    df["before_trace"] = False
    df["free_inferred"] = df.get("free_inferred", pd.Series(False, index=df.index)).fillna(False).astype(bool)
    df["step_idx"] = 0
    df["free_step_idx"] = np.where(df["free_seq"] == NEVER, 1 << 30, 0)
    df["free_stage"] = np.where(df["free_seq"] == NEVER, None, df["stage"])
    df["free_fsdp_phase"] = None
    return df


def _case():
    """One FSDP2 step of two units, times in µs.  Annotations (ts_us, end_us):
    forward:  all_gather(u1) 10-12, copy_out(u1) 14-16, all_gather(u2) 20-22, copy_out(u2) 24-26
    backward: all_gather(u2) 60-62, copy_out(u2) 64-66, all_gather(u1) 70-72, copy_out(u1) 74-76
    Memory events happen at the allocation / free times below (ts)."""
    iv = pd.DataFrame([
        (10, 12, "all_gather", "u1"), (14, 16, "all_gather_copy_out", "u1"),
        (20, 22, "all_gather", "u2"), (24, 26, "all_gather_copy_out", "u2"),
        (60, 62, "all_gather", "u2"), (64, 66, "all_gather_copy_out", "u2"),
        (70, 72, "all_gather", "u1"), (74, 76, "all_gather_copy_out", "u1"),
    ], columns=["ts_us", "end_us", "fsdp_phase", "unit"]).assign(family="fsdp2")
    ts = np.array([11, 15, 21, 24.5, 25, 30, 40, 61, 65, 66.5, 67, 71, 75, 76.5, 80, 90], dtype=float)
    seq = {t: i for i, t in enumerate(ts)}
    rows = [
        # forward flat output of u1: freed at u2's wait_for_unshard (24.5, before u2's copy-out) -- LOST
        dict(bytes=8 * MIB, alloc_us=11, alloc_seq=seq[11], free_us=np.nan, free_seq=NEVER, stage="forward",
             fsdp_phase="all_gather", unit="u1"),
        # copy-out of u1 in forward, freed at reshard (30)
        dict(bytes=8 * MIB, alloc_us=15, alloc_seq=seq[15], free_us=30, free_seq=seq[30], stage="forward",
             fsdp_phase="all_gather_copy_out", unit="u1"),
        # forward flat output of u2, freed at the root's post-forward (40)
        dict(bytes=8 * MIB, alloc_us=21, alloc_seq=seq[21], free_us=40, free_seq=seq[40], stage="forward",
             fsdp_phase="all_gather", unit="u2"),
        # copy-out of u2 in forward -- its free LOST (reshard after forward would free it before 60)
        dict(bytes=8 * MIB, alloc_us=25, alloc_seq=seq[25], free_us=np.nan, free_seq=NEVER, stage="forward",
             fsdp_phase="all_gather_copy_out", unit="u2"),
        # backward flat output of u2: freed right after its copy-out (66.5) -- free only inferred from a
        # reuse of the address much later (90)
        dict(bytes=8 * MIB, alloc_us=61, alloc_seq=seq[61], free_us=90, free_seq=seq[90], stage="backward",
             fsdp_phase="all_gather", unit="u2", free_inferred=True),
        dict(bytes=8 * MIB, alloc_us=65, alloc_seq=seq[65], free_us=67, free_seq=seq[67], stage="backward",
             fsdp_phase="all_gather_copy_out", unit="u2"),
        # backward flat output of u1: its free recorded (76.5): stands
        dict(bytes=8 * MIB, alloc_us=71, alloc_seq=seq[71], free_us=76.5, free_seq=seq[76.5], stage="backward",
             fsdp_phase="all_gather", unit="u1"),
        dict(bytes=8 * MIB, alloc_us=75, alloc_seq=seq[75], free_us=80, free_seq=seq[80], stage="backward",
             fsdp_phase="all_gather_copy_out", unit="u1"),
        # an activation that lives to the end: no FSDP rule applies to it
        dict(bytes=1 * MIB, alloc_us=21, alloc_seq=seq[21], free_us=np.nan, free_seq=NEVER, stage="forward",
             fsdp_phase=None, unit="u2"),
    ]
    marks = pd.DataFrame([dict(step=1.0, start_us=0.0, end_us=100.0, fwd_us=5.0, bwd_us=50.0, opt_us=85.0,
                               opt_end_us=95.0)], columns=model.STEP_MARK_COLUMNS)
    return _frame(rows), ts, iv, marks, seq


def test_fsdp_free_bounds_exact():
    allocs, ts, iv, marks, seq = _case()
    b = fsdp_free_bounds(allocs, iv)
    # flat output in forward: before the next copy-out that starts after its own copy-out (u2's at 24);
    # and never after the unit's next all-gather (70)
    assert b[0] == 24
    # a copy-out: before the unit's next all-gather
    assert b[1] == 70 and b[3] == 60
    # flat output in backward: before the next all-gather after its own copy-out (u1's at 70)
    assert b[4] == 70
    assert b[6] == np.inf          # u1's last all-gather of the window: no later all-gather or copy-out bounds it
    assert b[8] == np.inf          # not an FSDP buffer


def test_lost_frees_inferred_exactly():
    allocs, ts, iv, marks, seq = _case()
    before = allocs.copy()
    n, nbytes = infer_lost_frees(allocs, ts, iv, marks)
    assert (n, nbytes) == (3, 24 * MIB)
    # the lost free of u1's forward flat output: at u2's copy-out (24), ordered before the event at 24.5
    assert allocs.loc[0, "free_us"] == 24 and allocs.loc[0, "free_seq"] == seq[24.5]
    # u2's lost copy-out free: at u2's next all-gather (60)
    assert allocs.loc[3, "free_us"] == 60 and allocs.loc[3, "free_seq"] == seq[61]
    # a free inferred from a late reuse of the address is brought back to FSDP's bound
    assert allocs.loc[4, "free_us"] == 70 and allocs.loc[4, "free_seq"] == seq[71]
    assert allocs.loc[[0, 3, 4], "free_inferred"].all()
    assert list(allocs.loc[[0, 3, 4], "free_stage"]) == ["forward", "backward", "backward"]
    assert list(allocs.loc[[0, 3, 4], "free_fsdp_phase"]) == ["all_gather_copy_out", "all_gather", "all_gather"]
    # recorded frees and non-FSDP allocations are left as they were
    for i in (1, 2, 5, 6, 7, 8):
        assert allocs.loc[i, "free_us"] == before.loc[i, "free_us"] or (
            np.isnan(allocs.loc[i, "free_us"]) and np.isnan(before.loc[i, "free_us"]))
    # the FSDP invariant holds all through: per unit and phase, at most one buffer alive at a time
    for (u, ph), g in allocs[allocs["fsdp_phase"].notna()].groupby(["unit", "fsdp_phase"]):
        ev = sorted([(a, 1) for a in g["alloc_seq"]] + [(f, -1) for f in g["free_seq"]])
        level = np.cumsum([d for _, d in ev])
        assert level.max() <= 1, (u, ph)


def test_lost_free_without_bound_takes_peers_lifetime():
    """The last all-gather output of the window: no later all-gather bounds it; peers (same unit, phase and
    stage, other steps) lend their median lifetime, as before."""
    allocs, ts, iv, marks, seq = _case()
    allocs.loc[6, ["free_us", "free_seq"]] = [np.nan, NEVER]
    # a peer of u1's backward flat output, freed 4 µs after its allocation (an earlier step)
    peer = allocs.loc[[6]].copy()
    peer[["alloc_us", "free_us", "alloc_seq", "free_seq"]] = [1.0, 5.0, 0, 1]
    # an earlier step's: peers are the same buffer of the collective in another step (its place among the unit's
    # same-size buffers of its own step), not a second buffer of this step
    peer[["step_idx", "free_step_idx"]] = peer[["step_idx", "step_idx"]].to_numpy() - 1
    allocs = pd.concat([allocs, peer], ignore_index=True)
    n, _ = infer_lost_frees(allocs, ts, iv, marks)
    assert n == 4
    assert allocs.loc[6, "free_us"] == 71 + 4
