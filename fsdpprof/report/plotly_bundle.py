"""The installed plotly package's data files (plotly.js, templates), found without importing plotly, and the
name of the plotly.js file that pages load from beside them.  No numpy, no pandas: the output checks that run
before an analysis import this."""
from __future__ import annotations

import hashlib
import importlib.util
import os
import re

from fsdpprof.errors import UserError

_CACHE: dict = {}


def plotly_data(*parts: str) -> str:
    """A data file of the installed plotly package (found without importing it)."""
    spec = importlib.util.find_spec("plotly")
    if spec is None or not spec.submodule_search_locations:
        raise UserError("the plotly package is not installed; install fsdpprof with its dependencies "
                        "(pip install fsdpprof)")
    return os.path.join(list(spec.submodule_search_locations)[0], "package_data", *parts)


def plotly_js() -> str:
    """The plotly.js bundle of the installed plotly package (read once per process)."""
    if "js" not in _CACHE:
        with open(plotly_data("plotly.min.js"), encoding="utf-8") as fh:
            _CACHE["js"] = fh.read()
    return _CACHE["js"]


def plotly_js_version() -> str:
    """The version of the installed plotly.js bundle, from its banner ("4.1.1"); where the banner has none, the
    first 12 hex digits of the bundle's SHA-256 (a name that still changes with its content)."""
    if "version" not in _CACHE:
        js = plotly_js()
        m = re.search(r"plotly\.js v(\d+\.\d+\.\d+[0-9A-Za-z.\-]*)", js[:2000])
        _CACHE["version"] = m.group(1) if m else hashlib.sha256(js.encode("utf-8")).hexdigest()[:12]
    return _CACHE["version"]


def plotly_js_name() -> str:
    """The file name pages load plotly.js from, beside them: ``plotly-<version>.min.js``."""
    return f"plotly-{plotly_js_version()}.min.js"
