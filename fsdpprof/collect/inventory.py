"""Model-state inventory of one rank (schema ``fsdpprof.inventory/1``): stdlib + torch only.

Finds the model an optimizer trains, works out framework (fsdp2 / fsdp1 / ddp / none), strategy,
group sizes, mixed precision and offload, the FSDP units with unsharded and local numel, and
describes every parameter, gradient and optimizer-state tensor this rank holds (bytes, device,
storage address). Sizes are in elements (``numel``) and bytes; addresses are integers.
"""
from __future__ import annotations

import gc

import torch
import torch.nn as nn

from fsdpprof.runfmt import INVENTORY_SCHEMA, ROLE_GRAD, ROLE_OPTIMIZER_STATE, ROLE_PARAM

_WRAPPER_SEGMENTS = ("_fsdp_wrapped_module", "_checkpoint_wrapped_module", "_orig_mod")


def _dtype_name(dtype) -> str:
    return str(dtype).replace("torch.", "")


def clean_fqn(name: str) -> str:
    """Drop FSDP1/checkpoint/compile wrapper segments from a module or parameter name."""
    return ".".join(part for part in name.split(".") if part not in _WRAPPER_SEGMENTS)


def _local(t: torch.Tensor) -> torch.Tensor:
    """The tensor this rank holds: a DTensor's local shard, else the tensor itself."""
    local = getattr(t, "_local_tensor", None)
    if local is not None:
        return local
    if hasattr(t, "to_local"):
        return t.to_local()
    return t


def _nbytes(t: torch.Tensor) -> int:
    return int(t.numel()) * int(t.element_size())


def tensor_entry(role: str, name: str, unit, t: torch.Tensor, step: int, captured_at: str) -> dict:
    """One ``tensors`` row of the inventory for tensor ``t`` (local view)."""
    t = _local(t)
    try:
        storage = t.untyped_storage()
        storage_ptr, storage_nbytes = int(storage.data_ptr()), int(storage.nbytes())
    except Exception:
        storage_ptr, storage_nbytes = 0, 0
    return {"role": role, "name": name, "unit": unit, "dtype": _dtype_name(t.dtype), "numel": int(t.numel()),
            "bytes": _nbytes(t), "device": str(t.device), "data_ptr": int(t.data_ptr()),
            "storage_ptr": storage_ptr, "storage_nbytes": storage_nbytes, "step": step,
            "captured_at": captured_at}


def optimizer_params(optimizers) -> list:
    params, seen = [], set()
    for opt in optimizers:
        for group in getattr(opt, "param_groups", []):
            for p in group.get("params", []):
                if id(p) not in seen:
                    seen.add(id(p))
                    params.append(p)
    return params


def find_model(optimizers) -> nn.Module | None:
    """The outermost nn.Module holding most of the optimizers' parameters (found once, via gc).

    Without optimizers: the outermost module with the most parameters.
    """
    param_ids = {id(p) for p in optimizer_params(optimizers)}
    module_type = nn.Module
    modules = [o for o in gc.get_objects() if issubclass(type(o), module_type)]
    children = {id(c) for m in modules for c in m._modules.values() if c is not None}
    best, best_key = None, (0, 0)
    for m in modules:
        if id(m) in children:
            continue
        try:
            hits = sum(1 for p in m.parameters() if not param_ids or id(p) in param_ids)
        except Exception:
            continue
        if hits == 0:
            continue
        key = (hits, sum(1 for _ in m.modules()))
        if key > best_key:
            best, best_key = m, key
    return best


