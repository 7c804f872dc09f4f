"""Shared helpers and fixtures of the suite.

Real profiler data: ``shared_data("gpu-traces", ...)`` is a file of tests/data (licensed copies, in the
repository: see tests/data/README.md); the three CUDA snapshots without a licence are read from
``../shared/data`` instead, and a test that needs one is skipped, with the reason, where that is absent.

The CLI: ``run_fsdpprof(*args)`` runs ``fsdpprof`` and returns a ``subprocess.CompletedProcess``
(returncode, stdout, stderr).  It calls ``fsdpprof.cli.main(argv)`` in this process by default, with the
call's own folder, environment, stdin, and file descriptors 1 and 2 sent to files (so the exit code, the
one-line errors and what child processes print are what a user sees); ``record`` and ``demo`` (which run jobs
and handle signals), a call given ``fresh_process=True``, and a call whose ``env`` changes what an interpreter
reads at start-up run a real ``python -m fsdpprof`` instead.

Recordings: ``recorded_run(strategy, nproc=2, record_args=(), train_args=())`` runs
``fsdpprof record --out DIR -- python -m torch.distributed.run --standalone --nproc-per-node N
fsdpprof/examples/train_fsdp.py --strategy S ...`` for real (gloo on CPU) and returns DIR.
Identical requests share one recording, so collect, analyze, memory and report tests all read
the same run directories and the suite stays fast; the session's one ``fsdpprof demo`` (``demo_out``)
is shared by test_demo's tests.

Slow tests are marked where they are written (``pytestmark = pytest.mark.slow`` or ``@pytest.mark.slow``):
every test that records the example or runs torchrun, HTA, a Dask cluster or a browser.  The fast lane is
``pytest -m "not slow"``.  A test not marked slow that records (``recorded_run``, ``demo_out``, or
``run_fsdpprof("record" / "demo", ...)``) fails and says so.
"""
from __future__ import annotations

import contextlib
import compileall
import fcntl
import hashlib
import io
import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import traceback
import warnings
from pathlib import Path

import pytest

from fsdpprof import cli

ROOT = Path(__file__).resolve().parents[1]
TEST_DATA = ROOT / "tests" / "data"               # licensed real data, in the repository
SHARED_DATA = ROOT.parent / "shared" / "data"     # the team's folder, for what has no licence to be copied
# the CUDA snapshots without a clear licence (not in tests/data): read from SHARED_DATA, skipped without it
UNLICENSED = frozenset({("cuda-snapshots", "lm-step-user-metadata.pickle"),
                        ("cuda-snapshots", "qlora-tinyllama-legacy.pickle"),
                        ("cuda-snapshots", "multi-device-expandable-oom.pickle")})
EXAMPLE = ROOT / "fsdpprof" / "examples" / "train_fsdp.py"

# Small, fast model for tests (fp32, CPU): the example's own defaults are sized for this.
DEFAULT_TRAIN_ARGS = ("--steps", "5")
DEFAULT_RECORD_ARGS = ("--skip-steps", "1", "--warmup-steps", "1", "--active-steps", "2")
# the suite's one recording with CPU offload and the one with bf16 mixed precision, the same recording
# (FSDP2, CPUOffloadPolicy, MixedPrecisionPolicy(bf16 params, fp32 reduce)): recorded_run(*OFFLOAD_BF16).
# At half the example's width (OFFLOAD_BF16_SIZES): a CPU without bf16 instructions emulates bf16 matmuls,
# and at the full width this one 2-rank recording took 36 CPU-s (19 at dim 128; an fp32 one takes 17).
OFFLOAD_BF16_SIZES = {"dim": 128}
OFFLOAD_BF16 = ("fsdp2-offload", 2, (), ("--mixed-precision", "bf16",
                                         *(a for k, v in OFFLOAD_BF16_SIZES.items() for a in (f"--{k}", str(v)))))


