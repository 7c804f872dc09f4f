"""Memory attribution on real 2-rank gloo runs of the example (FSDP2 FULL_SHARD / SHARD_GRAD_OP,
FSDP1 NO_SHARD, DDP), recorded once per session by the shared ``recorded_run`` fixture."""
from __future__ import annotations

import gzip
import json
import shutil
import sys

import numpy as np
import pandas as pd
import pytest

from conftest import EXAMPLE, run_fsdpprof
from fsdpprof.analyze.memory import memory_analysis
from fsdpprof.analyze.load.run import load_run
from fsdpprof.errors import UserError

pytestmark = pytest.mark.slow  # real torchrun/gloo recordings

STRATEGIES = ["fsdp2", "fsdp2-no-reshard", "fsdp1-full", "fsdp1-no-shard", "ddp"]
_cache: dict = {}


def analysed(recorded_run, strategy):
    if strategy not in _cache:
        run = load_run(str(recorded_run(strategy)))
        assert sorted(run.ranks) == [0, 1]
        _cache[strategy] = (run, {r: memory_analysis(rd) for r, rd in run.ranks.items()})
    return _cache[strategy]


def _unique(inv, role):
    """Inventory tensors of a role, one per (name, step) (a tensor listed twice counts once)."""
    t = pd.DataFrame([x for x in inv["tensors"] if x["role"] == role])
    return t.drop_duplicates(["name", "step"] if role == "grad" else ["name"])


@pytest.mark.parametrize("strategy", STRATEGIES)
def test_model_states_exact(recorded_run, strategy):
    """Bytes attributed to sharded params, sharded grads and optimizer state equal the inventory's
    local bytes exactly. Attribution is per storage: tensors sharing one (FSDP2's per-unit grad
    buffer, FSDP1's flat parameter) count once with the storage's size; no padding arises in this
    model (every numel divides by 2), so storage bytes == tensor bytes."""
    run, res = analysed(recorded_run, strategy)
    for r, m in res.items():
        inv = run.ranks[r].inventory
        a = m.allocations
        exact = a[a["category_source"] == "inventory"]
        got = exact.groupby(exact["category"].astype(str))["bytes"].sum()
        params, grads, opt = _unique(inv, "param"), _unique(inv, "grad"), _unique(inv, "optimizer_state")
        n_steps = grads["step"].nunique()
        assert n_steps == len(run.ranks[r].info["steps_recorded"]) == 2
        assert got["sharded_param"] == params["bytes"].sum() == inv["totals"]["param_bytes"]
        # grads are captured every step of the window (they are reallocated each step)
        assert got["sharded_grad"] == grads["bytes"].sum() == n_steps * inv["totals"]["grad_bytes"]
        assert got["optimizer_state"] == opt["bytes"].sum()
        # params and optimizer state exist before the window and all through it: all of them at the peak
        bd = m.breakdown_at_peak.set_index("category")["bytes"]
        assert bd["sharded_param"] == params["bytes"].sum()
        assert bd["optimizer_state"] == opt["bytes"].sum()
        assert m.baseline_bytes >= params["bytes"].sum() + opt["bytes"].sum()


