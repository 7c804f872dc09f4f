"""FSDP: its annotations and phases, the phase sets each analysis asks about, FSDP's functions in stack
frames (and the phase / role they mean), and units in the model's one order."""
from __future__ import annotations

import re

from fsdpprof import runfmt
from fsdpprof.analyze.model.memory import MemoryCategory
from fsdpprof.runfmt import STAGE_BACKWARD, STAGE_FORWARD

__all__ = [
    "FSDP1_PREFIX", "FSDP2_PREFIX", "FAMILY_FSDP2", "FAMILY_FSDP1", "FAMILY_DDP", "FAMILIES", "FSDP_FAMILIES", "parse_fsdp",
    "PHASE_ROOT_PRE_FORWARD", "PHASE_PRE_FORWARD", "PHASE_POST_FORWARD", "PHASE_FORWARD", "PHASE_PRE_BACKWARD",
    "PHASE_POST_BACKWARD", "PHASE_ALL_GATHER", "PHASE_ALL_GATHER_COPY_OUT", "PHASE_FOREACH_ALL_GATHER",
    "PHASE_FOREACH_ALL_GATHER_COPY_OUT", "PHASE_UNSHARD", "PHASE_RESHARD", "PHASE_POST_BACKWARD_REDUCE",
    "PHASE_FOREACH_REDUCE", "PHASE_REDUCE_SCATTER", "PHASE_POST_BACKWARD_RESHARD", "PHASE_POST_BACKWARD_ACCUMULATE",
    "PHASE_POST_BACKWARD_RS_WAIT", "PHASE_ROOT_POST_BACKWARD_CALLBACK", "PHASE_PRE_FORWARD_PREFETCH",
    "PHASE_PRE_BACKWARD_PREFETCH", "PHASE_POST_BACKWARD_PREFETCH", "PHASE_POST_BACKWARD_RESHARD_ONLY",
    "FSDP_PHASES", "FLAT_GATHER_PHASES", "COPY_OUT_PHASES", "UNSHARDED_PARAM_PHASES", "UNSHARDED_GRAD_PHASES",
    "FSDP1_UNSHARD_PHASES", "FSDP1_RESHARD_PHASES", "GATHER_PHASES", "POST_FORWARD_PHASES", "POST_BACKWARD_PHASES",
    "GATHER_OVERHEAD_PHASES", "REDUCE_OVERHEAD_PHASES", "PHASE_STAGE_PATTERNS",
    "FSDP2_FRAME_FILES", "FSDP1_FRAME_FILES", "FSDP_ROLE_ALL_GATHER_INPUT", "FSDP_ROLE_ALL_GATHER_OUTPUT",
    "FSDP_ROLE_COPY_OUT", "FSDP_ROLE_COPY_OUT_TEMP", "FSDP_ROLE_REDUCE_SCATTER", "FSDP_ROLE_REDUCE_SCATTER_INPUT",
    "FSDP_ROLE_REDUCE_SCATTER_OUTPUT", "FSDP_ROLE_SHARDED_PARAM", "FSDP_ROLE_OPTIMIZER_STATE", "FSDP_ROLE_CATEGORY", "FSDP_FRAME_ROLES",
    "FSDP_PHASE_FRAME_RULES", "MODULE_CALL_FUNCTIONS", "MODULE_CALL_FILE", "FSDP2_GROUP_PRE_HOOK", "ROOT_UNIT", "ROOT_UNIT_TEXT",
    "unit_order",
]

FSDP1_PREFIX = "FullyShardedDataParallel."
FSDP2_PREFIX = "FSDP::"
# which implementation: FSDP2 ``fully_shard``, FSDP1 ``FullyShardedDataParallel``, DDP
# ``DistributedDataParallel`` (inventory.json's ``framework``)
FAMILY_FSDP2, FAMILY_FSDP1, FAMILY_DDP = runfmt.FRAMEWORK_FSDP2, runfmt.FRAMEWORK_FSDP1, runfmt.FRAMEWORK_DDP
FAMILIES = (FAMILY_FSDP2, FAMILY_FSDP1, FAMILY_DDP)
FSDP_FAMILIES = frozenset({FAMILY_FSDP2, FAMILY_FSDP1})
_FSDP2 = re.compile(r"^FSDP::(\w+)(?: \((.*)\)| for (.*))?$")
_FSDP1 = re.compile(r"^FullyShardedDataParallel\.(\w+)$")


