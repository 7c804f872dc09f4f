"""Damaged inputs are detected (issue 39, item 5), never turned into wrong numbers.

- CUDA snapshots: a real one (tests/data) edited by hand, each kind of damage on its own: what breaks the
  allocator's rules (a segment of 0 bytes or overlapping another, a block of 0 bytes, outside its segment or
  overlapping another, a flag that is not a boolean) is left out with one warning that counts it, and the figures
  are exactly those of the snapshot with the damaged part deleted by hand; every byte figure stays >= 0.
- Process memory: readings below the allocator's reserved memory are shown as contradicting it, not subtracted.
- A merged timeline (``fsdpprof timeline``) with one rank's events deleted: that rank is named missing and counted
  out by report, overlap and compare.
"""
from __future__ import annotations

import copy
import gzip
import json
import pickle
import re

import pytest

from conftest import run_fsdpprof, shared_data
from fsdpprof import runfmt
from fsdpprof.analyze.memory import safe_pickle, snapshot_memory
from fsdpprof.analyze.memory.process import CONTRADICTS_ALLOCATOR, process_memory
from fsdpprof.analyze.memory.snapshot import parse_snapshot
from fsdpprof.analyze.summary import findings as fnd

LEGACY = ("cuda-snapshots", "flexgen-opt1.3b-legacy.pickle")          # in tests/data: always there
GIB = 1 << 30


def _addressed(raw: dict) -> dict:
    """``raw`` with every block's address written out as torch's tools lay legacy blocks out (from the segment's
    address, one after the other): the same snapshot, whose blocks can then be moved."""
    out = copy.deepcopy(raw)
    for s in out["segments"]:
        at = s["address"]
        for b in s["blocks"]:
            b.setdefault("address", at)
            at = b["address"] + b["size"]
    return out


def _figures(snap) -> dict:
    """What the report shows of a snapshot: per device the peak, the rounding and every fragmentation entry."""
    out = {}
    for dev in snap.devices:
        res = snapshot_memory(snap, device=dev)
        out[dev] = {"peak": res.peak_allocated_bytes, "reserved": res.reserved_bytes,
                    "rounding": res.rounding_end_bytes, "fragmentation": res.fragmentation.to_list()}
    return out


def _byte_figures(obj, where=""):
    """(where, value) of every number under a key ending in _bytes in ``obj`` (dicts / lists)."""
    if isinstance(obj, dict):
        for k, v in obj.items():
            if k.endswith("_bytes") and isinstance(v, (int, float)) and not isinstance(v, bool):
                yield f"{where}.{k}", v
            else:
                yield from _byte_figures(v, f"{where}.{k}")
    elif isinstance(obj, list):
        for i, v in enumerate(obj):
            yield from _byte_figures(v, f"{where}[{i}]")


@pytest.fixture(scope="module")
def legacy():
    return _addressed(safe_pickle.load(shared_data(*LEGACY)))


def _blocks(raw, pred):
    """(segment index, block index) of the blocks for which ``pred(segment, block)`` holds."""
    return [(i, j) for i, s in enumerate(raw["segments"]) for j, b in enumerate(s["blocks"]) if pred(s, b)]


def test_addresses_written_out_change_nothing(legacy):
    """The base of every case below: the legacy snapshot with its block addresses written out reads the same."""
    plain = parse_snapshot(safe_pickle.load(shared_data(*LEGACY)), "plain")
    assert _figures(parse_snapshot(legacy, "addressed")) == _figures(plain)
    assert parse_snapshot(legacy, "addressed").defects == []


