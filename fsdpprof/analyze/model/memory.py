"""Memory categories (what an allocation holds), the names they take when nothing is sharded, and the one
sweep of allocations and frees that finds a peak."""
from __future__ import annotations

import enum

__all__ = ["MemoryCategory", "MEMORY_CATEGORIES", "UNNAMED_CATEGORIES", "BEFORE_RECORDING_NOTE",
           "SHARDED_CATEGORIES", "REPLICATED_LABELS", "REPLICATED_CATEGORIES", "category_name", "MemoryRole",
           "ROLE_OF_CATEGORY", "MEMORY_ROLES", "memory_role", "sweep", "ReplayRole"]


class ReplayRole(str, enum.Enum):
    """What an allocation is to the what-if replay (fsdpprof.analyze.whatif.memory): the rule that moves, scales
    or synthesises it under another strategy."""

    PARAM_STATE = "param_state"      # the parameters the optimizer updates (sharded or replicated)
    OPT_STATE = "opt_state"          # optimizer state
    GRAD_STATE = "grad_state"        # the gradient the optimizer reads
    AG_FLAT = "ag_flat"              # FSDP2's flat all-gather output
    AG_HELD = "ag_held"              # the unsharded parameters compute uses
    RS = "rs"                        # reduce-scatter input and scratch
    AUTO_GRAD = "auto_grad"          # an FSDP run's autograd gradients
    AG_SCRATCH = "ag_scratch"        # all-gather scratch (temporaries of a gather phase)
    OPT_TMP = "opt_tmp"              # optimizer temporaries
    KEEP = "keep"                    # activations, other temporaries, inputs

    def __str__(self) -> str:        # the value, as numpy reads a str (enum.StrEnum's rule, Python >= 3.11)
        return self.value


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
    BEFORE_RECORDING = "before_recording"    # alive before the allocation history began, nothing says more
    OTHER_THREADS = "other_threads"          # CPU runs: net bytes of threads the profiler does not record (gloo's)
    OTHER = "other"
    # the names SHARDED_PARAM and SHARDED_GRAD take on an input that shards nothing (DDP, one device):
    # the rank's own parameters and gradients (see :func:`category_name`)
    PARAM = "param"
    GRAD = "grad"


MC = MemoryCategory
# the categories the attribution gives, in the order of every table
MEMORY_CATEGORIES = [c.value for c in (MC.SHARDED_PARAM, MC.UNSHARDED_PARAM, MC.SHARDED_GRAD, MC.UNSHARDED_GRAD,
                                       MC.OPTIMIZER_STATE, MC.ACTIVATION, MC.TEMPORARY, MC.INPUT, MC.BEFORE_RECORDING,
                                       MC.OTHER_THREADS, MC.OTHER)]
# categories that say nothing about what the memory holds: outside "named" (coverage_pct)
UNNAMED_CATEGORIES = frozenset({MC.OTHER.value, MC.BEFORE_RECORDING.value})   # (other_threads says whose)
BEFORE_RECORDING_NOTE = ("allocated before the allocation history began (torch records no frames and no time "
                         "for it); the blocks' sizes are listed")
# categories that only exist when the model states are sharded (none on DDP / single-device inputs)
SHARDED_CATEGORIES = frozenset({MC.UNSHARDED_PARAM.value, MC.UNSHARDED_GRAD.value})
# how the categories of the rank's own model states read when nothing is sharded (DDP, one device)
REPLICATED_LABELS = {MC.SHARDED_PARAM.value: MC.PARAM.value, MC.SHARDED_GRAD.value: MC.GRAD.value}
REPLICATED_CATEGORIES = list(REPLICATED_LABELS.values())


def category_name(category, sharded: bool = True):
    """The name a category takes on an input whose model states are ``sharded`` or not (DDP, one device:
    ``sharded_param`` -> ``param``, ``sharded_grad`` -> ``grad``); the one place that relabels."""
    return category if sharded else REPLICATED_LABELS.get(category, category)


class MemoryRole(str, enum.Enum):
    """What memory is for, whatever the strategy: the roles runs of different strategies are compared by
    (FSDP's sharded and gathered params are both params, as DDP's whole ones)."""

    PARAMS = "params"
    GRADS = "grads"
    OPTIMIZER_STATE = "optimizer_state"
    ACTIVATIONS = "activations"
    TEMPORARIES = "temporaries"
    OTHER = "other"


_R = MemoryRole
# every category (and the replicated names) in exactly one role: the roles add up to the allocated bytes
ROLE_OF_CATEGORY = {
    MC.SHARDED_PARAM.value: _R.PARAMS, MC.UNSHARDED_PARAM.value: _R.PARAMS, MC.PARAM.value: _R.PARAMS,
    MC.SHARDED_GRAD.value: _R.GRADS, MC.UNSHARDED_GRAD.value: _R.GRADS, MC.GRAD.value: _R.GRADS,
    MC.OPTIMIZER_STATE.value: _R.OPTIMIZER_STATE, MC.ACTIVATION.value: _R.ACTIVATIONS,
    MC.TEMPORARY.value: _R.TEMPORARIES,
    MC.INPUT.value: _R.OTHER, MC.BEFORE_RECORDING.value: _R.OTHER, MC.OTHER.value: _R.OTHER}
MEMORY_ROLES = [r.value for r in MemoryRole]


def memory_role(category) -> str:
    """The role (MemoryRole value) of a memory category; an unknown category is ``other``."""
    return ROLE_OF_CATEGORY.get(str(category), MemoryRole.OTHER).value


def sweep(base, delta, *keys):
    """Allocated bytes after each event, the events ordered by ``keys`` (the first key first, then the next
    at ties: numpy arrays, as np.lexsort takes them reversed): (levels, order). ``base``: bytes alive before
    the first event; ``delta``: + bytes of an allocation, - bytes of a free. The one peak sweep of the
    measured allocations and of the what-if replay."""
    import numpy as np  # (numpy stays out of `fsdpprof plan` and --help)

    o = np.lexsort(keys[::-1])
    return base + np.cumsum(delta[o]), o
