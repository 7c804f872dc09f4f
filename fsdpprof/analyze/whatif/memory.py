"""Peak memory of another strategy, by replaying the run's own allocation timeline under its rules.

Input: one rank's categorised allocations frame (``MemoryResult.allocations``: bytes, alloc_us, free_us,
category, stage, fsdp_phase, unit, step_idx ...). Each allocation gets a *role*:

==============  ============================================================================
role            what it is, and what the target does with it
==============  ============================================================================
param_state     this rank's parameters (sharded, or whole when replicated): x local share per unit
opt_state       optimizer state: x local share per unit
grad_state      the gradient the optimizer reads (sharded grad, or DDP's whole grad): x local share;
                a replicated run's whole grads become a sharded target's autograd grads (freed
                at the unit's post-backward) and vice versa (kept until zero_grad)
auto_grad       autograd's whole grads of an FSDP run, freed when copied into the reduce buffer
rs              reduce-scatter input and its scratch (unsharded grads in the reduce phase)
ag_flat         FSDP2's flat all-gather output (freed at the next copy-out in forward, its own in
                backward)
ag_held         the unsharded parameters compute uses (FSDP2 copy-out, FSDP1 padded flat param):
                freed after forward (reshard_after_forward) or after backward
ag_scratch      the collective's own scratch during an all-gather
opt_tmp         temporaries of the optimizer step: x local share
keep            activations, other temporaries, inputs: kept as measured (x batch scale)
==============  ============================================================================

Per step and unit the schedule gives the anchors F0/F1 (forward gather / end of the unit's forward),
B0/B1 (backward gather / the unit's post-backward) and Z (zero_grad), taken from the allocations
themselves (same clock as the memory record). Groups the target needs and the run lacks (a backward
all-gather under FULL_SHARD from a SHARD_GRAD_OP run, everything FSDP from a DDP run) are synthesised
at those anchors with the unit's sizes. The peak is the maximum of the replayed timeline.
Bytes; times in µs of the memory record's clock.
"""
from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np
import pandas as pd

from fsdpprof.analyze import model
from fsdpprof.analyze.model import MemoryCategory as MC
from fsdpprof.analyze.model import ROOT_UNIT
from fsdpprof.analyze.whatif import targets as tg
from fsdpprof.analyze.whatif.units import Unit, local_numel, padded_numel

EPS_US = 1e-3                                   # orders events at one anchor: frees, then allocations
KEEP_SCALED = frozenset({MC.ACTIVATION.value, MC.TEMPORARY.value, MC.INPUT.value})
# gloo's all-gather / emulated reduce-scatter copy their buffer once more while they run (measured on
# this project's gloo runs); NCCL works in its own buffers, outside the caching allocator
SCRATCH_DEFAULT = {"cpu": 1.0}


@dataclass
class MemoryPrediction:
    """Peak of the replayed timeline (bytes), what is alive at it by category, and the story."""

    peak_allocated_bytes: int
    breakdown: dict                      # category -> bytes alive at the peak
    peak_stage: str | None
    host_bytes: int = 0                  # model states moved to the host (offload on an accelerator)
    kept: list = field(default_factory=list)
    assumed: list = field(default_factory=list)


# --------------------------------------------------------------------------- roles
def _str_or_none(values) -> np.ndarray:
    v = np.asarray(values, dtype=object)
    return np.array([x if isinstance(x, str) else None for x in v], dtype=object)


def roles_frame(allocs: pd.DataFrame, family: str) -> pd.DataFrame:
    """The allocations as replay rows: bytes, t0, t1 (-inf / +inf outside the record), seq0, seq1, category,
    role, unit (None when unknown), step, stage (fwd / bwd pass of a gather)."""
    cat = allocs["category"].astype(object).to_numpy()
    phase = _str_or_none(allocs["fsdp_phase"])
    stage = _str_or_none(allocs["stage"])
    ph = pd.Series(phase, dtype=object)
    in_gather = ph.isin(model.GATHER_PHASES).to_numpy()
    in_flat = ph.isin(model.FLAT_GATHER_PHASES).to_numpy()
    in_reduce = ph.isin(model.UNSHARDED_GRAD_PHASES).to_numpy()
    opt_stage = pd.Series(stage, dtype=object).isin([model.STAGE_OPTIMIZER, model.STAGE_POST_STEP]).to_numpy()
    conds = [cat == MC.SHARDED_PARAM.value, cat == MC.OPTIMIZER_STATE.value, cat == MC.SHARDED_GRAD.value,
             (cat == MC.UNSHARDED_PARAM.value) & in_flat & (family == "fsdp2"),
             cat == MC.UNSHARDED_PARAM.value,
             (cat == MC.UNSHARDED_GRAD.value) & in_reduce, cat == MC.UNSHARDED_GRAD.value,
             (cat == MC.TEMPORARY.value) & in_gather, (cat == MC.TEMPORARY.value) & opt_stage]
    role = np.select(conds, ["param_state", "opt_state", "grad_state", "ag_flat", "ag_held", "rs", "auto_grad",
                             "ag_scratch", "opt_tmp"], "keep").astype(object)
    aseq = allocs["alloc_seq"].to_numpy(np.int64)
    fseq = allocs["free_seq"].to_numpy(np.int64)
    step = allocs["step_idx"].to_numpy(np.int64)
    if len(np.unique(step[aseq >= 0])) <= 1:       # a CUDA snapshot is one window: split it into steps
        step = steps_from_stages(stage, aseq)
    t0 = np.where(aseq < 0, -np.inf, allocs["alloc_us"].to_numpy(float))
    t1 = allocs["free_us"].to_numpy(float)
    t1 = np.where(np.isnan(t1) | (fseq == np.iinfo(np.int64).max), np.inf, t1)
    return pd.DataFrame({
        "bytes": allocs["bytes"].to_numpy(np.float64), "t0": t0, "t1": t1,
        "seq0": aseq.astype(np.float64), "seq1": np.where(np.isinf(t1), np.inf, fseq.astype(np.float64)),
        "category": cat, "role": role, "unit": _str_or_none(allocs["unit"]),
        "step": step, "stage": stage})


