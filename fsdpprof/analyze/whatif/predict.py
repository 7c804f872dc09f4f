"""Predictions of one rank (map: small dicts, no frames) and of the run (reduce: JSON-ready dicts).

:func:`rank_predictions` gives per target the replayed peak (:mod:`.memory`) and what the step times are
replayed from (:class:`RankTiming`); :func:`reduce_predictions` fits each rank's collectives with the run's
latency floor and replays its steps (:mod:`.timing`): the peak is the largest rank's, the step time the median
over ranks and steps.
"""
from __future__ import annotations

import multiprocessing
from dataclasses import asdict, dataclass

import numpy as np
import pandas as pd

from fsdpprof.analyze import model
from fsdpprof.analyze.load import engines
from fsdpprof.analyze.load.frames import startswith
from fsdpprof.analyze.memory import attribution, cpu_events
from fsdpprof.analyze.load.files import no_usable_rank, with_inventory
from fsdpprof.analyze.load.run import load_rank, map_run
from fsdpprof.analyze.whatif import advice
from fsdpprof.analyze.whatif import contention as ct
from fsdpprof.analyze.whatif import memory as mem
from fsdpprof.analyze.whatif import targets as tg
from fsdpprof.analyze.whatif import timing
from fsdpprof.analyze.whatif.units import model_units, padded_numel, param_unit_map, parameter_tensors
from fsdpprof.errors import UserError

REPLAY_POOL_MIN_RANKS = 64    # from this many ranks on, the replays run in a pool of processes (~10 ms a rank)
NO_INVENTORY = ("no inventory.json (parameter sizes, units and strategy are unknown); record the run with "
                "`fsdpprof record` to predict other strategies")
PREDICT_JOB_MODULES = ("fsdpprof.analyze.load.run", "fsdpprof.analyze.memory.attribution")   # a worker's imports
# The step-time interval: the 10th-90th percentile of the replayed steps (ranks x steps), widened by the model's
# error, a factor each way, and on a CPU run by the run's own CPU contention too (the host's load, which changes
# between recordings, stretches or shrinks every time by as much).  The model's error: this project's five demo
# recordings (DDP, SHARD_GRAD_OP and FULL_SHARD on 2 ranks, FULL_SHARD and HYBRID_SHARD on 4; CPU, gloo), each
# strategy predicted from each other run: measured / predicted median 0.55 - 1.8 (docs/whatif-model.md).
STEP_TIME_ERROR = 1.6
STEP_TIME_PERCENTILES = (10.0, 90.0)


def _no_time() -> dict:
    """The time keys of a prediction that has none."""
    return {"steps_us": [], "compute_us": None, "exposed_comm_us": None, "comm_us": None,
            "run_cpu_contention": None, "cpu_contention": None, "kept": [], "assumed": []}


def source_of_rank(rd, hosts: int = 1, ranks_per_host: int | None = None) -> tg.Source:
    device = (getattr(rd, "trace_meta", None) or {}).get("device_type") or \
        str((rd.info or {}).get("device") or "cpu").split(":")[0] or "cpu"
    return tg.source_of(rd.inventory, rd.info, str(device), hosts, ranks_per_host)


def _inventory_names(allocs: pd.DataFrame, inventory: dict, events: pd.DataFrame | None,
                     kind: str) -> pd.Series | None:
    """The inventory tensor name (parameter fqn for params and grads) of each allocation it describes."""
    if kind == "cpu_trace" and events is not None:
        opt = events[startswith(events["name"], (model.OPTIMIZER_PREFIX,))]
        t_end = float(np.nanmax(allocs["alloc_us"].to_numpy(float))) if len(allocs) else 0.0
        inv_t = cpu_events.inventory_tensors(inventory, np.sort(opt["ts_us"].to_numpy(float)),
                                             np.sort((opt["ts_us"] + opt["dur_us"]).to_numpy(float)), t_end)
    else:
        inv_t = attribution.snapshot_inventory(inventory, allocs)
    if inv_t is None or not len(inv_t):
        return None
    a = pd.DataFrame({"index": np.arange(len(allocs)), "addr": allocs["addr"].to_numpy(np.int64),
                      "alloc_us": allocs["alloc_us"].to_numpy(float), "free_us": allocs["free_us"].to_numpy(float)})
    m = a.merge(inv_t[["addr", "ref_us", "name"]], on="addr")
    m = m[(m["alloc_us"] <= m["ref_us"]) & (m["ref_us"] < m["free_us"].fillna(np.inf))].drop_duplicates("index")
    names = pd.Series([None] * len(allocs), dtype=object)
    names.iloc[m["index"].to_numpy()] = m["name"].astype(str).str.split("/").str[0].to_numpy(object)
    return names


