"""Fragmentation of the CUDA caching allocator (fsdpprof.analyze.memory.fragmentation).

At the end / OOM: the figures equal the snapshot's own blocks, summed here from the pickle with a few plain
lines.  At the peak: the trace replayed backwards gives the allocator's state at the peak, checked against
hand-built snapshots whose state at the peak is known (tests/fsdp_snapshots.py's allocator model, its
segments copied at that moment) and, on the real snapshots, against what they say themselves (replayed to
their last entry: their segments; reserved memory: the segment actions summed from the pickle).
"""
from __future__ import annotations

import copy
import json

import pytest

from conftest import shared_data
from fsdp_snapshots import MIB, Recorder
from fsdpprof.analyze.memory import safe_pickle, snapshot_memory
from fsdpprof.analyze.memory.fragmentation import fragmentation
from fsdpprof.analyze.memory.snapshot import load_snapshot, parse_snapshot
from fsdpprof.analyze.load.frames import json_safe
from fsdpprof.report.summary import memory_summary

SNAP = "cuda-snapshots"
NAMES = ["lm-step-user-metadata.pickle", "qlora-tinyllama-legacy.pickle", "multi-device-expandable-oom.pickle",
         "flexgen-opt1.3b-legacy.pickle", "flexgen-state-only.pickle"]
FIELDS = ["reserved_bytes", "allocated_bytes", "free_bytes", "largest_free_block_bytes", "free_blocks",
          "free_small_bytes", "free_large_bytes", "expandable_segments", "segments"]


def truth(segments: list[dict], device: int = 0) -> dict:
    """The figures of a snapshot's segments, from their blocks (the free ones are the inactive blocks)."""
    segs = [s for s in segments if s["device"] == device]
    free = [(b["size"], s["segment_type"]) for s in segs for b in s["blocks"] if b["state"] == "inactive"]
    reserved = sum(s["total_size"] for s in segs)
    return {"reserved_bytes": reserved, "allocated_bytes": reserved - sum(n for n, _ in free),
            "free_bytes": sum(n for n, _ in free), "largest_free_block_bytes": max((n for n, _ in free), default=0),
            "free_blocks": len(free), "free_small_bytes": sum(n for n, t in free if t == "small"),
            "free_large_bytes": sum(n for n, t in free if t == "large"),
            "expandable_segments": any(s.get("is_expandable") is True for s in segs), "segments": len(segs)}


def figures(entry) -> dict:
    return {k: getattr(entry, k) for k in FIELDS}


# --------------------------------------------------------------------------- the real snapshots
@pytest.mark.parametrize("name", NAMES)
def test_end_equals_the_snapshots_blocks(name):
    path = shared_data(SNAP, name)
    raw = safe_pickle.load(path)
    snap = load_snapshot(path)
    for dev in sorted({s["device"] for s in raw["segments"]}):
        res = snapshot_memory(snap, device=dev)
        last = res.fragmentation.entries[-1]
        ooms = [e for e in (raw["device_traces"][dev] if dev < len(raw["device_traces"]) else [])
                if e["action"] == "oom"]
        assert last.source == "segments" and last.at in ("end", "oom")
        assert figures(last) == truth(raw["segments"], dev), (name, dev)
        assert last.pending_free_bytes == sum(b["size"] for s in raw["segments"] if s["device"] == dev
                                              for b in s["blocks"] if b["state"] == "active_pending_free")
        assert last.free_bytes == last.reserved_bytes - last.allocated_bytes
        sizes = sorted(b["size"] for s in raw["segments"] if s["device"] == dev for b in s["blocks"]
                       if b["state"] == "inactive")
        assert sum(c["count"] for c in last.free_blocks_by_size) == len(sizes)
        assert sum(c["bytes"] for c in last.free_blocks_by_size) == sum(sizes)
        for c in last.free_blocks_by_size:
            assert c["count"] == sum(1 for n in sizes if c["lo_bytes"] <= n < c["hi_bytes"])
        if last.at == "oom":
            assert last.largest_request_after_bytes == ooms[0]["size"]
        # summary.json carries it as memory[rank].fragmentation
        out = json.loads(json.dumps(json_safe(memory_summary(res))))
        assert out["fragmentation"][-1] == json.loads(json.dumps(last.to_dict()))
        assert out["fragmentation_notes"] == res.fragmentation.notes


