"""Self-contained HTML rendering of an Analysis (one run) or a Comparison (several runs).

Rendering only: every number comes from ``fsdpprof.analyze`` (the headline from
:func:`fsdpprof.analyze.headline.headline`). plotly.js is embedded once per page (works with no
network). Every string that may come from a trace goes through ``esc`` (html.escape) in tables and
text, and through ``label`` in plot labels; plotly's JSON in <script> escapes ``</`` itself.

What a person reads: the words for columns, metrics and categories live in one place here
(COLUMN_LABELS, CATEGORY_LABELS, METRIC_LABELS); tables pick one unit per column (MiB, ms, %) from
the column's name and values, so summary.json keeps its keys (``*_bytes``, ``*_us``, ``*_pct``)
while the page shows "peak allocated (MiB)". A page is a list of sections, one function each
(``_memory(a, page)`` ...), called from :func:`render_report` / :func:`render_compare`.
"""
from __future__ import annotations

import html
import math
import re

import pandas as pd

from fsdpprof import __version__
from fsdpprof.analyze import vocab
from fsdpprof.analyze.headline import headline, peak_rank
from fsdpprof.report import figures
from fsdpprof.report.outputs import generator_meta

MIB = float(2**20)
CATEGORY_COLORS = {
    "sharded_param": "#1f77b4", "param": "#1f77b4", "unsharded_param": "#aec7e8", "sharded_grad": "#ff7f0e",
    "grad": "#ff7f0e", "unsharded_grad": "#ffbb78", "optimizer_state": "#2ca02c", "activation": "#d62728",
    "temporary": "#9467bd", "input": "#8c564b", "before_recording": "#bcbd22", "other": "#7f7f7f",
}
KIND_COLORS = {"compute": "#1f77b4", "cpu_op": "#1f77b4", "comm": "#d62728", "memcpy": "#2ca02c",
               "memset": "#17becf", "sync": "#7f7f7f"}
SPLIT_COLORS = {"compute": "#1f77b4", "exposed_comm": "#dc2626", "idle": "#d1d5db", "residual": "#fde68a"}

# --- words and units: the one place for what the page calls things ---------------------------------
CATEGORY_LABELS = {
    "sharded_param": "sharded params", "unsharded_param": "gathered params",
    "sharded_grad": "sharded grads", "unsharded_grad": "unsharded grads",
    "param": "params", "grad": "grads", "optimizer_state": "optimizer states", "activation": "activations",
    "temporary": "temporaries", "input": "inputs", "before_recording": "allocated before recording",
    "other": "other",
}
KIND_LABELS = {"compute": "compute", "cpu_op": "CPU operator", "comm": "communication", "memcpy": "memory copy",
               "memset": "memset", "sync": "synchronisation", "annotation": "annotation"}
COLUMN_LABELS = {
    # memory
    "peak_allocated_bytes": "peak allocated", "peak_stage": "stage at the peak", "peak_fsdp_phase": "FSDP phase at the peak",
    "baseline_bytes": "allocated before the window", "coverage_pct": "attributed", "reserved_bytes": "reserved",
    "fragmentation_pct": "fragmentation", "source": "memory source", "addr": "address", "alloc_us": "allocated at",
    "free_us": "freed at", "frames": "allocated by", "category": "category", "unit": "FSDP unit",
    "role": "model state", "measured_bytes": "measured", "theory_bytes": "formula", "diff_bytes": "measured - formula",
    "diff_pct": "difference", "label": "strategy", "formula": "formula (per rank)", "param_bytes": "params",
    "grad_bytes": "grads", "optimizer_state_bytes": "optimizer states", "total_bytes": "model states per rank",
    "traffic_bytes": "traffic per rank per step",
    # communication
    "collective": "collective", "count": "count", "bytes": "size", "time_us": "time", "algbw_gbps": "algorithm bandwidth",
    "busbw_gbps": "bus bandwidth", "stage": "stage", "fsdp_phase": "FSDP phase", "comm_us": "communication",
    "overlapped_comm_us": "hidden behind compute", "exposed_comm_us": "exposed communication",
    "overlap_pct": "hidden behind compute", "comp_comm_overlap_pct": "communication hidden behind compute",
    "payload_bytes": "payload", "wire_bytes": "on the wire", "steps": "steps", "payload_per_step_bytes": "payload per step",
    "wire_per_step_bytes": "on the wire per step", "theory_wire_per_step_bytes": "formula per step",
    "name": "name", "kind": "kind", "total_us": "total time", "max_us": "longest", "step": "step", "rank": "rank",
    # steps
    "step_us": "step", "compute_us": "compute", "idle_us": "idle", "residual_us": "copies, memsets, syncs only",
    "model_step_us": "T_comp + T_comm - T_overlap", "unexplained_us": "step - formula",
    # ranks
    "pg": "process group", "seq": "sequence number", "n_ranks": "ranks", "start_skew_us": "start skew",
    "end_skew_us": "end skew", "last_rank": "last to arrive", "times_last": "times last", "share_last_pct": "share last",
    "mean_start_lag_us": "mean start lag", "clock_offset_us": "clock offset",
    # device
    "span_us": "span", "idle_time_us": "idle", "compute_time_us": "compute", "non_compute_time_us": "non-compute",
    "idle_time_pct": "idle", "compute_time_pct": "compute", "non_compute_time_pct": "non-compute",
    "kernel_type": "kernel type", "pct": "share", "sum_us": "total time", "mean_us": "mean", "min_us": "shortest",
    "std_us": "standard deviation", "type_pct": "share of its type", "stream": "stream", "idle_category": "cause",
    # compare
    "run": "run", "strategy": "strategy", "world_size": "N (ranks)", "shard_group_size": "shard group",
    "exposed_comm_pct": "of the step",
}
# host time on a CPU trace: what "idle" is when the profiler sees operators only
HOST_TIME = "host time outside operators"
HOST_TIME_WHAT = "Python, the dispatcher, FSDP's hooks"
VALUE_COLUMNS = frozenset({"category", "collective", "role", "fsdp_phase", "peak_fsdp_phase", "kind", "idle_category",
                           "stage", "peak_stage", "source"})
NAME_COLUMNS = frozenset({"name", "frames"})
NAME_MAX = 64   # characters of a trace name shown in tables and charts (the full name on hover)


def esc(x) -> str:
    """HTML-escape any value for text and attributes."""
    return html.escape("" if x is None else str(x), quote=True)


def label(x) -> str:
    """A string from a trace, made safe for plotly's pseudo-HTML labels."""
    return html.escape("" if x is None else str(x), quote=False)


def _isnan(x) -> bool:
    try:
        return x is None or (isinstance(x, float) and math.isnan(x)) or pd.isna(x)
    except (TypeError, ValueError):
        return False


def category_label(c) -> str:
    """A memory category as the page says it ("optimizer states")."""
    return CATEGORY_LABELS.get(str(c), str(c).replace("_", " "))


def value_label(col: str, v) -> str:
    """A vocabulary value in a table cell: memory categories in words, all_gather -> all-gather, snake_case
    words spaced; anything else unchanged."""
    if _isnan(v):
        return "-"
    s = str(v)
    if col == "category":
        return category_label(s)
    if col == "kind":
        return KIND_LABELS.get(s, s)
    if col == "collective":
        return s.replace("_", "-")
    if col == "role":
        return category_label(s)
    return s.replace("_", " ") if re.fullmatch(r"[a-z0-9_]+", s) else s


