"""Peak memory of another strategy: the run's own allocation timeline replayed under the target's rules
(bytes; µs of the memory record's clock; the model: docs/whatif-model.md).

Each allocation gets a role: param_state, opt_state, grad_state (the gradient the optimizer reads), auto_grad
(an FSDP run's autograd gradients), rs (reduce-scatter input and scratch), ag_flat (FSDP2's flat all-gather
output), ag_held (the unsharded parameters compute uses), ag_scratch, opt_tmp (optimizer temporaries) or keep
(activations, other temporaries, inputs). Per step and unit the schedule's anchors F0 / F1 (forward gather /
end of the unit's forward), B0 / B1 (backward gather / post-backward) and ``zero`` (zero_grad) come from the
allocations; what the target needs and the run lacks is synthesised there from the unit sizes.
"""
from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np
import pandas as pd

from fsdpprof.analyze import model
from fsdpprof.analyze.model import MemoryCategory as MC, ReplayRole as Role
from fsdpprof.analyze.model import ROOT_UNIT
from fsdpprof.analyze.whatif import targets as tg
from fsdpprof.analyze.whatif.units import Unit, local_numel, padded_numel

EPS_US = 1e-3                                   # orders events at one anchor: frees, then allocations
KEEP_SCALED = frozenset({MC.ACTIVATION.value, MC.TEMPORARY.value, MC.INPUT.value})
# gloo's all-gather / emulated reduce-scatter copy their buffer once more while they run (measured on
# this project's gloo runs); NCCL works in its own buffers, outside the caching allocator
SCRATCH_DEFAULT = {"cpu": 1.0}
ROWS = ["bytes", "t0", "t1", "seq0", "seq1", "category"]     # a replayed allocation


@dataclass
class MemoryPrediction:
    """Peak of the replayed timeline (bytes), what is alive at it by category, and the story."""

    peak_allocated_bytes: int
    breakdown: dict                      # category -> bytes alive at the peak
    peak_stage: str | None
    host_bytes: int = 0                  # model states moved to the host (offload on an accelerator)
    kept: list = field(default_factory=list)
    assumed: list = field(default_factory=list)


def _str_or_none(values) -> np.ndarray:
    return np.array([x if isinstance(x, str) else None for x in np.asarray(values, dtype=object)], dtype=object)


def _isin(values, choices) -> np.ndarray:
    return pd.Series(values, dtype=object).isin(choices).to_numpy()


def _forward_order(units: list[Unit]) -> list[str]:
    return [u.fqn for u in sorted(units, key=lambda u: u.order)]


def roles_frame(allocs: pd.DataFrame, family: str) -> pd.DataFrame:
    """The allocations as replay rows: bytes, t0, t1 (-inf / +inf outside the record), seq0, seq1, category,
    role, unit (None when unknown), step, stage (fwd / bwd pass of a gather)."""
    cat = allocs["category"].astype(object).to_numpy()
    phase, stage = _str_or_none(allocs["fsdp_phase"]), _str_or_none(allocs["stage"])
    up, ug, tmp = cat == MC.UNSHARDED_PARAM.value, cat == MC.UNSHARDED_GRAD.value, cat == MC.TEMPORARY.value
    conds = [cat == MC.SHARDED_PARAM.value, cat == MC.OPTIMIZER_STATE.value, cat == MC.SHARDED_GRAD.value,
             up & _isin(phase, model.FLAT_GATHER_PHASES) & (family == model.FAMILY_FSDP2), up,
             ug & _isin(phase, model.UNSHARDED_GRAD_PHASES), ug, tmp & _isin(phase, model.GATHER_PHASES),
             tmp & _isin(stage, [model.STAGE_OPTIMIZER, model.STAGE_POST_STEP])]
    role = np.select(conds, [Role.PARAM_STATE.value, Role.OPT_STATE.value, Role.GRAD_STATE.value, Role.AG_FLAT.value,
                             Role.AG_HELD.value, Role.RS.value, Role.AUTO_GRAD.value, Role.AG_SCRATCH.value, Role.OPT_TMP.value],
                     Role.KEEP.value).astype(object)
    aseq, fseq = allocs["alloc_seq"].to_numpy(np.int64), allocs["free_seq"].to_numpy(np.int64)
    step = allocs["step_idx"].to_numpy(np.int64)
    if len(np.unique(step[aseq >= 0])) <= 1:       # a CUDA snapshot is one window: split it into steps
        step = steps_from_stages(stage, aseq)
    t0 = np.where(aseq < 0, -np.inf, allocs["alloc_us"].to_numpy(float))
    t1 = allocs["free_us"].to_numpy(float)
    t1 = np.where(np.isnan(t1) | (fseq == np.iinfo(np.int64).max), np.inf, t1)
    return pd.DataFrame({"bytes": allocs["bytes"].to_numpy(np.float64), "t0": t0, "t1": t1,
                         "seq0": aseq.astype(np.float64),
                         "seq1": np.where(np.isinf(t1), np.inf, fseq.astype(np.float64)), "category": cat,
                         "role": role, "unit": _str_or_none(allocs["unit"]), "step": step, "stage": stage})


