"""Classify decoded trace events: kind (compute, comm, memcpy, memset, sync, cpu_op, annotation),
collective type and message size (bytes), on GPU (NCCL/RCCL kernels) and CPU (gloo) traces.

GPU: kernels named ``nccl*``/``rccl*`` (``ncclKernel_*``, ``ncclDevKernel_*``, RCCL
``ncclDevKernel_Generic``) are comm; Memcpy/Memset are memcpy/memset; ``*Sync*`` GPU events are
sync; other kernels are compute.  Sizes come from the kernel's args (``In msg nelems``,
``Out msg nelems``, ``dtype``, ``Group size``, ``Process Group Name``, ``Seq``) or, when the
kernel has none, from its launching ``record_param_comms``/``c10d::*`` op (same External id).

CPU (gloo): the collective runs as a ``gloo:<op>`` annotation on a gloo worker thread; the
``c10d::<op>`` call on the issuing thread carries the shapes.  Nothing links the two, so they are
paired by order per gloo op type (``c10d::_reduce_scatter_base_`` runs as ``gloo:all_reduce``)
and checked in time.  CPU compute is the leaf ``cpu_op`` events on threads that run no gloo work.

``classify(raw_trace)`` returns the events frame plus link columns (``tid``, ``stream``,
``correlation``, ``ext_id``, ``cat``, ``launch_tid``, ``launch_ts_us``) used by phases.py.
"""
from __future__ import annotations

import re

import numpy as np
import pandas as pd

from fsdpprof.analyze import schema

# dtype spellings in traces -> (torch-style name, element bytes)
_DTYPES = {
    "float": ("float32", 4), "float32": ("float32", 4), "floatfloat": ("float32", 4),
    "double": ("float64", 8), "float64": ("float64", 8),
    "half": ("float16", 2), "c10::half": ("float16", 2), "float16": ("float16", 2),
    "bfloat16": ("bfloat16", 2), "c10::bfloat16": ("bfloat16", 2),
    "int": ("int32", 4), "int32": ("int32", 4),
    "long": ("int64", 8), "long int": ("int64", 8), "int64": ("int64", 8),
    "short": ("int16", 2), "short int": ("int16", 2), "int16": ("int16", 2),
    "byte": ("uint8", 1), "unsigned char": ("uint8", 1), "uint8": ("uint8", 1),
    "char": ("int8", 1), "signed char": ("int8", 1), "int8": ("int8", 1),
    "bool": ("bool", 1),
    "float8_e4m3fn": ("float8_e4m3fn", 1), "c10::float8_e4m3fn": ("float8_e4m3fn", 1),
    "float8_e5m2": ("float8_e5m2", 1), "c10::float8_e5m2": ("float8_e5m2", 1),
}

_COLL_PATTERNS = [  # order matters: "reducescatter" before "allreduce"/"reduce"
    ("allgather", "all_gather"), ("reducescatter", "reduce_scatter"), ("allreduce", "all_reduce"),
    ("alltoall", "all_to_all"), ("broadcast", "broadcast"), ("sendrecv", "send_recv"),
    ("send", "send_recv"), ("recv", "send_recv"), ("barrier", "barrier"),
]
_NON_ALNUM = re.compile(r"[^a-z]")

# gloo op each c10d op runs as (for pairing)
_GLOO_AS = {"reduce_scatter": "all_reduce"}

_COMM_CPU_NAMES = ("record_param_comms",)
_WAIT_NAMES = frozenset({"c10d::wait", "aten::wait", "_c10d_functional::wait_tensor", "c10d_functional::wait_tensor"})


def _obj(values) -> pd.Series:
    """An object column that pandas will not convert to its string dtype (that conversion is slow)."""
    return pd.Series(np.asarray(values, dtype=object), dtype=object)


