"""Light pages: plotly.js written once beside the pages of a folder (``plotly-<version>.min.js``, loaded by a
relative ``<script src>``), embedded only with ``--self-contained``; a page alone stays small; the file follows
the outputs' rules (a user's file of that name is never replaced without --force); compare's long diff tables
show their top rows and keep the rest under a native <details>."""
from __future__ import annotations

import os
import re
from pathlib import Path

import pandas as pd
import pytest

from conftest import run_fsdpprof, shared_data
from fsdpprof.report import diff, figures, outputs
from fsdpprof.report.page import Page, document
from fsdpprof.report.plotly_bundle import plotly_js, plotly_js_name, plotly_js_version

DLRM = ("gpu-traces", "param-dlrm-8rank-v100")
SNAPSHOT = ("cuda-snapshots", "lm-step-user-metadata.pickle")
PAGE_MAX_BYTES = 1.5e6            # a page alone, without plotly.js (the bundle alone is ~4.8 MB)
BANNER = re.compile(r"\* plotly\.js v\d")     # the bundle's own banner


def _script_srcs(html: str) -> list[str]:
    return re.findall(r"<script[^>]*\ssrc=\"([^\"]*)\"", html)


def _report(src, out: Path, *extra):
    p = run_fsdpprof("report", str(src), "-o", str(out), *extra, timeout=300)
    return p


def _stamp(path: Path) -> tuple[int, int]:
    st = path.stat()
    return st.st_ino, st.st_mtime_ns


def test_the_file_name_and_the_first_figure_load_it_by_a_relative_path():
    name = plotly_js_name()
    assert name == f"plotly-{plotly_js_version()}.min.js"
    assert f"plotly.js v{plotly_js_version()}" in plotly_js()[:300]     # the version is the bundle's own
    page = Page(name)
    fig = figures.Figure(figures.bar(x=["a"], y=[1.0]))
    first, second = page.fig(fig, 200), page.fig(fig, 200)
    assert _script_srcs(first) == [name] and not _script_srcs(second)
    assert not BANNER.search(first) and len(first) < 20_000               # the bundle is not in the page
    assert "window.Plotly &&" in first and "window.Plotly &&" in second   # no script error when the file is missing
    assert f"need {name} in the folder the page is in" in first            # said in the page instead
    embedded = Page().fig(fig, 200)                                       # self-contained: as before
    assert not _script_srcs(embedded) and len(BANNER.findall(embedded)) == 1


def test_a_report_page_alone_is_small_and_loads_the_file_beside_it(tmp_path):
    out = tmp_path / "dlrm.html"
    p = _report(shared_data(*DLRM), out)
    assert p.returncode == 0, p.stderr
    html = out.read_text()
    assert out.stat().st_size <= PAGE_MAX_BYTES and not BANNER.search(html)
    srcs = _script_srcs(html)
    assert srcs == [plotly_js_name()]                                     # relative: no folder, no scheme
    assert "/" not in srcs[0] and ":" not in srcs[0]
    js = tmp_path / srcs[0]
    assert js.read_bytes() == outputs.plotly_file_bytes() and js.read_bytes().endswith(plotly_js().encode())
    assert outputs.written_by_fsdpprof(str(js))                           # ours: replaced without --force
    assert sorted(x.name for x in tmp_path.iterdir()) == sorted([out.name, "dlrm.summary.json", srcs[0]])


def test_one_file_for_several_pages_in_a_folder_and_none_when_self_contained(tmp_path):
    pages = tmp_path / "pages"
    p = _report(shared_data(*DLRM), pages / "dlrm.html")
    assert p.returncode == 0, p.stderr
    js = pages / plotly_js_name()
    before = _stamp(js)
    p = _report(shared_data(*SNAPSHOT), pages / "snap.html")
    assert p.returncode == 0, p.stderr
    p = _report(shared_data(*DLRM), pages / "dlrm.html")                  # the same page again
    assert p.returncode == 0, p.stderr
    assert _stamp(js) == before                                           # intact: not written again
    assert [x.name for x in pages.iterdir() if x.suffix == ".js"] == [js.name]
    for page in ("dlrm.html", "snap.html"):
        assert _script_srcs((pages / page).read_text()) == [js.name]
    # a damaged file of ours is written again
    js.write_bytes(outputs.plotly_file_bytes()[:1000])
    p = _report(shared_data(*SNAPSHOT), pages / "snap.html")
    assert p.returncode == 0, p.stderr
    assert js.read_bytes() == outputs.plotly_file_bytes()
    # --self-contained: the bundle in the page, no file beside it
    alone = tmp_path / "alone"
    p = _report(shared_data(*DLRM), alone / "dlrm.html", "--self-contained")
    assert p.returncode == 0, p.stderr
    html = (alone / "dlrm.html").read_text()
    assert len(BANNER.findall(html)) == 1 and not _script_srcs(html)
    assert sorted(x.name for x in alone.iterdir()) == ["dlrm.html", "dlrm.summary.json"]


