"""Communication / computation overlap and exposed communication (times in microseconds).

Definition (per rank, i.e. per device): let C be the union of the rank's compute intervals
(GPU: compute kernels on any stream; CPU/gloo: leaf CPU ops on non-comm threads) and M_g the
union of the comm intervals (NCCL kernels / gloo work) of group g.  Then

    comm_us            = |M_g|
    overlapped_comm_us = |M_g ∩ C|
    exposed_comm_us    = comm_us - overlapped_comm_us
    overlap_pct        = 100 * overlapped_comm_us / comm_us

Memcpy, memset and sync are neither compute nor comm.  ``overall_overlap`` is the per-rank figure
that HTA's ``get_comm_comp_overlap`` reports (``comp_comm_overlap_pct``).
"""
from __future__ import annotations

import numpy as np
import pandas as pd

from fsdpprof.analyze import intervals, schema

OVERLAP_COLUMNS = ["comm_us", "overlapped_comm_us", "exposed_comm_us", "overlap_pct"]


def _group_union(df: pd.DataFrame, keys: list[str]) -> pd.DataFrame:
    """Merge each group's intervals (columns start, end) into disjoint ones, vectorised over groups."""
    if len(df) == 0:
        return df
    df = df.sort_values(keys + ["start"], kind="mergesort")
    g = df.groupby(keys, sort=False, dropna=False, observed=True)
    run_end = g["end"].cummax()
    prev_end = run_end.groupby([df[k] for k in keys], sort=False, dropna=False, observed=True).shift(1)
    new = prev_end.isna().to_numpy() | (df["start"].to_numpy() > prev_end.to_numpy())
    df = df.assign(_run_end=run_end.to_numpy(), _gid=np.cumsum(new))
    return (df.groupby("_gid", sort=False)
              .agg(**{k: (k, "first") for k in keys}, start=("start", "first"), end=("_run_end", "max"))
              .reset_index(drop=True))


def comm_overlap(events: pd.DataFrame, by=("rank",)) -> pd.DataFrame:
    """Per group of ``by`` (rank and optionally step, collective, phase, unit, ...):
    comm_us, overlapped_comm_us, exposed_comm_us, overlap_pct (see module docstring)."""
    by = list(by)
    if "rank" not in by:
        by = ["rank"] + by
    if by == ["rank"]:
        return _per_rank(events)
    kind = events["kind"].astype(object).to_numpy()
    comm = events.loc[kind == schema.KIND_COMM, by + ["ts_us", "dur_us"]]
    comm = comm.assign(start=comm["ts_us"], end=comm["ts_us"] + comm["dur_us"]).drop(columns=["ts_us", "dur_us"])
    for k in by:
        if isinstance(comm[k].dtype, pd.CategoricalDtype):
            comm[k] = comm[k].astype(object)
    merged = _group_union(comm, by)
    if len(merged) == 0:
        return pd.DataFrame({**{k: [] for k in by}, **{c: [] for c in OVERLAP_COLUMNS}})
    ov = np.zeros(len(merged))
    comp_mask = kind == schema.KIND_COMPUTE
    ranks_c = events["rank"].to_numpy()
    for r in pd.unique(merged["rank"]):
        sel = np.flatnonzero(merged["rank"].to_numpy() == r)
        cm = comp_mask & (ranks_c == r)
        cs = events["ts_us"].to_numpy()[cm]
        ce = cs + events["dur_us"].to_numpy()[cm]
        ov[sel] = intervals.overlap_with(merged["start"].to_numpy()[sel], merged["end"].to_numpy()[sel], cs, ce)
    merged["comm_us"] = merged["end"] - merged["start"]
    merged["overlapped_comm_us"] = ov
    out = merged.groupby(by, sort=True, dropna=False)[["comm_us", "overlapped_comm_us"]].sum().reset_index()
    out["exposed_comm_us"] = out["comm_us"] - out["overlapped_comm_us"]
    with np.errstate(invalid="ignore", divide="ignore"):
        out["overlap_pct"] = np.where(out["comm_us"] > 0, 100.0 * out["overlapped_comm_us"] / out["comm_us"], np.nan)
    return out


def _per_rank(events: pd.DataFrame) -> pd.DataFrame:
    """comm_overlap(by=("rank",)) straight on numpy arrays (the common, hot case)."""
    kind = events["kind"].to_numpy(dtype=object)
    rank = events["rank"].to_numpy()
    ts = events["ts_us"].to_numpy(dtype=np.float64)
    end = ts + events["dur_us"].to_numpy(dtype=np.float64)
    is_comm, is_comp = kind == schema.KIND_COMM, kind == schema.KIND_COMPUTE
    rows = []
    for r in np.unique(rank[is_comm]):
        on = rank == r
        cm, pm = on & is_comm, on & is_comp
        comm_us = intervals.total(ts[cm], end[cm])
        s, e = intervals.intersect(ts[cm], end[cm], ts[pm], end[pm])
        rows.append((r, comm_us, float((e - s).sum())))
    out = pd.DataFrame(rows, columns=["rank", "comm_us", "overlapped_comm_us"])
    out["exposed_comm_us"] = out["comm_us"] - out["overlapped_comm_us"]
    with np.errstate(invalid="ignore", divide="ignore"):
        out["overlap_pct"] = np.where(out["comm_us"] > 0, 100.0 * out["overlapped_comm_us"] / out["comm_us"], np.nan)
    return out


def overall_overlap(events: pd.DataFrame) -> pd.DataFrame:
    """Per rank: compute_us (union), comm_us, overlapped_comm_us, exposed_comm_us,
    comp_comm_overlap_pct (= HTA's get_comm_comp_overlap, in percent)."""
    out = comm_overlap(events, by=("rank",))
    kind = events["kind"].astype(object).to_numpy()
    comp = events.loc[kind == schema.KIND_COMPUTE, ["rank", "ts_us", "dur_us"]]
    ranks = sorted(set(pd.unique(events["rank"])))
    comp_us = {r: intervals.total(g["ts_us"].to_numpy(), (g["ts_us"] + g["dur_us"]).to_numpy())
               for r, g in comp.groupby("rank", sort=True)}
    base = pd.DataFrame({"rank": ranks})
    base["compute_us"] = base["rank"].map(comp_us).fillna(0.0)
    out = base.merge(out, on="rank", how="left")
    out[["comm_us", "overlapped_comm_us", "exposed_comm_us"]] = out[
        ["comm_us", "overlapped_comm_us", "exposed_comm_us"]].fillna(0.0)
    out = out.rename(columns={"overlap_pct": "comp_comm_overlap_pct"})
    return out[["rank", "compute_us", "comm_us", "overlapped_comm_us", "exposed_comm_us", "comp_comm_overlap_pct"]]
