"""Trace decoding and load_run: chunked decoding equals a whole-document parse, bad input gives one-line
UserErrors naming the file, one bad rank does not hide the others."""
from __future__ import annotations

import gzip
import json
import shutil

import msgspec
import numpy as np
import orjson
import pandas as pd
import pytest

from conftest import shared_data
from fsdpprof.analyze import model
from fsdpprof.analyze.trace import decode as trace
from fsdpprof.analyze.trace import load as loader
from fsdpprof.analyze.load.run import load_run, run_events
from fsdpprof.analyze.trace import decode_trace, load_trace
from fsdpprof.errors import UserError


def _doc(rank=0, world=2, steps=True, dist=True, extra=()):
    ev = []
    if steps:
        ev.append({"ph": "X", "cat": "user_annotation", "name": "ProfilerStep#3", "pid": 1, "tid": 1, "ts": 0.0, "dur": 100.0})
    ev += [
        {"ph": "X", "cat": "cpu_op", "name": "aten::mm", "pid": 1, "tid": 1, "ts": 10.0, "dur": 20.0, "args": {"External id": 5}},
        {"ph": "X", "cat": "cpu_op", "name": "aten::add", "pid": 1, "tid": 1, "ts": 40.0, "dur": 5.0},
        {"ph": "i", "cat": "cpu_instant_event", "s": "t", "name": "[memory]", "pid": 1, "tid": 1, "ts": 11.0,
         "args": {"Total Reserved": 0, "Total Allocated": 400, "Bytes": 400, "Device Id": -1, "Device Type": 0, "Addr": 1234}},
        *extra,
    ]
    doc = {"schemaVersion": 1, "traceEvents": ev}
    if dist:
        doc["distributedInfo"] = {"backend": "gloo", "rank": rank, "world_size": world}
    return doc


def _write(path, doc, gz=True):
    data = orjson.dumps(doc)
    path.write_bytes(gzip.compress(data) if gz else data)
    return path


def _same_frames(a: pd.DataFrame, b: pd.DataFrame):
    assert len(a) == len(b)
    for c in a.columns:
        x, y = a[c].astype(object).to_numpy(), b[c].astype(object).to_numpy()
        assert ((x == y) | (pd.isna(x) & pd.isna(y))).all(), c


@pytest.mark.parametrize("rel", ["hta-nccl-2rank-a100/rank-0.json.gz", "tracelens-b200-8rank/rank-0.json.gz",
                                 "param-dlrm-8rank-v100/rank-3.json.gz"])     # (the last: 1 MB)
def test_chunked_decode_equals_whole_parse(rel, tmp_path, monkeypatch):
    src = shared_data("gpu-traces", rel)
    sliced = load_trace(str(src))                       # the default: slices of CHUNK_BYTES
    monkeypatch.setattr(trace, "CHUNK_BYTES", 1 << 40)   # one piece
    whole = load_trace(str(src))
    _same_frames(whole.events, sliced.events)
    raw = gzip.decompress(src.read_bytes())
    doc = orjson.loads(raw)
    # reference counts from a generic parse (of the runtime calls, only the host's synchronisations stay)
    ref = sum(1 for e in doc["traceEvents"] if e.get("ph") == "X" and e.get("cat") in trace.KEEP_CATS
              and (e.get("cat") not in ("cuda_runtime", "cuda_driver") or e.get("name") in model.SYNC_CALLS))
    assert len(whole.events) == ref
    n_mem = sum(1 for e in doc["traceEvents"] if e.get("name") == "[memory]")
    assert len(whole.memory_events) == n_mem
    # small chunks and reads, on the original layout and on a compact one-line re-serialisation
    monkeypatch.setattr(trace, "CHUNK_BYTES", 50_000)
    monkeypatch.setattr(trace, "READ_BYTES", 7_777)
    plain = tmp_path / "plain.json"
    plain.write_bytes(raw)
    compact = _write(tmp_path / "compact.json.gz", doc)
    for p in (plain, compact):
        small = load_trace(str(p))
        _same_frames(whole.events, small.events)
        assert small.meta.get("distributedInfo") == doc.get("distributedInfo")


