"""`fsdpprof overlap` (fsdpprof.analyze.pipeline.overlap_summary): the report's overlap and volume numbers.

Every input is read both ways: overlap_summary(load_run(path, lazy=True)), the pipeline's map and reduce restricted
to those two tables, against overall_overlap + collective_volume on run_events(load_run(path)), value by value
(relative tolerance 1e-9), and the same errors.
"""
from __future__ import annotations

import json
import math
import sys
from pathlib import Path
from types import SimpleNamespace

import orjson
import pandas as pd
import pytest

from conftest import ROOT, run_fsdpprof, shared_data
from fsdpprof.analyze.comm import overlap, volume
from fsdpprof.analyze.pipeline import analyze_run, overlap_summary
from fsdpprof.analyze.load.run import load_run, run_events
from fsdpprof.errors import UserError

OVERLAP_FIELDS = ("compute_us", "comm_us", "overlapped_comm_us", "exposed_comm_us", "comp_comm_overlap_pct")
VOLUME_FIELDS = ("count", "bytes", "time_us", "algbw_gbps", "busbw_gbps")
REAL_INPUTS = ("hta-nccl-2rank-a100/rank-0.json.gz", "hta-16rank-a100/rank-0.json.gz", "param-dlrm-8rank-v100",
               "tracelens-b200-8rank/rank-0.json.gz")


def overlap_of(path, **kwargs):
    return overlap_summary(load_run(path, lazy=True), **kwargs)


def _same(value, full_value) -> bool:
    """None (JSON) is NaN (frame); numbers agree to 1e-9 relative."""
    if value is None or full_value != full_value:
        return value is None and full_value != full_value
    return math.isclose(value, full_value, rel_tol=1e-9, abs_tol=1e-9)


def assert_same_as_full_path(path) -> object:
    """overlap_summary on the lazily loaded run equals overall_overlap + collective_volume on the events of the
    eagerly loaded one on every rank and collective, and says the same warnings; returns its result as
    to_dict() gives it (rows with attributes), the JSON that `fsdpprof overlap --json` prints."""
    s = overlap_of(path)
    q = s.to_dict()
    assert json.loads(json.dumps(q)) == q                    # JSON-ready
    run = load_run(path)
    ev = run_events(run)
    assert set(s.warnings) == set(run.warnings), set(s.warnings) ^ set(run.warnings)
    full_o = overlap.overall_overlap(ev).to_dict("records")
    full_v = volume.collective_volume(ev).to_dict("records")
    assert [r["rank"] for r in q["overlap"]] == [int(r["rank"]) for r in full_o]
    for qr, fr in zip(q["overlap"], full_o):
        for k in OVERLAP_FIELDS:
            assert _same(qr[k], fr[k]), (qr["rank"], k, qr[k], fr[k])
    assert [(v["rank"], v["collective"]) for v in q["volume"]] == \
        [(int(r["rank"]), r["collective"] if isinstance(r["collective"], str) else None) for r in full_v]
    for qv, fv in zip(q["volume"], full_v):
        for k in VOLUME_FIELDS:
            assert _same(qv[k], fv[k]), (qv["rank"], qv["collective"], k, qv[k], fv[k])
    return _rows(q)


def _rows(q: dict) -> SimpleNamespace:
    """A to_dict() result with its rows read as attributes (r.rank, v.bytes)."""
    return SimpleNamespace(overlap=[SimpleNamespace(**r) for r in q["overlap"]],
                           volume=[SimpleNamespace(**r) for r in q["volume"]], warnings=q["warnings"],
                           missing=q["missing"])


# ----------------------------------------------------------------------------------------- real inputs
@pytest.mark.parametrize("name", REAL_INPUTS)
def test_real_gpu_traces_give_the_full_paths_numbers(name):
    path = shared_data("gpu-traces", name)
    q = assert_same_as_full_path(str(path))
    assert q.overlap and all(r.comm_us > 0 for r in q.overlap)


def test_the_reports_own_tables():
    """The report's overall-overlap and volume tables (analyze_run) are the overlap command's, row for row."""
    run = load_run(str(shared_data("gpu-traces", "param-dlrm-8rank-v100")), lazy=True)
    a, s = analyze_run(run), overlap_summary(run)
    pd.testing.assert_frame_equal(a.overlap_overall, s.overlap)
    pd.testing.assert_frame_equal(a.volume, s.volume)
    assert s.warnings == a.warnings and s.missing == a.missing and len(s.overlap) == 8


@pytest.mark.slow
def test_recorded_gloo_run_gives_the_full_paths_numbers(recorded_run):
    q = assert_same_as_full_path(str(recorded_run("fsdp2")))
    assert [r.rank for r in q.overlap] == [0, 1]
    colls = {v.collective for v in q.volume}
    assert {"all_gather", "reduce_scatter"} <= colls and all(v.bytes and v.bytes > 0 for v in q.volume)


