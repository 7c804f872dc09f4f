"""Labels of every event, taken from the point that launched it: step, stage, FSDP phase and unit.

The launch point of an event is the CPU time (and thread) where it was issued: a device kernel's
runtime call (``cudaLaunchKernel`` ..., found through the correlation id by
:func:`fsdpprof.analyze.trace.classify.classify_arrays`), a gloo collective's ``c10d`` call, a CPU op
itself.  On a GPU the device lags the CPU, so a kernel's execution time says little about what issued
it; its execution interval is still what overlap measures.

- step: the ``ProfilerStep#N`` annotation containing the launch point; none in the trace -> the
  whole trace is step 0, with a warning.
- stage: :func:`fsdpprof.analyze.model.stage_at` of the launch point against the step marks
  (:func:`step_marks`), collectives (comm events and collective ops) marked as such (between the end of
  the forward and the backward they are input distribution: data); a device kernel whose launch is not
  in the trace is ``unknown``.
- fsdp_phase / unit: the innermost FSDP annotation (:func:`fsdpprof.analyze.model.parse_fsdp`) on the
  launching thread that contains the launch point.
"""
from __future__ import annotations

import numpy as np
import pandas as pd

from fsdpprof.analyze import model
from fsdpprof.analyze.comm import intervals
from fsdpprof.analyze.load.frames import column_arrays, frame_of, isin, on_device
from fsdpprof.analyze.trace.classify import K_COMM, KIND_LABELS, per_name


def _name_hits(cats: list[str], test) -> np.ndarray:
    """``test(name)`` once per distinct name (bool per category)."""
    return np.fromiter((test(x) for x in cats), dtype=bool, count=len(cats))


def _step_number(x: str) -> float:
    """N of a ``ProfilerStep#N`` name, NaN for any other name."""
    if x.startswith(model.STEP_PREFIX) and x[len(model.STEP_PREFIX):].isdigit():
        return float(x[len(model.STEP_PREFIX):])
    return np.nan


M_STEP, M_FWD, M_BWD, M_OPT, M_FWD_SPAN = 1, 2, 4, 8, 16


def _mark_flags(x: str) -> int:
    """Bit set: a ProfilerStep# / forward / backward / Optimizer.step# / whole-forward name."""
    return ((M_STEP if x.startswith(model.STEP_PREFIX) else 0) | (M_FWD if x.startswith(model.FORWARD_MARKERS) else 0)
            | (M_BWD if x.startswith(model.BACKWARD_MARKERS) else 0)
            | (M_OPT if x.startswith(model.OPTIMIZER_PREFIX) else 0)
            | (M_FWD_SPAN if x.startswith(model.FORWARD_SPAN_MARKERS) else 0))


def step_marks_arrays(cats: list[str], codes: np.ndarray, ts: np.ndarray, end: np.ndarray,
                      cpu_side: np.ndarray) -> pd.DataFrame:
    """Step marks (model.STEP_MARK_COLUMNS, one row per ProfilerStep, by start) from name codes into
    ``cats`` and the events' times (µs); only CPU-side events (``cpu_side``) mark."""
    cols = _step_mark_columns(cats, codes, ts, end, cpu_side)
    if cols is None:
        return pd.DataFrame(columns=model.STEP_MARK_COLUMNS)
    return pd.DataFrame(cols, columns=model.STEP_MARK_COLUMNS)


