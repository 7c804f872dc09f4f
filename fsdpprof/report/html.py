"""Self-contained HTML rendering of an Analysis (one run) or a Comparison (several runs).

Rendering only: every number comes from ``fsdpprof.analyze.analysis``. plotly.js is embedded once
per page (works with no network). Every string that may come from a trace goes through
``esc`` (html.escape) in tables and text, and through ``label`` in plot labels; plotly's JSON in
<script> escapes ``</`` itself.
"""
from __future__ import annotations

import html
import math

import pandas as pd
import plotly.graph_objects as go
import plotly.io as pio

from fsdpprof import __version__
from fsdpprof.report import figures
from fsdpprof.report.outputs import generator_meta

MIB = float(2**20)
CATEGORY_COLORS = {
    "sharded_param": "#1f77b4", "unsharded_param": "#aec7e8", "sharded_grad": "#ff7f0e",
    "unsharded_grad": "#ffbb78", "optimizer_state": "#2ca02c", "activation": "#d62728",
    "temporary": "#9467bd", "input": "#8c564b", "other": "#7f7f7f",
}
KIND_COLORS = {"compute": "#1f77b4", "cpu_op": "#1f77b4", "comm": "#d62728", "memcpy": "#2ca02c",
               "memset": "#17becf", "sync": "#7f7f7f"}

CSS = """
body{font-family:-apple-system,Segoe UI,Roboto,Helvetica,Arial,sans-serif;margin:0;color:#222;background:#fafafa}
header{background:#1f2937;color:#fff;padding:14px 24px}header h1{margin:0;font-size:20px}
header .sub{color:#cbd5e1;font-size:13px;margin-top:4px;word-break:break-all}
nav{padding:6px 24px;background:#e5e7eb;font-size:13px}nav a{margin-right:14px;color:#1f2937}
main{padding:8px 24px 40px;max-width:1400px}
section{background:#fff;border:1px solid #e5e7eb;border-radius:6px;padding:10px 18px;margin:14px 0}
h2{font-size:17px;margin:6px 0 10px}h3{font-size:14px;margin:14px 0 6px}
table{border-collapse:collapse;font-size:12.5px;margin:6px 0}
td,th{border:1px solid #e5e7eb;padding:3px 8px;text-align:right;vertical-align:top;max-width:640px;overflow-wrap:anywhere}
th{background:#f3f4f6}td.l,th.l{text-align:left}
.banner{background:#fef3c7;border:1px solid #f59e0b;padding:10px 14px;border-radius:6px;margin:12px 0}
.note{color:#6b7280;font-size:13px;font-style:italic}
.finding{border-left:4px solid #9ca3af;padding:4px 10px;margin:8px 0}
.finding.high{border-color:#dc2626}.finding.medium{border-color:#f59e0b}.finding.info{border-color:#3b82f6}
.formula{font-family:ui-monospace,Menlo,Consolas,monospace;font-size:12.5px;background:#f8fafc;padding:6px 10px;
border:1px solid #e2e8f0;border-radius:4px;margin:4px 0;white-space:pre-wrap}
.verdict{font-size:15px;font-weight:600;margin:8px 0}
.plot{min-height:200px}
"""


def esc(x) -> str:
    """HTML-escape any value for text and attributes."""
    return html.escape("" if x is None else str(x), quote=True)


def label(x) -> str:
    """A string from a trace, made safe for plotly's pseudo-HTML labels."""
    return html.escape("" if x is None else str(x), quote=False)


def _isnan(x) -> bool:
    try:
        return x is None or (isinstance(x, float) and math.isnan(x)) or pd.isna(x)
    except (TypeError, ValueError):
        return False


def fmt_bytes(x) -> str:
    if _isnan(x):
        return "-"
    x = float(x)
    if abs(x) >= 2**30:
        return f"{x / 2**30:.3f} GiB"
    if abs(x) >= 2**20:
        return f"{x / 2**20:.2f} MiB"
    if abs(x) >= 2**10:
        return f"{x / 2**10:.1f} KiB"
    return f"{x:.0f} B"


