"""What limits the step: the critical path across ranks and what each cause costs (µs).

Map (one rank's events, :func:`rank_chain`): per step the rank's serial timeline cut into a chain of nodes, in time
order — the device's timeline on GPU traces (kernels on every stream; a gap is classified by what the host does in
it), the training thread's on CPU / gloo traces (its ops; gloo's work runs on its own threads):

- local segments of fixed length: ``compute`` (something runs; the op with most time names it; unit, stage),
  ``collective`` (only communication runs, and the rank does not wait for that call's end), ``host_gap`` (nothing
  runs), ``sync`` (nothing runs while the host blocks in a synchronisation), ``data_loading`` (nothing runs while the
  DataLoader fetches); gaps under GAP_MIN_US join the segment before them;
- an *issue* node (zero length) where the rank's part of a collective call starts: its arrival;
- a *wait* node where the rank's timeline waits in a collective until that call ends on it.

Reduce (:func:`critical_path`, only collective records and chains): clocks aligned on matched calls' ends; a call
completes on rank r at ``max(arrival over its members) + transfer_r`` (``transfer_r`` = r's end - the last
arrival, ≥ 0).  Replaying the chains (local lengths fixed, a wait node ends at its call's completion) reproduces
the step; the critical path walks back from the end of the step on the rank that ends last, and at a wait whose
call's last member arrived after the wait began it jumps to that rank at its arrival.  Its segments add up to
the path's length, which is the step's length within the alignment residual.  Counterfactuals replay the step
with one change (a rank as fast as the median rank, a unit's collective hidden, no host gaps, the DataLoader
instantly ready, no synchronisations): ``saved_us_per_step`` = replayed length - changed length, the median over
steps.
"""
from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np
import pandas as pd
from pandas.api.types import union_categoricals

from fsdpprof.analyze import model
from fsdpprof.analyze.comm import intervals, steps
from fsdpprof.analyze.load.frames import codes_of, isin, on_device, records, startswith

_NONE = "\u2400"             # stands for None in group keys (pandas drops None keys; "\0" does not survive fillna)
GAP_MIN_US = 5.0            # a gap shorter than this joins the segment before it (launch latency, not a cause)
NODE_LOCAL, NODE_ISSUE, NODE_WAIT = 0, 1, 2
_ISSUE = -2                 # the kind code of issue nodes among rank_chain's pieces (a label's code is >= -1)
CHAIN_COLUMNS = ["rank", "step", "node", "start_us", "dur_us", "kind", "what", "unit", "stage", "call"]
LABEL_COLUMNS = ["kind", "what", "unit", "stage"]
SEGMENT_COLUMNS = ["step", "rank", "kind", "what", "unit", "stage", "dur_us"]
STEP_COLUMNS = ["step", "length_us", "path_us", "span_us", "limiting_rank", "limiting_rank_saved_us",
                "limiting_rank_us", "ranks", "residual_us"]
# limiting_rank: of the ranks tried, the one whose work as fast as the median rank's saves most in that step
# (limiting_rank_saved_us; without several ranks or any saving: the rank with most time on the path);
# limiting_rank_us: its time on the path
# length_us: from the step's start on the rank the path begins on to its end on the rank that ends last (aligned
# clocks); path_us: the sum of the path's segments (= length_us within the alignment residual); span_us: from the
# earliest start to the latest end over the step's ranks, as replayed (what the counterfactuals shorten)
BREAKDOWN_COLUMNS = ["step", "kind", "dur_us", "pct"]
COUNTERFACTUAL_COLUMNS = ["change", "kind", "rank", "unit", "stage", "collective", "segment_kind",
                          "saved_us_per_step", "saved_pct", "saved_q25_us", "contended_us", "p_value"]
# contended_us (CHANGE_RANK, CPU runs that measured every rank's load): µs per step of that saving that the rank's
# longer wait for a core explains — the replay with its local work shrunk by the other ranks' median contention
# over its own, at most the saving (0 when it waits no longer than they do; NaN unknown)
# p_value (CHANGE_RANK): how likely chance alone makes the rank this much slower — one-sided paired t-test over the
# steps of its saving less its contended part against the other tried ranks' median (ranks alike save alike in
# the mean); NaN with fewer than 2 steps or no spread
# saved_q25_us: the lower quartile over steps of what the change saves in one step (a cause in most steps, not in
# one or two: what the findings about a rank ask for)
# collective: the collective type hidden; for CHANGE_RANK, segment_kind, unit and stage say where the rank's work
# exceeds the median rank's most (rank_excess)
TOP_COLUMNS = ["rank", "kind", "what", "unit", "stage", "us_per_step", "pct"]
TOP_ROWS = 20
SPAN_COLUMNS = ["step", "rank", "kind", "what", "unit", "stage", "start_us", "end_us"]
SEGMENTS_PER_STEP_MAX = 60  # a step's path with more segments is summed by (rank, kind, what, unit, stage)
RANKS_TRIED_MAX = 8         # "as fast as the median" for at most this many ranks (those with most time on the path)
COLLECTIVES_TRIED_MAX = 8   # "fully hidden" for at most this many (collective, unit, stage) of the path
REPLAY_TOL_US = 1e-3
NOISE_K = 3.0               # "as fast as the median": a stretch counts as slow beyond NOISE_K x the rank's spread


# --------------------------------------------------------------------------- map: one rank's chain
def _main_lane(events: pd.DataFrame, cpu: np.ndarray) -> object:
    """The training thread of a CPU trace: the lane of its ProfilerStep annotations, else the busiest CPU lane."""
    ps = cpu & startswith(events["name"], (model.STEP_PREFIX,))
    pick = events["lane"][ps if ps.any() else cpu & ~isin(events["kind"], [model.KIND_COMM])].astype(object)
    return pick.value_counts().index[0] if len(pick) else None


def _unit_at(events: pd.DataFrame, cpu: np.ndarray, units: _Taker):
    """A function time (µs, host clock) -> the code (in ``units``, the unit column's codes by row) of the FSDP
    unit whose forward or backward hook ran last before it ("" the root; -1 before any)."""
    owning = {model.PHASE_ROOT_PRE_FORWARD, model.PHASE_PRE_FORWARD, model.PHASE_FORWARD, model.PHASE_PRE_BACKWARD}
    rows = np.flatnonzero(cpu & isin(events["fsdp_phase"], owning) & events["unit"].notna().to_numpy())
    ts = events["ts_us"].to_numpy(np.float64)[rows]
    unit = units[rows]
    order = np.argsort(ts, kind="mergesort")
    ts, unit = ts[order], unit[order]

    def at(t: np.ndarray) -> np.ndarray:
        k = np.searchsorted(ts, np.asarray(t, dtype=np.float64), side="right") - 1
        return np.where(k >= 0, unit[np.clip(k, 0, max(len(unit) - 1, 0))] if len(unit) else -1, -1)
    return at


def _covered(s: np.ndarray, e: np.ndarray, q: np.ndarray) -> np.ndarray:
    """Whether each time q lies inside the union of [s, e)."""
    us, ue = intervals.union(s, e)
    if us.size == 0:
        return np.zeros(q.size, dtype=bool)
    k = np.searchsorted(us, q, side="right") - 1
    return (k >= 0) & (q < ue[np.clip(k, 0, None)])


class _Taker:
    """A column's values by row (``codes`` -1: the last of ``values``), taken only where indexed."""

    __slots__ = ("codes", "values")

    def __init__(self, codes: np.ndarray, values: np.ndarray) -> None:
        self.codes, self.values = codes, values

    def __getitem__(self, rows) -> np.ndarray:
        return self.values[self.codes[rows]]


