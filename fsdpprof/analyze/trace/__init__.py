"""Traces: ``decode`` (one file -> raw columns), ``classify`` (kind, collective, size, group), ``labels`` (step,
stage, FSDP phase and unit from each event's launch), ``load`` (all three -> the events frame).  Importing this
package is cheap: load_trace / decode_trace are resolved on first use."""
from __future__ import annotations

import importlib

_NAMES = {"RawTrace": "decode", "decode_trace": "decode", "TraceData": "load", "load_trace": "load"}


def __getattr__(name: str):
    if name in _NAMES:
        return getattr(importlib.import_module(f"fsdpprof.analyze.trace.{_NAMES[name]}"), name)
    raise AttributeError(f"module 'fsdpprof.analyze.trace' has no attribute {name!r}")
