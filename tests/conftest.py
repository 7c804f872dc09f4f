"""Shared fixtures: real multi-process recordings of the example, each made once per session.

`recorded_run(strategy, nproc=2, record_args=(), train_args=())` runs
``fsdpprof record --out DIR -- python -m torch.distributed.run --standalone --nproc-per-node N
fsdpprof/examples/train_fsdp.py --strategy S ...`` for real (gloo on CPU) and returns DIR.
Identical requests share one recording, so collect, analyze, memory and report tests all read
the same run directories and the suite stays fast; the session's one ``fsdpprof demo`` (``demo_out``)
is shared by test_demo's tests.

Every test that records (or runs torchrun) is marked ``slow`` here, automatically: the fast lane is
``pytest -m "not slow"``.  A test is slow when it uses the ``recorded_run`` or ``demo_out`` fixture
(itself or through another fixture), or when its code, a fixture it uses, a parameter it is given or a function of the
test modules it calls names a recording: the ``record`` / ``demo`` sub-command, ``torch.distributed.run``
/ ``torchrun``, or ``fsdpprof.record(...)``; or one of the suite's other heavy jobs: HTA, the oracle
(``hta.trace_analysis``, an import of any ``hta.*`` module, ``report --hta``), a Dask cluster (the ``scheduler`` fixture, ``--engine dask``) or a
real browser.  What that reading misses is caught when it
happens: a test not marked slow that records through ``run_fsdpprof`` or ``recorded_run`` fails and says so.
"""
from __future__ import annotations

import compileall
import contextlib
import fcntl
import hashlib
import inspect
import json
import os
import shutil
import subprocess
import sys
import types
from pathlib import Path

import pytest

import cli_server

ROOT = Path(__file__).resolve().parents[1]
SHARED_DATA = ROOT.parent / "shared" / "data"
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
    """Path under ../shared/data; skips the test with a reason when the folder is absent."""
    path = SHARED_DATA.joinpath(*parts)
    if not SHARED_DATA.is_dir():
        pytest.skip(f"real profiler data not found at {SHARED_DATA} (see shared/data/README.md)")
    return path


# --- the slow marker ---------------------------------------------------------------------------------
TESTS = Path(__file__).resolve().parent
RECORDING_FIXTURES = frozenset({"recorded_run", "demo_out"})
RECORDING_COMMANDS = frozenset({"record", "demo"})          # CLI sub-commands that record the example
RECORDING_TEXT = ("torch.distributed.run", "torchrun", "fsdpprof.record(", "import record", "record(out=")
# the other heavy jobs of the suite, slow too: HTA (the oracle, whole real traces through its pandas code)
# and a real browser (a global holding the path of one, e.g. shutil.which("chromium"))
HEAVY_CONSTANTS = frozenset({"hta.trace_analysis", "--hta", "dask"})   # ("dask": the engine, a LocalCluster)
HEAVY_MODULE_PREFIX = "hta."                                    # `from hta.trace_diff import ...` and the like
HEAVY_FIXTURES = frozenset({"scheduler"})                      # test_engines' Dask LocalCluster
BROWSERS = frozenset({"chromium", "chromium-browser", "google-chrome", "chrome", "firefox"})
_CURRENT: dict = {}                                          # the test running now (for the guard below)


def _ours(obj) -> bool:
    """A function or class defined in tests/."""
    try:
        return Path(inspect.getsourcefile(obj) or "").resolve().is_relative_to(TESTS)
    except (TypeError, OSError):
        return False


def _code_records(code: types.CodeType, names: dict, seen: set, depth: int) -> bool:
    if code in seen:
        return False
    seen.add(code)
    # (pytest's assertion rewriting adds the names of an assert's variables as strings: those are no commands)
    own_names = set(code.co_varnames) | set(code.co_names) | set(code.co_cellvars) | set(code.co_freevars)
    for c in code.co_consts:
        if isinstance(c, str) and c not in own_names and (
                c in RECORDING_COMMANDS or c in HEAVY_CONSTANTS or any(t in c for t in RECORDING_TEXT)):
            return True
        if isinstance(c, types.CodeType) and _code_records(c, names, seen, depth):
            return True
    for n in code.co_names:
        if n.startswith(HEAVY_MODULE_PREFIX):          # (an import of one of HTA's modules: its dotted name)
            return True
        v = names.get(n)
        if isinstance(v, str) and os.path.basename(v) in BROWSERS:
            return True
    return depth < 4 and any(_records(names.get(n), seen, depth + 1) for n in code.co_names)


