"""Constants and small I/O helpers of the run-directory contract (schema ``fsdpprof.run/1``).

Imported by both ``collect`` (inside the user's job: stdlib only) and ``analyze``.
See ../shared/DESIGN.md for the contract itself.
"""
from __future__ import annotations

import errno
import glob
import json
import os
import re
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
# the names of the files a rank's recorder writes (a rank folder recorded before manifests existed: `--force`
# removes these, and the temporaries of their writes, nothing else)
RANK_FILES = (MANIFEST_JSON, RANK_JSON, TRACE_FILE, INVENTORY_JSON, SNAPSHOT_FILE, COLLECTOR_LOG)
RANK_TEMP_RE = re.compile(r"\.trace\.\d+\.tmp\.json(\.gz|\.tmp)?$|\.(" + "|".join(
    re.escape(n) for n in RANK_FILES) + r")\.\d+\.[0-9a-f]+\.tmp$")

# Stages of a training step (the analysis labels every event and allocation with one). collect tags the CUDA
# memory history with forward / backward / optimizer (``phase=<stage>``), so both sides take the names from here.
STAGE_DATA = "data"              # in a step, before its forward (data loading, host-to-device copies), and the
                                 # collectives between the end of its forward and its backward (input
                                 # distribution: TorchRec's sparse data all-to-alls)
STAGE_FORWARD = "forward"
STAGE_BACKWARD = "backward"      # from the step's first backward marker
STAGE_OPTIMIZER = "optimizer"    # from the first Optimizer.step# to the end of the last one
STAGE_POST_STEP = "post_step"    # after the optimizer (zero_grad, logging)
STAGE_OUTSIDE = "outside_step"   # launched outside every ProfilerStep
STAGE_UNKNOWN = "unknown"        # a device kernel whose launch is not in the trace

# inventory.json: the role of each tensor listed
ROLE_PARAM = "param"
ROLE_GRAD = "grad"
ROLE_OPTIMIZER_STATE = "optimizer_state"

# run.json status values
STATUS_RUNNING = "running"
STATUS_COMPLETE = "complete"
STATUS_PARTIAL = "partial"
STATUS_FAILED = "failed"
STATUS_STEPPED_ASIDE = "stepped_aside"   # every rank stepped aside for the job's own torch.profiler
# shown by `report` (never written) for a run.json left `running` by a launcher that is gone
STATUS_INTERRUPTED = "interrupted"

# rank.json status values (besides complete | partial | failed)
RANK_STEPPED_ASIDE = "stepped_aside"     # the job ran its own torch.profiler: fsdpprof recorded no trace
RANK_NO_OPTIMIZER = "no_optimizer"

# run_liveness(): whether the launchers of a run.json that says running are alive
LIVENESS_ALIVE, LIVENESS_GONE, LIVENESS_UNKNOWN = "alive", "gone", "unknown"
# rank.json "process_memory": the process's memory at every step of the window, and where it comes from
RANK_PROCESS_MEMORY = "process_memory"
PROCESS_MEMORY_NVML = "nvml"                      # this process's device memory, NVML's per-process figure
PROCESS_MEMORY_MEM_GET_INFO = "cuda_mem_get_info"  # the device's used memory (every process on it)
PROCESS_MEMORY_PROC_STATUS = "proc_status"        # CPU: VmRSS / VmHWM of /proc/self/status
# the NCCL settings that size its buffers (recorded when set)
NCCL_BUFFER_ENV = ("NCCL_BUFFSIZE", "NCCL_MIN_NCHANNELS", "NCCL_MAX_NCHANNELS", "NCCL_MIN_CTAS", "NCCL_MAX_CTAS",
                   "NCCL_NVLS_ENABLE")

# A running launcher touches its launchers/<host>-<pid>.json this often, so that another host
# can tell a live launcher from one that was killed.
HEARTBEAT_S = 30

# Environment variables through which the launcher configures the bootstrap in every process.
ENV_RUN_DIR = "FSDPPROF_RUN_DIR"
ENV_OPTIONS = "FSDPPROF_OPTIONS"  # JSON of the record options
ENV_PREV_PYTHONPATH = "FSDPPROF_PREV_PYTHONPATH"


def rank_dir(run_dir: str, rank: int) -> str:
    return os.path.join(run_dir, RANK_DIR_FMT.format(rank=rank))