# ----------------------------------------------------------------------------------------- hand-built traces
def _x(name, cat, ts, dur, tid=1, pid=1, **args):
    e = {"ph": "X", "cat": cat, "name": name, "pid": pid, "tid": tid, "ts": ts, "dur": dur}
    if args:
        e["args"] = {k.replace("_", " "): v for k, v in args.items()}
    return e


def _kernel(name, stream, ts, dur, corr=None, **args):
    extra = {"correlation": corr} if corr is not None else {}
    return {"ph": "X", "cat": "kernel", "name": name, "pid": 0, "tid": stream, "ts": ts, "dur": dur,
            "args": {"stream": stream, "device": 0, **extra, **{k.replace("_", " "): v for k, v in args.items()}}}


def _launch(corr, ts, tid=1):
    return {"ph": "X", "cat": "cuda_runtime", "name": "cudaLaunchKernel", "pid": 1, "tid": tid, "ts": ts, "dur": 0.5,
            "args": {"correlation": corr}}


def _write(tmp_path, events, name="rank-0.json", **doc):
    p = tmp_path / name
    p.write_bytes(orjson.dumps({"schemaVersion": 1, **doc, "traceEvents": events}))
    return str(p)


def test_no_communication(tmp_path):
    path = _write(tmp_path, [_x("aten::mm", "cpu_op", 0, 5), _launch(1, 1), _kernel("void gemm", 7, 10, 30, corr=1),
                             _kernel("void gemm", 7, 20, 5)], distributedInfo={"rank": 0, "world_size": 1})
    q = assert_same_as_full_path(path)
    assert q.volume == [] and q.overlap[0].comm_us == 0 and q.overlap[0].comp_comm_overlap_pct is None
    assert q.overlap[0].compute_us == 30


def _gpu_edge_events():
    """Overlapping and nested compute kernels on three streams, a zero-duration kernel, a memcpy; comm kernels:
    an all_reduce without size args (type from the op around its launch, size from the op with its External id),
    a SendRecv launched inside nccl:all_to_all, one whose launch is not in the trace (type: its name), a
    zero-duration all_gather, an exact duplicate, and an event with a negative duration (left out)."""
    return [
        _x("c10d::allreduce_", "cpu_op", 3, 5, **{"External_id": 77, "Input_Dims": [[1000]], "Input_type": ["float"]}),
        _x("record_param_comms", "cpu_op", 4, 2, **{"Collective_name": "allreduce", "In_msg_nelems": 1000,
                                                    "dtype": "Float", "Group_size": 8, "External_id": 78}),
        _launch(200, 5),
        _x("nccl:all_to_all", "user_annotation", 11, 3),
        _launch(201, 12),
        _launch(202, 15),     # (after nccl:all_to_all: a kernel launched inside a collective op is its communication)
        _kernel("void gemm_a", 7, 10, 30, corr=202), _kernel("void gemm_b", 8, 20, 30), _kernel("void relu", 9, 15, 10),
        _kernel("void zero", 7, 60, 0), _kernel("Memcpy DtoD (Device -> Device)", 7, 45, 40),
        _kernel("ncclDevKernel_AllReduce_Sum_f32_RING_LL", 20, 30, 40, corr=200, External_id=77),
        _kernel("ncclDevKernel_SendRecv", 21, 80, 10, corr=201),
        _kernel("ncclDevKernel_SendRecv", 21, 80, 10, corr=201),                        # exact duplicate
        _kernel("ncclKernel_Weird(int)", 22, 95, 5, corr=999),
        _kernel("ncclDevKernel_AllGather_RING_LL", 20, 100, 0, In_msg_nelems=10, Out_msg_nelems=80, dtype="Float",
                Group_size=8),
        _kernel("ncclDevKernel_AllGather_RING_LL", 20, 110, -3, In_msg_nelems=10, dtype="Float"),  # negative dur
    ]


def test_gpu_edge_cases(tmp_path):
    path = _write(tmp_path, _gpu_edge_events(), distributedInfo={"rank": 0, "world_size": 8})
    q = assert_same_as_full_path(path)
    o = q.overlap[0]
    # compute: [10,40) u [20,50) u [15,25) = [10,50); comm: [30,70) u [80,90) u [95,100); overlap [30,50)
    assert (o.compute_us, o.comm_us, o.overlapped_comm_us) == (40, 55, 20)
    v = {x.collective: x for x in q.volume}
    assert set(v) == {"all_reduce", "all_to_all", "all_gather", "unknown collective"}   # (a raw name is no type)
    assert v["all_reduce"].bytes == 4000 and v["all_reduce"].busbw_gbps == pytest.approx(0.1 * 2 * 7 / 8)
    assert v["all_to_all"].count == 1 and v["all_to_all"].bytes is None
    assert v["all_gather"].count == 1 and v["all_gather"].bytes == 320 and v["all_gather"].algbw_gbps is None
    # what was left out is said, in the decoder's words
    assert f"trace {path}: 1 events with a negative duration were left out" in q.warnings
    assert f"trace {path}: 1 duplicated events (identical to an earlier event) were left out" in q.warnings


