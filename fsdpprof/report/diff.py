"""The "What changed" section of compare.html and its terminal lines: each run against the baseline (the first
run), from ``Comparison.diff`` (:class:`fsdpprof.analyze.compare.diff.Diff`)."""
from __future__ import annotations

import math

import pandas as pd

from fsdpprof.analyze import model
from fsdpprof.analyze.compare.diff import NO_UNIT
from fsdpprof.analyze.model import MISSING_WORD, ROOT_UNIT, ROOT_UNIT_TEXT
from fsdpprof.report import figures
from fsdpprof.report.page import (NO_UNIT_TEXT, category_label, column_scale, esc, fmt_bytes, fmt_fixed, fmt_num,
                                  fmt_us, is_missing, label, role_label, value_label)

TOP_ROWS = 50          # rows per table in the page (compare.json has them all)
SHOWN_ROWS = 10        # of which shown at first, the largest changes; the rest under "show all N"
NAME_CHARS = 90        # operator / kernel names shown in tables (the full name on hover)

STEP_LABELS = {"step_us": "step", "compute_us": "compute", "comm_us": "communication",
               "exposed_comm_us": "exposed communication", "idle_us": "idle / host time"}
CHANGE_TEXT = {"added": "added (only in the run)", "deleted": "deleted (only in the baseline)",
               "increased": "increased (more calls)", "decreased": "decreased (fewer calls)",
               "unchanged": "unchanged count"}


def _signed(fmt, x) -> str:
    """A difference with its sign: +1.20 ms, -3.0 MiB, 0."""
    if is_missing(x):
        return ""
    x = float(x)
    if x == 0:
        return "0"
    return ("+" if x > 0 else "-") + fmt(abs(x))


# formatters of a column shown in one unit (its largest value's): bytes or times, plain or as signed changes
_ONE_UNIT = {"time": ("time", False), "+time": ("time", True), "bytes": ("bytes", False), "+bytes": ("bytes", True)}


def _in_one_unit(df: pd.DataFrame, col: str, head: str, spec):
    """(column, header with the unit, formatter) of a ``_table`` column: a spec of _ONE_UNIT becomes one unit for
    the whole column (a size the input lacks: "unknown"); any other spec is kept."""
    if not isinstance(spec, str) or spec not in _ONE_UNIT:
        return col, head, spec
    unit, signed = _ONE_UNIT[spec]
    scale, unit_text = column_scale(unit, df[col] if col in df else [])

    def fmt(v) -> str:
        if is_missing(v):
            return MISSING_WORD if unit == "bytes" else ""
        v = float(v)
        if not signed:
            return fmt_fixed(v / scale)
        return "0" if v == 0 else ("+" if v > 0 else "-") + fmt_fixed(abs(v) / scale)
    return col, f"{head} ({unit_text})" if head else unit_text, fmt


def _pct(x) -> str:
    return "" if is_missing(x) or not math.isfinite(float(x)) else f"{float(x):+.1f}%"


def _count(x) -> str:
    """A count as a whole number (a median over ranks of counts is rounded to whole calls, half up)."""
    return fmt_num(math.floor(float(x) + 0.5)) if not is_missing(x) else ""


def _table(df: pd.DataFrame, cols: list[tuple[str, str, object]], rows: int = TOP_ROWS,
           shown: int = SHOWN_ROWS) -> str:
    """cols: (column, header, formatter, or 'name': shortened, the full name on hover, or 'text'). The first
    ``shown`` rows are the table; the rest, up to ``rows``, follow under a ``<details>`` "show all N"."""
    if df is None or not len(df):
        return '<p class="note">no rows</p>'
    cols = [_in_one_unit(df.head(rows), c, h, f) for c, h, f in cols]
    head = "".join(f'<th class="{"l" if f in ("name", "text") else ""}">{esc(h)}</th>' for _, h, f in cols)

    def td(v, f) -> str:
        if f == "name":
            s = "" if v is None else str(v)
            short = s if len(s) <= NAME_CHARS else s[:NAME_CHARS - 3] + "..."
            return f'<td class="l" title="{esc(s)}">{esc(short)}</td>'
        if f == "text":
            return f'<td class="l" style="white-space:nowrap">{esc("" if is_missing(v) else v)}</td>'
        return f'<td style="white-space:nowrap">{esc(f(v))}</td>'
    body = ["<tr>" + "".join(td(rec.get(c), f) for c, _, f in cols) + "</tr>"
            for rec in df.head(rows).to_dict("records")]
    out = f"<table><tr>{head}</tr>{''.join(body[:shown])}</table>"
    rest = body[shown:]
    if rest:
        n = len(df)
        what = f"show all {n}" if n <= rows else f"show the top {rows} of {n} (all {n} in compare.json)"
        more = f'<p class="note">{n - rows} more rows in compare.json</p>' if n > rows else ""
        out += (f"<details><summary>{esc(what)}</summary><table><tr>{head}</tr>{''.join(rest)}</table>{more}"
                "</details>")
    return out


