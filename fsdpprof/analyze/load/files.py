"""Find a run's files: our run directory, a folder of profiler traces, one trace, or CUDA snapshots.

``find_run(path)`` returns a :class:`Run` whose traces are not read yet (:mod:`fsdpprof.analyze.load.run` reads
them).  A rank whose files are bad is listed in ``Run.missing`` with a one-line reason; nothing usable at all ->
UserError.  No numpy or pandas here: a bad path is refused before they are imported.  A trace's rank comes from
its ``distributedInfo``, else from its file name (``rank-3``, ``worker3``), else from its position (warned).
"""
from __future__ import annotations

import errno
import gzip
import json
import os
import re
import stat
import zlib
from dataclasses import dataclass, field, replace
from typing import TYPE_CHECKING

from fsdpprof import runfmt
from fsdpprof.analyze.load.engines import check_workers
from fsdpprof.analyze.trace.timeline_file import is_timeline, rank_parts, timeline_meta
from fsdpprof.errors import UserError, unexpected_as_user_error

if TYPE_CHECKING:
    import pandas as pd

SOURCE_RUN_DIR = "run_dir"
SOURCE_TRACE_FOLDER = "trace_folder"
SOURCE_TRACE_FILE = "trace_file"
SOURCE_SNAPSHOT_FILE = "snapshot_file"
SOURCE_SNAPSHOT_FOLDER = "snapshot_folder"

_RANK_IN_NAME = [re.compile(p, re.I) for p in (r"(?<![a-z])rank[-_]?(\d+)(?!\d)", r"(?<![a-z])worker[-_]?(\d+)(?!\d)")]
_DIST_INFO = re.compile(rb'"distributedInfo"\s*:\s*')
_SNAPSHOT_SUFFIXES = (".pickle", ".pickle.gz", ".pkl", ".pkl.gz")
_ITERATION_DIR = re.compile(r"^iteration_(\d{1,12})$")
# the start of summary.json / compare.json / tables.json (what fsdpprof report / compare write): never a trace
OUTPUT_JSON_MARK = re.compile(rb'\s*\{\s*"schema"\s*:\s*"fsdpprof\.(?:summary|compare|tables)/[0-9]+"')


@dataclass
class RankData:
    """One rank's files, and its frames once parsed (``events`` None: not parsed yet, or no trace)."""

    rank: int
    info: dict                                   # rank.json, or derived from the trace's distributedInfo
    inventory: dict | None = None                # inventory.json
    trace_path: str | None = None
    events: pd.DataFrame | None = None           # model.EVENT_COLUMNS
    memory_events: pd.DataFrame | None = None    # model.MEMORY_EVENT_COLUMNS
    snapshot_path: str | None = None             # CUDA snapshot of this rank
    trace_meta: dict = field(default_factory=dict)   # distributedInfo, deviceProperties, baseTimeNanoseconds, ...
    label: str = ""                              # rank-3, or the file's name: how messages name this rank
    inventory_path: str | None = None            # lazily loaded run: inventory.json, read where the rank is analysed
    trace_pid: int | None = None                 # the rank's process in a merged timeline (trace_path: every rank)


@dataclass
class Run:
    """A loaded run: where it came from, its ranks, what is missing and why, warnings (one line each)."""

    path: str
    source: str                          # one of the SOURCE_* above
    meta: dict                           # run.json ({} when not ours)
    ranks: dict[int, RankData]
    missing: dict[str, str] = field(default_factory=dict)   # rank or file label -> one-line reason
    warnings: list[str] = field(default_factory=list)
    world_size: int | None = None
    inputs: list[str] = field(default_factory=list)   # every file read (or offered) as input: never an output
    max_trace_bytes: int | None = None   # largest trace JSON accepted once decompressed (None: the default)
    max_memory: int | None = None        # the memory budget for ranks analysed at once (None: memory_budget's)

    def record_folders(self) -> list[str]:
        """Folders of a run directory that ``fsdpprof record`` wrote (rank-*/, launchers/): never an output's."""
        return sorted({os.path.dirname(f) for f in self.inputs} - {self.path}) if self.source == SOURCE_RUN_DIR else []


