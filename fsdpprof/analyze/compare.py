"""Several runs side by side: one column per run, the memory at the peak by category, the step time,
a verdict, and what changed against the first run (:mod:`fsdpprof.analyze.diff`).  Works from Analyses
only (:func:`fsdpprof.analyze.pipeline.analyze_run`).  Sizes in bytes, times in µs.

Runs are comparable unless both models are known (an inventory, from ``fsdpprof record``) and differ;
a run whose model is unknown (a trace folder) is compared on everything measured, without the formulas."""
from __future__ import annotations

import os
from dataclasses import dataclass, field

import numpy as np
import pandas as pd

from fsdpprof.analyze import diff, theory, vocab
from fsdpprof.analyze.pipeline import Analysis
from fsdpprof.errors import UserError


@dataclass
class Comparison:
    """Several runs side by side: ``table`` has a ``metric`` column and one column per run."""

    paths: list
    labels: list
    table: pd.DataFrame
    categories: pd.DataFrame      # run, category, bytes (at the peak of each run's first rank)
    time: pd.DataFrame            # run, step_us, compute_us, exposed_comm_us, idle_us (medians per step)
    verdict: str
    warnings: list
    comparable: bool
    diff: diff.Diff | None = None  # every run against the first (fsdpprof.analyze.diff)
    notes: list = field(default_factory=list)   # what is left out and why (e.g. formulas of unknown models)
    models_known: bool = True      # every run has an inventory (its model, Psi, is known)


def run_numbers(a: Analysis) -> dict:
    """Per-run numbers for comparison (first rank for memory; medians over ranks for time)."""
    o, t = a.overview, a.theory or {}
    d = {"strategy": o.get("strategy") or "-", "framework": o.get("framework") or "-",
         "world_size": o.get("world_size"), "psi": o.get("psi")}
    m = a.memory.get(min(a.memory)) if a.memory else None
    d["peak_allocated_bytes"] = float(m.peak_allocated_bytes) if m is not None else np.nan
    cats = {}
    if m is not None and m.breakdown_at_peak is not None and not m.breakdown_at_peak.empty:
        cats = m.breakdown_at_peak.groupby("category", observed=True)["bytes"].sum().to_dict()
    for c in vocab.MEMORY_CATEGORIES + list(vocab.REPLICATED_LABELS.values()):
        d[f"peak_{c}_bytes"] = float(cats.get(c, 0.0)) if m is not None else np.nan
    ms = t.get("model_states") or {}
    d["model_states_measured_bytes"] = t.get("measured_model_states_bytes", np.nan)
    d["model_states_theory_bytes"] = ms.get("total_bytes", np.nan)
    tr = t.get("traffic") or {}
    if a.traffic is not None and not a.traffic.empty:
        r0 = a.traffic["rank"].min()
        d["traffic_measured_bytes"] = float(a.traffic.loc[a.traffic["rank"] == r0, "wire_per_step_bytes"].sum())
    else:
        d["traffic_measured_bytes"] = np.nan
    d["traffic_theory_bytes"] = tr.get("total_bytes", np.nan)
    s = a.steps
    if s is not None and not s.empty:
        per_rank = s.groupby("rank")[[c for c in ("step_us", "compute_us", "exposed_comm_us", "idle_us") if c in s]].mean()
        med = per_rank.median()
        for c in ("step_us", "compute_us", "exposed_comm_us", "idle_us"):
            d[c] = float(med.get(c, np.nan))
    else:
        for c in ("step_us", "compute_us", "exposed_comm_us", "idle_us"):
            d[c] = np.nan
    return d


THEORY_METRICS = ("model_states_theory_bytes", "traffic_theory_bytes")


def _labels(analyses: list[Analysis], nums: list[dict]) -> list[str]:
    """One label per run: its strategy when known, else the input's folder name; repeats numbered."""
    names = [os.path.basename(os.path.normpath(a.path)) or a.path for a in analyses]
    if len(set(names)) < len(names):   # e.g. two torchtitan iteration_10 folders: name their parents too
        names = [os.path.join(*os.path.normpath(a.path).split(os.sep)[-2:]) for a in analyses]
    labels, seen = [], {}
    for a, n, name in zip(analyses, nums, names):
        if n["strategy"] != "-":
            base = f"{n['strategy']} ({n['framework']}, N={n['world_size']})"
        else:
            base = f"{name} ({a.overview.get('input_kind') or 'unknown'}, N={n['world_size'] or '?'})"
        seen[base] = seen.get(base, 0) + 1
        labels.append(base if seen[base] == 1 else f"{base} #{seen[base]}")
    return labels