def fmt_us(x) -> str:
    if _isnan(x):
        return "-"
    x = float(x)
    if abs(x) >= 1e6:
        return f"{x / 1e6:.3f} s"
    if abs(x) >= 1e3:
        return f"{x / 1e3:.2f} ms"
    return f"{x:.1f} us"


def fmt_num(x, digits: int = 4) -> str:
    if _isnan(x):
        return "-"
    if isinstance(x, (int,)) or (isinstance(x, float) and x.is_integer() and abs(x) < 1e15):
        return f"{int(x):,}"
    try:
        return f"{float(x):.{digits}g}"
    except (TypeError, ValueError):
        return str(x)


def fmt_cell(col: str, v) -> str:
    if isinstance(v, (list, tuple, dict)):
        return str(v)
    if col == "addr" and not _isnan(v):
        try:
            return hex(int(v))
        except (TypeError, ValueError):
            return str(v)
    if col.endswith("_bytes") or col == "bytes":
        return fmt_bytes(v)
    if col.endswith("_us"):
        return fmt_us(v)
    if col.endswith("_pct"):
        return "-" if _isnan(v) else f"{float(v):.1f}%"
    if col.endswith("_gbps"):
        return "-" if _isnan(v) else f"{float(v):.3g} GB/s"
    if isinstance(v, float):
        return fmt_num(v)
    if isinstance(v, int) and not isinstance(v, bool) and abs(v) >= 10000:
        return f"{v:,}"
    return "-" if _isnan(v) else str(v)


def table(df: pd.DataFrame | None, cols: list[str] | None = None, max_rows: int = 200, left: tuple = ()) -> str:
    """An HTML table with every cell escaped and unit-aware formatting by column name."""
    if df is None or len(df) == 0:
        return '<p class="note">no rows</p>'
    cols = [c for c in (cols or list(df.columns)) if c in df.columns]
    head = "".join(f'<th class="{"l" if (c in left or not _numeric(df[c])) else ""}">{esc(c)}</th>' for c in cols)
    rows = []
    for row in df[cols].head(max_rows).itertuples(index=False, name=None):
        tds = "".join(f'<td class="{"l" if (c in left or not _numeric(df[c])) else ""}">{esc(fmt_cell(c, v))}</td>'
                      for c, v in zip(cols, row))
        rows.append(f"<tr>{tds}</tr>")
    more = f'<p class="note">{len(df) - max_rows} more rows in summary.json</p>' if len(df) > max_rows else ""
    return f"<table><tr>{head}</tr>{''.join(rows)}</table>{more}"


def _numeric(s: pd.Series) -> bool:
    return pd.api.types.is_numeric_dtype(s) and not pd.api.types.is_bool_dtype(s)


def kv_table(items: list[tuple[str, object]]) -> str:
    rows = "".join(f'<tr><th class="l">{esc(k)}</th><td class="l">{esc(v)}</td></tr>' for k, v in items)
    return f"<table>{rows}</table>"


class Page:
    """Collects figures: plotly.js goes into the page once, with the first figure."""

    def __init__(self) -> None:
        self.n_figs = 0

    def fig(self, fig: go.Figure | dict, height: int = 360) -> str:
        """A figure (go.Figure, or a plain figure dict: no validation) as HTML; see report.figures."""
        self.n_figs += 1
        return figures.figure_html(fig, height, f"plot-{self.n_figs}", include_plotlyjs=(self.n_figs == 1))


def document(title: str, subtitle: str, nav: list[tuple[str, str]], body: str) -> str:
    links = "".join(f'<a href="#{esc(a)}">{esc(t)}</a>' for a, t in nav)
    return (f"<!DOCTYPE html><html lang=\"en\"><head><meta charset=\"utf-8\">{generator_meta()}"
            f"<title>{esc(title)}</title>"
            f"<meta name=\"viewport\" content=\"width=device-width, initial-scale=1\"><style>{CSS}</style></head>"
            f"<body><header><h1>{esc(title)}</h1><div class=\"sub\">{esc(subtitle)}</div></header>"
            f"<nav>{links}</nav><main>{body}</main>"
            f"<footer style=\"padding:10px 24px;color:#6b7280;font-size:12px\">fsdpprof {esc(__version__)}</footer>"
            f"</body></html>")