@dataclass
class RankMemory:
    """What one rank's memory record gives the predictions: replay rows, schedule and scratch ratio."""

    rows: pd.DataFrame
    sched: dict
    scratch: tuple
    host_states: dict | None


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
        out = _no_time()
        if not fit.by_type or not self.tsched:
            return out
        scale, ckept, cassumed = ct.cpu_step_scale(self.host_load, self.source, target)
        contention = self.host_load.contention if self.host_load else None
        own = timing.own_work_for(self.run_overhead, self.optimizer_element_us, self.params, self.source, target,
                                  self.units, contention)
        steps, kept, assumed = timing.predict_time(self.steps, self.tsched, target, self.units, fit, self.source,
                                                   own, scale)
        if self.host_load is not None:                  # (measured on CPU runs only)
            out["run_cpu_contention"] = contention
            out["cpu_contention"] = self.host_load.contention_at(tg.ranks_on_host(self.source, target))
        if steps:
            out.update(steps_us=[s.step_us for s in steps], kept=kept + ckept, assumed=assumed + cassumed,
                       **{k: float(np.median([getattr(s, k) for s in steps]))
                          for k in ("compute_us", "comm_us", "exposed_comm_us")})
        return out


def _rank_memory(rd, source: tg.Source, units: list, memory_result, notes: list) -> tuple:
    """(:class:`RankMemory` or None, measured peak bytes, the memory record's kind) of one rank.
    ``memory_result``: its MemoryResult with allocations; None: computed here; False: none."""
    m = memory_result if memory_result is not False else None
    if memory_result is None and (rd.snapshot_path or (rd.memory_events is not None and len(rd.memory_events))):
        m = attribution.memory_analysis(rd)
    if m is None or getattr(m, "allocations", None) is None or not len(m.allocations):
        notes.append("no memory record (no [memory] events, no CUDA snapshot): memory not predicted")
        return None, None, None
    r = mem.roles_frame(m.allocations, source.family)
    names = None
    if source.family not in model.FSDP_FAMILIES:
        names = _inventory_names(m.allocations, rd.inventory, rd.events, m.source)
    sizes = {u.fqn: padded_numel(u.numel, source.shard_group) * model.dtype_bytes(source.param_dtype) for u in units}
    mem.label_units(r, units, sizes, names, param_unit_map(rd.inventory, units))
    sched = mem.schedule(r, units, source)
    if not sched:
        notes.append("no recorded step has both a forward and a backward in the memory record: memory not predicted")
        return None, int(m.peak_allocated_bytes), m.source
    totals = (rd.inventory or {}).get("totals") or {}
    mc = model.MemoryCategory
    host_states = {mc.SHARDED_PARAM.value: totals.get("param_bytes"), mc.SHARDED_GRAD.value: totals.get("grad_bytes"),
                   mc.OPTIMIZER_STATE.value: totals.get("optimizer_state_bytes")} \
        if source.cpu_offload and source.device_type != "cpu" else None
    return (RankMemory(r, sched, mem.scratch_ratio(r, units, source), host_states), int(m.peak_allocated_bytes),
            m.source)