def _damages(raw: dict) -> dict:
    """kind -> (damaged snapshot, the same with the damaged parts deleted by hand, words of its warning, count)."""
    out = {}
    # segments of 0 bytes (three of them, with their blocks)
    d, e = copy.deepcopy(raw), copy.deepcopy(raw)
    for i in (3, 10, 20):
        d["segments"][i]["total_size"] = 0
    e["segments"] = [s for i, s in enumerate(e["segments"]) if i not in (3, 10, 20)]
    out["segment of 0 bytes"] = (d, e, "3 segment(s) of 0 bytes", 3)
    # a segment that overlaps another (a copy of it, half a segment on)
    d = copy.deepcopy(raw)
    s = copy.deepcopy(d["segments"][5])
    s["address"] += s["total_size"] // 2
    for b in s["blocks"]:
        b["address"] += s["total_size"] // 2
    d["segments"].insert(6, s)
    out["overlapping segment"] = (d, copy.deepcopy(raw), "1 segment(s) overlapping another", 1)
    # blocks outside their segment: the last block of two segments moved past the segment's end
    d, e = copy.deepcopy(raw), copy.deepcopy(raw)
    for i in (0, 7):
        seg = d["segments"][i]
        seg["blocks"][-1]["address"] = seg["address"] + seg["total_size"] + 4096
        del e["segments"][i]["blocks"][-1]
    out["block outside its segment"] = (d, e, "2 block(s) lying (partly) outside their segment", 2)
    # a block that starts inside another block: a copy of an in-use one, 512 B on; and an exact duplicate
    d = copy.deepcopy(raw)
    (i, j), (k, m) = _blocks(d, lambda s, b: b["state"] == "active_allocated")[:2]
    dup = dict(d["segments"][i]["blocks"][j])
    dup["address"] += 512
    d["segments"][i]["blocks"].insert(j + 1, dup)
    d["segments"][k]["blocks"].insert(m + (2 if k == i else 1), dict(d["segments"][k]["blocks"][m]))
    out["overlapping blocks"] = (d, copy.deepcopy(raw), "2 block(s) overlapping another block", 2)
    # blocks of 0 bytes (a free one and one in use)
    d = copy.deepcopy(raw)
    seg = d["segments"][2]
    seg["blocks"].append({"address": seg["address"] + seg["total_size"] - 1, "size": 0, "state": "inactive"})
    seg["blocks"].insert(0, {"address": seg["address"], "size": 0, "state": "active_allocated",
                             "history": [{"real_size": 0, "addr": seg["address"]}]})
    out["block of 0 bytes"] = (d, copy.deepcopy(raw), "2 block(s) of segments of 0 bytes", 2)
    return out


KINDS = ["segment of 0 bytes", "overlapping segment", "block outside its segment", "overlapping blocks",
         "block of 0 bytes"]


@pytest.mark.parametrize("kind", KINDS)
def test_damaged_snapshot_is_read_as_with_the_damage_deleted(legacy, kind):
    damaged, deleted, words, n = _damages(legacy)[kind]
    snap = parse_snapshot(damaged, "damaged.pickle")
    said = [w for w in snap.warnings if words in w]
    assert len(said) == 1 and said[0].startswith("damaged.pickle: ") and said[0] in snap.defects, snap.warnings
    assert re.search(rf"\b{n} ", said[0])
    assert len(snap.defects) == 1, snap.defects          # one line per kind, and no other kind said
    assert _figures(snap) == _figures(parse_snapshot(deleted, "deleted.pickle"))
    for dev, figs in _figures(snap).items():
        bad = [(w, v) for w, v in _byte_figures(figs) if v < 0]
        assert not bad and figs["peak"] >= 0 and figs["rounding"] >= 0, (dev, bad)


def test_zero_size_segments_keep_every_byte_figure_non_negative():
    """The issue's case: every segment of the LM snapshot at 0 bytes gave allocated_bytes -12,803,188,224."""
    raw = safe_pickle.load(shared_data("cuda-snapshots", "lm-step-user-metadata.pickle"))
    for s in raw["segments"]:
        s["total_size"] = 0
    snap = parse_snapshot(raw, "zero.pickle")
    assert any(f"{len(raw['segments'])} segment(s) of 0 bytes" in w for w in snap.warnings)
    res = snapshot_memory(snap, device=0)
    neg = [(w, v) for w, v in _byte_figures({"f": res.fragmentation.to_list()}) if v < 0]
    assert not neg and res.peak_allocated_bytes > 0


