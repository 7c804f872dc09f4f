"""Constants and small I/O helpers of the run-directory contract (schema ``fsdpprof.run/1``).

Imported by both ``collect`` (inside the user's job: stdlib only) and ``analyze``.
See ../shared/DESIGN.md for the contract itself.
"""
from __future__ import annotations

import contextlib
import errno
import glob
import json
import os
import re
import socket
import sys
import time

RUN_SCHEMA = "fsdpprof.run/1"
RUN_SCHEMA_PREFIX = "fsdpprof.run/"
MANIFEST_SCHEMA = "fsdpprof.manifest/1"
CLASH_SCHEMA = "fsdpprof.clash/1"
INVENTORY_SCHEMA = "fsdpprof.inventory/1"
RANK_SCHEMA = "fsdpprof.rank/1"

RUN_JSON = "run.json"
LAUNCHERS_DIR = "launchers"
RANK_DIR_FMT = "rank-{rank}"
RANK_DIR_PREFIX = "rank-"
RANK_JSON = "rank.json"
TRACE_FILE = "trace.json.gz"
INVENTORY_JSON = "inventory.json"
SNAPSHOT_FILE = "memory_snapshot.pickle"
COLLECTOR_LOG = "collector.log"
MANIFEST_JSON = "manifest.json"   # in each rank-<R>/: the files that rank's recorder wrote there
CLASHES_DIR = "clashes"           # clashes/rank-<R>-<host>-<pid>.json: a process that found rank R taken
TRACE_TEMP_FMT = ".trace.{pid}.tmp.json"   # kineto's export, gzipped into <it>.gz, then renamed to trace.json.gz
# what a rank's recorder writes: `--force` removes these (and their temporaries) from a rank folder without manifest
RANK_FILES = (MANIFEST_JSON, RANK_JSON, TRACE_FILE, INVENTORY_JSON, SNAPSHOT_FILE, COLLECTOR_LOG)
RANK_TEMP_RE = re.compile(r"\.trace\.\d+\.tmp\.json(\.gz|\.tmp)?$|\.(" + "|".join(
    re.escape(n) for n in RANK_FILES) + r")\.\d+\.[0-9a-f]+\.tmp$")

# Stages of a training step (every event and allocation gets one; collect tags CUDA memory with three of them).
STAGE_DATA = "data"              # before the forward (data loading, copies) and input all-to-alls after it
STAGE_FORWARD = "forward"
STAGE_BACKWARD = "backward"      # from the step's first backward marker
STAGE_OPTIMIZER = "optimizer"    # from the first Optimizer.step# to the end of the last one
STAGE_POST_STEP = "post_step"    # after the optimizer (zero_grad, logging)
STAGE_OUTSIDE = "outside_step"   # launched outside every ProfilerStep
STAGE_UNKNOWN = "unknown"        # a device kernel whose launch is not in the trace

# inventory.json: the framework that ran the job (FSDP2 fully_shard, FSDP1 FullyShardedDataParallel,
# DistributedDataParallel, none: no data parallelism)
FRAMEWORK_FSDP2 = "fsdp2"
FRAMEWORK_FSDP1 = "fsdp1"
FRAMEWORK_DDP = "ddp"
FRAMEWORK_NONE = "none"

# inventory.json: the role of each tensor listed
ROLE_PARAM = "param"
ROLE_GRAD = "grad"
ROLE_OPTIMIZER_STATE = "optimizer_state"
ROLE_GRAD_BUCKET = "grad_bucket"   # (analysis only) DDP's gradient bucket, from inventory.json's ddp_bucket_bytes
# inventory.json's "before_window" (CPU runs): the CPU allocations alive when the window's trace starts, from a
# memory-only record of the steps before it ("allocations": [[address, bytes, step allocated in], ...])
INVENTORY_BEFORE_WINDOW = "before_window"
# its key: true when c10's count of every thread's CPU bytes was on through the window (each [memory] event's
# "Total Allocated" is then that count: the bytes of all threads, the profiler's unseen ones included)
WINDOW_COUNTS_EVERY_THREAD = "window_counts_every_thread"
# "every_thread_counted_from": when that count began; this value: as torch was imported (fsdpprof record's bootstrap),
# so the count is every CPU byte alive; else "record start" (fsdpprof.record() in code)
COUNT_FROM_IMPORT = "torch import"
BEFORE_WINDOW_SOURCE = "memory-only profiler from the model's construction to the first recorded step"

