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
from fsdpprof import cli
from fsdpprof.analyze.load import engines, memory_budget
from fsdpprof.analyze.load.memory_budget import inflated_size
from fsdpprof.analyze.load.run import load_run
from fsdpprof.analyze.memory.attribution import memory_analysis
from fsdpprof.analyze.trace import classify, load_trace
from fsdpprof.analyze.trace import decode as trace
from fsdpprof.errors import UserError

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
    line = memory_budget.memory_warning("big.json.gz", 30 << 30, available=8 << 30)
    assert line is not None and "big.json.gz" in line and "30.0 GiB of JSON" in line and "8.0 GiB is available" in line
    assert f"up to {memory_budget.need_bytes(30 << 30) / 2**30:.1f} GiB" in line
    assert memory_budget.memory_warning("big.json.gz", 1 << 30, available=8 << 30) is None


def test_the_default_trace_limit_follows_the_machines_memory(tmp_path, monkeypatch):
    mb = memory_budget
    monkeypatch.setattr(mb, "available_memory_bytes", lambda: 1 << 30)                   # a small machine
    assert mb.default_max_trace_bytes() == mb.MAX_TRACE_BYTES_FLOOR
    monkeypatch.setattr(mb, "available_memory_bytes", lambda: 24 << 30)
    big = mb.default_max_trace_bytes()
    assert big > 16 << 30 and mb.need_bytes(big) <= (24 << 30) * mb.MEMORY_SHARE + 1       # a 16 GB trace goes here
    monkeypatch.setattr(mb, "available_memory_bytes", lambda: None)                        # unknown
    assert mb.default_max_trace_bytes() == mb.MAX_TRACE_BYTES_FLOOR
    # refused beyond the default, the line says where that limit comes from and how to raise it
    src = shared_data("gpu-traces", "hta-nccl-2rank-a100", "rank-0.json.gz")
    monkeypatch.setattr(mb, "MAX_TRACE_BYTES_FLOOR", 1 << 20)
    monkeypatch.setattr(mb, "available_memory_bytes", lambda: 1 << 20)
    with pytest.raises(UserError, match="the limit this machine's available memory sets.*--max-trace-bytes"):
        load_trace(str(src), progress=False)
    assert len(load_trace(str(src), progress=False, max_bytes=1 << 30).events)


def test_ranks_at_once_takes_the_biggest_traces_together():
    mb = memory_budget
    sizes = [1 << 30, 4 << 30, 2 << 30, 1 << 30]
    both = mb.need_bytes(4 << 30) + mb.need_bytes(2 << 30)
    assert mb.ranks_at_once(sizes, both) == 2
    assert mb.ranks_at_once(sizes, both - 1) == 1
    assert mb.ranks_at_once(sizes, 1 << 20) == 1                    # never none
    assert mb.ranks_at_once(sizes, 1 << 40) == 4
    assert mb.budget_bytes(3 << 30) == 3 << 30                      # --max-memory as given
    assert mb.budget_bytes(None, available=10 << 30) == int((10 << 30) * mb.MEMORY_SHARE)


def test_the_local_pool_runs_only_the_ranks_memory_holds(monkeypatch, capsys):
    folder = shared_data("gpu-traces", "param-dlrm-8rank-v100")
    sizes = [inflated_size(str(p)) for p in sorted(folder.glob("rank-*.json.gz"))]
    alone = load_run(str(folder), workers=1)
    need = memory_budget.need_bytes(max(sizes))
    monkeypatch.setattr(memory_budget, "available_memory_bytes", lambda: int(2.5 * need / memory_budget.MEMORY_SHARE))
    monkeypatch.setattr(engines, "usable_cores", lambda: 8)   # (cores do not set the number here)
    assert engines.local_workers(4, sizes) == 2
    err = capsys.readouterr().err
    assert "analysing 2 ranks at a time, not 4" in err and err.count("\n") == 1
    assert engines.local_workers(None, sizes) == 1          # small traces: this process, nothing said
    assert capsys.readouterr().err == ""
    two = load_run(str(folder), workers=4)
    assert "analysing 2 ranks at a time, not 4" in capsys.readouterr().err
    assert sorted(two.ranks) == sorted(alone.ranks) == list(range(8))
    for r in alone.ranks:
        pd.testing.assert_frame_equal(two.ranks[r].events, alone.ranks[r].events)
    # --max-memory sets the budget whatever the machine has
    monkeypatch.setattr(memory_budget, "available_memory_bytes", lambda: 1 << 40)
    assert engines.local_workers(4, sizes) == 4
    assert engines.local_workers(4, sizes, max_memory=3 * need) == 3
    err = capsys.readouterr().err
    assert "analysing 3 ranks at a time, not 4" in err and err.rstrip().endswith("(--max-memory)")
    three = load_run(str(folder), workers=4, max_memory=3 * need)
    assert "analysing 3 ranks at a time, not 4" in capsys.readouterr().err
    assert all(three.ranks[r].events.equals(alone.ranks[r].events) for r in alone.ranks)