def _window_rows(rows: np.ndarray, ts: np.ndarray, dur: np.ndarray):
    """``in_window(ws, we)``: the ``rows`` (in row order) whose interval [ts, ts + dur) overlaps [ws, we), found
    among the rows that start from the longest duration before ws on (sorted by start once: linear in the steps,
    not steps x rows)."""
    order = np.argsort(ts[rows], kind="stable")
    srows = rows[order]
    sts = ts[srows]
    del order
    d = dur[rows]
    longest = float(np.nanmax(d)) if rows.size and not np.isnan(d).all() else 0.0
    del d

    def in_window(ws: float, we: float) -> np.ndarray:
        lo = np.searchsorted(sts, ws - longest - 1.0, "left")
        hi = np.searchsorted(sts, we, "left")
        cand = srows[lo:hi]
        return np.sort(cand[(ts[cand] + dur[cand] > ws) & (ts[cand] < we)])
    return in_window


def _merge_pieces(parts: list[tuple], r_end: np.ndarray, labels: _Labels) -> tuple:
    """One step's pieces (``parts``: (step, s, e, kind, what, unit, stage, call, epoch) arrays, labels as codes of
    ``labels``, the issue nodes' kind _ISSUE) as nodes: (step, start, end, node, call, kind, what, unit, stage)
    arrays, in the pieces' order (merged runs, then the issue nodes).  ``r_end``: the collective records' ends (a
    wait ends with its call)."""
    step_a, s_a, e_a, kind_a, what_a, unit_a, stage_a, call_a, epoch_a = (
        np.concatenate([p[i] for p in parts]) for i in range(9))
    issue = kind_a == _ISSUE
    loc = np.flatnonzero(~issue)
    # merge consecutive pieces of one (kind, unit, stage, call) between two arrivals; the op with most time names it
    lk = [step_a[loc], call_a[loc], epoch_a[loc], kind_a[loc], unit_a[loc], stage_a[loc]]
    new = np.ones(loc.size, dtype=bool)
    if loc.size > 1:
        new[1:] = np.logical_or.reduce([k[1:] != k[:-1] for k in lk])
    run = np.cumsum(new) - 1
    first = np.flatnonzero(new)
    d = e_a[loc] - s_a[loc]
    what_code = what_a[loc].astype(np.int64)                   # (None: -1)
    span = int(what_code.max()) + 2 if what_code.size else 1
    pair = run * span + (what_code + 1)
    uniq, first_at, inv = np.unique(pair, return_index=True, return_inverse=True)
    total = np.bincount(inv.ravel(), weights=d, minlength=uniq.size)
    run_of = uniq // span
    order = np.lexsort((first_at, -total, run_of))       # per run: most time first, then the first to appear
    top = order[np.r_[True, run_of[order][1:] != run_of[order][:-1]]]
    best = np.full(first.size, -1, dtype=np.int32)
    best[run_of[top]] = uniq[top] % span - 1
    at = loc[first]
    m_call = call_a[at]
    m_e = np.maximum.reduceat(e_a[loc], first) if first.size else np.zeros(0)
    m_s = np.minimum.reduceat(s_a[loc], first) if first.size else np.zeros(0)
    node = np.full(first.size, NODE_LOCAL, dtype=np.int8)
    is_wait = (kind_a[at] == labels.label(model.PATH_COLLECTIVE)) & (m_call >= 0)
    is_wait &= np.abs(m_e - r_end[np.clip(m_call, 0, None)] if len(r_end) else 0) < 1e-6
    node[is_wait] = NODE_WAIT
    m_call = np.where(is_wait, m_call, -1)
    iss = np.flatnonzero(issue)
    o_step = np.concatenate([step_a[at], step_a[iss]])
    o_s = np.concatenate([m_s, s_a[iss]])
    o_e = np.concatenate([m_e, e_a[iss]])
    o_node = np.concatenate([node, np.full(iss.size, NODE_ISSUE, dtype=np.int8)])
    o_call = np.concatenate([m_call, call_a[iss]])
    o_kind = np.where(o_node == NODE_ISSUE, labels.label("issue"), np.concatenate([kind_a[at], kind_a[iss]]))
    return (o_step, o_s, o_e, o_node, o_call, o_kind, np.concatenate([best, what_a[iss]]),
            np.concatenate([unit_a[at], unit_a[iss]]), np.concatenate([stage_a[at], stage_a[iss]]))


class _Labels:
    """A rank's chain labels (str; None: code -1) as int32 codes in the order first seen, one table for every label
    column: its steps are merged on codes (no object array of a step's pieces), and :meth:`categorical` gives a
    column as ``pd.Categorical(labels)`` makes it (categories sorted), without an object array of every node's
    label (nor its copy into Arrow strings)."""

    def __init__(self) -> None:
        self.code: dict = {}

    def label(self, value) -> int:
        """The code of one label."""
        return self.code.setdefault(value, len(self.code))

    def _codes(self, uniques) -> np.ndarray:
        return np.fromiter((self.code.setdefault(u, len(self.code)) for u in uniques), np.int32, len(uniques))

    def of(self, values: np.ndarray) -> np.ndarray:
        """Codes of an array of labels (None, NaN: -1)."""
        local, uniq = pd.factorize(np.asarray(values, dtype=object))
        return np.append(self._codes(uniq), np.int32(-1))[local]

    def column(self, col: pd.Series) -> _Taker:
        """An events column's codes by row, taken only where indexed (-1: missing)."""
        codes, uniques = codes_of(col)
        return _Taker(np.asarray(codes), np.append(self._codes(uniques), np.int32(-1)))

    def categorical(self, codes: np.ndarray) -> pd.Categorical:
        """A column's codes as a categorical of the labels it holds."""
        present = np.unique(codes[codes >= 0])
        held = np.array(list(self.code), dtype=object)[present] if present.size else np.zeros(0, dtype=object)
        order = np.argsort(held, kind="stable")
        rank = np.full(len(self.code) + 1, -1, dtype=np.int32)        # (the last: code -1)
        rank[present[order]] = np.arange(present.size, dtype=np.int32)
        return pd.Categorical.from_codes(rank[codes], categories=pd.Index(held[order]))


