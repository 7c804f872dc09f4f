"""One run -> every number the report shows: a per-rank map (:func:`analyze_rank` -> :class:`RankResult`, small
tables; one rank's events held at a time) and a cross-rank reduce (:func:`reduce_run` -> :class:`Analysis`).
:func:`analyze_run` = map + reduce; :func:`overlap_summary` = the same restricted to what ``fsdpprof overlap``
prints.  A part that cannot be computed leaves a one-line note in ``notes[section]`` instead of failing.
Units: bytes, microseconds (``_us``), percent (``_pct``).
"""
from __future__ import annotations

import contextlib
import os
import socket
import traceback
from collections import Counter
from dataclasses import dataclass, field, replace

import numpy as np
import pandas as pd

from fsdpprof.analyze import model
from fsdpprof.analyze.comm import breakdown, matching, overlap, skew, steps, volume
from fsdpprof.analyze.comm import critical_path as cpath
from fsdpprof.analyze.compare import diff
from fsdpprof.analyze.load import hta as hta_tables
from fsdpprof.analyze.load.frames import isin, packed, records, unpacked
from fsdpprof.analyze.load.files import SOURCE_SNAPSHOT_FILE, SOURCE_SNAPSHOT_FOLDER, no_usable_rank, with_inventory
from fsdpprof.analyze.load.run import load_rank, load_run, map_run
from fsdpprof.analyze.memory.attribution import memory_analysis
from fsdpprof.analyze.summary import distributions, host, model_states, shares, theory
from fsdpprof.analyze.summary import findings as fnd
from fsdpprof.analyze.summary.headline import peak_rank, step_medians
from fsdpprof.analyze.timeline import clock_anchors_us
from fsdpprof.analyze.trace import labels
from fsdpprof.analyze.whatif.contention import training_thread_contention
from fsdpprof.analyze.whatif.predict import report_rank, report_reduce
from fsdpprof.errors import UserError, unexpected_as_user_error

LANE_EVENTS_MAX = 4000
# keys of the communication tables (rank first)
PHASE_KEYS = ["rank", "collective", "stage", "fsdp_phase"]
UNIT_STEP_KEYS = ["rank", "step", "collective", "stage", "fsdp_phase", "unit"]


# --------------------------------------------------------------------------- results
@dataclass
class RankResult:
    """Everything the reduce needs from one rank: small tables (µs, bytes), no events."""

    rank: int
    label: str                                   # rank-3, or the trace / snapshot file name
    info: dict = field(default_factory=dict)     # rank.json, or derived from the trace
    trace_meta: dict = field(default_factory=dict)  # device_type, device_name, distributedInfo, ...
    error: str | None = None                     # the rank could not be analysed at all (-> missing)
    fatal: str | None = None                     # bad input that must stop the report (exit 2)
    warnings: list = field(default_factory=list)
    notes: dict = field(default_factory=dict)    # section -> text
    has_trace: bool = False
    framework: str | None = None                 # from the events: fsdp2 | fsdp1 | ddp | distributed | single_device
    workload: str | None = None                  # from the events: training | inference (model.workload_of)
    kernels: dict = field(default_factory=dict)  # device_kernels, unknown_launch (launch not in the trace)
    inventory: dict | None = None                # inventory.json without its tensor list
    measured: dict | None = None                 # model-state bytes per role (inventory)
    k: object = None                             # theory.BytesPerParam the run used
    memory: object = None                        # MemoryResult without its allocations frame
    gathered_most_bytes: float | None = None     # the most gathered (unsharded) parameter bytes alive at once
    volume: pd.DataFrame | None = None           # rank, collective: count, bytes, time_us, algbw/busbw
    comm_phase: pd.DataFrame | None = None       # PHASE_KEYS: volume + overlap (all steps)
    comm_unit_step: pd.DataFrame | None = None   # UNIT_STEP_KEYS: volume + overlap
    overlap_overall: pd.DataFrame | None = None  # overall_overlap (one row)
    steps: pd.DataFrame | None = None            # step_breakdown rows
    step_stalls: pd.DataFrame | None = None      # steps.step_stalls: device idle by cause, syncs, DataLoader
    records: pd.DataFrame | None = None          # skew.collective_records (p2p left out) + call (row in the rank)
    chain: object = None                         # packed(cpath.rank_chain): the rank's steps as chains of nodes
    traffic: pd.DataFrame | None = None          # rank, collective: in-step count, payload and wire bytes, steps
    lanes: pd.DataFrame | None = None
    lanes_step: float | None = None
    top_ops: pd.DataFrame | None = None
    temporal: pd.DataFrame | None = None         # device traces: breakdown.temporal_breakdown
    kernel_type_time: pd.DataFrame | None = None  # rank, kernel_type, time_us (breakdown.kernel_type_time)
    top_kernels: pd.DataFrame | None = None      # breakdown.top_kernels
    idle: pd.DataFrame | None = None             # breakdown.idle_time_breakdown
    op_stats: object = None                      # packed(diff.op_table): rank, step, name, kind: count, ...
    whatif: dict | None = None                   # whatif.predict.report_rank: standard strategies predicted
    worker: dict | None = None                   # engines.measured_call: where and how long (not in summary.json)