def rank_from_name(path: str) -> int | None:
    """The rank an explicit pattern in a file name gives (``rank-3``, ``rank3_trace``, ``worker_3``), or None."""
    for pat in _RANK_IN_NAME:
        m = pat.search(os.path.basename(path))
        if m:
            return int(m.group(1))
    return None


def iteration_folders(path: str) -> dict[int, str]:
    """torchtitan's layout, one folder per profiling window (``iteration_<s>/rank<r>_trace.json``, or one folder
    deeper): s -> the folder holding that window's traces; {} when ``path`` holds traces itself."""
    try:
        entries = sorted(os.listdir(path))
    except OSError:
        return {}
    if any(_looks_like_trace(os.path.join(path, e)) for e in entries if os.path.isfile(os.path.join(path, e))):
        return {}
    out: dict[int, str] = {}
    for e in entries:
        m = _ITERATION_DIR.match(e)
        d = os.path.join(path, e)
        if not m or not os.path.isdir(d):
            continue
        try:
            sub = sorted(os.path.join(d, x) for x in os.listdir(d) if os.path.isdir(os.path.join(d, x)))
            folder = next((f for f in [d] + sub if _window_traces(f)), None)
        except OSError:
            continue
        if folder:
            out[int(m.group(1))] = folder
    return out


def _window_traces(folder: str) -> list[str]:
    files = [os.path.join(folder, x) for x in sorted(os.listdir(folder))]
    return [f for f in files if os.path.isfile(f) and _looks_like_trace(f)]


def distributed_info_head(path: str) -> dict:
    """The trace's ``distributedInfo`` when it sits in its first MiB of JSON (read 64 KiB first), else {}."""
    for head, final in _heads(path, (64 << 10, 1 << 20)):
        m = _DIST_INFO.search(head)
        if not m:
            continue
        try:
            doc, _ = json.JSONDecoder().raw_decode(head[m.end():].decode("utf-8", "replace"))
        except (ValueError, RecursionError):
            if final:
                return {}
            continue
        from fsdpprof.analyze.trace.decode import check_distributed_info

        meta = {"distributedInfo": doc}
        check_distributed_info(meta, {})          # implausible ranks and sizes left out, as the full parse does
        return meta.get("distributedInfo") or {}
    return {}


def _is_snapshot(path: str) -> bool:
    return path.lower().endswith(_SNAPSHOT_SUFFIXES)


def _heads(path: str, sizes: tuple[int, ...]):
    """(the first ``size`` bytes of JSON, last or not) for each size in turn, gzip or plain, inflating only as far
    as asked; nothing more once the file is read to its end; nothing at all when it cannot be read."""
    try:
        with open(path, "rb") as fh:
            magic = fh.read(2)
            fh.seek(0)
            with gzip.GzipFile(fileobj=fh) if magic == b"\x1f\x8b" else fh as src:
                head = b""
                for i, size in enumerate(sizes):
                    head += src.read(size - len(head))
                    last = i == len(sizes) - 1 or len(head) < size
                    yield head, last
                    if last:
                        return
    except (OSError, EOFError, zlib.error):   # unreadable or corrupt: the rank's own parse says why
        return


def _looks_like_trace(path: str) -> bool:
    base = os.path.basename(path).lower()
    if not base.endswith((".json", ".json.gz")):
        return False
    heads = _heads(path, (256, 1 << 20))
    head, last = next(heads, (b"", True))
    if OUTPUT_JSON_MARK.match(head):
        return False  # summary.json / compare.json of an earlier report
    if base.startswith("rank-") or ".pt.trace.json" in base:
        return True
    if not last:
        head = next(heads, (b"", True))[0]
    return b'"traceEvents"' in head or b'"distributedInfo"' in head or is_timeline(head)


