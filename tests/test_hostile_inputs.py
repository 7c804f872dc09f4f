"""Hostile and implausible input contents (issue 8): malformed fields, NaN / inf / huge / negative values,
duplicated events, pickle and size bombs in traces and CUDA snapshots.  Every failure is one UserError
line naming the file (never a raw TypeError / KeyError / ...); whatever is left out is counted in one
warning line per kind that reaches the terminal summary and the report; numbers come from what is left."""
from __future__ import annotations

import gzip
import json
import math
import random
import re
import pickle
import warnings

import orjson
import pandas as pd
import pytest

from conftest import run_fsdpprof, shared_data
from fsdpprof.analyze.trace import classify
from fsdpprof.analyze.load import files as runmod
from fsdpprof.analyze.load import memory_budget
from fsdpprof.analyze.memory import snapshot as snapmod
from fsdpprof.analyze.trace import decode as trace
from fsdpprof.analyze.pipeline import analyze_run
from fsdpprof.analyze.load.run import load_run
from fsdpprof.analyze.memory.snapshot import load_snapshot, parse_snapshot
from fsdpprof.analyze.trace import load_trace
from fsdpprof.errors import BUG_MARK, UserError
from fsdpprof.report.run_page import render_report
from fsdpprof.report.summary import summary as summary_of
from fsdpprof.report.text import summary_text

DLRM = ("gpu-traces", "param-dlrm-8rank-v100", "rank-0.json.gz")
REAL_TRACES = ["hta-16rank-a100/rank-0.json.gz", "hta-nccl-2rank-a100/rank-0.json.gz",
               "param-dlrm-8rank-v100/rank-0.json.gz", "tracelens-b200-8rank/rank-0.json.gz"]
REAL_SNAPSHOTS = ["lm-step-user-metadata.pickle", "qlora-tinyllama-legacy.pickle", "multi-device-expandable-oom.pickle"]


# ------------------------------------------------------------------------------------------ helpers
def _mem(ts, addr, nbytes, total):
    return {"ph": "i", "cat": "cpu_instant_event", "s": "t", "name": "[memory]", "pid": 1, "tid": 1, "ts": ts,
            "args": {"Total Reserved": 0, "Total Allocated": total, "Bytes": nbytes, "Device Id": -1,
                     "Device Type": 0, "Addr": addr}}


def _doc(extra=(), events=None):
    """A tiny CPU trace: one step, two ops, two allocations (peak 3000 bytes at ts 15)."""
    ev = events if events is not None else [
        {"ph": "X", "cat": "user_annotation", "name": "ProfilerStep#3", "pid": 1, "tid": 1, "ts": 0.0, "dur": 100.0},
        {"ph": "X", "cat": "cpu_op", "name": "aten::mm", "pid": 1, "tid": 1, "ts": 10.0, "dur": 20.0,
         "args": {"External id": 5}},
        {"ph": "X", "cat": "cpu_op", "name": "aten::add", "pid": 1, "tid": 1, "ts": 40.0, "dur": 5.0,
         "args": {"External id": 6}},
        _mem(11.0, 1234, 1000, 1000), _mem(15.0, 5678, 2000, 3000), _mem(25.0, 1234, -1000, 2000),
        _mem(50.0, 5678, -2000, 0),
    ]
    return {"schemaVersion": 1, "distributedInfo": {"backend": "gloo", "rank": 0, "world_size": 2},
            "traceEvents": list(ev) + list(extra)}


def _write(path, doc, gz=False):
    try:
        data = orjson.dumps(doc)
    except TypeError:                      # integers beyond 64 bits: the standard library writes them
        data = json.dumps(doc).encode()
    path.write_bytes(gzip.compress(data) if gz else data)
    return path


def _real_doc(*parts):
    return orjson.loads(gzip.decompress(shared_data(*parts).read_bytes()))


def _one_line_error(fn, *args, **kw) -> UserError:
    with pytest.raises(UserError) as ei:
        fn(*args, **kw)
    msg = str(ei.value)
    assert "\n" not in msg and msg
    return ei.value


def _no_python_warnings(fn, *args, **kw):
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        return fn(*args, **kw)


def _report(path):
    """The report path in-process: analysis, strict summary.json, terminal text, HTML; no Python warning."""
    def go():
        a = analyze_run(load_run(path, workers=1), hta=False)
        summary = json.dumps(summary_of(a), allow_nan=False)
        return a, summary, summary_text(a), render_report(a)
    return _no_python_warnings(go)