def _step_mark_columns(cats: list[str], codes: np.ndarray, ts: np.ndarray, end: np.ndarray,
                       cpu_side: np.ndarray) -> dict | None:
    """:func:`step_marks_arrays` as a dict of its columns (numpy), None when there is no ProfilerStep."""
    if not len(cats) or not len(codes):
        return None
    flags = np.array(per_name(_mark_flags, cats), dtype=np.uint8)[codes]
    ps = np.flatnonzero(((flags & M_STEP) != 0) & cpu_side)
    if not ps.size:
        return None
    step_of = np.array(per_name(_step_number, cats), dtype=np.float64)
    # the steps with a number, by start (stable), the first of those starting at the same time
    step, start, stop = step_of[codes[ps]], ts[ps], end[ps]
    ok = ~np.isnan(step)
    step, start, stop = step[ok], start[ok], stop[ok]
    order = np.argsort(start, kind="mergesort")
    step, start, stop = step[order], start[order], stop[order]
    first = np.ones(start.size, dtype=bool)
    first[1:] = start[1:] != start[:-1]
    starts, ends, steps = start[first], stop[first], step[first]

    def first_in_step(idx: np.ndarray, t: np.ndarray, last: bool = False) -> np.ndarray:
        out = np.full(starts.size, -np.inf if last else np.inf)
        k = np.searchsorted(starts, t, side="right") - 1
        ok = (k >= 0) & (t <= ends[np.maximum(k, 0)])
        (np.maximum if last else np.minimum).at(out, k[ok], t[ok])
        return np.where(np.isfinite(out), out, np.nan)

    fwd = np.flatnonzero(((flags & M_FWD) != 0) & cpu_side)
    bwd = np.flatnonzero(((flags & M_BWD) != 0) & cpu_side)
    opt = np.flatnonzero(((flags & M_OPT) != 0) & cpu_side)
    bwd_us = first_in_step(bwd, ts[bwd])
    # the forward's end: the last end of a whole-forward marker that starts before the step's backward
    span = np.flatnonzero(((flags & M_FWD_SPAN) != 0) & cpu_side)
    k = np.searchsorted(starts, ts[span], side="right") - 1
    kk = np.maximum(k, 0)
    with np.errstate(invalid="ignore"):
        before_bwd = ~(ts[span] >= bwd_us[kk]) if starts.size else np.zeros(0, dtype=bool)
    keep = (k >= 0) & (ts[span] <= ends[kk]) & before_bwd
    fwd_end = np.full(starts.size, -np.inf)
    np.maximum.at(fwd_end, k[keep], end[span][keep])
    return {"step": steps, "start_us": starts, "end_us": ends,
            "fwd_us": first_in_step(fwd, ts[fwd]), "fwd_end_us": np.where(np.isfinite(fwd_end), fwd_end, np.nan),
            "bwd_us": bwd_us, "opt_us": first_in_step(opt, ts[opt]),
            "opt_end_us": first_in_step(opt, end[opt], last=True)}


def _cat_codes(col: pd.Series) -> tuple[list[str], np.ndarray]:
    """(categories as str, codes; -1 = missing) of a column, categorical or not."""
    if not isinstance(col.dtype, pd.CategoricalDtype):
        col = col.astype(object).astype("category")
    return [str(x) for x in col.cat.categories], col.cat.codes.to_numpy()


def step_marks(events: pd.DataFrame | None) -> pd.DataFrame:
    """:func:`step_marks_arrays` of an events frame (memory attribution uses the same marks)."""
    if events is None or not len(events):
        return pd.DataFrame(columns=model.STEP_MARK_COLUMNS)
    cats, codes = _cat_codes(events["name"])
    lanes, lane_codes = _cat_codes(events["lane"])
    on_stream = np.array([x.startswith("stream:") for x in lanes] + [False], dtype=bool)
    ts = events["ts_us"].to_numpy(np.float64)
    end = ts + events["dur_us"].to_numpy(np.float64)
    ok = codes >= 0
    return step_marks_arrays(cats, np.where(ok, codes, 0), ts, end, ~on_stream[lane_codes] & ok)


def fsdp_intervals(events: pd.DataFrame | None) -> pd.DataFrame:
    """The FSDP annotations of an events frame: ts_us, end_us, fsdp_phase, unit, family (by start)."""
    cols = ["ts_us", "end_us", "fsdp_phase", "unit", "family"]
    if events is None or not len(events):
        return pd.DataFrame(columns=cols)
    cats, codes = _cat_codes(events["name"])
    parsed = [model.parse_fsdp(x) for x in cats]
    is_f = np.array([p[0] is not None for p in parsed] + [False], dtype=bool)
    rows = np.flatnonzero(is_f[codes])
    sel = codes[rows]
    ts = events["ts_us"].to_numpy(np.float64)
    out = pd.DataFrame({"ts_us": ts[rows], "end_us": ts[rows] + events["dur_us"].to_numpy(np.float64)[rows],
                        "fsdp_phase": np.array([parsed[i][0] for i in sel], dtype=object),
                        "unit": np.array([parsed[i][1] for i in sel], dtype=object),
                        "family": np.array([parsed[i][2] for i in sel], dtype=object)})
    return out.sort_values("ts_us", kind="stable").reset_index(drop=True)


