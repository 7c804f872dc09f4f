"""Labels of every event, taken from the CPU point that launched it (a kernel's runtime call, a gloo collective's
``c10d`` call, a CPU op itself): step (the ``ProfilerStep#N`` around it; none in the trace: step 0, with a
warning), stage (:func:`fsdpprof.analyze.model.stage_codes_at` against :func:`step_marks`; a kernel whose launch
is not in the trace: unknown), FSDP phase and unit (the innermost FSDP annotation on the launching thread).
"""
from __future__ import annotations

from collections import Counter

import numpy as np
import pandas as pd

from fsdpprof.analyze import model
from fsdpprof.analyze.comm import intervals
from fsdpprof.analyze.load.frames import column_arrays, frame_of, isin, on_device
from fsdpprof.analyze.trace.classify import K_COMM, KIND_LABELS, _isna, per_name


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
    """Step marks (model.STEP_MARK_COLUMNS, one row per ProfilerStep, by start) from name codes into ``cats``
    and the events' times (µs); only CPU-side events (``cpu_side``) mark."""
    cols = _step_mark_columns(cats, codes, ts, end.__getitem__, cpu_side)
    return pd.DataFrame(cols or None, columns=model.STEP_MARK_COLUMNS)


def _step_mark_columns(cats: list[str], codes: np.ndarray, ts: np.ndarray, end_of,
                       cpu_side: np.ndarray) -> dict | None:
    """:func:`step_marks_arrays` as a dict of numpy columns, None when there is no ProfilerStep (``end_of(rows)``:
    those rows' ends, asked for the marks only)."""
    if not len(cats) or not len(codes):
        return None
    flags = np.array(per_name(_mark_flags, cats), dtype=np.uint8)[codes]
    ps = np.flatnonzero(((flags & M_STEP) != 0) & cpu_side)
    if not ps.size:
        return None
    # the steps with a number, by start (stable), the first of those starting at the same time
    step, start, stop = np.array(per_name(_step_number, cats), dtype=np.float64)[codes[ps]], ts[ps], end_of(ps)
    ok = ~np.isnan(step)
    order = np.argsort(start[ok], kind="mergesort")
    step, start, stop = step[ok][order], start[ok][order], stop[ok][order]
    first = np.ones(start.size, dtype=bool)
    first[1:] = start[1:] != start[:-1]
    starts, ends, steps = start[first], stop[first], step[first]

    def rows(flag: int) -> np.ndarray:
        return np.flatnonzero(((flags & flag) != 0) & cpu_side)

    def first_in_step(t: np.ndarray, last: bool = False) -> np.ndarray:
        out = np.full(starts.size, -np.inf if last else np.inf)
        k = np.searchsorted(starts, t, side="right") - 1
        ok = (k >= 0) & (t <= ends[np.maximum(k, 0)])
        (np.maximum if last else np.minimum).at(out, k[ok], t[ok])
        return np.where(np.isfinite(out), out, np.nan)

    fwd, bwd, opt, span = rows(M_FWD), rows(M_BWD), rows(M_OPT), rows(M_FWD_SPAN)
    bwd_us = first_in_step(ts[bwd])
    # the forward's end: the last end of a whole-forward marker that starts before the step's backward
    k = np.searchsorted(starts, ts[span], side="right") - 1
    kk = np.maximum(k, 0)
    with np.errstate(invalid="ignore"):
        before_bwd = ~(ts[span] >= bwd_us[kk]) if starts.size else np.zeros(0, dtype=bool)
    keep = (k >= 0) & (ts[span] <= ends[kk]) & before_bwd
    fwd_end = np.full(starts.size, -np.inf)
    np.maximum.at(fwd_end, k[keep], end_of(span)[keep])
    return {"step": steps, "start_us": starts, "end_us": ends,
            "fwd_us": first_in_step(ts[fwd]), "fwd_end_us": np.where(np.isfinite(fwd_end), fwd_end, np.nan),
            "bwd_us": bwd_us, "opt_us": first_in_step(ts[opt]), "opt_end_us": first_in_step(end_of(opt), last=True)}


def _cat_codes(col: pd.Series) -> tuple[list[str], np.ndarray]:
    """(categories as str, codes; -1 = missing) of a column, categorical or not."""
    if not isinstance(col.dtype, pd.CategoricalDtype):
        col = col.astype(object).astype("category")
    return [str(x) for x in col.cat.categories], col.cat.codes.to_numpy()


