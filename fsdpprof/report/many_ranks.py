"""Report sections for runs of many ranks: above ``DETAIL_RANKS_MAX`` (16) ranks, each per-rank table and
chart of the report is shown as a distribution over ranks instead (statistics: min, p10, p50, p90, p99,
max, mean; the 10 worst ranks; histograms; a heat map rank x step of exposed communication), so that the
page stays small (it does not grow with the ranks but for the heat map, at most 1,024 rows) and readable.
The per-rank rows stay in summary.json.

Rendering only: the numbers are ``Analysis.rank_distributions``
(:func:`fsdpprof.analyze.summary.distributions.rank_distributions`).  Each function takes the Analysis and the
page's :class:`fsdpprof.report.page.Page` and returns an HTML fragment ("" when there is nothing to show);
:func:`is_many` says when to use them instead of the per-rank blocks of the sections
(:mod:`fsdpprof.report.memory`, ...).
"""
from __future__ import annotations

import numpy as np

from fsdpprof.analyze.summary.distributions import WORST_N, exposed_heatmap
from fsdpprof.analyze.pipeline import DETAIL_RANKS_MAX
from fsdpprof.report import figures
from fsdpprof.report.page import MIB, esc, fmt_num, table


def is_many(a) -> bool:
    """True when the report shows distributions over ranks instead of per-rank tables (> DETAIL_RANKS_MAX)."""
    return int((a.overview or {}).get("ranks_analysed") or 0) > DETAIL_RANKS_MAX


def _d(a, name: str):
    return (getattr(a, "rank_distributions", None) or {}).get(name)


def _stats_block(a, name: str, what: str) -> str:
    d = _d(a, name)
    if d is None:
        return ""
    return f"<h4>{esc(what)}: distribution over {_ranks_in(d)} ranks</h4>" + table(d, left=("statistic",))


def _ranks_in(stats) -> int:
    return int(stats["ranks"].max()) if stats is not None and "ranks" in stats and len(stats) else 0


def _worst_block(a, name: str, what: str) -> str:
    d = _d(a, name)
    if d is None:
        return ""
    return f"<h4>The {min(WORST_N, len(d))} ranks with {esc(what)}</h4>" + table(d)


def _histogram(page, values, title: str, xaxis: str, color: str = "#1f77b4") -> str:
    v = np.asarray(values, dtype=float)
    v = v[np.isfinite(v)]
    if v.size == 0:
        return ""
    fig = figures.Figure(figures.histogram(x=v.astype(np.float32), nbinsx=min(60, max(10, int(np.sqrt(v.size)))),
                                 marker_color=color))
    fig.update_layout(title=title, xaxis_title=xaxis, yaxis_title="ranks", bargap=0.05)
    return page.fig(fig, 280)


def _distribution(a, page, values, title: str, xaxis: str, name: str, what: str, worst: str,
                  color: str = "#1f77b4") -> str:
    """A per-rank column as a histogram, its statistics over ranks and the ranks with the worst values."""
    return (_histogram(page, values, title, xaxis, color) + _stats_block(a, name, what)
            + _worst_block(a, f"{name}_worst", worst))


# --------------------------------------------------------------------------- sections
def memory_peaks(a, page) -> str:
    """Instead of the per-rank peak bar chart and the memory_peaks table (memory.memory_section)."""
    mp = a.memory_peaks
    if mp is None or mp.empty:
        return ""
    return _distribution(a, page, mp["peak_allocated_bytes"] / MIB, f"Peak allocated memory of {len(mp)} ranks",
                         "MiB at the peak", "memory_peak", "Peak memory", "the highest peak")


def comm_phase(a, page) -> str:
    """Instead of the comm_phase table (one row per rank, collective, stage, FSDP phase) in
    communication.communication_section."""
    d = _d(a, "comm_phase")
    if d is None:
        return ""
    return ("<h4>Per collective, stage and FSDP phase, all ranks: totals, and the exposed time per rank "
            "(p50, p90, max; worst_rank has the max)</h4>"
            + table(d, left=("collective", "stage", "fsdp_phase")))


