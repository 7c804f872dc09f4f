"""The page of several runs (compare.html): the verdict, what ZeRO promises (fsdpprof.report.promise), the
memory and step time per run, what changed (fsdpprof.report.diff) and the runs side by side."""
from __future__ import annotations

import pandas as pd

from fsdpprof.analyze.model import MISSING_WORD
from fsdpprof.report import diff, figures, promise
from fsdpprof.report.promise import spread_of
from fsdpprof.report.page import (CATEGORY_COLORS, HOST_TIME, HOST_TIME_WHAT, SPLIT_COLORS, Page, category_label,
                                  column_unit, document, esc, fmt_fixed, fmt_num, fmt_params, fmt_spread, idle_words,
                                  is_missing, label, mem_scale, metric_label, text_table)

SPREAD_ROWS = ("step_us", "exposed_comm_us", "cpu_contention")   # shown with their spread (Comparison.spread)


def scope_words(c) -> str:
    """What the compare page's single numbers are over: the report's rules, the ranks and steps of each run."""
    sp = getattr(c, "spread", None)
    per = []
    if sp is not None and not sp.empty:
        st = sp[sp["metric"] == "step_us"].set_index("run")
        for run in c.labels:
            if run in st.index and st.loc[run, "steps"]:
                r = st.loc[run]
                per.append(f"{run}: {int(r['ranks'])} rank{'s' if r['ranks'] != 1 else ''}, "
                           f"{int(r['steps'])} rank-steps")
    return ("Memory per rank: the rank whose peak is highest (named in the row below). Times per step: each rank's "
            "mean over its steps, then the median over ranks (as the report's headline), in brackets the min–max "
            "over every rank and step" + (f" ({'; '.join(per)})" if per else "") + ". CPU contention: the median "
            "over ranks, in brackets the min–max over ranks (rank.json).")


def compare_host(c) -> bool:
    """True when every run's idle time is host time (CPU runs)."""
    p = c.promise
    return p is None or p.empty or all((d or "cpu") == "cpu" for d in p["device_type"])


def _verdict(c) -> str:
    lines = c.verdict_lines or [c.verdict]
    first, rest = lines[0], lines[1:]
    items = "".join(f"<li>{esc(x)}</li>" for x in rest)
    noise = "".join(f'<p class="note"><b>Noise:</b> {esc(x)}</p>' for x in getattr(c, "noise", None) or [])
    return (f'<section id="verdict"><h2>Verdict</h2><p class="verdict">{esc(first)}</p>'
            + (f'<ul class="costs">{items}</ul>' if items else "") + noise + "</section>")


def _compare_time(c, page: Page) -> str:
    tm = c.time
    if tm is None or tm.empty:
        return ""
    host = compare_host(c)
    fig = figures.Figure()
    for col, name, color in (("compute_us", "compute", SPLIT_COLORS["compute"]),
                             ("exposed_comm_us", "exposed communication", SPLIT_COLORS["exposed_comm"]),
                             ("idle_us", idle_words(host), SPLIT_COLORS["idle"])):
        if col in tm:
            fig.add_trace(figures.bar(x=[label(x) for x in tm["run"]], y=tm[col] / 1e3, name=name, marker_color=color))
    lo_hi = [spread_of(c, r, "step_us") for r in tm["run"]]
    if any(not is_missing(lo) for lo, _ in lo_hi):
        fig.add_trace(figures.scatter(
            x=[label(x) for x in tm["run"]], y=tm["step_us"] / 1e3, mode="markers", name="step (min–max)",
            marker=dict(color="#111", symbol="line-ew-open", size=14),
            error_y=dict(type="data", symmetric=False, array=[(hi - v) / 1e3 for (_, hi), v in zip(lo_hi, tm["step_us"])],
                         arrayminus=[(v - lo) / 1e3 for (lo, _), v in zip(lo_hi, tm["step_us"])])))
    fig.update_layout(barmode="relative", title="Step time (each rank's mean per step, median over ranks; bars: "
                                             "min–max over ranks and steps)", yaxis_title="ms")
    words = (f"On CPU traces {HOST_TIME} is {HOST_TIME_WHAT}: time of the step covered by no operator and no "
             "collective." if host else "Idle: time of the step in which the device ran nothing.")
    return f'<section id="time"><h2>Step time</h2>{page.fig(fig, 360)}<p class="note">{esc(words)}</p></section>'