def step_marks(events: pd.DataFrame | None) -> pd.DataFrame:
    """:func:`step_marks_arrays` of an events frame."""
    if events is None or not len(events):
        return pd.DataFrame(columns=model.STEP_MARK_COLUMNS)
    cats, codes = _cat_codes(events["name"])
    ts = events["ts_us"].to_numpy(np.float64)
    ok = codes >= 0
    return step_marks_arrays(cats, np.where(ok, codes, 0), ts, ts + events["dur_us"].to_numpy(np.float64),
                             cpu_side(events) & ok)


def fsdp_intervals(events: pd.DataFrame | None) -> pd.DataFrame:
    """The FSDP annotations of an events frame: ts_us, end_us, fsdp_phase, unit, family (by start)."""
    cols = ["ts_us", "end_us", "fsdp_phase", "unit", "family"]
    if events is None or not len(events):
        return pd.DataFrame(columns=cols)
    cats, codes = _cat_codes(events["name"])
    parsed = [model.parse_fsdp(x) for x in cats]
    is_f = np.array([p[0] is not None for p in parsed] + [False], dtype=bool)
    rows = np.flatnonzero(is_f[codes])
    ts = events["ts_us"].to_numpy(np.float64)[rows]
    out = {"ts_us": ts, "end_us": ts + events["dur_us"].to_numpy(np.float64)[rows]}
    for j, c in enumerate(cols[2:]):
        out[c] = np.array([parsed[i][j] for i in codes[rows]], dtype=object)
    return pd.DataFrame(out).sort_values("ts_us", kind="stable").reset_index(drop=True)


def assign_arrays(c: dict, rt) -> tuple[dict, list[str]]:
    """Add ``step`` (float64), ``stage`` (int8 codes into model.STAGES), ``fsdp_name`` (the name code of the FSDP
    annotation that labels the row, -1: none) and ``fsdp_phase`` / ``unit`` (per name code) to classify_arrays'
    columns; returns (c, warnings)."""
    warnings: list[str] = []
    n = len(c["ts_us"])
    cats, codes, ts, dur = list(c["name_cats"]), c["name"], c["ts_us"], c["dur_us"]
    lane_gpu = np.fromiter((str(x).startswith("stream:") for x in c["lane_cats"]), dtype=bool,
                           count=len(c["lane_cats"]))
    on_dev = lane_gpu[c["lane"]] if n else np.zeros(0, dtype=bool)
    cpu = ~on_dev
    lt = c["launch_tid"]
    no_launch = on_dev & (lt < 0)
    q_ts = c["launch_ts_us"]                    # the launch point (a CPU op's own start)

    # --- steps
    marks = _step_mark_columns(cats, codes, ts, lambda i: ts[i] + dur[i], cpu)
    collective = (c["kind"] == K_COMM) | ~c["collective"].isna()        # (stage_at: input distribution)
    step = np.full(n, np.nan)
    if marks is not None and len(marks["start_us"]):
        s_idx = np.flatnonzero(((np.array(per_name(_mark_flags, cats), dtype=np.uint8)[codes] & M_STEP) != 0) & cpu)
        step_of = np.array(per_name(_step_number, cats), dtype=np.float64)
        k = intervals.innermost(ts[s_idx], ts[s_idx] + dur[s_idx], q_ts)
        outside = k < 0
        np.maximum(k, 0, out=k)
        step = step_of[codes[s_idx]][k]
        del k
        step[outside] = np.nan
        del outside
    else:
        warnings.append(f"trace {rt.path} has no ProfilerStep# annotations: the whole trace is taken as one step "
                        f"(use torch.profiler's schedule and prof.step() to get per-step numbers)")
        step[:] = 0.0
        # the marks of one step, ProfilerStep#0, over the whole trace
        end = ts + dur
        t0, t1 = (float(np.min(q_ts)), float(np.max(np.maximum(end, q_ts)))) if n else (0.0, 0.0)
        marks = _step_mark_columns(cats + [model.STEP_PREFIX + "0"], np.append(codes, len(cats)),
                                   np.append(ts, t0), np.append(end, t1).__getitem__, np.append(cpu, True))
        del end
    stage = model.stage_codes_at(q_ts, marks, collective)
    step[no_launch] = np.nan
    stage[no_launch] = model.STAGES.index(model.STAGE_UNKNOWN)

    # --- FSDP annotations -> fsdp_phase / unit (as the annotation's name code)
    parsed = per_name(model.parse_fsdp, cats)
    c_phase, c_unit = [p[0] for p in parsed], [p[1] for p in parsed]
    c_is_fsdp = np.fromiter((p is not None for p in c_phase), dtype=bool, count=len(c_phase))
    is_fsdp = (c_is_fsdp[codes] if len(cats) else np.zeros(n, dtype=bool)) & cpu & (c["kind"] != K_COMM)
    fsdp_name = np.full(n, -1, dtype=np.int32)
    f_idx = np.flatnonzero(is_fsdp)
    f_tid = c["tid"][f_idx]
    for t in np.unique(f_tid).tolist():
        sel = f_idx[f_tid == t]
        qsel = np.flatnonzero(lt == t)
        k = intervals.innermost(ts[sel], ts[sel] + dur[sel], q_ts[qsel])
        fsdp_name[qsel[k >= 0]] = codes[sel[k[k >= 0]]]
    fsdp_name[f_idx] = codes[f_idx]              # the FSDP annotations describe themselves too
    c["step"], c["stage"], c["fsdp_name"], c["fsdp_phase"], c["unit"] = step, stage, fsdp_name, c_phase, c_unit
    q_ts[no_launch] = np.nan                     # (classify's column: changed in place)
    return c, warnings


