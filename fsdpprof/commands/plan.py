"""``fsdpprof plan``: per-rank model-state memory and traffic per strategy, before anything runs."""
from __future__ import annotations

import json
import math

from fsdpprof import options
from fsdpprof.analyze.summary import theory
from fsdpprof.errors import UserError


def add_arguments(p) -> None:
    p.add_argument("--params", required=True, type=options.PARAMS,
                   help=f"parameter count Psi, e.g. 7.5e9 or 7.5B ({options.PARAMS.describe()})")
    p.add_argument("--world", required=True, type=options.WORLD, help="number of ranks N")
    p.add_argument("--optimizer", default="adam", help="adam (default), adamw, sgd, sgd-momentum, adagrad, none")
    p.add_argument("--param-dtype", default="bf16", help="dtype parameters are stored and all-gathered in (bf16)")
    p.add_argument("--grad-dtype", default=None, help="dtype of gradients / reduce-scatter (default: param dtype)")
    p.add_argument("--state-dtype", default="fp32", help="dtype of optimizer states and master copy (fp32)")
    p.add_argument("--shard-group", default=None, type=options.WORLD, help="HYBRID_SHARD shard-group size N_s (adds an HSDP row)")
    p.add_argument("--offload", default="none", choices=["none", "optimizer", "params"],
                   help="CPU offload: optimizer state, or params+grads+optimizer state (FSDP CPUOffload)")
    p.add_argument("--compression", default="1", type=options.COMPRESSION, help="gradient compression ratio (divides gradient traffic)")
    p.add_argument("--gpu-mem", default=None, type=options.GPU_MEM, help="memory per GPU, e.g. 40GB or 80GiB: says whether each fits")
    p.add_argument("--units", default="GB", choices=["GB", "GiB"], help="print GB (1e9 bytes, default) or GiB (2^30)")
    p.add_argument("--json", action="store_true", help="print the numbers as JSON")


def _check_finite(x, where: str = "") -> None:
    """Every number of the plan is finite (the limits on the options make it so; this is the proof)."""
    if isinstance(x, dict):
        for k, v in x.items():
            _check_finite(v, k)
    elif isinstance(x, (list, tuple)):
        for v in x:
            _check_finite(v, where)
    elif isinstance(x, float) and not math.isfinite(x):
        raise UserError(f"the plan's {where} is not a finite number with these options; use smaller --params")


def plan(args) -> dict:
    """All numbers the plan prints, as a dict (bytes)."""
    for name in ("optimizer", "param_dtype", "grad_dtype", "state_dtype"):
        value = getattr(args, name)
        if value is not None and not str(value).strip():
            raise UserError(f"--{name.replace('_', '-')} is empty: give e.g. "
                            f"{'adam' if name == 'optimizer' else 'bf16 or fp32'}")
    psi = options.PARAMS.parse(args.params, "--params")
    world = options.WORLD.parse(args.world, "--world")
    shard_group = options.checked(args.shard_group, "--shard-group", options.WORLD)
    if shard_group and (shard_group > world or world % shard_group):
        raise UserError(f"--shard-group {shard_group} must divide --world {world}")
    compression = options.COMPRESSION.parse(args.compression, "--compression")
    gpu = options.checked(args.gpu_mem, "--gpu-mem", options.GPU_MEM)
    k = theory.bytes_per_param(args.param_dtype, args.grad_dtype, args.optimizer, state_dtype=args.state_dtype)
    rows = []
    ddp_traffic = theory.fsdp_traffic(psi, "DDP", world, args.param_dtype, k.grad_dtype,
                                      compression_ratio=compression).total_bytes
    for ms in theory.all_model_states(psi, k, world, shard_group, args.offload):
        tr = theory.fsdp_traffic(psi, ms.strategy, world, args.param_dtype, k.grad_dtype, shard_group, compression)
        row = {"strategy": ms.strategy, "label": ms.label, "formula": ms.formula, "substituted": ms.substituted,
               "param_bytes": ms.param_bytes, "grad_bytes": ms.grad_bytes,
               "optimizer_state_bytes": ms.optimizer_state_bytes, "model_states_bytes": ms.total_bytes,
               "device_bytes": ms.device_bytes, "host_bytes": ms.host_bytes,
               "traffic_bytes": tr.total_bytes, "traffic_formula": tr.formula,
               "traffic_vs_ddp": tr.total_bytes / ddp_traffic if ddp_traffic else None,
               "fits": (ms.device_bytes <= gpu) if gpu else None}
        rows.append(row)
    res = {"psi": psi, "world": world, "shard_group": shard_group, "k_param": k.k_param, "k_grad": k.k_grad,
            "k_opt": k.k_opt, "k_opt_detail": k.opt_detail, "param_dtype": k.param_dtype, "grad_dtype": k.grad_dtype,
            "optimizer": k.optimizer, "offload": args.offload, "compression_ratio": compression,
            "gpu_mem_bytes": gpu, "units": args.units, "rows": rows}
    _check_finite(res)
    return res