def notes_html(a, section: str) -> str:
    n = a.notes.get(section)
    return f'<p class="note">{esc(n)}</p>' if n else ""


# --- one run --------------------------------------------------------------------------------

INPUT_KIND_TEXT = {"fsdp2": "FSDP2 (fully_shard)", "fsdp1": "FSDP1 (FullyShardedDataParallel)",
                   "ddp": "DDP (DistributedDataParallel): nothing sharded",
                   "distributed": "distributed job of another framework (not FSDP)",
                   "single_device": "one device, no communication", "unknown": "unknown"}


def _overview(a) -> str:
    o = a.overview
    mp = o.get("mixed_precision")
    items = [
        ("input", f"{a.path} ({a.source})"), ("command", o.get("command") or "-"), ("status", o.get("status")),
        ("strategy", f"{o.get('strategy') or '-'} ({o.get('framework') or 'unknown framework'})"),
        ("input", INPUT_KIND_TEXT.get(o.get("input_kind"), o.get("input_kind") or "-")),
        ("world size", o.get("world_size")), ("ranks analysed", ", ".join(map(str, o.get("ranks_present") or []))),
        ("shard / replicate group", f"{o.get('shard_group_size') or '-'} / {o.get('replicate_group_size') or '-'}"),
        ("Psi (parameters)", fmt_num(o.get("psi")) if o.get("psi") else "-"),
        ("mixed precision", f"param {mp.get('param_dtype')}, reduce {mp.get('reduce_dtype')}" if mp else "none"),
        ("optimizer", o.get("optimizer") or "-"), ("CPU offload", o.get("cpu_offload")),
        ("device", f"{o.get('device_type') or '-'} {o.get('device_name') or ''}"),
        ("backend", o.get("backend") or "-"), ("hosts", ", ".join(o.get("hosts") or []) or "-"),
        ("steps recorded", o.get("steps_recorded")), ("median step time", fmt_us(o.get("step_time_us"))),
    ]
    return f'<section id="overview"><h2>Overview</h2>{kv_table(items)}</section>'


def _banner(a) -> str:
    out = []
    if a.missing:
        lst = "; ".join(f"{k}: {v}" for k, v in sorted(a.missing.items()))
        out.append(f'<div class="banner"><b>Partial run</b>: missing ranks/files: {esc(lst)}. '
                   f"The numbers below cover the ranks that were recorded.</div>")
    for w in a.warnings or []:
        out.append(f'<div class="banner">{esc(w)}</div>')
    return "".join(out)


def _findings(a) -> str:
    if not a.findings:
        body = '<p class="note">Nothing stands out against the thresholds in fsdpprof/analyze/findings.py.</p>'
    else:
        body = "".join(
            f'<div class="finding {esc(f.severity)}"><b>{esc(f.title)}</b><br>Try: {esc(f.suggestion)}<br>'
            f'<span class="note">triggered by {esc(f.metric)} = {esc(fmt_num(f.value))}{esc(f.unit)} '
            f'(threshold {esc(fmt_num(f.threshold))}{esc(f.unit)}), see <a href="#{esc(f.section)}">'
            f"{esc(f.section)}</a></span></div>" for f in a.findings)
    return f'<section id="findings"><h2>Findings</h2>{body}</section>'