def rank_chain(events: pd.DataFrame, records: pd.DataFrame | None,
               windows: pd.DataFrame | None = None) -> pd.DataFrame:
    """One rank's chain of nodes per step (CHAIN_COLUMNS, in time order; ``node``: NODE_LOCAL / NODE_ISSUE /
    NODE_WAIT; ``call``: the row of ``records`` (skew.collective_records of these events) an issue or wait node
    belongs to, else -1).  Empty without steps.  ``windows``: steps.step_windows of these events, where the
    caller has them."""
    empty = pd.DataFrame({c: [] for c in CHAIN_COLUMNS})
    win = steps.step_windows(events) if windows is None else windows
    if not len(win):
        return empty
    rank = int(events["rank"].iloc[0])
    cpu = ~on_device(events["lane"])
    kind = events["kind"]
    ts_all, dur_all = events["ts_us"].to_numpy(np.float64), events["dur_us"].to_numpy(np.float64)

    def span(rows):
        """(start, end) of ``rows`` (µs; no full-length end column)."""
        ts = ts_all[rows]
        return ts, ts + dur_all[rows]
    gpu = bool((~cpu & isin(kind, model.DEVICE_KINDS)).any())
    is_comm = isin(kind, [model.KIND_COMM])
    if gpu:
        busy = ~cpu & isin(kind, [model.KIND_COMPUTE, model.KIND_MEMCPY, model.KIND_MEMSET])
        comm = ~cpu & is_comm
        lts = events["launch_ts_us"].to_numpy(np.float64) if "launch_ts_us" in events else ts_all
    else:
        main = _main_lane(events, cpu)
        busy = cpu & (events["lane"] == main).to_numpy() & \
            ~isin(kind, [model.KIND_ANNOTATION, model.KIND_COMM])
        comm = is_comm
        lts = ts_all

    def label_ts(rows):
        """The time that labels ``rows`` (µs): a kernel's launch, else its start."""
        t = lts[rows]
        return np.where(np.isfinite(t), t, ts_all[rows])
    loader = cpu & startswith(events["name"], (model.DATALOADER_PREFIX,))
    sync = cpu & isin(events["name"], model.SYNC_CALLS) if gpu else np.zeros(len(events), dtype=bool)
    labels = _Labels()         # every label of the chain as a code; the path kinds' codes:
    k_gap, k_coll, k_comp, k_sync, k_data = (labels.label(k) for k in (
        model.PATH_HOST_GAP, model.PATH_COLLECTIVE, model.PATH_COMPUTE, model.PATH_SYNC, model.PATH_DATA))
    fwd_bwd = [labels.label(model.STAGE_FORWARD), labels.label(model.STAGE_BACKWARD)]
    names, colls, stages, units = (labels.column(events[c]) for c in ("name", "collective", "stage", "unit"))
    unit_at = _unit_at(events, cpu, units)
    rec = records if records is not None and len(records) else pd.DataFrame({"ts_us": [], "end_us": []})
    r_ts, r_end = rec["ts_us"].to_numpy(np.float64), rec["end_us"].to_numpy(np.float64)
    r_order = np.argsort(r_ts, kind="stable")
    r_sorted = r_ts[r_order]
    in_window_b = _window_rows(np.flatnonzero(busy), ts_all, dur_all)
    in_window_c = _window_rows(np.flatnonzero(comm), ts_all, dur_all)
    sync_iv, loader_iv = span(np.flatnonzero(sync)), span(np.flatnonzero(loader))
    del busy, comm, sync, loader, is_comm
    nodes: list[tuple] = []     # per step: its merged nodes (see _merge_pieces), labels as codes
    for w in win.itertuples(index=False):
        parts: list[tuple] = []     # this step's (step, s, e, kind, what, unit, stage, call, epoch), issue nodes after
        ws, we = float(w.start_us), float(w.end_us)
        if not we > ws:
            continue
        b, c = in_window_b(ws, we), in_window_c(ws, we)
        (b_s, b_e), (c_s, c_e) = span(b), span(c)
        calls = np.sort(r_order[np.searchsorted(r_sorted, ws, "left"):np.searchsorted(r_sorted, we, "left")])
        t = np.concatenate([[ws, we], b_s, b_e, c_s, c_e, r_ts[calls], r_end[calls]])
        t = np.unique(t[(t >= ws) & (t <= we)])
        if t.size < 2:
            continue
        s0, e0 = t[:-1], t[1:]
        mid = (s0 + e0) / 2
        n = mid.size
        k_b = intervals.innermost(b_s, b_e, mid)
        k_c = intervals.innermost(c_s, c_e, mid)
        pk = np.full(n, k_gap, dtype=np.int32)
        ev = np.full(n, -1, dtype=np.int64)
        on_c = k_c >= 0
        pk[on_c] = k_coll
        ev[on_c] = c[k_c[on_c]]
        on_b = k_b >= 0
        pk[on_b] = k_comp
        ev[on_b] = b[k_b[on_b]]
        gap = ev < 0
        if gap.any():
            in_sync = _covered(*sync_iv, mid) & gap
            in_load = _covered(*loader_iv, mid) & gap
            pk[in_sync] = k_sync
            pk[in_load] = k_data
        what = np.full(n, -1, dtype=np.int32)
        unit = np.full(n, -1, dtype=np.int32)
        stage = np.full(n, -1, dtype=np.int32)
        has = ev >= 0
        e_has = ev[has]
        what[has] = np.where(pk[has] == k_coll, colls[e_has], names[e_has])
        u = units[e_has]
        need = u < 0
        if need.any():
            u[need] = unit_at(label_ts(e_has[need]))
        unit[has] = u
        stage[has] = stages[e_has]
        # a gap takes the labels of the work that ends it (the last one: of the work before it)
        idx = np.where(has, np.arange(n), n)
        nxt = np.minimum.accumulate(idx[::-1])[::-1]
        prv = np.maximum.accumulate(np.where(has, np.arange(n), -1))
        src = np.where(nxt < n, nxt, prv)
        fill = ~has & (src >= 0)
        unit[fill], stage[fill] = unit[src[fill]], stage[src[fill]]
        if (~has).any():
            stage[~has & (src < 0)] = labels.of(model.stage_at(mid[~has & (src < 0)], pd.DataFrame(
                {"step": [w.step], "start_us": [ws], "end_us": [we], **{k: [np.nan] for k in
                                                                        model.STEP_MARK_COLUMNS[3:]}})))
        # units name a part of forward or backward only (the last hook's unit says nothing in the optimizer)
        unit[(stage != fwd_bwd[0]) & (stage != fwd_bwd[1])] = -1
        # the call a communication piece belongs to: of the calls running then, the one ending first
        call = np.full(n, -1, dtype=np.int64)
        if calls.size:
            cm = np.flatnonzero(pk == k_coll)
            if cm.size:
                act = (r_ts[calls][None, :] <= mid[cm, None]) & (r_end[calls][None, :] > mid[cm, None])
                endm = np.where(act, r_end[calls][None, :], np.inf)
                j = endm.argmin(axis=1)
                ok = np.isfinite(endm[np.arange(cm.size), j])
                call[cm[ok]] = calls[j[ok]]
        # short gaps join the piece before them
        short = ~has & (e0 - s0 < GAP_MIN_US) & (pk == k_gap)
        if short.any():
            keep = np.where(short, -1, np.arange(n))
            prev_keep = np.maximum.accumulate(keep)
            j = short & (prev_keep >= 0)
            p = prev_keep[j]
            pk[j], what[j], unit[j], stage[j], call[j] = pk[p], what[p], unit[p], stage[p], call[p]
        # epochs: a new one at each call's arrival, so that merged runs never span an issue node
        epoch = np.searchsorted(np.sort(r_ts[calls]), s0, side="right")
        parts.append((np.full(n, w.step, dtype=np.float64), s0, e0, pk, what, unit, stage, call, epoch))
        if calls.size:
            cev = intervals.innermost(c_s, c_e, r_ts[calls] + 1e-6) if c.size else np.full(calls.size, -1)
            cj = np.where(cev >= 0, c[np.clip(cev, 0, None)] if c.size else 0, -1)
            ok = cj >= 0
            cu = np.full(calls.size, -1, dtype=np.int32)
            cu[ok] = units[cj[ok]]
            need = ok & (cu < 0)
            if need.any():
                cu[need] = unit_at(label_ts(cj[need]))
            m = calls.size
            none = np.full(m, -1, dtype=np.int32)
            parts.append((np.full(m, w.step, dtype=np.float64), r_ts[calls], r_ts[calls],
                          np.full(m, _ISSUE, dtype=np.int32),
                          np.where(ok, colls[np.clip(cj, 0, None)], none) if len(events) else none,
                          cu, np.where(ok, stages[np.clip(cj, 0, None)], none) if len(events) else none,
                          calls.astype(np.int64), np.full(m, -1, dtype=np.int64)))
        nodes.append(_merge_pieces(parts, r_end, labels))
    if not nodes:
        return empty
    o_step, o_s, o_e, o_node, o_call, *labs = (np.concatenate([nd[i] for nd in nodes]) for i in range(9))
    del nodes
    coded = dict(zip(LABEL_COLUMNS, labs))
    # in time order; at one time an issue node before the piece that starts there
    ordr = np.lexsort((np.where(o_node == NODE_ISSUE, 0, 1), o_s, o_step))
    # labels as categoricals: a chain travels from its worker to the reduce as codes (1,024 ranks: 10 KB a rank)
    return pd.DataFrame({"rank": np.full(ordr.size, rank, dtype=np.int32), "step": o_step[ordr],
                         "node": o_node[ordr], "start_us": o_s[ordr], "dur_us": (o_e - o_s)[ordr],
                         **{c: labels.categorical(coded[c][ordr]) for c in LABEL_COLUMNS},
                         "call": o_call[ordr].astype(np.int32)})[CHAIN_COLUMNS]


