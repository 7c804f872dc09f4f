"""CPU contention in `fsdpprof whatif`: the processor-sharing model on hand-built numbers, a run recorded
before rank.json had its CPU load (predicted as before, and it says so) and one that has it."""
from __future__ import annotations

from dataclasses import replace

import pytest

from fsdpprof.analyze import load_run
from fsdpprof.analyze.whatif import contention as ct
from fsdpprof.analyze.whatif import predict as wp
from fsdpprof.analyze.whatif import targets as tg

# 2 ranks on 2 cores, each over a 1000 us window: 800 us on a CPU, 200 us waiting for one
CPU = {"usable_cores": 2, "cpu_count": 2, "local_world_size": 2, "torch_threads": 1, "wall_us": 1000.0,
       "cpu_us": 800.0, "run_us": 800.0, "runqueue_us": 200.0, "threads": 4}


def source(device: str = "cpu") -> tg.Source:
    return tg.Source(family="fsdp2", strategy=tg.FULL_SHARD, world_size=2, shard_group=2, reshard_after_forward=True,
                     stored_dtype="float32", param_dtype="float32", reduce_dtype="float32", cpu_offload=False,
                     device_type=device, hosts=1, ranks_per_host=2)


def test_processor_sharing_on_hand_built_numbers():
    """demand (800 + 200) / 1000 = 1 core; contention 1 + 200 / 800 = 1.25; the host's runnable threads
    2 x 1.25 = 2.5 less the ranks' 2 x 1 leave 0.5 of other load. 4 ranks: (4 + 0.5) / 2 = 2.25 -> the step
    x 2.25 / 1.25 = 1.8; 1 rank: (1 + 0.5) / 2 < 1, no contention -> x 0.8; 2 ranks: unchanged."""
    load = ct.host_load(CPU)
    assert (load.cores, load.ranks, load.demand, load.contention) == (2, 2, 1.0, 1.25)
    assert load.other_load == pytest.approx(0.5)
    assert load.contention_at(4) == pytest.approx(2.25) and load.step_scale(4) == pytest.approx(1.8)
    assert load.contention_at(1) == 1.0 and load.step_scale(1) == pytest.approx(0.8)
    assert load.step_scale(2) == pytest.approx(1.0)
    # no other load measured: the ranks' own demand only (3 cores demanded on 2: x1.5; 6 on 2: x3)
    quiet = ct.host_load(dict(CPU, run_us=1000.0, runqueue_us=500.0, wall_us=1000.0))
    assert quiet.demand == 1.5 and quiet.contention == 1.5 and quiet.other_load == 0.0
    assert quiet.step_scale(4) == pytest.approx(2.0)
    # LOCAL_WORLD_SIZE missing: the run's layout
    assert ct.host_load({k: v for k, v in CPU.items() if k != "local_world_size"}, ranks_on_host=4).ranks == 4


@pytest.mark.parametrize("cpu", [None, {}, {"usable_cores": 2}, dict(CPU, run_us=0.0), dict(CPU, wall_us="x"),
                                 dict(CPU, usable_cores=0, cpu_count=None), dict(CPU, runqueue_us=-1.0)])
def test_missing_or_broken_cpu_load_is_none(cpu):
    assert ct.host_load(cpu) is None


def test_step_scale_by_target_layout():
    """A one-host run: all the target's ranks on its host (or --ranks-per-host); an accelerator run and a run
    without the load are not scaled, the latter says so."""
    load, src = ct.host_load(CPU), source()
    four = tg.make_target(src, "HYBRID_SHARD", world_size=4, shard_group=2)
    scale, kept, assumed = ct.cpu_step_scale(load, src, four)
    assert scale == pytest.approx(1.8) and kept and any("4 ranks per host" in a for a in assumed)
    spread = tg.make_target(src, "HYBRID_SHARD", world_size=4, shard_group=2, ranks_per_host=2)
    assert tg.ranks_on_host(src, spread) == 2 and ct.cpu_step_scale(load, src, spread)[0] == pytest.approx(1.0)
    assert ct.cpu_step_scale(load, source("cuda"), four) == (1.0, [], [])
    scale, kept, assumed = ct.cpu_step_scale(None, src, four)
    assert scale == 1.0 and not kept and any("CPU contention unknown" in a for a in assumed)
    with pytest.raises(tg.UserError):
        tg.make_target(src, "FULL_SHARD", world_size=4, ranks_per_host=3)


@pytest.mark.slow
def test_recorded_run_with_and_without_cpu_load(recorded_run):
    """A real recording carries rank.json cpu: 4 ranks on its host predict a longer step than 2, by the model's
    ratio, and say what they kept and assumed. The same ranks with the field removed (as recorded before it)
    predict the same step on 2 ranks per host and on 4, and say the contention is unknown. (Time only: the
    memory replay does not read the field.)"""
    run = load_run(str(recorded_run("fsdp2")))
    hosts = wp.hosts_of(run)
    src = wp.source_of_rank(run.ranks[0], *hosts)
    two = tg.target_of_source(src)
    four = tg.make_target(src, "HYBRID_SHARD", world_size=4, shard_group=2)

    def predict(strip: bool) -> dict:
        ranks = [replace(rd, info={k: v for k, v in rd.info.items() if k != "cpu" or not strip})
                 for rd in run.ranks.values()]
        assert all(("cpu" in rd.info) != strip for rd in ranks)
        return wp.reduce_predictions([two, four], [wp.rank_predictions(rd, [two, four], False, *hosts) for rd in ranks],
                                     two)

    res = predict(strip=False)
    p2, p4 = res["predictions"]
    assert p2["step_us"] == pytest.approx(res["measured"]["step_us"], rel=0.02)
    assert p4["cpu_contention"] > p2["cpu_contention"] == pytest.approx(p2["run_cpu_contention"])
    assert p4["step_us"] > p2["step_us"]
    assert any("rank.json cpu" in k for k in p4["kept"]) and any("processor sharing" in a for a in p4["assumed"])
    o2, o4 = predict(strip=True)["predictions"]
    assert o2["step_us"] == pytest.approx(p2["step_us"], rel=1e-6)
    assert o2["cpu_contention"] is None and o4["cpu_contention"] is None
    assert o4["step_us"] < p4["step_us"]
    assert any("CPU contention unknown" in a for a in o4["assumed"])
