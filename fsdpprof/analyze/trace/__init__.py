"""Traces: decode a profiler (kineto) chrome trace, classify its events, label every event from its launch.

- ``decode``    typed, streaming decoder: one trace file -> raw columns (:func:`decode_trace`), and
  :func:`load_trace` = decode + classify + labels -> the events frame of :mod:`fsdpprof.analyze.vocab`.
- ``classify``  kind (compute, comm, ...), collective type, message size, process group.
- ``labels``    step, stage, FSDP phase and unit of every event, taken from the CPU point that launched it.
"""
from fsdpprof.analyze.trace.decode import RawTrace, TraceData, decode_trace, load_trace  # noqa: F401
