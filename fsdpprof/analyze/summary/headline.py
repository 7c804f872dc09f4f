"""The few numbers a person reads first: peak per rank against the formula's model states, the step's
split (compute, exposed communication, the rest) and the first finding.  From an Analysis only
(bytes, µs, % of the step).

On a CPU trace the profiler sees operators only: "compute" is time inside leaf operators and the
step's time outside every operator and collective (``idle_us`` of the step breakdown) is host time:
Python, the dispatcher, FSDP's hooks.  On a GPU trace the same column is device idle time.
"""
from __future__ import annotations

import math

import pandas as pd

from fsdpprof.analyze import model

STEP_PARTS = ("compute_us", "exposed_comm_us", "idle_us", "residual_us")


def step_medians(steps: pd.DataFrame | None) -> dict:
    """Per step, the mean over each rank's steps, then the median over ranks: step_us, compute_us, comm_us,
    overlapped_comm_us, exposed_comm_us, idle_us, residual_us (NaN when there are no steps)."""
    cols = ["step_us", "compute_us", "comm_us", "overlapped_comm_us"] + [c for c in STEP_PARTS if c != "compute_us"]
    if steps is None or steps.empty:
        return {c: math.nan for c in cols}
    have = [c for c in cols if c in steps]
    med = steps.groupby("rank")[have].mean().median()
    return {c: float(med.get(c, math.nan)) for c in cols}


def step_spread(steps: pd.DataFrame | None, col: str) -> dict:
    """One column of the step breakdown (µs) as the report states it: ``value`` (step_medians' rule: each
    rank's mean over its steps, the median over ranks), its spread ``min`` / ``max`` over every rank and step,
    the ``worst_rank`` (largest mean over its steps, the smallest such rank) with ``worst`` (that mean),
    and how many ``ranks`` and ``steps`` (rank x step rows) it is over. NaN / None without steps."""
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


def share_of_step(steps: pd.DataFrame | None, col: str) -> dict:
    """One part of the step (``col``, µs; ``steps`` has rank, step_us and ``col`` per step) as the report states
    it, step_split's rule: ``us`` (each rank's mean over its steps, the median over ranks), ``pct`` (``us`` over
    the median step, %), beside it the ``worst_rank`` (the largest share of its own mean step, the smallest such
    rank) with ``worst_pct`` and ``worst_us``, and how many ``ranks``. NaN / None without steps."""
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
    """step_medians plus each part's share of the step (``*_pct``: compute, exposed comm, idle, residual;
    they add up to 100 %)."""
    d = step_medians(steps)
    s = d["step_us"]
    for c in STEP_PARTS:
        d[c[:-3] + "_pct"] = 100.0 * d[c] / s if s == s and s > 0 else math.nan
    return d


def peak_rank(a) -> int | None:
    """The rank whose memory peaks highest (the smallest such rank): what a run must fit, the rank the
    report's headline, memory charts and compare's numbers are from. None without memory data."""
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
    """The rank whose snapshot ended in an out-of-memory error (the peak rank when it did, else the smallest such
    rank); None when none did."""
    ooms = [r for r, m in sorted((a.memory or {}).items()) if getattr(m, "oom", None)]
    if not ooms:
        return None
    r = peak_rank(a)
    return r if r in ooms else ooms[0]


def oom_headline(a) -> dict | None:
    """The out-of-memory error a person must read first (:func:`oom_rank`), or None: rank, device (the CUDA device
    index), requested_bytes, free_bytes, short_bytes, stage, unit, fragmentation_decides and the first change of its
    advice (change, saves_bytes, enough, cost), from the rank's ``memory.oom`` (analyze.memory.oom.explain_oom)."""
    r = oom_rank(a)
    if r is None:
        return None
    o = a.memory[r].oom
    first = (o.get("suggestions") or [None])[0] or {}
    return {"rank": int(r), "device": o.get("device"), "requested_bytes": o.get("requested_bytes"),
            "free_bytes": o.get("free_bytes"), "short_bytes": o.get("short_bytes"), "stage": o.get("stage"),
            "unit": o.get("unit"), "fragmentation_decides": o.get("fragmentation_decides"),
            "change": first.get("change"), "saves_bytes": first.get("saves_bytes"), "enough": first.get("enough"),
            "cost": first.get("cost")}


def headline(a) -> dict:
    """The report's headline numbers of an Analysis: peak_bytes (of ``peak_rank``),
    model_states_theory_bytes / model_states_measured_bytes and their share of the peak, the step split
    (step_split), ``idle_is_host`` (True on a CPU trace: idle is host time outside operators), the
    first finding's title and severity, and ``oom`` (:func:`oom_headline`: what comes before everything else)."""
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
    d["first_finding"] = f.title if f else None
    d["first_finding_severity"] = f.severity if f else None
    d["first_finding_section"] = f.section if f else None
    d["findings"] = len(a.findings)
    return d