@dataclass
class Analysis:
    """Every number of one run, as small tables and dicts (units in the names)."""

    path: str
    source: str
    overview: dict
    missing: dict
    warnings: list
    notes: dict = field(default_factory=dict)                 # section -> why something is not shown
    memory: dict = field(default_factory=dict)                # rank -> MemoryResult
    memory_peaks: pd.DataFrame | None = None                  # one row per rank
    theory: dict = field(default_factory=dict)
    model_states: pd.DataFrame | None = None                  # rank, role, measured_bytes, theory_bytes, diff_bytes
    volume: pd.DataFrame | None = None
    comm_phase: pd.DataFrame | None = None                    # rank, collective, stage, fsdp_phase
    comm_unit_step: pd.DataFrame | None = None                # rank, step, collective, stage, fsdp_phase, unit
    p2p: pd.DataFrame | None = None                           # point-to-point rows of comm_phase
    comm_outside_steps: pd.DataFrame | None = None            # rank, collective: comm launched outside any step
    overlap_overall: pd.DataFrame | None = None
    steps: pd.DataFrame | None = None
    step_stalls: pd.DataFrame | None = None                   # steps.step_stalls: rank, step, idle by cause, ...
    exposed_stage: pd.DataFrame | None = None                 # shares.exposed_by_stage: per collective and stage
    exposed_unit: pd.DataFrame | None = None                  # shares.exposed_by_unit: per unit, collective, stage
    idle_causes: pd.DataFrame | None = None                   # shares.idle_by_cause: device idle per step by cause
    skew: pd.DataFrame | None = None                          # per checked match (skew.SKEW_COLUMNS)
    stragglers: pd.DataFrame | None = None
    matching: dict | None = None                              # matching.MatchStats.to_dict(): matched/refused/...
    matches: pd.DataFrame | None = None                       # every collective call + match_id, match_status
    critical_path: object = None                              # critical_path.CriticalPath (what limits the step)
    traffic: pd.DataFrame | None = None                       # rank: measured vs theory bytes per step
    lanes: pd.DataFrame | None = None                         # one step of one rank, for the lanes chart
    lanes_step: float | None = None
    top_ops: pd.DataFrame | None = None                       # name, kind, count, total_us, max_us in that step
    temporal: pd.DataFrame | None = None                      # device traces: idle / compute / non-compute per rank
    kernel_types: pd.DataFrame | None = None                  # kernel_type, time_us, pct (all ranks)
    top_kernels: pd.DataFrame | None = None
    idle: pd.DataFrame | None = None                          # rank, stream, idle_category, idle_time_us, pct
    hta: dict = field(default_factory=dict)                   # name -> DataFrame (with --hta, GPU traces only)
    findings: list = field(default_factory=list)
    op_stats: pd.DataFrame | None = None                      # rank, step, name, kind: count, total_us (diff.op_table)
    whatif: dict | None = None                                # predictions of the standard strategies (JSON-ready)
    rank_distributions: dict = field(default_factory=dict)    # distributions.rank_distributions: name -> DataFrame
    cpu_load: dict = field(default_factory=dict)              # rank -> rank.json "cpu" (cores, CPU time, wait µs)


def _note(notes: dict, section: str, text: str) -> None:
    notes[section] = (notes[section] + " " + text) if section in notes else text


def _try(notes: dict, section: str, what: str, fn, *args, **kwargs):
    """Call fn; on any failure leave a one-line note in ``notes[section]`` and return None."""
    try:
        return fn(*args, **kwargs)
    except ImportError as exc:
        _note(notes, section, f"{what} not available ({exc}).")
    except UserError as exc:
        _note(notes, section, f"{what}: {exc}")
    except Exception as exc:  # an analysis failing must not lose the rest of the report
        last = traceback.extract_tb(exc.__traceback__)[-1]
        _note(notes, section, f"{what} failed: {type(exc).__name__}: {exc} "
                              f"(at {os.path.basename(last.filename)}:{last.lineno}).")
    return None


# --------------------------------------------------------------------------- the map
def comm_table(events: pd.DataFrame, keys: list[str]) -> pd.DataFrame:
    """Per group of ``keys``: count, bytes, time_us, busbw_gbps (volume) beside comm_us, overlapped_comm_us,
    exposed_comm_us, overlap_pct (overlap)."""
    labels_as_objects = {k: object for k in keys if k != "rank"}
    ov = overlap.comm_overlap(events, by=keys).astype(labels_as_objects)
    vol = volume.collective_volume(events, by=keys).astype(labels_as_objects)
    return vol[keys + ["count", "bytes", "time_us", "busbw_gbps"]].merge(ov, on=keys, how="outer")


def _distinct_steps(step_col: np.ndarray) -> list[float]:
    """The step numbers of a step column (NaN: outside any step), sorted; read a block at a time (no sort or hash
    table of every row)."""
    seen: set = set()
    for lo in range(0, len(step_col), model.BLOCK_ROWS):
        block = step_col[lo:lo + model.BLOCK_ROWS]
        seen.update(pd.unique(block[~np.isnan(block)]).tolist())
    return sorted(seen)


def _traffic(events: pd.DataFrame) -> pd.DataFrame | None:
    """Per rank and collective, comm launched inside a step: count, payload and wire bytes, steps spread over."""
    step_col = events["step"].to_numpy(np.float64)
    in_step = ~np.isnan(step_col)
    c = events[isin(events["kind"], [model.KIND_COMM]) & in_step & events["collective"].notna().to_numpy()]
    if c.empty or c["bytes"].isna().all():
        return None
    coll = c["collective"].astype(object).to_numpy()
    payload = c["bytes"].to_numpy(np.float64)
    d = pd.DataFrame({"rank": c["rank"].to_numpy(), "collective": coll, "payload_bytes": payload,
                      "wire_bytes": payload * model.ring_factor(coll, c["group_size"].to_numpy(np.float64))})
    g = d.groupby(["rank", "collective"])
    out = g.size().rename("count").reset_index()
    out["payload_bytes"] = g["payload_bytes"].sum(min_count=1).to_numpy()
    out["wire_bytes"] = g["wire_bytes"].sum(min_count=1).to_numpy()
    out["steps"] = max(len(_distinct_steps(step_col)), 1)
    return out


