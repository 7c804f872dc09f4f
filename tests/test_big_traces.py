"""Big traces (issue 40): the decoder keeps compact typed columns (no object column, the documented bytes a row),
classify releases the raw columns it copied, codes are renumbered without sorting where they need not be, and a
trace too big for the machine's memory is warned about before it is read.  Timings and peak RSS live in
benchmarks/bench_big.py."""
from __future__ import annotations

import gzip
import json

import numpy as np
import pandas as pd
import pytest

from conftest import shared_data
from fsdpprof.analyze import model
from fsdpprof.analyze.load.run import load_run
from fsdpprof.analyze.memory.attribution import memory_analysis
from fsdpprof.analyze.trace import classify, load_trace
from fsdpprof.analyze.trace import decode as trace

REAL = ("hta-nccl-2rank-a100", "hta-16rank-a100", "tracelens-b200-8rank")
ROW_BYTES = 53          # docs/architecture.md: name 4, cat 1, tid_code 4, pid 4, ts 8, dur 8, stream/corr/ext 8 each
LAUNCH_ROW_BYTES = 24   # tid_code 4, pid 4, ts 8, correlation 8


@pytest.mark.parametrize("rel", REAL)
def test_decoded_columns_are_compact_typed_arrays(rel):
    rt = trace.decode_trace(str(shared_data("gpu-traces", rel, "rank-0.json.gz")))
    arrays = {k: v for k, v in rt.cols.items() if isinstance(v, np.ndarray)}
    n = len(arrays["ts_us"])
    assert n > 5_000
    assert all(v.dtype != object and len(v) == n for v in arrays.values()), {k: v.dtype for k, v in arrays.items()}
    assert sum(v.dtype.itemsize for v in arrays.values()) == ROW_BYTES
    # the codes point into their tables, which hold the original values
    assert int(arrays["tid_code"].max()) < len(rt.cols["tid_values"])
    assert int(arrays["pid"].max()) < len(rt.cols["pid_values"])
    assert int(arrays["cat"].max()) < len(rt.cols["cat_cats"])
    # the runtime calls that launch device work: a table of their own, only those whose correlation id a device
    # event has (most runtime calls launch nothing)
    lc = {k: v for k, v in rt.cols["launches"].items() if isinstance(v, np.ndarray)}
    assert sum(v.dtype.itemsize for v in lc.values()) == LAUNCH_ROW_BYTES
    assert len(lc["ts_us"]) > 500 and all(len(v) == len(lc["ts_us"]) for v in lc.values())
    device = np.isin(np.asarray(rt.cols["cat_cats"], dtype=object)[arrays["cat"]], list(model.DEVICE_EVENT_CATS))
    assert np.isin(lc["correlation"], arrays["correlation"][device]).all()
    assert int(lc["tid_code"].max()) < len(rt.cols["tid_values"])
    cats = np.asarray(rt.cols["cat_cats"], dtype=object)[arrays["cat"]]
    assert not np.isin(cats, ["cuda_runtime", "cuda_driver"]).any() or set(
        np.asarray(rt.cols["name_cats"], dtype=object)[arrays["name"][np.isin(cats, ["cuda_runtime", "cuda_driver"])]]
    ) <= {"cudaStreamSynchronize", "cudaDeviceSynchronize", "cudaEventSynchronize"}   # (only the syncs stay rows)
    kernels = np.isin(cats, ["kernel"])
    launched = np.isin(arrays["correlation"][kernels], lc["correlation"])
    assert launched.mean() > 0.85        # (hta-16rank-a100: 88 %, the others all)


def test_classify_releases_the_raw_columns():
    rt = trace.decode_trace(str(shared_data("gpu-traces", "hta-nccl-2rank-a100", "rank-0.json.gz")))
    n_raw = len(rt.cols["ts_us"])
    c = classify.classify_arrays(rt)
    assert rt.cols is None and rt.comm_rows is None
    assert 0 < len(c["ts_us"]) == n_raw       # (the runtime calls that launch kernels were never rows: not events)


def _compact_by_sorting(codes: np.ndarray, labels: list) -> tuple[np.ndarray, list]:
    """What _compact computes, the plain way (np.unique sorts)."""
    used, first = np.unique(codes, return_index=True)
    order = used[np.argsort(first, kind="stable")]
    remap = np.zeros(max(len(labels), 1), dtype=codes.dtype)
    remap[order] = np.arange(len(order), dtype=codes.dtype)
    return remap[codes], [labels[i] for i in order.tolist()]


@pytest.mark.parametrize("n_labels", [1, 3, 12, 64, 65, 500])
@pytest.mark.parametrize("layout", ["first-use order", "shuffled", "some unused"])
def test_compact_equals_sorting(n_labels, layout):
    rng = np.random.default_rng(n_labels)
    labels = [f"x{i}" for i in range(n_labels)]
    if layout == "first-use order":
        codes = np.concatenate([np.arange(n_labels), rng.integers(0, n_labels, 5_000)]).astype(np.int32)
    elif layout == "shuffled":
        codes = rng.permutation(np.concatenate([np.arange(n_labels), rng.integers(0, n_labels, 5_000)]))
        codes = codes.astype(np.int32)
    else:
        codes = rng.integers(0, n_labels, 5_000).astype(np.int8 if n_labels < 100 else np.int32) // 2 * 2
    got, got_labels = trace._compact(codes, labels)
    want, want_labels = _compact_by_sorting(codes, labels)
    assert got_labels == want_labels
    assert np.array_equal(got, want) and got.dtype == codes.dtype


