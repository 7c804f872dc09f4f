"""FSDP units, buffers and shards recovered from a CUDA snapshot's stack frames, with no inventory.

FSDP's own functions are in the frames of every allocation they make (model.FSDP_FRAME_ROLES).  The all-gathers
are the units: in each forward the k-th is unit k; a backward gathers them again in reverse order (matched by
size).  Copy-outs, all-gather inputs and reduce-scatters belong to the all-gather (or the backward) they serve;
a forward allocation to the unit whose module call it runs in (a unit of several modules: until its post-forward);
a backward allocation to the unit whose reduce-scatter ends it.  Blocks alive before the history whose sizes are
the shards the all-gathers imply are the sharded parameters, and 1 or 2 more of each size their optimizer state.
Sizes in bytes (requested sizes).
"""
from __future__ import annotations

from collections import Counter
from dataclasses import dataclass, field

import numpy as np
import pandas as pd

from fsdpprof.analyze import model
from fsdpprof.analyze.memory.snapshot import NEVER

AG_OUT, AG_IN, COPY_OUT = model.FSDP_ROLE_ALL_GATHER_OUTPUT, model.FSDP_ROLE_ALL_GATHER_INPUT, model.FSDP_ROLE_COPY_OUT
RS, RS_IN, RS_OUT = model.FSDP_ROLE_REDUCE_SCATTER, model.FSDP_ROLE_REDUCE_SCATTER_INPUT, model.FSDP_ROLE_REDUCE_SCATTER_OUTPUT
WORLD_MAX = 1 << 16
DTYPE_RATIOS = (1.0, 2.0, 4.0, 0.5)      # stored shard bytes / gathered bytes per element (fp32 vs bf16, fp8 ...)


@dataclass
class FsdpRecovery:
    """What the frames say about FSDP on one device: ``unit``, ``role``, ``role_source`` per allocation."""

    unit: np.ndarray
    role: np.ndarray
    role_source: np.ndarray
    unit_names: list[str] = field(default_factory=list)      # forward order
    world_size: int | None = None
    world_size_source: str | None = None
    notes: list[str] = field(default_factory=list)


def unit_name(k: int) -> str:
    """The name of the k-th unit in forward order when nothing names it."""
    return f"unit {k}"


# --------------------------------------------------------------------------- Python stacks
def _py_frames(stack) -> tuple:
    """The Python frames of a stack, innermost first, as (name, filename, line) tuples."""
    if not stack:
        return ()
    out = []
    for f in stack:
        if type(f) is not dict:
            continue
        fn = f.get("filename")
        if type(fn) is str and fn.endswith(".py"):
            out.append((f.get("name"), fn, f.get("line")))
    return tuple(out)


def _is_module_call(fr: tuple) -> bool:
    return fr[0] in model.MODULE_CALL_FUNCTIONS and str(fr[1]).replace("\\", "/").endswith(model.MODULE_CALL_FILE)


class _Stacks:
    """Python frames of each distinct stack (by stack code), computed on first use."""

    def __init__(self, stacks: list):
        self.stacks = stacks
        self.py: dict[int, tuple] = {}

    def get(self, code: int) -> tuple:
        p = self.py.get(code)
        if p is None:
            p = self.py[code] = _py_frames(self.stacks[code]) if code else ()
        return p

    def unit_key(self, code: int) -> tuple | None:
        """The callers of the innermost module call in a stack (the module whose hook made the allocation)."""
        py = self.get(code)
        for i, fr in enumerate(py):
            if _is_module_call(fr):
                return py[i + 1:]
        return None

    def depth(self, code: int) -> int:
        return sum(1 for fr in self.get(code) if _is_module_call(fr))

    def group_hook(self, code: int) -> bool:
        """The stack runs FSDP2's pre-forward hook of a unit of several modules."""
        name, file = model.FSDP2_GROUP_PRE_HOOK
        return any(fr[0] == name and str(fr[1]).replace("\\", "/").endswith(file) for fr in self.get(code))