# run.json status values
STATUS_RUNNING = "running"
STATUS_COMPLETE = "complete"
STATUS_PARTIAL = "partial"
STATUS_FAILED = "failed"
STATUS_STEPPED_ASIDE = "stepped_aside"   # every rank stepped aside for the job's own torch.profiler
STATUS_INTERRUPTED = "interrupted"       # shown by `report` (never written): `running`, its launchers gone

# rank.json status values (besides complete | partial | failed)
RANK_STEPPED_ASIDE = "stepped_aside"     # the job ran its own torch.profiler: fsdpprof recorded no trace
RANK_NO_OPTIMIZER = "no_optimizer"

# run_liveness(): whether the launchers of a run.json that says running are alive
LIVENESS_ALIVE, LIVENESS_GONE, LIVENESS_UNKNOWN = "alive", "gone", "unknown"
# rank.json "process_memory" and its sources
RANK_PROCESS_MEMORY = "process_memory"
PROCESS_MEMORY_NVML = "nvml"                      # this process's device memory, NVML's per-process figure
PROCESS_MEMORY_MEM_GET_INFO = "cuda_mem_get_info"  # the device's used memory (every process on it)
PROCESS_MEMORY_PROC_STATUS = "proc_status"        # CPU: VmRSS / VmHWM of /proc/self/status
# the NCCL settings that size its buffers (recorded when set)
NCCL_BUFFER_ENV = ("NCCL_BUFFSIZE", "NCCL_MIN_NCHANNELS", "NCCL_MAX_NCHANNELS", "NCCL_MIN_CTAS", "NCCL_MAX_CTAS",
                   "NCCL_NVLS_ENABLE")

# the recording window (optimizer steps) and limits by default: `fsdpprof record`'s options, fsdpprof.record()'s
DEFAULT_SKIP_STEPS, DEFAULT_WARMUP_STEPS, DEFAULT_ACTIVE_STEPS = 5, 1, 3
DEFAULT_MAX_MEMORY_ENTRIES = 100_000   # CUDA memory history entries kept
RECORD_DEFAULTS = {"skip_steps": DEFAULT_SKIP_STEPS, "warmup_steps": DEFAULT_WARMUP_STEPS,
                   "active_steps": DEFAULT_ACTIVE_STEPS, "ranks": None, "memory": True, "with_stack": False,
                   "max_memory_entries": DEFAULT_MAX_MEMORY_ENTRIES}

HEARTBEAT_S = 30   # a running launcher touches its launchers/<host>-<pid>.json this often (seconds)

# Environment variables through which the launcher configures the bootstrap in every process.
ENV_RUN_DIR = "FSDPPROF_RUN_DIR"
ENV_OPTIONS = "FSDPPROF_OPTIONS"  # JSON of the record options
ENV_PREV_PYTHONPATH = "FSDPPROF_PREV_PYTHONPATH"

_FULL = (errno.ENOSPC, getattr(errno, "EDQUOT", errno.ENOSPC))   # the disk (or the user's quota) is full
_WRITE_ERRORS = {errno.ENOSPC: "disk full", getattr(errno, "EDQUOT", -1): "disk quota exceeded",
                 errno.EROFS: "read-only file system", errno.EACCES: "permission denied",
                 errno.EPERM: "permission denied"}