def _lanes(events: pd.DataFrame, trace_meta: dict | None = None):
    """Compute and communication events of one step (µs from its start, with ``lane_name``), the step, and the
    operations with the most time in it."""
    step_col = events["step"].to_numpy(np.float64)
    stps = _distinct_steps(step_col)
    if not stps:
        return None
    step = stps[1] if len(stps) > 2 else stps[0]  # avoid the first (warm-up effects) when possible
    e = events.iloc[np.flatnonzero(step_col == step)]      # (that step's rows only: no copy of the frame)
    sel = e[isin(e["kind"], model.DEVICE_KINDS)]
    if not isin(sel["kind"], [model.KIND_COMPUTE]).any():  # CPU traces: ops are cpu_op
        sel = e[isin(e["kind"], model.DEVICE_KINDS + [model.KIND_CPU_OP])]
    if len(sel) > LANE_EVENTS_MAX:
        sel = sel.nlargest(LANE_EVENTS_MAX, "dur_us")
    if sel.empty:
        return None
    t0 = float(e["ts_us"].min())
    ops = e[~isin(e["kind"], [model.KIND_ANNOTATION])]
    top = (ops.groupby(["name", "kind"], observed=True)["dur_us"].agg(count="size", total_us="sum", max_us="max")
           .reset_index().sort_values("total_us", ascending=False).head(25).reset_index(drop=True))
    top = top.astype({"name": str, "kind": str})
    out = pd.DataFrame({**{c: sel[c].astype(str).to_numpy() for c in ("lane", "kind", "name")},
                        "start_us": sel["ts_us"].to_numpy() - t0, "dur_us": sel["dur_us"].to_numpy(),
                        **{c: sel[c].astype(object).to_numpy() for c in ("collective", "stage", "fsdp_phase")}})
    tm = trace_meta or {}
    comm = out[out["kind"] == model.KIND_COMM]
    is_nccl = pd.Series(model.is_comm_kernel(comm["name"].to_numpy(object)), index=comm.index)
    nccl_lanes = {ln for ln, share in is_nccl.groupby(comm["lane"]).mean().items() if share > 0.5}
    on_lane = e[isin(e["kind"], model.DEVICE_KINDS)]   # the whole step's, before LANE_EVENTS_MAX
    comm_share = pd.Series(isin(on_lane["kind"], [model.KIND_COMM])).groupby(
        on_lane["lane"].astype(str).to_numpy()).mean()
    names = labels.lane_names(out["lane"].unique(), set(comm["lane"]), nccl_lanes, tm.get("thread_names"),
                              tm.get("device_type"), comm_share=comm_share.to_dict())
    out["lane_name"] = out["lane"].map(names)
    return out.sort_values(["lane", "start_us"]).reset_index(drop=True), float(step), top


def _trace_part(res: RankResult, events: pd.DataFrame, want_lanes: bool, want_ops: bool = True,
                overlap_only: bool = False) -> None:
    """The trace analyses of one rank into ``res`` (``overlap_only``: the volume and overall overlap alone)."""
    n = res.notes
    res.has_trace = True
    res.volume = _try(n, "communication", "collective volume", volume.collective_volume, events)
    res.overlap_overall = _try(n, "communication", "overall overlap", overlap.overall_overlap, events)
    res.framework = labels.framework_of(events)
    res.workload = labels.workload_of(events)
    if overlap_only:
        return
    dev = isin(events["kind"], model.DEVICE_KINDS) & ~labels.cpu_side(events)
    res.kernels = {"device_kernels": int(dev.sum()),
                   "unknown_launch": int((dev & isin(events["stage"], [model.STAGE_UNKNOWN])).sum()),
                   "precisions": labels.precisions_seen(events)}
    res.comm_phase = _try(n, "communication", "overlap per collective and phase", comm_table, events, PHASE_KEYS)
    res.comm_unit_step = _try(n, "communication", "overlap per unit and step", comm_table, events, UNIT_STEP_KEYS)
    windows = _try(n, "steps", "step windows", steps.step_windows, events)
    res.steps = _try(n, "steps", "step breakdown", steps.step_breakdown, events, windows)
    res.step_stalls = _try(n, "steps", "device idle causes, host synchronisations and DataLoader time",
                           steps.step_stalls, events)
    res.records = _try(n, "ranks", "collective records", skew.collective_records, events)
    if res.records is not None:
        res.records["call"] = np.arange(len(res.records), dtype=np.int64)
    res.chain = packed(_try(n, "critical_path", "the steps' chains (critical path)", cpath.rank_chain, events,
                            res.records, windows))
    res.traffic = _try(n, "communication", "measured traffic", _traffic, events)
    if want_ops:   # what compare diffs; up to OPS_ROWS_MAX rows a rank, so the report leaves it out
        res.op_stats = packed(_try(n, "steps", "operators per step", diff.op_table, events))
    if want_lanes:
        lanes = _try(n, "communication", "lanes of one step", _lanes, events, res.trace_meta)
        if lanes is not None:
            res.lanes, res.lanes_step, res.top_ops = lanes
    if res.kernels["device_kernels"]:      # the device time breakdowns (HTA's definitions, our events)
        res.temporal = _try(n, "device", "temporal breakdown", breakdown.temporal_breakdown, events)
        res.kernel_type_time = _try(n, "device", "kernel-type breakdown", breakdown.kernel_type_time, events)
        res.top_kernels = _try(n, "device", "top kernels", breakdown.top_kernels, events)
        res.idle = _try(n, "device", "idle-time breakdown", breakdown.idle_time_breakdown, events)


NO_MEMORY_EVENTS = ("the trace has no [memory] events (profile_memory was off); record with fsdpprof record "
                    "(memory on) or torch.profiler.profile(profile_memory=True)")