def is_run_meta(doc) -> bool:
    """Is ``doc`` (a parsed run.json) fsdpprof's? Only a run.json with an ``fsdpprof.run/*`` schema makes a run."""
    return isinstance(doc, dict) and isinstance(doc.get("schema"), str) and doc["schema"].startswith(RUN_SCHEMA_PREFIX)


def temp_name(name: str) -> str:
    """Name of a temporary file for ``name``: ``.<name>.<pid>.<token>.tmp`` (see :func:`temp_siblings`)."""
    import secrets

    return f".{name}.{os.getpid()}.{secrets.token_hex(4)}.tmp"


def temp_siblings(directory: str, name: str) -> list[str]:
    """Temporary files that a write of ``name`` in ``directory`` left behind (a process killed mid-write)."""
    return glob.glob(os.path.join(glob.escape(directory), "." + glob.escape(name) + ".*.tmp"))


# -- writing (inside the user's job: a failed write is reported, never fatal) ----------------------
def write_all(fd: int, data: bytes) -> None:
    """Write all of ``data`` to file descriptor ``fd``.  Every byte fsdpprof writes (run directory, its
    ``fsdpprof:`` lines) goes through here, so that tests can make any one write fail."""
    view = memoryview(data)
    while view:
        view = view[os.write(fd, view):]


def write_error_text(exc: BaseException, path: str | None = None) -> str:
    """What a failed write means, in words, with the file: ``disk full: <path>``, ``read-only file system:
    <path>``... (``path``: the file meant, when ``exc`` names none or only a temporary file)."""
    named = getattr(exc, "filename", None)
    if not named or (path and os.path.basename(str(named)).startswith(".")):  # (fsdpprof's temporaries are hidden)
        named = path
    path = named or "?"
    code = getattr(exc, "errno", None)
    if code == errno.ENOSPC:
        what = "disk full"
    elif code == getattr(errno, "EDQUOT", None):
        what = "disk quota exceeded"
    elif code == errno.EROFS:
        what = "read-only file system"
    elif code in (errno.EACCES, errno.EPERM):
        what = "permission denied"
    elif isinstance(exc, OSError) and exc.strerror:
        what = exc.strerror[:1].lower() + exc.strerror[1:]
    else:
        what = f"{type(exc).__name__}: {exc}"
    return f"{what}: {path}"


def _failed_write(exc: OSError, path: str) -> OSError:
    """``exc`` naming ``path`` (the file meant, not a temporary one) when it named no file or another one."""
    if isinstance(exc, OSError) and exc.errno is not None and exc.filename != path:
        return type(exc)(exc.errno, exc.strerror or os.strerror(exc.errno), path)
    return exc


def remove_quietly(path: str) -> None:
    try:
        os.unlink(path)
    except OSError:
        pass


def atomic_write_bytes(path: str, data: bytes) -> None:
    """Write ``data`` to a temporary file beside ``path`` and rename it into place.

    The file is created as ``open()`` would create it (mode 0666 less the umask), so a run
    directory is as readable as the user's other files.  On any failure (a full disk, a read-only
    folder) the temporary file is removed and the ``OSError`` raised names ``path``; ``path`` itself
    is left as it was.
    """
    directory = os.path.dirname(os.path.abspath(path))
    try:
        os.makedirs(directory, exist_ok=True)
    except OSError as exc:
        raise _failed_write(exc, path) from exc
    while True:
        tmp = os.path.join(directory, temp_name(os.path.basename(path)))
        try:
            fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL | getattr(os, "O_CLOEXEC", 0), 0o666)
            break
        except FileExistsError:
            continue
        except OSError as exc:
            raise _failed_write(exc, path) from exc
    try:
        try:
            write_all(fd, data)
            os.fsync(fd)
        finally:
            os.close(fd)
        os.replace(tmp, path)
    except BaseException as exc:
        remove_quietly(tmp)
        if isinstance(exc, OSError):
            raise _failed_write(exc, path) from exc
        raise


def atomic_write_json(path: str, obj) -> None:
    atomic_write_bytes(path, json.dumps(obj, indent=1, sort_keys=False, default=str).encode())