_CLOEXEC = getattr(os, "O_CLOEXEC", 0)
_RANK_DIR_RE = re.compile(re.escape(RANK_DIR_PREFIX) + "([0-9]+)")


def rank_dir(run_dir: str, rank: int) -> str:
    return os.path.join(run_dir, RANK_DIR_FMT.format(rank=rank))


def rank_of_dir(name: str) -> int | None:
    """The rank a rank folder's name says (``rank-3`` -> 3); None for any other name (``rank-analysis``)."""
    m = _RANK_DIR_RE.fullmatch(name)
    return int(m.group(1)) if m else None


def is_run_meta(doc) -> bool:
    """Is ``doc`` (a parsed run.json) fsdpprof's, with an ``fsdpprof.run/*`` schema?"""
    return isinstance(doc, dict) and isinstance(doc.get("schema"), str) and doc["schema"].startswith(RUN_SCHEMA_PREFIX)


def temp_name(name: str) -> str:
    """Name of a temporary file for ``name``: ``.<name>.<pid>.<8 hex>.tmp``."""
    return f".{name}.{os.getpid()}.{os.urandom(4).hex()}.tmp"


def temp_siblings(directory: str, name: str) -> list[str]:
    """Temporary files that a write of ``name`` in ``directory`` left behind (a process killed mid-write)."""
    return glob.glob(os.path.join(glob.escape(directory), "." + glob.escape(name) + ".*.tmp"))


# -- writing (inside the user's job: a failed write is reported, never fatal) ----------------------
def write_all(fd: int, data: bytes) -> None:
    """Write all of ``data`` to ``fd``: every byte fsdpprof writes goes through here (tests make it fail)."""
    view = memoryview(data)
    while view:
        view = view[os.write(fd, view):]


def write_error_text(exc: BaseException, path: str | None = None) -> str:
    """A failed write in words, with the file: ``disk full: <path>`` (``path``: the file meant, when ``exc``
    names none or only one of fsdpprof's hidden temporaries)."""
    named = getattr(exc, "filename", None)
    if not named or (path and os.path.basename(str(named)).startswith(".")):
        named = path
    what = _WRITE_ERRORS.get(getattr(exc, "errno", None))
    if what is None:
        if isinstance(exc, OSError) and exc.strerror:
            what = exc.strerror[:1].lower() + exc.strerror[1:]
        else:
            what = f"{type(exc).__name__}: {exc}"
    return f"{what}: {named or '?'}"


@contextlib.contextmanager
def _naming(path: str):
    """An ``OSError`` raised inside names ``path`` (the file meant) when it named no file or another one."""
    try:
        yield
    except OSError as exc:
        if exc.errno is not None and exc.filename != path:
            raise type(exc)(exc.errno, exc.strerror or os.strerror(exc.errno), path) from exc
        raise


def remove_quietly(path: str) -> None:
    try:
        os.unlink(path)
    except OSError:
        pass


def _write_new(path: str, data: bytes) -> None:
    """Create ``path`` exclusively (mode 0666 less the umask) holding ``data``; removed again if a write fails."""
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL | _CLOEXEC, 0o666)
    try:
        try:
            write_all(fd, data)
            os.fsync(fd)
        finally:
            os.close(fd)
    except BaseException:
        remove_quietly(path)
        raise


def atomic_write_bytes(path: str, data: bytes) -> None:
    """Write ``data`` to a temporary file beside ``path`` and rename it into place. On failure nothing is
    left, ``path`` is as it was and the ``OSError`` names ``path``."""
    directory = os.path.dirname(os.path.abspath(path))
    with _naming(path):
        os.makedirs(directory, exist_ok=True)
        while True:
            tmp = os.path.join(directory, temp_name(os.path.basename(path)))
            try:
                _write_new(tmp, data)
                break
            except FileExistsError:
                continue
        try:
            os.replace(tmp, path)
        except BaseException:
            remove_quietly(tmp)
            raise


