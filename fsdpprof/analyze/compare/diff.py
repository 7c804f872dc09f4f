"""What changed between runs, each against the first (the baseline), in one scope (:class:`Scope`): communication
per collective x stage x FSDP phase x unit, the step decomposition, operators and kernels per name (HTA's
``ops_diff`` categories), memory at the peak by category, role and unit.  From the small per-rank tables of the
map; bytes, µs."""
from __future__ import annotations

import hashlib
from dataclasses import dataclass, field

import numpy as np
import pandas as pd

from fsdpprof.analyze import model
from fsdpprof.analyze.load.frames import isin, on_device
from fsdpprof.analyze.compare.scope import SCOPE_ALL, SCOPE_FIRST, SCOPE_MEDIAN, Scope
from fsdpprof.analyze.summary.headline import peak_rank, step_medians
from fsdpprof.errors import UserError

OPS_NAME_CHARS = 200        # longer operator / kernel names are cut (with a hash of the full name, kept distinct)
OPS_ROWS_MAX = 50_000       # rows of one rank's operator table; the names with least time past it -> "(other)"
OTHER_OPS = "(other)"
NO_UNIT = "-"               # communication outside any FSDP unit (the root unit is "")
STEP_OP = "ProfilerStep"    # ProfilerStep#N of every step, under one name (the step number is the step column)
COMM_KEYS = ["collective", "stage", "fsdp_phase", "unit"]
STEP_METRICS = ["step_us", "compute_us", "comm_us", "exposed_comm_us", "idle_us"]
# HTA's ops_diff categories, by count (hta.trace_diff.TraceDiff.ops_diff)
ADDED, DELETED, INCREASED, DECREASED, UNCHANGED = "added", "deleted", "increased", "decreased", "unchanged"
SLOWER, FASTER, SAME = "slower", "faster", "same"


# --------------------------------------------------------------------------- the per-rank operator table (map)
def op_name(name: str) -> str:
    """The name an operator or kernel is compared under: ``ProfilerStep#N`` -> ``ProfilerStep``; a name longer than
    OPS_NAME_CHARS cut, ending in a hash of the whole."""
    name = str(name)
    if name.startswith(model.STEP_PREFIX) and name[len(model.STEP_PREFIX):].isdigit():
        return STEP_OP
    if len(name) <= OPS_NAME_CHARS:
        return name
    digest = hashlib.blake2s(name.encode("utf-8", "replace"), digest_size=4).hexdigest()
    return name[:OPS_NAME_CHARS - 12] + "...#" + digest


def op_table(events: pd.DataFrame, rows_max: int = OPS_ROWS_MAX) -> pd.DataFrame | None:
    """One rank's operators and kernels per step: rank, step, name, kind, count, total_us, max_us; past ``rows_max``
    rows, the names with the least time summed into ``(other)``.  An annotation's device mirror (the GPU span of a
    CPU region, same name) is left out: a region counts once, by its CPU annotation."""
    rows = events["step"].notna().to_numpy() & ~(isin(events["kind"], [model.KIND_ANNOTATION])
                                                  & on_device(events["lane"]))
    e = events[["step", "name", "kind", "dur_us"]][rows]          # (only the columns grouped: not a copy of every one)
    if e.empty:
        return None
    g = (e.groupby(["step", "name", "kind"], observed=True, sort=False)["dur_us"]
         .agg(count="size", total_us="sum", max_us="max").reset_index())
    names = pd.Series(g["name"].astype(str).unique())
    short = dict(zip(names, names.map(op_name)))
    g["name"] = g["name"].astype(str).map(short)
    g["kind"] = g["kind"].astype(str)
    if len(short) != len(set(short.values())):          # ProfilerStep#N of several steps: one name
        g = g.groupby(["step", "name", "kind"], sort=False, as_index=False).agg(
            count=("count", "sum"), total_us=("total_us", "sum"), max_us=("max_us", "max"))
    if len(g) > rows_max:
        per_name = g.groupby("name")["total_us"].sum().sort_values(ascending=False, kind="stable")
        rows_of = g.groupby("name").size().reindex(per_name.index)
        keep = set(per_name.index[(rows_of.cumsum() <= rows_max - 2 * e["kind"].nunique()
                                   * max(1, e["step"].nunique())).to_numpy()])
        rest = g[~g["name"].isin(keep)]
        other = rest.groupby(["step", "kind"], as_index=False).agg(
            count=("count", "sum"), total_us=("total_us", "sum"), max_us=("max_us", "max"))
        other["name"] = OTHER_OPS
        g = pd.concat([g[g["name"].isin(keep)], other[g.columns]], ignore_index=True)
    g.insert(0, "rank", int(events["rank"].iloc[0]))
    g["count"] = g["count"].astype(np.int64)
    return g.sort_values(["step", "total_us"], ascending=[True, False], kind="stable").reset_index(drop=True)


