"""The "Memory" section: the peak per rank, what was alive at the peak, memory over the steps, the OOM and FSDP's
buffers (report.oom), the allocator's cache, the largest allocations, and the ZeRO formulas beside the measurement."""
from __future__ import annotations

from typing import TYPE_CHECKING

import itertools

import pandas as pd

from fsdpprof.analyze.model import rank_list
from fsdpprof.analyze.summary.headline import peak_rank
from fsdpprof.analyze.memory.attribution import DEVICE_CHOICE_LARGEST
from fsdpprof.analyze.memory.process import CONTRADICTS_ALLOCATOR
from fsdpprof.analyze.load.files import SOURCE_SNAPSHOT_FILE
from fsdpprof.report import figures, many_ranks, oom
from fsdpprof.report.page import (CATEGORY_COLORS, OUTSIDE_ALLOCATOR_COLOR, OUTSIDE_ALLOCATOR_LABEL, Page,
                                  category_label, esc, fmt_bytes, fmt_fixed, fmt_num, label, mem_scale, moment_label,
                                  notes_html, side_by_side, signed_bytes, size_class_label, table, value_label)

if TYPE_CHECKING:      # (the report's modules stay light: plan and --help import some)
    from fsdpprof.analyze.pipeline import Analysis


def memory_owner(a: Analysis, r) -> str:
    """Whose memory rank ``r``'s result is: "cuda:1" (one snapshot file), "rank 3, cuda:3" or "rank 3"."""
    dev = getattr((a.memory or {}).get(r), "device", None)
    if dev is None:
        return f"rank {r}"
    return f"cuda:{dev}" if a.source == SOURCE_SNAPSHOT_FILE else f"rank {r}, cuda:{dev}"


def devices_analysed(a: Analysis) -> str:
    """The devices of one snapshot file analysed ("cuda:0, cuda:1"); "" for any other input."""
    if a.source != SOURCE_SNAPSHOT_FILE:
        return ""
    devs = sorted({m.device for m in (a.memory or {}).values() if getattr(m, "device", None) is not None})
    return ", ".join(f"cuda:{d}" for d in devs)


def other_devices_said(m) -> str:
    """For a snapshot of several devices analysed on the largest, the others' peaks and how to choose one; else ""."""
    peaks = getattr(m, "device_peaks", None) or {}
    if len(peaks) < 2 or getattr(m, "device_choice", None) != DEVICE_CHOICE_LARGEST:
        return ""
    others = ", ".join(f"cuda:{d} {fmt_bytes(b)}" for d, b in sorted(peaks.items()) if d != m.device)
    return f"the largest of the snapshot's {len(peaks)} devices; the others peak at {others} (--device N or all)"


def _theory_block(a: Analysis) -> str:
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
           f"{esc(fmt_bytes(t.get('measured_model_states_bytes')))}; measured - formula "
           f"{esc(signed_bytes(t.get('model_states_diff_bytes')))}: {esc(t.get('model_states_explanation'))}</div>"]
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
                   f'{esc(fmt_bytes(pe.get("measured_peak_bytes")))}; measured - formula {esc(signed_bytes(diff))}: '
                   f'{esc(pe.get("explanation") or "no memory data to compare")}</div>')
    return "".join(out)


def _process_block(a: Analysis) -> str:
    """The process's memory beside the allocator's, per rank (rank.json's samples; "" when no rank has them)."""
    rows, notes = [], []
    for r, m in sorted(a.memory.items()):
        p = getattr(m, "process", None)
        if not p:
            continue
        keys = ("source_words", "used_peak_bytes", "allocator_reserved_peak_bytes", "outside_allocator_peak_bytes")
        # readings that contradict the allocator: said so, the memory outside it unknown (never a negative figure)
        rows.append({"rank": r, **{k: p.get(k) for k in keys},
                     "reading": CONTRADICTS_ALLOCATOR if p.get("contradiction") else ""})
        if p.get("note") and p["note"] not in notes:
            notes.append(p["note"])
        if p.get("contradiction"):
            notes.append(f"rank {r}: {CONTRADICTS_ALLOCATOR}: {p['contradiction']}; the memory outside the "
                         f"allocator is unknown")
    if not rows:
        return ""
    first = next(m.process for _, m in sorted(a.memory.items()) if getattr(m, "process", None))
    cpu = first.get("source") == "proc_status"
    what = ("Python's objects, the interpreter and the libraries (the allocator's peak: what the profiler's memory "
            "events show)" if cpu else "the CUDA context, NCCL's buffers and other libraries (the allocator's peak: "
            "torch.cuda.max_memory_reserved)")
    out = [f"<h3>The process's memory beside the allocator's</h3><p class='note'>{esc(OUTSIDE_ALLOCATOR_LABEL)}: "
           f"{esc(what)}; sampled at the end of every step of the window.</p>"]
    df = pd.DataFrame(rows)
    if many_ranks.is_many(a) and len(df) > 16:
        df = df.sort_values("outside_allocator_peak_bytes", ascending=False, kind="stable").head(16)
        out.append('<p class="note">the 16 ranks with the most outside the allocator; every rank in '
                   "summary.json</p>")
    out.append(table(df, left=("source_words",)))
    out.extend(f'<p class="note">{esc(n)}</p>' for n in notes)
    return "".join(out)


