"""Open the HTML reports in a real headless Chromium: no console errors, every plot rendered,
a screenshot taken, and strings from a trace shown as text, never run."""
from __future__ import annotations

import json
import re
import shutil
import subprocess
from pathlib import Path

import pytest

from conftest import run_fsdpprof, shared_data

CHROMIUM = shutil.which("chromium") or shutil.which("chromium-browser")
pytestmark = pytest.mark.skipif(CHROMIUM is None, reason="chromium is not installed (apt-get install -y chromium)")
FLAGS = ["--headless", "--no-sandbox", "--disable-gpu", "--disable-background-networking", "--no-first-run",
         "--disable-component-update", "--disable-sync", "--disable-extensions", "--virtual-time-budget=10000"]

XSS_NAMES = ["<script>alert(1)</script>",
             "<img src=x onerror=\"document.body.setAttribute('data-pwned','img')\">",
             "</script><script>document.body.setAttribute('data-pwned','script')</script>"]


def open_page(html: Path, tmp: Path, screenshot: Path | None = None) -> tuple[str, list[str]]:
    """Load the page in headless Chromium; returns (DOM after load, console messages)."""
    url = html.resolve().as_uri()
    prof = tmp / f"profile-{html.stem}"
    dom = subprocess.run([CHROMIUM, *FLAGS, f"--user-data-dir={prof}", "--enable-logging=stderr", "--v=0",
                          "--dump-dom", url], capture_output=True, text=True, timeout=120)
    assert dom.returncode == 0, dom.stderr[-2000:]
    console = [ln for ln in dom.stderr.splitlines() if ":CONSOLE" in ln]
    if screenshot is not None:
        shot = subprocess.run([CHROMIUM, *FLAGS, f"--user-data-dir={prof}-shot", "--window-size=1400,2400",
                               f"--screenshot={screenshot}", url], capture_output=True, text=True, timeout=120)
        assert shot.returncode == 0 and screenshot.stat().st_size > 10_000, shot.stderr[-2000:]
    return dom.stdout, console


def assert_plots_rendered(dom: str, html_text: str) -> int:
    expected = len(re.findall(r'<div class="plot">', html_text))
    chunks = dom.split('id="plot-')[1:]
    assert len(chunks) == expected, (len(chunks), expected)
    for i, chunk in enumerate(chunks, 1):
        assert "main-svg" in chunk.split('id="plot-')[0], f"plot {i} did not render an SVG"
    return expected


def _make_xss_trace(folder: Path) -> None:
    ev = []
    for step in (1, 2, 3):
        t0 = step * 10000.0
        ev.append({"ph": "X", "cat": "user_annotation", "name": f"ProfilerStep#{step}", "pid": 1, "tid": 1,
                   "ts": t0, "dur": 9000.0})
        for i, n in enumerate(XSS_NAMES):
            ev.append({"ph": "X", "cat": "cpu_op", "name": n, "pid": 1, "tid": 1, "ts": t0 + 100 + i * 2000,
                       "dur": 1500.0 + i, "args": {}})
    doc = {"schemaVersion": 1, "distributedInfo": {"backend": "gloo", "rank": 0, "world_size": 1},
           "traceEvents": ev}
    folder.mkdir(parents=True, exist_ok=True)
    (folder / "rank-0.json").write_text(json.dumps(doc))


def test_xss_names_shown_as_text_and_never_run(tmp_path):
    _make_xss_trace(tmp_path / "xss")
    out = tmp_path / "xss.html"
    p = run_fsdpprof("report", str(tmp_path / "xss"), "-o", str(out), timeout=300)
    assert p.returncode == 0, p.stderr
    text = out.read_text()
    assert "<script>alert(1)" not in text and "<img src=x" not in text
    dom, console = open_page(out, tmp_path)
    assert "data-pwned" not in dom.split("<body", 1)[1].split(">", 1)[0], "a name from the trace ran as code"
    assert "&lt;script&gt;alert(1)&lt;/script&gt;" in dom  # shown as text in the table
    assert "&lt;img src=x onerror=" in dom
    assert console == [], console
    assert_plots_rendered(dom, text)


def test_gpu_trace_report_renders(tmp_path):
    folder = shared_data("gpu-traces", "param-dlrm-8rank-v100")
    out = tmp_path / "dlrm.html"
    p = run_fsdpprof("report", str(folder), "-o", str(out), timeout=300)
    assert p.returncode == 0, p.stderr
    shot = tmp_path / "dlrm.png"
    dom, console = open_page(out, tmp_path, shot)
    assert console == [], console
    n = assert_plots_rendered(dom, out.read_text())
    assert n >= 3  # lanes, steps, device temporal (at least)
    assert "Temporal breakdown of device time" in dom


def test_recorded_reports_and_compare_render(tmp_path, recorded_run):
    runs = [recorded_run("fsdp2"), recorded_run("ddp")]
    pages = []
    for r in runs:
        out = tmp_path / f"{r.parent.name}.html"
        p = run_fsdpprof("report", str(r), "-o", str(out), timeout=300)
        assert p.returncode == 0, p.stderr
        pages.append(out)
    cmp_out = tmp_path / "compare.html"
    p = run_fsdpprof("compare", *map(str, runs), "-o", str(cmp_out), timeout=300)
    assert p.returncode == 0, p.stderr
    pages.append(cmp_out)
    for page in pages:
        dom, console = open_page(page, tmp_path, tmp_path / f"{page.stem}.png")
        assert console == [], (page, console)
        assert assert_plots_rendered(dom, page.read_text()) >= 2, page


COMMITTED = sorted((Path(__file__).resolve().parents[1] / "reports").glob("*.html"))


@pytest.mark.parametrize("page", COMMITTED, ids=[p.name for p in COMMITTED])
def test_committed_demo_reports_render(page, tmp_path):
    """What a visitor opens without running anything: reports/*.html."""
    dom, console = open_page(page, tmp_path)
    assert console == [], console
    assert assert_plots_rendered(dom, page.read_text()) >= 2
