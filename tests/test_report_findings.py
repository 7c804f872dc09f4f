"""Findings fire on the numbers that should trigger them, and name those numbers."""
import pandas as pd

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
    assert f.value == 10.0 and f.unit == "%" and "prefetch" in f.suggestion and "reshard_after_forward" in f.suggestion
    assert f.rank == 0 and f.section == "communication"
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
    st = pd.DataFrame({"rank": [0, 1], "times_last": [2, 8], "mean_start_lag_us": [10.0, 500.0]})
    out = fnd.rank_findings(st, 10, 10_000.0)
    assert [f.rank for f in out] == [1] and out[0].value == 80.0
    even = pd.DataFrame({"rank": [0, 1], "times_last": [5, 5], "mean_start_lag_us": [500.0, 500.0]})
    assert fnd.rank_findings(even, 10, 10_000.0)[0].value == 50.0
    assert fnd.rank_findings(st.assign(times_last=[6, 4]).iloc[::-1], 20, 10_000.0) == []


def test_sort_puts_high_first():
    a = fnd.Finding("a", "info", "", "", 99.0, "%", 1, "", "x")
    b = fnd.Finding("b", "high", "", "", 5.0, "%", 1, "", "x")
    c = fnd.Finding("c", "high", "", "", 50.0, "%", 1, "", "x")
    assert [f.id for f in fnd.sort_findings([a, b, c])] == ["c", "b", "a"]
