"""FSDP2 / FSDP1 recognised in CUDA snapshots with no inventory, an OOM explained, and torch's peak
convention (requested sizes, as torch.cuda._memory_viz / MemoryViz.js count them).

The FSDP snapshots are built by hand (tests/fsdp_snapshots.py: torch's snapshot layout, torch 2.13's
FSDP frames read from the installed source, a caching-allocator model); every allocation's truth
(category, unit) is known, so the attribution is compared with it byte for byte."""
from __future__ import annotations

import json
import pickle

import numpy as np
import pandas as pd
import pytest

from conftest import run_fsdpprof, shared_data
from fsdpprof.analyze.memory import safe_pickle, snapshot_memory
from fsdpprof.analyze.memory.snapshot import load_snapshot, parse_snapshot
from fsdpprof.analyze.model import MemoryCategory as MC
from fsdpprof.report.oom import render_fsdp_memory, render_oom

SNAP = "cuda-snapshots"
PUBLIC = {"lm-step-user-metadata.pickle": [0], "qlora-tinyllama-legacy.pickle": [0],
          "multi-device-expandable-oom.pickle": [0, 1, 2]}
FAR = 1 << 62


# --------------------------------------------------------------------------- torch's peak
def memory_viz_peak(snap: dict, device: int) -> int:
    """The largest 'allocated' of torch's Active Memory Timeline for ``device``: MemoryViz.js
    (torch/utils/viz/MemoryViz.js, ``annotate_snapshot`` then ``process_alloc_data``, which
    torch.cuda._memory_viz.trace_plot embeds) followed step by step: adjacent free_requested /
    free_completed of one address become one free; an alloc adds its trace size, a free (or a
    free_completed) of a traced alloc removes it, a free without an alloc is memory allocated before the
    history (alive from the start); blocks active_allocated at snapshot time with no open alloc are alive
    from the start with the size torch's own ``_memory_viz._block_extra`` gives them (requested_size)."""
    from torch.cuda import _memory_viz as mv
    trace = snap["device_traces"][device] if device < len(snap["device_traces"]) else []
    events = []
    for e in trace:
        if (e["action"] == "free_completed" and events and events[-1]["action"] == "free_requested"
                and events[-1]["addr"] == e["addr"]):
            events[-1] = dict(events[-1], action="free")
            continue
        events.append(e)
    size, initially, actions, open_alloc = [], [], [], {}
    for e in events:
        if e["action"] == "alloc":
            size.append(e["size"])
            open_alloc[e["addr"]] = len(size) - 1
            actions.append(len(size) - 1)
        elif e["action"] in ("free", "free_completed"):
            if e["addr"] in open_alloc:
                actions.append(open_alloc.pop(e["addr"]))
            else:
                size.append(e["size"])
                initially.append(len(size) - 1)
                actions.append(len(size) - 1)
    for seg in snap["segments"]:
        if seg["device"] != device:
            continue
        addr = seg["address"]
        for b in seg["blocks"]:
            if b["state"] == "active_allocated" and b.get("address", addr) not in open_alloc:
                size.append(mv._block_extra(b)[1])
                initially.append(len(size) - 1)
            addr += b["size"]
    live = set(initially)
    total = sum(size[i] for i in initially)
    peak = 0
    for i in actions:
        if i in live:
            live.discard(i)
            total -= size[i]
        else:
            live.add(i)
            total += size[i]
        peak = max(peak, total)
    return peak


def _hand_built():
    import fsdp_snapshots as fs     # (torch's FSDP modules: imported where the snapshots are built, not to collect)

    out = {}
    for fam in ("fsdp2", "fsdp1"):
        out[fam] = fs.build(fs.Model(family=fam))
    out["fsdp2-oom"] = fs.build(fs.Model(family="fsdp2"), oom_layer=5)
    # torchtitan's layout: the embedding a unit, fully_shard([norm, output]) the last, the root without parameters
    out["fsdp2-titan"] = fs.build(fs.Model(family="fsdp2", tail_unit=True))
    return out


@pytest.fixture(scope="module")
def hand():
    return _hand_built()


@pytest.fixture(scope="module")
def results(hand):
    return {k: snapshot_memory(parse_snapshot(v[0])) for k, v in hand.items()}


