"""Cross-rank alignment, collective skew and stragglers (µs).  Each rank's events reduce to one record per
collective call (the map); calls are matched across ranks by identity and every match is checked
(:mod:`fsdpprof.analyze.comm.matching`), point-to-point left out.  Everything here uses the checked matches
only.  Clocks (:func:`align_ranks`): fsdpprof's recorded clock anchors where they agree with the matches, else
the ends of the matches (a rank's offset is the median of (its end - the mean end over ranks)); skew and
stragglers are computed on the clock they are given (the report: align_ranks'), else on the ends'."""
from __future__ import annotations

import math

import numpy as np
import pandas as pd

from fsdpprof.analyze import model
from fsdpprof.analyze.comm import matching
from fsdpprof.analyze.load.frames import isin

RECORD_COLUMNS = ["rank", "pg", "collective", "key", "by_seq", "ts_us", "end_us", "bytes", "dtype", "group_size",
                  "step", "stage", "unit"]
SKEW_COLUMNS = ["pg", "seq", "collective", "n_ranks", "start_skew_us", "end_skew_us", "last_rank", "step", "stage",
                "unit"]
RANK_LAG_COLUMNS = ["rank", "mean_start_lag_us", "clock_offset_us", "matches", "chance_last", "last_autocorr"]
STRAGGLER_COLUMNS = ["rank", "times_last", "share_last_pct", "expected_last_pct", "independent_matches", "p_value",
                     "mean_start_lag_us", "lag_per_step_us", "cost_per_step_us", "contended_us_per_step", "where",
                     "clock_offset_us"]
_KEYS = ["match_id"]


def collective_records(events: pd.DataFrame) -> pd.DataFrame:
    """One row per collective call (RECORD_COLUMNS) of the comm events, point-to-point left out;
    several kernels of one call share (rank, pg, seq) when seq is known.  Identity (bytes of the whole array,
    dtype, group size) and place (step, stage, unit) are the call's first kernel's."""
    comm = isin(events["kind"], [model.KIND_COMM]) & ~isin(events["collective"], model.P2P)
    cols = ["rank", "ts_us", "dur_us", "collective", "pg", "seq"]
    extra = [c for c in RECORD_COLUMNS[7:] if c in events]
    c = events.loc[comm, cols + extra].copy()
    if not len(c):
        return pd.DataFrame({k: [] for k in RECORD_COLUMNS})
    for k in RECORD_COLUMNS[7:]:
        if k not in c:
            c[k] = np.nan
    c["collective"] = c["collective"].astype(object).fillna(model.UNKNOWN_COLLECTIVE).astype(str)
    c["pg"] = c["pg"].astype(object).fillna(matching.PG_UNNAMED).astype(str)
    for k in ("dtype", "stage", "unit"):
        c[k] = c[k].astype(object)
    c = c.sort_values(["rank", "ts_us"], kind="mergesort")
    order = c.groupby(["rank", "pg", "collective"], sort=False).cumcount().astype(float)
    c["key"] = np.where(c["seq"].notna(), c["seq"], order)
    c["by_seq"] = c["seq"].notna()
    c["end_us"] = c["ts_us"] + c["dur_us"]
    return c.groupby(["rank", "pg", "collective", "key"], sort=False, as_index=False).agg(
        by_seq=("by_seq", "first"), ts_us=("ts_us", "min"), end_us=("end_us", "max"), bytes=("bytes", "first"),
        dtype=("dtype", "first"), group_size=("group_size", "first"), step=("step", "first"),
        stage=("stage", "first"), unit=("unit", "first"))[RECORD_COLUMNS]


def checked(records: pd.DataFrame) -> pd.DataFrame:
    """The records in a checked match (``match_id`` >= 0), matched first when ``records`` have no match_id."""
    if records is None or not len(records):
        return pd.DataFrame({k: [] for k in RECORD_COLUMNS + matching.MATCH_COLUMNS})
    if "match_id" not in records:
        records = matching.match_collectives(records)[0]
    return records[records["match_id"].to_numpy() >= 0]


