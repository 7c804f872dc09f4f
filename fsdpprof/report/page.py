"""The page every report section is drawn on: formatters, the words the page uses (COLUMN_LABELS,
METRIC_LABELS ...), the table renderers and the page shell. Every string from a trace goes through ``esc`` in
tables and text and through ``label`` in plot labels; tables pick one unit per column from its name."""
from __future__ import annotations

from typing import TYPE_CHECKING

import html
import math
import re

import pandas as pd

from fsdpprof.version import __version__
from fsdpprof.analyze import model
from fsdpprof.analyze.model import MemoryCategory as MC
from fsdpprof.analyze.model import MemoryRole as MR
from fsdpprof.report import figures
from fsdpprof.report.outputs import generator_meta

if TYPE_CHECKING:      # (the report's modules stay light: plan and --help import some)
    from fsdpprof.analyze.pipeline import Analysis

MIB = float(2**20)
# one hue per role, one shade per category: whole (DDP) darkest, sharded, gathered / unsharded lightest
CATEGORY_COLORS = {c.value: color for c, color in (
    (MC.SHARDED_PARAM, "#1f77b4"), (MC.PARAM, "#08306b"), (MC.UNSHARDED_PARAM, "#aec7e8"), (MC.SHARDED_GRAD, "#ff7f0e"),
    (MC.GRAD, "#a63603"), (MC.UNSHARDED_GRAD, "#ffbb78"), (MC.OPTIMIZER_STATE, "#2ca02c"), (MC.ACTIVATION, "#d62728"),
    (MC.TEMPORARY, "#9467bd"), (MC.INPUT, "#8c564b"), (MC.BEFORE_RECORDING, "#bcbd22"), (MC.OTHER_THREADS, "#17becf"),
    (MC.OTHER, "#7f7f7f"))}
KIND_COLORS = {"compute": "#1f77b4", "cpu_op": "#1f77b4", "comm": "#d62728", "memcpy": "#2ca02c",
               "memset": "#17becf", "sync": "#7f7f7f"}
SPLIT_COLORS = {"compute": "#1f77b4", "exposed_comm": "#dc2626", "idle": "#d1d5db", "residual": "#fde68a"}

# --- words and units: the one place for what the page calls things ---------------------------------
KIND_LABELS = {model.KIND_COMPUTE: "compute", model.KIND_CPU_OP: "CPU operator", model.KIND_COMM: "communication",
               model.KIND_MEMCPY: "memory copy", model.KIND_MEMSET: "memset", model.KIND_SYNC: "synchronisation",
               model.KIND_ANNOTATION: "annotation"}
