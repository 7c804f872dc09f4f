"""Figures as plain plotly.js JSON and HTML without importing plotly's Python package: :class:`Figure` and the
traces (:func:`bar`, :func:`scatter`, :func:`histogram`, :func:`heatmap`) take ``plotly.graph_objects``' keyword
arguments (``marker_color=``, ``xaxis_title=``); :func:`figure_html` writes what plotly's ``to_html`` would, its
JSON escaped for a <script>, plotly.js with the first figure (embedded or from a file beside the page)."""
from __future__ import annotations

import base64
import functools
import html
import json
from typing import Any

import numpy as np

from fsdpprof.report.plotly_bundle import plotly_data, plotly_js

MARGIN = {"l": 60, "r": 20, "t": 40, "b": 40}
CONFIG = {"displaylogo": False, "responsive": True}
# the prefixes of "magic underscore" keyword arguments (marker_color -> marker.color) the report uses
_TRACE_NESTED = frozenset({"marker", "line", "legendgrouptitle", "colorbar", "hoverlabel", "textfont"})
_LAYOUT_NESTED = frozenset({"xaxis", "yaxis", "legend", "title", "font", "margin"})
# plotly.js typed arrays (what plotly's convert_to_base64 writes): numpy dtype -> plotly.js dtype
_TYPED = {"int8": "i1", "uint8": "u1", "int16": "i2", "uint16": "u2", "int32": "i4", "uint32": "u4",
          "float32": "f4", "float64": "f8"}
# the data arrays plotly writes typed; others (a bar's ``base``, ...) as lists
_TYPED_KEYS = frozenset({"x", "y", "z", "customdata"})
_SAFE = (("<", "\\u003c"), (">", "\\u003e"), ("/", "\\u002f"), ("\u2028", "\\u2028"), ("\u2029", "\\u2029"))


# --------------------------------------------------------------------------- building figures
def _put(out: dict, path: list[str], value: Any) -> None:
    for key in path[:-1]:
        nxt = out.get(key)
        if not isinstance(nxt, dict):
            nxt = out[key] = {}
        out = nxt
    last = path[-1]
    if isinstance(value, dict) and isinstance(out.get(last), dict):
        for k, v in value.items():
            _put(out[last], [k], v)
    else:
        out[last] = dict(value) if isinstance(value, dict) else value


def _props(kwargs: dict, nested: frozenset) -> dict:
    """Keyword arguments as plotly.js properties: ``a_b=v`` -> ``{"a": {"b": v}}`` for a nested ``a``;
    pandas columns as numpy arrays, tuples as lists."""
    out: dict = {}
    for key, value in kwargs.items():
        if value is None:
            continue
        if hasattr(value, "to_numpy") and not hasattr(value, "__array_interface__"):
            value = value.to_numpy()
        elif type(value) is tuple:
            value = list(value)
        head = key.split("_", 1)[0]
        _put(out, key.split("_") if head in nested and "_" in key else [key], value)
    return out


def _titled(d: dict | None, key: str = "title") -> None:
    """A title given as text becomes ``{"text": ...}`` (plotly.js 3 reads only that form)."""
    if isinstance(d, dict) and isinstance(d.get(key), str):
        d[key] = {"text": d[key]}


def _trace(kind: str, **kwargs) -> dict:
    """A trace of type ``kind`` from the keyword arguments of its ``go`` class (``go.Bar`` for "bar")."""
    t = {"type": kind, **_props(kwargs, _TRACE_NESTED)}
    _titled(t.get("colorbar"))
    return t


bar, scatter, histogram, heatmap = (functools.partial(_trace, k) for k in ("bar", "scatter", "histogram", "heatmap"))


class Figure:
    """A figure as plotly.js reads it: ``data`` (a list of trace dicts) and ``layout`` (a dict)."""

    def __init__(self, data: dict | list | None = None) -> None:
        self.data: list[dict] = [data] if isinstance(data, dict) else list(data or [])
        self.layout: dict = {}

    def add_trace(self, trace: dict) -> "Figure":
        self.data.append(trace)
        return self

    def update_layout(self, **kwargs) -> "Figure":
        """``go.Figure.update_layout``'s keyword arguments (``title=``, ``xaxis_title=``, ``yaxis=dict(...)``)."""
        for key, value in _props(kwargs, _LAYOUT_NESTED).items():
            _put(self.layout, [key], value)
        _titled(self.layout)
        for axis in ("xaxis", "yaxis"):
            _titled(self.layout.get(axis))
        return self

    def add_hline(self, y: float, line_dash: str | None = None, annotation_text: str | None = None) -> "Figure":
        """A horizontal line across the plot at ``y``, with a note at its right end (as ``go.Figure.add_hline``)."""
        line = {"dash": line_dash} if line_dash else {}
        self.layout.setdefault("shapes", []).append(
            {"type": "line", "xref": "x domain", "x0": 0, "x1": 1, "yref": "y", "y0": y, "y1": y, "line": line})
        if annotation_text:
            self.layout.setdefault("annotations", []).append(
                {"text": annotation_text, "showarrow": False, "xref": "x domain", "x": 1, "xanchor": "right",
                 "yref": "y", "y": y, "yanchor": "bottom"})
        return self

    def to_dict(self) -> dict:
        return {"data": self.data, "layout": self.layout}