def concat_chains(chains) -> pd.DataFrame | None:
    """The ranks' chains as one frame (labels stay categoricals, their categories united), None without any."""
    chains = [c for c in chains if c is not None and len(c)]
    if not chains:
        return None
    out = {c: np.concatenate([x[c].to_numpy() for x in chains]) for c in CHAIN_COLUMNS if c not in LABEL_COLUMNS}
    for c in LABEL_COLUMNS:
        try:            # (the ranks' categories are of one dtype: united as they are)
            out[c] = union_categoricals([x[c].array for x in chains], ignore_order=True)
        except (TypeError, AttributeError, ValueError):
            out[c] = union_categoricals([pd.Categorical(x[c].astype(object).to_numpy()) for x in chains],
                                        ignore_order=True)
    return pd.DataFrame(out)[CHAIN_COLUMNS]


# --------------------------------------------------------------------------- reduce: the replay
@dataclass
class _Model:
    """The steps' graph: nodes of every (rank, step) chain, sorted, and the calls they issue and wait on."""

    node: np.ndarray        # NODE_*
    grp: np.ndarray         # (rank, step) group of each node, 0..G-1, contiguous
    d: np.ndarray           # local length (µs; issue and wait nodes 0)
    g_start: np.ndarray     # per group: aligned start (µs)
    g_first: np.ndarray     # per group: its first node
    g_last: np.ndarray      # per group: its last node
    g_rank: np.ndarray
    g_step: np.ndarray
    rec_arr: np.ndarray     # per call record: aligned arrival (µs)
    rec_match: np.ndarray   # its match id (-1: unmatched)
    rec_transfer: np.ndarray  # end - last arrival over its members (µs, >= 0)
    rec_issue: np.ndarray   # its issue node (-1: none in the chains)
    node_rec: np.ndarray    # per node: its call record (-1)
    n_match: int
    start: np.ndarray       # per node: its start (aligned µs)
    dur: np.ndarray         # per node: its recorded length (µs)
    records: pd.DataFrame   # rank, collective, pg, ts_us, end_us (aligned), match_id
    codes: dict = field(default_factory=dict)    # kind, what, unit, stage -> per node its code (-1: none)
    uniques: dict = field(default_factory=dict)  # code -> label
    cache: dict = field(default_factory=dict)

    def last_arrival(self, arr: np.ndarray) -> np.ndarray:
        """Per record: the latest arrival over its call's members (µs)."""
        if not self.n_match:
            return arr.copy()
        m = self.rec_match >= 0
        top = np.full(self.n_match, -np.inf)
        np.maximum.at(top, self.rec_match[m], arr[m])
        out = arr.copy()
        out[m] = top[self.rec_match[m]]
        return out

    def replay(self, d: np.ndarray | None = None, transfer: np.ndarray | None = None) -> np.ndarray:
        """Per node its end (aligned µs) with local lengths ``d`` and transfers ``transfer`` (None: as recorded)."""
        d = self.d if d is None else d
        transfer = self.rec_transfer if transfer is None else transfer
        cs = np.cumsum(d)
        base = np.concatenate([[0.0], cs])[self.g_first]            # the cumsum before each group
        c = cs - base[self.grp]
        s = self.g_start[self.grp]
        wait = np.flatnonzero(self.node == NODE_WAIT)
        issue = np.flatnonzero(self.node == NODE_ISSUE)
        # A node ends at s + c + cm, cm the largest wait so far in its (rank, step) group: a running maximum over
        # the nodes, kept apart per group by offsets of ``big``.  A round needs it only at the issue nodes, where
        # it is the running maximum at the last wait before them in their group (0 without one): each round
        # reads the waits and issue nodes only, every node once at the end, each value as the whole running
        # maximum gives it.
        w_grp, i_grp = self.grp[wait], self.grp[issue]
        w_rec, i_rec = self.node_rec[wait], self.node_rec[issue]
        s_w, c_w = s[wait], c[wait]
        sc_i = s[issue] + c[issue]
        last_w = np.searchsorted(wait, issue) - 1          # the last wait before each issue node
        after_w = (last_w >= 0) & (w_grp[np.clip(last_w, 0, None)] == i_grp) if wait.size \
            else np.zeros(issue.size, dtype=bool)
        last_w = np.where(after_w, last_w, 0)
        arr = self.rec_arr.copy()
        u_w, big = np.zeros(0), 1.0
        for _ in range(len(self.rec_arr) + 2):
            comp = self.last_arrival(arr) + transfer
            u_w = np.maximum(comp[w_rec] - s_w - c_w, 0.0)
            big = (float(u_w.max()) if wait.size else 0.0) * 2.0 + 1.0
            if wait.size:
                run_max = np.maximum.accumulate(u_w + w_grp * big)
                cm_i = np.where(after_w, run_max[last_w] - i_grp * big, 0.0)
            else:
                cm_i = np.zeros(issue.size)
            new = arr.copy()
            new[i_rec] = sc_i + cm_i
            if not len(issue) or np.max(np.abs(new - arr)) < REPLAY_TOL_US:
                break
            arr = new
        u = np.zeros(len(d))
        u[wait] = u_w
        cm = np.maximum.accumulate(u + self.grp * big) - self.grp * big
        return s + c + cm

    def step_lengths(self, t: np.ndarray) -> pd.Series:
        """Per step: latest end over its ranks - earliest start (µs)."""
        end = t[self.g_last]
        df = pd.DataFrame({"step": self.g_step, "s": self.g_start, "e": end})
        g = df.groupby("step", sort=True)
        return g["e"].max() - g["s"].min()