def atomic_write_json(path: str, obj) -> None:
    atomic_write_bytes(path, json.dumps(obj, indent=1, default=str).encode())


def write_json_in_place(path: str, obj) -> None:
    """Overwrite status file ``path`` itself, compact, when the text fits in the blocks it already holds (a full
    disk refuses a temporary file); the old bytes are put back if the write fails. Raises the ``OSError``."""
    data = json.dumps(obj, separators=(",", ":"), default=str).encode()
    with _naming(path):
        fd = os.open(path, os.O_RDWR | _CLOEXEC)
        try:
            st = os.fstat(fd)
            if len(data) > max(st.st_size, getattr(st, "st_blocks", 0) * 512):
                raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC), path)
            old = os.pread(fd, st.st_size, 0)
            try:
                _overwrite(fd, data)
                os.fsync(fd)
            except OSError:
                with contextlib.suppress(OSError):
                    _overwrite(fd, old)
                raise
        finally:
            os.close(fd)


def _overwrite(fd: int, data: bytes) -> None:
    os.lseek(fd, 0, os.SEEK_SET)
    write_all(fd, data)
    os.ftruncate(fd, len(data))


def write_status_json(path: str, obj) -> None:
    """A status file (run.json, launchers/*.json, rank.json): atomically, or in place when the disk is too full
    for a temporary file. Raises the first ``OSError`` when neither works."""
    try:
        atomic_write_json(path, obj)
    except OSError as exc:
        if exc.errno not in _FULL or not os.path.isfile(path):
            raise
        try:
            write_json_in_place(path, obj)
        except OSError:
            raise exc from None


def exclusive_create_json(path: str, obj) -> bool:
    """Create ``path`` holding ``obj`` unless it exists (False then), never half-written: a temporary file and a
    hard link where the filesystem has them. Raises ``OSError`` naming ``path``, leaving nothing behind."""
    data = json.dumps(obj, indent=1, default=str).encode()
    tmp = os.path.join(os.path.dirname(path), temp_name(os.path.basename(path)))
    try:
        with _naming(path):
            _write_new(tmp, data)
            try:
                os.link(tmp, path)  # atomic and exclusive
                return True
            except FileExistsError:
                return False
            except OSError as exc:
                if exc.errno in _FULL + (errno.EROFS, errno.EACCES):
                    raise
            try:  # filesystems without hard links
                _write_new(path, data)
            except FileExistsError:
                return False
            return True
    finally:
        remove_quietly(tmp)


def append_bytes(path: str, data: bytes) -> None:
    """Append ``data`` to ``path`` (created when missing), all or nothing: a failed append cuts the file back.
    Raises the ``OSError`` (naming ``path``)."""
    with _naming(path):
        fd = os.open(path, os.O_WRONLY | os.O_APPEND | os.O_CREAT | _CLOEXEC, 0o666)
        try:
            size = os.fstat(fd).st_size
            try:
                write_all(fd, data)
            except OSError:
                with contextlib.suppress(OSError):
                    os.ftruncate(fd, size)
                raise
        finally:
            os.close(fd)


def out_of_space(directory: str) -> bool:
    """Is the filesystem of ``directory`` full (under 64 KiB or no inode left to this user)?"""
    try:
        st = os.statvfs(directory)
    except OSError:
        return False
    return st.f_bavail * st.f_frsize < 64 * 1024 or (st.f_files > 0 and st.f_favail == 0)


def say(line: str) -> bool:
    """Write one ``fsdpprof: ...`` line on stderr, unbuffered: never raises, leaves nothing queued that could
    fail at the interpreter's end (and change its exit code). False when the line could not be written."""
    stream = sys.stderr
    if stream is None:
        return False
    text = line.rstrip("\n") + "\n"
    try:
        fd = stream.fileno()
    except Exception:
        fd = None
    try:
        if fd is None:  # a stream without a file (e.g. replaced by a test harness)
            stream.write(text)
            stream.flush()
            return True
        with contextlib.suppress(Exception):
            stream.flush()  # what the job wrote before, in order
        write_all(fd, text.encode(getattr(stream, "encoding", None) or "utf-8", "backslashreplace"))
        return True
    except Exception:
        return False


