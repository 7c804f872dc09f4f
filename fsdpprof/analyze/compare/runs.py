"""Several runs side by side: one column per run, the memory at the peak by category, the step time,
a verdict, and what changed against the first run (:mod:`fsdpprof.analyze.compare.diff`).  Works from Analyses
only (:func:`fsdpprof.analyze.pipeline.analyze_run`).  Sizes in bytes, times in µs.

Runs are comparable unless both models are known (an inventory, from ``fsdpprof record``) and differ;
a run whose model is unknown (a trace folder) is compared on everything measured, without the formulas."""
from __future__ import annotations

import os
from dataclasses import dataclass, field

import numpy as np
import pandas as pd

from fsdpprof.analyze import model
from fsdpprof.analyze.compare import diff
from fsdpprof.analyze.summary.headline import peak_rank, step_medians
from fsdpprof.analyze.pipeline import Analysis
from fsdpprof.errors import UserError


@dataclass
class Comparison:
    """Several runs side by side: ``table`` has a ``metric`` column and one column per run."""

    paths: list
    labels: list
    table: pd.DataFrame
    categories: pd.DataFrame      # run, category, bytes (at the peak of each run's highest-peaking rank)
    time: pd.DataFrame            # run, step_us, compute_us, exposed_comm_us, idle_us (medians per step)
    verdict: str
    warnings: list
    comparable: bool
    diff: diff.Diff | None = None  # every run against the first (fsdpprof.analyze.compare.diff)
    notes: list = field(default_factory=list)   # what is left out and why (e.g. formulas of unknown models)
    models_known: bool = True      # every run has an inventory (its model, Psi, is known)
    promise: pd.DataFrame | None = None   # per run: the ZeRO formulas' promise beside the measurement (zero_promise)
    formula: pd.DataFrame | None = None   # run, category (param, grad, optimizer_state), bytes: the formula's model states
    verdict_lines: list | None = None     # the verdict, one sentence per line (verdict joins them)


def run_numbers(a: Analysis) -> dict:
    """Per-run numbers for comparison (memory: the rank with the highest peak, what a run must fit; time:
    medians over ranks)."""
    o, t = a.overview, a.theory or {}
    d = {"strategy": o.get("strategy") or "-", "framework": o.get("framework") or "-",
         "world_size": o.get("world_size"), "psi": o.get("psi")}
    m = a.memory[peak_rank(a)] if a.memory else None
    d["peak_allocated_bytes"] = float(m.peak_allocated_bytes) if m is not None else np.nan
    cats = {}
    if m is not None and m.breakdown_at_peak is not None and not m.breakdown_at_peak.empty:
        cats = m.breakdown_at_peak.groupby("category", observed=True)["bytes"].sum().to_dict()
    for c in model.MEMORY_CATEGORIES + list(model.REPLICATED_LABELS.values()):
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
    med = step_medians(a.steps)
    for c in ("step_us", "compute_us", "exposed_comm_us", "idle_us"):
        d[c] = med[c]
    return d


THEORY_METRICS = ("model_states_theory_bytes", "traffic_theory_bytes")


def _labels(analyses: list[Analysis], nums: list[dict]) -> list[str]:
    """One label per run: the input as every command describes it (model.describe_input), after the input's folder
    name when its strategy is not recorded; repeats numbered."""
    names = [os.path.basename(os.path.normpath(a.path)) or a.path for a in analyses]
    if len(set(names)) < len(names):   # e.g. two torchtitan iteration_10 folders: name their parents too
        names = [os.path.join(*os.path.normpath(a.path).split(os.sep)[-2:]) for a in analyses]
    labels, seen = [], {}
    for a, n, name in zip(analyses, nums, names):
        o = a.overview
        said = o.get("description") or model.describe_input(o.get("input_kind"), o.get("strategy"), o.get("world_size"))
        base = said if n["strategy"] != "-" else f"{name} ({said})"
        seen[base] = seen.get(base, 0) + 1
        labels.append(base if seen[base] == 1 else f"{base} #{seen[base]}")
    return labels