def steps_from_stages(stage: np.ndarray, alloc_seq: np.ndarray) -> np.ndarray:
    """Step index of each allocation from the stages alone (a CUDA snapshot has no step marks): in record
    order, a step starts at the first data / forward allocation after an optimizer (or post-step) one.
    Allocations before the record keep -1."""
    order = np.argsort(alloc_seq, kind="stable")
    s = np.asarray(stage, dtype=object)[order]
    kind = np.where(_isin(s, [model.STAGE_DATA, model.STAGE_FORWARD]), 1,
                    np.where(_isin(s, [model.STAGE_OPTIMIZER, model.STAGE_POST_STEP]), 2, 0))
    last = pd.Series(np.where(kind > 0, kind, np.nan)).ffill().shift(1).to_numpy()
    out = np.empty(len(order), dtype=np.int64)
    out[order] = np.cumsum((kind == 1) & (last == 2))
    return np.where(np.asarray(alloc_seq) < 0, -1, out)


def label_units(r: pd.DataFrame, units: list[Unit], unit_sizes: dict[str, float], names: pd.Series | None,
                name_unit: dict[str, str]) -> None:
    """Fill in ``unit`` where the record has none (in place): grads and states from the inventory's names;
    FSDP1 gathers in forward / backward order, matched by size; scratch by the gather before it, reduce rows by
    the gradient shard made at or before them."""
    unit = r["unit"].to_numpy(object).copy()
    unit = np.where(_isin(unit, {u.fqn for u in units}), unit, None)
    if names is not None:
        by_name = names.map(name_unit).to_numpy(object)
        unit = np.where(pd.isna(unit) & pd.notna(by_name), by_name, unit)
    role, t0, step, stage = r["role"].to_numpy(object), r["t0"].to_numpy(float), r["step"].to_numpy(), \
        r["stage"].to_numpy(object)
    fwd_order = _forward_order(units)
    for s in np.unique(step[step >= 0]):
        for pass_, order in ((model.STAGE_FORWARD, fwd_order),
                             (model.STAGE_BACKWARD, fwd_order[:1] + fwd_order[1:][::-1])):
            idx = np.flatnonzero((role == Role.AG_HELD) & (step == s) & (stage == pass_) & pd.isna(unit))
            k = 0
            for i in idx[np.argsort(t0[idx], kind="stable")]:
                b = r["bytes"].iat[i]
                j = next((j for j in range(k, len(order)) if abs(unit_sizes[order[j]] - b) <= 0.02 * b + 64), None)
                j = min(k, len(order) - 1) if j is None else j
                unit[i], k = order[j], j + 1
        sel = step == s
        # (FSDP1 allocates the new gradient shard first, then reduces into it)
        for src, dst, at_least_first in ((Role.AG_HELD, [Role.AG_SCRATCH], False), (Role.GRAD_STATE, [Role.RS, Role.AUTO_GRAD], True)):
            known = np.flatnonzero(sel & (role == src) & pd.notna(unit))
            known = known[np.argsort(t0[known], kind="stable")]
            for i in np.flatnonzero(sel & np.isin(role, dst) & pd.isna(unit)):
                j = np.searchsorted(t0[known], t0[i], side="right") - 1
                j = max(j, 0) if at_least_first else j
                if 0 <= j < len(known):
                    unit[i] = unit[known[j]]
    r["unit"] = unit