# ------------------------------------------------------------------------------------------ traces
@pytest.mark.parametrize("lenient", [False, True])
def test_unhashable_names_threads_and_categories_are_read(tmp_path, lenient):
    # a list / object as an event's name, tid, pid or cat raised "TypeError: unhashable type" (268 of 2,000
    # fuzzed traces); the lenient decoder (taken here because one ts is a string) had the same fault
    odd = [
        {"ph": "X", "cat": "cpu_op", "name": ["a", 1], "pid": 1, "tid": 1, "ts": 50.0, "dur": 1.0},
        {"ph": "X", "cat": "cpu_op", "name": "aten::odd_tid", "pid": 1, "tid": {"x": 1}, "ts": 52.0, "dur": 1.0},
        {"ph": "X", "cat": "cpu_op", "name": "aten::odd_pid", "pid": [7], "tid": 1, "ts": 54.0, "dur": 1.0},
        {"ph": "X", "cat": ["cpu_op"], "name": "aten::odd_cat", "pid": 1, "tid": 1, "ts": 56.0, "dur": 1.0},
        {"ph": "M", "name": "thread_name", "pid": [1], "tid": {"t": 2}, "args": {"name": ["main"]}},
    ]
    if lenient:
        odd.append({"ph": "X", "cat": "cpu_op", "name": "aten::str_ts", "pid": 1, "tid": 1, "ts": "58", "dur": 1.0})
    td = load_trace(str(_write(tmp_path / "odd.json", _doc(odd))))
    names = set(td.events["name"].astype(str))
    assert {'["a",1]', "aten::odd_tid", "aten::odd_pid", "aten::mm"} <= names
    assert "aten::odd_cat" not in names                       # an unknown category is not one we read
    assert any(lane.startswith('thread:{"x":1}') for lane in td.events["lane"].astype(str))
    w = "\n".join(td.warnings)
    assert "1 event names were not strings" in w and "1 thread ids were lists or objects" in w
    assert "1 process ids were lists or objects" in w
    assert all(str(tmp_path / "odd.json") in x for x in td.warnings)


def test_a_time_written_as_a_string_or_a_bool_is_missing_whatever_its_slice_holds(tmp_path):
    # numpy read "58" as 58.0 and true as 1.0 when every other time of the slice was a number (and as missing when
    # one was not): a time that is not a JSON number is missing, for duration and [memory] events alike
    bad = [{"ph": "X", "cat": "cpu_op", "name": "aten::str_ts", "pid": 1, "tid": 1, "ts": "58", "dur": 1.0},
           {"ph": "X", "cat": "cpu_op", "name": "aten::bool_dur", "pid": 1, "tid": 1, "ts": 60.0, "dur": True},
           _mem("70", 4321, 100, 3100), _mem(True, 4322, 100, 3100)]
    path = _write(tmp_path / "str.json", _doc(bad))
    td = load_trace(str(path))
    good = load_trace(str(_write(tmp_path / "good.json", _doc())))
    pd.testing.assert_frame_equal(td.events, good.events)
    pd.testing.assert_frame_equal(td.memory_events, good.memory_events)
    assert sum("2 events without a timestamp or duration" in x for x in td.warnings) == 1
    assert sum("2 [memory] events with a missing or invalid time" in x for x in td.warnings) == 1


def _memory_oracle(events):
    """The [memory] rows the decoder keeps, one event at a time: (ts, addr, bytes, total allocated, total reserved,
    device type, device id) and the process id, and the counts of the bad and the duplicated."""
    def num(v):
        return type(v) in (int, float) and math.isfinite(v) and abs(v) <= 2 ** 53

    def integer(v, bits):
        lo, hi = -(1 << (bits - 1)), (1 << (bits - 1)) - 1
        if type(v) is int and lo <= v <= hi or type(v) is float and v.is_integer() and lo <= v <= hi:
            return int(v)
        return None
    rows, pids, seen, bad, dup = [], [], set(), 0, 0
    for e in events:
        a = e["args"]
        vals = [integer(a.get(k), b) for k, b in (("Addr", 64), ("Bytes", 64), ("Total Allocated", 64),
                                                 ("Total Reserved", 64), ("Device Type", 8), ("Device Id", 16))]
        if not num(e.get("ts")) or vals[0] is None or vals[1] is None or abs(vals[1]) > 1 << 44:
            bad += 1
            continue
        row = (float(e["ts"]),) + tuple(0 if v is None else v for v in vals)
        if row in seen:
            dup += 1
            continue
        seen.add(row)
        rows.append(row)
        p = e["pid"]
        pids.append(json.dumps(p, separators=(",", ":")) if isinstance(p, (list, dict)) else p)   # (as its JSON text)
    return rows, pids, bad, dup


