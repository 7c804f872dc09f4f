"""Seeded fuzz campaign (benchmarks/fuzz.py) in the slow suite: 2,000 mutated real traces and 1,000 mutated
real CUDA snapshots through the Python API, and a share of them through the whole report path; every
failure must be fsdpprof's own one-line UserError, no case may take more than 10 s (a robustness bound,
not a speed target), no Python warning may reach stderr and no summary.json may hold an implausible
number.  `python benchmarks/fuzz.py --traces 5000 --snapshots 2000` runs a larger campaign on demand."""
from __future__ import annotations

import sys
import time

import pytest

from conftest import ROOT, shared_data

sys.path.insert(0, str(ROOT / "benchmarks"))
import fuzz  # noqa: E402

pytestmark = pytest.mark.slow

SEED = 20240817
# (the count the reliability issue asks of every run; the whole-report path takes a sample of them, below)
TRACES, SNAPSHOTS = 2000, 1000
# Every case goes through load_trace / load_snapshot (~20 ms a trace case, ~6 ms a snapshot case here);
# every FULL_EVERY-th (125 traces, 125 snapshots) also through load_run + analyze_run + summary.json + terminal text + render_report,
# which costs ~0.13 s a trace case and ~0.035 s a snapshot case on this machine (pandas analysis ~40 ms,
# plotly page ~50 ms): all cases through it would take too long for the suite.  `python benchmarks/fuzz.py`
# sends every case through it (--full-every 1, its default).
FULL_EVERY = {"trace": 16, "snapshot": 8}


SHARDS = 4     # the campaign in 4 shards, each a quarter of every kind's cases (consecutive indices: each holds its share
               # of the report-path cases), run in the test's own process: pytest-xdist spreads them over its workers
               # (one 2-process campaign held both cores for 2 minutes)


def _shard(n: int, shard: int) -> range:
    return range(shard * n // SHARDS, (shard + 1) * n // SHARDS)


@pytest.mark.parametrize("shard", range(SHARDS))
def test_fuzz_campaign(recorded_run, shard):
    trace = shared_data("gpu-traces", "param-dlrm-8rank-v100", "rank-0.json.gz")
    snapshot = shared_data("cuda-snapshots", "lm-step-user-metadata.pickle")
    # half the trace cases mutate a real CPU recording ([memory] events, gloo), trimmed to the time window of
    # its first 3,000 duration events for speed (the DLRM trace has fewer)
    cpu_trace = recorded_run("fsdp2") / "rank-0" / "trace.json.gz"
    cases = [(k, i) for k, n in (("trace", TRACES), ("snapshot", SNAPSHOTS)) for i in _shard(n, shard)]
    t0 = time.perf_counter()
    res = fuzz.run_campaign(TRACES, SNAPSHOTS, seed=SEED, workers=1, trace=trace, cpu_trace=cpu_trace,
                            snapshot=snapshot, snapshot_entries=600, trace_events=3000, full_every=FULL_EVERY,
                            only=cases)
    wall = time.perf_counter() - t0
    c = res["counts"]
    print(f"fuzz shard {shard}: {wall:.1f} s wall; max {res['max_s']:.2f} s per case ({res['slowest']}); counts {c}; "
          f"report path {res['full']}")
    want = {k: len(_shard(n, shard)) for k, n in (("trace", TRACES), ("snapshot", SNAPSHOTS))}
    assert {k: sum(c[k].values()) for k in want} == want          # (over the 4 shards: every one of the cases)
    assert res["full"] == {k: sum(1 for i in _shard(n, shard) if i % FULL_EVERY[k] == 0)
                           for k, n in (("trace", TRACES), ("snapshot", SNAPSHOTS))}
    assert res["full"]["trace"] > 0 and res["full"]["snapshot"] > 0
    shown = "\n".join(f"{f['kind']}:{f['index']} {f['outcome']} {f['mutations']}\n{f['detail'][-1500:]}"
                      for f in res["failures"][:5])
    assert res["failures"] == [], f"{len(res['failures'])} failures, e.g.:\n{shown}"
    assert res["max_s"] < 10.0
    # the mutations reach both ends: inputs read (with repairs) and inputs refused
    for kind in ("trace", "snapshot"):
        assert c[kind]["ok"] > 0.3 * sum(c[kind].values()) and c[kind]["user_error"] > 0.1 * sum(c[kind].values())
