"""The one vocabulary of an FSDP step: every concept the analyses share is defined here, once (``events``,
``fsdp``, ``collectives``, ``memory``, ``dtypes``, ``strategy``, ``inputs``, ``words``), each name importable from
here (``model.STAGE_FORWARD``).  Stage names and inventory roles are the run-directory format's (runfmt).

The events frame has one row per duration event (GPU kernels on ``stream:N`` lanes, CPU ops and gloo work on
``thread:N`` lanes), columns EVENT_COLUMNS: rank, lane, kind (KINDS), name, ts_us / dur_us (the execution
interval, µs), collective (COLLECTIVES or UNKNOWN_COLLECTIVE), bytes (all_gather: the gathered output,
reduce_scatter: the whole input, others: the input), dtype, group_size, pg, seq, step, stage (STAGES), fsdp_phase,
unit ("" the root) and launch_ts_us.  Labels come from the launch (a kernel takes step, stage, phase, unit and
collective from the CPU op that launched it), intervals from the execution.  The memory frames use the same
stage, fsdp_phase and unit columns at the allocation.
"""
from __future__ import annotations

from fsdpprof.analyze.model.collectives import *  # noqa: F401,F403
from fsdpprof.analyze.model.critical import *  # noqa: F401,F403
from fsdpprof.analyze.model.dtypes import *  # noqa: F401,F403
from fsdpprof.analyze.model.events import *  # noqa: F401,F403
from fsdpprof.analyze.model.fsdp import *  # noqa: F401,F403
from fsdpprof.analyze.model.inputs import *  # noqa: F401,F403
from fsdpprof.analyze.model.memory import *  # noqa: F401,F403
from fsdpprof.analyze.model.strategy import *  # noqa: F401,F403
from fsdpprof.analyze.model.words import *  # noqa: F401,F403
from fsdpprof.analyze.model import collectives, critical, dtypes, events, fsdp, inputs, memory, strategy, words  # noqa: E402

__all__ = sorted({n for m in (collectives, critical, dtypes, events, fsdp, inputs, memory, strategy, words) for n in m.__all__})
