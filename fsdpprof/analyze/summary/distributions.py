"""Per-rank tables as distributions over ranks, of a size that does not grow with the ranks: *statistics* (one
row per STATISTICS over ranks, plus the mean; ``ranks`` counts ranks with a value), *worst* (the WORST_N worst
ranks' rows for one column) and *grouped* (per collective / step / category: totals, p50 / p90 / max over
ranks and the ``worst_rank``)."""
from __future__ import annotations

import numpy as np
import pandas as pd

STATISTICS = [("min", 0.0), ("p10", 0.10), ("p50", 0.50), ("p90", 0.90), ("p99", 0.99), ("max", 1.0)]
WORST_N = 10
TOP_KERNELS_N = 40
HEATMAP_ROWS_MAX = 1024


def _present(df: pd.DataFrame | None, cols: list[str]) -> list[str]:
    return [] if df is None else [c for c in cols if c in df.columns]


def statistics(per_rank: pd.DataFrame | None, cols: list[str]) -> pd.DataFrame | None:
    """One row per statistic over the ranks' rows for each of ``cols`` (missing values left out)."""
    cols = _present(per_rank, cols)
    if per_rank is None or per_rank.empty or not cols:
        return None
    v = np.column_stack([pd.to_numeric(per_rank[c], errors="coerce").to_numpy(dtype=float, na_value=np.nan)
                         for c in cols])
    has = ~np.isnan(v)
    stats = np.full((len(STATISTICS) + 1, len(cols)), np.nan)
    for j in np.flatnonzero(has.any(axis=0)):
        x = v[has[:, j], j]
        stats[:-1, j] = np.quantile(x, [q for _, q in STATISTICS], method="linear")
        stats[-1, j] = x.mean()
    out = pd.DataFrame(stats, columns=cols)
    out.insert(0, "statistic", [name for name, _ in STATISTICS] + ["mean"])
    out.insert(1, "ranks", int(has.any(axis=1).sum()))
    return out


def worst(per_rank: pd.DataFrame | None, col: str, largest: bool = True, n: int = WORST_N,
          cols: list[str] | None = None) -> pd.DataFrame | None:
    """The ``n`` rows with the largest (or smallest) ``col``, worst first; ties by rank."""
    if per_rank is None or per_rank.empty or col not in per_rank.columns:
        return None
    d = per_rank[per_rank[col].notna()]
    if d.empty:
        return None
    d = d.sort_values([col, "rank"], ascending=[not largest, True], kind="mergesort").head(n)
    keep = ["rank"] + [c for c in (cols or list(d.columns)) if c in d.columns and c != "rank"]
    return d[keep].reset_index(drop=True)


def _first_appearance_ids(df: pd.DataFrame, keys: list[str]) -> np.ndarray:
    """Per row, its group of ``keys`` numbered in order of first appearance (missing: a key of its own)."""
    ids = np.zeros(len(df), dtype=np.int64)
    for k in keys:
        codes, uniques = pd.factorize(df[k].astype(object), use_na_sentinel=False)
        ids = ids * (len(uniques) + 1) + codes
        ids = pd.factorize(ids)[0]
    return ids


