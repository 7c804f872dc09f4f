"""Findings: what to try next, each pointing at the number that triggered it, from the small per-run tables.
Thresholds are the module's constants."""
from __future__ import annotations

import math
from dataclasses import asdict, dataclass

import pandas as pd

from fsdpprof import runfmt
from fsdpprof.analyze import model
from fsdpprof.analyze.model import MemoryCategory as MC, fmt_ms
from fsdpprof.analyze.summary import shares
from fsdpprof.analyze.summary.headline import per_step, share_of_step

EXPOSED_PHASE_PCT = 5.0         # exposed time of one collective in one phase, % of step time
EXPOSED_TOTAL_PCT = 20.0        # all exposed communication, % of step time
OPTIMIZER_DOMINATES_PCT = 40.0  # optimizer state, % of memory at the peak
ACTIVATIONS_DOMINATE_PCT = 50.0
UNSHARDED_PARAM_PCT = 30.0
REPLICATED_STATES_PCT = 50.0    # DDP / NO_SHARD: model states, % of the peak
FRAGMENTATION_PCT = 30.0
OUTSIDE_ALLOCATOR_BYTES = 2 << 30  # device memory outside PyTorch's caching allocator (CUDA context, NCCL, ...)
NCCL_BUFFSIZE_DEFAULT = "4 MiB"    # NCCL's default NCCL_BUFFSIZE (per channel, per peer, per protocol)
COVERAGE_LOW_PCT = 70.0
STRAGGLER_ALPHA = 0.01          # a rank is last more often than chance when the binomial p-value is below this
                                # (divided by the ranks tested)
DEVICE_IDLE_PCT = 10.0          # device idle, % of step time (device traces)
SYNC_IDLE_PCT = 2.0             # device idle in the gaps where a host synchronisation returns, % of step time
DATA_LOADER_PCT = 5.0           # DataLoader fetches with the device idle (CPU traces: all of them), % of step time
IDLE_CAUSE_DOMINATES_PCT = 70.0 # an idle cause is named (host-bound, launch-bound) from this share of the idle time
CRITICAL_SAVED_PCT = 2.0        # a counterfactual of the critical path saving at least this % of the step
CRITICAL_RANK_PCT = 5.0         # "rank R as fast as the median rank": at least this % of the step, in the mean and
                                # in 3 of 4 steps (saved_q25_us), beyond its wait for a core (contended_us) and
                                # chance (p_value <= STRAGGLER_ALPHA / ranks tried): on a busy 2-core host a 2-rank
                                # CPU run without a straggler has single steps where a rank saves 5-29 %, a 150 ms
                                # sleep 23-28 % in each
CRITICAL_FINDINGS_MAX = 4       # at most this many findings from the critical path's counterfactuals


@dataclass
class Finding:
    """One thing to try: ``metric`` / ``value`` / ``unit`` the number that triggered it (a share of the step: the
    median over ranks; ``worst``: the value of ``rank``, the worst rank), ``section`` the report section showing
    it, ``stake_us`` the step time at stake per step (µs; NaN for memory or placement), what findings rank by."""

    id: str
    severity: str          # high | medium | info
    title: str
    metric: str
    value: float
    unit: str
    threshold: float
    suggestion: str
    section: str
    rank: int | None = None
    stake_us: float = float("nan")
    worst: float = float("nan")

    def to_dict(self) -> dict:
        return asdict(self)


def _exposed_suggestion(collective: str, stage: str, fsdp: bool) -> str:
    if not fsdp:   # not an FSDP input: no FSDP knobs to turn
        if collective == model.ALL_REDUCE:
            return ("all-reduce is exposed: bucket gradients (DDP bucket_cap_mb) so it overlaps with backward, or "
                    "move less per step (gradient accumulation without sync)")
        return "overlap this collective with compute (issue it earlier, on its own stream) or run it less often"
    if collective == model.ALL_GATHER and stage == model.STAGE_FORWARD:
        return ("prefetch the next unit's all-gather (FSDP2: module.set_modules_to_forward_prefetch; FSDP1: "
                "forward_prefetch=True), or keep parameters after forward (reshard_after_forward=False / "
                "SHARD_GRAD_OP) if memory allows")
    if collective == model.ALL_GATHER:
        return ("backward prefetch (FSDP1 backward_prefetch=BACKWARD_PRE; FSDP2 set_modules_to_backward_prefetch) "
                "or reshard_after_forward=False so backward does not all-gather again")
    if collective == model.REDUCE_SCATTER:
        return ("reduce-scatter is not hidden behind backward compute: use fewer, larger FSDP units, a lower "
                "reduce dtype (MixedPrecision reduce_dtype=bf16) or gradient accumulation without sync")
    if collective == model.ALL_REDUCE:
        return ("all-reduce is exposed: overlap it with backward, or shard (FULL_SHARD / HYBRID_SHARD) to cut "
                "the volume per rank")
    return "overlap this collective with compute or reduce how often it runs"


