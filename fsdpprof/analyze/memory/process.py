"""The process's memory beside the allocator's: what rank.json's ``process_memory`` (fsdpprof.collect.process_memory)
says over the window, and how much of it is outside the allocator.  Bytes throughout.

- CUDA (source ``nvml``: this process's device memory; ``cuda_mem_get_info``: the device's, every process on it):
  ``used_peak_bytes`` is the largest device memory sampled, ``allocator_reserved_peak_bytes`` torch's
  ``max_memory_reserved`` and ``outside_allocator_peak_bytes`` the largest of used - reserved at one sample: the
  CUDA context, NCCL's buffers and other libraries.
- CPU (source ``proc_status``): ``used_peak_bytes`` is the peak RSS (VmHWM), ``allocator_reserved_peak_bytes`` the
  peak the profiler's memory events show (CPU tensors have no caching allocator) and
  ``outside_allocator_peak_bytes`` the difference: Python's objects, the interpreter and the libraries.
- Readings that contradict the allocator (used below reserved, at a sample on CUDA or at the peaks on CPU) are
  never subtracted: ``outside_allocator_peak_bytes`` is then None (unknown) and ``contradiction`` says where.
"""
from __future__ import annotations

from fsdpprof import runfmt
from fsdpprof.analyze.model import fmt_bytes

SOURCE_WORDS = {runfmt.PROCESS_MEMORY_NVML: "this process's device memory (NVML)",
                runfmt.PROCESS_MEMORY_MEM_GET_INFO: "the device's used memory (torch.cuda.mem_get_info, every process)",
                runfmt.PROCESS_MEMORY_PROC_STATUS: "the process's resident memory (VmRSS / VmHWM)"}
CONTRADICTS_ALLOCATOR = "contradicts the allocator"     # what a reading below the allocator's is called
_CUDA_KEYS = ("used_bytes", "reserved_bytes", "max_reserved_bytes", "allocated_bytes", "max_allocated_bytes")
_CPU_KEYS = ("used_bytes", "used_peak_bytes")


def _int(v) -> int | None:
    return v if type(v) is int and v >= 0 else None


def process_memory(info: dict | None, allocator_peak_bytes: int | None) -> tuple[dict | None, list[str]]:
    """(``memory[rank].process``, notes) from ``info`` (rank.json) and, on CPU, the allocator's peak; (None, [])
    without process memory, (None, [why]) when it cannot be read."""
    pm = (info or {}).get(runfmt.RANK_PROCESS_MEMORY)
    if pm is None:
        return None, []
    what = f"rank {(info or {}).get('rank')}: rank.json's {runfmt.RANK_PROCESS_MEMORY}"
    if not isinstance(pm, dict) or pm.get("source") not in SOURCE_WORDS or not isinstance(pm.get("samples"), list):
        return None, [f"{what} is not what fsdpprof writes (a source and samples): the process's memory is left out"]
    cpu = pm["source"] == runfmt.PROCESS_MEMORY_PROC_STATUS
    keys = _CPU_KEYS if cpu else _CUDA_KEYS
    rows = []
    for s in pm["samples"]:
        if isinstance(s, dict) and type(s.get("step")) is int and all(_int(s.get(k)) is not None for k in keys):
            rows.append({"step": s["step"], **{k: s[k] for k in keys}})
    notes = [] if len(rows) == len(pm["samples"]) else \
        [f"{what}: {len(pm['samples']) - len(rows)} of {len(pm['samples'])} samples unreadable, left out"]
    if not rows:
        return None, notes + [f"{what} holds no readable sample"]
    contradiction = None
    if cpu:
        used_peak = max(max(r["used_peak_bytes"], r["used_bytes"]) for r in rows)
        reserved_peak = allocator_peak_bytes
        outside = used_peak - reserved_peak if reserved_peak is not None else None
        alloc_src = "the peak of the profiler's memory events (CPU tensors have no caching allocator)"
        if outside is not None and outside < 0:
            contradiction = f"the peak RSS ({fmt_bytes(used_peak)}) is below the allocator's peak " \
                            f"({fmt_bytes(reserved_peak)})"
    else:
        used_peak = max(r["used_bytes"] for r in rows)
        reserved_peak = max(r["max_reserved_bytes"] for r in rows)
        outside = max(r["used_bytes"] - r["reserved_bytes"] for r in rows)
        alloc_src = "torch.cuda.max_memory_reserved()"
        below = [r for r in rows if r["used_bytes"] < r["reserved_bytes"]]
        if below:
            r = below[0]
            contradiction = f"at {len(below)} of {len(rows)} samples the device memory used is below what the " \
                            f"allocator reserved (step {r['step']}: {fmt_bytes(r['used_bytes'])} used, " \
                            f"{fmt_bytes(r['reserved_bytes'])} reserved)"
    if contradiction is not None:       # never subtracted into a negative (or a partial) figure
        outside = None
        notes.append(f"{what}: {CONTRADICTS_ALLOCATOR}: {contradiction}; the memory outside the allocator is "
                     f"unknown")
    env = pm.get("nccl_env")
    return {"source": pm["source"], "source_words": SOURCE_WORDS[pm["source"]],
            "device": pm.get("device") if isinstance(pm.get("device"), str) else None,
            "note": pm.get("note") if isinstance(pm.get("note"), str) else None,
            "used_peak_bytes": int(used_peak),
            "allocator_reserved_peak_bytes": None if reserved_peak is None else int(reserved_peak),
            "outside_allocator_peak_bytes": None if outside is None else int(outside), "allocator_source": alloc_src,
            "contradiction": contradiction,
            "nccl_env": {str(k): str(v) for k, v in env.items()} if isinstance(env, dict) else {},
            "steps": rows}, notes
