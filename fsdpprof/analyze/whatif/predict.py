"""Predictions of one rank (map: small dicts, no frames) and of the run (reduce: JSON-ready dicts).

:func:`rank_predictions` reads one rank's allocations, trace and inventory and returns, per target,
the replayed peak and its breakdown (:mod:`.memory`), and what its step times are replayed from
(:class:`RankTiming`: collectives, unit boundaries, steps): never the frames. :func:`reduce_predictions`
takes the ranks' results: it fits each rank's collectives with the run's latency floor (the fastest call of
each type on any rank), replays each rank's steps (:mod:`.timing`); the peak is the largest rank's, the step
time the median over ranks and steps (as the report's).
"""
from __future__ import annotations

import multiprocessing
from dataclasses import dataclass

import numpy as np
import pandas as pd

from fsdpprof.analyze import model
from fsdpprof.analyze.load import engines
from fsdpprof.analyze.load.frames import startswith
from fsdpprof.analyze.memory import attribution, cpu_events
from fsdpprof.analyze.load.files import no_usable_rank, with_inventory
from fsdpprof.analyze.load.run import load_rank, unread_trace_bytes
from fsdpprof.analyze.whatif import contention as ct
from fsdpprof.analyze.whatif import memory as mem
from fsdpprof.analyze.whatif import targets as tg
from fsdpprof.analyze.whatif import timing
from fsdpprof.analyze.whatif.units import model_units, padded_numel, param_unit_map, parameter_tensors
from fsdpprof.errors import UserError


def _device_type(rd) -> str:
    meta = getattr(rd, "trace_meta", None) or {}
    dt = meta.get("device_type")
    if dt:
        return str(dt)
    return str((rd.info or {}).get("device") or "cpu").split(":")[0] or "cpu"


def source_of_rank(rd, hosts: int = 1, ranks_per_host: int | None = None) -> tg.Source:
    return tg.source_of(rd.inventory, rd.info, _device_type(rd), hosts, ranks_per_host)


def _inventory_names(allocs: pd.DataFrame, inventory: dict, events: pd.DataFrame | None,
                     kind: str) -> pd.Series | None:
    """The inventory tensor name (parameter fqn for params and grads) of each allocation it describes."""
    if kind == "cpu_trace" and events is not None:
        opt = events[startswith(events["name"], (model.OPTIMIZER_PREFIX,))]
        starts = np.sort(opt["ts_us"].to_numpy(float))
        ends = np.sort((opt["ts_us"] + opt["dur_us"]).to_numpy(float))
        t_end = float(np.nanmax(allocs["alloc_us"].to_numpy(float))) if len(allocs) else 0.0
        inv_t = cpu_events.inventory_tensors(inventory, starts, ends, t_end)
    else:
        inv_t = attribution._snapshot_inventory(inventory, allocs)
    if inv_t is None or not len(inv_t):
        return None
    a = pd.DataFrame({"index": np.arange(len(allocs)), "addr": allocs["addr"].to_numpy(np.int64),
                      "alloc_us": allocs["alloc_us"].to_numpy(float), "free_us": allocs["free_us"].to_numpy(float)})
    m = a.merge(inv_t[["addr", "ref_us", "name"]], on="addr")
    m = m[(m["alloc_us"] <= m["ref_us"]) & (m["ref_us"] < m["free_us"].fillna(np.inf))].drop_duplicates("index")
    names = pd.Series([None] * len(allocs), dtype=object)
    names.iloc[m["index"].to_numpy()] = m["name"].astype(str).str.split("/").str[0].to_numpy(object)
    return names


