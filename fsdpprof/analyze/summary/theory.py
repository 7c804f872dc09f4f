"""ZeRO / FSDP theory from a few numbers (``fsdpprof plan``, and beside what a run measured): model-state bytes
per rank, the FSDP peak estimate, traffic per step.  Notation of the ZeRO paper: Psi parameters; k_param, k_grad,
k_opt bytes per parameter (mixed-precision Adam: 2 + 2 + 12 = 16); N ranks.  Bytes; GB = 1e9, GiB = 2**30."""
from __future__ import annotations

import math
import re
from dataclasses import asdict, dataclass

from fsdpprof import runfmt
from fsdpprof.analyze import model
from fsdpprof.options import shown
from fsdpprof.errors import UserError

GB = 1e9
GIB = float(2**30)

# optimizer name -> number of per-parameter state slots (scalars like Adam's `step` not counted)
OPTIMIZER_SLOTS = {
    "adam": 2, "adamw": 2, "fusedadam": 2, "lamb": 2, "nadam": 2, "radam": 2, "adamax": 2,
    "sgd": 0, "sgd-momentum": 1, "sgdm": 1, "momentum": 1, "adagrad": 1, "rmsprop": 1,
    "lion": 1, "adafactor": 0, "none": 0,
}

# The formulas take a strategy's ZeRO stage (model.ZERO_STAGES: model.zero_stage of any spelling).
STRATEGY_LABELS = {
    model.ZERO_DDP: "DDP / NO_SHARD", model.ZERO_1: "ZeRO-1", model.ZERO_2: "ZeRO-2 / SHARD_GRAD_OP",
    model.ZERO_3: "ZeRO-3 / FULL_SHARD", model.ZERO_HYBRID: "HYBRID_SHARD",
}


@dataclass(frozen=True)
class BytesPerParam:
    """Bytes per parameter of each model state (k_param, k_grad, k_opt of the ZeRO paper)."""

    k_param: float
    k_grad: float
    k_opt: float
    param_dtype: str = "bf16"
    grad_dtype: str = "bf16"
    optimizer: str = "adam"
    opt_detail: str = ""  # how k_opt was made, e.g. "4 (fp32 master) + 2 x 4 (exp_avg, exp_avg_sq)"

    @property
    def total(self) -> float:
        return self.k_param + self.k_grad + self.k_opt


def bytes_per_param(param_dtype: str = "bf16", grad_dtype: str | None = None, optimizer: str = "adam",
                    state_dtype: str = "fp32", master_copy: bool | None = None,
                    optimizer_slots: int | None = None) -> BytesPerParam:
    """k_param, k_grad, k_opt from dtypes and optimizer; ``master_copy`` (an fp32 copy kept by the optimizer)
    defaults to True when the parameters are narrower than ``state_dtype``; ``optimizer_slots`` overrides
    OPTIMIZER_SLOTS."""
    grad_dtype = grad_dtype or param_dtype
    kp, kg, ks = model.dtype_bytes(param_dtype), model.dtype_bytes(grad_dtype), model.dtype_bytes(state_dtype)
    opt = str(optimizer or "none").strip().lower()
    if optimizer_slots is None:
        if opt not in OPTIMIZER_SLOTS:
            raise UserError(f"unknown optimizer {shown(optimizer)}: use one of {', '.join(sorted(OPTIMIZER_SLOTS))}")
        optimizer_slots = OPTIMIZER_SLOTS[opt]
    if master_copy is None:
        master_copy = kp < ks and opt != "none"
    k_opt = (ks if master_copy else 0) + optimizer_slots * ks
    parts = []
    if master_copy:
        parts.append(f"{ks} ({state_dtype} master copy)")
    if optimizer_slots:
        parts.append(f"{optimizer_slots} x {ks} ({optimizer} states)")
    return BytesPerParam(float(kp), float(kg), float(k_opt), str(param_dtype), str(grad_dtype), opt,
                         " + ".join(parts) or "0 (no optimizer state)")


@dataclass(frozen=True)
class ModelStates:
    """Model-state bytes per rank for one strategy (host: CPU offload)."""

    strategy: str
    label: str
    formula: str            # symbolic, e.g. "(k_p + k_g + k_o) * Psi / N"
    substituted: str        # the same with the numbers put in
    param_bytes: float
    grad_bytes: float
    optimizer_state_bytes: float
    device_bytes: float
    host_bytes: float

    @property
    def total_bytes(self) -> float:
        return self.param_bytes + self.grad_bytes + self.optimizer_state_bytes

    def to_dict(self) -> dict:
        d = asdict(self)
        d["total_bytes"] = self.total_bytes
        return d