def _memory_part(res: RankResult, rd, source: str):
    """The rank's MemoryResult (with its allocations, for the what-if replay), kept without them in ``res``."""
    if rd.snapshot_path is None and (rd.memory_events is None or not len(rd.memory_events)):
        _note(res.notes, "memory", NO_MEMORY_EVENTS)
        return
    snapshots_only = source in (SOURCE_SNAPSHOT_FILE, SOURCE_SNAPSHOT_FOLDER)    # nothing else to report
    try:
        with unexpected_as_user_error(f"memory analysis of {rd.snapshot_path or res.label}") if snapshots_only \
                else contextlib.nullcontext():
            m = memory_analysis(rd)
    except UserError as exc:
        # snapshots only, or an inventory from another run (mixed-up files): bad input, one line and exit 2;
        # otherwise the rest of the report still stands
        if snapshots_only or "inventory.json" in str(exc):
            res.fatal = str(exc)
        else:
            _note(res.notes, "memory", str(exc))
        return
    except Exception as exc:
        _note(res.notes, "memory", f"memory analysis failed: {type(exc).__name__}: {exc}.")
        return
    res.memory = replace(m, allocations=None)
    res.gathered_most_bytes = model_states.most_alive_bytes(m, model.MemoryCategory.UNSHARDED_PARAM.value)
    # what was malformed in the input is said once, with the run's warnings (terminal and report)
    res.warnings += [w for w in getattr(m, "input_warnings", []) if w not in res.warnings]
    return m


def analyze_rank(rd, *, source: str = "run_dir", lanes: bool = False, progress: bool | None = False,
                 max_bytes: int | None = None, timeline: bool = True, ops: bool = True,
                 overlap_only: bool = False) -> RankResult:
    """Map: every per-rank number of one RankData, its trace read here if need be (a worker holds one rank only).
    ``lanes``: keep one step for the lanes chart; ``timeline``: keep the memory timeline; ``ops``: diff.op_table;
    ``overlap_only``: the collective volume and overall overlap alone."""
    loaded = load_rank(rd, max_bytes=max_bytes, progress=progress, inventory=not overlap_only)
    rd = loaded.rank
    res = RankResult(rank=int(rd.rank), label=rd.label, info=dict(rd.info or {}), trace_meta=dict(rd.trace_meta or {}),
                     warnings=([loaded.inventory_error] if loaded.inventory_error else []) + loaded.warnings)
    if loaded.trace_error:
        res.error = loaded.trace_error
        if overlap_only or (rd.snapshot_path is None and rd.inventory is None):
            return res
    traced = rd.events is not None and len(rd.events) > 0
    if rd.inventory and not overlap_only:
        res.inventory = model_states.inventory_summary(rd.inventory)
        res.measured = _try(res.notes, "theory", "measured model states", model_states.measured_model_states,
                            rd.inventory)
        res.k = _try(res.notes, "theory", "bytes per parameter", theory.k_from_inventory, rd.inventory)
    if traced:
        _trace_part(res, rd.events, lanes, ops, overlap_only)
    if overlap_only:
        return res
    if rd.events is not None or rd.snapshot_path:
        m = _memory_part(res, rd, source)
        if rd.inventory and traced:
            res.whatif = _try(res.notes, "whatif", "what-if predictions", report_rank, rd, m)
        if res.memory is not None and not timeline:
            res.memory = replace(res.memory, timeline=None)
    return res


# --------------------------------------------------------------------------- running the map
DETAIL_RANKS_MAX = 16       # above this many ranks, one rank keeps its memory timeline; the report shows distributions
# what a worker imports once before its first rank (so that a rank's measured memory is its own)
RANK_JOB_MODULES = ("fsdpprof.analyze.load.run", "fsdpprof.analyze.memory.attribution")


def rank_job(rd, *, source: str, lanes: bool, timeline: bool, max_bytes: int | None,
             progress: bool | None = False, ops: bool = True, overlap_only: bool = False) -> RankResult:
    """analyze_rank where the map runs it (here, a local worker or a Dask worker), on the files as it sees them."""
    for what, path in (("trace", rd.trace_path), ("snapshot", rd.snapshot_path)):
        if path and not os.path.lexists(path):
            return RankResult(rank=int(rd.rank), label=rd.label, info=dict(rd.info or {}),
                              error=f"its {what} {path} is not there on {socket.gethostname()} (deleted, "
                                    f"or not on storage this worker sees: Dask workers must see the run at the same "
                                    f"path)")
    return analyze_rank(rd, source=source, lanes=lanes, progress=progress, max_bytes=max_bytes, timeline=timeline,
                        ops=ops, overlap_only=overlap_only)


def map_ranks(run, *, workers: int | None = None, progress: bool | None = None, engine: str | None = None,
              scheduler: str | None = None, ops: bool = True, overlap_only: bool = False) -> list[RankResult]:
    """analyze_rank over the run's ranks, each where :func:`fsdpprof.analyze.load.run.map_run` runs it (``engine``
    local or dask).  One progress line per rank with ``progress``."""
    lanes_rank = min(run.ranks, default=None)
    all_timelines = len(run.ranks) <= DETAIL_RANKS_MAX

    def kwargs(rd) -> dict:
        return {"source": run.source, "lanes": rd.rank == lanes_rank, "max_bytes": run.max_trace_bytes,
                "timeline": all_timelines or rd.rank == lanes_rank, "ops": ops, "overlap_only": overlap_only}

    def failed(rd, why: str) -> RankResult:
        return RankResult(rank=rd.rank, label=rd.label, info=dict(rd.info or {}), error=why)

    out = []
    for _, res, stats in map_run(run, rank_job, kwargs, failed, lambda res: res.error, engine=engine,
                                 workers=workers, scheduler=scheduler, here_kwargs={"progress": progress},
                                 preload=RANK_JOB_MODULES[:1] if overlap_only else RANK_JOB_MODULES,
                                 progress=progress):    # (overlap_only: no memory analysis to import)
        res.worker = stats
        out.append(res)
    return out


