"""CPU runs: the trace's ``[memory]`` events (+ inventory.json) -> allocations frame.  Memory alive before the
window comes from frees without an alloc and from inventory tensors no window allocation accounts for.  Bytes are
allocator request sizes; times in µs.
"""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import pandas as pd

from fsdpprof import runfmt
from fsdpprof.analyze import model
from fsdpprof.analyze.load.frames import labels_array, startswith
from fsdpprof.analyze.memory import categorize as cz
from fsdpprof.analyze.memory import fsdp_units as fu
from fsdpprof.analyze.model import MemoryCategory as MC
from fsdpprof.analyze.trace import labels
from fsdpprof.analyze.memory.snapshot import NEVER, NO_ADDRESS, pair_alloc_free
from fsdpprof.errors import UserError
from fsdpprof.runfmt import INVENTORY_SCHEMA

DEVICE_TYPE_CUDA = 1


def check_inventory(inventory: dict | None, rank: int, world_size: int | None, label: str) -> None:
    """Refuse an inventory.json that belongs to another run (schema, rank or world size mismatch)."""
    if inventory is None:
        return
    if not isinstance(inventory, dict) or inventory.get("schema") != INVENTORY_SCHEMA:
        raise UserError(f"{label}: inventory.json is not schema {INVENTORY_SCHEMA}; record the run again with "
                        f"this fsdpprof version")
    inv_rank, inv_ws = inventory.get("rank"), inventory.get("world_size")
    if inv_rank is not None and int(inv_rank) != int(rank):
        raise UserError(f"{label}: inventory.json is for rank {inv_rank} but the trace is rank {rank}; the rank "
                        f"folder mixes files from different runs, copy the folder from one run")
    if inv_ws is not None and world_size is not None and int(inv_ws) != int(world_size):
        raise UserError(f"{label}: inventory.json has world size {inv_ws} but the trace has {world_size}; it "
                        f"comes from another run, copy the rank folder from one run")


def inventory_tensors(inventory: dict | None, opt_starts: np.ndarray, opt_ends: np.ndarray,
                      t_end: float) -> pd.DataFrame:
    """Inventory tensors with the time (µs) each was captured (``ref_us``): params before the last optimizer step,
    optimizer state after it, grads before their own step (aligned from the last); one row per storage."""
    cols = ["addr", "bytes", "tensor_bytes", "category", "ref_us", "unit", "name", "role", "step"]
    tens = (inventory or {}).get("tensors") or []
    if not tens:
        return pd.DataFrame(columns=cols)
    t = pd.DataFrame(tens)
    for c in ("storage_ptr", "storage_nbytes", "bytes", "step", "unit", "name", "role", "device"):
        if c not in t:
            t[c] = None
    t = t[t["role"].isin(list(cz.ROLE_TO_CATEGORY))]
    last_opt = float(opt_starts[-1]) if len(opt_starts) else t_end
    last_opt_end = float(opt_ends[-1]) if len(opt_ends) else t_end
    ref = np.where(t["role"] == runfmt.ROLE_OPTIMIZER_STATE, last_opt_end, last_opt).astype(float)
    g = (t["role"] == runfmt.ROLE_GRAD).to_numpy()
    if g.any() and len(opt_starts):
        steps = pd.to_numeric(t.loc[g, "step"], errors="coerce")
        uniq = np.sort(steps.dropna().unique())
        # the k-th from last inventory step <-> the k-th from last optimizer step in the trace
        k_from_end = len(uniq) - 1 - np.searchsorted(uniq, steps.fillna(uniq[-1] if len(uniq) else 0).to_numpy())
        pos = len(opt_starts) - 1 - k_from_end
        ref_g = np.where(pos >= 0, opt_starts[np.clip(pos, 0, None)], np.nan)
        ref[g] = ref_g
    out = pd.DataFrame({
        "addr": pd.to_numeric(t["storage_ptr"], errors="coerce").fillna(-1).astype(np.int64).to_numpy(),
        "bytes": pd.to_numeric(t["storage_nbytes"], errors="coerce").fillna(t["bytes"]).astype(np.int64).to_numpy(),
        "tensor_bytes": pd.to_numeric(t["bytes"], errors="coerce").fillna(0).astype(np.int64).to_numpy(),
        "category": t["role"].map(cz.ROLE_TO_CATEGORY).to_numpy(object),
        "ref_us": ref, "unit": t["unit"].to_numpy(object), "name": t["name"].to_numpy(object),
        "role": t["role"].to_numpy(object), "step": pd.to_numeric(t["step"], errors="coerce").to_numpy()})
    out = out[(out["addr"] > 0) & np.isfinite(out["ref_us"])]
    # one storage, one label: FSDP1 views and tensors sharing a storage collapse to their storage
    return out.drop_duplicates(["addr", "ref_us", "category"]).reset_index(drop=True)


