"""Load a run: our run directory, a folder of profiler traces, one trace, or CUDA snapshots.

``load_run(path)`` finds each rank's files, parses the traces in parallel processes (one pure
function per rank: :func:`fsdpprof.analyze.trace.load_trace`), and returns a :class:`Run`.  A rank
whose files are bad is listed in ``Run.missing`` with a one-line reason; the others are analysed.
Nothing usable at all -> :class:`fsdpprof.errors.UserError`.
"""
from __future__ import annotations

import concurrent.futures as cf
import gzip
import multiprocessing
import os
import re
from dataclasses import dataclass, field

import pandas as pd

from fsdpprof import runfmt
from fsdpprof.analyze import schema
from fsdpprof.errors import UserError, unexpected_as_user_error

SOURCE_RUN_DIR = "run_dir"
SOURCE_TRACE_FOLDER = "trace_folder"
SOURCE_TRACE_FILE = "trace_file"
SOURCE_SNAPSHOT_FILE = "snapshot_file"
SOURCE_SNAPSHOT_FOLDER = "snapshot_folder"

_RANK_IN_NAME = [re.compile(p, re.I) for p in (r"rank[-_]?(\d+)", r"worker[-_]?(\d+)", r"(\d+)(?!.*\d)")]
_SNAPSHOT_SUFFIXES = (".pickle", ".pickle.gz", ".pkl", ".pkl.gz")


@dataclass
class RankData:
    rank: int
    info: dict                           # rank.json, or derived from the trace's distributedInfo
    inventory: dict | None               # inventory.json
    trace_path: str | None
    events: pd.DataFrame | None          # schema.EVENT_COLUMNS
    memory_events: pd.DataFrame | None   # schema.MEMORY_EVENT_COLUMNS
    snapshot_path: str | None            # CUDA snapshot of this rank
    trace_meta: dict = field(default_factory=dict)   # distributedInfo, deviceProperties, baseTimeNanoseconds, device_type


@dataclass
class Run:
    path: str
    source: str                          # run_dir | trace_folder | trace_file | snapshot_file | snapshot_folder
    meta: dict                           # run.json ({} when not ours)
    ranks: dict[int, RankData]
    missing: dict[str, str]              # rank or file label -> one-line reason
    warnings: list[str]
    world_size: int | None

    def events(self) -> pd.DataFrame:
        """All ranks' events concatenated (schema.EVENT_COLUMNS), categoricals kept."""
        frames = [r.events for _, r in sorted(self.ranks.items()) if r.events is not None]
        if not frames:
            return empty_events()
        if len(frames) == 1:
            return frames[0]
        out = pd.concat(frames, ignore_index=True)
        for c in ("lane", "kind", "name", "collective", "dtype", "pg", "phase", "unit"):
            if out[c].dtype == object:
                out[c] = out[c].astype("category")
        return out

    def memory_events(self) -> pd.DataFrame:
        frames = [r.memory_events for _, r in sorted(self.ranks.items()) if r.memory_events is not None]
        if not frames:
            return pd.DataFrame({c: [] for c in schema.MEMORY_EVENT_COLUMNS})
        return pd.concat(frames, ignore_index=True)


def empty_events() -> pd.DataFrame:
    df = pd.DataFrame({c: [] for c in schema.EVENT_COLUMNS})
    for c in ("lane", "kind", "name", "collective", "dtype", "pg", "phase", "unit"):
        df[c] = df[c].astype("category")
    return df


def rank_from_name(path: str) -> int | None:
    base = os.path.basename(path)
    for pat in _RANK_IN_NAME:
        m = pat.search(base)
        if m:
            return int(m.group(1))
    return None


def _is_snapshot(path: str) -> bool:
    return path.lower().endswith(_SNAPSHOT_SUFFIXES)


def _head(path: str, nbytes: int = 1 << 20) -> bytes:
    try:
        with open(path, "rb") as fh:
            magic = fh.read(2)
            fh.seek(0)
            if magic == b"\x1f\x8b":
                with gzip.GzipFile(fileobj=fh) as gz:
                    return gz.read(nbytes)
            return fh.read(nbytes)
    except (OSError, EOFError):
        return b""


def _looks_like_trace(path: str) -> bool:
    base = os.path.basename(path).lower()
    if not (base.endswith(".json") or base.endswith(".json.gz")):
        return False
    if base.startswith("rank-") or ".pt.trace.json" in base:
        return True
    head = _head(path)
    return b'"traceEvents"' in head or b'"distributedInfo"' in head