@pytest.mark.parametrize("lenient", [False, True])
def test_memory_events_over_many_slices_match_an_event_by_event_reading(tmp_path, lenient):
    # the [memory] events are kept in typed columns slice by slice (no tuple per event): what is kept, left out
    # (bad, or a duplicate of an event slices earlier) and each row's process id (1, 1.0 and True apart; a list as
    # its JSON text) must be what reading the events one by one gives
    rng = random.Random(7)
    odd = [None, "12", [1], {"a": 1}, 1.5, 2 ** 70, 1e30, True]
    mem = []
    for i in range(8000):
        e = _mem(float(i) + rng.choice([0, 0, 0, 0.5]), 4096 + 16 * (i % 997), rng.choice([512, -512, 2048]),
                 1 << 20)
        a = e["args"]
        for key in ("Addr", "Bytes", "Total Allocated", "Total Reserved", "Device Type", "Device Id"):
            r = rng.random()
            if r < 0.02:
                a[key] = rng.choice(odd)
            elif r < 0.03:
                del a[key]
            elif r < 0.04 and key in ("Addr", "Bytes"):
                a[key] = float(a[key])                    # an integer written as a float is read
        if rng.random() < 0.01:
            e["ts"] = rng.choice([None, 1e300, "7"] if lenient else [None, 1e300])
        e["pid"] = rng.choice([1, 1, 1, 1.0, True, "1", [1]])
        mem.append(e)
        if rng.random() < 0.03:
            mem.insert(rng.randrange(len(mem)), dict(e))   # a duplicate, often in another slice
    path = _write(tmp_path / "mem.json", _doc(mem, events=[]))
    assert path.stat().st_size > 4 * trace.CHUNK_BYTES
    rt = trace.decode_trace(str(path))
    rows, pids, bad, dup = _memory_oracle(mem)
    cols = ["ts_us", "addr", "bytes", "total_allocated_bytes", "total_reserved_bytes", "device_type", "device_id"]
    got = list(zip(*(rt.memory_events[c].tolist() for c in cols)))
    assert got == rows and len(rows) > 5000
    assert [(type(p), p) for p in rt.memory_pids.tolist()] == [(type(p), p) for p in pids]
    assert rt.defects.get("bad_memory", 0) == bad > 100 and rt.defects.get("duplicate_memory", 0) == dup > 100
    assert list(rt.memory_events.dtypes.astype(str)) == ["int32", "float64", "int64", "int64", "int64", "int64",
                                                         "int8", "int16"]


def test_real_trace_with_unhashable_ids_loads(tmp_path):
    doc = _real_doc(*DLRM)
    base = load_trace(str(shared_data(*DLRM)))
    n = 0
    for i, e in enumerate(doc["traceEvents"]):
        if e.get("ph") == "X" and e.get("cat") == "cpu_op" and i % 50 == 0:
            e["tid"], e["pid"], n = {"odd": i}, [i], n + 1
    td = load_trace(str(_write(tmp_path / "dlrm.json", doc)))
    assert n > 10 and len(td.events) == len(base.events)
    assert any(f"{n} thread ids were lists or objects" in w for w in td.warnings)


def test_negative_missing_and_beyond_range_times_are_left_out(tmp_path):
    bad = [
        {"ph": "X", "cat": "cpu_op", "name": "aten::neg", "pid": 1, "tid": 1, "ts": 60.0, "dur": -803850.0},
        {"ph": "X", "cat": "cpu_op", "name": "aten::no_ts", "pid": 1, "tid": 1, "dur": 3.0},
        {"ph": "X", "cat": "cpu_op", "name": "aten::no_dur", "pid": 1, "tid": 1, "ts": 70.0},
        {"ph": "X", "cat": "cpu_op", "name": "aten::far", "pid": 1, "tid": 1, "ts": 1e300, "dur": 1.0},
        {"ph": "X", "cat": "cpu_op", "name": "aten::long", "pid": 1, "tid": 1, "ts": 80.0, "dur": 1e30},
        _mem(None, 99, 500, 500), _mem(12.0, 98, 1e30, 500), _mem(13.0, [1], 500, 500),
    ]
    path = _write(tmp_path / "bad.json", _doc(bad))
    td = load_trace(str(path))
    good = load_trace(str(_write(tmp_path / "good.json", _doc())))
    pd.testing.assert_frame_equal(td.events, good.events)
    pd.testing.assert_frame_equal(td.memory_events, good.memory_events)
    w = [x for x in td.warnings if x.startswith(f"trace {path}")]
    assert sum("2 events without a timestamp or duration" in x for x in w) == 1
    assert sum("2 events with an infinite or implausible timestamp or duration" in x for x in w) == 1
    assert sum("1 events with a negative duration" in x for x in w) == 1
    assert sum("3 [memory] events with a missing or invalid time, address or size" in x for x in w) == 1
    # no "nan% of the step", no RuntimeWarning; the step and the peak are those of the good events
    a, summary, text, page = _report(str(path))
    step_line = text.split(", step ")[1].split("\n")[0]
    assert "nan" not in text.lower() and not re.search(r"(?<![\d.])-\d", step_line), step_line   # no negative time
    assert a.memory[0].peak_allocated_bytes == 3000
    assert "events with a negative duration were left out" in text and "negative duration" in page
    assert a.steps is not None and (a.steps["step_us"] > 0).all()