def compare_analyses(analyses: list[Analysis], *, allow_different_models: bool = False,
                     scope: diff.Scope | None = None) -> Comparison:
    """Put runs side by side, and each against the first in ``scope`` (:class:`fsdpprof.analyze.compare.diff.Scope`,
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
    promise = zero_promise(analyses, nums, labels)
    lines = verdict_lines(promise)
    verdict = " ".join(lines) if lines else "Not enough memory data to compare peaks."
    formula = pd.DataFrame([{"run": lab, "category": cat, "bytes": float(b)}
                            for lab, a in zip(labels, analyses)
                            for cat, b in _formula_parts(a).items()], columns=["run", "category", "bytes"])
    d = diff.diff_analyses(analyses, labels, scope)
    return Comparison([a.path for a in analyses], labels, t, cats, tm, verdict, warnings, comparable, diff=d,
                      notes=notes + d.notes, models_known=not unknown,
                      promise=promise, formula=formula, verdict_lines=lines)


# --------------------------------------------------------------------------- the verdict
REPLICATED_STRATEGIES = (model.DDP, model.NO_SHARD)


def _formula_parts(a: Analysis) -> dict:
    """The formula's model states per rank of one run by part (bytes): param, grad, optimizer_state."""
    ms = (a.theory or {}).get("model_states") or {}
    mc = model.MemoryCategory
    parts = {mc.PARAM.value: ms.get("param_bytes"), mc.GRAD.value: ms.get("grad_bytes"),
             mc.OPTIMIZER_STATE.value: ms.get("optimizer_state_bytes")}
    return {k: float(v) for k, v in parts.items() if v is not None and v == v}


def _ddp_traffic_bytes(a: Analysis) -> float:
    """What DDP would send per rank per step for the same model and N (the formula), bytes."""
    for row in (a.theory or {}).get("all_strategies") or []:
        if row.get("strategy") == "DDP":
            return float(row.get("traffic_bytes", np.nan))
    return np.nan


def _ratio(x, y) -> float:
    x, y = float(x), float(y)
    return x / y if x == x and y == y and y else np.nan


def zero_promise(analyses: list[Analysis], nums: list[dict], labels: list[str]) -> pd.DataFrame:
    """Per run, what the ZeRO formulas promise beside what was measured (bytes per rank, µs per step):
    model states (formula, measured, each as a ratio to the baseline run's), the peak (and its ratio),
    traffic per rank per step (formula, measured, each as a ratio to DDP's formula for the same model
    and N: 1.5 for FULL_SHARD), exposed communication (µs and % of the step) and the step time.
    The baseline is the unsharded run (DDP / NO_SHARD) with the fewest ranks, else the run with the
    largest formula model states; ``baseline`` marks it."""
    rows = []
    for a, n, lab in zip(analyses, nums, labels):
        o = a.overview
        rows.append({
            "run": lab, "strategy": n["strategy"], "world_size": n["world_size"],
            "shard_group_size": o.get("shard_group_size"), "device_type": o.get("device_type"),
            "model_states_theory_bytes": float(n["model_states_theory_bytes"]),
            "model_states_measured_bytes": float(n["model_states_measured_bytes"]),
            "peak_allocated_bytes": float(n["peak_allocated_bytes"]),
            "traffic_theory_bytes": float(n["traffic_theory_bytes"]),
            "traffic_measured_bytes": float(n["traffic_measured_bytes"]),
            "ddp_traffic_theory_bytes": _ddp_traffic_bytes(a),
            "exposed_comm_us": n["exposed_comm_us"], "step_us": n["step_us"], "compute_us": n["compute_us"],
            "idle_us": n["idle_us"]})
    p = pd.DataFrame(rows)
    unsharded = p[p["strategy"].isin(REPLICATED_STRATEGIES)]
    if not unsharded.empty:
        base = int(unsharded.sort_values("world_size", kind="mergesort").index[0])
    elif p["model_states_theory_bytes"].notna().any():
        base = int(p["model_states_theory_bytes"].idxmax())
    else:
        base = 0
    p["baseline"] = p.index == base
    b = p.loc[base]
    for col, ratio in (("model_states_theory_bytes", "model_states_theory_ratio"),
                       ("model_states_measured_bytes", "model_states_measured_ratio"),
                       ("peak_allocated_bytes", "peak_ratio")):
        p[ratio] = [_ratio(x, b[col]) for x in p[col]]
    p["traffic_theory_vs_ddp"] = [_ratio(x, y) for x, y in zip(p["traffic_theory_bytes"], p["ddp_traffic_theory_bytes"])]
    p["traffic_measured_vs_ddp"] = [_ratio(x, y) for x, y in zip(p["traffic_measured_bytes"],
                                                                  p["ddp_traffic_theory_bytes"])]
    p["exposed_comm_pct"] = [100.0 * _ratio(x, y) for x, y in zip(p["exposed_comm_us"], p["step_us"])]
    return p


