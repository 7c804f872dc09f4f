"""``fsdpprof whatif RUN``: predict peak memory and step time of the run under another strategy or world size."""
from __future__ import annotations

import os
import sys

from fsdpprof import options
from fsdpprof.analyze.model import fmt_bytes, rank_list
from fsdpprof.commands import ENGINE, add, checked_run, engine_of
from fsdpprof.errors import UserError, unexpected_as_user_error
from fsdpprof.report.outputs import check_not_empty, json_bytes, page_items, plotly_output, write_files

FIT_RANKS_SHOWN = 4     # ranks whose collective fits the terminal text lists (all of them in --json)
TARGET_OPTIONS = ("strategy", "shard_group", "world", "reshard_after_forward", "param_dtype", "reduce_dtype",
                  "fsdp_version", "ranks_per_host")


def add_arguments(p) -> None:
    p.add_argument("run", metavar="RUN", help="run directory recorded by `fsdpprof record` (trace, memory, inventory)")
    p.add_argument("--strategy", default=None,
                   help="target: DDP, NO_SHARD, SHARD_GRAD_OP, FULL_SHARD or HYBRID_SHARD (default: the run's)")
    p.add_argument("--shard-group", default=None, metavar="K", type=options.WORLD,
                   help="HYBRID_SHARD: ranks each parameter is sharded over")
    p.add_argument("--world", default=None, metavar="N", type=options.WORLD,
                   help="target world size (default: the run's)")
    p.add_argument("--reshard-after-forward", default=None, metavar="true|false|INT",
                   type=options.reshard_after_forward,
                   help="free unsharded parameters after forward (true), keep them (false), or reshard to INT ranks")
    p.add_argument("--param-dtype", default=None, help="mixed precision: dtype of unsharded parameters and compute")
    p.add_argument("--reduce-dtype", default=None, help="mixed precision: dtype of the gradient reduction")
    p.add_argument("--cpu-offload", action="store_true", help="FSDP CPU offload of the sharded states")
    p.add_argument("--batch-scale", default="1", metavar="X", type=options.BATCH_SCALE,
                   help="local batch x X: activations and compute time scale with it (default 1)")
    p.add_argument("--ranks-per-host", default=None, metavar="R", type=options.WORLD,
                   help="CPU runs: ranks of the target on one host, sharing its cores (default: the run's layout; "
                        "a run on one host puts all the target's ranks on it)")
    p.add_argument("--fsdp-version", default=None, choices=["1", "2"],
                   help="FSDP implementation of the target (default: the run's; FSDP2 for a DDP run)")
    p.add_argument("--only", action="store_true", help="predict only the target, not every standard strategy too")
    p.add_argument("-o", "--output", default=None, metavar="HTML",
                   help="also write an HTML page of the predictions (a folder: whatif.html in it)")
    add(p, "--json", "--force", *ENGINE, "--self-contained", "--device", json="print the predictions as JSON on stdout")


def _target_given(args) -> bool:
    return any(getattr(args, k) is not None for k in TARGET_OPTIONS) or args.cpu_offload or args.batch_scale != 1


def build(args, run) -> tuple[list, object, list[str], object]:
    """(targets, the run's own target, notes, the run's Source) from the options; UserError for an impossible
    target."""
    from fsdpprof.analyze.whatif import predict as wp
    from fsdpprof.analyze.whatif import targets as tg

    if not run.ranks:
        raise UserError(f"{args.run}: no rank recorded anything to predict from")
    source = wp.source_of_rank(wp.source_rank(run), *wp.hosts_of(run))
    out, notes = [], []
    if _target_given(args):
        out.append(tg.make_target(source, args.strategy, world_size=args.world, shard_group=args.shard_group,
                                  reshard_after_forward=args.reshard_after_forward, param_dtype=args.param_dtype,
                                  reduce_dtype=args.reduce_dtype, cpu_offload=True if args.cpu_offload else None,
                                  batch_scale=args.batch_scale, ranks_per_host=args.ranks_per_host,
                                  family=args.fsdp_version and f"fsdp{args.fsdp_version}"))
    elif args.only:
        raise UserError("--only needs a target: give --strategy (or --world, --shard-group, ...)")
    if not args.only:
        std, notes = tg.standard_targets(source, out[0] if out else None)
        out += [t for t in std if not any(tg.same_config(t, o) for o in out)]
    return out, tg.target_of_source(source), list(notes), source


