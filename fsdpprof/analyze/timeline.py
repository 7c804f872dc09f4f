"""What ``fsdpprof timeline`` lays over the ranks' own events: per rank, its clock offset and fsdpprof's tracks.

:func:`timeline_tracks` takes a loaded run (its events frames) and its Analysis and returns a :class:`Timeline`:
the alignment of the ranks on one clock (:func:`fsdpprof.analyze.comm.skew.align_ranks`), and per rank its
steps, stages, FSDP phase and unit spans (:mod:`fsdpprof.analyze.trace.spans`), exposed communication spans
(:func:`fsdpprof.analyze.comm.overlap.exposed_comm_spans`), memory by category over time (the memory
analysis' timeline) and where each finding points (:func:`fsdpprof.analyze.summary.findings.finding_places`).  Every
time is on the rank's own clock (µs); subtract the rank's ``offset_us`` to put it on the common one.
"""
from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np
import pandas as pd

from fsdpprof.analyze.summary import findings as fnd
from fsdpprof.analyze.comm import overlap, skew, steps
from fsdpprof.analyze.trace import spans
from fsdpprof.errors import UserError


@dataclass
class RankTracks:
    """fsdpprof's tracks of one rank (times on the rank's own clock, µs)."""

    rank: int
    offset_us: float                     # subtracted from every time of this rank: the common clock
    residual_us: float                   # after it: how far its shared collectives end from the others' (median)
    steps: pd.DataFrame                  # step, start_us, end_us (ProfilerStep)
    stages: pd.DataFrame                 # step, stage, start_us, end_us
    fsdp: pd.DataFrame                   # lane, fsdp_phase, unit, start_us, end_us
    units: pd.DataFrame                  # lane, unit, start_us, end_us
    exposed: pd.DataFrame                # collective, start_us, end_us
    memory: pd.DataFrame | None          # ts_us + one column per memory category (bytes allocated)
    window: tuple[float, float] | None   # --steps: the part of the rank's clock kept (None: all)


@dataclass
class Timeline:
    """The ranks' alignment (skew.ALIGNMENT_COLUMNS), their tracks, the run's findings and where they point
    (findings.PLACE_COLUMNS), and one line per thing to say."""

    alignment: pd.DataFrame
    ranks: dict[int, RankTracks]
    findings: list
    places: pd.DataFrame
    notes: list[str] = field(default_factory=list)


def clock_anchors_us(run) -> dict:
    """rank -> the µs to add to its trace times for Unix time, from the clock anchor fsdpprof recorded in
    rank.json (None where it recorded none)."""
    out = {}
    for r, rd in run.ranks.items():
        a = (rd.info or {}).get("clock_anchor") if isinstance(rd.info, dict) else None
        base = a.get("base_time_ns") if isinstance(a, dict) else None
        out[r] = float(base) / 1e3 if isinstance(base, (int, float)) and not isinstance(base, bool) else None
    return out


def _memory_on_trace_clock(m, events: pd.DataFrame, trace_meta: dict, notes: list[str], r: int):
    """The memory timeline of a MemoryResult on the trace's clock, or None (with a note) when it is not there."""
    tl = getattr(m, "timeline", None)
    if tl is None or not len(tl):
        return None
    if getattr(m, "timeline_unit", "us") != "us":
        notes.append(f"rank {r}: its CUDA snapshot has no times (a legacy snapshot): no memory counters")
        return None
    if m.source == "cpu_trace":
        return tl
    # a CUDA snapshot's times are Unix µs: on the trace's clock through its baseTimeNanoseconds
    ts = tl["ts_us"].to_numpy(np.float64)
    lo, hi = float(events["ts_us"].min()), float((events["ts_us"] + events["dur_us"]).max())
    base = trace_meta.get("baseTimeNanoseconds")
    if isinstance(base, (int, float)) and not isinstance(base, bool):
        shifted = ts - float(base) / 1e3
        if ((shifted >= lo) & (shifted <= hi)).any():
            return tl.assign(ts_us=shifted)
    if ((ts >= lo) & (ts <= hi)).any():
        return tl
    notes.append(f"rank {r}: its CUDA snapshot's times do not fall in its trace: no memory counters")
    return None