def _theory_block(a) -> str:
    t = a.theory
    if not t:
        return f"<h3>Theory vs measured</h3>{notes_html(a, 'theory')}"
    ms = t["model_states"]
    out = ["<h3>Theory vs measured: model states per rank</h3>",
           f"<p>Psi = {esc(fmt_num(t['psi']))} parameters; k_param = {esc(fmt_num(t['k_param']))} "
           f"({esc(t['param_dtype'])}), k_grad = {esc(fmt_num(t['k_grad']))} ({esc(t['grad_dtype'])}), "
           f"k_opt = {esc(fmt_num(t['k_opt']))} ({esc(t['k_opt_detail'])}); "
           f"strategy {esc(t['strategy'])} with N = {esc(t['N'])}.</p>",
           f'<div class="formula">{esc(ms["label"])}: model states per rank = {esc(ms["formula"])}\n'
           f'  = {esc(ms["substituted"])}\n  = {esc(fmt_bytes(ms["total_bytes"]))} '
           f"({esc(fmt_num(ms['total_bytes']))} bytes)\n"
           f"measured (inventory of rank {esc(min(a.model_states['rank']) if a.model_states is not None else '-')}) = "
           f"{esc(fmt_bytes(t.get('measured_model_states_bytes')))}; difference "
           f"{esc(fmt_bytes(t.get('model_states_diff_bytes')))}: {esc(t.get('model_states_explanation'))}</div>"]
    if a.model_states is not None:
        out.append(table(a.model_states))
    out.append("<p>The same model under every strategy (same Psi, dtypes, optimizer and N):</p>")
    out.append(table(pd.DataFrame(t["all_strategies"]), ["label", "formula", "param_bytes", "grad_bytes",
                                                         "optimizer_state_bytes", "total_bytes", "traffic_bytes"],
                     left=("label", "formula")))
    out.append('<p class="note">traffic_bytes: bytes each rank sends per step (ring), all-gather in '
               f'{esc(t.get("unsharded_param_dtype"))}, reduce in {esc(t.get("reduce_dtype"))}.</p>')
    pe = t.get("peak_estimate")
    if pe:
        out.append("<h3>Theory vs measured: peak memory</h3>")
        diff = pe.get("diff_bytes")
        out.append(f'<div class="formula">peak ~ {esc(pe["formula"])}\n  = {esc(pe["substituted"])}\n'
                   f'  = {esc(fmt_bytes(pe["estimate_bytes"]))}\nmeasured peak (rank {esc(pe.get("measured_rank"))}) = '
                   f'{esc(fmt_bytes(pe.get("measured_peak_bytes")))}; difference {esc(fmt_bytes(diff))}: '
                   f'{esc(pe.get("explanation") or "no memory data to compare")}</div>')
    return "".join(out)


