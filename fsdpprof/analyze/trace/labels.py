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

from fsdpprof.analyze.comm import intervals
from fsdpprof.analyze import vocab
from fsdpprof.analyze.trace.classify import K_COMM, KIND_LABELS

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


def assign_arrays(c: dict, rt) -> tuple[dict, list[str]]:
    """Add ``step`` (float64), ``phase``, ``unit`` (object) to classify_arrays' columns; returns (c, warnings)."""
    warnings: list[str] = []
    n = len(c["ts_us"])
    cats = [str(x) for x in c["name_cats"]]
    codes = c["name"]
    ts = c["ts_us"]
    end = ts + c["dur_us"]
    lane_gpu = np.fromiter((str(x).startswith("stream:") for x in c["lane_cats"]), dtype=bool,
                           count=len(c["lane_cats"]))
    cpu_side = ~lane_gpu[c["lane"]] if n else np.zeros(0, dtype=bool)
    lt = c["launch_tid"]
    lts = c["launch_ts_us"]
    q_ts = np.where(np.isnan(lts), ts, lts)

    # --- steps ----------------------------------------------------------------------------
    step_num = np.array([float(m.group(1)) if (m := _STEP.match(x)) else np.nan for x in cats], dtype=np.float64)
    row_step = step_num[codes] if len(cats) else np.full(n, np.nan)
    is_step = ~np.isnan(row_step) & cpu_side
    step = np.full(n, np.nan)
    if is_step.any():
        s_idx = np.flatnonzero(is_step)
        k = intervals.innermost(ts[s_idx], end[s_idx], q_ts)
        step = np.where(k >= 0, row_step[s_idx][np.clip(k, 0, None)], np.nan)
    else:
        warnings.append(f"trace {rt.path} has no ProfilerStep# annotations: the whole trace is taken as one step "
                        f"(use torch.profiler's schedule and prof.step() to get per-step numbers)")
        step[:] = 0.0

    # --- FSDP annotations -> phase/unit ----------------------------------------------------------
    parsed = [parse_fsdp(x) for x in cats]
    c_phase = np.array([p[0] for p in parsed] or [None], dtype=object)
    c_unit = np.array([p[1] for p in parsed] or [None], dtype=object)
    c_is_fsdp = np.fromiter((p[0] is not None for p in parsed), dtype=bool, count=len(parsed))
    is_fsdp = (c_is_fsdp[codes] if len(cats) else np.zeros(n, dtype=bool)) & cpu_side & \
        (c["kind"] != K_COMM)
    phase = np.full(n, None, dtype=object)
    unit = np.full(n, None, dtype=object)
    f_idx = np.flatnonzero(is_fsdp)
    if f_idx.size:
        f_tid = c["tid"][f_idx]
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
    def by_name(test) -> np.ndarray:
        hit = np.fromiter((test(x) for x in cats), dtype=bool, count=len(cats))
        return hit[codes] & cpu_side if len(cats) else np.zeros(n, dtype=bool)

    is_opt = by_name(lambda x: x.startswith("Optimizer.step#"))
    if is_opt.any():
        o_idx = np.flatnonzero(is_opt)
        k = intervals.innermost(ts[o_idx], end[o_idx], q_ts)
        phase[(k >= 0) & _isna(phase)] = "optimizer"
    is_bwd = by_name(lambda x: _BACKWARD_MARK.search(x) is not None)
    if is_bwd.any():
        # each step's backward starts at its first backward marker (steps keyed with NaN -> -1)
        key = np.where(np.isnan(step), -1.0, step)
        bkeys, binv = np.unique(key[is_bwd], return_inverse=True)
        first = np.full(bkeys.size, np.nan)
        np.fmin.at(first, binv, ts[is_bwd])
        pos = np.minimum(np.searchsorted(bkeys, key), bkeys.size - 1)
        start_bwd = np.where(bkeys[pos] == key, first[pos], np.nan)
        phase[_isna(phase) & ~np.isnan(start_bwd) & (q_ts >= start_bwd)] = "backward"
    phase[_isna(phase)] = "forward"
    if is_step.any():
        # annotations that are not inside any step keep forward/backward only when inside a step
        phase[np.isnan(step) & _isna(unit) & ~is_fsdp] = None
    c["step"], c["phase"], c["unit"] = step, phase, unit
    return c, warnings


def _isna(a: np.ndarray) -> np.ndarray:
    return pd.isna(a) if len(a) else np.zeros(0, dtype=bool)


def _categorical(values: np.ndarray) -> pd.Categorical:
    """pd.Categorical(values) of an object array, factorizing only its non-missing entries."""
    miss = _isna(values)
    if not miss.any() or miss.all():
        return pd.Categorical(values)
    nn = np.flatnonzero(~miss)
    sub = pd.Categorical(values[nn])
    codes = np.full(len(values), -1, dtype=sub.codes.dtype)
    codes[nn] = sub.codes
    return pd.Categorical.from_codes(codes, dtype=sub.dtype)


def _categorical_codes(codes: np.ndarray, labels: np.ndarray) -> pd.Categorical:
    """pd.Categorical(labels[codes]) (categories: the labels used, sorted) without a per-row factorize."""
    used = np.flatnonzero(np.bincount(codes, minlength=len(labels))) if len(codes) else np.empty(0, dtype=np.int64)
    order = sorted(used.tolist(), key=lambda i: labels[i])
    remap = np.full(len(labels), -1, dtype=np.int8)
    remap[order] = np.arange(len(order))
    return pd.Categorical.from_codes(remap[codes], categories=pd.Index([labels[i] for i in order]))


def events_frame(c: dict, rank: int) -> pd.DataFrame:
    """The vocab.EVENT_COLUMNS frame from classified, phase-tagged columns (one DataFrame built, once)."""
    n = len(c["ts_us"])
    cols = {
        "rank": np.full(n, rank, dtype=np.int32),
        "lane": pd.Categorical.from_codes(c["lane"], categories=c["lane_cats"]),
        "kind": _categorical_codes(c["kind"], KIND_LABELS),
        "name": pd.Categorical.from_codes(c["name"], categories=c["name_cats"]),
        "ts_us": c["ts_us"], "dur_us": c["dur_us"],
        "collective": _categorical(c["collective"]),
        "bytes": c["bytes"].astype(np.float64, copy=False),
        "dtype": _categorical(c["dtype"]),
        "group_size": c["group_size"].astype(np.float64, copy=False),
        "pg": _categorical(c["pg"]),
        "seq": c["seq"].astype(np.float64, copy=False),
        "step": c["step"], "phase": _categorical(c["phase"]), "unit": _categorical(c["unit"]),
    }
    return pd.DataFrame(cols, columns=vocab.EVENT_COLUMNS)