def rank_predictions(rd, targets: list[tg.Target], memory_result=None, hosts: int = 1,
                     ranks_per_host: int | None = None) -> dict:
    """Map: every target on one rank -> {"rank", "source", "measured_peak_bytes", "measured_steps_us", "notes",
    "predictions": [memory per target], "timing": :class:`RankTiming` or None} (the time is predicted in
    :func:`reduce_predictions`). ``memory_result``: see :func:`_rank_memory`."""
    rank = int(rd.rank)
    source = source_of_rank(rd, hosts, ranks_per_host)
    units, note = model_units(rd.inventory)
    notes = [note] if note else []
    memory, measured_peak, memory_kind = _rank_memory(rd, source, units, memory_result, notes)
    host_load = None
    if source.device_type == "cpu":
        layout = tg.ranks_on_host(source, tg.target_of_source(source))   # the run's own ranks per host
        host_load = ct.host_load((rd.info or {}).get("cpu"), layout)
    rank_timing, measured_steps = None, []
    events = rd.events
    if events is not None and len(events):
        tsched = timing.trace_schedule(events, units, memory and memory.sched, same_clock=memory_kind == "cpu_trace")
        steps = timing.run_steps(events, tsched, async_host_comm=timing.comm_beside_training_thread(source))
        n = max(len(steps), 1)
        params = parameter_tensors(rd.inventory)
        rank_timing = RankTiming(rank, source, units, timing.collective_samples(events), tsched, steps,
                                 timing.run_overhead(events, source.family, params, n),
                                 timing.optimizer_element_us(events) / n, params, host_load)
        measured_steps = [s.w1 - s.w0 for s in steps]
        if not len(rank_timing.samples.dur_us):
            notes.append("the run has no collectives to fit latency and bandwidth on: time not predicted")
    else:
        notes.append("no profiler trace: time not predicted")
    no_memory = {"peak_allocated_bytes": None, "breakdown": {}, "peak_stage": None, "host_bytes": 0}
    memory_of = [asdict(mem.predict_memory(memory.rows, memory.sched, units, source, t, memory.scratch,
                                           memory.host_states)) if memory else no_memory for t in targets]
    return {"rank": rank, "source": source, "measured_peak_bytes": measured_peak, "measured_steps_us": measured_steps,
            "notes": notes, "timing": rank_timing,
            "predictions": [{"rank": rank, **_no_time(), **m} for m in memory_of]}


def _ranks_times(timed: list[tuple[int, RankTiming]], targets: list[tg.Target], floor: dict) -> list[tuple]:
    """(index, fit description, time per target) of each rank: its fit with the run's latency floor."""
    fits = [(i, t, timing.fit_collectives(t.samples, floor)) for i, t in timed]
    return [(i, fit.describe(), [t.predict(target, fit) for target in targets]) for i, t, fit in fits]


def _replays(timed: list[tuple[int, RankTiming]], targets: list[tg.Target], floor: dict) -> dict:
    """index -> (fit description, time per target) of every timed rank: in this process, or, from
    REPLAY_POOL_MIN_RANKS ranks on a machine with several cores, in a local pool (a chunk whose worker fails
    is replayed here)."""
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