def steps_from_stages(stage: np.ndarray, alloc_seq: np.ndarray) -> np.ndarray:
    """Step index of each allocation from the stages alone (a CUDA snapshot has no step marks): in record
    order, a step starts at the first data / forward allocation after an optimizer (or post-step) one.
    Allocations before the record keep -1."""
    st = pd.Series(np.asarray(stage, dtype=object))
    order = np.argsort(alloc_seq, kind="stable")
    s = st.to_numpy(object)[order]
    kind = np.where(pd.Series(s).isin([model.STAGE_DATA, model.STAGE_FORWARD]).to_numpy(), 1,
                    np.where(pd.Series(s).isin([model.STAGE_OPTIMIZER, model.STAGE_POST_STEP]).to_numpy(), 2, 0))
    last = pd.Series(np.where(kind > 0, kind, np.nan)).ffill().shift(1).to_numpy()
    start = (kind == 1) & (last == 2)
    idx = np.cumsum(start)
    out = np.empty(len(order), dtype=np.int64)
    out[order] = idx
    return np.where(np.asarray(alloc_seq) < 0, -1, out)


def label_units(r: pd.DataFrame, units: list[Unit], unit_sizes: dict[str, float], names: pd.Series | None,
                name_unit: dict[str, str]) -> None:
    """Fill in ``unit`` where the record has none (in place): grads and states from the inventory's names;
    FSDP1 gathers in forward / backward order, matched by size; reduce rows by the gradient shard made
    just before them."""
    fqns = {u.fqn for u in units}
    unit = r["unit"].to_numpy(object).copy()
    unit = np.where(pd.Series(unit).isin(fqns).to_numpy(), unit, None)
    if names is not None:
        by_name = names.map(name_unit).to_numpy(object)
        unit = np.where(pd.isna(unit) & pd.notna(by_name), by_name, unit)
    role = r["role"].to_numpy(object)
    t0 = r["t0"].to_numpy(float)
    step = r["step"].to_numpy()
    stage = r["stage"].to_numpy(object)
    fwd_order = [u.fqn for u in sorted(units, key=lambda u: u.order)]
    for s in np.unique(step[step >= 0]):
        for pass_, order in ((model.STAGE_FORWARD, fwd_order), (model.STAGE_BACKWARD, fwd_order[:1] + fwd_order[1:][::-1])):
            idx = np.flatnonzero((role == "ag_held") & (step == s) & (stage == pass_) & pd.isna(unit))
            idx = idx[np.argsort(t0[idx], kind="stable")]
            k = 0
            for i in idx:
                b = r["bytes"].iat[i]
                j = next((j for j in range(k, len(order)) if abs(unit_sizes[order[j]] - b) <= 0.02 * b + 64), None)
                if j is None:
                    j = min(k, len(order) - 1)
                unit[i] = order[j]
                k = j + 1
        # scratch and reduce rows: the gather before them / the grad after them
        sel = step == s
        held = np.flatnonzero(sel & (role == "ag_held") & pd.notna(unit))
        held = held[np.argsort(t0[held], kind="stable")]
        for i in np.flatnonzero(sel & (role == "ag_scratch") & pd.isna(unit)):
            j = np.searchsorted(t0[held], t0[i], side="right") - 1
            if j >= 0:
                unit[i] = unit[held[j]]
        grads = np.flatnonzero(sel & (role == "grad_state") & pd.notna(unit))
        grads = grads[np.argsort(t0[grads], kind="stable")]
        # FSDP1 allocates the new gradient shard first, then reduces into it: the grad at or before
        for i in np.flatnonzero(sel & np.isin(role, ["rs", "auto_grad"]) & pd.isna(unit)):
            j = np.searchsorted(t0[grads], t0[i], side="right") - 1
            if j < 0:
                j = 0
            if j < len(grads):
                unit[i] = unit[grads[j]]
    r["unit"] = unit


