"""The "At a glance" section: an OOM first, the peak against the formula's model states, exposed communication,
the step's split and the first finding (numbers from fsdpprof.analyze.summary.headline)."""
from __future__ import annotations

from typing import TYPE_CHECKING

from fsdpprof.analyze.summary.headline import step_spread
from fsdpprof.report.memory import devices_analysed, memory_owner
from fsdpprof.report.page import (HOST_TIME, HOST_TIME_WHAT, SPLIT_COLORS, esc, finding_title, fmt_bytes, fmt_pct,
                                  fmt_us, fmt_us_spread, idle_words, step_scope, value_label)

if TYPE_CHECKING:      # (the report's modules stay light: plan and --help import some)
    from fsdpprof.analyze.pipeline import Analysis


def split_bar(parts: list[tuple[str, float, str]]) -> str:
    """A stacked bar in plain HTML (no plotly): parts are (words, percent, color)."""
    parts = [(w, p, c) for w, p, c in parts if p == p and p > 0]
    bar = "".join(f'<div style="width:{p:.2f}%;background:{c}" title="{esc(w)}: {p:.0f}%"></div>' for w, p, c in parts)
    legend = "".join(f'<span class="sw" style="background:{c}"></span>{esc(w)} {fmt_pct(p)}' for w, p, c in parts)
    return f'<div class="split">{bar}</div><div class="legend">{legend}</div>'


def _tile(big: str, what: str, sub: str = "", cls: str = "") -> str:
    return (f'<div class="tile {cls}"><div class="big{" text" if "text" in cls else ""}">{big}</div>'
            f'<div class="what">{what}</div>' + (f'<div class="sub">{sub}</div>' if sub else "") + "</div>")


def _fill_rows(tiles: list[str], columns: int = 3) -> list[str]:
    """Tiles in a grid of ``columns``: the last tile of a row that is not full stretches to its end."""
    spans = [2 if 'class="tile wide' in t else 1 for t in tiles]
    out, col = [], 0
    for i, (t, n) in enumerate(zip(tiles, spans)):
        nxt = spans[i + 1] if i + 1 < len(tiles) else columns + 1
        col += n
        if col < columns and col + nxt > columns:
            t = t.replace('class="tile', f'style="grid-column:span {n + columns - col}" class="tile', 1)
            col = columns
        out.append(t)
        col %= columns
    return out


def oom_line(a: Analysis, o: dict | None) -> str:
    """The out-of-memory error (headline's ``oom``) in one sentence of plain text; "" without one."""
    head, rest = oom_parts(a, o)
    return f"{head}: {rest}" if head else ""


def oom_parts(a: Analysis, o: dict | None) -> tuple[str, str]:
    """:func:`oom_line` as (head, rest): "Out of memory on cuda:1" and what follows; ("", "") without an OOM."""
    if not o:
        return "", ""
    head = f"Out of memory on {memory_owner(a, o['rank'])}"
    at = ", ".join(x for x in ((f"in the {o['stage']}" if o.get("stage") else ""),
                               (f"in {o['unit']}" if o.get("unit") else "")) if x)
    text = (f"{fmt_bytes(o.get('requested_bytes'))} requested"
            + (f" with {fmt_bytes(o.get('free_bytes'))} free ({fmt_bytes(o.get('short_bytes'))} short)"
               if o.get("free_bytes") is not None else "") + (f", {at}" if at else "") + ".")
    if o.get("change"):
        text += (f" First change{' that frees enough' if o.get('enough') else ''}: {o['change']} (saves "
                 f"{fmt_bytes(o.get('saves_bytes'))}" + (f"; what it costs: {o['cost']}" if o.get("cost") else "") + ").")
    return head, text


def glance_section(a: Analysis, h: dict) -> str:
    """The "At a glance" section from headline's dict ``h``."""
    tiles = []
    peak, ms = h["peak_bytes"], h["model_states_theory_bytes"]
    n_ranks = len(a.memory_peaks) if a.memory_peaks is not None else 0
    oom_head, oom = oom_parts(a, h.get("oom"))
    if peak == peak:
        owner = memory_owner(a, h["peak_rank"]) if h.get("peak_rank") is not None else ""
        named = n_ranks > 1 or h.get("peak_device") is not None
        where = (f"{owner}, " if named and owner else "") + (f"in {value_label('stage', h['peak_stage'])}"
                                                             if h.get("peak_stage") else "")
        where = where.rstrip(", ")
        sub = (f"the formula's model states are {esc(fmt_pct(h['model_states_theory_pct_of_peak']))} of it"
               if ms == ms else "no inventory: no formula to compare with")
        what = "peak memory" if devices_analysed(a) else "peak memory per rank"
        tiles.append(_tile(esc(fmt_bytes(peak)), f"{what}{' (' + esc(where) + ')' if where else ''}", sub))
    if ms == ms:
        meas = h["model_states_measured_bytes"]
        tiles.append(_tile(esc(fmt_bytes(ms)), f"model states per rank, {esc(h['model_states_label'])} formula "
                           f"<code>{esc(h['model_states_formula'])}</code>",
                           f"measured {esc(fmt_bytes(meas))}" if meas == meas else ""))
    step = h["step_us"]
    if step == step:
        sp, ex = step_spread(a.steps, "step_us"), step_spread(a.steps, "exposed_comm_us")
        tiles.append(_tile(esc(fmt_pct(h["exposed_comm_pct"])), "of the step is exposed communication",
                           f"{esc(fmt_us_spread(h['exposed_comm_us'], ex['min'], ex['max']))} of a "
                           f"{esc(fmt_us_spread(step, sp['min'], sp['max']))} step ({esc(step_scope(sp))}); "
                           + (f"{esc(fmt_us(h['overlapped_comm_us']))} more hidden behind compute"
                              if h["overlapped_comm_us"] > 0 else "none of it hidden behind compute")))
        host = h["idle_is_host"]
        parts = [("compute", h["compute_pct"], SPLIT_COLORS["compute"]),
                 ("exposed communication", h["exposed_comm_pct"], SPLIT_COLORS["exposed_comm"]),
                 (idle_words(host), h["idle_pct"], SPLIT_COLORS["idle"]),
                 ("copies, memsets, syncs", h["residual_pct"], SPLIT_COLORS["residual"])]
        what = (f"the step's split ({HOST_TIME}: {HOST_TIME_WHAT})" if host else "the step's split on the device")
        tiles.append(_tile("", esc(what), split_bar(parts), cls="wide"))
    if h["first_finding"]:
        more = f" ({h['findings'] - 1} more below)" if h["findings"] > 1 else ""
        tiles.append(_tile(esc(finding_title(h["first_finding"])), f'first finding{esc(more)}: see <a href="#findings">Findings</a>',
                           cls=f"text finding-{esc(h['first_finding_severity'])}"))
    elif step == step or peak == peak:
        tiles.append(_tile("nothing stands out", "no finding crossed its threshold", cls="text"))
    if not tiles and not oom:
        return ""
    first = (f'<div class="banner oom" id="oom-first"><b>{esc(oom_head)}</b>: {esc(oom)} '
             f'<a href="#memory">The error explained, with every change</a></div>' if oom else "")
    return (f'<section id="headline"><h2>At a glance</h2>{first}<div class="tiles">{"".join(_fill_rows(tiles))}</div>'
            f'</section>')
