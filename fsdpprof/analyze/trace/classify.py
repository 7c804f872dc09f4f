"""Classify decoded trace events: kind (compute, comm, memcpy, memset, sync, cpu_op, annotation), collective type,
message size (bytes), group, on GPU (NCCL kernels: type and group from the CPU op that launched them, sizes from
their args or the op with the same External id) and CPU (gloo work paired with its ``c10d::`` call by order).
:func:`classify_arrays` returns numpy columns with each event's launch point for :mod:`.labels`.
"""
from __future__ import annotations

import math

import msgspec
import numpy as np
import pandas as pd

from fsdpprof.analyze import model
from fsdpprof.analyze.comm import intervals
from fsdpprof.analyze.trace.decode import RANK_MAX, as_text, cut_text, plausible_count
from fsdpprof.analyze.trace.names import per_name

NUMEL_MAX = 2.0 ** 53           # element / byte counts beyond this (8 Pi) are not real messages
# categories of CPU ops and annotations, and the device-event categories that are copies, sets and waits
CPU_OP_CATS = ("cpu_op",)
ANNOTATION_CATS = ("user_annotation", "gpu_user_annotation")
GPU_ANNOTATION_CATS = ("gpu_user_annotation",)     # the device's mirror of a CPU annotation (on its stream)
MEMCPY_CATS, MEMSET_CATS, SYNC_CATS = ("gpu_memcpy", "Memcpy"), ("gpu_memset", "Memset"), ("cuda_sync",)


# --------------------------------------------------------------------------- what a name says
WAIT_NAMES = frozenset({"c10d::wait", "aten::wait", "_c10d_functional::wait_tensor", "c10d_functional::wait_tensor"})
N_COMM, N_MEMCPY, N_MEMSET, N_SYNC, N_GLOO, N_C10D, N_NCCL_OP = (1 << i for i in range(7))


def name_flags_of(x: str) -> int:
    """Bit set of what a name says: comm kernel, memcpy, memset, sync, gloo work, c10d call, nccl op."""
    low = x.lower()
    return ((N_COMM if model.is_comm_kernel(x) else 0) | (N_MEMCPY if low.startswith(("memcpy", "dma")) else 0)
            | (N_MEMSET if low.startswith("memset") else 0) | (N_SYNC if model.is_sync_kernel(x) else 0)
            | (N_GLOO if x.startswith(model.GLOO_PREFIX) else 0)
            | (N_C10D if x.startswith(model.C10D_PREFIX) or x == model.RECORD_PARAM_COMMS or x in WAIT_NAMES else 0)
            | (N_NCCL_OP if low.startswith(model.NCCL_OP_PREFIX) else 0))


# --------------------------------------------------------------------------- message sizes (bytes)
def numel(dims, depth: int = 0) -> float:
    """Elements of a shape ``[d0, d1, ...]`` or the sum over a list of shapes (TensorList); NaN otherwise."""
    if not isinstance(dims, list) or not dims or depth > 2:
        return float("nan")
    if all(type(d) is int for d in dims):
        if min(dims) < 0:
            return float("nan")
        n = float(math.prod(float(d) for d in dims))
        return n if n <= NUMEL_MAX else float("nan")
    vals = [numel(d, depth + 1) for d in dims if isinstance(d, list)]
    vals = [v for v in vals if v == v]
    return float(sum(vals)) if vals else float("nan")


def c10d_sizes(coll: str | None, dims_raw: bytes, types_raw: bytes) -> tuple[float, str | None, float]:
    """(bytes of the whole array, dtype, group size implied by the shapes or NaN) from a c10d op's Input Dims /
    Input type (all_gather: output/input numel; reduce_scatter: input/output numel)."""
    try:
        dims = msgspec.json.decode(dims_raw) if dims_raw else None
        types = msgspec.json.decode(types_raw) if types_raw else None
    except (msgspec.DecodeError, RecursionError):
        return float("nan"), None, float("nan")
    if not isinstance(dims, list) or not dims:
        return float("nan"), None, float("nan")
    dtype, size = (None, float("nan"))
    if isinstance(types, list):
        for t in types:
            dtype, size = dtype_of(t)
            if size == size:
                break
    n0 = numel(dims[0])
    n1 = numel(dims[1]) if len(dims) > 1 and isinstance(dims[1], list) and dims[1] else float("nan")
    group = float("nan")
    if coll in (model.ALL_GATHER, model.REDUCE_SCATTER):
        n = max(n0 if n0 == n0 else n1, n1 if n1 == n1 else n0)
        if n0 == n0 and n1 == n1 and min(n0, n1) > 0 and max(n0, n1) % min(n0, n1) == 0:
            group = max(n0, n1) / min(n0, n1)
    else:
        n = n0
    return n * size, dtype, group