def cpu_allocations(memory_events: pd.DataFrame, events: pd.DataFrame | None, inventory: dict | None,
                    label: str) -> tuple[pd.DataFrame, pd.DataFrame, list[str]]:
    """(labelled allocations, inventory tensors with ref times, warnings) of a trace's memory events."""
    warnings: list[str] = []
    me = memory_events
    if (me["device_type"] == DEVICE_TYPE_CUDA).any():
        me = me[me["device_type"] == DEVICE_TYPE_CUDA]
        warnings.append(f"{label}: GPU trace without a CUDA snapshot: memory taken from the trace's CUDA "
                        f"[memory] events (no frames, no segments)")
    me = me.sort_values("ts_us", kind="stable")
    ts = me["ts_us"].to_numpy(float)
    addr = me["addr"].to_numpy(np.int64)
    b = me["bytes"].to_numpy(np.int64)
    seq = np.arange(len(me), dtype=np.int64)
    pr = pair_alloc_free(seq, addr, b > 0, ts)
    ar, of = pr["alloc_rows"], pr["orphan_free_rows"]
    if pr["n_realloc"]:
        warnings.append(f"{label}: {pr['n_realloc']} address(es) allocated again without a free event between; "
                        f"the earlier allocation is taken as freed at the second")
    t0 = float(ts[0]) if len(ts) else 0.0
    dev = me["device_id"].to_numpy(np.int16)
    allocs = pd.DataFrame({
        "addr": np.concatenate([addr[ar], addr[of]]),
        "bytes": np.concatenate([b[ar], -b[of]]),
        "alloc_us": np.concatenate([ts[ar], np.full(len(of), t0)]),
        "free_us": np.concatenate([pr["free_us"], ts[of]]),
        "alloc_seq": np.concatenate([seq[ar], np.full(len(of), -1, np.int64)]),
        "free_seq": np.concatenate([pr["free_seq"], seq[of]]),
        "device": np.concatenate([dev[ar], dev[of]]).astype(np.int16),
        "stream": np.int64(0),
        "before_trace": np.concatenate([np.zeros(len(ar), bool), np.ones(len(of), bool)]),
        "free_inferred": np.concatenate([pr["free_inferred"], np.zeros(len(of), bool)]),
    })
    # reference times for the inventory: the optimizer steps in the window
    marks = labels.step_marks(events)
    opt = events[startswith(events["name"], (model.OPTIMIZER_PREFIX,))] if events is not None and len(events) else None
    opt_starts = np.sort(opt["ts_us"].to_numpy(float)) if opt is not None and len(opt) else np.array([])
    opt_ends = np.sort((opt["ts_us"] + opt["dur_us"]).to_numpy(float)) if opt is not None and len(opt) else np.array([])
    t_end = float(ts[-1]) if len(ts) else 0.0
    inv_t = inventory_tensors(inventory, opt_starts, opt_ends, t_end)
    if inventory is not None and not len(opt_starts):
        warnings.append(f"{label}: no Optimizer.step in the trace: inventory tensors matched at the end of the window")

    every = me["total_allocated_bytes"].to_numpy(float)
    counted = _counts_every_thread(inventory) and len(b) and np.isfinite(every).all()
    allocs = _with_before_window(allocs, inventory, addr, b > 0, seq, t0, label, warnings,
                                 int(every[0]) - int(b[0]) if counted else None)
    # inventory tensors that no allocation accounts for were alive since before the window
    if len(inv_t):
        matched = _matched_inventory(allocs, inv_t)
        extra = inv_t[~matched].drop_duplicates("addr")
        # an address may already be a pre-window allocation at another reference time: keep one
        extra = extra[~extra["addr"].isin(allocs.loc[allocs["before_trace"], "addr"])]
        if len(extra):
            allocs = pd.concat([allocs, pd.DataFrame({
                "addr": extra["addr"].to_numpy(np.int64), "bytes": extra["bytes"].to_numpy(np.int64),
                "alloc_us": t0, "free_us": np.nan, "alloc_seq": np.int64(-1), "free_seq": NEVER,
                "device": np.int16(0), "stream": np.int64(0), "before_trace": True, "free_inferred": False})],
                ignore_index=True)
    inv_t = _with_ddp_buckets(allocs, inv_t, inventory, t0)
    allocs["user_metadata"] = labels_array("", len(allocs))
    allocs["frames"] = pd.Series([None] * len(allocs), dtype=object)
    ws = (inventory or {}).get("shard_group_size") or (inventory or {}).get("world_size")
    annotate_from_events(allocs, events, marks, inventory, ws)
    n_lost, lost_bytes = infer_lost_frees(allocs, ts, labels.fsdp_intervals(events), marks)
    unseen = other_threads(allocs, every, b, ts, _counted_from(inventory) == runfmt.COUNT_FROM_IMPORT) \
        if counted else None
    if unseen is not None and len(unseen):
        unseen["user_metadata"] = labels_array("", len(unseen))
        unseen["frames"] = pd.Series([None] * len(unseen), dtype=object)
        annotate_from_events(unseen, events, marks, inventory, ws)
        for c in ("unit", "fsdp_role", "free_unit"):      # (no one allocation: when, not whose)
            if c in unseen:
                unseen[c] = None
        allocs = pd.concat([allocs, unseen], ignore_index=True)
    if cz.OTHER_THREADS_COLUMN in allocs:
        allocs[cz.OTHER_THREADS_COLUMN] = allocs[cz.OTHER_THREADS_COLUMN].fillna(False).astype(bool)
    if n_lost:
        warnings.append(f"{label}: {n_lost} FSDP all-gather / reduce-scatter buffer(s) ({model.fmt_bytes(lost_bytes)}) "
                        f"have no free event in the window (or only one inferred from a later reuse of the address), "
                        f"a free probably on a communication thread the profiler did not record; taken as freed by "
                        f"FSDP's own rule (at the latest where FSDP frees it: the unit's next all-gather, and a flat "
                        f"all-gather output after its copy-out), else after the same unit's usual lifetime")
    return allocs, inv_t, warnings


