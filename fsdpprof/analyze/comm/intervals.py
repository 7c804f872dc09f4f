"""Vectorised interval arithmetic (sort + cumsum, no Python loop over intervals). Times in us.

Intervals are half-open ``[start, end)`` given as two float arrays.
"""
from __future__ import annotations

import numpy as np
import pandas as pd

from fsdpprof.analyze import model


def union(start: np.ndarray, end: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Merge intervals into disjoint sorted ones; returns (start, end) arrays."""
    start = np.asarray(start, dtype=np.float64)
    end = np.asarray(end, dtype=np.float64)
    ok = end > start
    start, end = start[ok], end[ok]
    if start.size == 0:
        return start, end
    order = np.argsort(start, kind="mergesort")
    s, e = start[order], end[order]
    del order, start, end
    run_end = np.maximum.accumulate(e)
    del e
    # a new group starts where the interval begins after everything before it ended; a group's end is the
    # running end at its last interval (the running end never falls)
    new = np.empty(s.size, dtype=bool)
    new[0] = True
    np.greater(s[1:], run_end[:-1], out=new[1:])
    out_s = s[new]
    new[:-1] = new[1:]                             # (now: the last interval of each group)
    new[-1] = True
    return out_s, run_end[new]


def total(start: np.ndarray, end: np.ndarray) -> float:
    """Length of the union of the intervals."""
    s, e = union(start, end)
    return float((e - s).sum())


def _segments_at(a_start, a_end, b_start, b_end, level_wanted: int) -> tuple[np.ndarray, np.ndarray]:
    """Segments of the merged A and B where A's level (1) plus B's (2) is ``level_wanted``: 3 both, 1 A alone."""
    as_, ae = union(a_start, a_end)
    bs, be = union(b_start, b_end)
    t = np.concatenate([as_, ae, bs, be])
    d = np.concatenate([np.ones(as_.size), -np.ones(ae.size), 2 * np.ones(bs.size), -2 * np.ones(be.size)])
    order = np.lexsort((d, t))        # at equal times apply ends (negative) before starts
    t, d = t[order], d[order]
    at = np.cumsum(d)[:-1] == level_wanted
    seg_s, seg_e = t[:-1][at], t[1:][at]
    keep = seg_e > seg_s
    return seg_s[keep], seg_e[keep]


def intersect(a_start, a_end, b_start, b_end) -> tuple[np.ndarray, np.ndarray]:
    """Intersection of two interval sets (each merged first); returns disjoint sorted (start, end)."""
    if np.size(a_start) == 0 or np.size(b_start) == 0:
        return np.empty(0), np.empty(0)
    return _segments_at(a_start, a_end, b_start, b_end, 3)


def difference(a_start, a_end, b_start, b_end) -> tuple[np.ndarray, np.ndarray]:
    """The parts of the union of A not covered by the union of B: disjoint sorted (start, end)."""
    if np.size(b_start) == 0:
        return union(a_start, a_end)
    if np.size(a_start) == 0:
        return np.empty(0), np.empty(0)
    return union(*_segments_at(a_start, a_end, b_start, b_end, 1))


def overlap_with(start, end, other_start, other_end) -> np.ndarray:
    """Per interval i of (start, end): how long it overlaps the union of ``other`` (us)."""
    start = np.asarray(start, dtype=np.float64)
    end = np.asarray(end, dtype=np.float64)
    os_, oe = union(other_start, other_end)
    if start.size == 0:
        return np.zeros(0)
    if os_.size == 0:
        return np.zeros(start.size)
    cum = np.concatenate([[0.0], np.cumsum(oe - os_)])

    def covered_before(t):
        # length of union(other) inside (-inf, t)
        k = np.searchsorted(os_, t, side="right")       # intervals starting at or before t
        full = cum[k]                                   # total length of those intervals
        last = np.clip(k - 1, 0, None)
        excess = np.where(k > 0, np.clip(oe[last] - t, 0, None), 0.0)
        return full - excess

    return np.clip(covered_before(end) - covered_before(start), 0, None)


def innermost(iv_start: np.ndarray, iv_end: np.ndarray, q: np.ndarray) -> np.ndarray:
    """Index of the innermost interval containing each query time (properly nested intervals), -1 if none.

    Intervals are grouped by nesting depth (non-overlapping within a depth), then each depth is
    searched with ``searchsorted``: a loop over depths only, not over intervals.  The queries are judged
    model.BLOCK_ROWS at a time (the temporaries stay that small; the result is 8 bytes a query).
    """
    iv_start = np.asarray(iv_start, dtype=np.float64)
    iv_end = np.asarray(iv_end, dtype=np.float64)
    q = np.asarray(q, dtype=np.float64)
    res = np.full(q.size, -1, dtype=np.int64)
    if iv_start.size == 0 or q.size == 0:
        return res
    order = np.lexsort((-iv_end, iv_start))
    s, e = iv_start[order], iv_end[order]
    ends_sorted = np.sort(e)
    # depth = intervals started before (or at) me, minus those already ended at my start
    depth = np.arange(s.size) - np.searchsorted(ends_sorted, s, side="right")
    depth = np.maximum(depth, 0)
    levels = [np.flatnonzero(depth == d) for d in np.unique(depth)]
    levels = [(s[sel], e[sel], order[sel]) for sel in levels]
    for lo in range(0, q.size, model.BLOCK_ROWS):
        qb, out = q[lo:lo + model.BLOCK_ROWS], res[lo:lo + model.BLOCK_ROWS]
        for ds, de, ids in levels:                       # deeper levels overwrite shallower ones
            k = np.searchsorted(ds, qb, side="right") - 1
            kk = np.maximum(k, 0)
            inside = (k >= 0) & (qb < de[kk]) & (qb >= ds[kk])
            out[inside] = ids[kk[inside]]
    return res


def grouped_union(group: np.ndarray, start: np.ndarray, end: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """``union`` within each group (integer keys), all groups at once: returns (group, start, end) of the
    disjoint merged intervals, sorted by group then start.  Touching intervals merge, as in ``union``."""
    group = np.asarray(group, dtype=np.int64)
    start = np.asarray(start, dtype=np.float64)
    end = np.asarray(end, dtype=np.float64)
    ok = end > start
    group, start, end = group[ok], start[ok], end[ok]
    if start.size == 0:
        return group, start, end
    order = np.lexsort((start, group))
    g, s, e = group[order], start[order], end[order]
    first = np.empty(g.size, dtype=bool)
    first[0] = True
    first[1:] = g[1:] != g[:-1]
    # running max of the ends within each group (pandas' grouped cummax: exact, no offsets)
    run_end = pd.Series(e).groupby(np.cumsum(first)).cummax().to_numpy()
    new = first.copy()
    new[1:] |= s[1:] > run_end[:-1]
    seg = np.cumsum(new) - 1
    out_e = np.full(int(seg[-1]) + 1, -np.inf)
    np.maximum.at(out_e, seg, run_end)
    return g[new], s[new], out_e