def test_separator_inside_strings_is_not_a_boundary(tmp_path, monkeypatch):
    tricky = [{"ph": "X", "cat": "cpu_op", "name": 'weird"},{"name', "pid": 1, "tid": 1, "ts": 50.0 + i, "dur": 0.5,
               "args": {"Input Dims": [[1, 2]], "s": "}, {"}} for i in range(400)]
    doc = _doc(extra=tricky)
    monkeypatch.setattr(trace, "CHUNK_BYTES", 2_000)
    monkeypatch.setattr(trace, "READ_BYTES", 999)
    td = load_trace(str(_write(tmp_path / "t.json", doc, gz=False)))
    assert (td.events["name"].astype(str) == 'weird"},{"name').sum() == 400
    assert list(td.events.columns) == model.EVENT_COLUMNS
    assert list(td.memory_events.columns) == model.MEMORY_EVENT_COLUMNS
    assert td.memory_events["bytes"].tolist() == [400] and td.memory_events["addr"].tolist() == [1234]


@pytest.mark.parametrize("where", [0.05, 0.5, 0.995])
@pytest.mark.parametrize("fault", ["syntax", "layout"])
def test_bad_event_named_at_its_place_in_the_document_and_found_once(fault, where, tmp_path, monkeypatch):
    """A malformed byte, or an event that fits no layout (a number beyond float range), in a trace read in
    slices: the message names its byte / its event in the whole document (not in the slice that held it), as
    a whole-document parse does, and decoding stops there: no slice is decoded again at earlier boundaries
    (up to 17 decodes for every slice read to the end of the file, before)."""
    tricky = [{"ph": "X", "cat": "cpu_op", "name": 'weird"},{"name', "pid": 1, "tid": 1, "ts": 50.0 + i, "dur": 0.5,
               "args": {"s": "}, {"}} for i in range(400)]
    doc = _doc(extra=tricky)
    good = orjson.dumps(doc)
    i = good.index(b'"ts"', int(len(good) * where))
    if fault == "syntax":
        bad = good[:i] + b'"ts"::' + good[i + 5:]
        said = f"JSON is malformed: invalid character (byte {i + 5})"     # (the second ':')
        want = f"is not valid JSON ({said})"
    else:
        value_end = good.index(b",", i)              # (the event's "ts" value: up to the next ',')
        bad = good[:i] + b'"ts":1e999' + good[value_end:]
        k = good[:i].count(b'"ph"') - 1             # the event that holds it (each event has one "ph")
        said = f"Number out of range - at `$.traceEvents[{k}].ts`"
        want = f"does not have the chrome-trace event layout ({said})"
    assert _whole_error(bad) == said                 # what a whole-document parse says
    monkeypatch.setattr(trace, "CHUNK_BYTES", 2_000)
    monkeypatch.setattr(trace, "READ_BYTES", 999)
    calls = []
    real = trace._decode_events
    monkeypatch.setattr(trace, "_decode_events", lambda buf, cols: (calls.append(len(buf)), real(buf, cols))[1])
    (tmp_path / "good.json").write_bytes(good)
    load_trace(str(tmp_path / "good.json"))
    whole_file = len(calls)                              # slices of the good trace (and retries at '},{' in strings)
    assert whole_file > 20
    for name, data in (("bad.json", bad), ("bad.json.gz", gzip.compress(bad))):
        calls.clear()
        (tmp_path / name).write_bytes(data)
        msg = _err(tmp_path / name)
        assert want in msg, msg
        assert len(calls) <= whole_file * where + 3, (len(calls), whole_file)


def _whole_error(data: bytes) -> str:
    """msgspec's error on the whole document, decoded at once in the lenient layout."""
    try:
        trace._TAIL_DEC.decode(data)
    except msgspec.DecodeError as exc:
        return str(exc)
    raise AssertionError("decodes")


def _err(path) -> str:
    with pytest.raises(UserError) as ei:
        load_trace(str(path))
    msg = str(ei.value)
    assert "\n" not in msg and str(path) in msg
    return msg


