"""GPU time breakdowns per rank, as Holistic Trace Analysis defines them (HTA 0.5 ``breakdown_analysis``):
temporal (idle / compute / non-compute time of the span), kernel type (COMPUTATION, COMMUNICATION, MEMORY
and their overlaps; top kernels) and idle time by cause (host wait: the kernel was launched after the stream
ran dry; kernel wait: a gap under KERNEL_WAIT_THRESHOLD_US; other).  Device events are those on ``stream:N``
lanes; times in µs, percentages 0-100.  Rows are used as passed (HTA drops the last ProfilerStep's kernels)."""
from __future__ import annotations

import numpy as np
import pandas as pd

from fsdpprof.analyze import model
from fsdpprof.analyze.comm import intervals
from fsdpprof.analyze.load.frames import codes_of, isin, on_device

TEMPORAL_COLUMNS = ["rank", "span_us", "idle_time_us", "compute_time_us", "non_compute_time_us",
                    "idle_time_pct", "compute_time_pct", "non_compute_time_pct"]
KERNEL_TYPE_COLUMNS = ["kernel_type", "time_us", "pct"]
TOP_KERNEL_COLUMNS = ["rank", "kernel_type", "name", "count", "sum_us", "mean_us", "min_us", "max_us", "std_us",
                      "type_pct"]
IDLE_COLUMNS = ["rank", "stream", "idle_category", "idle_time_us", "idle_time_pct"]

COMPUTATION, COMMUNICATION, MEMORY, OTHER = "COMPUTATION", "COMMUNICATION", "MEMORY", "OTHER"
# HTA's kernel types, from our kinds
KERNEL_TYPE_OF_KIND = {model.KIND_COMPUTE: COMPUTATION, model.KIND_COMM: COMMUNICATION,
                       model.KIND_MEMCPY: MEMORY, model.KIND_MEMSET: MEMORY, model.KIND_SYNC: OTHER}
# the types of the kernel-type table, in HTA's order (bit i of a "which types run" mask)
TABLE_TYPES = [COMPUTATION, COMMUNICATION, MEMORY]
HOST_WAIT, KERNEL_WAIT, OTHER_WAIT = "host_wait", "kernel_wait", "other"
IDLE_CATEGORIES = [HOST_WAIT, KERNEL_WAIT, OTHER_WAIT]
KERNEL_WAIT_THRESHOLD_US = 30.0


def _device(events: pd.DataFrame) -> dict:
    """The device events (on a stream lane) as numpy arrays; ``type`` indexes TABLE_TYPES (-1: OTHER, i.e. a
    synchronisation: every other kind of KERNEL_TYPE_OF_KIND has a type of the table)."""
    sel = np.flatnonzero(on_device(events["lane"]) & isin(events["kind"], KERNEL_TYPE_OF_KIND))
    ts = events["ts_us"].to_numpy(dtype=np.float64)[sel]
    dur = np.nan_to_num(events["dur_us"].to_numpy(dtype=np.float64)[sel], nan=0.0)
    codes, kinds = codes_of(events["kind"])
    type_of_code = np.array([TABLE_TYPES.index(KERNEL_TYPE_OF_KIND[k]) if KERNEL_TYPE_OF_KIND.get(k) in TABLE_TYPES
                             else -1 for k in kinds] + [-1], dtype=np.int8)
    return {"idx": sel, "rank": events["rank"].to_numpy()[sel].astype(np.int64), "ts": ts, "dur": dur, "end": ts + dur,
            "type": type_of_code[codes[sel]]}


def _union_by_rank(rank: np.ndarray, start: np.ndarray, end: np.ndarray, ranks: np.ndarray) -> np.ndarray:
    """Per rank of ``ranks`` (sorted): length of the union of its intervals (0 when none)."""
    g, s, e = intervals.grouped_union(np.searchsorted(ranks, rank), start, end)
    return np.bincount(g, weights=e - s, minlength=ranks.size) if g.size else np.zeros(ranks.size)


