"""``fsdpprof report RUN``: analyse a run directory (or traces / a snapshot) into report.html + summary.json."""
from __future__ import annotations

import os
import sys
import webbrowser

from fsdpprof import options
from fsdpprof.errors import UserError


def add_arguments(p) -> None:
    p.add_argument("run", metavar="RUN", help="run directory, folder of profiler traces, trace file, or CUDA snapshot")
    p.add_argument("-o", "--output", default=None,
                   help="report HTML path, or a folder to write it in (default: RUN/report.html for a folder; "
                        "X.report.html beside a file X.json.gz / X.pickle; the current folder when RUN's is "
                        "not writable)")
    p.add_argument("--summary", default=None,
                   help="JSON path (default: beside the HTML: report.html -> summary.json, X.html -> X.summary.json)")
    p.add_argument("--force", action="store_true",
                   help="overwrite output files that fsdpprof did not write (never one of the inputs)")
    p.add_argument("--open", action="store_true", help="open the report in a browser")
    add_self_contained(p)
    add_engine_arguments(p)
    p.add_argument("--hta", action="store_true",
                   help="add HTA's own kernel, temporal and idle-time tables (GPU traces; pip install 'fsdpprof[hta]')")
    add_max_trace_bytes(p)  # the default since 0.2; kept for scripts
    p.add_argument("--tables", default=None, metavar="DIR",
                   help="also write every table of summary.json into DIR, one CSV each (and Parquet with "
                        "pip install 'fsdpprof[parquet]'), listed in DIR/tables.json")
    add_device_argument(p)


def add_device_argument(p) -> None:
    p.add_argument("--device", type=options.device_choice, default=None, metavar="N|all",
                   help="the CUDA device of a snapshot to analyse: N for cuda:N, 'all' for every device of one snapshot "
                        "file, each on its own (default: the rank's device, else the device with the largest peak; "
                        "the report names it)")


def add_self_contained(p) -> None:
    """--self-contained: plotly.js embedded in each HTML page instead of one file beside the pages."""
    p.add_argument("--self-contained", action="store_true",
                   help="embed plotly.js (4.8 MB) in the HTML page; by default the page loads it from "
                        "plotly-<version>.min.js, written once beside the pages of its folder (keep the two "
                        "together); either way the page works offline")


def add_max_trace_bytes(p) -> None:
    p.add_argument("--max-trace-bytes", type=options.TRACE_BYTES, default=None, metavar="BYTES",
                   help="largest trace accepted, in bytes of JSON once decompressed, e.g. 16GiB (default 8 GiB)")


def add_engine_arguments(p) -> None:
    """--workers / --engine / --scheduler / --connect-timeout: where the per-rank work runs
    (fsdpprof.analyze.load.engines); report, compare, overlap and whatif take them alike."""
    p.add_argument("--workers", type=options.WORKERS, default=None,
                   help="processes for loading ranks (at most one per rank and per CPU core)")
    p.add_argument("--engine", choices=("local", "dask"), default=None,
                   help="where each rank is analysed: local (default; this machine, a pool of --workers processes "
                        "for big traces) or dask (a Dask cluster: --scheduler, else a LocalCluster of --workers "
                        "processes here; pip install 'fsdpprof[dask]')")
    p.add_argument("--scheduler", default=None, metavar="ADDRESS",
                   help="address of a running dask.distributed scheduler (tcp://HOST:8786; implies --engine dask): "
                        "its workers read each rank's files at the same path (shared storage), only small results "
                        "come back")
    p.add_argument("--connect-timeout", type=options.CONNECT_TIMEOUT_S, default=options.DEFAULT_CONNECT_TIMEOUT_S,
                   metavar="SECONDS",
                   help=f"--scheduler: seconds to wait for the scheduler to connect and answer (default "
                        f"{options.DEFAULT_CONNECT_TIMEOUT_S:g}; {options.CONNECT_TIMEOUT_S.describe()})")


def write_report(analysis, out_html: str, out_summary: str | None = None,
                 self_contained: bool = False, tables: list | None = None) -> tuple[str, str]:
    """Render and write the report HTML and its summary JSON, both or neither (with the plotly.js file beside
    the page, unless ``self_contained`` or already there: outputs.page_items; and ``tables``: the (path, bytes)
    of --tables, :func:`table_outputs`); returns both paths.

    No check of what is at those paths: callers run :func:`fsdpprof.report.outputs.check_outputs` first.
    """
    from fsdpprof.report.run_page import render_report
    from fsdpprof.report.outputs import json_bytes, page_items, summary_for, write_files
    from fsdpprof.report.summary import summary

    out_summary = out_summary or summary_for(out_html)
    page = page_items(out_html, lambda src: render_report(analysis, src), self_contained)
    write_files(page + [(out_summary, json_bytes(summary(analysis, plain=False)))] + list(tables or []))
    return out_html, out_summary