@pytest.mark.parametrize("name", [n for n in NAMES if n != "flexgen-state-only.pickle"])
def test_replay_of_the_real_traces_matches_their_segments(name):
    """Replayed to the last entry the state is the snapshot's own (blocks rebuilt from requested sizes and the
    allocator's rules); replayed to the peak, reserved memory is the end's minus the segment actions after it."""
    path = shared_data(SNAP, name)
    raw = safe_pickle.load(path)
    snap = load_snapshot(path)
    for dev, trace in enumerate(raw["device_traces"]):
        if not any(e["action"] == "alloc" for e in trace):
            continue
        segs = [s for s in raw["segments"] if s["device"] == dev]
        res = snapshot_memory(snap, device=dev)
        peak = res.fragmentation.at("peak")
        if snap.has_time or any(e["action"].startswith("segment") for e in trace):
            assert peak is not None and peak.source == "replay", res.fragmentation.notes
        else:
            assert peak is None
            continue
        delta = {"segment_alloc": 1, "segment_map": 1, "segment_free": -1, "segment_unmap": -1}
        after = sum(delta.get(e["action"], 0) * e["size"] for e in trace[res.peak_seq + 1:])
        assert peak.reserved_bytes == sum(s["total_size"] for s in segs) - after
        assert peak.allocated_bytes >= res.peak_allocated_bytes     # blocks are requests rounded up
        assert peak.largest_request_after_bytes == max(
            (e["size"] for e in trace[res.peak_seq + 1:] if e["action"] in ("alloc", "oom")), default=None)
        # the whole trace undone, back to before its first entry: every entry matches the segments
        first = fragmentation(snap, dev, -1).at("peak")
        assert first is not None and first.reserved_bytes == sum(s["total_size"] for s in segs) - sum(
            delta.get(e["action"], 0) * e["size"] for e in trace)
        at_last = fragmentation(snap, dev, len(trace) - 1)
        assert figures(at_last.at("peak")) == truth(raw["segments"], dev)
        assert not any("do not match" in n for n in at_last.notes + res.fragmentation.notes)


def test_oom_followed_by_frees_is_replayed_back_to_the_oom():
    """The shared OOM snapshot: its OOM (cuda:1) is followed by the frees of the unwinding: the "oom" entry
    comes from the replay, the "end" from the segments; the request is the OOM's."""
    path = shared_data(SNAP, "multi-device-expandable-oom.pickle")
    raw = safe_pickle.load(path)
    snap = load_snapshot(path)
    res = snapshot_memory(snap, device=1)
    trace = raw["device_traces"][1]
    i = next(k for k, e in enumerate(trace) if e["action"] == "oom")
    assert i < len(trace) - 1                                    # (the premise: entries follow it)
    f = res.fragmentation
    assert [e.at for e in f.entries][-2:] == ["oom", "end"] and f.at("oom").seq == i
    assert f.at("oom").source == "replay" and f.at("oom").largest_request_after_bytes == trace[i]["size"]
    assert f.at("oom").expandable_segments
    # nothing after the OOM maps or unmaps memory here: the same reserved bytes, fewer of them free at the OOM
    assert not any(e["action"].startswith("segment") for e in trace[i + 1:])
    assert f.at("oom").reserved_bytes == f.at("end").reserved_bytes
    freed_after = sum(e["size"] for e in trace[i + 1:] if e["action"] == "free_completed") \
        - sum(e["size"] for e in trace[i + 1:] if e["action"] == "alloc")
    assert f.at("oom").free_bytes < f.at("end").free_bytes and freed_after > 0
    assert res.oom is not None


# --------------------------------------------------------------------------- hand-built: the peak known
def _fragmented(rec: Recorder, with_oom: bool = False) -> tuple[dict, int, list[dict]]:
    """A run that fragments the large pool: 3 MiB blocks, every other one freed, the holes partly reused (one
    2.5 MiB request keeps its 0.5 MiB rest: not split off), then the peak (a 30 MiB tensor); afterwards
    frees, ``empty_cache`` (segment_free) and new segments.  Returns (snapshot, peak seq, segments at the peak)."""
    rec.recording = True
    big = [rec.alloc(3 * MIB, [], "activation", None) for _ in range(9)]
    small = [rec.alloc(100_000 + 512 * k, [], "activation", None) for k in range(6)]
    for a in big[1::2]:
        rec.free(a, [])
    for a in small[::2]:
        rec.free(a, [])
    unsplit = rec.alloc(int(2.5 * MIB), [], "activation", None)
    split = rec.alloc(int(1.5 * MIB) + 100, [], "activation", None)
    if with_oom:
        rec.oom(64 * MIB, [], device_free=5 * MIB)
    else:
        rec.alloc(30 * MIB, [], "activation", None)
    peak_seq = len(rec.trace) - 1
    at_peak = copy.deepcopy(rec.al.segments(0))
    for a in big[0::2] + [unsplit, split] + small[1::2]:     # (unsplit freed once the block after it is free)
        rec.free(a, [])
    rec.al.empty_cache(rec._entry)
    rec.alloc(5 * MIB, [], "activation", None)
    rec.alloc(7_000, [], "activation", None)
    return rec.snapshot(), peak_seq, at_peak


