"""Terminal summary of an Analysis or a Comparison (rendering only)."""
from __future__ import annotations

from fsdpprof.report.html import fmt_bytes, fmt_num, fmt_us


def summary_text(a) -> str:
    o = a.overview
    lines = [f"fsdpprof report: {a.path} ({a.source})",
             f"  strategy {o.get('strategy') or '-'} ({o.get('framework') or '-'}), world size {o.get('world_size') or '?'}, "
             f"ranks analysed {len(o.get('ranks_present') or [])}, Psi {fmt_num(o.get('psi')) if o.get('psi') else '-'}, "
             f"median step {fmt_us(o.get('step_time_us'))}"]
    if a.missing:
        lines.append("  PARTIAL: missing " + "; ".join(f"{k}: {v}" for k, v in sorted(a.missing.items())))
    lines += [f"  warning: {w}" for w in a.warnings]
    if a.memory_peaks is not None and not a.memory_peaks.empty:
        mp = a.memory_peaks
        r = mp.loc[mp["peak_allocated_bytes"].idxmax()]
        lines.append(f"  memory: peak {fmt_bytes(r['peak_allocated_bytes'])} on rank {int(r['rank'])} "
                     f"(phase {r['peak_phase']}, {float(r['coverage_pct']):.0f}% attributed, source {r['source']})")
    t = a.theory or {}
    if t.get("model_states"):
        lines.append(f"  model states per rank: measured {fmt_bytes(t.get('measured_model_states_bytes'))}, "
                     f"theory {fmt_bytes(t['model_states']['total_bytes'])} ({t['model_states']['formula']})")
    if a.steps is not None and not a.steps.empty and "exposed_comm_us" in a.steps:
        per = a.steps.groupby("rank")[["exposed_comm_us", "step_us"]].mean().median()
        lines.append(f"  communication: exposed {fmt_us(per['exposed_comm_us'])} per step "
                     f"({100 * per['exposed_comm_us'] / per['step_us']:.1f}% of the step)")
    for f in a.findings[:5]:
        lines.append(f"  finding [{f.severity}]: {f.title} -> {f.suggestion}")
    for sec, n in sorted(a.notes.items()):
        lines.append(f"  note ({sec}): {n}")
    return "\n".join(lines)


def compare_text(c) -> str:
    lines = [f"fsdpprof compare: {len(c.paths)} runs"]
    lines += [f"  warning: {w}" for w in c.warnings]
    width = max(len(m) for m in c.table["metric"])
    for row in c.table.itertuples(index=False, name=None):
        m = row[0]
        vals = [fmt_bytes(v) if m.endswith("_bytes") else fmt_us(v) if m.endswith("_us") else
                (fmt_num(v) if isinstance(v, float) else str(v)) for v in row[1:]]
        lines.append(f"  {m.ljust(width)}  " + "  ".join(v.rjust(22) for v in vals))
    lines.append("  verdict: " + c.verdict)
    return "\n".join(lines)