def parse_fsdp(name: str) -> tuple[str | None, str | None, str | None]:
    """(fsdp_phase, unit, family) of an FSDP annotation, else (None, None, None): FSDP2 ``FSDP::<phase> (<fqn>)`` /
    ``FSDP::<phase>_prefetch for <fqn>`` / ``FSDP::<phase>`` (the root unit ""; ``root_*`` name none); FSDP1
    ``FullyShardedDataParallel._<phase>[_hook]`` (no unit)."""
    if not isinstance(name, str):
        return None, None, None
    m = _FSDP2.match(name)
    if m:
        unit = m.group(2) if m.group(2) is not None else m.group(3)
        if unit is None and not m.group(1).startswith("root_"):
            unit = ROOT_UNIT
        return m.group(1), unit, FAMILY_FSDP2
    m = _FSDP1.match(name)
    if m:
        return m.group(1).lstrip("_").replace("_hook", ""), None, FAMILY_FSDP1
    return None, None, None


# --------------------------------------------------------------------------- phases
# The phases FSDP's annotations (:func:`parse_fsdp`), fsdpprof's memory tags and FSDP's functions in stack
# frames (:data:`FSDP_PHASE_FRAME_RULES`) name; FSDP2 unless said.
PHASE_ROOT_PRE_FORWARD = "root_pre_forward"
PHASE_PRE_FORWARD = "pre_forward"                  # both families: the hook that unshards a unit for forward
PHASE_POST_FORWARD = "post_forward"
PHASE_FORWARD = "forward"                          # FSDP1: FullyShardedDataParallel.forward
PHASE_PRE_BACKWARD = "pre_backward"
PHASE_POST_BACKWARD = "post_backward"              # FSDP2's hook; FSDP1's, which reduce-scatters
PHASE_ALL_GATHER = "all_gather"
PHASE_ALL_GATHER_COPY_OUT = "all_gather_copy_out"
PHASE_FOREACH_ALL_GATHER = "foreach_all_gather"
PHASE_FOREACH_ALL_GATHER_COPY_OUT = "foreach_all_gather_copy_out"
PHASE_UNSHARD = "unshard"
PHASE_RESHARD = "reshard"
PHASE_POST_BACKWARD_REDUCE = "post_backward_reduce"
PHASE_FOREACH_REDUCE = "foreach_reduce"
PHASE_REDUCE_SCATTER = "reduce_scatter"
PHASE_POST_BACKWARD_RESHARD = "post_backward_reshard"
PHASE_POST_BACKWARD_ACCUMULATE = "post_backward_accumulate"
PHASE_POST_BACKWARD_RS_WAIT = "post_backward_rs_wait"
PHASE_ROOT_POST_BACKWARD_CALLBACK = "root_post_backward_callback"
PHASE_PRE_FORWARD_PREFETCH = "pre_forward_prefetch"          # FSDP1
PHASE_PRE_BACKWARD_PREFETCH = "pre_backward_prefetch"        # FSDP1
PHASE_POST_BACKWARD_PREFETCH = "post_backward_prefetch"      # FSDP1
PHASE_POST_BACKWARD_RESHARD_ONLY = "post_backward_reshard_only"    # FSDP1
FSDP_PHASES = [
    PHASE_ROOT_PRE_FORWARD, PHASE_PRE_FORWARD, PHASE_POST_FORWARD, PHASE_FORWARD, PHASE_PRE_BACKWARD,
    PHASE_POST_BACKWARD, PHASE_ALL_GATHER, PHASE_ALL_GATHER_COPY_OUT, PHASE_FOREACH_ALL_GATHER,
    PHASE_FOREACH_ALL_GATHER_COPY_OUT, PHASE_UNSHARD, PHASE_RESHARD, PHASE_POST_BACKWARD_REDUCE, PHASE_FOREACH_REDUCE,
    PHASE_REDUCE_SCATTER, PHASE_POST_BACKWARD_RESHARD, PHASE_POST_BACKWARD_ACCUMULATE, PHASE_POST_BACKWARD_RS_WAIT,
    PHASE_ROOT_POST_BACKWARD_CALLBACK, PHASE_PRE_FORWARD_PREFETCH, PHASE_PRE_BACKWARD_PREFETCH,
    PHASE_POST_BACKWARD_PREFETCH, PHASE_POST_BACKWARD_RESHARD_ONLY,
]