_NONE_DTYPE = pd.Categorical(np.full(1, None, dtype=object)).dtype   # what pd.Categorical makes of only None
_FROM_FASTPATH = getattr(pd.CategoricalDtype, "_from_fastpath", None)
_SMALL_DTYPES: dict = {}      # tuple of a few string categories -> its dtype, shared by every frame that has them


def _dtype(categories) -> pd.CategoricalDtype:
    """pd.CategoricalDtype of categories known to be distinct (not checked).  A few strings (up to 64) get one
    dtype per process, so that concat_events finds the ranks' dtypes the same object."""
    key = None
    if not isinstance(categories, pd.Index) and len(categories) <= 64 and all(type(x) is str for x in categories):
        key = tuple(categories)
        if key in _SMALL_DTYPES:
            return _SMALL_DTYPES[key]
    try:
        dtype = _FROM_FASTPATH(pd.Index(categories), False)
    except (TypeError, ValueError):     # pragma: no cover - another pandas
        dtype = pd.CategoricalDtype(categories)
    if key is not None:
        if len(_SMALL_DTYPES) >= 4096:
            _SMALL_DTYPES.clear()
        _SMALL_DTYPES[key] = dtype
    return dtype


def _from_codes(codes: np.ndarray, dtype: pd.CategoricalDtype) -> pd.Categorical:
    """pd.Categorical.from_codes for codes known to be valid (-1 or a position in the categories)."""
    try:
        return pd.Categorical.from_codes(codes, dtype=dtype, validate=False)
    except TypeError:                   # pragma: no cover - pandas < 2.1 has no validate=
        return pd.Categorical.from_codes(codes, dtype=dtype)


def _categorical(values: np.ndarray, rows: np.ndarray, n: int) -> pd.Categorical:
    """pd.Categorical of ``n`` rows holding the object array ``values`` at ``rows`` (missing elsewhere),
    factorizing only the non-missing entries."""
    miss = _isna(values)
    if miss.all():
        return _from_codes(np.full(n, -1, dtype=np.int8), _NONE_DTYPE)
    nn = np.flatnonzero(~miss)
    present = values[nn].tolist()
    distinct = set(present)
    if not all(type(v) is str for v in distinct):
        sub = pd.Categorical(values[nn])
        codes = np.full(n, -1, dtype=sub.codes.dtype)
        codes[rows[nn]] = sub.codes
        return _from_codes(codes, sub.dtype)
    pos = {v: i for i, v in enumerate(sorted(distinct))}          # (strings: sorted as pd.Categorical sorts them)
    codes = np.full(n, -1, dtype=np.int8 if len(pos) < 128 else np.int32)
    codes[rows[nn]] = np.fromiter(map(pos.__getitem__, present), dtype=np.int32, count=len(present))
    return _from_codes(codes, _dtype(list(pos)))


def _categorical_codes(codes: np.ndarray, labels: np.ndarray) -> pd.Categorical:
    """pd.Categorical(labels[codes]) (categories: the labels used, sorted) without a per-row factorize."""
    used = np.flatnonzero(np.bincount(codes, minlength=len(labels))) if len(codes) else np.empty(0, dtype=np.int64)
    order = sorted(used.tolist(), key=lambda i: labels[i])
    remap = np.full(len(labels), -1, dtype=np.int8)
    remap[order] = np.arange(len(order))
    return _from_codes(remap[codes], _dtype([labels[i] for i in order]))