def _build(chains: pd.DataFrame, records: pd.DataFrame, offsets: pd.Series) -> _Model:
    order = np.lexsort((chains["step"].to_numpy(np.float64), chains["rank"].to_numpy(np.int64)))
    ch = chains.take(order).reset_index(drop=True) if not (np.diff(order) == 1).all() else chains.reset_index(drop=True)
    c_rank, c_step = ch["rank"].to_numpy(np.int64), ch["step"].to_numpy(np.float64)
    off = pd.Series(c_rank).map(offsets).fillna(0.0).to_numpy(np.float64)
    start = ch["start_us"].to_numpy(np.float64) - off
    node = ch["node"].to_numpy(np.int64)
    new = np.ones(len(ch), dtype=bool)
    new[1:] = (c_rank[1:] != c_rank[:-1]) | (c_step[1:] != c_step[:-1])
    grp = np.cumsum(new) - 1
    first = np.flatnonzero(new)
    last = np.concatenate([first[1:] - 1, [len(ch) - 1]])
    dur = ch["dur_us"].to_numpy(np.float64)
    d = np.where(node == NODE_LOCAL, dur, 0.0)
    rec = records.reset_index(drop=True)
    ro = rec["rank"].map(offsets).fillna(0.0).to_numpy(np.float64)
    arr = rec["ts_us"].to_numpy(np.float64) - ro
    end = rec["end_us"].to_numpy(np.float64) - ro
    match = rec["match_id"].to_numpy(np.int64)
    # records' positions by (rank, call)
    pos = pd.Series(np.arange(len(rec)), index=pd.MultiIndex.from_arrays([rec["rank"].to_numpy(np.int64),
                                                                          rec["call"].to_numpy(np.int64)]))
    calls = ch["call"].to_numpy(np.int64)
    has_call = calls >= 0
    node_rec = np.full(len(ch), -1, dtype=np.int64)
    if has_call.any():
        idx = pd.MultiIndex.from_arrays([c_rank[has_call], calls[has_call]])
        node_rec[has_call] = pos.reindex(idx).fillna(-1).to_numpy(np.int64)
    bad = (node != NODE_LOCAL) & (node_rec < 0)
    node = np.where(bad, NODE_LOCAL, node)       # a node whose call is not among the records: a fixed length
    d = np.where(bad & (ch["kind"].astype(object).to_numpy() == model.PATH_COLLECTIVE), dur, d)
    rec_issue = np.full(len(rec), -1, dtype=np.int64)
    iss = np.flatnonzero(node == NODE_ISSUE)
    rec_issue[node_rec[iss]] = iss
    n_match = int(match.max()) + 1 if len(match) and match.max() >= 0 else 0
    m = _Model(node=node, grp=grp, d=d, g_start=start[first], g_first=first, g_last=last, g_rank=c_rank[first],
               g_step=c_step[first], rec_arr=arr, rec_match=match, rec_transfer=np.zeros(len(rec)),
               rec_issue=rec_issue, node_rec=node_rec, n_match=n_match, start=start, dur=dur,
               records=pd.DataFrame({"rank": rec["rank"].to_numpy(np.int64), "ts_us": arr, "end_us": end,
                                     "match_id": match,
                                     "collective": rec["collective"].astype(object).to_numpy()}))
    m.rec_transfer = np.maximum(end - m.last_arrival(arr), 0.0)
    for c in LABEL_COLUMNS:
        cat = ch[c] if isinstance(ch[c].dtype, pd.CategoricalDtype) else ch[c].astype(object).astype("category")
        m.codes[c] = cat.cat.codes.to_numpy(np.int32)
        m.uniques[c] = np.asarray(cat.cat.categories.astype(object), dtype=object)
    return m


def _code(m: _Model, col: str, label) -> int:
    """The code of ``label`` in ``col`` (-2: no node has it)."""
    hit = np.flatnonzero(m.uniques[col] == label)
    return int(hit[0]) if hit.size else -2


def _offsets(records: pd.DataFrame) -> pd.Series:
    """Per rank the clock offset (µs) to subtract so that matched calls end together (median deviation)."""
    c = records[records["match_id"].to_numpy() >= 0]
    if not len(c):
        return pd.Series(dtype=float)
    dev = c["end_us"] - c.groupby("match_id")["end_us"].transform("mean")
    return dev.groupby(c["rank"]).median()


def _residual(m: _Model) -> float:
    """The largest per-rank median |end - mean end| of matched calls after alignment (µs)."""
    c = m.records[m.records["match_id"] >= 0]
    if not len(c):
        return 0.0
    dev = (c["end_us"] - c.groupby("match_id")["end_us"].transform("mean")).abs()
    return float(dev.groupby(c["rank"]).median().max())


# --------------------------------------------------------------------------- the walk back
def _walk(m: _Model, step, t: np.ndarray, last_arr: np.ndarray, rec_rank: np.ndarray) -> tuple[list[tuple], float]:
    """The critical path of one step on the recorded (aligned) times ``t`` (per node its end; ``last_arr``: per
    record the last arrival of its call; ``rec_rank``: per record its rank): ((rank, node, waited_for, dur_us,
    start_us) in time order — the node whose labels the piece takes, the rank it waits for or -1 — the µs from the
    start of the rank it begins on to the end of the rank that ends last)."""
    gs = np.flatnonzero(m.g_step == step)
    g = int(gs[np.argmax(t[m.g_last[gs]])])
    end = float(t[m.g_last[g]])
    k = int(m.g_last[g])
    out: list[tuple] = []
    guard = 4 * len(t) + 10
    while k >= m.g_first[g] and guard > 0:
        guard -= 1
        nd = m.node[k]
        r = int(m.g_rank[g])
        if nd == NODE_ISSUE:
            k -= 1
            continue
        s, e = float(m.start[k]), float(t[k])
        if nd == NODE_LOCAL:
            out.append((r, k, -1, e - s, s))
            k -= 1
            continue
        ri = int(m.node_rec[k])
        L = float(last_arr[ri])
        if L > s + REPLAY_TOL_US and m.rec_match[ri] >= 0:
            # the call's last member arrived after this rank began waiting: the path goes on on that rank
            members = np.flatnonzero(m.rec_match == m.rec_match[ri])
            q = int(members[np.argmax(m.rec_arr[members])])
            qi = int(m.rec_issue[q])
            out.append((r, k, -1, max(e - L, 0.0), min(L, e)))
            if qi >= 0 and m.g_step[m.grp[qi]] == step and int(rec_rank[q]) != r and L < e + REPLAY_TOL_US:
                g, k = int(m.grp[qi]), qi
                continue
            out.append((r, k, int(rec_rank[q]), min(L, e) - s, s))
        else:
            out.append((r, k, -1, e - s, s))
        k -= 1
    return out[::-1], end - float(m.g_start[g])


def _paths(m: _Model, steps_: pd.Index) -> tuple[pd.DataFrame, dict]:
    """Every step's critical path as segments, consecutive pieces of one (rank, kind, what, unit, stage) merged
    (``step``, SEGMENT_COLUMNS' others and ``start_us``; path order; zero lengths dropped), and per step the µs from
    the start of the rank it begins on to the end of the rank that ends last."""
    t = m.start + np.where(m.node == NODE_ISSUE, 0.0, m.dur)
    last_arr = m.last_arrival(m.rec_arr)
    rec_rank = m.records["rank"].to_numpy(np.int64)
    blocks, lengths = [], {}
    for step in steps_:
        path, lengths[step] = _walk(m, step, t, last_arr, rec_rank)
        if path:
            blocks.append(np.column_stack([np.full(len(path), float(step)), np.array(path, dtype=np.float64)]))
    cols = np.concatenate(blocks) if blocks else np.zeros((0, 6))
    cols = cols[cols[:, 4] > 0]
    step, (rank, k, waited) = cols[:, 0], (cols[:, i].astype(np.int64) for i in (1, 2, 3))
    wait = waited >= 0
    codes = {c: m.codes[c][k] for c in LABEL_COLUMNS}
    codes["kind"] = np.where(wait, -2, codes["kind"])             # PATH_WAIT
    codes["what"] = np.where(wait, -3 - waited, codes["what"])    # "waiting for rank q"
    new = np.ones(len(step), dtype=bool)
    new[1:] = np.logical_or.reduce([x[1:] != x[:-1] for x in (step, rank, *codes.values())])
    first = np.flatnonzero(new)
    # labels as categoricals (a path as long as the trace's nodes: no string per row)
    special = {"kind": lambda code: model.PATH_WAIT, "what": lambda code: f"waiting for rank {-3 - code}"}
    labels = {}
    for c in LABEL_COLUMNS:
        code = codes[c][first]
        cats = list(m.uniques[c])
        extra = np.unique(code[code < -1])
        if extra.size:
            known = {v: i for i, v in enumerate(cats)}
            to = np.empty(extra.size, dtype=code.dtype)
            for j, x in enumerate(extra.tolist()):
                label = special[c](x)
                to[j] = known.setdefault(label, len(cats))
                if to[j] == len(cats):
                    cats.append(label)
            code = np.where(code < -1, to[np.clip(np.searchsorted(extra, code), 0, extra.size - 1)], code)
        labels[c] = pd.Categorical.from_codes(code, categories=pd.Index(cats, dtype=object))
    dur = pd.Series(cols[:, 4]).groupby(np.cumsum(new) - 1).sum().to_numpy(np.float64)
    start = np.minimum.reduceat(cols[:, 5], first) if len(first) else np.zeros(0)
    return pd.DataFrame({"step": step[first], "rank": rank[first], **labels, "dur_us": dur, "start_us": start}), lengths