def compare_analyses(analyses: list[Analysis], *, allow_different_models: bool = False,
                     scope: diff.Scope | None = None) -> Comparison:
    """Put runs side by side, and each against the first in ``scope`` (:class:`fsdpprof.analyze.diff.Scope`,
    default per-step medians over ranks).  UserError for fewer than two runs, or when both models are known
    and differ (unless allow_different_models, which turns that into a warning).  A run whose model is unknown
    (no inventory) is compared on what was measured; the formulas are left out, with a note."""
    if len(analyses) < 2:
        raise UserError("compare needs at least two runs, e.g. `fsdpprof compare RUN_A RUN_B`")
    nums = [run_numbers(a) for a in analyses]
    warnings, notes = [], []
    known = {n["psi"] for n in nums if n["psi"] is not None}
    comparable = len(known) <= 1
    if not comparable:
        desc = ", ".join(f"{a.path}: Psi={n['psi']}" for a, n in zip(analyses, nums) if n["psi"] is not None)
        msg = f"runs are of different models, so not comparable ({desc})"
        if not allow_different_models:
            raise UserError(msg + "; pass --force to compare anyway")
        warnings.append("Not comparable: " + msg + ".")
    unknown = [a.path for a, n in zip(analyses, nums) if n["psi"] is None]
    if unknown:
        for n in nums:
            for k in THEORY_METRICS:
                n[k] = np.nan
        notes.append(f"Model unknown for {', '.join(unknown)} (no inventory.json: not recorded with fsdpprof "
                     f"record), so the memory formulas (model states and traffic in theory) are left out; "
                     f"everything measured is compared.")
    labels = _labels(analyses, nums)
    metrics = list(nums[0].keys())
    t = pd.DataFrame({"metric": metrics, **{lab: [n.get(k) for k in metrics] for lab, n in zip(labels, nums)}})
    t = t.astype(object)
    cats = pd.DataFrame([{"run": lab, "category": k[len("peak_"):-len("_bytes")], "bytes": v}
                         for lab, n in zip(labels, nums) for k, v in n.items()
                         if k.startswith("peak_") and k != "peak_allocated_bytes" and v == v and v])
    if cats.empty:
        cats = pd.DataFrame(columns=["run", "category", "bytes"])
    tm = pd.DataFrame([{"run": lab, **{c: n.get(c) for c in ("step_us", "compute_us", "exposed_comm_us", "idle_us")}}
                       for lab, n in zip(labels, nums)])
    # verdict: the run with the lowest peak against the one with the highest
    peaks = [(n["peak_allocated_bytes"], i) for i, n in enumerate(nums) if n["peak_allocated_bytes"] == n["peak_allocated_bytes"]]
    if len(peaks) >= 2:
        lo, hi = min(peaks)[1], max(peaks)[1]
        if lo == hi:
            verdict = "All runs peak at the same memory."
        else:
            saved = (nums[hi]["peak_allocated_bytes"] - nums[lo]["peak_allocated_bytes"]) / theory.MIB
            de = nums[lo]["exposed_comm_us"] - nums[hi]["exposed_comm_us"]
            cost = ("(exposed communication unknown)" if de != de else
                    f"at the cost of {de / 1e3:.3g} ms more exposed communication per step" if de >= 0 else
                    f"and exposes {-de / 1e3:.3g} ms less communication per step")
            verdict = (f"{nums[lo]['strategy']} saves {saved:.3g} MiB per rank at the peak compared with "
                       f"{nums[hi]['strategy']}, {cost}")
            if nums[lo]["step_us"] == nums[lo]["step_us"] and nums[hi]["step_us"] == nums[hi]["step_us"]:
                verdict += f" (step time {nums[lo]['step_us'] / 1e3:.3g} ms vs {nums[hi]['step_us'] / 1e3:.3g} ms)"
            verdict += "."
    else:
        verdict = "Not enough memory data to compare peaks."
    d = diff.diff_analyses(analyses, labels, scope)
    return Comparison([a.path for a in analyses], labels, t, cats, tm, verdict, warnings, comparable, diff=d,
                      notes=notes + d.notes, models_known=not unknown)