def _counts_every_thread(inventory: dict | None) -> bool:
    """c10's count of every thread's CPU bytes was on through the window (inventory.json's
    ``before_window.window_counts_every_thread``): each [memory] event's "Total Allocated" is that count."""
    bw = (inventory or {}).get(runfmt.INVENTORY_BEFORE_WINDOW)
    return isinstance(bw, dict) and bw.get(runfmt.WINDOW_COUNTS_EVERY_THREAD) is True and not bw.get("error")


def _counted_from(inventory: dict | None):
    """When c10's count of every thread's bytes began (runfmt.COUNT_FROM_IMPORT, "record start" or None)."""
    return ((inventory or {}).get(runfmt.INVENTORY_BEFORE_WINDOW) or {}).get("every_thread_counted_from")


def other_threads(allocs: pd.DataFrame, total_allocated: np.ndarray, nbytes: np.ndarray, ts: np.ndarray,
                  from_import: bool) -> pd.DataFrame:
    """Rows that make the allocations' total equal c10's count of every thread's bytes at each memory event (when
    that count was on through the window: :func:`_counts_every_thread`).  ``total_allocated``, ``nbytes``, ``ts``:
    the events' "Total Allocated", signed bytes and times, in order.  ``from_import``: the count began as torch
    was imported, so it is every CPU byte alive; else it began with the record, and the bytes alive are the
    allocations' own before the window plus the count's change since.  What the rows of ``allocs`` (inferred
    frees included) do not hold of that is the net of what threads the profiler does not record allocated and
    freed (gloo's buffers; negative while a buffer freed there is still alive in ``allocs``): one row per change,
    at the event it shows at (alloc_seq), never freed; with ``from_import`` a first row, before the window, for
    what was alive as it began that no record names (allocated before the record began: ``before_recording``;
    negative: freed unseen, other threads'); what the other threads then free beyond what they allocated in the
    window comes out of that first row (freed there), not as a negative other-threads row."""
    n = len(nbytes)
    a_seq, f_seq = allocs["alloc_seq"].to_numpy(np.int64), allocs["free_seq"].to_numpy(np.int64)
    b = allocs["bytes"].to_numpy(np.int64)
    level = np.zeros(n + 1, dtype=np.int64)        # [0]: before the first event; [k + 1]: after event k
    np.add.at(level, np.clip(a_seq + 1, 0, n), b)
    freed = f_seq < n
    np.add.at(level, f_seq[freed] + 1, -b[freed])
    level = np.cumsum(level)
    every = total_allocated.astype(np.int64)
    before = int(every[0]) - int(nbytes[0])         # the count just before the first event
    total = every if from_import else level[0] + every - before
    start = before - int(level[0]) if from_import else 0
    net = total - level[1:] - start                 # the other threads' net since the window began, after each event
    # what they free beyond what they allocated in the window was alive as it began, unnamed: the start's
    # row gives it up there (a piece of it freed at each new low), rather than a negative other-threads row
    low = np.maximum(np.minimum.accumulate(np.minimum(net, 0)), -start) if start > 0 else np.zeros(n, np.int64)
    step = np.diff(net - low, prepend=0)
    k = np.flatnonzero(step)
    rows = pd.DataFrame({
        "addr": NO_ADDRESS, "bytes": step[k], "alloc_us": ts[k], "free_us": np.nan, "alloc_seq": k.astype(np.int64),
        "free_seq": NEVER, "device": np.int16(0), "stream": np.int64(0), "before_trace": False,
        "free_inferred": False, cz.OTHER_THREADS_COLUMN: True}, index=pd.RangeIndex(len(k)))
    if start:
        given = -np.diff(low, prepend=0)            # >= 0: the start's bytes freed at each event
        f = np.flatnonzero(given)
        pieces = np.concatenate([given[f], [start - int(given.sum())]]).astype(np.int64)
        f_seq = np.concatenate([f, [NEVER]]).astype(np.int64)
        keep = pieces != 0
        rows = pd.concat([pd.DataFrame({
            "addr": NO_ADDRESS, "bytes": pieces[keep], "alloc_us": ts[0],
            "free_us": np.where(f_seq < NEVER, ts[np.minimum(f_seq, n - 1)], np.nan)[keep],
            "alloc_seq": np.int64(-1), "free_seq": f_seq[keep], "device": np.int16(0), "stream": np.int64(0),
            "before_trace": True, "free_inferred": False, cz.OTHER_THREADS_COLUMN: start < 0}), rows],
            ignore_index=True)
    return rows


