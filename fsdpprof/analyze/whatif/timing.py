"""Step time of another strategy: the run's compute timeline with the target's collectives placed on it
(µs, bytes; the model: docs/whatif-model.md).

Per collective type ``time = latency + wire_bytes / bandwidth`` is fitted on the run's own collectives; each
recorded step has its exposed communication cut out, the target's collectives (issued and waited for at the
units' boundaries) are run on one communication stream, and the exposure is measured with the report's
interval code. FSDP's own CPU work and the optimizer's element work are swapped for the target's
(:class:`OwnWork`); CPU contention (:mod:`.contention`) stretches a CPU run's whole step.
"""
from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np
import pandas as pd

from fsdpprof.analyze import model
from fsdpprof.analyze.comm import intervals
from fsdpprof.analyze.comm.steps import step_windows
from fsdpprof.analyze.load.frames import isin, startswith
from fsdpprof.analyze.memory import categorize as cz
from fsdpprof.analyze.trace import labels
from fsdpprof.analyze.model import ROOT_UNIT
from fsdpprof.analyze.whatif import targets as tg
from fsdpprof.analyze.whatif.units import Unit, local_numel, padded_numel

DDP_FIRST_BUCKET_BYTES = 1 << 20   # torch.distributed's _DEFAULT_FIRST_BUCKET_BYTES
DDP_BUCKET_BYTES = 25 << 20        # DistributedDataParallel(bucket_cap_mb=25)
FIT_COLLECTIVES = (model.ALL_GATHER, model.REDUCE_SCATTER, model.ALL_REDUCE, model.BROADCAST, model.ALL_TO_ALL)
ANY_COLLECTIVE = "*"   # latency_floor's key for the fastest call of any type (the pooled fit's floor)
ANCHORS = ("F0", "F1", "B0", "B1")


@dataclass
class Fit:
    """latency_us + wire_bytes * us_per_byte, per collective type; ``pooled`` for types the run lacks;
    ``gloo``: the run's collectives ran on gloo (wire bytes: :func:`fsdpprof.analyze.model.wire_factor`)."""

    by_type: dict = field(default_factory=dict)     # collective -> (latency_us, us_per_byte, samples)
    pooled: tuple | None = None
    capped: set = field(default_factory=set)        # the types whose latency fit_line capped
    gloo: bool = False

    def time_us(self, collective: str, nbytes: float, group: int) -> float:
        if group <= 1 or nbytes <= 0:
            return 0.0
        lat, per_byte, _ = self.by_type.get(collective) or self.pooled or (0.0, 0.0, 0)
        return float(lat + float(model.wire_factor(collective, group, self.gloo)) * nbytes * per_byte)

    def describe(self) -> list[str]:
        out = []
        for c, (lat, pb, n) in sorted(self.by_type.items()):
            bw = 1.0 / pb / 1e3 if pb > 0 else float("inf")
            cap = "; latency capped at the run's fastest call" if c in self.capped else ""
            out.append(f"{model.collective_words(c)}: {lat:.0f} µs + wire bytes / {bw:.2f} GB/s ({n} collectives{cap})")
        return out


def fit_line(x: np.ndarray, y: np.ndarray, floor_us: float = np.inf) -> tuple[float, float, bool]:
    """(latency_us, us_per_wire_byte, capped) of one collective type from its calls (x: wire bytes, y: µs):
    Theil-Sen, the latency at most the fastest call and ``floor_us``; capped, the slope is the median of
    (time - latency) / wire bytes (the waits for peers charged per byte moved)."""
    lat, slope = _theil_sen(x, y)
    cap = min(float(np.min(y)), float(floor_us))
    if lat <= cap:
        return lat, slope, False
    return cap, float(np.median((y - cap) / np.maximum(x, 1.0))), True


def _theil_sen(x: np.ndarray, y: np.ndarray) -> tuple[float, float]:
    """(intercept >= 0, slope >= 0) of a robust line through the points."""
    if len(np.unique(x)) < 2:
        return 0.0, float(np.median(y / np.maximum(x, 1.0)))
    if len(x) > 400:
        sel = np.linspace(0, len(x) - 1, 400).astype(int)
        x, y = x[sel], y[sel]
    i, j = np.triu_indices(len(x), 1)
    dx = x[j] - x[i]
    ok = dx != 0
    slope = max(float(np.median((y[j] - y[i])[ok] / dx[ok])) if ok.any() else 0.0, 0.0)
    lat = max(float(np.median(y - slope * x)), 0.0)
    if slope == 0.0:
        slope = float(np.median(np.maximum(y - lat, 0.0) / np.maximum(x, 1.0)))
    return lat, slope


@dataclass(frozen=True)
class CollectiveSamples:
    """One rank's collectives a :class:`Fit` is made of: type, wire bytes, time (µs); ``gloo``: ran on gloo."""

    collective: np.ndarray
    wire_bytes: np.ndarray
    dur_us: np.ndarray
    gloo: bool = False


def collective_samples(events: pd.DataFrame) -> CollectiveSamples:
    """The rank's collectives of known size, group and time (a call of no time measures no latency)."""
    c = events[isin(events["kind"], [model.KIND_COMM])]
    coll = c["collective"].astype(object).to_numpy()
    nb, gs, dur = (c[k].to_numpy(float) for k in ("bytes", "group_size", "dur_us"))
    ok = (np.isin(coll, FIT_COLLECTIVES) & np.isfinite(nb) & (nb > 0) & np.isfinite(gs) & (gs > 1)
          & np.isfinite(dur) & (dur > 0))
    gloo = bool(startswith(c["name"], (model.GLOO_PREFIX,)).any())
    return CollectiveSamples(coll[ok].astype(str), nb[ok] * model.wire_factor(coll[ok], gs[ok], gloo), dur[ok], gloo)