def _memory(a, page: Page) -> str:
    out = ['<section id="memory"><h2>Memory</h2>', notes_html(a, "memory")]
    if a.memory_peaks is not None and not a.memory_peaks.empty:
        mp = a.memory_peaks
        fig = go.Figure(go.Bar(x=[f"rank {r}" for r in mp["rank"]], y=mp["peak_allocated_bytes"] / MIB,
                               marker_color="#1f77b4"))
        fig.update_layout(title="Peak allocated memory per rank", yaxis_title="MiB")
        out.append(page.fig(fig, 300))
        out.append(table(mp.drop(columns=["peak_ts_us"], errors="ignore")))
        r0 = int(mp["rank"].min())
        m = a.memory[r0]
        t_origin = (float(m.timeline["ts_us"].min()) if m.timeline is not None and len(m.timeline)
                    and getattr(m, "timeline_unit", "us") != "event_index" else None)
        bd = m.breakdown_at_peak
        if bd is not None and not bd.empty:
            bd = bd.groupby("category", observed=True, as_index=False)[["bytes", "pct"]].sum()
            order = {c: i for i, c in enumerate(CATEGORY_COLORS)}
            bd = bd.sort_values("category", key=lambda s: s.astype(str).map(order).fillna(99))
            fig = go.Figure(go.Bar(x=[label(c) for c in bd["category"]], y=bd["bytes"] / MIB,
                                   marker_color=[CATEGORY_COLORS.get(str(c), "#7f7f7f") for c in bd["category"]],
                                   text=[f"{p:.1f}%" for p in bd["pct"]]))
            fig.update_layout(title=f"Breakdown at the peak, rank {r0} (stage {label(m.peak_stage)}, "
                                    f"{m.coverage_pct:.1f}% attributed)", yaxis_title="MiB")
            out.append(page.fig(fig, 320))
        tl = m.timeline
        if tl is not None and not tl.empty and "ts_us" in tl:
            fig = go.Figure()
            by_index = getattr(m, "timeline_unit", "us") == "event_index"  # legacy snapshots: no times
            t0 = 0.0 if by_index else float(tl["ts_us"].min())
            xs = tl["ts_us"] if by_index else (tl["ts_us"] - t0) / 1e3
            for c in [c for c in tl.columns if c != "ts_us"]:
                if not pd.api.types.is_numeric_dtype(tl[c]) or float(tl[c].max() or 0) <= 0:
                    continue
                fig.add_trace(go.Scatter(x=xs, y=tl[c] / MIB, name=label(c), mode="lines",
                                         stackgroup="one", line=dict(width=0.5, color=CATEGORY_COLORS.get(c))))
            fig.update_layout(title=f"Memory timeline by category, rank {r0}",
                              xaxis_title="allocation event number (the snapshot has no times)" if by_index
                              else "ms from window start", yaxis_title="MiB")
            out.append(page.fig(fig, 380))
        bu = m.by_unit_at_peak
        if bu is not None and not bu.empty and bu["unit"].notna().any():
            fig = go.Figure()
            bu = bu.copy()
            bu["unit"] = bu["unit"].astype(object).fillna("(none)").replace("", "(root)")
            for cat, g in bu.groupby("category", observed=True):
                fig.add_trace(go.Bar(x=[label(u) for u in g["unit"]], y=g["bytes"] / MIB, name=label(cat),
                                     marker_color=CATEGORY_COLORS.get(str(cat))))
            fig.update_layout(barmode="stack", title=f"Per FSDP unit at the peak, rank {r0}", yaxis_title="MiB")
            out.append(page.fig(fig, 340))
        if m.oom:
            o = m.oom
            out.append(f'<div class="banner"><b>Out of memory</b> on device {esc(o.get("device"))}: requested '
                       f'{esc(fmt_bytes(o.get("requested_bytes")))} with {esc(fmt_bytes(o.get("free_bytes")))} free.</div>')
        if m.top_allocations is not None and not m.top_allocations.empty:
            out.append(f"<h3>Largest allocations alive at the peak, rank {r0}</h3>")
            top = m.top_allocations.head(15).copy()
            if t_origin is not None:  # display times from the window start, like the timeline
                for col in ("alloc_us", "free_us"):
                    if col in top:
                        top[col] = top[col] - t_origin
            out.append(table(top, left=("frames", "unit", "stage", "category")))
        if m.warnings:
            out.append("".join(f'<p class="note">{esc(w)}</p>' for w in m.warnings))
    out.append(_theory_block(a))
    out.append("</section>")
    return "".join(out)


