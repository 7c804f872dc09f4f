"""Above DETAIL_RANKS_MAX (16) ranks each per-rank table and chart of the report is a distribution over ranks
instead (``Analysis.rank_distributions``: statistics, the worst ranks, histograms, a heat map of exposed
communication); the per-rank rows stay in summary.json. Each function returns an HTML fragment, "" for none."""
from __future__ import annotations

from typing import TYPE_CHECKING

import numpy as np

from fsdpprof.analyze.summary.distributions import WORST_N, exposed_heatmap
from fsdpprof.analyze.pipeline import DETAIL_RANKS_MAX
from fsdpprof.report import figures
from fsdpprof.report.page import MIB, esc, fmt_num, table

if TYPE_CHECKING:      # (the report's modules stay light: plan and --help import some)
    from fsdpprof.analyze.pipeline import Analysis


def is_many(a: Analysis) -> bool:
    """True when the report shows distributions over ranks instead of per-rank tables (> DETAIL_RANKS_MAX)."""
    return int((a.overview or {}).get("ranks_analysed") or 0) > DETAIL_RANKS_MAX


def _d(a: Analysis, name: str):
    return (getattr(a, "rank_distributions", None) or {}).get(name)


def _titled(a: Analysis, name: str, title: str, **kw) -> str:
    """Distribution ``name`` as a table under ``title`` ("" when it is not there)."""
    d = _d(a, name)
    return "" if d is None else title + table(d, **kw)


def _stats_block(a: Analysis, name: str, what: str) -> str:
    d = _d(a, name)
    n = int(d["ranks"].max()) if d is not None and "ranks" in d and len(d) else 0
    return _titled(a, name, f"<h4>{esc(what)}: distribution over {n} ranks</h4>", left=("statistic",))


def _worst_block(a: Analysis, name: str, what: str) -> str:
    d = _d(a, name)
    return "" if d is None else _titled(a, name, f"<h4>The {min(WORST_N, len(d))} ranks with {esc(what)}</h4>")


def _distribution(a: Analysis, page, values, title: str, xaxis: str, name: str, what: str, worst: str,
                  color: str = "#1f77b4") -> str:
    """A per-rank column as a histogram, its statistics over ranks and the ranks with the worst values."""
    v = np.asarray(values, dtype=float)
    v = v[np.isfinite(v)]
    hist = ""
    if v.size:
        fig = figures.Figure(figures.histogram(x=v.astype(np.float32), nbinsx=min(60, max(10, int(np.sqrt(v.size)))),
                                               marker_color=color))
        fig.update_layout(title=title, xaxis_title=xaxis, yaxis_title="ranks", bargap=0.05)
        hist = page.fig(fig, 280)
    return hist + _stats_block(a, name, what) + _worst_block(a, f"{name}_worst", worst)


def _empty(df) -> bool:
    return df is None or df.empty


def memory_peaks(a: Analysis, page) -> str:
    """Instead of the per-rank peak bar chart and the memory_peaks table."""
    mp = a.memory_peaks
    return "" if _empty(mp) else _distribution(
        a, page, mp["peak_allocated_bytes"] / MIB, f"Peak allocated memory of {len(mp)} ranks", "MiB at the peak",
        "memory_peak", "Peak memory", "the highest peak")


def comm_phase(a: Analysis, page) -> str:
    """Instead of the comm_phase table (a row per rank, collective, stage, FSDP phase)."""
    return _titled(a, "comm_phase", "<h4>Per collective, stage and FSDP phase, all ranks: totals, and the exposed "
                   "time per rank (p50, p90, max; worst_rank has the max)</h4>",
                   left=("collective", "stage", "fsdp_phase"))


def overlap_per_rank(a: Analysis, page) -> str:
    """Instead of the 'Overall overlap per rank' table."""
    ov = a.overlap_overall
    return "" if _empty(ov) else "<h3>Overall overlap: distribution over ranks</h3>" + _distribution(
        a, page, ov["exposed_comm_us"] / 1e3, f"Exposed communication of {len(ov)} ranks",
        "ms exposed (whole window)", "overlap", "Overlap", "the most exposed communication", "#dc2626")


def traffic(a: Analysis, page) -> str:
    """Instead of the traffic table (a row per rank and collective); the formula above it stays."""
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


def steps(a: Analysis, page) -> str:
    """Instead of the per-(rank, step) bar chart and the steps table."""
    s = a.steps
    if _empty(s):
        return ""
    out = [_stats_block(a, "steps", "Mean step time per rank"),
           _titled(a, "steps_per_step", "<h4>Per step, over ranks (slowest_rank: the rank with the longest step)</h4>",
                   max_rows=100)]
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


def stragglers(a: Analysis, page) -> str:
    """Instead of the stragglers table (a row per rank)."""
    st = a.stragglers
    return "" if _empty(st) else _distribution(
        a, page, st["mean_start_lag_us"] / 1e3, f"Mean start lag after the earliest rank, {len(st)} ranks",
        "ms (aligned clocks)", "stragglers", "Stragglers", "the largest mean start lag", "#6366f1")


def temporal(a: Analysis, page) -> str:
    """Instead of the per-rank temporal bar chart and table."""
    tb = a.temporal
    return "" if _empty(tb) else _distribution(
        a, page, tb["idle_time_pct"], f"Device idle time of {len(tb)} ranks", "% of the span idle", "temporal",
        "Temporal breakdown", "the most idle device time", "#9ca3af")


def idle(a: Analysis, page) -> str:
    """Instead of the idle table (a row per rank, stream, category)."""
    return _titled(a, "idle", "<h4>Idle time per category, summed per rank over its streams: distribution over "
                   "ranks</h4>", left=("idle_category",))


def top_kernels(a: Analysis, page) -> str:
    """Instead of the 'Kernels with the most time' table (rows per rank)."""
    return _titled(a, "top_kernels", "<h3>Kernels with the most time, summed over ranks</h3>",
                   left=("kernel_type", "name"))