def schedule(r: pd.DataFrame, units: list[Unit], source: tg.Source) -> dict[int, dict]:
    """Per step index: fwd_start, bwd_start, bwd_end, zero (grads freed) and per unit F0, F1, B0, B1 (µs), from
    the allocations; missing anchors derived (:func:`_fill_anchors`)."""
    out = {}
    fin = r[(r["step"] >= 0) & np.isfinite(r["t0"].to_numpy(float))]
    stage = fin["stage"].to_numpy(object)
    fwd_order = _forward_order(units)
    numel = {u.fqn: u.numel for u in units}
    first_by = fin.groupby(["step", "stage"])["t0"].min()
    last_bwd = fin[stage == model.STAGE_BACKWARD].groupby("step")["t0"].max()
    opt_first = fin[np.isin(stage, [model.STAGE_OPTIMIZER, model.STAGE_POST_STEP])].groupby("step")["t0"].min()
    # per (step, unit): the anchors the allocations give
    named = fin[fin["unit"].notna()]
    nst, nrole = named["stage"].to_numpy(object), named["role"].to_numpy(object)
    nt0, nt1 = named["t0"].to_numpy(float), named["t1"].to_numpy(float)
    held = nrole == Role.AG_HELD
    keys = ["step", "unit"]
    f0 = named[np.isin(nrole, [Role.AG_HELD, Role.AG_FLAT]) & (nst == model.STAGE_FORWARD)].groupby(keys)["t0"].min()
    b0 = named[held & (nst == model.STAGE_BACKWARD)].groupby(keys)["t0"].min()
    rs_first = named[nrole == Role.RS].groupby(keys)["t0"].min()
    rt0, rt1 = r["t0"].to_numpy(float), r["t1"].to_numpy(float)
    r_grads = (r["role"].to_numpy(object) == Role.GRAD_STATE) & np.isfinite(rt1)
    for s in sorted(set(fin["step"].unique().tolist())):
        fwd_start = first_by.get((s, model.STAGE_FORWARD), np.nan)
        bwd_start = first_by.get((s, model.STAGE_BACKWARD), np.nan)
        if np.isnan(fwd_start) or np.isnan(bwd_start):
            continue
        bwd_end = float(opt_first.get(s, last_bwd.get(s, bwd_start)))
        sel = named["step"].to_numpy() == s
        grads = named[sel & (nrole == Role.GRAD_STATE) & (nt0 >= bwd_start)]
        f1 = named[sel & held & (nst == model.STAGE_FORWARD) & np.isfinite(nt1) & (nt1 < bwd_start)]
        f1 = f1.groupby("unit")["t1"].median()
        g_first, g_last = grads.groupby("unit")["t0"].min(), grads.groupby("unit")["t0"].max()
        gfree = rt1[(r["step"].to_numpy() == s) & r_grads & (rt0 >= bwd_start)]
        anchors = {}
        for u in fwd_order:
            b1 = rs_first.get((s, u), g_first.get(u, np.nan)) if source.sharded else g_last.get(u, np.nan)
            anchors[u] = {"F0": float(f0.get((s, u), np.nan)), "F1": float(f1.get(u, np.nan)),
                          "B0": float(b0.get((s, u), np.nan)), "B1": float(b1)}
        act = fin[(fin["step"].to_numpy() == s) & (fin["category"].to_numpy(object) == MC.ACTIVATION.value)]
        _fill_anchors(anchors, fwd_order, numel, float(fwd_start), float(bwd_start), bwd_end,
                      act["t0"].to_numpy(float), act["t1"].to_numpy(float))
        out[int(s)] = {"fwd_start": float(fwd_start), "bwd_start": float(bwd_start), "bwd_end": bwd_end,
                       "zero": float(np.median(gfree)) if gfree.size else np.inf, "units": anchors,
                       "fwd_order": fwd_order,
                       "bwd_order": [fwd_order[0]] + sorted(fwd_order[1:], key=lambda u: anchors[u]["B1"])}
    return out


