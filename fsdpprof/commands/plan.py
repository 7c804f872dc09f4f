"""``fsdpprof plan``: per-rank model-state memory and traffic per strategy, before anything runs."""
from __future__ import annotations

import json

from fsdpprof import options
from fsdpprof.analyze.summary import theory
from fsdpprof.commands import add
from fsdpprof.errors import UserError


def add_arguments(p) -> None:
    p.add_argument("--params", required=True, type=options.PARAMS,
                   help=f"parameter count Psi, e.g. 7.5e9 or 7.5B ({options.PARAMS.describe()})")
    p.add_argument("--world", required=True, type=options.WORLD, help="number of ranks N")
    p.add_argument("--optimizer", default="adam", help="adam (default), adamw, sgd, sgd-momentum, adagrad, none")
    p.add_argument("--param-dtype", default="bf16", help="dtype parameters are stored and all-gathered in (bf16)")
    p.add_argument("--grad-dtype", default=None, help="dtype of gradients / reduce-scatter (default: param dtype)")
    p.add_argument("--state-dtype", default="fp32", help="dtype of optimizer states and master copy (fp32)")
    p.add_argument("--shard-group", default=None, type=options.WORLD,
                   help="HYBRID_SHARD shard-group size N_s (adds an HSDP row)")
    p.add_argument("--offload", default="none", choices=["none", "optimizer", "params"],
                   help="CPU offload: optimizer state, or params+grads+optimizer state (FSDP CPUOffload)")
    p.add_argument("--compression", default="1", type=options.COMPRESSION,
                   help="gradient compression ratio (divides gradient traffic)")
    p.add_argument("--gpu-mem", default=None, type=options.GPU_MEM,
                   help="memory per GPU, e.g. 40GB or 80GiB: says whether each fits")
    p.add_argument("--units", default="GB", choices=["GB", "GiB"], help="print GB (1e9 bytes, default) or GiB (2^30)")
    add(p, "--json")


def plan(args) -> dict:
    """All numbers the plan prints, as a dict (bytes)."""
    for name in ("optimizer", "param_dtype", "grad_dtype", "state_dtype"):
        value = getattr(args, name)
        if value is not None and not str(value).strip():
            raise UserError(f"--{name.replace('_', '-')} is empty: give e.g. "
                            f"{'adam' if name == 'optimizer' else 'bf16 or fp32'}")
    psi, world, shard_group, gpu = args.params, args.world, args.shard_group, args.gpu_mem
    if shard_group and (shard_group > world or world % shard_group):
        raise UserError(f"--shard-group {shard_group} must divide --world {world}")
    k = theory.bytes_per_param(args.param_dtype, args.grad_dtype, args.optimizer, state_dtype=args.state_dtype)

    def traffic(strategy: str):
        return theory.fsdp_traffic(psi, strategy, world, args.param_dtype, k.grad_dtype, shard_group, args.compression)

    ddp = traffic("DDP").total_bytes
    rows = []
    for ms in theory.all_model_states(psi, k, world, shard_group, args.offload):
        tr = traffic(ms.strategy)
        rows.append({"strategy": ms.strategy, "label": ms.label, "formula": ms.formula, "substituted": ms.substituted,
                     "param_bytes": ms.param_bytes, "grad_bytes": ms.grad_bytes,
                     "optimizer_state_bytes": ms.optimizer_state_bytes, "model_states_bytes": ms.total_bytes,
                     "device_bytes": ms.device_bytes, "host_bytes": ms.host_bytes,
                     "traffic_bytes": tr.total_bytes, "traffic_formula": tr.formula,
                     "traffic_vs_ddp": tr.total_bytes / ddp if ddp else None,
                     "fits": (ms.device_bytes <= gpu) if gpu else None})
    res = {"psi": psi, "world": world, "shard_group": shard_group, "k_param": k.k_param, "k_grad": k.k_grad,
           "k_opt": k.k_opt, "k_opt_detail": k.opt_detail, "param_dtype": k.param_dtype, "grad_dtype": k.grad_dtype,
           "optimizer": k.optimizer, "offload": args.offload, "compression_ratio": args.compression,
           "gpu_mem_bytes": gpu, "units": args.units, "rows": rows}
    try:    # (the limits on the options keep every number finite; this is the proof)
        json.dumps(res, allow_nan=False)
    except ValueError:
        raise UserError("the plan has a number that is not finite with these options; use smaller --params") from None
    return res


def render_text(res: dict) -> str:
    """The plan as text: a row per strategy in res["units"], then the formulas."""
    u, gpu = res["units"], res["gpu_mem_bytes"]
    unit = theory.GB if u == "GB" else theory.GIB
    lines = [
        f"Psi = {res['psi']:.6g} parameters on N = {res['world']} ranks; per parameter: "
        f"k_param {res['k_param']:g} ({res['param_dtype']}) + k_grad {res['k_grad']:g} ({res['grad_dtype']}) + "
        f"k_opt {res['k_opt']:g} ({res['k_opt_detail']}) = {res['k_param'] + res['k_grad'] + res['k_opt']:g} bytes",
        f"Memory per rank in {'GB = 1e9 bytes' if u == 'GB' else 'GiB = 2^30 bytes'} (model states only: "
        f"activations and temporary buffers come on top); traffic = bytes each rank sends per step (ring).",
        "",
    ]
    cols = [("params", "param_bytes"), ("grads", "grad_bytes"), ("optim", "optimizer_state_bytes"),
            ("total", "device_bytes"), ("on host", "host_bytes"), ("traffic", "traffic_bytes")]
    if res["offload"] == "none":
        cols.remove(("on host", "host_bytes"))
    table = [["strategy", *(f"{h} {u}" for h, _ in cols), "vs DDP"]]
    for r in res["rows"]:
        table.append([r["label"], *(f"{r[k] / unit:.6g}" for _, k in cols),
                      f"{r['traffic_vs_ddp']:.3g}x" if r["traffic_vs_ddp"] is not None else "-"])
    if gpu:
        table[0].append(f"fits {gpu / unit:g} {u}?")
        for t, r in zip(table[1:], res["rows"]):
            t.append("yes" if r["fits"] else "NO")
    widths = [max(len(t[i]) for t in table) for i in range(len(table[0]))]
    table.insert(1, ["-" * w for w in widths])
    lines += ["  ".join(c.ljust(w) if i == 0 else c.rjust(w) for i, (c, w) in enumerate(zip(t, widths)))
              for t in table]
    lines.append("")
    lines.append("Formulas (k_p, k_g, k_o = bytes per parameter; Psi = parameters; N = ranks):")
    lines.extend(f"  {r['label']}: {r['formula']}" for r in res["rows"])
    if any(r["traffic_vs_ddp"] is None for r in res["rows"]):
        lines.append("(vs DDP: -, DDP sends nothing on one rank)")
    if u == "GB":
        lines.append("(use --units GiB for binary units)")
    return "\n".join(lines)


def run(args) -> int:
    res = plan(args)
    print(json.dumps(res, indent=1, allow_nan=False) if args.json else render_text(res))
    return 0