def test_real_trace_negative_kernel_durations(tmp_path):
    # the report: negated durations gave a negative median step and negative exposed communication
    doc = _real_doc(*DLRM)
    n = 0
    for e in doc["traceEvents"]:
        if e.get("cat") in ("kernel", "gpu_memcpy") and isinstance(e.get("dur"), (int, float)):
            e["dur"], n = -e["dur"] - 5, n + 1
    a, summary, text, _ = _report(str(_write(tmp_path / "neg.json", doc)))
    assert f"{n} events with a negative duration were left out" in text
    s = json.loads(summary)
    for row in (s["steps"] or []) + (s["overlap_overall"] or []) + (s["comm_phase"] or []):
        for k, v in row.items():
            if k.endswith(("_us", "_pct")) and "skew" not in k and v is not None and k != "idle_us":
                assert v >= 0, (k, v)
    assert a.overview["step_time_us"] > 0


def test_duplicated_events_are_counted_once(tmp_path):
    # a trace whose events were written twice raised the memory peak 20-fold (32 -> 659 MiB)
    doc = _doc()
    twice = dict(doc, traceEvents=doc["traceEvents"] * 2)
    once_path, twice_path = _write(tmp_path / "once.json", doc), _write(tmp_path / "twice.json", twice)
    once, dup = load_trace(str(once_path)), load_trace(str(twice_path))
    pd.testing.assert_frame_equal(dup.events, once.events)
    pd.testing.assert_frame_equal(dup.memory_events, once.memory_events)
    assert sum("3 duplicated events" in w for w in dup.warnings) == 1
    assert sum("4 duplicated [memory] events" in w for w in dup.warnings) == 1
    a, _, text, _ = _report(str(twice_path))
    assert a.memory[0].peak_allocated_bytes == 3000 and "duplicated [memory] events" in text
    # events that differ only in their External id (or in any arg) are distinct: nothing left out
    twins = [dict(e, args={"External id": 100 + i}) for i, e in enumerate([doc["traceEvents"][1]] * 2)]
    td = load_trace(str(_write(tmp_path / "twins.json", _doc(twins))))
    assert (td.events["name"].astype(str) == "aten::mm").sum() == 3 and not td.warnings


def test_real_trace_doubled_gives_the_same_events(tmp_path):
    doc = _real_doc(*DLRM)
    base = load_trace(str(shared_data(*DLRM)))
    doubled = dict(doc, traceEvents=doc["traceEvents"] + doc["traceEvents"])
    td = load_trace(str(_write(tmp_path / "twice.json.gz", doubled, gz=True)))
    pd.testing.assert_frame_equal(td.events, base.events)
    assert len(td.warnings) == 1 and "duplicated events" in td.warnings[0]


@pytest.mark.parametrize("rel", REAL_TRACES)
def test_real_traces_have_no_defects(rel):
    """The checks cost the real traces nothing: no event left out, cut or repaired, no warning about them."""
    path = shared_data("gpu-traces", rel)
    rt = trace.decode_trace(str(path))
    assert rt.defects == {}
    assert trace.defect_warnings(str(path), rt.defects) == []


def test_long_names_are_cut_at_decode_time(tmp_path):
    # a 400 KB gzip with one 400 MB operator name took 31 s, 3.8 GB and wrote an 844 MB report; here 20 MB
    big = "N" * (20 << 20)
    path = _write(tmp_path / "long.json.gz", _doc([{"ph": "X", "cat": "cpu_op", "name": big, "pid": 1, "tid": 1,
                                                   "ts": 60.0, "dur": 1.0}]), gz=True)
    assert path.stat().st_size < 100_000
    td = load_trace(str(path))
    names = td.events["name"].astype(str)
    longest = max(names, key=len)
    assert longest.startswith("N" * trace.NAME_MAX_CHARS) and "[cut: 20,971,520 characters]" in longest
    assert len(longest) < trace.NAME_MAX_CHARS + 100
    assert sum("1 event names longer than 4,096 characters were cut" in w for w in td.warnings) == 1
    _, summary, _, page = _report(str(path))
    assert len(summary) < 200_000 and len(page) < 20_000_000