def _records(obj, seen: set, depth: int = 0) -> bool:
    """Does this function of the tests (or one it names, its nested code, a class's methods) record?"""
    obj = getattr(obj, "__wrapped__", obj)
    if isinstance(obj, type):
        return _ours(obj) and any(_records(v, seen, depth + 1) for v in vars(obj).values()
                                  if isinstance(v, types.FunctionType))
    if not isinstance(obj, types.FunctionType) or not _ours(obj):
        return False
    names = dict(vars(__import__("builtins")), **obj.__globals__)
    return _code_records(obj.__code__, names, seen, depth)


def records(item) -> bool:
    """Whether a collected test records a run (see the module's docstring)."""
    if (RECORDING_FIXTURES | HEAVY_FIXTURES) & set(getattr(item, "fixturenames", ())):
        return True
    seen: set = set()
    roots = [getattr(item, "function", None)]
    info = getattr(item, "_fixtureinfo", None)
    for defs in (info.name2fixturedefs.values() if info else ()):
        roots += [d.func for d in defs]
    callspec = getattr(item, "callspec", None)
    roots += [v for v in (callspec.params.values() if callspec else ()) if callable(v)]
    return any(_records(r, seen) for r in roots)


@pytest.hookimpl(tryfirst=True)
def pytest_collection_modifyitems(config, items):
    for item in items:
        if item.get_closest_marker("slow") is None and records(item):
            item.add_marker(pytest.mark.slow)


@pytest.hookimpl(tryfirst=True)
def pytest_runtest_setup(item):
    _CURRENT["item"] = item


def pytest_runtest_teardown(item):
    _CURRENT.pop("item", None)


def _must_be_slow(what: str) -> None:
    item = _CURRENT.get("item")
    if item is not None and item.get_closest_marker("slow") is None:
        pytest.fail(f"{item.nodeid} {what} but is not marked slow; conftest.records() did not see it: "
                    f"mark it @pytest.mark.slow or name the recording where records() looks", pytrace=False)


def pytest_sessionstart(session):
    # subprocesses (CLI, recordings, torchrun workers) import fsdpprof from source: compile it once here, so
    # that none compiles it again where PYTHONDONTWRITEBYTECODE keeps Python from caching bytecode itself
    compileall.compile_dir(str(ROOT / "fsdpprof"), quiet=2)


_SERVER: list = []                                            # this worker's CLI fork server, once started


def _cli_env() -> dict:
    env = dict(os.environ)
    env.setdefault("OMP_NUM_THREADS", "1")
    return env


def run_fsdpprof(*args: str, cwd: Path | None = None, timeout: float = 300, env: dict | None = None,
                 input: str | None = None) -> subprocess.CompletedProcess:
    """Run the real CLI as a process of its own (so exit codes and stderr are what a user sees).

    ``record`` and ``demo`` (which run jobs and handle signals) and a call whose environment changes what an
    interpreter reads at start-up get a new ``python -m fsdpprof``; every other
    call a child forked from this worker's CLI server, which has fsdpprof and pandas imported already
    (tests/cli_server.py: the same process semantics, without ~0.2-0.9 s of start-up a call)."""
    if args and args[0] in RECORDING_COMMANDS:
        _must_be_slow(f"runs `fsdpprof {args[0]}`")
    full_env = dict(_cli_env(), **(env or {}))
    if not _SERVER:
        _SERVER.append(cli_server.ForkServer(_cli_env()))
    # (compared with the server's own start: a variable a test set since is not in the server)
    if (args and args[0] in RECORDING_COMMANDS) or cli_server.needs_fresh_process(full_env, _SERVER[0].env):
        return subprocess.run([sys.executable, "-m", "fsdpprof", *args], cwd=cwd, env=full_env,
                              capture_output=True, text=True, timeout=timeout, input=input)
    return _SERVER[0].run(args, cwd, full_env, input, timeout)


def pytest_sessionfinish(session):
    for server in _SERVER:
        server.close()


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
