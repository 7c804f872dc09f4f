"""Shared fixtures: real multi-process recordings of the example, each made once per session.

`recorded_run(strategy, nproc=2, record_args=(), train_args=())` runs
``fsdpprof record --out DIR -- python -m torch.distributed.run --standalone --nproc-per-node N
fsdpprof/examples/train_fsdp.py --strategy S ...`` for real (gloo on CPU) and returns DIR.
Identical requests share one recording, so collect, analyze, memory and report tests all read
the same run directories and the suite stays fast.
"""
from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
SHARED_DATA = ROOT.parent / "shared" / "data"
EXAMPLE = ROOT / "fsdpprof" / "examples" / "train_fsdp.py"

# Small, fast model for tests (fp32, CPU): the example's own defaults are sized for this.
DEFAULT_TRAIN_ARGS = ("--steps", "5")
DEFAULT_RECORD_ARGS = ("--skip-steps", "1", "--warmup-steps", "1", "--active-steps", "2")


def shared_data(*parts: str) -> Path:
    """Path under ../shared/data; skips the test with a reason when the folder is absent."""
    path = SHARED_DATA.joinpath(*parts)
    if not SHARED_DATA.is_dir():
        pytest.skip(f"real profiler data not found at {SHARED_DATA} (see shared/data/README.md)")
    return path


def run_fsdpprof(*args: str, cwd: Path | None = None, timeout: float = 300, env: dict | None = None,
                 input: str | None = None) -> subprocess.CompletedProcess:
    """Run the real CLI in a subprocess (so exit codes and stderr are what a user sees)."""
    full_env = dict(os.environ)
    full_env.setdefault("OMP_NUM_THREADS", "1")
    if env:
        full_env.update(env)
    return subprocess.run([sys.executable, "-m", "fsdpprof", *args], cwd=cwd, env=full_env,
                          capture_output=True, text=True, timeout=timeout, input=input)


@pytest.fixture(scope="session")
def recorded_run(tmp_path_factory):
    cache: dict[tuple, Path] = {}

    def _record(strategy: str, nproc: int = 2, record_args: tuple = (), train_args: tuple = ()) -> Path:
        key = (strategy, nproc, tuple(record_args), tuple(train_args))
        if key in cache:
            return cache[key]
        out = tmp_path_factory.mktemp(f"run-{strategy}") / "run"
        cmd = ["record", "--out", str(out), *DEFAULT_RECORD_ARGS, *record_args, "--",
               sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={nproc}",
               str(EXAMPLE), "--strategy", strategy, *DEFAULT_TRAIN_ARGS, *train_args]
        proc = run_fsdpprof(*cmd, timeout=600)
        assert proc.returncode == 0, f"record failed ({proc.returncode}):\n{proc.stdout[-3000:]}\n{proc.stderr[-3000:]}"
        cache[key] = out
        return out

    return _record
