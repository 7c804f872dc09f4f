"""What analysing a trace takes in memory and what this machine can give it (issue 40): the one estimate behind the
memory warning, the default limit on a trace's size and how many ranks the local engine analyses at once.  Bytes."""
from __future__ import annotations

import os
import zlib

# peak resident bytes of a rank's report per byte of its trace's JSON, at most: 0.56 for a recorded CPU run whose
# profiler [memory] events run through it (1 GB), 0.24 for an A100 trace without them (1 GB; 0.21 at 16 GB)
RESIDENT_PER_JSON_BYTE = 0.6
RANK_BASE_BYTES = 128 << 20      # a process's interpreter and libraries (numpy, pandas, plotly)
MEMORY_SHARE = 0.8               # of the memory available as a load starts, the share it plans to use
MAX_TRACE_BYTES_FLOOR = 8 << 30  # the default limit on a trace's JSON is never below this
GZ_SAMPLE_BYTES = 1 << 20       # compressed bytes inflated to estimate a big gzip trace's JSON size
GZ_LIFT_MIN_BYTES = 64 << 20    # from this size on a gzip file's JSON may pass 4 GiB, beyond what its trailer says
GZ_ISIZE_MOD = 1 << 32          # a gzip trailer's size is the member's size modulo this


def inflated_size(path: str) -> int:
    """Bytes of JSON in a trace file: the file's size; for gzip the trailer's size (its last member's, mod 2^32), and
    for a file of GZ_LIFT_MIN_BYTES or more that size lifted by the whole 4 GiBs that the compression ratio of its
    first MB predicts."""
    try:
        with open(path, "rb") as fh:
            size = os.fstat(fh.fileno()).st_size
            if fh.read(2) != b"\x1f\x8b":
                return size
            fh.seek(-4, os.SEEK_END)
            isize = int.from_bytes(fh.read(4), "little")
            if size < GZ_LIFT_MIN_BYTES:
                return max(isize, size)
            fh.seek(0)
            sample = fh.read(GZ_SAMPLE_BYTES)
    except OSError:
        return 0
    try:
        d = zlib.decompressobj(wbits=31)
        out = len(d.decompress(sample, 64 * GZ_SAMPLE_BYTES))
        used = len(sample) - len(d.unconsumed_tail) - len(d.unused_data)
    except zlib.error:
        return max(isize, size)
    estimate = size * out / used if used > 0 else size
    return max(size, isize + max(0, round((estimate - isize) / GZ_ISIZE_MOD)) * GZ_ISIZE_MOD)


MEMINFO = "/proc/meminfo"
PROC_CGROUP = "/proc/self/cgroup"
CGROUP_ROOT = "/sys/fs/cgroup"
CGROUP_UNLIMITED = 1 << 60       # a cgroup v1 limit this high is none (v1 writes 2^63 less a page)


def available_memory_bytes() -> int | None:
    """Memory this machine can give a new load: MemAvailable (Linux), or less where this process's memory cgroup
    (a container's, a job scheduler's) leaves less under its limit; None where unknown."""
    room = _cgroup_room()
    try:
        with open(MEMINFO) as fh:
            for line in fh:
                if line.startswith("MemAvailable:"):
                    free = int(line.split()[1]) * 1024
                    return free if room is None else min(free, room)
    except (OSError, ValueError, IndexError):
        pass
    return room


def _cgroup_room() -> int | None:
    """The least that this process's memory cgroup and those above it leave (limit less usage; cgroup v2, or v1's
    memory controller); None without a limit."""
    try:
        with open(PROC_CGROUP) as fh:
            lines = fh.read().splitlines()
    except OSError:
        return None
    room = None
    for line in lines:
        hid, controllers, path = (line.split(":", 2) + ["", ""])[:3]
        if hid == "0" and not controllers:
            base, limit_file, usage_file = CGROUP_ROOT, "memory.max", "memory.current"
        elif "memory" in controllers.split(","):
            base, limit_file, usage_file = os.path.join(CGROUP_ROOT, "memory"), "memory.limit_in_bytes", \
                "memory.usage_in_bytes"
        else:
            continue
        parts = [p for p in path.split("/") if p]
        for k in range(len(parts), -1, -1):      # (a container sees its own cgroup as the root: found there)
            folder = os.path.join(base, *parts[:k])
            limit = _read_bytes(os.path.join(folder, limit_file))
            if limit is None or limit >= CGROUP_UNLIMITED:
                continue
            left = max(0, limit - (_read_bytes(os.path.join(folder, usage_file)) or 0))
            room = left if room is None else min(room, left)
    return room


def _read_bytes(path: str) -> int | None:
    """A cgroup file's number of bytes; None when absent, unreadable or "max"."""
    try:
        with open(path) as fh:
            return int(fh.read().strip())
    except (OSError, ValueError):
        return None


def need_bytes(json_bytes: int) -> int:
    """The most a rank's report takes resident, its trace holding ``json_bytes`` of JSON."""
    return RANK_BASE_BYTES + int(json_bytes * RESIDENT_PER_JSON_BYTE)


def memory_warning(path: str, json_bytes: int, available: int | None = None) -> str | None:
    """A line saying that analysing ``json_bytes`` of trace JSON may need more memory than is available
    (``available``: default available_memory_bytes()); None when it fits or the memory is unknown."""
    need = need_bytes(json_bytes)
    available = available_memory_bytes() if available is None else available
    if available is None or need <= available:
        return None
    return (f"trace {path} holds about {json_bytes / 2**30:.1f} GiB of JSON; analysing it may need up to "
            f"{need / 2**30:.1f} GiB of memory and {available / 2**30:.1f} GiB is available: it may be killed "
            f"for memory; analyse it on a machine with more memory, or record a shorter profiler window")


def budget_bytes(max_memory: int | None = None, available: int | None = None) -> int | None:
    """The memory a load plans for: ``max_memory`` (``--max-memory``) when given, else MEMORY_SHARE of the
    available memory (``available``: default available_memory_bytes()); None where that is unknown."""
    if max_memory is not None:
        return int(max_memory)
    available = available_memory_bytes() if available is None else available
    return None if available is None else int(available * MEMORY_SHARE)


def default_max_trace_bytes() -> int:
    """The largest trace JSON read when no limit is given: what MEMORY_SHARE of the available memory can analyse,
    and at least MAX_TRACE_BYTES_FLOOR."""
    budget = budget_bytes()
    if budget is None:
        return MAX_TRACE_BYTES_FLOOR
    return max(MAX_TRACE_BYTES_FLOOR, int((budget - RANK_BASE_BYTES) / RESIDENT_PER_JSON_BYTE))


def ranks_at_once(json_sizes: list[int], budget: int) -> int:
    """How many of these traces (JSON bytes each) can be analysed at once within ``budget`` bytes, the biggest
    taken together (at least 1)."""
    n = 0
    for size in sorted(json_sizes, reverse=True):
        budget -= need_bytes(size)
        if budget < 0:
            break
        n += 1
    return max(1, n)