def latency_floor(samples: list[CollectiveSamples]) -> dict[str, float]:
    """Per collective type, the fastest call on any rank (µs; :data:`ANY_COLLECTIVE`: of any type): the
    group's latency, which a rank whose every call waits for a slower peer never shows on its own."""
    out: dict[str, float] = {}
    for s in samples:
        for t in np.unique(s.collective):
            out[str(t)] = min(out.get(str(t), np.inf), float(s.dur_us[s.collective == t].min()))
    if out:
        out[ANY_COLLECTIVE] = min(out.values())
    return out


def fit_collectives(events: pd.DataFrame | CollectiveSamples, floor: dict[str, float] | None = None) -> Fit:
    """One rank's collectives (events frame or samples) -> :class:`Fit`, latencies at most ``floor``'s."""
    s = events if isinstance(events, CollectiveSamples) else collective_samples(events)
    floor = floor or {}
    fit = Fit(gloo=s.gloo)
    if not len(s.dur_us):
        return fit
    for t in np.unique(s.collective):
        m = s.collective == t
        lat, pb, capped = fit_line(s.wire_bytes[m], s.dur_us[m], floor.get(str(t), np.inf))
        fit.by_type[str(t)] = (lat, pb, int(m.sum()))
        if capped:
            fit.capped.add(str(t))
    lat, pb, _ = fit_line(s.wire_bytes, s.dur_us, floor.get(ANY_COLLECTIVE, np.inf))
    fit.pooled = (lat, pb, len(s.dur_us))
    return fit


def trace_schedule(events: pd.DataFrame, units: list[Unit], memory_schedule: dict | None,
                   same_clock: bool) -> dict[float, dict]:
    """Per ProfilerStep number: bwd_end and per unit F0, F1, B0, B1 (trace µs), with the units' forward and
    backward order. From FSDP2's annotations; else the memory schedule (on the trace's clock); else the
    stages split by parameter count."""
    marks = labels.step_marks(events)
    if not len(marks):
        return {}
    ann = labels.fsdp_intervals(events)
    scopes = cz.unit_scopes(ann) if len(ann) and ann["unit"].notna().any() else None
    fwd_order = [u.fqn for u in sorted(units, key=lambda u: u.order)]
    numel = {u.fqn: u.numel for u in units}
    mem_by_start = {}
    for sc in (memory_schedule or {}).values() if same_clock else ():
        k = np.searchsorted(marks["start_us"].to_numpy(float), sc["fwd_start"], side="right") - 1
        if k >= 0:
            mem_by_start[int(k)] = sc
    out = {}
    for k, m in marks.reset_index(drop=True).iterrows():
        start, end = float(m["start_us"]), float(m["end_us"])
        if not np.isfinite(m["bwd_us"]):
            continue
        fwd_start = float(m["fwd_us"]) if np.isfinite(m["fwd_us"]) else start
        bwd_start = float(m["bwd_us"])
        opt = float(m["opt_us"]) if np.isfinite(m["opt_us"]) and m["opt_us"] > bwd_start else end
        a = {u: dict.fromkeys(ANCHORS, np.nan) for u in fwd_order}
        if scopes is not None and len(scopes):
            sc = scopes[(scopes["ts_us"] >= start) & (scopes["ts_us"] <= end) & scopes["unit"].isin(set(numel))]
            for row in sc.itertuples(index=False):
                k0, k1 = ("F0", "F1") if row.ts_us < bwd_start else ("B0", "B1")
                if np.isnan(a[row.unit][k0]):
                    a[row.unit][k0], a[row.unit][k1] = float(row.ts_us), float(row.end_us)
            bwd_end = max([v["B1"] for v in a.values() if np.isfinite(v["B1"])] + [bwd_start])
            bwd_end = max(bwd_end, min(opt, end)) if opt < end else bwd_end
        elif int(k) in mem_by_start:
            ms = mem_by_start[int(k)]
            a = {u: {key: ms["units"][u][key] for key in ANCHORS} for u in fwd_order}
            bwd_end = float(ms["bwd_end"])
        else:
            bwd_end = opt
        _fill(a, fwd_order, numel, fwd_start, bwd_start, bwd_end)
        out[float(m["step"])] = {"bwd_end": bwd_end, "units": a, "fwd_order": fwd_order,
                                 "bwd_order": [fwd_order[0]] + sorted(fwd_order[1:], key=lambda u: a[u]["B1"])}
    return out


def _fill(a: dict, fwd_order: list[str], numel: dict, fwd_start: float, bwd_start: float, bwd_end: float) -> None:
    """Anchors no record gave: each pass split by parameter count, in forward / backward order."""
    root, layers = fwd_order[0], fwd_order[1:]
    total = sum(numel[u] for u in layers) or 1
    for order, k0, k1, given, t0, t1 in ((layers, "F0", "F1", "F0", fwd_start, bwd_start),
                                         (layers[::-1], "B0", "B1", "B1", bwd_start, bwd_end)):
        t = t0
        for u in order:
            d = (t1 - t0) * numel[u] / total
            if np.isnan(a[u][given]):
                a[u][k0], a[u][k1] = t, t + d
            t += d
    for key, v in zip(ANCHORS, (fwd_start, bwd_start, bwd_start, bwd_end)):
        if np.isnan(a[root][key]):
            a[root][key] = v
    for u in layers:
        for key, other in (("F1", "F0"), ("B0", "B1")):
            if np.isnan(a[u][key]):
                a[u][key] = a[u][other]


