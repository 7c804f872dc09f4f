"""Memory: CUDA snapshots (restricted unpickler), the profiler's CPU memory events, attribution of every
allocation to a category, FSDP unit and stage.  Sizes in bytes, times in µs.

- ``safe_pickle``  unpickler that rebuilds builtin containers only.
- ``snapshot``     ``torch.cuda.memory._snapshot()`` -> allocations frame, segments, OOMs.
- ``cpu_events``   the trace's ``[memory]`` events + inventory.json -> allocations frame (CPU runs).
- ``categorize``   the ordered attribution passes (inventory, tags, frames, lifetime).
- ``fragmentation`` the allocator's free blocks at the peak, an OOM and the end (segments, trace replayed).
- ``attribution``  :func:`memory_analysis`: peak, breakdown, per unit, timeline, fragmentation, OOM.
"""
from fsdpprof.analyze.memory.attribution import MemoryResult, memory_analysis, snapshot_memory  # noqa: F401
