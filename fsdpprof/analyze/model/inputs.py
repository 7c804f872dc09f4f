"""What an input is (FSDP2, FSDP1, DDP, another distributed job, one device) and the one way every command
describes it: strategy, framework and world size in a few words."""
from __future__ import annotations

from fsdpprof import runfmt
from fsdpprof.analyze.model.fsdp import FAMILY_DDP, FAMILY_FSDP1, FAMILY_FSDP2
from fsdpprof.analyze.model.strategy import DDP, NO_SHARD, NONE

__all__ = ["INPUT_DISTRIBUTED", "INPUT_SINGLE_DEVICE", "INPUT_UNKNOWN", "INPUT_KINDS", "FSDP_KINDS",
           "FRAMEWORK_NONE", "DDP_MARKERS", "DDP_REDUCER_PREFIXES", "input_kind", "input_sharded", "describe_input",
           "INPUT_KIND_SHORT", "INPUT_KIND_TEXT", "rank_list", "WORKLOAD_TRAINING",
           "WORKLOAD_INFERENCE", "TRAINING_MARKERS", "workload_of"]

INPUT_DISTRIBUTED = "distributed"       # a distributed job of another framework (not FSDP, not DDP)
INPUT_SINGLE_DEVICE = "single_device"   # one device, no communication
INPUT_UNKNOWN = "unknown"
INPUT_KINDS = [FAMILY_FSDP2, FAMILY_FSDP1, FAMILY_DDP, INPUT_DISTRIBUTED, INPUT_SINGLE_DEVICE, INPUT_UNKNOWN]
FSDP_KINDS = frozenset({FAMILY_FSDP2, FAMILY_FSDP1})
FRAMEWORK_NONE = runfmt.FRAMEWORK_NONE  # inventory.json's framework of a job without data parallelism
INPUT_KIND_SHORT = {FAMILY_FSDP2: "FSDP2", FAMILY_FSDP1: "FSDP1", FAMILY_DDP: "DDP", INPUT_DISTRIBUTED: "distributed",
                    INPUT_SINGLE_DEVICE: "one device"}
INPUT_KIND_TEXT = {FAMILY_FSDP2: "FSDP2 (fully_shard)", FAMILY_FSDP1: "FSDP1 (FullyShardedDataParallel)",
                   FAMILY_DDP: "DDP (DistributedDataParallel): nothing sharded",
                   INPUT_DISTRIBUTED: "distributed job of another framework (not FSDP)",
                   INPUT_SINGLE_DEVICE: "one device, no communication", INPUT_UNKNOWN: "unknown"}
DDP_MARKERS = ("DistributedDataParallel.", "Reducer::")
# DDP's reducer on the training thread (torch 2.x's record_function names): the gradient hooks' division by
# the world size (mul_out) and the copies out of the buckets after the all-reduce: DDP's own CPU work
DDP_REDUCER_PREFIXES = ("torch::distributed::reducer::", "torch.distributed.ddp.reducer::")


# what the job does: training (a backward pass or an optimizer step is in the trace) or inference (neither)
WORKLOAD_TRAINING, WORKLOAD_INFERENCE = "training", "inference"
# op names only training runs: autograd's backward functions, the optimizer's step (record_function names)
TRAINING_MARKERS = ("autograd::engine::evaluate_function", "Optimizer.step", "Optimizer.zero_grad")


def workload_of(names) -> str | None:
    """``training`` when any op name is a backward function (``...Backward``) or a TRAINING_MARKERS op,
    ``inference`` when there are names and none is, None without names."""
    names = [n for n in names if isinstance(n, str)]
    if not names:
        return None
    training = any(n.startswith(TRAINING_MARKERS) or n.endswith(("Backward0", "Backward1")) for n in names)
    return WORKLOAD_TRAINING if training else WORKLOAD_INFERENCE


def input_kind(framework: str | None, found=(), world_size=None) -> str:
    """What the input is (one of INPUT_KINDS) from inventory.json's ``framework`` when there is one, else from
    what its ranks showed (``found``: kinds seen in traces / snapshot frames)."""
    if framework in (FAMILY_FSDP2, FAMILY_FSDP1, FAMILY_DDP):
        return framework
    if framework == FRAMEWORK_NONE:
        return INPUT_SINGLE_DEVICE if (world_size or 1) <= 1 else INPUT_DISTRIBUTED
    found = set(found)
    for kind in (FAMILY_FSDP2, FAMILY_FSDP1, FAMILY_DDP, INPUT_DISTRIBUTED, INPUT_SINGLE_DEVICE):
        if kind in found:
            if kind == INPUT_SINGLE_DEVICE and (world_size or 1) > 1:
                return INPUT_DISTRIBUTED
            return kind
    return INPUT_UNKNOWN


def input_sharded(kind: str | None, strategy: str | None) -> bool:
    """Are the input's model states sharded (an FSDP run whose strategy shards)?"""
    return kind in FSDP_KINDS and str(strategy or "") not in (DDP, NO_SHARD)


def describe_input(kind: str | None, strategy: str | None, world_size) -> str:
    """The input in a few words, the same in every command: ``FULL_SHARD, FSDP2, 8 ranks``, ``DDP, 16 ranks``
    (traces: DDP found in them), ``FSDP1, 4 ranks`` (the strategy unknown), ``one device``."""
    if kind == INPUT_SINGLE_DEVICE or (kind == INPUT_UNKNOWN and strategy == NONE and (world_size or 1) <= 1):
        return INPUT_KIND_SHORT[INPUT_SINGLE_DEVICE]
    n = int(world_size) if world_size else None
    ranks = f"{n} rank{'s' if n != 1 else ''}" if n else "world size unknown"
    if kind == FAMILY_DDP and strategy in (None, "", DDP):
        return f"{DDP}, {ranks}"
    short = INPUT_KIND_SHORT.get(kind)
    if strategy and strategy != NONE:
        return ", ".join([strategy] + ([short] if short else []) + [ranks])
    return f"{short or 'unknown input'}, {ranks}"


def rank_list(ranks) -> str:
    """'rank 3', 'ranks 0-7', 'ranks 0-2, 5' (ranges of consecutive ranks)."""
    rs = sorted(set(int(r) for r in ranks))
    parts, i = [], 0
    while i < len(rs):
        j = i
        while j + 1 < len(rs) and rs[j + 1] == rs[j] + 1:
            j += 1
        parts.append(str(rs[i]) if i == j else f"{rs[i]}-{rs[j]}")
        i = j + 1
    return ("rank " if len(rs) == 1 else "ranks ") + ", ".join(parts)