def short_name(name, limit: int = NAME_MAX) -> str:
    """A long trace name (templated C++ kernels span lines) shortened for tables and charts: no leading
    ``void``, no argument list, template arguments folded to ``<…>``, then cut at ``limit`` characters."""
    s = " ".join(str(name).split())
    if len(s) <= limit:
        return s
    if " < " in s:                            # a call stack (innermost first): its first frame
        return short_name(s.split(" < ", 1)[0], limit - 4) + " < …"
    if s.startswith("void "):
        s = s[5:]
    for _ in range(2):                        # a signature (and a "(file:line)"): drop the last (...) group
        if not s.endswith(")"):
            break
        depth = 0
        for i in range(len(s) - 1, 0, -1):
            depth += {")": 1, "(": -1}.get(s[i], 0)
            if depth == 0:
                s = s[:i].rstrip()
                break
    out, depth = [], 0
    for i, ch in enumerate(s):               # fold template arguments that follow an identifier
        if ch == "<" and (depth or (i > 0 and (s[i - 1].isalnum() or s[i - 1] in "_:"))):
            if depth == 0:
                out.append("<…>")
            depth += 1
        elif ch == ">" and depth:
            depth -= 1
        elif depth == 0:
            out.append(ch)
    s = "".join(out).strip()
    return s if len(s) <= limit else s[: limit - 1] + "…"


def hover_name(name, width: int = 100) -> str:
    """The full name for a chart's hover, escaped, wrapped every ``width`` characters."""
    s = " ".join(str(name).split())
    return "<br>".join(label(s[i:i + width]) for i in range(0, len(s), width)) or "-"


# --- numbers --------------------------------------------------------------------------------------
def fmt_fixed(x) -> str:
    """A number at a sensible precision: 1,234 / 12.3 / 1.23 / 0.123; 0 as 0."""
    if _isnan(x):
        return "-"
    x = float(x)
    a = abs(x)
    if a == 0:
        return "0"
    if a >= 100:
        return f"{x:,.0f}"
    if a >= 10:
        return f"{x:.1f}"
    if a >= 1:
        return f"{x:.2f}"
    if a >= 0.001:
        return f"{x:.3f}"
    return "<0.001" if x > 0 else ">-0.001"


fmt_bytes = vocab.fmt_bytes      # (one formatter for bytes: vocab's)


def fmt_us(x) -> str:
    """A time given in µs, in s, ms or µs."""
    if _isnan(x):
        return "-"
    x = float(x)
    if x == 0:
        return "0 ms"
    if abs(x) >= 1e6:
        return f"{fmt_fixed(x / 1e6)} s"
    if abs(x) >= 1e3:
        return f"{fmt_fixed(x / 1e3)} ms"
    return f"{fmt_fixed(x)} µs"


def fmt_pct(x) -> str:
    return "-" if _isnan(x) else f"{float(x):.0f}%" if abs(float(x)) >= 10 else f"{float(x):.1f}%"


def fmt_num(x, digits: int = 4) -> str:
    if _isnan(x):
        return "-"
    if isinstance(x, (int,)) or (isinstance(x, float) and x.is_integer() and abs(x) < 1e15):
        return f"{int(x):,}"
    try:
        return f"{float(x):.{digits}g}"
    except (TypeError, ValueError):
        return str(x)


def fmt_params(x) -> str:
    """A parameter count: 3.66 M."""
    if _isnan(x):
        return "-"
    x = float(x)
    for div, word in ((1e12, "T"), (1e9, "B"), (1e6, "M"), (1e3, "k")):
        if abs(x) >= div:
            return f"{x / div:.3g} {word}"
    return f"{x:.0f}"


def mem_scale(max_bytes) -> tuple[float, str]:
    """The unit of a memory chart or table whose largest value is ``max_bytes``: GiB from 10 GiB, else MiB."""
    return (2.0**30, "GiB") if not _isnan(max_bytes) and float(max_bytes) >= 10 * 2**30 else (MIB, "MiB")


def column_unit(col: str) -> str | None:
    """What a column's name says its values are: bytes, time (µs), pct, gbps, or None."""
    if col.endswith("_bytes") or col == "bytes":
        return "bytes"
    if col.endswith("_us"):
        return "time"
    if col.endswith("_pct") or col == "pct":
        return "pct"
    if col.endswith("_gbps"):
        return "gbps"
    return None


BYTE_UNITS = ((2.0**30, "GiB"), (2.0**20, "MiB"), (2.0**10, "KiB"), (1.0, "B"))


def _scale_for(unit: str, values) -> tuple[float, str]:
    """One unit for a whole column (from its largest value): bytes in GiB/MiB/KiB, times in s/ms/µs."""
    vals = [abs(float(v)) for v in values if not _isnan(v)]
    top = max(vals) if vals else 0.0
    if unit == "bytes":
        if top >= 10 * 2**30:
            return 2.0**30, "GiB"
        if top >= 2**20 or top == 0:
            return 2.0**20, "MiB"
        return (2.0**10, "KiB") if top >= 2**10 else (1.0, "B")
    if unit == "time":
        if top >= 100e6:
            return 1e6, "s"
        return (1e3, "ms") if top >= 100 or top == 0 else (1.0, "µs")
    if unit == "pct":
        return 1.0, "%"
    if unit == "gbps":
        return 1.0, "GB/s"
    return 1.0, ""


def column_label(col: str, unit_text: str = "") -> str:
    """The header of a column: its words (COLUMN_LABELS, else the name without its unit suffix and
    underscores) and the unit in brackets."""
    base = COLUMN_LABELS.get(col)
    if base is None:
        base = re.sub(r"_(bytes|us|pct|gbps)$", "", col).replace("_", " ")
    return f"{base} ({unit_text})" if unit_text else base


def fmt_cell(col: str, v) -> str:
    """One value of column ``col`` with its own unit (fsdpprof 0.1's per-cell formatting; tables use one
    unit per column)."""
    if isinstance(v, (list, tuple, dict)):
        return str(v)
    if col == "addr" and not _isnan(v):
        try:
            return hex(int(v))
        except (TypeError, ValueError):
            return str(v)
    unit = column_unit(col)
    if unit == "bytes":
        return fmt_bytes(v)
    if unit == "time":
        return fmt_us(v)
    if unit == "pct":
        return fmt_pct(v)
    if unit == "gbps":
        return "-" if _isnan(v) else f"{float(v):.3g} GB/s"
    if col in VALUE_COLUMNS:
        return value_label(col, v)
    if isinstance(v, float):
        return fmt_num(v)
    if isinstance(v, int) and not isinstance(v, bool) and abs(v) >= 10000:
        return f"{v:,}"
    return "-" if _isnan(v) else str(v)


def _numeric(s: pd.Series) -> bool:
    return pd.api.types.is_numeric_dtype(s) and not pd.api.types.is_bool_dtype(s)


def _plain_cell(col: str, v, scale: float, unit: str | None) -> str:
    if isinstance(v, (list, tuple, dict)):
        return str(v)
    if _isnan(v):
        return "-"
    if col == "addr":
        try:
            return hex(int(v))
        except (TypeError, ValueError):
            return str(v)
    if unit == "pct":
        return f"{float(v):.1f}"
    if unit == "gbps":
        return f"{float(v):.3g}"
    if unit is not None:
        return fmt_fixed(float(v) / scale)
    if col in VALUE_COLUMNS:
        return value_label(col, v)
    if isinstance(v, bool):
        return "yes" if v else "no"
    if isinstance(v, float):
        return f"{int(v):,}" if v.is_integer() and abs(v) < 1e15 else fmt_num(v)
    if isinstance(v, int):
        return f"{v:,}" if abs(v) >= 10000 else str(v)
    return str(v)