# where a rank's memory numbers come from (MemoryResult.source)
SOURCE_LABELS = {"cpu_trace": "profiler memory events", "cuda_snapshot": "CUDA memory snapshot"}
NO_UNIT_TEXT = "outside any unit"     # memory or communication of no FSDP unit (the root unit is ROOT_UNIT_TEXT)
MISSING = model.MISSING_WORD    # what a sentence says for a value that is not there (a table: for a size, else empty)
COLUMN_LABELS = {   # a column's words where they are not its name's (see column_label)
    # memory
    "peak_stage": "stage at the peak", "peak_fsdp_phase": "FSDP phase at the peak",
    "baseline_bytes": "allocated before the window", "coverage_pct": "attributed", "source": "memory source",
    "addr": "address", "alloc_us": "allocated at", "free_us": "freed at", "frames": "allocated by", "unit": "FSDP unit",
    "role": "model state", "theory_bytes": "formula", "diff_bytes": "measured - formula", "diff_pct": "measured - formula",
    "label": "strategy", "formula": "formula (per rank)", "param_bytes": "params", "grad_bytes": "grads",
    "optimizer_state_bytes": "optimizer states", "total_bytes": "model states per rank",
    "traffic_bytes": "traffic per rank per step",
    # the allocator's cache (fragmentation) and the process's memory
    "moment": "when", "largest_request_after_bytes": "largest request that followed",
    "free_small_bytes": "free, small pool (requests up to 1 MiB)", "free_large_bytes": "free, large pool",
    "size_class": "free block size", "used_peak_bytes": "process peak (device used / RSS)",
    "allocator_reserved_peak_bytes": "allocator peak", "outside_allocator_peak_bytes": "outside the allocator",
    "source_words": "measured as", "reading": "reading",
    # communication
    "bytes": "size", "algbw_gbps": "algorithm bandwidth", "busbw_gbps": "bus bandwidth", "fsdp_phase": "FSDP phase",
    "comm_us": "communication", "overlapped_comm_us": "hidden behind compute",
    "exposed_comm_us": "exposed communication", "overlap_pct": "hidden behind compute",
    "comp_comm_overlap_pct": "communication hidden behind compute", "wire_bytes": "on the wire",
    "wire_per_step_bytes": "on the wire per step", "theory_wire_per_step_bytes": "formula per step",
    "total_us": "total time", "max_us": "longest",
    # steps
    "residual_us": "copies, memsets, syncs only", "model_step_us": "T_comp + T_comm - T_overlap",
    "unexplained_us": "step - formula",
    # ranks
    "pg": "process group", "seq": "sequence number", "n_ranks": "ranks", "last_rank": "last to arrive",
    # device
    "idle_time_us": "idle", "compute_time_us": "compute", "non_compute_time_us": "non-compute", "idle_time_pct": "idle",
    "compute_time_pct": "compute", "non_compute_time_pct": "non-compute", "pct": "share", "sum_us": "total time",
    "min_us": "shortest", "std_us": "standard deviation", "type_pct": "share of its type", "idle_category": "cause",
    # compare
    "world_size": "N (ranks)", "shard_group_size": "shard group", "exposed_comm_pct": "of the step",
}
# the process's memory beyond the allocator's, as a bar beside the memory categories
OUTSIDE_ALLOCATOR_LABEL = "outside the allocator"
OUTSIDE_ALLOCATOR_COLOR = "#4b5563"
# the moments of the allocator's cache (fsdpprof.analyze.memory.fragmentation)
MOMENT_LABELS = {"peak": "at the peak", "oom": "at the out-of-memory error", "end": "at the end of the snapshot"}
# host time on a CPU trace: what "idle" is when the profiler sees operators only
HOST_TIME = "host time outside operators"
HOST_TIME_WHAT = "Python, the dispatcher, FSDP's hooks"
VALUE_COLUMNS = frozenset({"category", "collective", "role", "fsdp_phase", "peak_fsdp_phase", "kind", "idle_category",
                           "stage", "peak_stage", "source", "kernel_type"})
NAME_COLUMNS = frozenset({"name", "frames"})
NAME_MAX = 64   # characters of a trace name shown in tables and charts (the full name on hover)


def esc(x) -> str:
    """HTML-escape any value for text and attributes."""
    return html.escape("" if x is None else str(x), quote=True)


def label(x) -> str:
    """A string from a trace, made safe for plotly's pseudo-HTML labels."""
    return html.escape("" if x is None else str(x), quote=False)


def is_missing(x) -> bool:
    """True for None, NaN and pandas' missing values (a table's empty cell)."""
    try:
        return x is None or (isinstance(x, float) and math.isnan(x)) or pd.isna(x)
    except (TypeError, ValueError):
        return False


category_label = model.category_words     # a memory category as every output says it ("optimizer states")
_VALUE_WORDS = {  # column -> its values in words
    "category": category_label, "role": category_label, "collective": model.collective_words,
    "kind": lambda s: " / ".join(KIND_LABELS.get(k, k) for k in s.split("/")),
    "source": lambda s: SOURCE_LABELS.get(s, s.replace("_", " ")),
    "stage": model.stage_words, "peak_stage": model.stage_words, "kernel_type": str.lower}


def moment_label(at) -> str:
    """A moment of the allocator's cache in words ("at the peak")."""
    return MOMENT_LABELS.get(str(at), str(at))


def size_class_label(lo_bytes, hi_bytes) -> str:
    """A class of free block sizes: "< 1.00 MiB", "2.00 MiB - 4.00 MiB", "≥ 1.00 GiB"."""
    if not lo_bytes:
        return f"< {fmt_bytes(hi_bytes)}"
    if is_missing(hi_bytes):
        return f"≥ {fmt_bytes(lo_bytes)}"
    return f"{fmt_bytes(lo_bytes)} - {fmt_bytes(hi_bytes)}"


def value_label(col: str, v) -> str:
    """A vocabulary value of column ``col`` in words (all_gather -> all-gather), for tables, sentences and the
    terminal; other snake_case words spaced, anything else unchanged; "" for a missing value."""
    if is_missing(v):
        return ""
    s = str(getattr(v, "value", v))
    if col in _VALUE_WORDS:
        return _VALUE_WORDS[col](s)
    return s.replace("_", " ") if re.fullmatch(r"[a-z0-9_]+", s) else s


def short_name(name, limit: int = NAME_MAX) -> str:
    """A long trace name shortened: no leading ``void``, no argument list, template arguments as ``<…>``, then cut
    at ``limit`` characters."""
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


