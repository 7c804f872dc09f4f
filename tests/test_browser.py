"""Open the HTML reports in a real headless Chromium: no console errors, every plot rendered,
a screenshot taken, and strings from a trace shown as text, never run."""
from __future__ import annotations

import html
import json
import re
import shutil
import subprocess
from pathlib import Path

import pytest

from conftest import run_fsdpprof, shared_data
from fsdpprof.report.page import fmt_bytes
from fsdpprof.report.plotly_bundle import plotly_js_name

CHROMIUM = shutil.which("chromium") or shutil.which("chromium-browser")
pytestmark = pytest.mark.skipif(CHROMIUM is None, reason="chromium is not installed (apt-get install -y chromium)")
FLAGS = ["--headless", "--no-sandbox", "--disable-gpu", "--disable-background-networking", "--no-first-run",
         "--disable-component-update", "--disable-sync", "--disable-extensions", "--virtual-time-budget=10000"]

XSS_NAMES = ["<script>alert(1)</script>",
             "<img src=x onerror=\"document.body.setAttribute('data-pwned','img')\">",
             "</script><script>document.body.setAttribute('data-pwned','script')</script>"]


def open_page(html: Path, tmp: Path, screenshot: Path | None = None) -> tuple[str, list[str]]:
    """Load the page in headless Chromium; returns (DOM after load, console messages).  With ``screenshot``,
    the same load also paints the page into that PNG (one browser start: a report page costs ~5 s of CPU)."""
    url = html.resolve().as_uri()
    prof = tmp / f"profile-{html.stem}"
    shot = [] if screenshot is None else ["--window-size=1400,2400", f"--screenshot={screenshot}"]
    dom = subprocess.run([CHROMIUM, *FLAGS, f"--user-data-dir={prof}", "--enable-logging=stderr", "--v=0", *shot,
                          "--dump-dom", url], capture_output=True, text=True, timeout=120)
    assert dom.returncode == 0, dom.stderr[-2000:]
    console = [ln for ln in dom.stderr.splitlines() if ":CONSOLE" in ln]
    if screenshot is not None:
        assert screenshot.stat().st_size > 10_000, dom.stderr[-2000:]
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


def visible_headers(html_text: str) -> list[str]:
    """The text of every table header (<th>) of a page (not the scripts')."""
    body = re.sub(r"<script.*?</script>", "", html_text, flags=re.S)
    return [re.sub(r"<[^>]+>", "", h) for h in re.findall(r"<th\b[^>]*>(.*?)</th>", body, flags=re.S)]


def assert_reads_like_a_report(html_text: str) -> None:
    """Headers in words with units (no snake_case column names), no bare 'us' unit."""
    heads = [h for h in visible_headers(html_text) if h]
    snake = [h for h in heads if re.search(r"[a-z]_[a-z]", h) and not re.search(r"T_(comp|comm|overlap)", h)]
    assert not snake, snake
    body = re.sub(r"<script.*?</script>", "", html_text, flags=re.S)
    assert not re.search(r"\d us\b", body)


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
    text = out.read_text()
    assert re.findall(r"<script[^>]*\ssrc=\"([^\"]*)\"", text) == [plotly_js_name()]   # plotly.js from beside it
    assert_reads_like_a_report(text)
    assert "CUDA stream 84 (NCCL)" in text and "stream:84" not in text     # lanes named, not stream:84
    assert "device idle" in dom and "host time outside operators" not in dom  # idle is the device's on a GPU
    # long names shortened in the table, the whole name on hover
    hover = [(html.unescape(f), html.unescape(t)) for f, t in
             re.findall(r'<td class="l name" title="([^"]+)">([^<]+)</td>', text)]
    assert hover and all(len(short) <= 64 < len(full) for full, short in hover), hover[:3]
    assert "ncclKernel_SendRecv_RING_SIMPLE_Sum_int8_t" in {short for _, short in hover}


