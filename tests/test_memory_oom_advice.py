"""An OOM explained with fragmentation first when it decides (fsdpprof.analyze.memory.oom), the world size
"twice the shards" uses, and the allocator's cache in the report's Memory section.

Fragmentation decides when the bytes free in the allocator's cache that cannot serve the request (reserved -
allocated at the OOM, every free block smaller than the request) exceed the shortfall (request - free on the
device).  The cache's figures at the OOM are computed here from the allocator model's own segments at that
moment (hand-built snapshots) or from the pickle (the shared snapshot), not from fsdpprof's replay.
"""
from __future__ import annotations

import copy
import json
import pickle
import re

import pytest

import fsdp_snapshots as fs
from conftest import run_fsdpprof, shared_data
from fsdpprof.analyze.memory import safe_pickle, snapshot_memory
from fsdpprof.analyze.memory.snapshot import parse_snapshot

MIB = fs.MIB
EXPANDABLE = "PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True"
# the first step of an FSDP2 job dies in the forward of layer 3 at batch 8: a 3.5 GiB request (w1), while the
# cache holds ~2.46 GiB in 5 free blocks, the largest ~1.96 GiB (the gathered parameters of the resharded layers)
MODEL = dict(family="fsdp2", batch=8)
STEPS, LAYER = 1, 3


@pytest.fixture(scope="module")
def base():
    """(snapshot, info, request bytes, cached-but-unusable bytes from the allocator model at the OOM)."""
    snap, _, info = fs.build(fs.Model(**MODEL), steps=STEPS, oom_layer=LAYER)
    req = snap["device_traces"][0][info["oom_seq"]]["size"]
    free = [b["size"] for s in info["segments_at_oom"] for b in s["blocks"] if b["state"] == "inactive"]
    assert max(free) < req                   # (the premise: no free block could hold the request)
    return snap, info, req, sum(free)


def _with_device_free(snap: dict, seq: int, device_free: int) -> dict:
    snap = copy.deepcopy(snap)
    snap["device_traces"][0][seq]["device_free"] = device_free
    return snap


def _cost_order_ok(sugg: list[dict]) -> bool:
    keys = [(not s["enough"], s["cost_rank"], -s["saves_bytes"]) for s in sugg]
    return keys == sorted(keys)


# shortfall - cached-but-unusable bytes: two cases each side of the threshold (equal does not exceed)
@pytest.mark.parametrize("delta", [-(1 << 30), -1, 0, MIB])
def test_expandable_segments_first_exactly_when_the_cache_exceeds_the_shortfall(base, delta):
    snap, info, req, cached = base
    short = cached + delta
    o = snapshot_memory(parse_snapshot(_with_device_free(snap, info["oom_seq"], req - short))).oom
    assert o["short_bytes"] == short
    assert o["cached_unusable_bytes"] == cached
    decides = cached > short
    assert o["fragmentation_decides"] is decides
    sugg = o["suggestions"]
    assert len(sugg) >= 4                                      # the FSDP changes are there on both sides
    assert (sugg[0]["change"] == EXPANDABLE) is decides
    assert sum(s["change"] == EXPANDABLE for s in sugg) == int(decides)
    assert _cost_order_ok(sugg)
    if decides:
        first = sugg[0]
        assert first["enough"] and first["cost_rank"] == 0 and first["saves_bytes"] == cached
        # the numbers that make it enough: the cached bytes, the largest free block, the request, the shortfall
        for n in (cached, req, short):
            assert fs_bytes(n) in first["detail"]
        assert "Fragmentation decides" in o["explanation"]
    else:
        assert "Fragmentation does not decide" in o["explanation"]


def fs_bytes(n: int) -> str:
    from fsdpprof.analyze.model import fmt_bytes
    return fmt_bytes(n)


