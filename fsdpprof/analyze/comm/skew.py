"""Cross-rank alignment, collective skew and stragglers (µs).  Each rank's events reduce to one record per
collective call (the map); calls are matched across ranks by (process group, collective, sequence number, else
the call's order), point-to-point left out.  Clocks are aligned on the ends of matched collectives: a rank's
offset is the median of (its end - the mean end over ranks)."""
from __future__ import annotations

import numpy as np
import pandas as pd

from fsdpprof.analyze import model
from fsdpprof.analyze.load.frames import isin

RECORD_COLUMNS = ["rank", "pg", "collective", "key", "by_seq", "ts_us", "end_us"]
SKEW_COLUMNS = ["pg", "seq", "collective", "n_ranks", "start_skew_us", "end_skew_us", "last_rank"]
RANK_LAG_COLUMNS = ["rank", "mean_start_lag_us", "clock_offset_us"]
STRAGGLER_COLUMNS = ["rank", "times_last", "share_last_pct", "mean_start_lag_us", "clock_offset_us"]
_KEYS = ["pg", "collective", "key"]


def collective_records(events: pd.DataFrame) -> pd.DataFrame:
    """One row per collective call (RECORD_COLUMNS) of the comm events, point-to-point left out;
    several kernels of one call share (rank, pg, seq) when seq is known."""
    comm = isin(events["kind"], [model.KIND_COMM]) & ~isin(events["collective"], model.P2P)
    c = events.loc[comm, ["rank", "ts_us", "dur_us", "collective", "pg", "seq"]].copy()
    if not len(c):
        return pd.DataFrame({k: [] for k in RECORD_COLUMNS})
    c["collective"] = c["collective"].astype(object).fillna(model.UNKNOWN_COLLECTIVE).astype(str)
    c["pg"] = c["pg"].astype(object).fillna("default").astype(str)
    c = c.sort_values(["rank", "ts_us"], kind="mergesort")
    order = c.groupby(["rank", "pg", "collective"], sort=False).cumcount().astype(float)
    c["key"] = np.where(c["seq"].notna(), c["seq"], order)
    c["by_seq"] = c["seq"].notna()
    c["end_us"] = c["ts_us"] + c["dur_us"]
    return c.groupby(["rank", "pg", "collective", "key"], sort=False, as_index=False).agg(
        by_seq=("by_seq", "first"), ts_us=("ts_us", "min"), end_us=("end_us", "max"))[RECORD_COLUMNS]


def _on_several_ranks(c: pd.DataFrame) -> pd.DataFrame:
    n = c.groupby(_KEYS, sort=False)["rank"].transform("size")
    return c[n.to_numpy() > 1]


def clock_offsets(records: pd.DataFrame) -> pd.Series:
    """Per rank: clock offset (µs) to subtract so that matched collectives end together."""
    c = _on_several_ranks(records)
    if len(c) == 0:
        return pd.Series(dtype=float)
    dev = c["end_us"] - c.groupby(_KEYS)["end_us"].transform("mean")
    return dev.groupby(c["rank"]).median()


def collective_skew(records: pd.DataFrame) -> tuple[pd.DataFrame, pd.DataFrame]:
    """(skew: SKEW_COLUMNS per collective matched on >= 2 ranks, rank_lag: RANK_LAG_COLUMNS per rank), on aligned
    clocks; last_rank is the rank that started last."""
    empty = (pd.DataFrame(columns=SKEW_COLUMNS), pd.DataFrame(columns=RANK_LAG_COLUMNS))
    c = _on_several_ranks(records)
    if len(c) == 0:
        return empty
    off = clock_offsets(records)
    o = c["rank"].map(off).fillna(0.0).to_numpy()
    c = c.assign(ts_us=c["ts_us"] - o, end_us=c["end_us"] - o)
    g = c.groupby(_KEYS, sort=False)
    last = c.loc[g["ts_us"].idxmax(), _KEYS + ["rank"]].rename(columns={"rank": "last_rank"})
    out = pd.DataFrame({
        "n_ranks": g["rank"].size(),
        "start_skew_us": g["ts_us"].max() - g["ts_us"].min(),
        "end_skew_us": g["end_us"].max() - g["end_us"].min(),
        "first_start_us": g["ts_us"].min(),
    }).reset_index().merge(last, on=_KEYS)
    out = out.sort_values("first_start_us", kind="mergesort").rename(columns={"key": "seq"})
    out = out[SKEW_COLUMNS].reset_index(drop=True)
    lag = (c["ts_us"] - g["ts_us"].transform("min")).groupby(c["rank"]).mean()
    rank_lag = pd.DataFrame({"rank": lag.index.astype(int), "mean_start_lag_us": lag.to_numpy()})
    rank_lag["clock_offset_us"] = rank_lag["rank"].map(off).fillna(0.0).to_numpy()
    return out, rank_lag[RANK_LAG_COLUMNS]


def stragglers(skew: pd.DataFrame, rank_lag: pd.DataFrame) -> pd.DataFrame:
    """Per rank: times_last (collectives it started last), share_last_pct, mean_start_lag_us, clock_offset_us."""
    if len(skew) == 0:
        return pd.DataFrame(columns=STRAGGLER_COLUMNS)
    counts = skew["last_rank"].value_counts()
    out = pd.DataFrame({"rank": counts.index.astype(int), "times_last": counts.to_numpy()})
    allr = rank_lag.assign(rank=rank_lag["rank"].astype(int))
    out = allr.merge(out, on="rank", how="left")
    out["times_last"] = out["times_last"].fillna(0).astype(np.int64)
    out["share_last_pct"] = 100.0 * out["times_last"] / len(skew)
    return out[STRAGGLER_COLUMNS].sort_values("rank").reset_index(drop=True)