def _fsdp_phase_of(x: str):
    return model.parse_fsdp(x)[0]


def _fsdp_unit_of(x: str):
    return model.parse_fsdp(x)[1]


def assign_arrays(c: dict, rt) -> tuple[dict, list[str]]:
    """Add ``step`` (float64), ``stage`` (int8 codes into model.STAGES), ``fsdp_name`` (int: the name code of
    the FSDP annotation that labels the row, -1 for none) and ``fsdp_phase`` / ``unit`` (per name code:
    lists, None where a name is not an FSDP annotation) to classify_arrays' columns; returns (c, warnings).
    :func:`events_frame` turns them into the frame's columns."""
    warnings: list[str] = []
    n = len(c["ts_us"])
    cats = list(c["name_cats"])
    codes = c["name"]
    ts = c["ts_us"]
    end = ts + c["dur_us"]
    lane_gpu = np.fromiter((str(x).startswith("stream:") for x in c["lane_cats"]), dtype=bool,
                           count=len(c["lane_cats"]))
    on_device = lane_gpu[c["lane"]] if n else np.zeros(0, dtype=bool)
    cpu_side = ~on_device
    lt = c["launch_tid"]
    no_launch = on_device & (lt < 0) if n else np.zeros(0, dtype=bool)
    q_ts = c["launch_ts_us"]                    # the launch point (a CPU op's own start)

    # --- steps ----------------------------------------------------------------------------
    marks = _step_mark_columns(cats, codes, ts, end, cpu_side)
    collective = (c["kind"] == K_COMM) | ~_isna(c["collective"])        # (stage_at: input distribution)
    step = np.full(n, np.nan)
    if marks is not None and len(marks["start_us"]):
        marks_of = np.array(per_name(_mark_flags, cats), dtype=np.uint8)
        s_idx = np.flatnonzero(((marks_of[codes] & M_STEP) != 0) & cpu_side)
        step_of = np.array(per_name(_step_number, cats), dtype=np.float64)
        k = intervals.innermost(ts[s_idx], end[s_idx], q_ts)
        step = np.where(k >= 0, step_of[codes[s_idx]][np.clip(k, 0, None)], np.nan)
        stage = model.stage_codes_at(q_ts, marks, collective)
    else:
        warnings.append(f"trace {rt.path} has no ProfilerStep# annotations: the whole trace is taken as one step "
                        f"(use torch.profiler's schedule and prof.step() to get per-step numbers)")
        step[:] = 0.0
        t0, t1 = (float(np.min(q_ts)), float(np.max(np.maximum(end, q_ts)))) if n else (0.0, 0.0)
        whole = pd.DataFrame({"step": [0.0], "start_us": [t0], "end_us": [t1]})
        probe = step_marks_arrays(cats + [model.STEP_PREFIX + "0"], np.append(codes, len(cats)),
                                  np.append(ts, t0), np.append(end, t1), np.append(cpu_side, True))
        for col in ("fwd_us", "fwd_end_us", "bwd_us", "opt_us", "opt_end_us"):
            whole[col] = probe[col].to_numpy()[:1] if len(probe) else np.nan
        stage = model.stage_codes_at(q_ts, whole[model.STEP_MARK_COLUMNS], collective)
    step[no_launch] = np.nan
    stage[no_launch] = model.STAGES.index(model.STAGE_UNKNOWN)

    # --- FSDP annotations -> fsdp_phase / unit (as the annotation's name code) ---------------------------
    c_phase = per_name(_fsdp_phase_of, cats)
    c_unit = per_name(_fsdp_unit_of, cats)
    c_is_fsdp = np.fromiter((p is not None for p in c_phase), dtype=bool, count=len(c_phase))
    is_fsdp = (c_is_fsdp[codes] if len(cats) else np.zeros(n, dtype=bool)) & cpu_side & (c["kind"] != K_COMM)
    fsdp_name = np.full(n, -1, dtype=np.int64)
    f_idx = np.flatnonzero(is_fsdp)
    if f_idx.size:
        f_tid = c["tid"][f_idx]
        for t in np.unique(f_tid).tolist():
            sel = f_idx[f_tid == t]
            qsel = np.flatnonzero(lt == t)
            if qsel.size == 0:
                continue
            k = intervals.innermost(ts[sel], end[sel], q_ts[qsel])
            hit = k >= 0
            rows = sel[np.clip(k, 0, None)]
            fsdp_name[qsel[hit]] = codes[rows[hit]]
    # the FSDP annotations describe themselves too
    fsdp_name[f_idx] = codes[f_idx]
    c["step"], c["stage"], c["fsdp_name"], c["fsdp_phase"], c["unit"] = step, stage, fsdp_name, c_phase, c_unit
    c["launch_ts_us"] = np.where(no_launch, np.nan, q_ts)
    return c, warnings