# phases whose allocation is the flat all-gather output / FSDP2's copy-out (the unsharded parameters)
FLAT_GATHER_PHASES = frozenset({PHASE_ALL_GATHER, PHASE_FOREACH_ALL_GATHER})
COPY_OUT_PHASES = frozenset({PHASE_ALL_GATHER_COPY_OUT, PHASE_FOREACH_ALL_GATHER_COPY_OUT})
# fine FSDP phases whose allocations are unsharded parameters / unsharded gradients (both families)
UNSHARDED_PARAM_PHASES = FLAT_GATHER_PHASES | COPY_OUT_PHASES | {PHASE_UNSHARD}
UNSHARDED_GRAD_PHASES = frozenset({PHASE_POST_BACKWARD_REDUCE, PHASE_REDUCE_SCATTER, PHASE_FOREACH_REDUCE,
                                   PHASE_POST_BACKWARD})
# FSDP1 unshards (the padded flat parameter) inside these and frees it in a reshard
FSDP1_UNSHARD_PHASES = frozenset({PHASE_PRE_FORWARD, PHASE_PRE_FORWARD_PREFETCH, PHASE_PRE_BACKWARD,
                                  PHASE_PRE_BACKWARD_PREFETCH, PHASE_POST_BACKWARD_PREFETCH})
FSDP1_RESHARD_PHASES = frozenset({PHASE_POST_FORWARD, PHASE_POST_BACKWARD, PHASE_POST_BACKWARD_RESHARD_ONLY,
                                  PHASE_RESHARD})
# either family: the phases that allocate unsharded parameters
GATHER_PHASES = UNSHARDED_PARAM_PHASES | FSDP1_UNSHARD_PHASES
# the annotations that end a unit's forward / backward scope (opened by pre_forward / pre_backward)
POST_FORWARD_PHASES = (PHASE_POST_FORWARD,)
POST_BACKWARD_PHASES = (PHASE_POST_BACKWARD_RESHARD, PHASE_POST_BACKWARD_REDUCE, PHASE_POST_BACKWARD_ACCUMULATE,
                        PHASE_POST_BACKWARD)
# the FSDP annotations around each family's own CPU work for a gather / a reduction: the hooks that issue them
# too (FSDP2's pre-forward / pre-backward / post-forward around its all-gathers, its root post-backward callback,
# reshard and gradient accumulation beside its reductions), as FSDP1's hooks are
GATHER_OVERHEAD_PHASES = {
    FAMILY_FSDP2: (PHASE_ALL_GATHER, PHASE_ALL_GATHER_COPY_OUT, PHASE_FOREACH_ALL_GATHER,
                   PHASE_FOREACH_ALL_GATHER_COPY_OUT, PHASE_PRE_FORWARD, PHASE_PRE_BACKWARD, PHASE_POST_FORWARD),
    FAMILY_FSDP1: (PHASE_PRE_FORWARD, PHASE_PRE_FORWARD_PREFETCH, PHASE_PRE_BACKWARD, PHASE_PRE_BACKWARD_PREFETCH,
                   PHASE_POST_BACKWARD_PREFETCH)}
REDUCE_OVERHEAD_PHASES = {
    FAMILY_FSDP2: (PHASE_POST_BACKWARD_REDUCE, PHASE_FOREACH_REDUCE, PHASE_ROOT_POST_BACKWARD_CALLBACK,
                   PHASE_POST_BACKWARD_RESHARD, PHASE_POST_BACKWARD_ACCUMULATE, PHASE_POST_BACKWARD_RS_WAIT),
    FAMILY_FSDP1: (PHASE_POST_BACKWARD,)}

# The stage a phase belongs to when nothing else says it (a snapshot's untagged allocation): the first regex
# that the phase's name matches (pre_backward, post_backward_reduce: backward; all_gather, unshard: forward).
PHASE_STAGE_PATTERNS = [(STAGE_BACKWARD, r"backward|reduce"), (STAGE_FORWARD, r"forward|all_gather|unshard")]


