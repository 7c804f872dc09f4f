"""``analyze_run(run) -> Analysis``: the one place that turns a Run into every number a report shows.

Calls the trace analyses (overlap, volume, steps, ranks), ``memory_analysis`` per rank, the
theory formulas with the run's own numbers, and the findings. Each part that cannot be computed
for this input (no trace, no inventory, CPU trace for HTA, ...) leaves a one-line note in
``Analysis.notes[section]`` instead of failing. ``Analysis.to_summary()`` is summary.json.
Units: bytes, microseconds (``_us``), percent (``_pct``).
"""
from __future__ import annotations

import math
import os
import tempfile
import traceback
from dataclasses import dataclass, field

import numpy as np
import pandas as pd

from fsdpprof.analyze import findings as fnd
from fsdpprof.analyze import theory
from fsdpprof.errors import UserError, unexpected_as_user_error

SUMMARY_SCHEMA = "fsdpprof.summary/1"
LANE_EVENTS_MAX = 4000


@dataclass
class Analysis:
    """Every number of one run, as small tables and dicts (see module docstring for units)."""

    path: str
    source: str
    overview: dict
    missing: dict
    warnings: list
    notes: dict = field(default_factory=dict)                 # section -> why something is not shown
    memory: dict = field(default_factory=dict)                # rank -> MemoryResult
    memory_peaks: pd.DataFrame | None = None                  # one row per rank
    theory: dict = field(default_factory=dict)
    model_states: pd.DataFrame | None = None                  # rank, role, measured_bytes, theory_bytes, diff_bytes
    volume: pd.DataFrame | None = None
    overlap_phase: pd.DataFrame | None = None                 # rank, collective, phase, comm/overlapped/exposed
    overlap_overall: pd.DataFrame | None = None
    steps: pd.DataFrame | None = None
    skew: pd.DataFrame | None = None
    stragglers: pd.DataFrame | None = None
    traffic: pd.DataFrame | None = None                       # rank: measured vs theory bytes per step
    lanes: pd.DataFrame | None = None                         # one step of one rank, for the lanes chart
    lanes_step: float | None = None
    top_ops: pd.DataFrame | None = None                       # name, kind, count, total_us, max_us in that step
    hta: dict = field(default_factory=dict)                   # name -> DataFrame (GPU traces only)
    findings: list = field(default_factory=list)

    def to_summary(self) -> dict:
        """JSON-ready dict of every number (the content of summary.json)."""
        def tab(df):
            if df is None:
                return None
            return _records(df)

        mem = {}
        for r, m in sorted(self.memory.items()):
            mem[str(r)] = {
                "source": m.source, "peak_allocated_bytes": _j(m.peak_allocated_bytes), "peak_ts_us": _j(m.peak_ts_us),
                "peak_phase": m.peak_phase, "baseline_bytes": _j(m.baseline_bytes),
                "coverage_pct": _j(m.coverage_pct), "reserved_bytes": _j(m.reserved_bytes),
                "fragmentation_pct": _j(m.fragmentation_pct), "oom": _jd(m.oom),
                "breakdown_at_peak": tab(m.breakdown_at_peak), "by_unit_at_peak": tab(m.by_unit_at_peak),
                "top_allocations": tab(m.top_allocations.head(20) if m.top_allocations is not None else None),
                "warnings": list(m.warnings or []),
            }
        return {
            "schema": SUMMARY_SCHEMA, "path": self.path, "source": self.source, "overview": _jd(self.overview),
            "missing": dict(self.missing), "warnings": list(self.warnings), "notes": dict(self.notes),
            "memory": mem, "memory_peaks": tab(self.memory_peaks), "theory": _jd(self.theory),
            "model_states": tab(self.model_states), "volume": tab(self.volume),
            "overlap_phase": tab(self.overlap_phase), "overlap_overall": tab(self.overlap_overall),
            "steps": tab(self.steps), "skew": tab(self.skew.head(200) if self.skew is not None else None),
            "stragglers": tab(self.stragglers), "traffic": tab(self.traffic),
            "lanes_step": _j(self.lanes_step), "top_ops": tab(self.top_ops),
            "hta": {k: tab(v) for k, v in self.hta.items()},
            "findings": [f.to_dict() for f in self.findings],
        }


