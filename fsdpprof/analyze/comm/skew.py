"""Cross-rank alignment, collective skew and stragglers (microseconds).

Collectives are matched across ranks by (process group, sequence number); when the trace has no
``Seq``, by their order within (rank, process group, collective).  Rank clocks are aligned on the
ends of matched collectives (a collective ends at about the same moment on every rank): each
rank's offset is the median of (its end - the mean end over ranks).  After alignment:
start_skew_us = latest start - earliest start, end_skew_us = latest end - earliest end,
last_rank = the rank that started last (the one everybody waited for).
"""
from __future__ import annotations

import numpy as np
import pandas as pd

from fsdpprof.analyze import vocab

SKEW_COLUMNS = ["pg", "seq", "collective", "n_ranks", "start_skew_us", "end_skew_us", "last_rank"]


def _matched(events: pd.DataFrame) -> pd.DataFrame:
    kind = events["kind"].astype(object).to_numpy()
    c = events.loc[kind == vocab.KIND_COMM, ["rank", "ts_us", "dur_us", "collective", "pg", "seq"]].copy()
    c["collective"] = c["collective"].astype(object).fillna("unknown")
    c["pg"] = c["pg"].astype(object).fillna("default").astype(str)
    c = c.sort_values(["rank", "ts_us"], kind="mergesort")
    # one row per collective call: several kernels of one call share (rank, pg, seq) when seq is known
    order = c.groupby(["rank", "pg", "collective"], sort=False).cumcount().astype(float)
    c["key"] = np.where(c["seq"].notna(), c["seq"], order)
    c["by_seq"] = c["seq"].notna()
    c["end_us"] = c["ts_us"] + c["dur_us"]
    c = c.groupby(["rank", "pg", "collective", "key"], sort=False, as_index=False).agg(
        ts_us=("ts_us", "min"), end_us=("end_us", "max"))
    return c


def clock_offsets(events: pd.DataFrame) -> pd.Series:
    """Per rank: clock offset (us) to subtract so that matched collectives end together."""
    c = _matched(events)
    if len(c) == 0:
        return pd.Series(dtype=float)
    g = c.groupby(["pg", "collective", "key"])
    c["n"] = g["rank"].transform("size")
    c = c[c["n"] > 1]
    c["dev"] = c["end_us"] - c.groupby(["pg", "collective", "key"])["end_us"].transform("mean")
    return c.groupby("rank")["dev"].median()


def collective_skew(events: pd.DataFrame) -> pd.DataFrame:
    """Per collective matched on >= 2 ranks: pg, seq, collective, n_ranks, start_skew_us, end_skew_us, last_rank."""
    c = _matched(events)
    if len(c) == 0:
        return pd.DataFrame(columns=SKEW_COLUMNS)
    off = clock_offsets(events)
    o = c["rank"].map(off).fillna(0.0).to_numpy()
    c["ts_us"] = c["ts_us"] - o
    c["end_us"] = c["end_us"] - o
    keys = ["pg", "collective", "key"]
    g = c.groupby(keys, sort=False)
    c["n"] = g["rank"].transform("size")
    c = c[c["n"] > 1]
    if len(c) == 0:
        return pd.DataFrame(columns=SKEW_COLUMNS)
    g = c.groupby(keys, sort=False)
    last = c.loc[g["ts_us"].idxmax(), keys + ["rank"]].rename(columns={"rank": "last_rank"})
    out = pd.DataFrame({
        "n_ranks": g["rank"].size(),
        "start_skew_us": g["ts_us"].max() - g["ts_us"].min(),
        "end_skew_us": g["end_us"].max() - g["end_us"].min(),
        "first_start_us": g["ts_us"].min(),
    }).reset_index().merge(last, on=keys)
    out = out.sort_values("first_start_us", kind="mergesort").rename(columns={"key": "seq"})
    out = out[SKEW_COLUMNS].reset_index(drop=True)
    # per-rank lateness travels with the frame so that stragglers(skew) needs nothing else
    c["lag"] = c["ts_us"] - c.groupby(keys)["ts_us"].transform("min")
    per_rank = c.groupby("rank")["lag"].mean().rename("mean_start_lag_us").reset_index()
    per_rank["clock_offset_us"] = per_rank["rank"].map(off).fillna(0.0).to_numpy()
    out.attrs["per_rank"] = per_rank.to_dict("list")
    return out


def stragglers(skew: pd.DataFrame, events: pd.DataFrame | None = None) -> pd.DataFrame:
    """Per rank: times_last (collectives it started last), share_last_pct, mean_start_lag_us (mean lateness of
    its start after the earliest rank, aligned clocks) and clock_offset_us.  ``events`` is only needed when
    ``skew`` lost its attrs (then they are recomputed)."""
    cols = ["rank", "times_last", "share_last_pct", "mean_start_lag_us", "clock_offset_us"]
    if len(skew) == 0:
        return pd.DataFrame(columns=cols)
    per_rank = skew.attrs.get("per_rank")
    if per_rank is None and events is not None:
        per_rank = collective_skew(events).attrs.get("per_rank")
    counts = skew["last_rank"].value_counts()
    out = pd.DataFrame({"rank": counts.index.astype(int), "times_last": counts.to_numpy()})
    if per_rank is not None:
        allr = pd.DataFrame(per_rank)
        allr["rank"] = allr["rank"].astype(int)
        out = allr.merge(out, on="rank", how="left")
    else:
        out["mean_start_lag_us"] = np.nan
        out["clock_offset_us"] = np.nan
    out["times_last"] = out["times_last"].fillna(0).astype(np.int64)
    out["share_last_pct"] = 100.0 * out["times_last"] / len(skew)
    return out[cols].sort_values("rank").reset_index(drop=True)
