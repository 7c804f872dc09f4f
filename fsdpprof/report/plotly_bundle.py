"""The installed plotly package's data files (plotly.js, templates), found without importing plotly (nor numpy or
pandas), and the name of the plotly.js file pages load from beside them."""
from __future__ import annotations

import functools
import hashlib
import importlib.util
import os
import re

from fsdpprof.errors import UserError


def plotly_data(*parts: str) -> str:
    """A data file of the installed plotly package (found without importing it)."""
    spec = importlib.util.find_spec("plotly")
    if spec is None or not spec.submodule_search_locations:
        raise UserError("the plotly package is not installed; install fsdpprof with its dependencies "
                        "(pip install fsdpprof)")
    return os.path.join(list(spec.submodule_search_locations)[0], "package_data", *parts)


@functools.cache
def plotly_js() -> str:
    """The plotly.js bundle of the installed plotly package (read once per process)."""
    with open(plotly_data("plotly.min.js"), encoding="utf-8") as fh:
        return fh.read()


@functools.cache
def plotly_js_version() -> str:
    """The installed plotly.js' version from its banner ("4.1.1"), else the first 12 hex digits of its SHA-256."""
    js = plotly_js()
    m = re.search(r"plotly\.js v(\d+\.\d+\.\d+[0-9A-Za-z.\-]*)", js[:2000])
    return m.group(1) if m else hashlib.sha256(js.encode("utf-8")).hexdigest()[:12]


def plotly_js_name() -> str:
    """The file name pages load plotly.js from, beside them: ``plotly-<version>.min.js``."""
    return f"plotly-{plotly_js_version()}.min.js"
