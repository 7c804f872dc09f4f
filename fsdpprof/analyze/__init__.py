"""Analyses: run_dir -> Run (pandas DataFrames) -> pure analysis functions -> numbers.

Never imports ``fsdpprof.report``; never needs a GPU or torch.distributed.  The folders read like
the features: ``trace/`` (decode, classify, label every event from its launch), ``comm/`` (intervals,
overlap, volume, steps, skew), ``memory/`` (snapshots, CPU memory events, attribution), plus
``model`` (the one vocabulary of an FSDP step), ``theory``, ``findings``, ``compare`` and
``pipeline`` (per-rank map, cross-rank reduce).

The public Python API is importable from here (``from fsdpprof.analyze import load_run,
comm_overlap, memory_analysis``); names are resolved lazily, so importing this package is cheap.
Modules of the flat layout of fsdpprof 0.1 (``fsdpprof.analyze.overlap`` ...) still import, with a
FutureWarning naming their new place.
"""
from __future__ import annotations

import importlib
import sys

# public name -> module that defines it
_API = {
    "load_run": "fsdpprof.analyze.run", "Run": "fsdpprof.analyze.rundata", "RankData": "fsdpprof.analyze.rundata",
    "analyze_run": "fsdpprof.analyze.pipeline", "Analysis": "fsdpprof.analyze.pipeline",
    "compare_analyses": "fsdpprof.analyze.compare", "Comparison": "fsdpprof.analyze.compare",
    "load_trace": "fsdpprof.analyze.trace.decode", "decode_trace": "fsdpprof.analyze.trace.decode",
    "comm_overlap": "fsdpprof.analyze.comm.overlap", "overall_overlap": "fsdpprof.analyze.comm.overlap",
    "collective_volume": "fsdpprof.analyze.comm.volume", "quick_overlap": "fsdpprof.analyze.comm.quick",
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


# fsdpprof 0.1's flat modules -> where they live now
MOVED_MODULES = {
    "overlap": "fsdpprof.analyze.comm.overlap", "volume": "fsdpprof.analyze.comm.volume",
    "steps": "fsdpprof.analyze.comm.steps", "ranks": "fsdpprof.analyze.comm.skew",
    "intervals": "fsdpprof.analyze.comm.intervals", "classify": "fsdpprof.analyze.trace.classify",
    "phases": "fsdpprof.analyze.trace.labels", "schema": "fsdpprof.analyze.model",
    "analysis": "fsdpprof.analyze.pipeline", "snapshot": "fsdpprof.analyze.memory.snapshot",
    "safe_pickle": "fsdpprof.analyze.memory.safe_pickle", "memory_trace": "fsdpprof.analyze.memory.cpu_events",
    "categorize": "fsdpprof.analyze.memory.categorize",
}


class _MovedModules:
    """Imports ``fsdpprof.analyze.<old>`` as the module it moved to, with a FutureWarning (a meta path finder
    and loader; importlib.abc / importlib.util are imported only when an old name is asked for: cheap start-up)."""

    def find_spec(self, fullname, path, target=None):
        pkg, _, leaf = fullname.rpartition(".")
        if pkg == __name__ and leaf in MOVED_MODULES:
            import importlib.util

            return importlib.util.spec_from_loader(fullname, self)
        return None

    def create_module(self, spec):
        import warnings

        new = MOVED_MODULES[spec.name.rpartition(".")[2]]
        warnings.warn(f"{spec.name} is deprecated: it moved to {new} (the public API imports from "
                      f"fsdpprof.analyze, e.g. `from fsdpprof.analyze import comm_overlap`)", FutureWarning,
                      stacklevel=2)
        return importlib.import_module(new)

    def exec_module(self, module):
        pass


if not any(isinstance(f, _MovedModules) for f in sys.meta_path):
    sys.meta_path.append(_MovedModules())