class RankModel:
    """What one rank's record gives the predictions: its configuration, units, replay rows and schedules.
    ``memory_result``: the rank's MemoryResult with allocations; None: computed here; False: none."""

    def __init__(self, rd, memory_result=None, hosts: int = 1, ranks_per_host: int | None = None):
        self.rank = int(rd.rank)
        self.notes: list[str] = []
        self.source = source_of_rank(rd, hosts, ranks_per_host)
        self.units, note = model_units(rd.inventory)
        totals = (rd.inventory or {}).get("totals") or {}
        mc = model.MemoryCategory
        self.host_states = {mc.SHARDED_PARAM.value: totals.get("param_bytes"), mc.SHARDED_GRAD.value:
                            totals.get("grad_bytes"), mc.OPTIMIZER_STATE.value: totals.get("optimizer_state_bytes")} \
            if self.source.cpu_offload and self.source.device_type != "cpu" else None
        if note:
            self.notes.append(note)
        events = rd.events
        self.rows = self.msched = None
        self.measured_peak = None
        m = memory_result if memory_result is not False else None
        if memory_result is None and (rd.snapshot_path or (rd.memory_events is not None and len(rd.memory_events))):
            m = attribution.memory_analysis(rd)
        if m is not None and getattr(m, "allocations", None) is not None and len(m.allocations):
            self.measured_peak = int(m.peak_allocated_bytes)
            self.memory_kind = m.source
            r = mem.roles_frame(m.allocations, self.source.family)
            names = None
            if self.source.family not in ("fsdp1", "fsdp2"):
                names = _inventory_names(m.allocations, rd.inventory, events, m.source)
            sizes = {u.fqn: padded_numel(u.numel, self.source.shard_group) * model.dtype_bytes(self.source.param_dtype)
                     for u in self.units}
            mem.label_units(r, self.units, sizes, names, param_unit_map(rd.inventory, self.units))
            self.rows = r
            self.msched = mem.schedule(r, self.units, self.source)
            self.scratch = mem.scratch_ratio(r, self.units, self.source)
            if not self.msched:
                self.notes.append("no recorded step has both a forward and a backward in the memory record: "
                                  "memory not predicted")
                self.rows = None
        else:
            self.memory_kind = None
            self.notes.append("no memory record (no [memory] events, no CUDA snapshot): memory not predicted")
        host_load = None
        if self.source.device_type == "cpu":
            layout = tg.ranks_on_host(self.source, tg.target_of_source(self.source))   # the run's own ranks per host
            host_load = ct.host_load((rd.info or {}).get("cpu"), layout)
        self.timing = None
        self.measured_steps = []
        if events is not None and len(events):
            self.timing = rank_timing(self.rank, events, self.source, self.units, parameter_tensors(rd.inventory),
                                      self.msched, self.memory_kind == "cpu_trace", host_load)
            self.measured_steps = [s.w1 - s.w0 for s in self.timing.steps]
            if not len(self.timing.samples.dur_us):
                self.notes.append("the run has no collectives to fit latency and bandwidth on: time not predicted")
        else:
            self.notes.append("no profiler trace: time not predicted")

    def predict(self, target: tg.Target) -> dict:
        """One target's memory on this rank: small dict (bytes) with what was kept and assumed; its time
        (:meth:`RankTiming.predict`) comes in the reduce, once every rank's fastest collectives are known."""
        out = {"rank": self.rank, "peak_allocated_bytes": None, "breakdown": {}, "peak_stage": None,
               "host_bytes": 0, "steps_us": [], "compute_us": None, "exposed_comm_us": None, "comm_us": None,
               "run_cpu_contention": None, "cpu_contention": None, "kept": [], "assumed": []}
        if self.rows is not None:
            p = mem.predict_memory(self.rows, self.msched, self.units, self.source, target, self.scratch,
                                   self.host_states)
            out.update(peak_allocated_bytes=p.peak_allocated_bytes, breakdown=p.breakdown, peak_stage=p.peak_stage,
                       host_bytes=p.host_bytes)
            out["kept"] += p.kept
            out["assumed"] += p.assumed
        return out