def _categorical_of_table(idx: np.ndarray, table: list) -> pd.Categorical:
    """pd.Categorical of ``table[idx]`` per row (missing where idx < 0 or the value is None), categories sorted."""
    hit = np.flatnonzero(idx >= 0)
    cats = sorted({table[i] for i in np.unique(idx[hit]).tolist()} - {None})
    if not cats:
        return _from_codes(np.full(len(idx), -1, dtype=np.int8), _NONE_DTYPE)
    pos = {v: i for i, v in enumerate(cats)}
    remap = np.array([-1 if v is None else pos[v] for v in table], dtype=np.int32)
    codes = np.full(len(idx), -1, dtype=np.int32)
    codes[hit] = remap[idx[hit]]
    return _from_codes(codes, _dtype(cats))


_STAGE_DTYPE = pd.CategoricalDtype(model.STAGES)


def events_frame(c: dict, rank: int) -> pd.DataFrame:
    """The model.EVENT_COLUMNS frame from classified, labelled columns, moved out of ``c`` one by one (each
    freed once converted: the peak of a big trace's load; ``c`` is left empty)."""
    n = len(c["ts_us"])
    cols = {"rank": np.full(n, rank, dtype=np.int32)}
    cols["lane"] = _from_codes(c.pop("lane"), _dtype(c.pop("lane_cats")))
    cols["kind"] = _categorical_codes(c.pop("kind"), KIND_LABELS)
    cols["name"] = _from_codes(c.pop("name"), _dtype(c.pop("name_cats")))
    cols["ts_us"], cols["dur_us"] = c.pop("ts_us"), c.pop("dur_us")
    cols["stage"] = _from_codes(c.pop("stage"), _STAGE_DTYPE)
    cols["fsdp_phase"] = _categorical_of_table(c["fsdp_name"], c.pop("fsdp_phase"))
    cols["unit"] = _categorical_of_table(c.pop("fsdp_name"), c.pop("unit"))
    cols["step"], cols["launch_ts_us"] = c.pop("step"), c.pop("launch_ts_us")
    for k in ("collective", "dtype", "pg"):           # (classify's SparseColumns: values at their rows only)
        col = c.pop(k)
        cols[k] = _categorical(col.vals, col.rows, n)
    for k in ("bytes", "group_size", "seq"):
        cols[k] = c.pop(k).dense()
    c.clear()
    return frame_of(cols, model.EVENT_COLUMNS)


def concat_events(frames: list[pd.DataFrame]) -> pd.DataFrame:
    """Events frames of several ranks as one (index 0..n-1), categorical columns kept categorical: the first
    frame's categories where every frame's equal them, else the union of the categories used, sorted."""
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
        cats = [a.categories.tolist() for a in arrays]
        used = set()
        for a, c in zip(arrays, cats):
            seen = np.bincount(a.codes[a.codes >= 0].astype(np.intp), minlength=len(c)).astype(bool).tolist()
            used.update(x for x, u in zip(c, seen) if u)
        union = sorted(used)
        position = {x: i for i, x in enumerate(union)}
        # each frame's codes mapped into the union (-1, missing, stays -1: the appended last entry)
        parts = [np.array([position.get(x, -1) for x in c] + [-1], dtype=np.int64)[a.codes]
                 for a, c in zip(arrays, cats)]
        out[col] = _from_codes(np.concatenate(parts), _dtype(union) if union else _NONE_DTYPE)
    return frame_of(out, columns)


def cpu_side(events: pd.DataFrame) -> np.ndarray:
    """Rows on CPU threads (not on a device stream)."""
    return ~on_device(events["lane"])


def workload_of(events: pd.DataFrame) -> str | None:
    """``training`` or ``inference`` (model.workload_of) from the trace's op names; None without events."""
    cats, codes = _cat_codes(events["name"])
    return model.workload_of([cats[i] for i in np.unique(codes[codes >= 0]).tolist()])


def framework_of(events: pd.DataFrame) -> str:
    """What a trace shows running: ``fsdp2`` / ``fsdp1`` (their annotations), ``ddp`` (DDP's forward or its
    reducer), ``distributed`` (collectives of another framework) or ``single_device``."""
    cats, codes = _cat_codes(events["name"])
    names = [cats[i] for i in np.unique(codes[codes >= 0]).tolist()]
    for prefix, framework in ((model.FSDP2_PREFIX, model.FAMILY_FSDP2), (model.FSDP1_PREFIX, model.FAMILY_FSDP1),
                              (model.DDP_MARKERS, model.FAMILY_DDP)):
        if any(x.startswith(prefix) for x in names):
            return framework
    return model.INPUT_DISTRIBUTED if isin(events["kind"], [model.KIND_COMM]).any() else model.INPUT_SINGLE_DEVICE


