"""Step-time decomposition per rank and step (microseconds).

Step window W: the ``ProfilerStep#N`` annotation on CPU traces; on GPU traces the span from the
first to the last device event (kernel, memcpy, memset, sync) launched in step N; with no
ProfilerStep in the trace, the span of all events (step 0).  Within W, with C the union of
compute and M the union of comm intervals of the rank:

    step_us = |W|, compute_us = |C ∩ W|, comm_us = |M ∩ W|, overlapped_comm_us = |C ∩ M ∩ W|,
    exposed_comm_us = comm_us - overlapped_comm_us,
    idle_us = time of W covered by no device event at all,
    residual_us = step_us - (compute_us + comm_us - overlapped_comm_us + idle_us)

so T_step = T_comp + T_comm - T_overlap + idle + residual, where residual is the time taken only by
memcpy/memset/sync (>= 0; it is checked per step by the tests).
"""
from __future__ import annotations

import numpy as np
import pandas as pd

from fsdpprof.analyze import model
from fsdpprof.analyze.comm import intervals
from fsdpprof.analyze.frames import isin, on_device, startswith

STEP_COLUMNS = ["rank", "step", "step_us", "compute_us", "comm_us", "overlapped_comm_us", "exposed_comm_us",
                "idle_us", "residual_us", "model_step_us", "unexplained_us"]


def step_windows(events: pd.DataFrame) -> pd.DataFrame:
    """rank, step, start_us, end_us of every step window (see module docstring)."""
    on_stream = on_device(events["lane"])
    is_ps = startswith(events["name"], (model.STEP_PREFIX,)) & ~on_stream
    is_dev = isin(events["kind"], model.DEVICE_KINDS)
    rows = []
    for r, ev in events.groupby("rank", sort=True):
        idx = events.index.get_indexer(ev.index)
        gpu = on_stream[idx].any()
        dev = ev[is_dev[idx]]
        ps = ev[is_ps[idx]]
        if len(ps) and not gpu:
            w = pd.DataFrame({"rank": r, "step": ps["step"].to_numpy(), "start_us": ps["ts_us"].to_numpy(),
                              "end_us": (ps["ts_us"] + ps["dur_us"]).to_numpy()})
        else:
            d = dev.assign(end=dev["ts_us"] + dev["dur_us"]).dropna(subset=["step"])
            g = d.groupby("step", sort=True)
            w = pd.DataFrame({"start_us": g["ts_us"].min(), "end_us": g["end"].max()}).reset_index()
            w.insert(0, "rank", r)
        rows.append(w)
    if not rows:
        return pd.DataFrame(columns=["rank", "step", "start_us", "end_us"])
    return pd.concat(rows, ignore_index=True)


def step_breakdown(events: pd.DataFrame) -> pd.DataFrame:
    """Per rank and step: step_us, compute_us, comm_us, overlapped_comm_us, exposed_comm_us, idle_us, residual_us,
    model_step_us (T_comp + T_comm - T_overlap) and unexplained_us (step_us - model_step_us)."""
    win = step_windows(events)
    if len(win) == 0:
        return pd.DataFrame(columns=STEP_COLUMNS)
    is_comp, is_comm = isin(events["kind"], [model.KIND_COMPUTE]), isin(events["kind"], [model.KIND_COMM])
    is_dev = isin(events["kind"], model.DEVICE_KINDS)
    ts = events["ts_us"].to_numpy()
    end = ts + events["dur_us"].to_numpy()
    ranks = events["rank"].to_numpy()
    parts = []
    for r, w in win.groupby("rank", sort=True):
        on = ranks == r
        cm, mm, dm = on & is_comp, on & is_comm, on & is_dev
        ws, we = w["start_us"].to_numpy(), w["end_us"].to_numpy()
        comp = intervals.overlap_with(ws, we, ts[cm], end[cm])
        comm = intervals.overlap_with(ws, we, ts[mm], end[mm])
        both_s, both_e = intervals.intersect(ts[cm], end[cm], ts[mm], end[mm])
        both = intervals.overlap_with(ws, we, both_s, both_e)
        busy = intervals.overlap_with(ws, we, ts[dm], end[dm])
        step_us = we - ws
        parts.append(pd.DataFrame({
            "rank": r, "step": w["step"].to_numpy(), "step_us": step_us, "compute_us": comp, "comm_us": comm,
            "overlapped_comm_us": both, "exposed_comm_us": comm - both, "idle_us": step_us - busy,
        }))
    out = pd.concat(parts, ignore_index=True)
    out["residual_us"] = out["step_us"] - (out["compute_us"] + out["comm_us"] - out["overlapped_comm_us"]
                                           + out["idle_us"])
    # T_step ~ T_comp + T_comm - T_overlap, beside the measured step time
    out["model_step_us"] = out["compute_us"] + out["comm_us"] - out["overlapped_comm_us"]
    out["unexplained_us"] = out["step_us"] - out["model_step_us"]
    return out[STEP_COLUMNS]