# --------------------------------------------------------------------------- schedule
def schedule(r: pd.DataFrame, units: list[Unit], source: tg.Source) -> dict[int, dict]:
    """Per step index: fwd_start, bwd_start, bwd_end, zero (grads freed) and per unit F0, F1, B0, B1 (µs),
    from the allocations (see the module docstring); missing anchors are derived (backward windows split
    by parameter count, forward windows mirrored from the backward ones)."""
    out = {}
    fin = r[(r["step"] >= 0) & np.isfinite(r["t0"].to_numpy(float))]
    stage = fin["stage"].to_numpy(object)
    fwd_order = [u.fqn for u in sorted(units, key=lambda u: u.order)]
    numel = {u.fqn: u.numel for u in units}
    first_by = fin.groupby(["step", "stage"])["t0"].min()
    last_bwd = fin[stage == model.STAGE_BACKWARD].groupby("step")["t0"].max()
    opt_first = fin[np.isin(stage, [model.STAGE_OPTIMIZER, model.STAGE_POST_STEP])].groupby("step")["t0"].min()
    # per (step, unit): the anchors the allocations give
    named = fin[fin["unit"].notna()]
    nst = named["stage"].to_numpy(object)
    nrole = named["role"].to_numpy(object)
    gath = np.isin(nrole, ["ag_held", "ag_flat"])
    held = nrole == "ag_held"
    keys = ["step", "unit"]
    f0 = named[gath & (nst == model.STAGE_FORWARD)].groupby(keys)["t0"].min()
    b0i = named[gath & (nst == model.STAGE_BACKWARD)].groupby(keys)["t0"].min()
    b0 = named[held & (nst == model.STAGE_BACKWARD)].groupby(keys)["t0"].min()
    rs_first = named[nrole == "rs"].groupby(keys)["t0"].min()
    for s in sorted(set(fin["step"].unique().tolist())):
        fwd_start = first_by.get((s, model.STAGE_FORWARD), np.nan)
        bwd_start = first_by.get((s, model.STAGE_BACKWARD), np.nan)
        if np.isnan(fwd_start) or np.isnan(bwd_start):
            continue
        bwd_end = float(opt_first.get(s, last_bwd.get(s, bwd_start)))
        sel = named["step"].to_numpy() == s
        after = named["t0"].to_numpy(float) >= bwd_start
        grads = named[sel & (nrole == "grad_state") & after]
        f1_rows = named[sel & held & (nst == model.STAGE_FORWARD) & np.isfinite(named["t1"].to_numpy(float))
                        & (named["t1"].to_numpy(float) < bwd_start)]
        f1 = f1_rows.groupby("unit")["t1"].median()
        g_first, g_last = grads.groupby("unit")["t0"].min(), grads.groupby("unit")["t0"].max()
        gfree = r["t1"].to_numpy(float)[(r["step"].to_numpy() == s) & (r["role"].to_numpy(object) == "grad_state")
                                        & np.isfinite(r["t1"].to_numpy(float)) & (r["t0"].to_numpy(float) >= bwd_start)]
        zero = float(np.median(gfree)) if gfree.size else np.inf
        anchors = {}
        for u in fwd_order:
            if source.sharded:
                b1 = rs_first.get((s, u), g_first.get(u, np.nan))
            else:
                b1 = g_last.get(u, np.nan)
            anchors[u] = {"F0": float(f0.get((s, u), np.nan)), "F1": float(f1.get(u, np.nan)),
                          "B0": float(b0.get((s, u), np.nan)), "B0_issue": float(b0i.get((s, u), np.nan)),
                          "B1": float(b1)}
        act = fin[(fin["step"].to_numpy() == s) & (fin["category"].to_numpy(object) == MC.ACTIVATION.value)]
        _fill_anchors(anchors, fwd_order, numel, float(fwd_start), float(bwd_start), bwd_end,
                      act["t0"].to_numpy(float), act["t1"].to_numpy(float))
        bwd_order = [fwd_order[0]] + sorted(fwd_order[1:], key=lambda u: anchors[u]["B1"])
        out[int(s)] = {"fwd_start": float(fwd_start), "bwd_start": float(bwd_start), "bwd_end": bwd_end, "zero": zero,
                       "units": anchors, "fwd_order": fwd_order, "bwd_order": bwd_order}
    return out