def _fill_anchors(a: dict, fwd_order: list[str], numel: dict, fwd_start: float, bwd_start: float,
                  bwd_end: float, act_t0: np.ndarray, act_t1: np.ndarray) -> None:
    """Anchors the allocations did not give. Backward: split by parameter count. Forward: a unit's forward
    starts with the first activation its backward frees, else the backward mirrored in time; it ends where
    the next unit's starts."""
    root, layers = fwd_order[0], fwd_order[1:]
    if any(np.isnan(a[u]["B1"]) for u in layers):
        total = sum(numel[u] for u in layers) or 1
        t = bwd_start
        for u in layers[::-1]:
            t += (bwd_end - bwd_start) * numel[u] / total
            if np.isnan(a[u]["B1"]):
                a[u]["B1"] = t
    if np.isnan(a[root]["B1"]) or (layers and a[root]["B1"] < max(a[u]["B1"] for u in layers)):
        a[root]["B1"] = bwd_end
    prev = bwd_start
    for u in sorted(layers, key=lambda u: a[u]["B1"]):
        if np.isnan(a[u]["B0"]):   # after the previous unit's post-backward (its reduction: B1 .. B1 + 4 eps)
            a[u]["B0"] = prev if prev == bwd_start else prev + 5 * EPS_US
        prev = a[u]["B1"]
    if np.isnan(a[root]["B0"]):
        a[root]["B0"] = bwd_start
    ratio = (bwd_start - fwd_start) / max(bwd_end - bwd_start, 1e-9)

    def mirror(t):   # a unit's forward runs where its backward runs, reversed in time
        return fwd_start + (bwd_end - t) * ratio

    if np.isnan(a[root]["F0"]):
        a[root]["F0"] = fwd_start
    for u in layers:
        if np.isnan(a[u]["F0"]):
            saved = act_t0[(act_t1 > a[u]["B0"]) & (act_t1 <= a[u]["B1"]) & (act_t0 < bwd_start)]
            a[u]["F0"] = float(saved.min()) - EPS_US if len(saved) else mirror(a[u]["B1"])
    fwd = [root] + sorted(layers, key=lambda u: a[u]["F0"])
    for i, u in enumerate(fwd):
        if np.isnan(a[u]["F1"]):
            nxt = [a[v]["F0"] for v in fwd[i + 1:]]
            a[u]["F1"] = bwd_start if u == root else (min(nxt) if nxt else mirror(a[u]["B0"]))