def test_a_gzip_traces_json_size_is_lifted_past_its_trailers_modulus(tmp_path, monkeypatch):
    # a gzip trailer holds its last member's size modulo 4 GiB: a 16 GB trace's said 1.6 GB, and the memory plan
    # trusted it.  Here two members (a concatenated gzip), the first of exactly 4 MiB, with 4 MiB as the modulus
    raw = gzip.decompress(shared_data("gpu-traces", "hta-nccl-2rank-a100", "rank-0.json.gz").read_bytes())
    path = tmp_path / "t.json.gz"
    path.write_bytes(gzip.compress(raw))
    assert inflated_size(str(path)) == len(raw)
    path.write_bytes(gzip.compress(raw[:4 << 20]) + gzip.compress(raw[4 << 20:]))
    assert inflated_size(str(path)) == len(raw) - (4 << 20)            # (small: the trailer as it is)
    monkeypatch.setattr(memory_budget, "GZ_LIFT_MIN_BYTES", 0)
    monkeypatch.setattr(memory_budget, "GZ_ISIZE_MOD", 4 << 20)
    assert inflated_size(str(path)) == len(raw)                        # lifted by what the first MB predicts


@pytest.mark.parametrize("layout", ["v2 container", "v2 nested", "v1 nested", "v1 unlimited", "none"])
def test_available_memory_is_what_the_cgroup_leaves(tmp_path, monkeypatch, layout):
    # in a container or a scheduler's job, /proc/meminfo is the host's: the cgroup's limit less its usage is
    # what a load can have (else a trace the host could hold passed the default limit and was killed)
    meminfo = tmp_path / "meminfo"
    meminfo.write_text("MemTotal:       65536000 kB\nMemFree:  100 kB\nMemAvailable:   32768000 kB\n")
    root = tmp_path / "cgroup"
    proc = tmp_path / "self-cgroup"
    host = 32768000 * 1024
    want = host
    if layout.startswith("v2"):
        path = "/" if layout == "v2 container" else "/job/step"
        proc.write_text(f"0::{path}\n")
        (root / "job" / "step").mkdir(parents=True)
        (root / "memory.max").write_text("4294967296\n" if layout == "v2 container" else "max\n")
        (root / "memory.current").write_text("1073741824\n")
        if layout == "v2 nested":          # the tighter of two levels
            (root / "job" / "memory.max").write_text(f"{8 << 30}\n")
            (root / "job" / "memory.current").write_text(f"{1 << 30}\n")
            (root / "job" / "step" / "memory.max").write_text(f"{16 << 30}\n")
            (root / "job" / "step" / "memory.current").write_text(f"{2 << 30}\n")
            want = 7 << 30
        else:
            want = 3 << 30
    elif layout.startswith("v1"):
        proc.write_text("5:devices:/\n4:memory:/docker/abc\n0::/\n")
        mem = root / "memory" / "docker" / "abc"
        mem.mkdir(parents=True)
        limit = "9223372036854771712" if layout == "v1 unlimited" else str(6 << 30)
        (mem / "memory.limit_in_bytes").write_text(limit + "\n")
        (mem / "memory.usage_in_bytes").write_text(f"{1 << 30}\n")
        want = host if layout == "v1 unlimited" else 5 << 30
    monkeypatch.setattr(memory_budget, "MEMINFO", str(meminfo))
    monkeypatch.setattr(memory_budget, "PROC_CGROUP", str(proc))        # ("none": no such file)
    monkeypatch.setattr(memory_budget, "CGROUP_ROOT", str(root))
    assert memory_budget.available_memory_bytes() == want


@pytest.mark.parametrize("command", ["overlap", "report"])
def test_max_memory_reaches_the_pool_from_the_command_line(tmp_path, monkeypatch, capsys, command):
    folder = shared_data("gpu-traces", "param-dlrm-8rank-v100")
    need = memory_budget.need_bytes(max(inflated_size(str(p)) for p in folder.glob("rank-*.json.gz")))
    monkeypatch.setattr(engines, "usable_cores", lambda: 8)
    monkeypatch.setattr(memory_budget, "available_memory_bytes", lambda: 1 << 40)
    argv = [command, str(folder), "--workers", "4", "--max-memory", str(3 * need)]
    argv += ["--json"] if command == "overlap" else ["-o", str(tmp_path / "r.html")]
    assert cli.main(argv) in (0, None)
    err = capsys.readouterr().err
    assert "analysing 3 ranks at a time, not 4" in err and "(--max-memory)" in err