# --------------------------------------------------------------------------- the reduce
def _concat(frames) -> pd.DataFrame | None:
    frames = [f for f in frames if f is not None and len(f)]
    return pd.concat(frames, ignore_index=True) if frames else None


def _rank_notes(results: list[RankResult]) -> dict:
    """The ranks' notes, one line per distinct text naming the ranks it holds for."""
    by_text: dict[tuple, list] = {}
    for r in results:
        for section, text in r.notes.items():
            by_text.setdefault((section, text), []).append(r.rank)
    out: dict[str, str] = {}
    for (section, text), ranks in by_text.items():
        _note(out, section, f"{model.rank_list(ranks)}: {text}" if len(results) > 1 else text)
    return out


def input_of(results: list[RankResult], world_size) -> tuple[str, str | None]:
    """(model.INPUT_KINDS of the input, the inventory's strategy or None): from inventory.json when a rank has
    one, else from what the traces (or CUDA snapshots' stack frames) show."""
    inv = next((r.inventory for r in results if r.inventory), None) or {}
    found = {r.framework for r in results if r.framework} | {
        str(r.memory.fsdp_family) for r in results if getattr(r.memory, "fsdp_family", None)}
    return model.input_kind(inv.get("framework"), found, world_size), inv.get("strategy")


def _precisions_seen(results: list[RankResult]) -> dict | None:
    """labels.precisions_seen summed over the ranks that have a trace (None without one)."""
    seen = [r.kernels["precisions"] for r in results if (r.kernels or {}).get("precisions")]
    if not seen:
        return None
    by_dtype: Counter = Counter()
    for p in seen:
        by_dtype.update(p["by_dtype"])
    return {"kernels": sum(p["kernels"] for p in seen), "by_dtype": {k: by_dtype[k] for k in model.LOW_PRECISION
                                                                      if by_dtype[k]},
            "comm_dtypes": sorted({d for p in seen for d in p["comm_dtypes"]})}


def _overview(run, results: list[RankResult]) -> dict:
    meta = run.meta or {}
    # analysed: neither failed here nor named missing (a rank kept for its inventory or snapshot lacks its trace)
    ranks = [r.rank for r in results if not r.error and r.label not in run.missing]
    missing = sorted({*map(str, run.missing), *(str(r.label) for r in results if r.error)})
    r0 = next((r for r in results if not r.error), results[0] if results else None)
    inv = next((r.inventory for r in results if r.inventory), None) or {}
    infos = [r.info or {} for r in results]
    hosts = sorted({str(i.get("host")) for i in infos if i.get("host")})
    info0 = (r0.info or {}) if r0 else {}
    tm = (r0.trace_meta or {}) if r0 else {}
    device_type = tm.get("device_type") or (str(info0.get("device") or "").split(":")[0] or None)
    cmd = meta.get("command")
    input_kind, strategy = input_of(results, run.world_size)
    dev_index = str(info0.get("device") or "").partition(":")[2]
    dev_name, dev_mem = model.device_of(tm.get("deviceProperties"), int(dev_index) if dev_index.isdigit() else None)
    return {
        "command": " ".join(map(str, cmd)) if isinstance(cmd, list) else cmd,
        "status": meta.get("status") or ("partial" if missing else "complete"),
        "started_at": meta.get("started_at"), "ended_at": meta.get("ended_at"), "exit_code": meta.get("exit_code"),
        "world_size": run.world_size, "ranks_present": ranks, "ranks_analysed": len(ranks),
        "ranks_missing": missing, "input_kind": input_kind,
        "sharded": model.input_sharded(input_kind, strategy),
        "description": model.describe_input(input_kind, strategy, run.world_size),
        "framework": inv.get("framework") or (input_kind if input_kind in model.FSDP_KINDS else None),
        "strategy": inv.get("strategy"),
        "shard_group_size": inv.get("shard_group_size"), "replicate_group_size": inv.get("replicate_group_size"),
        "mixed_precision": inv.get("mixed_precision"), "cpu_offload": inv.get("cpu_offload"),
        "has_inventory": bool(inv), "precisions_seen": _precisions_seen(results),
        "optimizer": (inv.get("optimizer") or {}).get("class"), "psi": (inv.get("totals") or {}).get("psi"),
        "hosts": hosts, "device_type": device_type,
        "device_name": dev_name or info0.get("device_name") or tm.get("device_name"), "device_memory_bytes": dev_mem,
        "workload": next((r.workload for r in results if not r.error and r.workload), None),
        "backend": info0.get("backend"), "steps_recorded": info0.get("steps_recorded"),
        "versions": meta.get("versions"), "step_time_us": None,
        "device_kernels": sum(int(r.kernels.get("device_kernels", 0)) for r in results),
        "unknown_launch_kernels": sum(int(r.kernels.get("unknown_launch", 0)) for r in results),
    }


def _relabel_replicated(m):
    """Memory categories of an input whose model states are not sharded (DDP, one device): plain ``param`` /
    ``grad`` (model.category_name)."""
    def ren(c):
        return model.category_name(c, sharded=False)

    fixed = {k: df.assign(category=df["category"].astype(object).map(ren)) if df is not None and "category" in df
             else df for k, df in (("breakdown_at_peak", m.breakdown_at_peak), ("by_unit_at_peak", m.by_unit_at_peak),
                                   ("top_allocations", m.top_allocations))}
    return replace(m, **fixed, timeline=m.timeline.rename(columns=ren) if m.timeline is not None else None)


MEMORY_PEAK_FIELDS = ("source", "peak_allocated_bytes", "peak_ts_us", "peak_stage", "peak_fsdp_phase", "baseline_bytes",
                      "coverage_pct", "reserved_bytes", "fragmentation_pct")