def hover_name(name) -> str:
    """The full name for a chart's hover, escaped, wrapped every 100 characters."""
    s = " ".join(str(name).split())
    return "<br>".join(label(s[i:i + 100]) for i in range(0, len(s), 100))


# --- numbers --------------------------------------------------------------------------------------
def fmt_fixed(x) -> str:
    """A number at a sensible precision: 1,234 / 12.3 / 1.23 / 0.123; 0 as 0."""
    if is_missing(x):
        return MISSING
    x = float(x)
    if x == 0:
        return "0"
    for least, spec in ((100, ",.0f"), (10, ".1f"), (1, ".2f"), (0.001, ".3f")):
        if abs(x) >= least:
            return format(x, spec)
    return "<0.001" if x > 0 else ">-0.001"


fmt_bytes = model.fmt_bytes      # (the one formatter for bytes: the model's)


def fmt_spread(value, lo, hi, scale: float = 1.0) -> str:
    """A number with its spread, each divided by ``scale``: 566 (474–630); the number alone without a spread."""
    if is_missing(value):
        return MISSING
    if is_missing(lo) or is_missing(hi):
        return fmt_fixed(value / scale)
    return f"{fmt_fixed(value / scale)} ({fmt_fixed(lo / scale)}–{fmt_fixed(hi / scale)})"


def fmt_us_spread(value, lo, hi) -> str:
    """A time (µs) with its min–max in one unit: "542 ms (455–615)"; the time alone without a spread."""
    if is_missing(value):
        return MISSING
    if is_missing(lo) or is_missing(hi) or float(lo) == float(hi):
        return fmt_us(value)
    scale, unit = _time_unit(max(abs(float(hi)), abs(float(value))))
    return f"{fmt_fixed(value / scale)} {unit} ({fmt_fixed(lo / scale)}–{fmt_fixed(hi / scale)})"


def step_scope(sp: dict) -> str:
    """What a per-step number is over (headline.step_spread's dict), in words."""
    n, k = sp.get("ranks") or 0, sp.get("steps") or 0
    if n <= 1:
        return f"the mean over {k} step{'s' if k != 1 else ''}" + ("; in brackets the min–max" if k > 1 else "")
    return (f"each rank's mean per step, the median over {n} ranks; in brackets the min–max over every rank and step "
            f"({n} ranks, {k} steps in all)")


def _time_unit(top: float) -> tuple[float, str]:
    return (1e6, "s") if top >= 1e6 else (1e3, "ms") if top >= 1e3 else (1.0, "µs")


def fmt_us(x) -> str:
    """A time given in µs, in s, ms or µs."""
    if is_missing(x):
        return MISSING
    if float(x) == 0:
        return "0 ms"
    scale, unit = _time_unit(abs(float(x)))
    return f"{fmt_fixed(float(x) / scale)} {unit}"


fmt_pct = model.fmt_pct        # (the one percentage format: the model's, which findings use)


def fmt_num(x) -> str:
    """A whole number with thousands separators, else 4 significant digits."""
    if is_missing(x):
        return MISSING
    if isinstance(x, (int,)) or (isinstance(x, float) and x.is_integer() and abs(x) < 1e15):
        return f"{int(x):,}"
    try:
        return f"{float(x):.4g}"
    except (TypeError, ValueError):
        return str(x)


def fmt_params(x) -> str:
    """A parameter count: 3.66 M."""
    if is_missing(x):
        return MISSING
    x = float(x)
    for div, word in ((1e12, "T"), (1e9, "B"), (1e6, "M"), (1e3, "k")):
        if abs(x) >= div:
            return f"{x / div:.3g} {word}"
    return f"{x:.0f}"


def mem_scale(max_bytes) -> tuple[float, str]:
    """The unit of a memory chart or table whose largest value is ``max_bytes``: GiB from 10 GiB, else MiB."""
    return (2.0**30, "GiB") if not is_missing(max_bytes) and float(max_bytes) >= 10 * 2**30 else (MIB, "MiB")


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


def _scale_for(unit: str, values) -> tuple[float, str]:
    """One unit for a whole column (from its largest value): bytes in GiB/MiB/KiB, times in s/ms/µs."""
    vals = [abs(float(v)) for v in values if not is_missing(v)]
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


def signed_bytes(x) -> str:
    """A difference of bytes with its sign (+404 B, -5.69 MiB, 0); "unknown" when missing."""
    if is_missing(x):
        return model.MISSING_WORD
    x = float(x)
    return "0" if x == 0 else ("+" if x > 0 else "-") + fmt_bytes(abs(x))


