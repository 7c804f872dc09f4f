"""``fsdpprof compare RUN_A RUN_B ...``: several runs side by side in compare.html."""
from __future__ import annotations

from fsdpprof.errors import UserError


def add_arguments(p) -> None:
    p.add_argument("runs", nargs="+", metavar="RUN", help="two or more run directories (or trace folders)")
    p.add_argument("-o", "--output", default="compare.html",
                   help="compare HTML path, or a folder to write compare.html in (default ./compare.html)")
    p.add_argument("--summary", default=None, help="JSON of the comparison (default: X.json beside X.html)")
    p.add_argument("--force", action="store_true",
                   help="compare runs of different models anyway (with a warning), and overwrite output files "
                        "that fsdpprof did not write (never one of the inputs)")
    p.add_argument("--workers", type=int, default=None,
                   help="processes for loading ranks (at most one per rank and per CPU core)")
    from fsdpprof.commands.report import add_engine_arguments

    add_engine_arguments(p)


def write_compare(comparison, out_html: str, out_json: str | None = None) -> tuple[str, str]:
    """Write compare HTML and JSON, both or neither (callers check the paths first: outputs.check_outputs)."""
    from fsdpprof.report.html import render_compare
    from fsdpprof.report.outputs import compare_paths, json_bytes, write_files
    from fsdpprof.report.summary import compare_summary

    out_html, out_json = compare_paths(out_html, out_json)
    write_files([(out_html, render_compare(comparison).encode("utf-8")), (out_json, json_bytes(compare_summary(comparison)))])
    return out_html, out_json


def run(args) -> int:
    from fsdpprof.analyze.compare import compare_analyses
    from fsdpprof.analyze.engines import check_engine, shared_scheduler
    from fsdpprof.analyze.pipeline import analyze_run
    from fsdpprof.analyze.run import load_run
    from fsdpprof.commands.report import check_workers_option
    from fsdpprof.report.outputs import check_not_empty, check_outputs, compare_paths
    from fsdpprof.report.text import compare_text

    if len(args.runs) < 2:
        raise UserError("compare needs at least two runs, e.g. `fsdpprof compare RUN_A RUN_B`")
    check_workers_option(args.workers)
    engine = check_engine(args.engine, args.scheduler)
    check_not_empty(**{"-o": args.output, "--summary": args.summary}, **{f"RUN {i + 1}": p for i, p in enumerate(args.runs)})
    html_path, json_path = compare_paths(args.output, args.summary)
    outputs = [(html_path, "-o"), (json_path, "--summary" if args.summary else "the comparison's JSON")]
    check_outputs(outputs, force=args.force, defer_under=args.runs)
    analyses = []
    runs = []
    for path in args.runs:
        run_ = load_run(path, workers=args.workers, lazy=True)
        check_outputs(outputs, force=args.force, inputs=run_.inputs, input_folders=run_.record_folders())
        runs.append(run_)
    # one Dask cluster for every run (a LocalCluster when no --scheduler)
    with shared_scheduler(engine, args.scheduler, args.workers, max(len(r.ranks) for r in runs)) as scheduler:
        while runs:
            run_ = runs.pop(0)
            analyses.append(analyze_run(run_, workers=args.workers, engine=engine, scheduler=scheduler))
            del run_
    c = compare_analyses(analyses, allow_different_models=args.force)
    write_compare(c, html_path, json_path)
    print(compare_text(c))
    print(f"comparison: {html_path}\njson: {json_path}")
    return 0
