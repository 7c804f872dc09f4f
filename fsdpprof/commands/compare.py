"""``fsdpprof compare RUN_A RUN_B ...``: several runs side by side in compare.html, and what changed in
each against the first (the baseline): communication per collective, stage, FSDP phase and unit, the
step's decomposition, operators and kernels, memory at the peak.  Inputs: run directories, trace folders
of any source (HTA folders, torchtitan's ``iteration_<s>/rank<r>_trace.json``), or a mix."""
from __future__ import annotations

from fsdpprof import options
from fsdpprof.errors import UserError


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
    p.add_argument("--force", action="store_true",
                   help="compare runs of different models anyway (with a warning), and overwrite output files "
                        "that fsdpprof did not write (never one of the inputs)")
    from fsdpprof.commands.report import add_device_argument, add_engine_arguments, add_self_contained

    add_self_contained(p)
    add_engine_arguments(p)
    add_device_argument(p)


def write_compare(comparison, out_html: str, out_json: str | None = None,
                  self_contained: bool = False) -> tuple[str, str]:
    """Write compare HTML and JSON, both or neither (with the plotly.js file beside the page, unless
    ``self_contained`` or already there); callers check the paths first: outputs.check_outputs."""
    from fsdpprof.report.compare_page import render_compare
    from fsdpprof.report.outputs import compare_paths, json_bytes, page_items, write_files
    from fsdpprof.report.summary import compare_summary

    out_html, out_json = compare_paths(out_html, out_json)
    page = page_items(out_html, lambda src: render_compare(comparison, src), self_contained)
    write_files(page + [(out_json, json_bytes(compare_summary(comparison)))])
    return out_html, out_json


def profiling_window(path: str, iteration) -> tuple[str, str | None]:
    """A torchtitan-style folder (``iteration_<s>/`` per profiling window) -> the window the scope asks for
    (first: the earliest; step N: the first window dumped after step N, iteration_<s> with s > N; otherwise the
    latest) and a note naming it; any other path is returned as it is."""
    import os

    from fsdpprof.analyze.load.files import iteration_folders
    from fsdpprof.analyze.compare.scope import SCOPE_FIRST

    if not os.path.isdir(path):
        return path, None
    windows = iteration_folders(path)
    if not windows:
        return path, None
    if iteration == SCOPE_FIRST:
        s = min(windows)
    elif isinstance(iteration, int):
        after = [w for w in windows if w > iteration]
        s = min(after) if after else max(windows)
    else:
        s = max(windows)
    names = ", ".join(f"iteration_{w}" for w in sorted(windows))
    return windows[s], f"{path}: profiling windows {names}; compared {windows[s]}"


def run(args) -> int:
    # (pandas and the analysis are imported once the runs are found: see report.run)
    from fsdpprof.analyze.load.engines import check_engine, shared_scheduler
    from fsdpprof.analyze.load.files import find_run
    from fsdpprof.analyze.compare.scope import SCOPE_FIRST, Scope, parse_iteration
    from fsdpprof.commands.report import check_workers_option
    from fsdpprof.report.outputs import check_not_empty, check_outputs, compare_paths, plotly_output

    if len(args.runs) < 2:
        raise UserError("compare needs at least two runs, e.g. `fsdpprof compare RUN_A RUN_B`")
    check_workers_option(args.workers)
    scope = Scope(parse_iteration(args.iteration), args.rank)
    engine = check_engine(args.engine, args.scheduler, args.connect_timeout)
    check_not_empty(**{"-o": args.output, "--summary": args.summary}, **{f"RUN {i + 1}": p for i, p in enumerate(args.runs)})
    html_path, json_path = compare_paths(args.output, args.summary)
    outputs = [(html_path, "-o"), (json_path, "--summary" if args.summary else "the comparison's JSON"),
               *plotly_output(html_path, args.self_contained)]
    check_outputs(outputs, force=args.force, defer_under=args.runs)
    analyses, runs, window_notes = [], [], []
    for path in args.runs:
        path, note = profiling_window(path, scope.iteration)
        if note:
            window_notes.append(note)
        run_ = find_run(path, workers=args.workers)
        check_outputs(outputs, force=args.force, inputs=run_.inputs, input_folders=run_.record_folders())
        if args.device is not None:
            from fsdpprof.analyze.memory.attribution import choose_device

            run_ = choose_device(run_, args.device)
        keep = None
        if scope.rank is not None:
            if scope.rank not in run_.ranks:
                from fsdpprof.analyze.model import rank_list
                raise UserError(f"rank {scope.rank} is not in {run_.path} ({rank_list(run_.ranks)}); pass --rank with "
                                f"one of those, or leave --rank out to compare all ranks")
            keep = scope.rank
        elif scope.iteration == SCOPE_FIRST:   # HTA's default scope: the first rank only
            keep = min((r for r, rd in run_.ranks.items() if rd.trace_path), default=None)
        if keep is not None:
            run_.ranks = {keep: run_.ranks[keep]}
        runs.append(run_)
    from fsdpprof.analyze.compare.runs import compare_analyses
    from fsdpprof.analyze.pipeline import analyze_run
    from fsdpprof.report.diff import diff_text
    from fsdpprof.report.text import compare_text

    # one Dask cluster for every run (a LocalCluster when no --scheduler)
    with shared_scheduler(engine, args.scheduler, args.workers, max(len(r.ranks) for r in runs)) as scheduler:
        while runs:
            run_ = runs.pop(0)
            analyses.append(analyze_run(run_, workers=args.workers, engine=engine, scheduler=scheduler))
            del run_
    c = compare_analyses(analyses, allow_different_models=args.force, scope=scope)
    c.notes[:0] = window_notes
    write_compare(c, html_path, json_path, self_contained=args.self_contained)
    print(compare_text(c))
    print(diff_text(c))
    print(f"comparison: {html_path}\njson: {json_path}")
    return 0