def read_json(path: str):
    with open(path, "rb") as fh:
        return json.loads(fh.read())


INT64_MIN, INT64_MAX = -(1 << 63), (1 << 63) - 1


def int64_or_none(text: str) -> int | None:
    """A JSON integer as read by the analysis (``json.loads(..., parse_int=int64_or_none)``): None (unknown) outside
    64 bits, e.g. NVML's 2**64 - 1 for "not available"."""
    value = int(text)
    return value if INT64_MIN <= value <= INT64_MAX else None


# -- who wrote what (``--force`` removes only that) -------------------------------------------
def read_manifest(directory: str) -> list[str] | None:
    """File names listed in ``directory``'s manifest.json (None: no readable manifest of ours)."""
    try:
        return manifest_files(directory)
    except ValueError:
        return None


def manifest_files(directory: str) -> list[str] | None:
    """File names listed in ``directory``'s manifest.json; None without one. ValueError (what is wrong) for
    a manifest.json that is not a manifest of ours."""
    path = os.path.join(directory, MANIFEST_JSON)
    if not os.path.lexists(path):
        return None
    try:
        if os.path.islink(path) or not os.path.isfile(path):
            raise ValueError("not a file")
        doc = read_json(path)
    except OSError as exc:
        raise ValueError(exc.strerror or str(exc)) from None
    except ValueError as exc:
        raise ValueError("empty" if not os.path.getsize(path) else f"not JSON: {exc}") from None
    if not isinstance(doc, dict) or doc.get("schema") != MANIFEST_SCHEMA or not isinstance(doc.get("files"), list):
        raise ValueError(f"not an {MANIFEST_SCHEMA} document")
    return [f for f in doc["files"] if isinstance(f, str) and f and os.path.basename(f) == f and f not in (".", "..")]


def claim_dir(path: str, writer: dict, files: list[str]) -> bool:
    """Create ``path`` exclusively with its manifest (``files``, listed before they exist); False when taken."""
    with _naming(path):
        try:
            os.mkdir(path)
        except FileExistsError:
            return False
    try:
        write_manifest(path, writer, files)
    except BaseException:
        with contextlib.suppress(OSError):
            os.rmdir(path)  # not claimed after all: a later try (or another writer) may have it
        raise
    return True


def write_manifest(directory: str, writer: dict, files: list[str]) -> None:
    atomic_write_json(os.path.join(directory, MANIFEST_JSON),
                      {"schema": MANIFEST_SCHEMA, "writer": writer, "files": sorted(set(files) | {MANIFEST_JSON})})


def recorder_folder(path: str) -> str | None:
    """The folder that ``fsdpprof record`` writes (a run's rank-<R>/, launchers/ or clashes/, or a folder holding
    its manifest.json or rank.json) that ``path`` is or lies in; None when it lies in none (an output may go there:
    the next ``record --force`` would refuse a run whose recorder folders hold files it did not write)."""
    d = os.path.realpath(path)
    while True:
        parent, name = os.path.split(d)
        if _holds_recorder_file(d):
            return d
        if name in (LAUNCHERS_DIR, CLASHES_DIR) or rank_of_dir(name) is not None:
            try:
                if is_run_meta(read_json(os.path.join(parent, RUN_JSON))):
                    return d
            except (OSError, ValueError):
                pass
        if parent == d:
            return None
        d = parent