def _fill_anchors(a: dict, fwd_order: list[str], numel: dict, fwd_start: float, bwd_start: float,
                  bwd_end: float, act_t0: np.ndarray | None = None, act_t1: np.ndarray | None = None) -> None:
    """Anchors the allocations did not give. Backward: split by parameter count. Forward: a unit's forward
    starts with the first activation its backward frees (what the unit's forward saved), else the
    backward mirrored in time; it ends where the next unit's starts."""
    root, layers = fwd_order[0], fwd_order[1:]
    # backward: the unit's post-backward (B1); missing ones split the backward by parameter count
    if any(np.isnan(a[u]["B1"]) for u in layers):
        total = sum(numel[u] for u in layers) or 1
        t = bwd_start
        for u in layers[::-1]:
            t += (bwd_end - bwd_start) * numel[u] / total
            if np.isnan(a[u]["B1"]):
                a[u]["B1"] = t
    if np.isnan(a[root]["B1"]) or (layers and a[root]["B1"] < max(a[u]["B1"] for u in layers)):
        a[root]["B1"] = bwd_end
    bwd = sorted(layers, key=lambda u: a[u]["B1"])
    prev = bwd_start
    for u in bwd:
        if np.isnan(a[u]["B0"]):   # after the previous unit's post-backward (its reduction: B1 .. B1 + 4 eps)
            a[u]["B0"] = prev if prev == bwd_start else prev + 5 * EPS_US
        prev = a[u]["B1"]
    if np.isnan(a[root]["B0"]):
        a[root]["B0"] = bwd_start
    # forward mirrored from the backward: a unit's forward runs where its backward runs, reversed in time
    span_b = max(bwd_end - bwd_start, 1e-9)
    ratio = (bwd_start - fwd_start) / span_b

    def mirror(t):
        return fwd_start + (bwd_end - t) * ratio

    if np.isnan(a[root]["F0"]):
        a[root]["F0"] = fwd_start
    for u in layers:
        if np.isnan(a[u]["F0"]):
            saved = np.zeros(0)
            if act_t0 is not None and len(act_t0):
                saved = act_t0[(act_t1 > a[u]["B0"]) & (act_t1 <= a[u]["B1"]) & (act_t0 < bwd_start)]
            a[u]["F0"] = float(saved.min()) - EPS_US if len(saved) else mirror(a[u]["B1"])
    fwd = [root] + sorted(layers, key=lambda u: a[u]["F0"])
    for i, u in enumerate(fwd):
        if np.isnan(a[u]["F1"]):
            nxt = [a[v]["F0"] for v in fwd[i + 1:]]
            a[u]["F1"] = bwd_start if u == root else (min(nxt) if nxt else mirror(a[u]["B0"]))
    for u in fwd_order:
        if np.isnan(a[u]["B0_issue"]):
            a[u]["B0_issue"] = a[u]["B0"]


# --------------------------------------------------------------------------- the replay
def scratch_ratio(r: pd.DataFrame, units: list[Unit], source: tg.Source) -> tuple[float, float, str]:
    """(all-gather scratch, reduce scratch) as a fraction of the unit's unsharded bytes, from the run's own
    gathers when it has some, else the device's default; and where it came from."""
    unit_bytes = {u.fqn: padded_numel(u.numel, source.shard_group) * model.dtype_bytes(source.param_dtype)
                  for u in units}
    sc = r[r["role"] == "ag_scratch"]
    if len(sc) and sc["unit"].notna().any():
        g = sc.groupby(["step", "unit"])["bytes"].max()
        ratios = [b / unit_bytes[u] for (s, u), b in g.items() if unit_bytes.get(u)]
        if ratios:
            return float(np.median(ratios)), float(np.median(ratios)), "the run's own all-gathers"
    d = SCRATCH_DEFAULT.get(source.device_type, 0.0)
    how = (f"{d:g}x the unit's bytes during each all-gather / reduce-scatter (gloo, as measured on FSDP runs with "
           f"gloo)" if d else "none (NCCL works in its own buffers)")
    return d, d, how