@pytest.mark.parametrize("name", sorted(PUBLIC))
def test_peak_is_memory_viz_peak_on_public_snapshots(name):
    raw = safe_pickle.load(shared_data(SNAP, name))
    snap = load_snapshot(shared_data(SNAP, name))
    for dev in PUBLIC[name]:
        ours = snapshot_memory(snap, device=dev)
        theirs = memory_viz_peak(raw, dev)
        print(f"{name} cuda:{dev}: ours {ours.peak_allocated_bytes} / memory_viz {theirs} = "
              f"{ours.peak_allocated_bytes / theirs:.6f}; reserved {ours.reserved_bytes}")
        assert abs(ours.peak_allocated_bytes / theirs - 1) <= 0.001
        # reserved memory is reported apart, and is at least what is allocated
        assert ours.reserved_bytes >= ours.peak_allocated_bytes


@pytest.mark.parametrize("name", ["fsdp2", "fsdp1", "fsdp2-oom", "fsdp2-titan"])
def test_peak_is_memory_viz_peak_on_hand_built(hand, results, name):
    snap = hand[name][0]
    assert abs(results[name].peak_allocated_bytes / memory_viz_peak(snap, 0) - 1) <= 0.001


# --------------------------------------------------------------------------- FSDP without an inventory
def _truth(hand, name) -> pd.DataFrame:
    t = pd.DataFrame(hand[name][1])
    t["free_seq"] = t["free_seq"].fillna(FAR).astype(np.int64)
    # what only says "alive before the history" (the RoPE table) is before_recording for us
    t["category"] = t["category"].replace({"other": MC.BEFORE_RECORDING.value})
    return t


def _alive(t: pd.DataFrame, seq: int) -> pd.DataFrame:
    return t[(t["seq"] < seq) & (t["free_seq"] > seq) | (t["seq"] == seq)]


@pytest.mark.parametrize("name,family", [("fsdp2", "fsdp2"), ("fsdp1", "fsdp1"), ("fsdp2-titan", "fsdp2")])
def test_fsdp_recognised_without_inventory(hand, results, name, family):
    r = results[name]
    info = hand[name][2]
    print(r.breakdown_at_peak.to_string(), "\n", r.warnings)
    assert r.fsdp_family == family
    assert r.fsdp_units == info["units"]              # unit 0 (root), unit 1 ... in forward order
    assert r.world_size == 4
    assert r.coverage_pct >= 95.0
    t = _truth(hand, name)
    at_peak = _alive(t, r.peak_seq)
    assert int(at_peak["bytes"].sum()) == r.peak_allocated_bytes
    # every category at the peak holds exactly the truth's bytes (shards and optimizer state matched by size)
    ours = r.breakdown_at_peak.set_index("category")["bytes"]
    truth = at_peak.groupby("category")["bytes"].sum()
    for cat in ours.index:
        assert ours[cat] == truth.get(cat, 0), cat
    # every activation byte of the layers is assigned to its unit
    bu = r.by_unit_at_peak
    for cat in (MC.ACTIVATION.value, MC.UNSHARDED_PARAM.value, MC.SHARDED_PARAM.value, MC.OPTIMIZER_STATE.value):
        got = bu[bu["category"] == cat].groupby(bu["unit"].astype(str))["bytes"].sum()
        want = at_peak[(at_peak["category"] == cat) & at_peak["unit"].notna()].groupby("unit")["bytes"].sum()
        assert got.to_dict() == want.to_dict(), cat
    layer_act = at_peak[(at_peak["category"] == "activation") & at_peak["unit"].isin(info["units"][1:])]
    assert int(layer_act["bytes"].sum()) > 0
    # over the whole history, not only at the peak: each allocation's unit and category as in the truth
    a = r.allocations
    traced = a[a["alloc_seq"] >= 0].merge(t[t["seq"] >= 0], left_on="alloc_seq", right_on="seq", suffixes=("", "_t"))
    assert len(traced) == int((t["seq"] >= 0).sum())
    assert (traced["category"].astype(str) == traced["category_t"]).all()
    act = traced[traced["category_t"] == "activation"]
    assert (act["unit"].astype(object).fillna("-") == act["unit_t"].fillna("-")).all()
    for cat in ("unsharded_param", "unsharded_grad", "sharded_grad"):
        x = traced[traced["category_t"] == cat]
        assert (x["unit"].astype(object) == x["unit_t"]).all(), cat
    # FSDP's own buffers as what they are
    roles = set(r.allocations["fsdp_role"].dropna())
    assert {"all_gather_output", "reduce_scatter_input", "reduce_scatter_output", "sharded_param"} <= roles
    if family == "fsdp2":
        assert {"all_gather_input", "unsharded_param"} <= roles
    assert any("sharded parameters the all-gathers imply" in w for w in r.warnings)
    html = render_fsdp_memory(r)
    assert family.upper() in html and "unit 8" in html and "Allocated before recording" in html