column_scale = _scale_for     # (scale, unit words) of a column of bytes or times: one unit for the whole column


def column_label(col: str, unit_text: str = "") -> str:
    """A column's header: its words (COLUMN_LABELS, else its name in words) and the unit in brackets."""
    base = COLUMN_LABELS.get(col)
    if base is None:
        base = re.sub(r"_(bytes|us|pct|gbps)$", "", col).replace("_", " ")
    return f"{base} ({unit_text})" if unit_text else base


def _numeric(s: pd.Series) -> bool:
    return pd.api.types.is_numeric_dtype(s) and not pd.api.types.is_bool_dtype(s)


def _plain_cell(col: str, v, scale: float, unit: str | None) -> str:
    if isinstance(v, (list, tuple, dict)):
        return str(v)
    if is_missing(v):
        return model.MISSING_WORD if unit in ("bytes", "gbps") else ""   # a size (or a rate from it) the input lacks
    if col == "addr":
        try:
            return hex(int(v))
        except (TypeError, ValueError):
            return str(v)
    signed = "diff" in col.split("_")      # a difference (measured - formula, run - baseline) carries its sign
    if unit == "pct":
        return f"{float(v):+.1f}" if signed else f"{float(v):.1f}"
    if unit == "gbps":
        return f"{float(v):.3g}"
    if unit is not None:
        text = fmt_fixed(float(v) / scale)
        return ("+" + text) if signed and float(v) > 0 else text
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
          labels: dict | None = None) -> str:
    """A DataFrame as an HTML table: cells escaped, one unit per column from its name (shown in the header),
    headers in words (COLUMN_LABELS or ``labels``), trace names shortened (the full one on hover), empty columns
    left out."""
    if df is None or len(df) == 0:
        return '<p class="note">no rows</p>'
    cols = [c for c in (cols or list(df.columns)) if c in df.columns]
    shown = df[cols].head(max_rows)
    cols = [c for c in cols if not shown[c].map(lambda v: is_missing(v) or v == "").all()]
    shown = shown[cols]
    labels = labels or {}
    heads, specs = [], []
    for c in cols:
        unit = column_unit(c)
        scale, unit_text = _scale_for(unit, shown[c]) if unit else (1.0, "")
        is_left = c in left or c in NAME_COLUMNS or not _numeric(df[c])
        words = labels.get(c)
        head = f"{words} ({unit_text})" if words and unit_text else words or column_label(c, unit_text)
        heads.append(f'<th class="{"l" if is_left else ""}">{esc(head)}</th>')
        specs.append((c, unit, scale, is_left))
    rows = []
    for row in shown.itertuples(index=False, name=None):
        tds = []
        for (c, unit, scale, is_left), v in zip(specs, row):
            text = _plain_cell(c, v, scale, unit)
            if c in NAME_COLUMNS and not is_missing(v):
                short = short_name(text)
                title = f' title="{esc(text)}"' if short != text else ""
                tds.append(f'<td class="l name"{title}>{esc(short)}</td>')
            else:
                tds.append(f'<td class="{"l" if is_left else ""}">{esc(text)}</td>')
        rows.append(f"<tr>{''.join(tds)}</tr>")
    more = f'<p class="note">{len(df) - max_rows} more rows in summary.json</p>' if len(df) > max_rows else ""
    return f"<div class=\"tbl\"><table><tr>{''.join(heads)}</tr>{''.join(rows)}</table></div>{more}"


def kv_table(items: list[tuple[str, object]]) -> str:
    """Rows of (words, value); a row without a value (None, NaN, "") is left out."""
    rows = "".join(f'<tr><th class="l">{esc(k)}</th><td class="l">{esc(v)}</td></tr>' for k, v in items
                   if not is_missing(v) and str(v).strip() != "")
    return f"<table>{rows}</table>"


