"""The report's figures (fsdpprof.report.figures) against plotly's own objects: the same plotly.js JSON as
``plotly.graph_objects`` makes from the same keyword arguments, the same page markup as ``plotly.io.to_html``,
without importing plotly's Python package on the report's path."""
from __future__ import annotations

import json
import re
import subprocess
import sys

import numpy as np
import pandas as pd
import plotly.graph_objects as go
import plotly.io as pio
import pytest
from plotly.basedatatypes import convert_to_base64

from fsdpprof.report import figures

# (kind, keyword arguments) as the report's charts pass them
TRACES = [
    ("bar", dict(x=["rank 0", "rank 1"], y=pd.Series([1.5, 2.25]), marker_color="#1f77b4")),
    ("bar", dict(base=pd.Series([0.0, 1.0]), x=pd.Series([0.5, 0.25]), y=["main thread", "gloo"], orientation="h",
                 name="compute", marker_color="#123456", hovertext=["a<br>1 ms", "b<br>2 ms"], hoverinfo="text",
                 width=0.6, opacity=0.6)),
    ("bar", dict(x=["params"], y=np.array([3.0]), marker_color=["#ff0000"], text=["3 MiB<br>50%"],
                 textposition="outside", cliponaxis=False)),
    ("bar", dict(x=[["run a", "run b"], ["measured", "measured"]], y=[1.0, 2.0], name="grads", legendgroup="measured",
                 legendgrouptitle_text="measured at the peak", marker=dict(color="#00ff00", pattern=dict(shape="/", fgcolor="#fff")))),
    ("bar", dict(x=np.array([1, 2, 3], dtype=np.int64), y=np.array([7, 300, 70000], dtype=np.int64))),
    ("scatter", dict(x=pd.Series([0.0, 1.0, np.nan]), y=pd.Series([1.0, 2.0, 3.0]), name="activations", mode="lines",
                     stackgroup="one", line=dict(width=0.5, color="#abcdef"))),
    ("scatter", dict(x=["s1", "s2"], y=[1.0, 2.0], mode="markers", marker=dict(color="#2563eb", symbol="diamond"))),
    ("histogram", dict(x=np.array([1.0, 2.0, 2.5], dtype=np.float32), nbinsx=40, marker_color="#6366f1")),
    ("heatmap", dict(z=np.arange(6, dtype=np.float32).reshape(2, 3), x=["1", "2", "3"], y=["rank 0", "rank 1"],
                     colorbar=dict(title="ms"), hovertemplate="%{y}, step %{x}: %{z:.3f} ms exposed<extra></extra>")),
]
LAYOUTS = [
    dict(title="Peak allocated memory per rank", yaxis_title="MiB"),
    dict(barmode="stack", title="t", yaxis_title="ms", xaxis=dict(categoryorder="array", categoryarray=["a", "b"]),
         legend=dict(orientation="h", y=-0.2, font=dict(size=11))),
    dict(barmode="overlay", xaxis_title="ms from step start", yaxis=dict(categoryorder="array", categoryarray=["x"])),
    dict(title="t", xaxis_title="step", yaxis_title="rank", yaxis=dict(autorange="reversed", type="category"),
         xaxis=dict(type="category"), bargap=0.05),
    dict(xaxis=dict(tickangle=0), legend=dict(groupclick="toggleitem", font=dict(size=11))),
]


def _plotly_json(obj) -> object:
    """What plotly writes for a validated object: typed arrays, then its JSON."""
    d = json.loads(json.dumps(obj, default=lambda o: o.tolist()))  # (plain copy, arrays as lists first)
    return d


def _ours(obj) -> object:
    return json.loads(figures.to_json(figures._with_typed_arrays(obj)))


def _theirs(obj) -> object:
    convert_to_base64(obj)
    return json.loads(pio.json.to_json_plotly(obj))


@pytest.mark.parametrize("kind,kwargs", TRACES, ids=[f"{k}{i}" for i, (k, _) in enumerate(TRACES)])
def test_a_trace_is_the_json_plotly_makes(kind, kwargs):
    ours = _ours(getattr(figures, kind)(**kwargs))
    theirs = _theirs(getattr(go, kind.capitalize() if kind != "heatmap" else "Heatmap")(**kwargs).to_plotly_json())
    assert ours == theirs


@pytest.mark.parametrize("kwargs", LAYOUTS)
def test_a_layout_is_the_json_plotly_makes(kwargs):
    ours = _ours(figures.Figure().update_layout(**kwargs).layout)
    lay = go.Figure().update_layout(**kwargs).to_plotly_json()["layout"]
    lay.pop("template", None)
    assert ours == _theirs(lay)