def write_json_in_place(path: str, obj) -> None:
    """Last resort for a status file (run.json, launchers/*.json, rank.json) when a full disk refuses the
    temporary file of :func:`atomic_write_json`: overwrite ``path`` itself, compact, when the new text fits
    in the blocks the file already holds (so no new block is needed); the old bytes are put back if the
    write fails.  Raises the ``OSError`` when it cannot."""
    data = json.dumps(obj, separators=(",", ":"), default=str).encode()
    try:
        fd = os.open(path, os.O_RDWR | getattr(os, "O_CLOEXEC", 0))
    except OSError as exc:
        raise _failed_write(exc, path) from exc
    try:
        st = os.fstat(fd)
        room = max(st.st_size, getattr(st, "st_blocks", 0) * 512)
        if len(data) > room:
            raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC), path)
        old = os.pread(fd, st.st_size, 0)
        try:
            os.lseek(fd, 0, os.SEEK_SET)
            write_all(fd, data)
            os.ftruncate(fd, len(data))
            os.fsync(fd)
        except OSError as exc:
            try:
                os.lseek(fd, 0, os.SEEK_SET)
                write_all(fd, old)
                os.ftruncate(fd, len(old))
            except OSError:
                pass
            raise _failed_write(exc, path) from exc
    finally:
        os.close(fd)


def write_status_json(path: str, obj) -> None:
    """A status file (run.json, launchers/*.json, rank.json): written atomically, or, when the disk is
    too full for a temporary file, in place (:func:`write_json_in_place`).  Raises the first ``OSError``
    when neither works."""
    try:
        atomic_write_json(path, obj)
    except OSError as exc:
        if exc.errno not in (errno.ENOSPC, getattr(errno, "EDQUOT", errno.ENOSPC)) or not os.path.isfile(path):
            raise
        try:
            write_json_in_place(path, obj)
        except OSError:
            raise exc from None


def exclusive_create_json(path: str, obj) -> bool:
    """Create ``path`` holding ``obj`` only if it does not exist (False when it does), never half-written:
    through a temporary file and a hard link where the filesystem has them.  Raises ``OSError`` (naming
    ``path``) when it cannot be written; nothing is left behind then."""
    data = json.dumps(obj, indent=1, default=str).encode()
    tmp = os.path.join(os.path.dirname(path), temp_name(os.path.basename(path)))
    try:
        fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL | getattr(os, "O_CLOEXEC", 0), 0o666)
        try:
            write_all(fd, data)
            os.fsync(fd)
        finally:
            os.close(fd)
        try:
            os.link(tmp, path)  # atomic and exclusive: fails if the file exists
            return True
        except FileExistsError:
            return False
        except OSError as exc:
            if exc.errno in (errno.ENOSPC, getattr(errno, "EDQUOT", errno.ENOSPC), errno.EROFS, errno.EACCES):
                raise
        try:  # filesystems without hard links
            fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL | getattr(os, "O_CLOEXEC", 0), 0o666)
        except FileExistsError:
            return False
        try:
            try:
                write_all(fd, data)
            finally:
                os.close(fd)
        except BaseException:
            remove_quietly(path)
            raise
        return True
    except OSError as exc:
        raise _failed_write(exc, path) from exc
    finally:
        remove_quietly(tmp)


def append_bytes(path: str, data: bytes) -> None:
    """Append ``data`` to ``path`` (created when missing), all of it or nothing: a failed append (a full
    disk) cuts the file back to its old length.  Raises the ``OSError`` (naming ``path``)."""
    try:
        fd = os.open(path, os.O_WRONLY | os.O_APPEND | os.O_CREAT | getattr(os, "O_CLOEXEC", 0), 0o666)
    except OSError as exc:
        raise _failed_write(exc, path) from exc
    try:
        size = os.fstat(fd).st_size
        try:
            write_all(fd, data)
        except OSError as exc:
            try:
                os.ftruncate(fd, size)
            except OSError:
                pass
            raise _failed_write(exc, path) from exc
    finally:
        os.close(fd)


def out_of_space(directory: str) -> bool:
    """Is the filesystem of ``directory`` full (under 64 KiB left to this user)?  For writes of others
    (kineto's trace export) that fail without saying why."""
    try:
        st = os.statvfs(directory)
    except OSError:
        return False
    return st.f_bavail * st.f_frsize < 64 * 1024 or (st.f_files > 0 and st.f_favail == 0)


def say(line: str) -> bool:
    """Write one line (fsdpprof's ``fsdpprof: ...``) on stderr when it can take it: never raises, and leaves
    nothing queued that could fail later (a full or closed stderr would otherwise change the exit code of
    the interpreter at its end).  False when the line could not be written."""
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
        try:
            stream.flush()  # what the job wrote before, in order
        except Exception:
            pass
        write_all(fd, text.encode(getattr(stream, "encoding", None) or "utf-8", "backslashreplace"))
        return True
    except Exception:
        return False


