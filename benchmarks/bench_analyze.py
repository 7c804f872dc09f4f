"""Benchmark: fsdpprof's analysis vs HTA vs a bare orjson.loads, the report end to end, CLI start-up, memory.

    python benchmarks/bench_analyze.py [--cpu-run RUN_DIR] [--repeat 3] [--only NAME] [--profile]
                                       [--big-gb 1.0] [--skip-hta-big] [--no-big] [--out DIR] [--before REF]

Inputs, measured in one run: every folder of real GPU traces in tests/data/gpu-traces (a folder of
several rank files, param-dlrm-8rank-v100, is one input of 8 ranks), a recorded CPU (gloo) run
(``--cpu-run``; default: recorded here with the example, 2 ranks) and, unless ``--no-big``, a >= 1 GB
(decompressed, plain) trace built by replicating the largest real GPU trace.

Every measurement runs in a fresh child process.  Two ways, both printed:
- in process ("warm"): imports happen before the clock starts and one warm-up call on a tiny trace
  absorbs first-call costs, for every contender alike: the per-call work (the fastest of up to 5 calls
  of one process, while they take under 1 s in all: a small trace's call is ~0.1 s, which a shared VM's
  speed swings make a coin toss);
- whole process ("cold"): the wall time of ``python -c ...`` from start to exit, start-up and imports
  included: what a user waits for.
Each contender runs ``--repeat`` times, interleaved (ours, orjson, HTA, ours, ...).  The goals are judged on
the fastest of the runs of each contender (``--stat min``, the default: what the issue measured, "min of 3 fresh
processes"; on a shared box the slower runs measure the neighbours); the same table from the medians is
printed before it (``--stat median`` swaps the two).  Ratios use CPU seconds where the box is shared (wall
seconds are printed beside them).  The warm-up leaves no memo of
event names behind (fsdpprof judges each distinct name once per process): the timed call starts from none.

fsdpprof's own modules are compiled to bytecode first, as an installed package is (this machine sets
PYTHONDONTWRITEBYTECODE, which would make every process compile them again).

``--before REF`` (a git commit or branch of this repository) measures fsdpprof at REF too, in the same run,
interleaved with the current tree (``git archive REF`` into the temporary folder, imported from there), and
prints a before/after table: the per-call CPU time of ours and every goal's ratio, at REF and now.

Goals (issue 12), checked in the closing table:
(a) ours (load + overall overlap + collective volume) >= 10x faster than HTA (TraceAnalysis load +
    get_comm_comp_overlap);
(b) ours no slower than a bare ``orjson.loads`` of the same bytes (read + gunzip + loads), warm (the cold goal,
    start-up and imports counted, is withdrawn: issue 29);
(c) ``fsdpprof report`` end to end <= 1.5x the analysis alone (load_run + analyze_run(hta=False),
    whole processes both; CPU seconds);
(d) ``fsdpprof --help`` and ``fsdpprof plan --params 7e9 --world 8`` < 0.3 s wall, without importing
    pandas or torch (python -X importtime);
(e) ours' peak RSS <= 2x the decompressed trace + the interpreter's baseline (the same child with the
    same imports and the warm-up call on the tiny trace only).
``--profile`` adds where the time of the report goes (cProfile, -X importtime), for whoever fixes it.
Prints figures only; nothing here asserts timings.
"""
from __future__ import annotations

import argparse
import gzip
import importlib
import json
import os
import resource
import select
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
SHARED = ROOT / "tests" / "data" / "gpu-traces"   # (the real GPU traces, licensed copies)
WARMUP = SHARED / "param-dlrm-8rank-v100" / "rank-0.json.gz"
GOALS = {"hta_x": 10.0, "orjson_x": 1.0, "report_x": 1.5, "cli_s": 0.3, "rss_x": 2.0}


# ----------------------------------------------------------------------------------------- inputs
def trace_files(path: str) -> list[str]:
    """The trace files of an input (a file, a folder of traces, or a run directory)."""
    p = Path(path)
    if p.is_file():
        return [str(p)]
    files = sorted(p.glob("rank-*/trace.json.gz")) or sorted(p.glob("*.json.gz")) + sorted(p.glob("*.json"))
    return [str(f) for f in files]


def hta_dir(path: str, tmp: str) -> str:
    """A folder of rank-N.json.gz symlinks to the input's traces (what HTA reads)."""
    d = tempfile.mkdtemp(dir=tmp, prefix="hta-")
    for i, f in enumerate(trace_files(path)):
        ext = ".json.gz" if f.endswith(".gz") else ".json"
        os.symlink(os.path.abspath(f), os.path.join(d, f"rank-{i}{ext}"))
    return d


