"""The report of one run (report.html): its sections in reading order on one page."""
from __future__ import annotations

from typing import TYPE_CHECKING

from fsdpprof.analyze.summary.headline import headline
from fsdpprof.report import communication, critical, device, findings, glance, memory, overview, per_unit, ranks, steps, whatif
from fsdpprof.report.page import Page, document

if TYPE_CHECKING:      # (the report's modules stay light: plan and --help import some)
    from fsdpprof.analyze.pipeline import Analysis


REPORT_NAV = [("headline", "At a glance"), ("critical_path", "What limits the step"), ("findings", "Findings"), ("overview", "Overview"), ("memory", "Memory"),
              ("units", "Per unit"), ("communication", "Communication"), ("steps", "Steps"), ("ranks", "Ranks"),
              ("whatif", "What if"), ("device", "Device time")]


def _whatif(a: Analysis, page: Page) -> str:
    """The "What if" section (fsdpprof.report.whatif) when there are predictions or a note on why not; inputs
    without an inventory (a trace folder of another tool) have neither: their model is unknown."""
    if not getattr(a, "whatif", None) and "whatif" not in (a.notes or {}):
        return ""
    return whatif.whatif_section(a, page)


def render_report(a: Analysis, plotly_src: str | None = None) -> str:
    """The HTML of one run's report: one function per section, in reading order; plotly.js embedded, or loaded
    from ``plotly_src`` beside the page (see :class:`fsdpprof.report.page.Page`)."""
    page = Page(plotly_src)
    o = a.overview
    sections = [overview.banner(a), glance.glance_section(a, headline(a)),
                critical.critical_section(a, page), findings.findings_section(a),
                overview.overview_section(a), memory.memory_section(a, page), per_unit.per_unit_section(a, page),
                communication.communication_section(a, page), steps.steps_section(a, page), _whatif(a, page),
                ranks.ranks_section(a, page), device.device_section(a, page)]
    body = "".join(sections)
    what = {"snapshot_file": "CUDA memory snapshot", "snapshot_folder": "CUDA memory snapshots",
            "trace_file": "profiler trace", "trace_folder": "profiler traces"}.get(a.source, "run")
    n = o.get("ranks_analysed") or 0
    of = f" of {o['world_size']}" if o.get("world_size") and o["world_size"] != n else ""
    title = f"fsdpprof report: {o.get('strategy') or what}, {n}{of} rank{'s' if n != 1 or of else ''} analysed"
    if memory.devices_analysed(a):     # one snapshot file names no rank: its devices
        title = f"fsdpprof report: {o.get('strategy') or what}, {memory.devices_analysed(a)} analysed"
    nav = [(i, t) for i, t in REPORT_NAV if f'id="{i}"' in body]
    return document(title, a.path, nav, body, overview.context_line(a))