def text_table(head: list, rows: list[list], left=(0,), row_class=(), top: str = "", row_heads: bool = False) -> str:
    """A table of cells already in words (escaped here): the columns in ``left`` aligned left, ``row_class`` a class
    per row, ``top`` a header row (HTML) above ``head``; ``row_heads``: each row's first cell is its header."""
    def tag(t: str, i: int, x) -> str:
        return f'<{t} class="{"l" if i in left else ""}">{esc(x)}</{t}>'
    ths = "".join(tag("th", i, h) for i, h in enumerate(head))
    trs = "".join(f'<tr class="{c}">' + "".join(tag("th" if row_heads and not i else "td", i, x)
                                                for i, x in enumerate(r)) + "</tr>"
                  for r, c in zip(rows, list(row_class) or [""] * len(rows)))
    return f"<table>{top}<tr>{ths}</tr>{trs}</table>"


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
    """Numbers the page's figures; plotly.js comes with the first: embedded (``plotly_src`` None), or loaded from
    ``plotly_src``, a file beside the page."""

    def __init__(self, plotly_src: str | None = None) -> None:
        self.n_figs = 0
        self.plotly_src = plotly_src

    def fig(self, fig: figures.Figure | dict, height: int = 360) -> str:
        """A figure (figures.Figure, or a plotly.js figure dict) as HTML."""
        self.n_figs += 1
        return figures.figure_html(fig, height, f"plot-{self.n_figs}",
                                   include_plotlyjs=(self.plotly_src or True) if self.n_figs == 1 else False)


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


def notes_html(a: Analysis, section: str) -> str:
    n = a.notes.get(section)
    return f'<p class="note">{esc(n)}</p>' if n else ""


def scope_note(a: Analysis, per: str) -> str:
    """Which ranks and steps a table's rows are, as a note; ``per``: "rank_step", "window" or "rank"."""
    ranks = model.rank_list(sorted(int(r) for r in (a.overview.get("ranks_present") or [])))
    steps = sorted({int(x) for x in a.steps["step"].dropna()}) if a.steps is not None and "step" in a.steps else []
    said = f"step{'s' if len(steps) != 1 else ''} {', '.join(map(str, steps))}" if steps else "the whole trace"
    words = {"rank_step": f"one row per rank and step: {ranks}, {said}",
             "window": f"per rank ({ranks}), totals over the recorded window ({said})",
             "rank": f"one row per rank: {ranks}, over {said}"}[per]
    return f'<p class="note">Scope: {esc(words)}.</p>'


def idle_words(host: bool) -> str:
    """What the step breakdown's idle time is: device idle on a GPU trace, host time on a CPU trace."""
    return HOST_TIME if host else "device idle"


def finding_title(title: str) -> str:
    """A finding's title as the page shows it: collective names as words (all_gather -> all-gather)."""
    return re.sub(r"\b(all_gather|reduce_scatter|all_reduce|all_to_all|send_recv)\b",
                  lambda m: m.group(1).replace("_", "-"), str(title))


# the rows of compare's side-by-side table (and of its terminal text)
METRIC_LABELS = {
    "psi": "Ψ (parameters)", "framework": "framework", "world_size": "N (ranks)", "strategy": "strategy",
    "peak_allocated_bytes": "peak allocated per rank", "model_states_measured_bytes": "model states per rank, measured",
    "model_states_theory_bytes": "model states per rank, formula",
    "traffic_measured_bytes": "traffic per rank per step, measured",
    "traffic_theory_bytes": "traffic per rank per step, formula", "step_us": "step time", "compute_us": "compute",
    "exposed_comm_us": "exposed communication", "idle_us": "idle",
    "peak_rank": "memory from rank (its peak the highest)", "slowest_rank": "slowest rank (mean step)",
    "cpu_contention": "CPU contention (runnable / on a CPU)",
}
ROLE_LABELS = {r.value: text for r, text in (
    (MR.PARAMS, "params (sharded + gathered, or whole)"), (MR.GRADS, "grads (sharded + unsharded, or whole)"),
    (MR.OPTIMIZER_STATE, "optimizer states"), (MR.ACTIVATIONS, "activations"), (MR.TEMPORARIES, "temporaries"),
    (MR.OTHER, "other (inputs, before recording, unattributed)"))}


def role_label(role) -> str:
    """A memory role (model.MemoryRole) as the page says it."""
    return ROLE_LABELS.get(str(role), str(role).replace("_", " "))


def metric_label(metric: str, unit_text: str = "", host: bool = False) -> str:
    """A row of the side-by-side table in words, with its unit."""
    if metric == "idle_us":
        words = idle_words(host)
    elif metric.startswith("role_") and metric.endswith("_bytes"):
        words = "at the peak by role: " + role_label(metric[len("role_"):-len("_bytes")])
    elif metric.startswith("peak_") and metric.endswith("_bytes") and metric != "peak_allocated_bytes":
        words = "at the peak: " + category_label(metric[len("peak_"):-len("_bytes")])
    else:
        words = METRIC_LABELS.get(metric) or column_label(metric)
    return f"{words} ({unit_text})" if unit_text else words

