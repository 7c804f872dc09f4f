"""Findings fire on the numbers that should trigger them, and name those numbers."""
import numpy as np
import pandas as pd
import pytest

from fsdpprof.analyze.summary import findings as fnd


def _steps(step_us=1000.0, exposed=0.0, ranks=(0, 1)):
    return pd.DataFrame([{"rank": r, "step": s, "step_us": step_us, "exposed_comm_us": exposed}
                         for r in ranks for s in (2, 3)])


def test_exposed_forward_all_gather_suggests_prefetch():
    op = pd.DataFrame([
        {"rank": 0, "step": 2.0, "collective": "all_gather", "stage": "forward", "fsdp_phase": "all_gather",
         "exposed_comm_us": 200.0},
        {"rank": 0, "step": 3.0, "collective": "reduce_scatter", "stage": "backward",
         "fsdp_phase": "post_backward_reduce", "exposed_comm_us": 20.0},  # 10 us per step = 1%: below the threshold
        # launched outside every step: not divided by a step's time (it was "439.9% of step time")
        {"rank": 0, "step": float("nan"), "collective": "all_reduce", "stage": "outside_step", "fsdp_phase": None,
         "exposed_comm_us": 9000.0},
    ])
    out = fnd.comm_findings(op, _steps())
    ids = [f.id for f in out]
    assert ids == ["exposed_all_gather_forward"]
    f = out[0]
    # the report's statistic: each rank's mean per step, the median over ranks (rank 1 has none: 5 %), the worst
    # rank beside it (rank 0: 10 %), which crosses the threshold
    assert f.value == 5.0 and f.worst == 10.0 and f.unit == "%"
    assert "prefetch" in f.suggestion and "reshard_after_forward" in f.suggestion
    assert f.rank == 0 and f.section == "communication" and "median over 2 ranks, worst rank 0: 10%" in f.title
    # not an FSDP input: no FSDP knobs in the advice
    plain = fnd.comm_findings(op, _steps(), fsdp_advice=False)[0]
    assert "FSDP" not in plain.suggestion and "reshard" not in plain.suggestion


def test_total_exposed_and_thresholds():
    assert fnd.comm_findings(None, _steps(exposed=100.0)) == []  # 10% < 20%
    out = fnd.comm_findings(None, _steps(exposed=300.0))
    assert [f.id for f in out] == ["exposed_comm_total"] and out[0].value == 30.0


def _bd(**pct):
    return pd.DataFrame([{"category": c, "bytes": p * 10, "pct": p} for c, p in pct.items()])


def test_memory_findings():
    out = fnd.memory_findings(_bd(optimizer_state=50, activation=20, sharded_param=15, sharded_grad=15), "DDP", 1000,
                              alternatives={"ZeRO-3 / FULL_SHARD": 2**20})
    ids = {f.id for f in out}
    assert ids == {"optimizer_state_dominates", "replicated_model_states"}
    rep = next(f for f in out if f.id == "replicated_model_states")
    assert rep.value == 80 and "ZeRO-3 / FULL_SHARD 1.00 MiB" in rep.suggestion
    out = fnd.memory_findings(_bd(activation=60, unsharded_param=35, optimizer_state=5), "FULL_SHARD", 1000,
                              fragmentation_pct=40.0, coverage_pct=50.0)
    assert {f.id for f in out} == {"activations_dominate", "unsharded_params_large", "fragmentation",
                                   "low_attribution"}
    assert fnd.memory_findings(_bd(activation=30, optimizer_state=30, sharded_param=40), "FULL_SHARD", 1) == []
    # one device: no sharding advice, even with most of the peak in model states
    one = fnd.memory_findings(_bd(optimizer_state=50, param=25, grad=25), None, 1000, input_kind="single_device")
    assert {f.id for f in one} == {"optimizer_state_dominates"}
    assert "shard" not in one[0].suggestion.lower() and "offload" not in one[0].suggestion.lower()