@pytest.mark.parametrize("strategy", STRATEGIES)
def test_coverage_peak_and_window_accounting(recorded_run, strategy):
    run, res = analysed(recorded_run, strategy)
    for r, m in res.items():
        print(f"{strategy} rank {r}: peak {m.peak_allocated_bytes / 2**20:.2f} MiB in {m.peak_stage}/"
              f"{m.peak_fsdp_phase}, coverage {m.coverage_pct:.2f} %\n{m.breakdown_at_peak.to_string()}")
        assert m.source == "cpu_trace"
        assert m.coverage_pct >= 95.0
        assert m.peak_stage in ("forward", "backward", "optimizer", "post_step", "data")
        # c10's count of every thread's bytes runs from torch's import through the window: each event's Total
        # Allocated is every CPU byte alive, and the peak is the largest (the baseline: the count before the first)
        me = run.ranks[r].memory_events.sort_values("ts_us", kind="stable")
        every = me["total_allocated_bytes"].to_numpy()
        before = int(every[0] - me["bytes"].iloc[0])
        assert m.baseline_bytes == before
        assert m.peak_allocated_bytes == max(before, int(every.max()))
        # after every event, the allocations alive (other threads' rows included) hold exactly that count
        a, n = m.allocations, len(every)
        level = np.zeros(n + 1, dtype=np.int64)
        np.add.at(level, np.clip(a["alloc_seq"].to_numpy() + 1, 0, n), a["bytes"].to_numpy())
        freed = a["free_seq"].to_numpy() < n
        np.add.at(level, a["free_seq"].to_numpy()[freed] + 1, -a["bytes"].to_numpy()[freed])
        assert np.array_equal(np.cumsum(level)[1:], every)
        tl = m.timeline
        assert int(tl.drop(columns="ts_us").sum(axis=1).max()) == m.peak_allocated_bytes
        assert int(m.breakdown_at_peak["bytes"].sum()) == m.peak_allocated_bytes


def _max_alive(g: pd.DataFrame) -> int:
    """Most bytes of the allocations ``g`` alive at once (frees first at a tie, as the peak counts them)."""
    seq = np.concatenate([g["alloc_seq"].to_numpy(), g["free_seq"].to_numpy()])
    delta = np.concatenate([g["bytes"].to_numpy(), -g["bytes"].to_numpy()])
    o = np.lexsort((delta, seq))
    return int(np.cumsum(delta[o]).max()) if len(o) else 0


@pytest.mark.parametrize("strategy", ["fsdp2", "fsdp1-full"])
def test_full_shard_unsharded_params(recorded_run, strategy):
    """FULL_SHARD: unsharded params at the peak > 0 and at most the largest unit plus the prefetched
    one. Ours adds the root unit: the root is all-gathered again at the start of backward (the
    recorded trace shows it), so it is gathered in backward, where the peak is, beside the unit
    being computed and the one prefetched.

    Per unit, FSDP's own rule: a unit holds at most one all-gather output and one set of unsharded
    parameters at a time (FSDP2: the flat output is freed once copied out, the copy-out at reshard,
    before the unit's next all-gather; FSDP1: its flat parameter).  The trace sometimes loses the free
    of an all-gather buffer (freed on a thread the profiler does not record): the analysis bounds it by
    those rules, so the check holds over the whole window, not by luck at the peak.  (During FSDP2's
    copy-out both the flat output and the copy-out exist: up to twice the unit, by design.)"""
    run, res = analysed(recorded_run, strategy)
    for r, m in res.items():
        units = {u["fqn"]: u["unsharded_bytes"] for u in run.ranks[r].inventory["units"]}
        largest = max(v for k, v in units.items() if k)
        bd = m.breakdown_at_peak.set_index("category")["bytes"]
        assert bd["unsharded_param"] > 0
        assert bd["unsharded_param"] <= 2 * largest + units[""]
        # per unit (FSDP1's annotations name no unit: recovered from the inventory order and the all-gathers)
        bu = m.by_unit_at_peak
        per_unit = bu[bu["category"] == "unsharded_param"].groupby(bu["unit"].astype(str))["bytes"].sum()
        assert len(per_unit) >= 2 and set(per_unit.index) <= set(units)
        a = m.allocations
        up = a[(a["category"] == "unsharded_param") & ~a["before_trace"]]
        assert up["unit"].notna().all()
        for (unit, phase), g in up.groupby([up["unit"].astype(str), up["fsdp_phase"].astype(str)]):
            assert _max_alive(g) <= units[unit], (unit, phase, _max_alive(g), units[unit])
        for unit, b in per_unit.items():
            assert b <= (2 if strategy == "fsdp2" else 1) * units[unit], (unit, b, units[unit])
        # sharded params per unit equal the inventory's local bytes per unit
        sp = bu[bu["category"] == "sharded_param"].set_index("unit")["bytes"]
        for u in run.ranks[r].inventory["units"]:
            assert sp[u["fqn"]] == u["local_bytes"]


