"""Communication / computation overlap and exposed communication per rank (µs).  With C the union of the
rank's compute intervals and M the union of its comm intervals: comm_us = |M|, overlapped_comm_us = |M ∩ C|,
exposed_comm_us = comm_us - overlapped_comm_us, overlap_pct = 100 * overlapped / comm (HTA's
``get_comm_comp_overlap``).  Memcpy, memset and sync are neither compute nor comm."""
from __future__ import annotations

import numpy as np
import pandas as pd

from fsdpprof.analyze.comm import intervals
from fsdpprof.analyze.load.frames import distinct_ranks, isin
from fsdpprof.analyze import model

OVERLAP_COLUMNS = ["comm_us", "overlapped_comm_us", "exposed_comm_us", "overlap_pct"]


def comm_overlap(events: pd.DataFrame, by=("rank",)) -> pd.DataFrame:
    """Per group of ``by`` (rank and optionally step, collective, phase, unit ...): OVERLAP_COLUMNS; groups sorted
    by their keys, missing keys a group of their own."""
    by = list(by)
    if "rank" not in by:
        by = ["rank"] + by
    if by == ["rank"]:
        ranks, _, comm_us, ov_us = _per_rank_arrays(events)
        has = ~np.isnan(comm_us)
        out = pd.DataFrame({"rank": ranks[has], "comm_us": comm_us[has], "overlapped_comm_us": ov_us[has]})
    else:
        out = _grouped_comm(events, by)
        if out is None:
            return pd.DataFrame({**{k: [] for k in by}, **{c: [] for c in OVERLAP_COLUMNS}})
    out["exposed_comm_us"] = out["comm_us"] - out["overlapped_comm_us"]
    with np.errstate(invalid="ignore", divide="ignore"):
        out["overlap_pct"] = np.where(out["comm_us"] > 0, 100.0 * out["overlapped_comm_us"] / out["comm_us"], np.nan)
    return out


def _grouped_comm(events: pd.DataFrame, by: list[str]) -> pd.DataFrame | None:
    """The keys of each group of comm events, its comm_us (union) and overlapped_comm_us; None without comm."""
    is_comm = isin(events["kind"], [model.KIND_COMM])
    keys = events.loc[is_comm, by]
    if len(keys) == 0:
        return None
    keys = keys.assign(**{k: keys[k].astype(object) for k in by if isinstance(keys[k].dtype, pd.CategoricalDtype)})
    # one group number per row, in the order of the sorted keys; each group's intervals merged at once
    grouped = keys.groupby(by, sort=True, dropna=False)
    gid = grouped.ngroup().to_numpy(np.int64)
    n_groups = int(gid.max()) + 1
    first_row = np.unique(gid, return_index=True)[1]
    ts = events["ts_us"].to_numpy(np.float64)
    te = ts + events["dur_us"].to_numpy(np.float64)
    g, ms, me = intervals.grouped_union(gid, ts[is_comm], te[is_comm])
    group_rank = keys["rank"].to_numpy()[first_row]
    ov = np.zeros(len(ms))
    comp = isin(events["kind"], [model.KIND_COMPUTE])
    ranks = events["rank"].to_numpy()
    merged_rank = group_rank[g]
    for r in pd.unique(merged_rank):
        sel = np.flatnonzero(merged_rank == r)
        cm = comp & (ranks == r)
        ov[sel] = intervals.overlap_with(ms[sel], me[sel], ts[cm], te[cm])
    out = grouped.size().index.to_frame(index=False)      # (the groups' keys, in ngroup's order)
    out["comm_us"] = np.bincount(g, weights=me - ms, minlength=n_groups)
    out["overlapped_comm_us"] = np.bincount(g, weights=ov, minlength=n_groups)
    return out


