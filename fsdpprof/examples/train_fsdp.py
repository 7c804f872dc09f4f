"""fsdpprof's example: a small transformer-like model trained with FSDP2, FSDP1, DDP or nothing.

Run it under torchrun (gloo on CPU, NCCL when a GPU is present)::

    torchrun --standalone --nproc-per-node=2 -m fsdpprof.examples.train_fsdp --strategy fsdp2 --steps 5

Strategies: fsdp2 (FULL_SHARD), fsdp2-no-reshard (SHARD_GRAD_OP), hsdp (FSDP2 on a 2-D mesh), fsdp2-offload
(CPUOffloadPolicy, unpinned on CPU), fsdp1-full, fsdp1-grad-op, fsdp1-no-shard, fsdp1-hybrid (HYBRID_SHARD on a
2-D mesh), ddp, none (one process, no torch.distributed).  Every block is one FSDP unit, plus the root.

FSDPPROF_EXAMPLE_SLEEP="RANK:UNIT:MS" (e.g. "1:layers.2:80") makes rank RANK sleep MS ms on the host in block
UNIT's forward, every step: a straggler with a known cause, for checking fsdpprof's critical path.
"""
from __future__ import annotations

import argparse
import json
import os
import re
import socket
import sys
import time

import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F

STRATEGIES = ("fsdp2", "fsdp2-no-reshard", "hsdp", "fsdp2-offload", "fsdp1-full", "fsdp1-grad-op", "fsdp1-no-shard",
              "fsdp1-hybrid", "ddp", "none")


