"""Benchmark: the per-rank map at scale, local process pool vs Dask (LocalCluster), and HTA on the same input.

    python benchmarks/bench_scale.py [--ranks 8,64,256] [--mb 30] [--big 64x100] [--engines local,dask]
                                     [--workers 2] [--hta-max-ranks 64] [--sizes 1024] [--tmp DIR] [--keep]

Inputs (written under --tmp, default /tmp/fsdpprof-scale, removed at the end unless --keep): synthetic N-rank
runs built from the 8 real DLRM traces in tests/data/gpu-traces/param-dlrm-8rank-v100 (V100, NCCL, one
step each).  Rank i is rank i % 8's trace, its events replicated with shifted times, correlation / external /
flow ids and ProfilerStep numbers until the trace holds --mb MB of JSON, distributedInfo.rank = i and
world_size = N, and a per-rank clock offset of (i * 37) % 1000 µs (the skew analysis must align it).
Written gzipped (level 1), as folders of rank-<i>.json.gz.

For each input and engine, one fresh process runs what ``fsdpprof report DIR --engine E --workers W`` runs
(load_run lazily, map_ranks, reduce_run, write_report) and prints: wall seconds, the parent's peak RSS (its
own, getrusage SELF: a LocalCluster's scheduler lives in it, its workers do not), the largest worker peak RSS
(each rank's analysis resets and reads its process's VmHWM: engines.measured_call) and that worker's growth
over its RSS before the rank (what the rank itself cost), HTML and summary.json sizes.  HTA
(``TraceAnalysis`` + ``get_comm_comp_overlap``, every rank in one process) runs on the same folder up to
--hta-max-ranks ranks, killed past 10 min or when its processes hold more than 16 GB (or the memory the
machine has free, less 2 GB); a size that its smaller runs predict beyond either is skipped and said so.

--sizes N (default 1024; 0: skip) builds an N-rank run of the DLRM traces at their own size (about 1 MB each)
and reports the HTML and summary.json sizes of its report (goal: HTML < 10 MB).

Goals (issue 11), printed against the figures: 64 ranks x 100 MB in under 2 minutes on this machine (--big);
parent peak RSS under 500 MB at 256 ranks and flat in N; worker peak RSS <= 2x one rank's decompressed trace.
Prints figures only; nothing here asserts timings.  Run it niced on a shared machine (`nice -n 10`).
"""
from __future__ import annotations

import argparse
import gzip
import json
import os
import resource
import shutil
import subprocess
import sys
import threading
import time
import zlib
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
SOURCES = ROOT / "tests" / "data" / "gpu-traces" / "param-dlrm-8rank-v100"
GOALS = {"big_wall_s": 120.0, "parent_rss_mb": 500.0, "worker_x": 2.0}
HTA_TIMEOUT_S = 600.0
HTA_MAX_BYTES = 16 << 30
ID_STRIDE = 10_000_000          # correlation / external / flow ids of copy k are shifted by k * ID_STRIDE
STEP_STRIDE = 100_000           # ProfilerStep#n of copy k -> n + k * STEP_STRIDE


# ----------------------------------------------------------------------------------------- inputs
def _source(i: int) -> tuple[dict, list[dict], float, int]:
    """(header, events, span_us, plain JSON bytes of the events) of DLRM rank i % 8."""
    import orjson

    doc = orjson.loads(gzip.decompress((SOURCES / f"rank-{i % 8}.json.gz").read_bytes()))
    events = doc.pop("traceEvents")
    ts = [e["ts"] for e in events if isinstance(e.get("ts"), (int, float))]
    return doc, events, (max(ts) - min(ts)) + 1000.0, len(orjson.dumps(events))


def _shifted(events: list[dict], k: int, dt_us: float) -> list[dict]:
    out = []
    for e in events:
        e2 = dict(e)
        if isinstance(e2.get("ts"), (int, float)):
            e2["ts"] = e2["ts"] + dt_us
        if k:
            if e2.get("ph") in ("s", "f", "t") and isinstance(e2.get("id"), int):
                e2["id"] = e2["id"] + k * ID_STRIDE
            a = e2.get("args")
            if isinstance(a, dict):
                a = dict(a)
                for key in ("correlation", "External id"):
                    if isinstance(a.get(key), int):
                        a[key] = a[key] + k * ID_STRIDE
                e2["args"] = a
            name = e2.get("name")
            if isinstance(name, str) and name.startswith("ProfilerStep#") and name[13:].isdigit():
                e2["name"] = f"ProfilerStep#{int(name[13:]) + k * STEP_STRIDE}"
        out.append(e2)
    return out