def _memory_tables(a: Analysis, results: list[RankResult]) -> None:
    """Each rank's MemoryResult (categories relabelled where nothing is sharded) and a row of its peak."""
    rows = []
    for res in (r for r in results if r.memory is not None):
        m = a.memory[res.rank] = res.memory if a.overview.get("sharded") else _relabel_replicated(res.memory)
        dev = getattr(m, "device", None)
        rows.append({"rank": res.rank, "device": f"cuda:{dev}" if dev is not None else None,
                     **{k: getattr(m, k) for k in MEMORY_PEAK_FIELDS}})
    if rows:
        a.memory_peaks = pd.DataFrame(rows)
    elif "memory" not in a.notes:
        _note(a.notes, "memory", "no rank has memory data (no [memory] events in the trace and no CUDA snapshot).")


def _world_size_from_memory(a: Analysis) -> None:
    """``overview.world_size_source``: "the run" (run.json, rank.json, distributedInfo), else, when nothing recorded
    it, what the ranks' CUDA snapshots show (fsdp_units), which then sets ``world_size``."""
    o = a.overview
    if o.get("world_size"):
        o["world_size_source"] = "the run"
        return
    o["world_size_source"] = None
    shown = {r: m for r, m in sorted(a.memory.items()) if getattr(m, "world_size", None)}
    if not shown or len({m.world_size for m in shown.values()}) != 1:
        return
    r = peak_rank(a)
    m = shown.get(r) or next(iter(shown.values()))
    o["world_size"], o["world_size_source"] = int(m.world_size), m.world_size_source


def _traffic_vs_theory(traffic: pd.DataFrame | None, th: dict) -> pd.DataFrame | None:
    """Per rank and collective: bytes per step (payload and on the wire) beside the theory."""
    if traffic is None or traffic.empty:
        return None
    g = traffic.copy()
    g["payload_per_step_bytes"] = g["payload_bytes"] / g["steps"]
    g["wire_per_step_bytes"] = g["wire_bytes"] / g["steps"]
    tr = (th or {}).get("traffic")
    if tr:
        theory_bytes = {model.ALL_GATHER: tr["all_gather_bytes"], model.REDUCE_SCATTER: tr["reduce_scatter_bytes"],
                        model.ALL_REDUCE: tr["all_reduce_bytes"]}
        g["theory_wire_per_step_bytes"] = g["collective"].map(theory_bytes).astype(float)
        g["diff_pct"] = 100.0 * (g["wire_per_step_bytes"] - g["theory_wire_per_step_bytes"]) / \
            g["theory_wire_per_step_bytes"].where(g["theory_wire_per_step_bytes"] > 0)
    return g


def _findings(a: Analysis) -> list:
    o = a.overview
    fsdp = o.get("input_kind") in model.FSDP_FAMILIES
    # exposed communication is held to what hiding it saves by the critical path (not the time ranks wait)
    items = fnd.held_to_critical_path(fnd.comm_findings(a.comm_unit_step, a.steps, fsdp_advice=fsdp,
                                                        exposed_stage=a.exposed_stage), a.critical_path)
    accelerator = o.get("device_type") not in (None, model.DEVICE_CPU)
    device = bool(o.get("device_kernels")) and accelerator
    items += fnd.device_findings(a.steps, a.step_stalls, device=device, idle_causes=a.idle_causes)
    items += host.host_findings(a.steps, a.cpu_load, o.get("device_type"))
    items += fnd.critical_path_findings(a.critical_path, fsdp_advice=fsdp, said={f.id for f in items},
                                        device=accelerator)
    strat = o.get("strategy")
    r = peak_rank(a)      # one rank is representative (ranks differ little in FSDP): the one the headline names
    if r is not None:
        m = a.memory[r]
        alts = {x["label"]: x["total_bytes"] for x in (a.theory or {}).get("all_strategies") or []}
        act = getattr(m, "activation_by_unit", None)
        units = [str(u) for u in act["unit"]] if act is not None and len(act) else \
            list(getattr(m, "fsdp_units", None) or [])
        items += fnd.memory_findings(m.breakdown_at_peak, strat, m.peak_allocated_bytes, m.fragmentation_pct,
                                     m.coverage_pct, r, alts, input_kind=o.get("input_kind"), units=units)
        items += fnd.process_findings(getattr(m, "process", None), r)
    if fsdp:
        items += fnd.topology_findings(strat, len(o.get("hosts") or []), int(o.get("world_size") or 1))
    if a.stragglers is not None and a.skew is not None:
        items += fnd.rank_findings(a.stragglers, o.get("step_time_us"))
    return fnd.sort_findings(items)


def _usable(run, results: list[RankResult]) -> tuple[dict, list[RankResult], list[str]]:
    """(missing label -> why, the ranks analysed, the run's and their warnings once each) of the map's results;
    UserError for an input that must stop the report, or when no rank is usable."""
    fatal = next((r.fatal for r in results if r.fatal), None)
    if fatal:
        raise UserError(fatal)
    missing = {**run.missing, **{r.label: r.error for r in results if r.error}}
    ok = [r for r in results if not r.error]
    if not ok:
        raise no_usable_rank(missing, f"no usable rank in {run.path}", "no rank recorded")
    return missing, ok, list(dict.fromkeys(list(run.warnings) + [w for r in ok for w in r.warnings]))


def _critical_path(records: pd.DataFrame | None, chains: pd.DataFrame | None, contention: dict):
    """cpath.critical_path of the ranks' records (with matching's checked ``match_id``; one rank: none), chains and
    CPU contention (rank -> runnable threads per core)."""
    if records is not None and len(records) and "match_id" not in records:
        records = records.assign(match_id=np.full(len(records), -1, dtype=np.int64))
    return cpath.critical_path(records, chains, contention)


