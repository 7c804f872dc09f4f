"""What a run was (:class:`Source`) and what it could be (:class:`Target`): strategy, world size, shard
group, resharding after forward, mixed-precision dtypes, CPU offload and local batch.

``family`` is the implementation a target follows (``fsdp2``, ``fsdp1``, ``ddp``): an FSDP run keeps its own,
a DDP run is predicted as FSDP2. A refused target raises a one-line :class:`fsdpprof.errors.UserError`.
"""
from __future__ import annotations

import math
from dataclasses import dataclass

from fsdpprof import runfmt
from fsdpprof.analyze import model
from fsdpprof.analyze.model import DDP, FULL_SHARD, HYBRID_SHARD, NO_SHARD, SHARD_GRAD_OP, SHARDED, STANDARD
from fsdpprof.errors import UserError

MAX_WORLD = 1 << 20
MAX_BATCH_SCALE = 1024.0
DEFAULT_RESHARD = {FULL_SHARD: True, HYBRID_SHARD: True, SHARD_GRAD_OP: False}   # reshard_after_forward


def reshard_ranks(raf) -> int | None:
    """The ranks an int ``reshard_after_forward`` reshards to (None for True / False / None)."""
    return raf if isinstance(raf, int) and not isinstance(raf, bool) else None


def dtype_name(text, what: str) -> str:
    """torch dtype name (float32, bfloat16, ...) of a spelling, refusing unknown ones."""
    name, size = model.dtype_size(str(text))
    if size != size or name is None:
        raise UserError(f"{what} {str(text)[:40]!r} is not a dtype: use fp32, bf16 or fp16")
    return name


@dataclass(frozen=True)
class Source:
    """What the recorded run was, from its inventory and rank.json (one rank; the ranks agree)."""

    family: str                      # fsdp2 | fsdp1 | ddp | none
    strategy: str                    # one of STANDARD, or NONE (no data parallelism)
    world_size: int
    shard_group: int                 # ranks a parameter is sharded over (1 = replicated)
    reshard_after_forward: object    # True / False / int (FSDP), None otherwise
    stored_dtype: str                # dtype the parameters are stored in (sharded / replicated copy)
    param_dtype: str                 # dtype of the unsharded parameters and of compute (mixed precision)
    reduce_dtype: str                # dtype of the gradient reduction
    cpu_offload: bool
    device_type: str                 # cpu | cuda | ...
    hosts: int = 1
    ranks_per_host: int | None = None

    @property
    def sharded(self) -> bool:
        return self.strategy in SHARDED

    @property
    def fsdp_family(self) -> str:
        """The FSDP family a sharded target of this run follows by default (the run's, FSDP2 for others)."""
        return self.family if self.family in model.FSDP_FAMILIES else model.FAMILY_FSDP2


@dataclass(frozen=True)
class Target:
    """One configuration to predict. ``shard_group``: ranks a parameter is sharded over (1 for DDP and
    NO_SHARD, the world for SHARD_GRAD_OP / FULL_SHARD, K for HYBRID_SHARD); ``reshard_after_forward``:
    True, False or an int (reshard to groups of that many ranks after forward)."""

    strategy: str
    world_size: int
    shard_group: int
    reshard_after_forward: object
    family: str
    param_dtype: str
    reduce_dtype: str
    cpu_offload: bool = False
    batch_scale: float = 1.0
    ranks_per_host: int | None = None   # None: the run's layout (see :func:`ranks_on_host`)

    @property
    def sharded(self) -> bool:
        return self.strategy in SHARDED

    @property
    def replicas(self) -> int:
        return self.world_size // self.shard_group

    @property
    def label(self) -> str:
        s = self.strategy + (f" ({self.shard_group}x{self.replicas})" if self.strategy == HYBRID_SHARD else "")
        if reshard_ranks(self.reshard_after_forward) is not None:
            s += f" reshard->{self.reshard_after_forward}"
        return s + (" + offload" if self.cpu_offload else "")

    def to_dict(self) -> dict:
        return {"strategy": self.strategy, "label": self.label, "world_size": self.world_size,
                "shard_group": self.shard_group, "replicas": self.replicas,
                "reshard_after_forward": self.reshard_after_forward, "family": self.family,
                "param_dtype": self.param_dtype, "reduce_dtype": self.reduce_dtype, "cpu_offload": self.cpu_offload,
                "batch_scale": self.batch_scale, "ranks_per_host": self.ranks_per_host}