def table_outputs(analysis, directory: str, force: bool, inputs=()) -> list:
    """--tables: the (path, bytes) of every table of the analysis' summary in ``directory``, checked (a file
    there is replaced when fsdpprof's tables.json lists it, else only with ``force``; never an input)."""
    from fsdpprof.report.outputs import check_outputs
    from fsdpprof.report.summary import summary
    from fsdpprof.report.tables import listed_files, table_files

    if os.path.exists(directory) and not os.path.isdir(directory):
        raise UserError(f"--tables {directory} is not a folder; give a folder to write the tables in")
    directory = os.path.abspath(directory)
    items = table_files(summary(analysis), directory)
    ours = listed_files(directory)
    fix = "choose another folder with --tables"
    check_outputs([(p, "--tables") for p, _ in items if p not in ours], force=force, inputs=inputs, fix=fix)
    check_outputs([(p, "--tables") for p, _ in items if p in ours], force=True, inputs=inputs, fix=fix)
    return items


def analyse_path(path: str, workers: int | None = None, hta: bool = False, progress: bool | None = None,
                 max_trace_bytes: int | None = None, engine: str | None = None, scheduler: str | None = None,
                 ops: bool = False, device=None):
    """find_run (lazily: each rank's trace is parsed where it is analysed) + analyze_run (``ops``: with the
    operator table that compare diffs; ``device``: a snapshot's CUDA device, see --device)."""
    from fsdpprof.analyze.memory.attribution import choose_device
    from fsdpprof.analyze.pipeline import analyze_run
    from fsdpprof.analyze.load.files import find_run

    run = choose_device(find_run(path, workers=workers, max_trace_bytes=max_trace_bytes), device)
    return analyze_run(run, hta=hta, workers=workers, progress=progress, engine=engine, scheduler=scheduler,
                       ops=ops)


def check_hta_installed() -> None:
    """UserError unless HTA (holistictraceanalysis / traceinsight, both import as ``hta``) is installed."""
    import importlib.util

    if importlib.util.find_spec("hta") is None:
        raise UserError("--hta needs Holistic Trace Analysis: pip install 'fsdpprof[hta]' (or traceinsight); "
                        "fsdpprof's own device breakdowns are in the report without it")


def check_workers_option(workers) -> None:
    from fsdpprof.analyze.load.engines import check_workers

    check_workers(workers, "--workers")


def run(args) -> int:
    # (pandas and the analysis are imported once the input and the outputs are known good: a bad argument
    # is refused in a tenth of a second, not after half a second of imports)
    from fsdpprof.analyze.load.engines import check_engine
    from fsdpprof.analyze.load.files import find_run
    from fsdpprof.report.outputs import check_not_empty, check_outputs, plotly_output, report_paths

    check_workers_option(args.workers)
    engine = check_engine(args.engine, args.scheduler, args.connect_timeout)
    if args.hta:
        check_hta_installed()
    check_not_empty(**{"RUN": args.run, "-o": args.output, "--summary": args.summary, "--tables": args.tables})
    html_path, summary_path = report_paths(args.run, args.output, args.summary)
    outputs = [(html_path, "-o" if args.output else "the report"), (summary_path, "--summary" if args.summary else
                                                                      "the summary")]
    outputs += plotly_output(html_path, args.self_contained)
    check_outputs(outputs, force=args.force, defer_under=[args.run])  # before the long part; again with the inputs
    run_ = find_run(args.run, workers=args.workers, max_trace_bytes=args.max_trace_bytes)
    check_outputs(outputs, force=args.force, inputs=run_.inputs, input_folders=run_.record_folders())
    from fsdpprof.analyze.memory.attribution import choose_device
    from fsdpprof.analyze.pipeline import analyze_run

    run_ = choose_device(run_, args.device)
    from fsdpprof.report.text import summary_text

    a = analyze_run(run_, hta=args.hta, workers=args.workers, progress=sys.stderr.isatty(),
                    engine=engine, scheduler=args.scheduler, ops=False)   # (the operator table is compare's)
    inputs = run_.inputs
    del run_
    tables = table_outputs(a, args.tables, args.force, inputs) if args.tables else []
    write_report(a, html_path, summary_path, self_contained=args.self_contained, tables=tables)
    print(summary_text(a))
    print(f"report: {html_path}\nsummary: {summary_path}")
    if tables:
        print(f"tables: {sum(p.endswith('.csv') for p, _ in tables)} in {os.path.abspath(args.tables)}")
    if args.open:
        webbrowser.open("file://" + os.path.abspath(html_path))
    return 0