def test_decompressed_size_limit_names_the_flag(tmp_path):
    doc = _doc([{"ph": "X", "cat": "cpu_op", "name": f"op{i}", "pid": 1, "tid": 1, "ts": 60.0 + i, "dur": 0.5}
                for i in range(20000)])
    raw = orjson.dumps(doc)
    gz = tmp_path / "t.json.gz"
    gz.write_bytes(gzip.compress(raw))
    plain = _write(tmp_path / "t.json", doc)
    for p in (gz, plain):
        err = _one_line_error(load_trace, str(p), max_bytes=len(raw) // 2)
        assert str(p) in str(err) and "--max-trace-bytes" in str(err) and err.__cause__ is None
        assert len(load_trace(str(p), max_bytes=len(raw)).events) == 20003
    # a gzip trailer that lies about the size (says 100 bytes): inflated in bounded blocks, not trusted
    liar = tmp_path / "liar.json.gz"
    liar.write_bytes(gzip.compress(raw)[:-4] + (100).to_bytes(4, "little"))
    assert str(liar) in str(_one_line_error(load_trace, str(liar), max_bytes=len(raw) // 2))
    assert memory_budget.MAX_TRACE_BYTES_FLOOR == 8 << 30
    err = _one_line_error(load_run, str(gz), max_trace_bytes=1000)
    assert "--max-trace-bytes" in str(err)
    p = run_fsdpprof("report", str(gz), "--max-trace-bytes", "1000", "-o", str(tmp_path / "r.html"))
    assert p.returncode == 2 and "--max-trace-bytes" in p.stderr and p.stderr.count("\n") == 1, p.stderr
    assert "Traceback" not in p.stderr and not (tmp_path / "r.html").exists()


@pytest.mark.parametrize("rank", [-3, 10 ** 30, "0", [0], 2])
def test_implausible_distributed_info_is_left_out(tmp_path, rank):
    doc = _doc()
    doc["distributedInfo"]["rank"] = rank              # world_size is 2: rank 2 is not one of its ranks
    doc["distributedInfo"]["pg_config"] = [{"pg_name": "0", "pg_size": 0}]
    run = load_run(str(_write(tmp_path / "rank-5.json", doc)), workers=1)
    assert list(run.ranks) == [5]                      # taken from the file name, said so
    assert any("distributedInfo holds 2 value(s)" in w for w in run.warnings)
    assert any("no distributedInfo rank" in w or "rank 5 taken from the file name" in w for w in run.warnings)
    _report(str(tmp_path / "rank-5.json"))


def test_deep_nesting_and_huge_numbers_are_one_line_errors(tmp_path):
    deep = orjson.dumps(_doc())[:-2] + b', {"ph": "X", "name": ' + b"[" * 100_000 + b"]" * 100_000 + b"}]}"
    (tmp_path / "deep.json").write_bytes(deep)
    assert "too deeply" in str(_one_line_error(load_trace, str(tmp_path / "deep.json")))
    huge = orjson.dumps(_doc())[:-2] + b', {"ph": "X", "cat": "cpu_op", "name": "x", "ts": 1e400, "dur": 1}]}'
    (tmp_path / "huge.json").write_bytes(huge)
    assert "huge.json" in str(_one_line_error(load_trace, str(tmp_path / "huge.json")))
    # ids beyond int64 and sizes beyond any message are ignored, not fatal
    ids = [{"ph": "X", "cat": "kernel", "name": "ncclKernel_AllGather_RING_LL", "pid": 0, "tid": 7, "ts": 20.0,
            "dur": 5.0, "args": {"stream": 2 ** 64 - 1, "correlation": 2 ** 70, "External id": -(2 ** 63) - 5,
                                 "In msg nelems": 10 ** 40, "Group size": 0, "dtype": "Float" * 5000}}]
    td = load_trace(str(_write(tmp_path / "ids.json", _doc(ids))))
    k = td.events[td.events["name"].astype(str).str.startswith("nccl")]
    assert len(k) == 1 and pd.isna(k["bytes"].iloc[0]) and pd.isna(k["group_size"].iloc[0])


def test_api_turns_unexpected_exceptions_into_one_line_user_errors(tmp_path, monkeypatch):
    """The last resort at the API boundary: a bug shows as one line naming the file, chained to the cause."""
    path = str(_write(tmp_path / "t.json", _doc()))

    def boom(*a, **k):
        raise KeyError("no such column")
    monkeypatch.setattr(classify, "classify_arrays", boom)
    err = _one_line_error(load_trace, path)
    assert path in str(err) and BUG_MARK in str(err) and isinstance(err.__cause__, KeyError)
    monkeypatch.setattr(snapmod, "parse_snapshot", boom)
    snap = tmp_path / "s.pickle"
    snap.write_bytes(pickle.dumps({"segments": [], "device_traces": []}))
    err = _one_line_error(load_snapshot, str(snap))
    assert str(snap) in str(err) and isinstance(err.__cause__, KeyError)
    monkeypatch.setattr(runmod, "_load_traces", boom)
    err = _one_line_error(load_run, path)
    assert path in str(err) and isinstance(err.__cause__, KeyError)


# ------------------------------------------------------------------------------------------ snapshots
def _frames(name="forward"):
    return [{"name": name, "filename": "model.py", "line": 3}]


def _entry(action, addr, size, t, **kw):
    return {"action": action, "addr": addr, "size": size, "stream": 0, "time_us": t, "frames": _frames(), **kw}


def _snap(extra_entries=(), extra_segments=()):
    """One device: a 4 KiB segment with one live block; allocations A (512) and B (1024), A freed."""
    seg = {"device": 0, "address": 0x1000, "total_size": 4096, "allocated_size": 1536, "active_size": 1536,
           "stream": 0, "is_expandable": False,
           "blocks": [{"state": "active_allocated", "address": 0x1200, "size": 1024, "frames": _frames()}]}
    entries = [_entry("alloc", 0x1000, 512, 1.0), _entry("alloc", 0x1200, 1024, 2.0),
               _entry("free_requested", 0x1000, 512, 3.0), _entry("free_completed", 0x1000, 512, 3.5)]
    return {"segments": [seg, *extra_segments], "device_traces": [entries + list(extra_entries)],
            "allocator_settings": {}}


def _pickle(path, obj, gz=False):
    data = pickle.dumps(obj, protocol=4)
    path.write_bytes(gzip.compress(data) if gz else data)
    return path


def test_snapshot_malformed_fields_are_left_out_and_counted(tmp_path):
    # missing keys, wrong types, NaN, inf, huge integers: KeyError / TypeError / OverflowError before
    bad_entries = [
        {"action": "alloc", "size": 64, "time_us": 4.0},                              # no addr
        _entry("alloc", 0x2000, "abc", 4.1), _entry("alloc", 0x2100, float("inf"), 4.2),
        _entry("alloc", 10 ** 30, 64, 4.3), _entry("alloc", 0x2200, 64, float("nan")),
        _entry("alloc", 0x2300, -64, 4.4), 5, None,
        _entry(["alloc"], 0x2400, 64, 4.5),                                           # action: not a string
        _entry("alloc", 0x2500, 64, 4.6, frames=5, user_metadata=[1], stream="s"),    # fields ignored
        _entry("oom", 0, float("inf"), 4.7),
    ]
    bad_segments = [{"device": "x", "address": 1, "total_size": 1, "blocks": []}, 7,
                    {"device": 0, "address": 0x9000, "total_size": 2 ** 70, "blocks": []},
                    {"device": 0, "address": 0x8000, "total_size": 4096, "allocated_size": 0, "active_size": 0,
                     "stream": 0, "blocks": ["not a block", {"state": "active_allocated", "address": None}]}]
    good = [_entry("alloc", 0x10000 + 64 * i, 64, 10.0 + i) for i in range(20)]   # most of the file is fine
    path = _pickle(tmp_path / "bad.pickle", _snap(bad_entries + good, bad_segments))
    snap = _no_python_warnings(load_snapshot, str(path))
    assert sorted(snap.allocations["addr"].tolist()) == [0x1000, 0x1200, 0x2500] + [0x10000 + 64 * i for i in range(20)]
    w = "\n".join(snap.warnings)
    assert "3 segment(s) malformed" in w and "2 block(s) of segments malformed" in w
    # (the entry whose action is not a string counts too: an entry without an action says nothing)
    assert "10 trace entries malformed" in w and "3 trace entry field(s) of the wrong type" in w
    assert all(x.startswith(str(path)) for x in snap.defects) and len(snap.defects) == 4
    a, summary, text, page = _report(str(path))
    assert a.memory[0].peak_allocated_bytes == 1024 + 64 + 20 * 64          # A was freed before the others
    assert "10 trace entries malformed" in text and "10 trace entries malformed" in page


def _real_snapshot(name: str = "lm-step-user-metadata.pickle"):
    from fsdpprof.analyze.memory import safe_pickle

    return safe_pickle.load_sized(str(shared_data("cuda-snapshots", name)), max_bytes=1 << 30)[0]


def _emptied(snap):
    """Every segment and every trace entry of ``snap`` an empty dict."""
    return dict(snap, segments=[{} for _ in snap["segments"]],
                device_traces=[[{} for _ in t] for t in snap["device_traces"]])


_NO_ADDRESS = {k: v for k, v in _snap()["segments"][0].items() if k != "address"}


@pytest.mark.parametrize("case", ["hand-built emptied", "real emptied", "no address and a bad entry",
                                  "a few bad parts, no allocation left"])
def test_snapshot_with_no_allocation_left_is_exit_2(tmp_path, case):
    """Once its malformed parts are left out nothing is allocated: one line saying what was malformed, exit 2
    (before: a report of "peak 0 B", once with the finding "100 % of reserved memory is not allocated ->
    expandable_segments")."""
    content = {
        "hand-built emptied": lambda: _emptied(_snap()),
        "real emptied": lambda: _emptied(_real_snapshot()),
        "no address and a bad entry": lambda: {"segments": [_NO_ADDRESS],
                                               "device_traces": [[{"action": "alloc", "size": -3}]]},
        # a minority malformed (1 segment, 1 entry of 5): the rest holds segment events but no allocation
        "a few bad parts, no allocation left": lambda: {
            "segments": [_NO_ADDRESS], "device_traces": [[_entry("segment_alloc", 0x1000 * i, 2 << 20, float(i))
                                                           for i in range(1, 4)] + [{"size": 5}]]},
    }[case]()
    path = _pickle(tmp_path / "broken.pickle", content)
    err = str(_one_line_error(load_snapshot, str(path)))
    assert str(path) in err and "malformed" in err and "is the file corrupt?" in err, err
    assert "segment(s) malformed" in err and "trace entries malformed" in err, err
    p = run_fsdpprof("report", str(path), "-o", str(tmp_path / "r.html"))
    assert p.returncode == 2 and p.stderr.count("\n") == 1 and "broken.pickle" in p.stderr, p.stderr
    assert "peak 0 B" not in p.stdout and "expandable_segments" not in p.stdout + p.stderr
    assert not (tmp_path / "r.html").exists()


def test_snapshot_without_block_sizes_warns_and_keeps_its_peak(tmp_path):
    """Every live block without its size: the size its tensor requested stands for it, with a warning (before:
    no warning, the peak of lm-step-user-metadata 12.0 GiB instead of 13.0 GiB); a block with neither size is
    left out as malformed."""
    real = _real_snapshot()
    whole = _pickle(tmp_path / "whole.pickle", real)
    sizeless = dict(real, segments=[dict(seg, blocks=[{k: v for k, v in b.items() if k != "size"}
                                                      for b in seg["blocks"]]) for seg in real["segments"]])
    cut = _pickle(tmp_path / "no-sizes.pickle", sizeless)
    a_whole, a_cut = (analyze_run(load_run(str(p)), hta=False) for p in (whole, cut))
    live = sum(1 for seg in real["segments"] for b in seg["blocks"] if b.get("state") == "active_allocated")
    assert a_cut.memory[0].peak_allocated_bytes == a_whole.memory[0].peak_allocated_bytes > 12.5 * 2 ** 30
    assert any(f"{live:,} live block(s) of segments have no size" in w for w in a_cut.warnings), a_cut.warnings
    assert not any("have no size" in w for w in a_whole.warnings)
    # hand-built: the live block of 1024 B, without a size, with and without the size it requested
    snap = _snap()
    block = snap["segments"][0]["blocks"][0]
    del block["size"]
    block["requested_size"] = 1000
    got = load_snapshot(str(_pickle(tmp_path / "requested.pickle", snap)))
    assert "1 live block(s) of segments have no size" in "\n".join(got.warnings)
    del block["requested_size"]
    got = load_snapshot(str(_pickle(tmp_path / "neither.pickle", snap)))
    assert "1 block(s) of segments malformed" in "\n".join(got.warnings)


@pytest.mark.parametrize("content", [
    {"segments": [1, 2, 3], "device_traces": []},
    {"segments": [], "device_traces": [[_entry("alloc", 1, float("inf"), 1.0)] * 3]},
    {"segments": {"a": 1}, "device_traces": []},
    {"device_traces": []},
    [[1, 2]],
])
def test_snapshot_that_cannot_be_analysed_is_exit_2(tmp_path, content):
    # before: exit 0 with an empty report ("memory analysis of rank 0 failed: KeyError") or a traceback
    path = _pickle(tmp_path / "broken.pickle", content)
    _one_line_error(load_snapshot, str(path))
    p = run_fsdpprof("report", str(path), "-o", str(tmp_path / "r.html"))
    assert p.returncode == 2 and p.stderr.count("\n") == 1 and "broken.pickle" in p.stderr, p.stderr
    assert "Traceback" not in p.stderr


def test_snapshot_only_run_fails_loudly_on_an_unexpected_error(tmp_path, monkeypatch):
    from fsdpprof.analyze.memory import attribution as memory

    path = _pickle(tmp_path / "ok.pickle", _snap())

    def boom(*a, **k):
        raise KeyError("addr")
    monkeypatch.setattr(memory, "snapshot_memory", boom)
    err = _one_line_error(analyze_run, load_run(str(path)), hta=False)
    assert BUG_MARK in str(err) and str(path) in str(err)


@pytest.mark.parametrize("shape", ["frames", "entries"])
def test_pickle_bomb_is_refused_before_it_is_walked(tmp_path, shape):
    # dicts shared by reference (pickle memo) 20,000 x 20,000 times: 4e8 frames, or 4e8 entries (one device
    # trace list shared by 20,000 devices; it ran past 120 s), in a file of less than 500 KB
    entry = _entry("alloc", 0x1000, 64, 1.0, frames=_frames() * (20_000 if shape == "frames" else 20))
    traces = [[entry] * 20_000] if shape == "frames" else [[entry] * 20_000] * 20_000
    path = _pickle(tmp_path / "bomb.pickle", {"segments": [], "device_traces": traces})
    assert path.stat().st_size < 500_000
    err = _one_line_error(load_snapshot, str(path))
    assert "pickle bomb" in str(err) and str(path) in str(err)
    p = run_fsdpprof("report", str(path), "-o", str(tmp_path / "r.html"))
    assert p.returncode == 2 and "pickle bomb" in p.stderr


@pytest.mark.parametrize("name", REAL_SNAPSHOTS)
def test_real_snapshots_have_no_defects_and_stay_far_below_the_object_limit(name):
    path = shared_data("cuda-snapshots", name)
    obj, nbytes = snapmod.safe_pickle.load_sized(path)
    limit = max(snapmod.OBJECTS_MIN, snapmod.OBJECTS_PER_BYTE * nbytes)
    snap = parse_snapshot(obj, str(path), max_objects=limit)
    print(f"{name}: {snap.objects_visited:,} objects visited for {nbytes:,} bytes of pickle "
          f"({snap.objects_visited / nbytes:.3f} per byte), limit {limit:,}")
    assert snap.defects == []
    assert snap.objects_visited * 50 <= limit
    with pytest.raises(UserError, match="pickle bomb"):
        parse_snapshot(obj, str(path), max_objects=snap.objects_visited - 1)


def test_snapshot_decompressed_size_limit(tmp_path):
    payload = {"segments": [], "device_traces": [], "padding": b"\0" * (30 << 20)}
    path = _pickle(tmp_path / "zeros.pickle.gz", payload, gz=True)
    assert path.stat().st_size < 100_000
    err = _one_line_error(load_snapshot, str(path), max_bytes=10 << 20)
    assert "inflates to more than" in str(err) and str(path) in str(err)
    assert snapmod.MAX_SNAPSHOT_BYTES == 8 << 30
    assert load_snapshot(str(path)).allocations.empty
    plain = _pickle(tmp_path / "zeros.pickle", payload)
    assert "limit" in str(_one_line_error(load_snapshot, str(plain), max_bytes=10 << 20))


def _bytes_read() -> int:
    """Bytes this process has read through read system calls so far (Linux: /proc/self/io)."""
    try:
        with open("/proc/self/io") as fh:
            return next(int(line.split()[1]) for line in fh if line.startswith("rchar:"))
    except OSError:
        pytest.skip("/proc/self/io is not available here: the bytes a process reads cannot be counted")


def _sparse_file(path, head: bytes, size: int = 3 << 30):
    """``head`` then zero bytes up to ``size`` (3 GB; a sparse file: it takes no room on the disk)."""
    with open(path, "wb") as fh:
        fh.write(head)
        fh.truncate(size)
    return path


@pytest.mark.parametrize("head,what", [
    (b"junk that is no pickle", "not a readable pickle"),
    (b"\x00", "invalid load key"),
    (b"\x80\x04\x95" + (1 << 62).to_bytes(8, "little"), "more than a memory snapshot holds"),    # FRAME of 4 EiB
    (b"\x80\x04\x8e" + (2 << 30).to_bytes(8, "little"), "more than a memory snapshot holds"),    # BINBYTES8 of 2 GiB
    (b"\x1f\x8b\x08\x00\x00\x00\x00\x00\x00\xff" + b"garbage", "gzip data is corrupt"),
])
def test_garbage_snapshot_is_refused_without_reading_it_whole(tmp_path, head, what):
    # a 3 GB garbage file was read whole (3.2 GB of memory) before "invalid load key"; now the unpickler takes it
    # in 128 KiB windows and a length it claims is checked before it is read
    path = _sparse_file(tmp_path / "junk.pickle", head)
    before = _bytes_read()
    err = _one_line_error(load_snapshot, str(path))
    read = _bytes_read() - before
    assert what in str(err) and str(path) in str(err)
    assert read < 4 << 20, f"{read:,} bytes read to refuse {path.stat().st_size:,} bytes of garbage"


def test_zero_bytes_trace_is_refused_without_reading_it_whole(tmp_path):
    # (256 MiB of zero bytes took 121 s before "no 'traceEvents' key": the header was searched again at every read)
    path = _sparse_file(tmp_path / "zeros.json", b"")
    before = _bytes_read()
    err = _one_line_error(load_trace, str(path))
    assert _bytes_read() - before < 4 << 20
    assert "not valid JSON" in str(err) and "byte 0" in str(err)