def precisions_seen(events: pd.DataFrame) -> dict:
    """The evidence of low-precision compute in a trace: ``kernels`` (device kernels), ``by_dtype`` ({short name
    (model.LOW_PRECISION): kernels whose name spells it}) and ``comm_dtypes`` (the dtypes collectives carry)."""
    dev = events[isin(events["kind"], model.DEVICE_KINDS) & ~cpu_side(events)]
    cats, codes = _cat_codes(dev["name"])
    counts = np.bincount(codes[codes >= 0], minlength=len(cats))
    by_dtype: Counter = Counter()
    for i in np.flatnonzero(counts).tolist():
        for d in model.kernel_precisions(cats[i]):
            by_dtype[d] += int(counts[i])
    comm = events.loc[isin(events["kind"], [model.KIND_COMM]), "dtype"].dropna().astype(str)
    comm_dtypes = sorted({model.dtype_size(x)[0] or x for x in comm.unique() if x})
    return {"kernels": int(len(dev)), "by_dtype": {k: by_dtype[k] for k in model.LOW_PRECISION if by_dtype[k]},
            "comm_dtypes": comm_dtypes}


DEVICE_WORD = {model.DEVICE_CUDA: "CUDA", model.DEVICE_ROCM: "HIP", model.DEVICE_XPU: "XPU", model.DEVICE_MTIA: "MTIA"}
THREAD_ROLES = (("pt_main_thread", "main thread"), ("gloo", "gloo worker"), ("pt_autograd", "autograd thread"),
                ("nccl_watchdog", "NCCL watchdog"), ("pt_nccl", "NCCL watchdog"))
THREAD_NAMES_MAX = 4096   # thread_name records carried per trace (a hostile trace may name millions)


def thread_name_records(thread_names: dict) -> list:
    """The decoder's ``thread_names`` ({(pid, tid): name}) as JSON-friendly [pid, tid, name] triples."""
    return [[pid, tid, str(name)[:200]] for (pid, tid), name in list(thread_names.items())[:THREAD_NAMES_MAX]]


LANE_COMM_SHARE = 0.9   # a stream whose kernels are at least this share communication is named a communication stream


def lane_names(lanes, comm_lanes=(), nccl_lanes=(), thread_names=(), device_type: str | None = None,
               comm_share=None) -> dict:
    """Readable names of event lanes (``thread:T`` / ``stream:S``) from the trace's thread names ([pid, tid, name]):
    "main thread", "gloo worker", "autograd thread 0", "CUDA stream 7 (NCCL)" ...; a lane in ``comm_lanes`` runs
    communication (``nccl_lanes``: mostly NCCL kernels).  A stream is named by what runs on it: ``comm_share``
    ({lane: share of its device events that are communication}, 1 for a lane in ``comm_lanes`` when not given)
    at least LANE_COMM_SHARE: "(NCCL)" / "(communication)"; above 0: "(compute + NCCL)" / "(compute +
    communication)".  Others: "thread T" / "stream S"; names made unique."""
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
    for lane in map(str, lanes):
        kind, _, ident = lane.partition(":")
        if kind == "stream":
            share = (comm_share or {}).get(lane, 1.0 if comm_share is None else 0.0) if lane in comm_lanes else 0.0
            what = "NCCL" if lane in nccl_lanes else "communication"
            out[lane] = f"{dev} stream {ident}" + ("" if share <= 0 else f" ({what})" if share >= LANE_COMM_SHARE
                                                   else f" (compute + {what})")
            continue
        inner, is_main = by_lane.get(lane, ("", False))
        if "(" in inner:
            inner = inner.rpartition("(")[2].rstrip(")")
        role = "main thread" if is_main else next((r for key, r in THREAD_ROLES if key in inner.lower()), None)
        if role == "autograd thread" and inner.rsplit("_", 1)[-1].isdigit():
            role += " " + inner.rsplit("_", 1)[-1]
        if role is None and lane in comm_lanes and not is_main:
            role = "gloo worker"   # CPU threads run communication only as gloo's work (classify: gloo_comm)
        out[lane] = role or (f"thread {ident} ({inner})" if inner and not inner.startswith("thread") else f"thread {ident}")
    order = sorted(out, key=lambda x: (not x.startswith("thread"), x))
    seen = Counter(out[lane] for lane in order)
    count: Counter = Counter()
    for lane in order:
        n = out[lane]
        if seen[n] > 1:
            count[n] += 1
            out[lane] = f"{n} {count[n]}"
    return out