def rank_words(s: dict) -> str:
    """Whose share a finding states: "median over 8 ranks, worst rank 1: 60%", or "rank 0"."""
    if s["ranks"] > 1:
        return f"median over {s['ranks']} ranks, worst rank {s['worst_rank']}: {model.fmt_pct(s['worst_pct'])}"
    return f"rank {s['worst_rank']}"


def share_words(s: dict, what: str = "of step time") -> str:
    """A share as every finding states it: "43% of step time; median over 8 ranks, worst rank 1: 60%"."""
    return f"{model.fmt_pct(s['pct'])} {what}; {rank_words(s)}"


def _fires(s: dict, threshold: float) -> float:
    """The larger of the median's and the worst rank's share when it crosses ``threshold``, else NaN."""
    v = max(x for x in (s["pct"], s["worst_pct"], -1.0) if x == x)
    return v if v >= threshold else math.nan


def _share_finding(fid: str, severity: str, title: str, metric: str, s: dict, threshold: float, suggestion: str,
                   section: str = "steps") -> Finding:
    """A finding about a share of the step (:func:`share_of_step`'s ``s``): its µs per step is the stake."""
    return Finding(fid, severity, title, metric, s["pct"], "%", threshold, suggestion, section, s["worst_rank"],
                   s["us"], s["worst_pct"])


def comm_findings(comm_unit_step: pd.DataFrame | None, steps: pd.DataFrame | None,
                  fsdp_advice: bool = True, exposed_stage: pd.DataFrame | None = None) -> list[Finding]:
    """Exposed collectives per stage (communication launched inside a step; ``exposed_stage``, else
    :func:`shares.exposed_by_stage` of ``comm_unit_step``) and in all, as shares of the step
    (:func:`share_of_step`).  ``fsdp_advice``: an FSDP input (FSDP knobs may be suggested)."""
    out: list[Finding] = []
    if steps is None or steps.empty or "step_us" not in steps:
        return out
    es = exposed_stage if exposed_stage is not None else shares.exposed_by_stage(comm_unit_step, steps)
    if es is not None:
        for row in es.sort_values(["collective", "stage"], kind="stable").to_dict("records"):
            c, st, s = row["collective"], row["stage"], row
            top = _fires(s, EXPOSED_PHASE_PCT)
            if top != top:
                continue
            out.append(_share_finding(f"exposed_{c}_{st}".replace(" ", "_"),
                                      "high" if top >= 4 * EXPOSED_PHASE_PCT else "medium",
                                      f"Exposed {c} in {st}: {fmt_ms(s['us'])} per step ({share_words(s)})",
                                      f"exposed_comm_us[{c}, {st}] per step / step_us (median over ranks)", s,
                                      EXPOSED_PHASE_PCT, _exposed_suggestion(c, st, fsdp_advice), "communication"))
    if "exposed_comm_us" in steps:
        s = share_of_step(steps, "exposed_comm_us")
        top = _fires(s, EXPOSED_TOTAL_PCT)
        if top == top:
            out.append(_share_finding("exposed_comm_total", "high",
                                      f"Communication not hidden behind compute is {model.fmt_pct(s['pct'])} of the "
                                      f"step ({fmt_ms(s['us'])} per step; {rank_words(s)})",
                                      "steps.exposed_comm_us / steps.step_us (median over ranks)", s, EXPOSED_TOTAL_PCT,
                                      "more compute per collective (larger batch / sequence, gradient accumulation), "
                                      "prefetching, or a strategy that moves fewer bytes (see the traffic table)"))
    return out


# the device's idle causes (breakdown.device_idle_by_cause, columns of step_stalls): words, advice
IDLE_CAUSES = {
    "idle_host_wait_us": ("waiting for the host to launch work (host-bound)",
                          "the CPU does not launch work fast enough: capture the step in CUDA graphs "
                          "(torch.compile mode='reduce-overhead'), fuse small ops (torch.compile), take Python-side "
                          "work (logging, metrics, data preparation) off the training loop, or give each kernel more "
                          "work (a larger batch)"),
    "idle_kernel_wait_us": ("in gaps under 30 µs between back-to-back kernels (launch-bound)",
                            "too many small kernels: fuse them (torch.compile, fused optimizers foreach=True / "
                            "fused=True), capture the step in CUDA graphs, or give each kernel more work"),
    "idle_other_us": ("waiting on other streams' kernels, events or the host's synchronisations",
                      "a stream waits on another one or on the host: see the exposed communication and the "
                      "host synchronisations below, and the lanes of one step"),
}