def _fmt(x: float) -> str:
    """A number of a formula as written out: a whole number in full with thousands separators (3,660,672; never
    3.66067e+06), else at six significant digits without an exponent."""
    x = float(x)
    if x.is_integer():
        return f"{int(x):,}"
    text = f"{x:.6g}"
    return f"{x:,.1f}" if "e+" in text else text


# ZeRO stage -> what each of params, grads, optimizer states is divided by (1, N or the shard group N_s), formula
_STATE_FORMULAS = {
    model.ZERO_DDP: ("1", "1", "1", "(k_p + k_g + k_o) * Psi"),
    model.ZERO_1: ("1", "1", "N", "(k_p + k_g) * Psi + k_o * Psi / N"),
    model.ZERO_2: ("1", "N", "N", "k_p * Psi + (k_g + k_o) * Psi / N"),
    model.ZERO_3: ("N", "N", "N", "(k_p + k_g + k_o) * Psi / N"),
    model.ZERO_HYBRID: ("N_s", "N_s", "N_s", "(k_p + k_g + k_o) * Psi / N_s"),
}


def model_states(psi: float, k: BytesPerParam, strategy: str, world: int, shard_group: int | None = None,
                 offload: str = "none") -> ModelStates:
    """Model-state bytes per rank (_STATE_FORMULAS; HYBRID_SHARD shards like ZeRO-3 within a shard group of N_s
    ranks, replicated R = N / N_s times).  ``offload``: none, optimizer (its state on the host) or params (FSDP
    CPUOffload: every state on the host); host bytes are not device bytes."""
    _check_positive(psi=psi, world=world)
    s = model.zero_stage(strategy)
    n = int(world)
    ns = int(shard_group or n)
    if s == model.ZERO_HYBRID:
        if ns <= 0 or n % ns:
            raise UserError(f"shard group {ns} must divide the world size {n}")
    *div, f = _STATE_FORMULAS[s]
    by = {"N": n, "N_s": ns}
    p, g, o = (kx * psi / by[d] if d in by else kx * psi for kx, d in zip((k.k_param, k.k_grad, k.k_opt), div))
    text = {"k_p": _fmt(k.k_param), "k_g": _fmt(k.k_grad), "k_o": _fmt(k.k_opt), "Psi": _fmt(psi), "N_s": str(ns),
            "N": str(n)}
    sub = re.sub(r"k_[pgo]|Psi|N_s|N", lambda m: text[m.group()], f)
    if s == model.ZERO_HYBRID:
        f += "   (N_s = shard group, R = N / N_s replicas)"
        sub += f"   (R = {n // ns})"
    off = str(offload or "none").lower()
    if off in ("none", "false", "0"):
        host = 0.0
    elif off == "optimizer":
        host = o
    elif off in ("params", "param", "true", "1", "all"):
        host = p + g + o
    else:
        raise UserError(f"unknown offload {shown(offload)}: use none, optimizer or params")
    if host:
        f += f"   [offload={off}: {'optimizer state' if off == 'optimizer' else 'params, grads, optimizer state'} on host]"
    return ModelStates(s, STRATEGY_LABELS[s], f, sub, p, g, o, p + g + o - host, host)


def all_model_states(psi: float, k: BytesPerParam, world: int, shard_group: int | None = None,
                     offload: str = "none") -> list[ModelStates]:
    """model_states for every strategy (HYBRID_SHARD only when a shard group smaller than N is given)."""
    out = []
    for s in model.ZERO_STAGES:
        if s == model.ZERO_HYBRID and not (shard_group and shard_group < world):
            continue
        out.append(model_states(psi, k, s, world, shard_group, offload))
    return out


@dataclass(frozen=True)
class Traffic:
    """Bytes each rank sends per training step, ring algorithms (what nccl-tests call bus bytes)."""

    strategy: str
    label: str
    formula: str
    substituted: str
    all_gather_bytes: float
    reduce_scatter_bytes: float
    all_reduce_bytes: float

    @property
    def total_bytes(self) -> float:
        return self.all_gather_bytes + self.reduce_scatter_bytes + self.all_reduce_bytes

    def to_dict(self) -> dict:
        d = asdict(self)
        d["total_bytes"] = self.total_bytes
        return d