def decompressed_bytes(path: str) -> int:
    total = 0
    for f in trace_files(path):
        data = Path(f).read_bytes()
        total += len(gzip.decompress(data)) if data[:2] == b"\x1f\x8b" else len(data)
    return total


def real_inputs() -> list[tuple[str, str]]:
    out = []
    for d in sorted(p for p in SHARED.iterdir() if p.is_dir()):
        files = trace_files(str(d))
        if files:
            out.append((d.name, files[0] if len(files) == 1 else str(d)))
    if not out:
        raise SystemExit(f"no GPU traces under {SHARED}")
    return out


def cpu_run(run_dir: str | None, tmp: str) -> str:
    if run_dir:
        if not trace_files(run_dir):
            raise SystemExit(f"--cpu-run {run_dir}: no rank-*/trace.json.gz in it")
        return run_dir
    out = Path(tmp) / "cpu-run"
    cmd = [sys.executable, "-m", "fsdpprof", "record", "--out", str(out), "--skip-steps", "1", "--warmup-steps", "1",
           "--active-steps", "2", "--", sys.executable, "-m", "torch.distributed.run", "--standalone",
           "--nproc-per-node=2", str(ROOT / "fsdpprof" / "examples" / "train_fsdp.py"), "--strategy", "fsdp2",
           "--steps", "5"]
    print("recording a CPU run with the example (fsdp2, 2 ranks) ...", flush=True)
    subprocess.run(cmd, check=True, cwd=ROOT, env=dict(os.environ, OMP_NUM_THREADS="1"), capture_output=True)
    return str(out)


