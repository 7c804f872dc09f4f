"""``fsdpprof compare RUN_A RUN_B ...``: several runs side by side in compare.html, and what changed in each
against the first (the baseline).  Inputs: run directories, trace folders of any source, or a mix."""
from __future__ import annotations

import os

from fsdpprof import options
from fsdpprof.analyze.compare.scope import SCOPE_FIRST, Scope, parse_iteration
from fsdpprof.analyze.load.engines import shared_scheduler
from fsdpprof.analyze.load.files import iteration_folders
from fsdpprof.analyze.model import rank_list
from fsdpprof.commands import ENGINE, add, checked_run, engine_of
from fsdpprof.errors import UserError
from fsdpprof.report.outputs import check_not_empty, compare_paths, json_bytes, page_items, plotly_output, write_files


def add_arguments(p) -> None:
    p.add_argument("runs", nargs="+", metavar="RUN",
                   help="two or more run directories or trace folders (HTA, torchtitan profile_trace/ or one of "
                        "its iteration_<s> folders); the first is the baseline")
    p.add_argument("-o", "--output", default="compare.html",
                   help="compare HTML path, or a folder to write compare.html in (default ./compare.html)")
    p.add_argument("--summary", default=None, help="JSON of the comparison (default: X.json beside X.html)")
    p.add_argument("--iteration", default="median", metavar="first|N|all",
                   help="steps compared: 'first' = the first rank's first ProfilerStep, CPU operators and GPU "
                        "kernels together (HTA's compare_traces default); N = ProfilerStep#N; 'all' = every "
                        "recorded step summed; default: per-step medians over the recorded steps")
    p.add_argument("--rank", type=options.RANK, default=None, metavar="R",
                   help="compare rank R of every input (default: all ranks, medians across ranks)")
    add(p, "--force", "--self-contained", *ENGINE, "--device",
        force="compare runs of different models anyway (with a warning), and overwrite output files that fsdpprof "
              "did not write (never one of the inputs)")


def write_compare(comparison, out_html: str, out_json: str | None = None,
                  self_contained: bool = False) -> tuple[str, str]:
    """Write compare HTML and JSON (and plotly.js), all or none; callers check the paths first."""
    from fsdpprof.report.compare_page import render_compare
    from fsdpprof.report.summary import compare_summary

    out_html, out_json = compare_paths(out_html, out_json)
    page = page_items(out_html, lambda src: render_compare(comparison, src), self_contained)
    write_files(page + [(out_json, json_bytes(compare_summary(comparison)))])
    return out_html, out_json


def profiling_window(path: str, iteration) -> tuple[str, str | None]:
    """A torchtitan-style folder (``iteration_<s>/`` per window) -> the window compared (first: the earliest;
    step N: the first dumped after step N; else the latest) and a note naming it; any other path as it is."""
    windows = iteration_folders(path) if os.path.isdir(path) else None
    if not windows:
        return path, None
    if iteration == SCOPE_FIRST:
        s = min(windows)
    else:
        s = min((w for w in windows if isinstance(iteration, int) and w > iteration), default=max(windows))
    names = ", ".join(f"iteration_{w}" for w in sorted(windows))
    return windows[s], f"{path}: profiling windows {names}; compared {windows[s]}"


def run(args) -> int:
    # (pandas and the analysis are imported once the runs are found: see report.run)
    if len(args.runs) < 2:
        raise UserError("compare needs at least two runs, e.g. `fsdpprof compare RUN_A RUN_B`")
    scope = Scope(parse_iteration(args.iteration), args.rank)
    engine = engine_of(args)
    check_not_empty(**{"-o": args.output, "--summary": args.summary},
                    **{f"RUN {i + 1}": p for i, p in enumerate(args.runs)})
    html_path, json_path = compare_paths(args.output, args.summary)
    outputs = [(html_path, "-o"), (json_path, "--summary" if args.summary else "the comparison's JSON"),
               *plotly_output(html_path, args.self_contained)]
    runs, window_notes = [], []
    for path in args.runs:
        path, note = profiling_window(path, scope.iteration)
        window_notes += [note] if note else []
        run_ = checked_run(args, path, outputs, defer_under=args.runs, workers=args.workers)
        keep = scope.rank
        if keep is not None and keep not in run_.ranks:
            raise UserError(f"rank {keep} is not in {run_.path} ({rank_list(run_.ranks)}); pass --rank with "
                            f"one of those, or leave --rank out to compare all ranks")
        if keep is None and scope.iteration == SCOPE_FIRST:   # HTA's default scope: the first rank only
            keep = min((r for r, rd in run_.ranks.items() if rd.trace_path), default=None)
        if keep is not None:
            run_.ranks = {keep: run_.ranks[keep]}
        runs.append(run_)
    from fsdpprof.analyze.compare.runs import compare_analyses
    from fsdpprof.analyze.pipeline import analyze_run
    from fsdpprof.report.diff import diff_text
    from fsdpprof.report.text import compare_text

    analyses = []
    # one Dask cluster for every run (a LocalCluster when no --scheduler)
    with shared_scheduler(engine, args.scheduler, args.workers, max(len(r.ranks) for r in runs)) as scheduler:
        while runs:   # (each run's files are let go once analysed)
            analyses.append(analyze_run(runs.pop(0), workers=args.workers, engine=engine, scheduler=scheduler))
    c = compare_analyses(analyses, allow_different_models=args.force, scope=scope)
    c.notes[:0] = window_notes
    write_compare(c, html_path, json_path, self_contained=args.self_contained)
    print(compare_text(c))
    print(diff_text(c))
    print(f"comparison: {html_path}\njson: {json_path}")
    return 0