def _j(x):
    """One value made JSON-safe (numpy scalars -> python, NaN/inf -> None)."""
    if x is None:
        return None
    if isinstance(x, (np.integer,)):
        return int(x)
    if isinstance(x, (float, np.floating)):
        x = float(x)
        return x if math.isfinite(x) else None
    if isinstance(x, (bool, np.bool_)):
        return bool(x)
    if isinstance(x, (int, str)):
        return x
    if isinstance(x, pd.Timestamp):
        return x.isoformat()
    return str(x)


def _jd(x):
    if isinstance(x, dict):
        return {str(k): _jd(v) for k, v in x.items()}
    if isinstance(x, (list, tuple)):
        return [_jd(v) for v in x]
    if isinstance(x, pd.DataFrame):
        return _records(x)
    return _j(x)


def _records(df: pd.DataFrame) -> list[dict]:
    cols = [str(c) for c in df.columns]
    out = []
    for row in df.itertuples(index=False, name=None):
        out.append({c: _j(v) if not isinstance(v, (dict, list)) else _jd(v) for c, v in zip(cols, row)})
    return out


def _note(a: Analysis, section: str, text: str) -> None:
    a.notes[section] = (a.notes[section] + " " + text) if section in a.notes else text


def _try(a: Analysis, section: str, what: str, fn, *args, **kwargs):
    """Call fn; on ImportError/AttributeError/any failure leave a note and return None."""
    try:
        return fn(*args, **kwargs)
    except ImportError as exc:
        _note(a, section, f"{what} not available ({exc}).")
    except UserError as exc:
        _note(a, section, f"{what}: {exc}")
    except Exception as exc:  # an analysis failing must not lose the rest of the report
        last = traceback.extract_tb(exc.__traceback__)[-1]
        _note(a, section, f"{what} failed: {type(exc).__name__}: {exc} "
                          f"(at {os.path.basename(last.filename)}:{last.lineno}).")
    return None


def _trace_fn(module: str, name: str):
    import importlib

    return getattr(importlib.import_module(f"fsdpprof.analyze.{module}"), name)


# --- the parts ----------------------------------------------------------------------------

def _overview(run) -> dict:
    meta = run.meta or {}
    ranks = sorted(run.ranks)
    r0 = run.ranks[ranks[0]] if ranks else None
    inv = next((run.ranks[r].inventory for r in ranks if run.ranks[r].inventory), None)
    infos = [run.ranks[r].info or {} for r in ranks]
    hosts = sorted({str(i.get("host")) for i in infos if i.get("host")})
    tm = (r0.trace_meta or {}) if r0 else {}
    device_type = tm.get("device_type") or ((r0.info or {}).get("device", "") or "").split(":")[0] or None if r0 else None
    cmd = meta.get("command")
    return {
        "command": " ".join(map(str, cmd)) if isinstance(cmd, list) else cmd,
        "status": meta.get("status") or ("partial" if run.missing else "complete"),
        "started_at": meta.get("started_at"), "ended_at": meta.get("ended_at"), "exit_code": meta.get("exit_code"),
        "world_size": run.world_size, "ranks_present": ranks, "ranks_missing": sorted(map(str, run.missing)),
        "framework": (inv or {}).get("framework"), "strategy": (inv or {}).get("strategy"),
        "shard_group_size": (inv or {}).get("shard_group_size"),
        "replicate_group_size": (inv or {}).get("replicate_group_size"),
        "mixed_precision": (inv or {}).get("mixed_precision"), "cpu_offload": (inv or {}).get("cpu_offload"),
        "optimizer": ((inv or {}).get("optimizer") or {}).get("class"),
        "psi": ((inv or {}).get("totals") or {}).get("psi"),
        "hosts": hosts, "device_type": device_type,
        "device_name": (r0.info or {}).get("device_name") if r0 else None,
        "backend": (r0.info or {}).get("backend") if r0 else None,
        "steps_recorded": (r0.info or {}).get("steps_recorded") if r0 else None,
        "versions": meta.get("versions"),
        "step_time_us": None,
    }