def target_collectives(target: tg.Target, units: list[Unit], sc: dict, sync: bool,
                       run_buckets: list[dict] | None = None) -> list[dict]:
    """The target's collectives of one step: collective, bytes, group, issue_us, wait_us (trace clock), phase.
    ``run_buckets``: a DDP run's own bucket all-reduces, kept for a DDP target over the same ranks."""
    out = []
    a, fwd, bwd = sc["units"], sc["fwd_order"], sc["bwd_order"]
    pt, rt = model.dtype_bytes(target.param_dtype), model.dtype_bytes(target.reduce_dtype)
    n, k = target.world_size, target.shard_group
    end_bwd = sc["bwd_end"]
    numel = {u.fqn: u.numel for u in units}

    def add(coll, nbytes, group, issue, wait, phase):
        if group > 1 and nbytes > 0:
            out.append({"collective": coll, "bytes": float(nbytes), "group": int(group), "issue_us": float(issue),
                        "wait_us": float(issue if sync else max(wait, issue)), "phase": phase})

    if target.strategy == tg.DDP and run_buckets:
        for c in run_buckets:
            add(c["collective"], c["bytes"], c["group"], c["issue_us"], end_bwd, "ddp_bucket")
    elif target.strategy == tg.DDP:
        # buckets in backward order, ready when the last gradient in them is
        size, cap, ready = 0.0, DDP_FIRST_BUCKET_BYTES, None
        for u in bwd[1:] + bwd[:1]:
            size += numel[u] * pt
            ready = a[u]["B1"]
            if size >= cap:
                add(model.ALL_REDUCE, size, n, ready, end_bwd, "ddp_bucket")
                size, cap = 0.0, DDP_BUCKET_BYTES
        if size:
            add(model.ALL_REDUCE, size, n, ready, end_bwd, "ddp_bucket")
    elif target.strategy == tg.NO_SHARD:
        for u in bwd:
            add(model.ALL_REDUCE, numel[u] * rt, n, a[u]["B1"], end_bwd, model.PHASE_POST_BACKWARD)
    else:
        raf = target.reshard_after_forward
        for i, u in enumerate(fwd):
            wait = a[u]["F0"]
            issue = wait if (sync or i == 0) else a[fwd[i - 1]]["F0"]
            add(model.ALL_GATHER, padded_numel(numel[u], k) * pt, k, issue, wait, "forward all_gather")
        if raf is not False:
            order = [u for u in bwd if not (target.family == model.FAMILY_FSDP1 and u == ROOT_UNIT)]
            for j, u in enumerate(order):
                add(model.ALL_GATHER, padded_numel(numel[u], k) * pt, tg.reshard_ranks(raf) or k,
                    a[order[j - 1]]["B0"] if j > 0 else a[u]["B0"], a[u]["B0"], "backward all_gather")
        for u in bwd[1:] + bwd[:1]:
            add(model.REDUCE_SCATTER, padded_numel(numel[u], k) * rt, k, a[u]["B1"], end_bwd,
                model.PHASE_POST_BACKWARD_REDUCE)
            if target.replicas > 1:
                add(model.ALL_REDUCE, local_numel(numel[u], k) * rt, target.replicas, a[u]["B1"], end_bwd,
                    "hsdp all_reduce")
    return out


@dataclass(frozen=True)
class FamilyOverhead:
    """A family's own CPU work on a rank (None: unknown): µs per byte gathered and per byte reduced (inside its
    gather / reduce annotations, less the communication waited for there), µs of DTensor dispatch per parameter
    tensor and step, DDP's reducer µs per step, µs per byte of a reduction by all-reduce alone (a yardstick of
    the machine, not charged) and the compute share of each work. ``how``: measured or documented."""

    family: str
    gather_us_per_byte: float | None
    reduce_us_per_byte: float | None
    dispatch_us_per_param: float | None
    how: str = "measured"
    reducer_us_per_step: float = 0.0
    allreduce_us_per_byte: float | None = None
    gather_compute_share: float | None = None
    reduce_compute_share: float | None = None
    reducer_compute_share: float | None = None

    def step_us(self, gathered_bytes: float, reduced_bytes: float, params: int) -> float:
        """This overhead over one step (µs): gathered / reduced bytes, parameter tensors (unknown parts 0)."""
        return ((self.gather_us_per_byte or 0.0) * gathered_bytes + (self.reduce_us_per_byte or 0.0) * reduced_bytes
                + (self.dispatch_us_per_param or 0.0) * params + self.reducer_us_per_step)

    def compute_us(self, gathered_bytes: float, reduced_bytes: float) -> float:
        """The compute part of :meth:`step_us` (µs; an unknown share counts as none)."""
        return ((self.gather_us_per_byte or 0.0) * gathered_bytes * (self.gather_compute_share or 0.0)
                + (self.reduce_us_per_byte or 0.0) * reduced_bytes * (self.reduce_compute_share or 0.0)
                + self.reducer_us_per_step * (self.reducer_compute_share or 0.0))


