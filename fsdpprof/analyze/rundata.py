"""What :func:`fsdpprof.analyze.run.load_run` returns: a :class:`Run` and its :class:`RankData` (dataclasses).

They live apart from the finding of the files (``fsdpprof.analyze.run``), which builds plain namespaces of the
same fields (``run.find_files``; ``run.as_run`` makes these classes of them): ``fsdpprof overlap`` reads the
namespaces and so never imports ``dataclasses`` and, through it, ``inspect`` (~15 ms of a cold start on the
2-core EPYC).  Both classes are importable from ``fsdpprof.analyze.run`` and ``fsdpprof.analyze`` as before.
"""
from __future__ import annotations

import os
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from fsdpprof.analyze.run import SOURCE_RUN_DIR, empty_events, load_events

if TYPE_CHECKING:
    import pandas as pd


@dataclass
class RankData:
    """One rank's files, and its frames once parsed (``events`` None: not parsed yet, or no trace)."""

    rank: int
    info: dict                           # rank.json, or derived from the trace's distributedInfo
    inventory: dict | None               # inventory.json
    trace_path: str | None
    events: pd.DataFrame | None          # model.EVENT_COLUMNS
    memory_events: pd.DataFrame | None   # model.MEMORY_EVENT_COLUMNS
    snapshot_path: str | None            # CUDA snapshot of this rank
    trace_meta: dict = field(default_factory=dict)   # distributedInfo, deviceProperties, baseTimeNanoseconds, device_type
    label: str = ""                      # rank-3, or the file's name: how messages name this rank
    inventory_path: str | None = None    # lazily loaded run: inventory.json, read where the rank is analysed


@dataclass
class Run:
    """A loaded run: where it came from, its ranks, what is missing and why, warnings (one line each)."""

    path: str
    source: str                          # run_dir | trace_folder | trace_file | snapshot_file | snapshot_folder
    meta: dict                           # run.json ({} when not ours)
    ranks: dict[int, RankData]
    missing: dict[str, str]              # rank or file label -> one-line reason
    warnings: list[str]
    world_size: int | None
    inputs: list[str] = field(default_factory=list)   # every file read (or offered) as input: never an output
    max_trace_bytes: int | None = None   # largest trace JSON accepted once decompressed (None: the default)

    def record_folders(self) -> list[str]:
        """Folders of a run directory that hold what ``fsdpprof record`` wrote (rank-*/, launchers/): outputs
        never go there (a new recording replaces them)."""
        if self.source != SOURCE_RUN_DIR:
            return []
        return sorted({os.path.dirname(f) for f in self.inputs} - {self.path})

    def events(self) -> pd.DataFrame:
        """All ranks' events concatenated (model.EVENT_COLUMNS), categoricals kept; a lazily loaded run
        parses its traces now (and keeps them)."""
        if any(r.events is None and r.trace_path for r in self.ranks.values()):
            load_events(self)
        frames = [r.events for _, r in sorted(self.ranks.items()) if r.events is not None]
        if not frames:
            return empty_events()
        from fsdpprof.analyze.trace.labels import concat_events
        return concat_events(frames)