def category_mask(series: pd.Series, test) -> np.ndarray:
    """Vectorised string test evaluated once per distinct value: ``test(pd.Series of values) -> bool array``."""
    if isinstance(series.dtype, pd.CategoricalDtype):
        cats = pd.Series(series.cat.categories.astype(object), dtype=object)
        res = np.asarray(test(cats.astype(str)), dtype=bool) if len(cats) else np.zeros(0, dtype=bool)
        codes = series.cat.codes.to_numpy()
        return np.where(codes >= 0, res[np.clip(codes, 0, None)] if len(res) else False, False)
    codes, uniques = pd.factorize(series.astype(object), use_na_sentinel=True)
    u = pd.Series(np.asarray(uniques, dtype=object), dtype=object)
    res = np.asarray(test(u.astype(str)), dtype=bool) if len(u) else np.zeros(0, dtype=bool)
    return np.where(codes >= 0, res[np.clip(codes, 0, None)] if len(res) else False, False)


def collective_of(name) -> str | None:
    """Collective type of a kernel / op / annotation / 'Collective name' string, or None."""
    if not isinstance(name, str) or not name:
        return None
    s = name.split("(", 1)[0].lower()
    for prefix in ("nccldevkernel_", "ncclkernel_", "rccl", "nccl:", "gloo:", "c10d::", "c10d_functional::",
                   "_c10d_functional::"):
        if s.startswith(prefix):
            s = s[len(prefix):]
            break
    s = _NON_ALNUM.sub("", s.replace("_base", ""))
    for key, coll in _COLL_PATTERNS:
        if key in s:
            return coll
    return None


def dtype_of(value) -> tuple[str | None, float]:
    """(torch-style dtype name, element size in bytes) of a trace dtype string; (None, nan) unknown."""
    if not isinstance(value, str):
        return None, float("nan")
    return _DTYPES.get(value.strip().lower(), (value, float("nan")))


def _is_comm_kernel(names: pd.Series) -> np.ndarray:
    low = names.str.lower()
    return (low.str.startswith("nccl") | low.str.startswith("rccl")).to_numpy(dtype=bool)


def _numel(dims) -> float:
    if not isinstance(dims, list) or not dims:
        return float("nan")
    if all(isinstance(d, int) for d in dims):
        return float(np.prod(dims)) if dims else 1.0
    # list of tensors (TensorList): sum of their numels
    vals = [_numel(d) for d in dims if isinstance(d, list)]
    vals = [v for v in vals if v == v]
    return float(sum(vals)) if vals else float("nan")


def _c10d_sizes(coll: str | None, dims_raw: bytes, types_raw: bytes) -> tuple[float, str | None, float]:
    """(bytes of the whole array, dtype, group size implied by the shapes or NaN) from a c10d op's
    Input Dims / Input type (all_gather: output/input numel; reduce_scatter: input/output numel)."""
    import msgspec

    try:
        dims = msgspec.json.decode(dims_raw) if dims_raw else None
        types = msgspec.json.decode(types_raw) if types_raw else None
    except msgspec.DecodeError:
        return float("nan"), None, float("nan")
    if not isinstance(dims, list) or not dims:
        return float("nan"), None, float("nan")
    dtype, size = (None, float("nan"))
    if isinstance(types, list):
        for t in types:
            dtype, size = dtype_of(t)
            if size == size:
                break
    n0 = _numel(dims[0])
    n1 = _numel(dims[1]) if len(dims) > 1 and isinstance(dims[1], list) and dims[1] else float("nan")
    group = float("nan")
    if coll in ("all_gather", "reduce_scatter"):
        numel = np.nanmax([n0, n1]) if (n0 == n0 or n1 == n1) else float("nan")
        if n0 == n0 and n1 == n1 and min(n0, n1) > 0 and max(n0, n1) % min(n0, n1) == 0:
            group = max(n0, n1) / min(n0, n1)
    else:
        numel = n0
    return numel * size, dtype, group