def table(df: pd.DataFrame | None, cols: list[str] | None = None, max_rows: int = 200, left: tuple = (),
          labels: dict | None = None, names: tuple = ()) -> str:
    """An HTML table: every cell escaped; one unit per column from its name (``*_bytes`` -> MiB ...,
    ``*_us`` -> ms, ``*_pct`` -> %) shown in the header; headers in words (COLUMN_LABELS, or ``labels``
    for this table); trace names (``name``, ``frames`` and ``names``) shortened with the full name on hover."""
    if df is None or len(df) == 0:
        return '<p class="note">no rows</p>'
    cols = [c for c in (cols or list(df.columns)) if c in df.columns]
    shown = df[cols].head(max_rows)
    labels = labels or {}
    name_cols = NAME_COLUMNS | set(names)
    heads, specs = [], []
    for c in cols:
        unit = column_unit(c)
        scale, unit_text = _scale_for(unit, shown[c]) if unit else (1.0, "")
        is_left = c in left or c in name_cols or not _numeric(df[c])
        words = labels.get(c)
        head = f"{words} ({unit_text})" if words and unit_text else words or column_label(c, unit_text)
        heads.append(f'<th class="{"l" if is_left else ""}">{esc(head)}</th>')
        specs.append((c, unit, scale, is_left))
    rows = []
    for row in shown.itertuples(index=False, name=None):
        tds = []
        for (c, unit, scale, is_left), v in zip(specs, row):
            text = _plain_cell(c, v, scale, unit)
            if c in name_cols and not _isnan(v):
                short = short_name(text)
                title = f' title="{esc(text)}"' if short != text else ""
                tds.append(f'<td class="l name"{title}>{esc(short)}</td>')
            else:
                tds.append(f'<td class="{"l" if is_left else ""}">{esc(text)}</td>')
        rows.append(f"<tr>{''.join(tds)}</tr>")
    more = f'<p class="note">{len(df) - max_rows} more rows in summary.json</p>' if len(df) > max_rows else ""
    return f"<div class=\"tbl\"><table><tr>{''.join(heads)}</tr>{''.join(rows)}</table></div>{more}"


def kv_table(items: list[tuple[str, object]]) -> str:
    rows = "".join(f'<tr><th class="l">{esc(k)}</th><td class="l">{esc(v)}</td></tr>' for k, v in items)
    return f"<table>{rows}</table>"


def unit_order(units) -> list:
    """FSDP units in the model's order: the root first, then by name with numbers compared as numbers
    (layers.2 before layers.10)."""
    def key(u):
        u = str(u)
        if u in ("", "(root)"):
            return (0, [])
        return (1, [(0, int(p), "") if p.isdigit() else (1, 0, p) for p in re.split(r"[.]", u)])
    return sorted(dict.fromkeys(units), key=key)


CSS = """
body{font-family:-apple-system,Segoe UI,Roboto,Helvetica,Arial,sans-serif;margin:0;color:#222;background:#fafafa}
header{background:#1f2937;color:#fff;padding:14px 24px}header h1{margin:0;font-size:20px}
header .sub{color:#cbd5e1;font-size:13px;margin-top:4px;word-break:break-all}
header .ctx{color:#e5e7eb;font-size:14px;margin-top:4px}
nav{padding:6px 24px;background:#e5e7eb;font-size:13px;position:sticky;top:0;z-index:10}
nav a{margin-right:14px;color:#1f2937}
main{padding:8px 24px 40px;max-width:1400px}
section{background:#fff;border:1px solid #e5e7eb;border-radius:6px;padding:10px 18px;margin:14px 0}
h2{font-size:17px;margin:6px 0 10px}h3{font-size:14px;margin:14px 0 6px}
table{border-collapse:collapse;font-size:12.5px;margin:6px 0}
td,th{border:1px solid #e5e7eb;padding:3px 8px;text-align:right;vertical-align:top;max-width:640px;overflow-wrap:break-word}
.tbl{overflow-x:auto;max-width:100%}
th{background:#f3f4f6;font-weight:600}td.l,th.l{text-align:left}td.name{font-family:ui-monospace,Menlo,Consolas,monospace;font-size:12px}
td[title]{cursor:help;text-decoration:underline dotted #9ca3af}
tr.base td{background:#f8fafc}th.grp{text-align:center;background:#e5e7eb}
.banner{background:#fef3c7;border:1px solid #f59e0b;padding:10px 14px;border-radius:6px;margin:12px 0}
.note{color:#6b7280;font-size:13px;font-style:italic}
.finding{border-left:4px solid #9ca3af;padding:4px 10px;margin:8px 0}
.finding.high{border-color:#dc2626}.finding.medium{border-color:#f59e0b}.finding.info{border-color:#3b82f6}
.formula{font-family:ui-monospace,Menlo,Consolas,monospace;font-size:12.5px;background:#f8fafc;padding:6px 10px;
border:1px solid #e2e8f0;border-radius:4px;margin:4px 0;white-space:pre-wrap}
.verdict{font-size:15px;font-weight:600;margin:8px 0}ul.costs{margin:4px 0 8px 0;padding-left:20px;font-size:14px}
ul.costs li{margin:3px 0}
.plot{min-height:200px;min-width:0}
.grid2{display:grid;grid-template-columns:minmax(0,1fr) minmax(0,1fr);gap:14px;align-items:start}
@media (max-width:900px){.grid2{grid-template-columns:minmax(0,1fr)}}
.tiles{display:grid;grid-template-columns:repeat(3,minmax(0,1fr));gap:12px}
.tile{border:1px solid #e5e7eb;border-radius:6px;padding:10px 14px;background:#fcfcfd}
.tile .big{font-size:26px;font-weight:700;color:#111827}.tile .what{font-size:13px;color:#374151;margin-top:2px}
.tile .sub{font-size:12.5px;color:#6b7280;margin-top:4px}.tile.wide{grid-column:span 2}
.tile .big.text{font-size:15px;line-height:1.35;font-weight:600}
.split{display:flex;height:22px;border-radius:4px;overflow:hidden;margin:8px 0 6px}
.split div{height:100%}.legend{font-size:13px;color:#374151}
.legend span.sw{display:inline-block;width:10px;height:10px;border-radius:2px;margin:0 4px 0 10px;vertical-align:baseline}
.legend span.sw:first-child{margin-left:0}
details>summary{cursor:pointer;color:#374151;font-size:13px;margin:6px 0}
"""


class Page:
    """Collects figures: plotly.js goes into the page once, with the first figure."""

    def __init__(self) -> None:
        self.n_figs = 0

    def fig(self, fig: figures.Figure | dict, height: int = 360) -> str:
        """A figure (figures.Figure, or a plain plotly.js figure dict) as HTML; see report.figures."""
        self.n_figs += 1
        return figures.figure_html(fig, height, f"plot-{self.n_figs}", include_plotlyjs=(self.n_figs == 1))


def side_by_side(*blocks: str) -> str:
    """Two charts (or tables) beside each other; one above the other on a narrow screen."""
    blocks = [b for b in blocks if b]
    if len(blocks) < 2:
        return "".join(blocks)
    return '<div class="grid2">' + "".join(f"<div>{b}</div>" for b in blocks) + "</div>"


def document(title: str, subtitle: str, nav: list[tuple[str, str]], body: str, context: str = "") -> str:
    links = "".join(f'<a href="#{esc(a)}">{esc(t)}</a>' for a, t in nav)
    ctx = f'<div class="ctx">{esc(context)}</div>' if context else ""
    return (f"<!DOCTYPE html><html lang=\"en\"><head><meta charset=\"utf-8\">{generator_meta()}"
            f"<title>{esc(title)}</title>"
            f"<meta name=\"viewport\" content=\"width=device-width, initial-scale=1\"><style>{CSS}</style></head>"
            f"<body><header><h1>{esc(title)}</h1>{ctx}<div class=\"sub\">{esc(subtitle)}</div></header>"
            f"<nav>{links}</nav><main>{body}</main>"
            f"<footer style=\"padding:10px 24px;color:#6b7280;font-size:12px\">fsdpprof {esc(__version__)}</footer>"
            f"</body></html>")


def notes_html(a, section: str) -> str:
    n = a.notes.get(section)
    return f'<p class="note">{esc(n)}</p>' if n else ""