def _unit_text(u) -> str:
    if is_missing(u) or u == NO_UNIT:
        return NO_UNIT_TEXT
    return ROOT_UNIT_TEXT if u == ROOT_UNIT else str(u)


def _words(df: pd.DataFrame, *cols: str) -> pd.DataFrame:
    """The frame with its vocabulary columns in words; a key the diff filled in for a missing one is empty."""
    return df.assign(**{c: df[c].map(lambda v, c=c: "" if v == NO_UNIT else value_label(c, v)) for c in cols if c in df})


def _steps_html(s: pd.DataFrame, run: str, base: str, page) -> str:
    if s is None or not len(s):
        return '<p class="note">no step decomposition on one side</p>'
    s = s.assign(metric_text=s["metric"].map(lambda m: STEP_LABELS.get(m, m)))
    tab = _table(s, [("metric_text", "", "text"), ("baseline_us", base, "time"), ("run_us", run, "time"),
                     ("diff_us", "change", "+time"), ("diff_pct", "change %", _pct)],
                 shown=TOP_ROWS)
    parts = s[s["metric"].isin(["compute_us", "exposed_comm_us", "idle_us", "step_us"])]
    fig = figures.Figure(figures.bar(x=(parts["diff_us"] / 1e3).tolist(), y=[label(x) for x in parts["metric_text"]],
                           orientation="h", marker_color=["#dc2626" if v > 0 else "#16a34a" for v in parts["diff_us"]]))
    fig.update_layout(title="Change against the baseline", xaxis_title="ms", yaxis=dict(autorange="reversed"))
    return f'<div style="display:flex;flex-wrap:wrap;gap:18px"><div>{tab}</div>' \
           f'<div style="flex:1;min-width:360px">{page.fig(fig, 240)}</div></div>'


def _comm_html(c: pd.DataFrame) -> str:
    if c is None or not len(c):
        return '<p class="note">no collectives on either side</p>'
    c = _words(c, "collective", "stage", "fsdp_phase").assign(unit_text=c["unit"].map(_unit_text),
                 _order=(c["diff_exposed_comm_us"].abs() + c["diff_comm_us"].abs()))
    c = c.sort_values("_order", ascending=False, kind="stable")
    return _table(c, [
        ("collective", "collective", "text"), ("stage", "stage", "text"), ("fsdp_phase", "FSDP phase", "text"),
        ("unit_text", "unit", "text"), ("baseline_count", "count (base)", _count), ("run_count", "count (run)", _count),
        ("baseline_bytes", "size (base)", "bytes"), ("run_bytes", "size (run)", "bytes"),
        ("baseline_comm_us", "comm time (base)", "time"), ("run_comm_us", "comm time (run)", "time"),
        ("diff_comm_us", "change", "+time"),
        ("baseline_exposed_comm_us", "exposed (base)", "time"), ("run_exposed_comm_us", "exposed (run)", "time"),
        ("diff_exposed_comm_us", "exposed change", "+time")])


OPS_COLS = [("name", "operator / kernel", "name"), ("kind", "kind", "text"),
            ("baseline_count", "calls per step (base)", _count), ("run_count", "calls per step (run)", _count),
            ("diff_count", "calls change", lambda v: _signed(_count, v)),
            ("baseline_total_us", "total (base)", "time"), ("run_total_us", "total (run)", "time"),
            ("diff_total_us", "time added", "+time")]