def test_gloo_pairing(tmp_path):
    """CPU (gloo): gloo work paired with its c10d call by order per op type (reduce_scatter runs as all_reduce),
    one all_reduce already running when the window opened (shift 1), a duplicated call left out; compute: leaf
    ops off the gloo thread."""
    f = ["float"]
    ev = [
        _x("aten::mm", "cpu_op", 0, 10),
        _x("c10d::_allgather_base_", "cpu_op", 10, 1, **{"Input_Dims": [[400], [100]], "Input_type": f + f}),
        # a duplicate (the decoder compares the External id, not the other args): left out, the call order kept
        _x("c10d::_allgather_base_", "cpu_op", 10, 1, **{"Input_Dims": [[800], [200]], "Input_type": f + f}),
        _x("c10d::_reduce_scatter_base_", "cpu_op", 30, 1, **{"Input_Dims": [[100], [400]], "Input_type": f + f}),
        _x("aten::add", "cpu_op", 33, 5),
        _x("c10d::allreduce_", "cpu_op", 50, 1, **{"Input_Dims": [[250]], "Input_type": f}),
        _x("aten::linear", "cpu_op", 60, 20), _x("aten::addmm", "cpu_op", 62, 8),
        _x("gloo:all_reduce", "user_annotation", -5, 5, tid=2, **{"Input_Dims": [[250]], "Input_type": f}),
        _x("gloo:all_gather", "user_annotation", 11, 5, tid=2, **{"Input_Dims": [[100]], "Input_type": f}),
        _x("gloo:all_reduce", "user_annotation", 31, 5, tid=2, **{"Input_Dims": [[400]], "Input_type": f}),
        _x("gloo:all_reduce", "user_annotation", 51, 5, tid=2, **{"Input_Dims": [[250]], "Input_type": f}),
        _x("aten::copy_", "cpu_op", 52, 2, tid=2),
    ]
    dist = {"backend": "gloo", "rank": 0, "world_size": 4,
            "pg_config": [{"pg_name": "0", "pg_desc": "default_pg", "pg_size": 4, "ranks": [0, 1, 2, 3]}]}
    q = assert_same_as_full_path(_write(tmp_path, ev, distributedInfo=dist))
    o = q.overlap[0]
    assert (o.compute_us, o.comm_us, o.overlapped_comm_us) == (10 + 5 + 8, 20, 3)
    v = {x.collective: x for x in q.volume}
    assert v["all_gather"].bytes == 1600 and v["reduce_scatter"].bytes == 1600
    assert v["all_reduce"].count == 2 and v["all_reduce"].bytes == 2000


def test_odd_trace(tmp_path):
    """A correlation id that is not an integer (the decoder's lenient path reads the trace): the same numbers."""
    ev = _gpu_edge_events()
    ev.append(_x("cudaLaunchKernel", "cuda_runtime", 1, 1, correlation="not a number"))
    assert_same_as_full_path(_write(tmp_path, ev, distributedInfo={"rank": 0, "world_size": 8}))


def test_the_size_limit_is_the_full_paths(tmp_path):
    """A trace beyond max_trace_bytes is refused with the report's message, in Python and by the command."""
    path = _write(tmp_path, _gpu_edge_events(), distributedInfo={"rank": 0, "world_size": 8})
    with pytest.raises(UserError, match="limit"):
        overlap_summary(load_run(path, lazy=True, max_trace_bytes=100))
    p = run_fsdpprof("overlap", path, "--max-trace-bytes", "100")
    assert p.returncode == 2 and "--max-trace-bytes" in p.stderr and p.stderr.count("\n") == 1


@pytest.mark.parametrize("seed", range(4))
def test_mutated_real_traces_give_the_full_paths_numbers_or_its_error(tmp_path, seed):
    """The fuzz campaign's mutations (benchmarks/fuzz.py: swapped, deleted, duplicated, nested, long, odd numbers,
    truncated) of a real trace: the numbers of the events' own analysis, or a UserError where loading fails."""
    _check_mutations(shared_data("gpu-traces", "param-dlrm-8rank-v100", "rank-0.json.gz"), seed, tmp_path)