# --------------------------------------------------------------------------- FSDP in stack frames
# The source files of FSDP2 (torch/distributed/fsdp/_fully_shard/) and FSDP1 (torch/distributed/fsdp/)
# whose functions appear in the stack frames of a CUDA memory snapshot (torch 2.x; FSDP1's flat
# parameter file was flat_param.py before torch 2.1).  A snapshot with allocations under these
# frames comes from an FSDP2 / FSDP1 run.
FSDP2_FRAME_FILES = ("_fsdp_param_group.py", "_fsdp_collectives.py", "_fsdp_param.py", "_fsdp_state.py",
                     "_fully_shard.py")
FSDP1_FRAME_FILES = ("fully_sharded_data_parallel.py", "_flat_param.py", "flat_param.py", "_runtime_utils.py")

# What an FSDP allocation is, from the function that made it (its frames): role -> MemoryCategory.
FSDP_ROLE_ALL_GATHER_INPUT = "all_gather_input"      # the shard cast to the all-gather dtype (mixed precision)
FSDP_ROLE_ALL_GATHER_OUTPUT = "all_gather_output"    # the flat all-gather output (FSDP1: the unsharded flat param)
FSDP_ROLE_COPY_OUT = "unsharded_param"               # FSDP2: the per-parameter unsharded tensors (copy-out)
FSDP_ROLE_COPY_OUT_TEMP = "copy_out_temp"            # FSDP2: scratch of the copy-out for Shard(dim != 0)
FSDP_ROLE_REDUCE_SCATTER = "reduce_scatter"          # FSDP2 foreach_reduce / FSDP1 _reduce_grad buffers
FSDP_ROLE_REDUCE_SCATTER_INPUT = "reduce_scatter_input"    # (the largest of one call: the padded unsharded grads)
FSDP_ROLE_REDUCE_SCATTER_OUTPUT = "reduce_scatter_output"  # (the others: the new sharded grad, its cast)
FSDP_ROLE_SHARDED_PARAM = "sharded_param"            # the shard itself (made at fully_shard / FSDP init)
FSDP_ROLE_OPTIMIZER_STATE = "optimizer_state"        # blocks alive before the history with the sizes of the states
FSDP_ROLE_CATEGORY = {
    FSDP_ROLE_ALL_GATHER_INPUT: MemoryCategory.TEMPORARY.value,
    FSDP_ROLE_ALL_GATHER_OUTPUT: MemoryCategory.UNSHARDED_PARAM.value,
    FSDP_ROLE_COPY_OUT: MemoryCategory.UNSHARDED_PARAM.value,
    FSDP_ROLE_COPY_OUT_TEMP: MemoryCategory.TEMPORARY.value,
    FSDP_ROLE_REDUCE_SCATTER_INPUT: MemoryCategory.UNSHARDED_GRAD.value,
    FSDP_ROLE_REDUCE_SCATTER_OUTPUT: MemoryCategory.SHARDED_GRAD.value,
    FSDP_ROLE_SHARDED_PARAM: MemoryCategory.SHARDED_PARAM.value,
    FSDP_ROLE_OPTIMIZER_STATE: MemoryCategory.OPTIMIZER_STATE.value,
}
# (role, functions, file) in the order they are tried: the first rule with one of ``functions`` defined
# in ``file`` somewhere in the stack decides.  Function names are torch's own (torch 2.13:
# _fully_shard/_fsdp_collectives.py foreach_all_gather -> all_gather_comm.allocate,
# _get_param_all_gather_inputs -> torch.empty; _fsdp_param.py alloc_all_gather_outputs -> alloc_storage;
# foreach_reduce -> reduce_scatter_comm.allocate; FSDP1 _flat_param.py _alloc_padded_unsharded_flat_param,
# _use_low_precision_shard; _runtime_utils.py _reduce_grad / _get_reduce_scatter_tensors).
FSDP_FRAME_ROLES = [
    (FSDP_ROLE_COPY_OUT, ("alloc_all_gather_outputs", "init_all_gather_outputs", "init_unsharded_param"),
     "_fsdp_param.py"),
    (FSDP_ROLE_COPY_OUT_TEMP, ("foreach_all_gather_copy_out",), "_fsdp_collectives.py"),
    (FSDP_ROLE_ALL_GATHER_INPUT, ("_get_param_all_gather_inputs",), "_fsdp_collectives.py"),
    (FSDP_ROLE_ALL_GATHER_INPUT, ("all_gather_inputs",), "_fsdp_param.py"),
    (FSDP_ROLE_ALL_GATHER_OUTPUT, ("foreach_all_gather",), "_fsdp_collectives.py"),
    (FSDP_ROLE_REDUCE_SCATTER, ("foreach_reduce",), "_fsdp_collectives.py"),
    (FSDP_ROLE_SHARDED_PARAM, ("_init_sharded_param", "reset_sharded_param", "_init_sharded_post_forward_param_metadata"),
     "_fsdp_param.py"),
    (FSDP_ROLE_ALL_GATHER_INPUT, ("_use_low_precision_shard",), "flat_param.py"),
    (FSDP_ROLE_ALL_GATHER_OUTPUT, ("_alloc_padded_unsharded_flat_param",), "flat_param.py"),
    (FSDP_ROLE_REDUCE_SCATTER, ("_reduce_grad", "_get_reduce_scatter_tensors", "_reduce_grad_no_shard"),
     "_runtime_utils.py"),
    (FSDP_ROLE_SHARDED_PARAM, ("_init_flat_param_and_metadata", "flatten_tensors_into_flat_param", "_shard",
                               "shard"), "flat_param.py"),
]
# The FSDP phase of an allocation from FSDP2's / FSDP1's functions in its stack frames (snapshots), the first
# rule that matches: (phase, regex over the frame signature ``name@file|...`` in lower case, substrings one of
# which any match contains).
FSDP_PHASE_FRAME_RULES = [
    (PHASE_ALL_GATHER_COPY_OUT, r"foreach_all_gather_copy_out", ("foreach_all_gather_copy_out",)),
    (PHASE_ALL_GATHER, r"foreach_all_gather|_all_gather_flat_param|_alloc_padded_unsharded",
     ("foreach_all_gather", "_all_gather_flat_param", "_alloc_padded_unsharded")),
    (PHASE_UNSHARD, r"(?:^|\|)_?unshard@", ("unshard@",)),
    (PHASE_POST_BACKWARD_REDUCE, r"foreach_reduce|_reduce_grad|_post_backward_hook@",
     ("foreach_reduce", "_reduce_grad", "_post_backward_hook@"))]