@pytest.mark.slow
def test_recorded_reports_and_compare_render(tmp_path, recorded_run):
    runs = [recorded_run("fsdp2"), recorded_run("ddp"), recorded_run("fsdp2-no-reshard")]
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
    doms = {}
    for page in pages:
        dom, console = open_page(page, tmp_path, tmp_path / f"{page.stem}.png")
        assert console == [], (page, console)
        assert assert_plots_rendered(dom, page.read_text()) >= 2, page
        assert_reads_like_a_report(page.read_text())
        doms[page] = dom
    fsdp = pages[0].read_text()
    h = json.loads(pages[0].with_name(pages[0].stem + ".summary.json").read_text())["headline"]
    # the headline: the peak, the formula's model states, exposed share, the step's split, the first finding
    top = fsdp.split('id="headline"', 1)[1].split("</section>", 1)[0]
    assert fmt_bytes(h["peak_bytes"]) in top and fmt_bytes(h["model_states_theory_bytes"]) in top
    assert "of the step is exposed communication" in top and "host time outside operators" in top
    assert re.sub("_", "-", h["first_finding"])[:30] in re.sub("_", "-", top)
    # lanes named from the trace's threads; units in the model's order, no "(none)" bar
    assert "main thread" in fsdp and "gloo worker" in fsdp and '"thread:' not in fsdp
    unit_fig = [lay for _, lay in plot_specs(fsdp) if lay["title"]["text"].startswith("Memory per unit at the peak")]
    units = unit_fig[0]["xaxis"]["categoryarray"]
    assert units[0] == "(root)" and units[1:] == [f"layers.{i}" for i in range(len(units) - 1)], units
    assert "(none)" not in fsdp
    # the compare page: every run in the verdict, the promise table, measured beside the formula
    c = json.loads(cmp_out.with_suffix(".json").read_text())
    assert len(c["verdict_lines"]) == 2 + len(runs) - 1                 # peak, fastest, then each run vs the baseline
    cmp_dom = doms[cmp_out]
    assert "What ZeRO promises, and what was measured" in cmp_dom
    assert "beside the ZeRO formula" in cmp_out.read_text()
    for label in c["labels"]:
        assert label in cmp_dom


def plot_specs(html: str) -> list[tuple[list, dict]]:
    """(data, layout) of every plotly figure of a page, as its script gives them to Plotly.newPlot."""
    dec, out = json.JSONDecoder(), []
    for m in re.finditer(r'Plotly\.newPlot\(\s*"[^"]+",\s*', html):
        data, end = dec.raw_decode(html, m.end())
        layout, _ = dec.raw_decode(html, re.compile(r",\s*").match(html, end).end())
        out.append((data, layout))
    return out


COMMITTED = sorted((Path(__file__).resolve().parents[1] / "reports").glob("*.html"))


@pytest.mark.parametrize("page", COMMITTED, ids=[p.name for p in COMMITTED])
def test_committed_demo_reports_render(page, tmp_path):
    """What a visitor opens without running anything: reports/*.html."""
    dom, console = open_page(page, tmp_path)
    assert console == [], console
    assert assert_plots_rendered(dom, page.read_text()) >= 2


def test_every_kind_of_figure_renders(tmp_path):
    """Each trace type and layout feature the report's charts use (fsdpprof.report.figures: bars, stacked
    lines, markers, a histogram, a heat map with a named colour scale, a horizontal line with its note, a
    two-level category axis) drawn by the embedded plotly.js with no console error."""
    import numpy as np
    import pandas as pd

    from fsdpprof.report import figures
    from fsdpprof.report.page import Page, document

    page = Page()
    bars = figures.Figure()
    for name, ys in (("params", [1.0, 2.0]), ("grads", [0.5, 0.25])):
        bars.add_trace(figures.bar(x=[["run a", "run b"], ["measured", "measured"]], y=ys, name=name,
                                   legendgroup="m", legendgrouptitle_text="measured",
                                   marker=dict(color="#1f77b4", pattern=dict(shape="/", fgcolor="#fff"))))
    bars.add_hline(y=2.5, line_dash="dot", annotation_text="measured peak")
    bars.update_layout(barmode="stack", title="bars", yaxis_title="MiB", legend=dict(groupclick="toggleitem"))
    lines = figures.Figure()
    lines.add_trace(figures.scatter(x=pd.Series([0.0, 1.0, 2.0]), y=pd.Series([1.0, np.nan, 3.0]), mode="lines",
                                    stackgroup="one", line=dict(width=0.5, color="#abcdef"), name="acts"))
    lines.add_trace(figures.scatter(x=["a", "b"], y=[1.0, 2.0], mode="markers", marker=dict(symbol="diamond")))
    lanes = figures.Figure(figures.bar(base=pd.Series([0.0, 1.5]), x=pd.Series([1.0, 0.5]), y=["main", "gloo"],
                                       orientation="h", hovertext=["a", "b"], hoverinfo="text", width=0.6))
    lanes.update_layout(barmode="overlay", yaxis=dict(categoryorder="array", categoryarray=["gloo", "main"]))
    hist = figures.Figure(figures.histogram(x=np.linspace(0, 1, 50, dtype=np.float32), nbinsx=10))
    heat = figures.Figure(figures.heatmap(z=np.arange(12, dtype=np.float32).reshape(3, 4), x=["1", "2", "3", "4"],
                                          y=["rank 0", "rank 1", "rank 2"], colorscale="Reds", colorbar=dict(title="ms")))
    heat.update_layout(yaxis=dict(autorange="reversed", type="category"), xaxis=dict(type="category"))
    body = "".join(page.fig(f, 300) for f in (bars, lines, lanes, hist, heat))
    out = tmp_path / "figures.html"
    out.write_text(document("figures", "every kind", [], body))
    dom, console = open_page(out, tmp_path)
    assert console == [], console
    assert assert_plots_rendered(dom, out.read_text()) == 5
    assert "measured peak" in dom and "rank 2" in dom