def test_fsdp1_units_recovered(recorded_run):
    """FSDP1's annotations do not name the module: the units come from the inventory's order and the
    sequence of all-gathers (their sizes must agree), so unsharded params and activations split per unit
    as FSDP2's do."""
    run, res = analysed(recorded_run, "fsdp1-full")
    for r, m in res.items():
        inv = run.ranks[r].inventory
        order = [u["fqn"] for u in inv["units"]]
        a = m.allocations
        up = a[(a["category"] == "unsharded_param") & ~a["before_trace"]].sort_values("alloc_seq")
        for step, g in up.groupby("step_idx"):
            fwd = g[g["stage"] == "forward"]["unit"].tolist()
            bwd = g[g["stage"] == "backward"]["unit"].tolist()
            assert fwd == order                            # root, layers.0 ... in forward order
            assert bwd == [u for u in reversed(order) if u][:len(bwd)] and len(bwd) >= 1
        act = m.activation_by_unit.set_index("unit")["activation_bytes"]
        layers = [u for u in order if u]
        assert set(layers) <= set(act.index)
        # the layers are alike: each keeps the same activations for its backward
        assert act[layers].nunique() == 1 and act[layers].iloc[0] > 0
        bu = m.by_unit_at_peak
        at_peak = bu[(bu["category"] == "activation") & bu["unit"].isin(layers)]
        assert at_peak["unit"].nunique() >= 2
        # the peak estimate uses A_l per unit
        from fsdpprof.analyze.summary.model_states import activations_per_unit
        assert activations_per_unit(m)[layers[0]] == act[layers[0]]


@pytest.mark.parametrize("strategy", ["fsdp2", "fsdp1-full"])
def test_peak_estimate_per_unit(recorded_run, strategy):
    """16 Psi / N + max_l (k Psi_l + A_l) with A_l measured per unit, not the activations at the peak."""
    from fsdpprof.analyze import analyze_run
    a = analyze_run(load_run(str(recorded_run(strategy))))
    pe = a.theory["peak_estimate"]
    m = a.memory[pe["measured_rank"]]        # the peak rank (the headline's), beside its measured peak
    act = m.activation_by_unit.set_index("unit")["activation_bytes"]
    assert "max_l (k_param_unsharded * Psi_l + A_l)" in pe["formula"] and "measured per unit" in pe["formula"]
    assert pe["activations_per_unit"][pe["max_unit"]] == pe["activation_bytes"] == act.get(pe["max_unit"], 0)
    total_at_peak = m.breakdown_at_peak.set_index("category")["bytes"]["activation"]
    assert pe["activation_bytes"] < total_at_peak
    assert pe["estimate_bytes"] == pytest.approx(pe["model_states_bytes"] + pe["max_unit_unsharded_bytes"]
                                                 + pe["activation_bytes"])
    assert "activations of the other units" in pe["explanation"]


@pytest.mark.parametrize("strategy", ["fsdp1-no-shard", "ddp"])
def test_no_unsharded_params_without_sharding(recorded_run, strategy):
    run, res = analysed(recorded_run, strategy)
    for m in res.values():
        a = m.allocations
        assert int(a.loc[a["category"] == "unsharded_param", "bytes"].sum()) == 0
        assert m.breakdown_at_peak.set_index("category")["bytes"]["unsharded_param"] == 0