def shared_data(*parts: str) -> Path:
    """Path of real profiler data: under tests/data (``shared_data("gpu-traces", "hta-nccl-2rank-a100")``),
    or, for the unlicensed CUDA snapshots, under ../shared/data, skipping the test with the reason when it is
    not there."""
    if tuple(parts[:2]) not in UNLICENSED:
        return TEST_DATA.joinpath(*parts)
    path = SHARED_DATA.joinpath(*parts)
    if not path.exists():
        pytest.skip(f"{'/'.join(parts)} (a CUDA snapshot without a licence to copy into tests/data) "
                    f"not found at {SHARED_DATA}: see tests/data/README.md")
    return path


# --- the slow marker's guard -------------------------------------------------------------------------
RECORDING_COMMANDS = frozenset({"record", "demo"})          # CLI sub-commands that record the example
RECORDING_FIXTURES = frozenset({"recorded_run", "demo_out"})
_CURRENT: dict = {}                                          # the test running now (for the guard below)


@pytest.hookimpl(tryfirst=True)
def pytest_runtest_setup(item):
    _CURRENT["item"] = item
    used = sorted(RECORDING_FIXTURES & set(getattr(item, "fixturenames", ())))
    if used:
        _must_be_slow(f"uses {', '.join(used)}")


def pytest_runtest_teardown(item):
    _CURRENT.pop("item", None)


def _must_be_slow(what: str) -> None:
    item = _CURRENT.get("item")
    if item is not None and item.get_closest_marker("slow") is None:
        pytest.fail(f"{item.nodeid} {what} but is not marked slow: mark it @pytest.mark.slow "
                    f"(or its module pytestmark = pytest.mark.slow)", pytrace=False)


def pytest_sessionstart(session):
    # subprocesses (CLI, recordings, torchrun workers) import fsdpprof from source: compile it once here, so
    # that none compiles it again where PYTHONDONTWRITEBYTECODE keeps Python from caching bytecode itself
    compileall.compile_dir(str(ROOT / "fsdpprof"), quiet=2)


# --- the CLI -----------------------------------------------------------------------------------------
# environment variables that Python, numpy or torch read when they start or import, not when a command runs:
# a call that changes one of them gets a fresh interpreter
START_UP_PREFIXES = ("PYTHON", "OMP_", "MKL_", "OPENBLAS_", "NUMEXPR_", "LC_", "LANG", "TZ")
# the warning filters of a fresh interpreter (no -W, no PYTHONWARNINGS), which a call in this process gets
FRESH_WARNING_FILTERS = (("default", DeprecationWarning, "__main__"), ("ignore", DeprecationWarning, ""),
                         ("ignore", PendingDeprecationWarning, ""), ("ignore", ImportWarning, ""),
                         ("ignore", ResourceWarning, ""))


class _CallTimedOut(BaseException):
    """Raised in a call run in this process when its timeout expires (not an Exception: nothing catches it)."""


def needs_fresh_process(env: dict | None) -> bool:
    """A call whose ``env`` changes a variable read at start-up (compared with this process's environment)."""
    return any(k.startswith(START_UP_PREFIXES) and os.environ.get(k) != v for k, v in (env or {}).items())


def _subprocess_env(env: dict | None) -> dict:
    full = dict(os.environ)
    full.setdefault("OMP_NUM_THREADS", "1")
    full.update(env or {})
    return full


def _print_warning(msg) -> None:
    """What a fresh interpreter does with a warning: print it on (this call's) stderr."""
    (msg.file or sys.stderr).write(warnings.formatwarning(msg.message, msg.category, msg.filename, msg.lineno,
                                                          msg.line))


def _exit_code(exc: SystemExit) -> int:
    """The exit status an interpreter gives a SystemExit (printing a non-integer code on stderr)."""
    if exc.code is None:
        return 0
    if isinstance(exc.code, int):
        return exc.code & 0xFF
    print(exc.code, file=sys.stderr)
    return 1