def write_rank(i: int, n: int, target_bytes: int, path: str) -> int:
    """Rank i of an n-rank synthetic run at about target_bytes of JSON; returns the plain JSON bytes."""
    import orjson

    head, events, span, one = _source(i)
    head = dict(head, distributedInfo=dict(head.get("distributedInfo") or {}, rank=i, world_size=n))
    head["traceName"] = f"synthetic rank {i} of {n} from DLRM rank {i % 8}"
    copies = max(1, round(target_bytes / one))
    offset = float((i * 37) % 1000)
    comp = zlib.compressobj(1, zlib.DEFLATED, 31)
    total = 0
    with open(path + ".part", "wb") as fh:
        def put(b: bytes) -> None:
            nonlocal total
            total += len(b)
            fh.write(comp.compress(b))
        # the header as torch writes it ("rank": 3, with a space: what HTA's rank pattern needs)
        put(json.dumps(head).encode()[:-1] + b', "traceEvents": [\n')
        for k in range(copies):
            put(orjson.dumps(_shifted(events, k, k * span + offset))[1:-1])
            put(b",\n" if k + 1 < copies else b"\n")
        put(b"]}")
        fh.write(comp.flush())
    os.replace(path + ".part", path)
    return total


def build_run(n: int, mb: float, root: str, jobs: int) -> tuple[str, int]:
    """Folder of n synthetic rank traces (reused when complete); returns (folder, plain bytes of rank 0)."""
    import concurrent.futures as cf

    d = os.path.join(root, f"run-{n}x{mb:g}MB")
    os.makedirs(d, exist_ok=True)
    todo = [i for i in range(n) if not os.path.exists(os.path.join(d, f"rank-{i}.json.gz"))]
    t0 = time.perf_counter()
    if todo:
        with cf.ProcessPoolExecutor(max_workers=jobs) as pool:
            list(pool.map(write_rank, todo, [n] * len(todo), [int(mb * 1e6)] * len(todo),
                          [os.path.join(d, f"rank-{i}.json.gz") for i in todo], chunksize=4))
        print(f"  built {len(todo)} rank traces in {d} ({time.perf_counter() - t0:.0f} s)", flush=True)
    return d, plain_bytes(os.path.join(d, "rank-0.json.gz"))


def plain_bytes(path: str) -> int:
    n = 0
    with gzip.open(path, "rb") as fh:
        while chunk := fh.read(1 << 24):
            n += len(chunk)
    return n


def disk_bytes(folder: str) -> int:
    return sum(f.stat().st_size for f in Path(folder).iterdir())


