"""Several runs side by side from their Analyses: memory at the peak by category and by role (the rank whose peak is
highest), step times (each rank's mean, the median over ranks) with their spread, a verdict, and what changed
against the first run (:mod:`fsdpprof.analyze.compare.diff`).  Runs are comparable unless their models differ
(Psi, or the aten op mix where Psi is unknown), their devices differ, or one trains and the other infers
(:func:`not_comparable`).  Bytes, µs."""
from __future__ import annotations

import os
from dataclasses import dataclass, field

import numpy as np
import pandas as pd

from fsdpprof.analyze import model
from fsdpprof.analyze.model import fmt_ms, rank_list
from fsdpprof.analyze.compare import diff, noise
from fsdpprof.analyze.compare.noise import Difference, NoiseTest
from fsdpprof.analyze.compare.scope import Scope
from fsdpprof.analyze.summary import host
from fsdpprof.analyze.summary.headline import peak_rank, step_medians, step_spread
from fsdpprof.analyze.pipeline import Analysis
from fsdpprof.errors import UserError

SPREAD_METRICS = ("step_us", "exposed_comm_us")   # shown with their spread over ranks and steps
CPU_CONTENTION = "cpu_contention"                  # rank.json's CPU load: time runnable / time on a CPU (>= 1)
CONTENTION_DIFFERS = 1.25     # two runs' CPU contention (median over ranks) differ when one is this many times the other


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
    spread: pd.DataFrame | None = None    # run, metric (step_us, exposed_comm_us, cpu_contention): value, min, max,
                                          # worst_rank, worst, ranks, steps (headline.step_spread)
    roles: pd.DataFrame | None = None     # run, role, bytes: the memory at the peak by role (model.MemoryRole)
    noise: list = field(default_factory=list)   # differences inside the spread, runs under different CPU load


def role_bytes(breakdown: pd.DataFrame | None) -> dict:
    """A breakdown by category (category, bytes) -> bytes per role (model.MEMORY_ROLES, every role present)."""
    out = dict.fromkeys(model.MEMORY_ROLES, 0.0)
    if breakdown is not None and len(breakdown):
        for cat, b in breakdown.groupby("category", observed=True)["bytes"].sum().items():
            out[model.memory_role(cat)] += float(b)
    return out


def contention_spread(a: Analysis) -> dict:
    """The run's CPU contention (:func:`host.contention_spread`), as :func:`step_spread` states a column."""
    return host.contention_spread(a.cpu_load, a.overview.get("device_type"))


def run_numbers(a: Analysis) -> dict:
    """Per-run numbers for comparison, by the report's rules: memory of ``peak_rank`` by category and role, times
    per step with the slowest rank."""
    o, t = a.overview, a.theory or {}
    d = {"strategy": o.get("strategy"), "framework": o.get("framework"),
         "world_size": o.get("world_size"), "psi": o.get("psi")}
    r = peak_rank(a) if a.memory else None
    m = a.memory[r] if r is not None else None
    d["peak_rank"] = r
    d["peak_allocated_bytes"] = float(m.peak_allocated_bytes) if m is not None else np.nan
    cats = {}
    bd = m.breakdown_at_peak if m is not None else None
    if bd is not None and not bd.empty:
        cats = bd.groupby("category", observed=True)["bytes"].sum().to_dict()
    for role, b in role_bytes(bd).items():
        d[f"role_{role}_bytes"] = b if m is not None else np.nan
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
    d["slowest_rank"] = step_spread(a.steps, "step_us")["worst_rank"]
    d[CPU_CONTENTION] = contention_spread(a)["value"]
    return d


def spread_of(a: Analysis) -> dict:
    """metric -> step_spread (step_us, exposed_comm_us) or contention_spread (cpu_contention) of one run."""
    out = {c: step_spread(a.steps, c) for c in SPREAD_METRICS}
    out[CPU_CONTENTION] = contention_spread(a)
    return out


THEORY_METRICS = ("model_states_theory_bytes", "traffic_theory_bytes")