def test_blocks_outside_their_segments_leave_the_peak_as_without_them():
    """The issue's case: blocks moved outside their segments shifted the LM snapshot's peak, with no warning."""
    raw = safe_pickle.load(shared_data("cuda-snapshots", "lm-step-user-metadata.pickle"))
    moved, deleted = copy.deepcopy(raw), copy.deepcopy(raw)
    n = 0
    for s, t in zip(moved["segments"], deleted["segments"]):
        for b in s["blocks"]:
            b["address"] += 4 * s["total_size"]
            n += 1
        t["blocks"] = []
    snap = parse_snapshot(moved, "moved.pickle")
    assert any(f"{n:,} block(s) lying (partly) outside their segment" in w for w in snap.warnings)
    assert _figures(snap) == _figures(parse_snapshot(deleted, "deleted.pickle"))


def test_allocated_bytes_below_the_blocks_in_use_are_repaired(legacy):
    """A segment saying 0 bytes allocated while blocks of it are in use: the blocks' sum taken, said, and the
    allocator's rounding (allocated - requested) never below 0."""
    d = copy.deepcopy(legacy)
    busy = [i for i, s in enumerate(d["segments"]) if any(b["state"] == "active_allocated" for b in s["blocks"])]
    for i in busy[:5]:
        d["segments"][i]["allocated_size"] = 0
        d["segments"][i]["requested_size"] = 1 << 40         # more than allocated: not taken
    snap = parse_snapshot(d, "alloc.pickle")
    (line,) = snap.defects
    assert line.startswith("alloc.pickle: 5 segment(s) say fewer bytes allocated than their blocks in use")
    assert _figures(snap) == _figures(parse_snapshot(legacy, "legacy"))
    assert (snap.segments["allocated_bytes"] >= snap.segments["requested_bytes"]).all()


def test_flags_must_be_booleans(legacy):
    """``is_expandable`` / ``expandable_segments`` of "yes please" are not true: left out, said once each."""
    d = copy.deepcopy(legacy)
    for i in (1, 4):
        d["segments"][i]["is_expandable"] = "yes please"
    d["segments"][6]["is_expandable"] = 1
    d["allocator_settings"] = {"expandable_segments": "yes please", "release_lock_on_cudamalloc": False,
                               "max_split_size": -1}
    snap = parse_snapshot(d, "flags.pickle")
    (seg_line,) = [w for w in snap.defects if "is_expandable" in w]
    assert seg_line.startswith("flags.pickle: 3 segment(s)") and "not expandable" in seg_line
    (set_line,) = [w for w in snap.defects if "allocator setting" in w]
    assert "1 allocator setting(s)" in set_line and "expandable_segments" in set_line
    assert not snap.segments["is_expandable"].any()
    assert snap.allocator_settings == {"release_lock_on_cudamalloc": False, "max_split_size": -1}
    res = snapshot_memory(snap, device=0)
    assert not any(e.expandable_segments for e in res.fragmentation.entries)
    # real booleans are read as they are, without a word
    ok = copy.deepcopy(legacy)
    ok["segments"][1]["is_expandable"] = True
    ok["allocator_settings"] = {"expandable_segments": True}
    snap = parse_snapshot(ok, "ok.pickle")
    assert snap.defects == [] and snap.allocator_settings == {"expandable_segments": True}
    assert snap.segments["is_expandable"].sum() == 1


