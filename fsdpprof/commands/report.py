"""``fsdpprof report RUN``: analyse a run directory (or traces / a snapshot) into report.html + summary.json."""
from __future__ import annotations

import importlib.util
import os
import sys
import webbrowser

from fsdpprof import runfmt
from fsdpprof.analyze.load.files import find_run
from fsdpprof.commands import ENGINE, add, checked_run, engine_of
from fsdpprof.errors import UserError
from fsdpprof.report.outputs import (check_not_empty, check_outputs, json_bytes, page_items, plotly_output,
                                     report_paths, summary_for, write_files)


def add_arguments(p) -> None:
    p.add_argument("run", metavar="RUN", help="run directory, folder of profiler traces, trace file, or CUDA snapshot")
    p.add_argument("-o", "--output", default=None,
                   help="report HTML path, or a folder to write it in (default: RUN/report.html for a folder; "
                        "X.report.html beside a file X.json.gz / X.pickle; the current folder when RUN's is "
                        "not writable)")
    p.add_argument("--summary", default=None,
                   help="JSON path (default: beside the HTML: report.html -> summary.json, X.html -> X.summary.json)")
    add(p, "--force")
    p.add_argument("--open", action="store_true", help="open the report in a browser")
    add(p, "--self-contained", *ENGINE)
    p.add_argument("--hta", action="store_true",
                   help="add HTA's own kernel, temporal and idle-time tables (GPU traces; pip install 'fsdpprof[hta]')")
    add(p, "--max-trace-bytes", "--max-memory")
    p.add_argument("--tables", default=None, metavar="DIR",
                   help="also write every table of summary.json into DIR, one CSV each (and Parquet with "
                        "pip install 'fsdpprof[parquet]'), listed in DIR/tables.json")
    add(p, "--device")


def write_report(analysis, out_html: str, out_summary: str | None = None,
                 self_contained: bool = False, tables: list | None = None) -> tuple[str, str]:
    """Write the report HTML, its summary JSON (and plotly.js, ``tables``' (path, bytes)), all or none; returns
    both paths.  Callers check the paths first (report.outputs.check_outputs)."""
    from fsdpprof.report.run_page import render_report
    from fsdpprof.report.summary import summary

    out_summary = out_summary or summary_for(out_html)
    page = page_items(out_html, lambda src: render_report(analysis, src), self_contained)
    write_files(page + [(out_summary, json_bytes(summary(analysis, plain=False)))] + list(tables or []))
    return out_html, out_summary


def table_outputs(analysis, directory: str, force: bool, inputs=(), input_folders=()) -> list:
    """--tables: the checked (path, bytes) of every summary table in ``directory`` (a file that its tables.json
    lists and that is still as fsdpprof wrote it is replaced; another only with ``force``; never an input, nor
    anything in a folder that ``fsdpprof record`` writes)."""
    from fsdpprof.report.summary import summary
    from fsdpprof.report.tables import listed_files, table_files

    directory = check_tables_dir(directory)
    items = table_files(summary(analysis), directory)
    ours = listed_files(directory)
    check_outputs([(p, "--tables") for p, _ in items if p not in ours], force=force, inputs=inputs,
                  input_folders=input_folders, fix=_TABLES_FIX)
    check_outputs([(p, "--tables") for p, _ in items if p in ours], force=True, inputs=inputs,
                  input_folders=input_folders, fix=_TABLES_FIX)
    return items


_TABLES_FIX = "choose another folder with --tables"


def check_tables_dir(directory: str) -> str:
    """--tables' folder, absolute; UserError for a file, or a folder that ``fsdpprof record`` writes."""
    if os.path.exists(directory) and not os.path.isdir(directory):
        raise UserError(f"--tables {directory} is not a folder; give a folder to write the tables in")
    directory = os.path.abspath(directory)
    recorder = runfmt.recorder_folder(directory)
    if recorder is not None:
        raise UserError(f"--tables {directory} is in {recorder}, a folder that fsdpprof record writes (the next "
                        f"record --force there refuses files it did not write); {_TABLES_FIX}")
    return directory


def analyse_path(path: str, workers: int | None = None, hta: bool = False, progress: bool | None = None,
                 max_trace_bytes: int | None = None, engine: str | None = None, scheduler: str | None = None,
                 ops: bool = False, device=None):
    """find_run + analyze_run of ``path`` (``ops``: with compare's operator table; ``device``: see --device)."""
    from fsdpprof.analyze.memory.attribution import choose_device
    from fsdpprof.analyze.pipeline import analyze_run

    run = choose_device(find_run(path, workers=workers, max_trace_bytes=max_trace_bytes), device)
    return analyze_run(run, hta=hta, workers=workers, progress=progress, engine=engine, scheduler=scheduler,
                       ops=ops)


def run(args) -> int:
    # (pandas and the analysis are imported once the input and the outputs are known good)
    engine = engine_of(args)
    if args.hta and importlib.util.find_spec("hta") is None:
        raise UserError("--hta needs Holistic Trace Analysis: pip install 'fsdpprof[hta]' (or traceinsight); "
                        "fsdpprof's own device breakdowns are in the report without it")
    check_not_empty(**{"RUN": args.run, "-o": args.output, "--summary": args.summary, "--tables": args.tables})
    if args.tables:
        check_tables_dir(args.tables)
    html_path, summary_path = report_paths(args.run, args.output, args.summary)
    outputs = [(html_path, "-o" if args.output else "the report"),
               (summary_path, "--summary" if args.summary else "the summary"),
               *plotly_output(html_path, args.self_contained)]
    run_ = checked_run(args, args.run, outputs, workers=args.workers, max_trace_bytes=args.max_trace_bytes,
                       max_memory=args.max_memory)
    from fsdpprof.analyze.pipeline import analyze_run
    from fsdpprof.report.text import summary_text

    a = analyze_run(run_, hta=args.hta, workers=args.workers, progress=sys.stderr.isatty(),
                    engine=engine, scheduler=args.scheduler, ops=False)   # (the operator table is compare's)
    inputs, folders = run_.inputs, run_.record_folders()
    del run_
    tables = table_outputs(a, args.tables, args.force, inputs, folders) if args.tables else []
    write_report(a, html_path, summary_path, self_contained=args.self_contained, tables=tables)
    print(summary_text(a))
    print(f"report: {html_path}\nsummary: {summary_path}")
    if tables:
        print(f"tables: {sum(p.endswith('.csv') for p, _ in tables)} in {os.path.abspath(args.tables)}")
    if args.open:
        webbrowser.open("file://" + os.path.abspath(html_path))
    return 0