@pytest.mark.parametrize("odd", ["instant time out of range", "metadata id not an int", "instant id not an int"])
def test_instants_and_metadata_the_fast_path_rejects(tmp_path, odd):
    """Instants and metadata the decoder's fast path rejects: a timestamp beyond float range (the trace is
    refused, by the report and the overlap command alike), an id that is no integer (the trace is read leniently:
    the same numbers)."""
    extra = {"instant time out of range": '{"ph": "i", "s": "t", "name": "[memory]", "pid": 1, "tid": 1, "ts": 1e400}',
             "metadata id not an int": '{"ph": "M", "name": "thread_name", "pid": 1, "tid": 1, '
                                       '"args": {"name": "main", "correlation": "x"}}',
             "instant id not an int": '{"ph": "i", "s": "t", "name": "[memory]", "pid": 1, "tid": 1, "ts": 5, '
                                      '"args": {"Addr": 1, "Bytes": 8, "stream": [7]}}'}[odd]
    good = _write(tmp_path, _gpu_edge_events(), distributedInfo={"rank": 0, "world_size": 8})
    text = Path(good).read_bytes()
    assert text.endswith(b"]}")
    path = tmp_path / "odd" / "rank-0.json"
    path.parent.mkdir()
    path.write_bytes(text[:-2] + b"," + extra.encode() + b"]}")
    if odd == "instant time out of range":
        with pytest.raises(UserError, match="out of range"):
            load_run(str(path))
        with pytest.raises(UserError, match="out of range"):
            overlap_of(str(path))
    else:
        assert_same_as_full_path(str(path))


def _check_mutations(trace, seed: int, tmp_path) -> None:
    sys.path.insert(0, str(ROOT / "benchmarks"))
    import fuzz

    doc = fuzz.load_trace_doc(trace, events=800)
    rng = __import__("random").Random(seed)
    for case in range(15):
        data, suffix, what = fuzz.mutate_trace(doc, rng)
        path = tmp_path / f"case{case}" / f"rank-0{suffix}"
        path.parent.mkdir()
        path.write_bytes(data)
        try:
            run_events(load_run(str(path)))
        except UserError:
            with pytest.raises(UserError):
                overlap_of(str(path))
            continue
        assert_same_as_full_path(str(path)), what


def test_folder_of_ranks(tmp_path):
    for r in (1, 0):
        _write(tmp_path, _gpu_edge_events()[: 12 + r], name=f"rank-{r}.json",
               distributedInfo={"rank": r, "world_size": 2})
    q = assert_same_as_full_path(str(tmp_path))
    assert [o.rank for o in q.overlap] == [0, 1]


def test_ranks_in_worker_processes_give_the_same_numbers():
    """8 rank files read in this process and in a pool of 2 worker processes: the same result; a bad number of
    workers is refused."""
    path = str(shared_data("gpu-traces", "param-dlrm-8rank-v100"))
    alone, pooled = overlap_of(path, workers=1), overlap_of(path, workers=2)
    assert alone.to_dict() == pooled.to_dict() and len(alone.overlap) == 8
    for bad in (0, -1, 1.5, True):
        with pytest.raises(UserError, match="workers"):
            overlap_of(path, workers=bad)


# ----------------------------------------------------------------------------------------- the command
def test_cli_json_is_the_python_result(tmp_path):
    path = _write(tmp_path, _gpu_edge_events(), distributedInfo={"rank": 0, "world_size": 8})
    p = run_fsdpprof("overlap", path, "--json")
    assert p.returncode == 0, p.stderr
    assert json.loads(p.stdout) == overlap_of(path).to_dict()
    text = run_fsdpprof("overlap", path)
    assert text.returncode == 0 and "all_reduce" in text.stdout and "overlap %" in text.stdout
    dlrm = str(shared_data("gpu-traces", "param-dlrm-8rank-v100"))
    one, two = (run_fsdpprof("overlap", dlrm, "--json", "--workers", w) for w in ("1", "2"))
    assert one.returncode == two.returncode == 0 and one.stdout == two.stdout and '"rank": 7' in one.stdout
    bad = run_fsdpprof("overlap", dlrm, "--workers", "0")
    assert bad.returncode == 2 and bad.stderr.count("\n") == 1 and "--workers" in bad.stderr, bad.stderr


@pytest.mark.parametrize("what", ["missing", "not json", "snapshot only"])
def test_cli_bad_input_is_one_line(tmp_path, what):
    if what == "missing":
        arg = tmp_path / "nope.json"
    elif what == "not json":
        arg = tmp_path / "rank-0.json"
        arg.write_text("this is not a trace")
    else:
        arg = tmp_path / "rank-0.pickle"
        arg.write_bytes(b"\x80\x04N.")
    p = run_fsdpprof("overlap", str(arg))
    assert p.returncode == 2 and p.stdout == ""
    assert p.stderr.startswith("fsdpprof overlap: error: ") and p.stderr.count("\n") == 1, p.stderr
    with pytest.raises(UserError):
        overlap_of(str(arg))