def _isna(a: np.ndarray) -> np.ndarray:
    return pd.isna(a) if len(a) else np.zeros(0, dtype=bool)


_NONE_DTYPE = pd.Categorical(np.full(1, None, dtype=object)).dtype   # what pd.Categorical makes of only None


_FROM_FASTPATH = getattr(pd.CategoricalDtype, "_from_fastpath", None)


_SMALL_DTYPES: dict = {}      # tuple of a few string categories -> its dtype, shared by every frame that has them
_SMALL_MAX = 64               # categories in a shared dtype (kinds, collectives, dtypes, groups, phases, units)


def _dtype(categories) -> pd.CategoricalDtype:
    """pd.CategoricalDtype(categories) of categories known to be distinct (no check of that: faster). A few
    strings (what most columns but the names hold) get one shared dtype per process: built once, and
    concat_events then finds the ranks' dtypes the same object."""
    key = None
    if not isinstance(categories, pd.Index) and len(categories) <= _SMALL_MAX:
        key = tuple(categories)
        if all(type(x) is str for x in key):
            hit = _SMALL_DTYPES.get(key)
            if hit is not None:
                return hit
        else:
            key = None
    dtype = _new_dtype(categories)
    if key is not None:
        if len(_SMALL_DTYPES) >= 4096:
            _SMALL_DTYPES.clear()
        _SMALL_DTYPES[key] = dtype
    return dtype


def _new_dtype(categories) -> pd.CategoricalDtype:
    if _FROM_FASTPATH is not None:
        try:
            return _FROM_FASTPATH(pd.Index(categories), False)
        except (TypeError, ValueError):         # pragma: no cover - another pandas
            pass
    return pd.CategoricalDtype(categories)


def _from_codes(codes: np.ndarray, dtype: pd.CategoricalDtype) -> pd.Categorical:
    """pd.Categorical.from_codes for codes known to be valid (-1 or a position in the categories)."""
    try:
        return pd.Categorical.from_codes(codes, dtype=dtype, validate=False)
    except TypeError:                   # pragma: no cover - pandas < 2.1 has no validate=
        return pd.Categorical.from_codes(codes, dtype=dtype)


def _categorical(values: np.ndarray) -> pd.Categorical:
    """pd.Categorical(values) of an object array, factorizing only its non-missing entries."""
    miss = _isna(values)
    if miss.all():
        return _from_codes(np.full(len(values), -1, dtype=np.int8), _NONE_DTYPE)
    nn = np.flatnonzero(~miss)
    present = values[nn].tolist()
    distinct = set(present)
    if not all(type(v) is str for v in distinct):
        sub = pd.Categorical(values[nn])
        codes = np.full(len(values), -1, dtype=sub.codes.dtype)
        codes[nn] = sub.codes
        return _from_codes(codes, sub.dtype)
    cats = sorted(distinct)              # (strings: sorted as pd.Categorical sorts them)
    pos = {v: i for i, v in enumerate(cats)}
    codes = np.full(len(values), -1, dtype=np.int32)
    codes[nn] = np.fromiter(map(pos.__getitem__, present), dtype=np.int32, count=len(present))
    return _from_codes(codes, _dtype(cats))


def _categorical_codes(codes: np.ndarray, labels: np.ndarray) -> pd.Categorical:
    """pd.Categorical(labels[codes]) (categories: the labels used, sorted) without a per-row factorize."""
    used = np.flatnonzero(np.bincount(codes, minlength=len(labels))) if len(codes) else np.empty(0, dtype=np.int64)
    order = sorted(used.tolist(), key=lambda i: labels[i])
    remap = np.full(len(labels), -1, dtype=np.int8)
    remap[order] = np.arange(len(order))
    return _from_codes(remap[codes], _dtype([labels[i] for i in order]))