def device_findings(steps: pd.DataFrame | None, stalls: pd.DataFrame | None, device: bool = True,
                    idle_causes: pd.DataFrame | None = None) -> list[Finding]:
    """What keeps the device waiting, from the steps table and step_stalls: the device idle with its cause when one
    dominates (IDLE_CAUSE_DOMINATES_PCT of it; ``idle_causes``, else :func:`shares.idle_by_cause`), the host's
    synchronisations, the DataLoader; shares of the step as in :func:`share_words`."""
    out: list[Finding] = []
    if steps is None or steps.empty or "step_us" not in steps:
        return out
    if device and "idle_us" in steps:
        s = share_of_step(steps, "idle_us")
        top = _fires(s, DEVICE_IDLE_PCT)
        if top == top:
            why, advice = "", "see the idle-time breakdown by stream in the device section and the lanes of one step"
            ic = idle_causes if idle_causes is not None else shares.idle_by_cause(steps, stalls)
            if ic is not None and ic["us"].sum() > 0:
                ic = ic.sort_values("us", ascending=False, kind="stable")
                top_cause = ic.iloc[0]
                if top_cause["pct_of_idle"] >= IDLE_CAUSE_DOMINATES_PCT:
                    cause = str(top_cause["cause"])
                    why = f": {top_cause['pct_of_idle']:.0f}% of it {IDLE_CAUSES[cause][0]}"
                    advice = IDLE_CAUSES[cause][1]
                else:       # no cause dominates: name the split, claim none
                    why = ": no single cause dominates (" + ", ".join(
                        f"{r['pct_of_idle']:.0f}% {IDLE_CAUSES[r['cause']][0].split(' (')[0]}" for _, r in ic.iterrows()
                        if r["us"] > 0) + ")"
            out.append(_share_finding("device_idle", "high" if top >= 3 * DEVICE_IDLE_PCT else "medium",
                                      f"The device is idle {model.fmt_pct(s['pct'])} of the step "
                                      f"({fmt_ms(s['us'])} per step; {rank_words(s)}){why}",
                                      "steps.idle_us / steps.step_us (median over ranks); cause: step_stalls.idle_*_us",
                                      s, DEVICE_IDLE_PCT, advice))
    if stalls is None or stalls.empty or "step" not in stalls:
        return out
    if device and "sync_idle_us" in stalls:
        t = per_step(steps, stalls, ["sync_idle_us", "sync_calls", "scalar_sync_calls"])
        s = share_of_step(t, "sync_idle_us")
        top = _fires(s, SYNC_IDLE_PCT)
        if top == top:
            calls = t.groupby("rank")[["sync_calls", "scalar_sync_calls"]].mean().median()
            of_item = (f", {calls['scalar_sync_calls']:.3g} of them in tensor.item()"
                       if calls["scalar_sync_calls"] > 0 else "")
            out.append(_share_finding("host_syncs", "high" if top >= 5 * SYNC_IDLE_PCT else "medium",
                                      f"{calls['sync_calls']:.3g} host synchronisations per step{of_item} leave the "
                                      f"device idle {fmt_ms(s['us'])} per step ({share_words(s)})",
                                      "step_stalls.sync_idle_us / steps.step_us (median over ranks)", s, SYNC_IDLE_PCT,
                                      "keep the host from waiting on the device inside the step: no .item(), .cpu(), "
                                      "print or if on device tensors in the loop (log every N steps, keep metrics on "
                                      "the device), no torch.cuda.synchronize(); copy to the host with "
                                      "non_blocking=True into pinned memory"))
    col = "data_loader_idle_us" if device else "data_loader_us"
    if col in stalls:
        t = per_step(steps, stalls, list(dict.fromkeys([col, "data_loader_us"])))
        s = share_of_step(t, col)
        top = _fires(s, DATA_LOADER_PCT)
        if top == top:
            what = (f"DataLoader fetches leave the device idle {fmt_ms(s['us'])} per step" if device else
                    f"DataLoader fetches take {fmt_ms(s['us'])} per step on the training thread")
            fetching = (f"; {fmt_ms(t.groupby('rank')['data_loader_us'].mean().median())} fetching" if device else "")
            out.append(_share_finding("data_loader", "high" if top >= 4 * DATA_LOADER_PCT else "medium",
                                      f"{what} ({share_words(s)}{fetching})",
                                      f"step_stalls.{col} / steps.step_us (median over ranks)", s, DATA_LOADER_PCT,
                                      "load data ahead of the step: DataLoader num_workers > 0 with "
                                      "persistent_workers=True and prefetch_factor, pin_memory=True and "
                                      ".to(device, non_blocking=True), preprocessing moved into the workers"))
    return out