def _inside(py: tuple, key: tuple) -> bool:
    """A stack (Python frames) runs inside the module call whose callers are ``key``."""
    n = len(key)
    if len(py) <= n or (n and py[-n:] != key):
        return False
    return _is_module_call(py[-n - 1])


# --------------------------------------------------------------------------- all-gathers -> units
def _runs(passes: list[str]) -> list[tuple[int, int]]:
    """[start, end) of maximal runs of equal values."""
    out, s = [], 0
    for i in range(1, len(passes) + 1):
        if i == len(passes) or passes[i] != passes[s]:
            out.append((s, i))
            s = i
    return out


def _forward_offset(sig: list, tmpl: list, dep: list, tdep: list) -> int | None:
    """Where a forward run of all-gathers sits in the template: the start (a run from the root), the end
    (a history that began mid-forward), else the first place sizes and depths agree; None if nowhere."""
    m, n = len(sig), len(tmpl)
    ok = [o for o in range(n - m + 1) if tmpl[o:o + m] == sig and tdep[o:o + m] == dep]
    if not ok:
        ok = [o for o in range(n - m + 1) if tmpl[o:o + m] == sig]
    if not ok:
        return None
    if 0 in ok:
        return 0
    return n - m if n - m in ok else ok[0]


def _reverse_match(sizes: list, tmpl: list) -> list:
    """Units of a backward sequence (reverse forward order) by size: from the last unit down; one that
    matches nothing below the pointer (the root gathered again first) takes the highest unit of its size.
    (Backward all-gathers use the same rule, skipping the units still unsharded then.)"""
    p = len(tmpl) - 1
    out = []
    used: set[int] = set()
    for s in sizes:
        cands = [k for k in range(len(tmpl)) if tmpl[k] == s and k not in used]
        below = [k for k in cands if k <= p]
        if below:
            k = max(below)
            p = k - 1
        elif cands:
            k = max(cands)
        else:
            out.append(None)
            continue
        used.add(k)
        out.append(k)
    return out