def test_peak_replay_gives_the_allocators_state_at_the_peak():
    snap_raw, peak_seq, at_peak = _fragmented(Recorder())
    assert any(e["action"] == "segment_free" for e in snap_raw["device_traces"][0])
    snap = parse_snapshot(snap_raw)
    res = snapshot_memory(snap)
    assert res.peak_seq == peak_seq                              # (the premise: the 30 MiB tensor makes the peak)
    f = res.fragmentation
    assert [e.at for e in f.entries] == ["peak", "end"], f.notes
    want = truth(at_peak)
    assert figures(f.at("peak")) == want
    # fragmented: free memory in holes of the large pool, the largest smaller than the free bytes
    assert want["free_blocks"] >= 4 and want["largest_free_block_bytes"] < want["free_large_bytes"]
    trace = snap_raw["device_traces"][0]
    assert f.at("peak").largest_request_after_bytes == max(e["size"] for e in trace[peak_seq + 1:]
                                                           if e["action"] == "alloc")
    assert figures(f.at("end")) == truth(snap_raw["segments"])
    assert f.at("peak").reserved_bytes != f.at("end").reserved_bytes     # (segments were freed and made after)


def test_peak_replay_without_the_size_rules_would_be_wrong():
    """The 2.5 MiB block keeps the 0.5 MiB rest of its 3 MiB hole: rounding the request alone would show a
    0.5 MiB free block at the peak that the allocator did not have."""
    snap_raw, peak_seq, at_peak = _fragmented(Recorder())
    sizes = sorted(b["size"] for s in at_peak for b in s["blocks"] if b["state"] != "inactive")
    assert 3 * MIB in sizes and not any(b["size"] <= MIB for s in at_peak if s["segment_type"] == "large"
                                        for b in s["blocks"] if b["state"] == "inactive")
    f = fragmentation(parse_snapshot(snap_raw), 0, peak_seq)
    assert f.at("peak").free_blocks == truth(at_peak)["free_blocks"]


def test_oom_at_the_end_comes_from_the_segments_and_an_earlier_one_from_the_replay():
    # the snapshot taken at the OOM: nothing after it, the "oom" entry is the segments'
    rec = Recorder()
    rec.recording = True
    for _ in range(3):
        rec.alloc(3 * MIB, [], "activation", None)
    rec.oom(40 * MIB, [], device_free=MIB)
    raw = rec.snapshot()
    f = fragmentation(parse_snapshot(raw), 0, len(raw["device_traces"][0]) - 2)
    assert [(e.at, e.source) for e in f.entries] == [("peak", "replay"), ("oom", "segments")]
    assert f.at("oom").largest_request_after_bytes == 40 * MIB
    assert figures(f.at("oom")) == truth(raw["segments"])
    # frees after the OOM: the "oom" entry is replayed, and equals the allocator's state at the OOM
    snap_raw, oom_seq, at_oom = _fragmented(Recorder(), with_oom=True)
    res = snapshot_memory(parse_snapshot(snap_raw))
    assert [e.at for e in res.fragmentation.entries][-2:] == ["oom", "end"]
    assert res.fragmentation.at("oom").seq == oom_seq
    assert figures(res.fragmentation.at("oom")) == truth(at_oom)
    assert res.fragmentation.at("oom").largest_request_after_bytes == 64 * MIB


def _legacy(raw: dict, drop_segment_actions: bool, drop_time: bool) -> dict:
    raw = copy.deepcopy(raw)
    trace = raw["device_traces"][0]
    if drop_segment_actions:
        trace[:] = [e for e in trace if not e["action"].startswith("segment")]
    for e in trace:
        if drop_time:
            e.pop("time_us", None)
            e.pop("compile_context", None)
    if drop_time:
        raw.pop("allocator_settings", None)
        for s in raw["segments"]:
            for b in s["blocks"]:
                b.pop("address")                 # legacy blocks: laid out from the segment's address
    return raw