def source_of(inventory: dict | None, info: dict | None, device_type: str | None = None,
              hosts: int = 1, ranks_per_host: int | None = None) -> Source:
    """The run's configuration from one rank's inventory.json (and rank.json ``info``)."""
    inv, info = inventory or {}, info or {}
    if not inv:
        raise UserError("the run has no inventory.json (parameter sizes, units and strategy are unknown): record it "
                        "with `fsdpprof record` to predict other strategies")
    raw = str(inv.get("strategy") or model.NONE).upper()
    strategy = model.known_strategy(raw) or raw
    shard = int(inv.get("shard_group_size") or 1) if strategy not in model.REPLICATED else 1
    stored = next((u.get("dtype") for u in inv.get("units") or [] if u.get("dtype")), None)
    if stored is None:
        stored = next((t.get("dtype") for t in inv.get("tensors") or [] if t.get("role") == runfmt.ROLE_PARAM),
                      "float32")
    stored = model.dtype_size(str(stored))[0] or "float32"
    mp = inv.get("mixed_precision") or {}
    param_dtype = model.dtype_size(str(mp.get("param_dtype") or stored))[0] or stored
    reduce_dtype = model.dtype_size(str(mp.get("reduce_dtype") or param_dtype))[0] or param_dtype
    return Source(family=str(inv.get("framework") or model.FRAMEWORK_NONE), strategy=strategy,
                  world_size=max(int(inv.get("world_size") or info.get("world_size") or 1), 1),
                  shard_group=max(shard, 1), reshard_after_forward=DEFAULT_RESHARD.get(strategy), stored_dtype=stored,
                  param_dtype=param_dtype, reduce_dtype=reduce_dtype, cpu_offload=bool(inv.get("cpu_offload")),
                  device_type=device_type or str(info.get("device") or "cpu").split(":")[0] or "cpu",
                  hosts=max(int(hosts or 1), 1), ranks_per_host=ranks_per_host)


def ranks_on_host(source: Source, target: Target) -> int:
    """Ranks of the target on one host: its ``ranks_per_host``, else the run's layout (a run on one host:
    all the target's ranks on it; on several: as many per host as the run had), at most its world."""
    per = target.ranks_per_host or (source.ranks_per_host if source.hosts > 1 else None) or target.world_size
    return max(1, min(int(per), target.world_size))


def _number(value, what: str, example: str) -> float:
    try:
        return float(str(value).strip())
    except ValueError:
        raise UserError(f"{what} {str(value)[:40]!r} is not a number: give {example}") from None


def _positive_int(value, what: str, limit: int = MAX_WORLD) -> int:
    f = _number(value, what, "a whole number such as 8")
    if not math.isfinite(f) or f != int(f) or f < 1 or f > limit:
        raise UserError(f"{what} {str(value)[:40]!r} must be a whole number from 1 to {limit}")
    return int(f)


def parse_reshard(value) -> object:
    """``--reshard-after-forward``: true | false | a positive int (ranks to reshard to)."""
    if value is None or isinstance(value, (bool, int)):
        return value
    text = str(value).strip().lower()
    if text in ("true", "yes", "1.0", "on"):
        return True
    if text in ("false", "no", "off", "0"):
        return False
    return _positive_int(text, "--reshard-after-forward", MAX_WORLD)


def parse_batch_scale(value) -> float:
    f = _number(value, "--batch-scale", "e.g. 2 or 0.5")
    if not math.isfinite(f) or f <= 0 or f > MAX_BATCH_SCALE:
        raise UserError(f"--batch-scale {str(value)[:40]!r} must be a number above 0 and at most "
                        f"{MAX_BATCH_SCALE:g}")
    return f


def _shard_group(source: Source, s: str, n: int, shard_group) -> int:
    """The target's shard group (``shard_group``: --shard-group, None when not given), checked."""
    k = None if shard_group is None or s == HYBRID_SHARD else _positive_int(shard_group, "--shard-group")
    if s in (DDP, NO_SHARD):
        if k not in (None, 1):
            raise UserError(f"--shard-group applies to HYBRID_SHARD; {s} shards nothing (use --strategy HYBRID_SHARD)")
        return 1
    if s != HYBRID_SHARD:
        if k not in (None, n):
            raise UserError(f"--shard-group applies to HYBRID_SHARD; {s} shards over the whole world of {n} ranks "
                            f"(use --strategy HYBRID_SHARD --shard-group K)")
        return n
    groups = [g for g in range(2, n) if n % g == 0]
    if not groups:
        raise UserError(f"HYBRID_SHARD does not apply at world size {n}: it needs a shard group K that divides "
                        f"the world size with 1 < K < {n}, and {n} has none")
    if shard_group is not None:
        k = _positive_int(shard_group, "--shard-group")
    elif source.strategy == HYBRID_SHARD and n == source.world_size:
        k = source.shard_group
    elif source.hosts > 1 and source.ranks_per_host and n % source.ranks_per_host == 0:
        k = source.ranks_per_host
    else:
        raise UserError(f"HYBRID_SHARD needs a shard group: pass --shard-group K, one of "
                        f"{', '.join(map(str, groups))} (K divides the world size {n}), e.g. the GPUs of one node")
    if n % k or not 1 < k < n:
        raise UserError(f"--shard-group {k} must divide the world size {n} and lie strictly between 1 and {n} "
                        f"(K = {n} is FULL_SHARD, K = 1 is NO_SHARD)")
    return k