def _comm_info(rt, n: int, dist: dict) -> pd.DataFrame:
    """Per raw row with comm args: collective, bytes, dtype, group_size, pg, seq (NaN elsewhere)."""
    ca = rt.comm_args
    if len(ca) == 0:
        return pd.DataFrame(columns=["idx", "collective", "bytes", "dtype", "group_size", "pg", "seq", "shard"])
    names = rt.raw["name"].to_numpy()[ca["idx"].to_numpy()]
    rows = []
    shards = []
    for idx, name, cname, inn, outn, gs, dt, pg, seq, dims, types in zip(
            ca["idx"], names, ca["coll_name"], ca["in_nelems"], ca["out_nelems"], ca["group_size"], ca["dtype"],
            ca["pg"], ca["seq"], ca["input_dims"], ca["input_type"]):
        coll = collective_of(cname) or collective_of(str(name))
        dtype, size = dtype_of(dt)
        shard = False
        nbytes = float("nan")
        if isinstance(inn, (int, float)) or isinstance(outn, (int, float)):
            inn_f = float(inn) if isinstance(inn, (int, float)) else float("nan")
            out_f = float(outn) if isinstance(outn, (int, float)) else float("nan")
            if coll == "all_gather":
                numel = out_f if out_f == out_f else inn_f
            elif coll == "reduce_scatter":
                numel = inn_f if inn_f == inn_f else out_f
            else:
                numel = inn_f if inn_f == inn_f else out_f
            nbytes = numel * size
        elif str(name).startswith("c10d::"):
            nbytes, dtype2, group = _c10d_sizes(coll, dims, types)
            dtype = dtype or dtype2
            if not isinstance(gs, (int, float)) and group == group:
                gs = group
        elif str(name).startswith("gloo:"):
            # the gloo work's own input: all_gather gets one shard (whole = shard * group size),
            # all_reduce (also what reduce_scatter runs as) the whole array
            nbytes, dtype2, _ = _c10d_sizes(None, dims, types)
            dtype = dtype or dtype2
            shard = coll == "all_gather"  # only a shard here: times the group size once that is known
        shards.append(shard)
        rows.append((idx, coll, nbytes, dtype,
                     float(gs) if isinstance(gs, (int, float)) else float("nan"),
                     None if pg is None else str(pg),
                     float(seq) if isinstance(seq, (int, float)) else float("nan")))
    out = pd.DataFrame(rows, columns=["idx", "collective", "bytes", "dtype", "group_size", "pg", "seq"])
    out["shard"] = np.asarray(shards, dtype=bool)
    return out


def _default_group_size(dist: dict) -> float:
    if not isinstance(dist, dict):
        return float("nan")
    cfg = dist.get("pg_config")
    if isinstance(cfg, list) and len(cfg) == 1 and isinstance(cfg[0], dict) and isinstance(cfg[0].get("pg_size"), int):
        return float(cfg[0]["pg_size"])
    ws = dist.get("world_size")
    return float(ws) if isinstance(ws, int) else float("nan")


