"""Traces: decode a profiler (kineto) chrome trace, classify its events, label every event from its launch.

- ``decode``    typed, streaming decoder: one trace file -> raw columns (:func:`decode_trace`); what an event
  holds (its fields, phases, plausible values), defined once.
- ``classify``  kind (compute, comm, ...), collective type, message size, process group: what a name and
  a comm op's args say.
- ``labels``    step, stage, FSDP phase and unit of every event, taken from the CPU point that launched it.
- ``load``      :func:`load_trace` = decode + classify + labels -> the events frame of :mod:`fsdpprof.analyze.model`.

Importing this package is cheap (no numpy, no pandas): the names below are resolved on first use.
"""
from __future__ import annotations

import importlib

_NAMES = {"RawTrace": "decode", "decode_trace": "decode", "TraceData": "load", "load_trace": "load"}


def __getattr__(name: str):
    if name in _NAMES:
        return getattr(importlib.import_module(f"fsdpprof.analyze.trace.{_NAMES[name]}"), name)
    raise AttributeError(f"module 'fsdpprof.analyze.trace' has no attribute {name!r}")


def __dir__():
    return sorted(set(globals()) | set(_NAMES))
