"""Theory formulas: the ZeRO paper's numbers, dtype/optimizer derivation, traffic, peak estimate."""
import math

import pytest

from fsdpprof import options
from fsdpprof.analyze.summary import theory
from fsdpprof.errors import UserError

PSI = 7.5e9


@pytest.mark.parametrize("world,expected", [
    (8, {"DDP": 120, "ZERO1": 41.25, "ZERO2": 28.125, "ZERO3": 15}),
    (16, {"DDP": 120, "ZERO1": 35.625, "ZERO2": 21.5625, "ZERO3": 7.5}),
])
def test_zero_paper_numbers(world, expected):
    k = theory.bytes_per_param("bf16", "bf16", "adam")
    assert (k.k_param, k.k_grad, k.k_opt) == (2, 2, 12)
    got = {m.strategy: m.total_bytes / theory.GB for m in theory.all_model_states(PSI, k, world)}
    for s, gb in expected.items():
        assert got[s] == pytest.approx(gb, rel=1e-12), s
    # FSDP names map onto the same formulas
    assert theory.model_states(PSI, k, "FULL_SHARD", world).total_bytes == got["ZERO3"] * theory.GB
    assert theory.model_states(PSI, k, "SHARD_GRAD_OP", world).total_bytes == pytest.approx(got["ZERO2"] * theory.GB)
    assert theory.model_states(PSI, k, "NO_SHARD", world).total_bytes == pytest.approx(got["DDP"] * theory.GB)


def test_fsdp_over_ddp_traffic_is_one_and_a_half():
    for n in (2, 8, 16, 64):
        ddp = theory.traffic_per_step(PSI, "DDP", n, "bf16").total_bytes
        fsdp = theory.traffic_per_step(PSI, "FULL_SHARD", n, "bf16").total_bytes
        assert fsdp / ddp == pytest.approx(1.5)
        assert ddp == pytest.approx(2 * (n - 1) / n * PSI * 2)


def test_traffic_mixed_dtypes_and_variants():
    n = 8
    # the 70B run: all-gather in bf16, reduce-scatter in fp32
    t = theory.traffic_per_step(70e9, "FULL_SHARD", n, "bf16", "fp32")
    assert t.all_gather_bytes == pytest.approx(2 * 7 / 8 * 70e9 * 2)
    assert t.reduce_scatter_bytes == pytest.approx(7 / 8 * 70e9 * 4)
    sgo = theory.fsdp_traffic(PSI, "SHARD_GRAD_OP", n, "bf16")
    assert sgo.all_gather_bytes == pytest.approx(7 / 8 * PSI * 2)  # one all-gather
    # compression divides the gradient collectives only
    c = theory.traffic_per_step(PSI, "FULL_SHARD", n, "bf16", compression_ratio=4)
    assert c.reduce_scatter_bytes == pytest.approx(t.reduce_scatter_bytes / 70e9 * PSI / 2 / 4)
    assert c.all_gather_bytes == pytest.approx(2 * 7 / 8 * PSI * 2)
    # HSDP: FULL_SHARD inside 8, all-reduce of the shard across 2 replicas
    h = theory.traffic_per_step(PSI, "HYBRID_SHARD", 16, "bf16", shard_group=8)
    assert h.all_reduce_bytes == pytest.approx(2 * 1 / 2 * PSI * 2 / 8)
    assert h.all_gather_bytes == pytest.approx(2 * 7 / 8 * PSI * 2)


def test_hybrid_and_offload():
    k = theory.bytes_per_param("bf16")
    h = theory.model_states(PSI, k, "HYBRID_SHARD", 16, shard_group=8)
    assert h.total_bytes == pytest.approx(16 * PSI / 8)
    off = theory.model_states(PSI, k, "FULL_SHARD", 8, offload="optimizer")
    assert off.host_bytes == pytest.approx(12 * PSI / 8)
    assert off.device_bytes == pytest.approx(4 * PSI / 8)
    allh = theory.model_states(PSI, k, "FULL_SHARD", 8, offload="params")
    assert allh.device_bytes == 0 and allh.host_bytes == pytest.approx(15e9)
    with pytest.raises(UserError):
        theory.model_states(PSI, k, "HYBRID_SHARD", 16, shard_group=5)


def test_bytes_per_param_from_dtypes_and_optimizer():
    fp32 = theory.bytes_per_param("fp32", optimizer="adamw")
    assert (fp32.k_param, fp32.k_grad, fp32.k_opt) == (4, 4, 8)  # no master copy needed
    sgd = theory.bytes_per_param("bf16", optimizer="sgd-momentum")
    assert sgd.k_opt == 8  # master + momentum
    with pytest.raises(UserError):
        theory.bytes_per_param("int3")
    with pytest.raises(UserError):
        theory.bytes_per_param("bf16", optimizer="magic")


def test_k_from_inventory():
    inv = {"optimizer": {"class": "AdamW", "state_keys": ["step", "exp_avg", "exp_avg_sq"]},
           "tensors": [{"role": "param", "dtype": "float32", "name": "w"},
                       {"role": "grad", "dtype": "float32", "name": "w"},
                       {"role": "optimizer_state", "dtype": "float32", "name": "w/step"},
                       {"role": "optimizer_state", "dtype": "float32", "name": "w/exp_avg"}],
           "strategy": "FULL_SHARD"}
    k = theory.k_from_inventory(inv)
    assert (k.k_param, k.k_grad, k.k_opt) == (4, 4, 8)
    assert theory.strategy_from_inventory(inv) == "ZERO3"
    assert theory.k_from_inventory({"optimizer": None, "tensors": []}).k_opt == 0


def test_peak_estimate():
    est = theory.fsdp_peak_estimate(1000.0, {"a": 10, "b": 30}, 2, {"a": 100, "b": 5})
    assert est.max_unit == "a" and est.estimate_bytes == 1000 + 20 + 100
    est2 = theory.fsdp_peak_estimate(1000.0, {"a": 10, "b": 30}, 2, 7)
    assert est2.max_unit == "b" and est2.estimate_bytes == 1000 + 60 + 7


@pytest.mark.parametrize("bad", ["0", "-3", "abc", "nan", "inf", "1e9xb"])
def test_parse_rejects(bad):
    with pytest.raises(UserError):
        options.PARAMS.parse(bad, "--params")
    with pytest.raises(UserError):
        options.GPU_MEM.parse(bad, "--gpu-mem")


def test_parse_accepts():
    assert options.PARAMS.parse("7.5B", "--params") == 7.5e9
    assert options.PARAMS.parse("350M", "--params") == 350e6
    assert options.GPU_MEM.parse("40GB", "--gpu-mem") == 40e9
    assert options.GPU_MEM.parse("80GiB", "--gpu-mem") == 80 * 2**30
    assert math.isclose(options.GPU_MEM.parse("1.5e9", "--gpu-mem"), 1.5e9)