def text(result: dict, run_label: str) -> str:
    """The predictions as a terminal table plus what the first one kept and assumed."""
    def ms(x) -> str:
        return "-" if x is None else f"{x / 1e3:.1f}"

    m = result["measured"]
    lines = [f"what if: {run_label} — measured peak {fmt_bytes(m.get('peak_allocated_bytes'))} (largest rank), "
             f"step {ms(m.get('step_us'))} ms (median)"]
    if result.get("missing"):
        lines.append(f"PARTIAL: predicted from {rank_list(result.get('ranks_predicted') or [])} only; missing "
                     + "; ".join(f"{k}: {v}" for k, v in sorted(result["missing"].items())))
    lines.append(f"{'':2}{'strategy':30s}{'world':>6s}{'peak MiB':>10s}{'step ms':>9s}{'compute':>9s}{'exposed':>9s}"
                 f"{'rest':>9s}")
    for i, p in enumerate(result["predictions"]):
        mark = "*" if i == 0 and result.get("target_first") else ("=" if p.get("is_run") else " ")
        peak = "-" if p["peak_allocated_bytes"] is None else f"{p['peak_allocated_bytes'] / 2**20:.1f}"
        lines.append(f"{mark:2}{p['label'][:29]:30s}{p['world_size']:>6d}{peak:>10s}{ms(p['step_us']):>9s}"
                     f"{ms(p['compute_us']):>9s}{ms(p['exposed_comm_us']):>9s}{ms(p['rest_us']):>9s}")
    lines.append("(* the target; = the run's own configuration, predicted from itself; times per step; "
                 "rest = step - compute - exposed: host time outside operators, idle, copies)")
    lines += [f"step-time interval, {p['label']}: {ms(p['step_low_us'])}-{ms(p['step_high_us'])} ms"
              for p in result["predictions"] if p.get("step_low_us") is not None]
    lines += [f"order: {x}" for x in result.get("order") or []]
    if result.get("recommendation"):
        lines.append(f"recommendation: {result['recommendation']}")
    first = result["predictions"][0] if result["predictions"] else None
    if first and first.get("cpu_contention") is not None and first.get("run_cpu_contention") is not None:
        lines.append(f"CPU contention (1 + run-queue wait / time on a CPU): the run "
                     f"x{first['run_cpu_contention']:.2f}, "
                     f"{first['label']} x{first['cpu_contention']:.2f}")
    if first:
        lines.append(f"{first['label']}: kept: " + "; ".join(first["kept"]))
        lines.append(f"{first['label']}: assumed: " + "; ".join(first["assumed"]))
    fits = [(r, f) for r, f in (result.get("fits") or {}).items() if f]
    lines += [f"fits, rank {r}: " + "; ".join(f) for r, f in fits[:FIT_RANKS_SHOWN]]
    if len(fits) > FIT_RANKS_SHOWN:
        lines.append(f"fits of {len(fits) - FIT_RANKS_SHOWN} more ranks: --json")
    lines += [f"note: {n}" for n in result.get("notes") or []]
    return "\n".join(lines)


def run(args) -> int:
    # (pandas and the analysis are imported once the run is found: see report.run)
    engine = engine_of(args)
    check_not_empty(**{"RUN": args.run, "-o": args.output})
    if args.self_contained and not args.output:
        raise UserError("--self-contained is for the HTML page of -o: add -o PAGE.html, or leave --self-contained out")
    if args.output and os.path.isdir(args.output):
        args.output = os.path.join(args.output, "whatif.html")
    outputs = [(args.output, "-o"), *plotly_output(args.output, args.self_contained)] if args.output else []
    # (each rank's inventory and trace are read where it is predicted)
    run_ = checked_run(args, args.run, outputs, fix="choose another path with -o")
    from fsdpprof.analyze.whatif import predict as wp
    from fsdpprof.analyze.whatif import targets as tg

    targets, run_target, notes, source = build(args, run_)
    with unexpected_as_user_error(f"what-if of {args.run}"):
        result = wp.predict_run(run_, targets, run_target, engine=engine, workers=args.workers,
                                scheduler=args.scheduler)
    result["notes"] = list(dict.fromkeys(notes + result["notes"]))
    result["target_first"] = _target_given(args)
    result["run"] = {"path": run_.path, "strategy": run_target.strategy, "world_size": run_target.world_size,
                     "family": run_target.family, "description": tg.describe_source(source)}
    if all(p["peak_allocated_bytes"] is None and p["step_us"] is None for p in result["predictions"]):
        raise UserError(f"{args.run}: nothing to predict from: "
                        + "; ".join(result["notes"] or ["no trace, no memory"]))
    if args.output:
        from fsdpprof.report.whatif import render_whatif

        write_files(page_items(args.output, lambda src: render_whatif(result, src), args.self_contained),
                    fix="choose a writable path with -o")
    if args.json:
        sys.stdout.write(json_bytes(result).decode("utf-8") + "\n")
    else:
        print(text(result, f"{run_.path} ({result['run']['description']})"))
        if args.output:
            print(f"page: {args.output}")
    return 0