def test_topology_and_straggler():
    assert fnd.topology_findings("FULL_SHARD", 1, 8) == []
    t = fnd.topology_findings("FULL_SHARD", 2, 16)
    assert t and "HYBRID_SHARD" in t[0].suggestion
    # a straggler: last more often than chance (p-value under 1 % over the 2 ranks tested) AND costing >= 2 % of
    # the step; the finding states the cost per step, the p-value and where
    st = pd.DataFrame({"rank": [0, 1], "times_last": [20, 80], "share_last_pct": [20.0, 80.0],
                       "expected_last_pct": [50.0, 50.0], "p_value": [1.0, 1e-9], "mean_start_lag_us": [10.0, 500.0],
                       "cost_per_step_us": [0.0, 300.0], "where": [None, "forward, layers.2"]})
    out = fnd.rank_findings(st, 10_000.0)
    assert [f.rank for f in out] == [1] and out[0].stake_us == 300.0 and out[0].value == 300.0
    assert "p = 1e-09" in out[0].title and "forward, layers.2" in out[0].title and "0.3 ms per step" in out[0].title
    assert "prefetch" in out[0].suggestion and "not help" in out[0].suggestion
    # as often last as chance gives: no finding, however costly
    assert fnd.rank_findings(st.assign(p_value=[1.0, 0.007]), 10_000.0) == []     # 0.007 > 0.01 / 2 ranks
    # unlikely by chance but cheap (under 2 % of the step, the critical path's floor): no finding
    assert fnd.rank_findings(st, 20_000.0) == []


def test_sort_puts_high_first():
    a = fnd.Finding("a", "info", "", "", 99.0, "%", 1, "", "x")
    b = fnd.Finding("b", "high", "", "", 5.0, "%", 1, "", "x")
    c = fnd.Finding("c", "high", "", "", 50.0, "%", 1, "", "x")
    assert [f.id for f in fnd.sort_findings([a, b, c])] == ["c", "b", "a"]


def test_sort_ranks_by_the_step_time_at_stake():
    mem = fnd.Finding("mem", "high", "", "", 90.0, "%", 1, "", "memory")
    small = fnd.Finding("comm", "high", "", "", 30.0, "%", 1, "", "x", 0, 300.0)
    big = fnd.Finding("idle", "medium", "", "", 12.0, "%", 1, "", "x", 0, 5000.0)
    assert [f.id for f in fnd.sort_findings([mem, small, big])] == ["idle", "comm", "mem"]


def _stall_trace(tmp_path) -> str:
    """One step on a GPU: the device waits for a DataLoader fetch, a tensor.item() and a
    torch.cuda.synchronize() (times in us; every gap but one is host wait)."""
    from test_event_model import Trace

    t = Trace()
    t.cpu("ProfilerStep#1", 0, 1000, cat="user_annotation")
    t.kernel("void a", 5, 10, 100)                                         # busy 10-110
    t.cpu("enumerate(DataLoader)#_SingleProcessDataLoaderIter.__next__", 120, 200, cat="user_annotation")
    t.kernel("void b", 325, 330, 10)                                       # idle 110-330: host wait 220
    t.cpu("aten::item", 341, 29)
    t.cpu("aten::_local_scalar_dense", 342, 27)
    t.cpu("cudaStreamSynchronize", 345, 23, cat="cuda_runtime")           # returns at 368, in the gap 340-375
    t.kernel("void c", 372, 375, 100)                                      # idle 340-375: host wait 35
    t.cpu("cudaDeviceSynchronize", 500, 10, cat="cuda_runtime")           # returns at 510, in the gap 475-515
    t.kernel("void d", 512, 515, 85)                                       # idle 475-515: host wait 40
    t.kernel("void e", 520, 605, 95)                                       # idle 600-605: kernel wait 5
    return t.write(tmp_path / "rank-0.json")


