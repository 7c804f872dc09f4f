"""Terminal summary of an Analysis or a Comparison (rendering only; words and units as in the HTML)."""
from __future__ import annotations

from fsdpprof.analyze.summary.headline import headline
from fsdpprof.report.page import (HOST_TIME, column_unit, fmt_bytes, fmt_fixed, fmt_num, fmt_params, fmt_pct, fmt_us,
                                  metric_label)


def _plain(text: str) -> str:
    """Our own words in ASCII for any terminal (the HTML says Ψ and µs)."""
    return text.replace("Ψ", "Psi").replace("µs", "us")


def summary_text(a) -> str:
    o = a.overview
    h = headline(a)
    lines = [f"fsdpprof report: {a.path} ({a.source})",
             f"  {o.get('description') or '-'}; ranks analysed {len(o.get('ranks_present') or [])}, Psi {fmt_params(o.get('psi')) if o.get('psi') else '-'}, "
             f"median step {fmt_us(o.get('step_time_us'))}"]
    lines += [f"  warning: {w}" for w in a.warnings or []]
    if a.missing:
        lines.append("  PARTIAL: missing " + "; ".join(f"{k}: {v}" for k, v in sorted(a.missing.items())))
    if a.memory_peaks is not None and not a.memory_peaks.empty:
        mp = a.memory_peaks
        r = mp.loc[mp["peak_allocated_bytes"].idxmax()]
        lines.append(f"  memory: peak {fmt_bytes(r['peak_allocated_bytes'])} on rank {int(r['rank'])} "
                     f"(stage {r['peak_stage']}, {float(r['coverage_pct']):.0f}% attributed, source {r['source']})")
    t = a.theory or {}
    if t.get("model_states"):
        share = h["model_states_theory_pct_of_peak"]
        lines.append(f"  model states per rank: measured {fmt_bytes(t.get('measured_model_states_bytes'))}, "
                     f"theory {fmt_bytes(t['model_states']['total_bytes'])} ({t['model_states']['formula']})"
                     + (f", {fmt_pct(share)} of the peak" if share == share else ""))
    if h["step_us"] == h["step_us"]:
        idle = HOST_TIME if h["idle_is_host"] else "device idle"
        lines.append(f"  communication: exposed {fmt_us(h['exposed_comm_us'])} per step "
                     f"({fmt_pct(h['exposed_comm_pct'])} of the step)")
        lines.append(f"  step split: compute {fmt_pct(h['compute_pct'])}, exposed communication "
                     f"{fmt_pct(h['exposed_comm_pct'])}, {idle} {fmt_pct(h['idle_pct'])}")
    for f in a.findings[:5]:
        lines.append(f"  finding [{f.severity}]: {f.title} -> {f.suggestion}")
    for sec, n in sorted(a.notes.items()):
        lines.append(f"  note ({sec}): {n}")
    return _plain("\n".join(lines))


def _cell(metric: str, v) -> str:
    unit = column_unit(metric)
    if unit == "bytes":
        return fmt_bytes(v)
    if unit == "time":
        return fmt_us(v)
    if metric == "psi":
        return fmt_params(v)
    return fmt_num(v) if isinstance(v, float) else str(v)


def _x(v) -> str:
    return "-" if v != v else f"{v:.2f}x"


def compare_text(c) -> str:
    host = c.promise is None or c.promise.empty or all((d or "cpu") == "cpu" for d in c.promise["device_type"])
    lines = [f"fsdpprof compare: {len(c.paths)} runs"]
    lines += [f"  warning: {w}" for w in c.warnings]
    names = [metric_label(m, host=host) for m in c.table["metric"]]
    width = max(len(n) for n in names)
    lines.append("  " + " " * width + "  " + "  ".join(str(r)[:26].rjust(26) for r in c.table.columns[1:]))
    for name, row in zip(names, c.table.itertuples(index=False, name=None)):
        lines.append(f"  {name.ljust(width)}  " + "  ".join(_cell(row[0], v).rjust(26) for v in row[1:]))
    p = c.promise
    if p is not None and not p.empty and p["model_states_theory_bytes"].notna().any():
        lines.append("  ZeRO promised / measured, per rank (x: ratio to the baseline; traffic: to DDP's formula):")
        for _, r in p.iterrows():
            lines.append(f"    {str(r['run'])[:30]:30}  model states {fmt_fixed(r['model_states_theory_bytes'] / 2**20)}"
                         f" / {fmt_fixed(r['model_states_measured_bytes'] / 2**20)} MiB"
                         f" ({_x(r['model_states_theory_ratio'])} / {_x(r['model_states_measured_ratio'])})"
                         f"  peak {fmt_fixed(r['peak_allocated_bytes'] / 2**20)} MiB ({_x(r['peak_ratio'])})"
                         f"  traffic {_x(r['traffic_theory_vs_ddp'])} / {_x(r['traffic_measured_vs_ddp'])}"
                         f"  exposed {fmt_us(r['exposed_comm_us'])} ({fmt_pct(r['exposed_comm_pct'])} of the step)"
                         + ("  <- baseline" if r["baseline"] else ""))
    lines.append("  verdict: " + (c.verdict_lines[0] if c.verdict_lines else c.verdict))
    lines += [f"    {x}" for x in (c.verdict_lines or [])[1:]]
    return _plain("\n".join(lines))