# --------------------------------------------------------------------------- counterfactuals
def _epochs(m: _Model) -> np.ndarray:
    """Per node: how many issue nodes come before it in its (rank, step) chain."""
    iss = (m.node == NODE_ISSUE).astype(np.int64)
    cs = np.cumsum(iss)
    base = np.concatenate([[0], cs])[m.g_first]
    return cs - base[m.grp]


def _as_median(m: _Model, rank: int) -> np.ndarray:
    """Local lengths with ``rank``'s work between each two arrivals cut to the median over the other ranks of
    the same stretch where it exceeds that median by more than chance: by over NOISE_K times the spread of chance
    (1.4826 x the median of how much faster than the median it is where it is faster, over all its stretches; 0
    where it never is); never lengthened; a stretch the others do not have is kept."""
    ep = _epochs(m)
    node_rank = m.g_rank[m.grp]
    node_step = m.g_step[m.grp]
    loc = m.node == NODE_LOCAL
    w = pd.DataFrame({"rank": node_rank[loc], "step": node_step[loc], "ep": ep[loc], "d": m.d[loc]})
    per = w.groupby(["rank", "step", "ep"], sort=False)["d"].sum().reset_index()
    mine = per[per["rank"] == rank]
    others = per[per["rank"] != rank]
    if not len(mine) or not len(others):
        return m.d
    med = others.groupby(["step", "ep"])["d"].median().rename("med").reset_index()
    mm = mine.merge(med, on=["step", "ep"], how="left")
    excess = (mm["d"] - mm["med"]).to_numpy(np.float64)
    faster = excess[np.isfinite(excess) & (excess < 0)]      # where it is faster than the median: chance alone
    spread = 1.4826 * float(np.median(-faster)) if faster.size else 0.0
    slow = np.isfinite(excess) & (excess > NOISE_K * spread) & (mm["d"].to_numpy() > 0)
    f = np.where(slow, np.minimum(1.0, mm["med"] / mm["d"].where(mm["d"] > 0, 1.0)), 1.0)
    fac = pd.Series(f, index=pd.MultiIndex.from_arrays([mm["step"].to_numpy(), mm["ep"].to_numpy()]))
    sel = loc & (node_rank == rank)
    idx = pd.MultiIndex.from_arrays([node_step[sel], ep[sel]])
    d = m.d.copy()
    d[sel] = d[sel] * fac.reindex(idx).fillna(1.0).to_numpy()
    return d


def rank_excess(m: _Model, rank: int) -> tuple[str | None, str | None, str | None, float]:
    """(kind, unit, stage, µs per step) where ``rank``'s local work exceeds the median of the other ranks' most:
    per (kind, unit, stage) its time minus the others' median, the mean over steps."""
    if "excess" not in m.cache:
        loc = m.node == NODE_LOCAL
        w = pd.DataFrame({"rank": m.g_rank[m.grp][loc], "step": m.g_step[m.grp][loc],
                          **{c: m.codes[c][loc] for c in ("kind", "unit", "stage")}, "d": m.d[loc]})
        per = w.groupby(["rank", "step", "kind", "unit", "stage"], sort=False)["d"].sum()
        m.cache["excess"] = per.unstack("rank", fill_value=0.0)
    full = m.cache["excess"]
    if rank not in full.columns or full.shape[1] < 2:
        return None, None, None, 0.0
    ex = (full[rank] - full.drop(columns=rank).median(axis=1)).groupby(level=["kind", "unit", "stage"]).sum() / max(
        len(np.unique(m.g_step)), 1)
    k = ex.idxmax()
    return tuple(m.uniques[c][x] if x >= 0 else None for c, x in zip(("kind", "unit", "stage"), k)) + (
        float(ex.max()),)


@dataclass
class CriticalPath:
    """What limits each step (µs): ``steps`` (STEP_COLUMNS), ``segments`` (SEGMENT_COLUMNS, path order per step),
    ``breakdown`` (BREAKDOWN_COLUMNS per step, step NaN: the mean per step), ``counterfactuals``
    (COUNTERFACTUAL_COLUMNS, most saved first), ``notes`` one line each."""

    steps: pd.DataFrame
    segments: pd.DataFrame
    breakdown: pd.DataFrame
    counterfactuals: pd.DataFrame
    notes: list = field(default_factory=list)
    top: pd.DataFrame | None = None       # TOP_COLUMNS: the path's segments summed over steps, most time first
    spans: pd.DataFrame | None = None     # SPAN_COLUMNS: every segment where it lies, on its rank's own clock
    model: _Model | None = field(default=None, repr=False)
    baseline_us: pd.Series | None = field(default=None, repr=False)   # replayed length per step
    contention: dict = field(default_factory=dict)    # rank -> measured CPU contention (CPU runs; >= 1)

    def to_dict(self) -> dict:
        """summary.json's ``critical_path``: steps with their segments, breakdown, counterfactuals (JSON values:
        NaN and infinities as None)."""
        segs: dict = {}            # step -> its segments, in path order
        for r in records(self.segments):
            step = r.pop("step")
            if step is not None:
                segs.setdefault(step, []).append(r)
        st = records(self.steps)
        for r in st:
            r["segments"] = segs.get(r["step"], [])
        return {"steps": st, "breakdown": records(self.breakdown), "counterfactuals": records(self.counterfactuals),
                "top": records(self.top) if self.top is not None else [], "notes": list(self.notes)}


def _saved(m: _Model, base: pd.Series, t: np.ndarray) -> float:
    """µs per step the replay ``t`` saves against ``base``: the median over steps (a step the host stalled
    once does not set it)."""
    return float((base - m.step_lengths(t)).median())


def straggler_cost_us(cp: CriticalPath, rank: int) -> float:
    """µs per step saved were ``rank``'s work between each two collective calls as fast as the median rank's
    (the counterfactual "rank R as fast as the median"); NaN without a critical path or that rank."""
    m = cp.model if cp is not None else None
    if m is None or int(rank) not in set(m.g_rank.tolist()):
        return float("nan")
    return _saved(m, cp.baseline_us, m.replay(d=_as_median(m, int(rank))))


def _contended_replay(m: _Model, rank: int, contention: dict) -> np.ndarray | None:
    """Local lengths with ``rank``'s work shrunk by the median contention over the other ranks over its own (it
    waits for a core no longer than they do: the same median as :func:`_as_median`'s); None unless every rank in
    the chains measured its contention."""
    ranks = set(m.g_rank.tolist())
    if len(ranks) < 2 or not ranks <= set(contention):
        return None
    mine = float(contention[int(rank)])
    med = float(np.median([contention[r] for r in ranks if r != int(rank)]))
    if not mine > med:
        return m.d
    sel = (m.node == NODE_LOCAL) & (m.g_rank[m.grp] == int(rank))
    return np.where(sel, m.d * (med / mine), m.d)


