"""The device of a snapshot named and chosen (``--device N|all``), an out-of-memory error said first (terminal and
"At a glance"), advice that fits the model, a peak never below its baseline, and memory alive before the recording
named as such in the findings.  Real snapshots (../shared/data, tests/data) and hand-built ones."""
from __future__ import annotations

import html
import json
import pickle
import re

import pandas as pd
import pytest

import fsdp_snapshots as fs
from conftest import run_fsdpprof, shared_data
from fsdpprof.analyze.summary import findings as fnd
from fsdpprof.analyze.memory import safe_pickle, snapshot_memory
from fsdpprof.analyze.memory.attribution import BEFORE_HISTORY
from fsdpprof.analyze.memory.snapshot import NEVER, parse_snapshot

BLOCK_WORDS = re.compile(r"transformer|block|sequence parallel", re.I)


def _report(tmp_path, snap, *args):
    out = tmp_path / "r.html"
    proc = run_fsdpprof("report", str(snap), "-o", str(out), "--force", *args)
    summary = json.loads((tmp_path / "r.summary.json").read_text()) if proc.returncode == 0 else None
    page = out.read_text() if proc.returncode == 0 else None
    return proc, summary, page


def _glance(page: str) -> str:
    sec = page[page.index('<section id="headline">'):]
    return sec[:sec.index("</section>")]


@pytest.fixture(scope="module")
def multi():
    """The shared 3-device DataParallel snapshot: (path, the device whose trace holds the OOM entry)."""
    path = shared_data("cuda-snapshots", "multi-device-expandable-oom.pickle")
    raw = safe_pickle.load(path)
    oom_devs = [d for d, t in enumerate(raw["device_traces"]) if any(e.get("action") == "oom" for e in t)]
    assert len(oom_devs) == 1
    return path, oom_devs[0]


def test_oom_comes_first_on_the_device_that_failed(tmp_path, multi):
    path, dev = multi
    proc, s, page = _report(tmp_path, path)
    assert proc.returncode == 0, proc.stderr[-2000:]
    lines = proc.stdout.splitlines()
    # the first line after the title is the OOM, on cuda:N, with its first change
    assert lines[1].startswith(f"  Out of memory on cuda:{dev}: ") and "First change" in lines[1], lines[:3]
    m = s["memory"]["0"]
    assert m["device"] == dev and m["oom"]["device"] == dev and s["headline"]["oom"]["device"] == dev
    first = m["oom"]["suggestions"][0]["change"]
    assert first in lines[1] and s["headline"]["oom"]["change"] == first
    # the peak is named by its device, never "rank 0"; the others are said, with how to choose them
    mem = next(x for x in lines if x.startswith("  memory: "))
    assert f"on cuda:{dev} " in mem and "rank 0" not in mem and "--device N or all" in mem
    assert m["device_choice"] == "largest peak" and max(m["device_peaks"], key=m["device_peaks"].get) == str(dev)
    assert "pass device=" not in page and "pass device=" not in json.dumps(s)
    assert f"analysed cuda:{dev}, " in lines[2] and f"CUDA memory snapshot, cuda:{dev} analysed</title>" in page
    # At a glance opens with the OOM, before any tile
    g = _glance(page)
    assert g.index('class="banner oom"') < g.index('class="tiles"')
    assert f"Out of memory on cuda:{dev}</b>" in g
    # advice for any model: a DataParallel model shows no FSDP unit and no block
    act = next(f for f in s["findings"] if f["id"] == "activations_dominate")
    assert not BLOCK_WORDS.search(act["suggestion"]) and "micro-batch" in act["suggestion"]
    assert not s["memory"]["0"]["fsdp_units"]


def test_device_option_chooses_one_or_every_device(tmp_path, multi):
    path, dev = multi
    proc, s_all, page = _report(tmp_path, path, "--device", "all")
    assert proc.returncode == 0, proc.stderr[-2000:]
    peaks = {m["device"]: m["peak_allocated_bytes"] for m in s_all["memory"].values()}
    assert len(peaks) == 3 and {int(k) for k in s_all["memory"]} == set(peaks)
    said = ", ".join(f"cuda:{d}" for d in sorted(peaks))
    assert f"analysed {said}, " in proc.stdout and f"{said} analysed</title>" in page
    # 'all' analyses each device as the default analyses it: the default's peaks per device are the same figures
    proc, s_one, _ = _report(tmp_path, path)
    assert {int(d): b for d, b in s_one["memory"]["0"]["device_peaks"].items()} == peaks
    assert proc.stdout.splitlines()[1].startswith(f"  Out of memory on cuda:{dev}: ")
    # one other device: no OOM there, so nothing about one comes first; the device chosen is said
    other = min(d for d in peaks if d != dev)
    proc, s, page = _report(tmp_path, path, "--device", str(other))
    assert proc.returncode == 0, proc.stderr[-2000:]
    m = s["memory"]["0"]
    assert m["device"] == other and m["device_choice"] == "given" and m["peak_allocated_bytes"] == peaks[other]
    assert m["oom"] is None and s["headline"]["oom"] is None and "Out of memory" not in proc.stdout
    assert f"on cuda:{other} " in proc.stdout and 'class="banner oom"' not in _glance(page)