def dtype_of(value) -> tuple[str | None, float]:
    """model.dtype_size of a trace's dtype text; an unknown one is kept, cut to a readable length."""
    name, size = model.dtype_size(value)
    return (cut_text(name) if isinstance(name, str) and size != size else name), size


def given(x, low: float = 0.0):
    """A number from the args, or None when absent or not a plausible count (a bool, NaN, below ``low``, ...)."""
    t = type(x)
    if (t is int or t is float) and low <= x <= NUMEL_MAX:
        return x
    return None


# comm ops whose sizes come from their own args (nelems) or their own rule (gloo), not from their Input Dims
_OWN_SIZE_PREFIXES = (model.GLOO_PREFIX, model.NCCL_OP_PREFIX, model.RECORD_PARAM_COMMS) + model.FUNCTIONAL_PREFIXES


def comm_row_info(name: str, cname, inn, outn, gs, dt, pg, seq, dims: bytes, types: bytes) -> tuple:
    """What one event's comm args say: (collective or None, bytes or NaN, dtype or None, group_size or NaN, pg or
    None, seq or NaN, shard).  ``name``: the event's name; the others its args (Collective name, In / Out msg
    nelems, Group size, dtype, Process Group Name, Seq, raw Input Dims / Input type).  shard: the bytes are one
    shard of the array (gloo all_gather work), to be multiplied by the group size."""
    coll = (per_name(model.collective_of, [cname])[0] if type(cname) is str else model.collective_of(cname)) \
        or per_name(model.collective_of, [name])[0]
    dtype, size = dtype_of(dt)
    shard = False
    nbytes = float("nan")
    inn, outn, gs, seq = given(inn), given(outn), given(gs, 1), given(seq)
    if gs is not None and gs > RANK_MAX:
        gs = None
    if inn is not None or outn is not None:
        first, second = (outn, inn) if coll == model.ALL_GATHER else (inn, outn)
        nbytes = float(first if first is not None else second) * size
    elif name.startswith(model.C10D_PREFIX):
        nbytes, dtype2, group = c10d_sizes(coll, dims, types)
        dtype = dtype or dtype2
        if gs is None and group == group:
            gs = group
    elif not name.startswith(_OWN_SIZE_PREFIXES) and coll not in (model.ALL_GATHER, model.REDUCE_SCATTER):
        # symmetric-memory and libraries' own collectives (vllm::all_reduce): the message is their input
        nbytes, dtype2, _ = c10d_sizes(coll, dims, types)
        dtype = dtype or dtype2
    elif name.startswith(model.NCCL_OP_PREFIX) and coll not in (model.ALL_GATHER, model.REDUCE_SCATTER):
        # an older trace's NCCL op without nelems: its Input Dims are its input (all_reduce: the whole array;
        # all_to_all: what this rank sends)
        nbytes, dtype2, _ = c10d_sizes(None, dims, types)
        dtype = dtype or dtype2
    elif name.startswith(model.GLOO_PREFIX):
        # the gloo work's own input: all_gather gets one shard, all_reduce (and reduce_scatter) the whole array
        nbytes, dtype2, _ = c10d_sizes(None, dims, types)
        dtype = dtype or dtype2
        shard = coll == model.ALL_GATHER
    pg = None if pg is None or (type(pg) is float and pg != pg) else as_text(pg)
    return (coll, nbytes, dtype, float("nan") if gs is None else float(gs), pg,
            float("nan") if seq is None else float(seq), shard)


def default_group_size(dist: dict) -> float:
    """Group size of a comm event that says none: the only process group's size, else the world size, else NaN."""
    if not isinstance(dist, dict):
        return float("nan")
    cfg = dist.get("pg_config")
    if isinstance(cfg, list) and len(cfg) == 1 and isinstance(cfg[0], dict) and plausible_count(cfg[0].get("pg_size")):
        return float(cfg[0]["pg_size"])
    ws = dist.get("world_size")
    return float(ws) if plausible_count(ws) else float("nan")