def _categorical_of_table(idx: np.ndarray, table: list) -> pd.Categorical:
    """pd.Categorical of ``table[idx]`` per row (missing where idx < 0 or the value is None): the categories
    are the values used, sorted, as pd.Categorical makes them; no per-row objects."""
    n_rows = len(idx)
    hit = np.flatnonzero(idx >= 0)
    used = np.unique(idx[hit]).tolist()
    cats = sorted({table[i] for i in used} - {None})
    if not cats:
        return _from_codes(np.full(n_rows, -1, dtype=np.int8), _NONE_DTYPE)
    pos = {v: i for i, v in enumerate(cats)}
    remap = np.array([-1 if v is None else pos[v] for v in table], dtype=np.int32)
    codes = np.full(n_rows, -1, dtype=np.int32)
    codes[hit] = remap[idx[hit]]
    return _from_codes(codes, _dtype(cats))


_STAGE_DTYPE = pd.CategoricalDtype(model.STAGES)


def events_frame(c: dict, rank: int) -> pd.DataFrame:
    """The model.EVENT_COLUMNS frame from classified, labelled columns (one DataFrame built, once)."""
    n = len(c["ts_us"])
    cols = {
        "rank": np.full(n, rank, dtype=np.int32),
        "lane": _from_codes(c["lane"], _dtype(c["lane_cats"])),
        "kind": _categorical_codes(c["kind"], KIND_LABELS),
        "name": _from_codes(c["name"], _dtype(c["name_cats"])),
        "ts_us": c["ts_us"], "dur_us": c["dur_us"],
        "collective": _categorical(c["collective"]),
        "bytes": c["bytes"].astype(np.float64, copy=False),
        "dtype": _categorical(c["dtype"]),
        "group_size": c["group_size"].astype(np.float64, copy=False),
        "pg": _categorical(c["pg"]),
        "seq": c["seq"].astype(np.float64, copy=False),
        "step": c["step"],
        "stage": _from_codes(c["stage"], _STAGE_DTYPE),
        "fsdp_phase": _categorical_of_table(c["fsdp_name"], c["fsdp_phase"]),
        "unit": _categorical_of_table(c["fsdp_name"], c["unit"]),
        "launch_ts_us": c["launch_ts_us"],
    }
    return frame_of(cols, model.EVENT_COLUMNS)


def concat_events(frames: list[pd.DataFrame]) -> pd.DataFrame:
    """Events frames of several ranks as one (index 0..n-1), the categorical columns kept categorical without
    per-row objects: a column whose categories equal the first frame's (as pd.concat judges it) keeps the
    first frame's categories, others get the union of every frame's categories, sorted (what pd.concat then
    astype("category") gives)."""
    if len(frames) == 1:
        return frames[0]
    out = {}
    columns = list(frames[0].columns)
    per_frame = [column_arrays(f) if list(f.columns) == columns else [f[c].array for c in columns]
                 for f in frames]                        # (numpy or Categorical: no copies)
    for i, col in enumerate(columns):
        arrays = [a[i] for a in per_frame]
        dtype = arrays[0].dtype
        if not isinstance(dtype, pd.CategoricalDtype):
            out[col] = np.concatenate([np.asarray(a) for a in arrays])
            continue
        if all(a.dtype is dtype or (isinstance(a.dtype, pd.CategoricalDtype) and a.dtype == dtype) for a in arrays):
            out[col] = _from_codes(np.concatenate([a.codes for a in arrays]), dtype)
            continue
        # the union of the categories each frame uses, sorted; each frame's codes mapped into it (a category
        # a frame does not use maps to -1: no code points at it)
        cats = [a.categories.tolist() for a in arrays]
        used = set()
        for a, c in zip(arrays, cats):
            seen = np.bincount(a.codes[a.codes >= 0].astype(np.intp), minlength=len(c)).astype(bool).tolist()
            used.update(x for x, u in zip(c, seen) if u)
        union = sorted(used)
        dtype = _dtype(union) if union else _NONE_DTYPE
        position = {x: i for i, x in enumerate(union)}
        parts = []
        for a, c in zip(arrays, cats):
            remap = np.array([position.get(x, -1) for x in c] + [-1], dtype=np.int64)
            parts.append(remap[a.codes])        # (code -1, missing, stays -1: the appended last entry)
        out[col] = _from_codes(np.concatenate(parts), dtype)
    return frame_of(out, columns)