def replay(r: pd.DataFrame, sched: dict, units: list[Unit], source: tg.Source, target: tg.Target,
           scratch: tuple | None = None, host_states: dict | None = None) -> tuple[pd.DataFrame, list, list, float]:
    """The target's allocations (bytes, t0, t1, seq0, seq1, category) from the run's rows ``r``
    (:func:`roles_frame` + :func:`label_units`), with what was kept, what was assumed and the bytes moved
    to the host. ``scratch``: :func:`scratch_ratio` of the run, when computed already; ``host_states``:
    category -> bytes of this rank's states a CPU-offload run kept on the host (inventory)."""
    kept, assumed = [], []
    ks, kt = source.shard_group, target.shard_group
    ps, pt = model.dtype_bytes(source.param_dtype), model.dtype_bytes(target.param_dtype)
    rs_, rt = model.dtype_bytes(source.reduce_dtype), model.dtype_bytes(target.reduce_dtype)
    st = model.dtype_bytes(source.stored_dtype)
    numel = {u.fqn: u.numel for u in units}
    share = {u: local_numel(n, kt) / max(local_numel(n, ks), 1) for u, n in numel.items()}
    total_share = sum(local_numel(n, kt) for n in numel.values()) / max(sum(local_numel(n, ks) for n in numel.values()), 1)
    pad = {u: padded_numel(n, kt) / max(padded_numel(n, ks), 1) for u, n in numel.items()}
    sig_ag, sig_rs, sig_how = scratch or scratch_ratio(r, units, source)
    on_host = target.cpu_offload and source.device_type != "cpu"
    batch = target.batch_scale
    act = batch * pt / ps
    role = r["role"].to_numpy(object)
    unit = r["unit"].to_numpy(object)
    by_unit = pd.Series(unit, dtype=object).map(share).fillna(total_share).to_numpy(float)
    b = r["bytes"].to_numpy(float).copy()
    t0_all = r["t0"].to_numpy(float).copy()
    t1 = r["t1"].to_numpy(float).copy()
    cat = r["category"].to_numpy(object).copy()
    keep = np.ones(len(r), bool)
    step = r["step"].to_numpy(np.int64)
    stage = r["stage"].to_numpy(object)
    # activations, temporaries, inputs
    m = role == "keep"
    scaled = m & pd.Series(cat).isin(KEEP_SCALED).to_numpy()
    b[scaled & (cat == MC.ACTIVATION.value)] *= act
    b[scaled & (cat != MC.ACTIVATION.value)] *= batch
    kept.append("activations, temporaries and inputs as measured (same local batch"
                + (f", x{batch:g}" if batch != 1 else "") + ")")
    if act != batch:
        assumed.append(f"activations scale with the compute dtype ({source.param_dtype} -> {target.param_dtype})")
    # model states
    for name in ("param_state", "opt_state"):
        mm = role == name
        b[mm] *= by_unit[mm]
    b[role == "opt_tmp"] *= total_share
    kept.append("the run's own optimizer-step temporaries, x the local share of parameters")
    sharded_s, sharded_t = source.sharded, target.sharded
    zero_of = {s: v["zero"] for s, v in sched.items()}

    def anchor(s, u, key, default=np.nan):
        v = sched.get(int(s))
        if v is None:
            return default
        a = v["units"].get(u)
        return a[key] if a is not None else default

    g = role == "grad_state"
    if sharded_s == sharded_t:
        b[g] *= by_unit[g]
    elif sharded_t:                       # a replicated run's whole grads: autograd's, freed at post-backward
        cat[g] = MC.UNSHARDED_GRAD.value
        b[g] *= pt / st
        t0_ = r["t0"].to_numpy(float)
        for i in np.flatnonzero(g & (step >= 0) & np.isfinite(t0_)):
            if isinstance(unit[i], str):   # FSDP2: freed once copied into the reduce-scatter input (made at B1);
                # FSDP1: reduced from where autograd put it, freed when the reduction is done
                after = 0.5 * EPS_US if target.family == "fsdp2" else 4 * EPS_US
                t1[i] = max(t0_[i] + EPS_US, anchor(step[i], unit[i], "B1", t1[i]) + after)
    else:
        keep[g] = False
    ag = role == "auto_grad"
    if not sharded_t:                     # autograd's grads become the grads the optimizer reads
        cat[ag] = MC.SHARDED_GRAD.value
        b[ag] *= st / ps
        for i in np.flatnonzero(ag):
            t1[i] = zero_of.get(int(step[i]), t1[i])
    else:
        b[ag] *= pt / ps
    rs = role == "rs"
    if sharded_t:
        b[rs] *= (rt / rs_) * pd.Series(unit[rs], dtype=object).map(pad).fillna(1.0).to_numpy(float)
    else:
        keep[rs] = False
    gath = np.isin(role, ["ag_flat", "ag_held", "ag_scratch"])
    if not sharded_t:
        keep[gath] = False
    else:
        b[gath] *= (pt / ps) * pd.Series(unit[gath], dtype=object).map(pad).fillna(1.0).to_numpy(float)
        held = role == "ag_held"
        raf_t = target.reshard_after_forward
        for i in np.flatnonzero(held & (step >= 0)):
            u = unit[i]
            if not isinstance(u, str):
                continue
            if stage[i] == model.STAGE_FORWARD:
                keep_root = target.family == "fsdp1" and u == ROOT_UNIT
                key = "B1" if (raf_t is False or keep_root) else "F1"
                t1[i] = anchor(step[i], u, key, t1[i]) - EPS_US
            elif stage[i] == model.STAGE_BACKWARD:
                if raf_t is False:
                    keep[i] = False
        if raf_t is False:
            keep[gath & (stage == model.STAGE_BACKWARD)] = False
        if target.family == "fsdp1":      # FSDP1 keeps the root unit's parameters from forward to backward
            keep[gath & (stage == model.STAGE_BACKWARD) & (unit == ROOT_UNIT)] = False
    family_rows = None
    if sharded_s and sharded_t and source.family != target.family:
        family_rows = _family_change(r, sched, keep, t0_all, t1, b, source, target)
        assumed.append(f"{source.family} -> {target.family}: " + (
            "no flat all-gather buffer; reduce-scatter buffers freed when the reduction is done"
            if target.family == "fsdp1" else
            "a flat all-gather output beside each unit's unsharded parameters; the reduce-scatter input held "
            "until the next unit's post-backward"))
    if on_host:
        states = np.isin(role, ["param_state", "opt_state"]) | ((role == "grad_state") & sharded_t)
        host = float(b[states & keep].sum())
        keep[states] = False
        assumed.append("CPU offload: sharded parameters, gradients and optimizer state live on the host")
    else:
        host = 0.0
        if target.cpu_offload:
            assumed.append("CPU offload on a CPU device: the offloaded states stay in the same (host) memory, "
                           "so the peak counts them")
    out = pd.DataFrame({"bytes": b, "t0": t0_all, "t1": t1, "seq0": r["seq0"].to_numpy(float),
                        "seq1": r["seq1"].to_numpy(float), "category": cat})
    out.loc[role == "ag_scratch", "category"] = MC.TEMPORARY.value
    out = out[keep]
    if family_rows is not None and len(family_rows):
        out = pd.concat([out, family_rows], ignore_index=True)
    # what the target needs and the run lacks
    extra = _synthesise(r, sched, units, source, target, sig_ag, sig_rs, pt, rt, st, on_host)
    if len(extra):
        what = sorted(set(extra.pop("what")))
        assumed.append("synthesised from the unit sizes at the run's unit boundaries: " + ", ".join(what)
                       + f"; collective scratch {sig_how}")
        out = pd.concat([out, extra], ignore_index=True)
    if sharded_t and sharded_s:
        kept.append("the run's all-gather and reduce buffers per unit, lifetimes re-derived from the target's "
                    "resharding")
    if host_states and source.cpu_offload and source.device_type != "cpu" and not target.cpu_offload:
        assumed.append("the run offloaded its states to the host: they are put on the device from the inventory's "
                       "sizes, the gradients counted all step long")
        cats = [c for c, v in host_states.items() if v]
        add = pd.DataFrame({"bytes": [float(host_states[c]) * total_share for c in cats], "t0": -np.inf,
                            "t1": np.inf, "seq0": -1.0, "seq1": np.inf, "category": cats})
        out = pd.concat([out, add], ignore_index=True)
    return out, kept, assumed + [f"unit boundaries {'from' if sharded_s else 'derived from'} the run's "
                                 f"{'gathers and reductions' if sharded_s else 'gradients'}"], host