def _steps_of(a) -> dict[int, list[float]]:
    """rank -> the steps recorded on that rank (step breakdown, operators and communication tables)."""
    out: dict[int, set] = {}
    for df in (a.steps, getattr(a, "op_stats", None), a.comm_unit_step):
        if df is None or not len(df) or "step" not in df:
            continue
        d = df[["rank", "step"]].dropna().drop_duplicates()
        for r, s in zip(d["rank"].to_numpy(), d["step"].to_numpy()):
            out.setdefault(int(r), set()).add(float(s))
    return {r: sorted(s) for r, s in sorted(out.items())}


def _fmt_steps(steps) -> str:
    s = sorted({int(x) for x in steps})
    if not s:
        return "none"
    return ", ".join(map(str, s)) if len(s) <= 6 else f"{s[0]}-{s[-1]} ({len(s)} steps)"


def select(a, label: str, scope: Scope) -> tuple[dict[int, list[float]], str]:
    """(rank -> steps compared, one line saying what they are) of one input; UserError when the scope's rank
    or step is not in it."""
    steps = _steps_of(a)
    if not steps:
        return {}, f"{label}: no profiler steps (no trace events)"
    ranks = sorted(steps)
    if scope.rank is not None:
        if scope.rank not in steps:
            raise UserError(f"rank {scope.rank} has no trace in {a.path} ({model.rank_list(ranks)}); pass --rank with one "
                            f"of those, or leave --rank out to compare all ranks")
        ranks = [scope.rank]
    elif scope.iteration == SCOPE_FIRST:
        ranks = ranks[:1]
    it = scope.iteration
    if it == SCOPE_FIRST:
        sel = {r: steps[r][:1] for r in ranks}
    elif isinstance(it, int):
        sel = {r: [float(it)] for r in ranks if float(it) in steps[r]}
        if not sel:
            have = sorted({s for r in ranks for s in steps[r]})
            raise UserError(f"step {it} (ProfilerStep#{it}) is not in {a.path} (its steps: {_fmt_steps(have)}); pass "
                            f"--iteration with one of those, or first / all")
    else:
        sel = {r: steps[r] for r in ranks}
    all_steps = sorted({s for v in sel.values() for s in v})
    how = {SCOPE_MEDIAN: "median per step over steps", SCOPE_ALL: "sum over steps"}.get(it, "step")
    text = f"{label}: {model.rank_list(sel)}, {how} {_fmt_steps(all_steps)}"
    if len(sel) > 1:
        text += " (median across ranks)"
    return sel, text


def scoped(df: pd.DataFrame | None, keys: list[str], values: list[str], sel: dict[int, list[float]],
           how: str | int) -> pd.DataFrame:
    """One number per group of ``keys``: per rank the median (``how`` median) or sum over its selected steps, then
    the median across ranks (a step or rank without the group counts 0; a value the input does not hold, e.g. the
    size of a collective without size information, stays NaN through a sum and is left out of a median)."""
    empty = pd.DataFrame(columns=keys + values)
    if df is None or not len(df) or not sel:
        return empty
    pairs = pd.MultiIndex.from_tuples([(r, s) for r, ss in sel.items() for s in ss], names=["rank", "step"])
    d = df[keys + values].copy()
    d["rank"], d["step"] = df["rank"].astype(int).to_numpy(), df["step"].astype(float).to_numpy()
    d = d[pd.MultiIndex.from_arrays([d["rank"], d["step"]]).isin(pairs)]
    if d.empty:
        return empty
    for k in keys:
        d[k] = d[k].astype(object).where(d[k].notna(), NO_UNIT)
    d[values] = d[values].astype(float)
    by = ["rank", "step"] + keys
    g = d.groupby(by, sort=False)[values].sum()
    unknown = d[values].isna().assign(**{k: d[k] for k in by}).groupby(by, sort=False)[values].any()
    g = g.mask(unknown.reindex(g.index).to_numpy())                           # one unknown makes the sum unknown
    wide = g.unstack(keys).reindex(pairs)                                      # rows: (rank, step)
    present = d.groupby(by, sort=False).size().unstack(keys).reindex(pairs).notna()
    for v in values:                                                           # a group absent: 0
        wide[v] = wide[v].mask(~present.reindex(columns=wide[v].columns).fillna(False).to_numpy(dtype=bool), 0.0)
    per_rank = (wide.groupby(level="rank").median() if how == SCOPE_MEDIAN else
                wide.groupby(level="rank").sum().mask(wide.isna().groupby(level="rank").any()))
    per_rank = per_rank.reindex(sorted(sel), fill_value=0.0)
    out = per_rank.median().unstack(level=0)
    out = out.reset_index()
    out.columns = keys + [str(c) for c in out.columns[len(keys):]]
    return out[keys + values]


