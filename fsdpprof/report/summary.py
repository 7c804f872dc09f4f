"""summary.json and compare.json: every number of an Analysis / Comparison as plain JSON values (NaN and
infinities as null); their keys are a contract for scripts and CI."""
from __future__ import annotations

from typing import TYPE_CHECKING

from fsdpprof.analyze.load.frames import json_safe
from fsdpprof.analyze.summary.headline import headline

if TYPE_CHECKING:      # (the report's modules stay light: plan and --help import some)
    from fsdpprof.analyze.pipeline import Analysis

SUMMARY_SCHEMA = "fsdpprof.summary/2"   # /2: stage + fsdp_phase (was phase), comm tables per unit and step
COMPARE_SCHEMA = "fsdpprof.compare/1"
SKEW_ROWS_MAX = 200


def memory_summary(m) -> dict:
    """One rank's MemoryResult (``oom``: the failed request and fsdpprof.analyze.memory.oom.explain_oom's words)."""
    frag = getattr(m, "fragmentation", None)
    return {
        "source": m.source, "peak_allocated_bytes": m.peak_allocated_bytes, "peak_ts_us": m.peak_ts_us,
        "peak_stage": m.peak_stage, "peak_fsdp_phase": m.peak_fsdp_phase, "baseline_bytes": m.baseline_bytes,
        "coverage_pct": m.coverage_pct, "reserved_bytes": m.reserved_bytes, "fragmentation_pct": m.fragmentation_pct,
        "oom": m.oom, "breakdown_at_peak": m.breakdown_at_peak, "by_unit_at_peak": m.by_unit_at_peak,
        "top_allocations": m.top_allocations.head(20) if m.top_allocations is not None else None,
        "warnings": list(m.warnings or []),
        # snapshots: the device analysed, why, the peak of each device; FSDP seen in the frames; the allocator's cache
        "device": getattr(m, "device", None), "device_choice": getattr(m, "device_choice", None),
        "device_peaks": {str(d): b for d, b in (getattr(m, "device_peaks", None) or {}).items()},
        "fsdp_family": getattr(m, "fsdp_family", None), "fsdp_units": list(getattr(m, "fsdp_units", None) or []),
        "world_size": getattr(m, "world_size", None), "world_size_source": getattr(m, "world_size_source", None),
        "by_role_at_peak": getattr(m, "by_role_at_peak", None),
        "activation_by_unit": getattr(m, "activation_by_unit", None),
        "before_recording_sizes": _head(getattr(m, "before_recording_sizes", None), 50),
        "rounding_end_bytes": getattr(m, "rounding_end_bytes", None),
        "reserved_end_bytes": getattr(m, "reserved_end_bytes", None),
        "fragmentation": frag.to_list() if frag is not None else None,
        "fragmentation_notes": list(frag.notes) if frag is not None else [],
        "process": getattr(m, "process", None),
    }


def _head(df, n: int):
    return df.head(n) if df is not None else None


def summary(a: Analysis, plain: bool = True) -> dict:
    """The content of summary.json for one Analysis: plain JSON values, or with ``plain=False`` its tables still as
    DataFrames (for outputs.json_bytes, one key at a time)."""
    return (json_safe if plain else dict)({
        "schema": SUMMARY_SCHEMA, "path": a.path, "source": a.source, "overview": a.overview,
        "missing": dict(a.missing), "warnings": list(a.warnings), "notes": dict(a.notes),
        "memory": {str(r): memory_summary(m) for r, m in sorted(a.memory.items())},
        "memory_peaks": a.memory_peaks, "theory": a.theory, "model_states": a.model_states,
        "volume": a.volume, "comm_phase": a.comm_phase, "comm_unit_step": a.comm_unit_step, "p2p": a.p2p,
        "comm_outside_steps": a.comm_outside_steps, "overlap_overall": a.overlap_overall, "steps": a.steps,
        "step_stalls": getattr(a, "step_stalls", None), "exposed_stage": a.exposed_stage,
        "exposed_unit": a.exposed_unit, "idle_causes": a.idle_causes,
        "skew": a.skew.head(SKEW_ROWS_MAX) if a.skew is not None else None, "stragglers": a.stragglers,
        "matching": a.matching,
        "critical_path": a.critical_path.to_dict() if a.critical_path is not None else None,
        "traffic": a.traffic, "lanes_step": a.lanes_step, "top_ops": a.top_ops,
        "temporal": a.temporal, "kernel_types": a.kernel_types, "top_kernels": a.top_kernels, "idle": a.idle,
        "hta": a.hta,
        "findings": [f.to_dict() for f in a.findings],
        "headline": headline(a), "whatif": getattr(a, "whatif", None),
        "rank_distributions": getattr(a, "rank_distributions", None) or {},
    })


def diff_summary(d) -> dict | None:
    """A Comparison's diff (fsdpprof.analyze.compare.diff.Diff): each run against the baseline, in one scope."""
    if d is None:
        return None
    return {"baseline": d.baseline, "scope": d.scope, "comm": d.comm, "steps": d.steps, "ops": d.ops,
            "memory": d.memory, "memory_roles": d.memory_roles, "memory_units": d.memory_units,
            "critical_path": getattr(d, "critical", None), "notes": list(d.notes)}


def compare_summary(c) -> dict:
    """The content of compare.json for one Comparison."""
    return json_safe({"schema": COMPARE_SCHEMA, "paths": c.paths, "labels": c.labels, "table": c.table,
                      "categories": c.categories, "time": c.time, "verdict": c.verdict, "warnings": c.warnings,
                      "comparable": c.comparable, "models_known": getattr(c, "models_known", None),
                      "notes": list(getattr(c, "notes", []) or []), "diff": diff_summary(getattr(c, "diff", None)),
                      "verdict_lines": c.verdict_lines, "promise": c.promise, "formula_categories": c.formula,
                      "spread": c.spread, "roles": c.roles, "noise": list(c.noise or [])})