def _with_before_window(allocs: pd.DataFrame, inventory: dict | None, addr: np.ndarray, is_alloc: np.ndarray,
                        seq: np.ndarray, t0: float, label: str, warnings: list[str],
                        count_at_window: int | None = None) -> pd.DataFrame:
    """``allocs`` plus the allocations inventory.json's ``before_window`` saw alive at the window's start that the
    window never touches (alive all through it, e.g. DDP's buckets); one the window frees first is its orphan free
    already; one the window allocates again first was freed unseen (a thread the profiler does not record)."""
    bw = (inventory or {}).get(runfmt.INVENTORY_BEFORE_WINDOW)
    if not isinstance(bw, dict):
        return allocs
    if bw.get("error"):
        warnings.append(f"{label}: the memory record before the window stopped early ({bw['error']}): memory "
                        f"allocated before the window is seen only where the window frees it or the inventory names it")
        return allocs
    rows = [r for r in bw.get("allocations") or [] if isinstance(r, list) and len(r) >= 2]
    if not rows:
        return allocs
    pre = pd.DataFrame({"addr": np.array([r[0] for r in rows], np.int64), "bytes": np.array([r[1] for r in rows],
                                                                                              np.int64)})
    order = np.lexsort((seq, addr))
    first = pd.Series(is_alloc[order]).groupby(addr[order]).first()     # address -> its first event is an alloc
    seen = first.reindex(pre["addr"].to_numpy())
    untouched = seen.isna().to_numpy().copy()
    stale = int((seen == True).sum())   # noqa: E712  (NaN: untouched)
    if stale:
        warnings.append(f"{label}: {stale} allocation(s) alive when the window began by the record before it are "
                        f"allocated again in the window with no free between (freed on a thread the profiler does "
                        f"not record): taken as freed before the window")
    realloc = (seen == True).to_numpy()   # noqa: E712
    every = bw.get("alive_bytes_every_thread")
    at_start = bw.get("every_thread_bytes_at_start")
    if count_at_window is not None and isinstance(at_start, int):
        # c10's change from the record's start to just before the window's first event, plus the frees the record
        # saw of what was made before it: the bytes of the record's own allocations still alive, every thread
        every = count_at_window - at_start + int(bw.get("frees_unseen_bytes") or 0)
    net_other = 0
    if isinstance(every, int):
        # the record's allocations hold more than the allocator counts: some were freed on a thread no profiler
        # records (an address the window frees first may be one too, its bytes now another thread's allocation)
        kept = pre[~realloc]
        stale_bytes = int(kept["bytes"].sum()) - every
        drop = kept.index[freed_unseen(kept["bytes"].to_numpy(np.int64), stale_bytes)] if untouched.any() else []
        gone = np.isin(pre.index, drop) & untouched
        if gone.any():
            gone_bytes = int(pre["bytes"][gone].sum())
            warnings.append(f"{label}: {int(gone.sum())} allocation(s) ({model.fmt_bytes(gone_bytes)}) "
                            f"of the record before the window were freed on a thread the profiler does not record "
                            f"(the allocator's own count of every thread's bytes says so): taken as freed before the "
                            f"window")
            untouched &= ~gone
            stale_bytes -= gone_bytes
        if stale_bytes and count_at_window is not None and _counted_from(inventory) != runfmt.COUNT_FROM_IMPORT:
            # counted through the window: what no set of allocations explains is other threads' net bytes
            net_other = -stale_bytes
            warnings.append(f"{label}: as the window began, threads the profiler does not record had "
                            + (f"{model.fmt_bytes(net_other)} allocated" if net_other > 0 else
                               f"freed {model.fmt_bytes(stale_bytes)} of the record's allocations (which ones, no "
                               f"set of them says)")
                            + " (the allocator's own count of every thread's bytes): counted as other threads")
        elif stale_bytes > 0 and not gone.any():
            warnings.append(f"{label}: the record before the window holds {model.fmt_bytes(stale_bytes)} more than "
                            f"the allocator's own count of every thread's bytes, in no set of its allocations: "
                            f"memory alive before the window may be overstated by that much")
    add = pre[untouched]
    parts = [allocs]
    if len(add):
        parts.append(pd.DataFrame({
            "addr": add["addr"].to_numpy(np.int64), "bytes": add["bytes"].to_numpy(np.int64), "alloc_us": t0,
            "free_us": np.nan, "alloc_seq": np.int64(-1), "free_seq": NEVER, "device": np.int16(0),
            "stream": np.int64(0), "before_trace": True, "free_inferred": False}))
    if net_other:
        parts.append(pd.DataFrame({
            "addr": [NO_ADDRESS], "bytes": [np.int64(net_other)], "alloc_us": t0, "free_us": np.nan,
            "alloc_seq": np.int64(-1), "free_seq": NEVER, "device": np.int16(0), "stream": np.int64(0),
            "before_trace": True, "free_inferred": False, cz.OTHER_THREADS_COLUMN: True}))
    return pd.concat(parts, ignore_index=True) if len(parts) > 1 else allocs