def test_legacy_snapshot_without_segment_actions_has_no_peak_entry():
    snap_raw, peak_seq, _ = _fragmented(Recorder())
    raw = _legacy(snap_raw, drop_segment_actions=True, drop_time=True)
    snap = parse_snapshot(raw)
    res = snapshot_memory(snap)
    f = res.fragmentation
    assert [e.at for e in f.entries] == ["end"]
    assert len(f.notes) == 1 and "no segment actions" in f.notes[0] and "peak" in f.notes[0]
    assert figures(f.at("end")) == truth(raw["segments"])
    assert memory_summary(res)["fragmentation_notes"] == f.notes
    # the same legacy snapshot with its segment actions: the peak is there
    raw = _legacy(snap_raw, drop_segment_actions=False, drop_time=True)
    f = fragmentation(parse_snapshot(raw), 0, peak_seq)
    assert f.at("peak") is not None and not f.notes


def test_trace_that_does_not_match_the_segments_gives_no_peak():
    """Segment actions missing from a trace with time_us (cut out here) while segments were freed after the
    peak: blocks freed after the peak lie outside the end's segments; said, and no peak entry."""
    snap_raw, peak_seq, _ = _fragmented(Recorder())
    raw = _legacy(snap_raw, drop_segment_actions=True, drop_time=False)
    f = snapshot_memory(parse_snapshot(raw)).fragmentation
    assert [e.at for e in f.entries] == ["end"]
    assert any("do not match the segments" in n for n in f.notes), f.notes


def test_no_history_gives_the_end_only():
    snap_raw, _, _ = _fragmented(Recorder())
    raw = dict(snap_raw, device_traces=[[]])
    res = snapshot_memory(parse_snapshot(raw))
    assert [e.at for e in res.fragmentation.entries] == ["end"]
    assert "no allocation history" in res.fragmentation.notes[0]
    assert res.fragmentation.at("end").largest_request_after_bytes is None


def test_expandable_segments_map_and_unmap_replayed():
    """Expandable segments, written by hand: two 20 MiB pages mapped one after the other make one segment,
    blocks merge across the page border; after the peak one page is unmapped and a 2 MiB small page mapped."""
    A, S = 0x7000_0000_0000, 0x7100_0000_0000
    e = []

    def entry(action, addr, size):
        e.append({"action": action, "addr": addr, "size": size, "stream": 0, "time_us": 1000 + len(e),
                  "frames": []})
    entry("segment_map", A, 20 * MIB)
    entry("alloc", A, 8 * MIB)                     # [A, A+8)
    entry("alloc", A + 8 * MIB, 10 * MIB)          # [A+8, A+18)
    entry("segment_map", A + 20 * MIB, 20 * MIB)   # one mapped range [A, A+40)
    entry("alloc", A + 18 * MIB, 12 * MIB)         # [A+18, A+30): across the page border
    entry("free_completed", A + 8 * MIB, 10 * MIB)   # peak: used [A, A+8) and [A+18, A+30): free 10 + 10 MiB
    peak_seq = len(e) - 1
    entry("free_completed", A + 18 * MIB, 12 * MIB)
    entry("segment_unmap", A + 20 * MIB, 20 * MIB)
    entry("segment_map", S, 2 * MIB)
    entry("alloc", S, 1000)
    blocks_a = [{"address": A, "size": 8 * MIB, "requested_size": 8 * MIB, "state": "active_allocated"},
                {"address": A + 8 * MIB, "size": 12 * MIB, "requested_size": 0, "state": "inactive"}]
    blocks_s = [{"address": S, "size": 1024, "requested_size": 1000, "state": "active_allocated"},
                {"address": S + 1024, "size": 2 * MIB - 1024, "requested_size": 0, "state": "inactive"}]
    segs = [{"device": 0, "address": A, "total_size": 20 * MIB, "allocated_size": 8 * MIB, "active_size": 8 * MIB,
             "requested_size": 8 * MIB, "stream": 0, "segment_type": "large", "is_expandable": True, "blocks": blocks_a},
            {"device": 0, "address": S, "total_size": 2 * MIB, "allocated_size": 1024, "active_size": 1024,
             "requested_size": 1000, "stream": 0, "segment_type": "small", "is_expandable": True, "blocks": blocks_s}]
    raw = {"segments": segs, "device_traces": [e]}
    f = fragmentation(parse_snapshot(raw), 0, peak_seq)
    assert not f.notes
    assert figures(f.at("end")) == truth(segs)
    assert figures(f.at("peak")) == {
        "reserved_bytes": 40 * MIB, "allocated_bytes": 20 * MIB, "free_bytes": 20 * MIB,
        "largest_free_block_bytes": 10 * MIB, "free_blocks": 2, "free_small_bytes": 0, "free_large_bytes": 20 * MIB,
        "expandable_segments": True, "segments": 1}
    assert f.at("peak").largest_request_after_bytes == 1000
