"""The model's FSDP units (parameters all-gathered together) and their sizes under any shard group.

An FSDP run names its units in inventory.json (``units``: fqn, unsharded numel, dtype). A DDP or
single-device run has none: its units are derived from the parameter names with the usual
transformer wrapping policy (each numbered child of the container that holds the most of them,
``layers.0``, ``layers.1`` ..., is a unit; every other parameter belongs to the root unit ``""``);
:func:`model_units` says so in its note. Sizes in elements and bytes.
"""
from __future__ import annotations

import math
from dataclasses import dataclass

from fsdpprof import runfmt
from fsdpprof.analyze.model import ROOT_UNIT, unit_order
from fsdpprof.errors import UserError



@dataclass(frozen=True)
class Unit:
    """One FSDP unit: ``numel`` unsharded parameters; ``order`` its place in forward order (the root 0)."""

    fqn: str
    numel: int
    order: int

    @property
    def is_root(self) -> bool:
        return self.fqn == ROOT_UNIT


def local_numel(numel: int, shard_group: int) -> int:
    """Elements one rank holds of ``numel`` sharded over ``shard_group`` ranks (FSDP pads to a multiple)."""
    return int(math.ceil(numel / max(int(shard_group), 1)))


def padded_numel(numel: int, shard_group: int) -> int:
    """Elements of the all-gathered (padded) unsharded buffer."""
    return local_numel(numel, shard_group) * max(int(shard_group), 1)


def _unit_of_name(name: str) -> str:
    """The numbered container child a parameter lives in (``layers.3.attn.qkv.weight`` -> ``layers.3``)."""
    parts = name.split(".")
    for i, p in enumerate(parts[:-1]):
        if p.isdigit() and i > 0:
            return ".".join(parts[: i + 1])
    return ROOT_UNIT


def model_units(inventory: dict | None) -> tuple[list[Unit], str | None]:
    """Units in forward order (root first, then the inventory's / the names' order) and a note when they
    were derived rather than recorded. UserError when the inventory lists no parameters at all."""
    inv = inventory or {}
    rows = inv.get("units") or []
    if rows:
        units = []
        names = [str(r.get("fqn") or "") for r in rows]
        root = ROOT_UNIT if ROOT_UNIT in names else min(names, key=len)
        ordered = [root] + [n for n in unit_order(names, forward=names) if n != root]   # the inventory's: forward
        numel = {str(r.get("fqn") or ""): int(r.get("unsharded_numel") or 0) for r in rows}
        # parameters outside every unit are the root's (FSDP2 root; FSDP1 ignores none in practice)
        psi = int((inv.get("totals") or {}).get("psi") or 0)
        outside = psi - sum(numel.values())
        if outside > 0:
            numel[root] += outside
        for i, n in enumerate(ordered):
            units.append(Unit(n, numel[n], i))
        return units, None
    params = {}
    steps = [t.get("step") for t in inv.get("tensors") or [] if t.get("role") == runfmt.ROLE_PARAM]
    last = max((s for s in steps if isinstance(s, (int, float))), default=None)
    for t in inv.get("tensors") or []:
        if t.get("role") != runfmt.ROLE_PARAM or (last is not None and t.get("step") not in (last, None)):
            continue
        params.setdefault(str(t.get("name")), int(t.get("numel") or 0))
    if not params:
        raise UserError("inventory.json lists no parameters: the model's sizes are unknown, so no other strategy "
                        "can be predicted (record the run with `fsdpprof record`)")
    groups: dict[str, int] = {}
    for name, n in params.items():
        u = _unit_of_name(name)
        groups[u] = groups.get(u, 0) + n
    # only the container with the most numbered children makes units; the rest is the root's
    containers: dict[str, int] = {}
    for u in groups:
        if u != ROOT_UNIT:
            containers[u.rsplit(".", 1)[0]] = containers.get(u.rsplit(".", 1)[0], 0) + 1
    best = max(containers, key=containers.get) if containers else None
    units = {ROOT_UNIT: 0}
    order = [ROOT_UNIT]
    for u, n in groups.items():
        if u != ROOT_UNIT and best is not None and u.rsplit(".", 1)[0] == best and containers[best] >= 2:
            units[u] = n
            order.append(u)
        else:
            units[ROOT_UNIT] += n
    note = None
    if len(order) > 1:
        note = (f"the run has no FSDP units: assumed one unit per {best}.N ({len(order) - 1} units) plus the root "
                f"unit with the other parameters, the usual transformer wrapping")
    else:
        note = "the run has no FSDP units and no numbered blocks: assumed the whole model is one unit"
    return [Unit(u, units[u], i) for i, u in enumerate(order)], note


def parameter_tensors(inventory: dict | None) -> int:
    """The model's parameter tensors (before any flattening: FSDP1's units name them in ``param_fqns``)."""
    inv = inventory or {}
    rows = inv.get("units") or []
    if rows and all(isinstance(r.get("param_fqns"), list) for r in rows):
        return sum(len(r["param_fqns"]) for r in rows)
    steps = [t.get("step") for t in inv.get("tensors") or [] if t.get("role") == runfmt.ROLE_PARAM]
    last = max((s for s in steps if isinstance(s, (int, float))), default=None)
    return len({str(t.get("name")) for t in inv.get("tensors") or []
                if t.get("role") == runfmt.ROLE_PARAM and (last is None or t.get("step") in (last, None))})


def param_unit_map(inventory: dict | None, units: list[Unit]) -> dict[str, str]:
    """parameter (and FSDP1 flat parameter) name -> unit fqn."""
    fqns = sorted((u.fqn for u in units if u.fqn != ROOT_UNIT), key=len, reverse=True)
    out = {}
    for t in (inventory or {}).get("tensors") or []:
        name = str(t.get("name") or "").split("/")[0]
        if name in out:
            continue
        unit = t.get("unit")
        if unit is None or unit not in {u.fqn for u in units}:
            unit = next((f for f in fqns if name == f or name.startswith(f + ".")), ROOT_UNIT)
        out[name] = unit
    return out