def _per_rank_arrays(events: pd.DataFrame) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
    """Per rank (sorted): ranks, compute_us, comm_us (NaN without comm events), overlapped_comm_us."""
    rank = events["rank"].to_numpy()
    ts = events["ts_us"].to_numpy(dtype=np.float64)
    dur = events["dur_us"].to_numpy(dtype=np.float64)
    comm_rows = np.flatnonzero(isin(events["kind"], [model.KIND_COMM]))     # (rows, not masks of every row)
    comp_rows = np.flatnonzero(isin(events["kind"], [model.KIND_COMPUTE]))
    ranks = distinct_ranks(rank)
    one = ranks.size == 1
    comp_us, comm_us, ov_us = np.zeros(ranks.size), np.full(ranks.size, np.nan), np.full(ranks.size, np.nan)
    for i, r in enumerate(ranks):
        cm = comm_rows if one else comm_rows[rank[comm_rows] == r]
        pm = comp_rows if one else comp_rows[rank[comp_rows] == r]
        p_ts = ts[pm]
        p_ts, p_end = intervals.union(p_ts, p_ts + dur[pm])      # (merged once: the total and the overlap)
        comp_us[i] = float((p_end - p_ts).sum())
        if cm.size:
            c_ts = ts[cm]
            c_ts, c_end = intervals.union(c_ts, c_ts + dur[cm])
            comm_us[i] = float((c_end - c_ts).sum())
            s, e = intervals.intersect(c_ts, c_end, p_ts, p_end)
            ov_us[i] = float((e - s).sum())
    return ranks, comp_us, comm_us, ov_us


def overall_overlap(events: pd.DataFrame) -> pd.DataFrame:
    """Per rank: compute_us (union), comm_us, overlapped_comm_us, exposed_comm_us,
    comp_comm_overlap_pct (= HTA's get_comm_comp_overlap, in percent; NaN for a rank without comm)."""
    ranks, comp_us, comm_us, ov_us = _per_rank_arrays(events)
    has = ~np.isnan(comm_us)
    exposed = comm_us - ov_us
    with np.errstate(invalid="ignore", divide="ignore"):
        pct = np.where(has & (comm_us > 0), 100.0 * ov_us / comm_us, np.nan)
    return pd.DataFrame({"rank": ranks, "compute_us": comp_us, "comm_us": np.where(has, comm_us, 0.0),
                         "overlapped_comm_us": np.where(has, ov_us, 0.0),
                         "exposed_comm_us": np.where(has, exposed, 0.0), "comp_comm_overlap_pct": pct})


EXPOSED_SPAN_COLUMNS = ["rank", "collective", "start_us", "end_us"]


def exposed_comm_spans(events: pd.DataFrame) -> pd.DataFrame:
    """Per rank and collective: the disjoint spans (µs) where it runs and no compute does; they add up to
    :func:`comm_overlap`'s ``exposed_comm_us`` by collective."""
    rows = []
    is_comm, is_comp = isin(events["kind"], [model.KIND_COMM]), isin(events["kind"], [model.KIND_COMPUTE])
    ts = events["ts_us"].to_numpy(np.float64)
    end = ts + events["dur_us"].to_numpy(np.float64)
    rank = events["rank"].to_numpy()
    coll = events["collective"].astype(object).to_numpy()
    coll = np.where(pd.isna(coll), model.UNKNOWN_COLLECTIVE, coll)
    for r in np.unique(rank[is_comm]).tolist():
        on = rank == r
        pm = on & is_comp
        for c in sorted(set(coll[on & is_comm].tolist())):
            cm = on & is_comm & (coll == c)
            s, e = intervals.difference(ts[cm], end[cm], ts[pm], end[pm])
            rows.append(pd.DataFrame({"rank": r, "collective": c, "start_us": s, "end_us": e}))
    if not rows:
        return pd.DataFrame({c: [] for c in EXPOSED_SPAN_COLUMNS})
    return pd.concat(rows, ignore_index=True)[EXPOSED_SPAN_COLUMNS]