class ModelInfo:
    """Static facts about the model (framework, strategy, units, names), computed once per window."""

    def __init__(self, model: nn.Module | None, world_size: int):
        self.model = model
        self.framework = "none"
        self.strategy = "NONE"
        self.shard_group_size = 1
        self.replicate_group_size = 1
        self.mixed_precision = None
        self.cpu_offload = False
        self.units: list[dict] = []
        self.param_names: dict[int, str] = {}     # id(param) -> clean fqn
        self.param_unit: dict[int, str | None] = {}
        self.unit_modules: dict[int, str] = {}    # id(unit module) -> unit fqn
        self.params: list = []                    # (name, param)
        if model is not None:
            self._inspect(model, world_size)

    # -- framework detection -------------------------------------------------------------
    def _inspect(self, model: nn.Module, world_size: int) -> None:
        fsdp2_cls = fsdp1_cls = ddp_cls = ()
        try:
            from torch.distributed.fsdp import FSDPModule as fsdp2_cls  # noqa: N813
        except Exception:
            pass
        try:
            from torch.distributed.fsdp import FullyShardedDataParallel as fsdp1_cls  # noqa: N813
        except Exception:
            pass
        try:
            from torch.nn.parallel import DistributedDataParallel as ddp_cls  # noqa: N813
        except Exception:
            pass
        named_modules = list(model.named_modules())
        if fsdp1_cls and any(isinstance(m, fsdp1_cls) for _, m in named_modules):
            self._inspect_fsdp1(model, named_modules, fsdp1_cls, world_size)
        elif fsdp2_cls and any(isinstance(m, fsdp2_cls) for _, m in named_modules):
            self._inspect_fsdp2(model, named_modules, fsdp2_cls)
        else:
            prefix = ""
            if ddp_cls and isinstance(model, ddp_cls):
                self.framework, self.strategy = "ddp", "DDP"
                self.replicate_group_size = world_size
                try:
                    self.replicate_group_size = model.process_group.size()
                except Exception:
                    pass
                prefix = "module."
            for name, p in model.named_parameters():
                name = clean_fqn(name[len(prefix):] if name.startswith(prefix) else name)
                self._add_param(name, p, None)

    def _add_param(self, name: str, p, unit) -> None:
        self.params.append((name, p))
        self.param_names[id(p)] = name
        self.param_unit[id(p)] = unit

    def _inspect_fsdp2(self, model, named_modules, fsdp2_cls) -> None:
        self.framework = "fsdp2"
        unit_names = []
        groups = []
        for name, m in named_modules:
            if isinstance(m, fsdp2_cls):
                unit = clean_fqn(name)
                unit_names.append(unit)
                self.unit_modules[id(m)] = unit
                try:
                    groups.append(m._get_fsdp_state()._fsdp_param_group)
                except Exception:
                    pass
        by_unit: dict[str, list] = {u: [] for u in unit_names}
        for name, p in model.named_parameters():
            name = clean_fqn(name)
            unit = _owning_unit(name, unit_names)
            self._add_param(name, p, unit)
            if unit is not None:
                by_unit[unit].append((name, p))
        for unit in unit_names:
            self.units.append(_unit_row(unit, by_unit[unit]))
        group = next((g for g in groups if g is not None), None)
        if group is None:
            self.strategy = "FULL_SHARD"
            return
        mesh_info = group.mesh_info
        shard = int(getattr(mesh_info, "shard_mesh_size", 1) or 1)
        replicate = int(getattr(mesh_info, "replicate_mesh_size", 1) or 1)
        self.shard_group_size, self.replicate_group_size = shard, replicate
        if replicate > 1 and shard > 1:
            self.strategy = "HYBRID_SHARD"
        elif shard <= 1 and replicate > 1:
            self.strategy = "NO_SHARD"
        else:
            reshard = any(getattr(g, "post_forward_mesh_info", None) is not None for g in groups if g is not None)
            self.strategy = "FULL_SHARD" if reshard else "SHARD_GRAD_OP"
        mp = getattr(group, "mp_policy", None)
        if mp is not None and (mp.param_dtype is not None or mp.reduce_dtype is not None):
            stored = _dtype_name(self.params[0][1].dtype) if self.params else "float32"
            param_dtype = _dtype_name(mp.param_dtype) if mp.param_dtype is not None else stored
            reduce_dtype = _dtype_name(mp.reduce_dtype) if mp.reduce_dtype is not None else param_dtype
            self.mixed_precision = {"param_dtype": param_dtype, "reduce_dtype": reduce_dtype}
        try:
            from torch.distributed.fsdp import CPUOffloadPolicy

            self.cpu_offload = isinstance(getattr(group, "offload_policy", None), CPUOffloadPolicy)
        except Exception:
            pass

    def _inspect_fsdp1(self, model, named_modules, fsdp1_cls, world_size) -> None:
        self.framework = "fsdp1"
        first = None
        for name, m in named_modules:
            if not isinstance(m, fsdp1_cls):
                continue
            unit = clean_fqn(name)
            self.unit_modules[id(m)] = unit
            first = first or m
            flat = getattr(m, "_flat_param", None)
            if flat is None:
                continue
            fqns = [(unit + "." + f) if unit else f for f in getattr(flat, "_fqns", ())]
            pname = (unit + "." if unit else "") + "_flat_param"
            unsharded = getattr(flat, "_unpadded_unsharded_size", None)
            unsharded_numel = int(unsharded.numel()) if unsharded is not None else int(sum(getattr(flat, "_numels", ())))
            local_numel = int(flat.numel())
            el = int(flat.element_size())
            self.units.append({"fqn": unit, "param_fqns": fqns, "unsharded_numel": unsharded_numel,
                               "local_numel": local_numel, "dtype": _dtype_name(flat.dtype),
                               "unsharded_bytes": unsharded_numel * el, "local_bytes": local_numel * el})
            self._add_param(pname, flat, unit)
        # use_orig_params=True: the original parameters are views into the FlatParameters; name them
        # (their grads and optimizer state are the optimizer's) without listing their bytes twice
        orig = bool(getattr(first, "_use_orig_params", False)) if first is not None else False
        unit_names = [u["fqn"] for u in self.units]
        for name, p in model.named_parameters():
            if id(p) in self.param_names:
                continue
            name = clean_fqn(name)
            if orig:
                self.param_names[id(p)] = name
                self.param_unit[id(p)] = _owning_unit(name, unit_names)
            else:  # not managed by any FSDP unit (unusual)
                self._add_param(name, p, None)
        if first is None:
            return
        strategy = getattr(getattr(first, "sharding_strategy", None), "name", "FULL_SHARD")
        strategy = {"_HYBRID_SHARD_ZERO2": "HYBRID_SHARD"}.get(strategy, strategy)
        self.strategy = strategy
        try:
            pg_size = first.process_group.size()
        except Exception:
            pg_size = world_size
        if strategy == "NO_SHARD":
            self.shard_group_size, self.replicate_group_size = 1, pg_size
        elif strategy == "HYBRID_SHARD" or "HYBRID" in strategy:
            inter = getattr(first, "_inter_node_pg", None)
            self.shard_group_size = pg_size
            self.replicate_group_size = inter.size() if inter is not None else max(1, world_size // max(pg_size, 1))
        else:
            self.shard_group_size, self.replicate_group_size = pg_size, 1
        mp = getattr(first, "mixed_precision", None)
        if mp is not None and (getattr(mp, "param_dtype", None) is not None or getattr(mp, "reduce_dtype", None) is not None):
            stored = self.units[0]["dtype"] if self.units else "float32"
            param_dtype = _dtype_name(mp.param_dtype) if mp.param_dtype is not None else stored
            reduce_dtype = _dtype_name(mp.reduce_dtype) if mp.reduce_dtype is not None else param_dtype
            self.mixed_precision = {"param_dtype": param_dtype, "reduce_dtype": reduce_dtype}
        offload = getattr(first, "cpu_offload", None)
        self.cpu_offload = bool(getattr(offload, "offload_params", False))

    # -- capture ---------------------------------------------------------------------------
    def name_of(self, p) -> str:
        return self.param_names.get(id(p)) or f"param@{id(p):x}"

    def unit_of(self, p):
        return self.param_unit.get(id(p))

    def param_entries(self, step: int) -> list[dict]:
        return [tensor_entry(ROLE_PARAM, name, self.param_unit.get(id(p)), p.detach(), step, "before_step")
                for name, p in self.params]

    def grad_entries(self, params, step: int) -> list[dict]:
        rows = []
        for p in params:
            g = getattr(p, "grad", None)
            if g is not None:
                rows.append(tensor_entry(ROLE_GRAD, self.name_of(p), self.unit_of(p), g, step, "before_step"))
        return rows

    def optimizer_entries(self, optimizers, step: int) -> list[dict]:
        rows = []
        for opt in optimizers:
            for p, state in list(getattr(opt, "state", {}).items()):
                if not isinstance(state, dict):
                    continue
                for key, value in state.items():
                    if isinstance(value, torch.Tensor):
                        rows.append(tensor_entry(ROLE_OPTIMIZER_STATE, f"{self.name_of(p)}/{key}", self.unit_of(p),
                                                 value, step, "after_step"))
        return rows


def _owning_unit(name: str, unit_names: list[str]):
    best = None
    for unit in unit_names:
        if unit == "" or name == unit or name.startswith(unit + "."):
            if best is None or len(unit) > len(best):
                best = unit
    return best


def _unit_row(unit: str, params: list) -> dict:
    unsharded = sum(int(p.numel()) for _, p in params)
    locals_ = [_local(p) for _, p in params]
    local = sum(int(t.numel()) for t in locals_)
    return {"fqn": unit, "param_fqns": [n for n, _ in params], "unsharded_numel": unsharded, "local_numel": local,
            "dtype": _dtype_name(params[0][1].dtype) if params else "float32",
            "unsharded_bytes": sum(int(p.numel()) * int(p.element_size()) for _, p in params),
            "local_bytes": sum(_nbytes(t) for t in locals_)}


def optimizer_summary(optimizers) -> dict | None:
    if not optimizers:
        return None
    opt = optimizers[0]
    keys = []
    for state in list(getattr(opt, "state", {}).values())[:1]:
        if isinstance(state, dict):
            keys = list(state.keys())
    return {"class": type(opt).__name__, "state_keys": [str(k) for k in keys]}


def build_inventory(info: ModelInfo, *, rank: int, world_size: int, optimizers, tensors: list[dict],
                    status: str = "complete", error: str | None = None) -> dict:
    """Assemble inventory.json from the static model facts and the captured tensor rows."""
    if info.units:
        psi = sum(u["unsharded_numel"] for u in info.units)
        unsharded_bytes = sum(u["unsharded_bytes"] for u in info.units)
        # parameters outside every unit (not sharded)
        for name, p in info.params:
            if info.param_unit.get(id(p)) is None:
                psi += int(p.numel())
                unsharded_bytes += int(p.numel()) * int(p.element_size())
    else:
        psi = sum(int(p.numel()) for _, p in info.params)
        unsharded_bytes = sum(int(p.numel()) * int(p.element_size()) for _, p in info.params)
    last_grad_step = max((t["step"] for t in tensors if t["role"] == ROLE_GRAD), default=None)
    totals = {
        "psi": psi,
        "param_bytes": sum(t["bytes"] for t in tensors if t["role"] == ROLE_PARAM),
        "grad_bytes": sum(t["bytes"] for t in tensors if t["role"] == ROLE_GRAD and t["step"] == last_grad_step),
        "optimizer_state_bytes": sum(t["bytes"] for t in tensors if t["role"] == ROLE_OPTIMIZER_STATE),
        "unsharded_param_bytes": unsharded_bytes,
    }
    return {"schema": INVENTORY_SCHEMA, "rank": rank, "world_size": world_size, "framework": info.framework,
            "strategy": info.strategy, "shard_group_size": info.shard_group_size,
            "replicate_group_size": info.replicate_group_size, "mixed_precision": info.mixed_precision,
            "cpu_offload": info.cpu_offload, "optimizer": optimizer_summary(optimizers), "units": info.units,
            "tensors": tensors, "totals": totals, "status": status, "error": error}
