"""The "Ranks" section: stragglers (which rank is last into collectives) and the start skew of matched
collectives."""
from __future__ import annotations

from typing import TYPE_CHECKING

from fsdpprof.report import figures, many_ranks
from fsdpprof.report.page import Page, notes_html, table

if TYPE_CHECKING:      # (the report's modules stay light: plan and --help import some)
    from fsdpprof.analyze.pipeline import Analysis


def ranks_section(a: Analysis, page: Page) -> str:
    out = ['<section id="ranks"><h2>Ranks: skew and stragglers</h2>', notes_html(a, "ranks")]
    if a.stragglers is not None and not a.stragglers.empty:
        out.append(many_ranks.stragglers(a, page) if many_ranks.is_many(a) else table(a.stragglers))
    if a.skew is not None and not a.skew.empty and "start_skew_us" in a.skew:
        fig = figures.Figure(figures.histogram(x=a.skew["start_skew_us"] / 1e3, nbinsx=40, marker_color="#6366f1"))
        fig.update_layout(title=f"Start skew of {len(a.skew)} matched collectives", xaxis_title="ms",
                          yaxis_title="count")
        out.append(page.fig(fig, 300))
        out.append("<h3>Largest skews</h3>" + table(a.skew.sort_values("start_skew_us", ascending=False).head(15)))
    out.append("</section>")
    return "".join(out)
