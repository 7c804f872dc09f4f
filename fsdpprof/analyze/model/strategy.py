"""Data-parallel strategies: their names, the one table of the spellings users write, and the ZeRO stage
each implements (what the formulas of :mod:`fsdpprof.analyze.theory` take)."""
from __future__ import annotations

from fsdpprof.errors import UserError
from fsdpprof.options import shown

__all__ = ["DDP", "NO_SHARD", "ZERO1", "SHARD_GRAD_OP", "FULL_SHARD", "HYBRID_SHARD", "NONE", "STANDARD", "SHARDED",
           "REPLICATED", "STRATEGY_ALIASES", "known_strategy", "strategy_name", "ZERO_DDP", "ZERO_1", "ZERO_2", "ZERO_3", "ZERO_HYBRID",
           "ZERO_SHARDED_STAGES", "ZERO_STAGES", "ZERO_STAGE", "zero_stage"]

# FSDP's ShardingStrategy names, DDP, and ZeRO-1 (optimizer states sharded: no FSDP strategy does only that)
DDP, NO_SHARD, ZERO1 = "DDP", "NO_SHARD", "ZERO1"
SHARD_GRAD_OP, FULL_SHARD, HYBRID_SHARD = "SHARD_GRAD_OP", "FULL_SHARD", "HYBRID_SHARD"
NONE = "NONE"                    # inventory.json of a job with no data parallelism (one device)
STANDARD = [DDP, NO_SHARD, SHARD_GRAD_OP, FULL_SHARD, HYBRID_SHARD]    # what FSDP / DDP users choose between
SHARDED = frozenset({SHARD_GRAD_OP, FULL_SHARD, HYBRID_SHARD})         # parameters sharded (unsharded to compute)
REPLICATED = frozenset({DDP, NO_SHARD, NONE})                          # every rank holds every model state

# A spelling (upper case, '-' and ' ' read as '_') -> the strategy. NO_SHARD stays itself: it is FSDP's (one
# all-reduce per unit, FSDP's hooks), with DDP's memory and traffic (:data:`ZERO_STAGE`).
STRATEGY_ALIASES = {
    "DDP": DDP, "NO_SHARD": NO_SHARD, "NOSHARD": NO_SHARD, "NONE": NONE,
    "ZERO1": ZERO1, "ZERO_1": ZERO1,
    "SHARD_GRAD_OP": SHARD_GRAD_OP, "ZERO2": SHARD_GRAD_OP, "ZERO_2": SHARD_GRAD_OP,
    "FULL_SHARD": FULL_SHARD, "ZERO3": FULL_SHARD, "ZERO_3": FULL_SHARD,
    "HYBRID_SHARD": HYBRID_SHARD, "HSDP": HYBRID_SHARD,
}


def known_strategy(text) -> str | None:
    """The strategy a spelling names (``full_shard``, ``HSDP``, ``zero-3`` ...), None when it names none."""
    return STRATEGY_ALIASES.get(str(text or "").strip().upper().replace(" ", "_").replace("-", "_"))


def strategy_name(text, choices=None) -> str:
    """:func:`known_strategy` of a user's spelling; UserError in one line when it names none, or none of
    ``choices`` (default: every strategy)."""
    s = known_strategy(text)
    if s is None or (choices is not None and s not in choices):
        allowed = choices if choices is not None else [DDP, NO_SHARD, ZERO1, SHARD_GRAD_OP, FULL_SHARD, HYBRID_SHARD]
        raise UserError(f"unknown strategy {shown(text)}: use one of {', '.join(allowed)}")
    return s


# The ZeRO stage of each strategy: what is sharded (DDP: nothing; ZERO1: optimizer states; ZERO2: + gradients;
# ZERO3: + parameters; HYBRID_SHARD: ZERO3 within a shard group, replicated across groups)
ZERO_DDP, ZERO_1, ZERO_2, ZERO_3, ZERO_HYBRID = DDP, ZERO1, "ZERO2", "ZERO3", HYBRID_SHARD
ZERO_STAGES = [ZERO_DDP, ZERO_1, ZERO_2, ZERO_3, ZERO_HYBRID]
ZERO_SHARDED_STAGES = frozenset({ZERO_1, ZERO_2, ZERO_3})      # something sharded over the whole world
ZERO_STAGE = {DDP: ZERO_DDP, NO_SHARD: ZERO_DDP, NONE: ZERO_DDP, ZERO1: ZERO_1, SHARD_GRAD_OP: ZERO_2,
              FULL_SHARD: ZERO_3, HYBRID_SHARD: ZERO_HYBRID}


def zero_stage(text) -> str:
    """The ZeRO stage (:data:`ZERO_STAGES`) of a strategy's spelling (``FULL_SHARD`` -> ``ZERO3``, ``ZeRO-2`` ->
    ``ZERO2``, ``NO_SHARD`` -> ``DDP``); UserError when it names none."""
    return ZERO_STAGE[strategy_name(text)]
