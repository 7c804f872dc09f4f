"""The "Communication" section: per collective count, size, time and bandwidth; hidden vs exposed time per
collective and stage; point-to-point and out-of-step communication; overlap per rank; measured volume against
the formula; what ran where in one step; the operations with the most time."""
from __future__ import annotations

from typing import TYPE_CHECKING

import re

from fsdpprof.report import figures, many_ranks
from fsdpprof.report.page import (KIND_COLORS, KIND_LABELS, Page, esc, fmt_bytes, fmt_num, fmt_us, hover_name, label,
                                  notes_html, scope_note, table, value_label)

if TYPE_CHECKING:      # (the report's modules stay light: plan and --help import some)
    from fsdpprof.analyze.pipeline import Analysis


def _lanes_chart(a: Analysis, page: Page) -> str:
    ln = a.lanes
    if ln is None or ln.empty:
        return ""
    ln = ln.copy()
    ln["who"] = ln["lane_name"].fillna(ln["lane"]) if "lane_name" in ln else ln["lane"]
    order = list(dict.fromkeys(ln["who"]))
    order.sort(key=lambda w: (not str(w).startswith("main"),
                              [(0, int(p), "") if p.isdigit() else (1, 0, p) for p in re.split(r"(\d+)", str(w)) if p]))
    fig = figures.Figure()
    for kind, g in ln.groupby("kind"):
        fig.add_trace(figures.bar(base=g["start_us"] / 1e3, x=g["dur_us"] / 1e3, y=[label(x) for x in g["who"]],
                             orientation="h", name=label(KIND_LABELS.get(kind, kind)),
                             marker_color=KIND_COLORS.get(kind, "#999"),
                             hovertext=[f"{hover_name(n)}<br>{fmt_us(d)}" for n, d in zip(g["name"], g["dur_us"])],
                             hoverinfo="text", width=0.6, opacity=0.6 if kind == "cpu_op" else 1.0))
    fig.update_layout(barmode="overlay", title=f"What ran where in step {fmt_num(a.lanes_step)} of the first rank",
                      xaxis_title="ms from step start",
                      yaxis=dict(categoryorder="array", categoryarray=[label(w) for w in reversed(order)]))
    return page.fig(fig, 180 + 40 * len(order))


def _holds(df, *cols: str) -> bool:
    """Whether any of ``cols`` has a value in ``df`` (a heading names only the columns the table shows)."""
    return any(c in df and df[c].notna().any() for c in cols)


def _what(df, parts: list[tuple[str, tuple]]) -> str:
    """The words of ``parts`` ((words, columns)) whose columns hold a value, joined by commas."""
    return ", ".join(w for w, cols in parts if _holds(df, *cols))


def _same_time(op) -> bool:
    """Whether a comm table's kernel time (``time_us``) equals its communication time (``comm_us``) in every row
    (within 0.1 %): one column then says both."""
    if not (_holds(op, "time_us") and _holds(op, "comm_us")):
        return False
    t, c = op["time_us"].astype(float), op["comm_us"].astype(float)
    return bool(((t - c).abs() <= 1e-3 * c.abs().clip(lower=1.0)).all())


def communication_section(a: Analysis, page: Page) -> str:
    out = ['<section id="communication"><h2>Communication</h2>', notes_html(a, "communication")]
    if a.volume is not None and not a.volume.empty:
        out.append("<h3>Per collective: " + esc(_what(a.volume, [
            ("count", ("count",)), ("size", ("bytes",)), ("time", ("time_us",)),
            ("bandwidth (algorithm bandwidth; bus bandwidth with nccl-tests' factors)", ("algbw_gbps", "busbw_gbps"))]))
                   + "</h3>")
        out.append(scope_note(a, "window") + table(a.volume))
    es = a.exposed_stage
    if es is not None and not es.empty:
        keys = [label(f"{value_label('collective', c)} in {s}") for c, s in zip(es["collective"], es["stage"])]
        hidden = es["overlapped_us"] if "overlapped_us" in es else es["us"] * 0.0
        fig = figures.Figure([figures.bar(x=keys, y=hidden / 1e3, name="hidden behind compute",
                                          marker_color="#93c5fd"),
                              figures.bar(x=keys, y=es["us"] / 1e3, name="exposed", marker_color="#dc2626")])
        fig.update_layout(barmode="stack", title="Communication per step, hidden vs exposed (median over ranks of "
                                                 "each rank's mean per step, as the findings)", yaxis_title="ms per step")
        out.append(page.fig(fig, 320))
    if a.comm_phase is not None and not a.comm_phase.empty:
        op = a.comm_phase
        out.append("<h3>Per collective, stage (forward / backward / optimizer, from the CPU op that launched it) "
                   "and FSDP phase: " + esc(_what(op, [("volume", ("bytes",)), ("bandwidth", ("busbw_gbps",)),
                                                       ("overlap with compute", ("overlapped_comm_us",)),
                                                       ("exposed time", ("exposed_comm_us",))])) + "</h3>")
        shown = [c for c in op.columns if not (c == "time_us" and _same_time(op))]
        out.append(scope_note(a, "window") + (many_ranks.comm_phase(a, page) if many_ranks.is_many(a)
                                              else table(op, shown, labels={"time_us": "kernels' summed time"})))
    if a.p2p is not None and not a.p2p.empty:
        out.append("<h3>Point-to-point transfers (send / recv): not matched across ranks, not in skew</h3>")
        out.append(table(a.p2p))
    if a.comm_outside_steps is not None and not a.comm_outside_steps.empty:
        out.append("<h3>Communication launched outside every profiler step (not counted per step)</h3>")
        out.append(table(a.comm_outside_steps))
    if a.overlap_overall is not None and not a.overlap_overall.empty:
        out.append(many_ranks.overlap_per_rank(a, page) if many_ranks.is_many(a)
                   else "<h3>Overall overlap per rank</h3>" + scope_note(a, "window") + table(a.overlap_overall))
    if a.traffic is not None and not a.traffic.empty:
        tr = (a.theory or {}).get("traffic")
        vs = " vs theory" if tr or _holds(a.traffic, "theory_wire_per_step_bytes") else ""
        out.append(f"<h3>Measured volume{vs} (bytes each rank sends per step, ring)</h3>")
        if tr:
            out.append(f'<div class="formula">{esc(tr["label"])}: {esc(tr["formula"])}\n  = {esc(tr["substituted"])}\n'
                       f'  = {esc(fmt_bytes(tr["total_bytes"]))} per rank per step</div>')
        out.append(scope_note(a, "window"))
        out.append(many_ranks.traffic(a, page) if many_ranks.is_many(a)
                   else table(a.traffic, labels={"diff_pct": "measured - formula"}))
    out.append(_lanes_chart(a, page))
    if a.top_ops is not None and not a.top_ops.empty:
        out.append(f"<h3>Operations with the most time in step {esc(fmt_num(a.lanes_step))} of the first rank</h3>")
        out.append(table(a.top_ops, left=("name", "kind")))
    out.append("</section>")
    return "".join(out)
