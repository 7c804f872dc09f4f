"""The "What if" section of the report and the page of `fsdpprof whatif -o`, from the predictions dict of
:func:`fsdpprof.analyze.whatif.predict.reduce_predictions` (``a.whatif`` on an Analysis)."""
from __future__ import annotations

from typing import TYPE_CHECKING

from fsdpprof.analyze.model import rank_list
from fsdpprof.report import figures
from fsdpprof.report.page import (CATEGORY_COLORS, MIB, Page, category_label, column_scale, document, esc,
                                  fmt_fixed, is_missing, label, text_table)

if TYPE_CHECKING:      # (the report's modules stay light: plan and --help import some)
    from fsdpprof.analyze.pipeline import Analysis


def _table(result: dict) -> str:
    """The predictions, one unit per column (the peak's bytes, the times'), each against the measured run."""
    m = result.get("measured") or {}
    mpeak, mstep = m.get("peak_allocated_bytes"), m.get("step_us")
    preds = result.get("predictions") or []
    bscale, bunit = column_scale("bytes", [p.get("peak_allocated_bytes") for p in preds])
    tscale, tunit = column_scale("time", [p.get(k) for p in preds
                                          for k in ("step_us", "compute_us", "exposed_comm_us", "rest_us")])

    def t(x) -> str:
        return "" if x is None or is_missing(x) else fmt_fixed(x / tscale)
    rows = []
    for p in preds:
        peak, step = p.get("peak_allocated_bytes"), p.get("step_us")
        dp = f"{100.0 * (peak / mpeak - 1):+.1f}" if peak and mpeak else ""
        ds = f"{100.0 * (step / mstep - 1):+.1f}" if step and mstep else ""
        name = p.get("label") or p.get("strategy")
        if p.get("is_run"):
            name += " (this run's own)"
        interval = (f"{t(p['step_low_us'])} to {t(p['step_high_us'])}"
                    if p.get("step_low_us") is not None and step else "")
        rows.append([name, p.get("world_size"), p.get("shard_group"), "" if peak is None else fmt_fixed(peak / bscale),
                     dp, t(step), interval, ds, t(p.get("compute_us")), t(p.get("exposed_comm_us")),
                     t(p.get("rest_us"))])
    return text_table(["strategy", "world", "shard group", f"predicted peak ({bunit})", "vs measured (%)",
                       f"step time ({tunit})", f"step time interval ({tunit})", "vs measured (%)",
                       f"compute ({tunit})", f"exposed comm ({tunit})", f"rest ({tunit})"], rows)


REST_WORDS = ("rest: the predicted step's time that is neither compute nor exposed communication (host time outside "
              "operators, device idle, copies and waits): step time - compute - exposed comm.")
FIT_RANKS_SHOWN = 8      # ranks whose collective fits are listed (all of them in summary.json)


def _fits(result: dict) -> str:
    """Each rank's fitted collectives (latency + wire bytes / bandwidth), the model the step times use for a
    collective the run did not have."""
    fits = [(r, f) for r, f in (result.get("fits") or {}).items() if f]
    if not fits:
        return ""
    rows = [[f"rank {r}", "; ".join(f)] for r, f in fits[:FIT_RANKS_SHOWN]]
    more = (f'<p class="note">{len(fits) - FIT_RANKS_SHOWN} more ranks in summary.json</p>'
            if len(fits) > FIT_RANKS_SHOWN else "")
    return ("<h4>Collective fits (time = latency + wire bytes / bandwidth, fitted on each rank's own collectives)"
            "</h4>" + text_table(["rank", "fits"], rows, left=(0, 1)) + more)