# A family the run does not have (CPU runs), at contention 1 on the reference machine: the median over the ranks
# of benchmarks/bench_whatif.py's recordings of fsdpprof's example (2-core AMD EPYC, torch 2.13, gloo, fp32;
# 2026-12-01), each rank's figure divided by its contention; scaled to the run's machine by machine_factor.
DOCUMENTED_OVERHEAD = {
    model.FAMILY_FSDP2: FamilyOverhead(model.FAMILY_FSDP2, 1.565e-3, 3.450e-3, 481.0, "documented",
                            gather_compute_share=0.36, reduce_compute_share=0.63),
    model.FAMILY_FSDP1: FamilyOverhead(model.FAMILY_FSDP1, 0.616e-3, 1.712e-3, 0.0, "documented", allreduce_us_per_byte=0.480e-3,
                            gather_compute_share=0.08, reduce_compute_share=0.62),
    model.FAMILY_DDP: FamilyOverhead(model.FAMILY_DDP, 0.0, 0.0, 0.0, "documented", allreduce_us_per_byte=0.543e-3),
}


def machine_factor(run: FamilyOverhead, contention: float | None) -> float | None:
    """How much longer the run's machine takes for FSDP's own work than the reference machine: the geometric
    mean of measured / (documented x contention) over the figures the run measured; None without any."""
    doc = DOCUMENTED_OVERHEAD.get(run.family)
    if doc is None:
        return None
    c = contention or 1.0
    logs = [np.log(m / (d * c)) for m, d in ((run.gather_us_per_byte, doc.gather_us_per_byte),
                                             (run.reduce_us_per_byte, doc.reduce_us_per_byte),
                                             (run.dispatch_us_per_param, doc.dispatch_us_per_param),
                                             (run.allreduce_us_per_byte, doc.allreduce_us_per_byte))
            if m is not None and d and m > 0 and np.isfinite(m)]
    return float(np.exp(np.mean(logs))) if logs else None


def _comm(events: pd.DataFrame) -> pd.DataFrame:
    return events[isin(events["kind"], [model.KIND_COMM])]


def _intervals(events: pd.DataFrame) -> tuple[np.ndarray, np.ndarray]:
    t0 = events["ts_us"].to_numpy(float)
    return t0, t0 + events["dur_us"].to_numpy(float)


def gather_reduce_overhead(events: pd.DataFrame, family: str,
                           work: dict | None = None) -> tuple[float | None, float | None]:
    """The family's CPU time per gathered and per reduced byte (µs/byte), None where the run has none.
    ``work``: the run's :func:`_family_work`, when already known."""
    work = _family_work(events, family) if work is None else work
    return _per_byte(events, work["gather"], model.ALL_GATHER), _per_byte(events, work["reduce"], model.REDUCE_SCATTER)


def allreduce_overhead(events: pd.DataFrame, family: str, work: dict | None = None) -> float | None:
    """Where gradients are reduced by all-reduce alone: the reduction's own CPU time per byte all-reduced
    (µs/byte; FSDP1 NO_SHARD's post-backward hooks less their communication, DDP's reducer); else None."""
    comm = _comm(events)
    if isin(comm["collective"], [model.REDUCE_SCATTER]).any():
        return None
    nbytes = float(comm.loc[isin(comm["collective"], [model.ALL_REDUCE]), "bytes"].sum())
    if not nbytes > 0:
        return None
    if family == model.FAMILY_DDP:
        us = ddp_reducer_us(events)
        return us / nbytes if us > 0 else None
    if family != model.FAMILY_FSDP1:
        return None
    return _per_byte(events, (_family_work(events, family) if work is None else work)["reduce"], model.ALL_REDUCE)


def _family_work(events: pd.DataFrame, family: str) -> dict:
    """{"gather": w, "reduce": w}: w = (µs of the family's annotations of those phases less the communication
    inside them, µs of compute inside them), None where it has none."""
    out: dict = {"gather": None, "reduce": None}
    ann = labels.fsdp_intervals(events) if family in model.GATHER_OVERHEAD_PHASES else ()
    if not len(ann):
        return out
    ann = ann[ann["family"] == family]
    comm, comp = _kind_intervals(events)
    for key, phases in (("gather", model.GATHER_OVERHEAD_PHASES[family]),
                        ("reduce", model.REDUCE_OVERHEAD_PHASES[family])):
        sel = ann[ann["fsdp_phase"].isin(phases)]
        if len(sel):
            out[key] = _work_in(*intervals.union(sel["ts_us"].to_numpy(float), sel["end_us"].to_numpy(float)),
                                comm, comp)
    return out


def _per_byte(events: pd.DataFrame, work: tuple[float, float] | None, collective: str) -> float | None:
    """A work's µs over the bytes of the run's ``collective`` calls; None where either is missing."""
    if work is None:
        return None
    comm = _comm(events)
    nbytes = comm.loc[isin(comm["collective"], [collective]), "bytes"].sum()
    return max(work[0], 0.0) / float(nbytes) if nbytes else None


def _kind_intervals(events: pd.DataFrame) -> tuple[tuple, tuple]:
    """(the communication events' (start, end), the union of the compute events' (start, end))."""
    return _intervals(_comm(events)), intervals.union(*_intervals(events[isin(events["kind"], [model.KIND_COMPUTE])]))


def _work_in(s: np.ndarray, e: np.ndarray, comm: tuple, comp: tuple) -> tuple[float, float]:
    """(µs of the disjoint intervals s..e less the communication inside them, µs of compute inside them)."""
    busy = float((e - s).sum()) - float(intervals.overlap_with(s, e, *comm).sum())
    i_s, i_e = intervals.intersect(s, e, *comp)
    return busy, float((i_e - i_s).sum())


def _share(work: tuple[float, float] | None) -> float | None:
    return min(work[1] / work[0], 1.0) if work and work[0] > 0 else None