def build_big_trace(src: str, target_bytes: int, out_dir: str) -> tuple[str, int]:
    """Replicate src's events with shifted ts/ids/step numbers until the plain JSON is >= target_bytes."""
    import orjson
    doc = orjson.loads(gzip.decompress(Path(src).read_bytes()))
    events = doc.pop("traceEvents")
    ts = [e["ts"] for e in events if isinstance(e.get("ts"), (int, float))]
    span = (max(ts) - min(ts)) + 1000.0
    one = len(orjson.dumps(events))
    copies = max(1, -(-target_bytes // one))
    path = os.path.join(out_dir, "big-rank-0.json")
    header = orjson.dumps(doc)[:-1]            # without the closing brace
    with open(path, "wb") as fh:
        fh.write(header + (b", " if len(header) > 1 else b"") + b'"traceEvents": [\n')
        for k in range(copies):
            shifted = []
            for e in events:
                e2 = dict(e)
                if isinstance(e2.get("ts"), (int, float)):
                    e2["ts"] = e2["ts"] + k * span
                a = e2.get("args")
                if isinstance(a, dict) and k:
                    a = dict(a)
                    for key in ("correlation", "External id"):
                        if isinstance(a.get(key), int):
                            a[key] = a[key] + k * 10_000_000
                    e2["args"] = a
                name = e2.get("name")
                if k and isinstance(name, str) and name.startswith("ProfilerStep#"):
                    e2["name"] = f"ProfilerStep#{int(name[13:]) + k * 100_000}"
                shifted.append(e2)
            fh.write(orjson.dumps(shifted)[1:-1])
            fh.write(b",\n" if k + 1 < copies else b"\n")
        fh.write(b"]}")
    return path, os.path.getsize(path)


# ----------------------------------------------------------------------------------------- the work
# how a tree loads a run, now and before issue 29 (load_run in analyze/run.py, events a Run method): the one
# piece of --before that must know the old layout
LOAD_RUN = """
try:
    from fsdpprof.analyze.load.run import load_run, run_events
except ImportError:
    from fsdpprof.analyze.run import load_run
    def run_events(run):
        return run.events()
"""


def _ours(path: str) -> dict:
    from fsdpprof.analyze.comm import overlap, volume
    scope: dict = {}
    exec(LOAD_RUN, scope)
    ev = scope["run_events"](scope["load_run"](path, progress=False))
    o = overlap.overall_overlap(ev)
    volume.collective_volume(ev)
    return {"overlap_pct": float(o["comp_comm_overlap_pct"].iloc[0]), "events": len(ev)}


def _orjson(path: str) -> dict:
    import orjson
    n = 0
    for f in trace_files(path):
        with open(f, "rb") as fh:
            data = fh.read()
        if data[:2] == b"\x1f\x8b":
            data = gzip.decompress(data)
        n += len(orjson.loads(data)["traceEvents"])
    return {"events": n}


def _hta(path: str) -> dict:
    from hta.trace_analysis import TraceAnalysis
    d = hta_dir(path, tempfile.gettempdir())
    try:
        ta = TraceAnalysis(trace_dir=d, include_last_profiler_step=True)
        r = ta.get_comm_comp_overlap(visualize=False)
    finally:
        shutil.rmtree(d, ignore_errors=True)
    return {"overlap_pct": float(r["comp_comm_overlap_pctg"].iloc[0])}


def _breakdowns(path: str) -> dict:
    """Our native breakdowns on the loaded events (the load is not timed: see child())."""
    from fsdpprof.analyze.comm import breakdown
    ev = _LOADED[path]
    t0 = time.perf_counter()
    breakdown.temporal_breakdown(ev)
    breakdown.kernel_type_breakdown(ev)
    if "launch_ts_us" in ev.columns:
        breakdown.idle_time_breakdown(ev)
    return {"breakdown_seconds": time.perf_counter() - t0}


# where our load + overlap + volume spends its time: (label, function name in cProfile's stats); names that
# are not found (renamed) are left out of the line
STAGES = [("inflate", "<built-in method zlib.decompress>"), ("inflate", "<method 'decompress' of 'zlib.Decompress' objects>"),
          ("inflate", "<method 'decompress' of 'isal_zlib.Decompress' objects>"), ("JSON decode (msgspec)", "decode"),
          ("columns from events", "add_fast"), ("decode_trace", "decode_trace"), ("classify", "classify_arrays"),
          ("labels", "assign_arrays"), ("events frame", "events_frame"), ("overall_overlap", "overall_overlap"),
          ("collective_volume", "collective_volume")]


def _stages(path: str) -> dict:
    """_ours under cProfile (warm): cumulative seconds of each stage, and of the whole call."""
    import cProfile
    import pstats
    pr = cProfile.Profile()
    pr.enable()
    _ours(path)
    pr.disable()
    st = pstats.Stats(pr).stats
    out = {}
    for label, func in STAGES:
        hits = [v[3] for (f, _, name), v in st.items()
                if (name == func and (func.startswith("<") or "fsdpprof" in f)) or
                (func == "decode" and "msgspec.json.Decoder" in name)]
        if hits:
            value = sum(hits) if func == "decode" or label == "inflate" else max(hits)
            out[label] = out.get(label, 0.0) + value if label == "inflate" else value
    out["total"] = max(v[3] for v in st.values())
    return {"stages": out}


_LOADED: dict = {}
WORK = {"ours": _ours, "orjson": _orjson, "hta": _hta, "breakdowns": _breakdowns, "stages": _stages}


# a warm child times its call again, up to INNER_MAX calls while they take under INNER_BUDGET_S in all, and
# reports the fastest (every contender alike): a small trace's call takes ~0.1 s, and this VM's speed swings
# up to 2x from one such call to the next
INNER_MAX, INNER_BUDGET_S = 5, 1.0
TREE_ENV = "FSDPPROF_BENCH_TREE"      # the source tree a measurement imports fsdpprof from (default: ROOT)


def child(mode: str, path: str) -> None:
    """One in-process measurement: imports first (timed apart), a warm-up call, then the timed call."""
    idle = mode == "ours-idle"          # the same process as "ours", minus the work: its RSS is the baseline
    mode = "ours" if idle else mode
    t_import = time.perf_counter()
    sys.path.insert(0, os.environ.get(TREE_ENV) or str(ROOT))
    if mode in ("ours", "breakdowns", "stages"):
        from fsdpprof.analyze.comm import breakdown, overlap, volume  # noqa: F401
        from fsdpprof.analyze.trace import classify, decode, labels  # noqa: F401
        exec(LOAD_RUN, scope := {})
        load_run, run_events = scope["load_run"], scope["run_events"]
    elif mode == "orjson":
        import orjson  # noqa: F401
    elif mode == "hta":
        import logging
        logging.disable(logging.WARNING)
        from hta.trace_analysis import TraceAnalysis  # noqa: F401
    import_seconds = time.perf_counter() - t_import
    if mode == "breakdowns":
        _LOADED[path] = run_events(load_run(path, progress=False))
    elif WARMUP.is_file() and os.path.abspath(path) != str(WARMUP):
        WORK[mode](str(WARMUP))         # the idle child too: its peak RSS then holds what the warm-up left
        _forget(mode)

    def cpu() -> float:
        a, b = resource.getrusage(resource.RUSAGE_SELF), resource.getrusage(resource.RUSAGE_CHILDREN)
        return a.ru_utime + a.ru_stime + b.ru_utime + b.ru_stime

    walls, cpus, again = [], [], mode in ("ours", "orjson", "hta") and not idle
    while True:
        c0, t0 = cpu(), time.perf_counter()
        result = {"events": 0} if idle else WORK[mode](path)
        walls.append(time.perf_counter() - t0)
        cpus.append(cpu() - c0)
        if not again or len(walls) == INNER_MAX or sum(walls) >= INNER_BUDGET_S:
            break
        _forget(mode)
    result.update(seconds=min(walls), cpu_seconds=min(cpus), calls=len(walls), import_seconds=import_seconds)
    print("RESULT " + json.dumps(result), flush=True)


def _forget(mode: str) -> None:
    """No name judged in an earlier call is remembered for the timed one (fsdpprof judges each distinct name
    once per process), nor a category dtype it built (shared by the ranks of one load)."""
    if mode in ("ours", "stages"):
        from fsdpprof.analyze.trace import classify as _classify
        from fsdpprof.analyze.trace import labels as _labels
        try:                                     # trees since issue 40: the memo lives in trace/names.py
            _names = importlib.import_module("fsdpprof.analyze.trace.names")
        except ImportError:
            _names = None
        for mod in (_names, _classify):
            for memo in ("NAME_MEMO", "_MEMO"):  # (_MEMO: the same memo in trees of before issue 29)
                getattr(mod, memo, {}).clear()
        getattr(_labels, "_SMALL_DTYPES", {}).clear()


# ----------------------------------------------------------------------------------------- running
def run_process(argv: list[str], timeout: float, env: dict | None = None, tree: str | None = None) -> dict:
    """Run argv to its end: wall seconds, CPU seconds (it and its waited-for children), peak RSS, stdout.
    ``tree``: import fsdpprof from that source tree (PYTHONPATH, and a working directory that holds no
    fsdpprof of its own)."""
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONWARNINGS="ignore", **(env or {}))
    if tree:
        env.update({TREE_ENV: tree, "PYTHONPATH": tree + os.pathsep + env.get("PYTHONPATH", "")})
    r, w = os.pipe()
    t0 = time.perf_counter()
    pid = os.fork()
    if pid == 0:  # pragma: no cover - child
        if tree:
            os.chdir(tempfile.gettempdir())
        os.close(r)
        os.dup2(w, 1)
        devnull = os.open(os.devnull, os.O_WRONLY)
        os.dup2(devnull, 2)
        try:
            os.execve(argv[0], argv, env)
        finally:
            os._exit(127)
    os.close(w)
    chunks, deadline = [], t0 + timeout
    while True:
        left = deadline - time.perf_counter()
        if left <= 0:
            os.kill(pid, 9)
            os.waitpid(pid, 0)
            os.close(r)
            return {"error": f"timeout after {timeout:.0f} s"}
        ready, _, _ = select.select([r], [], [], min(left, 1.0))
        if ready:
            data = os.read(r, 65536)
            if not data:
                break
            chunks.append(data)
    os.close(r)
    _, status, ru = os.wait4(pid, 0)
    wall = time.perf_counter() - t0
    out = b"".join(chunks).decode(errors="replace")
    if status != 0:
        return {"error": f"exit status {status >> 8}"}
    return {"wall": wall, "cpu": ru.ru_utime + ru.ru_stime, "peak_rss_bytes": ru.ru_maxrss * 1024, "stdout": out}


def measure(mode: str, path: str, timeout: float, tree: str | None = None) -> dict:
    res = run_process([sys.executable, __file__, "--child", mode, path], timeout, tree=tree)
    if "error" in res:
        return res
    line = next((x for x in res["stdout"].splitlines() if x.startswith("RESULT ")), None)
    if line is None:
        return {"error": "no result"}
    out = json.loads(line[len("RESULT "):])
    out["peak_rss_bytes"] = res["peak_rss_bytes"]
    return out


PY_OURS = ("import sys" + LOAD_RUN + "from fsdpprof.analyze.comm import overlap, volume\n"
           "ev = run_events(load_run(sys.argv[1], progress=False))\noverlap.overall_overlap(ev)\n"
           "volume.collective_volume(ev)\n")
PY_HTA = ("import sys, logging\nlogging.disable(logging.WARNING)\nfrom hta.trace_analysis import TraceAnalysis\n"
          "TraceAnalysis(trace_dir=sys.argv[1], include_last_profiler_step=True).get_comm_comp_overlap(visualize=False)\n")
PY_ANALYSIS = ("import sys" + LOAD_RUN + "from fsdpprof.analyze.pipeline import analyze_run\n"
               "analyze_run(load_run(sys.argv[1], progress=False), hta=False)\n")


def cold(kind: str, path: str, tmp: str, timeout: float, tree: str | None = None) -> dict:
    """A whole process, start-up included."""
    py = sys.executable
    if kind == "ours":
        argv = [py, "-c", PY_OURS, path]
    elif kind == "hta":
        argv = [py, "-c", PY_HTA, hta_dir(path, tmp)]
    elif kind == "analysis":
        argv = [py, "-c", PY_ANALYSIS, path]
    elif kind == "report":
        out = tempfile.mkdtemp(dir=tmp, prefix="report-")
        argv = [py, "-m", "fsdpprof", "report", path, "-o", os.path.join(out, "report.html")]
    else:
        raise SystemExit(kind)
    return run_process(argv, timeout, tree=tree)


STATS = {"min": min, "median": statistics.median}


def over_runs(runs: list[dict], *keys: str, stat: str = "median") -> dict:
    """One measurement from its runs: each of ``keys`` by ``stat`` (a key of STATS); the first error if any."""
    bad = [r for r in runs if "error" in r]
    if bad:
        return bad[0]
    out = dict(runs[0])
    for k in keys:
        out[k] = STATS[stat](r[k] for r in runs)
    out["runs"] = len(runs)
    return out


def ratio(a: dict, b: dict, key: str) -> float | None:
    if "error" in a or "error" in b or not b.get(key):
        return None
    return a[key] / b[key]


def fmt_ratio(x: float | None) -> str:
    return "   n/a" if x is None else f"{x:6.2f}"


# ----------------------------------------------------------------------------------------- CLI start-up
def cli_startup(repeat: int, tree: str | None = None, stat: str = "median") -> list[dict]:
    """Wall time of `fsdpprof --help` and `fsdpprof plan ...` (console script and python -m), and whether
    pandas / torch / numpy / plotly get imported on those paths.  ``tree``: fsdpprof from that source tree
    (python -m only: the console script is the installed one)."""
    script = str(Path(sys.executable).parent / "fsdpprof")
    cases = [("fsdpprof --help", ["--help"]), ("fsdpprof plan --params 7e9 --world 8",
                                               ["plan", "--params", "7e9", "--world", "8"])]
    rows = []
    env = dict(os.environ, PYTHONWARNINGS="ignore")
    if tree:
        env["PYTHONPATH"] = tree + os.pathsep + env.get("PYTHONPATH", "")
    for label, args in cases:
        for how, argv in (("console script", [script, *args]), ("python -m", [sys.executable, "-m", "fsdpprof", *args])):
            if not os.path.exists(argv[0]) or (tree and how == "console script"):
                continue
            runs = [run_process(argv, 60, tree=tree) for _ in range(repeat)]
            m = over_runs(runs, "wall", "cpu", "peak_rss_bytes", stat=stat)
            imp = subprocess.run([sys.executable, "-X", "importtime", "-m", "fsdpprof", *args], capture_output=True,
                                 text=True, env=env, cwd=tempfile.gettempdir() if tree else None)
            mods, self_us = set(), []
            for line in imp.stderr.splitlines():
                if line.startswith("import time:") and "|" in line:
                    parts = [x.strip() for x in line[len("import time:"):].split("|")]
                    if parts[0].isdigit():
                        name = parts[2].strip()
                        mods.add(name)
                        self_us.append((int(parts[1]), name))
            heavy = sorted({m.split(".")[0] for m in mods} & {"pandas", "torch", "numpy", "plotly", "msgspec", "hta"})
            top = ", ".join(f"{n} {c / 1e3:.0f} ms" for c, n in sorted(self_us, reverse=True)[:4])
            rows.append({"label": f"{label} ({how}{', before' if tree else ''})", "res": m, "heavy": heavy,
                         "top": top})
    return rows


def profile_report(path: str, tmp: str) -> None:
    """Where `fsdpprof report` spends its time: cProfile (cumulative, fsdpprof's functions and the
    biggest others) and the slowest imports."""
    import pstats
    prof = os.path.join(tmp, "report.prof")
    out = tempfile.mkdtemp(dir=tmp, prefix="report-prof-")
    subprocess.run([sys.executable, "-m", "cProfile", "-o", prof, "-m", "fsdpprof", "report", path, "-o",
                    os.path.join(out, "report.html")], capture_output=True, env=dict(os.environ, OMP_NUM_THREADS="1"))
    st = pstats.Stats(prof)
    total = max(v[3] for v in st.stats.values())
    rows = []
    for (fname, line, func), (cc, nc, tt, ct, callers) in st.stats.items():
        if "fsdpprof" in fname:
            rows.append((ct, tt, nc, f"{os.path.relpath(fname, ROOT) if 'fsdpprof' in fname else fname}:{line} {func}"))
    print(f"   cProfile of `fsdpprof report {os.path.basename(path)}` (total {total:.2f} s; cumulative, "
          f"fsdpprof's functions >= 3 %):")
    for ct, tt, nc, name in sorted(rows, reverse=True):
        if ct >= 0.03 * total and "<module>" not in name:
            print(f"     {ct:6.3f} s cum {tt:6.3f} s self {nc:6d} calls  {name}")
    imp = subprocess.run([sys.executable, "-X", "importtime", "-m", "fsdpprof", "report", path, "-o",
                          os.path.join(out, "report2.html")], capture_output=True, text=True,
                         env=dict(os.environ, PYTHONWARNINGS="ignore", OMP_NUM_THREADS="1"))
    roots, ours_self = [], []
    for line in imp.stderr.splitlines():
        if line.startswith("import time:") and "|" in line:
            parts = line[len("import time:"):].split("|")
            if not parts[0].strip().isdigit():
                continue
            name = parts[2].strip()
            if "." not in name and not name.startswith("_"):
                roots.append((int(parts[1]), name))               # a package, with everything it imports
            if name.startswith("fsdpprof."):
                ours_self.append((int(parts[0]), name))           # our modules' own time
    print("   heaviest packages imported by the report (cumulative): "
          + ", ".join(f"{n} {c / 1e3:.0f} ms" for c, n in sorted(roots, reverse=True)[:8]))
    print("   our slowest modules to import (self): "
          + ", ".join(f"{n} {c / 1e3:.0f} ms" for c, n in sorted(ours_self, reverse=True)[:5]))


# ----------------------------------------------------------------------------------------- main
def before_tree(ref: str, tmp: str) -> str:
    """The source tree of ``ref`` (git archive, no .git), for measuring fsdpprof as it was."""
    out = os.path.join(tmp, "before")
    os.makedirs(out, exist_ok=True)
    archive = subprocess.run(["git", "-C", str(ROOT), "archive", ref], capture_output=True)
    if archive.returncode != 0:
        raise SystemExit(f"--before {ref}: git archive failed: {archive.stderr.decode(errors='replace').strip()}")
    subprocess.run(["tar", "-x", "-C", out], input=archive.stdout, check=True)
    return out


def row_of(name: str, w: dict, c: dict, base: dict, size: int, at: str = "") -> dict:
    """The goals' ratios of one input from the warm (w) and cold (c) medians; ``at``: "" (now) or "@before"."""
    ours, cold_ours = w.get("ours" + at, {"error": "-"}), c.get("ours" + at, {"error": "-"})
    row = {"input": name,
           "ours_cpu": None if "error" in ours else ours["cpu_seconds"],
           "hta_x": ratio(w["hta"], ours, "cpu_seconds"), "hta_x_wall": ratio(w["hta"], ours, "seconds"),
           "hta_x_cold": ratio(c["hta"], cold_ours, "cpu"),
           "orjson_x": ratio(w["orjson"], ours, "cpu_seconds"),
           "orjson_x_wall": ratio(w["orjson"], ours, "seconds"),
           "report_x": ratio(c.get("report" + at, {"error": "-"}), c.get("analysis" + at, {"error": "-"}), "cpu"),
           "report_x_wall": ratio(c.get("report" + at, {"error": "-"}), c.get("analysis" + at, {"error": "-"}), "wall")}
    if "error" not in ours and "error" not in base:
        row["rss_x"] = (ours["peak_rss_bytes"] - base["peak_rss_bytes"]) / size
    return row


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--child", nargs=2, metavar=("MODE", "PATH"))
    ap.add_argument("--cpu-run", help="a recorded run directory (default: record one with the example)")
    ap.add_argument("--repeat", type=int, default=3, help="runs per measurement")
    ap.add_argument("--stat", choices=sorted(STATS), default="min",
                    help="the runs' statistic the goals are judged on (default: min, as the issue measured; the "
                         "other one's table is printed before it)")
    ap.add_argument("--only", help="only the inputs whose name contains this")
    ap.add_argument("--profile", action="store_true", help="cProfile / -X importtime of the report per input")
    ap.add_argument("--big-gb", type=float, default=1.0)
    ap.add_argument("--skip-hta-big", action="store_true", help="do not run HTA on the big trace")
    ap.add_argument("--no-big", action="store_true", help="only the real traces and the CPU run")
    ap.add_argument("--timeout", type=float, default=1500)
    ap.add_argument("--out", help="folder for temporary files (a temporary one by default; removed at the end)")
    ap.add_argument("--before", metavar="REF", help="also measure fsdpprof at this git commit / branch, interleaved")
    args = ap.parse_args()
    if args.child:
        child(*args.child)
        return
    tmp = args.out or tempfile.mkdtemp(prefix="fsdpprof-bench-")
    os.makedirs(tmp, exist_ok=True)
    repeat = max(1, args.repeat)
    old = before_tree(args.before, tmp) if args.before else None
    # a user's Python caches bytecode; where PYTHONDONTWRITEBYTECODE is set (as on this machine) every process
    # would compile fsdpprof again: compile both trees once, as an installed package is
    import compileall
    for tree in (str(ROOT), old):
        if tree:
            compileall.compile_dir(os.path.join(tree, "fsdpprof"), quiet=2)
    inputs = real_inputs() + [("recorded CPU run (gloo, 2 ranks)", cpu_run(args.cpu_run, tmp))]
    if not args.no_big:
        inputs.append(("big", ""))
    if args.only:
        inputs = [x for x in inputs if args.only in x[0]]
    print(f"machine: {os.cpu_count()} cores, load {os.getloadavg()[0]:.1f}; python {sys.version.split()[0]}; "
          f"{args.stat} of {repeat} runs" + (f"; before = {args.before} (interleaved with now)" if old else ""))
    other = "median" if args.stat == "min" else "min"
    table, table_before, table_other = [], [], []
    big = None
    at_before = ("@before",) if old else ()
    try:
        for name, path in inputs:
            if name == "big":          # built after the real inputs were measured
                largest = max((f for _, p in real_inputs() for f in trace_files(p)), key=os.path.getsize)
                big, size = build_big_trace(largest, int(args.big_gb * 1e9), tmp)
                os.sync()
                path, name = big, f"replicated GPU trace ({size / 1e9:.2f} GB plain)"
            size = decompressed_bytes(path)
            n_files = len(trace_files(path))
            print(f"\n== {name}: {path}\n   {n_files} trace file(s), {size / 2**20:.1f} MiB decompressed", flush=True)
            reps = 1 if path == big else repeat
            warm = {m: [] for m in ("ours", *(f"ours{a}" for a in at_before), "orjson", "hta")}
            coldr = {m: [] for m in ("ours", "hta", "analysis", "report",
                                     *(f"{k}{a}" for a in at_before for k in ("ours", "analysis", "report")))}
            for _ in range(reps):        # interleaved
                for m in warm:
                    if m == "hta" and path == big and args.skip_hta_big:
                        warm[m].append({"error": "skipped"})
                        continue
                    warm[m].append(measure(m.split("@")[0], path, args.timeout, tree=old if "@" in m else None))
                for m in coldr:
                    kind = m.split("@")[0]
                    if path == big and kind in ("hta", "analysis", "report"):
                        coldr[m].append({"error": "skipped"})
                        continue
                    coldr[m].append(cold(kind, path, tmp, args.timeout, tree=old if "@" in m else None))
            w, w_other = ({m: over_runs(r, "seconds", "cpu_seconds", "peak_rss_bytes", "import_seconds", stat=st)
                           for m, r in warm.items()} for st in (args.stat, other))
            c, c_other = ({m: over_runs(r, "wall", "cpu", "peak_rss_bytes", stat=st) for m, r in coldr.items()}
                          for st in (args.stat, other))
            base = measure("ours-idle", path, args.timeout)
            base_before = measure("ours-idle", path, args.timeout, tree=old) if old else None
            bdk = measure("breakdowns", path, args.timeout)
            stages = measure("stages", path, args.timeout)
            for m, label in (("ours", "ours (load_run+overlap+volume)"),
                             ("ours@before", f"ours at {args.before}"),
                             ("orjson", "orjson.loads (read+gunzip+loads)"),
                             ("hta", "HTA (load+get_comm_comp_overlap)")):
                if m not in w:
                    continue
                r = w[m]
                if "error" in r:
                    print(f"   warm {label[:36]:36s} {r['error']}")
                else:
                    extra = f"  overlap {r['overlap_pct']:.2f} %" if "overlap_pct" in r else ""
                    print(f"   warm {label[:36]:36s} {r['seconds']:7.3f} s wall {r['cpu_seconds']:7.3f} s CPU  peak RSS "
                          f"{r['peak_rss_bytes'] / 2**20:5.0f} MiB  (imports {r['import_seconds']:.2f} s, untimed){extra}")
            for m, label in (("ours", "ours (load_run+overlap+volume)"), ("hta", "HTA"),
                             ("analysis", "analysis (load_run+analyze_run)"), ("report", "fsdpprof report"),
                             ("ours@before", f"ours at {args.before}"), ("analysis@before", f"analysis at {args.before}"),
                             ("report@before", f"report at {args.before}")):
                if m not in c:
                    continue
                r = c[m]
                print(f"   cold {label[:36]:36s} " + (r["error"] if "error" in r else
                      f"{r['wall']:7.3f} s wall {r['cpu']:7.3f} s CPU  peak RSS {r['peak_rss_bytes'] / 2**20:5.0f} MiB"))
            if "error" not in stages:
                tot = stages["stages"].pop("total")
                print(f"   where ours goes (cProfile, warm, {tot:.3f} s in all): " + ", ".join(
                    f"{k} {v:.3f}" for k, v in stages["stages"].items()))
            if "error" not in bdk:
                print(f"   our native breakdowns (temporal, kernel types, top kernels) on the loaded events: "
                      f"{bdk['breakdown_seconds']:.3f} s")
            row = row_of(name, w, c, base, size)
            if "rss_x" in row:
                print(f"   peak RSS: ours {w['ours']['peak_rss_bytes'] / 2**20:.0f} MiB = baseline "
                      f"{base['peak_rss_bytes'] / 2**20:.0f} MiB (same process and imports, the warm-up only) + "
                      f"{row['rss_x']:.2f} x the decompressed trace")
            table.append(row)
            table_other.append(row_of(name, w_other, c_other, base, size))
            if old:
                table_before.append(row_of(name, w, c, base_before, size, "@before"))
            if args.profile and path != big:
                profile_report(path, tmp)
        print("\n== CLI start-up (whole processes)")
        cli = cli_startup(max(repeat, 5), stat=args.stat)
        cli_before = cli_startup(max(repeat, 5), tree=old, stat=args.stat) if old else []
        for r in cli + cli_before:
            m = r["res"]
            print(f"   {r['label']:55s} " + (m["error"] if "error" in m else
                  f"{m['wall']:.3f} s wall {m['cpu']:.3f} s CPU  peak RSS {m['peak_rss_bytes'] / 2**20:.0f} MiB") +
                  f"  imports {'/'.join(r['heavy']) or 'none of pandas/torch/numpy/plotly'}; slowest: {r['top']}")
    finally:
        if not args.out:
            shutil.rmtree(tmp, ignore_errors=True)

    # ------------------------------------------------------------------ the table of goals
    def ok(x, goal, higher=True):
        return "  -  " if x is None else ("pass " if (x >= goal if higher else x <= goal) else "FAIL ")

    def goal_table(rows: list[dict], stat: str, note: str = "") -> None:
        print(f"\n== ratios against the goals of issue 12, from the {stat} of each contender's runs{note} (CPU-second "
              "ratios; wall in brackets)")
        print(f"   {'input':34s} {'HTA/ours >=10':>22s} {'orjson/ours >=1 warm':>22s} {'report/analysis <=1.5':>22s} "
              f"{'RSS-base/trace <=2':>19s}")
        for r in rows:
            print(f"   {r['input'][:34]:34s} {ok(r['hta_x'], GOALS['hta_x'])}{fmt_ratio(r['hta_x'])} ({fmt_ratio(r['hta_x_wall'])}) "
                  f"    {ok(r['orjson_x'], 1)}{fmt_ratio(r['orjson_x'])} ({fmt_ratio(r['orjson_x_wall'])})"
                  f"     {ok(r['report_x'], GOALS['report_x'], False)}{fmt_ratio(r['report_x'])} ({fmt_ratio(r['report_x_wall'])})"
                  f"   {ok(r.get('rss_x'), GOALS['rss_x'], False)}{fmt_ratio(r.get('rss_x'))}")

    goal_table(table_other, other, " (info: the same runs)")
    goal_table(table, args.stat)
    for r in cli:
        m = r["res"]
        wall = None if "error" in m else m["wall"]
        clean = not ({"pandas", "torch"} & set(r["heavy"]))
        print(f"   {r['label']:55s} {ok(wall, GOALS['cli_s'], False)}{wall if wall is None else round(wall, 3)} s "
              f"(goal < {GOALS['cli_s']} s); {'no pandas/torch import' if clean else 'imports ' + '/'.join(r['heavy'])}")
    if old:
        print(f"\n== before ({args.before}) -> now, measured interleaved in this run (CPU seconds; ratios as above)")
        print(f"   {'input':34s} {'ours warm CPU s':>18s} {'HTA/ours':>15s} {'orjson/ours warm':>17s} "
              f"{'report/analysis':>16s} {'RSS-base/trace':>15s}")

        def pair(a, b, fmt="{:.2f}"):
            f = (lambda x: "n/a" if x is None else fmt.format(x))
            return f"{f(a)} -> {f(b)}"
        for rb, ra in zip(table_before, table):
            print(f"   {ra['input'][:34]:34s} {pair(rb['ours_cpu'], ra['ours_cpu'], '{:.3f}'):>18s} "
                  f"{pair(rb['hta_x'], ra['hta_x']):>15s} {pair(rb['orjson_x'], ra['orjson_x']):>17s} "
                  f"{pair(rb['report_x'], ra['report_x']):>16s} "
                  f"{pair(rb.get('rss_x'), ra.get('rss_x')):>15s}")
        now_by_label = {r["label"]: r for r in cli}
        for rb in cli_before:
            ra = now_by_label.get(rb["label"].replace(", before", ""))
            if ra is None:
                continue
            wb, wa = (None if "error" in r["res"] else r["res"]["wall"] for r in (rb, ra))
            print(f"   {ra['label']:55s} {pair(wb, wa, '{:.3f}')} s; imports then: "
                  f"{'/'.join(rb['heavy']) or 'none of pandas/torch/numpy/plotly'}, now: "
                  f"{'/'.join(ra['heavy']) or 'none of pandas/torch/numpy/plotly'}")


if __name__ == "__main__":
    main()