# --------------------------------------------------------------------------- the pairs
def _pair(base: pd.DataFrame, run: pd.DataFrame, keys: list[str], values: list[str]) -> pd.DataFrame:
    """Outer join of the baseline's and a run's groups (a group on one side only: 0 on the other; a value NaN on
    its side stays NaN, and so does its difference): baseline_<v>, run_<v>, diff_<v>."""
    b = base.set_index(keys)[values].add_prefix("baseline_")
    r = run.set_index(keys)[values].add_prefix("run_")
    m = b.join(r, how="outer")
    for side, cols in ((b, b.columns), (r, r.columns)):
        m.loc[~m.index.isin(side.index), cols] = 0.0
    cols = []
    for v in values:
        m[f"diff_{v}"] = m[f"run_{v}"] - m[f"baseline_{v}"]
        cols += [f"baseline_{v}", f"run_{v}", f"diff_{v}"]
    return m[cols].reset_index()


def change_of(baseline_count: np.ndarray, run_count: np.ndarray) -> np.ndarray:
    """HTA's ops_diff category of each name, by count: added, deleted, increased, decreased, unchanged."""
    b, r = np.asarray(baseline_count, dtype=float), np.asarray(run_count, dtype=float)
    return np.select([(b == 0) & (r > 0), (b > 0) & (r == 0), (b > 0) & (r > b), (r > 0) & (r < b)],
                     [ADDED, DELETED, INCREASED, DECREASED], UNCHANGED).astype(object)


def _kinds_by_name(tables: list[pd.DataFrame]) -> pd.Series:
    """name -> its kind, or its kinds joined by '/' (e.g. compute/cpu_op) when it has several."""
    k = pd.concat([t[["name", "kind"]] for t in tables if len(t)] or [pd.DataFrame(columns=["name", "kind"])])
    k = k.astype(str).drop_duplicates()
    multi = k["name"].duplicated(keep=False).to_numpy()
    out = k[~multi].set_index("name")["kind"]
    if multi.any():       # few names: joined one group at a time
        out = pd.concat([out, k[multi].sort_values("kind").groupby("name")["kind"].agg("/".join)])
    return out


def ops_diff(base: pd.DataFrame, run: pd.DataFrame) -> pd.DataFrame:
    """Per name: kind(s), baseline_/run_/diff_ count and total_us, ``change`` (:func:`change_of`) and
    ``time_change``, most time added first."""
    def by_name(t: pd.DataFrame) -> pd.DataFrame:
        if t.empty:
            return pd.DataFrame(columns=["name", "count", "total_us"])
        return t.groupby("name", as_index=False, sort=False)[["count", "total_us"]].sum()
    m = _pair(by_name(base), by_name(run), ["name"], ["count", "total_us"])
    m.insert(1, "kind", m["name"].map(_kinds_by_name([base, run])).to_numpy())
    m["change"] = change_of(m["baseline_count"], m["run_count"])
    d = m["diff_total_us"].to_numpy()
    m["time_change"] = np.select([d > 0, d < 0], [SLOWER, FASTER], SAME).astype(object)
    return m.sort_values(["diff_total_us", "name"], ascending=[False, True], kind="stable").reset_index(drop=True)


def memory_rank(a, scope: Scope) -> int | None:
    """The rank whose memory at the peak is compared: the scope's, the first (scope first), else ``peak_rank``."""
    ranks = sorted(a.memory or {})
    if scope.rank is not None:
        ranks = [r for r in ranks if r == scope.rank]
    elif scope.iteration == SCOPE_FIRST:
        ranks = ranks[:1]
    if not ranks:
        return None
    return ranks[0] if len(ranks) == 1 else peak_rank(a)


def _memory_tables(a, scope: Scope) -> tuple[pd.DataFrame | None, pd.DataFrame | None, int | None]:
    """Memory at the peak by category and by (unit, category) of the rank :func:`memory_rank` picks."""
    r = memory_rank(a, scope)
    if r is None:
        return None, None, None

    def table(attr: str, keys: list[str]) -> pd.DataFrame | None:
        t = getattr(a.memory[r], attr, None)
        if t is None or not len(t):
            return None
        t = t[keys + ["bytes"]].copy()
        for k in keys:
            t[k] = t[k].astype(object).where(t[k].notna(), NO_UNIT)
        return t.groupby(keys, as_index=False, sort=False)["bytes"].sum()

    return table("breakdown_at_peak", ["category"]), table("by_unit_at_peak", ["unit", "category"]), r