# how the ranks of a merged timeline were put on one clock (align_ranks)
ALIGN_ANCHOR = "clock_anchor"          # the clock anchors fsdpprof recorded (rank.json): trace ts + base = Unix time
ALIGN_COLLECTIVES = "collective_ends"  # the ends of the collectives the ranks share (clock_offsets)
ALIGN_NONE = "none"                    # neither: the clocks as recorded
ANCHOR_TOLERANCE_US = 1000.0           # anchors that leave shared collectives this much further apart than their
                                       # ends' alignment does are not used (a wall clock off, a rounded base time)
ALIGNMENT_COLUMNS = ["rank", "offset_us", "method", "residual_us"]


def end_residuals(records: pd.DataFrame, offsets: pd.Series) -> pd.Series:
    """Per rank, with ``offsets`` (µs) subtracted: the median distance of its collectives' ends from the mean end
    over the ranks sharing them (µs; NaN for a rank that shares none)."""
    o = records["rank"].map(offsets).fillna(0.0).to_numpy()
    c = _on_several_ranks(records.assign(end_us=records["end_us"] - o))
    if len(c) == 0:
        return pd.Series(np.nan, index=sorted(records["rank"].unique()))
    dev = (c["end_us"] - c.groupby(_KEYS)["end_us"].transform("mean")).abs()
    return dev.groupby(c["rank"]).median().reindex(sorted(records["rank"].unique()))


def align_ranks(records: pd.DataFrame, ranks, anchors_us: dict | None = None,
                method: str | None = None) -> tuple[pd.DataFrame, list[str]]:
    """One clock for ``ranks``: per rank the offset (whole µs) to subtract from its times, the first rank's clock
    kept (ALIGNMENT_COLUMNS; ``residual_us``: :func:`end_residuals` after it).  ``anchors_us``: rank -> the µs to
    add to its trace times to get Unix time (fsdpprof's clock anchor), used when every rank has one and they
    leave the shared collectives no more than ANCHOR_TOLERANCE_US further apart than the collectives' own
    alignment; otherwise the collectives' ends
    (:func:`clock_offsets`); neither: offsets 0.  ``method``: ALIGN_COLLECTIVES or ALIGN_ANCHOR to use that one
    where it can be (None: as said).  Returns (the table, one line per thing to say)."""
    ranks = sorted(int(r) for r in ranks)
    notes: list[str] = []
    wanted = method
    records = records if records is not None and len(records) else pd.DataFrame({k: [] for k in RECORD_COLUMNS})
    shared = _on_several_ranks(records) if len(records) else records
    by_coll = clock_offsets(records) if len(shared) else pd.Series(dtype=float)
    method, off = ALIGN_NONE, pd.Series(0.0, index=ranks)
    anchors = {r: anchors_us.get(r) for r in ranks} if anchors_us else {}
    have_anchors = bool(anchors) and all(a is not None and np.isfinite(a) for a in anchors.values())
    if wanted == ALIGN_ANCHOR and not have_anchors and len(ranks) > 1:
        notes.append("not every rank has a recorded clock anchor (a run recorded by fsdpprof has): aligned "
                     "on the collectives' ends" if len(by_coll) else "not every rank has a recorded clock anchor")
    if have_anchors and wanted != ALIGN_COLLECTIVES:
        ref = anchors[ranks[0]]
        off = pd.Series({r: float(ref - anchors[r]) for r in ranks})
        method = ALIGN_ANCHOR
        if len(by_coll):
            worst = float(end_residuals(records, off).max())
            best = float(end_residuals(records, by_coll).max())
            if worst > best + ANCHOR_TOLERANCE_US and wanted != ALIGN_ANCHOR:
                notes.append(f"the recorded clock anchors leave collectives the ranks share {worst:,.0f} us apart "
                             f"({best:,.0f} us aligned on their ends): aligned on the collectives' ends instead")
                method = ALIGN_COLLECTIVES
    elif len(by_coll):
        method = ALIGN_COLLECTIVES
    if method == ALIGN_COLLECTIVES:
        off = by_coll.reindex(ranks).fillna(0.0)
        alone = [r for r in ranks if r not in by_coll.index]
        if alone:
            notes.append(f"{model.rank_list(alone)} share{'s' if len(alone) == 1 else ''} no collective with the "
                         f"others: {'its' if len(alone) == 1 else 'their'} clock is left as recorded")
    elif method == ALIGN_NONE and len(ranks) > 1:
        notes.append("the ranks share no collective and have no recorded clock anchor: their clocks are left as "
                     "recorded")
    off = (off - off.get(ranks[0], 0.0)).round() + 0.0    # whole µs: shifted times stay exact (no -0)
    res = end_residuals(records, off) if len(by_coll) else pd.Series(np.nan, index=ranks)
    out = pd.DataFrame({"rank": ranks, "offset_us": off.reindex(ranks).to_numpy(np.float64), "method": method,
                        "residual_us": res.reindex(ranks).to_numpy(np.float64)})
    return out[ALIGNMENT_COLUMNS], notes