def _labels(analyses: list[Analysis], nums: list[dict]) -> list[str]:
    """One label per run: model.describe_input, after the folder name when the strategy is not recorded."""
    names = [os.path.basename(os.path.normpath(a.path)) or a.path for a in analyses]
    if len(set(names)) < len(names):   # e.g. two torchtitan iteration_10 folders: name their parents too
        names = [os.path.join(*os.path.normpath(a.path).split(os.sep)[-2:]) for a in analyses]
    labels, seen = [], {}
    for a, n, name in zip(analyses, nums, names):
        o = a.overview
        said = o.get("description") or model.describe_input(o.get("input_kind"), o.get("strategy"), o.get("world_size"))
        base = said if n["strategy"] else f"{name} ({said})"
        seen[base] = seen.get(base, 0) + 1
        labels.append(base if seen[base] == 1 else f"{base} #{seen[base]}")
    return labels


def compare_analyses(analyses: list[Analysis], *, allow_different_models: bool = False,
                     scope: Scope | None = None) -> Comparison:
    """Put runs side by side, and each against the first in ``scope``.  UserError for fewer than two runs, or for
    known models that differ (unless allow_different_models: a warning); unknown models leave the formulas out."""
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
    for reason in not_comparable(analyses, nums):
        comparable = False
        warnings.append("Not comparable: " + reason + ".")
    unknown = [a.path for a, n in zip(analyses, nums) if n["psi"] is None]
    if unknown:
        for n in nums:
            for k in THEORY_METRICS:
                n[k] = np.nan
        notes.append(f"Model unknown for {', '.join(unknown)} (no inventory.json: not recorded with fsdpprof "
                     f"record), so the memory formulas (model states and traffic in theory) are left out; "
                     f"everything measured is compared.")
    labels = _labels(analyses, nums)
    counted = [(lab, (a.theory or {}).get("model_states_counted")) for lab, a in zip(labels, analyses)]
    if not unknown and any(c for _, c in counted):
        notes.append("Model states measured: " + "; ".join(f"{lab}: {c}" for lab, c in counted if c) + ".")
    for lab, a in zip(labels, analyses):     # a rank missing from a run: named, its figures are the others'
        if a.missing:
            warnings.append(f"PARTIAL: {lab} is compared over {rank_list(a.overview.get('ranks_present') or [])} "
                            f"only; missing " + "; ".join(f"{k}: {v}" for k, v in sorted(a.missing.items())))
    metrics = list(nums[0].keys())
    t = pd.DataFrame({"metric": metrics, **{lab: [n.get(k) for k in metrics] for lab, n in zip(labels, nums)}})
    t = t.astype(object)
    cats = pd.DataFrame([{"run": lab, "category": k[len("peak_"):-len("_bytes")], "bytes": v}
                         for lab, n in zip(labels, nums) for k, v in n.items()
                         if k.startswith("peak_") and k.endswith("_bytes") and k != "peak_allocated_bytes"
                         and v == v and v])
    if cats.empty:
        cats = pd.DataFrame(columns=["run", "category", "bytes"])
    tm = pd.DataFrame([{"run": lab, **{c: n.get(c) for c in ("step_us", "compute_us", "exposed_comm_us", "idle_us")}}
                       for lab, n in zip(labels, nums)])
    spread = pd.DataFrame([{"run": lab, "metric": k, **v} for lab, a in zip(labels, analyses)
                           for k, v in spread_of(a).items()])
    roles = pd.DataFrame([{"run": lab, "role": k[len("role_"):-len("_bytes")], "bytes": v}
                          for lab, n in zip(labels, nums) for k, v in n.items() if k.startswith("role_")],
                         columns=["run", "role", "bytes"])
    promise = zero_promise(analyses, nums, labels)
    test = NoiseTest.of_steps({lab: a.steps for lab, a in zip(labels, analyses)}, SPREAD_METRICS)
    lines = verdict_lines(promise, spread, test)
    verdict = " ".join(lines) if lines else "Not enough memory data to compare peaks."
    formula = pd.DataFrame([{"run": lab, "category": cat, "bytes": float(b)}
                            for lab, a in zip(labels, analyses)
                            for cat, b in _formula_parts(a).items()], columns=["run", "category", "bytes"])
    d = diff.diff_analyses(analyses, labels, scope)
    return Comparison([a.path for a in analyses], labels, t, cats, tm, verdict, warnings, comparable, diff=d,
                      notes=notes + d.notes, models_known=not unknown,
                      promise=promise, formula=formula, verdict_lines=lines, spread=spread, roles=roles,
                      noise=noise_lines(promise, spread, test))