def reduce_predictions(targets: list[tg.Target], per_rank: list[dict], run_target: tg.Target | None = None) -> dict:
    """Reduce: the run's predictions (JSON-ready): per target the largest rank's peak and its breakdown, the
    median step time over ranks and steps and its split, what was kept and assumed; each rank's fits."""
    per_rank = [p for p in per_rank if p]
    timed = [(i, p["timing"]) for i, p in enumerate(per_rank) if p.get("timing") is not None]
    replays = _replays(timed, targets, timing.latency_floor([t.samples for _, t in timed]))
    fits, rows_of = {}, []
    for i, p in enumerate(per_rank):       # each rank's memory prediction with its time (kept / assumed: both's)
        described, times = replays.get(i, ([], None))
        fits[str(p["rank"])] = described
        rows_of.append(p["predictions"] if times is None else [
            {**row, **time, "kept": row["kept"] + time["kept"], "assumed": row["assumed"] + time["assumed"]}
            for row, time in zip(p["predictions"], times)])
    preds = []
    for i, t in enumerate(targets):
        rows = [r[i] for r in rows_of]
        top = max((r for r in rows if r["peak_allocated_bytes"] is not None),
                  key=lambda r: r["peak_allocated_bytes"], default=None)
        steps = [s for r in rows for s in r["steps_us"]]
        step = float(np.median(steps)) if steps else None

        def med(key):
            v = [r[key] for r in rows if r[key] is not None]
            return float(np.median(v)) if v else None

        exposed, compute = med("exposed_comm_us"), med("compute_us")
        low, high = step_interval(steps, med("run_cpu_contention"))
        preds.append({**t.to_dict(), "is_run": bool(run_target is not None and tg.same_config(t, run_target)),
                      "peak_allocated_bytes": top["peak_allocated_bytes"] if top else None,
                      "peak_rank": top["rank"] if top else None, "peak_stage": top["peak_stage"] if top else None,
                      "breakdown": dict(top["breakdown"]) if top else {},
                      "host_bytes": top["host_bytes"] if top else 0,
                      "step_us": step, "step_low_us": low, "step_high_us": high, "compute_us": compute, "exposed_comm_us": exposed, "comm_us": med("comm_us"),
                      "run_cpu_contention": med("run_cpu_contention"), "cpu_contention": med("cpu_contention"),
                      "rest_us": (step - compute - exposed) if None not in (step, compute, exposed) else None,
                      "kept": list(dict.fromkeys(x for r in rows for x in r["kept"])),
                      "assumed": list(dict.fromkeys(x for r in rows for x in r["assumed"]))})
    msteps = [s for p in per_rank for s in p["measured_steps_us"]]
    measured = {"peak_allocated_bytes": max((p["measured_peak_bytes"] for p in per_rank
                                             if p["measured_peak_bytes"] is not None), default=None),
                "step_us": float(np.median(msteps)) if msteps else None}
    # the ranks' notes, each once; one that holds for some of the ranks only names them ("rank 1: ...")
    ranks_of: dict[str, list[int]] = {}
    for p in per_rank:
        for n in p["notes"]:
            ranks_of.setdefault(n, []).append(p["rank"])
    notes = [n if len(set(rs)) == len(per_rank) else f"{model.rank_list(rs)}: {n}" for n, rs in ranks_of.items()]
    out = {"predictions": preds, "measured": measured, "fits": fits, "notes": notes, "order": time_order(preds)}
    out["recommendation"] = advice.recommend(out)
    return out


def step_interval(steps_us: list[float], run_contention: float | None = None) -> tuple[float | None, float | None]:
    """The interval of a predicted step time (µs): STEP_TIME_PERCENTILES of the replayed steps, divided and
    multiplied by STEP_TIME_ERROR x the run's CPU contention (CPU runs; >= 1); (None, None) without steps."""
    if not steps_us:
        return None, None
    lo, hi = np.percentile(np.asarray(steps_us, dtype=float), STEP_TIME_PERCENTILES)
    f = STEP_TIME_ERROR * max(1.0, run_contention or 1.0)
    return float(lo / f), float(hi * f)


def time_order(preds: list[dict]) -> list[str]:
    """The order of the predicted step times, one sentence per pair of adjacent strategies (fastest first): "A is
    faster than B" only where their intervals do not overlap, else "A and B: no order".  Empty under two."""
    timed = sorted((p for p in preds if p.get("step_low_us") is not None), key=lambda p: p["step_us"])
    out = []
    for a, b in zip(timed, timed[1:]):
        na, nb = a.get("label") or a.get("strategy"), b.get("label") or b.get("strategy")
        ranges = (f"{a['step_low_us'] / 1e3:.0f}-{a['step_high_us'] / 1e3:.0f} ms against "
                  f"{b['step_low_us'] / 1e3:.0f}-{b['step_high_us'] / 1e3:.0f} ms")
        if a["step_high_us"] < b["step_low_us"]:
            out.append(f"{na} is faster than {nb} ({ranges})")
        else:
            out.append(f"{na} and {nb}: no order, their predicted intervals overlap ({ranges})")
    return out


def hosts_of(run) -> tuple[int, int | None]:
    """(hosts, ranks per host) of a run from its ranks' rank.json."""
    hosts = [str((rd.info or {}).get("host")) for rd in run.ranks.values() if (rd.info or {}).get("host")]
    if not hosts:
        return 1, None
    counts = pd.Series(hosts).value_counts()
    return len(counts), int(counts.max()) if counts.nunique() == 1 else None