def _ops_html(o: pd.DataFrame) -> str:
    if o is None or not len(o):
        return '<p class="note">no operators or kernels on either side</p>'
    o = _words(o, "kind")
    counts = o["change"].value_counts()
    tc = o["time_change"].value_counts()
    summary = ", ".join(f"{int(counts.get(k, 0))} {v}" for k, v in CHANGE_TEXT.items())
    out = [f"<p>{esc(summary)}; {int(tc.get('slower', 0))} take more time, {int(tc.get('faster', 0))} less "
           f"(categories as HTA's TraceDiff.ops_diff: by number of calls).</p>"
           '<p class="note">Total time per name, as HTA counts it: CPU operators nest, so a parent\'s time '
           "includes its children's; GPU kernels do not nest. Calls per step: the median over ranks of each "
           "rank's calls per step, rounded to whole calls.</p>"]
    slower = o[o["diff_total_us"] > 0]
    faster = o[o["diff_total_us"] < 0].sort_values("diff_total_us", kind="stable")
    out.append("<h4>Adding the most time</h4>" + _table(slower, OPS_COLS))
    out.append("<h4>Saving the most time</h4>" + _table(faster, OPS_COLS))
    for cat in ("added", "deleted"):
        sub = o[o["change"] == cat]
        if len(sub):
            sub = sub.reindex(sub["diff_total_us"].abs().sort_values(ascending=False, kind="stable").index)
            out.append(f"<h4>{esc(CHANGE_TEXT[cat].capitalize())}</h4>" + _table(sub, OPS_COLS))
    return "".join(out)


def with_peak(roles: pd.DataFrame) -> pd.DataFrame:
    """The roles' table (role: baseline_/run_/diff_ bytes) with their total, the peak, as a last row."""
    cols = ["baseline_bytes", "run_bytes", "diff_bytes"]
    total = pd.DataFrame([{"role_text": "peak (the roles' sum)", **roles[cols].sum().to_dict()}])
    return pd.concat([roles.assign(role_text=roles["role"].map(role_label)), total], ignore_index=True)


def _memory_html(m: pd.DataFrame, u: pd.DataFrame, roles: pd.DataFrame | None = None) -> str:
    if m is None or not len(m):
        return '<p class="note">memory at the peak: not on both sides</p>'
    m = m[(m["baseline_bytes"] != 0) | (m["run_bytes"] != 0)]
    change = ("diff_bytes", "change", "+bytes")
    out = []
    if roles is not None and len(roles):
        out.append("<h4>By role (every strategy alike; they add up to the peak)</h4>" + _table(with_peak(roles), [
            ("role_text", "role", "text"), ("baseline_bytes", "base", "bytes"), ("run_bytes", "run", "bytes"),
            change], shown=TOP_ROWS) + "<h4>By category</h4>")
    m = m.assign(category_text=m["category"].map(category_label))
    out.append(_table(m, [("category_text", "category", "text"), ("baseline_bytes", "base", "bytes"),
                          ("run_bytes", "run", "bytes"), change], shown=TOP_ROWS))
    if u is not None and len(u):
        u = u.assign(unit_text=u["unit"].map(_unit_text), category=u["category"].map(category_label))
        u = u.reindex(u["diff_bytes"].abs().sort_values(ascending=False, kind="stable").index)
        u = u[u["diff_bytes"] != 0]
        out.append("<h4>By unit</h4>" + _table(u, [
            ("unit_text", "unit", "text"), ("category", "category", "text"), ("baseline_bytes", "base", "bytes"),
            ("run_bytes", "run", "bytes"), ("diff_bytes", "change", "+bytes")]))
    return "".join(out)


def _of(df, run: str):
    """The rows of ``run`` (None when there are none)."""
    return df[df["run"] == run] if df is not None and len(df) else None