def overlap_per_rank(a, page) -> str:
    """Instead of the 'Overall overlap per rank' table in communication.communication_section."""
    ov = a.overlap_overall
    if ov is None or ov.empty:
        return ""
    return ("<h3>Overall overlap: distribution over ranks</h3>"
            + _distribution(a, page, ov["exposed_comm_us"] / 1e3, f"Exposed communication of {len(ov)} ranks",
                            "ms exposed (whole window)", "overlap", "Overlap", "the most exposed communication",
                            "#dc2626"))


def traffic(a, page) -> str:
    """Instead of table(a.traffic) (one row per rank and collective) in communication.communication_section;
    the formula above it stays."""
    d = _d(a, "traffic")
    if d is None:
        return ""
    tr = a.traffic
    theory = ""
    if tr is not None and "theory_wire_per_step_bytes" in tr:
        th = tr.groupby("collective", as_index=False).agg(theory_wire_per_step_bytes=("theory_wire_per_step_bytes",
                                                                                        "first"))
        d = d.merge(th, on="collective", how="left")
        theory = " beside the theory"
    return (f"<h4>Bytes on the wire per rank and step, distribution over ranks{theory}</h4>"
            + table(d, left=("collective",)))


def steps(a, page) -> str:
    """Instead of the per-(rank, step) bar chart and table(a.steps) in steps.steps_section."""
    s = a.steps
    if s is None or s.empty:
        return ""
    out = [_stats_block(a, "steps", "Mean step time per rank")]
    per_step = _d(a, "steps_per_step")
    if per_step is not None:
        out.append("<h4>Per step, over ranks (slowest_rank: the rank with the longest step)</h4>"
                   + table(per_step, max_rows=100))
    hm = exposed_heatmap(s)
    if hm is not None:
        z, rows, cols = hm
        fig = figures.Figure(figures.heatmap(z=(z / 1e3).astype(np.float32), x=[fmt_num(c) for c in cols], y=rows,
                                   colorscale="Reds", colorbar=dict(title="ms"),
                                   hovertemplate="%{y}, step %{x}: %{z:.3f} ms exposed<extra></extra>"))
        fig.update_layout(title=f"Exposed communication per rank and step ({len(s['rank'].unique())} ranks)",
                          xaxis_title="step", yaxis_title="rank", yaxis=dict(autorange="reversed", type="category"),
                          xaxis=dict(type="category"))
        out.append(page.fig(fig, int(min(900, 220 + 2 * len(rows)))))
    out.append(_worst_block(a, "steps_worst", "the most exposed communication per step (mean over their steps)"))
    return "".join(out)


def stragglers(a, page) -> str:
    """Instead of table(a.stragglers) (one row per rank) in ranks.ranks_section."""
    st = a.stragglers
    if st is None or st.empty:
        return ""
    return _distribution(a, page, st["mean_start_lag_us"] / 1e3,
                         f"Mean start lag after the earliest rank, {len(st)} ranks", "ms (aligned clocks)",
                         "stragglers", "Stragglers", "the largest mean start lag", "#6366f1")


def temporal(a, page) -> str:
    """Instead of the per-rank temporal bar chart and table(tb) in device.device_section."""
    tb = a.temporal
    if tb is None or tb.empty:
        return ""
    return _distribution(a, page, tb["idle_time_pct"], f"Device idle time of {len(tb)} ranks", "% of the span idle",
                         "temporal", "Temporal breakdown", "the most idle device time", "#9ca3af")


def idle(a, page) -> str:
    """Instead of table(a.idle, max_rows=60) (one row per rank, stream, category) in device.device_section."""
    d = _d(a, "idle")
    if d is None:
        return ""
    return ("<h4>Idle time per category, summed per rank over its streams: distribution over ranks</h4>"
            + table(d, left=("idle_category",)))


def top_kernels(a, page) -> str:
    """Instead of the 'Kernels with the most time' table (rows per rank) in device.device_section."""
    d = _d(a, "top_kernels")
    if d is None:
        return ""
    return ("<h3>Kernels with the most time, summed over ranks</h3>"
            + table(d, left=("kernel_type", "name")))