def _why_not(rd, known_why: str | None) -> str | None:
    """Why a rank (its inventory read) gives nothing to predict from, or None: no inventory, or neither a trace
    nor a snapshot (``known_why``: the reason discovery gave)."""
    if not rd.inventory:
        return NO_INVENTORY
    if rd.events is None and not rd.trace_path and not rd.snapshot_path:
        return known_why or "no trace and no CUDA snapshot"
    return None


def source_rank(run):
    """The run's first rank (its inventory read) that the predictions can start from; UserError naming why
    when none can."""
    missing = {}
    for r in sorted(run.ranks):
        rd, why = with_inventory(run.ranks[r])
        why = why or _why_not(rd, run.missing.get(rd.label))
        if why is None:
            return rd
        missing[rd.label] = why
    if all(w == NO_INVENTORY for w in missing.values()):
        raise UserError(f"{run.path}: {NO_INVENTORY}")
    raise no_usable_rank({**run.missing, **missing}, f"nothing to predict from in {run.path}", "no rank",
                         one_alone=False)


def predict_rank(rd, targets: list[tg.Target], *, hosts: int = 1, ranks_per_host: int | None = None,
                 max_bytes: int | None = None, known_why: str | None = None) -> tuple[dict | None, str | None]:
    """Map job of :func:`predict_run` (here, in a local worker or on Dask): one rank loaded and its
    :func:`rank_predictions`, and why the rank (or its trace: with a snapshot, memory is still predicted) is
    left out, else None. ``known_why``: why discovery listed the rank as missing."""
    rd, why = with_inventory(rd)          # (first: a rank without a usable inventory is not worth its trace)
    why = why or _why_not(rd, known_why)
    if why is not None:
        return None, why
    loaded = load_rank(rd, max_bytes=max_bytes)
    if loaded.trace_error and not loaded.rank.snapshot_path:
        return None, loaded.trace_error
    return rank_predictions(loaded.rank, targets, hosts=hosts, ranks_per_host=ranks_per_host), loaded.trace_error


def predict_run(run, targets: list[tg.Target], run_target: tg.Target | None = None, progress: bool | None = None,
                *, engine: str | None = None, workers: int | None = None, scheduler: str | None = None) -> dict:
    """Every target for a (lazily) loaded Run: each rank predicted where :func:`fsdpprof.analyze.load.run.map_run`
    runs it, then the reduce here. A rank that cannot be predicted from is left out and named with its reason
    in ``missing``; UserError when none is left. ``progress``: a line per rank as it is done."""
    hosts, per_host = hosts_of(run)
    kwargs = {"targets": targets, "hosts": hosts, "ranks_per_host": per_host, "max_bytes": run.max_trace_bytes}
    done = map_run(run, predict_rank, lambda rd: dict(kwargs, known_why=run.missing.get(rd.label)),
                   lambda rd, why: (None, why), lambda res: res[1], engine=engine, workers=workers,
                   scheduler=scheduler, preload=PREDICT_JOB_MODULES, progress=progress)
    missing = {**run.missing, **{rd.label: why for rd, (_, why), _ in done if why is not None}}
    results = [prediction for _, (prediction, _), _ in done if prediction is not None]
    if not results:
        raise no_usable_rank(missing, f"nothing to predict from in {run.path}", "no rank", one_alone=False)
    out = reduce_predictions(targets, results, run_target)
    out.update(ranks_predicted=[p["rank"] for p in results], missing=missing)
    return out


def report_rank(rd, memory_result=None) -> dict:
    """Map side of the report's "What if" section: the standard strategies at the run's world size on one
    rank (``memory_result``: the rank's MemoryResult, when already computed)."""
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
    run_target = results[0]["run_target"]
    out = reduce_predictions(results[0]["targets"], results, run_target)
    out["run"] = {"strategy": run_target.strategy, "world_size": run_target.world_size, "family": run_target.family}
    return out