def _on_several_ranks(c: pd.DataFrame) -> pd.DataFrame:
    """The checked matches held by >= 2 ranks."""
    c = checked(c)
    n = c.groupby(_KEYS, sort=False)["rank"].transform("size")
    return c[n.to_numpy() > 1]


def clock_offsets(records: pd.DataFrame) -> pd.Series:
    """Per rank: clock offset (µs) to subtract so that matched collectives end together (checked matches only)."""
    c = _on_several_ranks(records)
    if len(c) == 0:
        return pd.Series(dtype=float)
    dev = c["end_us"] - c.groupby(_KEYS)["end_us"].transform("mean")
    return dev.groupby(c["rank"]).median()


def collective_skew(records: pd.DataFrame, offsets: pd.Series | None = None) -> tuple[pd.DataFrame, pd.DataFrame]:
    """(skew: SKEW_COLUMNS per checked match on >= 2 ranks, rank_lag: RANK_LAG_COLUMNS per rank: mean start
    lag, clock offset, the matches it is in, its chance of being last in them by luck (the mean of 1 / their
    ranks) and the lag-1 autocorrelation of its being last, in time order), on aligned clocks; last_rank is the
    rank that started last, ``last_lag_us`` (µs) how much later than the median start of the others, step /
    stage / unit the last rank's call's.  ``seq``: the sequence number, else the call's
    position on its rank.  ``offsets``: rank -> µs to subtract (:func:`align_ranks`' offset_us); None: the
    matches' ends (:func:`clock_offsets`)."""
    empty = (pd.DataFrame(columns=SKEW_COLUMNS + ["last_lag_us"]), pd.DataFrame(columns=RANK_LAG_COLUMNS))
    c = _on_several_ranks(records)
    if len(c) == 0:
        return empty
    off = clock_offsets(c) if offsets is None else offsets
    o = c["rank"].map(off).fillna(0.0).to_numpy()
    c = c.assign(ts_us=c["ts_us"] - o, end_us=c["end_us"] - o)
    g = c.groupby(_KEYS, sort=False)
    last_rows = g["ts_us"].idxmax()
    last = c.loc[last_rows, _KEYS + ["rank", "pg", "key", "collective", "step", "stage", "unit", "ts_us"]].rename(
        columns={"rank": "last_rank", "key": "seq", "ts_us": "last_start_us"})
    others = c.drop(index=last_rows.to_numpy())
    last["last_lag_us"] = (last["last_start_us"] - last["match_id"].map(
        others.groupby("match_id")["ts_us"].median()).to_numpy())
    out = pd.DataFrame({
        "n_ranks": g["rank"].size(),
        "start_skew_us": g["ts_us"].max() - g["ts_us"].min(),
        "end_skew_us": g["end_us"].max() - g["end_us"].min(),
        "first_start_us": g["ts_us"].min(),
    }).reset_index().merge(last, on=_KEYS)
    out = out.sort_values("first_start_us", kind="mergesort")
    out = out[SKEW_COLUMNS + ["last_lag_us"]].reset_index(drop=True)
    lag = (c["ts_us"] - g["ts_us"].transform("min")).groupby(c["rank"]).mean()
    rank_lag = pd.DataFrame({"rank": lag.index.astype(int), "mean_start_lag_us": lag.to_numpy()})
    rank_lag["clock_offset_us"] = rank_lag["rank"].map(off).fillna(0.0).to_numpy()
    member = c.assign(chance=1.0 / g["rank"].transform("size").to_numpy()).groupby("rank")["chance"]
    rank_lag["matches"] = rank_lag["rank"].map(member.size()).to_numpy(np.int64)
    rank_lag["chance_last"] = rank_lag["rank"].map(member.mean()).to_numpy(np.float64)
    # lateness carries from one collective to the next: the lag-1 autocorrelation of "this rank is last", in time order
    first = g["ts_us"].transform("min").to_numpy()
    t = pd.DataFrame({"rank": c["rank"].to_numpy(), "first": first,
                      "last": (c["rank"].to_numpy() == c["match_id"].map(last.set_index("match_id")["last_rank"])
                               .to_numpy()).astype(np.float64)}).sort_values(["rank", "first"], kind="mergesort")
    t["prev"] = t.groupby("rank")["last"].shift()
    t = t.dropna(subset=["prev"])
    by = t.groupby("rank")
    x, y = t["last"] - by["last"].transform("mean"), t["prev"] - by["prev"].transform("mean")
    num = (x * y).groupby(t["rank"]).sum()
    den = np.sqrt((x * x).groupby(t["rank"]).sum() * (y * y).groupby(t["rank"]).sum())
    rho = (num / den.where(den > 0)).fillna(0.0).clip(lower=0.0, upper=1.0)
    rank_lag["last_autocorr"] = rank_lag["rank"].map(rho).fillna(0.0).to_numpy(np.float64)
    return out, rank_lag[RANK_LAG_COLUMNS]