def by_role(categories: pd.DataFrame) -> pd.DataFrame:
    """A memory table by category -> by role (every role of model.MEMORY_ROLES, in order; same total)."""
    r = categories.assign(role=categories["category"].map(model.memory_role)).groupby("role")["bytes"].sum()
    return pd.DataFrame({"role": model.MEMORY_ROLES, "bytes": [float(r.get(k, 0.0)) for k in model.MEMORY_ROLES]})


# --------------------------------------------------------------------------- the diff
@dataclass
class Diff:
    """Every run against the baseline (the first): tables in long form with a ``run`` column (its label)."""

    baseline: str
    scope: dict                                   # iteration, rank, text, per_run (what each input contributed)
    comm: pd.DataFrame                            # run, COMM_KEYS: baseline_/run_/diff_ count, bytes, comm_us, exposed_comm_us
    steps: pd.DataFrame                           # run, metric: baseline_us, run_us, diff_us, diff_pct
    ops: pd.DataFrame                             # run, name, kind: baseline_/run_/diff_ count, total_us; change, time_change
    memory: pd.DataFrame                          # run, category: baseline_/run_/diff_ bytes
    memory_roles: pd.DataFrame                    # run, role: baseline_/run_/diff_ bytes (they add up to the peak's)
    memory_units: pd.DataFrame                    # run, unit, category: baseline_/run_/diff_ bytes
    notes: list = field(default_factory=list)
    critical: pd.DataFrame | None = None          # run, kind: baseline_/run_/diff_us (critical path, mean per step)


COMM_VALUES = ["count", "bytes", "comm_us", "exposed_comm_us"]
OPS_VALUES = ["count", "total_us"]


def _concat_runs(parts: list[tuple[str, pd.DataFrame]], columns: list[str]) -> pd.DataFrame:
    frames = [p.assign(run=lab)[["run"] + [c for c in p.columns]] for lab, p in parts if p is not None and len(p)]
    if not frames:
        return pd.DataFrame(columns=["run"] + columns)
    return pd.concat(frames, ignore_index=True)


def critical_breakdown(a) -> pd.DataFrame:
    """kind, us: the critical path's time per kind, the mean per step over all the run's steps (empty without)."""
    cp = getattr(a, "critical_path", None)
    br = cp.breakdown if cp is not None and cp.breakdown is not None else None
    if br is None or not len(br):
        return pd.DataFrame(columns=["kind", "us"])
    m = br[br["step"].isna()]
    return pd.DataFrame({"kind": m["kind"].astype(str).to_numpy(), "us": m["dur_us"].to_numpy(np.float64)})


