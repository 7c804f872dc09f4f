"""``fsdpprof report RUN``: analyse a run directory (or traces / a snapshot) into report.html + summary.json."""
from __future__ import annotations

import json
import os
import webbrowser

from fsdpprof.errors import UserError


def add_arguments(p) -> None:
    p.add_argument("run", metavar="RUN", help="run directory, folder of profiler traces, trace file, or CUDA snapshot")
    p.add_argument("-o", "--output", default=None,
                   help="report.html path (default: RUN/report.html, or ./report.html when RUN is not a writable folder)")
    p.add_argument("--summary", default=None, help="summary.json path (default: beside the report)")
    p.add_argument("--open", action="store_true", help="open the report in a browser")
    p.add_argument("--workers", type=int, default=None, help="processes for loading ranks")
    p.add_argument("--no-hta", action="store_true", help="skip HTA's breakdowns on GPU traces")
    p.add_argument("--max-trace-bytes", type=int, default=None, metavar="BYTES",
                   help="largest trace accepted, in bytes of JSON once decompressed (default 8 GiB)")


def default_output(run_path: str) -> str:
    if os.path.isdir(run_path) and os.access(run_path, os.W_OK):
        return os.path.join(run_path, "report.html")
    return os.path.abspath("report.html")


def write_report(analysis, out_html: str, out_summary: str | None = None) -> tuple[str, str]:
    """Render and write report.html and summary.json atomically; returns both paths."""
    from fsdpprof.report.html import render_report

    out_summary = out_summary or os.path.join(os.path.dirname(os.path.abspath(out_html)), "summary.json")
    write_pair(out_html, render_report(analysis).encode("utf-8"),
               out_summary, json.dumps(analysis.to_summary(), indent=1, allow_nan=False).encode(), "the report")
    return out_html, out_summary


def write_pair(out_html: str, html_bytes: bytes, out_json: str, json_bytes: bytes, what: str) -> None:
    """Write an HTML page and its JSON atomically, readable by everyone; a failure is one line."""
    from fsdpprof.runfmt import atomic_write_bytes

    try:
        atomic_write_bytes(out_html, html_bytes)
        atomic_write_bytes(out_json, json_bytes)
        for path in (out_html, out_json):
            os.chmod(path, 0o644)
    except OSError as exc:
        raise UserError(f"cannot write {what} to {out_html}: {exc.strerror}; pass -o to a writable path") from None


def analyse_path(path: str, workers: int | None = None, hta: bool = True, max_trace_bytes: int | None = None):
    from fsdpprof.analyze.analysis import analyze_run
    from fsdpprof.analyze.run import load_run

    if not os.path.exists(path):
        raise UserError(f"{path} does not exist: give a run directory (fsdpprof record --out DIR), "
                        "a folder of profiler traces or a CUDA snapshot")
    return analyze_run(load_run(path, workers=workers, max_trace_bytes=max_trace_bytes), hta=hta)


def run(args) -> int:
    from fsdpprof.report.text import summary_text

    a = analyse_path(args.run, args.workers, hta=not args.no_hta, max_trace_bytes=args.max_trace_bytes)
    out = args.output or default_output(args.run)
    html_path, summary_path = write_report(a, out, args.summary)
    print(summary_text(a))
    print(f"report: {html_path}\nsummary: {summary_path}")
    if args.open:
        webbrowser.open("file://" + os.path.abspath(html_path))
    return 0