def binomial_tail(k: np.ndarray, n: np.ndarray, p: np.ndarray) -> np.ndarray:
    """P(X >= k) for X ~ Binomial(n, p), per element (log-space sums of exact terms; n up to a few 100,000)."""
    k, n, p = (np.asarray(x) for x in (k, n, p))
    out = np.ones(k.shape, dtype=np.float64)
    top = int(n.max()) if n.size else 0
    log_fact = np.concatenate([[0.0], np.cumsum(np.log(np.arange(1, top + 1, dtype=np.float64)))])
    for i in np.flatnonzero(k > 0):
        ni, ki, pi = int(n[i]), int(k[i]), float(p[i])
        if ki > ni:
            out[i] = 0.0
            continue
        if pi <= 0.0 or pi >= 1.0:
            out[i] = 1.0 if pi >= 1.0 else 0.0
            continue
        x = np.arange(ki, ni + 1)
        logs = log_fact[ni] - log_fact[x] - log_fact[ni - x] + x * math.log(pi) + (ni - x) * math.log1p(-pi)
        m = logs.max()
        out[i] = min(1.0, math.exp(m) * float(np.exp(logs - m).sum()))
    return out


def lag_per_step_us(skew: pd.DataFrame) -> pd.Series:
    """Per rank: how late it was into the matches it started last, per step (µs): the sum over those matches of
    how much later it started than the median of the others (``last_lag_us``), divided by the steps the matches
    cover (1 when no step is known).  Observed lateness, not its cost: the others may have had work to do
    meanwhile (the cost is the critical path's counterfactual, ``cost_per_step_us``)."""
    if skew is None or not len(skew):
        return pd.Series(dtype=float)
    steps = skew["step"].dropna().nunique() if "step" in skew else 0
    return skew.groupby("last_rank")["last_lag_us"].sum().clip(lower=0.0) / max(int(steps), 1)


def _where(skew: pd.DataFrame) -> pd.Series:
    """Per rank: the stage and unit of the matches it is last into that hold most of its lag ("forward, layers.1")."""
    if not len(skew):
        return pd.Series(dtype=object)
    t = skew.assign(stage=skew["stage"].astype(object).fillna(model.STAGE_UNKNOWN).astype(str),
                    unit=skew["unit"].astype(object).fillna("").astype(str))
    lag = t.groupby(["last_rank", "stage", "unit"])["last_lag_us"].sum().reset_index()
    top = lag.sort_values("last_lag_us", ascending=False, kind="mergesort").drop_duplicates("last_rank")
    text = top["stage"] + np.where(top["unit"] != "", ", " + top["unit"], "")
    return pd.Series(text.to_numpy(), index=top["last_rank"].to_numpy())


