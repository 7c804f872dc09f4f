"""``fsdpprof compare RUN_A RUN_B ...``: several runs side by side in compare.html."""
from __future__ import annotations

import json
import os

from fsdpprof.errors import UserError


def add_arguments(p) -> None:
    p.add_argument("runs", nargs="+", metavar="RUN", help="two or more run directories (or trace folders)")
    p.add_argument("-o", "--output", default="compare.html", help="compare.html path (default ./compare.html)")
    p.add_argument("--summary", default=None, help="JSON of the comparison (default: compare.json beside the html)")
    p.add_argument("--force", action="store_true", help="compare runs of different models anyway (with a warning)")
    p.add_argument("--workers", type=int, default=None)


def write_compare(comparison, out_html: str, out_json: str | None = None) -> tuple[str, str]:
    from fsdpprof.report.html import render_compare
    from fsdpprof.commands.report import write_pair

    out_json = out_json or os.path.splitext(os.path.abspath(out_html))[0] + ".json"
    write_pair(out_html, render_compare(comparison).encode("utf-8"),
               out_json, json.dumps(comparison.to_summary(), indent=1, default=str).encode(), "the comparison")
    return out_html, out_json


def run(args) -> int:
    from fsdpprof.analyze.pipeline import compare_analyses
    from fsdpprof.commands.report import analyse_path
    from fsdpprof.report.text import compare_text

    if len(args.runs) < 2:
        raise UserError("compare needs at least two runs, e.g. `fsdpprof compare RUN_A RUN_B`")
    analyses = [analyse_path(p, args.workers, hta=False) for p in args.runs]
    c = compare_analyses(analyses, allow_different_models=args.force)
    html_path, json_path = write_compare(c, args.output, args.summary)
    print(compare_text(c))
    print(f"comparison: {html_path}\njson: {json_path}")
    return 0