def classify(rt) -> pd.DataFrame:
    """Events frame (schema columns except rank/step/phase/unit) + link columns, from a RawTrace."""
    raw = rt.raw
    n = len(raw)
    dist = rt.meta.get("distributedInfo") or {}
    names = raw["name"]
    cat_codes = raw["cat"].cat.codes.to_numpy()
    cat_names = np.asarray(raw["cat"].cat.categories.astype(object), dtype=object)

    def cat_is(*wanted) -> np.ndarray:
        hit = np.isin(cat_names, list(wanted))
        return hit[cat_codes] if len(hit) else np.zeros(n, dtype=bool)

    stream = raw["stream"].to_numpy()
    gpu_cat = cat_is("kernel", "gpu_memcpy", "gpu_memset", "cuda_sync", "Kernel", "Memcpy", "Memset")
    on_gpu = (stream >= 0) & gpu_cat
    is_runtime = cat_is("cuda_runtime", "cuda_driver", "Runtime", "Driver")
    is_cpu_op = cat_is("cpu_op")
    is_annot = cat_is("user_annotation", "gpu_user_annotation")
    is_memcpy_cat, is_memset_cat, is_sync_cat = cat_is("gpu_memcpy", "Memcpy"), cat_is("gpu_memset", "Memset"), \
        cat_is("cuda_sync")

    # --- kind -------------------------------------------------------------------------------
    # name-level tests on the (few) categories, broadcast to rows
    cats = names.cat.categories
    cs = pd.Series(cats, dtype=object)
    low = cs.str.lower()
    c_comm = (low.str.startswith("nccl") | low.str.startswith("rccl")).to_numpy()
    c_memcpy = (low.str.startswith("memcpy") | low.str.startswith("dma")).to_numpy()
    c_memset = low.str.startswith("memset").to_numpy()
    c_sync = low.str.contains("sync").to_numpy()
    c_gloo = cs.str.startswith("gloo:").to_numpy()
    c_c10d = (cs.str.startswith("c10d::") | cs.isin(_COMM_CPU_NAMES) | cs.isin(list(_WAIT_NAMES))).to_numpy()
    codes = names.cat.codes.to_numpy()
    r_comm, r_memcpy, r_memset, r_sync = c_comm[codes], c_memcpy[codes], c_memset[codes], c_sync[codes]
    r_gloo, r_c10d = c_gloo[codes], c_c10d[codes]

    kind = np.full(n, schema.KIND_CPU_OP, dtype=object)
    kind[is_annot] = schema.KIND_ANNOTATION
    gpu_kind = np.where(r_comm, schema.KIND_COMM,
                        np.where(r_memcpy | is_memcpy_cat, schema.KIND_MEMCPY,
                                 np.where(r_memset | is_memset_cat, schema.KIND_MEMSET,
                                          np.where(r_sync | is_sync_cat, schema.KIND_SYNC,
                                                   schema.KIND_COMPUTE))))
    kind[on_gpu] = gpu_kind[on_gpu]
    gloo_comm = is_annot & r_gloo
    kind[gloo_comm] = schema.KIND_COMM

    tid = raw["tid"].to_numpy()
    # lane labels built once per distinct stream / thread, then broadcast (no per-row strings)
    tcodes, tuniq = pd.factorize(pd.Series(tid, dtype=object))
    scodes, suniq = pd.factorize(stream)
    lane_labels = np.array([f"thread:{t}" for t in tuniq] + [f"stream:{x}" for x in suniq], dtype=object)
    lane_codes = np.where(on_gpu, len(tuniq) + scodes, tcodes) if n else np.empty(0, dtype=np.int64)
    if pd.Index(lane_labels).is_unique:
        lane = pd.Categorical.from_codes(lane_codes, categories=pd.Index(lane_labels, dtype=object))
    else:
        lane = pd.Categorical(lane_labels[lane_codes])

    device_type = rt.meta.get("device_type", "cpu")
    if device_type == "cpu":
        # CPU compute: leaf cpu_ops on threads that run no gloo work, not comm calls themselves
        comm_threads = set(pd.unique(tid[gloo_comm]))
        cand = is_cpu_op & ~r_c10d & ~np.isin(tid, list(comm_threads)) if comm_threads else is_cpu_op & ~r_c10d
        leaf = _leaf_mask(raw, is_cpu_op)
        kind[cand & leaf] = schema.KIND_COMPUTE

    # --- collective type + sizes ---------------------------------------------------------------
    coll_by_cat = np.array([collective_of(c) for c in cats], dtype=object) if len(cats) else np.empty(0, dtype=object)
    collective = coll_by_cat[codes] if n else np.empty(0, dtype=object)
    relevant = (kind == schema.KIND_COMM) | r_c10d | (is_annot & (low.str.startswith("nccl:").to_numpy()[codes]))
    collective = np.where(relevant, collective, None)

    # --- launch point of every event (for phases/steps): the runtime call for kernels -----------------
    ts = raw["ts_us"].to_numpy()
    corr = raw["correlation"].to_numpy()
    launch_tid = tid.astype(object)             # a new array
    launch_ts = ts.copy()
    if on_gpu.any():
        launch_tid[on_gpu] = None
        rsel = is_runtime & (corr >= 0)
        rt_rows = pd.DataFrame({"correlation": corr[rsel], "tid": _obj(tid[rsel]), "ts_us": ts[rsel]})
        rt_rows = rt_rows.drop_duplicates("correlation")
        gidx = np.flatnonzero(on_gpu)
        m = pd.DataFrame({"correlation": corr[gidx]}).merge(rt_rows, on="correlation", how="left")
        ok = m["ts_us"].notna().to_numpy()
        launch_tid[gidx[ok]] = m["tid"].to_numpy(dtype=object)[ok]
        launch_ts[gidx[ok]] = m["ts_us"].to_numpy()[ok]

    # --- the frame: every event but the runtime calls ------------------------------------------------
    kidx = np.flatnonzero(~is_runtime)
    pos = np.full(n, -1, dtype=np.int64)
    pos[kidx] = np.arange(len(kidx))
    k = len(kidx)
    out = pd.DataFrame({
        "lane": pd.Categorical.from_codes(np.asarray(lane.codes)[kidx], categories=lane.categories),
        "kind": _obj(kind[kidx]),
        "name": pd.Categorical.from_codes(codes[kidx], categories=names.cat.categories),
        "ts_us": ts[kidx], "dur_us": raw["dur_us"].fillna(0.0).to_numpy()[kidx], "collective": _obj(collective[kidx]),
        "bytes": np.full(k, np.nan), "dtype": _obj(np.full(k, None, dtype=object)), "group_size": np.full(k, np.nan),
        "pg": _obj(np.full(k, None, dtype=object)), "seq": np.full(k, np.nan),
        "tid": _obj(tid[kidx]), "stream": stream[kidx], "correlation": corr[kidx],
        "ext_id": raw["ext_id"].to_numpy()[kidx],
        "cat": pd.Categorical.from_codes(cat_codes[kidx], categories=raw["cat"].cat.categories),
        "launch_tid": _obj(launch_tid[kidx]), "launch_ts_us": launch_ts[kidx],
    })
    k_on_gpu, k_gloo, k_c10d, k_cpu_op = on_gpu[kidx], gloo_comm[kidx], r_c10d[kidx], is_cpu_op[kidx]
    del launch_tid, launch_ts, collective, kind
    info = _comm_info(rt, n, dist)
    shard = np.zeros(k, dtype=bool)
    if len(info):
        ipos = pos[info["idx"].to_numpy()]
        info = info[ipos >= 0]
        idx = ipos[ipos >= 0]
        shard[idx] = info["shard"].to_numpy(dtype=bool)
        coll_info = info["collective"].to_numpy(dtype=object)
        cur = out["collective"].to_numpy(dtype=object).copy()
        cur[idx] = np.where(pd.isna(coll_info), cur[idx], coll_info)
        out["collective"] = _obj(cur)
        for c in ("bytes", "group_size", "seq"):
            arr = out[c].to_numpy(dtype=float).copy()
            arr[idx] = info[c].to_numpy(dtype=float)
            out[c] = arr
        for c in ("dtype", "pg"):
            arr = out[c].to_numpy(dtype=object).copy()
            arr[idx] = info[c].to_numpy(dtype=object)
            out[c] = _obj(arr)
    if k_on_gpu.any():
        # comm kernels without size info: take it from the CPU op with the same External id
        _fill_from_cpu_side(out, k_on_gpu)

    # --- gloo: pair gloo:<op> work with the c10d::<op> call --------------------------------------
    if k_gloo.any():
        _pair_gloo(out, k_gloo, k_c10d & k_cpu_op, dist, shard)
        _gloo_group_sizes(out, k_gloo, rt.meta)
    # default group size for comm rows that lack one
    gs = out["group_size"].to_numpy(dtype=float).copy()
    comm_rows = (out["kind"].to_numpy() == schema.KIND_COMM) | k_c10d
    miss = comm_rows & np.isnan(gs)
    if miss.any():
        gs[miss] = _default_group_size(dist)
        out["group_size"] = gs
    # gloo all_gather work that kept its own (shard) size: the whole array is shard * group size
    sh = shard
    if sh.any():
        b = out["bytes"].to_numpy(dtype=float).copy()
        b[sh] = b[sh] * gs[sh]
        out["bytes"] = b
    return out


