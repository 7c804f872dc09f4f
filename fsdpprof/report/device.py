"""The "Device time" section: the temporal, kernel-type and idle-time breakdowns (HTA's definitions), then
HTA's own tables when asked for (--hta)."""
from __future__ import annotations

from typing import TYPE_CHECKING

from fsdpprof.report import figures, many_ranks
from fsdpprof.report.page import Page, esc, label, notes_html, scope_note, table

if TYPE_CHECKING:      # (the report's modules stay light: plan and --help import some)
    from fsdpprof.analyze.pipeline import Analysis

IDLE_CAUSE_WORDS = {"idle_host_wait_us": "host wait", "idle_kernel_wait_us": "kernel wait",
                    "idle_other_us": "other streams, events, syncs"}


def device_section(a: Analysis, page: Page) -> str:
    """Device time: the temporal, kernel-type and idle-time breakdowns (HTA's definitions, computed by
    fsdpprof.analyze.comm.breakdown), then HTA's own tables when asked for (--hta)."""
    out = ['<section id="device"><h2>Device time: idle, compute, communication</h2>', notes_html(a, "device")]
    tb = a.temporal
    if tb is not None and not tb.empty and many_ranks.is_many(a):
        out.append(many_ranks.temporal(a, page))
    elif tb is not None and not tb.empty:
        fig = figures.Figure()
        for col, name, color in (("compute_time_us", "compute", "#1f77b4"),
                                 ("non_compute_time_us", "non-compute (communication, memory)", "#d62728"),
                                 ("idle_time_us", "idle", "#d1d5db")):
            fig.add_trace(figures.bar(x=[f"rank {r}" for r in tb["rank"]], y=tb[col] / 1e3, name=name, marker_color=color))
        fig.update_layout(barmode="stack", title="Temporal breakdown of device time per rank", yaxis_title="ms")
        out.append(page.fig(fig, 320) + scope_note(a, "window") + table(tb))
    else:
        out.append('<p class="note">No device kernels in this input: the device time breakdowns need a GPU '
                   '(CUDA, ROCm, MTIA, XPU) trace.</p>')
    if a.kernel_types is not None and not a.kernel_types.empty:
        out.append("<h3>Kernel types (all ranks; overlapping types counted once, as overlapped)</h3>"
                   + table(a.kernel_types, left=("kernel_type",)))
    if a.top_kernels is not None and not a.top_kernels.empty and many_ranks.is_many(a):
        out.append(many_ranks.top_kernels(a, page))
    elif a.top_kernels is not None and not a.top_kernels.empty:
        out.append("<h3>Kernels with the most time (hover a name for all of it)</h3>" + scope_note(a, "window")
                   + table(a.top_kernels.sort_values("sum_us", ascending=False).head(40), left=("kernel_type", "name")))
    ic = a.idle_causes
    if ic is not None and not ic.empty:
        fig = figures.Figure(figures.bar(x=[label(IDLE_CAUSE_WORDS.get(c, c)) for c in ic["cause"]],
                                         y=ic["us"] / 1e3, marker_color="#9ca3af"))
        fig.update_layout(title="Device idle per step by cause (median over ranks, as the headline)",
                          yaxis_title="ms per step")
        out.append("<h3>Idle time by cause: host wait (the CPU had not launched the next kernel), kernel wait "
                   "(back-to-back launches), other</h3>" + page.fig(fig, 300) + table(ic, left=("cause",)))
    if a.idle is not None and not a.idle.empty:
        out.append("<h3>Idle time per rank and stream (each stream's own gaps over the whole window: a nearly "
                   "empty side stream is idle almost all of it)</h3>" + scope_note(a, "window")
                   + (many_ranks.idle(a, page) if many_ranks.is_many(a) else table(a.idle, max_rows=60)))
    if a.hta or "hta" in a.notes:
        out.append("<h3>HTA's own tables (--hta)</h3>" + notes_html(a, "hta"))
        for name, df in a.hta.items():
            out.append(f"<h4>HTA {esc(name)}</h4>" + table(df, max_rows=40))
    out.append("</section>")
    return "".join(out)