def traffic_per_step(psi: float, strategy: str, world: int, param_dtype: str = "bf16",
                     reduce_dtype: str | None = None, shard_group: int | None = None,
                     compression_ratio: float = 1.0) -> Traffic:
    """Per-rank bytes on the wire per step (ring: (n-1)/n * S per all-gather / reduce-scatter, 2(n-1)/n * S per
    all-reduce): DDP 2(N-1)/N * S; ZeRO-1/2 a reduce-scatter and an all-gather; FULL_SHARD two all-gathers and a
    reduce-scatter; HYBRID_SHARD FULL_SHARD within N_s plus an all-reduce of the shard across R = N/N_s replicas.
    ``compression_ratio`` divides the gradient collectives."""
    _check_positive(psi=psi, world=world, compression_ratio=compression_ratio)
    s = model.zero_stage(strategy)
    n = int(world)
    reduce_dtype = reduce_dtype or param_dtype
    sp = psi * model.dtype_bytes(param_dtype)          # parameter array in the all-gather dtype
    sg = psi * model.dtype_bytes(reduce_dtype) / compression_ratio  # gradient array in the reduce dtype
    ag_f, rs_f, ar_f = (model.bus_factor(c, n) for c in (model.ALL_GATHER, model.REDUCE_SCATTER, model.ALL_REDUCE))
    ag = rs = ar = 0.0
    c = f" / {_fmt(compression_ratio)}" if compression_ratio != 1 else ""
    frac, s_param = f"{n - 1}/{n}", f"{_fmt(psi)} * {model.dtype_bytes(param_dtype)}"
    s_grad = f"{_fmt(psi)} * {model.dtype_bytes(reduce_dtype)}{c}"
    if s == model.ZERO_DDP:
        ar = ar_f * sg
        formula, sub = "2 (N-1)/N * S_grad", f"2 * {frac} * {s_grad}"
    elif s == model.ZERO_1 or s == model.ZERO_2:
        rs, ag = rs_f * sg, ag_f * sp
        formula = "(N-1)/N * S_grad (reduce-scatter) + (N-1)/N * S_param (all-gather)"
        sub = f"{frac} * {s_grad} + {frac} * {s_param}"
    elif s == model.ZERO_3:
        ag, rs = 2 * ag_f * sp, rs_f * sg                   # all-gathers in forward and backward
        formula = "2 (N-1)/N * S_param (fwd + bwd all-gather) + (N-1)/N * S_grad (reduce-scatter)  [= 3(N-1)/N * S]"
        sub = f"2 * {frac} * {s_param} + {frac} * {s_grad}"
    else:
        ns = int(shard_group or n)
        if ns <= 0 or n % ns:
            raise UserError(f"shard group {ns} must divide the world size {n}")
        r = n // ns
        ag = 2 * model.bus_factor(model.ALL_GATHER, ns) * sp
        rs = model.bus_factor(model.REDUCE_SCATTER, ns) * sg
        ar = model.bus_factor(model.ALL_REDUCE, r) * sg / ns     # the shard, across the R replicas
        formula = ("2 (N_s-1)/N_s * S_param + (N_s-1)/N_s * S_grad + 2 (R-1)/R * S_grad / N_s "
                   "(all-reduce of the shard across replicas)")
        sub = (f"2 * {ns - 1}/{ns} * {_fmt(sp)} + {ns - 1}/{ns} * {_fmt(sg)} + "
               f"2 * {r - 1}/{r} * {_fmt(sg)} / {ns}")
    return Traffic(s, STRATEGY_LABELS[s], formula, sub, ag, rs, ar)


def fsdp_traffic(psi: float, strategy: str, world: int, param_dtype: str = "bf16", reduce_dtype: str | None = None,
                 shard_group: int | None = None, compression_ratio: float = 1.0) -> Traffic:
    """Traffic of the strategy as FSDP implements it (SHARD_GRAD_OP keeps params after forward: one all-gather)."""
    s = model.zero_stage(strategy)
    t = traffic_per_step(psi, s, world, param_dtype, reduce_dtype, shard_group, compression_ratio)
    if s != model.ZERO_2:
        return t
    return Traffic(model.ZERO_2, model.SHARD_GRAD_OP, "(N-1)/N * S_param (one all-gather) + (N-1)/N * S_grad (reduce-scatter)",
                   t.substituted, t.all_gather_bytes, t.reduce_scatter_bytes, 0.0)