def memory_findings(breakdown: pd.DataFrame | None, strategy: str | None, peak_bytes: float | None,
                    fragmentation_pct: float | None = None, coverage_pct: float | None = None,
                    rank: int | None = None, alternatives: dict | None = None,
                    input_kind: str | None = model.FAMILY_FSDP2, units: list[str] | None = None) -> list[Finding]:
    """From one rank's breakdown at the peak (category, bytes, pct).  ``alternatives``: strategy label -> model-state
    bytes per rank, quoted; ``units``: the FSDP units keeping the most activations first (named in the advice)."""
    out: list[Finding] = []
    if breakdown is None or breakdown.empty:
        return out
    pct = breakdown.groupby("category", observed=True)["pct"].sum()
    get = lambda c: float(pct.get(c.value, 0.0))  # noqa: E731
    opt = get(MC.OPTIMIZER_STATE)
    if opt >= OPTIMIZER_DOMINATES_PCT:
        out.append(Finding("optimizer_state_dominates", "high" if opt >= 60 else "medium",
                           f"Optimizer state is {opt:.1f}% of memory at the peak",
                           "breakdown_at_peak[optimizer_state].pct", opt, "%", OPTIMIZER_DOMINATES_PCT,
                           ("shard it further (FULL_SHARD, or a larger shard group), offload it to CPU "
                            "(CPUOffload / ZeRO-Offload), or use" if input_kind in model.FSDP_KINDS or strategy
                            else "use") + " an optimizer with less state (8-bit Adam, Adafactor)",
                           "memory", rank))
    act = get(MC.ACTIVATION)
    if act >= ACTIVATIONS_DOMINATE_PCT:
        if units:
            named = ", ".join(units[:3]) + (" ..." if len(units) > 3 else "")
            advice = (f"activation checkpointing of the FSDP units that keep the most ({named}), a smaller "
                      f"micro-batch, or sequence parallelism; sharding does not reduce activations")
        elif input_kind in model.FSDP_KINDS:
            advice = ("activation checkpointing of the FSDP units (the model's blocks), a smaller micro-batch, or "
                      "sequence parallelism; sharding does not reduce activations")
        else:   # nothing says the model has blocks: advice for any model
            advice = ("a smaller micro-batch (gradient accumulation keeps the global batch), or activation "
                      "checkpointing (torch.utils.checkpoint) of the modules whose forward keeps the most; "
                      "sharding does not reduce activations")
        out.append(Finding("activations_dominate", "medium", f"Activations are {act:.1f}% of memory at the peak",
                           "breakdown_at_peak[activation].pct", act, "%", ACTIVATIONS_DOMINATE_PCT, advice,
                           "memory", rank))
    unsh = get(MC.UNSHARDED_PARAM)
    if unsh >= UNSHARDED_PARAM_PCT and input_kind in model.FSDP_KINDS:
        out.append(Finding("unsharded_params_large", "medium",
                           f"All-gathered (unsharded) parameters are {unsh:.1f}% of memory at the peak",
                           "breakdown_at_peak[unsharded_param].pct", unsh, "%", UNSHARDED_PARAM_PCT,
                           "wrap smaller FSDP units so fewer parameters are unsharded at once, and reshard after "
                           "forward (reshard_after_forward=True / FULL_SHARD); limit prefetch depth", "memory", rank))
    states = sum(get(c) for c in (MC.SHARDED_PARAM, MC.SHARDED_GRAD, MC.PARAM, MC.GRAD, MC.OPTIMIZER_STATE))
    if strategy in (model.DDP, model.NO_SHARD) and input_kind != model.INPUT_SINGLE_DEVICE and states >= REPLICATED_STATES_PCT:
        out.append(Finding("replicated_model_states", "high",
                           f"Model states, replicated on every rank by {strategy}, are {states:.1f}% of the peak",
                           "breakdown_at_peak[param+grad+optimizer_state].pct", states, "%", REPLICATED_STATES_PCT,
                           "shard them: FULL_SHARD divides them by N, SHARD_GRAD_OP shards grads and optimizer "
                           "state" + (" (model states per rank by theory: " + ", ".join(
                               f"{k} {model.fmt_bytes(v)}" for k, v in alternatives.items()) + ")"
                                      if alternatives else ""), "memory", rank))
    if fragmentation_pct is not None and fragmentation_pct == fragmentation_pct and fragmentation_pct >= FRAGMENTATION_PCT:
        out.append(Finding("fragmentation", "medium", f"{fragmentation_pct:.1f}% of reserved memory is not allocated",
                           "fragmentation_pct", float(fragmentation_pct), "%", FRAGMENTATION_PCT,
                           "PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True", "memory", rank))
    if coverage_pct is not None and coverage_pct == coverage_pct and coverage_pct < COVERAGE_LOW_PCT:
        before, other = get(MC.BEFORE_RECORDING), get(MC.OTHER)
        rest = []
        if before > 0:
            rest.append(f"{before:.1f}% was allocated before recording (alive before the allocation history began: "
                        f"start torch.cuda.memory._record_memory_history before the model is built, or record with "
                        f"fsdpprof record, whose inventory names parameters and optimizer state by address)")
        if other > 0 or not rest:
            rest.append(f"{other:.1f}% is other (no frame, tag or inventory names it: record with the inventory "
                        f"(fsdpprof record) so parameters, gradients and optimizer state are matched by address)")
        out.append(Finding("low_attribution", "info", f"Only {coverage_pct:.1f}% of the peak has a named category",
                           "coverage_pct", float(coverage_pct), "%", COVERAGE_LOW_PCT, "; ".join(rest), "memory",
                           rank))
    return out


