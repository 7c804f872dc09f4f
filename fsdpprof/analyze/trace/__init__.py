"""Traces: decode a profiler (kineto) chrome trace, classify its events, label every event from its launch.

- ``decode``    typed, streaming decoder: one trace file -> raw columns (:func:`decode_trace`), and
  :func:`load_trace` = decode + classify + labels -> the events frame of :mod:`fsdpprof.analyze.model`.
- ``classify``  kind (compute, comm, ...), collective type, message size, process group.
- ``labels``    step, stage, FSDP phase and unit of every event, taken from the CPU point that launched it.
- ``rules``     the per-event rules the others apply (kept events, what a name says, message sizes), numpy-free.

Importing this package is cheap (no numpy, no pandas): ``decode``'s names are resolved on first use.
"""
from __future__ import annotations

import importlib

_FROM_DECODE = ("RawTrace", "TraceData", "decode_trace", "load_trace")


def __getattr__(name: str):
    if name in _FROM_DECODE:
        return getattr(importlib.import_module("fsdpprof.analyze.trace.decode"), name)
    raise AttributeError(f"module 'fsdpprof.analyze.trace' has no attribute {name!r}")


def __dir__():
    return sorted(set(globals()) | set(_FROM_DECODE))