def no_usable_rank(missing: dict, what: str, nothing: str, one_alone: bool = True) -> UserError:
    """The error for an input none of whose ranks can be used (``missing``: label -> why): ``what: <the first
    reason>`` (``nothing`` when there is none); ``one_alone``: a single reason is the whole line."""
    if not missing:
        return UserError(f"{what}: {nothing}")
    label, why = next(iter(missing.items()))
    line = why if str(label) in why else f"{label}: {why}"
    if len(missing) == 1:
        return UserError(line if one_alone else f"{what}: {line}")
    more = len(missing) - 1
    return UserError(f"{what}: {line}; {more} more rank{'s' if more > 1 else ''} left out")


def _info_from_meta(rank: int, meta: dict) -> dict:
    dist = meta.get("distributedInfo") if isinstance(meta.get("distributedInfo"), dict) else {}
    pgs = [{"name": pg.get("pg_name"), "size": pg.get("pg_size"), "ranks": pg.get("ranks")}
           for pg in dist.get("pg_config") or [] if isinstance(pg, dict)]
    return {"rank": rank, "world_size": dist.get("world_size"), "backend": dist.get("backend"),
            "device": meta.get("device_type"), "process_groups": pgs, "status": "complete", "error": None}


def with_inventory(rd: RankData) -> tuple[RankData, str | None]:
    """The rank with its inventory read (a lazily loaded run keeps only its path), and why it cannot be used."""
    if rd.inventory is not None or not rd.inventory_path:
        return rd, None
    try:
        doc = _read_json(rd.inventory_path, "inventory")
        schema_version(doc, "fsdpprof.inventory", rd.inventory_path)
    except UserError as exc:
        return replace(rd, inventory=None), str(exc)
    return replace(rd, inventory=doc), None


def _read_json(path: str, what: str) -> dict:
    """A run file as the analysis reads it: an integer beyond 64 bits is unknown (None)."""
    try:
        with open(path, "rb") as fh:
            doc = json.loads(fh.read(), parse_int=runfmt.int64_or_none)
    except (OSError, ValueError) as exc:
        raise UserError(f"{what} {path} is unreadable ({exc}); re-record the run") from None
    if not isinstance(doc, dict):
        raise UserError(f"{what} {path} is not a JSON object; re-record the run")
    return doc


_WHAT_TO_GIVE = ("give a run directory (fsdpprof record --out DIR), a folder of profiler traces, a trace file or a "
                 "CUDA snapshot")
_KINDS = {stat.S_IFDIR: "a directory", stat.S_IFIFO: "a named pipe (FIFO)", stat.S_IFSOCK: "a socket",
          stat.S_IFCHR: "a character device", stat.S_IFBLK: "a block device", stat.S_IFLNK: "a symbolic link"}
_NO_PERMISSION = "fix its permissions (chmod) or run as its owner"


def file_kind(mode: int) -> str:
    """What a path is, from its stat mode: 'a directory', 'a named pipe (FIFO)', ... ('a regular file')."""
    return "a regular file" if stat.S_ISREG(mode) else _KINDS.get(stat.S_IFMT(mode), "not a regular file")


def check_input_path(path: str) -> bool:
    """UserError (one line) unless ``path`` is a readable regular file or folder; True for a folder."""
    try:
        st = os.stat(path)
    except OSError as exc:
        if exc.errno == errno.ELOOP:
            raise UserError(f"{path} is a loop of symbolic links; {_WHAT_TO_GIVE}") from None
        if exc.errno == errno.ENOENT and os.path.islink(path):
            raise UserError(f"{path} is a symbolic link to {os.readlink(path)}, which does not exist; "
                            f"{_WHAT_TO_GIVE}") from None
        if exc.errno in (errno.ENOENT, errno.ENOTDIR):
            raise UserError(f"{path} does not exist; {_WHAT_TO_GIVE}") from None
        if exc.errno == errno.EACCES:
            raise UserError(f"{path} cannot be reached (permission denied on a folder above it); "
                            f"fix the permissions or run as its owner") from None
        raise UserError(f"{path} cannot be opened ({exc.strerror}); {_WHAT_TO_GIVE}") from None
    if stat.S_ISDIR(st.st_mode):
        if not os.access(path, os.R_OK | os.X_OK):
            raise UserError(f"folder {path} cannot be read (permission denied); {_NO_PERMISSION}")
        return True
    if not stat.S_ISREG(st.st_mode):
        raise UserError(f"{path} is {file_kind(st.st_mode)}, neither a file nor a folder; {_WHAT_TO_GIVE}")
    if not os.access(path, os.R_OK):
        raise UserError(f"{path} cannot be read (permission denied); {_NO_PERMISSION}")
    return False


