"""Figures into HTML, fast: what :meth:`fsdpprof.report.html.Page.fig` does with a figure.

A plotly figure (``go.Figure``) or a plain figure dict (``{"data": [...], "layout": {...}}``, the same
JSON plotly.js reads: no validation, nothing copied twice) becomes one ``<div>`` with its script.
``go.Figure.to_dict`` deep-copies the whole figure, its default template included, and
``update_layout`` validates again: here only the dicts that change are copied (the figure given is
left as it was), the height and margins are set in the copy, and the ``plotly_white`` template goes in
as JSON built once per process.  The page is the same as with ``to_dict`` and ``update_layout``.
"""
from __future__ import annotations

from typing import Any

MARGIN = {"l": 60, "r": 20, "t": 40, "b": 40}
CONFIG = {"displaylogo": False, "responsive": True}
_TEMPLATE_JSON: dict = {}


def white_template() -> dict:
    """plotly's ``plotly_white`` template as JSON (built once per process)."""
    if not _TEMPLATE_JSON:
        import plotly.io as pio

        _TEMPLATE_JSON.update(pio.templates["plotly_white"].to_plotly_json())
    return _TEMPLATE_JSON


def _copy_dicts(obj: Any) -> Any:
    """``obj`` with every dict (and every list holding one) copied; other values shared.  Enough for
    plotly's base64 pass, which replaces arrays inside dicts and changes nothing else."""
    t = type(obj)
    if t is dict:
        return {k: _copy_dicts(v) for k, v in obj.items()}
    if (t is list or t is tuple) and any(type(x) in (dict, list, tuple) for x in obj):
        return t(_copy_dicts(x) for x in obj)
    return obj


def figure_spec(fig, height: int) -> dict:
    """The JSON figure plotly.js draws: ``fig`` (go.Figure or dict) with ``height``, fsdpprof's margins
    and the plotly_white template, numeric arrays as plotly's typed arrays.  ``fig`` is not changed."""
    if isinstance(fig, dict):
        data, layout = fig.get("data") or [], fig.get("layout") or {}
        frames = fig.get("frames")
    else:                          # a go.Figure: its own dicts, as to_dict reads them (without the deep copy)
        data, layout = fig._data, fig._layout
        frames = [f._props for f in fig._frame_objs]
    # (the template is replaced below, in its place: not copied)
    lay = {k: None if k == "template" else _copy_dicts(v) for k, v in layout.items()}
    spec = {"data": [_copy_dicts(t) for t in data], "layout": lay}
    if frames:
        spec["frames"] = _copy_dicts(list(frames))
    lay["margin"] = {**(lay.get("margin") or {}), **MARGIN}     # (in update_layout's order: margin, height)
    lay["height"] = height
    from plotly.basedatatypes import convert_to_base64

    convert_to_base64(spec)
    lay["template"] = white_template()
    return spec


def figure_html(fig, height: int, div_id: str, include_plotlyjs: bool) -> str:
    """One figure as a ``<div class="plot">`` (with plotly.js itself when ``include_plotlyjs``)."""
    import plotly.io as pio

    return '<div class="plot">' + pio.to_html(
        figure_spec(fig, height), full_html=False, include_plotlyjs=include_plotlyjs, div_id=div_id,
        config=CONFIG, validate=False) + "</div>"
