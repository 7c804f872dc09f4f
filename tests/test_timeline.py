"""``fsdpprof timeline``: every rank one process of one chrome trace, on one clock, with fsdpprof's tracks; the file
reads back as its ranks with the inputs' numbers; ``report --tables`` writes summary.json's tables as CSV.

On the DLRM 8-rank folder (real V100 traces, NCCL) and on a recorded 2-rank fsdp2 run (CPU, gloo; slow)."""
from __future__ import annotations

import gc
import gzip
import json
import math
import os
import random
import warnings

import numpy as np
import pandas as pd
import pytest

from conftest import run_fsdpprof, shared_data
from fsdpprof.analyze import model
from fsdpprof.analyze.comm import intervals, overlap, skew
from fsdpprof.analyze.load.run import load_run, run_events
from fsdpprof.analyze.pipeline import analyze_run, overlap_summary
from fsdpprof.analyze.trace.timeline_file import TIMELINE_SCHEMA, TRACK_CAT, TRACK_TID_BASE, timeline_meta
from fsdpprof.report.timeline import (TRACK_CRITICAL, TRACK_EXPOSED, TRACK_FINDINGS, TRACK_MEMORY, TRACK_PHASE,
                                      TRACK_STAGE, TRACK_STEP, TRACK_UNIT)

DLRM = ("gpu-traces", "param-dlrm-8rank-v100")
FEW_US = 5.0          # "a few microseconds": how far shared collectives may end apart after alignment


def _timeline(src, out, *extra) -> tuple[dict, str]:
    proc = run_fsdpprof("timeline", str(src), "-o", str(out), *extra)
    assert proc.returncode == 0, proc.stderr
    with gzip.open(out, "rt") as fh:
        return json.load(fh), proc.stdout


def _processes(doc) -> dict:
    return {e["pid"]: e["args"]["name"] for e in doc["traceEvents"] if e.get("ph") == "M"
            and e.get("name") == "process_name"}


def _track_names(doc) -> set:
    return {e["args"]["name"] for e in doc["traceEvents"] if e.get("ph") == "M" and e.get("name") == "thread_name"
            and isinstance(e.get("tid"), int) and e["tid"] >= TRACK_TID_BASE}


def _shared_ends(events: pd.DataFrame, label: str) -> tuple[pd.Series, pd.Series]:
    """(per rank: median distance of its shared collectives' ends from the mean end; per rank: the clock offset
    the collectives' ends still ask for), printed."""
    rec = skew.collective_records(events)
    ranks = sorted(rec["rank"].unique())
    dist = skew.end_residuals(rec, pd.Series(0.0, index=ranks))
    signed = skew.clock_offsets(rec)
    print(f"{label}: residual per rank after alignment (us): median distance "
          f"{ {int(r): round(float(v), 2) for r, v in dist.items()} }, offset still asked "
          f"{ {int(r): round(float(v), 2) for r, v in signed.items()} }")
    return dist, signed


def _same_numbers(a, b) -> None:
    """overlap and volume of two OverlapSummaries equal (1e-9)."""
    for name in ("overlap", "volume"):
        x = getattr(a, name).sort_values(list(getattr(a, name).columns[:2])).reset_index(drop=True)
        y = getattr(b, name).sort_values(list(getattr(b, name).columns[:2])).reset_index(drop=True)
        pd.testing.assert_frame_equal(x, y, check_exact=False, rtol=1e-9, atol=0, check_dtype=False)


# --------------------------------------------------------------------------- the DLRM folder (8 ranks, GPU)
@pytest.fixture(scope="module")
def dlrm_timeline(tmp_path_factory):
    out = tmp_path_factory.mktemp("timeline") / "dlrm.json.gz"
    doc, said = _timeline(shared_data(*DLRM), out)
    return out, doc, said


