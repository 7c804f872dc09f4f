"""Model states: the ZeRO formulas filled in with a run's own numbers (inventory, bytes per parameter), beside
what the run measured (bytes)."""
from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np
import pandas as pd

from fsdpprof import runfmt
from fsdpprof.analyze import model
from fsdpprof.analyze.model import MemoryCategory as MC
from fsdpprof.analyze.summary import theory
from fsdpprof.analyze.summary.headline import peak_rank_of


def measured_model_states(inv: dict) -> dict:
    """Bytes per role this rank holds, from the inventory's tensors (a role's last capture), else ``totals``."""
    t = pd.DataFrame(inv.get("tensors") or [])
    totals = inv.get("totals") or {}
    out = {runfmt.ROLE_PARAM: totals.get("param_bytes"), runfmt.ROLE_GRAD: totals.get("grad_bytes"),
           runfmt.ROLE_OPTIMIZER_STATE: totals.get("optimizer_state_bytes")}
    if not t.empty and {"role", "bytes"} <= set(t.columns):
        if "step" not in t:
            t["step"] = 0
        t["step"] = pd.to_numeric(t["step"], errors="coerce").fillna(-1)
        last = t.groupby("role")["step"].transform("max")
        s = pd.to_numeric(t.loc[t["step"] == last, "bytes"], errors="coerce").groupby(t["role"]).sum()
        for role in out:
            if role in s.index:
                out[role] = float(s[role])
    return {k: float(v) for k, v in out.items() if v is not None}


def inventory_summary(inv: dict) -> dict:
    """The inventory without its per-tensor list (small: what the cross-rank reduce needs)."""
    return {k: v for k, v in inv.items() if k != "tensors"}


def unsharded_param_dtype(inv: dict) -> str:
    """dtype of the all-gathered parameters: the mixed-precision param dtype, else the stored one."""
    mp = inv.get("mixed_precision") or {}
    if mp.get("param_dtype"):
        return str(mp["param_dtype"]).replace("torch.", "")
    units = inv.get("units") or []
    return str(units[0].get("dtype") if units else "float32").replace("torch.", "")


@dataclass
class TheoryResult:
    """The formulas with their numbers (JSON-ready), per rank and role measured / theory bytes, or why not."""

    theory: dict = field(default_factory=dict)
    model_states: pd.DataFrame | None = None
    note: str | None = None


def _category_bytes(memory_result, category: str) -> float | None:
    bd = getattr(memory_result, "breakdown_at_peak", None)
    if bd is None or bd.empty:
        return None
    return float(bd.groupby("category", observed=True)["bytes"].sum().get(category, 0.0))


def most_alive_bytes(memory_result, category: str) -> float | None:
    """The most bytes of ``category`` alive at once over the memory record (allocation order; frees first at a
    tie), None without allocations.  FSDP2's flat all-gather outputs are left out: each lives only until its
    copy-out into the per-parameter tensors, which are what a unit holds."""
    df = getattr(memory_result, "allocations", None)
    if df is None or not len(df) or "category" not in df:
        return None
    keep = (df["category"].astype(str) == category).to_numpy().copy()
    if "fsdp_phase" in df:
        keep &= ~df["fsdp_phase"].astype(object).isin(model.FLAT_GATHER_PHASES).to_numpy()
    if "fsdp_role" in df and getattr(memory_result, "fsdp_family", None) != model.FAMILY_FSDP1:
        keep &= (df["fsdp_role"].astype(object) != model.FSDP_ROLE_ALL_GATHER_OUTPUT).to_numpy()
    a = df[keep]
    if not len(a):
        return 0.0
    seq = np.concatenate([a["alloc_seq"].to_numpy(np.int64), a["free_seq"].to_numpy(np.int64)])
    delta = np.concatenate([a["bytes"].to_numpy(np.int64), -a["bytes"].to_numpy(np.int64)])
    order = np.lexsort((delta, seq))
    return float(max(0, np.cumsum(delta[order]).max()))