def _holds_recorder_file(directory: str) -> bool:
    """``directory`` holds a manifest.json or rank.json of fsdpprof's."""
    try:
        if manifest_files(directory) is not None:
            return True
    except ValueError:
        pass
    try:
        doc = read_json(os.path.join(directory, RANK_JSON))
    except (OSError, ValueError):
        return False
    return isinstance(doc, dict) and str(doc.get("schema", "")).startswith("fsdpprof.rank/")


# -- is a run still being recorded? -----------------------------------------------------------
def process_start_ticks(pid: int):
    """Start time of process ``pid`` in clock ticks since boot (Linux /proc), None when unknown: tells the
    process from a later one that reuses its pid."""
    try:
        with open(f"/proc/{int(pid)}/stat", "rb") as fh:
            return int(fh.read().rsplit(b")", 1)[1].split()[19])
    except (OSError, ValueError, IndexError):
        return None


def launcher_alive(doc: dict, path: str, now: float | None = None):
    """Is the launcher of launcher file ``doc`` (at ``path``) running? On this host: its pid is alive and the
    same process; on another: its file was touched within a few heartbeats (None: no heartbeat to tell)."""
    if doc.get("exit_code") is not None:
        return False
    if doc.get("host") == socket.gethostname():
        try:
            pid = int(doc.get("pid"))
            os.kill(pid, 0)
        except PermissionError:
            pass  # alive, owned by someone else
        except (OSError, TypeError, ValueError, OverflowError):
            return False
        started = doc.get("pid_start")
        return started is None or process_start_ticks(pid) in (None, started)
    heartbeat = doc.get("heartbeat_s")
    if not isinstance(heartbeat, (int, float)) or heartbeat <= 0:
        return None
    try:
        age_s = (time.time() if now is None else now) - os.stat(path).st_mtime
    except OSError:
        return None
    return age_s <= 3 * heartbeat + 60


def _json_docs(run_dir: str, folder: str) -> list[tuple[str, dict]]:
    """(path, document) of every readable ``run_dir/folder/*.json`` holding an object."""
    out = []
    for path in sorted(glob.glob(os.path.join(glob.escape(run_dir), folder, "*.json"))):
        try:
            doc = read_json(path)
        except (OSError, ValueError):
            continue
        if isinstance(doc, dict):
            out.append((path, doc))
    return out


def launcher_docs(run_dir: str) -> list[tuple[str, dict]]:
    """(path, launcher file) for every readable launchers/*.json of ``run_dir``."""
    return _json_docs(run_dir, LAUNCHERS_DIR)


def run_liveness(run_dir: str) -> tuple[str, str]:
    """For a run.json that says ``running``: (LIVENESS_ALIVE | _GONE | _UNKNOWN, which launchers, in words)."""
    states = [(launcher_alive(doc, path), doc) for path, doc in launcher_docs(run_dir) if doc.get("exit_code") is None]
    if not states:
        return LIVENESS_GONE, "no launcher file of this run is unfinished"
    desc = ", ".join(f"pid {doc.get('pid')} on {doc.get('host')}" for _, doc in states)
    alive = {a for a, _ in states}
    return (LIVENESS_ALIVE if True in alive else LIVENESS_UNKNOWN if None in alive else LIVENESS_GONE), desc


def read_clashes(run_dir: str) -> list[dict]:
    """The clash notes of ``run_dir`` (clashes/*.json): processes that found their rank already taken."""
    return [doc for _, doc in _json_docs(run_dir, CLASHES_DIR) if doc.get("schema") == CLASH_SCHEMA]


def clash_text(doc: dict) -> str:
    """One line naming a clash (used by the launcher's run.json notes and by ``report``)."""
    by = doc.get("claimed_by") or {}
    holder = f"pid {by.get('pid')} on {by.get('host')}" if by.get("pid") is not None else "another process"
    return (f"rank {doc.get('rank')} was claimed by two processes: {holder} recorded it, pid {doc.get('pid')} on "
            f"{doc.get('host')} recorded nothing (two jobs, or two processes without torch.distributed, "
            "shared one --out)")