def test_dlrm_one_process_per_rank_on_one_clock(dlrm_timeline):
    out, doc, said = dlrm_timeline
    meta = doc["otherData"]
    assert meta["schema"] == TIMELINE_SCHEMA
    assert _processes(doc) == {r: f"rank {r}" for r in range(8)}
    parts = {p["rank"]: p for p in meta["ranks"]}
    assert sorted(parts) == list(range(8)) and meta["clock"]["method"] == skew.ALIGN_COLLECTIVES
    for r, p in parts.items():                     # the offsets of the metadata are the ones the command printed
        assert f"{r:>5} {p['offset_us']:>14.0f}" in said
        assert p["trace"]["distributedInfo"]["rank"] == r
    # every original event is there, once, in its rank's process (the process metadata replaced)
    for r in range(8):
        with gzip.open(shared_data(*DLRM) / f"rank-{r}.json.gz", "rt") as fh:
            orig = [e for e in json.load(fh)["traceEvents"]
                    if not (e.get("ph") == "M" and e["name"] in ("process_name", "process_labels", "process_sort_index"))]
        mine = [e for e in doc["traceEvents"] if e["pid"] == r and e.get("cat") != TRACK_CAT
                and not (isinstance(e.get("tid"), int) and e["tid"] >= TRACK_TID_BASE)
                and not (e.get("ph") == "M" and e["name"] in ("process_name", "process_sort_index", "process_labels"))]
        assert len(mine) == len(orig)
        off = parts[r]["offset_us"]
        x = next(e for e in orig if e.get("cat") == "kernel")
        y = next(e for e in mine if e.get("cat") == "kernel" and e["name"] == x["name"] and e["args"] == x["args"])
        assert y["ts"] == x["ts"] - off and y["tid"] == x["tid"] and y["dur"] == x["dur"]
    # the collectives the ranks share end within a few microseconds of each other on the file's clock
    dist, signed = _shared_ends(run_events(load_run(str(out))), "DLRM")
    assert len(dist) == 8 and (dist <= FEW_US).all()
    assert (signed.abs() <= 1.0).all()             # whole-us offsets: at most the rounding is left


def test_dlrm_added_tracks(dlrm_timeline):
    _, doc, _ = dlrm_timeline
    names = _track_names(doc)
    for track in (TRACK_STEP, TRACK_STAGE):
        assert f"fsdpprof: {track}" in names
    assert any(n.startswith(f"fsdpprof: {TRACK_EXPOSED}: ") for n in names)
    ours = [e for e in doc["traceEvents"] if e.get("cat") == TRACK_CAT]
    tids = {(e["pid"], e["tid"]): e["args"]["name"] for e in doc["traceEvents"]
            if e.get("ph") == "M" and e["name"] == "thread_name"}
    stages = {e["name"] for e in ours
              if e["ph"] == "X" and tids.get((e["pid"], e["tid"])) == f"fsdpprof: {TRACK_STAGE}"}
    assert stages and stages <= set(model.STEP_STAGES)
    # the critical path: its spans on the ranks add up to the step's path (summary.json's critical_path)
    path = [e for e in ours if e["ph"] == "X" and tids.get((e["pid"], e["tid"])) == f"fsdpprof: {TRACK_CRITICAL}"]
    assert path and {e["args"]["kind"] for e in path} <= set(model.PATH_KINDS)
    cp = analyze_run(load_run(str(shared_data(*DLRM))), workers=1).critical_path
    assert sum(e["dur"] for e in path) == pytest.approx(float(cp.steps["path_us"].sum()), abs=1.0)
    exposed = [e for e in ours if e["ph"] == "X" and "exposed_us" in e["args"]]
    assert exposed and {e["args"]["collective"] for e in exposed} <= set(model.COLLECTIVES) | {model.UNKNOWN_COLLECTIVE}
    assert all(e["pid"] in range(8) for e in ours)


def test_dlrm_merged_file_reads_back_with_the_inputs_numbers(dlrm_timeline):
    out, _, _ = dlrm_timeline
    merged = overlap_summary(load_run(str(out), lazy=True))
    inputs = overlap_summary(load_run(str(shared_data(*DLRM)), lazy=True))
    assert sorted(merged.overlap["rank"]) == list(range(8)) and not merged.missing
    _same_numbers(merged, inputs)
    proc = run_fsdpprof("report", str(out), "-o", str(out.parent / "merged.html"))
    assert proc.returncode == 0, proc.stderr
    with open(out.parent / "merged.summary.json") as fh:
        s = json.load(fh)
    assert sorted(r["rank"] for r in s["overlap_overall"]) == list(range(8))


def test_exposed_spans_add_up_to_the_exposed_time_per_collective():
    ev = run_events(load_run(str(shared_data(*DLRM))))
    spans = overlap.exposed_comm_spans(ev)
    assert len(spans) and (spans["end_us"] > spans["start_us"]).all()
    per = spans.assign(us=spans["end_us"] - spans["start_us"]).groupby(["rank", "collective"])["us"].sum()
    ref = overlap.comm_overlap(ev, by=["rank", "collective"])
    ref["collective"] = ref["collective"].astype(object).fillna(model.UNKNOWN_COLLECTIVE)
    ref = ref.set_index(["rank", "collective"])["exposed_comm_us"]
    ref = ref[ref > 0]
    assert np.allclose(per.reindex(ref.index).to_numpy(), ref.to_numpy(), rtol=1e-9, atol=1e-6)


