"""The "What limits the step" section: the critical path across ranks of each step (its breakdown by kind, the
limiting rank) and what each change would save (fsdpprof.analyze.comm.critical_path)."""
from __future__ import annotations

from typing import TYPE_CHECKING

import pandas as pd

from fsdpprof.analyze import model
from fsdpprof.report import figures
from fsdpprof.report.page import Page, esc, fmt_num, notes_html, table, value_label

if TYPE_CHECKING:      # (the report's modules stay light: plan and --help import some)
    from fsdpprof.analyze.pipeline import Analysis

PATH_COLORS = {model.PATH_COMPUTE: "#1f77b4", model.PATH_COLLECTIVE: "#dc2626", model.PATH_HOST_GAP: "#9ca3af",
               model.PATH_SYNC: "#f59e0b", model.PATH_DATA: "#8b5cf6", model.PATH_WAIT: "#fca5a5"}
COUNTERFACTUAL_ROWS = 8
SEGMENT_ROWS = 10


def _ms(us: float) -> str:
    return model.fmt_ms(float(us))


def critical_section(a: Analysis, page: Page) -> str:
    """The section, or "" when the input has no steps (nothing to say) and no note on why."""
    cp = getattr(a, "critical_path", None)
    if cp is None or cp.steps is None or not len(cp.steps):
        note = notes_html(a, "critical_path")
        return f'<section id="critical_path"><h2>What limits the step</h2>{note}</section>' if note else ""
    out = ['<section id="critical_path"><h2>What limits the step</h2>', notes_html(a, "critical_path")]
    st = cp.steps
    cf = cp.counterfactuals
    mean_len = float(st["span_us"].mean())
    lim = st["limiting_rank"].dropna().astype(int)
    if len(cf) and float(cf["saved_us_per_step"].iat[0]) > 0:
        top = cf.iloc[0]
        out.append(f'<p class="lead"><b>{esc(str(top["change"]).capitalize())}</b> would save '
                   f'<b>{esc(_ms(top["saved_us_per_step"]))}</b> per step '
                   f'({esc(model.fmt_pct(top["saved_pct"]))} of the step\'s {esc(_ms(mean_len))}, from the first '
                   f'rank\'s start to the last rank\'s end).</p>')
    if len(lim):
        counts = lim.value_counts()
        words = ", ".join(f"rank {r} in {n} of {len(st)} step{'s' if len(st) != 1 else ''}"
                          for r, n in counts.head(4).items())
        out.append(f"<p>Limiting rank (the one whose work, as fast as the median rank's, would shorten the step "
                   f"most): {esc(words)}.</p>")
    out.append("<p>The critical path is the chain of work, across ranks, that set each step's length: walking back "
               "from the end of the step on the rank that ends last, through its work, and, where it waited in a "
               "collective for a later rank, on to that rank's work. Each change below is replayed on the recorded "
               "steps (every rank's work as recorded, each collective waiting for its last rank): the time it "
               "saves per step. Time spent waiting for another rank is that rank's, never the collective's.</p>")
    br = cp.breakdown[cp.breakdown["step"].notna()]
    if len(br):
        fig = figures.Figure()
        x_of = {s: f"step {fmt_num(s)} (rank {int(r)})" if r == r and r is not None else f"step {fmt_num(s)}"
                for s, r in zip(st["step"], st["limiting_rank"])}
        for kind in model.PATH_KINDS:
            k = br[br["kind"] == kind]
            if len(k):
                fig.add_trace(figures.bar(x=[x_of.get(s, str(s)) for s in k["step"]], y=k["dur_us"] / 1e3,
                                          name=model.PATH_KIND_WORDS[kind], marker_color=PATH_COLORS[kind]))
        fig.update_layout(barmode="stack", title="The critical path of each step, by kind (limiting rank)",
                          yaxis_title="ms")
        out.append(page.fig(fig, 320))
    if len(cf):
        shown = cf.head(COUNTERFACTUAL_ROWS).assign(saved_us=lambda d: d["saved_us_per_step"])
        cols = ["change", "saved_us", "saved_pct"]
        if "contended_us" in shown and shown["contended_us"].notna().any():
            cols.append("contended_us")    # CPU runs: the part a rank's longer wait for a core explains
        if "p_value" in shown and shown["p_value"].notna().any():
            cols.append("p_value")         # a rank's: how likely chance alone makes it this much slower
        out.append("<h3>What each change would save</h3>" + table(
            shown, cols, left=("change",),
            labels={"change": "change (replayed)", "saved_us": "saved per step", "saved_pct": "% of the step",
                    "contended_us": "of it, its longer wait for a core", "p_value": "p (rank slower by chance)"}))
    if cp.top is not None and len(cp.top):
        t = cp.top.head(SEGMENT_ROWS)
        # a collective's "what" is a vocabulary name (all_reduce -> all-reduce); an op's is a trace name, kept
        what = [value_label("collective", w) if k == model.PATH_COLLECTIVE else w for k, w in zip(t["kind"], t["what"])]
        t = t.assign(what=what, kind=t["kind"].map(model.PATH_KIND_WORDS).fillna(t["kind"]), per_step_us=t["us_per_step"])
        out.append("<h3>The path's largest parts</h3>" + table(
            t, ["rank", "kind", "what", "unit", "stage", "per_step_us", "pct"], left=("kind", "what", "unit", "stage"),
            labels={"per_step_us": "per step", "pct": "% of the path", "what": "op / collective"}))
    cols = ["step", "span_us", "length_us", "path_us", "limiting_rank", "limiting_rank_saved_us", "limiting_rank_us",
            "residual_us"]
    out.append(table(pd.DataFrame(st), cols, labels={
        "span_us": "step (all ranks)", "length_us": "step (path's ranks)", "path_us": "path",
        "limiting_rank_saved_us": "it would save", "limiting_rank_us": "its time on the path",
        "residual_us": "alignment residual"}))
    out.append("</section>")
    return "".join(out)