def render_diff(c, page) -> str:
    """The "What changed" section of compare.html; "" for a Comparison without a diff."""
    d = getattr(c, "diff", None)
    if d is None:
        return ""
    out = [f'<section id="diff"><h2>What changed against {esc(d.baseline)}</h2>']
    out += [f'<p class="note">{esc(n)}</p>' for n in getattr(c, "notes", []) or []]
    per_run = "".join(f"<li>{esc(x)}</li>" for x in d.scope.get("per_run") or [])
    ranks = d.scope.get("memory_ranks") or {}
    mem = "; ".join(f"{esc(k)}: rank {v}" for k, v in ranks.items() if v is not None)
    out.append(f"<p>Scope: {esc(d.scope.get('text'))}. Every number below is the run's minus the baseline's "
               f"(a group absent on one side counts 0).</p><ul>{per_run}</ul>"
               + '<p class="note">' + (f"Memory at the peak: the rank whose peak is highest in the scope ({mem}). "
                                       if mem else "")
               + "The step decomposition under per-step medians: each rank's mean over its steps, the median over "
                 "ranks (as the report's headline and the side-by-side table).</p>")
    for run in [lab for lab in c.labels if lab != d.baseline]:
        out.append(f"<h3>{esc(run)} against {esc(d.baseline)}</h3>")
        out.append("<h4>Step decomposition</h4>" + _steps_html(_of(d.steps, run), run, d.baseline, page))
        crit = _of(getattr(d, "critical", None), run)
        if crit is not None and len(crit):
            out.append("<h4>What limits the step (critical path, mean per step over all steps)</h4>" + _table(
                crit.assign(kind=crit["kind"].map(model.PATH_KIND_WORDS).fillna(crit["kind"])),
                [("kind", "kind", "text"), ("baseline_us", d.baseline, fmt_us), ("run_us", run, fmt_us),
                 ("diff_us", "change", lambda v: _signed(fmt_us, v))]))
        out.append("<h4>Communication per collective, stage, FSDP phase and unit</h4>" + _comm_html(_of(d.comm, run)))
        out.append("<h4>Operators and kernels</h4>" + _ops_html(_of(d.ops, run)))
        out.append("<h4>Memory at the peak</h4>" + _memory_html(_of(d.memory, run), _of(d.memory_units, run),
                                                                 _of(getattr(d, "memory_roles", None), run)))
    out.append("</section>")
    return "".join(out)


def diff_text(c) -> str:
    """The diff in the terminal: per run the step's change and the largest communication, operator and memory
    changes."""
    d = getattr(c, "diff", None)
    if d is None:
        return ""
    lines = [f"changes against {d.baseline} ({d.scope.get('text')}):"]
    lines += [f"  note: {n}" for n in getattr(c, "notes", []) or []]
    for run in [lab for lab in c.labels if lab != d.baseline]:
        lines.append(f"  {run}:")
        s, cm, o, m = (_of(x, run) for x in (d.steps, d.comm, d.ops, d.memory_roles))
        if s is not None and len(s):
            lines.append("    step: " + ", ".join(f"{STEP_LABELS.get(r['metric'], r['metric'])} "
                                                   f"{_signed(fmt_us, r['diff_us'])} ({_pct(r['diff_pct'])})"
                                                   for r in s.to_dict("records")))
        cr = _of(getattr(d, "critical", None), run)
        if cr is not None and len(cr):
            lines.append("    critical path per step: " + ", ".join(
                f"{model.PATH_KIND_WORDS.get(r['kind'], r['kind'])} {_signed(fmt_us, r['diff_us'])}"
                for r in cr.to_dict("records") if r["diff_us"]))
        if cm is not None and len(cm):
            r = cm.loc[cm["diff_exposed_comm_us"].abs().idxmax()]
            where = ", ".join(x for x in (value_label("collective", r["collective"]),
                                          f"in {value_label('stage', r['stage'])}" if not is_missing(r["stage"]) else "",
                                          "" if r["fsdp_phase"] == NO_UNIT else value_label("fsdp_phase", r["fsdp_phase"]),
                                          _unit_text(r["unit"])) if x)
            lines.append(f"    communication: largest change in exposed time: {where} "
                         f"{_signed(fmt_us, r['diff_exposed_comm_us'])}")
        if o is not None and len(o):
            n = o["change"].value_counts()
            line = "    operators: " + ", ".join(f"{int(n.get(k, 0))} {k}" for k in CHANGE_TEXT)
            top, low = o.iloc[0], o.iloc[-1]
            if top["diff_total_us"] > 0:
                line += f"; adds most time: {str(top['name'])[:60]} {_signed(fmt_us, top['diff_total_us'])}"
            if low["diff_total_us"] < 0:
                line += f"; saves most: {str(low['name'])[:60]} {_signed(fmt_us, low['diff_total_us'])}"
            lines.append(line)
        if m is not None and len(m):
            lines.append(f"    memory at the peak: {_signed(fmt_bytes, m['diff_bytes'].sum())} = "
                         + ", ".join(f"{role_label(r['role']).split(' (')[0]} {_signed(fmt_bytes, r['diff_bytes'])}"
                                     for r in m.to_dict("records") if r["diff_bytes"]))
    return "\n".join(lines)
