"""Cross-rank alignment, collective skew and stragglers (microseconds).

Per rank (the map): :func:`collective_records` reduces a rank's events to one row per collective
call.  Across ranks (the reduce, records only): calls are matched by (process group, collective,
sequence number); when the trace has no ``Seq``, by their order within (rank, process group,
collective).  Point-to-point transfers (send/recv, batched p2p: :data:`fsdpprof.analyze.model.P2P`)
are left out: a send has no peer call of the same kind on every rank, so matching them by order
would blame innocent ranks.  Rank clocks are aligned on the ends of matched collectives (a collective
ends at about the same moment on every rank): each rank's offset is the median of (its end - the
mean end over ranks).  After alignment: start_skew_us = latest start - earliest start, end_skew_us =
latest end - earliest end, last_rank = the rank that started last (the one everybody waited for).
"""
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
    """(skew, rank_lag) from the records of all ranks: skew has one row per collective matched on >= 2
    ranks (SKEW_COLUMNS), rank_lag per rank its mean start lag after the earliest rank and its clock
    offset (RANK_LAG_COLUMNS), both after alignment."""
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
    """Per rank: times_last (collectives it started last), share_last_pct, mean_start_lag_us (mean lateness
    of its start after the earliest rank, aligned clocks) and clock_offset_us."""
    if len(skew) == 0:
        return pd.DataFrame(columns=STRAGGLER_COLUMNS)
    counts = skew["last_rank"].value_counts()
    out = pd.DataFrame({"rank": counts.index.astype(int), "times_last": counts.to_numpy()})
    allr = rank_lag.assign(rank=rank_lag["rank"].astype(int))
    out = allr.merge(out, on="rank", how="left")
    out["times_last"] = out["times_last"].fillna(0).astype(np.int64)
    out["share_last_pct"] = 100.0 * out["times_last"] / len(skew)
    return out[STRAGGLER_COLUMNS].sort_values("rank").reset_index(drop=True)