def recover_units(cols: dict, role: np.ndarray, stacks: tuple[np.ndarray, list], *, family: str | None,
                  inventory_units: list[dict] | None = None, world_size: int | None = None,
                  world_size_source: str = "the run") -> FsdpRecovery:
    """Units, FSDP roles and shards of one device's allocations (``cols`` as arrays, ``role`` from the frames,
    ``stacks`` = categorize.stack_codes).  ``inventory_units`` name the units when their count agrees.  World size:
    ``world_size``, else reduce-scatter input / output, else all-gather output / input, else the pre-history blocks
    when their sizes fit one world size only (else unknown)."""
    n_rows = len(role)
    rec = FsdpRecovery(unit=np.full(n_rows, None, dtype=object), role=role.copy(),
                       role_source=np.where(pd.notna(role), "frames", None).astype(object))
    codes, distinct = stacks
    st = _Stacks(distinct)
    seq = np.asarray(cols["alloc_seq"], dtype=np.int64)
    fseq = np.asarray(cols["free_seq"], dtype=np.int64)
    nbytes = np.asarray(cols["bytes"], dtype=np.int64)
    before = np.asarray(cols["before_trace"], dtype=bool)
    stage = np.asarray(cols["stage"], dtype=object)
    inside = ~before
    order = np.flatnonzero(inside)[np.argsort(seq[inside], kind="stable")]   # rows in trace order
    pos_of = np.full(n_rows, -1, dtype=np.int64)
    pos_of[order] = np.arange(len(order))
    role_o = role[order]

    ag = order[role_o == AG_OUT]
    if not len(ag):
        return rec
    is_bwd = [stage[r] == model.STAGE_BACKWARD for r in ag]
    ag_sig = [int(nbytes[r]) for r in ag]
    ag_dep = [st.depth(int(codes[r])) for r in ag]
    runs = _runs(["b" if b else "f" for b in is_bwd])
    fwd_runs = [(a, b) for a, b in runs if not is_bwd[a]]
    ag_unit = [None] * len(ag)
    if fwd_runs:
        min_dep = min(ag_dep[i] for a, b in fwd_runs for i in range(a, b))
        from_root = [r for r in fwd_runs if ag_dep[r[0]] == min_dep]
        a0, b0 = max(from_root or fwd_runs, key=lambda r: r[1] - r[0])
        tmpl, tdep = ag_sig[a0:b0], ag_dep[a0:b0]
    else:   # a history that holds a backward only: its all-gathers in reverse are the units
        a0, b0 = runs[0]
        tmpl, tdep = ag_sig[a0:b0][::-1], ag_dep[a0:b0][::-1]
    n_units = len(tmpl)
    for a, b in runs:
        if not is_bwd[a]:
            o = _forward_offset(ag_sig[a:b], tmpl, ag_dep[a:b], tdep)
            if o is not None:
                ag_unit[a:b] = list(range(o, o + b - a))
    names = [unit_name(k) for k in range(n_units)]
    if inventory_units and len(inventory_units) == n_units:
        names = [str(u.get("fqn") or "") for u in inventory_units]
    elif inventory_units:
        rec.notes.append(f"the snapshot's all-gathers show {n_units} FSDP units per forward, the inventory lists "
                         f"{len(inventory_units)}: units are numbered in forward order")
    rec.unit_names = names

    # in trace order: all-gathers and FSDP2's copy-out groups.  A copy-out belongs to the pending
    # all-gather of its size; a backward all-gather to a unit that is sharded then (FSDP gathers only
    # those), in reverse forward order.
    ag_pos = pos_of[ag]                                     # positions (trace order) of the all-gathers
    copy_groups = _groups(order, role_o == COPY_OUT, stop=np.isin(role_o, [AG_OUT, AG_IN, RS]))
    events = sorted([(int(p), 0, i) for i, p in enumerate(ag_pos)] +
                    [(int(pos_of[g[0]]), 1, j) for j, g in enumerate(copy_groups)])
    open_until = [-1] * n_units                   # the unit is unsharded until this free seq
    pending: list[int] = []
    run_of = np.zeros(len(ag), dtype=np.int64)
    for ri, (a, b) in enumerate(runs):
        run_of[a:b] = ri
    ptr: dict[int, int] = {}
    used: dict[int, set] = {}
    per_param: dict[str, list[int]] = {}
    copy_free: dict[int, int] = {}      # all-gather -> the first free of its copy-out (FSDP2: the unit resharded)
    for p, kind, i in events:
        if kind == 0:
            r = int(ag[i])
            if is_bwd[i]:
                ri = int(run_of[i])
                pt = ptr.setdefault(ri, n_units - 1)
                us = used.setdefault(ri, set())
                cands = [k for k in range(n_units) if tmpl[k] == ag_sig[i] and k not in us
                         and open_until[k] <= seq[r]]
                below = [k for k in cands if k <= pt]
                k = max(below) if below else (max(cands) if cands else None)
                if below:
                    ptr[ri] = k - 1
                if k is not None:
                    us.add(k)
                ag_unit[i] = k
            pending.append(i)
            if family == model.FAMILY_FSDP1 and ag_unit[i] is not None:     # FSDP1: the all-gather output is the unsharded param
                open_until[ag_unit[i]] = int(fseq[r])
            continue
        g = copy_groups[i]
        total = int(nbytes[g].sum())
        cand = [x for x in pending if ag_pos[x] < p]
        hit = next((x for x in cand if ag_sig[x] == total), None)
        if hit is None and cand:
            hit = cand[-1]
        k = None
        if hit is not None:
            pending.remove(hit)
            k = ag_unit[hit]
            copy_free[hit] = int(fseq[g].min())
        else:
            ks = [j for j in range(n_units) if tmpl[j] == total]
            k = ks[0] if len(ks) == 1 else None
        u = names[k] if k is not None else None
        rec.unit[g] = u
        if k is not None:
            open_until[k] = int(fseq[g].max())
        if u is not None and u not in per_param:
            per_param[u] = [int(x) for x in nbytes[g]]
    unit_of_ag = {int(r): (names[k] if k is not None else None) for r, k in zip(ag, ag_unit)}
    for r, u in unit_of_ag.items():
        rec.unit[r] = u
    # all-gather inputs: the all-gather that follows in the same call
    ag_calls = []       # (input, output) rows of one all-gather
    for r in order[role_o == AG_IN]:
        j = int(np.searchsorted(ag_pos, pos_of[r], side="right"))
        if j < len(ag):
            rec.unit[r] = unit_of_ag[int(ag[j])]
            ag_calls.append((int(r), int(ag[j])))

    # reduce-scatter calls: the largest buffer is the input (padded unsharded grads), the rest outputs
    rs_groups = _groups(order, role_o == RS, stop=None, adjacent=True, codes=codes)
    rs_calls = []
    for g in rs_groups:
        if len(g) == 1:
            r_in = None if family == model.FAMILY_FSDP1 else g[0]
        else:
            r_in = g[int(np.argmax(nbytes[g]))]
        for r in g:
            rec.role[r] = RS_IN if r == r_in else RS_OUT
        rs_calls.append((g, r_in))
    if rs_calls:
        _rs_units(rec, rs_calls, tmpl, names, pos_of, ag_pos, is_bwd, nbytes, seq, fseq, order, stage, before)

    # what a unit's forward allocated: between its all-gather and the next, inside its module call
    ag_end = [min(int(fseq[r]), copy_free.get(i, NEVER)) for i, r in enumerate(ag)]
    _forward_units(rec, order, role_o, pos_of, ag, ag_pos, is_bwd, ag_unit, names, codes, st, stage, seq, ag_end)
    # what a unit's backward allocated: before the reduce-scatter that ends it (FSDP's post-backward)
    if rs_calls:
        rs_first = np.array([pos_of[g[0]] for g, _ in rs_calls], dtype=np.int64)
        rs_unit = [rec.unit[g[0]] for g, _ in rs_calls]
        fwd_pos = np.array([p for p, b in zip(ag_pos, is_bwd) if not b], dtype=np.int64)
        for r in order[(role_o == None) & (stage[order] == model.STAGE_BACKWARD)]:  # noqa: E711 (object array)
            if rec.unit[r] is not None:
                continue
            p = pos_of[r]
            j = int(np.searchsorted(rs_first, p, side="left"))
            # the same backward: no forward all-gather between the allocation and that reduce-scatter
            if j < len(rs_first) and not (len(fwd_pos) and ((fwd_pos > p) & (fwd_pos < rs_first[j])).any()):
                rec.unit[r] = rs_unit[j]

    # world size and the shards alive since before the history
    ws, src = _world_size(world_size, rs_calls, ag_calls, nbytes, world_size_source)
    if ws:
        rec.world_size, rec.world_size_source = ws, src
    if not per_param and family == model.FAMILY_FSDP1:      # FSDP1 gathers one flat parameter per unit
        per_param = {names[k]: [tmpl[k]] for k in range(n_units)}
    _match_shards(rec, per_param, names, ws, src, cols, before, fseq, nbytes)
    return rec


