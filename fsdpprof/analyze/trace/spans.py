"""Spans of one rank's labels over time (µs): steps, the stages of each step, and the regions each FSDP annotation
labels (phase and unit), as :mod:`.labels` labels the events.  What ``fsdpprof timeline`` draws as tracks."""
from __future__ import annotations

import numpy as np
import pandas as pd

from fsdpprof.analyze import model
from fsdpprof.analyze.comm import intervals
from fsdpprof.analyze.load.frames import isin
from fsdpprof.analyze.trace import labels

STEP_SPAN_COLUMNS = ["step", "start_us", "end_us"]
STAGE_SPAN_COLUMNS = ["step", "stage", "start_us", "end_us"]
FSDP_SPAN_COLUMNS = ["lane", "fsdp_phase", "unit", "start_us", "end_us"]
UNIT_SPAN_COLUMNS = ["lane", "unit", "start_us", "end_us"]


def step_spans(events: pd.DataFrame | None) -> pd.DataFrame:
    """One row per ProfilerStep: step, start_us, end_us (labels.step_marks)."""
    marks = labels.step_marks(events)
    return marks[STEP_SPAN_COLUMNS].reset_index(drop=True)


def stage_spans(events: pd.DataFrame | None) -> pd.DataFrame:
    """Per step, the stretches of one stage between two of its marks: step, stage, start_us, end_us."""
    marks = labels.step_marks(events)
    if not len(marks):
        return pd.DataFrame({c: [] for c in STAGE_SPAN_COLUMNS})
    bound_cols = ["start_us", "fwd_us", "bwd_us", "opt_us", "opt_end_us", "end_us"]
    rows = []
    for m in marks.itertuples(index=False):
        b = np.array([getattr(m, c) for c in bound_cols], dtype=np.float64)
        b = np.unique(b[np.isfinite(b) & (b >= m.start_us) & (b <= m.end_us)])
        if b.size < 2:
            continue
        mid = (b[:-1] + b[1:]) / 2
        codes = model.stage_codes_at(mid, marks)
        for s, e, c in zip(b[:-1].tolist(), b[1:].tolist(), codes.tolist()):
            stage = model.STAGES[c]
            if rows and rows[-1][0] == m.step and rows[-1][1] == stage and rows[-1][3] == s:
                rows[-1][3] = e
            else:
                rows.append([m.step, stage, s, e])
    return pd.DataFrame(rows, columns=STAGE_SPAN_COLUMNS)


def fsdp_spans(events: pd.DataFrame | None) -> pd.DataFrame:
    """Per thread, the stretches the innermost FSDP annotation labels: lane, fsdp_phase, unit ("" the root unit,
    None: none named), start_us, end_us, by lane and start."""
    if events is None or not len(events):
        return pd.DataFrame({c: [] for c in FSDP_SPAN_COLUMNS})
    names = events["name"].astype(str).to_numpy(object)
    parsed = {x: model.parse_fsdp(x) for x in pd.unique(names)}
    is_f = np.fromiter((parsed[x][0] is not None for x in names), dtype=bool, count=len(names))
    is_f &= labels.cpu_side(events) & ~isin(events["kind"], [model.KIND_COMM])
    f = events[is_f]
    out: list[list] = []
    ts_all = f["ts_us"].to_numpy(np.float64)
    end_all = ts_all + f["dur_us"].to_numpy(np.float64)
    lane_all = f["lane"].astype(str).to_numpy(object)
    fname = names[is_f]
    for lane in sorted(set(lane_all.tolist())):
        on = lane_all == lane
        ts, end, nm = ts_all[on], end_all[on], fname[on]
        b = np.unique(np.concatenate([ts, end]))
        if b.size < 2:
            continue
        k = intervals.innermost(ts, end, (b[:-1] + b[1:]) / 2)
        prev = -1
        for s, e, i in zip(b[:-1].tolist(), b[1:].tolist(), k.tolist()):
            if i >= 0 and prev == i and out[-1][4] == s:
                out[-1][4] = e
            elif i >= 0:
                phase, unit, _ = parsed[nm[i]]
                out.append([lane, phase, unit, s, e])
            prev = i
    return pd.DataFrame(out, columns=FSDP_SPAN_COLUMNS)


def unit_spans(fsdp: pd.DataFrame) -> pd.DataFrame:
    """:func:`fsdp_spans` merged by unit (adjacent stretches of one unit on a thread join): lane, unit, start_us,
    end_us; stretches that name no unit left out."""
    f = fsdp[fsdp["unit"].notna()] if len(fsdp) else fsdp
    rows: list[list] = []
    for r in f.itertuples(index=False):
        if rows and rows[-1][0] == r.lane and rows[-1][1] == r.unit and rows[-1][3] == r.start_us:
            rows[-1][3] = r.end_us
        else:
            rows.append([r.lane, r.unit, r.start_us, r.end_us])
    return pd.DataFrame(rows, columns=UNIT_SPAN_COLUMNS)