def temporal_breakdown(events: pd.DataFrame) -> pd.DataFrame:
    """Per rank: span_us, idle_time_us, compute_time_us, non_compute_time_us and their _pct of the span."""
    d = _device(events)
    ranks = np.unique(d["rank"])
    if ranks.size == 0:
        return pd.DataFrame({c: [] for c in TEMPORAL_COLUMNS})
    busy = _union_by_rank(d["rank"], d["ts"], d["end"], ranks)
    comp = d["type"] == TABLE_TYPES.index(COMPUTATION)
    compute = _union_by_rank(d["rank"][comp], d["ts"][comp], d["end"][comp], ranks)
    pos = np.searchsorted(ranks, d["rank"])
    first, last = np.full(ranks.size, np.inf), np.full(ranks.size, -np.inf)
    np.minimum.at(first, pos, d["ts"])          # every device event counts for the span, 0 us ones too
    np.maximum.at(last, pos, d["end"])
    span = last - first
    idle = span - busy
    non_compute = span - compute - idle
    out = pd.DataFrame({"rank": ranks, "span_us": span, "idle_time_us": idle, "compute_time_us": compute,
                        "non_compute_time_us": non_compute})
    with np.errstate(invalid="ignore", divide="ignore"):
        for c in ("idle_time", "compute_time", "non_compute_time"):
            out[f"{c}_pct"] = np.where(span > 0, 100.0 * out[f"{c}_us"] / span, np.nan)
    return out[TEMPORAL_COLUMNS]


def _type_name(mask: int) -> str:
    return " overlapping ".join(t for i, t in enumerate(TABLE_TYPES) if mask >> i & 1)


def kernel_type_time(events: pd.DataFrame) -> pd.DataFrame:
    """Per rank and kernel type (``COMPUTATION``, ``COMPUTATION overlapping COMMUNICATION``, ...): time_us
    during which exactly those types run, and pct of the rank's time with any of them running."""
    d = _device(events)
    keep = d["type"] >= 0
    rank, ts, end, typ = (d[k] if keep.all() else d[k][keep] for k in ("rank", "ts", "end", "type"))
    del d
    if rank.size == 0:
        return pd.DataFrame({c: [] for c in ["rank"] + KERNEL_TYPE_COLUMNS})
    ranks = np.unique(rank)
    # merge each (rank, type)'s kernels, then sweep every rank's merged intervals with +bit / -bit
    key = np.searchsorted(ranks, rank) * len(TABLE_TYPES) + typ
    g, s, e = intervals.grouped_union(key, ts, end)
    r_of, bit = g // len(TABLE_TYPES), (1 << (g % len(TABLE_TYPES))).astype(np.int64)
    t = np.concatenate([s, e])
    r2 = np.concatenate([r_of, r_of])
    delta = np.concatenate([bit, -bit])
    order = np.lexsort((delta, t, r2))          # by rank, then time; ends before starts at a tie
    t, r2, delta = t[order], r2[order], delta[order]
    level = np.cumsum(delta)                    # each rank's deltas sum to 0: no reset needed between ranks
    seg = np.diff(t)
    same = r2[1:] == r2[:-1]
    lv = level[:-1]
    use = same & (lv > 0) & (seg > 0)
    n_masks = 1 << len(TABLE_TYPES)
    acc = np.bincount(r2[:-1][use] * n_masks + lv[use], weights=seg[use], minlength=ranks.size * n_masks)
    acc = acc.reshape(ranks.size, n_masks)
    rr, mm = np.nonzero(acc)
    out = pd.DataFrame({"rank": ranks[rr], "kernel_type": [_type_name(m) for m in mm.tolist()],
                        "time_us": acc[rr, mm]})
    total = acc.sum(axis=1)
    out["pct"] = 100.0 * out["time_us"].to_numpy() / total[rr]
    return out.sort_values(["rank", "time_us"], ascending=[True, False], kind="mergesort").reset_index(drop=True)


def kernel_type_breakdown(events: pd.DataFrame, top_n: int = 10) -> tuple[pd.DataFrame, pd.DataFrame]:
    """(:func:`kernel_types_of` over all ranks, :func:`top_kernels`)."""
    return kernel_types_of(kernel_type_time(events)), top_kernels(events, top_n)


def kernel_types_of(per_rank: pd.DataFrame | None) -> pd.DataFrame | None:
    """The per-rank :func:`kernel_type_time` rows summed over ranks: kernel_type, time_us, pct, most time first."""
    if per_rank is None:
        return None
    types = per_rank.groupby("kernel_type", sort=False)["time_us"].sum().reset_index()
    total = types["time_us"].sum()
    types["pct"] = 100.0 * types["time_us"] / total if total > 0 else np.nan
    types = types.sort_values("time_us", ascending=False, kind="mergesort").reset_index(drop=True)
    return types[KERNEL_TYPE_COLUMNS]