def test_interval_difference_against_a_grid():
    rng = np.random.default_rng(3)
    a_s = rng.integers(0, 90, 30).astype(float)
    a_e = a_s + rng.integers(0, 12, 30)
    b_s = rng.integers(0, 90, 25).astype(float)
    b_e = b_s + rng.integers(0, 8, 25)
    s, e = intervals.difference(a_s, a_e, b_s, b_e)
    grid = np.arange(0, 110) + 0.5
    in_a = ((grid[:, None] >= a_s) & (grid[:, None] < a_e)).any(1)
    in_b = ((grid[:, None] >= b_s) & (grid[:, None] < b_e)).any(1)
    got = ((grid[:, None] >= s) & (grid[:, None] < e)).any(1)
    assert (got == (in_a & ~in_b)).all() and (s[1:] > e[:-1]).all()


def test_ranks_and_steps_keep_the_file_small(tmp_path, dlrm_timeline):
    _, full, _ = dlrm_timeline
    doc, _ = _timeline(shared_data(*DLRM), tmp_path / "few.json.gz", "--ranks", "0,3,7")
    assert _processes(doc) == {0: "rank 0", 3: "rank 3", 7: "rank 7"}
    steps = sorted({e["args"]["step"] for e in full["traceEvents"] if e.get("cat") == TRACK_CAT
                    and e["ph"] == "X" and "step" in e["args"] and "stage" not in e["args"]})
    assert steps
    doc, _ = _timeline(shared_data(*DLRM), tmp_path / "step.json.gz", "--steps", str(steps[0]))
    assert len(doc["traceEvents"]) <= len(full["traceEvents"]) and doc["otherData"]["steps"] == [steps[0]]
    proc = run_fsdpprof("timeline", str(shared_data(*DLRM)), "-o", str(tmp_path / "x.json.gz"), "--steps", "999")
    assert proc.returncode == 2 and len(proc.stderr.splitlines()) == 1 and "999" in proc.stderr, proc.stderr
    proc = run_fsdpprof("timeline", str(shared_data(*DLRM)), "-o", str(tmp_path / "x.json.gz"), "--ranks", "9")
    assert proc.returncode == 2 and "rank 9 is not in" in proc.stderr, proc.stderr


def test_reading_the_timeline_mark_closes_the_file(tmp_path, dlrm_timeline):
    """timeline_meta (which every trace found in a folder goes through) closes the file it opened: a timeline, a
    gzipped trace that is none, a plain JSON one (before: a gzipped file was left open, a ResourceWarning in
    448 of the 3,000 seeded fuzz cases)."""
    plain = tmp_path / "plain.json"
    plain.write_bytes(gzip.decompress((shared_data(*DLRM) / "rank-0.json.gz").read_bytes()))
    for path, is_one in ((dlrm_timeline[0], True), (shared_data(*DLRM) / "rank-0.json.gz", False), (plain, False)):
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            meta = timeline_meta(str(path))
            gc.collect()
        assert (meta is not None and meta["schema"] == TIMELINE_SCHEMA) == is_one, path
        assert not [w for w in caught if issubclass(w.category, ResourceWarning)], [str(w.message) for w in caught]


def test_outputs_are_safe(tmp_path):
    out = tmp_path / "t.json.gz"
    _timeline(shared_data(*DLRM), out)
    _timeline(shared_data(*DLRM), out)                  # its own file: replaced without --force
    mine = tmp_path / "mine.json.gz"
    mine.write_bytes(gzip.compress(b'{"traceEvents": []}'))
    proc = run_fsdpprof("timeline", str(shared_data(*DLRM)), "-o", str(mine))
    assert proc.returncode == 2 and "not written by fsdpprof" in proc.stderr, proc.stderr
    src = shared_data(*DLRM) / "rank-0.json.gz"
    proc = run_fsdpprof("timeline", str(src), "-o", str(src), "--force")
    assert proc.returncode == 2 and "one of the input files" in proc.stderr, proc.stderr


def test_report_tables_read_back_equal_to_the_summary(tmp_path):
    tables = tmp_path / "tables"
    proc = run_fsdpprof("report", str(shared_data(*DLRM)), "-o", str(tmp_path / "r.html"), "--tables", str(tables))
    assert proc.returncode == 0, proc.stderr
    with open(tmp_path / "r.summary.json") as fh:
        summary = json.load(fh)
    with open(tables / "tables.json") as fh:
        index = json.load(fh)
    assert index["tables"] and {t["csv"] for t in index["tables"]} == {p.name for p in tables.glob("*.csv")}

    def at(doc, name):
        for part in name.split("."):
            if isinstance(doc, list):    # rows holding tables: their inner rows, each led by its row's first value
                first = next(iter(doc[0]))
                return [{first: r[first], **x} for r in doc for x in r.get(part) or []]
            doc = doc[part]
        if isinstance(doc, list):        # (and the outer table without them)
            return [{k: v for k, v in r.items() if not isinstance(v, list)} for r in doc]
        return doc

    checked = 0
    for t in index["tables"]:
        rows = at(summary, t["table"])
        df = pd.read_csv(tables / t["csv"], keep_default_na=False, na_values=[""])
        assert list(df.columns) == list(dict.fromkeys(k for r in rows for k in r)) and len(df) == len(rows)
        for row, got in zip(rows, df.to_dict("records")):
            for k, v in row.items():
                g = got[k]
                if v is None or (isinstance(g, float) and math.isnan(g)):
                    assert v is None and (g is None or (isinstance(g, float) and math.isnan(g))), (t, k, v, g)
                elif isinstance(v, (int, float)) and not isinstance(v, bool):
                    assert float(g) == pytest.approx(v, rel=1e-12), (t, k)
                else:
                    assert str(g) == str(v), (t, k, v, g)
        checked += 1
    assert checked >= 5
    again = run_fsdpprof("report", str(shared_data(*DLRM)), "-o", str(tmp_path / "r.html"), "--tables", str(tables))
    assert again.returncode == 0, again.stderr          # its own tables: replaced without --force