def _comm(a, page: Page) -> str:
    out = ['<section id="communication"><h2>Communication</h2>', notes_html(a, "communication")]
    if a.volume is not None and not a.volume.empty:
        out.append("<h3>Per collective: count, bytes, time, bandwidth (algbw; busbw with nccl-tests' factors)</h3>")
        out.append(table(a.volume))
    if a.comm_phase is not None and not a.comm_phase.empty:
        op = a.comm_phase
        out.append("<h3>Per collective, stage (forward / backward / optimizer, from the CPU op that launched it) "
                   "and FSDP phase: volume, bandwidth, overlap with compute, exposed time</h3>")
        out.append(table(op))
        g = op.copy()
        g["key"] = g["collective"].astype(str) + " / " + g["stage"].astype(str)
        g = g.groupby("key", as_index=False)[["overlapped_comm_us", "exposed_comm_us"]].sum()
        fig = go.Figure([go.Bar(x=[label(k) for k in g["key"]], y=g["overlapped_comm_us"] / 1e3, name="overlapped",
                                marker_color="#93c5fd"),
                         go.Bar(x=[label(k) for k in g["key"]], y=g["exposed_comm_us"] / 1e3, name="exposed",
                                marker_color="#dc2626")])
        fig.update_layout(barmode="stack", title="Communication time, overlapped vs exposed (all ranks, all steps)",
                          yaxis_title="ms")
        out.append(page.fig(fig, 320))
    out.append(_exposed_per_unit(a, page))
    if a.p2p is not None and not a.p2p.empty:
        out.append("<h3>Point-to-point transfers (send / recv): not matched across ranks, not in skew</h3>")
        out.append(table(a.p2p))
    if a.comm_outside_steps is not None and not a.comm_outside_steps.empty:
        out.append("<h3>Communication launched outside every profiler step (not counted per step)</h3>")
        out.append(table(a.comm_outside_steps))
    if a.overlap_overall is not None and not a.overlap_overall.empty:
        out.append("<h3>Overall overlap per rank</h3>" + table(a.overlap_overall))
    if a.traffic is not None and not a.traffic.empty:
        tr = (a.theory or {}).get("traffic")
        out.append("<h3>Measured volume vs theory (bytes each rank sends per step, ring)</h3>")
        if tr:
            out.append(f'<div class="formula">{esc(tr["label"])}: {esc(tr["formula"])}\n  = {esc(tr["substituted"])}\n'
                       f'  = {esc(fmt_bytes(tr["total_bytes"]))} per rank per step</div>')
        out.append(table(a.traffic))
    if a.lanes is not None and not a.lanes.empty:
        ln = a.lanes
        fig = go.Figure()
        for kind, g in ln.groupby("kind"):
            fig.add_trace(go.Bar(base=g["start_us"] / 1e3, x=g["dur_us"] / 1e3, y=[label(x) for x in g["lane"]],
                                 orientation="h", name=label(kind), marker_color=KIND_COLORS.get(kind, "#999"),
                                 hovertext=[label(n) for n in g["name"]], hoverinfo="text+x", width=0.6,
                                 opacity=0.6 if kind == "cpu_op" else 1.0))
        fig.update_layout(barmode="overlay", title=f"Lanes of compute and communication, step {fmt_num(a.lanes_step)} "
                                                   f"of the first rank", xaxis_title="ms from step start")
        out.append(page.fig(fig, 160 + 40 * ln["lane"].nunique()))
    if a.top_ops is not None and not a.top_ops.empty:
        out.append(f"<h3>Operations with the most time in step {esc(fmt_num(a.lanes_step))} of the first rank</h3>")
        out.append(table(a.top_ops, left=("name", "kind")))
    out.append("</section>")
    return "".join(out)


def _exposed_per_unit(a, page: Page) -> str:
    """Which unit's all-gather / reduce-scatter is exposed, in forward and backward: ms per step, mean over
    ranks and steps (communication launched inside a step only)."""
    cu = a.comm_unit_step
    if cu is None or cu.empty or not cu["unit"].notna().any():
        return ""
    c = cu[cu["step"].notna() & cu["unit"].notna()].copy()
    if c.empty:
        return ""
    per = c.groupby(["rank", "step", "unit", "collective", "stage"], as_index=False)["exposed_comm_us"].sum()
    g = per.groupby(["unit", "collective", "stage"], as_index=False)["exposed_comm_us"].mean()
    g["unit"] = g["unit"].astype(str).replace("", "(root)")
    fig = go.Figure()
    for (coll, stage), s in g.groupby(["collective", "stage"]):
        fig.add_trace(go.Bar(x=[label(u) for u in s["unit"]], y=s["exposed_comm_us"] / 1e3,
                             name=label(f"{coll} in {stage}")))
    fig.update_layout(barmode="group", title="Exposed communication per FSDP unit (ms per step, mean over ranks)",
                      yaxis_title="ms")
    return ("<h3>Exposed communication per FSDP unit</h3>" + page.fig(fig, 340)
            + table(g.sort_values("exposed_comm_us", ascending=False), left=("unit", "collective", "stage")))