def test_damaged_snapshot_through_the_report(legacy, tmp_path):
    """`fsdpprof report` on a snapshot with every kind of damage: exit 0, each kind said once with its count, and
    no byte figure of summary.json's memory below 0."""
    d = copy.deepcopy(legacy)
    d["segments"][3]["total_size"] = 0
    seg = d["segments"][0]
    seg["blocks"][-1]["address"] = seg["address"] + seg["total_size"] + 4096
    seg = d["segments"][2]
    seg["blocks"].append({"address": seg["address"], "size": 0, "state": "inactive"})
    seg = d["segments"][5]
    seg["blocks"].insert(1, dict(seg["blocks"][0]))
    seg["is_expandable"] = "yes please"
    path = tmp_path / "damaged.pickle"
    path.write_bytes(pickle.dumps(d, protocol=4))
    proc = run_fsdpprof("report", str(path), "-o", str(tmp_path / "r.html"))
    assert proc.returncode == 0, proc.stderr
    for words in ("1 segment(s) of 0 bytes", "1 block(s) lying (partly) outside", "1 block(s) of segments of 0 bytes",
                  "1 block(s) overlapping another block", "1 segment(s) whose is_expandable"):
        assert proc.stdout.count(words) == 1, (words, proc.stdout)
    summary = json.loads((tmp_path / "r.summary.json").read_text())
    neg = [(w, v) for w, v in _byte_figures(summary["memory"]) if v < 0]
    assert not neg, neg


# --------------------------------------------------------------------------- process memory
def _cuda_doc(samples) -> dict:
    keys = ("used_bytes", "reserved_bytes", "max_reserved_bytes", "allocated_bytes", "max_allocated_bytes")
    return {"rank": 2, runfmt.RANK_PROCESS_MEMORY: {
        "source": runfmt.PROCESS_MEMORY_NVML, "device": "cuda:2", "nccl_env": {},
        "samples": [dict(zip(("step",) + keys, s)) for s in samples]}}


def test_cuda_used_below_reserved_contradicts_the_allocator():
    # step, used, reserved, max reserved, allocated, max allocated: step 6 uses less than the allocator reserved
    info = _cuda_doc([(5, 70 * GIB, 60 * GIB, 62 * GIB, 50 * GIB, 55 * GIB),
                      (6, 40 * GIB, 61 * GIB, 64 * GIB, 51 * GIB, 56 * GIB)])
    p, notes = process_memory(info, None)
    assert p["outside_allocator_peak_bytes"] is None           # unknown, not 10 GiB (step 5) nor -21 GiB (step 6)
    assert "step 6" in p["contradiction"] and "1 of 2 samples" in p["contradiction"]
    (note,) = [n for n in notes if CONTRADICTS_ALLOCATOR in n]
    assert note.startswith("rank 2: ") and "unknown" in note
    assert p["used_peak_bytes"] == 70 * GIB and p["allocator_reserved_peak_bytes"] == 64 * GIB
    assert fnd.process_findings(p, 2) == []
    # consistent readings: no contradiction, the figure as before
    p, notes = process_memory(_cuda_doc([(5, 70 * GIB, 60 * GIB, 62 * GIB, 50 * GIB, 55 * GIB)]), None)
    assert p["outside_allocator_peak_bytes"] == 10 * GIB and p["contradiction"] is None and notes == []


def test_cpu_rss_below_the_allocators_peak_contradicts_it():
    info = {"rank": 0, runfmt.RANK_PROCESS_MEMORY: {"source": runfmt.PROCESS_MEMORY_PROC_STATUS, "device": "cpu",
                                                  "samples": [{"step": 3, "used_bytes": 1 * GIB,
                                                               "used_peak_bytes": 2 * GIB}]}}
    p, notes = process_memory(info, 3 * GIB)
    assert p["outside_allocator_peak_bytes"] is None and "below the allocator's peak" in p["contradiction"]
    assert any(CONTRADICTS_ALLOCATOR in n for n in notes)
    p, notes = process_memory(info, 1 * GIB)
    assert p["outside_allocator_peak_bytes"] == 1 * GIB and p["contradiction"] is None