OP_MIX_SAME = 0.65     # share of aten op calls two runs of one model have in common (min of the two shares per op)


def op_mix(a: Analysis) -> pd.Series | None:
    """The run's mix of aten operators: each ``aten::`` op's share of the calls (op_stats), None without ops."""
    o = a.op_stats
    if o is None or o.empty or "name" not in o:
        return None
    o = o[o["name"].astype(str).str.startswith("aten::")]
    calls = o.groupby(o["name"].astype(str))["count"].sum()
    return calls / calls.sum() if calls.sum() > 0 else None


def op_mix_overlap(x: pd.Series, y: pd.Series) -> float:
    """The share of calls two op mixes have in common: the sum over ops of the smaller share (0..1)."""
    m = pd.concat([x, y], axis=1).fillna(0.0)
    return float(m.min(axis=1).sum())


def not_comparable(analyses: list[Analysis], nums: list[dict]) -> list[str]:
    """Why runs are not comparable to the first, one reason a line: different models where Psi is unknown (their
    aten op mix has less than OP_MIX_SAME in common), different devices (type or name), training against
    inference.  (Known models that differ in Psi: :func:`compare_analyses` refuses them.)"""
    out = []
    base, bn = analyses[0], nums[0]
    ob = base.overview
    mix0 = op_mix(base)
    for a, n in zip(analyses[1:], nums[1:]):
        o = a.overview
        if bn["psi"] is None or n["psi"] is None:
            mix = op_mix(a)
            if mix0 is not None and mix is not None and op_mix_overlap(mix0, mix) < OP_MIX_SAME:
                out.append(f"{a.path} and {base.path} run different models: {100 * op_mix_overlap(mix0, mix):.0f}% "
                           f"of their aten operator calls are in common (one model, other strategies: "
                           f"{100 * OP_MIX_SAME:.0f}% or more; Psi unknown: no inventory.json)")
        dev = [(x.get("device_type"), x.get("device_name")) for x in (ob, o)]
        if dev[0][0] and dev[1][0] and (dev[0][0] != dev[1][0] or (dev[0][1] and dev[1][1] and dev[0][1] != dev[1][1])):
            out.append(f"{a.path} and {base.path} ran on different devices ("
                       + " against ".join(" ".join(str(v) for v in d if v) for d in (dev[1], dev[0]))
                       + "): their times compare the devices as much as the runs")
        w = (ob.get("workload"), o.get("workload"))
        if w[0] and w[1] and w[0] != w[1]:
            out.append(f"{a.path} is {w[1]} and {base.path} is {w[0]}: a step of one is not a step of the other")
    return out


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
        if row.get("strategy") == model.ZERO_DDP:
            return float(row.get("traffic_bytes", np.nan))
    return np.nan


def _ratio(x, y) -> float:
    x, y = float(x), float(y)
    return x / y if x == x and y == y and y else np.nan


def zero_promise(analyses: list[Analysis], nums: list[dict], labels: list[str]) -> pd.DataFrame:
    """Per run, the ZeRO formulas' promise beside the measurement (bytes per rank, µs per step), as ratios to the
    baseline run (marked ``baseline``: the unsharded run with the fewest ranks, else the largest formula model
    states) and, for traffic, to DDP's formula."""
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


def _on(row) -> str:
    n = row["world_size"]
    if not row["strategy"]:
        return str(row["run"])
    return f"{row['strategy']} on {n} rank{'' if n == 1 else 's'}"


def _ranks(n) -> str:
    return f"{n} rank{'' if n == 1 else 's'}"


def _n_differs(x, y) -> str:
    """'' when two runs have the same world size, else '; N differs: 4 ranks against 2'."""
    nx, ny = x["world_size"], y["world_size"]
    if nx == ny or nx is None or ny is None or nx != nx or ny != ny:
        return ""
    return f"; N differs: {_ranks(nx)} against {ny}"


