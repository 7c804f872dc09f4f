"""Benchmark: load + overlap on big traces (issue 40): CPU seconds, MB/s, peak RSS and its ratio to the trace,
this tree against ``--before COMMIT`` in the same run, with orjson.loads and HTA on the 1 GB trace as anchors
(``--anchors orjson,hta``, ``--anchor-gb``).

    python benchmarks/bench_big.py [--sizes 0.5,1,2] [--gz-gb 16] [--before b6e0271] [--anchors orjson,hta]
                                   [--source TRACE] [--repeat 1] [--tmp /tmp/fsdpprof-big] [--keep] [--max-rss-gb 6]

Inputs (written under --tmp, kept with --keep and reused when already there): traces of 0.5 / 1 / 2 / 4 GB
(decompressed, plain JSON; --sizes, in GB of 2^30 bytes) built by replicating a real A100 trace
(tests/data/gpu-traces/hta-16rank-a100, 109 k events) with shifted times, correlation / External ids and
ProfilerStep numbers (``--source``: another real trace, e.g. a recorded CPU run's rank-0/trace.json.gz, whose
profiler [memory] events the A100 trace lacks); ``--gz-gb N`` adds an N GB trace written gzipped (level 1), run through
``fsdpprof report`` (its peak RSS is the figure of the issue's goal: <= 4 GB for 16 GB).

Each measurement is one fresh process (nice the whole benchmark on a shared machine, not its children: a
doubly niced child starves), timed from after its imports: load_run + run_events +
overall_overlap + collective_volume (what bench_analyze.py calls "ours").  CPU s is user + system of that
process; MB/s = trace bytes (decompressed) / CPU s; peak RSS is the process's VmHWM (imports included).  A run
whose peak the smaller sizes predict beyond --max-rss-gb (default 6: a shared machine) is skipped and said so;
an anchor past it is killed (psutil watches it) and reported as such.

Goals (issue 40), printed against the figures: on 1 GB, load + overlap >= 2x faster than --before and peak RSS
<= 0.3x the trace; MB/s at the largest plain size within 15 % of the smallest's; the --gz-gb report's peak RSS
<= 4 GB.  Prints figures only; nothing here asserts.
"""
from __future__ import annotations

import argparse
import gzip
import hashlib
import json
import os
import shutil
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
SOURCE = ROOT / "tests" / "data" / "gpu-traces" / "hta-16rank-a100" / "rank-0.json.gz"
GB = 1 << 30
INPUT_FORMAT = 2                # in the inputs' names: a trace built by an older write_replicated is built again
ID_STRIDE = 10_000_000          # correlation / External ids of copy k are shifted by k * ID_STRIDE
STEP_STRIDE = 100_000           # ProfilerStep#n of copy k -> n + k * STEP_STRIDE

# what a child runs (argv: tree, trace path); "ours" prints one RESULT line
OURS = """
import sys, time, json, resource
sys.path.insert(0, sys.argv[1])
try:
    from fsdpprof.analyze.load.run import load_run, run_events
except ImportError:
    from fsdpprof.analyze.run import load_run
    def run_events(run):
        return run.events()
from fsdpprof.analyze.comm import overlap, volume
t0, c0 = time.perf_counter(), time.process_time()
ev = run_events(load_run(sys.argv[2], progress=False, max_trace_bytes=1 << 40))
o = overlap.overall_overlap(ev)
volume.collective_volume(ev)
print("RESULT " + json.dumps({"cpu_s": time.process_time() - c0, "wall_s": time.perf_counter() - t0,
      "events": len(ev), "overlap_pct": float(o["comp_comm_overlap_pct"].iloc[0])}), flush=True)
"""
ORJSON = """
import sys, time, json
import orjson
t0, c0 = time.perf_counter(), time.process_time()
with open(sys.argv[2], "rb") as fh:
    n = len(orjson.loads(fh.read())["traceEvents"])
print("RESULT " + json.dumps({"cpu_s": time.process_time() - c0, "wall_s": time.perf_counter() - t0,
      "events": n}), flush=True)
"""
HTA = """
import sys, time, json, logging, os, tempfile
logging.disable(logging.WARNING)
from hta.trace_analysis import TraceAnalysis
d = tempfile.mkdtemp()
os.symlink(os.path.abspath(sys.argv[2]), os.path.join(d, "rank-0.json"))
t0, c0 = time.perf_counter(), time.process_time()
r = TraceAnalysis(trace_dir=d, include_last_profiler_step=True).get_comm_comp_overlap(visualize=False)
print("RESULT " + json.dumps({"cpu_s": time.process_time() - c0, "wall_s": time.perf_counter() - t0,
      "overlap_pct": float(r["comp_comm_overlap_pctg"].iloc[0])}), flush=True)
"""
REPORT = """
import sys, time, json, runpy
sys.path.insert(0, sys.argv[1])
t0, c0 = time.perf_counter(), time.process_time()
sys.argv = ["fsdpprof", "report", sys.argv[2], "-o", sys.argv[3], "--force", "--workers", "1",
            "--max-trace-bytes", str(1 << 40)]
try:
    runpy.run_module("fsdpprof", run_name="__main__")
except SystemExit as exc:
    if exc.code:
        raise
print("RESULT " + json.dumps({"cpu_s": time.process_time() - c0, "wall_s": time.perf_counter() - t0}), flush=True)
"""