class Attention(nn.Module):
    def __init__(self, dim: int, heads: int):
        super().__init__()
        self.heads = heads
        self.qkv = nn.Linear(dim, 3 * dim)
        self.proj = nn.Linear(dim, dim)

    def forward(self, x):
        b, t, d = x.shape
        q, k, v = self.qkv(x).view(b, t, 3, self.heads, d // self.heads).permute(2, 0, 3, 1, 4)
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        return self.proj(y.transpose(1, 2).reshape(b, t, d))


class MLP(nn.Module):
    def __init__(self, dim: int):
        super().__init__()
        self.fc1 = nn.Linear(dim, 4 * dim)
        self.fc2 = nn.Linear(4 * dim, dim)

    def forward(self, x):
        return self.fc2(F.gelu(self.fc1(x)))


class Block(nn.Module):
    def __init__(self, dim: int, heads: int):
        super().__init__()
        self.norm1 = nn.LayerNorm(dim)
        self.attn = Attention(dim, heads)
        self.norm2 = nn.LayerNorm(dim)
        self.mlp = MLP(dim)

    sleep_s = 0.0       # FSDPPROF_EXAMPLE_SLEEP: a host stall in this block's forward

    def forward(self, x):
        if self.sleep_s:
            time.sleep(self.sleep_s)
        x = x + self.attn(self.norm1(x))
        return x + self.mlp(self.norm2(x))


class TinyTransformer(nn.Module):
    def __init__(self, vocab: int, dim: int, layers: int, heads: int, seq: int):
        super().__init__()
        self.embed = nn.Embedding(vocab, dim)
        self.pos = nn.Parameter(torch.zeros(seq, dim))
        self.layers = nn.ModuleList(Block(dim, heads) for _ in range(layers))
        self.norm = nn.LayerNorm(dim)
        self.head = nn.Linear(dim, vocab, bias=False)

    def forward(self, tokens):
        x = self.embed(tokens) + self.pos[: tokens.shape[1]]
        for layer in self.layers:
            x = layer(x)
        return self.head(self.norm(x))


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--strategy", choices=STRATEGIES, default="fsdp2")
    p.add_argument("--steps", type=int, default=10)
    p.add_argument("--mixed-precision", choices=("none", "bf16"), default="none")
    p.add_argument("--cpu-offload", action="store_true", help="FSDP only: keep sharded params on the CPU")
    p.add_argument("--crash-at-step", type=int, default=None, help="raise an error in this step (0-based)")
    p.add_argument("--crash-rank", type=int, default=None, help="only this rank crashes (default: every rank)")
    for name, default in (("vocab", 1024), ("dim", 256), ("layers", 4), ("heads", 4), ("seq", 64), ("batch", 4)):
        p.add_argument(f"--{name}", type=int, default=default)
    p.add_argument("--lr", type=float, default=1e-3)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--quiet", action="store_true", help="print nothing")
    p.add_argument("--memory-oracle", metavar="PREFIX", default=None,
                   help="CPU memory check: from before the model's construction to the end, c10's CPU allocator "
                        "counts every thread's bytes and logs each allocation (stderr goes to PREFIX.<rank>.log); "
                        "the most bytes alive at once is written into PREFIX.<rank> (JSON). No profiler: it runs "
                        "under fsdpprof record, on the very run recorded")
    p.add_argument("--time-steps", action="store_true",
                   help="rank 0 prints every step's wall time (ms) as JSON: train_fsdp: step_ms=[...]")
    return p.parse_args(argv)


SLEEP_ENV = "FSDPPROF_EXAMPLE_SLEEP"


def injected_sleep(rank: int, blocks: int) -> tuple[int, float] | None:
    """(block index, seconds) of FSDPPROF_EXAMPLE_SLEEP="RANK:layers.K:MS" for this rank, else None; a malformed
    value is an error that says the format."""
    v = os.environ.get(SLEEP_ENV)
    if not v:
        return None
    try:
        r, unit, ms = v.split(":")
        k = int(unit.rsplit(".", 1)[-1])
        secs = float(ms) / 1000.0
        if not 0 <= k < blocks or secs < 0:
            raise ValueError
    except ValueError:
        raise SystemExit(f"train_fsdp: {SLEEP_ENV}={v!r}: give RANK:layers.K:MS with 0 <= K < {blocks}, "
                         f"e.g. 1:layers.2:80") from None
    return (k, secs) if int(r) == rank else None


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def setup_distributed(device_type: str):
    if "RANK" not in os.environ:  # plain `python train_fsdp.py`: a world of one
        os.environ.update(RANK="0", LOCAL_RANK="0", WORLD_SIZE="1", MASTER_ADDR="127.0.0.1",
                          MASTER_PORT=str(_free_port()))
    backend = "nccl" if device_type == "cuda" else "gloo"
    local_rank = int(os.environ.get("LOCAL_RANK", "0"))
    if device_type == "cuda":
        torch.cuda.set_device(local_rank)
        dist.init_process_group(backend, device_id=torch.device("cuda", local_rank))
    else:
        dist.init_process_group(backend)
    return dist.get_rank(), dist.get_world_size(), local_rank


def mesh_2d(device_type: str, world: int):
    from torch.distributed.device_mesh import init_device_mesh

    if world % 2 or world < 2:
        raise SystemExit(f"hybrid sharding needs an even world size >= 2 (got {world})")
    replicate = 2 if world >= 4 else 1
    return init_device_mesh(device_type, (replicate, world // replicate), mesh_dim_names=("replicate", "shard"))


def wrap(model: nn.Module, args, device: torch.device, world: int) -> nn.Module:
    s = args.strategy
    bf16 = args.mixed_precision == "bf16"
    on_cpu = device.type == "cpu"
    if s in ("fsdp2", "fsdp2-no-reshard", "hsdp", "fsdp2-offload"):
        from torch.distributed.device_mesh import init_device_mesh
        from torch.distributed.fsdp import CPUOffloadPolicy, MixedPrecisionPolicy, fully_shard

        mesh = mesh_2d(device.type, world) if s == "hsdp" else init_device_mesh(device.type, (world,))
        kw = dict(mesh=mesh, reshard_after_forward=(s != "fsdp2-no-reshard"))
        if bf16:
            kw["mp_policy"] = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
        if args.cpu_offload or s == "fsdp2-offload":  # pinned memory needs an accelerator
            kw["offload_policy"] = CPUOffloadPolicy(pin_memory=not on_cpu)
        for layer in model.layers:
            fully_shard(layer, **kw)
        fully_shard(model, **kw)
        return model
    if s.startswith("fsdp1"):
        from torch.distributed.fsdp import CPUOffload, MixedPrecision, ShardingStrategy
        from torch.distributed.fsdp import FullyShardedDataParallel as FSDP
        from torch.distributed.fsdp.wrap import ModuleWrapPolicy

        strategy = {"fsdp1-full": ShardingStrategy.FULL_SHARD, "fsdp1-grad-op": ShardingStrategy.SHARD_GRAD_OP,
                    "fsdp1-no-shard": ShardingStrategy.NO_SHARD, "fsdp1-hybrid": ShardingStrategy.HYBRID_SHARD}[s]
        kw = dict(auto_wrap_policy=ModuleWrapPolicy({Block}), sharding_strategy=strategy, device_id=device)
        if s == "fsdp1-hybrid":  # without a mesh HYBRID_SHARD silently degrades to local training on CPU
            kw["device_mesh"] = mesh_2d(device.type, world)
        if bf16:
            kw["mixed_precision"] = MixedPrecision(param_dtype=torch.bfloat16, reduce_dtype=torch.bfloat16,
                                                   buffer_dtype=torch.bfloat16)
        if args.cpu_offload:
            if on_cpu:
                raise SystemExit("train_fsdp: FSDP1 CPU offload pins memory and needs an accelerator; "
                                 "on CPU use --strategy fsdp2 --cpu-offload")
            kw["cpu_offload"] = CPUOffload(offload_params=True)
        return FSDP(model, **kw)
    if s == "ddp":
        from torch.nn.parallel import DistributedDataParallel as DDP

        return DDP(model, device_ids=[device.index] if device.type == "cuda" else None)
    return model


_C10_LINE = re.compile(rb"C10 (alloc|deleted) \d+ bytes, total alloc (\d+) bytes|train_fsdp: step (\d+) optimizer done")


def _c10_flags():
    """c10's CPU-allocator count flag and log level (ctypes views into libc10)."""
    import ctypes

    lib = ctypes.CDLL(os.path.join(os.path.dirname(torch.__file__), "lib", "libc10.so"))
    return (ctypes.c_bool.in_dll(lib, "FLAGS_caffe2_report_cpu_memory_usage"),
            ctypes.c_int.in_dll(lib, "FLAGS_caffe2_log_level"))


def _memory_oracle_start(path: str) -> dict:
    """From now on c10's CPU allocator counts the bytes every thread allocates and frees, and logs each
    allocation with the running total ("C10 alloc N bytes, total alloc T bytes") into ``path`` (this process's
    stderr goes there).  Independent of any profiler, so it runs beside fsdpprof record's."""
    sys.stderr.flush()
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
    os.dup2(fd, 2)
    os.close(fd)
    count, level = _c10_flags()
    count.value, level.value = True, 0      # (0: c10's INFO level)
    return {"path": path, "level": 2}


def _memory_oracle_write(oracle: dict, path: str, rank: int) -> None:
    """Stop the count's log and write the most CPU bytes alive at once since the oracle started, the most in each
    step (from the previous step's optimizer.step() returning to its own) and those alive as each step's
    optimizer.step() returned (where fsdpprof's window begins), as JSON."""
    count, level = _c10_flags()
    level.value = oracle["level"]           # (2: c10's default, WARNING)
    sys.stderr.flush()
    totals, after_step, step_peak, total, most = [], [], [], 0, 0
    with open(oracle["path"], "rb") as fh:
        for m in _C10_LINE.finditer(fh.read()):
            if m.group(3) is not None:      # the bytes alive as this step's optimizer.step() returned
                after_step.append(total)
                step_peak.append(most)
                most = total
            else:
                total = int(m.group(2))
                if m.group(1) == b"alloc":
                    totals.append(total)
                    most = max(most, total)
    with open(path, "w") as fh:
        json.dump({"rank": rank, "peak_allocated_bytes": max(totals, default=0), "allocations": len(totals),
                   "after_step_bytes": after_step, "step_peak_bytes": step_peak}, fh)


def main(argv=None) -> int:
    args = parse_args(argv)
    device_type = "cuda" if torch.cuda.is_available() else "cpu"
    distributed = args.strategy != "none"
    rank, world, local_rank = setup_distributed(device_type) if distributed else (0, 1, 0)
    device = torch.device(device_type, local_rank) if device_type == "cuda" else torch.device("cpu")

    oracle = _memory_oracle_start(f"{args.memory_oracle}.{rank}.log") if args.memory_oracle else None
    torch.manual_seed(args.seed)  # same initial weights on every rank
    model = TinyTransformer(args.vocab, args.dim, args.layers, args.heads, args.seq).to(device)
    stall = injected_sleep(rank, args.layers)
    if stall:
        model.layers[stall[0]].sleep_s = stall[1]
    model = wrap(model, args, device, world)
    opt = torch.optim.AdamW(model.parameters(), lr=args.lr)
    autocast = (args.mixed_precision == "bf16" and args.strategy in ("ddp", "none"))

    gen = torch.Generator().manual_seed(args.seed + 1000 + rank)
    loss = None
    step_ms = []
    for step in range(args.steps):
        t0 = time.perf_counter()
        tokens = torch.randint(0, args.vocab, (args.batch, args.seq + 1), generator=gen).to(device)
        with torch.autocast(device_type, dtype=torch.bfloat16, enabled=autocast):
            logits = model(tokens[:, :-1])
            loss = F.cross_entropy(logits.float().reshape(-1, args.vocab), tokens[:, 1:].reshape(-1))
        loss.backward()
        if args.crash_at_step is not None and step == args.crash_at_step and args.crash_rank in (None, rank):
            raise RuntimeError(f"train_fsdp: deliberate crash at step {step} (--crash-at-step)")
        opt.step()
        if oracle is not None:
            print(f"train_fsdp: step {step} optimizer done", file=sys.stderr, flush=True)
        opt.zero_grad(set_to_none=True)
        if args.time_steps:
            if distributed:
                dist.barrier()
            step_ms.append((time.perf_counter() - t0) * 1000.0)
    if oracle is not None:
        _memory_oracle_write(oracle, f"{args.memory_oracle}.{rank}", rank)
    if args.time_steps and rank == 0:
        print("train_fsdp: step_ms=" + json.dumps([round(x, 3) for x in step_ms]), flush=True)
    if rank == 0 and not args.quiet:
        print(f"train_fsdp: strategy={args.strategy} world={world} steps={args.steps} "
              f"final_loss={loss.item() if loss is not None else float('nan'):.4f}", flush=True)
    if distributed:
        dist.barrier()
        dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    sys.exit(main())