def _window(events: pd.DataFrame, wanted: list, r: int) -> tuple[float, float]:
    """The stretch of rank ``r``'s clock that its steps ``wanted`` cover (ProfilerStep and device work)."""
    w = steps.step_windows(events)
    s = spans.step_spans(events)
    w = w[w["step"].isin(wanted)]
    s = s[s["step"].isin(wanted)]
    if not len(w) and not len(s):
        have = sorted(set(pd.concat([steps.step_windows(events)["step"], spans.step_spans(events)["step"]])
                          .dropna().astype(int).tolist()))
        raise UserError(f"--steps {','.join(map(str, wanted))}: rank {r} has no such step (its steps: "
                        f"{', '.join(map(str, have)) or 'none'}); pick steps it has")
    lo = min(w["start_us"].min() if len(w) else np.inf, s["start_us"].min() if len(s) else np.inf)
    hi = max(w["end_us"].max() if len(w) else -np.inf, s["end_us"].max() if len(s) else -np.inf)
    return float(lo), float(hi)


def timeline_tracks(run, analysis, wanted_steps: list | None = None, align: str | None = None) -> Timeline:
    """The Timeline of a run whose events are loaded (:func:`fsdpprof.analyze.load.run.load_run`) and of its Analysis
    (:func:`fsdpprof.analyze.pipeline.analyze_run`).  ``wanted_steps``: keep those steps only (UserError for a
    rank without any of them); ``align``: skew.ALIGN_ANCHOR or skew.ALIGN_COLLECTIVES to prefer that way of
    aligning the clocks (None: the anchor where fsdpprof recorded one, see :func:`skew.align_ranks`)."""
    notes: list[str] = []
    traced = {r: rd for r, rd in sorted(run.ranks.items()) if rd.events is not None and len(rd.events)}
    if not traced:
        raise UserError(f"{run.path} holds no profiler trace: a timeline is made of the ranks' traces")
    records = pd.concat([skew.collective_records(rd.events) for rd in traced.values()], ignore_index=True)
    alignment, said = skew.align_ranks(records, list(traced), clock_anchors_us(run), align)
    notes += said
    al = alignment.set_index("rank")
    exposed_all = []
    ranks = {}
    for r, rd in traced.items():
        ev = rd.events
        fsdp = spans.fsdp_spans(ev)
        exposed = overlap.exposed_comm_spans(ev)
        exposed_all.append(exposed)
        m = analysis.memory.get(r) if analysis is not None else None
        mem = _memory_on_trace_clock(m, ev, rd.trace_meta or {}, notes, r) if m is not None else None
        ranks[r] = RankTracks(rank=r, offset_us=float(al.at[r, "offset_us"]),
                              residual_us=float(al.at[r, "residual_us"]), steps=spans.step_spans(ev),
                              stages=spans.stage_spans(ev), fsdp=fsdp, units=spans.unit_spans(fsdp),
                              exposed=exposed.drop(columns="rank"), memory=mem,
                              window=_window(ev, wanted_steps, r) if wanted_steps else None)
    items = list(analysis.findings) if analysis is not None else []
    windows = pd.concat([steps.step_windows(rd.events) for rd in traced.values()], ignore_index=True)
    peaks = {r: m.peak_ts_us for r, m in (analysis.memory.items() if analysis is not None else [])
             if r in ranks and ranks[r].memory is not None and m.peak_ts_us is not None}
    peaks = {r: float(ts) - (0.0 if analysis.memory[r].source == "cpu_trace" else
                             float(ranks[r].memory["ts_us"].iat[0]) - float(analysis.memory[r].timeline["ts_us"].iat[0]))
             for r, ts in peaks.items()}
    places = fnd.finding_places(items, list(ranks), windows, pd.concat(exposed_all, ignore_index=True), peaks)
    return Timeline(alignment=alignment, ranks=ranks, findings=items, places=places, notes=notes)
