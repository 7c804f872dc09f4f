"""Overhead of ``fsdpprof record`` outside its window: step time of the example with and without it.

Two measurements, each giving a ratio within this one run:

1. in-process (precise): the example's model trained in one process, alternating blocks of steps
   with fsdpprof's recorder hooks installed (window not reached) and without them, so slow drift
   of a shared machine cancels out;  and the window's own end: saving its trace, fsdpprof's export
   (``recorder.export_trace_gz``) against torch's ``export_chrome_trace`` of a .gz path, CPU seconds
   on the same profiler, alternated;
   the memory record before the window (CPU runs), in the same ABBA blocks;
2. end to end (noisy on a shared machine): runs the example (torchrun, 2 ranks, gloo, FSDP2 by default) alternately without fsdpprof and
under ``fsdpprof record`` whose window lies after the measured steps, several times, and prints
the median step time of each and their ratio (goal: <= 1.01). The first steps (warm-up, the
fallback trace of step 0) are left out of both. Usage::

    python benchmarks/bench_collect.py [--blocks 40] [--pairs 2] [--steps 40] [--strategy fsdp2] [--nproc 2]
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
EXAMPLE = ROOT / "fsdpprof" / "examples" / "train_fsdp.py"


def step_times(cmd: list[str], env: dict) -> list[float]:
    proc = subprocess.run(cmd, capture_output=True, text=True, env=env, cwd=ROOT)
    if proc.returncode != 0:
        raise SystemExit(f"command failed ({proc.returncode}): {' '.join(cmd)}\n{proc.stderr[-2000:]}")
    for line in proc.stdout.splitlines():
        if line.startswith("train_fsdp: step_ms="):
            return json.loads(line.split("=", 1)[1])
    raise SystemExit(f"no step times in the output of {' '.join(cmd)}")


def in_process(blocks: int, block_steps: int) -> tuple[list[float], list[float]]:
    """Step times (ms) with and without the recorder's hooks, alternating blocks in one process."""
    import time

    import torch
    import torch.nn.functional as F
    import torch.optim.optimizer as optim_mod

    from fsdpprof.collect.recorder import Recorder
    from fsdpprof.examples.train_fsdp import TinyTransformer

    torch.manual_seed(0)
    model = TinyTransformer(1024, 256, 4, 4, 64)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    gen = torch.Generator().manual_seed(1)

    def step():
        tokens = torch.randint(0, 1024, (4, 65), generator=gen)
        t0 = time.perf_counter()
        logits = model(tokens[:, :-1])
        F.cross_entropy(logits.reshape(-1, 1024), tokens[:, 1:].reshape(-1)).backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        return (time.perf_counter() - t0) * 1000.0

    with tempfile.TemporaryDirectory() as tmp:
        rec = Recorder(tmp, {"skip_steps": 10**9, "warmup_steps": 1, "active_steps": 1}, announce=False)
        rec.install()  # as the bootstrap does: hooks + first-forward fallback trace
        for _ in range(3):
            step()  # step 0 (fallback trace, dropped at the first optimizer step) and warm-up
        rec.uninstall()
        with_rec, without, pair_ratios = [], [], []
        for b in range(blocks):
            hooked = b % 4 in (0, 3)  # ABBA order: neither side always runs first
            if hooked:
                rec.handles = [optim_mod.register_optimizer_step_pre_hook(rec._pre_hook),
                               optim_mod.register_optimizer_step_post_hook(rec._post_hook)]
            times = [step() for _ in range(block_steps)]
            if hooked:
                rec.uninstall()
                with_rec.extend(times)
            else:
                without.extend(times)
            if b % 4 == 3:  # one ABBA group: 2 blocks each way
                k = 2 * block_steps
                pair_ratios.append(sum(with_rec[-k:]) / sum(without[-k:]))
        # the hooks alone, called directly: their cost per optimizer step, free of machine noise
        rec.steps_done = 100  # past the point where a window would start
        n = 20000
        t0 = time.perf_counter()
        for _ in range(n):
            rec._pre_hook(opt, (), {})
            rec._post_hook(opt, (), {})
        hook_us = (time.perf_counter() - t0) / n * 1e6
    return with_rec, without, pair_ratios, hook_us


