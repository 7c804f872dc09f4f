"""Memory attribution from real CUDA snapshots (../shared/data/cuda-snapshots) and bad snapshot input."""
from __future__ import annotations

import gzip
import json
import os
import pickle

import pytest

from conftest import run_fsdpprof, shared_data
from fsdpprof.analyze.memory import safe_pickle
from fsdpprof.analyze.memory import memory_analysis, snapshot_memory
from fsdpprof.analyze.load.run import load_run
from fsdpprof.analyze.model import MEMORY_CATEGORIES
from fsdpprof.analyze.memory.snapshot import NEVER, load_snapshot
from fsdpprof.errors import UserError

SNAP = "cuda-snapshots"
MIB = 2 ** 20

# Coverage (% of bytes alive at the peak in a named category) per public file and device, as measured
# when this was written. These snapshots are not FSDP runs and carry no tags: labels come from frames
# and lifetimes. What is not named is memory allocated before the history began (no frames: the model
# weights / optimizer state of those jobs): `before_recording`. A drop below these figures is a regression.
# Peaks count requested sizes throughout, as torch's own viewer does (test_peak_is_memory_viz_peak).
EXPECTED = {
    # file, device: (peak bytes, coverage %, peak phase)
    ("lm-step-user-metadata.pickle", 0): (13923997700, 92.49, "forward"),
    ("qlora-tinyllama-legacy.pickle", 0): (5876132840, 81.35, "backward"),
    ("multi-device-expandable-oom.pickle", 0): (8456473388, 100.0, "forward"),
    ("multi-device-expandable-oom.pickle", 1): (84063351764, 100.0, "forward"),
    ("multi-device-expandable-oom.pickle", 2): (21564645800, 100.0, "forward"),
}

# reserved bytes at the peak: qlora's allocator mapped 130 MB of segments after its peak; the others
# peak with all their segments mapped (the OOM device peaks just before failing: 0.17 % unused)
RESERVED_AT_PEAK = {
    ("lm-step-user-metadata.pickle", 0): 14180941824,
    ("qlora-tinyllama-legacy.pickle", 0): 6341787648,
    ("multi-device-expandable-oom.pickle", 0): 8541700096,
    ("multi-device-expandable-oom.pickle", 1): 84202749952,
    ("multi-device-expandable-oom.pickle", 2): 21883781120,
}


@pytest.fixture(scope="module")
def snaps():
    out = {}
    for name in {k[0] for k in EXPECTED}:
        out[name] = load_snapshot(shared_data(SNAP, name))
    return out


@pytest.mark.parametrize("name,device", sorted(EXPECTED))
def test_public_snapshot_breakdown(snaps, name, device):
    peak, cov, phase = EXPECTED[(name, device)]
    snap = snaps[name]
    r = snapshot_memory(snap, device=device)
    print(f"{name} cuda:{device}: peak {r.peak_allocated_bytes / MIB:.1f} MiB, coverage {r.coverage_pct:.2f} %, "
          f"phase {r.peak_stage}\n{r.breakdown_at_peak.to_string()}")
    assert r.source == "cuda_snapshot" and r.device == device
    # the peak is the real maximum of the allocated-bytes curve: recompute it independently
    a = r.allocations
    alive_at_end = int(a.loc[a["free_seq"] == NEVER, "bytes"].sum())
    assert r.peak_allocated_bytes >= alive_at_end
    assert r.peak_allocated_bytes == peak
    assert r.coverage_pct >= cov - 0.01
    assert r.peak_stage == phase
    bd = r.breakdown_at_peak
    assert list(bd["category"]) == MEMORY_CATEGORIES
    assert int(bd["bytes"].sum()) == r.peak_allocated_bytes
    assert abs(bd["pct"].sum() - 100.0) < 1e-6
    # the timeline is downsampled but keeps the peak, and its columns are the categories
    tl = r.timeline
    assert tl is not None and len(tl) <= 2002
    assert list(tl.columns) == ["ts_us"] + MEMORY_CATEGORIES
    assert int(tl.drop(columns="ts_us").sum(axis=1).max()) == r.peak_allocated_bytes
    assert tl["ts_us"].is_monotonic_increasing
    # largest allocations at the peak, biggest first, with frames where the snapshot has them
    top = r.top_allocations
    assert list(top.columns) == ["addr", "bytes", "category", "stage", "unit", "alloc_us", "free_us", "frames"]
    assert top["bytes"].is_monotonic_decreasing
    assert 0 < int(top["bytes"].sum()) <= r.peak_allocated_bytes
    # reserved at the peak (segments at snapshot time minus segments mapped after the peak)
    assert r.reserved_bytes == RESERVED_AT_PEAK[(name, device)]
    assert r.peak_allocated_bytes <= r.reserved_bytes <= r.reserved_end_bytes
    assert r.fragmentation_pct == pytest.approx(100 * (r.reserved_bytes - peak) / r.reserved_bytes)


