"""The "Steps" section: each step decomposed into compute, exposed communication, idle (host time on a CPU
trace) and the rest: T_step ~ T_comp + T_comm - T_overlap."""
from __future__ import annotations

from typing import TYPE_CHECKING

from fsdpprof.report import figures, many_ranks
from fsdpprof.report.page import (HOST_TIME_WHAT, SPLIT_COLORS, Page, esc, fmt_num, idle_words, notes_html, scope_note,
                                  table)

if TYPE_CHECKING:      # (the report's modules stay light: plan and --help import some)
    from fsdpprof.analyze.pipeline import Analysis


def _host_time(a: Analysis) -> bool:
    """True when the step's idle time is host time (a CPU trace: no device kernels)."""
    o = a.overview
    return (o.get("device_type") or "cpu") == "cpu" or not o.get("device_kernels")


def steps_section(a: Analysis, page: Page) -> str:
    out = ['<section id="steps"><h2>Step decomposition</h2>', notes_html(a, "steps")]
    s = a.steps
    host = _host_time(a)
    idle = idle_words(host)
    if s is not None and not s.empty and many_ranks.is_many(a):
        out.append(many_ranks.steps(a, page))
    elif s is not None and not s.empty:
        if host:
            what = (f"On a CPU trace the profiler sees operators only: compute is time inside leaf operators, and "
                    f"{idle} ({HOST_TIME_WHAT}) is the step's time covered by no operator and no collective.")
        else:
            what = "Device idle: time of the step in which the device ran nothing."
        out.append(f"<p>T_step ~ T_comp + T_comm - T_overlap: compute, communication hidden behind compute, "
                   f"communication exposed, {esc(idle)}. {esc(what)} <i>step - formula</i> is the measured step "
                   f"minus T_comp + T_comm - T_overlap.</p>")
        x = [f"rank {int(r)}, step {fmt_num(st)}" for r, st in zip(s["rank"], s["step"])]
        fig = figures.Figure()
        for col, name, color in (("compute_us", "compute", SPLIT_COLORS["compute"]),
                                 ("exposed_comm_us", "exposed communication", SPLIT_COLORS["exposed_comm"]),
                                 ("idle_us", idle, SPLIT_COLORS["idle"]),
                                 ("residual_us", "copies, memsets, syncs only", SPLIT_COLORS["residual"])):
            if col in s and (col != "residual_us" or float(s[col].abs().max()) > 0):
                fig.add_trace(figures.bar(x=x, y=s[col] / 1e3, name=name, marker_color=color))
        if "overlapped_comm_us" in s:
            fig.add_trace(figures.scatter(x=x, y=s["overlapped_comm_us"] / 1e3, name="communication hidden behind compute",
                                     mode="markers", marker=dict(color="#2563eb", symbol="diamond")))
        fig.update_layout(barmode="stack", title="Step time per rank and step", yaxis_title="ms")
        out.append(page.fig(fig, 340))
        shown = s.drop(columns=["residual_us"]) if "residual_us" in s and not s["residual_us"].abs().gt(0).any() else s
        out.append(scope_note(a, "rank_step") + table(shown, labels={"idle_us": idle}))
    out.append("</section>")
    return "".join(out)
