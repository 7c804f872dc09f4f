"""Read a run's traces: one rank (:func:`load_rank`, the one way every analysis reads a rank, wherever it runs),
every rank at once (:func:`load_events`, each where :mod:`fsdpprof.analyze.load.engines` runs it), :func:`load_run`
(find the files, then read them) and :func:`run_events` (all ranks' events).
"""
from __future__ import annotations

import os
import sys
import time
from dataclasses import dataclass, field, replace

import pandas as pd

from fsdpprof.analyze import model
from fsdpprof.analyze.load import engines
from fsdpprof.analyze.load.files import SOURCE_RUN_DIR, RankData, Run, find_run, no_usable_rank, with_inventory
from fsdpprof.analyze.load.memory_budget import inflated_size
from fsdpprof.analyze.trace.labels import concat_events
from fsdpprof.analyze.trace.load import load_trace, load_trace_parts
from fsdpprof.errors import UserError, unexpected_as_user_error


@dataclass
class LoadedRank:
    """One rank ready to analyse: its inventory read and its trace parsed (``trace_path`` None when that failed),
    and what went wrong, one line each."""

    rank: RankData
    warnings: list[str] = field(default_factory=list)   # malformed parts of the trace, left out
    inventory_error: str | None = None                  # why its inventory.json cannot be used
    trace_error: str | None = None                      # why its trace cannot be used


def load_rank(rd: RankData, *, max_bytes: int | None = None, progress: bool | None = False,
              inventory: bool = True) -> LoadedRank:
    """The rank's inventory read (with ``inventory``) and its trace parsed, unless its events are there already.
    ``max_bytes``: largest trace JSON accepted once decompressed."""
    why_inventory = None
    if inventory:
        rd, why_inventory = with_inventory(rd)
    if rd.events is not None or not rd.trace_path:
        return LoadedRank(rd, inventory_error=why_inventory)
    path = rd.trace_path
    try:
        if not os.access(path, os.R_OK):
            raise UserError(f"trace {path} cannot be read (permission denied); fix its permissions or run as its owner")
        if rd.trace_pid is not None:     # one rank of a merged timeline
            val = load_trace_parts(path, {rd.trace_pid: (rd.rank, rd.trace_meta)}, progress=progress,
                                   max_bytes=max_bytes)[rd.rank]
            if isinstance(val, UserError):      # (the rank's events were deleted from the timeline)
                raise val
        else:
            val = load_trace(path, rank=rd.rank, progress=progress, max_bytes=max_bytes)
    except (UserError, MemoryError) as exc:
        why = str(exc) if isinstance(exc, UserError) else \
            f"trace {path}: out of memory while decoding; analyse fewer ranks at once (--workers 1)"
        return LoadedRank(replace(rd, trace_path=None), inventory_error=why_inventory, trace_error=why)
    rd = replace(rd, events=val.events, memory_events=val.memory_events, trace_meta={**val.meta, **rd.trace_meta})
    return LoadedRank(rd, list(val.warnings), why_inventory)


def unread_trace_sizes(rds) -> list[int]:
    """Bytes of JSON in each trace of ``rds`` (0: none, or read already)."""
    return [inflated_size(rd.trace_path) if rd.events is None and rd.trace_path else 0 for rd in rds]


def map_run(run: Run, job, kwargs_of, failed, why_of, *, engine: str | None = None, workers: int | None = None,
            scheduler: str | None = None, preload: tuple = (), here_kwargs: dict | None = None,
            progress: bool | None = False) -> list[tuple[RankData, object, dict | None]]:
    """``job(rd, **kwargs_of(rd))`` on every rank of ``run``, each where :mod:`engines` runs it (ranks already
    parsed, or all when one local process will do: here, with ``here_kwargs``); (rd, result, its stats) in rank
    order, ``failed(rd, why)`` the result of a job that gave none.  ``progress``: a line per rank (``why_of``)."""
    engine = engines.check_engine(engine, scheduler)
    engines.check_workers(workers)
    rds = [run.ranks[r] for r in sorted(run.ranks)]
    here = [rd for rd in rds if rd.events is not None]        # parsed already: sending them costs more
    away = [rd for rd in rds if rd.events is None]
    if engine == "local":
        workers = engines.local_workers(workers, unread_trace_sizes(away), run.max_memory)
        if workers <= 1 or len(away) <= 1:
            here, away = rds, []
    out: dict[int, tuple] = {}
    t0 = time.perf_counter()
    for batch, where, n, extra in ((here, "local", 1, here_kwargs or {}), (away, engine, workers, {})):
        jobs = [((rd,), {**kwargs_of(rd), **extra}) for rd in batch]
        for i, ok, value in engines.map_unordered(job, jobs, engine=where, workers=n, scheduler=scheduler,
                                                  preload=preload):
            rd = batch[i]
            out[rd.rank] = (rd, *value) if ok else (rd, failed(rd, str(value)), None)
            if progress and len(rds) > 1:
                why = why_of(out[rd.rank][1])
                print(f"fsdpprof: rank {rd.rank} {f'missing: {why}' if why else 'analysed'} "
                      f"({time.perf_counter() - t0:.1f} s, {len(out)}/{len(rds)})", file=sys.stderr, flush=True)
    return [out[r] for r in sorted(out)]