def _in_process(args: tuple, cwd, env: dict | None, input: str | None, timeout: float | None
                ) -> subprocess.CompletedProcess:
    """``fsdpprof.cli.main(args)`` here, as a process of its own would run it: its folder, its environment, a
    stdin holding ``input``, file descriptors 1 and 2 on files (also for the processes it starts), the warning
    filters of a fresh interpreter; an exception it lets out is a traceback on stderr and exit code 1."""
    cmd = [sys.executable, "-m", "fsdpprof", *args]
    saved = (dict(os.environ), os.getcwd(), sys.stdin, sys.stdout, sys.stderr, os.dup(1), os.dup(2))
    alarm = timeout is not None and threading.current_thread() is threading.main_thread()
    old_handler, code, timed_out = None, 1, False
    with tempfile.TemporaryFile() as out, tempfile.TemporaryFile() as err, warnings.catch_warnings():
        for stream in (sys.stdout, sys.stderr):
            stream.flush()
        try:
            os.environ.update(env or {})
            os.chdir(cwd if cwd is not None else saved[1])
            os.dup2(out.fileno(), 1)
            os.dup2(err.fileno(), 2)
            # (never closed: a logging handler made during the call may keep one; it writes to fd 1 / 2,
            # which are pytest's again after the call)
            sys.stdout = open(1, "w", encoding="utf-8", closefd=False)
            sys.stderr = open(2, "w", buffering=1, encoding="utf-8", errors="backslashreplace", closefd=False)
            sys.stdin = io.StringIO(input or "")
            warnings.resetwarnings()
            for action, category, module in FRESH_WARNING_FILTERS:
                warnings.filterwarnings(action, category=category, module=module, append=True)
            warnings.showwarning = warnings._showwarning_orig   # (not pytest's recorder: what a user sees)
            warnings._showwarnmsg_impl = _print_warning
            if alarm:
                def _expired(signum, frame):
                    raise _CallTimedOut()
                old_handler = signal.signal(signal.SIGALRM, _expired)
                signal.setitimer(signal.ITIMER_REAL, timeout)
            try:
                code = int(cli.main(list(args)) or 0) & 0xFF
            except SystemExit as exc:
                code = _exit_code(exc)
            except _CallTimedOut:
                timed_out = True
            except BaseException:                      # as the interpreter does with an uncaught exception
                traceback.print_exc()
                code = 1
            finally:
                if alarm:
                    signal.setitimer(signal.ITIMER_REAL, 0)
                    signal.signal(signal.SIGALRM, old_handler)
        finally:
            for stream in (sys.stdout, sys.stderr):
                with contextlib.suppress(Exception):
                    stream.flush()
            os.environ.clear()
            os.environ.update(saved[0])
            os.chdir(saved[1])
            sys.stdin, sys.stdout, sys.stderr = saved[2:5]
            os.dup2(saved[5], 1)
            os.dup2(saved[6], 2)
            os.close(saved[5])
            os.close(saved[6])
        texts = []
        for f in (out, err):
            f.seek(0)
            texts.append(f.read().decode("utf-8", errors="replace"))
    if timed_out:
        raise subprocess.TimeoutExpired(cmd, timeout, output=texts[0], stderr=texts[1])
    return subprocess.CompletedProcess(cmd, code, texts[0], texts[1])


def run_fsdpprof(*args: str, cwd: Path | None = None, timeout: float = 300, env: dict | None = None,
                 input: str | None = None, fresh_process: bool = False) -> subprocess.CompletedProcess:
    """Run the CLI; (returncode, stdout, stderr) as a user sees them, as ``subprocess.run(..., text=True)``.

    In this process (``fsdpprof.cli.main``, see ``_in_process``) unless ``fresh_process``, the command is
    ``record`` or ``demo``, or ``env`` changes a variable read at start-up: those run ``python -m fsdpprof``.
    ``env`` adds to this process's environment for the one call."""
    if args and args[0] in RECORDING_COMMANDS:
        _must_be_slow(f"runs `fsdpprof {args[0]}`")
    if fresh_process or (args and args[0] in RECORDING_COMMANDS) or needs_fresh_process(env):
        return subprocess.run([sys.executable, "-m", "fsdpprof", *args], cwd=cwd, env=_subprocess_env(env),
                              capture_output=True, text=True, timeout=timeout, input=input)
    return _in_process(args, cwd, env, input, timeout)