# newest version of each run-directory file this fsdpprof reads (schema "<family>/<version>")
_SCHEMAS = {family: int(version) for family, version in
            (s.rsplit("/", 1) for s in (runfmt.RUN_SCHEMA, runfmt.RANK_SCHEMA, runfmt.INVENTORY_SCHEMA))}


def schema_version(doc, family: str, path: str) -> int | None:
    """Version of an fsdpprof file's ``schema`` (``fsdpprof.run/1`` -> 1); None when it is not ``family``'s;
    UserError when it is newer than this fsdpprof reads, or not a version number."""
    s = doc.get("schema") if isinstance(doc, dict) else None
    if not isinstance(s, str) or not s.startswith(family + "/"):
        return None
    shown = s if len(s) <= 60 else s[:57] + "..."
    ver = s[len(family) + 1:]
    if not re.fullmatch(r"[0-9]{1,9}", ver):
        raise UserError(f"{path} has schema {shown!r}, which this fsdpprof does not know "
                        f"(it reads {family}/{_SCHEMAS[family]}); re-record the run or upgrade fsdpprof")
    if int(ver) > _SCHEMAS[family]:
        raise UserError(f"{path} was written by a newer fsdpprof (schema {shown}; this one reads up to "
                        f"{family}/{_SCHEMAS[family]}); upgrade fsdpprof")
    return int(ver)


def read_run_json(path: str) -> tuple[dict | None, str | None]:
    """(run.json, None) when ``path`` is an fsdpprof run file; (None, why not) otherwise."""
    try:
        doc = _read_json(path, "run file")
    except UserError as exc:
        return None, str(exc)
    if schema_version(doc, "fsdpprof.run", path) is None:
        s = doc.get("schema")
        said = f"schema {str(s)[:60]!r}" if s is not None else "no schema"
        return None, f"{path} is not an fsdpprof run file ({said}, not fsdpprof.run/N): ignored"
    return doc, None


def find_run(path, *, workers: int | None = None, max_trace_bytes: int | None = None,
             max_memory: int | None = None, inventories: bool = False) -> Run:
    """The files of a run directory, a folder of traces, a trace, a CUDA snapshot or a folder of them: a Run whose
    traces are not read yet.  ``inventories``: keep each inventory.json as read (else only its path); ``workers``
    is only checked; ``max_trace_bytes``: largest trace JSON accepted once decompressed; ``max_memory``: the memory
    budget (bytes) that sets how many ranks are analysed at once.  Bad input: UserError."""
    with unexpected_as_user_error(f"{os.fspath(path)}"):
        check_workers(workers)
        if not str(os.fspath(path)).strip():
            raise UserError(f"the path is empty; {_WHAT_TO_GIVE}")
        path = os.path.abspath(os.fspath(path))
        run = _discover_folder(path, lazy=not inventories) if check_input_path(path) else _discover_file(path)
        run.max_trace_bytes, run.max_memory = max_trace_bytes, max_memory
        return run


def _snapshot_rank(rank: int, path: str, **info) -> RankData:
    return RankData(rank=rank, info={"rank": rank, **info}, snapshot_path=path, trace_meta={"device_type": "cuda"},
                    label=os.path.basename(path))


def _discover_file(path: str) -> Run:
    if not _is_snapshot(path):
        return _load_traces(path, [path], SOURCE_TRACE_FILE)
    r = rank_from_name(path)
    rank = r if r is not None and re.search(r"rank", os.path.basename(path), re.I) else 0
    return Run(path=path, source=SOURCE_SNAPSHOT_FILE, meta={}, ranks={rank: _snapshot_rank(rank, path)},
               inputs=[path])