def scratch_ratio(r: pd.DataFrame, units: list[Unit], source: tg.Source) -> tuple[float, float, str]:
    """(all-gather scratch, reduce scratch) as a fraction of the unit's unsharded bytes, from the run's own
    gathers when it has some, else the device's default; and where it came from."""
    unit_bytes = {u.fqn: padded_numel(u.numel, source.shard_group) * model.dtype_bytes(source.param_dtype)
                  for u in units}
    sc = r[r["role"] == Role.AG_SCRATCH]
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
    """The target's allocations (:data:`ROWS`) from the run's rows ``r`` (:func:`roles_frame` +
    :func:`label_units`), what was kept and assumed, and the bytes moved to the host. ``scratch``:
    :func:`scratch_ratio`; ``host_states``: category -> bytes a CPU-offload run kept on the host."""
    ks, kt = source.shard_group, target.shard_group
    ps, pt = model.dtype_bytes(source.param_dtype), model.dtype_bytes(target.param_dtype)
    rs_, rt = model.dtype_bytes(source.reduce_dtype), model.dtype_bytes(target.reduce_dtype)
    st = model.dtype_bytes(source.stored_dtype)
    numel = {u.fqn: u.numel for u in units}
    share = {u: local_numel(n, kt) / max(local_numel(n, ks), 1) for u, n in numel.items()}
    total_share = sum(local_numel(n, kt) for n in numel.values()) / max(sum(local_numel(n, ks)
                                                                          for n in numel.values()), 1)
    pad = {u: padded_numel(n, kt) / max(padded_numel(n, ks), 1) for u, n in numel.items()}
    sig_ag, sig_rs, sig_how = scratch or scratch_ratio(r, units, source)
    on_host = target.cpu_offload and source.device_type != "cpu"
    batch = target.batch_scale
    act = batch * pt / ps
    role, unit = r["role"].to_numpy(object), r["unit"].to_numpy(object)
    by_unit = pd.Series(unit, dtype=object).map(share).fillna(total_share).to_numpy(float)
    pad_of = pd.Series(unit, dtype=object).map(pad).fillna(1.0).to_numpy(float)
    b, t0, t1 = (r[c].to_numpy(float).copy() for c in ("bytes", "t0", "t1"))
    cat = r["category"].to_numpy(object).copy()
    keep = np.ones(len(r), bool)
    step, stage = r["step"].to_numpy(np.int64), r["stage"].to_numpy(object)
    sharded_s, sharded_t = source.sharded, target.sharded
    scaled = (role == Role.KEEP) & _isin(cat, KEEP_SCALED)
    b[scaled & (cat == MC.ACTIVATION.value)] *= act
    b[scaled & (cat != MC.ACTIVATION.value)] *= batch
    kept = ["activations, temporaries and inputs as measured (same local batch"
            + (f", x{batch:g}" if batch != 1 else "") + ")",
            "the run's own optimizer-step temporaries, x the local share of parameters"]
    assumed = [f"activations scale with the compute dtype ({source.param_dtype} -> {target.param_dtype})"] \
        if act != batch else []
    g = role == Role.GRAD_STATE
    states = np.isin(role, [Role.PARAM_STATE, Role.OPT_STATE]) | (g & (sharded_s == sharded_t))
    b[states] *= by_unit[states]
    b[role == Role.OPT_TMP] *= total_share

    def anchor(s, u, key, default):
        a = sched[int(s)]["units"].get(u) if int(s) in sched else None
        return a[key] if a is not None else default

    if sharded_t and not sharded_s:       # a replicated run's whole grads: autograd's, freed at post-backward
        cat[g] = MC.UNSHARDED_GRAD.value
        b[g] *= pt / st
        # FSDP2: freed once copied into the reduce-scatter input (made at B1); FSDP1: when the reduction is done
        after = 0.5 * EPS_US if target.family == model.FAMILY_FSDP2 else 4 * EPS_US
        for i in np.flatnonzero(g & (step >= 0) & np.isfinite(t0)):
            if isinstance(unit[i], str):
                t1[i] = max(t0[i] + EPS_US, anchor(step[i], unit[i], "B1", t1[i]) + after)
    elif sharded_s and not sharded_t:
        keep[g] = False
    ag = role == Role.AUTO_GRAD
    if not sharded_t:                     # autograd's grads become the grads the optimizer reads
        cat[ag] = MC.SHARDED_GRAD.value
        b[ag] *= st / ps
        for i in np.flatnonzero(ag):
            t1[i] = sched[int(step[i])]["zero"] if int(step[i]) in sched else t1[i]
    else:
        b[ag] *= pt / ps
    rs = role == Role.RS
    gath = np.isin(role, [Role.AG_FLAT, Role.AG_HELD, Role.AG_SCRATCH])
    if not sharded_t:
        keep[rs | gath] = False
    else:
        b[rs] *= (rt / rs_) * pad_of[rs]
        b[gath] *= (pt / ps) * pad_of[gath]
        raf_t = target.reshard_after_forward
        for i in np.flatnonzero((role == Role.AG_HELD) & (step >= 0) & (stage == model.STAGE_FORWARD)):
            if isinstance(unit[i], str):
                keep_root = target.family == model.FAMILY_FSDP1 and unit[i] == ROOT_UNIT
                t1[i] = anchor(step[i], unit[i], "B1" if (raf_t is False or keep_root) else "F1", t1[i]) - EPS_US
        if raf_t is False:
            keep[gath & (stage == model.STAGE_BACKWARD)] = False
        if target.family == model.FAMILY_FSDP1:      # FSDP1 keeps the root unit's parameters from forward to backward
            keep[gath & (stage == model.STAGE_BACKWARD) & (unit == ROOT_UNIT)] = False
    family_rows = None
    if sharded_s and sharded_t and source.family != target.family:
        family_rows = _family_change(r, sched, keep, t0, t1, b, target)
        assumed.append(f"{source.family} -> {target.family}: " + (
            "no flat all-gather buffer; reduce-scatter buffers freed when the reduction is done"
            if target.family == model.FAMILY_FSDP1 else
            "a flat all-gather output beside each unit's unsharded parameters; the reduce-scatter input held "
            "until the next unit's post-backward"))
    host = 0.0
    if on_host:
        states = np.isin(role, [Role.PARAM_STATE, Role.OPT_STATE]) | (g & sharded_t)
        host = float(b[states & keep].sum())
        keep[states] = False
        assumed.append("CPU offload: sharded parameters, gradients and optimizer state live on the host")
    elif target.cpu_offload:
        assumed.append("CPU offload on a CPU device: the offloaded states stay in the same (host) memory, "
                       "so the peak counts them")
    out = pd.DataFrame({"bytes": b, "t0": t0, "t1": t1, "seq0": r["seq0"].to_numpy(float),
                        "seq1": r["seq1"].to_numpy(float), "category": cat})
    out.loc[role == Role.AG_SCRATCH, "category"] = MC.TEMPORARY.value
    parts = [out[keep], family_rows]
    extra = _synthesise(r, sched, units, source, target, sig_ag, sig_rs, pt, rt, st, on_host)
    if len(extra):
        assumed.append("synthesised from the unit sizes at the run's unit boundaries: "
                       + ", ".join(sorted(set(extra.pop("what")))) + f"; collective scratch {sig_how}")
        parts.append(extra)
    if sharded_t and sharded_s:
        kept.append("the run's all-gather and reduce buffers per unit, lifetimes re-derived from the target's "
                    "resharding")
    if host_states and source.cpu_offload and source.device_type != "cpu" and not target.cpu_offload:
        assumed.append("the run offloaded its states to the host: they are put on the device from the inventory's "
                       "sizes, the gradients counted all step long")
        cats = [c for c, v in host_states.items() if v]
        parts.append(pd.DataFrame({"bytes": [float(host_states[c]) * total_share for c in cats], "t0": -np.inf,
                                   "t1": np.inf, "seq0": -1.0, "seq1": np.inf, "category": cats}))
    extras = [p for p in parts[1:] if p is not None and len(p)]
    out = pd.concat([parts[0], *extras], ignore_index=True) if extras else parts[0]
    return out, kept, assumed + [f"unit boundaries {'from' if sharded_s else 'derived from'} the run's "
                                 f"{'gathers and reductions' if sharded_s else 'gradients'}"], host