def test_device_idle_syncs_and_data_loader_from_a_hand_built_step(tmp_path):
    from fsdpprof.analyze.comm import steps as st
    from fsdpprof.analyze.pipeline import analyze_run
    from fsdpprof.analyze.load.run import load_run
    from fsdpprof.analyze.trace import load_trace

    ev = load_trace(_stall_trace(tmp_path)).events
    s = st.step_stalls(ev).iloc[0]
    assert (s["idle_host_wait_us"], s["idle_kernel_wait_us"], s["idle_other_us"]) == (295.0, 5.0, 0.0)
    assert (s["sync_calls"], s["scalar_sync_calls"], s["sync_us"], s["sync_idle_us"]) == (2, 1, 33.0, 75.0)
    assert (s["data_loader_us"], s["data_loader_idle_us"]) == (200.0, 200.0)
    step = st.step_breakdown(ev).iloc[0]
    assert step["idle_us"] == s["idle_host_wait_us"] + s["idle_kernel_wait_us"] + s["idle_other_us"] == 300.0

    a = analyze_run(load_run(_stall_trace(tmp_path)))
    f = {x.id: x for x in a.findings}
    assert [x.id for x in a.findings][:3] == ["device_idle", "data_loader", "host_syncs"]      # by time at stake
    idle = f["device_idle"]
    assert idle.value == pytest.approx(100 * 300 / 690) and idle.stake_us == 300.0 and idle.severity == "high"
    assert "98% of it waiting for the host to launch work (host-bound)" in idle.title and "CUDA graphs" in idle.suggestion
    sync = f["host_syncs"]
    assert sync.stake_us == 75.0 and sync.value == pytest.approx(100 * 75 / 690)
    assert sync.title.startswith("2 host synchronisations per step, 1 of them in tensor.item()")
    assert f["data_loader"].stake_us == 200.0 and "num_workers" in f["data_loader"].suggestion
    for x in (idle, sync, f["data_loader"]):           # each names its threshold and summary.json keys
        assert x.threshold > 0 and ("steps." in x.metric or "step_stalls." in x.metric)
    assert a.step_stalls is not None and len(a.step_stalls) == 1


def test_device_findings_thresholds():
    steps = pd.DataFrame({"rank": [0, 0], "step": [1.0, 2.0], "step_us": [1000.0, 1000.0], "idle_us": [90.0, 90.0]})
    stalls = pd.DataFrame({"rank": [0, 0], "step": [1.0, 2.0], "idle_host_wait_us": [10.0, 10.0],
                           "idle_kernel_wait_us": [70.0, 70.0], "idle_other_us": [10.0, 10.0],
                           "sync_calls": [3, 3], "scalar_sync_calls": [0, 0], "sync_us": [5.0, 5.0],
                           "sync_idle_us": [19.0, 19.0], "data_loader_us": [60.0, 60.0],
                           "data_loader_idle_us": [49.0, 49.0]})
    assert fnd.device_findings(steps, stalls) == []       # 9% idle, 1.9% after syncs, 4.9% loading: below
    more = fnd.device_findings(steps.assign(idle_us=100.0), stalls.assign(sync_idle_us=20.0, data_loader_idle_us=50.0))
    assert {x.id for x in more} == {"device_idle", "host_syncs", "data_loader"}
    idle = next(x for x in more if x.id == "device_idle")
    assert idle.value == 10.0 and "launch-bound" in idle.title and idle.stake_us == 100.0
    # a CPU trace: no device idle and no syncs; the DataLoader's host time is what is at stake
    cpu = fnd.device_findings(steps.assign(idle_us=500.0), stalls.assign(data_loader_idle_us=np.nan), device=False)
    assert [x.id for x in cpu] == ["data_loader"] and cpu[0].value == 6.0 and "training thread" in cpu[0].title


@pytest.mark.parametrize("rel,idle_pct,cause", [("tracelens-b200-8rank", 86.3, "host-bound"),
                                                ("hta-16rank-a100", 62.6, "other streams")])
def test_real_traces_say_the_device_is_idle_first(rel, idle_pct, cause):
    """The B200 trace's device is idle 86 % of the step, hta-16rank 63 %: the first finding says so, why, and
    the time at stake (it used to be "nothing stands out" / a 6.7 % all-reduce finding)."""
    from conftest import shared_data
    from fsdpprof.analyze.pipeline import analyze_run
    from fsdpprof.analyze.load.run import load_run

    a = analyze_run(load_run(str(shared_data("gpu-traces", rel)), lazy=True))
    first = a.findings[0]
    s = a.steps
    assert first.id == "device_idle" and cause in first.title
    assert first.value == pytest.approx(100 * s["idle_us"].sum() / s["step_us"].sum()) == pytest.approx(idle_pct, abs=0.1)
    assert first.stake_us == pytest.approx(s["idle_us"].sum() / s["step"].nunique())
    assert all(first.stake_us >= f.stake_us for f in a.findings if f.stake_us == f.stake_us)