# ----------------------------------------------------------------------------------------- children
def child_ours(engine: str, path: str, workers: int, out: str) -> None:
    """What `fsdpprof report PATH --engine ENGINE --workers W` runs, measured; prints one RESULT line."""
    t0 = time.perf_counter()
    sys.path.insert(0, str(ROOT))
    from fsdpprof.analyze.pipeline import map_ranks, reduce_run
    from fsdpprof.analyze.load.run import load_run
    from fsdpprof.commands.report import write_report

    t_import = time.perf_counter() - t0
    run = load_run(path, lazy=True)
    t1 = time.perf_counter()
    start_s = None
    if engine == "dask":           # the LocalCluster that `report --engine dask` starts, timed on its own
        from fsdpprof.analyze.load import engines

        with engines.shared_scheduler("dask", None, workers, len(run.ranks)) as address:
            start_s = time.perf_counter() - t1
            results = map_ranks(run, engine="dask", scheduler=address, progress=False, ops=False)
    else:
        results = map_ranks(run, workers=workers, engine=engine, progress=False, ops=False)
    t_map = time.perf_counter() - t1
    a = reduce_run(run, results)
    t_reduce = time.perf_counter() - t1 - t_map
    stats = [r.worker for r in results if r.worker]
    del results
    html, summ = write_report(a, os.path.join(out, f"report-{engine}.html"))
    peaks = [s for s in stats if s.get("peak_rss_bytes")]
    top = max(peaks, key=lambda s: s["peak_rss_bytes"]) if peaks else {}
    grow = max((s["peak_rss_bytes"] - s["start_rss_bytes"] for s in peaks if s.get("start_rss_bytes")), default=None)
    print("RESULT " + json.dumps({
        "seconds": time.perf_counter() - t0, "import_s": t_import, "map_s": t_map, "reduce_s": t_reduce,
        "parent_peak_rss": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024,
        "worker_peak_rss": top.get("peak_rss_bytes"), "worker_growth": grow,
        "rank_seconds_max": max((s["seconds"] for s in stats), default=None),
        "ranks_cpu_s": sum(s.get("cpu_seconds") or 0.0 for s in stats), "cluster_start_s": start_s,
        "overlap_pct": [float(x) for x in a.overlap_overall["comp_comm_overlap_pct"]],
        "workers_seen": len({(s["host"], s["pid"]) for s in stats}),
        "ranks": a.overview.get("ranks_analysed"), "missing": len(a.missing),
        "html_bytes": os.path.getsize(html), "summary_bytes": os.path.getsize(summ)}), flush=True)


def child_hta(path: str) -> None:
    import logging

    logging.disable(logging.WARNING)
    t0 = time.perf_counter()
    from hta.trace_analysis import TraceAnalysis

    ta = TraceAnalysis(trace_dir=path, include_last_profiler_step=True)
    r = ta.get_comm_comp_overlap(visualize=False)
    a, c = resource.getrusage(resource.RUSAGE_SELF), resource.getrusage(resource.RUSAGE_CHILDREN)
    print("RESULT " + json.dumps({"seconds": time.perf_counter() - t0, "parent_peak_rss": a.ru_maxrss * 1024,
                                  "children_peak_rss": c.ru_maxrss * 1024, "ranks": int(len(r)),
                                  "overlap_pct": [float(x) for x in r.sort_values("rank")["comp_comm_overlap_pctg"]]}),
          flush=True)


def _tree_rss(pid: int) -> int:
    """Resident bytes of a process and its descendants (from /proc)."""
    import psutil

    try:
        p = psutil.Process(pid)
        procs = [p] + p.children(recursive=True)
    except psutil.Error:
        return 0
    total = 0
    for q in procs:
        try:
            total += q.memory_info().rss
        except psutil.Error:
            pass
    return total


def run_child(argv: list[str], timeout: float, max_bytes: int | None = None) -> dict:
    """Run a child (niced like us), watch its tree's RSS; its RESULT line, or why there is none."""
    import psutil

    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONWARNINGS="ignore")
    t0 = time.perf_counter()
    p = subprocess.Popen(argv, stdout=subprocess.PIPE, stderr=subprocess.PIPE, env=env, text=True,
                         start_new_session=True)
    peak_tree = [0]
    why = [None]

    def watch() -> None:
        while p.poll() is None:
            rss = _tree_rss(p.pid)
            peak_tree[0] = max(peak_tree[0], rss)
            limit = max_bytes
            if limit is not None:
                limit = min(limit, rss + psutil.virtual_memory().available - (2 << 30))
                if rss > limit:
                    why[0] = f"gave up: its processes held {rss / 2**30:.1f} GB (limit {limit / 2**30:.1f} GB)"
                    os.killpg(p.pid, 9)
                    return
            if time.perf_counter() - t0 > timeout:
                why[0] = f"gave up after {timeout:.0f} s"
                os.killpg(p.pid, 9)
                return
            time.sleep(0.5)

    th = threading.Thread(target=watch, daemon=True)
    th.start()
    out, err = p.communicate()
    th.join()
    wall = time.perf_counter() - t0
    if why[0]:
        return {"error": why[0], "wall": wall, "tree_peak_rss": peak_tree[0]}
    line = next((x for x in out.splitlines() if x.startswith("RESULT ")), None)
    if p.returncode != 0 or line is None:
        return {"error": f"exit {p.returncode}: {err.strip().splitlines()[-1] if err.strip() else 'no result'}"}
    res = json.loads(line[len("RESULT "):])
    res.update(wall=wall, tree_peak_rss=peak_tree[0])
    return res