def _memory(a: Analysis, run) -> None:
    try:
        from fsdpprof.analyze.memory import memory_analysis
    except ImportError as exc:
        _note(a, "memory", f"memory analysis not available ({exc}).")
        return
    rows = []
    snapshot_only = run.source in ("snapshot_file", "snapshot_folder")
    for r in sorted(run.ranks):
        try:
            m = memory_analysis(run.ranks[r])
        except UserError as exc:
            # a snapshot is all there is, and an inventory from another run means mixed-up files:
            # both are bad input (one line, exit 2); otherwise the rest of the report still stands
            if snapshot_only or "inventory.json" in str(exc):
                raise
            _note(a, "memory", f"rank {r}: {exc}")
            continue
        except Exception as exc:
            if snapshot_only:        # nothing else to report: an empty report would hide the failure
                with unexpected_as_user_error(f"memory analysis of {run.ranks[r].snapshot_path or run.path}"):
                    raise
            _note(a, "memory", f"memory analysis of rank {r} failed: {type(exc).__name__}: {exc}.")
            continue
        a.memory[r] = m
        # what was malformed in the input is said once, with the run's warnings (terminal and report)
        a.warnings += [w for w in getattr(m, "input_warnings", []) if w not in a.warnings]
        rows.append({"rank": r, "source": m.source, "peak_allocated_bytes": m.peak_allocated_bytes,
                     "peak_ts_us": m.peak_ts_us, "peak_phase": m.peak_phase,
                     "peak_fsdp_phase": getattr(m, "peak_fsdp_phase", None), "baseline_bytes": m.baseline_bytes,
                     "coverage_pct": m.coverage_pct, "reserved_bytes": m.reserved_bytes,
                     "fragmentation_pct": m.fragmentation_pct})
    if rows:
        a.memory_peaks = pd.DataFrame(rows)
    elif "memory" not in a.notes:
        _note(a, "memory", "no rank has memory data (no [memory] events in the trace and no CUDA snapshot).")


def _unsharded_dtype(inv: dict) -> str:
    mp = inv.get("mixed_precision") or {}
    if mp.get("param_dtype"):
        return str(mp["param_dtype"]).replace("torch.", "")
    units = inv.get("units") or []
    return str(units[0].get("dtype") if units else "float32").replace("torch.", "")


def measured_model_states(inv: dict) -> dict:
    """Bytes per role (param, grad, optimizer_state) this rank holds, from the inventory's tensors;
    a role captured at several steps counts only its last capture. Falls back to ``totals``."""
    t = pd.DataFrame(inv.get("tensors") or [])
    totals = inv.get("totals") or {}
    out = {"param": totals.get("param_bytes"), "grad": totals.get("grad_bytes"),
           "optimizer_state": totals.get("optimizer_state_bytes")}
    if not t.empty and {"role", "bytes"} <= set(t.columns):
        if "step" not in t:
            t["step"] = 0
        t["step"] = pd.to_numeric(t["step"], errors="coerce").fillna(-1)
        last = t.groupby("role")["step"].transform("max")
        s = t[t["step"] == last].groupby("role")["bytes"].sum()
        for role in out:
            if role in s.index:
                out[role] = float(s[role])
    return {k: float(v) for k, v in out.items() if v is not None}