def _discover_folder(path: str, lazy: bool) -> Run:
    try:
        entries = sorted(os.listdir(path))
    except OSError as exc:
        raise UserError(f"folder {path} cannot be listed ({exc.strerror}); fix its permissions or run as its "
                        f"owner") from None
    run_json = os.path.join(path, runfmt.RUN_JSON)
    meta, why_not = read_run_json(run_json) if os.path.isfile(run_json) else (None, None)
    has_ranks = any(runfmt.rank_of_dir(e) is not None and os.path.isfile(os.path.join(path, e, runfmt.RANK_JSON))
                    for e in entries)
    if meta is not None or has_ranks:
        return _load_run_dir(path, entries, meta or {}, why_not, lazy)
    files = [os.path.join(path, e) for e in entries if os.path.isfile(os.path.join(path, e))]
    snaps = [f for f in files if _is_snapshot(f)]
    traces = [f for f in files if _looks_like_trace(f)]
    if traces:
        run = _load_traces(path, traces, SOURCE_TRACE_FOLDER)
        run.inputs += snaps
        run.warnings += [why_not] if why_not else []
        return run
    windows = iteration_folders(path) if not snaps else {}
    if windows:      # torchtitan: one folder per profiling window; the latest is past the warm-up
        last = max(windows)
        run = _load_traces(windows[last], _window_traces(windows[last]), SOURCE_TRACE_FOLDER)
        if len(windows) > 1:
            run.warnings.append(f"{path} holds {len(windows)} profiling windows (iteration_{min(windows)} ... "
                                f"iteration_{last}): analysed the latest, {windows[last]}; point at another "
                                f"iteration_<s> folder to analyse that one")
        return run
    if not snaps:
        raise UserError(f"{path} holds no run directory (run.json, rank-*/), no profiler traces (*.json[.gz] with "
                        f"traceEvents) and no CUDA snapshots (*.pickle); point fsdpprof at one of those")
    ranks, warnings = {}, []
    for i, f in enumerate(snaps):
        r = rank_from_name(f)
        if r is None:
            r = i
            warnings.append(f"snapshot {f}: no rank in the file name (rank-N, rankN, workerN), taken as rank {r} "
                            f"from its position among the snapshots")
        if r in ranks:
            raise UserError(f"folder {path} has two snapshots for rank {r} ("
                            f"{os.path.basename(ranks[r].snapshot_path)}, {os.path.basename(f)}); keep one per rank")
        ranks[r] = _snapshot_rank(r, f)
    return Run(path=path, source=SOURCE_SNAPSHOT_FOLDER, meta={}, ranks=ranks, warnings=warnings, inputs=snaps)


def _trace_ranks(f: str, i: int, warnings: list[str]) -> list[RankData]:
    """The ranks of trace file ``f`` (the ``i``-th given): every rank of a merged timeline, else one."""
    label = os.path.basename(f)
    merged = timeline_meta(f)
    if merged is not None:
        out = []
        for part in rank_parts(merged, f):
            rank, meta = part["rank"], dict(part.get("trace") or {})
            inventory = part.get("inventory") if isinstance(part.get("inventory"), dict) else None
            out.append(RankData(rank=rank, info=dict(part.get("info") or {}) or _info_from_meta(rank, meta),
                                inventory=inventory, trace_path=f, trace_meta=meta, label=f"{label}:rank-{rank}",
                                trace_pid=part["pid"]))
        return out
    dist = distributed_info_head(f)
    rank = dist.get("rank") if isinstance(dist.get("rank"), int) and not isinstance(dist.get("rank"), bool) else None
    if rank is None:
        rank, how = rank_from_name(f), "from the file name"
        if rank is None:
            rank, how = i, "from its position among the traces (no rank-N / rankN / workerN in its name)"
        warnings.append(f"trace {f} has no distributedInfo: rank {rank} taken {how}")
    meta = {"distributedInfo": dist} if dist else {}
    return [RankData(rank=rank, info=_info_from_meta(rank, {"distributedInfo": dist}), trace_path=f, trace_meta=meta,
                     label=label)]