def _family_change(r, sched, keep, t0, t1, b, source, target) -> pd.DataFrame | None:
    """FSDP2 <-> FSDP1 on a sharded run (in place on ``keep`` / ``t0`` / ``t1``; returns rows to add): FSDP1
    gathers straight into the padded flat parameter (a prefetched one exists from the prefetch on) and
    frees the reduce-scatter input once reduced; FSDP2 gathers into a flat output (freed at the next
    copy-out in forward, at its own in backward) and keeps the reduce-scatter input until the next unit's
    post-backward."""
    role, unit, stage = (r[c].to_numpy(object) for c in ("role", "unit", "stage"))
    step = r["step"].to_numpy(np.int64)
    rows = []
    for s, sc in sched.items():
        a, fwd, bwd = sc["units"], sc["fwd_order"], sc["bwd_order"]
        for u in fwd:
            m = (step == s) & (unit == u)
            rs = np.flatnonzero(m & (role == "rs"))
            if target.family == "fsdp1":
                if len(rs):
                    done = float(t0[rs].max()) + EPS_US
                    t1[rs] = np.maximum(np.minimum(t1[rs], done), t0[rs] + EPS_US)
                flat = np.flatnonzero(m & (role == "ag_flat") & (stage == model.STAGE_BACKWARD))
                held = np.flatnonzero(m & keep & (role == "ag_held") & (stage == model.STAGE_BACKWARD))
                if len(flat) and len(held):
                    t0[held] = np.minimum(t0[held], float(t0[flat].min()))
                continue
            for pass_ in (model.STAGE_FORWARD, model.STAGE_BACKWARD):
                g = np.flatnonzero(m & keep & (role == "ag_held") & (stage == pass_))
                if not len(g):
                    continue
                start = float(t0[g].min())
                if pass_ == model.STAGE_FORWARD:
                    i = fwd.index(u)
                    free = (a[fwd[i + 1]]["F0"] + 4 * EPS_US) if i + 1 < len(fwd) else sc["bwd_start"]
                else:
                    free = a[u]["B0"] + 4 * EPS_US
                rows.append((float(b[g].sum()), start - EPS_US, max(free, start), MC.UNSHARDED_PARAM.value))
            if len(rs):
                big = rs[np.argmax(b[rs])]
                later = [a[v]["B1"] for v in bwd if a[v]["B1"] > a[u]["B1"]]
                t1[big] = max(t1[big], (min(later) if later else sc["bwd_end"]) - EPS_US)
    if target.family == "fsdp1":
        keep[role == "ag_flat"] = False
    if not rows:
        return None
    d = pd.DataFrame(rows, columns=["bytes", "t0", "t1", "category"])
    d["seq0"], d["seq1"] = np.inf, -np.inf
    return d[["bytes", "t0", "t1", "seq0", "seq1", "category"]]


