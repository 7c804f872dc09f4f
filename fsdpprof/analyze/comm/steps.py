"""Step-time decomposition per rank and step (µs).  The step window W is the ``ProfilerStep#N`` annotation on CPU
traces, on GPU traces the span of the device events launched in step N (no ProfilerStep: all events, step 0).
With C the union of compute and M of comm intervals: compute_us = |C ∩ W|, comm_us = |M ∩ W|,
overlapped_comm_us = |C ∩ M ∩ W|, idle_us = time of W with no device event, and residual_us = step_us -
(compute + comm - overlapped + idle) >= 0 is memcpy/memset/sync alone."""
from __future__ import annotations

import numpy as np
import pandas as pd

from fsdpprof.analyze import model
from fsdpprof.analyze.comm import breakdown, intervals
from fsdpprof.analyze.load.frames import distinct_ranks, isin, on_device, startswith

STEP_COLUMNS = ["rank", "step", "step_us", "compute_us", "comm_us", "overlapped_comm_us", "exposed_comm_us",
                "idle_us", "residual_us", "model_step_us", "unexplained_us"]


def step_windows(events: pd.DataFrame) -> pd.DataFrame:
    """rank, step, start_us, end_us of every step window (see module docstring).  Column arrays only: no copy
    of the frame, however big."""
    on_stream = on_device(events["lane"])
    is_ps = startswith(events["name"], (model.STEP_PREFIX,)) & ~on_stream
    is_dev = isin(events["kind"], model.DEVICE_KINDS)
    rank = events["rank"].to_numpy()
    ts = events["ts_us"].to_numpy(np.float64)
    dur = events["dur_us"].to_numpy(np.float64)
    step = events["step"].to_numpy(np.float64)
    ranks = distinct_ranks(rank).tolist()
    one = len(ranks) == 1
    rows = []
    for r in ranks:
        on = None if one else rank == r
        gpu = bool(on_stream.any() if one else (on_stream & on).any())
        ps = np.flatnonzero(is_ps if one else is_ps & on)
        if ps.size and not gpu:
            w = pd.DataFrame({"rank": r, "step": step[ps], "start_us": ts[ps], "end_us": ts[ps] + dur[ps]})
        else:
            d = np.flatnonzero((is_dev if one else is_dev & on) & ~np.isnan(step))
            g = pd.DataFrame({"step": step[d], "ts_us": ts[d], "end": ts[d] + dur[d]}).groupby("step", sort=True)
            w = pd.DataFrame({"start_us": g["ts_us"].min(), "end_us": g["end"].max()}).reset_index()
            w.insert(0, "rank", r)
        rows.append(w)
    if not rows:
        return pd.DataFrame(columns=["rank", "step", "start_us", "end_us"])
    return pd.concat(rows, ignore_index=True)


def step_breakdown(events: pd.DataFrame, windows: pd.DataFrame | None = None) -> pd.DataFrame:
    """Per rank and step: STEP_COLUMNS; model_step_us = compute + comm - overlapped, unexplained_us = step - model.
    ``windows``: :func:`step_windows` of these events, where the caller has them."""
    win = step_windows(events) if windows is None else windows
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
    out["model_step_us"] = out["compute_us"] + out["comm_us"] - out["overlapped_comm_us"]
    out["unexplained_us"] = out["step_us"] - out["model_step_us"]
    return out[STEP_COLUMNS]


STALL_COLUMNS = breakdown.DEVICE_IDLE_COLUMNS + ["sync_calls", "scalar_sync_calls", "sync_us", "sync_idle_us",
                                                "data_loader_us", "data_loader_idle_us"]