def _fill_from_cpu_side(out: pd.DataFrame, on_gpu: np.ndarray) -> None:
    kind = out["kind"].to_numpy()
    ck = on_gpu & (kind == schema.KIND_COMM) & (out["ext_id"].to_numpy() >= 0)
    if not ck.any():
        return
    cpu = out.loc[~on_gpu & out["collective"].notna() & (out["ext_id"].to_numpy() >= 0),
                  ["ext_id", "collective", "bytes", "dtype", "group_size", "pg", "seq"]]
    if len(cpu) == 0:
        return
    cpu = cpu.drop_duplicates("ext_id", keep="last")
    k = out.loc[ck, ["ext_id"]].merge(cpu, on="ext_id", how="left")
    idx = np.flatnonzero(ck)
    for c in ("bytes", "group_size", "seq"):
        cur = out[c].to_numpy(dtype=float).copy()
        sub = cur[idx]
        cur[idx] = np.where(np.isnan(sub), k[c].to_numpy(dtype=float), sub)
        out[c] = cur
    for c in ("dtype", "pg", "collective"):
        cur = out[c].to_numpy(dtype=object).copy()
        sub = cur[idx]
        cur[idx] = np.where(pd.isna(sub), k[c].to_numpy(dtype=object), sub)
        out[c] = _obj(cur)