# ----------------------------------------------------------------------------------------- main
def _short(r: dict) -> str:
    return json.dumps({k: (round(v, 2) if isinstance(v, float) else v) for k, v in r.items() if k != "overlap_pct"})


def mb(x) -> str:
    return "-" if x is None else f"{x / 1e6:,.0f}"


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--child", nargs="+")
    ap.add_argument("--ranks", default="8,64,256")
    ap.add_argument("--mb", type=float, default=30.0, help="MB of JSON per rank (decompressed)")
    ap.add_argument("--big", default="64x100", help="RANKSxMB of the wall-time goal ('' to skip)")
    ap.add_argument("--engines", default="local,dask")
    ap.add_argument("--workers", type=int, default=os.cpu_count() or 1)
    ap.add_argument("--hta-max-ranks", type=int, default=64)
    ap.add_argument("--sizes", type=int, default=1024, help="ranks of the report-size run (0: skip)")
    ap.add_argument("--tmp", default="/tmp/fsdpprof-scale")
    ap.add_argument("--keep", action="store_true", help="keep the synthetic runs (reused by the next call)")
    ap.add_argument("--timeout", type=float, default=1800)
    args = ap.parse_args()
    if args.child:
        if args.child[0] == "hta":
            child_hta(args.child[1])
        else:
            engine, path, workers, out = args.child
            child_ours(engine, path, int(workers), out)
        return
    os.makedirs(args.tmp, exist_ok=True)
    engines = [e for e in args.engines.split(",") if e]
    sizes = [(int(n), args.mb) for n in args.ranks.split(",") if n]
    if args.big:
        n, m = args.big.lower().split("x")
        sizes.append((int(n), float(m)))
    load = os.getloadavg()
    print(f"machine: {os.cpu_count()} cores shared with other users (load average {load[0]:.1f} at the start), "
          f"{os.sysconf('SC_PHYS_PAGES') * os.sysconf('SC_PAGE_SIZE') / 2**30:.0f} GiB; this benchmark runs at nice "
          f"{os.nice(0)}; --workers {args.workers}; python {sys.version.split()[0]}", flush=True)
    rows = []
    hta_seen: list[tuple[int, float, dict]] = []
    try:
        for n, size_mb in sizes:
            folder, one = build_run(n, size_mb, args.tmp, args.workers)
            print(f"input: {n} ranks x {one / 1e6:.0f} MB of JSON ({disk_bytes(folder) / 1e6:,.0f} MB gzipped)",
                  flush=True)
            for engine in engines:
                out = os.path.join(args.tmp, f"out-{n}x{size_mb:g}-{engine}")
                os.makedirs(out, exist_ok=True)
                r = run_child([sys.executable, __file__, "--child", engine, folder, str(args.workers), out],
                              args.timeout)
                rows.append((n, one, engine, r))
                print(f"  {engine}: {_short(r)}", flush=True)
                shutil.rmtree(out, ignore_errors=True)
            if n > args.hta_max_ranks:
                rows.append((n, one, "HTA", {"error": f"not run (more than --hta-max-ranks {args.hta_max_ranks})"}))
                continue
            pred = None
            for n0, one0, r0 in hta_seen:          # linear in the bytes of JSON: HTA holds every rank at once
                if "error" not in r0:
                    f = (n * one) / (n0 * one0)
                    pred = (r0["wall"] * f, r0["tree_peak_rss"] * f, n0, one0)
            if pred and (pred[0] > HTA_TIMEOUT_S or pred[1] > HTA_MAX_BYTES):
                r = {"error": f"skipped: {pred[0]:.0f} s and {pred[1] / 2**30:.1f} GB predicted from its "
                              f"{pred[2]} x {pred[3] / 1e6:.0f} MB run (limits {HTA_TIMEOUT_S:.0f} s, "
                              f"{HTA_MAX_BYTES / 2**30:.0f} GB)"}
            else:
                r = run_child([sys.executable, __file__, "--child", "hta", folder], HTA_TIMEOUT_S, HTA_MAX_BYTES)
                hta_seen.append((n, one, r))
            rows.append((n, one, "HTA", r))
            ours = next((x for m, _, e, x in rows if m == n and e == "local" and "overlap_pct" in x), None)
            if ours and "overlap_pct" in r:
                r["max_overlap_diff_pct"] = max(abs(p - q) for p, q in zip(ours["overlap_pct"], r["overlap_pct"])) \
                    if len(ours["overlap_pct"]) == len(r["overlap_pct"]) else None
            print(f"  HTA: {_short(r)}", flush=True)
        size_row = None
        if args.sizes:
            folder, one = build_run(args.sizes, 0.0, args.tmp, args.workers)
            out = os.path.join(args.tmp, f"out-sizes-{args.sizes}")
            os.makedirs(out, exist_ok=True)
            size_row = run_child([sys.executable, __file__, "--child", "local", folder, str(args.workers), out],
                                 args.timeout)
            print(f"report sizes at {args.sizes} ranks: {_short(size_row)}", flush=True)
    finally:
        if not args.keep:
            shutil.rmtree(args.tmp, ignore_errors=True)
    print(f"\nload average at the end {os.getloadavg()[0]:.1f} (the machine is shared: wall times include waiting "
          f"for the CPU)")
    print("wall s: the whole report (imports, map, reduce, HTML + JSON written); map s: the per-rank map (a Dask\n"
          "LocalCluster's start included, in brackets); rank CPU s: CPU seconds of every rank's analysis, summed (what an\n"
          "idle machine divides by its cores); parent RSS: the report process's own peak; worker peak: the largest peak of\n"
          "a worker while it analysed a rank; growth: that peak minus the worker's RSS before the rank; x trace: growth\n"
          "/ one rank's JSON.")
    print(f"{'ranks':>5} {'MB/rank':>7} {'engine':>6} {'wall s':>7} {'map s':>12} {'rank CPU s':>10} {'parent RSS MB':>13} "
          f"{'worker peak MB':>14} {'worker growth MB':>16} {'x trace':>7} {'HTML MB':>7} {'summary MB':>10}")
    for n, one, engine, r in rows:
        if "error" in r:
            print(f"{n:>5} {one / 1e6:>7.0f} {engine:>6}   {r['error']}")
            continue
        if engine == "HTA":
            rss = max(r.get("parent_peak_rss", 0), r.get("tree_peak_rss", 0))
            diff = r.get("max_overlap_diff_pct")
            print(f"{n:>5} {one / 1e6:>7.0f} {engine:>6} {r['wall']:>7.1f} {'':>12} {'':>10} {mb(rss):>13}   all ranks in "
                  f"one process (tree peak); overlap % per rank vs ours: max diff "
                  f"{'-' if diff is None else f'{diff:.3f}'}")
            continue
        x = r["worker_growth"] / one if r.get("worker_growth") else None
        m = f"{r['map_s']:.1f}" + (f" ({r['cluster_start_s']:.1f})" if r.get("cluster_start_s") is not None else "")
        print(f"{n:>5} {one / 1e6:>7.0f} {engine:>6} {r['wall']:>7.1f} {m:>12} {r['ranks_cpu_s']:>10.1f} "
              f"{mb(r['parent_peak_rss']):>13} "
              f"{mb(r['worker_peak_rss']):>14} {mb(r['worker_growth']):>16} {'-' if x is None else f'{x:.2f}':>7} "
              f"{r['html_bytes'] / 1e6:>7.1f} {r['summary_bytes'] / 1e6:>10.1f}")
    if size_row and "error" not in size_row:
        print(f"report of {args.sizes} ranks (DLRM traces at their own size): HTML {size_row['html_bytes'] / 1e6:.1f} MB "
              f"(goal < 10), summary.json {size_row['summary_bytes'] / 1e6:.1f} MB, parent peak RSS "
              f"{mb(size_row['parent_peak_rss'])} MB")
    print("goals: big run wall < 120 s; parent RSS < 500 MB at 256 ranks and flat in N; worker growth <= 2x the "
          "rank's JSON")


if __name__ == "__main__":
    main()