def _comm_info(rt, name_cats: list) -> dict:
    """Per raw row with comm args (numpy columns): idx, collective, bytes, dtype, group_size, pg, seq, shard."""
    name_codes = rt.cols["name"]
    rows = []
    memo: dict = {}     # rows that differ only in their sequence number say the same: judged once
    for idx, cname, inn, outn, gs, dt, pg, seq, dims, types in rt.comm_rows:
        name_code = int(name_codes[idx])
        try:
            args = (cname, inn, outn, gs, dt, pg)
            key = (name_code, dims, types, args, tuple(map(type, args)))    # (types too: 1, 1.0 and True are equal)
            said = memo.get(key)
        except TypeError:             # a list or an object among the args: judged on its own
            key = said = None
        if said is None:
            said = comm_row_info(name_cats[name_code], cname, inn, outn, gs, dt, pg, None, dims, types)
            if key is not None:
                memo[key] = said
        seq = given(seq)
        rows.append((idx, *said[:5], float("nan") if seq is None else float(seq), said[6]))
    cols = list(zip(*rows)) if rows else [()] * 8
    dtypes = (np.int64, object, np.float64, object, np.float64, object, np.float64, bool)
    return {k: np.asarray(v, dtype=t) for k, v, t in
            zip(("idx", "collective", "bytes", "dtype", "group_size", "pg", "seq", "shard"), cols, dtypes)}


def _isna(a: np.ndarray) -> np.ndarray:
    """Missing (None/NaN) per element."""
    return pd.isna(a) if len(a) else np.zeros(0, dtype=bool)


class SparseColumn:
    """A column of ``n`` rows that can hold a value only at ``rows`` (sorted, unique): the communication columns
    (collective, bytes, dtype, group size, group, sequence), which only collectives, device events and gloo work
    carry; reading any other row gives the missing value (None or NaN), writing one is an error.  ``vals``: the
    values at ``rows`` (object or float64).  48 bytes a row as six full columns; here 48 per row that can hold one."""

    __slots__ = ("n", "rows", "vals", "missing")

    def __init__(self, n: int, rows: np.ndarray, dtype) -> None:
        self.n, self.rows = n, rows
        self.missing = None if dtype is object else np.nan
        self.vals = np.full(len(rows), self.missing, dtype=dtype)

    def _at(self, idx) -> tuple[np.ndarray, np.ndarray]:
        """(positions in ``vals``, which of ``idx`` are rows that can hold a value)."""
        idx = np.asarray(idx)
        held, pos = _lookup(self.rows, np.flatnonzero(idx) if idx.dtype == bool else idx)
        return pos, held

    def __getitem__(self, idx) -> np.ndarray:
        pos, held = self._at(idx)
        out = np.full(len(pos), self.missing, dtype=self.vals.dtype)
        out[held] = self.vals[pos[held]]
        return out

    def __setitem__(self, idx, value) -> None:
        pos, held = self._at(idx)
        if not held.all():
            raise IndexError("a communication value written to a row that cannot hold one")
        self.vals[pos] = value

    def isna(self) -> np.ndarray:
        """Missing per row (bool, n)."""
        out = np.ones(self.n, dtype=bool)
        out[self.rows] = _isna(self.vals)
        return out

    def dense(self) -> np.ndarray:
        """The whole column (n values)."""
        out = np.full(self.n, self.missing, dtype=self.vals.dtype)
        out[self.rows] = self.vals
        return out


def _factorize_into(values: np.ndarray, where: np.ndarray, out: np.ndarray, offset: int) -> list:
    """pd.factorize(values) block by block (a few distinct values, e.g. streams: no table of every row): the
    distinct values in order of first appearance; ``out[where]`` gets ``offset`` + each row's code."""
    seen: dict = {}
    for lo in range(0, len(values), model.BLOCK_ROWS):
        block = values[lo:lo + model.BLOCK_ROWS]
        for v in pd.unique(block).tolist():
            seen.setdefault(v, len(seen))
        sel = np.flatnonzero(where[lo:lo + model.BLOCK_ROWS])
        if sel.size:
            keys = np.fromiter(seen, dtype=values.dtype, count=len(seen))
            order = np.argsort(keys)
            pos = order[np.searchsorted(keys, block[sel], sorter=order)]
            out[lo + sel] = offset + pos
    return list(seen)


def _first_launch(q: np.ndarray, lcorr: np.ndarray) -> np.ndarray:
    """Per device event's correlation id ``q``: the row of the first launch (in the file's order) with that id
    in ``lcorr``, -1 for none (or a negative id).  The device events' ids are sorted, the launches read a block
    at a time: no sort or table of every launch."""
    uq, inv = np.unique(q, return_inverse=True)
    first = np.full(len(uq), -1, dtype=np.int64)
    if len(uq):
        for lo in range(0, len(lcorr), model.BLOCK_ROWS):
            block = lcorr[lo:lo + model.BLOCK_ROWS]
            p = np.minimum(np.searchsorted(uq, block), len(uq) - 1)
            hit = np.flatnonzero((uq[p] == block) & (block >= 0))
            p, at = np.unique(p[hit], return_index=True)      # (each id's first launch in the block)
            new = first[p] < 0
            first[p[new]] = lo + hit[at[new]]
    return first[inv.reshape(-1)] if len(q) else np.empty(0, dtype=np.int64)