@dataclass
class RankTiming:
    """What one rank's trace gives the time predictions, small enough to go from a worker to the reduce:
    its collectives (to fit on), unit boundaries per step, replayable steps and own CPU work (µs)."""

    rank: int
    source: tg.Source
    units: list
    samples: timing.CollectiveSamples
    tsched: dict
    steps: list
    run_overhead: timing.FamilyOverhead
    optimizer_element_us: float
    params: int
    host_load: ct.HostLoad | None

    def predict(self, target: tg.Target, fit: timing.Fit) -> dict:
        """One target's step time on this rank with ``fit``: the time keys of a prediction, plus kept/assumed."""
        out = {"steps_us": [], "compute_us": None, "exposed_comm_us": None, "comm_us": None,
               "run_cpu_contention": None, "cpu_contention": None, "kept": [], "assumed": []}
        if not fit.by_type or not self.tsched:
            return out
        scale, ckept, cassumed = ct.cpu_step_scale(self.host_load, self.source, target)
        own = timing.own_work_for(self.run_overhead, self.optimizer_element_us, self.params, self.source, target,
                                  self.units, self.host_load.contention if self.host_load else None)
        steps, kept, assumed = timing.predict_time(self.steps, self.tsched, target, self.units, fit, self.source,
                                                   own, scale)
        if self.host_load is not None:                  # (measured on CPU runs only)
            out["run_cpu_contention"] = self.host_load.contention
            out["cpu_contention"] = self.host_load.contention_at(tg.ranks_on_host(self.source, target))
        if steps:
            out.update(steps_us=[s.step_us for s in steps],
                       compute_us=float(np.median([s.compute_us for s in steps])),
                       comm_us=float(np.median([s.comm_us for s in steps])),
                       exposed_comm_us=float(np.median([s.exposed_comm_us for s in steps])),
                       kept=kept + ckept, assumed=assumed + cassumed)
        return out


def rank_timing(rank: int, events: pd.DataFrame, source: tg.Source, units: list, params: int,
                memory_schedule: dict | None, same_clock: bool, host_load) -> RankTiming:
    """One rank's events -> :class:`RankTiming` (the frames are not kept)."""
    tsched = timing.trace_schedule(events, units, memory_schedule, same_clock=same_clock)
    steps = timing.run_steps(events, tsched, async_host_comm=timing.comm_beside_training_thread(source))
    n = max(len(steps), 1)
    return RankTiming(rank, source, units, timing.collective_samples(events), tsched, steps,
                      timing.run_overhead(events, source.family, params, n),
                      timing.optimizer_element_us(events) / n, params, host_load)


def rank_predictions(rd, targets: list[tg.Target], memory_result=None, hosts: int = 1,
                     ranks_per_host: int | None = None) -> dict:
    """Map: every target on one rank -> {"rank", "measured_peak_bytes", "measured_steps_us", "notes",
    "predictions": [per target dict, memory only], "timing": :class:`RankTiming` or None} (small; the time is
    predicted in :func:`reduce_predictions`)."""
    rank_model = RankModel(rd, memory_result, hosts, ranks_per_host)
    return {"rank": rank_model.rank, "source": rank_model.source, "measured_peak_bytes": rank_model.measured_peak,
            "measured_steps_us": rank_model.measured_steps, "notes": rank_model.notes,
            "predictions": [rank_model.predict(t) for t in targets], "timing": rank_model.timing}


REPLAY_POOL_MIN_RANKS = 64    # from this many ranks on, the replays run in a pool of processes (~10 ms a rank)


def _rank_times(t: RankTiming, targets: list[tg.Target], floor: dict) -> tuple[list[str], list[dict]]:
    """One rank's fit with the run's latency floor (its description) and its time prediction per target."""
    fit = timing.fit_collectives(t.samples, floor)
    return fit.describe(), [t.predict(target, fit) for target in targets]


