"""Terminal summary of an Analysis or a Comparison (rendering only; words and units as in the HTML)."""
from __future__ import annotations

from typing import TYPE_CHECKING

from fsdpprof.analyze.summary.headline import headline, step_spread
from fsdpprof.analyze.memory.fsdp_units import world_size_inferred
from fsdpprof.report.glance import oom_line
from fsdpprof.report.memory import devices_analysed, memory_owner, other_devices_said
from fsdpprof.report.compare_page import SPREAD_ROWS, compare_host, shown_rows
from fsdpprof.report.overview import SOURCE_TEXT
from fsdpprof.report.page import (HOST_TIME, MISSING, column_unit, finding_title, fmt_bytes, fmt_fixed, fmt_num, fmt_params,
                                  fmt_pct, fmt_us, fmt_us_spread, is_missing, metric_label, value_label)
from fsdpprof.report.promise import spread_of

if TYPE_CHECKING:      # (the report's modules stay light: plan and --help import some)
    from fsdpprof.analyze.pipeline import Analysis


def _plain(text: str) -> str:
    """Our own words in ASCII for any terminal (the HTML says Ψ, µs, × and –)."""
    return text.replace("Ψ", "Psi").replace("µs", "us").replace("–", "-").replace("×", "x")


def _psi(o: dict) -> str:
    return f"Psi {fmt_params(o['psi'])}" if o.get("psi") else "Psi unknown (no inventory)"


def _short_scope(sp: dict) -> str:
    """What a step time is over, briefly (page.step_scope says it in full)."""
    n = sp.get("ranks") or 0
    return (f" (median over {n} ranks of each rank's mean; min-max over ranks and steps in brackets)" if n > 1
            else " (mean over the steps; min-max in brackets)" if (sp.get("steps") or 0) > 1 else "")


def summary_text(a: Analysis) -> str:
    o = a.overview
    h = headline(a)
    oom = oom_line(a, h.get("oom"))
    world = o.get("world_size") or MISSING
    step = step_spread(a.steps, "step_us")
    lines = [f"fsdpprof report: {a.path} ({SOURCE_TEXT.get(a.source, a.source)})"] + ([f"  {oom}"] if oom else []) + [
             f"  {o.get('description') or 'unknown input'}"
             + (f", world size {world} (inferred from {o['world_size_source']})" if world_size_inferred(o) else "")
             + "; " + (f"analysed {devices_analysed(a)}, " if devices_analysed(a) else
                       f"ranks analysed {len(o.get('ranks_present') or [])}, ")
             + _psi(o) + (f", step {fmt_us_spread(h['step_us'], step['min'], step['max'])}" + _short_scope(step)
                          if h["step_us"] == h["step_us"] else "")]
    lines += [f"  warning: {w}" for w in a.warnings or []]
    if a.missing:
        lines.append("  PARTIAL: missing " + "; ".join(f"{k}: {v}" for k, v in sorted(a.missing.items())))
    if a.memory_peaks is not None and not a.memory_peaks.empty:
        r = h["peak_rank"]
        m = a.memory[r]
        said = other_devices_said(m)
        where = ", ".join(x for x in ((f"in {value_label('stage', m.peak_stage)}" if not is_missing(m.peak_stage)
                                       else ""), f"{fmt_pct(m.coverage_pct)} attributed",
                                      f"from the {value_label('source', m.source)}") if x)
        lines.append(f"  memory: peak {fmt_bytes(m.peak_allocated_bytes)} on {memory_owner(a, r)} ({where})"
                     + (f"; {said}" if said else ""))
    t = a.theory or {}
    if t.get("model_states"):
        share = h["model_states_theory_pct_of_peak"]
        lines.append(f"  model states per rank: measured {fmt_bytes(t.get('measured_model_states_bytes'), missing=MISSING)}, "
                     f"theory {fmt_bytes(t['model_states']['total_bytes'])} ({t['model_states']['formula']})"
                     + (f", {fmt_pct(share)} of the peak" if share == share else ""))
    if h["step_us"] == h["step_us"]:
        idle = HOST_TIME if h["idle_is_host"] else "device idle"
        exp = step_spread(a.steps, "exposed_comm_us")
        lines.append(f"  communication: exposed {fmt_us_spread(h['exposed_comm_us'], exp['min'], exp['max'])} per step "
                     f"({fmt_pct(h['exposed_comm_pct'])} of the step)")
        lines.append(f"  step split: compute {fmt_pct(h['compute_pct'])}, exposed communication "
                     f"{fmt_pct(h['exposed_comm_pct'])}, {idle} {fmt_pct(h['idle_pct'])}")
    for f in a.findings[:5]:
        lines.append(f"  finding [{f.severity}]: {finding_title(f.title)} -> {f.suggestion}")
    for sec, n in sorted(a.notes.items()):
        lines.append(f"  note ({sec}): {n}")
    return _plain("\n".join(lines))