@pytest.mark.parametrize("args, said", [
    (("--device", "9"), "holds no cuda:9 (it holds cuda:0, cuda:1, cuda:2)"),
    (("--device", "-1"), "give a whole number from 0"),
    (("--device", "first"), "or 'all'"),
])
def test_device_option_refuses_what_is_not_there(tmp_path, multi, args, said):
    proc, _, _ = _report(tmp_path, multi[0], *args)
    assert proc.returncode == 2 and said in proc.stderr and "Traceback" not in proc.stderr
    assert len(proc.stderr.strip().splitlines()) == 1


def test_device_option_on_a_trace_is_refused(tmp_path):
    trace = shared_data("gpu-traces", "hta-nccl-2rank-a100", "rank-0.json.gz")
    proc = run_fsdpprof("report", str(trace), "-o", str(tmp_path / "r.html"), "--device", "0")
    assert proc.returncode == 2 and "holds no CUDA snapshot" in proc.stderr and "Traceback" not in proc.stderr


def test_legacy_peak_is_never_below_its_baseline(tmp_path):
    """flexgen-opt1.3b-legacy: its one trace entry frees a block alive before the history: the peak is the moment
    before it (the baseline), not after it."""
    path = shared_data("cuda-snapshots", "flexgen-opt1.3b-legacy.pickle")
    raw = safe_pickle.load(path)
    (entry,) = [e for t in raw["device_traces"] for e in t]
    assert entry["action"] == "free_completed"
    r = snapshot_memory(parse_snapshot(raw))
    alive_end = int(r.allocations.loc[r.allocations["free_seq"] == NEVER, "bytes"].sum())
    assert r.peak_allocated_bytes == r.baseline_bytes == alive_end + entry["size"]
    assert r.peak_seq == BEFORE_HISTORY and r.peak_stage is None
    # the report says the same, and names what was alive before the recording as such
    proc, s, _ = _report(tmp_path, path)
    assert proc.returncode == 0, proc.stderr[-2000:]
    m = s["memory"]["0"]
    assert m["peak_allocated_bytes"] >= m["baseline_bytes"]
    before = next(b for b in m["breakdown_at_peak"] if b["category"] == "before_recording")
    f = next(f for f in s["findings"] if f["id"] == "low_attribution")
    assert f"{before['pct']:.1f}% was allocated before recording" in f["suggestion"]
    assert "is other" not in f["suggestion"]          # nothing is 'other' in it


@pytest.mark.parametrize("name", ["flexgen-opt1.3b-legacy.pickle", "flexgen-state-only.pickle",
                                  "lm-step-user-metadata.pickle", "qlora-tinyllama-legacy.pickle",
                                  "multi-device-expandable-oom.pickle"])
def test_no_snapshot_peaks_below_its_baseline(name):
    snap = parse_snapshot(safe_pickle.load(shared_data("cuda-snapshots", name)))
    for d in snap.devices:
        r = snapshot_memory(snap, device=d)
        assert r.peak_allocated_bytes >= r.baseline_bytes, (name, d)


def test_low_attribution_names_other_and_before_recording_apart():
    bd = pd.DataFrame({"category": ["activation", "before_recording", "other"], "bytes": [20, 50, 30],
                       "pct": [20.0, 50.0, 30.0]})
    (f,) = fnd.memory_findings(bd, None, 100, None, 20.0, 0, input_kind="unknown")
    assert f.id == "low_attribution"
    assert "50.0% was allocated before recording" in f.suggestion and "30.0% is other" in f.suggestion