def _with_ddp_buckets(allocs: pd.DataFrame, inv_t: pd.DataFrame, inventory: dict | None, t0: float) -> pd.DataFrame:
    """``inv_t`` plus DDP's gradient buckets (inventory.json's ``ddp_bucket_bytes``): per bucket one allocation of
    its bytes alive all through the window from before it, labelled as full gradients waiting for their
    all-reduce (unsharded_grad)."""
    sizes = (inventory or {}).get("ddp_bucket_bytes") or []
    if not sizes:
        return inv_t
    cand = allocs[allocs["before_trace"] & allocs["free_us"].isna() & ~allocs["addr"].isin(inv_t["addr"])]
    # the latest made first (DDP rebuilds its buckets in its second forward)
    made = {int(r[0]): r[2] for r in ((inventory or {}).get(runfmt.INVENTORY_BEFORE_WINDOW) or {}).get("allocations")
            or [] if isinstance(r, list) and len(r) >= 3}
    cand = cand.assign(made=cand["addr"].map(made).fillna(-1)).sort_values("made", ascending=False, kind="stable")
    rows, taken = [], set()
    for size in sizes:
        hit = cand[(cand["bytes"] == int(size)) & ~cand["addr"].isin(taken)]
        if len(hit):
            addr = int(hit["addr"].iat[0])
            taken.add(addr)
            rows.append({"addr": addr, "bytes": int(size), "tensor_bytes": int(size),
                         "category": MC.UNSHARDED_GRAD.value, "ref_us": t0, "unit": None,
                         "name": "DDP gradient bucket", "role": runfmt.ROLE_GRAD_BUCKET, "step": np.nan})
    if not rows:
        return inv_t
    return pd.concat([inv_t, pd.DataFrame(rows)], ignore_index=True) if len(inv_t) else pd.DataFrame(rows)


def freed_unseen(sizes: np.ndarray, stale_bytes: int, max_set: int = 4) -> np.ndarray:
    """Positions of the fewest (up to ``max_set``) of ``sizes`` that sum to exactly ``stale_bytes`` (latest first),
    the allocations whose free a thread the profiler does not record made; empty when none do."""
    if stale_bytes <= 0 or not len(sizes):
        return np.array([], dtype=np.int64)
    idx = np.arange(len(sizes))[::-1]
    pos = {}
    for i in idx:
        pos.setdefault(int(sizes[i]), []).append(int(i))
    if stale_bytes in pos:
        return np.array(pos[stale_bytes][:1])
    cand = [int(i) for i in idx if sizes[i] < stale_bytes]
    for a_n, i in enumerate(cand):                 # two
        j = [k for k in pos.get(stale_bytes - int(sizes[i]), []) if k != i]
        if j:
            return np.array([i, j[0]])
    if max_set >= 3:
        for a_n, i in enumerate(cand[:200]):
            for k in cand[a_n + 1:200]:
                rest = stale_bytes - int(sizes[i]) - int(sizes[k])
                j = [m for m in pos.get(rest, []) if m not in (i, k)]
                if rest > 0 and j:
                    return np.array([i, k, j[0]])
    if max_set >= 4:
        # two pairs (meet in the middle): FSDP2 on gloo, seen on rank 1: both 3 MB reduce buffers of a unit, a
        # 2 MB and a 1 MB one (9,531,392 B) freed on gloo's thread before the window
        top = cand[:200]
        pairs: dict[int, list[tuple[int, int]]] = {}
        for a_n, i in enumerate(top):
            for k in top[a_n + 1:]:
                pairs.setdefault(int(sizes[i]) + int(sizes[k]), []).append((i, k))
        for s, ps in pairs.items():
            for i, k in ps:
                for m, n in pairs.get(stale_bytes - s, []):
                    if len({i, k, m, n}) == 4:
                        return np.array([i, k, m, n])
    return np.array([], dtype=np.int64)


def fsdp_free_bounds(allocs: pd.DataFrame, intervals: pd.DataFrame) -> np.ndarray:
    """The latest time (µs) FSDP frees each all-gather buffer (inf: no rule), by _fsdp_param_group.py's rules: an
    unsharded parameter before the unit's next all-gather; FSDP2's flat all-gather output after its copy-out, before
    the next all-gather (backward) or copy-out (forward).  ``intervals``: labels.fsdp_intervals of the trace."""
    n = len(allocs)
    bound = np.full(n, np.inf)
    if not n or intervals is None or not len(intervals):
        return bound
    fp = allocs["fsdp_phase"].astype(object).to_numpy()
    unit = allocs["unit"].astype(object).to_numpy()
    at = allocs["alloc_us"].to_numpy(float)
    stage = allocs["stage"].astype(object).to_numpy()
    pre = allocs["before_trace"].to_numpy(bool)
    iv = intervals[intervals["fsdp_phase"].isin(model.FLAT_GATHER_PHASES | model.COPY_OUT_PHASES)]
    ag_iv = iv[iv["fsdp_phase"].isin(model.FLAT_GATHER_PHASES)]
    co_iv = iv[iv["fsdp_phase"].isin(model.COPY_OUT_PHASES)]
    ag_all = np.sort(ag_iv["ts_us"].to_numpy(float))
    co_all = np.sort(co_iv["ts_us"].to_numpy(float))
    ag_by_unit = {u: np.sort(g["ts_us"].to_numpy(float)) for u, g in ag_iv.groupby(ag_iv["unit"].astype(object).fillna("\0"))}
    co_by_unit = {u: g.sort_values("ts_us")[["ts_us", "end_us"]].to_numpy(float)
                  for u, g in co_iv.groupby(co_iv["unit"].astype(object).fillna("\0"))}
    is_ag = cz._Codes(fp).isin(model.FLAT_GATHER_PHASES) & ~pre
    is_unsh = cz._Codes(fp).isin(model.COPY_OUT_PHASES | model.FSDP1_UNSHARD_PHASES) & ~pre
    for i in np.flatnonzero((is_ag | is_unsh) & pd.notna(unit)):
        u = unit[i]
        nxt = ag_by_unit.get(u)
        b = np.inf
        if nxt is not None:
            j = np.searchsorted(nxt, at[i], side="right")
            if j < len(nxt):
                b = nxt[j]
        if is_ag[i]:
            co = co_by_unit.get(u)
            if co is not None:
                j = np.searchsorted(co[:, 0], at[i], side="left")
                if j < len(co):
                    own_end = co[j, 1]
                    after = ag_all if stage[i] == model.STAGE_BACKWARD else co_all
                    k = np.searchsorted(after, own_end, side="left")
                    if k < len(after):
                        b = min(b, after[k])
        bound[i] = b
    return bound