def _ranks_times(timed: list[tuple[int, RankTiming]], targets: list[tg.Target], floor: dict) -> list[tuple]:
    return [(i, *_rank_times(t, targets, floor)) for i, t in timed]


def _replays(timed: list[tuple[int, RankTiming]], targets: list[tg.Target], floor: dict) -> dict:
    """index -> (fit description, time per target) of every timed rank: in this process, or, from
    REPLAY_POOL_MIN_RANKS ranks on a machine with several cores, in a local pool (chunks of ranks; a chunk
    whose worker fails is replayed here)."""
    cores = engines.usable_cores()
    if len(timed) < REPLAY_POOL_MIN_RANKS or cores < 2 or multiprocessing.current_process().daemon:
        return {i: rest for i, *rest in _ranks_times(timed, targets, floor)}
    n_chunks = min(len(timed), 4 * cores)
    chunks = [timed[k::n_chunks] for k in range(n_chunks)]
    out: dict = {}
    for k, ok, value in engines.map_unordered(_ranks_times, [((c, targets, floor), {}) for c in chunks]):
        for i, *rest in (value[0] if ok else _ranks_times(chunks[k], targets, floor)):
            out[i] = rest
    return out


def _with_time(per_rank: list[dict], targets: list[tg.Target]) -> tuple[list[dict], dict]:
    """The ranks' predictions with their step times: each rank's collectives fitted with the run's latency
    floor (:func:`fsdpprof.analyze.whatif.timing.latency_floor`) and its steps replayed per target;
    and the fits' descriptions per rank."""
    timed = [(i, p["timing"]) for i, p in enumerate(per_rank) if p.get("timing") is not None]
    floor = timing.latency_floor([t.samples for _, t in timed])
    replays = _replays(timed, targets, floor)
    out, fits = [], {}
    for i, p in enumerate(per_rank):
        described, times = replays.get(i, ([], None))
        fits[str(p["rank"])] = described
        rows = p["predictions"]
        if times is not None:
            rows = [_add_time(row, time) for row, time in zip(rows, times)]
        out.append({**p, "predictions": rows})
    return out, fits


def _add_time(row: dict, time: dict) -> dict:
    """A rank's memory prediction of one target with its time prediction (kept / assumed: memory's, then time's)."""
    return {**row, **time, "kept": row["kept"] + time["kept"], "assumed": row["assumed"] + time["assumed"]}


def reduce_predictions(targets: list[tg.Target], per_rank: list[dict], run_target: tg.Target | None = None) -> dict:
    """Reduce: the run's predictions (JSON-ready): per target the largest rank's peak and its breakdown,
    the median step time over ranks and steps and its split, what was kept and assumed."""
    per_rank, fits = _with_time([p for p in per_rank if p], targets)
    preds = []
    for i, t in enumerate(targets):
        rows = [p["predictions"][i] for p in per_rank]
        peaks = [r for r in rows if r["peak_allocated_bytes"] is not None]
        top = max(peaks, key=lambda r: r["peak_allocated_bytes"]) if peaks else None
        steps = [s for r in rows for s in r["steps_us"]]
        step = float(np.median(steps)) if steps else None

        def med(key):
            v = [r[key] for r in rows if r[key] is not None]
            return float(np.median(v)) if v else None

        exposed, compute = med("exposed_comm_us"), med("compute_us")
        kept = list(dict.fromkeys(x for r in rows for x in r["kept"]))
        assumed = list(dict.fromkeys(x for r in rows for x in r["assumed"]))
        preds.append({**t.to_dict(), "is_run": bool(run_target is not None and tg.same_config(t, run_target)),
                      "peak_allocated_bytes": top["peak_allocated_bytes"] if top else None,
                      "peak_rank": top["rank"] if top else None, "peak_stage": top["peak_stage"] if top else None,
                      "breakdown": dict(top["breakdown"]) if top else {},
                      "host_bytes": top["host_bytes"] if top else 0,
                      "step_us": step, "compute_us": compute, "exposed_comm_us": exposed, "comm_us": med("comm_us"),
                      "run_cpu_contention": med("run_cpu_contention"), "cpu_contention": med("cpu_contention"),
                      "rest_us": (step - compute - exposed) if None not in (step, compute, exposed) else None,
                      "kept": kept, "assumed": assumed})
    measured_peak = max((p["measured_peak_bytes"] for p in per_rank if p["measured_peak_bytes"] is not None),
                        default=None)
    msteps = [s for p in per_rank for s in p["measured_steps_us"]]
    notes = _notes_by_rank(per_rank)
    return {"predictions": preds, "measured": {"peak_allocated_bytes": measured_peak,
                                               "step_us": float(np.median(msteps)) if msteps else None},
            "fits": fits, "notes": notes}