def test_shard_grad_op_keeps_params_gathered(recorded_run):
    """SHARD_GRAD_OP (no reshard after forward): all units stay gathered from forward to backward,
    so unsharded params at the peak exceed FULL_SHARD's and reach the whole model."""
    run, res = analysed(recorded_run, "fsdp2-no-reshard")
    _, full = analysed(recorded_run, "fsdp2")
    for r, m in res.items():
        bd = m.breakdown_at_peak.set_index("category")["bytes"]
        total_unsharded = run.ranks[r].inventory["totals"]["unsharded_param_bytes"]
        assert bd["unsharded_param"] >= total_unsharded
        assert bd["unsharded_param"] > full[r].breakdown_at_peak.set_index("category")["bytes"]["unsharded_param"]


# --------------------------------------------------------------------------- bad input
def _copy_rank(recorded_run, tmp_path):
    src = recorded_run("fsdp2")
    dst = tmp_path / "run"
    shutil.copytree(src, dst)
    return dst


@pytest.mark.parametrize("field,value,words", [("rank", 1, "rank 1"), ("world_size", 8, "world size 8")])
def test_inventory_from_another_run(recorded_run, tmp_path, field, value, words):
    dst = _copy_rank(recorded_run, tmp_path)
    p = dst / "rank-0" / "inventory.json"
    inv = json.loads(p.read_text())
    inv[field] = value
    p.write_text(json.dumps(inv))
    run = load_run(str(dst))
    with pytest.raises(UserError) as ei:
        memory_analysis(run.ranks[0])
    msg = str(ei.value)
    assert words in msg and ("another run" in msg or "different runs" in msg)
    assert "\n" not in msg
    # the other rank is unaffected
    assert memory_analysis(run.ranks[1]).coverage_pct >= 95.0
    if field == "world_size":  # the CLI: one line, exit 2
        proc = run_fsdpprof("report", str(dst), "-o", str(tmp_path / "r.html"), timeout=300)
        assert proc.returncode == 2, (proc.stdout[-1500:], proc.stderr[-1500:])
        err = proc.stderr.strip()
        assert len(err.splitlines()) == 1 and words in err and "Traceback" not in proc.stderr


def test_trace_without_memory_events(recorded_run, tmp_path):
    src = recorded_run("fsdp2") / "rank-0" / "trace.json.gz"
    doc = json.loads(gzip.decompress(src.read_bytes()))
    doc["traceEvents"] = [e for e in doc["traceEvents"] if e.get("name") != "[memory]"]
    p = tmp_path / "rank-0.json.gz"
    p.write_bytes(gzip.compress(json.dumps(doc).encode()))
    run = load_run(str(p))
    rd = next(iter(run.ranks.values()))
    with pytest.raises(UserError, match="profile_memory was off"):
        memory_analysis(rd)
    # the CLI still reports the rest (communication, steps) and says why memory is missing
    out = tmp_path / "r"
    out.mkdir()
    proc = run_fsdpprof("report", str(p), "-o", str(out / "r.html"), timeout=300)
    assert proc.returncode == 0, proc.stderr[-1500:]
    summary = json.loads((out / "r.summary.json").read_text())
    assert "profile_memory was off" in json.dumps(summary.get("notes"))
    assert summary.get("steps")


def test_bare_trace_without_inventory(recorded_run):
    """A bare trace (no inventory): window memory is still attributed by FSDP annotations and
    lifetimes; what was alive before the window and never freed in it is unknown (warned)."""
    run = load_run(str(recorded_run("fsdp2") / "rank-0" / "trace.json.gz"))
    m = memory_analysis(next(iter(run.ranks.values())))
    assert any("no inventory.json" in w for w in m.warnings)
    bd = m.breakdown_at_peak.set_index("category")["bytes"]
    assert bd["unsharded_param"] > 0 and bd["activation"] > 0
    assert m.coverage_pct >= 95.0