def render_text(res: dict) -> str:
    unit = theory.GB if res["units"] == "GB" else theory.GIB
    uname = "GB = 1e9 bytes" if res["units"] == "GB" else "GiB = 2^30 bytes"
    u = res["units"]
    lines = [
        f"Psi = {res['psi']:.6g} parameters on N = {res['world']} ranks; per parameter: "
        f"k_param {res['k_param']:g} ({res['param_dtype']}) + k_grad {res['k_grad']:g} ({res['grad_dtype']}) + "
        f"k_opt {res['k_opt']:g} ({res['k_opt_detail']}) = {res['k_param'] + res['k_grad'] + res['k_opt']:g} bytes",
        f"Memory per rank in {uname} (model states only: activations and temporary buffers come on top); "
        f"traffic = bytes each rank sends per step (ring).",
        "",
    ]
    hdr = ["strategy", f"params {u}", f"grads {u}", f"optim {u}", f"total {u}", "traffic " + u, "vs DDP"]
    if res["offload"] != "none":
        hdr.insert(5, f"on host {u}")
    if res["gpu_mem_bytes"]:
        hdr.append(f"fits {res['gpu_mem_bytes'] / unit:g} {u}?")
    table = [hdr]
    for r in res["rows"]:
        row = [r["label"], f"{r['param_bytes'] / unit:.6g}", f"{r['grad_bytes'] / unit:.6g}",
               f"{r['optimizer_state_bytes'] / unit:.6g}", f"{r['device_bytes'] / unit:.6g}",
               f"{r['traffic_bytes'] / unit:.6g}",
               f"{r['traffic_vs_ddp']:.3g}x" if r["traffic_vs_ddp"] is not None else "-"]
        if res["offload"] != "none":
            row.insert(5, f"{r['host_bytes'] / unit:.6g}")
        if res["gpu_mem_bytes"]:
            row.append("yes" if r["fits"] else "NO")
        table.append(row)
    widths = [max(len(t[i]) for t in table) for i in range(len(hdr))]
    for j, t in enumerate(table):
        lines.append("  ".join(c.ljust(widths[i]) if i == 0 else c.rjust(widths[i]) for i, c in enumerate(t)))
        if j == 0:
            lines.append("  ".join("-" * w for w in widths))
    lines.append("")
    lines.append("Formulas (k_p, k_g, k_o = bytes per parameter; Psi = parameters; N = ranks):")
    lines.extend(f"  {r['label']}: {r['formula']}" for r in res["rows"])
    if any(r["traffic_vs_ddp"] is None for r in res["rows"]):
        lines.append("(vs DDP: -, DDP sends nothing on one rank)")
    if res["units"] == "GB":
        lines.append("(use --units GiB for binary units)")
    return "\n".join(lines)


def run(args) -> int:
    res = plan(args)
    if args.json:
        print(json.dumps(res, indent=1, allow_nan=False))
    else:
        print(render_text(res))
    return 0