def process_findings(process: dict | None, rank: int | None = None) -> list[Finding]:
    """Device memory outside the caching allocator (``memory[rank].process``) of at least OUTSIDE_ALLOCATOR_BYTES,
    with the NCCL settings that size NCCL's buffers; none on CPU."""
    if not process or process.get("source") == runfmt.PROCESS_MEMORY_PROC_STATUS:
        return []
    outside = process.get("outside_allocator_peak_bytes")
    if outside is None or outside < OUTSIDE_ALLOCATOR_BYTES:
        return []
    env = process.get("nccl_env") or {}
    said = ", ".join(f"{k}={v}" for k, v in sorted(env.items())) or \
        f"none set: NCCL_BUFFSIZE at its default {NCCL_BUFFSIZE_DEFAULT}, channels as NCCL chooses"
    dev = process.get("device") or "the device"
    fb = model.fmt_bytes
    return [Finding("outside_allocator", "medium",
                    f"{fb(outside)} of {dev} is outside PyTorch's caching allocator (device used "
                    f"{fb(process.get('used_peak_bytes'))}, allocator reserved "
                    f"{fb(process.get('allocator_reserved_peak_bytes'))})",
                    "process.outside_allocator_peak_bytes", float(outside), "bytes", float(OUTSIDE_ALLOCATOR_BYTES),
                    "the CUDA context, NCCL's buffers and other libraries hold it. NCCL's buffers grow with "
                    "NCCL_BUFFSIZE (per channel and peer), the channels (NCCL_MIN_NCHANNELS / NCCL_MAX_NCHANNELS) and "
                    f"the number of communicators (process groups); this run's settings: {said}. Lower NCCL_BUFFSIZE "
                    "or NCCL_MAX_NCHANNELS (less bandwidth), or create fewer process groups"
                    + ("; the figure is the whole device's (every process on it)"
                       if process.get("source") == runfmt.PROCESS_MEMORY_MEM_GET_INFO else ""),
                    "memory", rank)]


def topology_findings(strategy: str | None, hosts: int, world: int) -> list[Finding]:
    """Cross-node traffic of a flat FULL_SHARD over several hosts -> HYBRID_SHARD."""
    if hosts > 1 and strategy in ("FULL_SHARD", "SHARD_GRAD_OP"):
        return [Finding("cross_node_shard", "medium",
                        f"{strategy} shards over {world} ranks on {hosts} hosts: every all-gather and "
                        f"reduce-scatter crosses the slower inter-node network", "hosts", float(hosts), "hosts", 1.0,
                        "HYBRID_SHARD (shard within a node, replicate across nodes) keeps the per-step "
                        "all-gathers on NVLink", "overview")]
    return []


def late_beyond_chance(stragglers: pd.DataFrame) -> pd.Series:
    """Per row of ``stragglers``: whether the rank is last into more checked matches than chance explains (its
    binomial ``p_value`` at most STRAGGLER_ALPHA over the ranks tested)."""
    if stragglers is None or len(stragglers) < 2 or "p_value" not in stragglers:
        return pd.Series(False, index=getattr(stragglers, "index", None), dtype=bool)
    return stragglers["p_value"] <= STRAGGLER_ALPHA / len(stragglers)