def test_trace_sizes_agree_with_segments(snaps):
    """Allocations alive at snapshot time (trace replay + pre-history blocks) are exactly the bytes the
    live blocks requested, as torch's own _memory_viz reads them (``_block_extra``); the allocator's
    blocks are larger by its rounding, which the result reports apart (``rounding_end_bytes``)."""
    from torch.cuda import _memory_viz as mv
    for name, snap in snaps.items():
        raw = safe_pickle.load(shared_data(SNAP, name))
        a = snap.allocations
        alive = a[a["free_seq"] == NEVER].groupby("device")["bytes"].sum()
        for dev in sorted(snap.segments["device"].unique()):
            segs = [sg for sg in raw["segments"] if sg["device"] == dev]
            torch_requested = sum(mv._block_extra(b)[1] for sg in segs for b in sg["blocks"]
                                  if b["state"] == "active_allocated")
            blocks = sum(b["size"] for sg in segs for b in sg["blocks"] if b["state"] == "active_allocated")
            assert alive.get(dev, 0) == torch_requested, (name, dev)
            r = snapshot_memory(snap, device=int(dev))
            assert r.rounding_end_bytes == blocks - torch_requested >= 0


def test_layouts(snaps):
    legacy = snaps["qlora-tinyllama-legacy.pickle"]
    assert not legacy.has_time and any("legacy" in w for w in legacy.warnings)
    assert snapshot_memory(legacy).timeline_unit == "event_index"
    new = snaps["lm-step-user-metadata.pickle"]
    assert new.has_time and snapshot_memory(new).timeline_unit == "us"
    multi = snaps["multi-device-expandable-oom.pickle"]
    assert sorted(multi.allocations["device"].unique()) == [0, 1, 2]
    assert bool(multi.segments["is_expandable"].any())
    # one OOM, on cuda:1: 5.31 GB requested with 95.7 MB free
    assert [(o["device"], o["requested_bytes"], o["free_bytes"]) for o in multi.ooms] == [(1, 5308694528, 95682560)]
    r = snapshot_memory(multi)  # no device given: the one with the largest peak, and a warning naming the others
    assert r.device == 1 and r.oom["requested_bytes"] == 5308694528 and r.oom["free_bytes"] == 95682560
    assert any("3 devices" in w for w in r.warnings)
    assert snapshot_memory(multi, device=0).oom is None


def test_load_run_on_bare_snapshot_and_gzip(tmp_path):
    src = shared_data(SNAP, "lm-step-user-metadata.pickle")
    gz = tmp_path / "rank3_memory_snapshot.pickle.gz"
    gz.write_bytes(gzip.compress(src.read_bytes()))
    plain = memory_analysis(load_run(str(src)).ranks[0])
    run = load_run(str(gz))
    zipped = memory_analysis(run.ranks[3])
    assert zipped.rank == 3
    assert zipped.peak_allocated_bytes == plain.peak_allocated_bytes == EXPECTED[(src.name, 0)][0]
    assert zipped.breakdown_at_peak.equals(plain.breakdown_at_peak)


def test_snapshot_without_history(tmp_path, snaps):
    raw = safe_pickle.load(shared_data(SNAP, "qlora-tinyllama-legacy.pickle"))
    raw["device_traces"] = [[]]
    p = tmp_path / "nohist.pickle"
    p.write_bytes(pickle.dumps(raw))
    s = load_snapshot(p)
    assert any("without allocation history" in w for w in s.warnings)
    r = snapshot_memory(s)
    live = sum(b["requested_size"] for seg in raw["segments"] for b in seg["blocks"] if b["state"] == "active_allocated")
    assert r.peak_allocated_bytes == live > 0
    # nothing says what those blocks hold: allocated before recording, with their sizes
    assert r.breakdown_at_peak.set_index("category")["bytes"]["before_recording"] > 0.5 * live
    sizes = r.before_recording_sizes
    assert int(sizes["total_bytes"].sum()) == r.breakdown_at_peak.set_index("category")["bytes"]["before_recording"]
    assert (sizes["total_bytes"] == sizes["bytes"] * sizes["count"]).all()
    assert r.timeline is None and r.peak_ts_us is None
    assert any("timeline unavailable" in w for w in r.warnings)


# --------------------------------------------------------------------------- bad input
class _Evil:
    def __init__(self, marker):
        self.marker = marker

    def __reduce__(self):
        return (os.system, (f"touch {self.marker}",))


def test_pickle_global_refused_and_not_run(tmp_path):
    marker = tmp_path / "PAYLOAD_RAN"
    p = tmp_path / "evil.pickle"
    p.write_bytes(pickle.dumps({"segments": [_Evil(marker)], "device_traces": []}))
    with pytest.raises(UserError) as ei:
        load_snapshot(p)
    msg = str(ei.value)
    assert "refusing" in msg and "system" in msg and "\n" not in msg
    assert not marker.exists()
    # gzipped, and an old-protocol pickle (GLOBAL opcode) too
    p.write_bytes(gzip.compress(pickle.dumps(_Evil(marker), protocol=0)))
    with pytest.raises(UserError, match="refusing"):
        load_snapshot(p)
    assert not marker.exists()


