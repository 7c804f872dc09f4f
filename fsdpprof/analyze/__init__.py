"""Analyses: run_dir -> Run (pandas DataFrames) -> pure analysis functions -> numbers.

Never imports ``fsdpprof.report``; never needs a GPU or torch.distributed.  The folders read like
the features: ``load/`` (find a run's files, load each rank, where the per-rank work runs), ``trace/``
(decode, classify, label every event from its launch), ``comm/`` (intervals, overlap, volume, steps, skew),
``memory/`` (snapshots, CPU memory events, attribution), ``summary/`` (headline, findings, formulas,
distributions over ranks), ``whatif/`` (other strategies predicted), ``compare/`` (several runs side by
side), plus ``model`` (the one vocabulary of an FSDP step) and ``pipeline`` (per-rank map, cross-rank reduce).

The public Python API is importable from here (``from fsdpprof.analyze import load_run,
comm_overlap, memory_analysis``); names are resolved lazily, so importing this package is cheap.
"""
from __future__ import annotations

import importlib

# public name -> module that defines it
_API = {
    "load_run": "fsdpprof.analyze.load.run", "run_events": "fsdpprof.analyze.load.run",
    "find_run": "fsdpprof.analyze.load.files", "Run": "fsdpprof.analyze.load.files", "RankData": "fsdpprof.analyze.load.files",
    "analyze_run": "fsdpprof.analyze.pipeline", "Analysis": "fsdpprof.analyze.pipeline",
    "overlap_summary": "fsdpprof.analyze.pipeline", "OverlapSummary": "fsdpprof.analyze.pipeline",
    "compare_analyses": "fsdpprof.analyze.compare.runs", "Comparison": "fsdpprof.analyze.compare.runs",
    "load_trace": "fsdpprof.analyze.trace.load", "decode_trace": "fsdpprof.analyze.trace.decode",
    "comm_overlap": "fsdpprof.analyze.comm.overlap", "overall_overlap": "fsdpprof.analyze.comm.overlap",
    "collective_volume": "fsdpprof.analyze.comm.volume",
    "step_breakdown": "fsdpprof.analyze.comm.steps",
    "collective_skew": "fsdpprof.analyze.comm.skew", "stragglers": "fsdpprof.analyze.comm.skew",
    "memory_analysis": "fsdpprof.analyze.memory.attribution", "snapshot_memory": "fsdpprof.analyze.memory.attribution",
    "MemoryResult": "fsdpprof.analyze.memory.attribution", "load_snapshot": "fsdpprof.analyze.memory.snapshot",
}
__all__ = sorted(_API)


def __getattr__(name: str):
    module = _API.get(name)
    if module is None:
        raise AttributeError(f"module 'fsdpprof.analyze' has no attribute {name!r}")
    return getattr(importlib.import_module(module), name)


def __dir__():
    return sorted(set(globals()) | set(_API))