def _rows(rows: list[tuple], extra: tuple = ()) -> pd.DataFrame:
    """Added allocations (bytes, t0, t1, category, *extra) as :data:`ROWS` (+ extra)."""
    d = pd.DataFrame(rows, columns=["bytes", "t0", "t1", "category", *extra])
    d["seq0"], d["seq1"] = np.inf, -np.inf      # allocated after, freed before recorded events at the same time
    return d[[*ROWS, *extra]]


def _family_change(r, sched, keep, t0, t1, b, target) -> pd.DataFrame | None:
    """FSDP2 <-> FSDP1 on a sharded run (in place on ``keep`` / ``t0`` / ``t1``; returns rows to add): FSDP1
    gathers straight into the padded flat parameter and frees the reduce-scatter input once reduced; FSDP2
    gathers into a flat output (freed at the next copy-out in forward, at its own in backward) and keeps the
    reduce-scatter input until the next unit's post-backward."""
    role, unit, stage = (r[c].to_numpy(object) for c in ("role", "unit", "stage"))
    step = r["step"].to_numpy(np.int64)
    rows = []
    for s, sc in sched.items():
        a, fwd, bwd = sc["units"], sc["fwd_order"], sc["bwd_order"]
        for u in fwd:
            m = (step == s) & (unit == u)
            rs = np.flatnonzero(m & (role == Role.RS))
            if target.family == model.FAMILY_FSDP1:
                if len(rs):
                    t1[rs] = np.maximum(np.minimum(t1[rs], float(t0[rs].max()) + EPS_US), t0[rs] + EPS_US)
                flat = np.flatnonzero(m & (role == Role.AG_FLAT) & (stage == model.STAGE_BACKWARD))
                held = np.flatnonzero(m & keep & (role == Role.AG_HELD) & (stage == model.STAGE_BACKWARD))
                if len(flat) and len(held):
                    t0[held] = np.minimum(t0[held], float(t0[flat].min()))
                continue
            for pass_ in (model.STAGE_FORWARD, model.STAGE_BACKWARD):
                g = np.flatnonzero(m & keep & (role == Role.AG_HELD) & (stage == pass_))
                if not len(g):
                    continue
                start = float(t0[g].min())
                if pass_ == model.STAGE_BACKWARD:
                    free = a[u]["B0"] + 4 * EPS_US
                else:
                    i = fwd.index(u)
                    free = (a[fwd[i + 1]]["F0"] + 4 * EPS_US) if i + 1 < len(fwd) else sc["bwd_start"]
                rows.append((float(b[g].sum()), start - EPS_US, max(free, start), MC.UNSHARDED_PARAM.value))
            if len(rs):
                big = rs[np.argmax(b[rs])]
                later = [a[v]["B1"] for v in bwd if a[v]["B1"] > a[u]["B1"]]
                t1[big] = max(t1[big], (min(later) if later else sc["bwd_end"]) - EPS_US)
    if target.family == model.FAMILY_FSDP1:
        keep[role == Role.AG_FLAT] = False
    return _rows(rows) if rows else None