def stragglers(skew: pd.DataFrame, rank_lag: pd.DataFrame) -> pd.DataFrame:
    """Per rank (STRAGGLER_COLUMNS): times_last (checked matches it started last), share_last_pct (of the matches
    it is in) and what chance alone gives (expected_last_pct: the mean of 1 / the match's ranks), p_value (P of
    being last at least that often by chance: binomial over ``independent_matches`` = matches x (1 - rho) /
    (1 + rho), rho the lag-1 autocorrelation of its being last in time order, as a rank late into one collective
    tends to be late into the next), mean_start_lag_us, lag_per_step_us (:func:`lag_per_step_us`),
    cost_per_step_us and contended_us_per_step (NaN here: the critical path's counterfactual "rank R as fast as the
    median" and the part of it the rank's longer wait for a core explains fill them, ``pipeline``), where (the stage
    and unit holding most of its lag), clock_offset_us."""
    if len(skew) == 0:
        return pd.DataFrame(columns=STRAGGLER_COLUMNS)
    counts = skew["last_rank"].value_counts()
    out = pd.DataFrame({"rank": counts.index.astype(int), "times_last": counts.to_numpy()})
    allr = rank_lag.assign(rank=rank_lag["rank"].astype(int))
    out = allr.merge(out, on="rank", how="left")
    out["times_last"] = out["times_last"].fillna(0).astype(np.int64)
    out["share_last_pct"] = 100.0 * out["times_last"] / out["matches"].clip(lower=1)
    out["expected_last_pct"] = 100.0 * out["chance_last"]
    # independent trials: N (1 - rho) / (1 + rho) (rho: last_autocorr), the times last scaled alike
    rho = out["last_autocorr"].to_numpy(np.float64)
    n_eff = np.maximum(np.floor(out["matches"].to_numpy() * (1.0 - rho) / (1.0 + rho)), 1.0)
    k_eff = np.round(out["times_last"].to_numpy() * n_eff / np.maximum(out["matches"].to_numpy(), 1))
    out["independent_matches"] = n_eff.astype(np.int64)
    out["p_value"] = binomial_tail(k_eff, n_eff, out["chance_last"].to_numpy())
    out["lag_per_step_us"] = out["rank"].map(lag_per_step_us(skew)).fillna(0.0).to_numpy(np.float64)
    out["cost_per_step_us"] = np.nan
    out["contended_us_per_step"] = np.nan
    out["where"] = out["rank"].map(_where(skew)).astype(object)
    return out[STRAGGLER_COLUMNS].sort_values("rank").reset_index(drop=True)


# how the ranks of a merged timeline were put on one clock (align_ranks)
ALIGN_ANCHOR = "clock_anchor"          # the clock anchors fsdpprof recorded (rank.json): trace ts + base = Unix time
ALIGN_COLLECTIVES = "collective_ends"  # the ends of the collectives the ranks share (clock_offsets)
ALIGN_NONE = "none"                    # neither: the clocks as recorded
ANCHOR_TOLERANCE_US = 1000.0           # anchors that leave shared collectives this much further apart than their
                                       # ends' alignment does are not used (a wall clock off, a rounded base time)
ALIGNMENT_COLUMNS = ["rank", "offset_us", "method", "residual_us"]


def end_residuals(records: pd.DataFrame, offsets: pd.Series) -> pd.Series:
    """Per rank, with ``offsets`` (µs) subtracted: the median distance of its collectives' ends from the mean end
    over the ranks sharing them (checked matches only; µs; NaN for a rank that shares none)."""
    if len(records) and "match_id" not in records:
        records = matching.match_collectives(records)[0]
    o = records["rank"].map(offsets).fillna(0.0).to_numpy()
    c = _on_several_ranks(records.assign(end_us=records["end_us"] - o))
    if len(c) == 0:
        return pd.Series(np.nan, index=sorted(records["rank"].unique()))
    dev = (c["end_us"] - c.groupby(_KEYS)["end_us"].transform("mean")).abs()
    return dev.groupby(c["rank"]).median().reindex(sorted(records["rank"].unique()))