# Module calls in a stack (nn.Module.__call__): the innermost one in an all-gather's stack is the FSDP
# unit whose pre-forward hook unshards it.
MODULE_CALL_FUNCTIONS = ("_call_impl",)
MODULE_CALL_FILE = "torch/nn/modules/module.py"
# FSDP2's pre-forward hook of a unit of several modules (fully_shard([norm, output])): function and file in the
# all-gather's stack.  The unit runs from that all-gather (in its first module's call) to its post-forward (in its last
# module's), through sibling module calls
FSDP2_GROUP_PRE_HOOK = ("wrapped_pre_hook", "_fsdp_state.py")


# --------------------------------------------------------------------------- units
ROOT_UNIT = ""                 # the root unit's fqn (FSDP2 annotations without one, the inventory's root)
ROOT_UNIT_TEXT = "(root)"      # how tables name it


def unit_order(units, forward=()) -> list:
    """FSDP units (fqns, each once) in the model's one order: the root first, then the units of ``forward``
    (the model's forward order when known: the inventory's units) in that order, then the others by name
    with numbers compared as numbers (layers.2 before layers.10)."""
    pos = {u: i for i, u in enumerate(dict.fromkeys(forward))}

    def key(u):
        u = str(u)
        if u in (ROOT_UNIT, ROOT_UNIT_TEXT):
            return (0, 0, [])
        if u in pos:
            return (1, pos[u], [])
        return (2, 0, [(0, int(p), "") if p.isdigit() else (1, 0, p) for p in re.split(r"[.]", u)])
    return sorted(dict.fromkeys(units), key=key)
