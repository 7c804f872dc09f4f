"""Communication volume and bandwidth per collective, with nccl-tests' bus-bandwidth factors.

S is the message size in bytes as the events carry it (all_gather: the whole gathered output;
reduce_scatter: the whole input; others: the input).  For one collective taking t seconds:
algbw = S / t, busbw = algbw * factor(n), n = process-group size:
factor = :func:`fsdpprof.analyze.model.ring_factor`.
Bandwidths in GB/s (1e9 bytes/s); times in us.
"""
from __future__ import annotations

import numpy as np
import pandas as pd

from fsdpprof.analyze import model
from fsdpprof.analyze.load.frames import isin


def _key_values(col: pd.Series, rows: np.ndarray) -> np.ndarray:
    """The column's values at ``rows``, a categorical one as objects (NaN where missing: ``astype(object)``)."""
    if isinstance(col.dtype, pd.CategoricalDtype):
        cats = np.append(col.cat.categories.to_numpy(dtype=object), np.nan)
        return cats[col.cat.codes.to_numpy()[rows]]
    return col.to_numpy()[rows]


def collective_volume(events: pd.DataFrame, by=("rank", "collective")) -> pd.DataFrame:
    """Per group: count, bytes, time_us, algbw_gbps, busbw_gbps (over events whose size is known)."""
    by = list(by)
    if by == ["rank", "collective"] and isinstance(events["collective"].dtype, pd.CategoricalDtype):
        return _per_rank_collective(events)
    return _grouped(events, by)


def _grouped(events: pd.DataFrame, by: list[str]) -> pd.DataFrame:
    """collective_volume for any grouping: one pandas groupby over the comm rows."""
    rows = np.flatnonzero(isin(events["kind"], [model.KIND_COMM]))
    keys = {k: _key_values(events[k], rows) for k in by}
    coll = keys["collective"] if "collective" in keys else _key_values(events["collective"], rows)
    nbytes = events["bytes"].to_numpy(dtype=np.float64)[rows]
    dur = events["dur_us"].to_numpy(dtype=np.float64)[rows]
    known = ~np.isnan(nbytes)
    bus = np.where(known, nbytes * model.ring_factor(coll, events["group_size"].to_numpy(dtype=np.float64)[rows]), 0.0)
    c = pd.DataFrame({**keys, "bytes": nbytes, "dur_us": dur, "_known_t": np.where(known, dur, 0.0),
                      "_bus": np.nan_to_num(bus, nan=0.0), "_bus_t": np.where(known & np.isfinite(bus), dur, 0.0)},
                     copy=False)
    # one aggregation call on the small comm-only frame (bytes: NaN when no size is known in the group; the
    # other sums never are: they hold no NaN), the output built once from its index and sums
    g = c.groupby(by, sort=True, dropna=False)
    t = g.sum(min_count=1)
    idx = t.index
    out = {k: idx.get_level_values(i) if len(by) > 1 else idx for i, k in enumerate(by)}
    known_t, bus, bus_t = (t[k].to_numpy() for k in ("_known_t", "_bus", "_bus_t"))
    total = t["bytes"].to_numpy()
    with np.errstate(invalid="ignore", divide="ignore"):
        out.update(count=g.size().to_numpy().astype(np.int64), bytes=total, time_us=t["dur_us"].to_numpy(),
                   algbw_gbps=np.where(known_t > 0, total / (known_t * 1e3), np.nan),
                   busbw_gbps=np.where(bus_t > 0, bus / (bus_t * 1e3), np.nan))
    return pd.DataFrame(out, columns=[*by, "count", "bytes", "time_us", "algbw_gbps", "busbw_gbps"])


def _per_rank_collective(events: pd.DataFrame) -> pd.DataFrame:
    """collective_volume(by=("rank", "collective")) on numpy arrays (the common, hot case): groups sorted by rank,
    then collective name, a missing collective last (as the groupby above sorts them); sums by bincount."""
    rows = np.flatnonzero(isin(events["kind"], [model.KIND_COMM]))
    col = events["collective"]
    cats = col.cat.categories.to_numpy(dtype=object)
    # a code per collective in name order (missing: after every name)
    order = np.argsort(cats.astype(str), kind="stable")
    by_name = np.empty(len(cats) + 1, dtype=np.int64)
    by_name[order] = np.arange(len(cats))
    by_name[-1] = len(cats)
    names = np.append(cats[order], np.nan)
    coll = by_name[col.cat.codes.to_numpy()[rows]]              # (code -1 -> the last slot: missing)
    rank = events["rank"].to_numpy()[rows]
    key = rank.astype(np.int64) * (len(cats) + 1) + coll
    uniq, group = np.unique(key, return_inverse=True)
    nbytes = events["bytes"].to_numpy(dtype=np.float64)[rows]
    dur = events["dur_us"].to_numpy(dtype=np.float64)[rows]
    known = ~np.isnan(nbytes)
    coll_names = names[coll]
    bus = np.where(known, nbytes * model.ring_factor(coll_names, events["group_size"].to_numpy(dtype=np.float64)[rows]),
                   0.0)
    n = len(uniq)

    def total(w):
        return np.bincount(group, weights=w, minlength=n)
    count = np.bincount(group, minlength=n).astype(np.int64)
    total_bytes = np.where(total(known.astype(np.float64)) > 0, total(np.where(known, nbytes, 0.0)), np.nan)
    known_t, bus_t = total(np.where(known, dur, 0.0)), total(np.where(known & np.isfinite(bus), dur, 0.0))
    bus_sum = total(np.nan_to_num(bus, nan=0.0))
    with np.errstate(invalid="ignore", divide="ignore"):
        out = {"rank": (uniq // (len(cats) + 1)).astype(rank.dtype), "collective": names[uniq % (len(cats) + 1)],
               "count": count, "bytes": total_bytes, "time_us": total(dur),
               "algbw_gbps": np.where(known_t > 0, total_bytes / (known_t * 1e3), np.nan),
               "busbw_gbps": np.where(bus_t > 0, bus_sum / (bus_t * 1e3), np.nan)}
    return pd.DataFrame(out, columns=["rank", "collective", "count", "bytes", "time_us", "algbw_gbps", "busbw_gbps"])