def load_events(run: Run, *, workers: int | None = None, progress: bool | None = None) -> Run:
    """Parse the traces of a lazily loaded run into its RankData, in place (here, or in processes for big traces:
    engines.local_workers); a rank whose trace fails moves to ``run.missing`` (kept with a snapshot or inventory)."""
    load_parts(run, progress=progress)
    rds = [rd for _, rd in sorted(run.ranks.items()) if rd.events is None and rd.trace_path]
    jobs = [((rd,), {"max_bytes": run.max_trace_bytes, "progress": progress, "inventory": False}) for rd in rds]
    workers = engines.local_workers(workers, unread_trace_sizes(rds), run.max_memory)
    loaded = {i: value[0] if ok else f"{value}; retry with workers=1"
              for i, ok, value in engines.map_unordered(load_rank, jobs, workers=workers)}
    for i, rd in enumerate(rds):     # (in rank order: the warnings are said in that order)
        lr = loaded[i]
        if isinstance(lr, LoadedRank) and lr.trace_error is None:
            run.warnings += lr.warnings
            dist = lr.rank.trace_meta.get("distributedInfo")
            meta_rank = dist.get("rank") if isinstance(dist, dict) else None
            if isinstance(meta_rank, int) and meta_rank != rd.rank and run.source != SOURCE_RUN_DIR:
                run.warnings.append(f"trace {rd.trace_path}: its distributedInfo says rank {meta_rank} "
                                    f"(past its first MiB), analysed as rank {rd.rank}")
            rd.events, rd.memory_events, rd.trace_meta = lr.rank.events, lr.rank.memory_events, lr.rank.trace_meta
            continue
        run.missing[rd.label] = lr.trace_error if isinstance(lr, LoadedRank) else lr
        rd.trace_path = None
        if rd.snapshot_path is None and rd.inventory is None and rd.inventory_path is None:
            del run.ranks[rd.rank]
    if not run.ranks:
        raise no_usable_rank(run.missing, f"no usable trace in {run.path}", "no trace")
    return run


def load_run(path, *, workers: int | None = None, progress: bool | None = None, lazy: bool = False,
             max_trace_bytes: int | None = None, max_memory: int | None = None) -> Run:
    """A run directory, trace folder, single trace, snapshot file or snapshot folder, its traces read (``lazy``:
    not read, each is read by whoever analyses its rank).  ``max_trace_bytes``: largest trace JSON accepted once
    decompressed; ``max_memory``: the memory budget (bytes) that sets how many ranks are read at once (default:
    a share of the available memory).  Bad input raises :class:`fsdpprof.errors.UserError`, never another
    exception."""
    run = find_run(path, workers=workers, max_trace_bytes=max_trace_bytes, max_memory=max_memory,
                   inventories=not lazy)
    with unexpected_as_user_error(f"{os.fspath(path)}"):
        if lazy:    # (a merged timeline is read here, once for all its ranks)
            return load_parts(run, progress=progress)
        return load_events(run, workers=workers, progress=progress)


def load_parts(run: Run, *, progress: bool | None = None) -> Run:
    """Parse the merged timelines of a run (ranks with a ``trace_pid``) in place: each file once, every rank of it
    at once (a file that fails moves its ranks to ``run.missing``)."""
    files: dict[str, list[RankData]] = {}
    for rd in run.ranks.values():
        if rd.events is None and rd.trace_path and rd.trace_pid is not None:
            files.setdefault(rd.trace_path, []).append(rd)
    for path, rds in files.items():
        try:
            parts = load_trace_parts(path, {rd.trace_pid: (rd.rank, rd.trace_meta) for rd in rds},
                                     progress=progress, max_bytes=run.max_trace_bytes)
        except UserError as exc:
            for rd in rds:
                run.missing[rd.label] = str(exc)
                del run.ranks[rd.rank]
            continue
        for rd in rds:
            val = parts[rd.rank]
            if isinstance(val, UserError):      # listed, but no event of it in the file: missing, counted out
                run.missing[rd.label] = str(val)
                del run.ranks[rd.rank]
                continue
            run.warnings += [w for w in val.warnings if w not in run.warnings]
            rd.events, rd.memory_events, rd.trace_meta = val.events, val.memory_events, {**val.meta, **rd.trace_meta}
    if not run.ranks:
        raise no_usable_rank(run.missing, f"no usable trace in {run.path}", "no trace")
    return run


def run_events(run: Run) -> pd.DataFrame:
    """All ranks' events concatenated (model.EVENT_COLUMNS, categoricals kept); a lazily loaded run parses its
    traces now (and keeps them)."""
    if any(r.events is None and r.trace_path for r in run.ranks.values()):
        load_events(run)
    frames = [r.events for _, r in sorted(run.ranks.items()) if r.events is not None]
    if frames:
        return concat_events(frames)
    df = pd.DataFrame({c: [] for c in model.EVENT_COLUMNS})
    return df.astype({c: "category" for c in model.CATEGORICAL_EVENT_COLUMNS})