def _load_traces(root: str, traces: list[str], source: str) -> Run:
    """Ranks of trace files from their distributedInfo (first MiB), else the file name, else their position."""
    ranks: dict[int, RankData] = {}
    warnings: list[str] = []
    world_sizes: dict[int, list[str]] = {}
    for i, f in enumerate(traces):
        for rd in _trace_ranks(f, i, warnings):
            if rd.rank in ranks:
                raise UserError(f"folder {root} has two traces for rank {rd.rank} ({ranks[rd.rank].label}, "
                                f"{os.path.basename(f)}): it mixes runs; keep one trace per rank")
            dist = rd.trace_meta.get("distributedInfo")
            if isinstance(dist, dict) and isinstance(dist.get("world_size"), int):
                ws = dist["world_size"]
                world_sizes.setdefault(ws, []).append(os.path.basename(f))
            ranks[rd.rank] = rd
    if len(world_sizes) > 1:
        desc = "; ".join(f"world_size {ws}: {', '.join(sorted(ls)[:3])}" for ws, ls in sorted(world_sizes.items()))
        raise UserError(f"folder {root} mixes traces of different runs ({desc}); put each run's traces in its own "
                        f"folder")
    return Run(path=root, source=source, meta={}, ranks=ranks, warnings=warnings,
               world_size=next(iter(world_sizes), None), inputs=list(traces))


def _liveness(root: str, meta: dict, warnings: list[str]) -> tuple[dict, str | None]:
    """run.json as the report shows it (a run left ``running`` by a launcher that is gone is ``interrupted``,
    warned; the file is not changed) and, when it says running, the run's state: alive, unknown, or None."""
    if meta.get("status") != runfmt.STATUS_RUNNING:
        return meta, None
    state, launchers = runfmt.run_liveness(root)
    if state == runfmt.LIVENESS_GONE:
        warnings.append(f"run.json says running, but no launcher of this run is alive ({launchers}): the run was "
                        "interrupted (its launcher was killed); showing what the ranks saved")
        return dict(meta, status=runfmt.STATUS_INTERRUPTED), None
    if state == runfmt.LIVENESS_UNKNOWN:
        warnings.append(f"run.json says running; its launcher ({launchers}) runs on another host and cannot be "
                        "checked from here: the run may still be going or may have been interrupted")
    else:
        warnings.append(f"the run is still being recorded ({launchers}): the figures cover what was saved so far")
    return meta, state


# why a rank has saved nothing (yet), by the run's state (_liveness): still recording, perhaps, or not
_NOT_SAVED_YET = {runfmt.LIVENESS_ALIVE: "not saved yet: the run is still being recorded",
                  runfmt.LIVENESS_UNKNOWN: "not saved yet, or never: the run may still be being recorded on another "
                                           "host"}


def _files_under(directory: str) -> list[str]:
    """Regular files in ``directory`` and its sub-folders (symbolic links not followed)."""
    paths = (os.path.join(d, n) for d, _, names in os.walk(directory) for n in names)
    return [p for p in paths if os.path.isfile(p)]


def _read_rank_file(path: str, what: str, family: str, warnings: list[str], default=None):
    """A rank's JSON file as read (``default`` when it is unreadable, warned); UserError for a newer schema."""
    doc = default
    try:
        doc = _read_json(path, what)
    except UserError as exc:
        warnings.append(str(exc))
    schema_version(doc, family, path)
    return doc