def rank_findings(stragglers: pd.DataFrame | None, step_us: float | None) -> list[Finding]:
    """A rank last into more checked matches than chance explains (binomial p-value below STRAGGLER_ALPHA over the
    ranks tested) whose lateness costs at least CRITICAL_SAVED_PCT of the step (``cost_per_step_us``: the critical
    path's counterfactual, held to the same floor as the others; 1 % named a 2-rank CPU run without a straggler on
    a loaded host: 457 µs of a 41 ms step) beyond what
    its longer wait for a core explains (``contended_us_per_step``, CPU runs); the one that costs most."""
    out: list[Finding] = []
    if stragglers is None or stragglers.empty or "p_value" not in stragglers or len(stragglers) < 2:
        return out
    alpha = STRAGGLER_ALPHA / len(stragglers)
    cost_floor = CRITICAL_SAVED_PCT / 100.0 * step_us if step_us and step_us == step_us else 0.0
    contended = stragglers["contended_us_per_step"].fillna(0.0) if "contended_us_per_step" in stragglers else 0.0
    own = stragglers["cost_per_step_us"] - contended     # what its longer wait for a core explains is the host's
    s = stragglers[late_beyond_chance(stragglers) & (own >= cost_floor) & (own > 0)]
    if s.empty:
        return out
    s = s.sort_values("cost_per_step_us", ascending=False, kind="mergesort").iloc[0]
    rank, cost = int(s["rank"]), float(s["cost_per_step_us"])
    where = s.get("where")
    where = f", mostly before collectives of {where}" if isinstance(where, str) and where else ""
    host = float(s.get("contended_us_per_step", math.nan))
    where += f"; its longer wait for a core explains {fmt_ms(host)} of it" if host == host and host > 0 else ""
    pct = f" ({100.0 * cost / step_us:.1f}% of the step)" if step_us else ""
    out.append(Finding("straggler", "medium",
                       f"Rank {rank} is a straggler: last into {s['share_last_pct']:.0f}% of collectives (chance: "
                       f"{s['expected_last_pct']:.0f}%, p = {s['p_value']:.2g}); as fast as the median rank it would "
                       f"save {fmt_ms(cost)} per step{pct}{where}",
                       "stragglers.cost_per_step_us (the critical path's counterfactual; rank last into more "
                       f"collectives than chance, binomial p <= {alpha:.2g})", cost, "us", cost_floor,
                       "look at what that rank does before those collectives: data loading, uneven inputs, a slower "
                       "host or GPU, or extra work (logging, checkpointing) on that rank; prefetching does not help "
                       "time spent waiting for another rank", "ranks", rank, stake_us=cost))
    return out


def _where_on_path(seg: pd.DataFrame) -> tuple[int | None, str, float]:
    """(rank, "host / launch gap in layers.2, forward", µs per step) of the path's (rank, kind, unit, stage) with
    most time in ``seg`` (segments of every step; µs per step = the mean over the steps)."""
    if seg is None or not len(seg):
        return None, "", 0.0
    g = seg.groupby(["rank", "kind", "unit", "stage"], dropna=False)["dur_us"].sum().sort_values(ascending=False)
    (rank, kind, unit, stage), us = g.index[0], float(g.iloc[0])
    unit, stage = (x if isinstance(x, str) else None for x in (unit, stage))
    place = ", ".join(x for x in (("the root unit" if unit == "" else unit) if unit is not None else None,
                                  model.stage_words(stage) if stage else None) if x)
    words = model.PATH_KIND_WORDS.get(kind, kind) + (f" in {place}" if place else "")
    return int(rank), words, us / max(seg["step"].nunique(), 1)


# a critical-path finding about a kind of gap is not made where the device findings already say it (their ids)
SAID_BY = {model.CHANGE_HOST_GAPS: "device_idle", model.CHANGE_DATA: "data_loader", model.CHANGE_SYNC: "host_syncs"}


# a host gap on a CPU trace: the training thread runs no operator (no device waits on a launch)
CPU_HOST_GAP_ADVICE = ("on a CPU trace a host gap is time the training thread runs no operator: Python between ops, "
                       "sleeps, I/O, locks or waiting for a core; where it sits on one rank only, look at what that "
                       "rank does there (py-spy, or the profiler with with_stack=True); where every rank has it, "
                       "take Python-side work (logging, metrics, data preparation) off the training loop")