def _notes_by_rank(per_rank: list[dict]) -> list[str]:
    """The ranks' notes, each once; one that holds for some of the ranks only names them ("rank 1: ...")."""
    ranks_of: dict[str, list[int]] = {}
    for p in per_rank:
        for n in p["notes"]:
            ranks_of.setdefault(n, []).append(p["rank"])
    every = len(per_rank)
    return [n if len(set(rs)) == every else f"{model.rank_list(rs)}: {n}" for n, rs in ranks_of.items()]


def hosts_of(run) -> tuple[int, int | None]:
    """(hosts, ranks per host) of a run from its ranks' rank.json."""
    hosts = [str((rd.info or {}).get("host")) for rd in run.ranks.values() if (rd.info or {}).get("host")]
    if not hosts:
        return 1, None
    n = len(set(hosts))
    counts = pd.Series(hosts).value_counts()
    per = int(counts.max()) if counts.nunique() == 1 else None
    return n, per


NO_INVENTORY = ("no inventory.json (parameter sizes, units and strategy are unknown); record the run with "
                "`fsdpprof record` to predict other strategies")


def _why_not(rd, missing: dict) -> str | None:
    """Why a rank (its inventory read) gives nothing to predict from, or None: an unreadable or absent
    inventory, or neither a trace nor a snapshot (the reason discovery gave, in ``missing``)."""
    if not rd.inventory:
        return NO_INVENTORY
    if rd.events is None and not rd.trace_path and not rd.snapshot_path:
        return missing.get(rd.label) or "no trace and no CUDA snapshot"
    return None


def source_rank(run):
    """The run's first rank (its inventory read) that the predictions can start from: its configuration is
    the run's (:func:`source_of_rank`).  UserError naming why when none can: no inventory.json anywhere, or
    each rank's own reason (an unreadable inventory, no trace)."""
    missing = {}
    for r in sorted(run.ranks):
        rd, why = with_inventory(run.ranks[r])
        why = why or _why_not(rd, run.missing)
        if why is None:
            return rd
        missing[rd.label] = why
    if all(w == NO_INVENTORY for w in missing.values()):
        raise UserError(f"{run.path}: {NO_INVENTORY}")
    raise no_usable_rank({**run.missing, **missing}, f"nothing to predict from in {run.path}", "no rank",
                         one_alone=False)


def predict_rank(rd, targets: list[tg.Target], *, hosts: int = 1, ranks_per_host: int | None = None,
                 max_bytes: int | None = None, known_why: str | None = None) -> tuple[dict | None, str | None]:
    """Map job of :func:`predict_run` (this process, a local worker or a Dask worker): one rank's inventory and
    trace loaded (:func:`fsdpprof.analyze.load.run.load_rank`) and its :func:`rank_predictions`; and why the rank
    is left out (or its trace is: with a snapshot, its memory is still predicted from), else None.
    ``known_why``: why discovery listed the rank as missing."""
    rd, why = with_inventory(rd)          # (first: a rank without a usable inventory is not worth its trace)
    why = why or _why_not(rd, {rd.label: known_why} if known_why else {})
    if why is not None:
        return None, why
    loaded = load_rank(rd, max_bytes=max_bytes)
    if loaded.trace_error and not loaded.rank.snapshot_path:
        return None, loaded.trace_error
    return rank_predictions(loaded.rank, targets, hosts=hosts, ranks_per_host=ranks_per_host), loaded.trace_error