def _cell(metric: str, v) -> str:
    if v is None or is_missing(v):
        return MISSING
    unit = column_unit(metric)
    if unit == "bytes":
        return fmt_bytes(v)
    if unit == "time":
        return fmt_us(v)
    if metric == "psi":
        return fmt_params(v)
    if metric == "framework":
        return str(v).upper()
    return fmt_num(v) if isinstance(v, float) else str(v)


def _x(v) -> str:
    return MISSING if is_missing(v) else f"{v:.2f}x"


def _spread_cell(c, run: str, metric: str, v) -> str:
    """A compare table's step time, exposed communication or CPU contention with its min-max: 566 ms (474-630)."""
    lo, hi = spread_of(c, run, metric)
    if metric == "cpu_contention":
        return MISSING if is_missing(v) else f"x{v:.2f}" + ("" if lo != lo else f" ({lo:.2f}-{hi:.2f})")
    return fmt_us_spread(v, lo, hi)


def compare_text(c) -> str:
    host = compare_host(c)
    lines = [f"fsdpprof compare: {len(c.paths)} runs (memory: the rank whose peak is highest; times per step: each "
             f"rank's mean, the median over ranks, min-max over ranks and steps in brackets)"]
    lines += [f"  warning: {w}" for w in c.warnings]
    runs = list(c.table.columns[1:])
    rows = shown_rows(c)
    names = [metric_label(metric, host=host) for metric, _ in rows]
    width = max(len(n) for n in names)
    cells = [[_spread_cell(c, r, metric, v) if metric in SPREAD_ROWS else _cell(metric, v)
              for r, v in zip(runs, vals)] for metric, vals in rows]
    widths = [max([len(str(r))] + [len(cs[i]) for cs in cells]) for i, r in enumerate(runs)]
    lines.append("  " + " " * width + "  " + "  ".join(str(r).rjust(w) for r, w in zip(runs, widths)))
    for name, cs in zip(names, cells):
        lines.append(f"  {name.ljust(width)}  " + "  ".join(x.rjust(w) for x, w in zip(cs, widths)))
    p = c.promise
    if p is not None and not p.empty and p["model_states_theory_bytes"].notna().any():
        lines.append("  ZeRO promised / measured, per rank (x: ratio to the baseline; traffic: to DDP's formula):")
        name_w = max(len(str(x)) for x in p["run"])
        for _, r in p.iterrows():
            lines.append(f"    {str(r['run']):{name_w}}  model states {fmt_fixed(r['model_states_theory_bytes'] / 2**20)}"
                         f" / {fmt_fixed(r['model_states_measured_bytes'] / 2**20)} MiB"
                         f" ({_x(r['model_states_theory_ratio'])} / {_x(r['model_states_measured_ratio'])})"
                         f"  peak {fmt_fixed(r['peak_allocated_bytes'] / 2**20)} MiB ({_x(r['peak_ratio'])})"
                         f"  traffic {_x(r['traffic_theory_vs_ddp'])} / {_x(r['traffic_measured_vs_ddp'])}"
                         f"  exposed {fmt_us(r['exposed_comm_us'])} ({fmt_pct(r['exposed_comm_pct'])} of the step)"
                         + ("  <- baseline" if r["baseline"] else ""))
    lines.append("  verdict: " + (c.verdict_lines[0] if c.verdict_lines else c.verdict))
    lines += [f"    {x}" for x in (c.verdict_lines or [])[1:]]
    lines += [f"  noise: {x}" for x in getattr(c, "noise", None) or []]
    return _plain("\n".join(lines))
