"""Communication volume and bandwidth per collective: algbw = S / t and busbw = algbw * model.ring_factor(n)
(nccl-tests), S the message bytes the events carry, n the process-group size.  GB/s (1e9 bytes/s), µs."""
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
    """Per group of ``by`` (sorted, missing last): count, bytes, time_us, algbw_gbps, busbw_gbps (bandwidths over
    the events whose size is known)."""
    by = list(by)
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
    # bytes: NaN when no size is known in the group (the other sums hold no NaN)
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