def test_contradiction_in_the_reports_memory_block():
    """The report's table says "contradicts the allocator" for that rank and leaves its outside figure empty."""
    from types import SimpleNamespace

    from fsdpprof.report.memory import _process_block

    bad, _ = process_memory(_cuda_doc([(6, 40 * GIB, 61 * GIB, 64 * GIB, 51 * GIB, 56 * GIB)]), None)
    good, _ = process_memory(_cuda_doc([(5, 70 * GIB, 60 * GIB, 62 * GIB, 50 * GIB, 55 * GIB)]), None)
    a = SimpleNamespace(memory={0: SimpleNamespace(process=good), 1: SimpleNamespace(process=bad)}, overview={})
    html = _process_block(a)
    assert html.count(CONTRADICTS_ALLOCATOR) == 2                # the table's cell and the note naming the rank
    assert "rank 1: " + CONTRADICTS_ALLOCATOR in html
    assert "-21" not in html and "−21" not in html


# --------------------------------------------------------------------------- merged timelines
DLRM = ("gpu-traces", "param-dlrm-8rank-v100")


@pytest.fixture(scope="module")
def merged(tmp_path_factory):
    """The 8-rank DLRM traces as one merged timeline, and a copy with rank 3's events deleted by hand."""
    d = tmp_path_factory.mktemp("merged")
    whole = d / "dlrm.json.gz"
    proc = run_fsdpprof("timeline", str(shared_data(*DLRM)), "-o", str(whole))
    assert proc.returncode == 0, proc.stderr
    doc = json.loads(gzip.decompress(whole.read_bytes()))
    pid = next(p["pid"] for p in doc["otherData"]["ranks"] if p["rank"] == 3)
    n = len(doc["traceEvents"])
    doc["traceEvents"] = [e for e in doc["traceEvents"] if e.get("pid") != pid]
    assert len(doc["traceEvents"]) < n
    cut = d / "dlrm-no-rank-3.json.gz"
    cut.write_bytes(gzip.compress(json.dumps(doc).encode()))
    return whole, cut


def test_merged_timeline_without_a_ranks_events_names_it_missing(merged, tmp_path):
    whole, cut = merged
    proc = run_fsdpprof("report", str(cut), "-o", str(tmp_path / "r.html"))
    assert proc.returncode == 0, proc.stderr
    assert "ranks analysed 7" in proc.stdout
    (line,) = [ln for ln in proc.stdout.splitlines() if "PARTIAL" in ln]
    assert "rank 3 is missing" in line and "no event of it" in line
    ov = json.loads((tmp_path / "r.summary.json").read_text())["overview"]
    assert ov["ranks_analysed"] == 7 and 3 not in ov["ranks_present"]
    assert ov["ranks_missing"] == [f"{cut.name}:rank-3"]
    # the whole timeline: every rank analysed, none missing
    proc = run_fsdpprof("report", str(whole), "-o", str(tmp_path / "w.html"))
    assert proc.returncode == 0 and "ranks analysed 8" in proc.stdout and "PARTIAL" not in proc.stdout


def test_merged_timeline_without_a_ranks_events_in_overlap_and_compare(merged, tmp_path):
    whole, cut = merged
    proc = run_fsdpprof("overlap", str(cut))
    assert proc.returncode == 0, proc.stderr
    assert "rank 3 is missing" in proc.stderr
    table = proc.stdout[proc.stdout.index("per rank"):proc.stdout.index("collective volume")]
    assert not re.search(r"^\s+3\s", table, re.M) and re.search(r"^\s+4\s", table, re.M)
    proc = run_fsdpprof("compare", str(whole), str(cut), "-o", str(tmp_path / "c.html"))
    assert proc.returncode == 0, proc.stderr
    (line,) = [ln for ln in proc.stdout.splitlines() if "PARTIAL" in ln]
    assert "ranks 0-2, 4-7 only" in line and "rank 3 is missing" in line