def critical_path_findings(cp, fsdp_advice: bool = True, said: set | None = None,
                           device: bool = True) -> list[Finding]:
    """The changes of the critical path's counterfactuals that save at least CRITICAL_SAVED_PCT of the step
    (at most CRITICAL_FINDINGS_MAX, most saved first), each naming the rank, unit and stage where it holds most
    path time; the time is at stake (``stake_us``: µs saved per step).  ``said``: ids of findings already made
    (a gap kind that a device finding names is left to it, SAID_BY); ``device``: an accelerator trace (a host gap
    leaves the device waiting for a launch) or not (CPU: the training thread runs nothing)."""
    said = said or set()
    out: list[Finding] = []
    cf = getattr(cp, "counterfactuals", None)
    if cf is None or not len(cf) or not len(cp.steps):
        return out
    step_us = float(cp.steps["span_us"].mean())
    seg = cp.segments
    skip = {model.CHANGE_TYPE, model.CHANGE_ALL_COMM}     # (what the exposed-communication findings are held to)
    ranks_tried = max(int((cf["kind"] == model.CHANGE_RANK).sum()), 1)
    for c in cf[~cf["kind"].isin(skip)].itertuples(index=False):
        saved = float(c.saved_us_per_step)
        if SAID_BY.get(c.kind) in said:
            continue
        floor = CRITICAL_RANK_PCT if c.kind == model.CHANGE_RANK else CRITICAL_SAVED_PCT
        # a rank's saving that its longer wait for a core explains is the host's, not the rank's (CPU runs)
        contended = float(c.contended_us) if c.kind == model.CHANGE_RANK and c.contended_us == c.contended_us \
            else 0.0
        if not step_us or saved - contended < floor / 100.0 * step_us or len(out) >= CRITICAL_FINDINGS_MAX:
            continue
        if c.kind == model.CHANGE_RANK and not float(c.saved_q25_us) - contended >= floor / 100.0 * step_us:
            continue       # slow in a step or two only: chance (a straggler is slow in most steps)
        if c.kind == model.CHANGE_RANK and float(c.p_value) > STRAGGLER_ALPHA / ranks_tried:
            continue       # not slower than the others beyond chance over the steps
        pct_v = float(c.saved_pct)
        pct = f"{model.fmt_pct(pct_v)} of the step"
        metric = f"critical_path.counterfactuals.saved_pct[{c.change}]"
        if c.kind == model.CHANGE_RANK:
            r = int(c.rank)
            place = ", ".join(x for x in (("the root unit" if c.unit == "" else c.unit) if isinstance(c.unit, str)
                                          else None, model.stage_words(c.stage) if isinstance(c.stage, str) else None)
                              if x)
            where = model.PATH_KIND_WORDS.get(c.segment_kind, "its work") + (f" in {place}" if place else "")
            host = f"; its longer wait for a core explains {fmt_ms(contended)} of it" if contended > 0 else ""
            n = len(cp.steps)
            chance = f"p = {float(c.p_value):.2g} by chance over {n} steps" if c.p_value == c.p_value else \
                f"{n} step{'s' if n != 1 else ''}: chance not tested"
            out.append(Finding(
                f"limiting_rank_{r}", "high", f"Rank {r} limits the step: as fast as the median rank it would save "
                f"{fmt_ms(saved)} per step ({pct}; {chance}); it is slower than the others most in {where}{host}",
                metric, pct_v, "%", CRITICAL_RANK_PCT,
                f"look at what rank {r} does there (data loading, uneven inputs, a slower host or device, extra "
                f"work such as logging or checkpointing on that rank); the other ranks wait for it in their "
                f"collectives, which prefetching does not help", "critical_path", r, stake_us=saved))
        elif c.kind == model.CHANGE_COLLECTIVE:
            if not isinstance(c.unit, str):
                continue      # no unit: the exposed-communication finding of its (collective, stage) says it
            unit = "the root unit" if c.unit == "" else f"unit {c.unit}"
            stage = f" in {model.stage_words(c.stage)}" if isinstance(c.stage, str) and c.stage else ""
            part = seg[(seg["kind"] == model.PATH_COLLECTIVE) & (seg["what"] == c.collective)]
            rank, _, _ = _where_on_path(part)
            out.append(Finding(
                f"exposed_{c.collective}_{c.unit}_{c.stage}".replace(" ", "_"), "high" if saved >= 4 *
                CRITICAL_SAVED_PCT / 100.0 * step_us else "medium",
                f"The {model.collective_words(c.collective)} of {unit}{stage} sets the step: hidden, it would save "
                f"{fmt_ms(saved)} per step ({pct})", metric, pct_v, "%", CRITICAL_SAVED_PCT,
                _exposed_suggestion(str(c.collective), str(c.stage), fsdp_advice), "critical_path", rank,
                stake_us=saved))
        else:
            kind = {model.CHANGE_HOST_GAPS: model.PATH_HOST_GAP, model.CHANGE_DATA: model.PATH_DATA,
                    model.CHANGE_SYNC: model.PATH_SYNC}.get(c.kind)
            rank, where, us = _where_on_path(seg[seg["kind"] == kind])
            advice = {model.CHANGE_HOST_GAPS: IDLE_CAUSES["idle_host_wait_us"][1] if device else CPU_HOST_GAP_ADVICE,
                      model.CHANGE_DATA: "more DataLoader workers (num_workers), pinned memory and prefetch_factor, "
                                         "or lighter per-batch preprocessing",
                      model.CHANGE_SYNC: "remove host synchronisations from the step (tensor.item(), .cpu(), "
                                         "printing device values): accumulate on the device, read once per N steps"}
            out.append(Finding(
                f"critical_{c.kind}", "high" if saved >= 4 * CRITICAL_SAVED_PCT / 100.0 * step_us else "medium",
                f"{model.PATH_KIND_WORDS.get(kind, kind).capitalize()} on the critical path: {c.change} would save "
                f"{fmt_ms(saved)} per step ({pct}); most is on rank {rank}, {where} ({fmt_ms(us)} per step)",
                metric, pct_v, "%", CRITICAL_SAVED_PCT, advice.get(c.kind, ""), "critical_path", rank,
                stake_us=saved))
    return out


