"""The model's FSDP units (parameters all-gathered together) and their sizes under any shard group (elements).

An FSDP run names its units in inventory.json; a DDP or single-device run's are derived from the parameter
names with the usual transformer wrapping (each numbered child of the container with the most, the rest root).
"""
from __future__ import annotations

import math
from collections import Counter
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


def local_numel(numel: int, shard_group: int) -> int:
    """Elements one rank holds of ``numel`` sharded over ``shard_group`` ranks (FSDP pads to a multiple)."""
    return int(math.ceil(numel / max(int(shard_group), 1)))


def padded_numel(numel: int, shard_group: int) -> int:
    """Elements of the all-gathered (padded) unsharded buffer."""
    return local_numel(numel, shard_group) * max(int(shard_group), 1)


def _unit_of_name(name: str) -> str:
    """The numbered container child a parameter lives in (``layers.3.attn.qkv.weight`` -> ``layers.3``)."""
    parts = name.split(".")
    i = next((i for i, p in enumerate(parts[:-1]) if p.isdigit() and i > 0), None)
    return ROOT_UNIT if i is None else ".".join(parts[: i + 1])


def _params(inv: dict) -> dict[str, int]:
    """Parameter name -> numel of the inventory's tensors (of its last step when it lists several)."""
    tensors = [t for t in inv.get("tensors") or [] if t.get("role") == runfmt.ROLE_PARAM]
    last = max((t.get("step") for t in tensors if isinstance(t.get("step"), (int, float))), default=None)
    out: dict[str, int] = {}
    for t in tensors:
        if last is None or t.get("step") in (last, None):
            out.setdefault(str(t.get("name")), int(t.get("numel") or 0))
    return out


def model_units(inventory: dict | None) -> tuple[list[Unit], str | None]:
    """Units in forward order (root first) and a note when they were derived rather than recorded.
    UserError when the inventory lists no parameters at all."""
    inv = inventory or {}
    rows = inv.get("units") or []
    if rows:
        names = [str(r.get("fqn") or "") for r in rows]
        root = ROOT_UNIT if ROOT_UNIT in names else min(names, key=len)
        numel = {str(r.get("fqn") or ""): int(r.get("unsharded_numel") or 0) for r in rows}
        # parameters outside every unit are the root's (FSDP2 root; FSDP1 ignores none in practice)
        numel[root] += max(int((inv.get("totals") or {}).get("psi") or 0) - sum(numel.values()), 0)
        ordered = [root] + [n for n in unit_order(names, forward=names) if n != root]
        return [Unit(n, numel[n], i) for i, n in enumerate(ordered)], None
    params = _params(inv)
    if not params:
        raise UserError("inventory.json lists no parameters: the model's sizes are unknown, so no other strategy "
                        "can be predicted (record the run with `fsdpprof record`)")
    groups: Counter = Counter()
    for name, n in params.items():
        groups[_unit_of_name(name)] += n
    # only the container with the most numbered children makes units; the rest is the root's
    containers = Counter(u.rsplit(".", 1)[0] for u in groups if u != ROOT_UNIT)
    best = max(containers, key=containers.get) if containers else None
    units = {ROOT_UNIT: 0}
    for u, n in groups.items():
        if u != ROOT_UNIT and containers[best] >= 2 and u.rsplit(".", 1)[0] == best:
            units[u] = n
        else:
            units[ROOT_UNIT] += n
    if len(units) > 1:
        note = (f"the run has no FSDP units: assumed one unit per {best}.N ({len(units) - 1} units) plus the root "
                f"unit with the other parameters, the usual transformer wrapping")
    else:
        note = "the run has no FSDP units and no numbered blocks: assumed the whole model is one unit"
    return [Unit(u, n, i) for i, (u, n) in enumerate(units.items())], note


def parameter_tensors(inventory: dict | None) -> int:
    """The model's parameter tensors (before any flattening: FSDP1's units name them in ``param_fqns``)."""
    rows = (inventory or {}).get("units") or []
    if rows and all(isinstance(r.get("param_fqns"), list) for r in rows):
        return sum(len(r["param_fqns"]) for r in rows)
    return len(_params(inventory or {}))


def param_unit_map(inventory: dict | None, units: list[Unit]) -> dict[str, str]:
    """parameter (and FSDP1 flat parameter) name -> unit fqn."""
    known = {u.fqn for u in units}
    fqns = sorted((u.fqn for u in units if u.fqn != ROOT_UNIT), key=len, reverse=True)
    out = {}
    for t in (inventory or {}).get("tensors") or []:
        name = str(t.get("name") or "").split("/")[0]
        if name not in out:
            unit = t.get("unit")
            out[name] = unit if unit is not None and unit in known else next(
                (f for f in fqns if name == f or name.startswith(f + ".")), ROOT_UNIT)
    return out
