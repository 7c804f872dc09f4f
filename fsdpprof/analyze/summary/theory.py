"""ZeRO / FSDP theory: model-state bytes per rank, FSDP peak estimate, traffic per step.

Pure functions of a few numbers (no trace needed), used by ``fsdpprof plan`` before anything
runs and by the report to put the formulas beside what a run measured.

Notation (ZeRO paper): Psi = unsharded parameter count; per parameter the run keeps
k_param bytes of parameters, k_grad bytes of gradients and k_opt bytes of optimizer state
(fp32 master copy when the stored parameters are not fp32, plus one fp32 slot per optimizer
state such as Adam's exp_avg and exp_avg_sq). Textbook mixed-precision Adam: 2 + 2 + 12 = 16.
N = ranks the states are sharded over. All sizes are bytes; GB = 1e9 bytes, GiB = 2**30.
"""
from __future__ import annotations

import math
from dataclasses import asdict, dataclass

from fsdpprof import runfmt
from fsdpprof.analyze import model
from fsdpprof.options import shown
from fsdpprof.errors import UserError

GB = 1e9
GIB = float(2**30)
MIB = float(2**20)

# optimizer name -> number of per-parameter state slots (scalars like Adam's `step` not counted)
OPTIMIZER_SLOTS = {
    "adam": 2, "adamw": 2, "fusedadam": 2, "lamb": 2, "nadam": 2, "radam": 2, "adamax": 2,
    "sgd": 0, "sgd-momentum": 1, "sgdm": 1, "momentum": 1, "adagrad": 1, "rmsprop": 1,
    "lion": 1, "adafactor": 0, "none": 0,
}