def _synthesise(r, sched, units, source, target, sig_ag, sig_rs, pt, rt, st, on_host) -> pd.DataFrame:
    """Rows for the gathers, reduce buffers and grad shards the target needs and the run has none of."""
    rows = []
    kt = target.shard_group
    named = r[r["unit"].notna()]
    g = named[named["role"].isin(["ag_flat", "ag_held"])][["step", "unit", "stage"]].drop_duplicates()
    have = {("gather", int(s), u, sg) for s, u, sg in g.itertuples(index=False)}
    g = named[named["role"] == "rs"][["step", "unit"]].drop_duplicates()
    have |= {("rs", int(s), u) for s, u in g.itertuples(index=False)}
    g = named[named["role"] == "auto_grad"][["step", "unit"]].drop_duplicates()
    have |= {("auto_grad", int(s), u) for s, u in g.itertuples(index=False)}
    sharded_s = source.sharded
    fsdp2 = target.family == "fsdp2"
    raf = target.reshard_after_forward
    keep_all_root = target.family == "fsdp1"     # FSDP1 never gathers the root unit again in backward

    def add(nbytes, a, f, category, what):
        if nbytes > 0 and np.isfinite(a):
            rows.append((float(nbytes), float(a), float(f), category, what))

    for s, sc in sched.items():
        a = sc["units"]
        fwd, bwd = sc["fwd_order"], sc["bwd_order"]
        for u in units:
            U = padded_numel(u.numel, kt) * pt
            an = a[u.fqn]
            if not target.sharded:
                # a sharded run whose autograd grads are not apart from its reduce buffers (FSDP1): the
                # replicated target's whole grads, kept until zero_grad
                if sharded_s and ("auto_grad", s, u.fqn) not in have:
                    add(u.numel * st, an["B1"], sc["zero"], MC.SHARDED_GRAD.value, "whole gradients")
                continue
            keep_root = target.family == "fsdp1" and u.is_root
            rule_f = an["B1"] if (raf is False or keep_root) else an["F1"]
            if ("gather", s, u.fqn, model.STAGE_FORWARD) not in have:
                i = fwd.index(u.fqn)
                nxt = a[fwd[i + 1]]["F0"] if i + 1 < len(fwd) else sc["bwd_start"]
                t = an["F0"]
                if fsdp2:   # freed at the next unit's copy-out
                    add(U, t, nxt + 4 * EPS_US if i + 1 < len(fwd) else nxt, MC.UNSHARDED_PARAM.value,
                        "forward all-gather output")
                add(sig_ag * U, t + EPS_US, t + 2 * EPS_US, MC.TEMPORARY.value, "all-gather scratch")
                add(U, t + 3 * EPS_US, rule_f - EPS_US, MC.UNSHARDED_PARAM.value, "unsharded parameters")
                if on_host:
                    add(local_numel(u.numel, kt) * model.dtype_bytes(source.stored_dtype), t, t + EPS_US,
                        MC.TEMPORARY.value, "host-to-device copy of the shard")
            if (raf is not False and not keep_root and ("gather", s, u.fqn, model.STAGE_BACKWARD) not in have):
                # prefetched at the previous unit's pre-backward (FSDP2's default, FSDP1's BACKWARD_PRE)
                order = [v for v in bwd if not (keep_all_root and v == ROOT_UNIT)]
                j = order.index(u.fqn)
                issue = (a[order[j - 1]]["B0"] + EPS_US) if j > 0 else an["B0"]
                if fsdp2:
                    add(U, issue, an["B0"] + 4 * EPS_US, MC.UNSHARDED_PARAM.value, "backward all-gather output")
                add(sig_ag * U, issue + EPS_US, issue + 2 * EPS_US, MC.TEMPORARY.value, "all-gather scratch")
                add(U, (an["B0"] + 3 * EPS_US) if fsdp2 else issue, an["B1"] - EPS_US, MC.UNSHARDED_PARAM.value,
                    "unsharded parameters")
                if isinstance(raf, int) and not isinstance(raf, bool):
                    add(U / raf, an["F1"], an["B0"], MC.UNSHARDED_PARAM.value,
                        f"parameters resharded to {raf} ranks between forward and backward")
            if ("rs", s, u.fqn) not in have and not fsdp2:
                # FSDP1 reduces the flat gradient autograd made (kept until reduced, see replay): scratch + shard
                R = padded_numel(u.numel, kt) * rt
                if not sharded_s:
                    add(local_numel(u.numel, kt) * st, an["B1"] + EPS_US, sc["zero"], MC.SHARDED_GRAD.value,
                        "sharded gradients")
                add(sig_rs * R, an["B1"] + 2 * EPS_US, an["B1"] + 3 * EPS_US, MC.UNSHARDED_GRAD.value,
                    "reduce-scatter scratch")
            elif ("rs", s, u.fqn) not in have:
                R = padded_numel(u.numel, kt) * rt
                j = bwd.index(u.fqn)
                later = [a[v]["B1"] for v in bwd if a[v]["B1"] > an["B1"]]
                free = min(later) - EPS_US if later else sc["bwd_end"]
                add(R, an["B1"], free, MC.UNSHARDED_GRAD.value, "reduce-scatter input")
                if not sharded_s:
                    add(local_numel(u.numel, kt) * st, an["B1"] + EPS_US, sc["zero"], MC.SHARDED_GRAD.value,
                        "sharded gradients")
                add(sig_rs * R, an["B1"] + 2 * EPS_US, an["B1"] + 3 * EPS_US, MC.UNSHARDED_GRAD.value,
                    "reduce-scatter scratch")
    if not rows:
        return pd.DataFrame(columns=["bytes", "t0", "t1", "seq0", "seq1", "category", "what"])
    d = pd.DataFrame(rows, columns=["bytes", "t0", "t1", "category", "what"])
    d["seq0"] = np.inf   # after a recorded event at the same time
    d["seq1"] = -np.inf  # a free before recorded events at the same time
    return d[["bytes", "t0", "t1", "seq0", "seq1", "category", "what"]]