def _parse_one(path: str, rank: int | None, progress: bool | None, max_bytes: int | None = None):
    """Worker: load one trace; returns ('ok', TraceData) or ('error', message)."""
    from fsdpprof.analyze.trace import load_trace
    try:
        return "ok", load_trace(path, rank=rank, progress=progress, max_bytes=max_bytes)
    except UserError as exc:
        return "error", str(exc)
    except MemoryError:
        return "error", f"trace {path}: out of memory while decoding; analyse fewer ranks at once (workers=1)"
    except Exception as exc:  # a bug or an unexpected format: report it for this rank, keep the others
        return "error", f"trace {path}: could not be analysed ({type(exc).__name__}: {exc})"


POOL_MIN_BYTES = 64 << 20   # parse in worker processes (auto mode) only when the traces hold this much JSON


def _inflated_size(path: str) -> int:
    """Bytes of JSON in a trace file: the gzip trailer's size for .gz (last member), else the file size."""
    try:
        with open(path, "rb") as fh:
            if fh.read(2) != b"\x1f\x8b":
                return os.fstat(fh.fileno()).st_size
            size = os.fstat(fh.fileno()).st_size
            fh.seek(-4, os.SEEK_END)
            return max(int.from_bytes(fh.read(4), "little"), size)
    except OSError:
        return 0


def _parse_all(jobs: list[tuple[str, str, int | None]], workers: int | None, progress: bool | None,
               max_bytes: int | None = None) -> dict:
    """jobs: (label, path, rank override). Returns label -> (status, value)."""
    if not jobs:
        return {}
    if workers is None:
        # processes pay off only when there is enough to parse: their start-up and sending the frames
        # back cost more than small traces take to parse in this process
        small = sum(_inflated_size(path) for _, path, _ in jobs) < POOL_MIN_BYTES
        workers = 1 if small else min(len(jobs), os.cpu_count() or 1)
    if workers <= 1 or len(jobs) == 1:
        return {label: _parse_one(path, rank, progress, max_bytes) for label, path, rank in jobs}
    ctx = multiprocessing.get_context("fork") if hasattr(os, "fork") else None
    out = {}
    with cf.ProcessPoolExecutor(max_workers=workers, mp_context=ctx) as pool:
        futs = {pool.submit(_parse_one, path, rank, progress, max_bytes): label for label, path, rank in jobs}
        for fut in cf.as_completed(futs):
            label = futs[fut]
            try:
                out[label] = fut.result()
            except Exception as exc:  # worker died (e.g. killed for memory)
                out[label] = ("error", f"{label}: worker failed ({type(exc).__name__}: {exc}); retry with workers=1")
    return out


def _info_from_meta(rank: int, meta: dict) -> dict:
    dist = meta.get("distributedInfo") if isinstance(meta.get("distributedInfo"), dict) else {}
    pgs = []
    for pg in dist.get("pg_config") or []:
        if isinstance(pg, dict):
            pgs.append({"name": pg.get("pg_name"), "size": pg.get("pg_size"), "ranks": pg.get("ranks")})
    return {"rank": rank, "world_size": dist.get("world_size"), "backend": dist.get("backend"),
            "device": meta.get("device_type"), "process_groups": pgs, "status": "complete", "error": None}


def _read_json(path: str, what: str) -> dict:
    try:
        doc = runfmt.read_json(path)
    except (OSError, ValueError) as exc:
        raise UserError(f"{what} {path} is unreadable ({exc}); re-record the run") from None
    if not isinstance(doc, dict):
        raise UserError(f"{what} {path} is not a JSON object; re-record the run")
    return doc


def load_run(path, *, workers: int | None = None, progress: bool | None = None,
             max_trace_bytes: int | None = None) -> Run:
    """Load a run directory, trace folder, single trace, snapshot file or snapshot folder.
    ``max_trace_bytes``: largest trace JSON accepted once decompressed (default trace.MAX_TRACE_BYTES).
    Bad input raises :class:`fsdpprof.errors.UserError`, never another exception."""
    with unexpected_as_user_error(f"{os.fspath(path)}"):
        return _load_run(path, workers, progress, max_trace_bytes)