def test_the_rest_ranked_by_cost(base):
    """With fragmentation deciding, the other changes follow: enough ones first, each group by what it costs (an
    FSDP setting, the batch or checkpointing, more devices)."""
    snap, info, req, cached = base
    o = snapshot_memory(parse_snapshot(_with_device_free(snap, info["oom_seq"], req - cached // 2))).oom
    names = [s["change"].split(" (")[0].split(" of ")[0] for s in o["suggestions"]]
    assert names[0] == EXPANDABLE
    ranks = {n: s["cost_rank"] for n, s in zip(names, o["suggestions"])}
    assert ranks["reshard after forward"] < ranks["half the micro-batch"] == ranks["activation checkpointing"] \
        < ranks["twice the shards"]
    assert _cost_order_ok(o["suggestions"])


def test_no_fragmentation_advice_when_a_free_block_could_hold_the_request():
    """The default hand-built OOM (batch 2): its request would fit in the largest free block, so the cache is not
    what failed; the explanation says so."""
    snap, _, info = fs.build(fs.Model(family="fsdp2"), steps=STEPS, oom_layer=LAYER)
    req = snap["device_traces"][0][info["oom_seq"]]["size"]
    largest = max(b["size"] for s in info["segments_at_oom"] for b in s["blocks"] if b["state"] == "inactive")
    assert largest >= req
    o = snapshot_memory(parse_snapshot(snap)).oom
    assert o["fragmentation_decides"] is False and o["cached_unusable_bytes"] is None
    assert o["largest_free_block_bytes"] == largest
    assert not any("expandable" in s["change"] or "empty_cache" in s["change"] for s in o["suggestions"])
    assert "could have held the request" in o["explanation"]


# --------------------------------------------------------------------------- the shared OOM snapshot
def _shared():
    path = shared_data("cuda-snapshots", "multi-device-expandable-oom.pickle")
    raw = safe_pickle.load(path)
    seq = next(i for i, e in enumerate(raw["device_traces"][1]) if e["action"] == "oom")
    return raw, seq


def test_shared_oom_snapshot_fragmentation_does_not_decide():
    """cuda:1 was 4.85 GiB short with 133 MiB free in the cache: the advice is not the allocator's."""
    raw, seq = _shared()
    entry = raw["device_traces"][1][seq]
    res = snapshot_memory(parse_snapshot(raw), device=1)
    o = res.oom
    f = res.fragmentation.at("oom")
    assert o["short_bytes"] == entry["size"] - entry["device_free"]
    assert f.largest_free_block_bytes < entry["size"] and o["cached_unusable_bytes"] == f.free_bytes
    assert (o["cached_unusable_bytes"] > o["short_bytes"]) is False and o["fragmentation_decides"] is False
    assert o["suggestions"] and not any(s["cost_rank"] == 0 for s in o["suggestions"])
    assert o["expandable_segments"] is True


@pytest.mark.parametrize("delta", [-MIB, 0])
def test_shared_oom_snapshot_with_less_short_empties_the_cache_first(delta):
    """The same OOM with more free on the device: short by less than its cache holds, fragmentation decides; its
    segments are already expandable, so the first change is emptying the cache before the failing stage."""
    raw, seq = _shared()
    cached = snapshot_memory(parse_snapshot(raw), device=1).oom["cached_unusable_bytes"]
    raw = copy.deepcopy(raw)
    entry = raw["device_traces"][1][seq]
    entry["device_free"] = entry["size"] - (cached + delta)
    o = snapshot_memory(parse_snapshot(raw), device=1).oom
    first = o["suggestions"][0]
    assert o["fragmentation_decides"] is (delta < 0)
    assert first["change"].startswith("torch.cuda.empty_cache() before the forward") is (delta < 0)
    assert not any(s["change"] == EXPANDABLE for s in o["suggestions"])     # already expandable


# --------------------------------------------------------------------------- checkpointing frees what it says
def _checkpointing(o: dict) -> dict | None:
    return next((s for s in o["suggestions"] if s["change"].startswith("activation checkpointing")), None)


@pytest.mark.parametrize("device_free", [1 * MIB, 3 << 30])
def test_checkpointing_never_offers_a_units_output(device_free):
    """torchtitan's FSDP2 layout (the final norm and the output projection one unit) dies in the loss: the largest
    bytes alive are that unit's output, the bf16 logits (1.96 GiB), which the loss holds and checkpointing never
    frees.  The advice counts per unit only what recomputation frees (its activations less its output), so the
    tail unit offers its norm output alone, and no checkpointing saving reaches the logits' bytes."""
    m = fs.Model(family="fsdp2", tail_unit=True)
    snap, _, info = fs.build(m, steps=1, oom_layer=fs.OOM_IN_LOSS, device_free=device_free)
    o = snapshot_memory(parse_snapshot(snap)).oom
    bsd = m.batch * m.seq * m.dim * m.gather_bytes
    logits = bsd * m.vocab // m.dim
    tail = fs.unit_label(m.n_layers + 1)
    alive = {(u["unit"], u["category"]): u["bytes"] for u in o["alive_by_unit"]}
    assert alive[(tail, "activation")] == bsd + logits        # (the premise: the logits dominate)
    # a layer's forward saves its activations; its output (the block's last one, bsd) goes on to the next
    per_layer = alive[(fs.unit_label(1), "activation")] - bsd
    ck = _checkpointing(o)
    assert ck is not None
    names = ck["change"].removeprefix("activation checkpointing of ").replace(" and ", ", ").split(", ")
    expected = sum(bsd if u == tail else per_layer for u in names if u.startswith("unit"))
    assert ck["saves_bytes"] == expected        # the tail unit: its norm output (bsd) alone, never the logits
    assert ck["enough"] == (ck["saves_bytes"] >= o["short_bytes"])
    assert "keeps each unit's output" in ck["detail"]
    # the old advice: "checkpointing of unit 9 saves 1.96 GiB, enough on its own"
    assert not any(s["change"] == f"activation checkpointing of {tail}" and s["saves_bytes"] >= logits
                   for s in o["suggestions"])


# --------------------------------------------------------------------------- the world size of the advice
def test_twice_the_shards_uses_the_world_size_the_snapshots_show(tmp_path):
    """A 4-way FSDP2 job that died in its first forward (no reduce-scatter yet): one snapshot's all-gathers (flat
    output against its input, both bf16) read N = 4; two of the four ranks' snapshots read the same, never 2."""
    snap, _, _ = fs.build(fs.Model(family="fsdp2", world=4), steps=STEPS, oom_layer=LAYER)
    one = snapshot_memory(parse_snapshot(snap))
    assert one.world_size == 4 and one.world_size_source == "all-gather output / input"
    shards = next(s for s in one.oom["suggestions"] if s["change"].startswith("twice the shards"))
    assert "(4 -> 8 ranks)" in shards["change"] and "N = 4 inferred from all-gather output / input" in shards["detail"]
    for r in range(2):
        (tmp_path / f"rank{r}_memory_snapshot.pickle").write_bytes(pickle.dumps(snap))
    proc = run_fsdpprof("report", str(tmp_path), "-o", str(tmp_path / "r.html"))
    assert proc.returncode == 0, proc.stderr[-2000:]
    for m in json.loads((tmp_path / "r.summary.json").read_text())["memory"].values():
        assert m["world_size"] == 4
        shards = next(s for s in m["oom"]["suggestions"] if s["change"].startswith("twice the shards"))
        assert "(4 -> 8 ranks)" in shards["change"]


def test_world_size_from_the_run_is_not_called_inferred(base):
    snap, _, _, _ = base
    r = snapshot_memory(parse_snapshot(snap), world_size=4)
    shards = next(s for s in r.oom["suggestions"] if s["change"].startswith("twice the shards"))
    assert r.world_size == 4 and "N = 4 from the run" in shards["detail"] and "inferred" not in shards["detail"]


# --------------------------------------------------------------------------- the report
def test_report_shows_the_cache_and_the_advice_escaped(base, tmp_path):
    snap, info, req, cached = base
    snap = _with_device_free(snap, info["oom_seq"], req - cached // 2)
    for e in snap["device_traces"][0]:
        if e["action"] == "oom":
            evil = {"name": "<script>alert(1)</script>", "filename": "/x/<b>evil</b>.py", "line": 1}
            e["frames"] = [evil] + e["frames"]
    p = tmp_path / "rank0_memory_snapshot.pickle"
    p.write_bytes(pickle.dumps(snap))
    proc = run_fsdpprof("report", str(p), "-o", str(tmp_path / "r.html"))
    assert proc.returncode == 0, proc.stderr[-2000:]
    page = (tmp_path / "r.html").read_text()
    assert "<script>alert" not in page and "<b>evil" not in page
    sec = page[page.index('<section id="memory">'):]
    sec = sec[:sec.index("</section>")]
    # the advice: expandable segments first, with what each costs
    advice = sec[sec.index("What would free enough"):]
    assert advice.index(EXPANDABLE) < advice.index("half the micro-batch") and "what it costs" in advice
    # the cache: reserved vs allocated, free blocks by size, the largest free block beside the largest request
    assert "The allocator&#x27;s cache, cuda:0: reserved vs allocated" in sec
    assert "Free blocks by size, at the out-of-memory error" in sec
    assert "largest free block" in sec and "largest request that followed" in sec
    said = re.search(r"<p>At the ([a-z -]+): the largest free block was ([^<]*)</p>", sec)
    assert said and "out-of-memory error" in said.group(1) and "no free block could hold it" in said.group(2)
    n_free = sum(b["state"] == "inactive" for s in info["segments_at_oom"] for b in s["blocks"])
    assert f"{fs_bytes(cached)} free in the cache as {n_free} blocks" in said.group(2)
    for raw_word in ("largest_free_block", "free_blocks_by_size", "oom</td>"):
        assert raw_word not in sec
    s = json.loads((tmp_path / "r.summary.json").read_text())["memory"]["0"]
    assert s["oom"]["fragmentation_decides"] is True and s["oom"]["suggestions"][0]["cost_rank"] == 0