def _steps(a, page: Page) -> str:
    out = ['<section id="steps"><h2>Step decomposition</h2>', notes_html(a, "steps")]
    s = a.steps
    if s is not None and not s.empty:
        out.append('<p>T_step ~ T_comp + T_comm - T_overlap: compute, communication hidden behind compute, '
                   'communication exposed, idle. <code>model_step_us</code> is the formula with each step\'s '
                   'numbers; <code>unexplained_us</code> = measured step - formula (time with neither compute nor '
                   'communication: data loading, Python, synchronisation).</p>')
        x = [f"r{int(r)} s{fmt_num(st)}" for r, st in zip(s["rank"], s["step"])]
        fig = go.Figure()
        for col, name, color in (("compute_us", "compute", "#1f77b4"), ("exposed_comm_us", "exposed comm", "#dc2626"),
                                 ("idle_us", "idle", "#d1d5db"), ("residual_us", "residual", "#fde68a")):
            if col in s:
                fig.add_trace(go.Bar(x=x, y=s[col] / 1e3, name=name, marker_color=color))
        if "overlapped_comm_us" in s:
            fig.add_trace(go.Scatter(x=x, y=s["overlapped_comm_us"] / 1e3, name="overlapped comm (inside compute)",
                                     mode="markers", marker=dict(color="#2563eb", symbol="diamond")))
        fig.update_layout(barmode="stack", title="Step time per rank and step", yaxis_title="ms")
        out.append(page.fig(fig, 340))
        out.append(table(s))
    out.append("</section>")
    return "".join(out)


def _ranks(a, page: Page) -> str:
    out = ['<section id="ranks"><h2>Ranks: skew and stragglers</h2>', notes_html(a, "ranks")]
    if a.stragglers is not None and not a.stragglers.empty:
        out.append(table(a.stragglers))
    if a.skew is not None and not a.skew.empty and "start_skew_us" in a.skew:
        fig = go.Figure(go.Histogram(x=a.skew["start_skew_us"] / 1e3, nbinsx=40, marker_color="#6366f1"))
        fig.update_layout(title=f"Start skew of {len(a.skew)} matched collectives", xaxis_title="ms",
                          yaxis_title="count")
        out.append(page.fig(fig, 300))
        out.append("<h3>Largest skews</h3>" + table(a.skew.sort_values("start_skew_us", ascending=False).head(15)))
    out.append("</section>")
    return "".join(out)


def _device(a, page: Page) -> str:
    """Device time: the temporal, kernel-type and idle-time breakdowns (HTA's definitions, computed by
    fsdpprof.analyze.comm.breakdown), then HTA's own tables when asked for (--hta)."""
    out = ['<section id="device"><h2>Device time: idle, compute, communication</h2>', notes_html(a, "device")]
    tb = a.temporal
    if tb is not None and not tb.empty:
        fig = go.Figure()
        for col, name, color in (("compute_time_us", "compute", "#1f77b4"),
                                 ("non_compute_time_us", "non-compute (comm, memory)", "#d62728"),
                                 ("idle_time_us", "idle", "#d1d5db")):
            fig.add_trace(go.Bar(x=[f"rank {r}" for r in tb["rank"]], y=tb[col] / 1e3, name=name, marker_color=color))
        fig.update_layout(barmode="stack", title="Temporal breakdown of device time per rank", yaxis_title="ms")
        out.append(page.fig(fig, 320) + table(tb))
    else:
        out.append('<p class="note">No device kernels in this input: the device time breakdowns need a GPU '
                   '(CUDA, ROCm, MTIA, XPU) trace.</p>')
    if a.kernel_types is not None and not a.kernel_types.empty:
        out.append("<h3>Kernel types (all ranks; overlapping types counted once, as overlapped)</h3>"
                   + table(a.kernel_types, left=("kernel_type",)))
    if a.top_kernels is not None and not a.top_kernels.empty:
        out.append("<h3>Kernels with the most time</h3>"
                   + table(a.top_kernels.sort_values("sum_us", ascending=False).head(40), left=("kernel_type", "name")))
    if a.idle is not None and not a.idle.empty:
        idle = a.idle.groupby("idle_category", as_index=False)["idle_time_us"].sum()
        fig = go.Figure(go.Bar(x=[label(c) for c in idle["idle_category"]], y=idle["idle_time_us"] / 1e3,
                               marker_color="#9ca3af"))
        fig.update_layout(title="Device idle time by cause (all ranks and streams)", yaxis_title="ms")
        out.append("<h3>Idle time by cause: host wait (the CPU had not launched the next kernel), kernel wait "
                   "(back-to-back launches), other</h3>" + page.fig(fig, 300) + table(a.idle, max_rows=60))
    if a.hta or "hta" in a.notes:
        out.append("<h3>HTA's own tables (--hta)</h3>" + notes_html(a, "hta"))
        for name, df in a.hta.items():
            out.append(f"<h4>HTA {esc(name)}</h4>" + table(df, max_rows=40))
    out.append("</section>")
    return "".join(out)