def _leaf_mask(raw: pd.DataFrame, is_cpu_op: np.ndarray) -> np.ndarray:
    """True for cpu_op rows that contain no other cpu_op of the same thread."""
    n = len(raw)
    leaf = np.zeros(n, dtype=bool)
    if not is_cpu_op.any():
        return leaf
    sub = pd.DataFrame({"tid": raw["tid"].to_numpy()[is_cpu_op].astype(str),
                        "ts": raw["ts_us"].to_numpy()[is_cpu_op],
                        "end": (raw["ts_us"] + raw["dur_us"].fillna(0)).to_numpy()[is_cpu_op],
                        "i": np.flatnonzero(is_cpu_op)})
    # parents start no later and end no earlier: sort by (tid, ts, -end); an op is a leaf when the
    # next op on its thread starts at or after its end
    sub = sub.sort_values(["tid", "ts", "end"], ascending=[True, True, False], kind="mergesort")
    nxt_ts = sub["ts"].shift(-1).to_numpy()
    nxt_tid = sub["tid"].shift(-1).to_numpy()
    end = sub["end"].to_numpy()
    is_leaf = (nxt_tid != sub["tid"].to_numpy()) | (nxt_ts >= end) | pd.isna(nxt_ts)
    leaf[sub["i"].to_numpy()[is_leaf]] = True
    return leaf