# ----------------------------------------------------------------------------------------- inputs
def write_replicated(target_bytes: int, path: Path, gz: bool, source: Path = SOURCE) -> int:
    """``source``'s events replicated (shifted times, ids, step numbers) until the JSON holds >= target_bytes;
    plain or gzip (level 1).  Returns the decompressed size."""
    import orjson
    data = source.read_bytes()
    doc = orjson.loads(gzip.decompress(data) if data[:2] == b"\x1f\x8b" else data)
    events = doc.pop("traceEvents")
    ts = [e["ts"] for e in events if isinstance(e.get("ts"), (int, float))]
    # (an int when every time is: a copy's times are written as the source wrote them.  "1683564901548726.0" takes
    # msgspec's slow float path, ~300 ns against ~20 ns for the integer real traces hold)
    span = (max(ts) - min(ts)) + 1000
    header = orjson.dumps(doc)[:-1] + b', "traceEvents": [\n'
    tmp = path.with_suffix(path.suffix + ".part")
    raw = open(tmp, "wb")
    if gz:
        from isal import isal_zlib
        comp = isal_zlib.compressobj(1, isal_zlib.DEFLATED, 31)
        write = lambda b: raw.write(comp.compress(b))      # noqa: E731
    else:
        write = raw.write
    total = len(header)
    write(header)
    k = 0
    while True:
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
                        a[key] = a[key] + k * ID_STRIDE
                e2["args"] = a
            name = e2.get("name")
            if k and isinstance(name, str) and name.startswith("ProfilerStep#"):
                e2["name"] = f"ProfilerStep#{int(name[13:]) + k * STEP_STRIDE}"
            shifted.append(e2)
        body = orjson.dumps(shifted)[1:-1]
        total += len(body)
        k += 1
        last = total + 4 >= target_bytes
        body += b"\n]}" if last else b",\n"
        total += 3 if last else 2
        write(body)
        if last:
            break
    if gz:
        raw.write(comp.flush())
    raw.close()
    os.replace(tmp, path)
    return total


def trace_for(gb: float, tmp: Path, gz: bool, source: Path = SOURCE) -> tuple[Path, int]:
    tag = "" if source == SOURCE else "-" + hashlib.sha1(str(source.resolve()).encode()).hexdigest()[:8]
    path = tmp / f"big-{gb:g}gb{tag}.v{INPUT_FORMAT}.json{'.gz' if gz else ''}"
    size_file = path.with_suffix(path.suffix + ".size")
    if path.is_file() and size_file.is_file():
        return path, int(size_file.read_text())
    print(f"building {path} ...", flush=True)
    size = write_replicated(int(gb * GB), path, gz, source)
    size_file.write_text(str(size))
    return path, size