@pytest.mark.parametrize("kind", ["user_file", "symlink"])
def test_a_users_file_of_that_name_is_never_replaced_without_force(tmp_path, kind):
    folder = tmp_path / "out"
    folder.mkdir()
    js = folder / plotly_js_name()
    mine = tmp_path / "my-plotly.js"
    mine.write_text("// my own plotly build\n")
    if kind == "user_file":
        js.write_text("// my own plotly build\n")
    else:
        js.symlink_to(mine)
    p = _report(shared_data(*SNAPSHOT), folder / "snap.html")
    lines = p.stderr.strip().splitlines()
    assert p.returncode == 2 and len(lines) == 1 and "Traceback" not in p.stderr, p.stderr
    assert str(js) in lines[0] and "--force" in lines[0] and "--self-contained" in lines[0], lines[0]
    assert sorted(x.name for x in folder.iterdir()) == [js.name]          # nothing written, the file as it was
    assert js.read_text() == "// my own plotly build\n"
    # --self-contained needs no file: the user's is left alone
    p = _report(shared_data(*SNAPSHOT), folder / "snap.html", "--self-contained")
    assert p.returncode == 0, p.stderr
    assert js.read_text() == "// my own plotly build\n" and js.is_symlink() == (kind == "symlink")
    # --force replaces it (a link itself, never its target)
    p = _report(shared_data(*SNAPSHOT), folder / "snap.html", "--force")
    assert p.returncode == 0, p.stderr
    assert not js.is_symlink() and js.read_bytes() == outputs.plotly_file_bytes()
    assert mine.read_text() == "// my own plotly build\n"


def test_the_file_is_never_one_of_the_inputs(tmp_path):
    """An input that has the plotly file's name (a trace folder holding it) is refused even with --force."""
    folder = tmp_path / "traces"
    folder.mkdir()
    (folder / "rank-0.json.gz").write_bytes(shared_data(*DLRM, "rank-0.json.gz").read_bytes())
    os.link(folder / "rank-0.json.gz", folder / plotly_js_name())        # the same file under the plotly name
    before = (folder / plotly_js_name()).read_bytes()
    p = _report(folder / "rank-0.json.gz", folder / "r.html", "--force")
    assert p.returncode == 2 and "one of the input files" in p.stderr, p.stderr
    assert (folder / plotly_js_name()).read_bytes() == before


def test_check_outputs_names_the_file_and_the_way_out(tmp_path):
    js = tmp_path / plotly_js_name()
    js.write_text("x")
    with pytest.raises(outputs.UserError) as exc:
        outputs.check_outputs([(str(tmp_path / "r.html"), "-o"), *outputs.plotly_output(str(tmp_path / "r.html"))])
    assert "the page's plotly.js" in str(exc.value) and "--self-contained" in str(exc.value)
    assert outputs.plotly_output(str(tmp_path / "r.html"), self_contained=True) == []
    # a page with no figure needs no file
    items = outputs.page_items(str(tmp_path / "r.html"), lambda src: document("t", "s", [], "<p>no charts</p>"))
    assert [p for p, _ in items] == [str(tmp_path / "r.html")]


def _ops_frame(n: int) -> pd.DataFrame:
    return pd.DataFrame({"name": [f"op{i}" for i in range(n)], "kind": "cpu_op", "baseline_count": 1.0,
                         "run_count": 2.0, "diff_count": 1.0, "baseline_total_us": 10.0,
                         "run_total_us": [10.0 + n - i for i in range(n)],
                         "diff_total_us": [float(n - i) for i in range(n)]})


@pytest.mark.parametrize("n", [5, 30, 80])
def test_diff_tables_show_the_top_rows_and_the_rest_under_details(n):
    html = diff._table(_ops_frame(n), diff.OPS_COLS)
    top, _, rest = html.partition("<details>")
    names = re.findall(r'title="(op\d+)"', html)
    assert re.findall(r'title="(op\d+)"', top) == [f"op{i}" for i in range(min(n, diff.SHOWN_ROWS))]
    assert names == [f"op{i}" for i in range(min(n, diff.TOP_ROWS))]      # in the frame's order, once each
    if n <= diff.SHOWN_ROWS:
        assert not rest
    elif n <= diff.TOP_ROWS:
        assert f"<summary>show all {n}</summary>" in rest and "compare.json" not in rest
    else:
        assert f"<summary>show the top {diff.TOP_ROWS} of {n} (all {n} in compare.json)</summary>" in rest
        assert f"{n - diff.TOP_ROWS} more rows in compare.json" in rest
    assert "<script" not in html


def test_whatif_page_needs_o(tmp_path):
    p = run_fsdpprof("whatif", str(tmp_path), "--self-contained", timeout=120)
    assert p.returncode == 2 and "--self-contained" in p.stderr and "-o" in p.stderr, p.stderr