def test_lost_free_of_all_gather_buffer_is_inferred(recorded_run):
    """Seen in real gloo runs: an FSDP all-gather output whose free event never reaches the trace
    (freed on a thread the profiler does not record), so it looks alive to the end. Drop the free of
    one such buffer (backward, last step) from a real recording: it is detected, freed where FSDP2 frees
    it at the latest (in backward: once copied out, before the next all-gather starts), and warned."""
    from fsdpprof.analyze.trace import labels
    run = load_run(str(recorded_run("fsdp2")))
    rd = run.ranks[0]
    m0 = memory_analysis(rd)
    a = m0.allocations
    # (a buffer whose free event is really in the trace: the recording itself may already lack one)
    ag = a[(a["fsdp_phase"] == "all_gather") & (a["category"] == "unsharded_param") & a["free_us"].notna()
           & ~a["free_inferred"] & (a["step_idx"] == a["step_idx"].max()) & (a["stage"] == "backward")]
    me = rd.memory_events
    # a buffer that FSDP's rule bounds: one with an all-gather after its own copy-out (the last unit's of the
    # backward has none: its peers' lifetime ends it instead), and whose address is not allocated again
    # before that all-gather (an earlier re-allocation ends it first). Those alive to the end once their
    # free is dropped come first; which buffers qualify depends on the allocator's address reuse.
    iv = labels.fsdp_intervals(rd.events)

    def next_gather(r) -> float:
        own = iv[(iv["fsdp_phase"] == "all_gather_copy_out") & (iv["unit"] == r["unit"]) & (iv["ts_us"] >= r["alloc_us"])]
        return iv[(iv["fsdp_phase"] == "all_gather") & (iv["ts_us"] >= own["end_us"].iloc[0])]["ts_us"].min() \
            if len(own) else np.nan

    def realloc(r) -> float:
        later = me[(me["addr"] == r["addr"]) & (me["bytes"] > 0) & (me["ts_us"] > r["free_us"])]["ts_us"]
        return later.min() if len(later) else np.inf

    nxt_of = np.array([next_gather(r) for _, r in ag.iterrows()], dtype=float)
    re_of = np.array([realloc(r) for _, r in ag.iterrows()], dtype=float)
    ok = np.isfinite(nxt_of) & (re_of > nxt_of)
    assert ok.any(), (ag[["unit", "addr"]], nxt_of, re_of)
    victim = ag.iloc[sorted(np.flatnonzero(ok), key=lambda i: np.isfinite(re_of[i]))[0]]
    drop = (me["addr"] == victim["addr"]) & (me["bytes"] == -victim["bytes"]) & (me["ts_us"] == victim["free_us"])
    assert drop.sum() == 1
    rd.memory_events = me[~drop].reset_index(drop=True)
    m1 = memory_analysis(rd)
    assert any("no free event" in w for w in m1.warnings)
    b = m1.allocations
    fixed = b[(b["addr"] == victim["addr"]) & (b["alloc_us"] == victim["alloc_us"])].iloc[0]
    assert np.isfinite(fixed["free_us"]) and fixed["free_us"] > fixed["alloc_us"] and fixed["free_inferred"]
    # FSDP's rule, from the trace's own annotations: its unit's copy-out, then the next all-gather
    nxt = next_gather(victim)
    assert victim["free_us"] <= nxt                 # the real free respected the rule
    assert fixed["free_us"] == nxt
    ts = np.sort(rd.memory_events["ts_us"].to_numpy(float))
    assert fixed["free_seq"] == np.searchsorted(ts, nxt, side="left")
    assert abs(m1.peak_allocated_bytes - m0.peak_allocated_bytes) <= victim["bytes"]
    units = {u["fqn"]: u["unsharded_bytes"] for u in rd.inventory["units"]}
    bd = m1.breakdown_at_peak.set_index("category")["bytes"]
    assert bd["unsharded_param"] <= 2 * max(v for k, v in units.items() if k) + units[""]


# --------------------------------------------------------------------------- memory before the window
ORACLE_STRATEGIES = ["ddp", "fsdp1-full", "fsdp2"]