def _load_run_dir(root: str, entries: list[str], meta: dict, run_json_note: str | None, lazy: bool) -> Run:
    """``lazy``: each inventory is checked here and then dropped (its path kept): the rank's analysis reads it
    where it runs, so that this process does not hold every rank's tensor list."""
    warnings: list[str] = [run_json_note] if run_json_note else []
    missing: dict[str, str] = {}
    inputs = [os.path.join(root, runfmt.RUN_JSON)] + _files_under(os.path.join(root, runfmt.LAUNCHERS_DIR))
    meta, recording = _liveness(root, meta, warnings)
    warnings += [runfmt.clash_text(doc) for doc in runfmt.read_clashes(root)]
    rank_dirs = {r: os.path.join(root, e) for e in entries
                 if (r := runfmt.rank_of_dir(e)) is not None and os.path.isdir(os.path.join(root, e))}
    infos: dict[int, dict] = {}
    ranks: dict[int, RankData] = {}
    for r, d in sorted(rank_dirs.items()):
        label = f"rank-{r}"
        inputs += _files_under(d)
        info_path, inv_path = os.path.join(d, runfmt.RANK_JSON), os.path.join(d, runfmt.INVENTORY_JSON)
        info = infos[r] = _read_rank_file(info_path, "rank file", "fsdpprof.rank", warnings, {"rank": r}) \
            if os.path.isfile(info_path) else {"rank": r}
        inv = lazy_path = unreadable = None
        if os.path.isfile(inv_path):
            inv = _read_rank_file(inv_path, "inventory", "fsdpprof.inventory", warnings)
            unreadable = inv_path if inv is None else None   # (with_inventory says why, where it is analysed)
            if lazy and inv is not None:
                inv, lazy_path = None, inv_path
        snap = os.path.join(d, runfmt.SNAPSHOT_FILE)
        snap = snap if os.path.isfile(snap) else None
        tpath = os.path.join(d, runfmt.TRACE_FILE)
        rd = RankData(rank=r, info=info, inventory=inv, trace_path=tpath, snapshot_path=snap, label=label,
                      inventory_path=lazy_path or unreadable)
        if os.path.isfile(tpath):
            ranks[r] = rd
            continue
        st = info.get("status")
        reason = _NOT_SAVED_YET.get(recording) or info.get("error") or (f"status {st}" if st else "no trace file")
        if not os.access(d, os.R_OK | os.X_OK):
            reason = f"folder {d} cannot be read: permission denied"
        missing[label] = f"no {runfmt.TRACE_FILE} ({reason})"
        if snap is not None or inv is not None or lazy_path:     # still useful for memory attribution
            ranks[r] = replace(rd, trace_path=None)
    expected = meta.get("ranks_expected")
    ws = meta.get("world_size") if isinstance(meta.get("world_size"), int) else None
    if ws is None:
        ws = next((i["world_size"] for i in infos.values() if isinstance(i.get("world_size"), int)), None)
    if isinstance(expected, int) and ws is None:
        ws = expected
    n_expected = expected if isinstance(expected, int) else ws
    for r in range(n_expected if isinstance(n_expected, int) else 0):
        if r not in rank_dirs:
            why = _NOT_SAVED_YET.get(recording) or "the rank did not record or died early"
            missing.setdefault(f"rank-{r}", f"no rank directory ({why})")
    sizes = {info.get("world_size") for info in infos.values() if isinstance(info.get("world_size"), int)}
    if len(sizes) > 1:
        raise UserError(f"run directory {root} mixes ranks of different runs (world sizes {sorted(sizes)}); "
                        f"record each run into its own --out folder")
    aside = sorted(r for r, info in infos.items() if info.get("status") == runfmt.RANK_STEPPED_ASIDE)
    if aside and len(aside) == len(infos) and not any(rd.trace_path or rd.snapshot_path for rd in ranks.values()):
        raise UserError(f"fsdpprof stepped aside in {root}: the job ran its own torch.profiler, so fsdpprof recorded "
                        "no trace; report the job's own trace (fsdpprof report TRACE) or record without its profiler")
    if aside:
        warnings.append(f"fsdpprof stepped aside on rank{'s' if len(aside) > 1 else ''} {', '.join(map(str, aside))}: "
                        "the job ran its own torch.profiler there, so those ranks have no trace")
    if not ranks:
        raise no_usable_rank(missing, f"run directory {root} has no usable rank", "no rank recorded", one_alone=False)
    return Run(path=root, source=SOURCE_RUN_DIR, meta=meta, ranks=ranks, missing=missing, warnings=warnings,
               world_size=ws, inputs=inputs)