MOMENT_COLORS = {"peak": "#1f77b4", "oom": "#dc2626", "end": "#9ca3af"}


def _fragmentation_block(m, page: Page) -> str:
    """The caching allocator's cache of one rank: reserved vs allocated at the peak, the OOM and the end, its free
    blocks by size, the largest free block beside the largest request that followed ("" without a snapshot)."""
    f = getattr(m, "fragmentation", None)
    if f is None:
        return ""
    notes = "".join(f'<p class="note">{esc(n)}</p>' for n in f.notes)
    if not f.entries:
        return notes
    dev = getattr(m, "device", None)
    where = f", cuda:{dev}" if dev is not None else ""
    title = "The allocator's cache" + where + ": reserved vs allocated"
    out = [f"<h3>{esc(title)}</h3>",
           '<p class="note">reserved: memory the CUDA caching allocator holds from the device; allocated: the '
           "blocks in use; the rest sits free in the cache, usable only by a request that fits in one free block.</p>"]
    ents = f.entries
    sc, unit = mem_scale(max(e.reserved_bytes for e in ents))
    xs = [label(moment_label(e.at)) for e in ents]
    fig = figures.Figure()
    fig.add_trace(figures.bar(x=xs, y=[e.allocated_bytes / sc for e in ents], name="allocated", marker_color="#1f77b4"))
    fig.add_trace(figures.bar(x=xs, y=[e.free_bytes / sc for e in ents], name="free in the cache",
                              marker_color="#fbbf24",
                              text=[f"{e.free_blocks:,} blocks" for e in ents], textposition="inside"))
    fig.update_layout(barmode="stack", title="Reserved = allocated + free in the cache", yaxis_title=unit)
    charts = [page.fig(fig, 320)]
    # the free blocks by size at the moment that matters most: the OOM, else the peak, else the end
    shown = next((e for at in ("oom", "peak", "end") for e in ents if e.at == at and e.free_blocks_by_size), None)
    if shown is not None:
        cls = shown.free_blocks_by_size
        fsc, funit = mem_scale(max(c["bytes"] for c in cls))
        fig = figures.Figure(figures.bar(x=[label(size_class_label(c["lo_bytes"], c["hi_bytes"])) for c in cls],
                                         y=[c["bytes"] / fsc for c in cls],
                                         text=[f"{c['count']:,} block{'s' if c['count'] != 1 else ''}" for c in cls],
                                         textposition="outside", cliponaxis=False,
                                         marker_color=MOMENT_COLORS.get(shown.at, "#7f7f7f")))
        fig.update_layout(title=f"Free blocks by size, {label(moment_label(shown.at))}", yaxis_title=funit,
                          xaxis_title="free block size")
        charts.append(page.fig(fig, 320))
    out.append(side_by_side(*charts))
    def figures_of(e) -> tuple:
        return e.largest_free_block_bytes, e.largest_request_after_bytes, e.free_bytes, e.free_blocks
    # consecutive moments with the same figures said once
    for _, same in itertools.groupby([e for e in ents if e.largest_request_after_bytes is not None], key=figures_of):
        same = list(same)
        e, req = same[0], same[0].largest_request_after_bytes
        when = " and ".join(moment_label(x.at) for x in same)
        fits = e.largest_free_block_bytes >= req
        out.append(f"<p>{esc(when[:1].upper() + when[1:])}: the largest free block was "
                   f"{esc(fmt_bytes(e.largest_free_block_bytes))}, the largest request that followed "
                   f"{esc(fmt_bytes(req))}: "
                   + (esc("one free block could have held it.") if fits else
                      esc(f"no free block could hold it; {fmt_bytes(e.free_bytes)} free in the cache as "
                          f"{e.free_blocks:,} blocks" + (" (segments already expandable)." if e.expandable_segments
                                                          else ", in segments that are not expandable.")))
                   + "</p>")
    fields = ("reserved_bytes", "allocated_bytes", "free_bytes", "free_blocks", "free_small_bytes", "free_large_bytes",
              "largest_free_block_bytes", "largest_request_after_bytes", "expandable_segments")
    df = pd.DataFrame([{"moment": moment_label(e.at), **{k: getattr(e, k) for k in fields}} for e in ents])
    out.append(table(df, left=("moment",), labels={"free_bytes": "free in the cache"}))
    out.append(notes)
    return "".join(out)