def test_hline_and_two_layout_calls_as_plotly():
    ours = figures.Figure(figures.bar(x=["a"], y=[1.0])).update_layout(yaxis_title="MiB")
    ours.add_hline(y=3.5, line_dash="dot", annotation_text="this run, measured")
    ours.update_layout(barmode="stack", title="Predicted")
    theirs = go.Figure(go.Bar(x=["a"], y=[1.0])).update_layout(yaxis_title="MiB")
    theirs.add_hline(y=3.5, line_dash="dot", annotation_text="this run, measured")
    theirs.update_layout(barmode="stack", title="Predicted")
    lay = theirs.to_plotly_json()["layout"]
    lay.pop("template")
    assert _ours(ours.layout) == _theirs(lay)


def _script_json(html: str) -> tuple[object, object]:
    m = re.search(r'Plotly\.newPlot\(\s*"[^"]+",\s*(\[.*?\]),\s*(\{.*\}),\s*\{"displaylogo', html, re.S)
    assert m, html[-400:]
    return json.loads(m.group(1)), json.loads(m.group(2))


def test_the_page_markup_and_json_are_plotlys():
    fig = figures.Figure(figures.bar(x=["a", "b"], y=pd.Series([1.0, 2.0]), name="x")).update_layout(title="t")
    ours = figures.figure_html(fig, 300, "plot-1", include_plotlyjs=True)
    gofig = go.Figure(go.Bar(x=["a", "b"], y=pd.Series([1.0, 2.0]), name="x")).update_layout(title="t")
    theirs = pio.to_html(figures.figure_spec(gofig, 300), full_html=False, include_plotlyjs=True, div_id="plot-1",
                         config=figures.CONFIG, validate=False)
    assert _script_json(ours) == _script_json(theirs)
    # plotly.js embedded once, the same bundle; the same template
    import plotly.offline
    assert plotly.offline.get_plotlyjs() in ours and ours.count("<script>") == 3
    assert figures.white_template() == pio.templates["plotly_white"].to_plotly_json()
    assert 'style="height:300px; width:100%;"' in ours and 'class="plotly-graph-div"' in ours
    assert "plotly.js" not in figures.figure_html(fig, 300, "plot-2", include_plotlyjs=False)


def test_a_trace_string_cannot_close_the_script():
    evil = '</script><script>alert(1)</script>\u2028'
    html = figures.figure_html(figures.Figure(figures.bar(x=[evil], y=[1.0], name=evil)), 200, "p", False)
    body = html.split("<script>", 1)[1]
    assert "</script>" not in body[: body.rindex("</script>")] and "\u2028" not in html
    data, _ = _script_json(html)
    assert data[0]["x"] == [evil] and data[0]["name"] == evil           # the string itself, intact


def test_nan_and_numpy_scalars_are_json():
    fig = figures.Figure(figures.bar(x=["a", "b"], y=[np.float64("nan"), np.int64(3)], text=[np.float32(1.5), None]))
    data, _ = _script_json(figures.figure_html(fig, 200, "p", False))
    assert data[0]["y"] == [None, 3] and data[0]["text"] == [1.5, None]


def test_rendering_a_report_imports_no_plotly(tmp_path):
    """The figures go into the page without plotly's Python package (its import and validation cost more than the
    rest of the rendering)."""
    code = ("import sys\nfrom fsdpprof.report import figures, page, run_page, compare_page\n"
            "f = figures.Figure(figures.bar(x=['a'], y=[1.0])).update_layout(title='t')\n"
            "page.Page().fig(f, 300)\nprint(sorted(m for m in sys.modules if m.split('.')[0] == 'plotly'))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert out.strip() == "[]"


def test_memory_timeline_stacks_what_is_below_zero_below_the_axis():
    """A category's negative bytes (a CPU run's other threads freeing what the named categories counted) are
    stacked below the axis, apart from the others; its positive part stays in the stack above."""
    from fsdpprof.report.memory import timeline_figure

    tl = pd.DataFrame({"ts_us": [0.0, 1000.0, 2000.0], "activation": [4.0, 6.0, 2.0],
                       "other_threads": [0.0, -3.0, -1.0], "gradient": [1.0, -1.0, 0.0], "optimizer_state": [0.0] * 3})
    traces = timeline_figure(tl, 0.0, 1.0, "B", "rank 0").to_dict()["data"]
    by = {(t["legendgroup"], t["stackgroup"]): [float(v) for v in np.asarray(t["y"], dtype=float)] for t in traces}
    assert by == {("activation", "above"): [4.0, 6.0, 2.0], ("other_threads", "below"): [0.0, -3.0, -1.0],
                  ("gradient", "above"): [1.0, 0.0, 0.0], ("gradient", "below"): [0.0, -1.0, 0.0]}
    # one legend entry per category; the positive stack's top is what the categories hold above zero
    assert [t["showlegend"] for t in traces] == [True, True, True, False]
    assert [t["x"][1] for t in traces][:1] == [1.0]        # ms from the window's start