def _load_run(path, workers: int | None, progress: bool | None, max_trace_bytes: int | None) -> Run:
    path = os.path.abspath(os.fspath(path))
    if not os.path.exists(path):
        raise UserError(f"{path} does not exist; pass a run directory, a folder of traces or a trace file")
    if os.path.isfile(path):
        if _is_snapshot(path):
            r = rank_from_name(path)
            rank = r if r is not None and re.search(r"rank", os.path.basename(path), re.I) else 0
            rd = RankData(rank=rank, info={"rank": rank}, inventory=None, trace_path=None, events=None,
                          memory_events=None, snapshot_path=path, trace_meta={"device_type": "cuda"})
            return Run(path=path, source=SOURCE_SNAPSHOT_FILE, meta={}, ranks={rank: rd}, missing={}, warnings=[],
                       world_size=None)
        return _load_traces(path, [path], SOURCE_TRACE_FILE, workers, progress, max_trace_bytes)
    entries = sorted(os.listdir(path))
    if os.path.isfile(os.path.join(path, runfmt.RUN_JSON)) or any(
            e.startswith(runfmt.RANK_DIR_PREFIX) and os.path.isfile(os.path.join(path, e, runfmt.RANK_JSON))
            for e in entries):
        return _load_run_dir(path, entries, workers, progress, max_trace_bytes)
    files = [os.path.join(path, e) for e in entries if os.path.isfile(os.path.join(path, e))]
    traces = [f for f in files if _looks_like_trace(f)]
    if traces:
        return _load_traces(path, traces, SOURCE_TRACE_FOLDER, workers, progress, max_trace_bytes)
    snaps = [f for f in files if _is_snapshot(f)]
    if snaps:
        ranks, warnings = {}, []
        for i, f in enumerate(snaps):
            r = rank_from_name(f)
            if r is None:
                r = i
                warnings.append(f"snapshot {f}: no rank in the file name, taken as rank {r}")
            if r in ranks:
                raise UserError(f"folder {path} has two snapshots for rank {r} ({os.path.basename(ranks[r].snapshot_path)}, "
                                f"{os.path.basename(f)}); keep one per rank")
            ranks[r] = RankData(rank=r, info={"rank": r}, inventory=None, trace_path=None, events=None,
                                memory_events=None, snapshot_path=f, trace_meta={"device_type": "cuda"})
        return Run(path=path, source=SOURCE_SNAPSHOT_FOLDER, meta={}, ranks=ranks, missing={}, warnings=warnings,
                   world_size=None)
    raise UserError(f"{path} holds no run directory (run.json, rank-*/), no profiler traces (*.json[.gz] with "
                    f"traceEvents) and no CUDA snapshots (*.pickle); point fsdpprof at one of those")


def _load_traces(root: str, traces: list[str], source: str, workers, progress, max_bytes=None) -> Run:
    jobs = [(os.path.basename(f), f, None) for f in traces]
    results = _parse_all(jobs, workers, progress, max_bytes)
    ranks: dict[int, RankData] = {}
    missing: dict[str, str] = {}
    warnings: list[str] = []
    world_sizes: dict[int, list[str]] = {}
    by_label = {os.path.basename(f): f for f in traces}
    for label in sorted(results):
        status, val = results[label]
        if status != "ok":
            missing[label] = val
            continue
        td = val
        dist = td.meta.get("distributedInfo") if isinstance(td.meta.get("distributedInfo"), dict) else {}
        rank = dist.get("rank") if isinstance(dist.get("rank"), int) else None
        if rank is None:
            rank = rank_from_name(by_label[label])
            if rank is None:
                rank = 0
            warnings.append(f"trace {td.path} has no distributedInfo: rank {rank} taken from the file name")
            if len(td.events):
                td.events["rank"] = pd.array([rank] * len(td.events), dtype="int32").to_numpy()
            td.memory_events["rank"] = rank
        ws = dist.get("world_size")
        if isinstance(ws, int):
            world_sizes.setdefault(ws, []).append(label)
        if rank in ranks:
            raise UserError(f"folder {root} has two traces for rank {rank} ({os.path.basename(ranks[rank].trace_path)}, "
                            f"{label}): it mixes runs; keep one trace per rank")
        warnings += td.warnings
        ranks[rank] = RankData(rank=rank, info=_info_from_meta(rank, td.meta), inventory=None, trace_path=td.path,
                               events=td.events, memory_events=td.memory_events, snapshot_path=None,
                               trace_meta=td.meta)
    if len(world_sizes) > 1:
        desc = "; ".join(f"world_size {ws}: {', '.join(sorted(ls)[:3])}" for ws, ls in sorted(world_sizes.items()))
        raise UserError(f"folder {root} mixes traces of different runs ({desc}); put each run's traces in its own folder")
    if not ranks:
        first = next(iter(missing.values()), "no trace")
        raise UserError(first if len(missing) == 1 else f"no usable trace in {root}: {first}")
    world_size = next(iter(world_sizes), None)
    return Run(path=root, source=source, meta={}, ranks=ranks, missing=missing, warnings=warnings,
               world_size=world_size)