def _groups(order: np.ndarray, is_member: np.ndarray, stop: np.ndarray | None, adjacent: bool = False,
            codes: np.ndarray | None = None) -> list:
    """Rows (in trace order) of consecutive members: a group ends at a ``stop`` row, or (``adjacent``) at any
    row that is not a member, or (``codes``) before a member whose exact stack the group already has (one
    call allocates each of its buffers from its own line: the same stack again is the next call)."""
    groups, cur, seen = [], [], set()
    for i, r in enumerate(order):
        if is_member[i]:
            if codes is not None and cur and int(codes[r]) in seen:
                groups.append(np.array(cur))
                cur, seen = [], set()
            cur.append(int(r))
            if codes is not None:
                seen.add(int(codes[r]))
        elif cur and (adjacent or (stop is not None and stop[i])):
            groups.append(np.array(cur))
            cur, seen = [], set()
    if cur:
        groups.append(np.array(cur))
    return groups


def reduce_ratio(sizes: list, tmpl: list) -> float:
    """The ratio of reduce-scatter to all-gather bytes that matches the most ``sizes`` to a size in ``tmpl``."""
    tset = sorted(set(tmpl))
    best_r, best_n = 1.0, -1
    for r in {s / t for s in sizes[:4] for t in tset if t}:
        n = sum(1 for s in sizes if (s / r) in tset)
        if n > best_n:
            best_r, best_n = r, n
    return best_r


