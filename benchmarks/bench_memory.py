"""Benchmark: memory attribution speed against torch.cuda._memory_viz on the same snapshot.

    python benchmarks/bench_memory.py [--snapshot FILE] [--run RUN_DIR] [--repeat N]

Times (median and best of N, the two tools' runs interleaved so a busy machine slows both alike) on
every public snapshot, smallest first: tests/data/cuda-snapshots (licensed copies) and, where present,
../shared/data/cuda-snapshots (the ones without a licence to copy):
  ours:        safe load + allocations frame + categorisation + peak/breakdown/timeline, every device
  _memory_viz: load + segsum + trace (text) + trace_plot (the HTML it builds), i.e. what
               torch's tool does in Python with the same file (its timeline is then drawn by
               JavaScript in the browser, which is not timed)
and on a CPU run directory (load_run + memory_analysis of every rank; _memory_viz has no CPU-trace
path). Prints the times and the ratio of the medians; no assertion (speed targets live here, not in
tests).
"""
from __future__ import annotations

import argparse
import contextlib
import io
import os
import statistics
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from fsdpprof.analyze.memory import safe_pickle  # noqa: E402
from fsdpprof.analyze.memory import memory_analysis, snapshot_memory  # noqa: E402
from fsdpprof.analyze.load.run import load_run  # noqa: E402
from fsdpprof.analyze.memory.snapshot import load_snapshot  # noqa: E402

SNAP_DIRS = (ROOT / "tests" / "data" / "cuda-snapshots", ROOT.parent / "shared" / "data" / "cuda-snapshots")


def best(fn, repeat):
    """Best wall time of ``repeat`` runs (the machine may be shared; the best run is the least disturbed)."""
    times = []
    for _ in range(repeat):
        t = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t)
    return min(times)


def interleaved(fns, repeat):
    """Wall times (s) of ``repeat`` runs of each function in ``fns``, taken in turn (a, b, a, b, ...)
    after one untimed warm-up run of each, so load on a shared machine falls on all alike."""
    for fn in fns:
        fn()
    times = [[] for _ in fns]
    for _ in range(repeat):
        for fn, ts in zip(fns, times):
            t = time.perf_counter()
            fn()
            ts.append(time.perf_counter() - t)
    return times


def ours(path):
    snap = load_snapshot(path)
    for d in sorted(set(snap.allocations["device"].unique().tolist())):
        snapshot_memory(snap, device=int(d))


def memory_viz(path):
    from torch.cuda import _memory_viz as mv

    # torch's tool would pickle.load the file; we never do that on a user file, and the restricted
    # loader runs the same C unpickler, so the load costs the same
    data = safe_pickle.load(path)
    with contextlib.redirect_stdout(io.StringIO()):
        mv.segsum(data)
        mv.trace(data)
        mv.trace_plot(data)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--snapshot", help="snapshot file (default: every public one)")
    ap.add_argument("--run", help="CPU run directory (default: /tmp/fsdpprof-sample/fsdp2 when present)")
    ap.add_argument("--repeat", type=int, default=7)
    a = ap.parse_args(argv)
    found = {p.name: p for d in reversed(SNAP_DIRS) for p in d.glob("*.pickle")}    # (tests/data's copy first)
    snaps = [Path(a.snapshot)] if a.snapshot else sorted(found.values(), key=lambda p: p.stat().st_size)
    if not snaps:
        print(f"no snapshot found (looked in {', '.join(map(str, SNAP_DIRS))})")
        return 1
    for path in snaps:
        t_ours, t_viz = interleaved([lambda: ours(path), lambda: memory_viz(path)], a.repeat)
        m_ours, m_viz = statistics.median(t_ours), statistics.median(t_viz)
        print(f"snapshot {path.name} ({path.stat().st_size / 2**20:.1f} MiB): ours {m_ours * 1e3:.0f} ms "
              f"(best {min(t_ours) * 1e3:.0f}), _memory_viz {m_viz * 1e3:.0f} ms (best {min(t_viz) * 1e3:.0f}), "
              f"ratio _memory_viz/ours = {m_viz / m_ours:.2f}x (medians of {a.repeat})")
    run = a.run or ("/tmp/fsdpprof-sample/fsdp2" if os.path.isdir("/tmp/fsdpprof-sample/fsdp2") else None)
    if run:
        t_load = best(lambda: load_run(run, progress=False), a.repeat)
        r = load_run(run, progress=False)
        t_mem = best(lambda: [memory_analysis(rd) for rd in r.ranks.values()], a.repeat)
        n = sum(len(rd.memory_events) for rd in r.ranks.values())
        print(f"CPU run {run}: load_run {t_load * 1e3:.0f} ms, memory_analysis of {len(r.ranks)} ranks "
              f"({n} memory events) {t_mem * 1e3:.0f} ms")
    else:
        print("CPU run: none given (--run DIR)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