def tree_at(ref: str, tmp: Path) -> str:
    """fsdpprof at git commit ``ref``, exported under tmp (git archive)."""
    out = tmp / f"tree-{ref}"
    if not (out / "fsdpprof").is_dir():
        out.mkdir(parents=True, exist_ok=True)
        data = subprocess.run(["git", "-C", str(ROOT), "archive", ref], check=True, capture_output=True).stdout
        subprocess.run(["tar", "-x", "-C", str(out)], input=data, check=True)
    return str(out)


# ----------------------------------------------------------------------------------------- measuring
def run_child(code: str, args: list[str], max_rss: int, timeout_s: float) -> dict:
    """One fresh, niced process: its RESULT, peak RSS (VmHWM, bytes, the largest of it and its children), or why
    it has none (killed past max_rss bytes or timeout_s)."""
    import psutil
    proc = subprocess.Popen([sys.executable, "-c", code, *args], stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True)
    peak, killed = [0], [None]

    def watch() -> None:
        try:
            p = psutil.Process(proc.pid)
            t0 = time.monotonic()
            while proc.poll() is None:
                procs = [p] + p.children(recursive=True)
                rss = 0
                for q in procs:
                    try:
                        rss += q.memory_info().rss
                        hwm = _hwm(q.pid)
                        peak[0] = max(peak[0], hwm or 0)
                    except psutil.Error:
                        pass
                peak[0] = max(peak[0], rss)
                if rss > max_rss or time.monotonic() - t0 > timeout_s:
                    killed[0] = (f"killed at {rss / GB:.1f} GB RSS after {time.monotonic() - t0:.0f} s wall"
                                 if rss > max_rss else f"killed after {timeout_s:.0f} s")
                    for q in procs:
                        try:
                            q.kill()
                        except psutil.Error:
                            pass
                    return
                time.sleep(0.05)
        except psutil.Error:
            pass

    th = threading.Thread(target=watch, daemon=True)
    th.start()
    out, err = proc.communicate()
    th.join()
    res = next((json.loads(line[7:]) for line in out.splitlines() if line.startswith("RESULT ")), None)
    if res is None:
        return {"error": killed[0] or (err.strip().splitlines() or ["no result"])[-1][:200], "peak_rss": peak[0]}
    res["peak_rss"] = peak[0]
    return res