def _synthesise(r, sched, units, source, target, sig_ag, sig_rs, pt, rt, st, on_host) -> pd.DataFrame:
    """Rows (:data:`ROWS` and ``what``) for the gathers, reduce buffers and grad shards the target needs and
    the run has none of."""
    rows = []
    kt, raf = target.shard_group, target.reshard_after_forward
    fsdp2, fsdp1 = target.family == model.FAMILY_FSDP2, target.family == model.FAMILY_FSDP1
    named = r[r["unit"].notna()]
    have = set()
    for what, roles, cols in (("gather", [Role.AG_FLAT, Role.AG_HELD], ["step", "unit", "stage"]),
                              (Role.RS, [Role.RS], ["step", "unit"]), (Role.AUTO_GRAD, [Role.AUTO_GRAD], ["step", "unit"])):
        g = named[named["role"].isin(roles)][cols].drop_duplicates()
        have |= {(what, int(x[0]), *x[1:]) for x in g.itertuples(index=False)}

    def add(nbytes, a, f, category, what):
        if nbytes > 0 and np.isfinite(a):
            rows.append((float(nbytes), float(a), float(f), category, what))

    for s, sc in sched.items():
        a, fwd, bwd = sc["units"], sc["fwd_order"], sc["bwd_order"]
        for u in units:
            U = padded_numel(u.numel, kt) * pt
            an = a[u.fqn]
            if not target.sharded:
                # a sharded run whose autograd grads are not apart from its reduce buffers (FSDP1): the
                # replicated target's whole grads, kept until zero_grad
                if source.sharded and (Role.AUTO_GRAD, s, u.fqn) not in have:
                    add(u.numel * st, an["B1"], sc["zero"], MC.SHARDED_GRAD.value, "whole gradients")
                continue
            keep_root = fsdp1 and u.fqn == ROOT_UNIT
            if ("gather", s, u.fqn, model.STAGE_FORWARD) not in have:
                i = fwd.index(u.fqn)
                t = an["F0"]
                if fsdp2:   # freed at the next unit's copy-out
                    add(U, t, a[fwd[i + 1]]["F0"] + 4 * EPS_US if i + 1 < len(fwd) else sc["bwd_start"],
                        MC.UNSHARDED_PARAM.value, "forward all-gather output")
                add(sig_ag * U, t + EPS_US, t + 2 * EPS_US, MC.TEMPORARY.value, "all-gather scratch")
                add(U, t + 3 * EPS_US, (an["B1"] if (raf is False or keep_root) else an["F1"]) - EPS_US,
                    MC.UNSHARDED_PARAM.value, "unsharded parameters")
                if on_host:
                    add(local_numel(u.numel, kt) * model.dtype_bytes(source.stored_dtype), t, t + EPS_US,
                        MC.TEMPORARY.value, "host-to-device copy of the shard")
            if raf is not False and not keep_root and ("gather", s, u.fqn, model.STAGE_BACKWARD) not in have:
                # prefetched at the previous unit's pre-backward (FSDP2's default, FSDP1's BACKWARD_PRE)
                order = [v for v in bwd if not (fsdp1 and v == ROOT_UNIT)]
                j = order.index(u.fqn)
                issue = (a[order[j - 1]]["B0"] + EPS_US) if j > 0 else an["B0"]
                if fsdp2:
                    add(U, issue, an["B0"] + 4 * EPS_US, MC.UNSHARDED_PARAM.value, "backward all-gather output")
                add(sig_ag * U, issue + EPS_US, issue + 2 * EPS_US, MC.TEMPORARY.value, "all-gather scratch")
                add(U, (an["B0"] + 3 * EPS_US) if fsdp2 else issue, an["B1"] - EPS_US, MC.UNSHARDED_PARAM.value,
                    "unsharded parameters")
                if tg.reshard_ranks(raf) is not None:
                    add(U / raf, an["F1"], an["B0"], MC.UNSHARDED_PARAM.value,
                        f"parameters resharded to {raf} ranks between forward and backward")
            if (Role.RS, s, u.fqn) not in have:
                # FSDP2: the reduce-scatter input, held until the next unit's post-backward; FSDP1 reduces the
                # flat gradient autograd made (kept until reduced, see replay)
                R = padded_numel(u.numel, kt) * rt
                if fsdp2:
                    later = [a[v]["B1"] for v in bwd if a[v]["B1"] > an["B1"]]
                    add(R, an["B1"], min(later) - EPS_US if later else sc["bwd_end"], MC.UNSHARDED_GRAD.value,
                        "reduce-scatter input")
                if not source.sharded:
                    add(local_numel(u.numel, kt) * st, an["B1"] + EPS_US, sc["zero"], MC.SHARDED_GRAD.value,
                        "sharded gradients")
                add(sig_rs * R, an["B1"] + 2 * EPS_US, an["B1"] + 3 * EPS_US, MC.UNSHARDED_GRAD.value,
                    "reduce-scatter scratch")
    return _rows(rows, ("what",))