def _lookup(keys: np.ndarray, q: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """(found, position in keys) of each q in the sorted unique int array ``keys``."""
    pos = np.searchsorted(keys, q)
    pos_c = np.minimum(pos, max(len(keys) - 1, 0))
    found = (pos < len(keys)) & (keys[pos_c] == q) if len(keys) else np.zeros(len(q), dtype=bool)
    return found, pos_c


def _copy(o: dict, dst: np.ndarray, src: np.ndarray, cols, fill: bool = False) -> None:
    """Columns ``cols`` of rows ``src`` into rows ``dst`` where the source has a value (``fill``: only where
    the destination has none)."""
    for c in cols:
        a = o[c]
        new, old = a[src], a[dst]
        a[dst] = np.where(_isna(old), new, old) if fill else np.where(_isna(new), old, new)


# kind codes of classify_arrays: positions in model.KINDS
KIND_LABELS = np.array(model.KINDS, dtype=object)
K_COMPUTE, K_COMM, K_MEMCPY, K_MEMSET, K_SYNC, K_CPU_OP, K_ANNOTATION = (
    model.KINDS.index(k) for k in (model.KIND_COMPUTE, model.KIND_COMM, model.KIND_MEMCPY, model.KIND_MEMSET,
                                    model.KIND_SYNC, model.KIND_CPU_OP, model.KIND_ANNOTATION))


def classify_arrays(rt) -> dict:
    """Classified events as numpy columns: lane/name/cat int codes into lane_cats/name_cats/cat_cats, kind int8
    codes into KIND_LABELS, collective/dtype/pg object arrays, tid/launch_tid thread codes (-1: a kernel whose
    launch is not in the trace), times float64 µs; runtime calls dropped.  ``rt``'s raw columns are released
    once copied (``rt.cols`` and ``rt.comm_rows`` become None): a big trace's two copies never coexist."""
    rc = rt.cols
    n = len(rc["ts_us"])
    dist = rt.meta.get("distributedInfo") or {}
    cat_codes = rc["cat"]
    cat_names = list(rc["cat_cats"])

    def cat_is(wanted) -> np.ndarray:
        hit = np.array([c in wanted for c in cat_names], dtype=bool)
        return hit[cat_codes] if len(hit) else np.zeros(n, dtype=bool)

    stream = rc["stream"]
    on_gpu = (stream >= 0) & cat_is(model.DEVICE_EVENT_CATS)
    is_runtime, is_cpu_op, is_annot = cat_is(model.RUNTIME_CATS), cat_is(CPU_OP_CATS), cat_is(ANNOTATION_CATS)

    cats = list(rc["name_cats"])
    codes = rc["name"]
    tcodes, tuniq = rc["tid_code"], rc["tid_values"]
    rc.pop("pid", None)                 # (not read here: freed first)
    rc["launches"].pop("pid", None)

    # --- the rows that become events: every one but the runtime calls (those that block the host,
    # model.SYNC_CALLS, stay); what follows is computed for those rows only (kidx)
    sync_call = is_runtime & np.isin(codes, [i for i, x in enumerate(cats) if x in model.SYNC_CALLS])
    stays = ~is_runtime | sync_call
    every = bool(stays.all())   # (the decoder's rows hold no launching call: then every row stays, nothing copied)
    kidx = None if every else np.flatnonzero(stays)
    del stays

    def kept(a: np.ndarray) -> np.ndarray:
        return a if every else a[kidx]

    def raw_rows(i: np.ndarray) -> np.ndarray:
        """The raw rows of kept rows ``i``."""
        return i if every else kidx[i]

    # --- launch point of every event: a kernel's runtime call (the first with its correlation id)
    ts = rc["ts_us"]
    corr = rc["correlation"]
    # (first: the launch table is freed before this function's other columns are made)
    launch_tid = tcodes.copy() if every else tcodes[kidx]      # (changed in place below)
    launch_ts = ts.copy() if every else ts[kidx]
    k_gpu = kept(on_gpu)
    launches = rc.pop("launches")
    if k_gpu.any():
        launch_tid[k_gpu] = -1
        gidx = np.flatnonzero(k_gpu)
        src = _first_launch(corr[raw_rows(gidx)], launches.pop("correlation"))
        found = src >= 0
        src = src[found]
        launch_tid[gidx[found]] = launches["tid_code"][src]
        launch_ts[gidx[found]] = launches["ts_us"][src]
        del gidx, found, src
    del k_gpu, launches

    # --- kind: name-level tests once per distinct name, broadcast to rows through the codes
    flags = np.array(per_name(name_flags_of, cats), dtype=np.uint8)[codes] if n else np.zeros(0, dtype=np.uint8)
    r_comm, r_memcpy, r_memset, r_sync, r_gloo, r_c10d, r_ncclop = (
        (flags & f) != 0 for f in (N_COMM, N_MEMCPY, N_MEMSET, N_SYNC, N_GLOO, N_C10D, N_NCCL_OP))
    kind = np.full(n, K_CPU_OP, dtype=np.int8)
    kind[is_annot] = K_ANNOTATION
    g = np.flatnonzero(on_gpu)          # (the device rows only: no temporary of every row)
    kind[g] = np.select([r_comm[g], (r_memcpy | cat_is(MEMCPY_CATS))[g], (r_memset | cat_is(MEMSET_CATS))[g],
                         (r_sync | cat_is(SYNC_CATS))[g]], [K_COMM, K_MEMCPY, K_MEMSET, K_SYNC], K_COMPUTE)
    del g, r_comm, r_memcpy, r_memset, r_sync, flags
    gloo_comm = is_annot & r_gloo
    kind[gloo_comm] = K_COMM

    # lanes: threads (the decoder's tid codes) and streams, labels built once per distinct thread / stream. A GPU
    # annotation (the device's span of a CPU region) lies on its stream, its tid (kineto writes no args.stream)
    gpu_annot = cat_is(GPU_ANNOTATION_CATS)
    if gpu_annot.any():
        tid_num = pd.to_numeric(pd.Series(list(tuniq), dtype=object), errors="coerce").to_numpy()
        as_stream = np.nan_to_num(tid_num[tcodes], nan=-1.0).astype(np.int64) if n else np.empty(0, np.int64)
        gpu_annot &= (stream >= 0) | (as_stream >= 0)
        stream = np.where(gpu_annot & (stream < 0), as_stream, stream)
        del as_stream
    on_lane = on_gpu | gpu_annot
    lane_codes = tcodes.astype(np.int32)        # (a copy: the threads' codes, then the streams' on their lanes)
    suniq = _factorize_into(stream, on_lane, lane_codes, len(tuniq))
    lane_labels = [f"thread:{t}" for t in tuniq] + [f"stream:{x}" for x in suniq]
    del on_lane, gpu_annot
    if len(set(lane_labels)) == len(lane_labels):
        lane_cats = pd.Index(lane_labels, dtype=object)
    else:
        lane_c = pd.Categorical(np.array(lane_labels, dtype=object)[lane_codes])
        lane_cats, lane_codes = lane_c.categories, np.asarray(lane_c.codes)

    if rt.meta.get("device_type", "cpu") == "cpu":
        # CPU compute: leaf cpu_ops on threads that run no gloo work, not comm calls themselves
        cand = is_cpu_op & ~r_c10d & ~np.isin(tcodes, np.unique(tcodes[gloo_comm]))
        end0 = rc["ts_us"] + np.nan_to_num(rc["dur_us"], nan=0.0)
        kind[cand & _leaf_mask(tcodes, rc["ts_us"], end0, is_cpu_op)] = K_COMPUTE

    lane_codes = kept(lane_codes)

    # --- collective type, parsed once per distinct name of the rows that carry one
    relevant = kept((kind == K_COMM) | r_c10d | (is_annot & r_ncclop))
    rel_rows = np.flatnonzero(relevant)
    rel_coll = np.full(len(rel_rows), None, dtype=object)
    if rel_rows.size:
        k_codes = codes[raw_rows(rel_rows)]
        used = np.unique(k_codes)
        coll_by_cat = np.full(len(cats), None, dtype=object)
        coll_by_cat[used] = per_name(model.collective_of, [cats[i] for i in used.tolist()])
        rel_coll = coll_by_cat[k_codes]
        del k_codes

    k = n if every else len(kidx)
    k_on_gpu, k_gloo, k_c10d, k_cpu_op = kept(on_gpu), kept(gloo_comm), kept(r_c10d), kept(is_cpu_op)
    del on_gpu, gloo_comm, r_c10d, is_cpu_op, is_runtime, is_annot, r_gloo, r_ncclop, sync_call
    info = _comm_info(rt, cats) if rt.comm_rows else None
    # the rows that can carry a collective, its size, group and sequence: collectives and comm ops, device
    # events, gloo work, and the rows the trace gave such args
    holds = relevant | k_on_gpu | k_gloo | k_c10d | (kept(kind) == K_COMM)
    del relevant
    if info is not None:        # (each comm row's position among the kept rows, -1: not kept)
        if every:
            found, pos = (info["idx"] >= 0) & (info["idx"] < n), info["idx"]
        else:
            found, pos = _lookup(kidx, info["idx"])
        ipos = np.where(found, pos, -1)
        holds[ipos[ipos >= 0]] = True
        del found, pos
    comm_rows = np.flatnonzero(holds)
    del holds
    # the kept rows' columns, each raw column released as soon as it is copied (the peak of a big trace's
    # load); rt.cols / rt.comm_rows become None
    k_stream = kept(stream)           # (a GPU annotation's stream is its tid: not the raw column)
    del codes, ts, corr, stream, cat_codes, tcodes
    o = {"lane": lane_codes, "lane_cats": lane_cats, "kind": kept(kind)}
    del lane_codes, kind
    o["name"] = kept(rc.pop("name"))
    o["name_cats"] = cats
    o["ts_us"] = kept(rc.pop("ts_us"))
    o["dur_us"] = np.nan_to_num(kept(rc.pop("dur_us")), nan=0.0, copy=False)
    o.update({c: SparseColumn(k, comm_rows, object if c in ("collective", "dtype", "pg") else np.float64)
              for c in ("collective", "bytes", "dtype", "group_size", "pg", "seq")})
    o["collective"][rel_rows] = rel_coll
    del rel_rows, rel_coll, comm_rows
    o["tid"] = kept(rc.pop("tid_code"))
    o["stream"] = k_stream
    del k_stream, rc["stream"]
    for c in ("correlation", "ext_id", "cat"):
        o[c] = kept(rc.pop(c))
    o["cat_cats"] = rc["cat_cats"]
    o["launch_tid"] = launch_tid
    o["launch_ts_us"] = launch_ts
    del launch_tid, launch_ts, kidx, rc, kept, raw_rows
    rt.cols = rt.comm_rows = None
    shard = np.zeros(k, dtype=bool)
    if info is not None:
        ok = ipos >= 0
        idx = ipos[ok]
        shard[idx] = info["shard"][ok]
        coll_info = info["collective"][ok]
        o["collective"][idx] = np.where(_isna(coll_info), o["collective"][idx], coll_info)
        for c in ("bytes", "group_size", "seq", "dtype", "pg"):
            o[c][idx] = info[c][ok]
    if k_on_gpu.any():
        # a kernel whose name does not tell its collective (SendRecv) takes it from its launch or from nothing
        ck = np.flatnonzero(k_on_gpu & (o["kind"] == K_COMM))
        told = np.array(per_name(model.kernel_name_tells_collective, [cats[c] for c in o["name"][ck].tolist()]),
                        dtype=bool)
        o["collective"][ck[~told]] = None
        _from_launching_op(o, k_on_gpu, K_COMM)
        _from_launching_op(o, k_on_gpu, K_COMPUTE)
        _fill_from_cpu_side(o, k_on_gpu)
        # sizes still unknown (older traces: no External id tying the kernel to a sized op): the launching op's
        _from_launching_op(o, k_on_gpu, K_COMM, ("bytes", "dtype"), fill=True)
        # a comm kernel whose type neither its launching op nor its name tells
        o["collective"][k_on_gpu & (o["kind"] == K_COMM) & o["collective"].isna()] = model.UNKNOWN_COLLECTIVE
    if k_gloo.any():
        _pair_gloo(o, k_gloo, k_c10d & k_cpu_op, shard)
        _gloo_group_sizes(o, k_gloo, rt.meta)
    gs = o["group_size"]
    miss = ((o["kind"] == K_COMM) | k_c10d) & gs.isna()
    if miss.any():
        gs[miss] = default_group_size(dist)
    # gloo all_gather work that kept its own (shard) size: the whole array is shard * group size
    if shard.any():
        o["bytes"][shard] = o["bytes"][shard] * gs[shard]
    return o


def _from_launching_op(o: dict, on_gpu: np.ndarray, kernel_kind: int,
                       cols=("collective", "pg", "seq", "group_size"), fill: bool = False) -> None:
    """Kernels of ``kernel_kind`` take the collective type, group and sequence number of the innermost CPU op
    around their launch on the launching thread.  K_COMM: that op is the innermost op with a known collective (a
    ``SendRecv`` kernel inside ``nccl:all_to_all`` is an all_to_all; the kernel's name is the fallback).
    K_COMPUTE: a kernel launched inside a collective op (``vllm::all_reduce``, symmetric memory) is that
    collective's communication when the op is the innermost CPU op around the launch (not a tensor op nested in
    it, e.g. the copy-out ``aten::copy_``); copies, sets and waits keep their kind.  ``cols``: the columns taken
    (``fill``: only where the kernel has none)."""
    kind = o["kind"]
    ck = np.flatnonzero(on_gpu & (kind == kernel_kind) & (o["launch_tid"] >= 0))
    coll_op = ~on_gpu & (kind != K_COMM) & ~o["collective"].isna()
    ops = np.flatnonzero(coll_op)
    if not ck.size or not ops.size:
        return
    ts, dur, launch, tid = o["ts_us"], o["dur_us"], o["launch_ts_us"], o["tid"]
    op_tid, k_tid = tid[ops], o["launch_tid"][ck]
    for t in np.unique(k_tid).tolist():
        sel = ops[op_tid == t]
        if not sel.size:
            continue
        q = ck[k_tid == t]
        k = intervals.innermost(ts[sel], ts[sel] + dur[sel], launch[q])
        q, src = q[k >= 0], sel[k[k >= 0]]
        if kernel_kind == K_COMPUTE and q.size:
            # the innermost CPU op (or collective) around those launches must be the collective op itself
            lo, hi = float(launch[q].min()), float(launch[q].max())
            cpu_op = np.flatnonzero((tid == t) & (kind == K_CPU_OP) & ~on_gpu)     # (this thread's only)
            cpu_op = cpu_op[(ts[cpu_op] <= hi) & (ts[cpu_op] + dur[cpu_op] >= lo)]
            cand = np.union1d(cpu_op, sel)
            del cpu_op
            inner = cand[np.maximum(intervals.innermost(ts[cand], ts[cand] + dur[cand], launch[q]), 0)]
            own = coll_op[inner]
            q, src = q[own], inner[own]
            kind[q] = K_COMM
        _copy(o, q, src, cols, fill=fill)


def _fill_from_cpu_side(o: dict, on_gpu: np.ndarray) -> None:
    """Comm kernels without size info take it from the (last) CPU op with the same External id."""
    ext = o["ext_id"]
    ck = np.flatnonzero(on_gpu & (o["kind"] == K_COMM) & (ext >= 0))
    cpu = np.flatnonzero(~on_gpu & (ext >= 0))
    cpu = cpu[~_isna(o["collective"][cpu])]
    if not ck.size or not cpu.size:
        return
    keys, first_rev = np.unique(ext[cpu][::-1], return_index=True)     # (reversed: each id's last row)
    found, pos = _lookup(keys, ext[ck])
    _copy(o, ck[found], cpu[::-1][first_rev][pos[found]], ("bytes", "group_size", "seq", "dtype", "pg", "collective"),
          fill=True)


def _leaf_mask(tcodes: np.ndarray, ts: np.ndarray, end: np.ndarray, is_cpu_op: np.ndarray) -> np.ndarray:
    """True for cpu_op rows that contain no other cpu_op of the same thread (tcodes: thread codes)."""
    leaf = np.zeros(len(ts), dtype=bool)
    i = np.flatnonzero(is_cpu_op)
    if not i.size:
        return leaf
    # a thread at a time, its ops sorted by (ts, -end): an op is a leaf when the next op on its thread starts at or
    # after its end.  A profiler writes a thread's ops in that order already: then they are not sorted again
    t = tcodes[i]
    order = np.argsort(t, kind="stable")
    i, cuts = i[order], np.flatnonzero(np.diff(t[order])) + 1
    del t, order
    for rows in np.split(i, cuts):
        s, e = ts[rows], end[rows]
        if not ((s[1:] > s[:-1]) | ((s[1:] == s[:-1]) & (e[1:] <= e[:-1]))).all():      # (NaN: not in order)
            order = np.lexsort((-e, s))
            rows, s, e = rows[order], s[order], e[order]
        is_leaf = np.ones(rows.size, dtype=bool)
        is_leaf[:-1] = (s[1:] >= e[:-1]) | np.isnan(s[1:])
        leaf[rows[is_leaf]] = True
    return leaf


def _in_time_order(keys: np.ndarray, rows: np.ndarray, ts: np.ndarray) -> tuple:
    """(rows, keys) sorted by time (stable), and each row's rank in time within its key (0, 1, ...)."""
    order = np.argsort(ts[rows], kind="mergesort")
    rows, keys = rows[order], keys[order]
    ordinal = np.zeros(rows.size, dtype=np.int64)
    for key in dict.fromkeys(keys.tolist()):
        sel = np.flatnonzero(keys == key)
        ordinal[sel] = np.arange(sel.size)
    return rows, keys, ordinal


def _pair_gloo(o: dict, gloo_comm: np.ndarray, c10d_call: np.ndarray, shard: np.ndarray) -> None:
    """Copy collective/bytes/dtype/pg/seq/group_size and the launch point from each c10d call to its gloo work:
    the k-th gloo work of an op type (in time) is the k-th call that runs as that op, shifted by 0-2 (work
    already running when the window opened has no call) to pair the most work with a call starting no later."""
    ts, coll, names = o["ts_us"], o["collective"], o["name_cats"]
    calls = np.flatnonzero(c10d_call & ~coll.isna())
    calls, call_as, _ = _in_time_order(np.array([model.GLOO_RUNS_AS.get(x, x) for x in coll[calls]], dtype=object),
                                       calls, ts)
    as_by_name: dict = {}
    work = np.flatnonzero(gloo_comm)
    work_as = np.array([as_by_name.setdefault(c, model.collective_of(str(names[c]))) for c in o["name"][work].tolist()],
                       dtype=object)
    known = ~_isna(work_as)
    work, work_as, work_ord = _in_time_order(work_as[known], work[known], ts)
    dst_all, src_all = [], []
    for g in dict.fromkeys(work_as.tolist()):
        w = np.flatnonzero(work_as == g)
        cg = calls[call_as == g]                 # this op's calls, in time order (ordinal = position)
        best = (np.empty(0, dtype=np.int64), np.empty(0, dtype=np.int64))
        for shift in (0, 1, 2):
            k = work_ord[w] - shift
            ok = (k >= 0) & (k < cg.size)
            dst, src = work[w[ok]], cg[k[ok]]
            hit = ts[src] <= ts[dst] + 1.0
            if hit.sum() > best[0].size:
                best = (dst[hit], src[hit])
        dst_all.append(best[0])
        src_all.append(best[1])
    if not dst_all:
        return
    rows, src = np.concatenate(dst_all), np.concatenate(src_all)
    # the call gave the whole array: the work's shard size is no longer used
    shard[rows] = shard[rows] & np.isnan(o["bytes"][src])
    _copy(o, rows, src, ("collective", "dtype", "pg", "bytes", "group_size", "seq"))
    o["launch_tid"][rows] = o["tid"][src]
    o["launch_ts_us"][rows] = ts[src]


def _gloo_group_sizes(o: dict, gloo_comm: np.ndarray, meta: dict) -> None:
    """Group size of gloo work whose call did not tell it, per gloo thread (gloo runs each process group on its
    own threads): the size known on the thread, else the one size of this rank's non-default process groups
    that no other thread claimed, else the only non-default size.  With one process group, that is every pg."""
    gs, lanes = o["group_size"], o["lane"]
    known = {}                                     # lane code -> most frequent known size (smallest on ties)
    sel = gloo_comm & ~gs.isna()
    for lane in np.unique(lanes[sel]).tolist():
        vals, counts = np.unique(gs[sel & (lanes == lane)], return_counts=True)
        known[lane] = float(vals[np.argmax(counts)])
    dist = meta.get("distributedInfo") if isinstance(meta.get("distributedInfo"), dict) else {}
    rank, cfg = dist.get("rank"), dist.get("pg_config")
    other_sizes = [float(g["pg_size"]) for g in (cfg if isinstance(cfg, list) and len(cfg) > 1 else [])
                   if isinstance(g, dict) and g.get("pg_desc") != "default_pg" and plausible_count(g.get("pg_size"))
                   and not (isinstance(g.get("ranks"), list) and rank is not None and rank not in g["ranks"])]
    left = set(other_sizes) - set(known.values())
    fallback = (left.pop() if len(left) == 1 else
                (other_sizes[0] if other_sizes and len(set(other_sizes)) == 1 else float("nan")))
    fill = np.flatnonzero(gloo_comm & gs.isna())
    gs[fill] = [known.get(lane, fallback) for lane in lanes[fill].tolist()]
    if isinstance(cfg, list) and len(cfg) == 1 and isinstance(cfg[0], dict) and cfg[0].get("pg_name") is not None:
        pg = o["pg"]
        pg[gloo_comm & pg.isna()] = as_text(cfg[0]["pg_name"])
