"""Steps and FSDP phases/units of every event.

- step: the ``ProfilerStep#N`` annotation that contains the event's launch point (a kernel's CPU
  launch, a gloo collective's ``c10d`` call, a CPU op itself); none in the trace -> the whole trace is
  step 0, with a warning.
- phase/unit: the innermost FSDP annotation on the launching thread that contains the launch point:
  FSDP2 ``FSDP::<phase> (<fqn>)`` / ``FSDP::backward_prefetch for <fqn>``, FSDP1
  ``FullyShardedDataParallel._<phase>``.  Outside them: ``optimizer`` inside ``Optimizer.step#*``,
  ``backward`` from the first backward marker of the step (autograd engine, FSDP pre/post backward,
  ``## backward ##``) on, ``forward`` before it.
"""
from __future__ import annotations

import re

import numpy as np
import pandas as pd

from fsdpprof.analyze import intervals, schema
from fsdpprof.analyze.classify import category_mask

_FSDP2 = re.compile(r"^FSDP::(\w+)(?: \((.*)\)| for (.*))?$")
_FSDP1 = re.compile(r"^FullyShardedDataParallel\.(\w+)$")
_STEP = re.compile(r"^ProfilerStep#(\d+)$")
_BACKWARD_MARK = re.compile(r"^(?:autograd::engine::evaluate_function|FSDP::pre_backward|FSDP::post_backward|"
                            r"FullyShardedDataParallel\._pre_backward|FullyShardedDataParallel\._post_backward|"
                            r"## backward ##)")


def parse_fsdp(name: str) -> tuple[str | None, str | None]:
    """(phase, unit) of an FSDP annotation name, (None, None) when it is not one."""
    m = _FSDP2.match(name)
    if m:
        unit = m.group(2) if m.group(2) is not None else m.group(3)
        if unit is None and not m.group(1).startswith("root_"):
            unit = ""            # FSDP2 names the root unit (fqn "") without a suffix
        return m.group(1), unit
    m = _FSDP1.match(name)
    if m:
        ph = m.group(1).lstrip("_")
        if ph.endswith("_hook"):
            ph = ph[: -len("_hook")]
        return ph, None
    return None, None


def assign_phases(ev: pd.DataFrame, rt) -> tuple[pd.DataFrame, list[str]]:
    """Add ``step``, ``phase``, ``unit`` to the classified frame; returns (frame, warnings)."""
    warnings: list[str] = []
    n = len(ev)
    names = ev["name"].astype(str) if not isinstance(ev["name"].dtype, pd.CategoricalDtype) else ev["name"]
    cats = pd.Series(names.cat.categories if isinstance(names.dtype, pd.CategoricalDtype) else pd.unique(names))
    codes = names.cat.codes.to_numpy() if isinstance(names.dtype, pd.CategoricalDtype) else \
        pd.Categorical(names, categories=cats).codes
    ts = ev["ts_us"].to_numpy()
    end = ts + ev["dur_us"].to_numpy()
    cpu_side = ~category_mask(ev["lane"], lambda s: s.str.startswith("stream:"))
    lt = ev["launch_tid"].to_numpy(dtype=object)
    lts = ev["launch_ts_us"].to_numpy(dtype=float)
    q_ts = np.where(np.isnan(lts), ts, lts)

    # --- steps ----------------------------------------------------------------------------
    step_num = cats.str.extract(_STEP)[0].astype(float).to_numpy()
    is_step = ~np.isnan(step_num[codes]) & cpu_side
    step = np.full(n, np.nan)
    if is_step.any():
        s_idx = np.flatnonzero(is_step)
        k = intervals.innermost(ts[s_idx], end[s_idx], q_ts)
        step = np.where(k >= 0, step_num[codes][s_idx][np.clip(k, 0, None)], np.nan)
    else:
        warnings.append(f"trace {rt.path} has no ProfilerStep# annotations: the whole trace is taken as one step "
                        f"(use torch.profiler's schedule and prof.step() to get per-step numbers)")
        step[:] = 0.0

    # --- FSDP annotations -> phase/unit ----------------------------------------------------------
    parsed = [parse_fsdp(c) for c in cats]
    c_phase = np.array([p[0] for p in parsed], dtype=object)
    c_unit = np.array([p[1] for p in parsed], dtype=object)
    is_fsdp = pd.notna(c_phase[codes]) & cpu_side & (ev["kind"].to_numpy() != schema.KIND_COMM)
    phase = np.full(n, None, dtype=object)
    unit = np.full(n, None, dtype=object)
    f_idx = np.flatnonzero(is_fsdp)
    if f_idx.size:
        f_tid = ev["tid"].to_numpy(dtype=object)[f_idx]
        for t in pd.unique(f_tid):
            sel = f_idx[f_tid == t]
            qsel = np.flatnonzero(lt == t)
            if qsel.size == 0:
                continue
            k = intervals.innermost(ts[sel], end[sel], q_ts[qsel])
            hit = k >= 0
            rows = sel[np.clip(k, 0, None)]
            phase[qsel[hit]] = c_phase[codes[rows[hit]]]
            unit[qsel[hit]] = c_unit[codes[rows[hit]]]
    # the FSDP annotations describe themselves too
    phase[f_idx] = c_phase[codes[f_idx]]
    unit[f_idx] = c_unit[codes[f_idx]]

    # --- optimizer / backward / forward for the rest ------------------------------------------------
    is_opt = cats.str.startswith("Optimizer.step#").to_numpy()[codes] & cpu_side
    if is_opt.any():
        o_idx = np.flatnonzero(is_opt)
        k = intervals.innermost(ts[o_idx], end[o_idx], q_ts)
        phase = np.where((k >= 0) & pd.isna(phase), "optimizer", phase)
    is_bwd = cats.str.contains(_BACKWARD_MARK).to_numpy()[codes] & cpu_side
    if is_bwd.any():
        bw = pd.DataFrame({"step": step[is_bwd], "ts": ts[is_bwd]}).fillna({"step": -1.0})
        first_bwd = bw.groupby("step")["ts"].min()
        key = np.where(np.isnan(step), -1.0, step)
        start_bwd = first_bwd.reindex(key).to_numpy()
        rest = pd.isna(phase)
        phase = np.where(rest & ~np.isnan(start_bwd) & (q_ts >= start_bwd), "backward", phase)
    rest = pd.isna(phase)
    phase = np.where(rest, "forward", phase)
    # annotations that are not inside any step keep forward/backward only when inside a step
    phase = np.where(np.isnan(step) & pd.isna(unit) & ~is_fsdp, None, phase) if is_step.any() else phase

    # ev is our own frame (from classify): columns are set in place, no copy of the whole frame
    ev["step"] = step
    ev["phase"] = pd.Categorical(phase)
    ev["unit"] = pd.Categorical(unit)
    for c in ("lane", "kind", "collective", "dtype", "pg"):
        if not isinstance(ev[c].dtype, pd.CategoricalDtype):
            ev[c] = pd.Categorical(ev[c].to_numpy(dtype=object))
    ev["group_size"] = ev["group_size"].astype(np.float64)
    ev["seq"] = ev["seq"].astype(np.float64)
    ev["bytes"] = ev["bytes"].astype(np.float64)
    return ev, warnings