@dataclass(frozen=True)
class PeakEstimate:
    """FSDP peak estimate: sharded model states + the largest unit's unsharded params + activations."""

    formula: str
    substituted: str
    model_states_bytes: float
    max_unit: str | None
    max_unit_unsharded_bytes: float
    activation_bytes: float
    estimate_bytes: float

    def to_dict(self) -> dict:
        return asdict(self)


def fsdp_peak_estimate(model_states_bytes: float, unit_numel: dict[str, float], k_unsharded: float,
                       activations: dict[str, float] | float = 0.0) -> PeakEstimate:
    """Model states per rank + max over units l of (k_unsharded * Psi_l + A_l): the unit's all-gathered params and
    its activations (bytes; a dict per unit, or one number for every unit)."""
    best_u, best_unsharded, best_a, best = None, 0.0, 0.0, -1.0
    for u, numel in unit_numel.items():
        a = activations.get(u, 0.0) if isinstance(activations, dict) else float(activations)
        v = k_unsharded * float(numel) + a
        if v > best:
            best_u, best_unsharded, best_a, best = u, k_unsharded * float(numel), a, v
    if best < 0:
        a = float(activations) if not isinstance(activations, dict) else 0.0
        best_unsharded, best_a, best = 0.0, a, a
    est = model_states_bytes + best
    sub = (f"{_fmt(model_states_bytes)} + ({_fmt(k_unsharded)} * {_fmt(best_unsharded / k_unsharded if k_unsharded else 0)}"
           f" + {_fmt(best_a)})" + ("" if best_u is None else
                                    f"  [unit {model.ROOT_UNIT_TEXT if best_u == model.ROOT_UNIT else best_u}]"))
    form = ("model_states / rank + max_l (k_param_unsharded * Psi_l + A_l)" if isinstance(activations, dict) else
            "model_states / rank + max_l (k_param_unsharded * Psi_l) + A   (A = activations alive at the measured peak)")
    return PeakEstimate(form, sub, model_states_bytes, best_u, best_unsharded, best_a, est)


def k_from_inventory(inv: dict) -> BytesPerParam:
    """k_param, k_grad, k_opt the run used, from its inventory's dtypes and optimizer state keys (but ``step``)."""
    tensors = inv.get("tensors") or []

    def _dtype(role):
        for t in tensors:
            step = role == runfmt.ROLE_OPTIMIZER_STATE and str(t.get("name", "")).endswith("/step")
            if t.get("role") == role and t.get("dtype") and not step:
                return str(t["dtype"]).replace("torch.", "")
        return None

    units = inv.get("units") or []
    pdt = _dtype(runfmt.ROLE_PARAM) or (units[0].get("dtype") if units else None) or "float32"
    gdt = _dtype(runfmt.ROLE_GRAD) or pdt
    opt = inv.get("optimizer") or None
    if not opt:
        return bytes_per_param(pdt, gdt, "none", master_copy=False)
    keys = [k for k in (opt.get("state_keys") or []) if k != "step"]
    sdt = _dtype(runfmt.ROLE_OPTIMIZER_STATE) or "float32"
    cls = str(opt.get("class") or "optimizer")
    return bytes_per_param(pdt, gdt, cls, state_dtype=sdt, master_copy=False, optimizer_slots=len(keys))


def strategy_from_inventory(inv: dict) -> str:
    """The ZeRO stage of a recorded run's strategy (NO_SHARD and DDP are both 'DDP'; an unknown one too)."""
    return model.ZERO_STAGE.get(model.known_strategy(inv.get("strategy")), model.ZERO_STAGE[model.DDP])


fmt_bytes = model.fmt_bytes      # (the one formatter for bytes: the model's; kept here for callers)


def _check_positive(**values) -> None:
    for name, v in values.items():
        try:
            ok = math.isfinite(float(v)) and float(v) > 0
        except (TypeError, ValueError):
            ok = False
        if not ok:
            raise UserError(f"{name} must be a positive number, got {v!r}")