def align_ranks(records: pd.DataFrame, ranks, anchors_us: dict | None = None,
                method: str | None = None) -> tuple[pd.DataFrame, list[str]]:
    """One clock for ``ranks``: per rank the offset (whole µs) to subtract from its times, the first rank's clock
    kept (ALIGNMENT_COLUMNS; ``residual_us``: :func:`end_residuals` after it).  ``anchors_us``: rank -> the µs to
    add to its trace times to get Unix time (fsdpprof's clock anchor), used when every rank has one and they
    leave the shared collectives no more than ANCHOR_TOLERANCE_US further apart than the collectives' own
    alignment; otherwise the collectives' ends
    (:func:`clock_offsets`); neither: offsets 0.  ``method``: ALIGN_COLLECTIVES or ALIGN_ANCHOR to use that one
    where it can be (None: as said).  Returns (the table, one line per thing to say)."""
    ranks = sorted(int(r) for r in ranks)
    notes: list[str] = []
    wanted = method
    records = records if records is not None and len(records) else pd.DataFrame({k: [] for k in RECORD_COLUMNS})
    if len(records) and "match_id" not in records:
        records = matching.match_collectives(records, clock_prior_us=matching.clock_prior(
            {r: (anchors_us or {}).get(r) for r in ranks}))[0]
    shared = _on_several_ranks(records) if len(records) else records
    by_coll = clock_offsets(records) if len(shared) else pd.Series(dtype=float)
    method, off = ALIGN_NONE, pd.Series(0.0, index=ranks)
    anchors = {r: anchors_us.get(r) for r in ranks} if anchors_us else {}
    have_anchors = bool(anchors) and all(a is not None and np.isfinite(a) for a in anchors.values())
    if wanted == ALIGN_ANCHOR and not have_anchors and len(ranks) > 1:
        notes.append("not every rank has a recorded clock anchor (a run recorded by fsdpprof has): aligned "
                     "on the collectives' ends" if len(by_coll) else "not every rank has a recorded clock anchor")
    if have_anchors and wanted != ALIGN_COLLECTIVES:
        ref = anchors[ranks[0]]
        off = pd.Series({r: float(ref - anchors[r]) for r in ranks})
        method = ALIGN_ANCHOR
        if len(by_coll):
            worst = float(end_residuals(records, off).max())
            best = float(end_residuals(records, by_coll).max())
            if worst > best + ANCHOR_TOLERANCE_US and wanted != ALIGN_ANCHOR:
                notes.append(f"the recorded clock anchors leave collectives the ranks share {worst:,.0f} µs apart "
                             f"({best:,.0f} µs aligned on their ends): aligned on the collectives' ends instead")
                method = ALIGN_COLLECTIVES
    elif len(by_coll):
        method = ALIGN_COLLECTIVES
    if method == ALIGN_COLLECTIVES:
        off = by_coll.reindex(ranks).fillna(0.0)
        alone = [r for r in ranks if r not in by_coll.index]
        if alone:
            notes.append(f"{model.rank_list(alone)} share{'s' if len(alone) == 1 else ''} no collective with the "
                         f"others: {'its' if len(alone) == 1 else 'their'} clock is left as recorded")
    elif method == ALIGN_NONE and len(ranks) > 1:
        notes.append("the ranks share no collective and have no recorded clock anchor: their clocks are left as "
                     "recorded")
    off = (off - off.get(ranks[0], 0.0)).round() + 0.0    # whole µs: shifted times stay exact (no -0)
    res = end_residuals(records, off) if len(by_coll) else pd.Series(np.nan, index=ranks)
    out = pd.DataFrame({"rank": ranks, "offset_us": off.reindex(ranks).to_numpy(np.float64), "method": method,
                        "residual_us": res.reindex(ranks).to_numpy(np.float64)})
    worst = out["residual_us"].max()
    ok = checked(records) if len(records) else records
    allowed = max(matching.MATCH_TOLERANCE_US, float(np.nanmedian(ok["end_us"] - ok["ts_us"])) if len(ok) else 0.0)
    if worst == worst and worst > allowed:
        far = out.loc[out["residual_us"] > allowed, "rank"].tolist()
        notes.append(f"after alignment the collectives' ends of {model.rank_list(far)} still lie {worst:,.0f} µs "
                     f"from the other ranks' (median over their collectives), more than the "
                     f"{matching.MATCH_TOLERANCE_US:,.0f} µs tolerance and the collectives' median duration "
                     f"({allowed:,.0f} µs): times across ranks there are uncertain by that much")
    return out[ALIGNMENT_COLUMNS], notes