def step_stalls(events: pd.DataFrame) -> pd.DataFrame:
    """Per rank and step, what makes the device wait (µs, counts): the idle time by cause
    (:func:`breakdown.device_idle_by_cause`), the host's blocking synchronisations (sync_calls, of which
    scalar_sync_calls in ``tensor.item()``; sync_us; sync_idle_us: the device gaps in which one returns) and the
    DataLoader's fetches (data_loader_us; data_loader_idle_us with the device idle, NaN without device events)."""
    cpu = ~on_device(events["lane"])
    dev = ~cpu & isin(events["kind"], model.DEVICE_KINDS)
    sync = cpu & isin(events["name"], model.SYNC_CALLS)
    scalar = cpu & isin(events["name"], model.SCALAR_SYNC_OPS)
    loader = cpu & startswith(events["name"], (model.DATALOADER_PREFIX,))
    idle = breakdown.device_idle_by_cause(events) if dev.any() and "launch_ts_us" in events else None
    step = events["step"].to_numpy(dtype=np.float64)
    ts = events["ts_us"].to_numpy(dtype=np.float64)
    end = ts + events["dur_us"].to_numpy(dtype=np.float64)
    ranks = events["rank"].to_numpy()
    lanes = events["lane"].astype(object).to_numpy() if (sync.any() and scalar.any()) else None
    rows = []
    for r in np.unique(ranks[(sync | loader) & ~np.isnan(step)]).tolist():
        on = ranks == r
        dm = on & dev
        bs, be = intervals.union(ts[dm], end[dm])
        has_dev = bs.size > 0
        si = np.flatnonzero(on & sync & ~np.isnan(step))
        in_scalar = np.zeros(si.size, dtype=bool)
        if lanes is not None and si.size:
            for lane in set(lanes[si].tolist()):
                ops = np.flatnonzero(on & scalar & (lanes == lane))
                q = lanes[si] == lane
                in_scalar[q] = intervals.innermost(ts[ops], end[ops], ts[si][q]) >= 0
        # the device gap each synchronisation returns in (-1: the device is busy then, or outside its events)
        gap = np.full(si.size, -1, dtype=np.int64)
        if has_dev and si.size:
            j = np.searchsorted(bs, end[si], side="right") - 1
            jj = np.clip(j, 0, bs.size - 1)
            gap = np.where((j >= 0) & (j + 1 < bs.size) & (end[si] >= be[jj]), j, -1)
        li = np.flatnonzero(on & loader & ~np.isnan(step))
        l_idle = np.full(li.size, np.nan)
        if has_dev and li.size:
            s0, e0 = np.clip(ts[li], bs[0], be[-1]), np.clip(end[li], bs[0], be[-1])
            l_idle = (e0 - s0) - intervals.overlap_with(s0, e0, bs, be)
        for st in np.unique(np.concatenate([step[si], step[li]])).tolist():
            ks, kl = step[si] == st, step[li] == st
            g = np.unique(gap[ks][gap[ks] >= 0])
            rows.append({"rank": r, "step": st, "sync_calls": int(ks.sum()), "scalar_sync_calls": int(in_scalar[ks].sum()),
                         "sync_us": float((end[si][ks] - ts[si][ks]).sum()),
                         "sync_idle_us": float((bs[g + 1] - be[g]).sum()) if has_dev else np.nan,
                         "data_loader_us": intervals.total(ts[li][kl], end[li][kl]),
                         "data_loader_idle_us": float(l_idle[kl].sum()) if has_dev else np.nan})
    host = pd.DataFrame(rows, columns=["rank", "step"] + STALL_COLUMNS[5:])
    if idle is None or idle.empty:
        out = host.assign(**{c: np.nan for c in breakdown.DEVICE_IDLE_COLUMNS[2:]})
    else:
        out = idle.merge(host, on=["rank", "step"], how="outer")
        for c in ("sync_calls", "scalar_sync_calls"):
            out[c] = out[c].fillna(0).astype(np.int64)
        for c in ("sync_us", "data_loader_us", "sync_idle_us", "data_loader_idle_us"):
            out[c] = out[c].fillna(0.0)
    return out[STALL_COLUMNS].sort_values(["rank", "step"], kind="mergesort").reset_index(drop=True)