def _theory(a: Analysis, run) -> None:
    """Formulas with the run's numbers, measured model states beside them, peak estimate."""
    invs = {r: d.inventory for r, d in run.ranks.items() if d.inventory}
    if not invs:
        _note(a, "theory", "no inventory.json in this input: Psi and the dtypes are unknown, so the ZeRO "
                           "formulas cannot be filled in (record with `fsdpprof record`).")
        return
    r0 = min(invs)
    inv = invs[r0]
    totals = inv.get("totals") or {}
    psi = float(totals.get("psi") or 0)
    if psi <= 0:
        _note(a, "theory", f"inventory of rank {r0} has no parameter count (totals.psi).")
        return
    strategy_name = str(inv.get("strategy") or "NONE")
    s = theory.strategy_from_inventory(inv)
    world = int(inv.get("world_size") or run.world_size or 1)
    ns = int(inv.get("shard_group_size") or world)
    n_for = ns if s in ("ZERO1", "ZERO2", "ZERO3") else world
    k = theory.k_from_inventory(inv)
    offload = "params" if inv.get("cpu_offload") else "none"
    ms = theory.model_states(psi, k, s, n_for, ns if s == "HYBRID_SHARD" else None, offload)
    mp = inv.get("mixed_precision") or {}
    pdt = _unsharded_dtype(inv)
    rdt = str(mp.get("reduce_dtype") or k.grad_dtype).replace("torch.", "")
    tr = theory.fsdp_traffic(psi, strategy_name if strategy_name in theory.STRATEGY_ALIASES else s, max(n_for, 1),
                             pdt, rdt, ns if s == "HYBRID_SHARD" else None) if n_for > 1 else None
    all_ms = [m.to_dict() for m in theory.all_model_states(psi, k, max(n_for, 1))]
    for d in all_ms:  # the traffic each strategy would move per step, beside its memory
        d["traffic_bytes"] = (theory.fsdp_traffic(psi, d["strategy"], n_for, pdt, rdt).total_bytes
                              if n_for > 1 else 0.0)
    a.theory = {
        "psi": psi, "strategy": strategy_name, "canonical_strategy": s, "N": n_for, "world_size": world,
        "shard_group_size": ns, "k_param": k.k_param, "k_grad": k.k_grad, "k_opt": k.k_opt,
        "k_opt_detail": k.opt_detail, "param_dtype": k.param_dtype, "grad_dtype": k.grad_dtype,
        "unsharded_param_dtype": pdt, "reduce_dtype": rdt, "optimizer": k.optimizer,
        "model_states": ms.to_dict(), "all_strategies": all_ms,
        "traffic": tr.to_dict() if tr else None,
        "step_time_formula": "T_step ~ T_comp + T_comm - T_overlap",
    }
    # measured model states per rank from each inventory
    rows = []
    for r, iv in sorted(invs.items()):
        meas = measured_model_states(iv)
        for role, th in (("param", ms.param_bytes), ("grad", ms.grad_bytes),
                         ("optimizer_state", ms.optimizer_state_bytes)):
            rows.append({"rank": r, "role": role, "measured_bytes": meas.get(role, np.nan), "theory_bytes": th})
    df = pd.DataFrame(rows)
    df["diff_bytes"] = df["measured_bytes"] - df["theory_bytes"]
    df["diff_pct"] = 100.0 * df["diff_bytes"] / df["theory_bytes"].where(df["theory_bytes"] > 0)
    a.model_states = df
    meas_total = df[df["rank"] == r0]["measured_bytes"].sum()
    expl = []
    fw = str(inv.get("framework") or "")
    if s == "ZERO2" and fw.startswith("fsdp"):
        m0 = a.memory.get(r0)
        un = None
        if m0 is not None and m0.breakdown_at_peak is not None and not m0.breakdown_at_peak.empty:
            un = float(m0.breakdown_at_peak.groupby("category", observed=True)["bytes"].sum().get("unsharded_param", 0.0))
        expl.append("FSDP's SHARD_GRAD_OP keeps parameters unsharded only from forward to the end of backward: "
                    "the inventory, taken at the optimizer step, sees the sharded parameters (k_p Psi / N = "
                    f"{theory.fmt_bytes(ms.param_bytes / n_for)}) where ZeRO-2's formula counts k_p Psi = "
                    f"{theory.fmt_bytes(ms.param_bytes)}"
                    + (f"; at the peak the unsharded parameters are there ({theory.fmt_bytes(un)} unsharded_param)."
                       if un is not None else "."))
    elif abs(meas_total - ms.total_bytes) > 0.001 * ms.total_bytes:
        expl.append("shards are padded so every rank holds ceil(numel / N) elements of each parameter; "
                    "scalar optimizer state (Adam's `step`) and non-parameter buffers are outside the formula.")
    a.theory["measured_model_states_bytes"] = float(meas_total)
    a.theory["model_states_diff_bytes"] = float(meas_total - ms.total_bytes)
    a.theory["model_states_explanation"] = " ".join(expl) or "measured and formula agree."
    # FSDP peak estimate beside the measured peak of the same rank
    m = a.memory.get(r0)
    unit_numel = {str(u.get("fqn")): float(u.get("unsharded_numel") or 0) for u in inv.get("units") or []}
    act = 0.0
    if m is not None and m.breakdown_at_peak is not None and not m.breakdown_at_peak.empty:
        bd = m.breakdown_at_peak.groupby("category", observed=True)["bytes"].sum()
        act = float(bd.get("activation", 0.0))
    k_un = theory.dtype_bytes(pdt)
    if s == "DDP":
        unit_numel = {}
    est = theory.fsdp_peak_estimate(ms.device_bytes, unit_numel, k_un, act)
    pe = est.to_dict()
    pe["measured_peak_bytes"] = float(m.peak_allocated_bytes) if m is not None else None
    pe["measured_rank"] = r0
    if m is not None:
        pe["diff_bytes"] = float(m.peak_allocated_bytes) - est.estimate_bytes
        left = []
        if m.breakdown_at_peak is not None and not m.breakdown_at_peak.empty:
            bd = m.breakdown_at_peak.groupby("category", observed=True)["bytes"].sum()
            for cat in ("unsharded_grad", "temporary", "input", "other"):
                if float(bd.get(cat, 0)) > 0:
                    left.append(f"{cat} {bd.get(cat) / theory.MIB:.3g} MiB")
            if float(bd.get("unsharded_param", 0)) > est.max_unit_unsharded_bytes * 1.05:
                left.append(f"unsharded params of more than one unit ({bd.get('unsharded_param') / theory.MIB:.3g} MiB: "
                            f"prefetch or no reshard after forward keeps several units gathered)")
        pe["explanation"] = ("the formula leaves out " + ", ".join(left) + ".") if left else \
            "the formula counts model states, one unit's gathered parameters and the activations at the peak."
    a.theory["peak_estimate"] = pe