def sweep(rows: pd.DataFrame) -> tuple[float, float, np.ndarray]:
    """(peak bytes, time of the peak, mask of the rows alive at it) of a replayed timeline: allocations
    in time order (recorded order at equal times), a free before an allocation at the same time."""
    b = rows["bytes"].to_numpy(float)
    t0, t1 = rows["t0"].to_numpy(float), rows["t1"].to_numpy(float)
    s0, s1 = rows["seq0"].to_numpy(float), rows["seq1"].to_numpy(float)
    base = float(b[np.isneginf(t0)].sum())
    ai = np.flatnonzero(np.isfinite(t0) & (t1 > t0))
    fi = np.flatnonzero(np.isfinite(t1) & np.isfinite(t0) & (t1 > t0))
    fi_pre = np.flatnonzero(np.isneginf(t0) & np.isfinite(t1))
    fi = np.concatenate([fi, fi_pre])
    t = np.concatenate([t0[ai], t1[fi]])
    seq = np.concatenate([s0[ai], s1[fi]])
    kind = np.concatenate([np.ones(len(ai)), np.zeros(len(fi))])
    delta = np.concatenate([b[ai], -b[fi]])
    if not len(t):
        return base, np.nan, np.isneginf(t0) & np.isinf(t1)
    level, o = model.sweep(base, delta, t, kind, seq)
    k = int(np.argmax(level))
    peak, tp = float(level[k]), float(t[o][k])
    if base >= peak:
        return base, np.nan, np.isneginf(t0) & np.isposinf(t1)
    # alive at the peak: allocated at or before the peak event, freed after it
    rank = np.empty(len(o), dtype=np.int64)
    rank[o] = np.arange(len(o))
    pos_a = np.full(len(b), -1, dtype=np.int64)
    pos_a[ai] = rank[: len(ai)]
    pos_f = np.full(len(b), np.iinfo(np.int64).max, dtype=np.int64)
    pos_f[fi] = rank[len(ai):]
    alive = ((pos_a <= k) | np.isneginf(t0)) & (pos_f > k) & (t1 > t0)
    return peak, tp, alive


def predict_memory(r: pd.DataFrame, sched: dict, units: list[Unit], source: tg.Source, target: tg.Target,
                   scratch: tuple | None = None, host_states: dict | None = None) -> MemoryPrediction:
    """The target's peak and breakdown from one rank's replay rows (see :func:`replay`)."""
    rows, kept, assumed, host = replay(r, sched, units, source, target, scratch, host_states)
    peak, tp, alive = sweep(rows)
    cats = rows["category"].to_numpy(object)[alive]
    byc = pd.Series(rows["bytes"].to_numpy(float)[alive]).groupby(cats).sum()
    breakdown = {model.category_name(c, target.sharded): int(round(float(byc.get(c, 0.0))))
                 for c in model.MEMORY_CATEGORIES if float(byc.get(c, 0.0)) > 0}
    stage = None
    if np.isfinite(tp) and sched:
        # the schedule's steps as step marks: forward from fwd_start, backward from bwd_start, the optimizer from
        # bwd_end to the step's end (its gradients freed, or just after bwd_end)
        sc = [sched[s] for s in sorted(sched)]
        marks = {"step": sorted(sched), "start_us": [x["fwd_start"] for x in sc], "fwd_us": [x["fwd_start"] for x in sc],
                 "end_us": [max(x["zero"], x["bwd_end"] + 1) for x in sc], "bwd_us": [x["bwd_start"] for x in sc],
                 "opt_us": [x["bwd_end"] for x in sc], "opt_end_us": [np.nan] * len(sc)}
        stage = model.stage_at([tp], marks, outside=None)[0]
    return MemoryPrediction(int(round(peak)), breakdown, stage, int(round(host)), kept, assumed)