@pytest.fixture(scope="module")
def oracle_runs(tmp_path_factory):
    """Each strategy recorded by fsdpprof record with the example's --memory-oracle on: c10's CPU allocator counts
    every thread's bytes from before the model's construction to the end, in the very run recorded."""
    out = {}

    def get(strategy):
        if strategy not in out:
            d = tmp_path_factory.mktemp(f"oracle-{strategy}")
            run_dir, prefix = d / "run", d / "oracle"
            proc = run_fsdpprof("record", "--out", str(run_dir), "--skip-steps", "1", "--warmup-steps", "1",
                                "--active-steps", "2", "--", sys.executable, "-m", "torch.distributed.run",
                                "--standalone", "--nproc-per-node=2", str(EXAMPLE), "--strategy", strategy,
                                "--steps", "5", "--memory-oracle", str(prefix), timeout=600)
            assert proc.returncode == 0, proc.stderr[-3000:]
            out[strategy] = (run_dir, {r: json.loads((d / f"oracle.{r}").read_text()) for r in (0, 1)})
        return out[strategy]
    return get


@pytest.mark.parametrize("strategy", ORACLE_STRATEGIES)
def test_memory_before_the_window_equals_the_oracle(oracle_runs, strategy):
    """What was alive as the window began (after step 1's optimizer step: --skip-steps 1 --warmup-steps 1) equals
    c10's every-thread count at that moment within 0.1 %: made before the window, in the construction or the
    steps before, by any thread, freed or not."""
    run_dir, oracle = oracle_runs(strategy)
    run = load_run(str(run_dir))
    for r, rd in run.ranks.items():
        m = memory_analysis(rd)
        want = oracle[r]["after_step_bytes"][1]
        print(f"{strategy} rank {r}: alive at the window's start {m.baseline_bytes} B, oracle {want} B")
        assert abs(m.baseline_bytes - want) <= 0.001 * want


# c10's count of every thread's CPU bytes is on from torch's import to the window's end (fsdpprof record's
# bootstrap), so each window [memory] event's "Total Allocated" is every CPU byte alive, gloo's threads included;
# what the profiler's rows do not hold of it is "other threads" (cpu_events.other_threads).  What the count does on
# gloo's threads between two events of the recorded thread stays unseen: the peak is the window's, and the oracle's
# like for like is its most in the window's steps (2 and 3: --skip-steps 1 --warmup-steps 1 --active-steps 2).
# Measured 06:40-06:50 UTC, two recordings at once on 2 cores, against the window's steps: DDP 2 of 2, FSDP1 12 of
# 12 and FSDP2 12 of 12 rank-runs exact (against the whole run's peak 4 of 26 read lower: another step went higher).
WINDOW_STEPS = slice(2, 4)


@pytest.mark.parametrize("strategy", ["ddp", "fsdp1-full", "fsdp2"])
def test_peak_equals_the_whole_run_oracle(oracle_runs, strategy):
    """The CPU peak fsdpprof reports equals the most bytes c10's allocator held at once (every thread, counted
    from before the model's construction) in the window's steps, within 0.1 %: memory made before the window and
    alive in it (DDP's buckets, params, optimizer state) is counted, and so are the buffers gloo's threads hold;
    the breakdown's categories add up to it."""
    run_dir, oracle = oracle_runs(strategy)
    run = load_run(str(run_dir))
    for r, rd in run.ranks.items():
        m = memory_analysis(rd)
        want = max(oracle[r]["step_peak_bytes"][WINDOW_STEPS])
        print(f"{strategy} rank {r}: fsdpprof {m.peak_allocated_bytes} B, oracle {want} B in the window "
              f"({oracle[r]['peak_allocated_bytes']} B in the whole run), baseline {m.baseline_bytes} B")
        assert oracle[r]["allocations"] > 1000          # the oracle really counted the run
        assert abs(m.peak_allocated_bytes - want) <= 0.001 * want
        assert int(m.breakdown_at_peak["bytes"].sum()) == m.peak_allocated_bytes
        bw = rd.inventory["before_window"]
        assert bw["error"] is None and bw["allocations"] and bw["steps"] == 2
        assert bw["window_counts_every_thread"] is True and bw["every_thread_counted_from"] == "torch import"


