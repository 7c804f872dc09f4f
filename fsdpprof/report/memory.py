"""The "Memory" section: the peak per rank, what was alive at the peak by category, memory over the recorded
steps, the OOM explained and FSDP's buffers (fsdpprof.report.oom), the largest allocations, and the ZeRO formula
for the model states and the peak beside the measurement."""
from __future__ import annotations

import pandas as pd

from fsdpprof.analyze.model import rank_list
from fsdpprof.analyze.headline import peak_rank
from fsdpprof.report import figures, many_ranks, oom
from fsdpprof.report.page import (CATEGORY_COLORS, Page, category_label, esc, fmt_bytes, fmt_fixed, fmt_num, label,
                                  mem_scale, notes_html, side_by_side, table, value_label)


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
            out.append(f'<p class="note">{esc(rank_list(same))}: the same as rank {esc(r0)}.</p>')
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


def _drop_empty(df: pd.DataFrame, cols=()) -> pd.DataFrame:
    """Leave out columns with no value in any row (e.g. reserved bytes on a CPU trace)."""
    empty = [c for c in (cols or df.columns) if c in df and (df[c].isna() | (df[c].astype(str) == "")).all()]
    return df.drop(columns=empty)


def memory_section(a, page: Page) -> str:
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
