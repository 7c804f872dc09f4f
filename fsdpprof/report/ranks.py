"""The "Ranks" section: how the collectives matched across ranks (matched / refused / unmatched calls), stragglers
(which rank is last into collectives more often than chance, and what it costs) and the start skew of the checked
matches."""
from __future__ import annotations

from typing import TYPE_CHECKING

from fsdpprof.report import figures, many_ranks
from fsdpprof.report.page import Page, esc, notes_html, table

if TYPE_CHECKING:      # (the report's modules stay light: plan and --help import some)
    from fsdpprof.analyze.pipeline import Analysis

_CLOCKS = {"clock_anchor": "the clock anchors fsdpprof recorded", "collective_ends": "the ends of the checked matches",
           "none": "the clocks as recorded"}


def matching_html(m: dict | None) -> str:
    """One paragraph: the calls matched, refused (and why) and left unmatched; the clock skew uses."""
    if not m:
        return ""
    total = m["matched_calls"] + m["refused_calls"] + m["unmatched_calls"]
    why = "".join(f"<li>{esc(reason)}: {n:,} calls</li>" for reason, n in (m.get("refusals") or {}).items())
    size = m.get("size_checked_pct")
    size = f"; sizes known and checked on {size:.0f}% of them" if size is not None else ""
    clock = _CLOCKS.get(m.get("clock"), m.get("clock"))
    clock = f" Skew and stragglers are on one clock from {esc(clock)}." if clock else ""
    return (f'<p class="matching">Collective calls matched across ranks by process group, type, size and sequence '
            f'number (or aligned as sequences), each match checked in time ({m["tolerance_us"]:,.0f} µs '
            f'tolerance): <b>{m["matched_calls"]:,}</b> of {total:,} calls in {m["matched_collectives"]:,} '
            f'collectives matched{size}; <b>{m["refused_calls"]:,}</b> refused, <b>{m["unmatched_calls"]:,}</b> '
            f'unmatched (neither used).{clock}</p>' + (f"<ul>{why}</ul>" if why else ""))


def ranks_section(a: Analysis, page: Page) -> str:
    out = ['<section id="ranks"><h2>Ranks: skew and stragglers</h2>', notes_html(a, "ranks"),
           matching_html(a.matching)]
    if a.stragglers is not None and not a.stragglers.empty:
        out.append(many_ranks.stragglers(a, page) if many_ranks.is_many(a) else table(a.stragglers))
    if a.skew is not None and not a.skew.empty and "start_skew_us" in a.skew:
        fig = figures.Figure(figures.histogram(x=a.skew["start_skew_us"] / 1e3, nbinsx=40, marker_color="#6366f1"))
        fig.update_layout(title=f"Start skew of {len(a.skew)} checked matches", xaxis_title="ms",
                          yaxis_title="count")
        out.append(page.fig(fig, 300))
        out.append("<h3>Largest skews</h3>" + table(a.skew.sort_values("start_skew_us", ascending=False).head(15)))
    out.append("</section>")
    return "".join(out)