def theory_vs_measured(inventories: dict, measured: dict, k_by_rank: dict, memory: dict,
                       world_size: int | None, gathered_most: dict | None = None) -> TheoryResult:
    """The formulas with the run's numbers, from per-rank inventory summaries, measured model states,
    BytesPerParam, MemoryResults and (``gathered_most``) each rank's most gathered parameter bytes alive at once
    (:func:`most_alive_bytes`)."""
    if not inventories:
        return TheoryResult(note="no inventory.json in this input: Psi and the dtypes are unknown, so the ZeRO "
                                 "formulas cannot be filled in (record with `fsdpprof record`).")
    r0 = min(inventories)
    inv = inventories[r0]
    psi = float((inv.get("totals") or {}).get("psi") or 0)
    if psi <= 0:
        return TheoryResult(note=f"inventory of rank {r0} has no parameter count (totals.psi).")
    strategy_name = str(inv.get("strategy") or "NONE")
    s = theory.strategy_from_inventory(inv)
    world = int(inv.get("world_size") or world_size or 1)
    ns = int(inv.get("shard_group_size") or world)
    n_for = ns if s in model.ZERO_SHARDED_STAGES else world
    k = k_by_rank[r0]
    offload = "params" if inv.get("cpu_offload") else "none"
    ms = theory.model_states(psi, k, s, n_for, ns if s == model.ZERO_HYBRID else None, offload)
    mp = inv.get("mixed_precision") or {}
    pdt = unsharded_param_dtype(inv)
    rdt = str(mp.get("reduce_dtype") or k.grad_dtype).replace("torch.", "")
    tr = theory.fsdp_traffic(psi, s, max(n_for, 1),
                             pdt, rdt, ns if s == model.ZERO_HYBRID else None) if n_for > 1 else None
    all_ms = [m.to_dict() for m in theory.all_model_states(psi, k, max(n_for, 1))]
    for d in all_ms:  # the traffic each strategy would move per step, beside its memory
        d["traffic_bytes"] = (theory.fsdp_traffic(psi, d["strategy"], n_for, pdt, rdt).total_bytes
                              if n_for > 1 else 0.0)
    t = {
        "psi": psi, "strategy": strategy_name, "canonical_strategy": s, "N": n_for, "world_size": world,
        "shard_group_size": ns, "k_param": k.k_param, "k_grad": k.k_grad, "k_opt": k.k_opt,
        "k_opt_detail": k.opt_detail, "param_dtype": k.param_dtype, "grad_dtype": k.grad_dtype,
        "unsharded_param_dtype": pdt, "reduce_dtype": rdt, "optimizer": k.optimizer,
        "model_states": ms.to_dict(), "all_strategies": all_ms,
        "traffic": tr.to_dict() if tr else None,
        "step_time_formula": "T_step ~ T_comp + T_comm - T_overlap",
    }
    fw = str(inv.get("framework") or "")
    gathered = {}   # ZeRO-2 under FSDP: the gathered parameters at their most, per rank (held forward to backward)
    if s == model.ZERO_2 and fw in model.FSDP_FAMILIES:
        gathered = {r: float(b) for r, b in (gathered_most or {}).items() if r in inventories and b}
    rows = []
    for r in sorted(inventories):
        meas = dict(measured.get(r) or {})
        if r in gathered:
            meas[runfmt.ROLE_PARAM] = gathered[r]
        for role, th in ((runfmt.ROLE_PARAM, ms.param_bytes), (runfmt.ROLE_GRAD, ms.grad_bytes),
                         (runfmt.ROLE_OPTIMIZER_STATE, ms.optimizer_state_bytes)):
            rows.append({"rank": r, "role": role, "measured_bytes": meas.get(role, np.nan), "theory_bytes": th})
    df = pd.DataFrame(rows)
    df["diff_bytes"] = df["measured_bytes"] - df["theory_bytes"]
    df["diff_pct"] = 100.0 * df["diff_bytes"] / df["theory_bytes"].where(df["theory_bytes"] > 0)
    meas_total = df[df["rank"] == r0]["measured_bytes"].sum()
    expl = []
    if r0 in gathered:
        shards = (measured.get(r0) or {}).get(runfmt.ROLE_PARAM)
        expl.append("counted as SHARD_GRAD_OP holds them: the gathered parameters at their most "
                    f"({theory.fmt_bytes(gathered[r0])}, all units gathered from forward to their backward; "
                    f"ZeRO-2's k_p Psi = {theory.fmt_bytes(ms.param_bytes)}), with the sharded gradients and the "
                    "optimizer state of the inventory; the parameter shards held beside them"
                    + (f" ({theory.fmt_bytes(shards)})" if shards else "") + " are not in ZeRO-2's formula.")
    elif s == model.ZERO_2 and fw in model.FSDP_FAMILIES:
        un = _category_bytes(memory.get(r0), MC.UNSHARDED_PARAM.value)
        expl.append("FSDP's SHARD_GRAD_OP keeps parameters unsharded only from forward to the end of backward: "
                    "the inventory, taken at the optimizer step, sees the sharded parameters (k_p Psi / N = "
                    f"{theory.fmt_bytes(ms.param_bytes / n_for)}) where ZeRO-2's formula counts k_p Psi = "
                    f"{theory.fmt_bytes(ms.param_bytes)}"
                    + (f"; at the peak the unsharded parameters are there ({theory.fmt_bytes(un)} "
                       f"{model.category_words(MC.UNSHARDED_PARAM)})."
                       if un is not None else "."))
    elif abs(meas_total - ms.total_bytes) > 0.001 * ms.total_bytes:
        expl.append("shards are padded so every rank holds ceil(numel / N) elements of each parameter; "
                    "scalar optimizer state (Adam's `step`) and non-parameter buffers are outside the formula.")
    t["model_states_counted"] = (
        f"the gathered parameters at their most ({theory.fmt_bytes(gathered[r0])}, SHARD_GRAD_OP holds them from "
        f"forward to each unit's backward), the sharded gradients and the optimizer state" if r0 in gathered else
        "the parameters, gradients and optimizer state the rank holds at the optimizer step (inventory)")
    t["measured_model_states_bytes"] = float(meas_total)
    t["model_states_diff_bytes"] = float(meas_total - ms.total_bytes)
    t["model_states_explanation"] = " ".join(expl) or "measured and formula agree."
    rp = peak_rank_of(memory)
    rp = r0 if rp is None else rp     # the measured peak of the rank the headline names (the highest)
    t["peak_estimate"] = _peak_estimate(inv, s, ms, pdt, memory.get(rp), rp)
    return TheoryResult(theory=t, model_states=df)