def _spread_row(spread: pd.DataFrame | None, run: str, metric: str) -> dict | None:
    if spread is None or spread.empty:
        return None
    s = spread[(spread["run"] == run) & (spread["metric"] == metric)]
    if s.empty or s.iloc[0]["min"] != s.iloc[0]["min"]:
        return None
    return s.iloc[0].to_dict()


def _range_ms(s: dict) -> str:
    """A spread in words: 474-630 ms."""
    return f"{fmt_ms(s['min'])[:-3]}-{fmt_ms(s['max'])}"


def _tested(test: NoiseTest | None, a: str, b: str, metric: str) -> Difference | None:
    return test.test(a, b, metric) if test is not None else None


def _peak_line(peaks: pd.DataFrame, test: NoiseTest | None = None) -> str:
    """The smallest peak against the largest: what it saves, and what it costs in exposed communication when that
    difference is measured (:mod:`noise`)."""
    if len(peaks) < 2:
        return "Not enough memory data to compare peaks."
    lo = peaks.loc[peaks["peak_allocated_bytes"].idxmin()]
    hi = peaks.loc[peaks["peak_allocated_bytes"].idxmax()]
    if lo["peak_allocated_bytes"] == hi["peak_allocated_bytes"]:
        return f"{', '.join(_on(r) for _, r in peaks.iterrows())}: the same peak memory."
    saved = hi["peak_allocated_bytes"] - lo["peak_allocated_bytes"]
    de = lo["exposed_comm_us"] - hi["exposed_comm_us"]
    d = _tested(test, hi["run"], lo["run"], "exposed_comm_us")
    if de != de:
        cost = "(exposed communication unknown)"
    elif test is not None and d is None:
        cost = "(exposed communication not tested: too few steps)"
    elif test is not None and not d.measured:
        cost = "with no measured difference in exposed communication per step"
    else:
        cost = (f"at the cost of {fmt_ms(de)} more exposed communication per step" if de >= 0 else
                f"and exposes {fmt_ms(-de)} less communication per step")
    line = (f"{_on(lo)} saves {model.fmt_bytes(saved)} per rank at the peak compared with {_on(hi)}, {cost} "
            f"({model.fmt_bytes(lo['peak_allocated_bytes'])} against {model.fmt_bytes(hi['peak_allocated_bytes'])}")
    if lo["step_us"] == lo["step_us"] and hi["step_us"] == hi["step_us"]:
        line += f"; step time {fmt_ms(lo['step_us'])} vs {fmt_ms(hi['step_us'])}"
    return line + _n_differs(lo, hi) + ")."


def peak_lines(p: pd.DataFrame, test: NoiseTest | None = None) -> list[str]:
    """:func:`_peak_line` per world size with two runs or more (the baseline's first), else over all runs."""
    peaks = p[p["peak_allocated_bytes"].notna()]
    base_n = p.loc[p["baseline"], "world_size"].iloc[0] if p["baseline"].any() else None
    sizes = sorted({n for n in peaks["world_size"] if n is not None and n == n}, key=lambda n: (n != base_n, n))
    lines = [_peak_line(peaks[peaks["world_size"] == n], test) for n in sizes if (peaks["world_size"] == n).sum() >= 2]
    return lines or [_peak_line(peaks, test)]