def _comm(a: Analysis, run, events: pd.DataFrame | None) -> None:
    if events is None or events.empty:
        _note(a, "communication", "no trace events in this input.")
        _note(a, "steps", "no trace events in this input.")
        return
    vol = _try(a, "communication", "collective volume", lambda: _trace_fn("volume", "collective_volume")(events))
    a.volume = vol
    staged = _try(a, "communication", "forward/backward stages", with_stage, events)
    if staged is not None:
        a.overlap_phase = _try(a, "communication", "overlap per collective and phase", _per_phase, staged)
    a.overlap_overall = _try(a, "communication", "overall overlap", lambda: _trace_fn("overlap", "overall_overlap")(events))
    a.steps = _try(a, "steps", "step breakdown", lambda: _trace_fn("steps", "step_breakdown")(events))
    if run.world_size and len(run.ranks) > 1:
        a.skew = _try(a, "ranks", "collective skew", lambda: _trace_fn("ranks", "collective_skew")(events))
        if a.skew is not None:
            a.stragglers = _try(a, "ranks", "stragglers", lambda: _trace_fn("ranks", "stragglers")(a.skew))
    else:
        _note(a, "ranks", f"only rank {', '.join(map(str, sorted(run.ranks)))} of "
                          f"{run.world_size or '?'} in this input: skew and stragglers need several ranks.")
    if a.steps is not None and not a.steps.empty and {"compute_us", "comm_us", "overlapped_comm_us"} <= set(a.steps):
        st = a.steps.copy()  # T_step ~ T_comp + T_comm - T_overlap, beside the measured step time
        st["model_step_us"] = st["compute_us"] + st["comm_us"] - st["overlapped_comm_us"]
        st["unexplained_us"] = st["step_us"] - st["model_step_us"]
        a.steps = st
    if a.steps is not None and not a.steps.empty and "step_us" in a.steps:
        a.overview["step_time_us"] = float(a.steps["step_us"].median())
        a.overview["steps_analysed"] = int(a.steps["step"].nunique()) if "step" in a.steps else None
    a.traffic = _try(a, "communication", "measured traffic", _traffic, a, events)
    lanes = _try(a, "communication", "lanes of one step", _lanes, events)
    if lanes is not None:
        a.lanes, a.lanes_step, a.top_ops = lanes