def activations_per_unit(m) -> dict[str, float] | None:
    """A_l per FSDP unit: the most of unit l's activations alive at once (bytes); None when no activation has
    a unit."""
    t = getattr(m, "activation_by_unit", None)
    if t is None or t.empty:
        return None
    return {str(u): float(b) for u, b in zip(t["unit"], t["activation_bytes"])}


def _peak_estimate(inv: dict, s: str, ms, pdt: str, m, r0: int) -> dict:
    """The FSDP peak estimate beside the measured peak of the same rank; without per-unit activations, the
    activations alive at the peak stand in for every A_l."""
    unit_numel = {} if s == model.ZERO_DDP else {str(u.get("fqn")): float(u.get("unsharded_numel") or 0)
                                         for u in inv.get("units") or []}
    per_unit = activations_per_unit(m)
    if per_unit and unit_numel:
        act = {u: per_unit.get(u, 0.0) for u in unit_numel}
    else:
        act = _category_bytes(m, MC.ACTIVATION.value) or 0.0
    est = theory.fsdp_peak_estimate(ms.device_bytes, unit_numel, model.dtype_bytes(pdt), act)
    pe = est.to_dict()
    if isinstance(act, dict):
        pe["formula"] = (pe["formula"] + "   (A_l = the activations unit l's forward keeps for its backward, "
                         "measured per unit)")
        pe["activations_per_unit"] = act
    pe["measured_peak_bytes"] = float(m.peak_allocated_bytes) if m is not None else None
    pe["measured_rank"] = r0
    if m is not None:
        pe["diff_bytes"] = float(m.peak_allocated_bytes) - est.estimate_bytes
        left = []
        if m.breakdown_at_peak is not None and not m.breakdown_at_peak.empty:
            bd = m.breakdown_at_peak.groupby("category", observed=True)["bytes"].sum()
            if isinstance(act, dict):
                other_act = float(bd.get(MC.ACTIVATION.value, 0)) - est.activation_bytes
                if other_act > 0:
                    left.append(f"activations of the other units and outside any unit alive at the peak "
                                f"({theory.fmt_bytes(other_act)})")
            for cat in (MC.UNSHARDED_GRAD.value, MC.TEMPORARY.value, MC.INPUT.value, MC.BEFORE_RECORDING.value,
                        MC.OTHER.value):
                if float(bd.get(cat, 0)) > 0:
                    left.append(f"{model.category_words(cat)} {theory.fmt_bytes(bd.get(cat))}")
            if float(bd.get(MC.UNSHARDED_PARAM.value, 0)) > est.max_unit_unsharded_bytes * 1.05:
                left.append(f"unsharded params of more than one unit ({theory.fmt_bytes(bd.get(MC.UNSHARDED_PARAM.value))}: "
                            f"prefetch or no reshard after forward keeps several units gathered)")
        pe["explanation"] = ("the formula leaves out " + ", ".join(left) + ".") if left else \
            "the formula counts model states, one unit's gathered parameters and that unit's activations."
    return pe
