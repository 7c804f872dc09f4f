"""The "Per unit" section: per FSDP unit, the memory at the peak beside the exposed communication, units in
the model's order."""
from __future__ import annotations

from typing import TYPE_CHECKING

from fsdpprof.analyze.model import ROOT_UNIT, ROOT_UNIT_TEXT, unit_order
from fsdpprof.analyze.summary.headline import peak_rank
from fsdpprof.report import figures
from fsdpprof.report.page import (CATEGORY_COLORS, Page, category_label, esc, fmt_bytes, label, mem_scale, side_by_side,
                                  table, value_label)

if TYPE_CHECKING:      # (the report's modules stay light: plan and --help import some)
    from fsdpprof.analyze.pipeline import Analysis


def _unit_memory_chart(a: Analysis, page: Page) -> tuple[str, str]:
    """Memory by FSDP unit at the peak of the first rank, units in the model's order (chart, note)."""
    if not a.memory:
        return "", ""
    r0 = peak_rank(a)
    bu = a.memory[r0].by_unit_at_peak
    if bu is None or bu.empty or not bu["unit"].notna().any():
        return "", ""
    bu = bu.copy()
    none = float(bu.loc[bu["unit"].isna(), "bytes"].sum())
    bu = bu[bu["unit"].notna() & (bu["bytes"] > 0)]
    bu["unit"] = bu["unit"].astype(str).replace(ROOT_UNIT, ROOT_UNIT_TEXT)
    units = unit_order(bu["unit"])
    sc, unit = mem_scale(bu.groupby("unit")["bytes"].sum().max())
    fig = figures.Figure()
    order = {c: i for i, c in enumerate(CATEGORY_COLORS)}
    for cat in sorted(bu["category"].astype(str).unique(), key=lambda c: order.get(c, 99)):
        g = bu[bu["category"].astype(str) == cat].groupby("unit")["bytes"].sum()
        fig.add_trace(figures.bar(x=[label(u) for u in units], y=[g.get(u, 0.0) / sc for u in units],
                             name=label(category_label(cat)), marker_color=CATEGORY_COLORS.get(cat)))
    fig.update_layout(barmode="relative", title=f"Memory per unit at the peak, rank {r0}", yaxis_title=unit,
                      xaxis=dict(categoryorder="array", categoryarray=[label(u) for u in units]),
                      legend=dict(orientation="h", y=-0.2, font=dict(size=11)))
    note = (f'<p class="note">{esc(fmt_bytes(none))} at the peak belong to no unit (inputs, tensors made outside '
            f"every FSDP unit).</p>" if none > 0.01 * a.memory[r0].peak_allocated_bytes else "")
    return page.fig(fig, 400), note


def _exposed_per_unit(a: Analysis, page: Page) -> tuple[str, str]:
    """Which unit's all-gather / reduce-scatter is exposed, in forward and backward: ms per step by the findings'
    rule (a.exposed_unit: each rank's mean per step, median over ranks). Returns (chart, table)."""
    eu = a.exposed_unit
    if eu is None or eu.empty:
        return "", ""
    g = eu.rename(columns={"us": "exposed_comm_us"})[["unit", "collective", "stage", "exposed_comm_us"]].copy()
    g["unit"] = g["unit"].astype(str).replace(ROOT_UNIT, ROOT_UNIT_TEXT)
    units = unit_order(g["unit"])
    fig = figures.Figure()
    for (coll, stage), s in g.groupby(["collective", "stage"]):
        by = s.set_index("unit")["exposed_comm_us"]
        fig.add_trace(figures.bar(x=[label(u) for u in units], y=[by.get(u, 0.0) / 1e3 for u in units],
                             name=label(f"{value_label('collective', coll)} in {stage}")))
    fig.update_layout(barmode="group", title="Exposed communication per unit (ms per step)",
                      yaxis_title="ms", xaxis=dict(categoryorder="array", categoryarray=[label(u) for u in units]),
                      legend=dict(orientation="h", y=-0.2, font=dict(size=11)))
    top = g.sort_values("exposed_comm_us", ascending=False).head(12)
    return page.fig(fig, 400), table(top, left=("unit", "collective", "stage"),
                                     labels={"exposed_comm_us": "exposed per step"})


def per_unit_section(a: Analysis, page: Page) -> str:
    """Per FSDP unit: the memory at the peak beside the exposed communication, units in the model's order."""
    mem, note = _unit_memory_chart(a, page)
    exp, tab = _exposed_per_unit(a, page)
    if not mem and not exp:   # DDP, one device, a trace of another framework: no units, no section
        return ""
    return ('<section id="units"><h2>Per FSDP unit: memory at the peak and exposed communication</h2>'
            + side_by_side(mem, exp) + note
            + (f"<details><summary>the units with the most exposed communication</summary>{tab}</details>" if tab else "")
            + "</section>")