def _load_run_dir(root: str, entries: list[str], workers, progress, max_bytes=None) -> Run:
    meta: dict = {}
    warnings: list[str] = []
    missing: dict[str, str] = {}
    run_json = os.path.join(root, runfmt.RUN_JSON)
    if os.path.isfile(run_json):
        try:
            meta = _read_json(run_json, "run file")
        except UserError as exc:
            warnings.append(str(exc))
    rank_dirs: dict[int, str] = {}
    for e in entries:
        if e.startswith(runfmt.RANK_DIR_PREFIX) and e[len(runfmt.RANK_DIR_PREFIX):].isdigit():
            d = os.path.join(root, e)
            if os.path.isdir(d):
                rank_dirs[int(e[len(runfmt.RANK_DIR_PREFIX):])] = d
    infos: dict[int, dict] = {}
    inventories: dict[int, dict | None] = {}
    jobs = []
    for r, d in sorted(rank_dirs.items()):
        label = f"rank-{r}"
        info_path = os.path.join(d, runfmt.RANK_JSON)
        info = {"rank": r}
        if os.path.isfile(info_path):
            try:
                info = _read_json(info_path, "rank file")
            except UserError as exc:
                warnings.append(str(exc))
        infos[r] = info
        inv_path = os.path.join(d, runfmt.INVENTORY_JSON)
        inventories[r] = None
        if os.path.isfile(inv_path):
            try:
                inventories[r] = _read_json(inv_path, "inventory")
            except UserError as exc:
                warnings.append(str(exc))
        tpath = os.path.join(d, runfmt.TRACE_FILE)
        if os.path.isfile(tpath):
            jobs.append((label, tpath, r))
    results = _parse_all(jobs, workers, progress, max_bytes)
    ranks: dict[int, RankData] = {}
    for r, d in sorted(rank_dirs.items()):
        label = f"rank-{r}"
        info = infos[r]
        snap = os.path.join(d, runfmt.SNAPSHOT_FILE)
        snap = snap if os.path.isfile(snap) else None
        tpath = os.path.join(d, runfmt.TRACE_FILE)
        if label in results and results[label][0] == "ok":
            td = results[label][1]
            warnings += td.warnings
            ranks[r] = RankData(rank=r, info=info, inventory=inventories[r], trace_path=tpath, events=td.events,
                                memory_events=td.memory_events, snapshot_path=snap, trace_meta=td.meta)
            continue
        if label in results:
            missing[label] = results[label][1]
        else:
            st = info.get("status")
            reason = info.get("error") or (f"status {st}" if st else "no trace file")
            missing[label] = f"{label}: no {runfmt.TRACE_FILE} ({reason})"
        if snap is not None or inventories[r] is not None:
            # still useful for memory attribution
            ranks[r] = RankData(rank=r, info=info, inventory=inventories[r], trace_path=None, events=None,
                                memory_events=None, snapshot_path=snap, trace_meta={})
    expected = meta.get("ranks_expected")
    ws = meta.get("world_size") if isinstance(meta.get("world_size"), int) else None
    if ws is None:
        for info in infos.values():
            if isinstance(info.get("world_size"), int):
                ws = info["world_size"]
                break
    if isinstance(expected, int) and ws is None:
        ws = expected
    n_expected = expected if isinstance(expected, int) else ws
    if isinstance(n_expected, int):
        for r in range(n_expected):
            if r not in rank_dirs:
                missing.setdefault(f"rank-{r}", f"rank-{r}: no rank directory (the rank did not record or died early)")
    sizes = {info.get("world_size") for info in infos.values() if isinstance(info.get("world_size"), int)}
    if len(sizes) > 1:
        raise UserError(f"run directory {root} mixes ranks of different runs (world sizes {sorted(sizes)}); "
                        f"record each run into its own --out folder")
    if not ranks:
        first = next(iter(missing.values()), "no rank recorded")
        raise UserError(f"run directory {root} has no usable rank: {first}")
    return Run(path=root, source=SOURCE_RUN_DIR, meta=meta, ranks=ranks, missing=missing, warnings=warnings,
               world_size=ws)