def verdict_lines(p: pd.DataFrame, spread: pd.DataFrame | None = None, test: NoiseTest | None = None) -> list[str]:
    """The verdict, one sentence each: peaks, fastest against slowest step, then each run against the baseline
    of :func:`zero_promise`.  With ``test`` (:class:`noise.NoiseTest`) a difference in time is stated only when it
    is measured; one that is not is said to be none (:func:`noise_lines` says why)."""
    if p is None or p.empty:
        return []
    lines = peak_lines(p, test)
    timed = p[p["step_us"].notna()]
    if len(timed) >= 2:
        fast, slow = timed.loc[timed["step_us"].idxmin()], timed.loc[timed["step_us"].idxmax()]
        d = _tested(test, fast["run"], slow["run"], "step_us")
        if test is not None and d is None:
            line = (f"Step time: {_on(fast)} {fmt_ms(fast['step_us'])} against {_on(slow)} "
                    f"{fmt_ms(slow['step_us'])} per step, not tested (too few steps: one of them has fewer than 2 "
                    f"steps x ranks")
        elif test is not None and not d.measured:
            line = (f"No measured difference in step time: {_on(fast)} {fmt_ms(fast['step_us'])} against "
                    f"{_on(slow)} {fmt_ms(slow['step_us'])} per step (the fastest and the slowest; difference of "
                    f"medians {d.words()}")
        else:
            line = (f"Fastest: {_on(fast)}, {fmt_ms(fast['step_us'])} per step; slowest: {_on(slow)}, "
                    f"{fmt_ms(slow['step_us'])} ({slow['step_us'] / fast['step_us']:.2g}x as long")
            sp = [_spread_row(spread, r, "step_us") for r in (fast["run"], slow["run"])]
            if all(x is not None for x in sp):
                line += f"; their steps range {_range_ms(sp[0])} against {_range_ms(sp[1])}"
            if d is not None:
                line += f"; difference of medians {d.words()}"
        lines.append(line + _n_differs(slow, fast) + ").")
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
            d = _tested(test, base["run"], r["run"], "exposed_comm_us")
            change = ("not tested: too few steps" if test is not None and d is None else
                      "no measured change" if test is not None and not d.measured else
                      f"{'+' if de >= 0 else '-'}{fmt_ms(abs(de))}")
            parts.append(f"exposed communication {fmt_ms(r['exposed_comm_us'])} per step "
                         f"({r['exposed_comm_pct']:.0f}% of its step, {change})")
        if parts:
            n = _n_differs(r, base)
            lines.append(f"{_on(r)} against {_on(base)}: " + ", ".join(parts) + (f" ({n[2:]})" if n else "") + ".")
    return lines


def noise_lines(p: pd.DataFrame, spread: pd.DataFrame | None, test: NoiseTest | None = None) -> list[str]:
    """What the verdict leaves out as noise: each run against the baseline (and the slowest against the fastest),
    the differences in step time and exposed communication whose bootstrap interval (:mod:`noise`) holds 0; and
    CPU runs recorded under CPU contention differing by CONTENTION_DIFFERS or more."""
    if p is None or p.empty:
        return []
    base = p[p["baseline"]].iloc[0]
    out = []
    pairs = [(base, r) for _, r in p.iterrows() if not r["baseline"]]
    timed = p[p["step_us"].notna()]
    if len(timed) >= 2:
        fast, slow = timed.loc[timed["step_us"].idxmin()], timed.loc[timed["step_us"].idxmax()]
        if not any({x["run"], y["run"]} == {fast["run"], slow["run"]} for x, y in pairs):
            pairs.insert(0, (fast, slow))
    for a, r in pairs:
        inside = []
        for metric, words in (("step_us", "step time"), ("exposed_comm_us", "exposed communication")):
            d = _tested(test, a["run"], r["run"], metric)
            if d is not None and not d.measured:
                inside.append(f"{words} ({fmt_ms(a[metric])} against {fmt_ms(r[metric])}; difference of medians "
                              f"{d.words()})")
        if inside:
            out.append(f"{_on(r)} against {_on(a)}: the difference in " + " and in ".join(inside)
                       + f" holds 0 in its {noise.INTERVAL_LEVEL:.0%} bootstrap interval: not a measured change.")
        if a is not base:
            continue
        cb, cr = _spread_row(spread, base["run"], CPU_CONTENTION), _spread_row(spread, r["run"], CPU_CONTENTION)
        if cb is not None and cr is not None and max(cb["value"], cr["value"]) >= CONTENTION_DIFFERS * min(
                cb["value"], cr["value"]):
            out.append(f"{_on(r)} and {_on(base)} were recorded under different CPU contention (x{cr['value']:.2f} "
                       f"against x{cb['value']:.2f}: time runnable over time on a CPU, median over ranks, from "
                       f"rank.json): their times differ by that much for the host's load alone; record both on "
                       f"an idle host to compare times.")
    return out