def timeline_figure(tl: pd.DataFrame, t_origin: float | None, sc: float, unit: str, owner: str) -> figures.Figure:
    """Memory over the recorded steps, stacked by category (``tl``: ts_us and bytes per category; ``t_origin``:
    the window's first µs, None for a snapshot without times).  What a category holds below zero (a CPU run's
    other threads freeing what the named categories counted) is stacked below the axis, not into the others."""
    fig = figures.Figure()
    by_index = t_origin is None  # legacy snapshots: no times
    xs = tl["ts_us"] if by_index else (tl["ts_us"] - t_origin) / 1e3
    for c in [c for c in tl.columns if c != "ts_us" and pd.api.types.is_numeric_dtype(tl[c])]:
        y = tl[c].astype("float64") / sc
        shown = False
        for part, group in ((y.clip(lower=0.0), "above"), (y.clip(upper=0.0), "below")):
            if not (part != 0).any():
                continue
            fig.add_trace(figures.scatter(x=xs, y=part, name=label(category_label(c)), legendgroup=str(c),
                                          showlegend=not shown, mode="lines", stackgroup=group,
                                          line=dict(width=0.5, color=CATEGORY_COLORS.get(c))))
            shown = True
    fig.update_layout(title=f"Memory over the recorded steps, {owner}",
                      xaxis_title="allocation event number (the snapshot has no times)" if by_index
                      else "ms from window start", yaxis_title=unit, legend=dict(font=dict(size=11)))
    return fig


def memory_section(a: Analysis, page: Page) -> str:
    out = ['<section id="memory"><h2>Memory</h2>', notes_html(a, "memory")]
    if a.memory_peaks is not None and not a.memory_peaks.empty:
        mp = a.memory_peaks
        if many_ranks.is_many(a):   # above 16 ranks: a distribution over ranks, not a row per rank
            out.append(many_ranks.memory_peaks(a, page))
        else:
            if len(mp) > 2:   # with one or two ranks the table says it all
                sc, unit = mem_scale(mp["peak_allocated_bytes"].max())
                fig = figures.Figure(figures.bar(x=[memory_owner(a, r) for r in mp["rank"]], y=mp["peak_allocated_bytes"] / sc,
                                       marker_color="#1f77b4"))
                fig.update_layout(title="Peak allocated memory per rank", yaxis_title=unit)
                out.append(page.fig(fig, 300))
            # one snapshot file names no rank: its devices name the rows
            drop = ["peak_ts_us"] + (["rank"] if a.source == SOURCE_SNAPSHOT_FILE else [])
            out.append(table(mp.drop(columns=drop, errors="ignore")))
        r0 = peak_rank(a)   # the rank the headline's peak is from
        m = a.memory[r0]
        owner = memory_owner(a, r0)
        said = other_devices_said(m)
        if said:
            out.append(f'<p class="note">Analysed {esc(owner)}: {esc(said)}.</p>')
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
                                   textposition="outside", cliponaxis=False, name="at the peak", showlegend=False))
            outside = (getattr(m, "process", None) or {}).get("outside_allocator_peak_bytes")
            if outside is not None and outside > 0:     # the process's memory beyond the allocator's: its own bar
                # cut when it would flatten the categories (a CPU process's RSS dwarfs its tensors): its value said
                top = float(bd["bytes"].max()) if len(bd) else 0.0
                cut = top > 0 and outside > 2.5 * top
                fig.add_trace(figures.bar(x=[label(OUTSIDE_ALLOCATOR_LABEL)], y=[(1.5 * top if cut else outside) / sc],
                                          marker_color=OUTSIDE_ALLOCATOR_COLOR, marker_pattern_shape="/",
                                          text=[f"{fmt_fixed(outside / sc)} {unit}<br>"
                                                + ("process (bar cut)" if cut else "process")],
                                          textposition="outside", cliponaxis=False,
                                          name=label(OUTSIDE_ALLOCATOR_LABEL), showlegend=False))
            fig.update_layout(title=f"At the peak, {owner} ({label(value_label('stage', m.peak_stage))}, "
                                    f"{m.coverage_pct:.0f}% attributed)", yaxis_title=unit, barmode="overlay")
            charts.append(page.fig(fig, 360))
        tl = m.timeline
        if tl is not None and not tl.empty and "ts_us" in tl:
            charts.append(page.fig(timeline_figure(tl, t_origin, sc, unit, owner), 360))
        out.append(side_by_side(*charts))
        out.append(_process_block(a))
        if a.overview.get("sharded"):
            out.append('<p class="note">gathered params: a unit\'s parameters all-gathered for its forward or backward; '
                       "unsharded grads: a unit's full gradients waiting for their reduce-scatter; sharded params, "
                       "sharded grads and optimizer states: this rank's 1/N of the model states.</p>")
        out.append(oom.render_oom(m))           # the OOM explained, with what would free enough
        out.append(_fragmentation_block(m, page))  # the allocator's cache: reserved vs allocated, its free blocks
        out.append(oom.render_fsdp_memory(m))   # FSDP's buffers by role, A_l per unit (also without an inventory)
        if m.top_allocations is not None and not m.top_allocations.empty:
            out.append(f"<h3>Largest allocations alive at the peak, {esc(owner)}</h3>")
            top = m.top_allocations.head(15).copy()
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