# --------------------------------------------------------------------------- into HTML
@functools.cache
def white_template() -> dict:
    """plotly's ``plotly_white`` template (read once per process)."""
    with open(plotly_data("templates", "plotly_white.json"), encoding="utf-8") as fh:
        return json.load(fh)


def _load_plotly(include_plotlyjs: bool | str) -> str:
    """The markup that gives the page plotly.js: the bundle (True), ``<script src>`` of a file beside the page (with
    a note shown when that file is not there), or nothing (False)."""
    if not include_plotlyjs:
        return ""
    config = "<script>window.PlotlyConfig = {MathJaxConfig: 'local'};</script>"
    if include_plotlyjs is True:
        return f"{config}<script>{plotly_js()}</script>"
    src = str(include_plotlyjs)
    missing = (f"The charts of this page need {src} in the folder the page is in (fsdpprof wrote it there); "
               "copy the two together, or write the page with --self-contained.")
    banner = to_json(f'<p class="banner">{html.escape(missing)}</p>')
    return (f'{config}<script charset="utf-8" src="{html.escape(src, quote=True)}"></script>'
            f'<script>window.Plotly || document.currentScript.insertAdjacentHTML("afterend", {banner});</script>')


def _typed(v):
    """A numeric numpy array as a plotly.js typed array (64-bit integers narrowed where they fit, as plotly does)."""
    dtype = str(v.dtype)
    if v.size == 0:
        return v
    if dtype in ("int64", "uint64"):
        lo, hi = int(v.min()), int(v.max())
        for cand in (("int8", "int16", "int32") if dtype == "int64" else ("uint8", "uint16", "uint32")):
            info = np.iinfo(cand)
            if info.min <= lo and hi <= info.max:
                v = v.astype(cand)
                break
        else:
            return v
        dtype = str(v.dtype)
    short = _TYPED.get(dtype)
    if short is None:
        return v
    spec = {"dtype": short, "bdata": base64.b64encode(np.ascontiguousarray(v)).decode("ascii")}
    if v.ndim > 1:
        spec["shape"] = str(v.shape)[1:-1]
    return spec


def _with_typed_arrays(obj):
    """A copy of ``obj`` with its numeric numpy data arrays (x, y, z, customdata) as typed arrays."""
    t = type(obj)
    if t is dict:
        return {k: (_typed(v) if k in _TYPED_KEYS else v) if isinstance(v, np.ndarray) else _with_typed_arrays(v)
                for k, v in obj.items()}
    if t is list or t is tuple:
        return [_with_typed_arrays(x) for x in obj]
    return obj


def _enc_hook(obj):
    if hasattr(obj, "tolist"):            # numpy arrays and scalars
        return obj.tolist()
    if hasattr(obj, "isoformat"):
        return obj.isoformat()
    return str(obj)


def to_json(obj) -> str:
    """JSON for a <script>: NaN / inf as null, numpy values as numbers, ``<``, ``>``, ``/`` and line separators
    escaped (as plotly's to_json_plotly)."""
    import msgspec

    out = msgspec.json.encode(obj, enc_hook=_enc_hook).decode("utf-8")
    for unsafe, safe in _SAFE:
        if unsafe in out:
            out = out.replace(unsafe, safe)
    return out


def figure_spec(fig, height: int) -> dict:
    """The figure plotly.js draws: ``fig`` (:class:`Figure`, a dict or a ``go.Figure``) with ``height``, the margins
    and the plotly_white template."""
    if isinstance(fig, Figure):
        data, layout = fig.data, fig.layout
    elif isinstance(fig, dict):
        data, layout = fig.get("data") or [], fig.get("layout") or {}
    else:                                  # a plotly go.Figure
        d = fig.to_plotly_json()
        data, layout = d.get("data") or [], {k: v for k, v in (d.get("layout") or {}).items() if k != "template"}
    spec = {"data": _with_typed_arrays(list(data)), "layout": _with_typed_arrays(dict(layout))}
    lay = spec["layout"]
    lay["margin"] = {**(lay.get("margin") or {}), **MARGIN}
    lay["height"] = height
    lay["template"] = white_template()
    return spec


def figure_html(fig, height: int, div_id: str, include_plotlyjs: bool | str) -> str:
    """One figure as plotly's ``to_html(full_html=False)`` writes it, with plotly.js when ``include_plotlyjs`` is
    True or a relative path; drawn only where plotly.js loaded."""
    spec = figure_spec(fig, height)
    load = _load_plotly(include_plotlyjs)
    script = (f'if (window.Plotly && document.getElementById("{div_id}")) {{Plotly.newPlot("{div_id}", '
              f'{to_json(spec["data"])}, '
              f'{to_json(spec["layout"])}, {json.dumps(CONFIG)})}};')
    return (f'<div class="plot"><div style="height:{height}px; width:100%;">{load}'
            f'<div id="{div_id}" class="plotly-graph-div" style="height:100%; width:100%;"></div>'
            f"<script>window.PLOTLYENV=window.PLOTLYENV || {{}};{script}</script></div></div>")