# --- recordings of the example, once per session each ------------------------------------------------
# `fsdpprof demo` (its DDP -> FULL_SHARD on 2 -> 4 ranks story, at the demo's own model size) runs once per
# session; every recording is made once per session, also under `pytest -n N` (the workers share them)
DEMO_STRATEGIES = ("ddp", "fsdp2", "fsdp2:4")
_DEMO: dict = {}


def shared_dir(tmp_path_factory, name: str) -> Path:
    """A folder of this session that every pytest-xdist worker sees (the session's base temp when run alone)."""
    base = tmp_path_factory.getbasetemp()
    if os.environ.get("PYTEST_XDIST_WORKER"):
        base = base.parent                      # the workers' base temps are siblings under the session's
    return base / "shared" / name


@contextlib.contextmanager
def made_once(folder: Path):
    """Yields True to the one process of the session that must make ``folder`` (then marked done), False to
    every other (after the first is done): the workers of ``pytest -n`` share one recording each."""
    folder.parent.mkdir(parents=True, exist_ok=True)
    done = folder.with_name(folder.name + ".done")
    with open(folder.with_name(folder.name + ".lock"), "a") as fh:
        fcntl.flock(fh, fcntl.LOCK_EX)          # released when the file closes (also if the maker fails)
        if done.exists():
            yield False
            return
        shutil.rmtree(folder, ignore_errors=True)   # what a failed attempt left
        folder.mkdir()
        yield True
        done.touch()


def demo_session(tmp_path_factory) -> tuple[Path, subprocess.CompletedProcess]:
    """``fsdpprof demo --strategies ddp,fsdp2,fsdp2:4`` run once per session: (its --out folder, the process)."""
    if "out" not in _DEMO:
        folder = shared_dir(tmp_path_factory, "demo")
        out, said = folder / "demo", folder / "process.json"
        with made_once(folder) as first:
            if first:
                proc = run_fsdpprof("demo", "--out", str(out), "--strategies", ",".join(DEMO_STRATEGIES), timeout=900)
                said.write_text(json.dumps({"args": proc.args, "returncode": proc.returncode, "stdout": proc.stdout,
                                            "stderr": proc.stderr}))
        _DEMO.update(out=out, proc=subprocess.CompletedProcess(**json.loads(said.read_text())))
    return _DEMO["out"], _DEMO["proc"]


@pytest.fixture(scope="session")
def demo_out(tmp_path_factory) -> tuple[Path, subprocess.CompletedProcess]:
    """The session's demo (see demo_session); tests must not change its folder (copy what they change)."""
    return demo_session(tmp_path_factory)


@pytest.fixture(scope="session")
def recorded_run(tmp_path_factory):
    cache: dict[tuple, Path] = {}

    def _record(strategy: str, nproc: int = 2, record_args: tuple = (), train_args: tuple = ()) -> Path:
        key = (strategy, nproc, tuple(record_args), tuple(train_args))
        _must_be_slow("uses recorded_run")
        if key in cache:
            return cache[key]
        digest = hashlib.sha1(repr(key).encode()).hexdigest()[:8]
        folder = shared_dir(tmp_path_factory, f"run-{strategy}-{nproc}-{digest}")
        out = folder / "run"
        with made_once(folder) as first:
            if first:
                cmd = ["record", "--out", str(out), *DEFAULT_RECORD_ARGS, *record_args, "--",
                       sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={nproc}",
                       str(EXAMPLE), "--strategy", strategy, *DEFAULT_TRAIN_ARGS, *train_args]
                proc = run_fsdpprof(*cmd, timeout=600)
                assert proc.returncode == 0, (f"record failed ({proc.returncode}):\n{proc.stdout[-3000:]}\n"
                                              f"{proc.stderr[-3000:]}")
        cache[key] = out
        return out

    return _record