def idle_words(host: bool) -> str:
    """What the step breakdown's idle time is: device idle on a GPU trace, host time on a CPU trace."""
    return HOST_TIME if host else "device idle"


def _host_time(a) -> bool:
    """True when the step's idle time is host time (a CPU trace: no device kernels)."""
    o = a.overview
    return (o.get("device_type") or "cpu") == "cpu" or not o.get("device_kernels")


def split_bar(parts: list[tuple[str, float, str]]) -> str:
    """A stacked bar in plain HTML (no plotly): parts are (words, percent, color)."""
    parts = [(w, p, c) for w, p, c in parts if p == p and p > 0]
    bar = "".join(f'<div style="width:{p:.2f}%;background:{c}" title="{esc(w)}: {p:.0f}%"></div>' for w, p, c in parts)
    legend = "".join(f'<span class="sw" style="background:{c}"></span>{esc(w)} {fmt_pct(p)}' for w, p, c in parts)
    return f'<div class="split">{bar}</div><div class="legend">{legend}</div>'


# --- one run --------------------------------------------------------------------------------

INPUT_KIND_TEXT = {"fsdp2": "FSDP2 (fully_shard)", "fsdp1": "FSDP1 (FullyShardedDataParallel)",
                   "ddp": "DDP (DistributedDataParallel): nothing sharded",
                   "distributed": "distributed job of another framework (not FSDP)",
                   "single_device": "one device, no communication", "unknown": "unknown"}
INPUT_KIND_SHORT = {"fsdp2": "FSDP2", "fsdp1": "FSDP1", "ddp": "DDP", "distributed": "distributed",
                    "single_device": "one device"}


def _context(a) -> str:
    """One line under the title: strategy, framework, ranks, model size, optimizer, dtypes, device."""
    o, t = a.overview, a.theory or {}
    bits = []
    if o.get("strategy"):
        bits.append(str(o["strategy"]))
    if INPUT_KIND_SHORT.get(o.get("input_kind")) and o.get("input_kind") != "ddp":
        bits.append(INPUT_KIND_SHORT[o["input_kind"]])
    if o.get("world_size"):
        n = o["world_size"]
        group = (f" (shard group {o['shard_group_size']} x replicas {o['replicate_group_size']})"
                 if (o.get("replicate_group_size") or 1) > 1 else "")
        bits.append(f"{n} rank{'s' if n != 1 else ''}{group}")
    if o.get("psi"):
        bits.append(f"Ψ = {fmt_params(o['psi'])} parameters")
    if o.get("optimizer"):
        bits.append(str(o["optimizer"]))
    if t.get("param_dtype"):
        mp = o.get("mixed_precision")
        bits.append(f"{t['param_dtype']}" + (f", compute {mp.get('param_dtype')}" if mp else ""))
    dev = " ".join(str(x) for x in (o.get("device_type"), o.get("backend")) if x)
    if dev:
        bits.append(dev)
    return " · ".join(bits)


SOURCE_TEXT = {"run_dir": "fsdpprof run directory", "trace_folder": "folder of profiler traces",
               "trace_file": "profiler trace", "snapshot_file": "CUDA memory snapshot",
               "snapshot_folder": "folder of CUDA memory snapshots"}


def finding_title(title: str) -> str:
    """A finding's title as the page shows it: collective names as words (all_gather -> all-gather)."""
    return re.sub(r"\b(all_gather|reduce_scatter|all_reduce|all_to_all|send_recv)\b",
                  lambda m: m.group(1).replace("_", "-"), str(title))


def _overview(a) -> str:
    o = a.overview
    mp = o.get("mixed_precision")
    items = [
        ("input", f"{a.path} ({SOURCE_TEXT.get(a.source, a.source)})"), ("command", o.get("command") or "-"), ("status", o.get("status")),
        ("strategy", f"{o.get('strategy') or '-'} ({o.get('framework') or 'unknown framework'})"),
        ("what ran", INPUT_KIND_TEXT.get(o.get("input_kind"), o.get("input_kind") or "-")),
        ("world size", o.get("world_size")), ("ranks analysed", ", ".join(map(str, o.get("ranks_present") or []))),
        ("shard / replicate group", f"{o.get('shard_group_size') or '-'} / {o.get('replicate_group_size') or '-'}"),
        ("Ψ (parameters)", f"{fmt_params(o.get('psi'))} ({fmt_num(o.get('psi'))})" if o.get("psi") else "-"),
        ("mixed precision", f"param {mp.get('param_dtype')}, reduce {mp.get('reduce_dtype')}" if mp else "none"),
        ("optimizer", o.get("optimizer") or "-"), ("CPU offload", "yes" if o.get("cpu_offload") else "no"),
        ("device", f"{o.get('device_type') or '-'} {o.get('device_name') or ''}"),
        ("backend", o.get("backend") or "-"), ("hosts", ", ".join(o.get("hosts") or []) or "-"),
        ("steps recorded", ", ".join(map(str, o.get("steps_recorded") or [])) or "-"),
        ("median step time", fmt_us(o.get("step_time_us"))),
    ]
    return (f'<section id="overview"><h2>Overview</h2><details><summary>the run: command, ranks, model, device '
            f'({esc(o.get("status") or "-")})</summary>{kv_table(items)}</details></section>')


def _banner(a) -> str:
    out = []
    if a.missing:
        lst = "; ".join(f"{k}: {v}" for k, v in sorted(a.missing.items()))
        out.append(f'<div class="banner"><b>Partial run</b>: missing ranks/files: {esc(lst)}. '
                   f"The numbers below cover the ranks that were recorded.</div>")
    for w in a.warnings or []:
        out.append(f'<div class="banner">{esc(w)}</div>')
    return "".join(out)


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