def make_target(source: Source, strategy=None, *, world_size=None, shard_group=None, reshard_after_forward=None,
                param_dtype=None, reduce_dtype=None, cpu_offload=None, batch_scale=1.0, family=None,
                ranks_per_host=None) -> Target:
    """A checked Target; what is not given comes from ``source`` (its world size, dtypes, family...).
    An impossible combination is refused in one line (UserError)."""
    s = model.strategy_name(strategy, STANDARD) if strategy is not None else (
        source.strategy if source.strategy in STANDARD else DDP)
    n = _positive_int(world_size, "--world") if world_size is not None else source.world_size
    raf = parse_reshard(reshard_after_forward)
    family = str(family if family is not None else model.FAMILY_DDP if s == DDP else source.fsdp_family).lower()
    if family not in model.FAMILIES:
        raise UserError(f"--fsdp-version {family!r}: use 1 or 2")
    if s == DDP:
        family = model.FAMILY_DDP
    elif family == model.FAMILY_DDP:
        raise UserError(f"{s} is an FSDP strategy: pass --fsdp-version 1 or 2, not ddp")
    k = _shard_group(source, s, n, shard_group)
    if s == NO_SHARD and n < 2:
        raise UserError("NO_SHARD needs a world of at least 2 ranks")
    if raf is None:
        raf = DEFAULT_RESHARD.get(s)
    elif s in (DDP, NO_SHARD):
        raise UserError(f"--reshard-after-forward applies to sharded strategies; {s} keeps whole parameters")
    elif s == SHARD_GRAD_OP and raf is not False:
        raise UserError("SHARD_GRAD_OP is reshard_after_forward=False; for resharding use --strategy FULL_SHARD "
                        "(or HYBRID_SHARD) with --reshard-after-forward true or an int")
    elif s == FULL_SHARD and raf is False:
        s = SHARD_GRAD_OP
    if reshard_ranks(raf) is not None:
        if family != model.FAMILY_FSDP2:
            raise UserError("--reshard-after-forward INT is FSDP2's (fully_shard); FSDP1 reshards to the full "
                            "shard group: pass true or false, or --fsdp-version 2")
        if raf == k:
            raf = True
        elif raf == 1:
            raf, s = False, SHARD_GRAD_OP if s == FULL_SHARD else s
        elif k % raf:
            raise UserError(f"--reshard-after-forward {raf} must divide the shard group of {k} ranks")
    pd_ = dtype_name(param_dtype, "--param-dtype") if param_dtype is not None else source.param_dtype
    rd_ = dtype_name(reduce_dtype, "--reduce-dtype") if reduce_dtype is not None else (
        source.reduce_dtype if param_dtype is None else pd_)
    off = bool(source.cpu_offload if cpu_offload is None and s in SHARDED and source.sharded else cpu_offload or False)
    if off and s not in SHARDED:
        raise UserError(f"--cpu-offload offloads sharded parameters (FSDP CPUOffload); {s} has none: use "
                        f"--strategy FULL_SHARD, SHARD_GRAD_OP or HYBRID_SHARD")
    if off and family == model.FAMILY_FSDP1 and source.device_type == "cpu":
        raise UserError("FSDP1 CPU offload pins memory and needs an accelerator: on CPU use --fsdp-version 2")
    per_host = _positive_int(ranks_per_host, "--ranks-per-host") if ranks_per_host is not None else None
    if per_host is not None and n % per_host:
        raise UserError(f"--ranks-per-host {per_host} must divide the world size {n} (whole hosts)")
    return Target(strategy=s, world_size=n, shard_group=k, reshard_after_forward=raf, family=family,
                  param_dtype=pd_, reduce_dtype=rd_, cpu_offload=off, batch_scale=parse_batch_scale(batch_scale),
                  ranks_per_host=per_host)


def describe_source(source: Source) -> str:
    """The recorded run in the words every command uses (model.describe_input)."""
    return model.describe_input(model.input_kind(source.family, (), source.world_size), source.strategy,
                                source.world_size)


def target_of_source(source: Source) -> Target:
    """The run itself as a Target (what a prediction of the run from itself must give back)."""
    s = source.strategy if source.strategy in STANDARD else DDP
    return Target(strategy=s, world_size=source.world_size, shard_group=source.shard_group if s in SHARDED else 1,
                  reshard_after_forward=source.reshard_after_forward, family=model.FAMILY_DDP if s == DDP else source.fsdp_family,
                  param_dtype=source.param_dtype, reduce_dtype=source.reduce_dtype,
                  cpu_offload=source.cpu_offload and s in SHARDED)


def standard_targets(source: Source, base: Target | None = None) -> tuple[list[Target], list[str]]:
    """Every standard strategy at the run's world size (with ``base``'s dtypes, batch scale, hosts; offload
    off), and a note for each strategy left out (HYBRID_SHARD without a shard group to take)."""
    out, notes = [], []
    for s in STANDARD:
        try:
            out.append(make_target(source, s, param_dtype=base and base.param_dtype,
                                   reduce_dtype=base and base.reduce_dtype, cpu_offload=False,
                                   batch_scale=base.batch_scale if base else 1.0,
                                   ranks_per_host=base and base.ranks_per_host,
                                   family=base.family if base and base.family != model.FAMILY_DDP and s != DDP else None))
        except UserError as exc:
            notes.append(f"{s} left out: {exc}")
    return out, notes


def same_config(a: Target, b: Target) -> bool:
    return a == b