def diff_analyses(analyses: list, labels: list[str], scope: Scope | None = None) -> Diff:
    """Each run against the first one in ``scope``; UserError when its rank or step is missing from an input."""
    scope = scope or Scope()
    how = scope.iteration
    notes: list[str] = []
    sels, per_run = [], []
    for a, lab in zip(analyses, labels):
        sel, text = select(a, lab, scope)
        sels.append(sel)
        per_run.append(text)

    def comm_of(a, sel):
        t = a.comm_unit_step
        if t is None or not len(t):
            return pd.DataFrame(columns=COMM_KEYS + COMM_VALUES)
        return scoped(t, COMM_KEYS, COMM_VALUES, sel, how)

    def steps_of(a, sel):
        t = a.steps
        cols = [c for c in STEP_METRICS if t is not None and c in t]
        if t is None or not len(t) or not cols:
            return pd.DataFrame(columns=["metric", "us"])
        if how == SCOPE_MEDIAN:      # the report's headline numbers (headline.step_medians) of the selected steps
            pairs = pd.MultiIndex.from_tuples([(r, x) for r, ss in sel.items() for x in ss])
            t = t[pd.MultiIndex.from_arrays([t["rank"].astype(int), t["step"].astype(float)]).isin(pairs)]
            med = step_medians(t)
            return pd.DataFrame({"metric": cols, "us": [med[c] for c in cols]}) if len(t) else \
                pd.DataFrame(columns=["metric", "us"])
        s = scoped(t.assign(_all="step"), ["_all"], cols, sel, how)
        if s.empty:
            return pd.DataFrame(columns=["metric", "us"])
        return pd.DataFrame({"metric": cols, "us": [float(s[c].iloc[0]) for c in cols]})

    def ops_of(a, sel):
        t = getattr(a, "op_stats", None)
        if t is None or not len(t):
            return pd.DataFrame(columns=["name", "kind"] + OPS_VALUES)
        return scoped(t, ["name", "kind"], OPS_VALUES, sel, how)

    base, base_sel, base_lab = analyses[0], sels[0], labels[0]
    b_comm, b_steps, b_ops = comm_of(base, base_sel), steps_of(base, base_sel), ops_of(base, base_sel)
    b_mem, b_units, b_mem_rank = _memory_tables(base, scope)
    comm, stp, ops, mem, roles, units = [], [], [], [], [], []
    mem_ranks = [b_mem_rank]
    for a, lab, sel in zip(analyses[1:], labels[1:], sels[1:]):
        if not sel or not base_sel:
            missing = [x for x, s in ((base_lab, base_sel), (lab, sel)) if not s]
            notes.append(f"{' and '.join(missing)} {'has' if len(missing) == 1 else 'have'} no profiler steps (no "
                         f"trace), so communication, steps and operators of {lab} are not compared.")
        else:
            comm.append((lab, _pair(b_comm, comm_of(a, sel), COMM_KEYS, COMM_VALUES)))
            s = _pair(b_steps, steps_of(a, sel), ["metric"], ["us"])
            s = s.rename(columns={"baseline_us": "baseline_us", "run_us": "run_us", "diff_us": "diff_us"})
            base_us = s["baseline_us"].to_numpy(float)
            s["diff_pct"] = np.where(base_us != 0, 100.0 * s["diff_us"].to_numpy(float) / np.where(
                base_us != 0, base_us, 1.0), np.nan)
            order = {m: i for i, m in enumerate(STEP_METRICS)}
            stp.append((lab, s.sort_values("metric", key=lambda c: c.map(order)).reset_index(drop=True)))
            ops.append((lab, ops_diff(b_ops, ops_of(a, sel))))
        r_mem, r_units, r_mem_rank = _memory_tables(a, scope)
        mem_ranks.append(r_mem_rank)
        if b_mem is None or r_mem is None:
            missing = [x for x, m in ((base_lab, b_mem), (lab, r_mem)) if m is None]
            notes.append(f"memory at the peak is not compared for {lab}: {' and '.join(missing)} "
                         f"{'has' if len(missing) == 1 else 'have'} no memory records.")
        else:
            mem.append((lab, _pair(b_mem, r_mem, ["category"], ["bytes"])))
            rl = _pair(by_role(b_mem), by_role(r_mem), ["role"], ["bytes"])
            roles.append((lab, rl.set_index("role").loc[model.MEMORY_ROLES].reset_index()))
            if b_units is not None and r_units is not None:
                u = _pair(b_units, r_units, ["unit", "category"], ["bytes"])
                units.append((lab, u[(u["baseline_bytes"] != 0) | (u["run_bytes"] != 0)]))
    b_crit = critical_breakdown(base)
    crit = [(lab, _pair(b_crit, critical_breakdown(a), ["kind"], ["us"])) for a, lab in zip(analyses[1:], labels[1:])
            if len(b_crit) or len(critical_breakdown(a))]
    comm_cols = COMM_KEYS + [f"{p}_{v}" for v in COMM_VALUES for p in ("baseline", "run", "diff")]
    comm_df = _concat_runs(comm, comm_cols)
    if len(comm_df):
        comm_df = comm_df.sort_values(["run", "diff_exposed_comm_us"], ascending=[True, False],
                                      kind="stable").reset_index(drop=True)
    return Diff(
        baseline=base_lab,
        scope={"iteration": how, "rank": scope.rank, "text": scope.describe(), "per_run": per_run,
               "memory_ranks": dict(zip(labels, mem_ranks))},
        comm=comm_df, steps=_concat_runs(stp, ["metric", "baseline_us", "run_us", "diff_us", "diff_pct"]),
        ops=_concat_runs(ops, ["name", "kind", "baseline_count", "run_count", "diff_count", "baseline_total_us",
                               "run_total_us", "diff_total_us", "change", "time_change"]),
        memory=_concat_runs(mem, ["category", "baseline_bytes", "run_bytes", "diff_bytes"]),
        memory_roles=_concat_runs(roles, ["role", "baseline_bytes", "run_bytes", "diff_bytes"]),
        memory_units=_concat_runs(units, ["unit", "category", "baseline_bytes", "run_bytes", "diff_bytes"]),
        notes=notes, critical=_concat_runs(crit, ["kind", "baseline_us", "run_us", "diff_us"]))
