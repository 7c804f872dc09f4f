"""What ``fsdpprof timeline`` lays over the ranks' own events (:func:`timeline_tracks`): the ranks aligned on one
clock, and per rank its step, stage, FSDP phase and unit spans, exposed communication, its part of the critical
path, memory by category and where each finding points.  Times are on the rank's own clock (µs); subtract its
``offset_us`` for the common one.
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
    critical: pd.DataFrame | None = None  # the critical path's segments on this rank: step, kind, what, unit,
                                          # stage, start_us, end_us (critical_path.SPAN_COLUMNS)


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
    both = [df[["step", "start_us", "end_us"]] for df in (steps.step_windows(events), spans.step_spans(events))]
    kept = [df[df["step"].isin(wanted)] for df in both]
    if not any(len(df) for df in kept):
        have = sorted(set(pd.concat([df["step"] for df in both]).dropna().astype(int).tolist()))
        raise UserError(f"--steps {','.join(map(str, wanted))}: rank {r} has no such step (its steps: "
                        f"{', '.join(map(str, have)) or 'none'}); pick steps it has")
    return (float(min(df["start_us"].min() for df in kept if len(df))),
            float(max(df["end_us"].max() for df in kept if len(df))))


def timeline_tracks(run, analysis, wanted_steps: list | None = None, align: str | None = None) -> Timeline:
    """The Timeline of a run whose events are loaded (:func:`fsdpprof.analyze.load.run.load_run`) and of its Analysis
    (:func:`fsdpprof.analyze.pipeline.analyze_run`).  ``wanted_steps``: keep those steps only (UserError for a
    rank without any of them); ``align``: skew.ALIGN_ANCHOR or skew.ALIGN_COLLECTIVES to prefer that way of
    aligning the clocks (None: the anchor where fsdpprof recorded one, see :func:`skew.align_ranks`)."""
    notes: list[str] = []
    traced = {r: rd for r, rd in sorted(run.ranks.items()) if rd.events is not None and len(rd.events)}
    if not traced:
        raise UserError(f"{run.path} holds no profiler trace: a timeline is made of the ranks' traces")
    matched = getattr(analysis, "matches", None) if analysis is not None else None
    records = matched if matched is not None and len(matched) else pd.concat(
        [skew.collective_records(rd.events) for rd in traced.values()], ignore_index=True)
    alignment, said = skew.align_ranks(records, list(traced), clock_anchors_us(run), align)
    notes += said
    al = alignment.set_index("rank")
    exposed_all = []
    ranks = {}
    memory = analysis.memory if analysis is not None else {}
    cp = getattr(analysis, "critical_path", None)
    path = cp.spans if cp is not None and cp.spans is not None else None
    for r, rd in traced.items():
        ev = rd.events
        fsdp = spans.fsdp_spans(ev)
        exposed = overlap.exposed_comm_spans(ev)
        exposed_all.append(exposed)
        mem = _memory_on_trace_clock(memory[r], ev, rd.trace_meta or {}, notes, r) if r in memory else None
        ranks[r] = RankTracks(rank=r, offset_us=float(al.at[r, "offset_us"]),
                              residual_us=float(al.at[r, "residual_us"]), steps=spans.step_spans(ev),
                              stages=spans.stage_spans(ev), fsdp=fsdp, units=spans.unit_spans(fsdp),
                              exposed=exposed.drop(columns="rank"), memory=mem,
                              window=_window(ev, wanted_steps, r) if wanted_steps else None,
                              critical=path[path["rank"] == r].drop(columns="rank") if path is not None else None)
    items = list(analysis.findings) if analysis is not None else []
    windows = pd.concat([steps.step_windows(rd.events) for rd in traced.values()], ignore_index=True)
    peaks = {}      # where each rank's memory peaks, on the timeline's clock (that of its memory track)
    for r, m in memory.items():
        if r in ranks and ranks[r].memory is not None and m.peak_ts_us is not None:
            shift = 0.0 if m.source == "cpu_trace" else float(ranks[r].memory["ts_us"].iat[0]) - float(
                m.timeline["ts_us"].iat[0])
            peaks[r] = float(m.peak_ts_us) - shift
    places = fnd.finding_places(items, list(ranks), windows, pd.concat(exposed_all, ignore_index=True), peaks)
    return Timeline(alignment=alignment, ranks=ranks, findings=items, places=places, notes=notes)
