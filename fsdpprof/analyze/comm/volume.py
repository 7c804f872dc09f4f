"""Communication volume and bandwidth per collective, with nccl-tests' bus-bandwidth factors.

S is the message size in bytes as the events carry it (all_gather: the whole gathered output;
reduce_scatter: the whole input; others: the input).  For one collective taking t seconds:
algbw = S / t, busbw = algbw * factor(n), n = process-group size:
factor = :func:`fsdpprof.analyze.vocab.ring_factor`.
Bandwidths in GB/s (1e9 bytes/s); times in us.
"""
from __future__ import annotations

import numpy as np
import pandas as pd

from fsdpprof.analyze import vocab
from fsdpprof.analyze.frames import isin


def collective_volume(events: pd.DataFrame, by=("rank", "collective")) -> pd.DataFrame:
    """Per group: count, bytes, time_us, algbw_gbps, busbw_gbps (over events whose size is known)."""
    by = list(by)
    cols = list(dict.fromkeys(by + ["bytes", "dur_us", "group_size", "collective"]))
    c = events.loc[isin(events["kind"], [vocab.KIND_COMM]), cols]
    for k in by:
        if isinstance(c[k].dtype, pd.CategoricalDtype):
            c[k] = c[k].astype(object)
    known = c["bytes"].notna().to_numpy()
    coll = c["collective"].to_numpy(dtype=object)
    c["_known_t"] = np.where(known, c["dur_us"], 0.0)
    c["_bus"] = np.where(known, c["bytes"] * vocab.ring_factor(coll, c["group_size"].to_numpy()), 0.0)
    c["_bus_t"] = np.where(known & np.isfinite(c["_bus"]), c["dur_us"], 0.0)
    c["_bus"] = np.nan_to_num(c["_bus"], nan=0.0)
    g = c.groupby(by, sort=True, dropna=False)
    # two aggregation calls on the small comm-only frame (bytes: NaN when no size is known in the group)
    out = g[["bytes"]].sum(min_count=1).reset_index()
    t = g[["dur_us", "_known_t", "_bus", "_bus_t"]].sum()
    out.insert(len(by), "count", g.size().to_numpy().astype(np.int64))
    out["time_us"] = t["dur_us"].to_numpy()
    known_t, bus, bus_t = (t[k].to_numpy() for k in ("_known_t", "_bus", "_bus_t"))
    with np.errstate(invalid="ignore", divide="ignore"):
        out["algbw_gbps"] = np.where(known_t > 0, out["bytes"].to_numpy() / (known_t * 1e3), np.nan)
        out["busbw_gbps"] = np.where(bus_t > 0, bus / (bus_t * 1e3), np.nan)
    return out