def top_kernels(events: pd.DataFrame, top_n: int = 10) -> pd.DataFrame:
    """Per rank and kernel type: the ``top_n`` kernel names with the most total time, then one ``others`` row
    (count, sum_us, mean_us, min_us, max_us, sample std_us as HTA, type_pct of the type's time)."""
    d = _device(events)
    keep = d["type"] >= 0
    idx = d["idx"][keep]
    if idx.size == 0:
        return pd.DataFrame({c: [] for c in TOP_KERNEL_COLUMNS})
    name_codes, name_labels = codes_of(events["name"].iloc[idx])
    rank, typ, dur = d["rank"][keep], d["type"][keep].astype(np.int64), d["dur"][keep]
    # one group per (rank, type, name): numpy reductions over the group index (no pandas groupby)
    (ranks, rank_i) = np.unique(rank, return_inverse=True)
    n_types, n_names = len(TABLE_TYPES), max(len(name_labels), 1)
    gkey, g = np.unique((rank_i * n_types + typ) * n_names + name_codes, return_inverse=True)
    count = np.bincount(g, minlength=gkey.size).astype(np.float64)
    total = np.bincount(g, weights=dur, minlength=gkey.size)
    g_mean = total / count
    m2 = np.bincount(g, weights=(dur - g_mean[g]) ** 2, minlength=gkey.size)   # two passes: no cancellation
    lo, hi = np.full(gkey.size, np.inf), np.full(gkey.size, -np.inf)
    np.minimum.at(lo, g, dur)
    np.maximum.at(hi, g, dur)
    rt, nm = gkey // n_names, gkey % n_names              # (rank, type) of each group, its name code
    # rank the names of each (rank, type) by total time; the top_n keep their row, the rest become "others"
    order = np.lexsort((nm, -total, rt))
    rt_o = rt[order]
    start = np.ones(order.size, dtype=bool)
    start[1:] = rt_o[1:] != rt_o[:-1]
    first = np.maximum.accumulate(np.where(start, np.arange(order.size), 0))
    pos = np.empty(order.size, dtype=np.int64)
    pos[order] = np.arange(order.size) - first
    slot = np.minimum(pos, top_n)                          # top_n: the "others" row
    okey, o = np.unique(rt * (top_n + 1) + slot, return_inverse=True)
    o_count = np.bincount(o, weights=count, minlength=okey.size)
    o_sum = np.bincount(o, weights=total, minlength=okey.size)
    o_lo, o_hi = np.full(okey.size, np.inf), np.full(okey.size, -np.inf)
    np.minimum.at(o_lo, o, lo)
    np.maximum.at(o_hi, o, hi)
    o_name = np.full(okey.size, -1, dtype=np.int64)
    single = slot < top_n
    o_name[o[single]] = nm[single]
    o_rt = okey // (top_n + 1)
    mean = o_sum / o_count
    # the groups' squared deviations combined about the row's mean (Chan et al.'s parallel variance)
    o_m2 = np.bincount(o, weights=m2 + count * (g_mean - mean[o]) ** 2, minlength=okey.size)
    with np.errstate(invalid="ignore", divide="ignore"):
        var = np.where(o_count > 1, o_m2 / (o_count - 1), 0.0)
    _, rt_inv = np.unique(o_rt, return_inverse=True)
    type_total = np.bincount(rt_inv, weights=o_sum)[rt_inv]
    labels = np.asarray(name_labels + ["others"], dtype=object)
    out = pd.DataFrame({
        "rank": ranks[o_rt // n_types], "kernel_type": np.asarray(TABLE_TYPES, dtype=object)[o_rt % n_types],
        "name": labels[o_name], "count": o_count.astype(np.int64), "sum_us": o_sum, "mean_us": mean,
        "min_us": o_lo, "max_us": o_hi, "std_us": np.sqrt(np.clip(var, 0, None)),
        "type_pct": np.where(type_total > 0, 100.0 * o_sum / type_total, np.nan)})
    # rows by rank, type (HTA's order), then most time first with "others" last
    return out.iloc[np.lexsort((okey % (top_n + 1), o_rt))].reset_index(drop=True)[TOP_KERNEL_COLUMNS]


def _idle_by_cause(key: np.ndarray, ts: np.ndarray, end: np.ndarray, launch: np.ndarray,
                   kernel_wait_threshold_us: float) -> tuple[np.ndarray, np.ndarray]:
    """The idle rule over groups of device events (``key``: one timeline each): (each group's first event,
    idle µs per group and IDLE_CATEGORIES cause), groups in key order."""
    order = np.lexsort((ts, key))
    key, ts, end, launch = key[order], ts[order], end[order], launch[order]
    first = np.ones(key.size, dtype=bool)
    first[1:] = key[1:] != key[:-1]
    # latest end before each event in its group: running max of ends, restarted at every group
    grp = np.cumsum(first) - 1
    run_end = pd.Series(end).groupby(grp).cummax().to_numpy()
    prev_end = np.concatenate([[np.nan], run_end[:-1]])
    gap = np.where(first, 0.0, np.clip(ts - prev_end, 0, None))    # the first event of a group: no gap
    host = ~first & (launch > prev_end)                  # NaN launch: False
    cat = np.where(host, 0, np.where(gap < kernel_wait_threshold_us, 1, 2))
    n_groups = int(grp[-1]) + 1 if grp.size else 0
    acc = np.bincount(grp * 3 + cat, weights=gap, minlength=n_groups * 3).reshape(n_groups, 3)
    return order[np.flatnonzero(first)], acc


DEVICE_IDLE_COLUMNS = ["rank", "step", "idle_host_wait_us", "idle_kernel_wait_us", "idle_other_us"]


def device_idle_by_cause(events: pd.DataFrame, kernel_wait_threshold_us: float = KERNEL_WAIT_THRESHOLD_US
                         ) -> pd.DataFrame:
    """Per rank and step: the idle gaps between the device events launched in the step, every stream together,
    by cause (µs, the rule of :func:`idle_time_breakdown`).  Needs column ``launch_ts_us``."""
    d = _device(events)
    step = events["step"].to_numpy(dtype=np.float64)[d["idx"]]
    ok = ~np.isnan(step)
    if not ok.any():
        return pd.DataFrame({c: [] for c in DEVICE_IDLE_COLUMNS})
    launch = events["launch_ts_us"].to_numpy(dtype=np.float64)[d["idx"]][ok]
    steps, step_code = np.unique(step[ok], return_inverse=True)
    rank = d["rank"][ok]
    key = rank * steps.size + step_code
    starts, acc = _idle_by_cause(key, d["ts"][ok], d["end"][ok], launch, kernel_wait_threshold_us)
    return pd.DataFrame({"rank": rank[starts], "step": steps[step_code[starts]], "idle_host_wait_us": acc[:, 0],
                         "idle_kernel_wait_us": acc[:, 1], "idle_other_us": acc[:, 2]})[DEVICE_IDLE_COLUMNS]


def idle_time_breakdown(events: pd.DataFrame, kernel_wait_threshold_us: float = KERNEL_WAIT_THRESHOLD_US
                        ) -> pd.DataFrame:
    """Per rank, stream and idle category: idle_time_us and idle_time_pct of the stream's idle time.  Needs
    column ``launch_ts_us`` (the kernel's CPU launch, NaN when unknown: never host wait)."""
    if "launch_ts_us" not in events.columns:
        raise ValueError("idle_time_breakdown needs the CPU launch time of every kernel (column launch_ts_us, "
                         "NaN where the launch is not in the trace)")
    d = _device(events)
    keep = d["type"] >= 0       # compute, communication, memcpy and memset: not synchronisations
    idx = d["idx"][keep]
    if idx.size == 0:
        return pd.DataFrame({c: [] for c in IDLE_COLUMNS})
    lane_codes, lane_labels = codes_of(events["lane"].iloc[idx])
    rank, ts, end = d["rank"][keep], d["ts"][keep], d["end"][keep]
    launch = events["launch_ts_us"].to_numpy(dtype=np.float64)[idx]
    key = rank * (int(lane_codes.max()) + 1) + lane_codes
    starts, acc = _idle_by_cause(key, ts, end, launch, kernel_wait_threshold_us)
    n_groups = starts.size
    total = acc.sum(axis=1, keepdims=True)
    with np.errstate(invalid="ignore", divide="ignore"):
        pct = np.where(total > 0, 100.0 * acc / total, np.nan)
    rank, lane_codes = rank[starts], lane_codes[starts]
    stream_labels = np.asarray([str(x).split(":", 1)[-1] for x in lane_labels], dtype=object)
    streams = pd.to_numeric(pd.Series(stream_labels[lane_codes]), errors="coerce").to_numpy()
    return pd.DataFrame({
        "rank": np.repeat(rank, 3), "stream": np.repeat(streams, 3),
        "idle_category": np.tile(np.asarray(IDLE_CATEGORIES, dtype=object), n_groups),
        "idle_time_us": acc.ravel(), "idle_time_pct": pct.ravel(),
    })[IDLE_COLUMNS]