def sweep(rows: pd.DataFrame) -> tuple[float, float, np.ndarray]:
    """(peak bytes, time of the peak, mask of the rows alive at it) of a replayed timeline: allocations
    in time order (recorded order at equal times), a free (or a negative row) before an allocation at the same
    time."""
    b = rows["bytes"].to_numpy(float)
    t0, t1 = rows["t0"].to_numpy(float), rows["t1"].to_numpy(float)
    s0, s1 = rows["seq0"].to_numpy(float), rows["seq1"].to_numpy(float)
    base = float(b[np.isneginf(t0)].sum())
    ai = np.flatnonzero(np.isfinite(t0) & (t1 > t0))
    fi = np.concatenate([np.flatnonzero(np.isfinite(t1) & np.isfinite(t0) & (t1 > t0)),
                         np.flatnonzero(np.isneginf(t0) & np.isfinite(t1))])
    t = np.concatenate([t0[ai], t1[fi]])
    if not len(t):
        return base, np.nan, np.isneginf(t0) & np.isinf(t1)
    # at one time what takes bytes away first (frees, and a CPU run's negative other-threads rows, which share
    # the time and seq of the event they show at), then what adds them: no level between counts a buffer twice
    delta = np.concatenate([b[ai], -b[fi]])
    level, o = model.sweep(base, delta, t, delta > 0, np.concatenate([s0[ai], s1[fi]]))
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
    return peak, tp, ((pos_a <= k) | np.isneginf(t0)) & (pos_f > k) & (t1 > t0)


def predict_memory(r: pd.DataFrame, sched: dict, units: list[Unit], source: tg.Source, target: tg.Target,
                   scratch: tuple | None = None, host_states: dict | None = None) -> MemoryPrediction:
    """The target's peak and breakdown from one rank's replay rows (see :func:`replay`)."""
    rows, kept, assumed, host = replay(r, sched, units, source, target, scratch, host_states)
    peak, tp, alive = sweep(rows)
    byc = pd.Series(rows["bytes"].to_numpy(float)[alive]).groupby(rows["category"].to_numpy(object)[alive]).sum()
    breakdown = {model.category_name(c, target.sharded): int(round(float(byc.get(c, 0.0))))
                 for c in model.MEMORY_CATEGORIES if round(float(byc.get(c, 0.0)))}   # (other threads: may be < 0)
    stage = None
    if np.isfinite(tp) and sched:
        # the schedule's steps as step marks: forward from fwd_start, backward from bwd_start, the optimizer
        # from bwd_end to the step's end (its gradients freed, or just after bwd_end)
        sc = [sched[s] for s in sorted(sched)]
        marks = {"step": sorted(sched), "start_us": [x["fwd_start"] for x in sc],
                 "fwd_us": [x["fwd_start"] for x in sc], "end_us": [max(x["zero"], x["bwd_end"] + 1) for x in sc],
                 "bwd_us": [x["bwd_start"] for x in sc], "opt_us": [x["bwd_end"] for x in sc],
                 "opt_end_us": [np.nan] * len(sc)}
        stage = model.stage_at([tp], marks, outside=None)[0]
    return MemoryPrediction(int(round(peak)), breakdown, stage, int(round(host)), kept, assumed)