def render_report(a) -> str:
    """The HTML of one run's report."""
    page = Page()
    o = a.overview
    body = (_banner(a) + _overview(a) + _findings(a) + _memory(a, page) + _comm(a, page) + _steps(a, page)
            + _ranks(a, page) + _device(a, page))
    what = {"snapshot_file": "CUDA memory snapshot", "snapshot_folder": "CUDA memory snapshots",
            "trace_file": "profiler trace", "trace_folder": "profiler traces"}.get(a.source, "run")
    n = o.get("ranks_analysed") or 0
    of = f" of {o['world_size']}" if o.get("world_size") and o["world_size"] != n else ""
    title = f"fsdpprof report: {o.get('strategy') or what}, {n}{of} rank{'s' if n != 1 or of else ''} analysed"
    nav = [("overview", "Overview"), ("findings", "Findings"), ("memory", "Memory"), ("communication", "Communication"),
           ("steps", "Steps"), ("ranks", "Ranks"), ("device", "Device time")]
    return document(title, a.path, nav, body)


# --- several runs ---------------------------------------------------------------------------

def render_compare(c) -> str:
    """The HTML of a Comparison (fsdpprof.analyze.analysis.compare_analyses)."""
    page = Page()
    out = []
    for w in c.warnings:
        out.append(f'<div class="banner">{esc(w)}</div>')
    out.append(f'<section id="verdict"><h2>Verdict</h2><p class="verdict">{esc(c.verdict)}</p></section>')
    t = c.table
    runs = [col for col in t.columns if col not in ("metric",)]
    head = '<th class="l">metric</th>' + "".join(f"<th>{esc(r)}</th>" for r in runs)
    rows = []
    for row in t.itertuples(index=False, name=None):
        metric = row[0]
        tds = "".join(f"<td>{esc(fmt_cell(metric, v))}</td>" for v in row[1:])
        rows.append(f'<tr><th class="l">{esc(metric)}</th>{tds}</tr>')
    out.append(f'<section id="table"><h2>Runs side by side</h2><table><tr>{head}</tr>{"".join(rows)}</table>'
               '<p class="note">bytes per rank; *_theory_* rows are the ZeRO formulas with each run\'s numbers; '
               'exposed comm and step time are per step (median over ranks).</p></section>')
    cats = c.categories
    if cats is not None and not cats.empty:
        fig = go.Figure()
        for cat, g in cats.groupby("category", observed=True):
            fig.add_trace(go.Bar(x=[label(x) for x in g["run"]], y=g["bytes"] / MIB, name=label(cat),
                                 marker_color=CATEGORY_COLORS.get(str(cat))))
        fig.update_layout(barmode="stack", title="Memory at the peak by category (first rank of each run)",
                          yaxis_title="MiB")
        out.append(f'<section id="memory"><h2>Peak memory by category</h2>{page.fig(fig, 380)}</section>')
    tm = c.time
    if tm is not None and not tm.empty:
        fig = go.Figure()
        for col, name, color in (("compute_us", "compute", "#1f77b4"), ("exposed_comm_us", "exposed comm", "#dc2626"),
                                 ("idle_us", "idle", "#d1d5db")):
            if col in tm:
                fig.add_trace(go.Bar(x=[label(x) for x in tm["run"]], y=tm[col] / 1e3, name=name, marker_color=color))
        fig.update_layout(barmode="stack", title="Step time (median per step over ranks)", yaxis_title="ms")
        out.append(f'<section id="time"><h2>Step time</h2>{page.fig(fig, 340)}</section>')
    nav = [("verdict", "Verdict"), ("table", "Side by side"), ("memory", "Memory"), ("time", "Step time")]
    return document(f"fsdpprof compare: {len(runs)} runs", " | ".join(c.paths), nav, "".join(out))