def t_test_greater(x: np.ndarray) -> float:
    """One-sided p-value that the mean of ``x`` is > 0 by Student's t with n - 1 degrees of freedom (the closed
    forms of its CDF for integer degrees, Abramowitz & Stegun 26.7.3-4); NaN with fewer than 2 values or no
    spread (where every value is > 0 with no spread: 0)."""
    x = np.asarray(x, dtype=np.float64)
    x = x[np.isfinite(x)]
    n = x.size
    if n < 2:
        return float("nan")
    sd = float(x.std(ddof=1))
    mean = float(x.mean())
    if not sd > 0:
        return 0.0 if mean > 0 else float("nan") if mean == 0 else 1.0
    t, nu = mean / (sd / np.sqrt(n)), n - 1
    theta = float(np.arctan(abs(t) / np.sqrt(nu)))
    c2, term, acc = np.cos(theta) ** 2, 1.0, 1.0
    if nu % 2:      # odd: 2/pi (theta + sin cos (1 + 2/3 cos^2 + 2.4/3.5 cos^4 + ...))
        for k in range(1, (nu - 1) // 2):
            term *= c2 * (2 * k) / (2 * k + 1)
            acc += term
        inside = (2 / np.pi) * (theta + (np.sin(theta) * np.cos(theta) * acc if nu > 1 else 0.0))
    else:           # even: sin (1 + 1/2 cos^2 + 1.3/2.4 cos^4 + ...)
        for k in range(1, nu // 2):
            term *= c2 * (2 * k - 1) / (2 * k)
            acc += term
        inside = np.sin(theta) * acc
    tail = max(0.0, (1.0 - float(inside)) / 2.0)
    return tail if t > 0 else 1.0 - tail


def _contended_saving(m: _Model, base: pd.Series, rank: int, contention: dict) -> pd.Series | None:
    """Per step: µs the replay with ``rank``'s CPU contention at the other ranks' median saves against ``base``
    (0 where it waits no longer than they do); None unknown (:func:`_contended_replay`)."""
    d = _contended_replay(m, int(rank), contention)
    if d is None:
        return None
    return base * 0.0 if d is m.d else base - m.step_lengths(m.replay(d=d))


def contended_cost_us(cp: CriticalPath, rank: int) -> float:
    """µs per step the critical path saves were ``rank``'s CPU contention the other ranks' median (how much of
    "rank R as fast as the median" its longer wait for a core explains: 0 when it waits no longer); NaN unknown
    (not a CPU run, a rank's load unrecorded, or no such rank)."""
    m = cp.model if cp is not None else None
    if m is None or int(rank) not in set(m.g_rank.tolist()):
        return float("nan")
    saving = _contended_saving(m, cp.baseline_us, int(rank), cp.contention)
    return float("nan") if saving is None else float(saving.median())


def rank_costs_us(cp: CriticalPath | None, rank: int) -> tuple[float, float]:
    """(:func:`straggler_cost_us`, the part of it :func:`contended_cost_us` explains, at most the cost) of
    ``rank``: the counterfactual's own numbers where the critical path tried that rank (the same replays), else
    replayed."""
    cf = cp.counterfactuals if cp is not None else None
    if cf is not None and len(cf):
        row = cf[(cf["kind"] == model.CHANGE_RANK) & (cf["rank"] == int(rank))]
        if len(row):
            return float(row["saved_us_per_step"].iat[0]), float(row["contended_us"].iat[0])
    cost, host = straggler_cost_us(cp, rank), contended_cost_us(cp, rank)
    return cost, float(np.minimum(host, cost))


def _objects(col: pd.Series) -> np.ndarray:
    """``col``'s labels as an object array, None where missing."""
    v = col.to_numpy(dtype=object)
    v[pd.isna(v)] = None
    return v


def _aggregate(seg: pd.DataFrame, by: tuple = ()) -> pd.DataFrame:
    """Segments summed by ``by`` (e.g. ``("step",)``) and (rank, kind, what, unit, stage), in order of first
    appearance (grouped on integer codes: no label is compared as an object)."""
    keys = [*by, "rank", *LABEL_COLUMNS]
    codes, uniques = {}, {}
    for c in keys:
        codes[c], uniques[c] = pd.factorize(seg[c])          # None: -1
    g = pd.DataFrame({**codes, "dur_us": seg["dur_us"].to_numpy(np.float64)}).groupby(
        keys, sort=False)["dur_us"].sum().reset_index()
    for c in keys:
        values = np.asarray(uniques[c])
        g[c] = values[g[c].to_numpy()] if c not in LABEL_COLUMNS else np.append(values.astype(object), None)[g[c]]
    return g


def critical_path(records: pd.DataFrame | None, chains: pd.DataFrame | None,
                  contention: dict | None = None) -> CriticalPath | None:
    """The critical path of every step and the counterfactuals, from all ranks' collective records (RECORD_COLUMNS
    with ``call`` the row within its rank and ``match_id``) and chains (:func:`rank_chain`); None without chains.
    ``contention``: rank -> measured CPU contention of a CPU run (``contended_us``)."""
    if chains is None or not len(chains):
        return None
    notes: list[str] = []
    if records is None or not len(records):
        records = pd.DataFrame({"rank": [], "call": [], "ts_us": [], "end_us": [], "match_id": [], "collective": [],
                                "pg": []})
    records = records.reset_index(drop=True)
    off = _offsets(records)
    m = _build(chains, records, off)
    base = m.step_lengths(m.replay())
    residual = _residual(m)
    merged, lengths = _paths(m, base.index)
    spans = merged.assign(start_us=merged["start_us"] + merged["rank"].map(off).fillna(0.0).to_numpy(np.float64))
    # a step's path with more segments than SEGMENTS_PER_STEP_MAX is summed by (rank, kind, what, unit, stage)
    long = merged["step"].map(merged["step"].value_counts()).to_numpy() > SEGMENTS_PER_STEP_MAX
    short = merged[~long][SEGMENT_COLUMNS]
    short = short.assign(**{c: _objects(short[c]) for c in LABEL_COLUMNS})
    segments = pd.concat([short, _aggregate(merged[long], by=("step",))[SEGMENT_COLUMNS]],
                         ignore_index=True).sort_values("step", kind="stable").reset_index(drop=True)
    segments["rank"] = segments["rank"].astype(np.int64)
    on_path = segments.groupby(["step", "rank"])["dur_us"].sum()
    limiting = on_path.groupby(level="step").idxmax().map(lambda sr: int(sr[1]))
    path_us = segments.groupby("step")["dur_us"].sum()
    n_ranks = pd.Series(m.g_step).value_counts()
    stp = pd.DataFrame({"step": base.index.to_numpy(np.float64), "length_us": [float(lengths[s]) for s in base.index],
                        "span_us": base.to_numpy(np.float64)})
    stp["path_us"] = stp["step"].map(path_us).fillna(0.0).to_numpy(np.float64)
    stp["limiting_rank"] = stp["step"].map(limiting).astype(object).where(stp["step"].isin(limiting.index), None)
    stp["limiting_rank_saved_us"] = np.nan
    stp["limiting_rank_us"] = 0.0
    stp["ranks"] = stp["step"].map(n_ranks).fillna(0).astype(int)
    stp["residual_us"] = residual
    stp = stp[STEP_COLUMNS]
    br = segments.groupby(["step", "kind"], sort=True)["dur_us"].sum().reset_index()
    br["pct"] = 100.0 * br["dur_us"] / br["step"].map(stp.set_index("step")["path_us"]).replace(0, np.nan)
    n_steps = max(len(stp), 1)
    mean = (segments.groupby("kind")["dur_us"].sum() / n_steps).reset_index()
    mean["pct"] = 100.0 * mean["dur_us"] / (stp["path_us"].mean() if len(stp) else np.nan)
    mean["step"] = np.nan
    breakdown = pd.concat([br, mean[BREAKDOWN_COLUMNS]], ignore_index=True)[BREAKDOWN_COLUMNS]
    top = _aggregate(segments).rename(columns={"dur_us": "us_per_step"})
    top["us_per_step"] = top["us_per_step"] / n_steps
    top["pct"] = 100.0 * top["us_per_step"] / (stp["path_us"].mean() if len(stp) else np.nan)
    top = top.sort_values("us_per_step", ascending=False, kind="mergesort").head(TOP_ROWS).reset_index(drop=True)
    spans["end_us"] = spans["start_us"] + spans["dur_us"]
    cps = CriticalPath(stp, segments, breakdown, pd.DataFrame(columns=COUNTERFACTUAL_COLUMNS), notes,
                       top[TOP_COLUMNS], spans[SPAN_COLUMNS], m, base, dict(contention or {}))
    cps.counterfactuals, per_step = _counterfactuals(cps, segments, base)
    if per_step is not None and len(per_step.columns):
        best = per_step.idxmax(axis=1)
        top = per_step.max(axis=1)
        pick = stp["step"].map(best.where(top > 0))
        stp["limiting_rank"] = pick.where(pick.notna(), stp["limiting_rank"])
        stp["limiting_rank_saved_us"] = stp["step"].map(top.where(top > 0)).to_numpy(np.float64)
    stp["limiting_rank_us"] = [float(on_path.get((s, r), 0.0)) if r == r and r is not None else 0.0
                               for s, r in zip(stp["step"], stp["limiting_rank"])]
    stp["limiting_rank"] = stp["limiting_rank"].astype("Int64")
    return cps


def _counterfactuals(cp: CriticalPath, segments: pd.DataFrame, base: pd.Series
                     ) -> tuple[pd.DataFrame, pd.DataFrame | None]:
    """(COUNTERFACTUAL_COLUMNS most saved first, per step x rank tried: µs "as fast as the median" saves)."""
    m = cp.model
    rows = []
    per_rank = {}
    mean_len = float(base.mean()) if len(base) else np.nan

    def add(change, kind, rank, unit, stage, coll, t, segment_kind=None, contended=np.nan, p_value=np.nan):
        per = base - m.step_lengths(t)
        s = float(per.median())
        rows.append({"change": change, "kind": kind, "rank": rank, "unit": unit, "stage": stage, "collective": coll,
                     "segment_kind": segment_kind, "saved_us_per_step": s,
                     "saved_pct": 100.0 * s / mean_len if mean_len else np.nan,
                     "saved_q25_us": float(per.quantile(0.25)), "contended_us": contended, "p_value": p_value})

    if len(set(m.g_rank.tolist())) > 1:
        on_path = segments.groupby("rank")["dur_us"].sum().sort_values(ascending=False)
        tried, own = {}, {}
        for r in on_path.index[:RANKS_TRIED_MAX].tolist():
            t = m.replay(d=_as_median(m, int(r)))
            per_rank[int(r)] = base - m.step_lengths(t)
            host = _contended_saving(m, base, int(r), cp.contention)
            own[int(r)] = per_rank[int(r)] - (host if host is not None else 0.0)
            tried[int(r)] = (t, host)
        for r, (t, host) in tried.items():
            kind, unit, stage, _ = rank_excess(m, r)      # where it is slower than the others
            others = [own[o] for o in own if o != r]
            against = pd.concat(others, axis=1).median(axis=1) if others else own[r] * 0.0
            # (the part of the saving explained: never more than the saving itself)
            explained = min(float(host.median()), float(per_rank[r].median())) if host is not None else np.nan
            add(f"rank {r} as fast as the median rank", model.CHANGE_RANK, r, unit, stage, None, t,
                segment_kind=kind, contended=max(explained, 0.0) if explained == explained else np.nan,
                p_value=t_test_greater((own[r] - against).to_numpy()))
    coll = segments[segments["kind"] == model.PATH_COLLECTIVE]
    if len(coll):
        c_what, c_unit, c_stage = m.codes["what"], m.codes["unit"], m.codes["stage"]
        is_comm = (m.codes["kind"] == _code(m, "kind", model.PATH_COLLECTIVE)) | (m.node != NODE_LOCAL)

        def hidden(sel):
            d = np.where(sel & (m.node == NODE_LOCAL), 0.0, m.d)
            tr = m.rec_transfer.copy()
            recs = np.unique(m.node_rec[sel & (m.node != NODE_LOCAL)])
            tr[recs[recs >= 0]] = 0.0
            return m.replay(d=d, transfer=tr)

        def label(x):
            return None if x == _NONE else x

        def code(col, x) -> int:
            """The code of label ``x`` (_NONE: none) in column ``col`` (-2: not there)."""
            return -1 if x == _NONE else _code(m, col, x)

        c = coll.assign(unit=coll["unit"].astype(object).fillna(_NONE),
                        stage=coll["stage"].astype(object).fillna(_NONE))
        keys = c.groupby(["what", "unit", "stage"])["dur_us"].sum().sort_values(ascending=False)
        for (what, unit, stage) in keys.index[:COLLECTIVES_TRIED_MAX]:
            u, st = label(unit), label(stage)
            unit_words = " of the root unit" if u == "" else f" of unit {u}" if u is not None else ""
            where = model.stage_words(st) if st else "the step"
            add(f"the {model.collective_words(what)}{unit_words} in {where} fully hidden",
                model.CHANGE_COLLECTIVE, None, u, st, what,
                hidden(is_comm & (c_what == code("what", what)) & (c_unit == code("unit", unit))
                       & (c_stage == code("stage", stage))))
        for (what, stage) in c.groupby(["what", "stage"])["dur_us"].sum().sort_values(ascending=False).index:
            st = label(stage)
            where = model.stage_words(st) if st else "the step"
            add(f"every {model.collective_words(what)} in {where} fully hidden", model.CHANGE_TYPE, None, None, st, what,
                hidden(is_comm & (c_what == code("what", what)) & (c_stage == code("stage", stage))))
        add("every collective fully hidden", model.CHANGE_ALL_COMM, None, None, None, None, hidden(is_comm))
    kinds = m.codes["kind"]
    for kind, change, words in ((model.PATH_HOST_GAP, model.CHANGE_HOST_GAPS, "no host / launch gaps"),
                                (model.PATH_DATA, model.CHANGE_DATA, "the data loader instantly ready"),
                                (model.PATH_SYNC, model.CHANGE_SYNC, "no host synchronisations")):
        sel = (kinds == _code(m, "kind", kind)) & (m.node == NODE_LOCAL)
        if sel.any():
            add(words, change, None, None, None, None, m.replay(d=np.where(sel, 0.0, m.d)))
    out = pd.DataFrame(rows, columns=COUNTERFACTUAL_COLUMNS)
    out = out.sort_values("saved_us_per_step", ascending=False, kind="mergesort").reset_index(drop=True)
    out["rank"] = out["rank"].astype("Int64")
    return out, (pd.DataFrame(per_rank) if per_rank else None)