def grouped(df: pd.DataFrame | None, keys: list[str], value: str, sums: list[str] = ()) -> pd.DataFrame | None:
    """Per group of ``keys`` (in order of first appearance, missing keys a group): ranks, the sums of ``sums``, and
    of ``value`` summed per rank p50 / p90 / max over ranks and ``worst_rank`` (the rank at the max)."""
    if df is None or df.empty or value not in df.columns or not set(keys) <= set(df.columns):
        return None
    gid = _first_appearance_ids(df, keys)
    n_groups = int(gid.max()) + 1
    rank = df["rank"].to_numpy()
    # (group, rank) pairs: the value summed per rank (missing when the rank has no value in the group)
    pair = pd.factorize(gid * (int(rank.max()) + 1) + rank)[0]
    n_pairs = int(pair.max()) + 1
    v = pd.to_numeric(df[value]).to_numpy(dtype=float, na_value=np.nan)
    has = ~np.isnan(v)
    pair_sum = np.bincount(pair, weights=np.where(has, v, 0.0), minlength=n_pairs)
    pair_sum[np.bincount(pair, weights=has, minlength=n_pairs) == 0] = np.nan
    first_of_pair = np.unique(pair, return_index=True)[1]     # (ids in order of appearance: sorted = in order)
    pair_group, pair_rank = gid[first_of_pair], rank[first_of_pair]
    first_row = np.unique(gid, return_index=True)[1]
    # the keys as a groupby's result gives them: each column inferred from its values (str where strings)
    out = pd.DataFrame({k: pd.Index([np.nan if pd.isna(x) else x for x in df[k].astype(object).to_numpy()[first_row]])
                        for k in keys})
    out["ranks"] = np.bincount(pair_group, minlength=n_groups).astype(np.int64)
    sum_cols = list(dict.fromkeys(c for c in sums if c in df.columns))
    if sum_cols:
        totals = df[sum_cols].groupby(gid, sort=False).sum(min_count=1)
        for c in sum_cols:
            out[c] = totals[c].to_numpy()
    # per group, the pairs by largest sum first (missing last), ties by lowest rank: the first is the worst
    order = np.lexsort((pair_rank, -np.nan_to_num(pair_sum, nan=-np.inf), np.isnan(pair_sum), pair_group))
    bounds = np.searchsorted(pair_group[order], np.arange(n_groups + 1))     # each group's slice of ``order``
    worst_rank = pair_rank[order[bounds[:-1]]]
    stats = np.full((n_groups, 3), np.nan)
    for g in range(n_groups):
        x = pair_sum[order[bounds[g]:bounds[g + 1]]]
        x = x[~np.isnan(x)]
        if x.size:
            stats[g, :2] = np.quantile(x, [0.5, 0.9], method="linear")
            stats[g, 2] = x.max()
    out[f"p50_{value}"], out[f"p90_{value}"] = stats[:, 0], stats[:, 1]
    out[f"max_{value}"] = stats[:, 2]
    if pd.api.types.is_integer_dtype(df[value].dtype):       # (a sum of integers is one, as pandas keeps it)
        out[f"max_{value}"] = out[f"max_{value}"].astype(np.int64)
    out["worst_rank"] = worst_rank
    return out


def _per_rank_steps(steps: pd.DataFrame | None) -> pd.DataFrame | None:
    """Per rank: the mean over its steps of each step column (µs)."""
    if steps is None or steps.empty or "rank" not in steps:
        return None
    cols = [c for c in steps.columns if c.endswith("_us")]
    out = steps.groupby("rank", as_index=False)[cols].mean()
    out.insert(1, "steps", steps.groupby("rank")["step"].nunique().to_numpy())
    return out


def _per_step(steps: pd.DataFrame | None) -> pd.DataFrame | None:
    """Per step: ranks, p50 / max step time and exposed communication over ranks, the slowest rank."""
    if steps is None or steps.empty or "step_us" not in steps:
        return None
    g = steps.groupby("step", sort=True)
    out = g["rank"].nunique().rename("ranks").reset_index()
    for c in ("step_us", "exposed_comm_us"):
        if c in steps:
            out[f"p50_{c}"] = g[c].quantile(0.5).to_numpy()
            out[f"max_{c}"] = g[c].max().to_numpy()
    slow = steps.sort_values(["step_us", "rank"], ascending=[False, True], kind="mergesort").drop_duplicates("step")
    return out.merge(slow[["step", "rank"]].rename(columns={"rank": "slowest_rank"}), on="step", how="left")


