"""Constants and small I/O helpers of the run-directory contract (schema ``fsdpprof.run/1``).

Imported by both ``collect`` (inside the user's job: stdlib only) and ``analyze``.
See ../shared/DESIGN.md for the contract itself.
"""
from __future__ import annotations

import json
import os
import tempfile

RUN_SCHEMA = "fsdpprof.run/1"
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

# run.json status values
STATUS_RUNNING = "running"
STATUS_COMPLETE = "complete"
STATUS_PARTIAL = "partial"
STATUS_FAILED = "failed"

# Environment variables through which the launcher configures the bootstrap in every process.
ENV_RUN_DIR = "FSDPPROF_RUN_DIR"
ENV_OPTIONS = "FSDPPROF_OPTIONS"  # JSON of the record options
ENV_PREV_PYTHONPATH = "FSDPPROF_PREV_PYTHONPATH"


def rank_dir(run_dir: str, rank: int) -> str:
    return os.path.join(run_dir, RANK_DIR_FMT.format(rank=rank))


def atomic_write_bytes(path: str, data: bytes) -> None:
    """Write ``data`` to a temporary file beside ``path`` and rename it into place."""
    directory = os.path.dirname(os.path.abspath(path))
    os.makedirs(directory, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix="." + os.path.basename(path) + ".", suffix=".tmp", dir=directory)
    try:
        with os.fdopen(fd, "wb") as fh:
            fh.write(data)
            fh.flush()
            os.fsync(fh.fileno())
        os.replace(tmp, path)
    except BaseException:
        try:
            os.unlink(tmp)
        except OSError:
            pass
        raise


def atomic_write_json(path: str, obj) -> None:
    atomic_write_bytes(path, json.dumps(obj, indent=1, sort_keys=False, default=str).encode())


def read_json(path: str):
    with open(path, "rb") as fh:
        return json.loads(fh.read())