def _label_codes(labels: pd.Series, missing: str) -> np.ndarray:
    """Integer codes of a column of labels, a missing label read as ``missing``."""
    return pd.factorize(labels.astype(object).fillna(missing).to_numpy(object))[0]


def infer_lost_frees(allocs: pd.DataFrame, ts: np.ndarray, intervals: pd.DataFrame, marks) -> tuple[int, int]:
    """Free, in place, the FSDP buffers whose free the trace lost (or found only at a later reuse of the address)
    where :func:`fsdp_free_bounds` says, else after the median lifetime of their peers (same phase, unit, stage and
    size); ``ts``: the memory events' sorted times.  Returns (count, bytes) fixed."""
    fp = allocs["fsdp_phase"].astype(object)
    unsh = cz._Codes(fp.to_numpy()).isin(model.FLAT_GATHER_PHASES | model.COPY_OUT_PHASES | model.FSDP1_UNSHARD_PHASES)
    buf = unsh & ~allocs["before_trace"].to_numpy()
    # reduce phases: their buffers are transient when their peers die in the step that made them (the
    # reduce-scatter input, held by the collective's work object, is often freed on gloo's thread); the new
    # sharded gradient made there lives into the next step and is left alone
    reduce_ = cz._Codes(fp.to_numpy()).isin(model.UNSHARDED_GRAD_PHASES) & ~allocs["before_trace"].to_numpy()
    never = allocs["free_seq"].to_numpy() == NEVER
    by_realloc = allocs["free_inferred"].to_numpy(bool) & ~never
    free_us = allocs["free_us"].to_numpy(float)
    bound = fsdp_free_bounds(allocs, intervals)
    # a free the trace recorded at or before FSDP's bound stands; a missing or reuse-inferred one is bounded
    fix_b = buf & np.isfinite(bound) & (never | (by_realloc & (free_us > bound)))
    new_us = np.where(fix_b, bound, np.nan)
    # no bound (the window ends first): the peers' usual lifetime
    gather = fp.isin(model.FLAT_GATHER_PHASES).to_numpy() & buf
    transient = gather | reduce_
    cand = transient & (never | by_realloc) & ~fix_b
    if cand.any():
        # peers are the same buffer of the collective: same phase, stage and size, and the same place among the
        # unit's same-size buffers of that step (FSDP2 on gloo makes two 3 MB reduce buffers per unit: the
        # reduce-scatter input, held long, and a short one freed on gloo's thread; mixing them gave the short one
        # the long one's lifetime, 3,159,040 B too many at the peak of tests/test_memory_cpu.py's oracle run)
        # (groups as integer codes: no string key per allocation)
        peers = pd.DataFrame({"phase": _label_codes(fp, ""), "stage": _label_codes(allocs["stage"], ""),
                              "bytes": allocs["bytes"].to_numpy(np.int64),
                              "unit": _label_codes(allocs["unit"], "<none>"),
                              "step": allocs["step_idx"].to_numpy(np.int64)})
        peers["base"] = peers.groupby(["phase", "stage", "bytes"], sort=False).ngroup()
        order = np.argsort(allocs["alloc_us"].to_numpy(float), kind="stable")
        nth = np.empty(len(peers), dtype=np.int64)
        nth[order] = peers.iloc[order].groupby(["base", "unit", "step"], sort=False).cumcount().to_numpy()
        peers["nth"] = nth
        key = peers.groupby(["base", "unit", "nth"], sort=False).ngroup().to_numpy()
        key_any_unit = peers.groupby(["base", "nth"], sort=False).ngroup().to_numpy()  # (the unit's peers outside)
        del peers, nth, order
        same_step = (allocs["free_step_idx"] == allocs["step_idx"]).to_numpy()
        freed = transient & ~never & ~by_realloc & (gather | same_step)
        # a reduce-phase size whose peers outlive their step (the sharded gradient) is not transient
        outlives = np.bincount(key, weights=reduce_ & ~never & ~by_realloc & ~same_step) > 0
        cand &= ~(reduce_ & outlives[key])
        life = (allocs["free_us"] - allocs["alloc_us"]).where(freed).reset_index(drop=True)
        med, n_peers = life.groupby(key).median().to_numpy(float), life.groupby(key).count().to_numpy()
        med_any = life.groupby(key_any_unit).median().to_numpy(float)
        n_any = life.groupby(key_any_unit).count().to_numpy()
        idx = np.flatnonzero(cand)
        k, k_any = key[idx], key_any_unit[idx]
        own = n_peers[k] >= 1
        ok = own | (n_any[k_any] >= 1)
        med_us = np.where(own, med[k], med_any[k_any])
        idx, med_us = idx[ok], med_us[ok]
        t = allocs["alloc_us"].to_numpy(float)[idx] + med_us
        # a free inferred from re-allocation stands unless the peers' lifetime ends the buffer earlier
        keep = never[idx] | (t < free_us[idx])
        new_us[idx[keep]] = t[keep]
    pos = np.searchsorted(ts, new_us, side="left")
    sel = np.flatnonzero(np.isfinite(new_us) & (pos < len(ts)))
    if not len(sel):
        return 0, 0
    rows = allocs.index[sel]
    t = new_us[sel]
    allocs.loc[rows, "free_us"] = t
    allocs.loc[rows, "free_seq"] = pos[sel].astype(np.int64)  # just before the event at that time
    allocs.loc[rows, "free_inferred"] = True
    allocs.loc[rows, "free_stage"] = model.stage_at(t, marks, outside=None)
    allocs.loc[rows, "free_fsdp_phase"] = cz.paint(t, intervals, "fsdp_phase")
    starts = marks["start_us"].to_numpy(float) if len(marks) else np.array([-np.inf])
    allocs.loc[rows, "free_step_idx"] = np.searchsorted(starts, t, side="right") - 1
    return len(sel), int(allocs.loc[rows, "bytes"].sum())


