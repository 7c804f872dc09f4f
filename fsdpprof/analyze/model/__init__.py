"""The one vocabulary of an FSDP step: every concept the analyses share is defined here, once.

``events`` (the events frame, kinds, devices, steps and stages), ``fsdp`` (annotations, phases, phase sets,
FSDP in stack frames, units and their order), ``collectives`` (types, name prefixes, ring / bus / wire
factors), ``memory`` (memory categories, their names when nothing is sharded, the peak sweep), ``dtypes``
(dtype sizes, byte formatting), ``strategy`` (strategy names, the one alias table, ZeRO stages), ``inputs``
(what an input is and how every command describes it), ``words`` (memory categories in words, the
percentage format). Each name is importable from here
(``from fsdpprof.analyze import model``; ``model.STAGE_FORWARD``). Stage names and inventory roles are the
run-directory format's (:mod:`fsdpprof.runfmt`), which ``collect`` shares.

Events frame (one row per duration event that matters, whatever the source: GPU kernels on device
streams, CPU ops and gloo work on threads):

=============  =========  ===========================================================
column         dtype      meaning
=============  =========  ===========================================================
rank           int32      global rank
lane           category   ``stream:7`` (device stream) or ``thread:1234`` (CPU thread)
kind           category   one of KINDS
name           category   event name (interned)
ts_us          float64    start, profiler clock, microseconds (the *execution* interval)
dur_us         float64    duration, microseconds
collective     category   one of COLLECTIVES, or UNKNOWN_COLLECTIVE for a comm kernel whose type is not told
bytes          float64    message size in bytes (NaN unknown); all_gather: the whole gathered
                          output, reduce_scatter: the whole input, others: the input
dtype          category   element dtype of the message when known
group_size     float64    process-group size (NaN unknown)
pg             category   process group name/id when known
seq            float64    collective sequence number within its group when known
step           float64    ProfilerStep number of the launch point (NaN outside any step)
stage          category   one of STAGES, from the *launch* point (see :func:`stage_at`)
fsdp_phase     category   innermost FSDP annotation around the launch point (see :func:`parse_fsdp`)
unit           category   FSDP unit fqn of that annotation ("" = the root unit) when known
launch_ts_us   float64    the launch point: a device event's runtime call, a gloo collective's
                          c10d call, a CPU op's own start; NaN when the launch is not in the trace
=============  =========  ===========================================================

Labels come from the launch, intervals from the execution: a device kernel takes step, stage,
FSDP phase, unit, collective type and process group from the CPU op that launched it; overlap
and exposure use its execution interval.  A kernel launched inside a collective op
(:func:`is_collective_op`) is communication (kind comm) whatever its name; a comm kernel whose launch is
not in the trace takes its type from its name (:func:`collective_of`), else UNKNOWN_COLLECTIVE.  The
runtime calls that block the host (SYNC_CALLS) are rows of kind cpu_op on their thread; the other
runtime calls are only used to find the launch points. The memory frames use the same ``stage``,
``fsdp_phase`` and ``unit`` columns with the same meanings (at the allocation; ``free_stage`` /
``free_fsdp_phase`` at the free).
"""
from __future__ import annotations

from fsdpprof.analyze.model.collectives import *  # noqa: F401,F403
from fsdpprof.analyze.model.dtypes import *  # noqa: F401,F403
from fsdpprof.analyze.model.events import *  # noqa: F401,F403
from fsdpprof.analyze.model.fsdp import *  # noqa: F401,F403
from fsdpprof.analyze.model.inputs import *  # noqa: F401,F403
from fsdpprof.analyze.model.memory import *  # noqa: F401,F403
from fsdpprof.analyze.model.strategy import *  # noqa: F401,F403
from fsdpprof.analyze.model.words import *  # noqa: F401,F403
from fsdpprof.analyze.model import collectives, dtypes, events, fsdp, inputs, memory, strategy, words  # noqa: E402

__all__ = sorted({n for m in (collectives, dtypes, events, fsdp, inputs, memory, strategy, words) for n in m.__all__})