@pytest.mark.slow
def test_hta_reads_each_rank_of_the_merged_file(dlrm_timeline):
    pytest.importorskip("hta")
    from fsdpprof.analyze.load.hta import hta_breakdowns

    out, _, _ = dlrm_timeline
    merged = hta_breakdowns(load_run(str(out)))
    inputs = hta_breakdowns(load_run(str(shared_data(*DLRM))))
    assert set(merged) == set(inputs) >= {"kernel_type", "temporal", "idle"}
    for k in inputs:
        pd.testing.assert_frame_equal(merged[k].reset_index(drop=True), inputs[k].reset_index(drop=True),
                                      check_exact=False, rtol=1e-9)


# --------------------------------------------------------------------------- a recorded 2-rank run (CPU, gloo)
@pytest.mark.slow
def test_recorded_run_timeline(recorded_run, tmp_path):
    run_dir = recorded_run("fsdp2")
    doc, said = _timeline(run_dir, tmp_path / "run.json.gz")
    assert _processes(doc) == {0: "rank 0", 1: "rank 1"}
    meta = doc["otherData"]
    assert meta["clock"]["method"] == skew.ALIGN_ANCHOR     # the clock anchor fsdpprof recorded
    names = _track_names(doc)
    for track in (TRACK_STEP, TRACK_STAGE, TRACK_PHASE, TRACK_UNIT, TRACK_MEMORY, TRACK_FINDINGS):
        assert any(n.startswith(f"fsdpprof: {track}") for n in names), (track, names)
    assert any(n.startswith(f"fsdpprof: {TRACK_EXPOSED}: ") for n in names)
    # the numbers of the merged file are those of the run
    _same_numbers(overlap_summary(load_run(str(tmp_path / "run.json.gz"), lazy=True)),
                  overlap_summary(load_run(str(run_dir), lazy=True)))
    # findings: their number and summary.json key, at a time of their rank
    a = analyze_run(load_run(str(run_dir), lazy=True), ops=False)
    found = [e for e in doc["traceEvents"] if e.get("cat") == TRACK_CAT and e["ph"] == "i"]
    assert found and all(e["args"]["summary_key"] == f"findings[{e['args']['number'] - 1}]" for e in found)
    assert {e["args"]["id"] for e in found} <= {f.id for f in a.findings}
    # memory counters by category: their highest total is the report's peak, on each rank
    for r in (0, 1):
        counters = [e["args"] for e in doc["traceEvents"] if e.get("ph") == "C" and e["pid"] == r]
        assert counters and set(counters[0]) <= set(model.MEMORY_CATEGORIES) | set(model.REPLICATED_LABELS.values())
        assert max(sum(c.values()) for c in counters) == a.memory[r].peak_allocated_bytes
    _shared_ends(run_events(load_run(str(tmp_path / "run.json.gz"))), "recorded run, clock anchor")
    # aligned on the collectives' ends instead: they then end together on the file's clock (gloo on a shared CPU
    # ends them milliseconds apart either way, so the figure checked is the offset they still ask for)
    _timeline(run_dir, tmp_path / "coll.json.gz", "--align", "collectives")
    _, signed = _shared_ends(run_events(load_run(str(tmp_path / "coll.json.gz"))), "recorded run, collective ends")
    assert len(signed) == 2 and (signed.abs() <= 1.0).all()
    assert os.path.getsize(tmp_path / "run.json.gz") < 10**9


def test_gzip_noise_is_no_timeline(tmp_path):
    """A gzip header followed by noise (zlib's own errors, not OSError) is not a timeline: the trace's own parse
    says what is wrong with it (a folder with such a rank used to fail whole, 'unexpected error')."""
    from fsdpprof.analyze.trace.timeline_file import timeline_meta

    rng = random.Random(7)
    for i in range(200):
        p = tmp_path / f"noise-{i}.json.gz"
        p.write_bytes(b"\x1f\x8b\x08\x00" + bytes(rng.randrange(256) for _ in range(512)))
        assert timeline_meta(str(p)) is None