def _pair_gloo(out: pd.DataFrame, gloo_comm: np.ndarray, c10d_call: np.ndarray, dist: dict,
               shard: np.ndarray) -> None:
    """Copy collective/bytes/dtype/pg/seq/group_size and the launch point from each c10d call to its gloo work."""
    coll = out["collective"].to_numpy(dtype=object)
    calls = out.loc[c10d_call & pd.notna(coll)].copy()
    calls["gloo_as"] = calls["collective"].replace(_GLOO_AS)
    calls = calls.sort_values("ts_us", kind="mergesort")
    calls["ord"] = calls.groupby("gloo_as", sort=False).cumcount()
    work = out.loc[gloo_comm, ["ts_us", "name"]].copy()
    work["gloo_as"] = [collective_of(str(x)) for x in work["name"]]
    work["row"] = np.flatnonzero(gloo_comm)
    work = work.sort_values("ts_us", kind="mergesort")
    work["ord"] = work.groupby("gloo_as", sort=False).cumcount()
    right = calls[["gloo_as", "ord", "ts_us", "tid", "collective", "bytes", "dtype", "group_size", "pg",
                   "seq"]].rename(columns={"ts_us": "call_ts"})
    # gloo work already running when the window opened has no call in the trace: then the k-th work
    # belongs to the (k - shift)-th call; per op type, keep the shift that pairs the most work in time
    best = []
    for _, w in work.groupby("gloo_as", sort=False):
        cand = None
        for shift in (0, 1, 2):
            m = w.assign(ord=w["ord"] - shift).merge(right, on=["gloo_as", "ord"], how="left")
            m = m[m["call_ts"].notna() & (m["call_ts"] <= m["ts_us"] + 1.0)]
            if cand is None or len(m) > len(cand):
                cand = m
        best.append(cand)
    m = pd.concat(best, ignore_index=True) if best else right.iloc[:0].assign(row=[])
    rows = m["row"].to_numpy()
    # the c10d call's values win; the gloo work's own (from its Input Dims) stay where the call has none
    for c in ("collective", "dtype", "pg"):
        arr = out[c].to_numpy(dtype=object).copy()
        new = m[c].to_numpy(dtype=object)
        arr[rows] = np.where(pd.isna(new), arr[rows], new)
        out[c] = _obj(arr)
    for c in ("bytes", "group_size", "seq"):
        arr = out[c].to_numpy(dtype=float).copy()
        new = m[c].to_numpy(dtype=float)
        arr[rows] = np.where(np.isnan(new), arr[rows], new)
        out[c] = arr
        if c == "bytes":   # the call gave the whole array: the work's shard size is no longer used
            shard[rows] = shard[rows] & np.isnan(new)
    lt = out["launch_tid"].to_numpy(dtype=object).copy()
    lts = out["launch_ts_us"].to_numpy(dtype=float).copy()
    lt[rows] = m["tid"].to_numpy(dtype=object)
    lts[rows] = m["call_ts"].to_numpy(dtype=float)
    out["launch_tid"] = _obj(lt)
    out["launch_ts_us"] = lts


def _gloo_group_sizes(out: pd.DataFrame, gloo_comm: np.ndarray, meta: dict) -> None:
    """Group size of gloo work whose call did not tell it (e.g. all_reduce), per gloo thread.

    gloo runs each process group on its own worker threads, so work on a thread where another
    collective's size is known (from its shapes) gets that size.  On threads with none known: the one
    size of the non-default process groups of this rank that no other thread claimed (HSDP's replicate
    group when the shard group is known), or the only non-default size there is."""
    gs = out["group_size"].to_numpy(dtype=float).copy()
    lanes = out["lane"].to_numpy(dtype=object)
    sub = pd.DataFrame({"lane": lanes[gloo_comm], "gs": gs[gloo_comm]})
    known = sub.dropna().groupby("lane")["gs"].agg(lambda x: x.mode().iloc[0])
    dist = meta.get("distributedInfo") if isinstance(meta.get("distributedInfo"), dict) else {}
    rank, cfg = dist.get("rank"), dist.get("pg_config")
    other_sizes: list[float] = []
    if isinstance(cfg, list) and len(cfg) > 1:
        for g in cfg:
            if not isinstance(g, dict) or g.get("pg_desc") == "default_pg" or not isinstance(g.get("pg_size"), int):
                continue
            if isinstance(g.get("ranks"), list) and rank is not None and rank not in g["ranks"]:
                continue
            other_sizes.append(float(g["pg_size"]))
    left = set(other_sizes) - set(known.to_numpy().tolist())
    fallback = (left.pop() if len(left) == 1 else
                (other_sizes[0] if other_sizes and len(set(other_sizes)) == 1 else float("nan")))
    lane_size = pd.Series(lanes).map(known).to_numpy(dtype=float)
    fill = gloo_comm & np.isnan(gs)
    gs[fill] = np.where(np.isnan(lane_size[fill]), fallback, lane_size[fill])
    out["group_size"] = gs
    # with a single process group, that is the group of every collective
    if isinstance(cfg, list) and len(cfg) == 1 and isinstance(cfg[0], dict) and cfg[0].get("pg_name") is not None:
        pg = out["pg"].to_numpy(dtype=object).copy()
        pg[gloo_comm & pd.isna(pg)] = str(cfg[0]["pg_name"])
        out["pg"] = _obj(pg)