def test_unit_of_several_modules_owns_its_activations(hand, results):
    """fully_shard([norm, output]): gathered in the norm's pre-forward (FSDP2's group hook), the logits allocated in
    the output's call, a sibling of the norm's in the root's forward, belong to that unit; only the loss (outside
    the model) has none."""
    import fsdp_snapshots as fs

    r, (_, truth, info) = results["fsdp2-titan"], hand["fsdp2-titan"]
    m = fs.Model(family="fsdp2", tail_unit=True)
    tail = info["units"][-1]
    logits = m.batch * m.seq * m.vocab * m.gather_bytes
    a = r.allocations
    fwd = a[(a["category"] == MC.ACTIVATION.value) & (a["stage"] == "forward").to_numpy() & (a["alloc_seq"] >= 0)]
    got = fwd[fwd["bytes"] == logits]
    assert len(got) == 2 and (got["unit"] == tail).all()            # one per step
    act = a[a["category"] == MC.ACTIVATION.value]
    no_unit = int(act.loc[act["unit"].isna(), "bytes"].sum())
    want = sum(x["bytes"] for x in truth if x["category"] == "activation" and x["unit"] is None and x["seq"] >= 0)
    assert no_unit == want == 2 * 2 * logits                        # the loss's two saved tensors, no more
    assert r.activation_by_unit.set_index("unit").loc[tail, "activation_bytes"] >= logits


def test_history_starting_mid_step(hand):
    """A ring buffer that dropped the start of the step: the history begins in the middle of a forward.
    Units are still counted from the root (a complete forward later in the history sets them)."""
    snap, truth, info = hand["fsdp2"]
    trace = snap["device_traces"][0]
    first_fwd_ag = next(i for i, e in enumerate(trace) if e["action"] == "alloc"
                        and any(f.get("name") == "foreach_all_gather" for f in e["frames"]))
    cut = first_fwd_ag + 200            # into the forward, after a few units were gathered
    cut_snap = dict(snap, device_traces=[trace[cut:]])
    r = snapshot_memory(parse_snapshot(cut_snap))
    assert r.fsdp_family == "fsdp2" and r.fsdp_units == info["units"]
    t = pd.DataFrame(truth)
    t = t[t["seq"] >= cut].assign(seq=lambda x: x["seq"] - cut)
    a = r.allocations
    m = a[a["alloc_seq"] >= 0].merge(t, left_on="alloc_seq", right_on="seq", suffixes=("", "_t"))
    act = m[m["category_t"] == "activation"]
    assert len(act) and (act["unit"].astype(object).fillna("-") == act["unit_t"].fillna("-")).all()
    assert abs(r.peak_allocated_bytes / memory_viz_peak(cut_snap, 0) - 1) <= 0.001


def test_fsdp_snapshot_with_inventory_units_named(hand):
    """With an inventory (fsdpprof recorded the run) the recovered units take the inventory's names."""
    snap = hand["fsdp2"][0]
    names = [""] + [f"layers.{i}" for i in range(8)]
    inv = {"schema": "fsdpprof.inventory/1", "rank": 0, "world_size": 4, "units": [{"fqn": n} for n in names],
           "tensors": []}
    r = snapshot_memory(parse_snapshot(snap), inventory=inv)
    assert r.fsdp_units == names
    act = r.activation_by_unit.set_index("unit")["activation_bytes"]
    assert set(act.index) == set(names)