def shown_rows(c) -> list[tuple]:
    """The rows of the side-by-side table that say something: (metric, value per run)."""
    out = []
    for metric, *vals in c.table.itertuples(index=False, name=None):
        if all(is_missing(v) for v in vals):
            continue      # measured in no run (CPU contention of accelerator runs, memory of traces without it)
        if metric.startswith("peak_") and metric.endswith("_bytes") and metric != "peak_allocated_bytes" and all(
                is_missing(v) or not v for v in vals):
            continue      # a category no run has at its peak
        out.append((metric, vals))
    return out


def _compare_table(c) -> str:
    t = c.table
    runs = list(t.columns[1:])
    host = compare_host(c)
    byte_rows = t[[column_unit(m) == "bytes" for m in t["metric"]]]
    max_bytes = pd.to_numeric(byte_rows[runs].stack(), errors="coerce").max() if len(byte_rows) else float("nan")
    rows = []
    for metric, vals in shown_rows(c):
        unit = column_unit(metric)
        if metric in SPREAD_ROWS:
            scale, unit_text = (1e3, "ms") if unit == "time" else (1.0, "×")
            cells = [fmt_spread(v, *spread_of(c, r, metric), scale=scale) for r, v in zip(runs, vals)]
            name = metric_label(metric, unit_text, host)
        elif metric in ("framework", "strategy") or unit is None:
            cells = ["" if is_missing(v) else fmt_params(v) if metric == "psi" else str(v).upper()
                     if metric == "framework" else v if isinstance(v, str) else fmt_num(v) for v in vals]
            name = metric_label(metric)
        else:
            scale, unit_text = mem_scale(max_bytes) if unit == "bytes" else (1e3, "ms") if unit == "time" else (1.0, "")
            cells = [fmt_fixed(v / scale) if not is_missing(v) else MISSING_WORD if unit == "bytes" else "" for v in vals]
            name = metric_label(metric, unit_text, host)
        rows.append([name, *cells])
    return (f'<section id="table"><h2>Runs side by side</h2><p class="note">{esc(scope_words(c))}</p>'
            + text_table(["metric", *runs], rows, row_heads=True)
            + '<p class="note">By role, the categories of every strategy add up: params are FSDP\'s sharded and '
            "gathered params or DDP's whole ones, grads alike; the roles add up to the peak. Formulas with each "
            "run's numbers. The same numbers are in compare.json.</p></section>")


def _compare_memory(c, page: Page) -> str:
    """Kept for pages without a promise table (no inventory): the memory at the peak by category."""
    cats = c.categories
    p = c.promise
    if (p is not None and not p.empty and p["model_states_theory_bytes"].notna().any()) or cats is None or cats.empty:
        return ""
    fig = figures.Figure()
    sc, unit = mem_scale(cats.groupby("run")["bytes"].sum().max())
    for cat, g in cats.groupby("category", observed=True):
        fig.add_trace(figures.bar(x=[label(x) for x in g["run"]], y=g["bytes"] / sc, name=label(category_label(cat)),
                             marker_color=CATEGORY_COLORS.get(str(cat))))
    fig.update_layout(barmode="relative", title="Memory at the peak by category (the rank with the highest peak)",
                      yaxis_title=unit)
    return f'<section id="memory"><h2>Peak memory by category</h2>{page.fig(fig, 380)}</section>'


COMPARE_NAV = [("verdict", "Verdict"), ("promise", "ZeRO: promised and measured"), ("memory", "Memory"),
               ("time", "Step time"), ("diff", "What changed"), ("table", "Side by side")]


def render_compare(c, plotly_src: str | None = None) -> str:
    """The HTML of a Comparison (fsdpprof.analyze.compare.runs.compare_analyses): one function per section; plotly.js
    embedded, or loaded from ``plotly_src`` beside the page (see :class:`fsdpprof.report.page.Page`)."""
    page = Page(plotly_src)
    warn = "".join(f'<div class="banner">{esc(w)}</div>' for w in c.warnings)
    sections = [warn, _verdict(c), promise.promise_section(c, page), _compare_memory(c, page), _compare_time(c, page),
                diff.render_diff(c, page), _compare_table(c)]
    body = "".join(sections)
    nav = [(i, t) for i, t in COMPARE_NAV if f'id="{i}"' in body]
    ctx = " · ".join(c.labels)
    return document(f"fsdpprof compare: {len(c.labels)} runs", " | ".join(c.paths), nav, body, ctx)
