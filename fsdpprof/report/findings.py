"""The "Findings" section: what crossed a threshold of fsdpprof.analyze.summary.findings, with what to try."""
from __future__ import annotations

from typing import TYPE_CHECKING

from fsdpprof.report.page import esc, finding_title, fmt_bytes, fmt_num, fmt_pct

if TYPE_CHECKING:      # (the report's modules stay light: plan and --help import some)
    from fsdpprof.analyze.pipeline import Analysis


def findings_section(a: Analysis) -> str:
    if not a.findings:
        body = '<p class="note">Nothing stands out against the thresholds in fsdpprof/analyze/summary/findings.py.</p>'
    else:
        def val(x, unit):
            if unit == "bytes":
                return fmt_bytes(x)
            return fmt_pct(x) if unit == "%" else f"{fmt_num(x)}{' ' + unit if unit else ''}"
        body = "".join(
            f'<div class="finding {esc(f.severity)}"><b>{esc(finding_title(f.title))}</b><br>Try: {esc(f.suggestion)}<br>'
            f'<span class="note">{esc(val(f.value, f.unit))} against a threshold of {esc(val(f.threshold, f.unit))} '
            f'(<code>{esc(f.metric)}</code> in summary.json), see <a href="#{esc(f.section)}">'
            f"{esc(f.section)}</a></span></div>" for f in a.findings)
    return f'<section id="findings"><h2>Findings</h2>{body}</section>'