def _ms(x) -> str:
    """µs in words: 84.4 ms, 1234 ms."""
    v = x / 1e3
    return f"{v:.0f} ms" if abs(v) >= 100 else f"{v:.3g} ms"


def _on(row) -> str:
    n = row["world_size"]
    if row["strategy"] == "-":
        return str(row["run"])
    return f"{row['strategy']} on {n} rank{'' if n == 1 else 's'}"


def _peak_line(peaks: pd.DataFrame) -> str:
    """The smallest peak against the largest: what it saves, what it costs in exposed communication."""
    if len(peaks) < 2:
        return "Not enough memory data to compare peaks."
    lo = peaks.loc[peaks["peak_allocated_bytes"].idxmin()]
    hi = peaks.loc[peaks["peak_allocated_bytes"].idxmax()]
    if lo["peak_allocated_bytes"] == hi["peak_allocated_bytes"]:
        return "All runs peak at the same memory."
    saved = hi["peak_allocated_bytes"] - lo["peak_allocated_bytes"]
    de = lo["exposed_comm_us"] - hi["exposed_comm_us"]
    cost = ("(exposed communication unknown)" if de != de else
            f"at the cost of {_ms(de)} more exposed communication per step" if de >= 0 else
            f"and exposes {_ms(-de)} less communication per step")
    line = (f"{_on(lo)} saves {model.fmt_bytes(saved)} per rank at the peak compared with {_on(hi)}, {cost} "
            f"({model.fmt_bytes(lo['peak_allocated_bytes'])} against {model.fmt_bytes(hi['peak_allocated_bytes'])}")
    if lo["step_us"] == lo["step_us"] and hi["step_us"] == hi["step_us"]:
        line += f"; step time {_ms(lo['step_us'])} vs {_ms(hi['step_us'])}"
    return line + ")."


def verdict_lines(p: pd.DataFrame) -> list[str]:
    """The verdict over every run, one sentence each: the smallest peak against the largest (what it saves,
    what it costs in exposed communication), the fastest and slowest step, then what each run pays
    against the baseline of :func:`zero_promise` (peak, model states, traffic, exposed communication)."""
    if p is None or p.empty:
        return []
    lines = [_peak_line(p[p["peak_allocated_bytes"].notna()])]
    timed = p[p["step_us"].notna()]
    if len(timed) >= 2:
        fast, slow = timed.loc[timed["step_us"].idxmin()], timed.loc[timed["step_us"].idxmax()]
        lines.append(f"Fastest: {_on(fast)}, {_ms(fast['step_us'])} per step; slowest: {_on(slow)}, "
                     f"{_ms(slow['step_us'])} ({slow['step_us'] / fast['step_us']:.2g}x as long).")
    base = p[p["baseline"]].iloc[0]
    for _, r in p.iterrows():
        if r["baseline"]:
            continue
        parts = []
        if r["peak_ratio"] == r["peak_ratio"]:
            parts.append(f"peak {model.fmt_bytes(r['peak_allocated_bytes'])} ({100 * (r['peak_ratio'] - 1):+.0f}%)")
        if r["model_states_measured_ratio"] == r["model_states_measured_ratio"]:
            parts.append(f"model states {model.fmt_bytes(r['model_states_measured_bytes'])} "
                         f"({r['model_states_measured_ratio']:.2f}x, the formula says "
                         f"{r['model_states_theory_ratio']:.2f}x)")
        if r["traffic_measured_vs_ddp"] == r["traffic_measured_vs_ddp"]:
            parts.append(f"traffic {model.fmt_bytes(r['traffic_measured_bytes'])} per step "
                         f"({r['traffic_measured_vs_ddp']:.2f}x DDP's on {r['world_size']} ranks)")
        de = r["exposed_comm_us"] - base["exposed_comm_us"]
        if de == de:
            parts.append(f"exposed communication {_ms(r['exposed_comm_us'])} per step "
                         f"({r['exposed_comm_pct']:.0f}% of its step, {'+' if de >= 0 else '-'}{_ms(abs(de))})")
        if parts:
            lines.append(f"{_on(r)} against {_on(base)}: " + ", ".join(parts) + ".")
    return lines