def read_json(path: str):
    with open(path, "rb") as fh:
        return json.loads(fh.read())


# -- who wrote what (``--force`` removes only that) -------------------------------------------
def read_manifest(directory: str) -> list[str] | None:
    """File names listed in ``directory``'s manifest.json (None: no readable manifest of ours)."""
    try:
        return manifest_files(directory)
    except ValueError:
        return None


def manifest_files(directory: str) -> list[str] | None:
    """File names listed in ``directory``'s manifest.json; None when there is no manifest.json.
    Raises ValueError (saying what is wrong) for a manifest.json that is there but not a manifest of ours."""
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
    """Create ``path`` exclusively and write its manifest (``files``, before any of them exists);
    False when another writer already has it."""
    try:
        os.mkdir(path)
    except FileExistsError:
        return False
    except OSError as exc:
        raise _failed_write(exc, path) from exc
    try:
        write_manifest(path, writer, files)
    except BaseException:
        try:
            os.rmdir(path)  # not claimed after all: a later try (or another writer) may have it
        except OSError:
            pass
        raise
    return True


def write_manifest(directory: str, writer: dict, files: list[str]) -> None:
    names = sorted(set(files) | {MANIFEST_JSON})
    atomic_write_json(os.path.join(directory, MANIFEST_JSON),
                      {"schema": MANIFEST_SCHEMA, "writer": writer, "files": names})


# -- is a run still being recorded? -----------------------------------------------------------
def process_start_ticks(pid: int):
    """Start time of process ``pid`` in clock ticks since boot (Linux /proc), None when unknown.
    Stored beside a pid so that a later reader can tell the process from another one that reuses its pid."""
    try:
        with open(f"/proc/{int(pid)}/stat", "rb") as fh:
            fields = fh.read().rsplit(b")", 1)[1].split()
        return int(fields[19])
    except (OSError, ValueError, IndexError):
        return None


def launcher_alive(doc: dict, path: str, now: float | None = None):
    """Is the launcher described by ``doc`` (its launchers/<host>-<pid>.json at ``path``) still running?

    True or False; None when it cannot be told (another host's launcher that keeps no heartbeat).
    On this host: its pid is alive and is the same process. On another host: its file was touched
    within a few heartbeats.
    """
    if doc.get("exit_code") is not None:
        return False
    import socket

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


def launcher_docs(run_dir: str) -> list[tuple[str, dict]]:
    """(path, launcher file) for every readable launchers/*.json of ``run_dir``."""
    out = []
    for path in sorted(glob.glob(os.path.join(glob.escape(run_dir), LAUNCHERS_DIR, "*.json"))):
        try:
            doc = read_json(path)
        except (OSError, ValueError):
            continue
        if isinstance(doc, dict):
            out.append((path, doc))
    return out


def run_liveness(run_dir: str) -> tuple[str, str]:
    """For a run.json that says ``running``: ("alive" | "gone" | "unknown", which launchers, in words)."""
    unfinished = [(path, doc) for path, doc in launcher_docs(run_dir) if doc.get("exit_code") is None]
    if not unfinished:
        return "gone", "no launcher file of this run is unfinished"
    states = [(launcher_alive(doc, path), doc) for path, doc in unfinished]
    desc = ", ".join(f"pid {doc.get('pid')} on {doc.get('host')}" for _, doc in states)
    if any(alive is True for alive, _ in states):
        return "alive", desc
    if any(alive is None for alive, _ in states):
        return "unknown", desc
    return "gone", desc


def read_clashes(run_dir: str) -> list[dict]:
    """The clash notes of ``run_dir`` (clashes/*.json): processes that found their rank already taken."""
    out = []
    for path in sorted(glob.glob(os.path.join(glob.escape(run_dir), CLASHES_DIR, "*.json"))):
        try:
            doc = read_json(path)
        except (OSError, ValueError):
            continue
        if isinstance(doc, dict) and doc.get("schema") == CLASH_SCHEMA:
            out.append(doc)
    return out


def clash_text(doc: dict) -> str:
    """One line naming a clash (used by the launcher's run.json notes and by ``report``)."""
    by = doc.get("claimed_by") or {}
    holder = f"pid {by.get('pid')} on {by.get('host')}" if by.get("pid") is not None else "another process"
    return (f"rank {doc.get('rank')} was claimed by two processes: {holder} recorded it, pid {doc.get('pid')} on "
            f"{doc.get('host')} recorded nothing (two jobs, or two processes without torch.distributed, "
            "shared one --out)")