# --------------------------------------------------------------------------- OOM explained
def test_oom_explained(hand, results):
    snap, truth, info = hand["fsdp2-oom"]
    r = results["fsdp2-oom"]
    o = r.oom
    oom_entry = snap["device_traces"][0][info["oom_seq"]]
    assert o["requested_bytes"] == oom_entry["size"] and o["free_bytes"] == oom_entry["device_free"]
    assert o["short_bytes"] == oom_entry["size"] - oom_entry["device_free"]
    # what was being allocated: an activation in the forward of the unit that failed
    assert o["stage"] == "forward" and o["unit"] == info["oom_unit"] and o["fsdp_role"] is None
    assert "forward (linear.py" in o["frames"]
    # what was alive then, by category: the truth's bytes
    t = _truth(hand, "fsdp2-oom")
    alive = t[(t["seq"] < info["oom_seq"]) & (t["free_seq"] > info["oom_seq"])]
    assert o["allocated_bytes"] == int(alive["bytes"].sum())
    got = {d["category"]: d["bytes"] for d in o["alive_by_category"]}
    assert got == alive.groupby("category")["bytes"].sum().to_dict()
    by_unit = pd.DataFrame(o["alive_by_unit"])
    act_units = by_unit[by_unit["category"] == "activation"].set_index("unit")["bytes"].to_dict()
    assert act_units == alive[(alive["category"] == "activation") & alive["unit"].notna()].groupby("unit")["bytes"].sum().to_dict()
    # suggestions, each with the bytes it would save, computed from what was alive
    sugg = {s["change"].split(" (")[0].split(" of ")[0]: s for s in o["suggestions"]}
    assert set(sugg) >= {"activation checkpointing", "half the micro-batch", "twice the shards",
                         "reshard after forward"}
    acts = int(alive.loc[alive["category"] == "activation", "bytes"].sum())
    assert sugg["half the micro-batch"]["saves_bytes"] == (acts + oom_entry["size"]) // 2
    states = int(alive.loc[alive["category"].isin(["sharded_param", "sharded_grad", "optimizer_state"]), "bytes"].sum())
    assert sugg["twice the shards"]["saves_bytes"] == states // 2
    assert "4 -> 8" in sugg["twice the shards"]["change"]
    ac = sugg["activation checkpointing"]
    assert 0 < ac["saves_bytes"] < acts and ac["enough"] == (ac["saves_bytes"] >= o["short_bytes"])
    # the root stays gathered (not resharded after forward): resharding it would free its parameters
    root = int(alive[(alive["category"] == "unsharded_param") & (alive["unit"] == "unit 0")]["bytes"].sum())
    assert sugg["reshard after forward"]["saves_bytes"] == root > 0
    # enough on their own first, then by what they cost (an FSDP setting, the batch, more devices), then savings
    keys = [(not s["enough"], s["cost_rank"], -s["saves_bytes"]) for s in o["suggestions"]]
    assert keys == sorted(keys)
    text = o["explanation"]
    assert "ran out of memory" in text and info["oom_unit"] in text and "short" in text
    # what the exception's unwinding freed after the OOM still counts as what it was (activations)
    assert r.breakdown_at_peak.set_index("category")["bytes"]["temporary"] < acts


def test_oom_html_escapes_everything(hand):
    snap = pickle.loads(pickle.dumps(hand["fsdp2-oom"][0]))
    for e in snap["device_traces"][0]:
        if e["action"] == "oom":
            e["frames"] = [{"name": "<script>alert(1)</script>", "filename": "/x/<b>evil</b>.py", "line": 1}] + e["frames"]
    r = snapshot_memory(parse_snapshot(snap))
    html = render_oom(r)
    assert "<script>alert" not in html and "&lt;script&gt;alert(1)&lt;/script&gt;" in html
    assert "<b>evil" not in html
    assert "What would free enough" in html and "Out of memory" in html
    assert render_oom(snapshot_memory(parse_snapshot(hand["fsdp2"][0]))) == ""


def test_oom_in_summary_json_from_cli(hand, tmp_path):
    p = tmp_path / "rank0_memory_snapshot.pickle"
    p.write_bytes(pickle.dumps(hand["fsdp2-oom"][0]))
    proc = run_fsdpprof("report", str(p), "-o", str(tmp_path / "r.html"), timeout=300)
    assert proc.returncode == 0, proc.stderr[-2000:]
    s = json.loads((tmp_path / "r.summary.json").read_text())
    m = s["memory"]["0"]
    o = m["oom"]
    assert o["requested_bytes"] > 0 and o["free_bytes"] is not None      # the figures it had
    assert "ran out of memory" in o["explanation"]
    assert o["suggestions"] and all(isinstance(x["saves_bytes"], int) and x["saves_bytes"] > 0
                                    for x in o["suggestions"])
    assert m["fsdp_family"] == "fsdp2" and m["fsdp_units"][0] == "unit 0" and m["world_size"] == 4
    assert m["activation_by_unit"] and m["by_role_at_peak"]


def test_real_oom_snapshot_explained():
    """The public multi-device snapshot ended in an OOM on cuda:1 (not an FSDP job)."""
    r = snapshot_memory(load_snapshot(shared_data(SNAP, "multi-device-expandable-oom.pickle")), device=1)
    o = r.oom
    assert o["short_bytes"] == 5308694528 - 95682560
    assert o["allocated_bytes"] == r.peak_allocated_bytes      # it peaked just before failing
    assert o["stage"] == "forward" and "relu" in o["frames"]
    assert sum(d["bytes"] for d in o["alive_by_category"]) == o["allocated_bytes"]
    mb = next(s for s in o["suggestions"] if s["change"].startswith("half the micro-batch"))
    assert mb["saves_bytes"] >= o["short_bytes"] and mb["enough"]
    assert not any(s["change"].startswith("twice the shards") for s in o["suggestions"])   # nothing is sharded
    assert r.reserved_bytes >= o["allocated_bytes"] and o["cached_free_bytes"] == o["reserved_bytes"] - o["allocated_bytes"]
