"""One events schema for every trace source (GPU kernels on CUDA streams, CPU ops on gloo threads).

Columns of the events DataFrame (one row per duration event that matters):

=============  =========  ===========================================================
column         dtype      meaning
=============  =========  ===========================================================
rank           int32      global rank
lane           category   ``stream:7`` (GPU) or ``thread:1234`` (CPU)
kind           category   one of KINDS
name           category   event name (interned)
ts_us          float64    start, profiler clock, microseconds
dur_us         float64    duration, microseconds
collective     category   one of COLLECTIVES, or missing for non-comm events
bytes          float64    message size in bytes (NaN unknown); for all_gather the output
                          (whole array), for reduce_scatter the input (whole array)
dtype          category   element dtype of the message when known
group_size     float64    process-group size (NaN unknown)
pg             category   process group name/id when known
seq            float64    collective sequence number within its group when known
step           float64    ProfilerStep number (NaN outside any step)
phase          category   FSDP phase (forward, backward, optimizer, pre_forward, all_gather, ...)
unit           category   FSDP unit fqn when known
=============  =========  ===========================================================
"""
from __future__ import annotations

import enum

EVENT_COLUMNS = [
    "rank", "lane", "kind", "name", "ts_us", "dur_us", "collective", "bytes", "dtype",
    "group_size", "pg", "seq", "step", "phase", "unit",
]

KIND_COMPUTE = "compute"
KIND_COMM = "comm"
KIND_MEMCPY = "memcpy"
KIND_MEMSET = "memset"
KIND_SYNC = "sync"
KIND_CPU_OP = "cpu_op"
KIND_ANNOTATION = "annotation"
KINDS = [KIND_COMPUTE, KIND_COMM, KIND_MEMCPY, KIND_MEMSET, KIND_SYNC, KIND_CPU_OP, KIND_ANNOTATION]

COLLECTIVES = [
    "all_gather", "reduce_scatter", "all_reduce", "broadcast", "all_to_all", "send_recv", "barrier",
]

# Columns of the memory-events frame (the trace's ``[memory]`` instant events), one row each:
#   rank int32, ts_us float64, addr int64, bytes int64 (negative on free),
#   total_allocated_bytes int64, total_reserved_bytes int64, device_type int8, device_id int16
MEMORY_EVENT_COLUMNS = [
    "rank", "ts_us", "addr", "bytes", "total_allocated_bytes", "total_reserved_bytes",
    "device_type", "device_id",
]


class MemoryCategory(str, enum.Enum):
    """What an allocation holds, in FSDP's own terms."""

    SHARDED_PARAM = "sharded_param"
    UNSHARDED_PARAM = "unsharded_param"      # all-gather output
    SHARDED_GRAD = "sharded_grad"
    UNSHARDED_GRAD = "unsharded_grad"        # reduce-scatter input
    OPTIMIZER_STATE = "optimizer_state"
    ACTIVATION = "activation"
    TEMPORARY = "temporary"
    INPUT = "input"
    OTHER = "other"
