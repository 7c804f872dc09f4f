"""The "What ZeRO promises" section of compare.html: the formulas' model states, peak and traffic per rank beside
what was measured, and the memory at the peak by category beside the formula's model states, per run."""
from __future__ import annotations

from fsdpprof.analyze.model import MemoryCategory as MC
from fsdpprof.report import figures
from fsdpprof.report.page import (CATEGORY_COLORS, Page, category_label, esc, fmt_fixed, fmt_pct, fmt_spread, is_missing,
                                  label, mem_scale, text_table)


def spread_of(c, run: str, metric: str) -> tuple[float, float]:
    """(min, max) of a run's metric over ranks and steps (Comparison.spread), NaN when not measured."""
    sp = getattr(c, "spread", None)
    if sp is None or sp.empty:
        return float("nan"), float("nan")
    s = sp[(sp["run"] == run) & (sp["metric"] == metric)]
    return (float(s.iloc[0]["min"]), float(s.iloc[0]["max"])) if len(s) else (float("nan"), float("nan"))


def promise_section(c, page: Page) -> str:
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
    def ratio(x) -> str:
        return "" if is_missing(x) else f"{float(x):.2f}×"

    rows = [[r["run"], r["world_size"], fmt_fixed(r["model_states_theory_bytes"] / sc),
             ratio(r["model_states_theory_ratio"]), fmt_fixed(r["model_states_measured_bytes"] / sc),
             ratio(r["model_states_measured_ratio"]), fmt_fixed(r["peak_allocated_bytes"] / sc), ratio(r["peak_ratio"]),
             fmt_fixed(r["traffic_theory_bytes"] / sc), fmt_fixed(r["traffic_measured_bytes"] / sc),
             ratio(r["traffic_measured_vs_ddp"]),
             fmt_spread(r["exposed_comm_us"], *spread_of(c, r["run"], "exposed_comm_us"), scale=1e3),
             fmt_pct(r["exposed_comm_pct"]), fmt_spread(r["step_us"], *spread_of(c, r["run"], "step_us"), scale=1e3)]
            for _, r in p.iterrows()]
    note = ("The formulas: model states per rank = (k_p + k_g + k_o) Ψ / N under FULL_SHARD (ZeRO-3), "
            "k_p Ψ + (k_g + k_o) Ψ / N under SHARD_GRAD_OP (ZeRO-2), Ψ over the shard group under HSDP; traffic per "
            "rank per step = 3(N-1)/N S for FULL_SHARD against 2(N-1)/N S for DDP's all-reduce: 1.5x. "
            f"× is the ratio to {base['run']} (the shaded row), and for traffic the ratio to what DDP's "
            "all-reduce moves on as many ranks. Peak: the rank whose peak is highest; times per step: each rank's "
            "mean, the median over ranks (min–max over ranks and steps in brackets). The peak adds what the formula "
            "leaves out (gathered units, gradients waiting for their reduce-scatter, activations).")
    out = ['<section id="promise"><h2>What ZeRO promises, and what was measured</h2>'
           + text_table(cols, rows, row_class=["base" if b else "" for b in p["baseline"]], top=f"<tr>{heads1}</tr>")
           + f'<p class="note">{esc(note)}</p>']
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
        for cat in (MC.PARAM.value, MC.GRAD.value, MC.OPTIMIZER_STATE.value):
            g = formula[formula["category"] == cat].groupby("run")["bytes"].sum()
            if g.empty:
                continue
            fig.add_trace(figures.bar(x=[[label(r) for r in runs], [said] * len(runs)], y=[g.get(r, 0.0) / sc for r in runs],
                                 name=label(category_label(cat)), legendgroup="formula",
                                 legendgrouptitle_text="ZeRO formula (model states)",
                                 marker=dict(color=CATEGORY_COLORS.get(cat), pattern=dict(shape="/", fgcolor="#fff"))))
    fig.update_layout(barmode="relative", title="Memory per rank: measured at the peak by category, beside the ZeRO "
                                             "formula's model states (hatched)", yaxis_title=unit,
                      xaxis=dict(tickangle=0), legend=dict(groupclick="toggleitem", font=dict(size=11)))
    return page.fig(fig, 480)
