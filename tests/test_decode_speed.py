"""The trace decoder stays linear in the decompressed size whatever the layout (issue 31): 8 and 32 MiB of blanks
between two events, an event name of 1 and 4 MiB of ``}``, each against the other size and against a real GPU trace,
all timed in this one run (CPU seconds, the fewest of 3 calls: ratios only, no absolute time).  The decoder before
the fix rescanned the growing buffer for every 256 KiB read: 30 and 103 ms a MiB at 8 and 32 MiB of blanks, 323 and
1,620 ms a MiB at 1 and 4 MiB of ``}``, a real trace 4.5 ms (now 1-2 ms a MiB for each of them).
benchmarks/bench_decode.py prints the MiB/s of the same cases and more."""
from __future__ import annotations

import sys
import time

import pytest

from conftest import ROOT, shared_data

sys.path.insert(0, str(ROOT / "benchmarks"))
import bench_decode  # noqa: E402

from fsdpprof.analyze.trace.decode import decode_trace  # noqa: E402

MIB = 1 << 20
GROWTH_MAX = 3.0      # per-byte time of the bigger input / the smaller one's
VS_REAL_MAX = 5.0     # per-byte time of a hostile input / a real trace's


def _cpu_s_per_mib(path, mib: float) -> float:
    best = float("inf")
    for _ in range(3):
        t0 = time.process_time()
        decode_trace(path)
        best = min(best, time.process_time() - t0)
    return best / mib


@pytest.fixture(scope="module")
def real_s_per_mib():
    path = shared_data("gpu-traces", "hta-16rank-a100", "rank-0.json.gz")
    decode_trace(path)                    # (first-call costs out of the timing)
    return _cpu_s_per_mib(path, bench_decode.gunzipped_size(path) / MIB)


@pytest.mark.parametrize("kind,small_mib,big_mib,events", [("blanks", 8, 32, 100), ("name", 1, 4, 101)])
def test_decode_time_grows_with_size(tmp_path, real_s_per_mib, kind, small_mib, big_mib, events):
    per_mib = {}
    for mib in (small_mib, big_mib):
        path = tmp_path / f"{kind}-{mib}.json.gz"
        size = bench_decode.hostile_trace(kind, mib * MIB, path)
        rt = decode_trace(path)                                    # read whole (the long name cut)
        assert len(rt.cols["ts_us"]) == events
        per_mib[mib] = _cpu_s_per_mib(path, size / MIB)
    ms = {m: round(v * 1e3, 2) for m, v in per_mib.items()}
    print(f"{kind}: ms per MiB {ms}, real trace {real_s_per_mib * 1e3:.2f}")
    assert per_mib[big_mib] <= GROWTH_MAX * per_mib[small_mib], f"{kind}: time grows faster than the size ({ms})"
    for mib, v in per_mib.items():
        assert v <= VS_REAL_MAX * real_s_per_mib, (
            f"{kind} {mib} MiB: {v * 1e3:.2f} ms a MiB, a real trace {real_s_per_mib * 1e3:.2f}")