def test_pickle_global_refused_from_cli(tmp_path):
    marker = tmp_path / "PAYLOAD_RAN"
    p = tmp_path / "evil.pickle"
    p.write_bytes(pickle.dumps({"segments": [_Evil(marker)], "device_traces": []}))
    proc = run_fsdpprof("report", str(p), "-o", str(tmp_path / "r.html"), timeout=300)
    assert not marker.exists()
    assert proc.returncode == 2, (proc.returncode, proc.stdout[-2000:], proc.stderr[-2000:])
    assert "refusing" in proc.stderr and "Traceback" not in proc.stderr


@pytest.mark.parametrize("kind", ["empty", "truncated"])
def test_broken_pickle_from_cli(tmp_path, kind):
    p = tmp_path / "rank0_memory_snapshot.pickle"
    data = shared_data(SNAP, "lm-step-user-metadata.pickle").read_bytes()
    p.write_bytes(b"" if kind == "empty" else data[: len(data) // 3])
    proc = run_fsdpprof("report", str(p), "-o", str(tmp_path / "r.html"), timeout=300)
    assert proc.returncode == 2, (proc.stdout[-1500:], proc.stderr[-1500:])
    err = proc.stderr.strip()
    assert len(err.splitlines()) == 1 and kind in err and str(p) in err


def test_report_on_public_snapshot_from_cli(tmp_path):
    src = shared_data(SNAP, "multi-device-expandable-oom.pickle")
    proc = run_fsdpprof("report", str(src), "-o", str(tmp_path / "r.html"), timeout=300)
    assert proc.returncode == 0, proc.stderr[-2000:]
    summary = json.loads((tmp_path / "r.summary.json").read_text())
    mem = summary["memory"]
    m = mem[next(iter(mem))]
    assert m["peak_allocated_bytes"] == EXPECTED[(src.name, 1)][0]
    assert m["oom"]["requested_bytes"] == 5308694528


@pytest.mark.parametrize("content,what", [(b"", "empty"), (None, "truncated"), (b"\x1f\x8b\x08\x00garbage", "gzip"),
                                          (b"not a pickle at all", "not a readable pickle")])
def test_broken_pickles(tmp_path, content, what):
    if content is None:
        content = shared_data(SNAP, "lm-step-user-metadata.pickle").read_bytes()[:100_000]
    p = tmp_path / "bad.pickle"
    p.write_bytes(content)
    with pytest.raises(UserError) as ei:
        load_snapshot(p)
    assert what in str(ei.value) and str(p) in str(ei.value) and "\n" not in str(ei.value)


def test_not_a_snapshot(tmp_path):
    p = tmp_path / "x.pickle"
    p.write_bytes(pickle.dumps({"hello": [1, 2, 3]}))
    with pytest.raises(UserError, match="not a CUDA memory snapshot"):
        load_snapshot(p)


def test_folder_of_per_rank_snapshots(tmp_path):
    """torchtitan-style folder: rank<r>_memory_snapshot.pickle, one MemoryResult per rank."""
    names = {0: "lm-step-user-metadata.pickle", 1: "qlora-tinyllama-legacy.pickle"}
    for r, name in names.items():
        (tmp_path / f"rank{r}_memory_snapshot.pickle").write_bytes(shared_data(SNAP, name).read_bytes())
    run = load_run(str(tmp_path))
    assert sorted(run.ranks) == [0, 1]
    for r, name in names.items():
        m = memory_analysis(run.ranks[r])
        assert m.rank == r and m.peak_allocated_bytes == EXPECTED[(name, 0)][0]


def test_inventory_addresses_label_snapshot_blocks(snaps):
    """Exact labels on a snapshot: an inventory naming storages alive at snapshot time (as our
    recorder writes for a CUDA run) labels exactly those blocks, whatever frames/lifetimes say."""
    snap = snaps["lm-step-user-metadata.pickle"]
    a = snap.allocations
    live = a[(a["free_seq"] == NEVER) & a["before_trace"]].nlargest(6, "bytes")
    roles = ["param", "param", "param", "optimizer_state", "optimizer_state", "optimizer_state"]
    inv = {"schema": "fsdpprof.inventory/1", "rank": 0, "world_size": 1, "tensors": [
        {"role": role, "name": f"t{i}", "unit": "layers.0", "bytes": int(b), "storage_ptr": int(ad),
         "storage_nbytes": int(b), "step": 1} for i, (role, ad, b) in enumerate(zip(roles, live["addr"], live["bytes"]))]}
    before = snapshot_memory(snap)
    r = snapshot_memory(snap, inventory=inv)
    bd = r.breakdown_at_peak.set_index("category")["bytes"]
    assert bd["sharded_param"] == int(live["bytes"].iloc[:3].sum())
    assert bd["optimizer_state"] == int(live["bytes"].iloc[3:].sum())
    assert r.peak_allocated_bytes == before.peak_allocated_bytes
    assert r.coverage_pct > before.coverage_pct
    bu = r.by_unit_at_peak
    assert int(bu.loc[bu["unit"] == "layers.0", "bytes"].sum()) == int(live["bytes"].sum())