def cpu_side(events: pd.DataFrame) -> np.ndarray:
    """Rows on CPU threads (not on a device stream)."""
    return ~on_device(events["lane"])


def framework_of(events: pd.DataFrame) -> str:
    """What a trace shows running: ``fsdp2`` / ``fsdp1`` (their annotations), ``ddp`` (DDP's forward or
    its reducer), ``distributed`` (collectives of another framework) or ``single_device``."""
    cats, codes = _cat_codes(events["name"])
    used = set(np.unique(codes[codes >= 0]).tolist())
    names = [cats[i] for i in used]
    if any(x.startswith(model.FSDP2_PREFIX) for x in names):
        return "fsdp2"
    if any(x.startswith(model.FSDP1_PREFIX) for x in names):
        return "fsdp1"
    if any(x.startswith(model.DDP_MARKERS) for x in names):
        return "ddp"
    if isin(events["kind"], [model.KIND_COMM]).any():
        return "distributed"
    return "single_device"


DEVICE_WORD = {model.DEVICE_CUDA: "CUDA", model.DEVICE_ROCM: "HIP", model.DEVICE_XPU: "XPU", model.DEVICE_MTIA: "MTIA"}
THREAD_ROLES = (("pt_main_thread", "main thread"), ("gloo", "gloo worker"), ("pt_autograd", "autograd thread"),
                ("nccl_watchdog", "NCCL watchdog"), ("pt_nccl", "NCCL watchdog"))
THREAD_NAMES_MAX = 4096   # thread_name records carried per trace (a hostile trace may name millions)


def thread_name_records(thread_names: dict) -> list:
    """The decoder's ``thread_names`` ({(pid, tid): name}) as JSON-friendly [pid, tid, name] triples."""
    return [[pid, tid, str(name)[:200]] for (pid, tid), name in list(thread_names.items())[:THREAD_NAMES_MAX]]


def lane_names(lanes, comm_lanes=(), nccl_lanes=(), thread_names=(), device_type: str | None = None) -> dict:
    """Readable names of event lanes (``thread:T`` / ``stream:S``, :func:`classify.classify_arrays`) from the
    trace's thread names ([pid, tid, name]): "main thread", "gloo worker", "autograd thread 0",
    "CUDA stream 7 (NCCL)" ...; a lane in ``comm_lanes`` runs communication (``nccl_lanes``: NCCL kernels).
    Lanes without a recorded name keep a plain "thread T" / "stream S"; names are made unique."""
    by_lane = {}
    for rec in thread_names or ():
        try:
            pid, tid, name = rec
        except (TypeError, ValueError):
            continue
        name = str(name).strip()
        if name.startswith("stream"):
            by_lane[f"stream:{tid}"] = name
        else:
            by_lane[f"thread:{tid}"] = (name, pid == tid)
    dev = DEVICE_WORD.get(device_type or "", "GPU")
    out = {}
    for lane in lanes:
        lane = str(lane)
        kind, _, ident = lane.partition(":")
        if kind == "stream":
            name = f"{dev} stream {ident}"
            if lane in nccl_lanes:
                name += " (NCCL)"
            elif lane in comm_lanes:
                name += " (communication)"
        else:
            rec = by_lane.get(lane)
            inner, is_main = ("", False) if rec is None else (rec[0].rpartition("(")[2].rstrip(")") if "(" in rec[0]
                                                              else rec[0], rec[1])
            role = "main thread" if is_main else next((r for key, r in THREAD_ROLES if key in inner.lower()), None)
            if role == "autograd thread" and inner.rsplit("_", 1)[-1].isdigit():
                role += " " + inner.rsplit("_", 1)[-1]
            if role is None and lane in comm_lanes and not is_main:
                role = "gloo worker"   # CPU threads run communication only as gloo's work (classify: gloo_comm)
            name = role or (f"thread {ident} ({inner})" if inner and not inner.startswith("thread") else f"thread {ident}")
        out[lane] = name
    seen: dict = {}
    for lane in sorted(out, key=lambda x: (not x.startswith("thread"), x)):
        n = out[lane]
        seen[n] = seen.get(n, 0) + 1
    count: dict = {}
    for lane in sorted(out, key=lambda x: (not x.startswith("thread"), x)):
        n = out[lane]
        if seen[n] > 1:
            count[n] = count.get(n, 0) + 1
            out[lane] = f"{n} {count[n]}"
    return out