def test_ddp_buckets_counted_before_the_window(oracle_runs):
    """DDP's gradient buckets (flat buffers its reducer made before the window, alive to the end) never appear in
    the window's trace: the record before the window counts them, named by the sizes DDP reports (inventory's
    ddp_bucket_bytes): at the peak, gradients waiting for their all-reduce, as many bytes as the parameters."""
    run_dir, _ = oracle_runs("ddp")
    run = load_run(str(run_dir))
    for r, rd in run.ranks.items():
        m = memory_analysis(rd)
        psi_bytes = rd.inventory["totals"]["param_bytes"]
        assert sum(rd.inventory["ddp_bucket_bytes"]) == psi_bytes        # fp32 grads, no bucket view
        bd = m.breakdown_at_peak.set_index("category")["bytes"]
        assert bd["unsharded_grad"] == psi_bytes
        # nothing of the buckets is left unnamed.  (A small allocation made before the record and freed on a thread
        # the profiler does not record stays named, and c10's count takes it back as a negative other-threads row:
        # 1,184 B in one recording of several; the two cancel to the byte)
        unnamed = bd.get("before_recording", 0)
        assert unnamed <= 4096 and unnamed + min(0, bd.get("other_threads", 0)) == 0, dict(bd)
        assert m.coverage_pct >= 99.9


@pytest.mark.parametrize("strategy", ["ddp", "fsdp2"])
def test_merged_timeline_keeps_the_memory_before_the_window(oracle_runs, tmp_path, strategy):
    """`fsdpprof timeline` then `report` on its file: the same baseline, peak and breakdown (other threads'
    bytes included) as the run directory's."""
    run_dir, _ = oracle_runs(strategy)
    out = tmp_path / "tl.json.gz"
    proc = run_fsdpprof("timeline", str(run_dir), "-o", str(out))
    assert proc.returncode == 0, proc.stderr
    merged = load_run(str(out))
    direct = load_run(str(run_dir))
    for r in direct.ranks:
        a, b = memory_analysis(direct.ranks[r]), memory_analysis(merged.ranks[r])
        assert b.baseline_bytes == a.baseline_bytes > 0
        assert b.peak_allocated_bytes == a.peak_allocated_bytes
        assert b.breakdown_at_peak["bytes"].tolist() == a.breakdown_at_peak["bytes"].tolist()


def test_c10_logging_at_info_level_keeps_the_count_off(tmp_path):
    """Where c10 logs at INFO level, its count of every thread's bytes would print a line per allocation into the
    job's stderr: fsdpprof leaves it off (and says so in collector.log), the job's output stays its own, and the
    analysis falls back to the recorded thread's bytes."""
    run_dir = tmp_path / "run"
    proc = run_fsdpprof("record", "--out", str(run_dir), "--skip-steps", "1", "--warmup-steps", "1",
                        "--active-steps", "1", "--", sys.executable, str(EXAMPLE), "--strategy", "none",
                        "--steps", "3", env={"TORCH_CPP_LOG_LEVEL": "INFO"}, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "C10 alloc" not in proc.stderr and "C10 deleted" not in proc.stderr
    bw = json.loads((run_dir / "rank-0" / "inventory.json").read_text())["before_window"]
    assert bw["every_thread_counted_from"] is None and bw["window_counts_every_thread"] is False
    assert "c10 logs at INFO level" in (run_dir / "rank-0" / "collector.log").read_text()
    m = memory_analysis(load_run(str(run_dir)).ranks[0])
    bd = m.breakdown_at_peak.set_index("category")["bytes"]
    assert m.peak_allocated_bytes > 0 and bd.get("other_threads", 0) == 0