def _rs_units(rec, rs_calls, tmpl, names, pos_of, ag_pos, is_bwd, nbytes, seq, fseq, order, stage, before) -> None:
    """Units of the reduce-scatter calls (reverse order within each backward, matched by size with the
    ratio of reduce to gather bytes) and of the gradients each call frees."""
    sizes = [int(nbytes[r_in]) if r_in is not None else int(nbytes[g].max()) for g, r_in in rs_calls]
    ratio = reduce_ratio(sizes, tmpl)
    norm = [s / ratio for s in sizes]
    # a backward: the calls between two forward all-gathers
    fwd_pos = np.array([p for p, b in zip(ag_pos, is_bwd) if not b], dtype=np.int64)
    region = np.searchsorted(fwd_pos, [pos_of[g[0]] for g, _ in rs_calls]) if len(fwd_pos) else np.zeros(len(rs_calls), int)
    units: list = [None] * len(rs_calls)
    for reg in np.unique(region):
        idx = np.flatnonzero(region == reg)
        for i, k in zip(idx, _reverse_match([norm[i] for i in idx], tmpl)):
            units[i] = names[k] if k is not None else None
    # the gradients a call frees (autograd's unsharded grads, cleared after the copy into the input)
    trace_seq = seq[order]
    lo = np.array([int(seq[g].min()) for g, _ in rs_calls], dtype=np.int64)
    after = np.searchsorted(trace_seq, [int(seq[g].max()) for g, _ in rs_calls], side="right")
    hi = np.where(after < len(trace_seq), trace_seq[np.minimum(after, len(trace_seq) - 1)], NEVER)
    for (g, _), u in zip(rs_calls, units):
        rec.unit[g] = u
    cand = order[(stage[order] == model.STAGE_BACKWARD) & (fseq[order] != NEVER)]
    j = np.searchsorted(lo, fseq[cand], side="right") - 1
    ok = j >= 0
    jj = np.maximum(j, 0)
    ok &= (fseq[cand] < hi[jj]) & (seq[cand] < lo[jj])
    for r, k in zip(cand[ok].tolist(), jj[ok].tolist()):
        if rec.unit[r] is None and rec.role[r] is None:
            rec.unit[r] = units[k]


