"""What the input is: the line under the title (strategy, ranks, model, device), the banner of a partial
run or of warnings, and the "Overview" section (command, ranks, model, device)."""
from __future__ import annotations

from typing import TYPE_CHECKING

from fsdpprof.analyze.memory.fsdp_units import world_size_inferred
from fsdpprof.analyze.model import INPUT_KIND_TEXT, MISSING_WORD, fmt_bytes, rank_list
from fsdpprof.analyze.summary.headline import step_spread
from fsdpprof.report.page import esc, fmt_num, fmt_params, fmt_us_spread, kv_table, step_scope

if TYPE_CHECKING:      # (the report's modules stay light: plan and --help import some)
    from fsdpprof.analyze.pipeline import Analysis


def context_line(a: Analysis) -> str:
    """One line under the title: strategy, framework, ranks, model size, optimizer, dtypes, device."""
    o, t = a.overview, a.theory or {}
    bits = [str(o["description"])] if o.get("description") else []
    if (o.get("replicate_group_size") or 1) > 1:
        bits.append(f"shard group {o['shard_group_size']} x replicas {o['replicate_group_size']}")
    if o.get("psi"):
        bits.append(f"Ψ = {fmt_params(o['psi'])} parameters")
    if o.get("optimizer"):
        bits.append(str(o["optimizer"]))
    if t.get("param_dtype"):
        mp = o.get("mixed_precision")
        bits.append(f"{t['param_dtype']}" + (f", compute {mp.get('param_dtype')}" if mp else ""))
    named = o.get("device_name") if o.get("device_type") not in (None, "cpu") else None   # (cpu: not "x86_64")
    dev = " ".join(str(x) for x in (named or o.get("device_type"), o.get("backend")) if x)
    if dev:
        bits.append(dev)
    return " · ".join(bits)


def precision_text(o: dict) -> str:
    """The mixed-precision row: the inventory's policy; without one, what the kernel names show, said to be
    inferred; else unknown."""
    if o.get("has_inventory"):
        mp = o.get("mixed_precision")
        return f"param {mp.get('param_dtype')}, reduce {mp.get('reduce_dtype')}" if mp else "none"
    seen = o.get("precisions_seen") or {}
    comm = f"; collectives carry {', '.join(seen['comm_dtypes'])}" if seen.get("comm_dtypes") else ""
    if seen.get("by_dtype"):
        counts = ", ".join(f"{d} in {n:,}" for d, n in seen["by_dtype"].items())
        return (f"inferred from kernel names (no inventory): {counts} of {seen['kernels']:,} device kernels"
                + comm)
    if seen.get("kernels"):
        return f"{MISSING_WORD} (no inventory; no low-precision type in the kernel names{comm})"
    return f"{MISSING_WORD} (no inventory)"


def device_text(o: dict) -> str | None:
    """The device row: type, name and memory from deviceProperties or rank.json (``NVIDIA B200, 178 GiB``)."""
    name = ", ".join(x for x in (o.get("device_name"), fmt_bytes(o.get("device_memory_bytes"), missing=""))
                     if x)
    return " ".join(str(x) for x in (o.get("device_type"), name and f"({name})" if o.get("device_type") else name)
                    if x) or None


SOURCE_TEXT = {"run_dir": "fsdpprof run directory", "trace_folder": "folder of profiler traces",
               "trace_file": "profiler trace", "snapshot_file": "CUDA memory snapshot",
               "snapshot_folder": "folder of CUDA memory snapshots"}


def overview_section(a: Analysis) -> str:
    """The run in a table; a row without a value is left out (Ψ says it is unknown without an inventory)."""
    o = a.overview
    sp = step_spread(a.steps, "step_us")
    groups = (f"{o['shard_group_size']} / {o['replicate_group_size']}"
              if o.get("shard_group_size") and o.get("replicate_group_size") else None)
    items = [
        ("input", f"{a.path} ({SOURCE_TEXT.get(a.source, a.source)})"), ("command", o.get("command")),
        ("status", o.get("status")), ("strategy", o.get("description")),
        ("what ran", INPUT_KIND_TEXT.get(o.get("input_kind"), o.get("input_kind"))),
        ("world size", f"{o['world_size']} (inferred from {o['world_size_source']})" if world_size_inferred(o)
         else o.get("world_size")), ("ranks analysed", rank_list(o["ranks_present"]) if o.get("ranks_present") else None),
        ("shard / replicate group", groups),
        ("Ψ (parameters)", f"{fmt_params(o.get('psi'))} ({fmt_num(o.get('psi'))})" if o.get("psi")
         else f"{MISSING_WORD} (no inventory)"),
        ("mixed precision", precision_text(o)), ("optimizer", o.get("optimizer")),
        ("CPU offload", ("yes" if o.get("cpu_offload") else "no") if o.get("has_inventory")
         else f"{MISSING_WORD} (no inventory)"),
        ("device", device_text(o)),
        ("backend", o.get("backend")), ("hosts", ", ".join(o.get("hosts") or [])),
        ("steps recorded", ", ".join(map(str, o.get("steps_recorded") or []))),
        ("step time", f"{fmt_us_spread(sp['value'], sp['min'], sp['max'])} ({step_scope(sp)})"
         if sp["value"] == sp["value"] else None),
    ]
    status = f" ({o['status']})" if o.get("status") else ""
    return (f'<section id="overview"><h2>Overview</h2><details><summary>the run: command, ranks, model, device'
            f'{esc(status)}</summary>{kv_table(items)}</details></section>')


def banner(a: Analysis) -> str:
    out = []
    if a.missing:
        lst = "; ".join(f"{k}: {v}" for k, v in sorted(a.missing.items()))
        out.append(f'<div class="banner"><b>Partial run</b>: missing ranks/files: {esc(lst)}. '
                   f"The numbers below cover the ranks that were recorded.</div>")
    for w in a.warnings or []:
        out.append(f'<div class="banner">{esc(w)}</div>')
    return "".join(out)