# what a worker imports once before its first rank
PREDICT_JOB_MODULES = ("fsdpprof.analyze.load.run", "fsdpprof.analyze.memory.attribution")


def predict_run(run, targets: list[tg.Target], run_target: tg.Target | None = None, progress=None, *,
                engine: str | None = None, workers: int | None = None, scheduler: str | None = None) -> dict:
    """Every target for a loaded (or lazily loaded) Run: each rank loaded and predicted where
    :mod:`fsdpprof.analyze.load.engines` runs it (``engine`` local: this process, or a pool of ``workers`` processes
    for big traces; dask: the scheduler at ``scheduler``, else a LocalCluster), then the reduce here.  A rank that
    cannot be predicted from (unreadable trace or inventory, none of them) is left out and named with its reason
    in the result's ``missing`` (label -> why, beside those of ``run.missing``), as the report names its missing
    ranks; the others are predicted from (``ranks_predicted``).  UserError when none is left.  ``progress``:
    called with each rank as it is done."""
    engine = engines.check_engine(engine, scheduler)
    engines.check_workers(workers)
    hosts, per_host = hosts_of(run)
    rds = [run.ranks[r] for r in sorted(run.ranks)]
    kwargs = {"targets": targets, "hosts": hosts, "ranks_per_host": per_host, "max_bytes": run.max_trace_bytes}
    jobs = [((rd,), dict(kwargs, known_why=run.missing.get(rd.label))) for rd in rds]
    if engine == "local":
        workers = engines.local_workers(workers, len(jobs), unread_trace_bytes(rds))
    done: dict[int, tuple] = {}
    for i, ok, value in engines.map_unordered(predict_rank, jobs, engine=engine, workers=workers,
                                              scheduler=scheduler, preload=PREDICT_JOB_MODULES):
        done[i] = value[0] if ok else (None, value)
        if progress:
            progress(rds[i].rank)
    missing = dict(run.missing)
    results = []
    for i, rd in enumerate(rds):           # (in rank order, whatever order they finished in)
        prediction, why = done[i]
        if why is not None:
            missing[rd.label] = why
        if prediction is not None:
            results.append(prediction)
    if not results:
        raise no_usable_rank(missing, f"nothing to predict from in {run.path}", "no rank", one_alone=False)
    out = reduce_predictions(targets, results, run_target)
    out.update(ranks_predicted=[p["rank"] for p in results], missing=missing)
    return out


def report_rank(rd, memory_result=None) -> dict:
    """Map side of the report's "What if" section: the standard strategies at the run's world size on one
    rank (``memory_result``: the rank's MemoryResult with its allocations, when already computed)."""
    source = source_of_rank(rd)
    if source.world_size < 2:
        raise UserError("one process: no collectives to fit; `fsdpprof whatif RUN --world N --strategy S` predicts "
                        "the memory of a distributed run")
    targets, notes = tg.standard_targets(source)
    res = rank_predictions(rd, targets, memory_result if memory_result is not None else False)
    res.update(targets=targets, run_target=tg.target_of_source(source), notes=notes + res["notes"])
    return res


def report_reduce(results: list) -> dict | None:
    """Reduce side: the ranks' :func:`report_rank` results -> the predictions dict (None without any)."""
    results = [r for r in results if r]
    if not results:
        return None
    out = reduce_predictions(results[0]["targets"], results, results[0]["run_target"])
    out["run"] = {"strategy": results[0]["run_target"].strategy, "world_size": results[0]["run_target"].world_size,
                  "family": results[0]["run_target"].family}
    return out