def _per_phase(staged: pd.DataFrame) -> pd.DataFrame:
    """Per rank, collective, stage and FSDP phase: count, bytes, time_us, busbw_gbps (volume) beside
    comm_us, overlapped_comm_us, exposed_comm_us, overlap_pct (overlap)."""
    keys = ["rank", "collective", "stage", "phase"]
    ov = _trace_fn("overlap", "comm_overlap")(staged, by=keys)
    vol = _trace_fn("volume", "collective_volume")(staged, by=keys)
    for df in (ov, vol):
        for k in keys[1:]:
            df[k] = df[k].astype(object)
    vol = vol[keys + [c for c in ("count", "bytes", "time_us", "busbw_gbps") if c in vol]]
    return vol.merge(ov, on=keys, how="outer")


BACKWARD_PHASES = ("backward", "pre_backward", "post_backward", "post_backward_reduce", "post_backward_reshard",
                   "post_backward_accumulate", "post_backward_rs_wait", "backward_prefetch",
                   "root_post_backward_callback")


def with_stage(events: pd.DataFrame) -> pd.DataFrame:
    """Events plus ``stage`` (forward | backward | optimizer): per rank and step, events from the
    first backward-phase event on are backward, from the first optimizer event after that on optimizer."""
    ph = events["phase"].astype(object)
    key = [events["rank"], events["step"]]
    ts = events["ts_us"]
    bwd = ts.where(ph.isin(BACKWARD_PHASES)).groupby(key, dropna=False).transform("min")
    # the optimizer step after backward (zero_grad at the start of a step is also 'optimizer')
    opt = ts.where((ph == "optimizer") & (ts > bwd.fillna(np.inf))).groupby(key, dropna=False).transform("min")
    stage = np.where(ts >= opt.fillna(np.inf), "optimizer", np.where(ts >= bwd.fillna(np.inf), "backward", "forward"))
    stage = np.where(events["step"].isna(), None, stage)
    return events.assign(stage=pd.Categorical(stage, categories=["forward", "backward", "optimizer"]))


def _traffic(a: Analysis, events: pd.DataFrame) -> pd.DataFrame | None:
    """Per rank: bytes on the wire per step (ring factors) beside the theory, per collective."""
    c = events[(events["kind"] == "comm") & events["collective"].notna()]
    if c.empty:
        _note(a, "communication", "no collectives in the trace.")
        return None
    gs = c["group_size"].astype(float).fillna(float(a.theory.get("N") or a.overview.get("world_size") or np.nan))
    coll = c["collective"].astype(str)
    f = np.where(coll == "all_reduce", 2 * (gs - 1) / gs,
                 np.where(coll.isin(["all_gather", "reduce_scatter", "all_to_all"]), (gs - 1) / gs,
                          np.where(coll.isin(["broadcast", "send_recv"]), 1.0, 0.0)))
    d = pd.DataFrame({"rank": c["rank"].to_numpy(), "collective": coll.to_numpy(),
                      "bytes": c["bytes"].astype(float).to_numpy(), "wire_bytes": c["bytes"].astype(float).to_numpy() * f,
                      "step": c["step"].to_numpy()})
    n_steps = d.groupby("rank")["step"].nunique().clip(lower=1)
    if d["bytes"].isna().all():
        _note(a, "communication", "the trace gives no message sizes, so the volume cannot be measured.")
        return None
    g = d.groupby(["rank", "collective"]).agg(count=("bytes", "size"), payload_bytes=("bytes", lambda x: x.sum(min_count=1)),
                                              wire_bytes=("wire_bytes", lambda x: x.sum(min_count=1))).reset_index()
    ns = g["rank"].map(n_steps)
    g["steps"] = ns
    g["payload_per_step_bytes"] = g["payload_bytes"] / ns
    g["wire_per_step_bytes"] = g["wire_bytes"] / ns
    tr = a.theory.get("traffic")
    if tr:
        th = {"all_gather": tr["all_gather_bytes"], "reduce_scatter": tr["reduce_scatter_bytes"],
              "all_reduce": tr["all_reduce_bytes"]}
        g["theory_wire_per_step_bytes"] = g["collective"].map(th).astype(float)
        g["diff_pct"] = 100.0 * (g["wire_per_step_bytes"] - g["theory_wire_per_step_bytes"]) / \
            g["theory_wire_per_step_bytes"].where(g["theory_wire_per_step_bytes"] > 0)
    return g