def test_activation_advice_fits_the_model():
    bd = pd.DataFrame({"category": ["activation", "sharded_param"], "bytes": [80, 20], "pct": [80.0, 20.0]})

    def advice(**kw):
        return next(f.suggestion for f in fnd.memory_findings(bd, None, 100, None, 100.0, 0, **kw)
                    if f.id == "activations_dominate")

    assert not BLOCK_WORDS.search(advice(input_kind="unknown"))
    assert not BLOCK_WORDS.search(advice(input_kind="single_device"))
    assert "FSDP units" in advice(input_kind="fsdp2")
    named = advice(input_kind="unknown", units=["unit 3", "unit 2", "unit 1", "unit 0"])
    assert "unit 3, unit 2, unit 1 ..." in named


def test_fsdp_snapshot_advice_names_its_units(tmp_path):
    """A hand-built FSDP2 snapshot (no inventory: the units come from its frames) whose peak is mostly activations:
    the advice names the units keeping the most, in that order."""
    snap, _, _ = fs.build(fs.Model(family="fsdp2", batch=8, n_layers=4), steps=1)
    p = tmp_path / "rank0_memory_snapshot.pickle"
    p.write_bytes(pickle.dumps(snap))
    proc, s, _ = _report(tmp_path, p)
    assert proc.returncode == 0, proc.stderr[-2000:]
    m = s["memory"]["0"]
    pct = next(b["pct"] for b in m["breakdown_at_peak"] if b["category"] == "activation")
    assert pct >= fnd.ACTIVATIONS_DOMINATE_PCT          # (the premise: batch 8 makes activations dominate)
    act = next(f for f in s["findings"] if f["id"] == "activations_dominate")
    top = [u["unit"] for u in m["activation_by_unit"]][:3]
    assert len(top) == 3 and ", ".join(top) + " ..." in act["suggestion"]


def test_world_size_from_the_all_gathers_not_from_how_many_snapshots_are_given(tmp_path):
    """A 4-way FSDP2 job that died in its first forward (no reduce-scatter yet): each snapshot's all-gathers show
    N = 4 (output against input), whether 2 of the 4 ranks' snapshots are given or one alone; the number given is
    no evidence.  Said as inferred, with its evidence, in the terminal, the overview and summary.json."""
    snap, _, _ = fs.build(fs.Model(family="fsdp2", world=4), steps=1, oom_layer=3)
    for n in (2, 1):
        folder = tmp_path / f"snaps{n}"
        folder.mkdir()
        for r in range(n):
            (folder / f"rank{r}_memory_snapshot.pickle").write_bytes(pickle.dumps(snap))
        proc, s, page = _report(tmp_path, folder if n > 1 else folder / "rank0_memory_snapshot.pickle")
        assert proc.returncode == 0, proc.stderr[-2000:]
        o = s["overview"]
        assert o["world_size"] == 4 and o["world_size_source"] == "all-gather output / input"
        assert all(m["world_size"] == 4 for m in s["memory"].values()) and len(s["memory"]) == n
        assert "world size 4 (inferred from all-gather output / input)" in proc.stdout
        text = html.unescape(page)
        assert "2 -> 4 ranks" not in text and "(4 -> 8 ranks)" in text


def test_world_size_unknown_without_evidence(tmp_path):
    """An FSDP1 snapshot (bf16 gathers, no reduce-scatter yet): its shards fit N = 2, 4 or 8 with another stored
    dtype each and nothing else tells: the world size is unknown, and the advice names no N -> 2N."""
    snap, _, _ = fs.build(fs.Model(family="fsdp1", world=4), steps=1, oom_layer=3)
    path = tmp_path / "rank0_memory_snapshot.pickle"
    path.write_bytes(pickle.dumps(snap))
    proc, s, page = _report(tmp_path, path)
    assert proc.returncode == 0, proc.stderr[-2000:]
    m = s["memory"]["0"]
    assert m["world_size"] is None and s["overview"].get("world_size") is None
    assert any("world size unknown" in w for w in m["warnings"])
    shards = next(x for x in m["oom"]["suggestions"] if x["change"].startswith("twice the shards"))
    assert shards["change"] == "twice the shards" and "world size is unknown" in shards["detail"]
    assert "ranks)" not in html.unescape(page)


def test_a_recorded_world_size_is_not_inferred(tmp_path):
    trace = shared_data("gpu-traces", "hta-nccl-2rank-a100", "rank-0.json.gz")
    proc, s, _ = _report(tmp_path, trace)
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert s["overview"]["world_size"] == 2 and s["overview"]["world_size_source"] == "the run"
    assert "inferred" not in proc.stdout.splitlines()[1]