def test_bad_files_give_one_line_errors(tmp_path):
    good = orjson.dumps(_doc())
    (tmp_path / "notgz.json.gz").write_bytes(b"\x1f\x8bthis is not gzip data at all")
    assert "gzip" in _err(tmp_path / "notgz.json.gz")
    (tmp_path / "trunc.json.gz").write_bytes(gzip.compress(good)[:-30])
    assert "truncated" in _err(tmp_path / "trunc.json.gz")
    (tmp_path / "invalid.json").write_bytes(good[:-40] + b"}, {oops]")
    assert "JSON" in _err(tmp_path / "invalid.json")
    (tmp_path / "cut.json").write_bytes(good[: len(good) // 2])
    assert "truncated" in _err(tmp_path / "cut.json") or "JSON" in _err(tmp_path / "cut.json")
    (tmp_path / "noevents.json").write_bytes(b'{"schemaVersion": 1, "deviceProperties": []}')
    assert "traceEvents" in _err(tmp_path / "noevents.json")
    (tmp_path / "zero.json").write_bytes(b'{"schemaVersion": 1, "traceEvents": []}')
    assert "no events" in _err(tmp_path / "zero.json")
    (tmp_path / "old.json").write_bytes(orjson.dumps(_doc()["traceEvents"]))
    assert "old list format" in _err(tmp_path / "old.json")
    (tmp_path / "empty.json").write_bytes(b"")
    assert "empty" in _err(tmp_path / "empty.json")
    (tmp_path / "badtype.json").write_bytes(b'{"traceEvents": [1, 2, 3]}')
    assert "layout" in _err(tmp_path / "badtype.json")
    # args that are not an object are ignored, not fatal
    (tmp_path / "oddargs.json").write_bytes(b'{"traceEvents": [{"ph": "X", "cat": "kernel", "name": "k", "ts": 1, '
                                            b'"dur": 1, "args": 5}, {"ph": "X", "cat": "cpu_op", "name": "c10d::x", '
                                            b'"ts": 1, "dur": 1, "args": [1]}]}')
    assert len(load_trace(str(tmp_path / "oddargs.json")).events) == 2


def test_no_distributed_info_and_no_profiler_step_warn(tmp_path):
    d = tmp_path / "traces"
    d.mkdir()
    _write(d / "worker3_trace.json.gz", _doc(dist=False, steps=False))
    run = load_run(d, workers=1)
    assert list(run.ranks) == [3]
    assert any("distributedInfo" in w and "rank 3" in w for w in run.warnings)
    assert any("ProfilerStep" in w for w in run.warnings)
    ev = run.ranks[3].events
    assert (ev["step"] == 0).all() and (ev["rank"] == 3).all()
    assert (run.ranks[3].memory_events["rank"] == 3).all()


def test_folder_mixing_runs_and_duplicate_ranks(tmp_path):
    mixed = tmp_path / "mixed"
    mixed.mkdir()
    _write(mixed / "rank-0.json.gz", _doc(rank=0, world=2))
    _write(mixed / "rank-1.json.gz", _doc(rank=1, world=4))
    with pytest.raises(UserError, match="different runs"):
        load_run(mixed, workers=1)
    dup = tmp_path / "dup"
    dup.mkdir()
    _write(dup / "a.pt.trace.json.gz", _doc(rank=1))
    _write(dup / "b.pt.trace.json.gz", _doc(rank=1))
    with pytest.raises(UserError, match="two traces for rank 1"):
        load_run(dup, workers=1)


def test_one_bad_rank_does_not_hide_others(tmp_path):
    src = shared_data("gpu-traces", "param-dlrm-8rank-v100")
    d = tmp_path / "dlrm"
    shutil.copytree(src, d)
    (d / "rank-5.json.gz").write_bytes(gzip.compress(b'{"traceEvents": [{"ph": "X", '))
    run = load_run(d, workers=2)
    assert sorted(run.ranks) == [0, 1, 2, 3, 4, 6, 7]
    assert list(run.missing) == ["rank-5.json.gz"] and "rank-5.json.gz" in run.missing["rank-5.json.gz"]
    assert run.world_size == 8 and run.source == "trace_folder"
    ev = run_events(run)
    assert sorted(ev["rank"].unique()) == [0, 1, 2, 3, 4, 6, 7]
    # every rank alone gives the same events as in the parallel load
    alone = load_trace(str(d / "rank-2.json.gz"))
    _same_frames(alone.events, run.ranks[2].events)


def test_a_pool_broken_while_submitting_costs_only_its_ranks(monkeypatch):
    """The parse pool (fsdpprof.analyze.load.engines') breaks while ranks are still being submitted (a worker killed
    for memory): the ranks done before load, those lost run again alone in a fresh process and, where that
    breaks too, are missing with a one-line reason; nothing raises, nothing hangs."""
    from concurrent.futures import ProcessPoolExecutor
    from concurrent.futures.process import BrokenProcessPool

    class BreaksOnFifthSubmit(ProcessPoolExecutor):
        submits = 0

        def submit(self, fn, /, *args, **kwargs):
            type(self).submits += 1
            if type(self).submits >= 5:
                raise BrokenProcessPool("a child process terminated abruptly")
            return super().submit(fn, *args, **kwargs)

    monkeypatch.setattr("concurrent.futures.ProcessPoolExecutor", BreaksOnFifthSubmit)
    run = load_run(shared_data("gpu-traces", "param-dlrm-8rank-v100"), workers=2)
    assert len(run.ranks) + len(run.missing) == 8 and run.ranks and run.missing, (run.ranks, run.missing)
    assert all(rd.events is not None and len(rd.events) for rd in run.ranks.values())
    assert all("worker process died twice" in why and "--workers 1" in why and "\n" not in why
               for why in run.missing.values()), run.missing


def test_nothing_usable(tmp_path):
    (tmp_path / "notes.txt").write_text("hello")
    with pytest.raises(UserError, match="no run directory"):
        load_run(tmp_path)
    with pytest.raises(UserError, match="does not exist"):
        load_run(tmp_path / "nope")
    bad = tmp_path / "only"
    bad.mkdir()
    (bad / "rank-0.json.gz").write_bytes(b"garbage")
    with pytest.raises(UserError, match="rank-0.json.gz"):
        load_run(bad)


def test_sources(tmp_path):
    snap = shared_data("cuda-snapshots", "lm-step-user-metadata.pickle")
    r = load_run(snap)
    assert r.source == "snapshot_file" and r.ranks[0].snapshot_path == str(snap) and r.ranks[0].events is None
    d = tmp_path / "snaps"
    d.mkdir()
    for k in (0, 1):
        shutil.copy(snap, d / f"rank{k}_memory_snapshot.pickle")
    r = load_run(d)
    assert r.source == "snapshot_folder" and sorted(r.ranks) == [0, 1]
    t = shared_data("gpu-traces", "hta-nccl-2rank-a100", "rank-0.json.gz")
    r = load_run(t)
    assert r.source == "trace_file" and r.world_size == 2 and r.ranks[0].trace_meta["device_type"] == "cuda"
    assert r.ranks[0].info["backend"] == "nccl"
    ev = run_events(r)
    assert list(ev.columns) == model.EVENT_COLUMNS
    assert set(ev["kind"].astype(str)) <= set(model.KINDS)
    assert set(ev["collective"].dropna().astype(str)) <= set(model.COLLECTIVES)


def test_gpu_classification_and_sizes():
    ev = load_trace(str(shared_data("gpu-traces", "hta-nccl-2rank-a100", "rank-0.json.gz"))).events
    comm = ev[ev["kind"] == "comm"]
    assert len(comm) == 21 and comm["lane"].astype(str).str.startswith("stream:").all()
    assert comm["collective"].astype(str).value_counts().to_dict() == {"all_reduce": 15, "broadcast": 6}
    # all_reduce float32 sizes: 4 bytes * In msg nelems, from the kernel args
    doc = orjson.loads(gzip.decompress(shared_data("gpu-traces", "hta-nccl-2rank-a100", "rank-0.json.gz").read_bytes()))
    k = [e for e in doc["traceEvents"] if e.get("cat") == "kernel" and "AllReduce" in e["name"]]
    want = sorted(4.0 * e["args"]["In msg nelems"] for e in k)
    got = sorted(comm.loc[comm["collective"] == "all_reduce", "bytes"])
    assert got == want
    assert (comm["group_size"] == 2).all() and (comm["pg"].astype(str) == "0").all()
    # memcpy/memset are neither compute nor comm
    names = ev["name"].astype(str)
    assert (ev.loc[names.str.startswith("Memcpy"), "kind"] == "memcpy").all()
    assert (ev.loc[names.str.startswith("Memset"), "kind"] == "memset").all()
    # new-style ncclDevKernel names, sizes from the kernel: all_gather S = the whole output
    b = load_trace(str(shared_data("gpu-traces", "tracelens-b200-8rank", "rank-0.json.gz"))).events
    c = b[b["kind"] == "comm"]
    nccl = c[c["name"].astype(str).str.startswith("nccl")]
    assert nccl["collective"].astype(str).tolist() == ["all_gather"]
    assert nccl["bytes"].tolist() == [201088 * 2] and nccl["dtype"].astype(str).tolist() == ["bfloat16"]
    # the others: symmetric-memory all-reduces (launched by symm_mem::multimem_all_reduce_), sized by that op
    other = c[~c.index.isin(nccl.index)]
    assert len(other) == 73 and other["name"].astype(str).str.contains("multimem_all_reduce_kernel").all()
    assert set(other["collective"].astype(str)) == {"all_reduce"} and set(other["dtype"].astype(str)) == {"bfloat16"}
    assert (other["bytes"] > 0).all() and (other["bytes"] % 2 == 0).all()


def test_collective_names():
    from fsdpprof.analyze.model import collective_of
    cases = {
        "ncclKernel_AllReduce_RING_LL_Sum_float(ncclDevComm*, unsigned long, ncclWork*)": "all_reduce",
        "ncclDevKernel_AllGather_RING_LL(ncclDevKernelArgsStorage<4096ul>)": "all_gather",
        "ncclDevKernel_ReduceScatter_Sum_bf16_RING_LL": "reduce_scatter",
        "ncclKernel_SendRecv_RING_SIMPLE_Sum_int8_t": "send_recv",
        "ncclDevKernel_Generic": None,
        "nccl:_all_gather_base": "all_gather", "nccl:_reduce_scatter_base": "reduce_scatter",
        "nccl:all_to_all": "all_to_all", "nccl:broadcast": "broadcast",
        "gloo:all_reduce": "all_reduce", "c10d::_reduce_scatter_base_": "reduce_scatter",
        "c10d::allgather_into_tensor_coalesced_": "all_gather", "c10d::alltoall_base_": "all_to_all",
        "c10d::barrier": "barrier", "_allgather_base": "all_gather", "allreduce": "all_reduce",
        "aten::mm": None,
    }
    for name, want in cases.items():
        assert collective_of(name) == want, name


def test_rccl_generic_kernel_uses_args(tmp_path):
    ev = [
        {"ph": "X", "cat": "user_annotation", "name": "ProfilerStep#1", "pid": 1, "tid": 1, "ts": 0.0, "dur": 100.0},
        {"ph": "X", "cat": "cuda_runtime", "name": "hipLaunchKernel", "pid": 1, "tid": 1, "ts": 5.0, "dur": 1.0,
         "args": {"correlation": 7}},
        {"ph": "X", "cat": "kernel", "name": "ncclDevKernel_Generic(ncclDevKernelArgsStorage<4096ul>)", "pid": 0, "tid": 3,
         "ts": 10.0, "dur": 10.0, "args": {"stream": 3, "correlation": 7, "Collective name": "reduce_scatter_tensor_coalesced",
                                           "In msg nelems": 1000, "Out msg nelems": 250, "Group size": 4, "dtype": "BFloat16",
                                           "Process Group Name": "1", "Seq": 12}},
    ]
    td = load_trace(str(_write(tmp_path / "r.json", {"traceEvents": ev, "distributedInfo": {"rank": 0, "world_size": 4}})))
    c = td.events[td.events["kind"] == "comm"].iloc[0]
    assert c["collective"] == "reduce_scatter" and c["bytes"] == 2000 and c["group_size"] == 4
    assert c["pg"] == "1" and c["seq"] == 12 and c["step"] == 1 and c["lane"] == "stream:3"


def _gloo_doc(drop_first_call: bool):
    """Main thread issues 3 c10d all-gathers; gloo threads run them; optionally the first call happened
    before the window (only its work is in the trace)."""
    ev = [{"ph": "X", "cat": "user_annotation", "name": "ProfilerStep#1", "pid": 1, "tid": 1, "ts": 0.0, "dur": 1000.0}]
    for k in range(3):
        if not (drop_first_call and k == 0):
            ev.append({"ph": "X", "cat": "user_annotation", "name": f"FSDP::all_gather (layers.{k})", "pid": 1, "tid": 1,
                       "ts": 100.0 * k + 1, "dur": 10.0})
            ev.append({"ph": "X", "cat": "cpu_op", "name": "c10d::_allgather_base_", "pid": 1, "tid": 1,
                       "ts": 100.0 * k + 2, "dur": 5.0,
                       "args": {"Input Dims": [[8 * (k + 1)], [4 * (k + 1)], [], [], []],
                                "Input type": ["float", "float", "", "Scalar", "Scalar"]}})
        ev.append({"ph": "X", "cat": "user_annotation", "name": "gloo:all_gather", "pid": 1, "tid": 7 + k % 2,
                   "ts": 100.0 * k + 3, "dur": 50.0,
                   "args": {"Input Dims": [[4 * (k + 1)]], "Input type": ["float"]}})
        ev.append({"ph": "X", "cat": "cpu_op", "name": "aten::mm", "pid": 1, "tid": 1, "ts": 100.0 * k + 20, "dur": 10.0})
    return {"traceEvents": ev, "distributedInfo": {"backend": "gloo", "rank": 0, "world_size": 2,
                                                   "pg_config": [{"pg_name": "0", "pg_size": 2, "ranks": [0, 1]}]}}


@pytest.mark.parametrize("drop_first_call", [False, True])
def test_gloo_pairing(tmp_path, drop_first_call):
    ev = load_trace(str(_write(tmp_path / "g.json", _gloo_doc(drop_first_call)))).events
    comm = ev[ev["kind"] == "comm"].sort_values("ts_us")
    assert len(comm) == 3 and (comm["collective"] == "all_gather").all()
    assert comm["lane"].astype(str).tolist() == ["thread:7", "thread:8", "thread:7"]
    # whole gathered array: from the c10d call (output dims), or shard * group size from the work itself
    assert comm["bytes"].tolist() == [32.0, 64.0, 96.0]
    units = comm["unit"].astype(object).tolist()
    assert units[1:] == ["layers.1", "layers.2"]
    assert pd.isna(units[0]) if drop_first_call else units[0] == "layers.0"
    comp = ev[ev["kind"] == "compute"]
    assert comp["name"].astype(str).tolist() == ["aten::mm"] * 3          # c10d calls are not compute
    from fsdpprof.analyze.comm import overlap
    o = overlap.overall_overlap(ev).iloc[0]
    assert o["comm_us"] == 150 and o["overlapped_comm_us"] == 30


def test_progress_bar_does_not_change_results(tmp_path, capsys):
    p = shared_data("gpu-traces", "param-dlrm-8rank-v100", "rank-0.json.gz")
    a = load_trace(str(p), progress=True)
    b = load_trace(str(p), progress=False)
    _same_frames(a.events, b.events)


def test_gloo_group_sizes_hsdp_and_list_allgather(tmp_path):
    """HSDP-like rank 0 of 4: shard-group threads run all-gathers (size from the shapes: 2), replicate-group
    threads run all-reduces (no shapes tell the group): the one non-default size left, 2, not the world's 4.
    FSDP1-style c10d::allgather_ (list output, no dtype) takes the whole array from the work's shard."""
    ev = [{"ph": "X", "cat": "user_annotation", "name": "ProfilerStep#1", "pid": 1, "tid": 1, "ts": 0.0, "dur": 1000.0},
          {"ph": "X", "cat": "cpu_op", "name": "c10d::_allgather_base_", "pid": 1, "tid": 1, "ts": 10.0, "dur": 5.0,
           "args": {"Input Dims": [[200], [100], [], [], []], "Input type": ["float", "float", "", "Scalar", "Scalar"]}},
          {"ph": "X", "cat": "user_annotation", "name": "gloo:all_gather", "pid": 1, "tid": 50, "ts": 12.0, "dur": 20.0,
           "args": {"Input Dims": [[100]], "Input type": ["float"]}},
          {"ph": "X", "cat": "cpu_op", "name": "c10d::allreduce_", "pid": 1, "tid": 1, "ts": 100.0, "dur": 5.0,
           "args": {"Input Dims": [[[50]], [], [], [], [], []], "Input type": ["TensorList", "", "", "", "Scalar", "Scalar"]}},
          {"ph": "X", "cat": "user_annotation", "name": "gloo:all_reduce", "pid": 1, "tid": 60, "ts": 102.0, "dur": 20.0,
           "args": {"Input Dims": [[50]], "Input type": ["float"]}},
          {"ph": "X", "cat": "cpu_op", "name": "c10d::allgather_", "pid": 1, "tid": 1, "ts": 200.0, "dur": 5.0,
           "args": {"Input Dims": [[], [[30]], [], [], []], "Input type": ["", "TensorList", "", "Scalar", "Scalar"]}},
          {"ph": "X", "cat": "user_annotation", "name": "gloo:all_gather", "pid": 1, "tid": 50, "ts": 202.0, "dur": 20.0,
           "args": {"Input Dims": [[30]], "Input type": ["float"]}}]
    cfg = [{"pg_name": "0", "pg_desc": "default_pg", "pg_size": 4, "ranks": [0, 1, 2, 3]},
           {"pg_name": "1", "pg_desc": "mesh_replicate", "pg_size": 2, "ranks": [0, 2]},
           {"pg_name": "3", "pg_desc": "mesh_shard", "pg_size": 2, "ranks": [0, 1]}]
    doc = {"traceEvents": ev, "distributedInfo": {"backend": "gloo", "rank": 0, "world_size": 4, "pg_config": cfg}}
    out = load_trace(str(_write(tmp_path / "hsdp.json", doc))).events
    comm = out[out["kind"] == "comm"].sort_values("ts_us")
    assert comm["collective"].astype(str).tolist() == ["all_gather", "all_reduce", "all_gather"]
    assert comm["group_size"].tolist() == [2.0, 2.0, 2.0]
    assert comm["bytes"].tolist() == [800.0, 200.0, 240.0]


def test_zlib_inflates_as_isal_does(tmp_path, monkeypatch):
    """ISA-L (the isal package, a dependency) inflates; zlib, the fallback, gives the same frames and errors."""
    import zlib
    assert trace._inflate_mod is not zlib
    src = shared_data("gpu-traces", "hta-nccl-2rank-a100", "rank-0.json.gz")
    good = gzip.compress(json.dumps(_doc()).encode())
    (tmp_path / "trunc.json.gz").write_bytes(good[:-30])
    (tmp_path / "notgz.json.gz").write_bytes(b"\x1f\x8bthis is not gzip data at all")
    fast = load_trace(str(src))
    errors = [_err(tmp_path / n) for n in ("trunc.json.gz", "notgz.json.gz")]
    monkeypatch.setattr(trace, "_inflate_mod", zlib)
    monkeypatch.setattr(trace, "_INFLATE_ERRORS", (zlib.error,))
    _same_frames(fast.events, load_trace(str(src)).events)
    assert "truncated" in errors[0] and "truncated" in _err(tmp_path / "trunc.json.gz")
    assert "gzip" in errors[1] and "gzip" in _err(tmp_path / "notgz.json.gz")


def test_multi_member_gzip_and_padding(tmp_path):
    src = shared_data("gpu-traces", "param-dlrm-8rank-v100", "rank-0.json.gz")
    raw = gzip.decompress(src.read_bytes())
    p = tmp_path / "mm.json.gz"
    p.write_bytes(gzip.compress(raw[:1000]) + gzip.compress(raw[1000:]) + b"\0" * 16)
    _same_frames(load_trace(str(src)).events, load_trace(str(p)).events)


def test_decode_while_something_else_holds_the_decoded_events(tmp_path, monkeypatch):
    """A Dask worker's sampling profiler holds the decoding thread's frames (and so the decoded events and the
    msgspec.Raw views they keep into the read buffer) a little longer than the decoder does; the buffer then
    cannot grow in place.  The decode must still be the same (it was a BufferError, a lost rank, before)."""
    from fsdpprof.analyze.trace import decode

    src = shared_data("gpu-traces", "param-dlrm-8rank-v100", "rank-3.json.gz")   # (its ops have Input Dims)
    whole = load_trace(str(src))
    kept = []
    fast = decode._FAST_CHUNK_DEC

    class Holding:
        def decode(self, buf):
            events = fast.decode(buf)
            kept.append(events)          # every chunk's events (and their views of the buffer) stay alive
            return events

    monkeypatch.setattr(decode, "_FAST_CHUNK_DEC", Holding())
    monkeypatch.setattr(trace, "CHUNK_BYTES", 200_000)
    monkeypatch.setattr(trace, "READ_BYTES", 65_536)
    held = load_trace(str(src))
    assert len(kept) >= 3                # several chunks were decoded while earlier ones were held
    _same_frames(whole.events, held.events)


def test_gc_paused_while_a_trace_loads_and_restored_after(tmp_path, monkeypatch):
    """load_trace pauses the cyclic collector while it decodes (each collection would rescan the events being
    built) and restores its state afterwards: enabled stays enabled, disabled stays disabled, also when the
    trace is refused."""
    import gc
    seen = []
    real = loader._load_trace
    monkeypatch.setattr(loader, "_load_trace", lambda *a: (seen.append(gc.isenabled()), real(*a))[1])
    good = _write(tmp_path / "t.json.gz", _doc())
    bad = tmp_path / "bad.json"
    bad.write_text('{"traceEvents": [ {"ph": "X", ')
    was = gc.isenabled()
    try:
        gc.enable()
        assert len(load_trace(str(good)).events) > 0
        assert gc.isenabled()
        with pytest.raises(UserError):
            load_trace(str(bad))
        assert gc.isenabled()
        gc.disable()
        load_trace(str(good))
        assert not gc.isenabled()
    finally:
        (gc.enable if was else gc.disable)()
    assert seen == [False, False, False]


def test_frame_of_is_the_plain_constructors_frame_without_copies():
    """frames.frame_of (the events and memory frames of every trace): the frame pd.DataFrame(columns, columns=order,
    copy=False) makes, dtypes and values alike, its numpy columns the arrays given (not copied, not consolidated);
    an object column takes the plain constructor (pandas' own inference). column_arrays gives each column's array."""
    from fsdpprof.analyze.load.frames import column_arrays, frame_of

    n = 5
    cols = {"rank": np.zeros(n, dtype=np.int32), "ts_us": np.arange(n, dtype=float),
            "lane": pd.Categorical(["thread:1", "stream:7"] * 2 + ["thread:1"]), "bytes": np.full(n, np.nan),
            "dur_us": np.ones(n)}
    order = ["ts_us", "lane", "rank", "dur_us", "bytes"]
    got = frame_of(cols, order)
    pd.testing.assert_frame_equal(got, pd.DataFrame(cols, columns=order, copy=False))
    assert list(got.columns) == order and np.shares_memory(got["ts_us"].to_numpy(), cols["ts_us"])
    for a, c in zip(column_arrays(got), order):
        assert pd.Series(np.asarray(a)).equals(pd.Series(np.asarray(cols[c]))) and a.dtype == got[c].dtype
    with_text = {**cols, "name": np.array(["a", "b", "c", "d", "e"], dtype=object)}
    pd.testing.assert_frame_equal(frame_of(with_text, order + ["name"]),
                                  pd.DataFrame(with_text, columns=order + ["name"], copy=False))
    assert len(frame_of({"x": np.zeros(0)}, ["x"])) == 0


def test_comm_rows_judged_once_per_distinct_args_read_per_row():
    """classify._comm_info judges rows that differ only in their sequence number once: each row keeps its own
    number, and args equal in value but not in type (1 and True as the group size: a bool is no count) are told
    apart."""
    from types import SimpleNamespace

    from fsdpprof.analyze.trace import classify

    row = ("allreduce", 10, 10, 1, "Float", "0")
    rt = SimpleNamespace(cols={"name": np.zeros(4, dtype=np.int32)}, comm_rows=[
        (0, *row, 1, b"", b""), (1, *row, 2, b"", b""), (2, *row[:3], True, *row[4:], 3, b"", b""),
        (3, *row[:3], 1.0, *row[4:], None, b"", b"")])
    info = classify._comm_info(rt, ["record_param_comms"])
    assert list(info["idx"]) == [0, 1, 2, 3]
    assert info["seq"][:3].tolist() == [1.0, 2.0, 3.0] and np.isnan(info["seq"][3])
    assert info["bytes"].tolist() == [40.0] * 4 and list(info["collective"]) == ["all_reduce"] * 4
    assert info["group_size"][[0, 1, 3]].tolist() == [1.0, 1.0, 1.0] and np.isnan(info["group_size"][2])


def test_ranks_share_the_dtype_of_a_few_string_categories():
    """Two ranks' frames: their kind / collective columns (a few strings) have one dtype object, built once, so
    that concat_events keeps their codes as they are; their names (many) each their own, equal to pandas' own."""
    from fsdpprof.analyze.trace import labels, load_trace

    a, b = (load_trace(str(shared_data("gpu-traces", "param-dlrm-8rank-v100", f"rank-{r}.json.gz"))).events
            for r in (0, 1))
    for col in ("kind", "collective", "stage"):
        assert a[col].dtype is b[col].dtype, col
    assert a["kind"].dtype == pd.CategoricalDtype(sorted(set(a["kind"].astype(str))))
    both = labels.concat_events([a, b])
    assert both["kind"].dtype is a["kind"].dtype
    assert both["kind"].astype(str).tolist() == a["kind"].astype(str).tolist() + b["kind"].astype(str).tolist()