def _forward_units(rec, order, role_o, pos_of, ag, ag_pos, is_bwd, ag_unit, names, codes, st, stage, seq,
                   ag_end) -> None:
    """Units of the forward's allocations (see the module docstring): inside a unit's module call, or (a unit of
    several modules) between its all-gather and ``ag_end`` (trace seq of its post-forward free, per all-gather)."""
    fwd = [i for i in range(len(ag)) if not is_bwd[i] and ag_unit[i] is not None]
    if not fwd:
        return
    # a unit of several modules: until its post-forward (None: one module, bounded by its module call)
    group_end = [ag_end[i] if st.group_hook(int(codes[ag[i]])) else None for i in fwd]
    f_pos = np.array([ag_pos[i] for i in fwd])
    # a forward ends at the next backward all-gather or reduce-scatter
    stops = np.sort(np.concatenate([np.array([ag_pos[i] for i in range(len(ag)) if is_bwd[i]], dtype=np.int64),
                                    np.flatnonzero(np.isin(role_o, [RS, RS_IN, RS_OUT]))]))
    keys = [st.unit_key(int(codes[ag[i]])) for i in fwd]
    run_start = [0] * len(fwd)        # index (in fwd) of the first all-gather of the same forward run
    for j in range(1, len(fwd)):
        same = fwd[j] == fwd[j - 1] + 1
        run_start[j] = run_start[j - 1] if same else j
    # the units gathered before a run began (a history that starts mid-forward) still enclose it: the
    # call chain of each unit from any forward that gathered it
    key_of_unit: dict[int, tuple] = {}
    for j, i in enumerate(fwd):
        if keys[j] is not None:
            key_of_unit.setdefault(ag_unit[i], keys[j])
    cache: dict[tuple[int, int], bool] = {}
    cand = order[(role_o == None) & (stage[order] == model.STAGE_FORWARD)]  # noqa: E711
    for r in cand:
        p = pos_of[r]
        j = int(np.searchsorted(f_pos, p, side="right")) - 1
        if j < 0:
            continue
        nxt = int(np.searchsorted(stops, f_pos[j], side="right"))
        if nxt < len(stops) and stops[nxt] < p:
            continue                    # past the end of that forward
        c = int(codes[r])
        py = st.get(c)
        if not py:
            rec.unit[r] = names[ag_unit[fwd[j]]]
            continue
        cands = [(keys[jj], ag_unit[fwd[jj]], group_end[jj]) for jj in range(j, run_start[j] - 1, -1)]
        cands += [(key_of_unit.get(k), k, None) for k in range(ag_unit[fwd[run_start[j]]] - 1, -1, -1)]
        for key, k, end in cands:
            if end is not None and seq[r] < end:      # inside a unit of several modules, in any of them
                rec.unit[r] = names[k]
                break
            if key is None:
                continue
            kk = (c, id(key))
            hit = cache.get(kk)
            if hit is None:
                hit = cache[kk] = _inside(py, key)
            if hit:
                rec.unit[r] = names[k]
                break


RECORDED_WORLD_SIZE_SOURCES = (None, "the run", "the inventory")   # world_size_source of a world size not inferred


def world_size_inferred(overview: dict) -> bool:
    """The run's world size (``overview``: Analysis.overview) was inferred from its snapshots, not recorded."""
    return bool(overview.get("world_size")) and overview.get("world_size_source") not in RECORDED_WORLD_SIZE_SOURCES


def world_size_said(ws: int | None, source: str | None) -> str:
    """"N = 4 from the run" / "N = 2 inferred from ..." ("" when unknown): a world size with where it comes from."""
    if not ws:
        return ""
    if source in RECORDED_WORLD_SIZE_SOURCES:
        return f"N = {ws}" + (f" from {source}" if source else "")
    return f"N = {ws} inferred from {source}"


