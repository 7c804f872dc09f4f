"""Model-state inventory of one rank (schema ``fsdpprof.inventory/1``): stdlib + torch only.

Finds the model an optimizer trains, its framework (fsdp2 / fsdp1 / ddp / none), strategy, group sizes, mixed
precision, offload and FSDP units (unsharded and local numel), and describes every parameter, gradient and
optimizer-state tensor this rank holds (numel, bytes, device, storage address as integers).
"""
from __future__ import annotations

import gc
import importlib

import torch
import torch.nn as nn

from fsdpprof.runfmt import (FRAMEWORK_DDP, FRAMEWORK_FSDP1, FRAMEWORK_FSDP2, FRAMEWORK_NONE, INVENTORY_SCHEMA,
                             ROLE_GRAD, ROLE_OPTIMIZER_STATE, ROLE_PARAM)

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
    return t.to_local() if hasattr(t, "to_local") else t


def _nbytes(t: torch.Tensor) -> int:
    return int(t.numel()) * int(t.element_size())


def _torch_class(module: str, name: str):
    """``module.name``, or () where this torch has none (nothing is an instance of ())."""
    try:
        return getattr(importlib.import_module(module), name)
    except Exception:
        return ()


def _mixed_precision(mp, stored: str) -> dict | None:
    """The param and reduce dtypes of a mixed-precision policy that sets either (None otherwise)."""
    param, reduce = getattr(mp, "param_dtype", None), getattr(mp, "reduce_dtype", None)
    if param is None and reduce is None:
        return None
    param_dtype = _dtype_name(param) if param is not None else stored
    return {"param_dtype": param_dtype, "reduce_dtype": _dtype_name(reduce) if reduce is not None else param_dtype}


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
    """The outermost nn.Module holding most of the optimizers' parameters (found via gc); without optimizers,
    the outermost module with the most parameters."""
    param_ids = {id(p) for p in optimizer_params(optimizers)}
    modules = [o for o in gc.get_objects() if issubclass(type(o), nn.Module)]
    children = {id(c) for m in modules for c in m._modules.values() if c is not None}
    best, best_key = None, (0, 0)
    for m in modules:
        if id(m) in children:
            continue
        try:
            hits = sum(1 for p in m.parameters() if not param_ids or id(p) in param_ids)
        except Exception:
            continue
        key = (hits, sum(1 for _ in m.modules()))
        if hits and key > best_key:
            best, best_key = m, key
    return best