def _top_kernels(top: pd.DataFrame | None) -> pd.DataFrame | None:
    """Kernels over ranks: ranks, count, sum_us, sum per rank (mean), max_us; the TOP_KERNELS_N biggest."""
    if top is None or top.empty:
        return None
    g = top.groupby(["kernel_type", "name"], sort=False)
    out = g["rank"].nunique().rename("ranks").reset_index()
    out["count"] = g["count"].sum().to_numpy()
    out["sum_us"] = g["sum_us"].sum().to_numpy()
    out["mean_per_rank_us"] = out["sum_us"] / out["ranks"]
    out["max_us"] = g["max_us"].max().to_numpy()
    return out.sort_values(["sum_us", "name"], ascending=[False, True], kind="mergesort").head(
        TOP_KERNELS_N).reset_index(drop=True)


def rank_distributions(a) -> dict:
    """Every distribution table of an Analysis (name -> DataFrame; tables without data left out)."""
    mp = a.memory_peaks
    steps_rank = _per_rank_steps(a.steps)
    out = {
        "memory_peak": statistics(mp, ["peak_allocated_bytes", "reserved_bytes", "fragmentation_pct",
                                       "coverage_pct"]),
        "memory_peak_worst": worst(mp, "peak_allocated_bytes", cols=["peak_allocated_bytes", "peak_stage",
                                                                     "peak_fsdp_phase", "reserved_bytes",
                                                                     "coverage_pct"]),
        "overlap": statistics(a.overlap_overall, ["compute_us", "comm_us", "exposed_comm_us",
                                                  "comp_comm_overlap_pct"]),
        "overlap_worst": worst(a.overlap_overall, "exposed_comm_us"),
        "comm_phase": grouped(a.comm_phase, ["collective", "stage", "fsdp_phase"], "exposed_comm_us",
                              ["count", "bytes", "comm_us", "overlapped_comm_us", "exposed_comm_us"]),
        "traffic": grouped(a.traffic, ["collective"], "wire_per_step_bytes", ["count"]),
        "steps": statistics(steps_rank, ["step_us", "compute_us", "exposed_comm_us", "idle_us",
                                         "unexplained_us"]),
        "steps_per_step": _per_step(a.steps),
        "steps_worst": worst(steps_rank, "exposed_comm_us", cols=["steps", "step_us", "compute_us",
                                                                  "exposed_comm_us", "idle_us"]),
        "stragglers": statistics(a.stragglers, ["times_last", "share_last_pct", "mean_start_lag_us", "lag_per_step_us",
                                                "cost_per_step_us", "contended_us_per_step", "clock_offset_us"]),
        "stragglers_worst": worst(a.stragglers, "mean_start_lag_us"),
        "temporal": statistics(a.temporal, ["span_us", "idle_time_pct", "compute_time_pct",
                                            "non_compute_time_pct"]),
        "temporal_worst": worst(a.temporal, "idle_time_pct"),
        "idle": grouped(a.idle, ["idle_category"], "idle_time_us"),
        "top_kernels": _top_kernels(a.top_kernels),
    }
    return {k: v for k, v in out.items() if v is not None and not v.empty}


def exposed_heatmap(steps: pd.DataFrame | None, max_rows: int = HEATMAP_ROWS_MAX):
    """(exposed_comm_us [rank or rank bin, step], row labels, steps); past ``max_rows`` ranks, bins of consecutive
    ranks hold their max.  None without data."""
    if steps is None or steps.empty or "exposed_comm_us" not in steps:
        return None
    w = steps.pivot_table(index="rank", columns="step", values="exposed_comm_us", aggfunc="sum")
    ranks = w.index.to_numpy()
    z = w.to_numpy(dtype=float)
    labels = [f"rank {int(r)}" for r in ranks]
    if len(ranks) > max_rows:
        per = -(-len(ranks) // max_rows)
        bins = np.arange(len(ranks)) // per
        z = pd.DataFrame(z).groupby(bins).max().to_numpy()
        labels = [f"ranks {int(ranks[i])}-{int(ranks[min(i + per, len(ranks)) - 1])}"
                  for i in range(0, len(ranks), per)]
    return z, labels, [float(s) for s in w.columns]