def compute_shares(events: pd.DataFrame, family: str,
                   work: dict | None = None) -> tuple[float | None, float | None, float | None]:
    """The compute share of the family's gather work, of its reduce work and of DDP's reducer ranges (None
    where the run has none of that work)."""
    work = _family_work(events, family) if work is None else work
    reducer = None
    if family == model.FAMILY_DDP:
        busy = comp = 0.0
        for ln, s, e in _reducer_spans(events):
            b, c = _work_in(s, e, *_kind_intervals(events[(events["lane"].astype(object) == ln).to_numpy()]))
            busy, comp = busy + b, comp + c
        reducer = _share((busy, comp))
    return _share(work["gather"]), _share(work["reduce"]), reducer


def _nesting(ts: np.ndarray, te: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Of intervals sorted by start (longest first): each one's parent (-1: none), number of children and
    time covered by its children (µs)."""
    parent = np.full(len(ts), -1)
    children = np.zeros(len(ts), int)
    inner = np.zeros(len(ts))
    stack: list[int] = []
    for i in range(len(ts)):
        while stack and te[stack[-1]] <= ts[i]:
            stack.pop()
        if stack:
            parent[i] = stack[-1]
            children[stack[-1]] += 1
            inner[stack[-1]] += min(te[i], te[stack[-1]]) - ts[i]
        stack.append(i)
    return parent, children, inner


def _lanes(events: pd.DataFrame, lanes):
    """Per lane: (ts, te, names, is_op) of its events sorted by start, longest first."""
    events = events[isin(events["lane"], list(lanes))]      # (names as text only on these lanes)
    names = events["name"].astype(str).to_numpy()
    lane = events["lane"].astype(object).to_numpy()
    is_op = ~isin(events["kind"], [model.KIND_ANNOTATION])
    t0, t1 = _intervals(events)
    for ln in lanes:
        on = np.flatnonzero(lane == ln)
        o = on[np.lexsort((-t1[on], t0[on]))]
        yield t0[o], t1[o], names[o], is_op[o]


def dtensor_dispatch_us(events: pd.DataFrame) -> float:
    """DTensor dispatch on the trace (µs, all steps): each tensor-subclass dispatch op's time outside the local
    ops it runs, with the ops (not annotations) whose only child it is."""
    hit = isin(events["name"], [model.TENSOR_SUBCLASS_DISPATCH])
    if not hit.any():
        return 0.0
    total = 0.0
    for ts, te, nm, op in _lanes(events, pd.unique(events["lane"].astype(object).to_numpy()[hit])):
        parent, children, inner = _nesting(ts, te)
        for i in np.flatnonzero(nm == model.TENSOR_SUBCLASS_DISPATCH):
            top = i
            while parent[top] >= 0 and children[parent[top]] == 1 and op[parent[top]]:
                top = parent[top]
            total += (te[top] - ts[top]) - inner[i]
    return float(total)


def optimizer_element_us(events: pd.DataFrame) -> float:
    """The optimizer's element work on the trace (µs, all steps): the self time of the aten ops inside its
    steps (DTensor wrappers left out); its Python loop over tensors is not in it."""
    is_opt = startswith(events["name"], (model.OPTIMIZER_PREFIX,))
    opt = events[is_opt]
    if not len(opt):
        return 0.0
    s, e = intervals.union(*_intervals(opt))
    t = events["ts_us"].to_numpy(float)
    k = np.searchsorted(s, t, side="right") - 1
    inside = events[(k >= 0) & (t < e[np.clip(k, 0, None)]) & ~is_opt]
    element = 0.0
    for ts, te, nm, _ in _lanes(inside, pd.unique(opt["lane"].astype(object))):
        parent, _, inner = _nesting(ts, te)
        wraps = np.zeros(len(ts), bool)
        wraps[parent[(nm == model.TENSOR_SUBCLASS_DISPATCH) & (parent >= 0)]] = True
        aten = np.char.startswith(nm.astype(str), "aten::") & ~wraps
        element += float(((te - ts) - inner)[aten].sum())
    return element


def ddp_reducer_us(events: pd.DataFrame) -> float:
    """DDP's reducer work on the trace (µs, all steps): the time its record_function ranges cover per lane."""
    return float(sum((e - s).sum() for _, s, e in _reducer_spans(events)))


def _reducer_spans(events: pd.DataFrame):
    """Per lane with DDP reducer ranges: (the lane, the union of its ranges as (start, end) arrays)."""
    red = events[startswith(events["name"], model.DDP_REDUCER_PREFIXES)]
    lane = red["lane"].astype(object).to_numpy()
    t0, t1 = _intervals(red)
    for ln in pd.unique(lane):
        yield (ln, *intervals.union(t0[lane == ln], t1[lane == ln]))


def run_overhead(events: pd.DataFrame, family: str, params: int, steps: int) -> FamilyOverhead:
    """The run's own :class:`FamilyOverhead`, measured on its trace (``steps`` recorded steps, ``params``
    parameter tensors)."""
    work = _family_work(events, family)
    ag, rs = gather_reduce_overhead(events, family, work)
    dispatch = dtensor_dispatch_us(events) / max(steps, 1) / max(params, 1) if family == model.FAMILY_FSDP2 else 0.0
    reducer = ddp_reducer_us(events) / max(steps, 1) if family == model.FAMILY_DDP else 0.0
    g_share, r_share, red_share = compute_shares(events, family, work)
    return FamilyOverhead(family, ag, rs, dispatch, reducer_us_per_step=reducer,
                          allreduce_us_per_byte=allreduce_overhead(events, family, work),
                          gather_compute_share=g_share, reduce_compute_share=r_share, reducer_compute_share=red_share)


def target_overhead(run: FamilyOverhead, target_family: str, device_type: str,
                    contention: float | None) -> FamilyOverhead | None:
    """The target family's overhead: the run's where it is the same family and measured it; else, on a CPU run,
    :data:`DOCUMENTED_OVERHEAD` x the run's contention x :func:`machine_factor` for what it lacks; None (not
    charged) on an accelerator."""
    if target_family == run.family and (run.family == model.FAMILY_DDP or run.gather_us_per_byte is not None
                                        and run.reduce_us_per_byte is not None):
        return run                     # (DDP: its reducer, all it has, is measured)
    if device_type != "cpu" or target_family not in DOCUMENTED_OVERHEAD:
        return run if target_family == run.family else None
    d = DOCUMENTED_OVERHEAD[target_family]
    c = (contention or 1.0) * (machine_factor(run, contention) or 1.0)
    if target_family != run.family:
        return FamilyOverhead(target_family, d.gather_us_per_byte * c, d.reduce_us_per_byte * c,
                              d.dispatch_us_per_param * c, "documented", gather_compute_share=d.gather_compute_share,
                              reduce_compute_share=d.reduce_compute_share)
    g, r = run.gather_us_per_byte is not None, run.reduce_us_per_byte is not None    # measured what it could
    return FamilyOverhead(run.family, run.gather_us_per_byte if g else d.gather_us_per_byte * c,
                          run.reduce_us_per_byte if r else d.reduce_us_per_byte * c, run.dispatch_us_per_param,
                          "measured+documented", run.reducer_us_per_step, run.allreduce_us_per_byte,
                          run.gather_compute_share if g else d.gather_compute_share,
                          run.reduce_compute_share if r else d.reduce_compute_share, run.reducer_compute_share)


@dataclass(frozen=True)
class OwnWork:
    """The run's CPU work that the target changes, per step: FSDP's own (``run`` measured, ``target``:
    :func:`target_overhead`, None: not charged) over ``params`` parameter tensors, and the optimizer's element
    work (µs) x ``element_ratio`` (the target's local parameter elements over the run's); ``machine``:
    :func:`machine_factor` of the run."""

    run: FamilyOverhead
    target: FamilyOverhead | None
    params: int
    optimizer_element_us: float
    element_ratio: float
    machine: float | None = None


@dataclass
class StepTime:
    step_us: float
    compute_us: float
    comm_us: float
    exposed_comm_us: float


@dataclass
class RunStep:
    """One recorded step of one rank, ready to be replayed: its window (µs), compute intervals, the run's
    exposed communication (cut out: ``xs``/``xe``, ``cum`` their running length), its collectives
    ((type, bytes, group, pass), µs) and DDP's bucket all-reduces, and the bytes it gathered / reduced."""

    step: float
    w0: float
    w1: float
    cs: np.ndarray
    ce: np.ndarray
    xs: np.ndarray
    xe: np.ndarray
    cum: np.ndarray
    pool: list
    buckets: list
    run_ag_bytes: float
    run_rs_bytes: float

    @property
    def length(self) -> float:
        return (self.w1 - self.w0) - float(self.cum[-1])

    def squeeze(self, t):
        """Times of the step on the clock without the run's exposed communication (µs from the step start)."""
        t = np.clip(np.asarray(t, dtype=float), self.w0, self.w1)
        k = np.searchsorted(self.xs, t, side="right")
        last = np.clip(k - 1, 0, None)
        inside = np.where(k > 0, np.clip(np.minimum(t, self.xe[last]) - self.xs[last], 0, None), 0.0) \
            if len(self.xs) else np.zeros(np.shape(t))
        return t - self.w0 - self.cum[np.maximum(k - 1, 0)] * (k > 0) - inside


def comm_beside_training_thread(source: tg.Source) -> bool:
    """Whether the run's collectives ran beside its training thread: DDP on CPU (gloo's all-reduces on their
    own thread during the backward); FSDP's gloo collectives block the thread."""
    return source.device_type == "cpu" and source.strategy == tg.DDP


def run_steps(events: pd.DataFrame, tsched: dict, async_host_comm: bool = False) -> list[RunStep]:
    """The recorded steps of this rank that have a schedule, as :class:`RunStep`. The run's exposed
    communication is its communication outside compute; with ``async_host_comm`` outside any work of the
    training threads (compute and CPU ops): only where the training thread had nothing to do did it wait."""
    ts, te = _intervals(events)
    is_comp = isin(events["kind"], [model.KIND_COMPUTE])
    is_comm = isin(events["kind"], [model.KIND_COMM])
    busy = is_comp
    if async_host_comm and is_comm.any():
        lane = events["lane"].astype(object).to_numpy()
        busy = isin(events["kind"], [model.KIND_COMPUTE, model.KIND_CPU_OP]) & ~np.isin(lane, list(set(lane[is_comm])))
    coll = events["collective"].astype(object).to_numpy()
    nbytes, group, launch = (events[c].to_numpy(float) for c in ("bytes", "group_size", "launch_ts_us"))
    fwd = (events["stage"].astype(object) == model.STAGE_FORWARD).to_numpy()
    out = []
    for row in step_windows(events).itertuples(index=False):
        if float(row.step) not in tsched:
            continue
        w0, w1 = float(row.start_us), float(row.end_us)
        inw = (te > w0) & (ts < w1)
        comp, comm, work = inw & is_comp, inw & is_comm, inw & busy
        xs, xe = intervals.difference(np.clip(ts[comm], w0, w1), np.clip(te[comm], w0, w1),
                                      np.clip(ts[work], w0, w1), np.clip(te[work], w0, w1))
        ci = np.flatnonzero(comm)
        ci = ci[np.argsort(ts[ci], kind="stable")]
        keys = [(coll[i], int(round(nbytes[i])) if np.isfinite(nbytes[i]) else 0,
                 int(group[i]) if np.isfinite(group[i]) else 0, "f" if fwd[i] else "b") for i in ci]
        buckets = [{"collective": k[0], "bytes": float(k[1]), "group": k[2],
                    "issue_us": float(launch[i] if np.isfinite(launch[i]) else ts[i])}
                   for k, i in zip(keys, ci) if k[0] == model.ALL_REDUCE]
        moved = [float(np.nansum(nbytes[ci][coll[ci] == c])) if len(ci) else 0.0
                 for c in (model.ALL_GATHER, model.REDUCE_SCATTER)]
        out.append(RunStep(float(row.step), w0, w1, np.clip(ts[comp], w0, w1), np.clip(te[comp], w0, w1), xs, xe,
                           np.concatenate([[0.0], np.cumsum(xe - xs)]),
                           [(k, float(te[i] - ts[i])) for k, i in zip(keys, ci)], buckets, *moved))
    return out


def predict_step(rs: RunStep, sc: dict, target: tg.Target, units: list[Unit], fit: Fit, source: tg.Source,
                 own: OwnWork, sync: bool) -> StepTime:
    """One recorded step replayed with the target's collectives (schedule ``sc``)."""
    # a target collective the run had too (same type, size, group and pass) keeps its measured time, in order
    pool: dict = {}
    for key, d in rs.pool:
        pool.setdefault(key, []).append(d)
    same_ddp = (target.strategy == tg.DDP and source.strategy == tg.DDP and target.world_size == source.world_size
                and model.dtype_bytes(target.reduce_dtype) == model.dtype_bytes(source.reduce_dtype))
    colls = target_collectives(target, units, sc, sync, rs.buckets if same_ddp else None)
    for c in sorted(colls, key=lambda c: c["issue_us"]):
        key = (c["collective"], int(round(c["bytes"])), int(c["group"]),
               "f" if c["phase"].startswith(model.STAGE_FORWARD) else "b")
        c["measured"] = bool(pool.get(key))
        c["dur_us"] = pool[key].pop(0) if c["measured"] else fit.time_us(c["collective"], c["bytes"], c["group"])
    # one communication stream in issue order; a wait that is not done delays everything after it
    issue = rs.squeeze([c["issue_us"] for c in colls]) if colls else np.zeros(0)
    wait = rs.squeeze([c["wait_us"] for c in colls]) if colls else np.zeros(0)
    evs = sorted([(float(p), 0, i) for i, p in enumerate(issue)] + [(float(p), 1, i) for i, p in enumerate(wait)])
    shift, free_at = 0.0, 0.0
    waits_p, waits_d = [], []
    starts, ends = np.zeros(len(colls)), np.zeros(len(colls))
    for p, kind, i in evs:
        if kind == 0:
            starts[i] = max(p + shift, free_at)
            ends[i] = free_at = starts[i] + colls[i]["dur_us"]
        elif ends[i] > p + shift:
            waits_p.append(p)
            waits_d.append(ends[i] - (p + shift))
            shift += ends[i] - (p + shift)
    # the run's compute on the compressed clock, delayed by the waits before it; exposure as the report's
    pc0, pc1 = rs.squeeze(rs.cs), rs.squeeze(rs.ce)
    wd = np.concatenate([[0.0], np.cumsum(waits_d)])
    delay = wd[np.searchsorted(np.asarray(waits_p), pc0, side="right")] if waits_p else np.zeros(len(pc0))
    c0, c1 = pc0 + delay, pc1 + delay
    compute_us = intervals.total(c0, c1)
    comm_us = intervals.total(starts, ends)
    both_s, both_e = intervals.intersect(starts, ends, c0, c1)
    exposed = comm_us - float((both_e - both_s).sum())
    step_us = rs.length + shift
    if target.batch_scale != 1.0:
        extra = (target.batch_scale - 1.0) * float(intervals.total(rs.cs, rs.ce))
        step_us += extra
        compute_us += extra
    # the rest can only shrink to nothing (a step is at least its compute and exposed communication)
    step_us = max(step_us, compute_us + exposed)
    # FSDP's own CPU work and the optimizer's element work: the target's instead of the run's, as compute (the
    # aten ops) or the rest (Python); work taken out of one part beyond what it holds leaves the other
    tgt_ag = sum(c["bytes"] for c in colls if c["collective"] == model.ALL_GATHER)
    tgt_rs = sum(c["bytes"] for c in colls if c["collective"] == model.REDUCE_SCATTER)
    d_compute = own.optimizer_element_us * (own.element_ratio - 1.0)
    d_rest = 0.0
    if own.target is not None:
        t_all, t_comp = own.target.step_us(tgt_ag, tgt_rs, own.params), own.target.compute_us(tgt_ag, tgt_rs)
        r_all = own.run.step_us(rs.run_ag_bytes, rs.run_rs_bytes, own.params)
        r_comp = own.run.compute_us(rs.run_ag_bytes, rs.run_rs_bytes)
        d_compute += t_comp - r_comp
        d_rest += (t_all - t_comp) - (r_all - r_comp)
    rest_us = step_us - compute_us - exposed + d_rest
    compute_us += d_compute
    if compute_us < 0:
        rest_us, compute_us = rest_us + compute_us, 0.0
    if rest_us < 0:
        compute_us, rest_us = max(compute_us + rest_us, 0.0), 0.0
    return StepTime(compute_us + exposed + rest_us, compute_us, comm_us, exposed)


def predict_time(steps: list[RunStep], tsched: dict, target: tg.Target, units: list[Unit], fit: Fit,
                 source: tg.Source, own: OwnWork,
                 step_scale: float = 1.0) -> tuple[list[StepTime], list[str], list[str]]:
    """Every recorded step of this rank replayed (:func:`predict_step`), x ``step_scale`` (the target's CPU
    contention over the run's), with what was kept / assumed."""
    # on CPU, FSDP's gloo collectives block the training thread (no streams); DDP's run behind backward
    sync = source.device_type == "cpu" and target.strategy != tg.DDP
    out = [predict_step(rs, tsched[rs.step], target, units, fit, source, own, sync) for rs in steps]
    if step_scale != 1.0:
        out = [StepTime(s.step_us * step_scale, s.compute_us * step_scale, s.comm_us * step_scale,
                        s.exposed_comm_us * step_scale) for s in out]
    cut = ("the training thread's waits for communication cut out" if comm_beside_training_thread(source)
           else "its exposed communication cut out")
    kept = [f"the run's compute and CPU time per step ({cut})",
            "the measured time of each collective the run had too (same type, size, group and pass)",
            "for the others, latency and bandwidth fitted on the rank's own collectives of that type, the latency "
            "at most the fastest such call on any rank (see fits)"]
    ddp = target.strategy == tg.DDP
    if ddp:
        assumed = ["DDP's bucket all-reduces run behind the backward and are waited for at its end"]
    elif sync:
        assumed = ["FSDP's collectives block the training thread on CPU (gloo, no streams: as recorded)"]
    else:
        assumed = ["forward all-gathers prefetched one unit ahead, backward ones one unit ahead (FSDP's "
                   "default), reductions waited for at the end of backward"]
    if fit.gloo:
        assumed.append("gloo runs a reduce-scatter as an all-reduce of its whole input: timed by the bytes that "
                       "all-reduce moves, 2(n-1)/n of the input, in the fit and in the target")
    used = {model.ALL_REDUCE} if ddp else {model.ALL_GATHER, model.REDUCE_SCATTER, model.ALL_REDUCE}
    if used - set(fit.by_type):
        assumed.append("collective types the run lacks use the fit of all its collectives together")
    assumed += own_work_assumed(own, source, target)
    if ddp:
        assumed.append("DDP buckets of 25 MiB (the first 1 MiB) filled unit by unit in backward order")
    if target.batch_scale != 1.0:
        assumed.append(f"compute time x{target.batch_scale:g} with the local batch; the rest unchanged")
    if model.dtype_bytes(target.param_dtype) != model.dtype_bytes(source.param_dtype):
        assumed.append("compute time kept as measured whatever the compute dtype")
    return out, kept, assumed


def own_work_for(run: FamilyOverhead, optimizer_element_us: float, params: int, source: tg.Source,
                 target: tg.Target, units: list[Unit], contention: float | None) -> OwnWork:
    """:class:`OwnWork` of one target: the target family's overhead and its local parameter elements."""
    def local(k):
        return sum(local_numel(u.numel, k) for u in units)

    run_local = local(source.shard_group if source.sharded else 1)
    ratio = local(target.shard_group if target.sharded else 1) / run_local if run_local else 1.0
    return OwnWork(run, target_overhead(run, target.family, source.device_type, contention), params,
                   optimizer_element_us, ratio, machine_factor(run, contention))


def own_work_assumed(own: OwnWork, source: tg.Source, target: tg.Target) -> list[str]:
    """What :func:`predict_step` assumed of the run's own CPU work for this target."""
    out = []
    if own.target is None:
        if target.family != own.run.family:
            out.append(f"{target.family}'s own CPU work (gathers, reductions, DTensor dispatch) not charged and the "
                       f"run's {own.run.family} work kept: no figure for it on {source.device_type}")
    elif own.target.how != "measured" and own.target.family == model.FAMILY_DDP and own.run.family != model.FAMILY_DDP:
        out.append("DDP's reducer work (gradient division, bucket copies) not charged: no figure for it without a "
                   "DDP run to measure")
    elif own.target.how != "measured":
        d = DOCUMENTED_OVERHEAD[own.target.family]
        machine = (f"x {own.machine:.2f}, the time the run's own {own.run.family} work took against the same "
                   f"figures of the reference machine" if own.machine is not None else
                   f"as on the reference machine (the run measured no {own.run.family} work to compare)")
        out.append(f"{own.target.family}'s own CPU work from documented figures (the run has none to measure): "
                   f"{d.gather_us_per_byte * 1e6:.0f} µs per MB gathered, {d.reduce_us_per_byte * 1e6:.0f} µs per MB "
                   f"reduced, {d.dispatch_us_per_param:.0f} µs of DTensor dispatch per parameter tensor and step on "
                   f"the reference machine (benchmarks/bench_whatif.py on fsdpprof's example, 2-core AMD EPYC, torch "
                   f"2.13, gloo), x the run's contention, {machine}")
    if own.run.family != target.family and own.target is not None:
        what = "its reducer's record_function ranges" if own.run.family == model.FAMILY_DDP else "its annotations"
        out.append(f"the run's own {own.run.family} CPU work (measured on {what}) taken out, of the compute as much "
                   f"as its aten ops took (the compute inside it), of the rest the others")
    if abs(own.element_ratio - 1.0) > 1e-9:
        out.append(f"the optimizer's element work (its aten ops) x{own.element_ratio:.2f} with the local parameter "
                   f"elements; its Python loop over tensors kept as measured")
    return out