class ModelInfo:
    """Static facts about the model (framework, strategy, units, names), computed once per window."""

    def __init__(self, model: nn.Module | None, world_size: int):
        self.model = model
        self.framework, self.strategy = FRAMEWORK_NONE, "NONE"
        self.shard_group_size = self.replicate_group_size = 1
        self.mixed_precision = None
        self.cpu_offload = False
        self.units: list[dict] = []
        self.param_names: dict[int, str] = {}     # id(param) -> clean fqn
        self.param_unit: dict[int, str | None] = {}
        self.unit_modules: dict[int, str] = {}    # id(unit module) -> unit fqn
        self.params: list = []                    # (name, param)
        if model is None:
            return
        fsdp1 = _torch_class("torch.distributed.fsdp", "FullyShardedDataParallel")
        fsdp2 = _torch_class("torch.distributed.fsdp", "FSDPModule")
        named_modules = list(model.named_modules())
        if any(isinstance(m, fsdp1) for _, m in named_modules):
            self._inspect_fsdp1(model, named_modules, fsdp1, world_size)
        elif any(isinstance(m, fsdp2) for _, m in named_modules):
            self._inspect_fsdp2(model, named_modules, fsdp2)
        else:
            prefix = ""
            if isinstance(model, _torch_class("torch.nn.parallel", "DistributedDataParallel")):
                self.framework, self.strategy, prefix = FRAMEWORK_DDP, "DDP", "module."
                try:
                    self.replicate_group_size = model.process_group.size()
                except Exception:
                    self.replicate_group_size = world_size
            for name, p in model.named_parameters():
                self._add_param(clean_fqn(name[len(prefix):] if name.startswith(prefix) else name), p, None)

    def _add_param(self, name: str, p, unit) -> None:
        self.params.append((name, p))
        self.param_names[id(p)] = name
        self.param_unit[id(p)] = unit

    def _inspect_fsdp2(self, model, named_modules, fsdp2_cls) -> None:
        self.framework = FRAMEWORK_FSDP2
        unit_names, groups = [], []
        for name, m in named_modules:
            if isinstance(m, fsdp2_cls):
                unit_names.append(clean_fqn(name))
                self.unit_modules[id(m)] = unit_names[-1]
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
        self.units = [_unit_row(unit, by_unit[unit]) for unit in unit_names]
        groups = [g for g in groups if g is not None]
        if not groups:
            self.strategy = "FULL_SHARD"
            return
        group = groups[0]
        shard = int(getattr(group.mesh_info, "shard_mesh_size", 1) or 1)
        replicate = int(getattr(group.mesh_info, "replicate_mesh_size", 1) or 1)
        self.shard_group_size, self.replicate_group_size = shard, replicate
        if replicate > 1:
            self.strategy = "HYBRID_SHARD" if shard > 1 else "NO_SHARD"
        else:
            reshard = any(getattr(g, "post_forward_mesh_info", None) is not None for g in groups)
            self.strategy = "FULL_SHARD" if reshard else "SHARD_GRAD_OP"
        stored = _dtype_name(self.params[0][1].dtype) if self.params else "float32"
        self.mixed_precision = _mixed_precision(getattr(group, "mp_policy", None), stored)
        offload_policy = _torch_class("torch.distributed.fsdp", "CPUOffloadPolicy")
        self.cpu_offload = isinstance(getattr(group, "offload_policy", None), offload_policy)

    def _inspect_fsdp1(self, model, named_modules, fsdp1_cls, world_size) -> None:
        self.framework = FRAMEWORK_FSDP1
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
            size = getattr(flat, "_unpadded_unsharded_size", None)
            unsharded_numel = int(size.numel()) if size is not None else int(sum(getattr(flat, "_numels", ())))
            local_numel, el = int(flat.numel()), int(flat.element_size())
            fqns = [(unit + "." + f) if unit else f for f in getattr(flat, "_fqns", ())]
            self.units.append({"fqn": unit, "param_fqns": fqns, "unsharded_numel": unsharded_numel,
                               "local_numel": local_numel, "dtype": _dtype_name(flat.dtype),
                               "unsharded_bytes": unsharded_numel * el, "local_bytes": local_numel * el})
            self._add_param((unit + "." if unit else "") + "_flat_param", flat, unit)
        # use_orig_params=True: the original parameters are views into the FlatParameters; name them
        # (their grads and optimizer state are the optimizer's) without listing their bytes twice
        orig = bool(getattr(first, "_use_orig_params", False))
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
        self.strategy = strategy = {"_HYBRID_SHARD_ZERO2": "HYBRID_SHARD"}.get(strategy, strategy)
        try:
            pg_size = first.process_group.size()
        except Exception:
            pg_size = world_size
        if strategy == "NO_SHARD":
            self.shard_group_size, self.replicate_group_size = 1, pg_size
        elif "HYBRID" in strategy:
            inter = getattr(first, "_inter_node_pg", None)
            self.shard_group_size = pg_size
            self.replicate_group_size = inter.size() if inter is not None else max(1, world_size // max(pg_size, 1))
        else:
            self.shard_group_size, self.replicate_group_size = pg_size, 1
        stored = self.units[0]["dtype"] if self.units else "float32"
        self.mixed_precision = _mixed_precision(getattr(first, "mixed_precision", None), stored)
        self.cpu_offload = bool(getattr(getattr(first, "cpu_offload", None), "offload_params", False))

    # -- capture ---------------------------------------------------------------------------
    def name_of(self, p) -> str:
        return self.param_names.get(id(p)) or f"param@{id(p):x}"

    def param_entries(self, step: int) -> list[dict]:
        return [tensor_entry(ROLE_PARAM, name, self.param_unit.get(id(p)), p.detach(), step, "before_step")
                for name, p in self.params]

    def grad_entries(self, params, step: int) -> list[dict]:
        return [tensor_entry(ROLE_GRAD, self.name_of(p), self.param_unit.get(id(p)), p.grad, step, "before_step")
                for p in params if getattr(p, "grad", None) is not None]

    def optimizer_entries(self, optimizers, step: int) -> list[dict]:
        rows = []
        for opt in optimizers:
            for p, state in list(getattr(opt, "state", {}).items()):
                if not isinstance(state, dict):
                    continue
                for key, value in state.items():
                    if isinstance(value, torch.Tensor):
                        rows.append(tensor_entry(ROLE_OPTIMIZER_STATE, f"{self.name_of(p)}/{key}",
                                                 self.param_unit.get(id(p)), value, step, "after_step"))
        return rows


def _owning_unit(name: str, unit_names: list[str]):
    """The innermost unit whose fqn prefixes parameter ``name`` (the root unit "" owns every name)."""
    owners = [u for u in unit_names if u == "" or name == u or name.startswith(u + ".")]
    return max(owners, key=len, default=None)


def _unit_row(unit: str, params: list) -> dict:
    locals_ = [_local(p) for _, p in params]
    return {"fqn": unit, "param_fqns": [n for n, _ in params],
            "unsharded_numel": sum(int(p.numel()) for _, p in params),
            "local_numel": sum(int(t.numel()) for t in locals_),
            "dtype": _dtype_name(params[0][1].dtype) if params else "float32",
            "unsharded_bytes": sum(_nbytes(p) for _, p in params), "local_bytes": sum(_nbytes(t) for t in locals_)}


def optimizer_summary(optimizers) -> dict | None:
    if not optimizers:
        return None
    opt = optimizers[0]
    first = list(getattr(opt, "state", {}).values())[:1]
    keys = list(first[0].keys()) if first and isinstance(first[0], dict) else []
    return {"class": type(opt).__name__, "state_keys": [str(k) for k in keys]}


def ddp_bucket_sizes(model) -> list[int] | None:
    """Bytes of each gradient bucket DDP's reducer holds (after its rebuild, when it has rebuilt them), from DDP's
    own logging data; None for another model, or a DDP whose buckets are the gradients' own storage."""
    try:
        if not hasattr(model, "_get_ddp_logging_data"):
            return None
        data = model._get_ddp_logging_data()
        if data.get("gradient_as_bucket_view"):
            return None
        text = data.get("rebuilt_bucket_sizes") or data.get("bucket_sizes")
        return [int(x) for x in str(text).split(",") if x.strip()] if text else None
    except Exception:
        return None


def build_inventory(info: ModelInfo, *, rank: int, world_size: int, optimizers, tensors: list[dict],
                    status: str = "complete", error: str | None = None) -> dict:
    """Assemble inventory.json from the static model facts and the captured tensor rows."""
    unsharded = [p for _, p in info.params if info.param_unit.get(id(p)) is None]   # outside every unit
    last_grad_step = max((t["step"] for t in tensors if t["role"] == ROLE_GRAD), default=None)

    def role_bytes(role: str, step=None) -> int:
        return sum(t["bytes"] for t in tensors if t["role"] == role and (step is None or t["step"] == step))

    totals = {"psi": sum(u["unsharded_numel"] for u in info.units) + sum(int(p.numel()) for p in unsharded),
              "param_bytes": role_bytes(ROLE_PARAM), "grad_bytes": role_bytes(ROLE_GRAD, last_grad_step),
              "optimizer_state_bytes": role_bytes(ROLE_OPTIMIZER_STATE),
              "unsharded_param_bytes": sum(u["unsharded_bytes"] for u in info.units) + sum(map(_nbytes, unsharded))}
    return {"schema": INVENTORY_SCHEMA, "rank": rank, "world_size": world_size, "framework": info.framework,
            "strategy": info.strategy, "shard_group_size": info.shard_group_size,
            "replicate_group_size": info.replicate_group_size, "mixed_precision": info.mixed_precision,
            "cpu_offload": info.cpu_offload, "optimizer": optimizer_summary(optimizers), "units": info.units,
            "tensors": tensors, "totals": totals, "ddp_bucket_bytes": ddp_bucket_sizes(info.model),
            "status": status, "error": error}
