"""Analyses: run_dir -> Run (pandas DataFrames) -> pure analysis functions -> numbers; never imports report.

Folders: ``load/`` (find and read a run, where per-rank work runs), ``trace/``, ``comm/``, ``memory/``,
``summary/``, ``whatif/``, ``compare/``, plus ``model`` (the vocabulary) and ``pipeline`` (map and reduce).
The public Python API is importable from here, resolved lazily so that importing this package is cheap.
"""
from __future__ import annotations

import importlib

# public name -> module that defines it
_API = {name: f"fsdpprof.analyze.{module}" for module, names in (
    ("load.run", "load_run run_events"), ("load.files", "find_run Run RankData"),
    ("pipeline", "analyze_run Analysis overlap_summary OverlapSummary critical_path"),
    ("comm.critical_path", "CriticalPath straggler_cost_us contended_cost_us"),
    ("compare.runs", "compare_analyses Comparison"),
    ("trace.load", "load_trace"), ("trace.decode", "decode_trace"), ("comm.overlap", "comm_overlap overall_overlap"),
    ("comm.volume", "collective_volume"), ("comm.steps", "step_breakdown"), ("comm.skew", "collective_skew stragglers"),
    ("comm.matching", "match_collectives MatchStats"),
    ("memory.attribution", "memory_analysis snapshot_memory MemoryResult"), ("memory.snapshot", "load_snapshot"),
) for name in names.split()}
__all__ = sorted(_API)


def __getattr__(name: str):
    if name not in _API:
        raise AttributeError(f"module 'fsdpprof.analyze' has no attribute {name!r}")
    return getattr(importlib.import_module(_API[name]), name)


def __dir__():
    return sorted(set(globals()) | set(_API))