def _world_size(given, rs_calls, ag_calls, nbytes, given_source: str = "the run") -> tuple[int | None, str | None]:
    """World size from evidence: given (run info / inventory), else the reduce-scatter input against its output
    (FSDP2), else an all-gather's output against its input (FSDP2: the shards cast and packed, in the gathered
    dtype); None when the snapshot holds neither (the number of snapshots given is no evidence: a job's ranks may
    be given in part)."""
    if given and int(given) > 0:
        return int(given), given_source
    ratios = Counter()
    for g, r_in in rs_calls:
        if r_in is None:
            continue
        for r in g:
            if r != r_in and nbytes[r] > 0 and nbytes[r_in] % nbytes[r] == 0:
                ratios[int(nbytes[r_in] // nbytes[r])] += 1
    ratios = Counter({k: v for k, v in ratios.items() if 1 < k <= WORLD_MAX})
    if ratios:
        return ratios.most_common(1)[0][0], "reduce-scatter input / output"
    ratios = Counter(int(nbytes[o] // nbytes[i]) for i, o in ag_calls
                     if nbytes[i] > 0 and nbytes[o] % nbytes[i] == 0)
    ratios = Counter({k: v for k, v in ratios.items() if 1 < k <= WORLD_MAX})
    if ratios:
        return ratios.most_common(1)[0][0], "all-gather output / input"
    return None, None


def _match_shards(rec, per_param: dict, names, ws, ws_src, cols, before, fseq, nbytes) -> None:
    """Blocks alive since before the history whose sizes are the implied shards -> sharded_param, and k
    more per parameter of each size -> optimizer_state (k the same for every size)."""
    pre = np.flatnonzero(before & (fseq == NEVER))
    if not len(pre) or not per_param:
        return
    addr = np.asarray(cols["addr"], dtype=np.int64)
    by_size: dict[int, list[int]] = {}
    for r in pre[np.argsort(addr[pre], kind="stable")]:
        by_size.setdefault(int(nbytes[r]), []).append(int(r))
    unsharded = [(u, b) for u in names if u in per_param for b in per_param[u]]
    if ws:
        worlds = [ws]
    else:   # the world sizes that turn a gathered size into a size some block has
        big_b = sorted({b for _, b in unsharded}, reverse=True)[:20]
        big_s = sorted(by_size, reverse=True)[:50]
        worlds = sorted({int(b * q // s) for b in big_b for s in big_s for q in DTYPE_RATIOS
                         if s and (b * q) % s == 0 and 2 <= b * q // s <= 4096})
    best = (0, None, None)
    ties: set[int] = set()      # other world sizes whose shards fit the blocks as well (a stored dtype twice as wide)
    for w in worlds:
        for ratio in DTYPE_RATIOS:
            need = Counter()
            for _, b in unsharded:
                s = b * ratio / w
                if s == int(s):
                    need[int(s)] += 1
            hit = sum(min(c, len(by_size.get(s, ()))) * s for s, c in need.items())
            if hit > best[0]:
                best, ties = (hit, w, ratio), set()
            elif hit and hit == best[0] and w != best[1]:
                ties.add(w)
    hit, w, ratio = best
    if not hit:
        return
    if ws is None:
        # a world size read from sizes alone must explain most of the shards
        n_need = len(unsharded)
        n_hit = sum(1 for _, b in unsharded if (b * ratio / w) in by_size)
        if n_hit < 0.9 * n_need:
            return
        ws_src = "the sizes of the blocks alive before the history"
        if ties:    # no evidence settles it: the shards are labelled, the world size stays unknown
            rec.notes.append(f"world size unknown: the blocks alive before the history fit the gathered sizes as "
                             f"shards of N = {' or '.join(str(t) for t in sorted(ties | {w}))} (another stored dtype "
                             f"each); no all-gather input or reduce-scatter in the snapshot settles it")
        else:
            rec.world_size, rec.world_size_source = w, ws_src
    else:
        rec.world_size, rec.world_size_source = w, ws_src
    need_by_size: dict[int, list[str]] = {}
    for u, b in unsharded:
        s = b * ratio / w
        if s == int(s):
            need_by_size.setdefault(int(s), []).append(u)
    extra = {s: len(by_size.get(s, ())) - len(us) for s, us in need_by_size.items()}
    mult = Counter(min(e // len(need_by_size[s]), 2) for s, e in extra.items() if e > 0)
    k_opt = 0
    if mult:
        k, c = mult.most_common(1)[0]
        if k >= 1 and c >= 0.8 * len(need_by_size):
            k_opt = k
    n_param = n_opt = 0
    for s, us in need_by_size.items():
        blocks = by_size.get(s, [])
        for r, u in zip(blocks, us):
            rec.role[r], rec.role_source[r], rec.unit[r] = model.FSDP_ROLE_SHARDED_PARAM, "sizes", u
            n_param += 1
        rest = blocks[len(us):len(us) * (1 + k_opt)]
        for i, r in enumerate(rest):
            rec.role[r], rec.role_source[r], rec.unit[r] = model.FSDP_ROLE_OPTIMIZER_STATE, "sizes", us[i % len(us)]
            n_opt += 1
    how = f"world size {w} from {ws_src}" if rec.world_size == w else f"taken as shards of N = {w}, the world size unknown"
    rec.notes.append(f"{n_param} block(s) alive before the history began have the sizes of the sharded "
                     f"parameters the all-gathers imply ({how}, stored/gathered dtype "
                     f"{ratio:g}x): counted as sharded parameters"
                     + (f"; {n_opt} more of the same sizes ({k_opt} per parameter) as optimizer state" if n_opt else ""))