# --------------------------------------------------------------------------- FSDP1 units (CPU / GPU traces)
@dataclass
class Fsdp1Units:
    """FSDP1 units from a trace: ``scopes`` (ts_us, end_us, unit) and the all-gathers' launch times and units."""

    scopes: pd.DataFrame
    ag_launch_us: np.ndarray
    ag_unit: list


def _collective_launches(events: pd.DataFrame, coll: str) -> pd.DataFrame:
    """launch_us, bytes, stage of each launch of ``coll`` (device / gloo work if the trace has it), by launch."""
    e = events[(events["collective"] == coll) & events["bytes"].notna() & events["launch_ts_us"].notna()]
    if (e["kind"] == model.KIND_COMM).any():
        e = e[e["kind"] == model.KIND_COMM]
    e = e.drop_duplicates("launch_ts_us").sort_values("launch_ts_us", kind="stable")
    return pd.DataFrame({"launch_us": e["launch_ts_us"].to_numpy(float), "bytes": e["bytes"].to_numpy(float),
                         "stage": e["stage"].astype(object).to_numpy()})


def _inventory_template(inventory: dict | None, world_size: int | None) -> tuple[list[str], list[float]] | None:
    """FSDP1 units in the inventory's order with their all-gather bytes (flat parameter padded to the shard group,
    in the all-gather dtype)."""
    units = (inventory or {}).get("units") or []
    if not units:
        return None
    w = int(world_size or inventory.get("shard_group_size") or inventory.get("world_size") or 1)
    mp = (inventory.get("mixed_precision") or {}).get("param_dtype")
    names, sizes = [], []
    for u in units:
        numel = int(u.get("unsharded_numel") or 0)
        _, el = model.dtype_size(str(mp or u.get("dtype") or "float32"))
        names.append(str(u.get("fqn") or ""))
        sizes.append(float(-(-numel // w) * w * el))
    return names, sizes


def fsdp1_units(events: pd.DataFrame | None, ann: pd.DataFrame, inventory: dict | None,
                world_size: int | None) -> Fsdp1Units | None:
    """FSDP1's units from the order of the all-gathers (its annotations name none), as fsdp_units does for
    snapshots; a forward annotation is the unit of its first all-gather, a stretch of backward the unit whose
    reduce-scatter ends it."""
    if events is None or not len(events):
        return None
    ag = _collective_launches(events, model.ALL_GATHER)
    if not len(ag):
        return None
    fwd = (ag["stage"] != model.STAGE_BACKWARD).to_numpy()
    runs = fu._runs(["f" if f else "b" for f in fwd])
    sig = ag["bytes"].tolist()
    tmpl = _inventory_template(inventory, world_size)
    if tmpl is not None:
        names, sizes = tmpl
    else:
        f_runs = [(a, b) for a, b in runs if fwd[a]]
        if not f_runs:
            return None
        a0, b0 = max(f_runs, key=lambda r: r[1] - r[0])
        names, sizes = [fu.unit_name(k) for k in range(b0 - a0)], sig[a0:b0]
    unit: list = [None] * len(ag)
    for a, b in runs:
        if fwd[a]:
            o = fu._forward_offset(sig[a:b], sizes, [0] * (b - a), [0] * len(sizes))
            if o is not None:
                unit[a:b] = [names[k] for k in range(o, o + b - a)]
        else:
            unit[a:b] = [names[k] if k is not None else None for k in fu._reverse_match(sig[a:b], sizes)]
    launch = ag["launch_us"].to_numpy(float)
    rows = []
    fw = ann[(ann["family"] == model.FAMILY_FSDP1) & (ann["fsdp_phase"] == model.PHASE_FORWARD)]
    for s0, e0 in fw[["ts_us", "end_us"]].to_numpy(float):
        j = int(np.searchsorted(launch, s0, side="left"))
        if j < len(launch) and launch[j] <= e0 and unit[j] is not None:
            rows.append((s0, e0, unit[j]))
    # backward: from the previous reduce-scatter (or the backward's start) to the end of this one's hook
    rs = _collective_launches(events, model.REDUCE_SCATTER)
    if len(rs):
        rsig = rs["bytes"].tolist()
        best_r = fu.reduce_ratio(rsig, sizes)
        rfwd = np.searchsorted(launch[fwd], rs["launch_us"].to_numpy(float)) if fwd.any() else np.zeros(len(rs), int)
        post = ann[(ann["family"] == model.FAMILY_FSDP1) & (ann["fsdp_phase"] == model.PHASE_POST_BACKWARD)]
        post_iv = post[["ts_us", "end_us"]].to_numpy(float)
        for reg in np.unique(rfwd):
            idx = np.flatnonzero(rfwd == reg)
            ks = fu._reverse_match([rsig[i] / best_r for i in idx], sizes)
            prev = None
            for i, k in zip(idx, ks):
                t = float(rs["launch_us"].iat[i])
                inside = post_iv[(post_iv[:, 0] <= t) & (post_iv[:, 1] >= t)]
                end = float(inside[:, 1].max()) if len(inside) else t
                start = prev if prev is not None else (float(inside[:, 0].min()) if len(inside) else t)
                if k is not None:
                    rows.append((start, end, names[k]))
                prev = end
    scopes = pd.DataFrame(rows, columns=["ts_us", "end_us", "unit"])
    return Fsdp1Units(scopes=scopes, ag_launch_us=launch, ag_unit=unit)


def _matched_inventory(allocs: pd.DataFrame, inv_t: pd.DataFrame) -> np.ndarray:
    a = allocs[["addr", "alloc_us", "free_us"]]
    m = inv_t.reset_index().merge(a, on="addr", how="inner")
    ok = (m["alloc_us"] <= m["ref_us"]) & (m["ref_us"] < m["free_us"].fillna(np.inf))
    hit = np.zeros(len(inv_t), bool)
    hit[m.loc[ok, "index"].to_numpy()] = True
    return hit


def annotate_from_events(allocs: pd.DataFrame, events: pd.DataFrame | None, marks: pd.DataFrame,
                         inventory: dict | None = None, world_size: int | None = None) -> None:
    """Add the labels (stage, fsdp_phase, unit, free_*, step_idx, free_step_idx, frame_sig, fsdp_family) from the
    trace's annotations at the allocation's and the free's time (in place)."""
    at, ft = allocs["alloc_us"].to_numpy(float), allocs["free_us"].to_numpy(float)
    pre = allocs["before_trace"].to_numpy(bool)
    ann = labels.fsdp_intervals(events)
    scopes = cz.unit_scopes(ann) if len(ann) else pd.DataFrame(columns=["ts_us", "end_us", "unit"])
    unit_iv = pd.concat([scopes, ann.loc[ann["unit"].notna(), ["ts_us", "end_us", "unit"]]], ignore_index=True)
    f1 = fsdp1_units(events, ann, inventory, world_size) if len(ann) and (ann["family"] == model.FAMILY_FSDP1).any() \
        and not ann["unit"].notna().any() else None
    if f1 is not None:
        unit_iv = pd.concat([unit_iv, f1.scopes], ignore_index=True)
    stage = model.stage_at(at, marks, outside=None)
    stage[pre] = None
    allocs["stage"] = labels_array(stage)
    fp = cz.paint(at, ann, "fsdp_phase")
    fp[pre] = None
    allocs["fsdp_phase"] = labels_array(fp)
    un = cz.paint(at, unit_iv, "unit")
    if f1 is not None and len(f1.ag_launch_us):
        # FSDP1's unsharded flat parameter: allocated by the unshard just before its all-gather is launched
        fp_codes = cz._Codes(fp)
        uns = fp_codes.isin(model.FSDP1_UNSHARD_PHASES) & ~pre
        j = np.searchsorted(f1.ag_launch_us, at[uns], side="left")
        ok = j < len(f1.ag_launch_us)
        idx = np.flatnonzero(uns)[ok]
        un[idx] = np.asarray(f1.ag_unit, dtype=object)[j[ok]]
    un[pre] = None
    allocs["unit"] = labels_array(un)
    ftf = np.where(np.isnan(ft), -np.inf, ft)
    allocs["free_stage"] = labels_array(model.stage_at(ftf, marks, outside=None))
    allocs["free_fsdp_phase"] = labels_array(cz.paint(ftf, ann, "fsdp_phase"))
    starts = marks["start_us"].to_numpy(float) if len(marks) else np.array([-np.inf])
    sidx = np.searchsorted(starts, at, side="right") - 1
    sidx[pre] = -1
    allocs["step_idx"] = sidx
    allocs["free_step_idx"] = np.where(np.isnan(ft), 1 << 30, np.searchsorted(starts, ftf, side="right") - 1)
    allocs["frame_sig"] = labels_array("", len(allocs))
    fams = set(ann["family"].dropna()) if len(ann) else set()
    allocs["fsdp_family"] = labels_array(model.FAMILY_FSDP1 if model.FAMILY_FSDP1 in fams else (
        model.FAMILY_FSDP2 if model.FAMILY_FSDP2 in fams else None), len(allocs))