def before_window_cost(blocks: int, block_steps: int) -> tuple[list[float], list[float], list[float], float]:
    """Step times (ms) with and without the memory record before the window (CPU runs: collect.before_window,
    folded at every optimizer step as the recorder does), alternating ABBA blocks in one process; and the
    record's own fold time per step (ms)."""
    import time

    import torch
    import torch.nn.functional as F

    from fsdpprof.collect.before_window import BeforeWindowMemory
    from fsdpprof.examples.train_fsdp import TinyTransformer

    torch.manual_seed(0)
    model = TinyTransformer(1024, 256, 4, 4, 64)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    gen = torch.Generator().manual_seed(1)

    def step(rec):
        tokens = torch.randint(0, 1024, (4, 65), generator=gen)
        t0 = time.perf_counter()
        logits = model(tokens[:, :-1])
        F.cross_entropy(logits.reshape(-1, 1024), tokens[:, 1:].reshape(-1)).backward()
        opt.step()
        if rec is not None:
            rec.stepped()
        opt.zero_grad(set_to_none=True)
        return (time.perf_counter() - t0) * 1000.0

    for _ in range(3):
        step(None)
    on, off, ratios, fold_ms = [], [], [], []
    for b in range(blocks):
        rec = BeforeWindowMemory() if b % 4 in (0, 3) else None
        if rec is not None:
            rec.start("benchmark")
        times = [step(rec) for _ in range(block_steps)]
        if rec is not None:
            doc = rec.finish()
            fold_ms.append(doc["fold_ms"] / block_steps)
            on.extend(times)
        else:
            off.extend(times)
        if b % 4 == 3:
            k = 2 * block_steps
            ratios.append(sum(on[-k:]) / sum(off[-k:]))
    return on, off, ratios, statistics.median(fold_ms)