def reduce_run(run, results: list[RankResult]) -> Analysis:
    """Reduce: the Analysis of a run from its RankResults (no events needed)."""
    missing, ok, warnings = _usable(run, results)
    a = Analysis(path=str(run.path), source=str(run.source), overview=_overview(run, results), missing=missing,
                 warnings=warnings)
    for section, text in _rank_notes(ok).items():
        _note(a.notes, section, text)
    a.cpu_load = {r.rank: (r.info or {})["cpu"] for r in ok if isinstance((r.info or {}).get("cpu"), dict)}
    _memory_tables(a, ok)
    _world_size_from_memory(a)
    th = model_states.theory_vs_measured({r.rank: r.inventory for r in ok if r.inventory and r.k is not None},
                                         {r.rank: r.measured for r in ok if r.measured},
                                         {r.rank: r.k for r in ok if r.k is not None}, a.memory, run.world_size,
                                         {r.rank: r.gathered_most_bytes for r in ok if r.gathered_most_bytes})
    a.theory, a.model_states = th.theory, th.model_states
    if th.note:
        _note(a.notes, "theory", th.note)
    traced = [r for r in ok if r.has_trace]
    if not traced:
        _note(a.notes, "communication", "no trace events in this input.")
        _note(a.notes, "steps", "no trace events in this input.")
    else:
        # the per-rank tables, all ranks' rows
        a.volume = _concat(r.volume for r in traced)
        a.comm_phase = _concat(r.comm_phase for r in traced)
        a.comm_unit_step = _concat(r.comm_unit_step for r in traced)
        a.overlap_overall = _concat(r.overlap_overall for r in traced)
        a.steps = _concat(r.steps for r in traced)
        a.step_stalls = _concat(r.step_stalls for r in traced)
        a.temporal = _concat(r.temporal for r in traced)
        a.top_kernels = _concat(r.top_kernels for r in traced)
        a.idle = _concat(r.idle for r in traced)
        a.op_stats = _concat(unpacked(r.op_stats) for r in traced)
        if a.comm_phase is None:
            _note(a.notes, "communication", "no collectives in the trace.")
        else:
            a.p2p = _concat([a.comm_phase[isin(a.comm_phase["collective"], model.P2P)]])
            o = a.comm_phase[a.comm_phase["stage"].astype(object) == model.STAGE_OUTSIDE]
            if not o.empty:
                a.comm_outside_steps = o.groupby(["rank", "collective"], as_index=False)[
                    ["count", "comm_us", "exposed_comm_us"]].sum()
        a.traffic = _traffic_vs_theory(_concat(r.traffic for r in traced), a.theory)
        if a.steps is not None and "step_us" in a.steps:
            # the headline's rule: each rank's mean, the median over ranks
            a.overview["step_time_us"] = step_medians(a.steps)["step_us"]
            a.overview["steps_analysed"] = int(a.steps["step"].nunique())
        first = traced[0]
        a.lanes, a.lanes_step, a.top_ops = first.lanes, first.lanes_step, first.top_ops
        a.kernel_types = breakdown.kernel_types_of(_concat(r.kernel_type_time for r in traced))
        records = _concat(r.records for r in traced)
        if len(traced) > 1:
            if records is not None:
                anchors = clock_anchors_us(run)
                records, stats = matching.match_collectives(records, clock_prior_us=matching.clock_prior(anchors))
                a.matches, a.matching = records, stats.to_dict()
                # one clock as timeline puts them on (the recorded anchors where they agree with the matches)
                al, said = skew.align_ranks(records, [r.rank for r in traced], anchors)
                for line in said:
                    _note(a.notes, "ranks", line[0].upper() + line[1:] + ".")
                a.matching["clock"] = str(al["method"].iat[0]) if len(al) else skew.ALIGN_NONE
                a.skew, rank_lag = skew.collective_skew(records, al.set_index("rank")["offset_us"])
                a.stragglers = skew.stragglers(a.skew, rank_lag)
                if stats.refused or stats.unmatched:
                    why = "; ".join(f"{reason}: {n:,}" for reason, n in stats.reasons.items())
                    _note(a.notes, "ranks", f"{stats.refused:,} of {len(records):,} collective calls were refused "
                                            f"across ranks{f' ({why})' if why else ''} and {stats.unmatched:,} left "
                                            f"unmatched: skew, stragglers and clock alignment use the "
                                            f"{stats.matched:,} checked calls only" +
                          (", so there are none here." if not stats.matched else "."))
        else:
            _note(a.notes, "ranks", f"only rank {first.rank} of {run.world_size or '?'} in this input: skew and "
                                    f"stragglers need several ranks.")
        a.critical_path = _try(a.notes, "critical_path", "critical path", _critical_path, records,
                               cpath.concat_chains(unpacked(r.chain) for r in traced),
                               training_thread_contention(a.cpu_load, a.overview.get("device_type")))
        if a.stragglers is not None and len(a.stragglers):
            # a straggler's cost is the counterfactual "rank R as fast as the median" (NaN without a critical path)
            # and the part its wait for a core explains, for the ranks late beyond chance only (one replay of every
            # rank is O(ranks^2) at scale; a rank the critical path tried is not replayed again)
            late = fnd.late_beyond_chance(a.stragglers).to_numpy()
            costs = [cpath.rank_costs_us(a.critical_path, r) if is_late else (np.nan, np.nan)
                     for r, is_late in zip(a.stragglers["rank"], late)]
            a.stragglers["cost_per_step_us"] = [c for c, _ in costs]
            a.stragglers["contended_us_per_step"] = [h for _, h in costs]
    unknown = a.overview.get("unknown_launch_kernels") or 0
    if unknown:
        _note(a.notes, "communication",
              f"{unknown} of {a.overview.get('device_kernels')} device kernels were launched before the trace "
              f"window opened (their launch is not in the trace): their stage is 'unknown'.")
    a.exposed_stage = _try(a.notes, "communication", "exposed communication per stage", shares.exposed_by_stage,
                           a.comm_unit_step, a.steps)
    a.exposed_unit = _try(a.notes, "communication", "exposed communication per unit", shares.exposed_by_unit,
                          a.comm_unit_step, a.steps)
    a.idle_causes = _try(a.notes, "device", "device idle by cause", shares.idle_by_cause, a.steps, a.step_stalls)
    a.findings = _findings(a)
    a.whatif = _try(a.notes, "whatif", "what-if predictions", report_reduce, [r.whatif for r in ok])
    a.rank_distributions = _try(a.notes, "ranks", "distributions over ranks", distributions.rank_distributions,
                                a) or {}
    return a