def held_to_critical_path(items: list[Finding], cp) -> list[Finding]:
    """The exposed-communication findings with their stake cut to what hiding that communication saves by the
    critical path (time spent waiting for another rank is not theirs); one that saves under 1 % of the step is
    dropped.  Unchanged without counterfactuals."""
    cf = getattr(cp, "counterfactuals", None)
    if cf is None or not len(cf) or not len(cp.steps):
        return items
    step_us = float(cp.steps["span_us"].mean())
    typed = cf[cf["kind"] == model.CHANGE_TYPE]
    saved_of = {(str(c.collective), str(c.stage)): float(c.saved_us_per_step) for c in typed.itertuples()}
    every = cf[cf["kind"] == model.CHANGE_ALL_COMM]["saved_us_per_step"]
    out = []
    for f in items:
        if f.id == "exposed_comm_total":
            saved = float(every.iat[0]) if len(every) else 0.0
        elif f.id.startswith("exposed_") and f.section == "communication":
            key = next(((c, st) for (c, st) in saved_of if f.id == f"exposed_{c}_{st}".replace(" ", "_")), None)
            saved = saved_of[key] if key else 0.0
        else:
            out.append(f)
            continue
        if saved < 0.01 * step_us:
            continue
        f.title += f" - hidden, it would save {fmt_ms(saved)} per step (critical path)"
        f.stake_us = saved
        out.append(f)
    return out


def sort_findings(items: list[Finding]) -> list[Finding]:
    """Findings about step time first, most time at stake first; then the others by severity and value."""
    order = {"high": 0, "medium": 1, "info": 2}

    def key(f: Finding):
        stake = f.stake_us if isinstance(f.stake_us, (int, float)) and f.stake_us == f.stake_us else None
        if stake is not None:
            return (0, -float(stake), 0)
        return (1, order.get(f.severity, 3), -abs(f.value if f.value == f.value else 0))

    return sorted(items, key=key)


PLACE_COLUMNS = ["number", "rank", "start_us", "end_us"]


def finding_places(items: list[Finding], ranks, step_windows: pd.DataFrame | None,
                   exposed_spans: pd.DataFrame | None, peak_ts_us: dict | None) -> pd.DataFrame:
    """Where on a rank's clock (µs) each finding (``number`` from 1) points: a memory finding at the memory peak, an
    exposed collective at its longest exposed span, anything else at the rank's longest step."""
    ranks = sorted(int(r) for r in ranks)
    rows = []
    win = step_windows if step_windows is not None and len(step_windows) else None
    exp = exposed_spans if exposed_spans is not None and len(exposed_spans) else None
    for i, f in enumerate(items, start=1):
        r = int(f.rank) if f.rank is not None and int(f.rank) in ranks else (ranks[0] if ranks else None)
        if r is None:
            continue
        place = None
        if f.section == "memory" and peak_ts_us and peak_ts_us.get(r) is not None:
            place = (peak_ts_us[r], peak_ts_us[r])
        elif f.id.startswith("exposed_") and exp is not None:
            e = exp[exp["rank"] == r]
            coll = next((c for c in model.COLLECTIVES if f.id.startswith(f"exposed_{c}_")), None)
            if coll is not None:
                e = e[e["collective"] == coll]
            if len(e):
                k = (e["end_us"] - e["start_us"]).to_numpy().argmax()
                place = (float(e["start_us"].iat[k]), float(e["end_us"].iat[k]))
        if place is None and win is not None:
            w = win[win["rank"] == r]
            if len(w):
                k = (w["end_us"] - w["start_us"]).to_numpy().argmax()
                place = (float(w["start_us"].iat[k]), float(w["end_us"].iat[k]))
        if place is not None:
            rows.append((i, r, place[0], place[1]))
    return pd.DataFrame(rows, columns=PLACE_COLUMNS)