def _headline(a, h: dict) -> str:
    """At a glance: the peak per rank against the formula's model states, exposed communication as a share of
    the step, the step's split and the first finding (numbers from analyze.headline)."""
    tiles = []
    peak, ms = h["peak_bytes"], h["model_states_theory_bytes"]
    n_ranks = len(a.memory_peaks) if a.memory_peaks is not None else 0
    if peak == peak:
        where = (f"rank {h['peak_rank']}, " if n_ranks > 1 else "") + (f"in {value_label('stage', h['peak_stage'])}"
                                                                          if h.get("peak_stage") else "")
        sub = (f"the formula's model states are {esc(fmt_pct(h['model_states_theory_pct_of_peak']))} of it"
               if ms == ms else "no inventory: no formula to compare with")
        tiles.append(_tile(esc(fmt_bytes(peak)), f"peak memory per rank{' (' + esc(where) + ')' if where else ''}", sub))
    if ms == ms:
        meas = h["model_states_measured_bytes"]
        tiles.append(_tile(esc(fmt_bytes(ms)), f"model states per rank, {esc(h['model_states_label'])} formula "
                           f"<code>{esc(h['model_states_formula'])}</code>",
                           f"measured {esc(fmt_bytes(meas))}" if meas == meas else ""))
    step = h["step_us"]
    if step == step:
        tiles.append(_tile(esc(fmt_pct(h["exposed_comm_pct"])), "of the step is exposed communication",
                           f"{esc(fmt_us(h['exposed_comm_us']))} of a {esc(fmt_us(step))} step (median over ranks); "
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
    if not tiles:
        return ""
    return f'<section id="headline"><h2>At a glance</h2><div class="tiles">{"".join(_fill_rows(tiles))}</div></section>'


def _findings(a) -> str:
    if not a.findings:
        body = '<p class="note">Nothing stands out against the thresholds in fsdpprof/analyze/findings.py.</p>'
    else:
        def val(x, unit):
            return fmt_pct(x) if unit == "%" else f"{fmt_num(x)}{' ' + unit if unit else ''}"
        body = "".join(
            f'<div class="finding {esc(f.severity)}"><b>{esc(finding_title(f.title))}</b><br>Try: {esc(f.suggestion)}<br>'
            f'<span class="note">{esc(val(f.value, f.unit))} against a threshold of {esc(val(f.threshold, f.unit))} '
            f'(<code>{esc(f.metric)}</code> in summary.json), see <a href="#{esc(f.section)}">'
            f"{esc(f.section)}</a></span></div>" for f in a.findings)
    return f'<section id="findings"><h2>Findings</h2>{body}</section>'


def _theory_block(a) -> str:
    t = a.theory
    if not t:
        return f"<h3>Theory vs measured</h3>{notes_html(a, 'theory')}"
    ms = t["model_states"]
    out = ["<h3>Theory vs measured: model states per rank</h3>",
           f"<p>Ψ = {esc(fmt_num(t['psi']))} parameters; k_param = {esc(fmt_num(t['k_param']))} "
           f"({esc(t['param_dtype'])}), k_grad = {esc(fmt_num(t['k_grad']))} ({esc(t['grad_dtype'])}), "
           f"k_opt = {esc(fmt_num(t['k_opt']))} ({esc(t['k_opt_detail'])}) bytes per parameter; "
           f"strategy {esc(t['strategy'])} with N = {esc(t['N'])}.</p>",
           f'<div class="formula">{esc(ms["label"])}: model states per rank = {esc(ms["formula"])}\n'
           f'  = {esc(ms["substituted"])}\n  = {esc(fmt_bytes(ms["total_bytes"]))} '
           f"({esc(fmt_num(ms['total_bytes']))} bytes)\n"
           f"measured (inventory of rank {esc(min(a.model_states['rank']) if a.model_states is not None else '-')}) = "
           f"{esc(fmt_bytes(t.get('measured_model_states_bytes')))}; difference "
           f"{esc(fmt_bytes(t.get('model_states_diff_bytes')))}: {esc(t.get('model_states_explanation'))}</div>"]
    if a.model_states is not None and not a.model_states.empty:
        ms_t = a.model_states
        r0 = ms_t["rank"].min()
        first = ms_t[ms_t["rank"] == r0].set_index("role")["measured_bytes"]
        same = [r for r, g in ms_t[ms_t["rank"] != r0].groupby("rank")
                if (abs(g.set_index("role")["measured_bytes"] - first.reindex(g["role"]).to_numpy())
                    <= 0.001 * first.abs().max()).all()]
        out.append(table(ms_t[~ms_t["rank"].isin(same)]))
        if same:
            out.append(f'<p class="note">rank{"s" if len(same) > 1 else ""} {esc(_rank_list(same))}: the same as '
                       f"rank {esc(r0)}.</p>")
    out.append("<p>The same model under every strategy (same Ψ, dtypes, optimizer and N):</p>")
    out.append(table(pd.DataFrame(t["all_strategies"]), ["label", "formula", "param_bytes", "grad_bytes",
                                                         "optimizer_state_bytes", "total_bytes", "traffic_bytes"],
                     left=("label", "formula")))
    out.append('<p class="note">traffic: bytes each rank sends per step (ring), all-gather in '
               f'{esc(t.get("unsharded_param_dtype"))}, reduce in {esc(t.get("reduce_dtype"))}.</p>')
    pe = t.get("peak_estimate")
    if pe:
        out.append("<h3>Theory vs measured: peak memory</h3>")
        diff = pe.get("diff_bytes")
        out.append(f'<div class="formula">peak ~ {esc(pe["formula"])}\n  = {esc(pe["substituted"])}\n'
                   f'  = {esc(fmt_bytes(pe["estimate_bytes"]))}\nmeasured peak (rank {esc(pe.get("measured_rank"))}) = '
                   f'{esc(fmt_bytes(pe.get("measured_peak_bytes")))}; difference {esc(fmt_bytes(diff))}: '
                   f'{esc(pe.get("explanation") or "no memory data to compare")}</div>')
    return "".join(out)


def _rank_list(ranks) -> str:
    """0-3, 5, 7-8"""
    rs, out = sorted(int(r) for r in ranks), []
    for r in rs:
        if out and r == out[-1][1] + 1:
            out[-1][1] = r
        else:
            out.append([r, r])
    return ", ".join(f"{a}-{b}" if b > a else f"{a}" for a, b in out)


def _drop_empty(df: pd.DataFrame, cols=()) -> pd.DataFrame:
    """Leave out columns with no value in any row (e.g. reserved bytes on a CPU trace)."""
    empty = [c for c in (cols or df.columns) if c in df and (df[c].isna() | (df[c].astype(str) == "")).all()]
    return df.drop(columns=empty)


def _memory(a, page: Page) -> str:
    out = ['<section id="memory"><h2>Memory</h2>', notes_html(a, "memory")]
    if a.memory_peaks is not None and not a.memory_peaks.empty:
        mp = a.memory_peaks
        if many_ranks.is_many(a):   # above 16 ranks: a distribution over ranks, not a row per rank
            out.append(many_ranks.memory_peaks(a, page))
        else:
            if len(mp) > 2:   # with one or two ranks the table says it all
                sc, unit = mem_scale(mp["peak_allocated_bytes"].max())
                fig = figures.Figure(figures.bar(x=[f"rank {r}" for r in mp["rank"]], y=mp["peak_allocated_bytes"] / sc,
                                       marker_color="#1f77b4"))
                fig.update_layout(title="Peak allocated memory per rank", yaxis_title=unit)
                out.append(page.fig(fig, 300))
            out.append(table(_drop_empty(mp.drop(columns=["peak_ts_us"], errors="ignore"),
                                         ("reserved_bytes", "fragmentation_pct"))))
        r0 = peak_rank(a)   # the rank the headline's peak is from
        m = a.memory[r0]
        sc, unit = mem_scale(m.peak_allocated_bytes)
        t_origin = (float(m.timeline["ts_us"].min()) if m.timeline is not None and len(m.timeline)
                    and getattr(m, "timeline_unit", "us") != "event_index" else None)
        charts = []
        bd = m.breakdown_at_peak
        if bd is not None and not bd.empty:
            bd = bd.groupby("category", observed=True, as_index=False)[["bytes", "pct"]].sum()
            bd = bd[bd["pct"] >= 0.1]   # what is not even 0.1% of the peak is in the tables, not a bar
            order = {c: i for i, c in enumerate(CATEGORY_COLORS)}
            bd = bd.sort_values("category", key=lambda s: s.astype(str).map(order).fillna(99))
            fig = figures.Figure(figures.bar(x=[label(category_label(c)) for c in bd["category"]], y=bd["bytes"] / sc,
                                   marker_color=[CATEGORY_COLORS.get(str(c), "#7f7f7f") for c in bd["category"]],
                                   text=[f"{fmt_fixed(b / sc)} {unit}<br>{p:.0f}%" for b, p in zip(bd["bytes"], bd["pct"])],
                                   textposition="outside", cliponaxis=False))
            fig.update_layout(title=f"At the peak, rank {r0} ({label(value_label('stage', m.peak_stage))}, "
                                    f"{m.coverage_pct:.0f}% attributed)", yaxis_title=unit)
            charts.append(page.fig(fig, 360))
        tl = m.timeline
        if tl is not None and not tl.empty and "ts_us" in tl:
            fig = figures.Figure()
            by_index = getattr(m, "timeline_unit", "us") == "event_index"  # legacy snapshots: no times
            t0 = 0.0 if by_index else float(tl["ts_us"].min())
            xs = tl["ts_us"] if by_index else (tl["ts_us"] - t0) / 1e3
            for c in [c for c in tl.columns if c != "ts_us"]:
                if not pd.api.types.is_numeric_dtype(tl[c]) or float(tl[c].max() or 0) <= 0:
                    continue
                fig.add_trace(figures.scatter(x=xs, y=tl[c] / sc, name=label(category_label(c)), mode="lines",
                                         stackgroup="one", line=dict(width=0.5, color=CATEGORY_COLORS.get(c))))
            fig.update_layout(title=f"Memory over the recorded steps, rank {r0}",
                              xaxis_title="allocation event number (the snapshot has no times)" if by_index
                              else "ms from window start", yaxis_title=unit, legend=dict(font=dict(size=11)))
            charts.append(page.fig(fig, 360))
        out.append(side_by_side(*charts))
        if a.overview.get("sharded"):
            out.append('<p class="note">gathered params: a unit\'s parameters all-gathered for its forward or backward; '
                       "unsharded grads: a unit's full gradients waiting for their reduce-scatter; sharded params, "
                       "sharded grads and optimizer states: this rank's 1/N of the model states.</p>")
        out.append(oom.render_oom(m))           # the OOM explained, with what would free enough
        out.append(oom.render_fsdp_memory(m))   # FSDP's buffers by role, A_l per unit (also without an inventory)
        if m.top_allocations is not None and not m.top_allocations.empty:
            out.append(f"<h3>Largest allocations alive at the peak, rank {r0}</h3>")
            top = _drop_empty(m.top_allocations.head(15).copy(), ("frames", "unit"))
            if t_origin is not None:  # display times from the window start, like the timeline
                for col in ("alloc_us", "free_us"):
                    if col in top:
                        top[col] = top[col] - t_origin
            out.append(table(top, left=("frames", "unit", "stage", "category"),
                             labels={"alloc_us": "allocated at, from window start",
                                     "free_us": "freed at, from window start"} if t_origin is not None else None))
        if m.warnings:
            out.append("".join(f'<p class="note">{esc(w)}</p>' for w in m.warnings))
    out.append(_theory_block(a))
    out.append("</section>")
    return "".join(out)


def _unit_memory_chart(a, page: Page) -> tuple[str, str]:
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
    bu["unit"] = bu["unit"].astype(str).replace("", "(root)")
    units = unit_order(bu["unit"])
    sc, unit = mem_scale(bu.groupby("unit")["bytes"].sum().max())
    fig = figures.Figure()
    order = {c: i for i, c in enumerate(CATEGORY_COLORS)}
    for cat in sorted(bu["category"].astype(str).unique(), key=lambda c: order.get(c, 99)):
        g = bu[bu["category"].astype(str) == cat].groupby("unit")["bytes"].sum()
        fig.add_trace(figures.bar(x=[label(u) for u in units], y=[g.get(u, 0.0) / sc for u in units],
                             name=label(category_label(cat)), marker_color=CATEGORY_COLORS.get(cat)))
    fig.update_layout(barmode="stack", title=f"Memory per unit at the peak, rank {r0}", yaxis_title=unit,
                      xaxis=dict(categoryorder="array", categoryarray=[label(u) for u in units]),
                      legend=dict(orientation="h", y=-0.2, font=dict(size=11)))
    note = (f'<p class="note">{esc(fmt_bytes(none))} at the peak belong to no unit (inputs, tensors made outside '
            f"every FSDP unit).</p>" if none > 0.01 * a.memory[r0].peak_allocated_bytes else "")
    return page.fig(fig, 400), note


def _exposed_per_unit(a, page: Page) -> tuple[str, str]:
    """Which unit's all-gather / reduce-scatter is exposed, in forward and backward: ms per step, mean over
    ranks and steps (communication launched inside a step only). Returns (chart, table)."""
    cu = a.comm_unit_step
    if cu is None or cu.empty or not cu["unit"].notna().any():
        return "", ""
    c = cu[cu["step"].notna() & cu["unit"].notna()].copy()
    if c.empty:
        return "", ""
    per = c.groupby(["rank", "step", "unit", "collective", "stage"], as_index=False)["exposed_comm_us"].sum()
    g = per.groupby(["unit", "collective", "stage"], as_index=False)["exposed_comm_us"].mean()
    g["unit"] = g["unit"].astype(str).replace("", "(root)")
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


def _units(a, page: Page) -> str:
    """Per FSDP unit: the memory at the peak beside the exposed communication, units in the model's order."""
    mem, note = _unit_memory_chart(a, page)
    exp, tab = _exposed_per_unit(a, page)
    if not mem and not exp:   # DDP, one device, a trace of another framework: no units, no section
        return ""
    return ('<section id="units"><h2>Per FSDP unit: memory at the peak and exposed communication</h2>'
            + side_by_side(mem, exp) + note
            + (f"<details><summary>the units with the most exposed communication</summary>{tab}</details>" if tab else "")
            + "</section>")


def _lanes_chart(a, page: Page) -> str:
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


def _comm(a, page: Page) -> str:
    out = ['<section id="communication"><h2>Communication</h2>', notes_html(a, "communication")]
    if a.volume is not None and not a.volume.empty:
        out.append("<h3>Per collective: count, size, time, bandwidth (algorithm bandwidth; bus bandwidth with "
                   "nccl-tests' factors)</h3>")
        out.append(table(a.volume))
    if a.comm_phase is not None and not a.comm_phase.empty:
        op = a.comm_phase
        g = op.copy()
        g["key"] = [f"{value_label('collective', c)} in {s}" for c, s in zip(g["collective"], g["stage"])]
        g = g.groupby("key", as_index=False)[["overlapped_comm_us", "exposed_comm_us"]].sum()
        fig = figures.Figure([figures.bar(x=[label(k) for k in g["key"]], y=g["overlapped_comm_us"] / 1e3,
                                name="hidden behind compute", marker_color="#93c5fd"),
                         figures.bar(x=[label(k) for k in g["key"]], y=g["exposed_comm_us"] / 1e3, name="exposed",
                                marker_color="#dc2626")])
        fig.update_layout(barmode="stack", title="Communication time, hidden vs exposed (all ranks, all steps)",
                          yaxis_title="ms")
        out.append(page.fig(fig, 320))
        out.append("<h3>Per collective, stage (forward / backward / optimizer, from the CPU op that launched it) "
                   "and FSDP phase: volume, bandwidth, overlap with compute, exposed time</h3>")
        out.append(many_ranks.comm_phase(a, page) if many_ranks.is_many(a) else table(op))
    if a.p2p is not None and not a.p2p.empty:
        out.append("<h3>Point-to-point transfers (send / recv): not matched across ranks, not in skew</h3>")
        out.append(table(a.p2p))
    if a.comm_outside_steps is not None and not a.comm_outside_steps.empty:
        out.append("<h3>Communication launched outside every profiler step (not counted per step)</h3>")
        out.append(table(a.comm_outside_steps))
    if a.overlap_overall is not None and not a.overlap_overall.empty:
        out.append(many_ranks.overlap_per_rank(a, page) if many_ranks.is_many(a)
                   else "<h3>Overall overlap per rank</h3>" + table(a.overlap_overall))
    if a.traffic is not None and not a.traffic.empty:
        tr = (a.theory or {}).get("traffic")
        out.append("<h3>Measured volume vs theory (bytes each rank sends per step, ring)</h3>")
        if tr:
            out.append(f'<div class="formula">{esc(tr["label"])}: {esc(tr["formula"])}\n  = {esc(tr["substituted"])}\n'
                       f'  = {esc(fmt_bytes(tr["total_bytes"]))} per rank per step</div>')
        out.append(many_ranks.traffic(a, page) if many_ranks.is_many(a)
                   else table(a.traffic, labels={"diff_pct": "measured vs formula"}))
    out.append(_lanes_chart(a, page))
    if a.top_ops is not None and not a.top_ops.empty:
        out.append(f"<h3>Operations with the most time in step {esc(fmt_num(a.lanes_step))} of the first rank</h3>")
        out.append(table(a.top_ops, left=("name", "kind")))
    out.append("</section>")
    return "".join(out)


def _steps(a, page: Page) -> str:
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
        out.append(table(shown, labels={"idle_us": idle}))
    out.append("</section>")
    return "".join(out)


def _ranks(a, page: Page) -> str:
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


def _device(a, page: Page) -> str:
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
        out.append(page.fig(fig, 320) + table(tb))
    else:
        out.append('<p class="note">No device kernels in this input: the device time breakdowns need a GPU '
                   '(CUDA, ROCm, MTIA, XPU) trace.</p>')
    if a.kernel_types is not None and not a.kernel_types.empty:
        out.append("<h3>Kernel types (all ranks; overlapping types counted once, as overlapped)</h3>"
                   + table(a.kernel_types, left=("kernel_type",)))
    if a.top_kernels is not None and not a.top_kernels.empty and many_ranks.is_many(a):
        out.append(many_ranks.top_kernels(a, page))
    elif a.top_kernels is not None and not a.top_kernels.empty:
        out.append("<h3>Kernels with the most time (hover a name for all of it)</h3>"
                   + table(a.top_kernels.sort_values("sum_us", ascending=False).head(40), left=("kernel_type", "name")))
    if a.idle is not None and not a.idle.empty:
        idle = a.idle.groupby("idle_category", as_index=False)["idle_time_us"].sum()
        fig = figures.Figure(figures.bar(x=[label(value_label("idle_category", c)) for c in idle["idle_category"]],
                               y=idle["idle_time_us"] / 1e3, marker_color="#9ca3af"))
        fig.update_layout(title="Device idle time by cause (all ranks and streams)", yaxis_title="ms")
        out.append("<h3>Idle time by cause: host wait (the CPU had not launched the next kernel), kernel wait "
                   "(back-to-back launches), other</h3>" + page.fig(fig, 300)
                   + (many_ranks.idle(a, page) if many_ranks.is_many(a) else table(a.idle, max_rows=60)))
    if a.hta or "hta" in a.notes:
        out.append("<h3>HTA's own tables (--hta)</h3>" + notes_html(a, "hta"))
        for name, df in a.hta.items():
            out.append(f"<h4>HTA {esc(name)}</h4>" + table(df, max_rows=40))
    out.append("</section>")
    return "".join(out)


REPORT_NAV = [("headline", "At a glance"), ("findings", "Findings"), ("overview", "Overview"), ("memory", "Memory"),
              ("units", "Per unit"), ("communication", "Communication"), ("steps", "Steps"), ("ranks", "Ranks"),
              ("whatif", "What if"), ("device", "Device time")]


def _whatif(a, page: Page) -> str:
    """The "What if" section (fsdpprof.report.whatif) when there are predictions or a note on why not; inputs
    without an inventory (a trace folder of another tool) have neither: their model is unknown."""
    if not getattr(a, "whatif", None) and "whatif" not in (a.notes or {}):
        return ""
    return whatif.whatif_section(a, page)


def render_report(a) -> str:
    """The HTML of one run's report: one function per section, in reading order."""
    page = Page()
    o = a.overview
    sections = [_banner(a), _headline(a, headline(a)), _findings(a), _overview(a), _memory(a, page), _units(a, page),
                _comm(a, page), _steps(a, page), _whatif(a, page), _ranks(a, page), _device(a, page)]
    body = "".join(sections)
    what = {"snapshot_file": "CUDA memory snapshot", "snapshot_folder": "CUDA memory snapshots",
            "trace_file": "profiler trace", "trace_folder": "profiler traces"}.get(a.source, "run")
    n = o.get("ranks_analysed") or 0
    of = f" of {o['world_size']}" if o.get("world_size") and o["world_size"] != n else ""
    title = f"fsdpprof report: {o.get('strategy') or what}, {n}{of} rank{'s' if n != 1 or of else ''} analysed"
    nav = [(i, t) for i, t in REPORT_NAV if f'id="{i}"' in body]
    return document(title, a.path, nav, body, _context(a))


# --- several runs ---------------------------------------------------------------------------

METRIC_LABELS = {
    "psi": "Ψ (parameters)", "framework": "framework", "world_size": "N (ranks)", "strategy": "strategy",
    "peak_allocated_bytes": "peak allocated per rank", "model_states_measured_bytes": "model states per rank, measured",
    "model_states_theory_bytes": "model states per rank, formula",
    "traffic_measured_bytes": "traffic per rank per step, measured",
    "traffic_theory_bytes": "traffic per rank per step, formula", "step_us": "step time", "compute_us": "compute",
    "exposed_comm_us": "exposed communication", "idle_us": "idle",
}


def metric_label(metric: str, unit_text: str = "", host: bool = False) -> str:
    """A row of the side-by-side table in words, with its unit."""
    if metric == "idle_us":
        words = idle_words(host)
    elif metric.startswith("peak_") and metric.endswith("_bytes") and metric != "peak_allocated_bytes":
        words = "at the peak: " + category_label(metric[len("peak_"):-len("_bytes")])
    else:
        words = METRIC_LABELS.get(metric) or column_label(metric)
    return f"{words} ({unit_text})" if unit_text else words


def _compare_host(c) -> bool:
    p = c.promise
    return p is None or p.empty or all((d or "cpu") == "cpu" for d in p["device_type"])


def _verdict(c) -> str:
    lines = c.verdict_lines or [c.verdict]
    first, rest = lines[0], lines[1:]
    items = "".join(f"<li>{esc(x)}</li>" for x in rest)
    return (f'<section id="verdict"><h2>Verdict</h2><p class="verdict">{esc(first)}</p>'
            + (f'<ul class="costs">{items}</ul>' if items else "") + "</section>")


def _ratio_text(x) -> str:
    return "-" if _isnan(x) else f"{float(x):.2f}×"


def _promise(c, page: Page) -> str:
    """What the ZeRO formulas promise beside what was measured: model states per rank falling as 1/N, the peak
    falling with them, FSDP's traffic 1.5x DDP's, and the exposed communication paid for it; then the picture:
    the memory at the peak by category beside the formula's model states, per run."""
    p = c.promise
    if p is None or p.empty or not p["model_states_theory_bytes"].notna().any():
        return ""   # no inventory in any run: no formula to put beside the measurement
    base = p[p["baseline"]].iloc[0]
    sc, unit = mem_scale(max(p["peak_allocated_bytes"].max(), p["model_states_theory_bytes"].max()))
    groups = [("", 2), ("model states per rank", 4), ("peak per rank", 2), ("traffic per rank per step", 3),
              ("exposed communication", 2), ("", 1)]
    heads1 = "".join(f'<th class="grp" colspan="{n}">{esc(g)}</th>' if g else f'<th colspan="{n}"></th>'
                     for g, n in groups)
    cols = ["run", "N", f"formula ({unit})", "formula ×", f"measured ({unit})", "measured ×", f"measured ({unit})", "×",
            f"formula ({unit})", f"measured ({unit})", "measured × DDP's formula", "ms per step", "% of the step",
            "step (ms)"]
    heads2 = "".join(f'<th class="{"l" if i == 0 else ""}">{esc(h)}</th>' for i, h in enumerate(cols))
    rows = []
    for _, r in p.iterrows():
        cells = [esc(r["run"]), esc(r["world_size"]),
                 fmt_fixed(r["model_states_theory_bytes"] / sc), _ratio_text(r["model_states_theory_ratio"]),
                 fmt_fixed(r["model_states_measured_bytes"] / sc), _ratio_text(r["model_states_measured_ratio"]),
                 fmt_fixed(r["peak_allocated_bytes"] / sc), _ratio_text(r["peak_ratio"]),
                 fmt_fixed(r["traffic_theory_bytes"] / sc), fmt_fixed(r["traffic_measured_bytes"] / sc),
                 _ratio_text(r["traffic_measured_vs_ddp"]), fmt_fixed(r["exposed_comm_us"] / 1e3),
                 fmt_pct(r["exposed_comm_pct"]), fmt_fixed(r["step_us"] / 1e3)]
        tds = "".join(f'<td class="{"l" if i == 0 else ""}">{esc(x) if i > 1 else x}</td>' for i, x in enumerate(cells))
        rows.append(f'<tr class="{"base" if r["baseline"] else ""}">{tds}</tr>')
    note = (f'<p class="note">The formulas: model states per rank = (k_p + k_g + k_o) Ψ / N under FULL_SHARD (ZeRO-3), '
            f"k_p Ψ + (k_g + k_o) Ψ / N under SHARD_GRAD_OP (ZeRO-2), Ψ over the shard group under HSDP; traffic per "
            f"rank per step = 3(N-1)/N S for FULL_SHARD against 2(N-1)/N S for DDP's all-reduce: 1.5x. "
            f"× is the ratio to {esc(base['run'])} (the shaded row), and for traffic the ratio to what DDP's "
            f"all-reduce moves on as many ranks. The peak adds what the formula leaves out (gathered units, "
            f"gradients waiting for their reduce-scatter, activations).</p>")
    out = [f'<section id="promise"><h2>What ZeRO promises, and what was measured</h2>'
           f"<table><tr>{heads1}</tr><tr>{heads2}</tr>{''.join(rows)}</table>{note}"]
    out.append(_memory_vs_formula(c, page))
    out.append("</section>")
    return "".join(out)


def _memory_vs_formula(c, page: Page) -> str:
    """Per run two stacked bars: the memory at the peak by category (measured) and the formula's model states
    (params, grads, optimizer states, hatched)."""
    cats, formula = c.categories, c.formula
    if (cats is None or cats.empty) and (formula is None or formula.empty):
        return ""
    runs = list(c.labels)
    measured, said = "measured", "formula"
    tops = [x.groupby("run")["bytes"].sum().max() for x in (cats, formula) if x is not None and not x.empty]
    sc, unit = mem_scale(max(tops) if tops else float("nan"))
    fig = figures.Figure()
    order = {k: i for i, k in enumerate(CATEGORY_COLORS)}
    if cats is not None and not cats.empty:
        for cat in sorted(cats["category"].astype(str).unique(), key=lambda k: order.get(k, 99)):
            g = cats[cats["category"].astype(str) == cat].groupby("run")["bytes"].sum()
            fig.add_trace(figures.bar(x=[[label(r) for r in runs], [measured] * len(runs)],
                                 y=[g.get(r, 0.0) / sc for r in runs], name=label(category_label(cat)),
                                 legendgroup="measured", legendgrouptitle_text="measured at the peak",
                                 marker_color=CATEGORY_COLORS.get(cat)))
    if formula is not None and not formula.empty:
        for cat in ("param", "grad", "optimizer_state"):
            g = formula[formula["category"] == cat].groupby("run")["bytes"].sum()
            if g.empty:
                continue
            fig.add_trace(figures.bar(x=[[label(r) for r in runs], [said] * len(runs)], y=[g.get(r, 0.0) / sc for r in runs],
                                 name=label(category_label(cat)), legendgroup="formula",
                                 legendgrouptitle_text="ZeRO formula (model states)",
                                 marker=dict(color=CATEGORY_COLORS.get(cat), pattern=dict(shape="/", fgcolor="#fff"))))
    fig.update_layout(barmode="stack", title="Memory per rank: measured at the peak by category, beside the ZeRO "
                                             "formula's model states (hatched)", yaxis_title=unit,
                      xaxis=dict(tickangle=0), legend=dict(groupclick="toggleitem", font=dict(size=11)))
    return page.fig(fig, 480)


def _compare_time(c, page: Page) -> str:
    tm = c.time
    if tm is None or tm.empty:
        return ""
    host = _compare_host(c)
    fig = figures.Figure()
    for col, name, color in (("compute_us", "compute", SPLIT_COLORS["compute"]),
                             ("exposed_comm_us", "exposed communication", SPLIT_COLORS["exposed_comm"]),
                             ("idle_us", idle_words(host), SPLIT_COLORS["idle"])):
        if col in tm:
            fig.add_trace(figures.bar(x=[label(x) for x in tm["run"]], y=tm[col] / 1e3, name=name, marker_color=color))
    fig.update_layout(barmode="stack", title="Step time (median per step over ranks)", yaxis_title="ms")
    words = (f"On CPU traces {HOST_TIME} is {HOST_TIME_WHAT}: time of the step covered by no operator and no "
             "collective." if host else "Idle: time of the step in which the device ran nothing.")
    return f'<section id="time"><h2>Step time</h2>{page.fig(fig, 360)}<p class="note">{esc(words)}</p></section>'


def _compare_table(c) -> str:
    t = c.table
    runs = [col for col in t.columns if col not in ("metric",)]
    host = _compare_host(c)
    byte_rows = t[[column_unit(m) == "bytes" for m in t["metric"]]]
    max_bytes = pd.to_numeric(byte_rows[runs].stack(), errors="coerce").max() if len(byte_rows) else float("nan")
    head = '<th class="l">metric</th>' + "".join(f"<th>{esc(r)}</th>" for r in runs)
    rows = []
    for row in t.itertuples(index=False, name=None):
        metric, vals = row[0], row[1:]
        unit = column_unit(metric)
        if metric in ("framework", "strategy") or unit is None:
            cells = [esc(fmt_params(v) if metric == "psi" else v if isinstance(v, str) else fmt_num(v)) for v in vals]
            name = metric_label(metric)
        else:
            scale, unit_text = mem_scale(max_bytes) if unit == "bytes" else (1e3, "ms") if unit == "time" else (1.0, "")
            cells = [esc(fmt_fixed(v / scale) if not _isnan(v) else "-") for v in vals]
            name = metric_label(metric, unit_text, host)
        tds = "".join(f"<td>{x}</td>" for x in cells)
        rows.append(f'<tr><th class="l">{esc(name)}</th>{tds}</tr>')
    return (f'<section id="table"><h2>Runs side by side</h2><table><tr>{head}</tr>{"".join(rows)}</table>'
            '<p class="note">Memory per rank (the first rank of each run); formulas with each run\'s numbers; '
            "exposed communication and step time per step (median over ranks). The same numbers are in "
            "compare.json.</p></section>")


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
    fig.update_layout(barmode="stack", title="Memory at the peak by category (the rank with the highest peak)",
                      yaxis_title=unit)
    return f'<section id="memory"><h2>Peak memory by category</h2>{page.fig(fig, 380)}</section>'


COMPARE_NAV = [("verdict", "Verdict"), ("promise", "ZeRO: promised and measured"), ("memory", "Memory"),
               ("time", "Step time"), ("diff", "What changed"), ("table", "Side by side")]


def render_compare(c) -> str:
    """The HTML of a Comparison (fsdpprof.analyze.compare.compare_analyses): one function per section."""
    page = Page()
    warn = "".join(f'<div class="banner">{esc(w)}</div>' for w in c.warnings)
    sections = [warn, _verdict(c), _promise(c, page), _compare_memory(c, page), _compare_time(c, page),
                diff.render_diff(c, page), _compare_table(c)]
    body = "".join(sections)
    nav = [(i, t) for i, t in COMPARE_NAV if f'id="{i}"' in body]
    ctx = " · ".join(c.labels)
    return document(f"fsdpprof compare: {len(c.labels)} runs", " | ".join(c.paths), nav, body, ctx)


# sections that live in their own modules (they import this one's helpers, so they come last)
from fsdpprof.report import diff, many_ranks, oom, whatif  # noqa: E402