# The formulas take a strategy's ZeRO stage (model.ZERO_STAGES: model.zero_stage of any spelling).
STRATEGY_LABELS = {
    "DDP": "DDP / NO_SHARD", "ZERO1": "ZeRO-1", "ZERO2": "ZeRO-2 / SHARD_GRAD_OP",
    "ZERO3": "ZeRO-3 / FULL_SHARD", "HYBRID_SHARD": "HYBRID_SHARD",
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
    """k_param, k_grad, k_opt from dtypes and optimizer.

    master_copy (an fp32 copy of the parameters kept by the optimizer) defaults to True when the
    stored parameters are narrower than ``state_dtype``; optimizer_slots overrides the count of
    per-parameter state tensors (Adam 2, SGD with momentum 1, ...).
    """
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
    """Model-state bytes per rank for one strategy (device = accelerator memory, host = CPU offload)."""

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
    return f"{x:.6g}"


def model_states(psi: float, k: BytesPerParam, strategy: str, world: int, shard_group: int | None = None,
                 offload: str = "none") -> ModelStates:
    """Model-state bytes per rank.

    DDP/NO_SHARD (k_p+k_g+k_o)Psi; ZeRO-1 (k_p+k_g)Psi + k_o Psi/N; ZeRO-2/SHARD_GRAD_OP
    k_p Psi + (k_g+k_o)Psi/N; ZeRO-3/FULL_SHARD (k_p+k_g+k_o)Psi/N; HYBRID_SHARD shards like
    ZeRO-3 within a shard group of N_s ranks and replicates it R = N/N_s times: (k_p+k_g+k_o)Psi/N_s.
    offload: 'none', 'optimizer' (optimizer state to host) or 'params' (FSDP CPUOffload: params,
    grads and optimizer state to host); moved bytes count as host_bytes, not device_bytes.
    """
    _check_positive(psi=psi, world=world)
    s = model.zero_stage(strategy)
    n = int(world)
    ns = int(shard_group or n)
    if s == "HYBRID_SHARD":
        if ns <= 0 or n % ns:
            raise UserError(f"shard group {ns} must divide the world size {n}")
    kp, kg, ko = k.k_param, k.k_grad, k.k_opt
    if s == "DDP":
        p, g, o = kp * psi, kg * psi, ko * psi
        f = "(k_p + k_g + k_o) * Psi"
        sub = f"({_fmt(kp)} + {_fmt(kg)} + {_fmt(ko)}) * {_fmt(psi)}"
    elif s == "ZERO1":
        p, g, o = kp * psi, kg * psi, ko * psi / n
        f = "(k_p + k_g) * Psi + k_o * Psi / N"
        sub = f"({_fmt(kp)} + {_fmt(kg)}) * {_fmt(psi)} + {_fmt(ko)} * {_fmt(psi)} / {n}"
    elif s == "ZERO2":
        p, g, o = kp * psi, kg * psi / n, ko * psi / n
        f = "k_p * Psi + (k_g + k_o) * Psi / N"
        sub = f"{_fmt(kp)} * {_fmt(psi)} + ({_fmt(kg)} + {_fmt(ko)}) * {_fmt(psi)} / {n}"
    elif s == "ZERO3":
        p, g, o = kp * psi / n, kg * psi / n, ko * psi / n
        f = "(k_p + k_g + k_o) * Psi / N"
        sub = f"({_fmt(kp)} + {_fmt(kg)} + {_fmt(ko)}) * {_fmt(psi)} / {n}"
    else:
        p, g, o = kp * psi / ns, kg * psi / ns, ko * psi / ns
        f = "(k_p + k_g + k_o) * Psi / N_s   (N_s = shard group, R = N / N_s replicas)"
        sub = f"({_fmt(kp)} + {_fmt(kg)} + {_fmt(ko)}) * {_fmt(psi)} / {ns}   (R = {n // ns})"
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
        if s == "HYBRID_SHARD" and not (shard_group and shard_group < world):
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
    """Per-rank bytes on the wire per step (ring): a collective over n ranks of an S-byte array moves
    (n-1)/n * S for all-gather / reduce-scatter and 2(n-1)/n * S for all-reduce.

    DDP/NO_SHARD and ZeRO-1/2 (reduce-scatter + all-gather of updated params): 2(N-1)/N * S;
    FULL_SHARD: forward all-gather + backward all-gather (param dtype) + reduce-scatter (reduce
    dtype) = 3(N-1)/N * S when the dtypes agree; SHARD_GRAD_OP keeps params after forward: one
    all-gather + reduce-scatter; HYBRID_SHARD: FULL_SHARD within N_s plus an all-reduce of the
    gradient shard across R = N/N_s replicas, 2(R-1)/R * S_grad / N_s. compression_ratio divides
    the gradient collectives (reduce-scatter / all-reduce).
    """
    _check_positive(psi=psi, world=world, compression_ratio=compression_ratio)
    s = model.zero_stage(strategy)
    n = int(world)
    reduce_dtype = reduce_dtype or param_dtype
    sp = psi * model.dtype_bytes(param_dtype)          # parameter array in the all-gather dtype
    sg = psi * model.dtype_bytes(reduce_dtype) / compression_ratio  # gradient array in the reduce dtype
    # bytes each rank sends per byte of the array (ring): all-gather, reduce-scatter (n-1)/n, all-reduce 2(n-1)/n
    ag_f, rs_f, ar_f = (model.bus_factor(c, n) for c in (model.ALL_GATHER, model.REDUCE_SCATTER, model.ALL_REDUCE))
    ag = rs = ar = 0.0
    c = f" / {_fmt(compression_ratio)}" if compression_ratio != 1 else ""
    if s == "DDP":
        ar = ar_f * sg
        formula = "2 (N-1)/N * S_grad"
        sub = f"2 * {n - 1}/{n} * {_fmt(psi)} * {model.dtype_bytes(reduce_dtype)}{c}"
    elif s == "ZERO1" or s == "ZERO2":
        rs = rs_f * sg
        ag = ag_f * sp
        formula = "(N-1)/N * S_grad (reduce-scatter) + (N-1)/N * S_param (all-gather)"
        sub = (f"{n - 1}/{n} * {_fmt(psi)} * {model.dtype_bytes(reduce_dtype)}{c} + "
               f"{n - 1}/{n} * {_fmt(psi)} * {model.dtype_bytes(param_dtype)}")
    elif s == "ZERO3":
        ag = 2 * ag_f * sp                   # forward and backward
        rs = rs_f * sg
        formula = "2 (N-1)/N * S_param (fwd + bwd all-gather) + (N-1)/N * S_grad (reduce-scatter)  [= 3(N-1)/N * S]"
        sub = (f"2 * {n - 1}/{n} * {_fmt(psi)} * {model.dtype_bytes(param_dtype)} + "
               f"{n - 1}/{n} * {_fmt(psi)} * {model.dtype_bytes(reduce_dtype)}{c}")
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


def traffic_shard_grad_op(psi: float, world: int, param_dtype: str = "bf16", reduce_dtype: str | None = None,
                          compression_ratio: float = 1.0) -> Traffic:
    """FSDP SHARD_GRAD_OP: one all-gather (forward; params stay unsharded for backward) + reduce-scatter."""
    t = traffic_per_step(psi, "ZERO2", world, param_dtype, reduce_dtype, compression_ratio=compression_ratio)
    return Traffic("ZERO2", "SHARD_GRAD_OP", "(N-1)/N * S_param (one all-gather) + (N-1)/N * S_grad (reduce-scatter)",
                   t.substituted, t.all_gather_bytes, t.reduce_scatter_bytes, 0.0)


def fsdp_traffic(psi: float, strategy: str, world: int, param_dtype: str = "bf16", reduce_dtype: str | None = None,
                 shard_group: int | None = None, compression_ratio: float = 1.0) -> Traffic:
    """Traffic of the strategy as FSDP implements it (SHARD_GRAD_OP: one all-gather per step)."""
    s = model.zero_stage(strategy)
    if s == "ZERO2":
        return traffic_shard_grad_op(psi, world, param_dtype, reduce_dtype, compression_ratio)
    return traffic_per_step(psi, s, world, param_dtype, reduce_dtype, shard_group, compression_ratio)


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
    """16 Psi / N + max_l (2 Psi_l + A_l): model states per rank plus, for the unit l that maximises it,
    its all-gathered parameters (k_unsharded bytes per parameter, 2 for bf16) and its activations
    A_l (bytes; a dict per unit, or one number applied to every unit)."""
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
    return PeakEstimate(form, sub, model_states_bytes,
                        best_u, best_unsharded, best_a, est)


# --- from a recorded inventory -------------------------------------------------------------

def k_from_inventory(inv: dict) -> BytesPerParam:
    """k_param, k_grad, k_opt that the run really used, from its inventory (stored dtypes and
    optimizer state keys; per-parameter state slots are the state keys other than ``step``)."""
    tensors = inv.get("tensors") or []

    def _dtype(role):
        for t in tensors:
            if t.get("role") == role and t.get("dtype"):
                return str(t["dtype"]).replace("torch.", "")
        return None

    units = inv.get("units") or []
    pdt = _dtype(runfmt.ROLE_PARAM) or (units[0].get("dtype") if units else None) or "float32"
    gdt = _dtype(runfmt.ROLE_GRAD) or pdt
    opt = inv.get("optimizer") or None
    if not opt:
        return bytes_per_param(pdt, gdt, "none", master_copy=False)
    keys = [k for k in (opt.get("state_keys") or []) if k != "step"]
    sdt = None
    for t in tensors:
        if t.get("role") == runfmt.ROLE_OPTIMIZER_STATE and not str(t.get("name", "")).endswith("/step") and t.get("dtype"):
            sdt = str(t["dtype"]).replace("torch.", "")
            break
    sdt = sdt or "float32"
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