def test_compact_of_nothing():
    codes, labels = trace._compact(np.zeros(0, dtype=np.int32), ["a"])
    assert len(codes) == 0 and labels == []


def _leaf_mask_by_sorting(tcodes, ts, end, is_cpu_op):
    """What _leaf_mask computes, the plain way: every cpu_op sorted by (thread, ts, -end) at once."""
    leaf = np.zeros(len(ts), dtype=bool)
    i = np.flatnonzero(is_cpu_op)
    order = np.lexsort((-end[i], ts[i], tcodes[i]))
    i = i[order]
    t, s, e = tcodes[i], ts[i], end[i]
    is_leaf = np.ones(i.size, dtype=bool)
    is_leaf[:-1] = (t[1:] != t[:-1]) | (s[1:] >= e[:-1]) | np.isnan(s[1:])
    leaf[i[is_leaf]] = True
    return leaf


@pytest.mark.parametrize("layout", ["in order", "out of order", "ties and NaN"])
def test_leaf_mask_equals_sorting_all_threads_at_once(layout):
    # a thread's ops in the profiler's order are not sorted again; any other order (or a NaN) is
    rng = np.random.default_rng(len(layout))
    for _ in range(200):
        n = int(rng.integers(0, 80))
        tcodes = rng.integers(0, 5, n).astype(np.int32)
        ts = rng.integers(0, 12 if layout == "ties and NaN" else 1000, n).astype(float)
        if layout == "in order":
            ts = np.sort(ts)
        end = ts + rng.integers(0, 6, n)
        if layout == "ties and NaN" and n:
            ts[rng.integers(0, n)] = np.nan
        is_cpu_op = rng.random(n) < 0.8
        assert np.array_equal(classify._leaf_mask(tcodes, ts, end, is_cpu_op),
                              _leaf_mask_by_sorting(tcodes, ts, end, is_cpu_op))


def test_memory_warning_says_what_to_do():
    line = trace.memory_warning("big.json.gz", 30 << 30, available=8 << 30)
    assert line is not None and "big.json.gz" in line and "30.0 GiB of JSON" in line and "8.0 GiB is available" in line
    assert trace.memory_warning("big.json.gz", 1 << 30, available=8 << 30) is None


def test_a_trace_too_big_for_memory_is_warned_about_before_it_is_read(tmp_path, monkeypatch, capsys):
    src = shared_data("gpu-traces", "hta-nccl-2rank-a100", "rank-0.json.gz")
    plain = gzip.decompress(src.read_bytes())
    base = load_trace(str(src), progress=False)
    assert "warning" not in capsys.readouterr().err            # (a small trace: no line)
    monkeypatch.setattr(trace, "PROGRESS_MIN_BYTES", 0)
    monkeypatch.setattr(trace, "available_memory_bytes", lambda: 1 << 20)
    for path, data in ((tmp_path / "t.json", plain), (tmp_path / "t.json.gz", src.read_bytes())):
        path.write_bytes(data)
        td = load_trace(str(path), progress=False)
        err = capsys.readouterr().err
        assert err.count("fsdpprof: warning: trace") == 1 and str(path) in err
        # the gzip trace's JSON size is estimated from its first MB: the whole of this one
        assert f"about {len(plain) / 2**30:.1f} GiB of JSON" in err
        pd.testing.assert_frame_equal(td.events, base.events)  # (a warning only: the load goes on)


def test_allocation_labels_keep_their_strings(tmp_path):
    # the allocations' label columns hold references to the few distinct labels (pandas' str dtype, Python storage):
    # the default storage copied every row's string into Arrow, whose pool kept it (+49 MiB for a 1 GB CPU run)
    def mem(ts, addr, nbytes, total):
        return {"ph": "i", "cat": "cpu_instant_event", "s": "t", "name": "[memory]", "pid": 1, "tid": 1, "ts": ts,
                "args": {"Total Reserved": 0, "Total Allocated": total, "Bytes": nbytes, "Device Id": -1,
                         "Device Type": 0, "Addr": addr}}
    ev = [{"ph": "X", "cat": "user_annotation", "name": "ProfilerStep#1", "pid": 1, "tid": 1, "ts": 0.0, "dur": 100.0},
          {"ph": "X", "cat": "user_annotation", "name": "## forward ##", "pid": 1, "tid": 1, "ts": 5.0, "dur": 40.0},
          {"ph": "X", "cat": "cpu_op", "name": "aten::mm", "pid": 1, "tid": 1, "ts": 10.0, "dur": 20.0}]
    ev += [mem(11.0 + i, 4096 * (i + 1), 1000, 1000 * (i + 1)) for i in range(20)]
    path = tmp_path / "t.json"
    path.write_text(json.dumps({"traceEvents": ev}))
    m = memory_analysis(next(iter(load_run(str(path), workers=1).ranks.values())))
    a = m.allocations
    for col in ("stage", "fsdp_phase", "unit", "free_stage", "free_fsdp_phase", "frame_sig", "fsdp_family",
                "user_metadata", "category_source"):
        assert isinstance(a[col].dtype, pd.StringDtype) and a[col].dtype.storage == "python", (col, a[col].dtype)
    assert set(a["stage"].dropna()) == {"forward"} and len(a) == 20