def _lanes(events: pd.DataFrame):
    """Compute and communication events of one full step of the lowest rank (times relative to step start)."""
    e = events[events["step"].notna()]
    if e.empty:
        return None
    r = int(e["rank"].min())
    e = e[e["rank"] == r]
    steps = sorted(e["step"].unique())
    step = steps[1] if len(steps) > 2 else steps[0]  # avoid the first (warm-up effects) when possible
    e = e[e["step"] == step]
    kinds = ["compute", "comm", "memcpy", "memset", "sync"]
    sel = e[e["kind"].isin(kinds)]
    if sel[sel["kind"] == "compute"].empty:  # CPU traces: ops are cpu_op
        sel = e[e["kind"].isin(kinds + ["cpu_op"])]
    if len(sel) > LANE_EVENTS_MAX:
        sel = sel.nlargest(LANE_EVENTS_MAX, "dur_us")
    if sel.empty:
        return None
    t0 = float(e["ts_us"].min())
    ops = e[e["kind"] != "annotation"]
    top = (ops.groupby(["name", "kind"], observed=True)["dur_us"].agg(count="size", total_us="sum", max_us="max")
           .reset_index().sort_values("total_us", ascending=False).head(25).reset_index(drop=True))
    top["name"] = top["name"].astype(str)
    top["kind"] = top["kind"].astype(str)
    out = pd.DataFrame({"lane": sel["lane"].astype(str).to_numpy(), "kind": sel["kind"].astype(str).to_numpy(),
                        "name": sel["name"].astype(str).to_numpy(), "start_us": sel["ts_us"].to_numpy() - t0,
                        "dur_us": sel["dur_us"].to_numpy(),
                        "collective": sel["collective"].astype(object).to_numpy(),
                        "phase": sel["phase"].astype(object).to_numpy()})
    return out.sort_values(["lane", "start_us"]).reset_index(drop=True), float(step), top


def hta_breakdowns(run) -> dict:
    """HTA's kernel, temporal and idle-time breakdowns (GPU traces only): name -> DataFrame."""
    import contextlib
    import io
    import logging

    from hta.trace_analysis import TraceAnalysis  # noqa: PLC0415  (heavy import, only for GPU traces)

    for name in list(logging.root.manager.loggerDict):
        if name.startswith("hta"):
            logging.getLogger(name).setLevel(logging.ERROR)
    sink = io.StringIO()
    with tempfile.TemporaryDirectory(prefix="fsdpprof-hta-") as tmp, contextlib.redirect_stdout(sink), \
            contextlib.redirect_stderr(sink):
        for r, d in sorted(run.ranks.items()):
            if d.trace_path:
                name = os.path.basename(d.trace_path)
                ext = ".json.gz" if name.endswith(".gz") else ".json"
                os.symlink(os.path.abspath(d.trace_path), os.path.join(tmp, f"rank-{r}{ext}"))
        ta = TraceAnalysis(trace_dir=tmp)
        out = {}
        kt, kb = ta.get_gpu_kernel_breakdown(visualize=False)
        out["kernel_type"] = kt
        out["kernels"] = kb.head(50) if kb is not None else None
        out["temporal"] = ta.get_temporal_breakdown(visualize=False)
        idle = ta.get_idle_time_breakdown(visualize=False)
        out["idle"] = idle[0] if isinstance(idle, tuple) else idle
    return {k: v for k, v in out.items() if isinstance(v, pd.DataFrame)}