def _figure(result: dict, page: Page) -> str:
    preds = [p for p in result.get("predictions") or [] if p.get("peak_allocated_bytes") is not None]
    if not preds:
        return ""
    names = [p.get("label") or p.get("strategy") for p in preds]
    cats = []
    for p in preds:
        for c in p.get("breakdown") or {}:
            if c not in cats:
                cats.append(c)
    fig = figures.Figure()
    for c in cats:
        fig.add_trace(figures.bar(x=names, y=[(p.get("breakdown") or {}).get(c, 0) / MIB for p in preds],
                                  name=label(category_label(c)),
                             marker_color=CATEGORY_COLORS.get(c, "#7f7f7f")))
    mpeak = (result.get("measured") or {}).get("peak_allocated_bytes")
    if mpeak:
        fig.add_hline(y=mpeak / MIB, line_dash="dot", annotation_text="this run, measured")
    fig.update_layout(barmode="relative", title="Predicted peak per rank, alive at the peak by category",
                      yaxis_title="MiB")
    return page.fig(fig, 360)


def _story(result: dict) -> str:
    out = []
    for p in result.get("predictions") or []:
        kept = "".join(f"<li>{esc(x)}</li>" for x in p.get("kept") or [])
        assumed = "".join(f"<li>{esc(x)}</li>" for x in p.get("assumed") or [])
        out.append(f"<details><summary>{esc(p.get('label') or p.get('strategy'))}: what was kept, what was "
                   f"assumed</summary><p>Kept from the measurement:</p><ul>{kept}</ul><p>Assumed:</p>"
                   f"<ul>{assumed}</ul></details>")
    return "".join(out)


def whatif_body(result: dict | None, page: Page, note: str | None = None) -> str:
    """Table, figure and the kept / assumed lists of a predictions dict (no section wrapper)."""
    out = []
    if note:
        out.append(f'<p class="note">{esc(note)}</p>')
    if not result or not result.get("predictions"):
        return "".join(out) or '<p class="note">No predictions for this input.</p>'
    out.append("<p>Each strategy predicted from this run's own record: its allocation timeline replayed "
               "under the strategy's rules (the peak is the maximum of the replayed timeline, per rank; the "
               "largest rank shown), and its compute timeline with the strategy's collectives placed on it "
               "(latency and bandwidth fitted on the run's own collectives).</p>")
    if result.get("missing"):
        left = "; ".join(f"{k}: {v}" for k, v in sorted(result["missing"].items()))
        out.append(f'<div class="banner"><b>Partial run</b>: predicted from '
                   f'{esc(rank_list(result.get("ranks_predicted") or []))} only; missing: {esc(left)}.</div>')
    if result.get("recommendation"):
        out.append(f"<p><b>Recommendation</b>: {esc(result['recommendation'])}.</p>")
    out.append(_table(result))
    if result.get("order"):
        out.append('<p class="note">Predicted step time, fastest first (an order is stated only where the '
                   'intervals do not overlap): ' + esc("; ".join(result["order"])) + ".</p>")
    out.append(f'<p class="note">{esc(REST_WORDS)}</p>')
    out.append(_fits(result))
    out.append(_figure(result, page))
    out.append(_story(result))
    for n in result.get("notes") or []:
        out.append(f'<p class="note">{esc(n)}</p>')
    return "".join(out)


def whatif_section(a: Analysis, page: Page) -> str:
    """The report's "What if" section (id ``whatif``) from an Analysis (``a.whatif``, ``a.notes['whatif']``)."""
    result = getattr(a, "whatif", None)
    note = (getattr(a, "notes", None) or {}).get("whatif")
    return f'<section id="whatif"><h2>What if</h2>{whatif_body(result, page, note)}</section>'


def render_whatif(result: dict, plotly_src: str | None = None) -> str:
    """The page `fsdpprof whatif -o` writes: the same section on its own (plotly.js as in render_report)."""
    page = Page(plotly_src)
    run = result.get("run") or {}
    title = f"fsdpprof what if: {run.get('description') or run.get('strategy') or 'run'}"
    body = f'<section id="whatif"><h2>What if</h2>{whatif_body(result, page)}</section>'
    return document(title, str(run.get("path") or ""), [("whatif", "What if")], body)
