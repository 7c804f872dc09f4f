"""The numbers a person reads first, from an Analysis (bytes, µs, % of the step): the peak per rank against the
formula's model states, the step's split (compute, exposed communication, the rest), the first finding.  On a
CPU trace a step's ``idle_us`` is host time outside every operator (Python, dispatcher, FSDP's hooks)."""
from __future__ import annotations

import math

import pandas as pd

from fsdpprof.analyze import model

STEP_PARTS = ("compute_us", "exposed_comm_us", "idle_us", "residual_us")


def step_medians(steps: pd.DataFrame | None) -> dict:
    """Each rank's mean over its steps, then the median over ranks, of the step columns (µs; NaN without steps)."""
    cols = ["step_us", "compute_us", "comm_us", "overlapped_comm_us"] + [c for c in STEP_PARTS if c != "compute_us"]
    if steps is None or steps.empty:
        return {c: math.nan for c in cols}
    have = [c for c in cols if c in steps]
    med = steps.groupby("rank")[have].mean().median()
    return {c: float(med.get(c, math.nan)) for c in cols}


def step_spread(steps: pd.DataFrame | None, col: str) -> dict:
    """One step column (µs): ``value`` (:func:`step_medians`), ``min`` / ``max`` over every rank and step, the
    ``worst_rank`` (largest mean over its steps) with ``worst``, and how many ``ranks`` and ``steps``."""
    out = {"value": math.nan, "min": math.nan, "max": math.nan, "worst_rank": None, "worst": math.nan,
           "ranks": 0, "steps": 0}
    if steps is None or steps.empty or col not in steps:
        return out
    v = steps[["rank", col]].dropna()
    if v.empty:
        return out
    per_rank = v.groupby("rank")[col].mean()
    top = per_rank.max()
    out.update(value=step_medians(steps)[col], min=float(v[col].min()), max=float(v[col].max()),
               worst_rank=int(min(r for r, x in per_rank.items() if x == top)), worst=float(top),
               ranks=int(per_rank.size), steps=int(len(v)))
    return out


def per_step(steps: pd.DataFrame, table: pd.DataFrame | None, cols: list[str]) -> pd.DataFrame:
    """The steps table (rank, step, step_us) beside the sums of ``cols`` of ``table`` in each step (0 for none)."""
    base = steps[["rank", "step", "step_us"]].astype({"step": float})
    if table is None or table.empty:
        return base.assign(**{c: 0.0 for c in cols})
    t = table[table["step"].notna()].astype({"step": float}).groupby(["rank", "step"])[cols].sum(min_count=1)
    out = base.merge(t.reset_index(), on=["rank", "step"], how="left")
    return out.fillna({c: 0.0 for c in cols})


def share_of_step(steps: pd.DataFrame | None, col: str) -> dict:
    """One part of the step (``col``, µs): ``us`` (:func:`step_medians`), ``pct`` of the median step, the
    ``worst_rank`` (largest share of its own mean step) with ``worst_pct`` and ``worst_us``, and ``ranks``."""
    out = {"us": math.nan, "pct": math.nan, "worst_rank": None, "worst_pct": math.nan, "worst_us": math.nan,
           "ranks": 0}
    if steps is None or steps.empty or col not in steps or "step_us" not in steps:
        return out
    per = steps.groupby("rank")[[col, "step_us"]].mean()
    med = per.median()
    share = (100.0 * per[col] / per["step_us"].where(per["step_us"] > 0)).dropna()
    out.update(us=float(med[col]), ranks=int(len(per)),
               pct=100.0 * float(med[col]) / float(med["step_us"]) if med["step_us"] > 0 else math.nan)
    if len(share):
        top = share.max()
        r = min(x for x, v in share.items() if v == top)
        out.update(worst_rank=int(r), worst_pct=float(top), worst_us=float(per.loc[r, col]))
    return out


def step_split(steps: pd.DataFrame | None) -> dict:
    """step_medians plus each STEP_PARTS' share of the step (``*_pct``, adding up to 100 %)."""
    d = step_medians(steps)
    s = d["step_us"]
    for c in STEP_PARTS:
        d[c[:-3] + "_pct"] = 100.0 * d[c] / s if s == s and s > 0 else math.nan
    return d


def peak_rank(a) -> int | None:
    """The rank whose memory peaks highest (the smallest such rank), the one every memory number is from."""
    return peak_rank_of(a.memory)


def peak_rank_of(memory: dict | None) -> int | None:
    """:func:`peak_rank` of the per-rank memory results (rank -> MemoryResult)."""
    peaks = {r: m.peak_allocated_bytes for r, m in (memory or {}).items()
             if m is not None and m.peak_allocated_bytes == m.peak_allocated_bytes}
    if not peaks:
        return min(memory) if memory else None
    top = max(peaks.values())
    return min(r for r, v in peaks.items() if v == top)


def oom_rank(a) -> int | None:
    """The rank whose snapshot ended in an out-of-memory error (the peak rank first), or None."""
    ooms = [r for r, m in sorted((a.memory or {}).items()) if getattr(m, "oom", None)]
    if not ooms:
        return None
    r = peak_rank(a)
    return r if r in ooms else ooms[0]


def oom_headline(a) -> dict | None:
    """The out-of-memory error to read first (:func:`oom_rank`'s ``memory.oom``) with its first advice, or None."""
    r = oom_rank(a)
    if r is None:
        return None
    o = a.memory[r].oom
    first = (o.get("suggestions") or [None])[0] or {}
    return {"rank": int(r), **{k: o.get(k) for k in ("device", "requested_bytes", "free_bytes", "short_bytes", "stage",
                                                       "unit", "fragmentation_decides")},
            **{k: first.get(k) for k in ("change", "saves_bytes", "enough", "cost")}}


def headline(a) -> dict:
    """The report's headline numbers: the peak (of ``peak_rank``), the model states (formula, measured, share of
    the peak), :func:`step_split`, ``idle_is_host`` (a CPU trace), the first finding and ``oom``."""
    o, t = a.overview, a.theory or {}
    d: dict = {"oom": oom_headline(a), "peak_bytes": math.nan, "peak_rank": None, "peak_device": None,
               "peak_stage": None}
    r = peak_rank(a)
    if r is not None and a.memory[r].peak_allocated_bytes == a.memory[r].peak_allocated_bytes:
        m = a.memory[r]
        d.update(peak_bytes=float(m.peak_allocated_bytes), peak_rank=int(r), peak_stage=m.peak_stage,
                 peak_device=getattr(m, "device", None))
    ms = t.get("model_states") or {}
    d["model_states_label"] = ms.get("label")
    d["model_states_formula"] = ms.get("formula")
    d["model_states_theory_bytes"] = float(ms.get("total_bytes", math.nan))
    measured = t.get("measured_model_states_bytes")
    d["model_states_measured_bytes"] = float(measured) if measured is not None else math.nan
    peak = d["peak_bytes"]
    d["model_states_theory_pct_of_peak"] = (100.0 * d["model_states_theory_bytes"] / peak
                                            if peak == peak and peak > 0 else math.nan)
    d.update(step_split(a.steps))
    d["device_type"] = o.get("device_type")
    d["idle_is_host"] = (o.get("device_type") or model.DEVICE_CPU) == model.DEVICE_CPU
    f = a.findings[0] if a.findings else None
    for k in ("title", "severity", "section"):
        d["first_finding" + ("" if k == "title" else "_" + k)] = getattr(f, k) if f else None
    d["findings"] = len(a.findings)
    return d