def analyze_run(run, *, hta: bool = True) -> Analysis:
    """All numbers of one Run (see fsdpprof.analyze.run.load_run)."""
    a = Analysis(path=str(run.path), source=str(run.source), overview=_overview(run), missing=dict(run.missing),
                 warnings=list(run.warnings))
    events = _try(a, "communication", "events", run.events) if any(d.events is not None for d in run.ranks.values()) else None
    _memory(a, run)
    _try(a, "theory", "theory", _theory, a, run)
    _comm(a, run, events)
    if a.overview.get("device_type") == "cuda" and hta and any(d.trace_path for d in run.ranks.values()):
        res = _try(a, "hta", "HTA breakdowns", hta_breakdowns, run)
        if res:
            a.hta = res
    elif hta and not any(d.trace_path for d in run.ranks.values()):
        _note(a, "hta", "no profiler trace in this input, so HTA's breakdowns are left out.")
    elif hta:
        _note(a, "hta", "HTA's kernel, temporal and idle-time breakdowns need GPU kernels: this is a "
                        f"{a.overview.get('device_type') or 'non-GPU'} trace, so they are left out.")
    # findings
    items = []
    items += fnd.comm_findings(a.overlap_phase, a.steps)
    strat = a.overview.get("strategy")
    for r, m in sorted(a.memory.items()):
        alts = {x["label"]: x["total_bytes"] for x in (a.theory or {}).get("all_strategies") or []}
        items += fnd.memory_findings(m.breakdown_at_peak, strat, m.peak_allocated_bytes, m.fragmentation_pct,
                                     m.coverage_pct, r, alts)
        break  # one rank is representative; ranks differ little in FSDP
    items += fnd.topology_findings(strat, len(a.overview.get("hosts") or []), int(a.overview.get("world_size") or 1))
    if a.stragglers is not None and a.skew is not None:
        items += fnd.rank_findings(a.stragglers, len(a.skew), a.overview.get("step_time_us"))
    a.findings = fnd.sort_findings(items)
    return a


# --- several runs -------------------------------------------------------------------------

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

    def to_summary(self) -> dict:
        return {"schema": "fsdpprof.compare/1", "paths": self.paths, "labels": self.labels,
                "table": _records(self.table), "categories": _records(self.categories),
                "time": _records(self.time), "verdict": self.verdict, "warnings": self.warnings,
                "comparable": self.comparable}


def _run_numbers(a: Analysis) -> dict:
    """Per-run numbers for comparison (first rank for memory; medians over ranks for time)."""
    o, t = a.overview, a.theory or {}
    d = {"strategy": o.get("strategy") or "-", "framework": o.get("framework") or "-",
         "world_size": o.get("world_size"), "psi": o.get("psi")}
    m = a.memory.get(min(a.memory)) if a.memory else None
    d["peak_allocated_bytes"] = float(m.peak_allocated_bytes) if m is not None else np.nan
    cats = {}
    if m is not None and m.breakdown_at_peak is not None and not m.breakdown_at_peak.empty:
        cats = m.breakdown_at_peak.groupby("category", observed=True)["bytes"].sum().to_dict()
    from fsdpprof.analyze.schema import MemoryCategory
    for c in MemoryCategory:
        d[f"peak_{c.value}_bytes"] = float(cats.get(c.value, 0.0)) if m is not None else np.nan
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


def compare_analyses(analyses: list[Analysis], *, allow_different_models: bool = False) -> Comparison:
    """Put runs side by side; raises UserError for fewer than two runs or runs of different models
    (unless allow_different_models, which turns that into a warning)."""
    if len(analyses) < 2:
        raise UserError("compare needs at least two runs, e.g. `fsdpprof compare RUN_A RUN_B`")
    nums = [_run_numbers(a) for a in analyses]
    warnings = []
    psis = {n["psi"] for n in nums}
    comparable = len(psis) == 1 and None not in psis
    if not comparable:
        desc = ", ".join(f"{a.path}: Psi={n['psi']}" for a, n in zip(analyses, nums))
        msg = f"runs are of different (or unknown) models, so not comparable ({desc})"
        if not allow_different_models:
            raise UserError(msg + "; pass --force to compare anyway")
        warnings.append("Not comparable: " + msg + ".")
    labels, seen = [], {}
    for n in nums:
        base = f"{n['strategy']} ({n['framework']}, N={n['world_size']})"
        seen[base] = seen.get(base, 0) + 1
        labels.append(base if seen[base] == 1 else f"{base} #{seen[base]}")
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
    return Comparison([a.path for a in analyses], labels, t, cats, tm, verdict, warnings, comparable)