def analyze_run(run, *, hta: bool = False, workers: int | None = None, progress: bool | None = None,
                engine: str | None = None, scheduler: str | None = None, ops: bool = True) -> Analysis:
    """All numbers of one Run (:func:`fsdpprof.analyze.load.run.load_run`): map (on ``engine``, see :func:`map_ranks`),
    reduce, and with ``hta`` HTA's own breakdowns (GPU traces).  ``ops=False`` leaves out ``op_stats`` (what compare
    diffs, the largest per-rank result)."""
    a = reduce_run(run, map_ranks(run, workers=workers, progress=progress, engine=engine, scheduler=scheduler,
                                  ops=ops))
    if hta:
        if not any(d.trace_path for d in run.ranks.values()):
            _note(a.notes, "hta", "no profiler trace in this input, so HTA's breakdowns are left out.")
        elif a.overview.get("device_type") in (None, model.DEVICE_CPU):
            _note(a.notes, "hta", "HTA's kernel, temporal and idle-time breakdowns need GPU kernels: this is a "
                                  f"{a.overview.get('device_type') or 'non-GPU'} trace, so they are left out.")
        else:
            res = _try(a.notes, "hta", "HTA breakdowns", hta_tables.hta_breakdowns, run)
            if res:
                a.hta = res
    return a


def critical_path(run, **kwargs):
    """What limits each step of ``run`` (an Analysis, a Run, or a path load_run reads; ``kwargs`` go to
    :func:`analyze_run`): a :class:`fsdpprof.analyze.comm.critical_path.CriticalPath` (steps, segments, breakdown,
    counterfactuals, µs), or None when the input has no steps."""
    if isinstance(run, Analysis):
        return run.critical_path
    if isinstance(run, (str, os.PathLike)):
        run = load_run(str(run))
    return analyze_run(run, **kwargs).critical_path


# --------------------------------------------------------------------------- fsdpprof overlap
OVERALL_COLUMNS = ["rank", "compute_us", "comm_us", "overlapped_comm_us", "exposed_comm_us", "comp_comm_overlap_pct"]
VOLUME_COLUMNS = ["rank", "collective", "count", "bytes", "time_us", "algbw_gbps", "busbw_gbps"]


@dataclass
class OverlapSummary:
    """What ``fsdpprof overlap`` prints: ``overlap`` one row per rank (OVERALL_COLUMNS, µs and % of comm_us),
    ``volume`` one row per rank and collective (VOLUME_COLUMNS), ``missing`` label -> why, ``warnings``."""

    path: str
    overlap: pd.DataFrame
    volume: pd.DataFrame
    missing: dict
    warnings: list
    description: str = ""   # what the input is, in the words of every command (model.describe_input)

    def to_dict(self) -> dict:
        """Plain dicts and lists (JSON-ready: None where a number or a collective is not known)."""
        return {"path": self.path, "description": self.description, "overlap": records(self.overlap),
                "volume": records(self.volume), "missing": dict(self.missing), "warnings": list(self.warnings)}


def overlap_summary(run, *, workers: int | None = None, engine: str | None = None,
                    scheduler: str | None = None) -> OverlapSummary:
    """Per rank the overall overlap of communication with compute, and the collective volume per rank and
    collective, of a Run: :func:`analyze_run`'s map and reduce restricted to those two tables (the same numbers,
    warnings and errors).  Ranks without a trace are left out (CUDA snapshots only: UserError)."""
    traced = {r: rd for r, rd in run.ranks.items() if rd.trace_path or rd.events is not None}
    if not traced:
        raise UserError(f"{run.path} holds no profiler trace (only CUDA snapshots or inventories): overlap and "
                        f"collective volume come from traces; give a trace file, a folder of traces or a run "
                        f"directory recorded with its trace")
    run = replace(run, ranks=traced)
    missing, ok, warnings = _usable(run, map_ranks(run, workers=workers, engine=engine, scheduler=scheduler,
                                                   progress=False, overlap_only=True))
    note = _rank_notes(ok).get("communication")
    # the inventory's framework and strategy, as report describes the input (one rank's: the ranks agree)
    inv = next((rd.inventory for rd in (with_inventory(rd)[0] for rd in run.ranks.values()) if rd.inventory), None)
    kind, strategy = input_of([replace(r, inventory=inv) for r in ok] if inv else ok, run.world_size)
    overall = _concat(r.overlap_overall for r in ok)
    vol = _concat(r.volume for r in ok)
    return OverlapSummary(
        path=str(run.path), missing=missing, warnings=warnings + ([note] if note else []),
        description=model.describe_input(kind, strategy, run.world_size),
        overlap=overall if overall is not None else pd.DataFrame(columns=OVERALL_COLUMNS),
        volume=vol if vol is not None else pd.DataFrame(columns=VOLUME_COLUMNS))