def _hwm(pid: int) -> int | None:
    try:
        with open(f"/proc/{pid}/status") as fh:
            for line in fh:
                if line.startswith("VmHWM:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        return None
    return None


def best(runs: list[dict]) -> dict:
    ok = [r for r in runs if "error" not in r]
    if not ok:
        return runs[0]
    return {**min(ok, key=lambda r: r["cpu_s"]), "peak_rss": max(r["peak_rss"] for r in ok)}


def row(label: str, what: str, size: int, r: dict) -> str:
    if "error" in r:
        return f"| {label} | {what} | {size / GB:.2f} | - | - | {r['peak_rss'] / GB:.2f} | - | {r['error']} |"
    overlap = "" if r.get("overlap_pct") is None else f"overlap {r['overlap_pct']:.4f} %"
    return (f"| {label} | {what} | {size / GB:.2f} | {r['cpu_s']:.1f} | {size / 1e6 / r['cpu_s']:.0f} | "
            f"{r['peak_rss'] / GB:.2f} | {r['peak_rss'] / size:.2f} | {r.get('events', '')} {overlap} |")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--sizes", default="0.5,1,2,4", help="plain trace sizes, GB (2^30 bytes), comma-separated")
    ap.add_argument("--gz-gb", type=float, default=0.0, help="also a gzipped trace of this many GB through report")
    ap.add_argument("--before", default=None, help="git commit to measure in the same run (e.g. b6e0271)")
    ap.add_argument("--anchors", default="", help="anchors to run on the --anchor-gb trace: orjson,hta")
    ap.add_argument("--anchor-gb", type=float, default=1.0, help="the plain size the anchors run on")
    ap.add_argument("--source", type=Path, default=SOURCE,
                    help="the real trace (plain or gzip) to replicate (default: the A100 trace; a recorded CPU run's "
                         "rank trace has the profiler's [memory] events)")
    ap.add_argument("--repeat", type=int, default=1)
    ap.add_argument("--tmp", default=os.path.join(tempfile.gettempdir(), "fsdpprof-big"))
    ap.add_argument("--keep", action="store_true", help="keep the traces (reused by the next run)")
    ap.add_argument("--max-rss-gb", type=float, default=6.0)
    ap.add_argument("--timeout-s", type=float, default=900.0)
    args = ap.parse_args()
    tmp = Path(args.tmp)
    tmp.mkdir(parents=True, exist_ok=True)
    max_rss = int(args.max_rss_gb * GB)
    trees = [("now", str(ROOT))] + ([(args.before, tree_at(args.before, tmp))] if args.before else [])
    sizes = [float(x) for x in args.sizes.split(",") if x]
    lines = ["| tree | work | trace GB | CPU s | MB/s | peak RSS GB | RSS / trace | events, overlap |",
             "|---|---|---|---|---|---|---|---|"]
    results: dict = {}
    ratio: dict = {}              # tree -> peak RSS / trace bytes of its last measured size (predicts the next)
    try:
        for gb in sizes:
            path, size = trace_for(gb, tmp, gz=False, source=args.source)
            for label, tree in trees:
                if label in ratio and ratio[label] * size > max_rss:
                    lines.append(f"| {label} | load+overlap | {size / GB:.2f} | - | - | - | - | skipped: "
                                 f"predicted {ratio[label] * size / GB:.1f} GB RSS > --max-rss-gb |")
                    continue
                r = best([run_child(OURS, [tree, str(path)], max_rss, args.timeout_s) for _ in range(args.repeat)])
                results[(label, gb)] = r
                if "error" not in r:
                    ratio[label] = r["peak_rss"] / size
                lines.append(row(label, "load+overlap", size, r))
                print(lines[-1], flush=True)
            if gb == args.anchor_gb:
                anchors = (("orjson", "orjson.loads", ORJSON), ("hta", "HTA overlap", HTA))
                for what, code in [(w, c) for k, w, c in anchors if k in args.anchors.split(",")]:
                    r = run_child(code, ["", str(path)], max_rss, args.timeout_s)
                    results[(what, gb)] = r
                    lines.append(row("-", what, size, r))
                    print(lines[-1], flush=True)
            if not args.keep:
                path.unlink()
        if args.gz_gb:
            path, size = trace_for(args.gz_gb, tmp, gz=True, source=args.source)
            for label, tree in trees:
                if label in ratio and ratio[label] * size > max_rss:
                    lines.append(f"| {label} | report (gz) | {size / GB:.2f} | - | - | - | - | skipped: "
                                 f"predicted {ratio[label] * size / GB:.1f} GB RSS > --max-rss-gb |")
                    continue
                out = tmp / f"report-{label}.html"
                r = run_child(REPORT, [tree, str(path), str(out)], max_rss, args.timeout_s)
                lines.append(row(label, "report (gz)", size, r))
                print(lines[-1], flush=True)
            if not args.keep:
                path.unlink()
    finally:
        if not args.keep:
            for p in tmp.glob("tree-*"):
                shutil.rmtree(p, ignore_errors=True)
    print("\n" + "\n".join(lines))
    # goals
    print("\ngoals (issue 40):")
    now1, before1 = results.get(("now", 1.0)), results.get((args.before, 1.0))
    if now1 and "error" not in now1:
        if before1 and "error" not in before1:
            print(f"  1 GB load+overlap {before1['cpu_s'] / now1['cpu_s']:.2f}x faster than {args.before} "
                  f"(goal >= 2x); overlap {'unchanged' if now1['overlap_pct'] == before1['overlap_pct'] else 'CHANGED'}")
        print(f"  1 GB peak RSS {now1['peak_rss'] / (1.0 * GB):.2f}x the trace (goal <= 0.3x)")
    measured = [gb for gb in sizes if ("now", gb) in results and "error" not in results[("now", gb)]]
    if len(measured) >= 2:
        lo, hi = results[("now", measured[0])], results[("now", measured[-1])]
        print(f"  MB/s at {measured[-1]:g} GB is {(measured[-1] / hi['cpu_s']) / (measured[0] / lo['cpu_s']):.2f}x "
              f"that at {measured[0]:g} GB (goal within 15 %)")


if __name__ == "__main__":
    main()