def export_cost(repeats: int) -> tuple[float, float, int, int]:
    """CPU seconds (min of ``repeats``) to save one window's trace as .json.gz: torch's export of a .gz path
    and fsdpprof's (recorder.export_trace_gz), alternated, each on a fresh profiler of 2 steps of the example's
    model recorded as the recorder records (shapes, memory; kineto saves a trace once); and the two files'
    sizes (bytes)."""
    import time

    import torch
    import torch.nn.functional as F

    from fsdpprof.collect.recorder import _quiet_kineto, export_trace_gz
    from fsdpprof.examples.train_fsdp import TinyTransformer

    torch.manual_seed(0)
    model = TinyTransformer(1024, 256, 4, 4, 64)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)

    def profiled():
        with _quiet_kineto(), torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU], record_shapes=True,
                                    profile_memory=True) as prof:
            for _ in range(2):
                tokens = torch.randint(0, 1024, (4, 65))
                F.cross_entropy(model(tokens[:, :-1]).reshape(-1, 1024), tokens[:, 1:].reshape(-1)).backward()
                opt.step()
                opt.zero_grad(set_to_none=True)
        return prof

    theirs, ours = [], []
    with tempfile.TemporaryDirectory() as tmp:
        a, b = os.path.join(tmp, "torch.json.gz"), os.path.join(tmp, "ours.json.gz")
        for i in range(repeats):
            for which in ((0, 1) if i % 2 == 0 else (1, 0)):
                prof = profiled()
                t0 = time.process_time()
                if which == 0:
                    prof.export_chrome_trace(a)
                else:
                    export_trace_gz(prof, os.path.join(tmp, "ours.json"), b)
                (theirs if which == 0 else ours).append(time.process_time() - t0)
        return min(theirs), min(ours), os.path.getsize(a), os.path.getsize(b)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--blocks", type=int, default=100, help="in-process: alternating blocks of steps")
    ap.add_argument("--block-steps", type=int, default=2)
    ap.add_argument("--export-repeats", type=int, default=5, help="in-process: saves of the window's trace, each way")
    ap.add_argument("--pairs", type=int, default=2, help="end to end: baseline/recorded pairs, interleaved (0: skip)")
    ap.add_argument("--steps", type=int, default=40)
    ap.add_argument("--measure-from", type=int, default=5, help="first measured step (earlier ones: warm-up)")
    ap.add_argument("--strategy", default="fsdp2")
    ap.add_argument("--nproc", type=int, default=2)
    args = ap.parse_args()
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    with_rec, without, pair_ratios, hook_us = in_process(args.blocks, args.block_steps)
    b, r = statistics.median(without), statistics.median(with_rec)
    print(f"in-process, {len(without)} + {len(with_rec)} steps in ABBA-alternating blocks of {args.block_steps}: "
          f"median step without fsdpprof {b:.2f} ms, with fsdpprof's hooks (outside the window) {r:.2f} ms, "
          f"ratio {r / b:.4f}; median of ABBA-group ratios {statistics.median(pair_ratios):.4f} (goal <= 1.01)")
    print(f"hooks alone: {hook_us:.2f} us per optimizer step = ratio {1 + hook_us / 1000 / b:.6f} on this "
          f"{b:.1f} ms step")
    on, off, ratios, fold = before_window_cost(args.blocks, args.block_steps)
    b, r = statistics.median(off), statistics.median(on)
    print(f"memory record before the window (CPU runs), {len(off)} + {len(on)} steps in ABBA blocks: median step "
          f"without {b:.2f} ms, with {r:.2f} ms, ratio {r / b:.4f}; median of ABBA-group ratios "
          f"{statistics.median(ratios):.4f}; its fold {fold:.2f} ms per step")
    t_torch, t_ours, n_torch, n_ours = export_cost(args.export_repeats)
    print(f"saving the window's trace (.json.gz, CPU s, min of {args.export_repeats}): torch's export_chrome_trace "
          f"{t_torch:.3f} s ({n_torch / 1e6:.2f} MB), fsdpprof's export {t_ours:.3f} s ({n_ours / 1e6:.2f} MB): "
          f"ratio {t_ours / t_torch:.2f}")
    if args.pairs <= 0:
        return 0
    env = dict(os.environ, OMP_NUM_THREADS="1")
    job = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={args.nproc}",
           str(EXAMPLE), "--strategy", args.strategy, "--steps", str(args.steps), "--time-steps", "--quiet"]
    # the window starts after the last measured step
    skip = args.steps - 3
    base_all, rec_all = [], []
    with tempfile.TemporaryDirectory() as tmp:
        for i in range(args.pairs):
            base = step_times(job, env)[args.measure_from:skip]
            out = os.path.join(tmp, f"run{i}")
            rec = step_times([sys.executable, "-m", "fsdpprof", "record", "--out", out, "--skip-steps", str(skip),
                              "--warmup-steps", "1", "--active-steps", "1", "--", *job], env)[args.measure_from:skip]
            base_all += base
            rec_all += rec
            print(f"pair {i}: median step without fsdpprof {statistics.median(base):.2f} ms, "
                  f"with fsdpprof record (outside the window) {statistics.median(rec):.2f} ms")
    b, r = statistics.median(base_all), statistics.median(rec_all)
    print("end to end (torchrun, separate processes; noisy on a shared machine):")
    print(f"steps measured: {len(base_all)} + {len(rec_all)} (steps {args.measure_from}-{skip - 1} of each run)")
    print(f"median step time: without {b:.2f} ms, with fsdpprof record {r:.2f} ms, ratio {r / b:.4f} (goal <= 1.01)")
    print(f"mean step time:   without {statistics.mean(base_all):.2f} ms, with {statistics.mean(rec_all):.2f} ms, "
          f"ratio {statistics.mean(rec_all) / statistics.mean(base_all):.4f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
