"""A real 2-rank FSDP2 run on gloo (recorded once per session by the shared fixture)."""
from __future__ import annotations

import numpy as np
import pytest

from fsdpprof.analyze.comm import matching
from fsdpprof.analyze.comm import overlap
from fsdpprof.analyze.comm import skew
from fsdpprof.analyze import model
from fsdpprof.analyze.comm import steps
from fsdpprof.analyze.comm import volume
from fsdpprof.analyze.load.run import load_run, run_events

pytestmark = pytest.mark.slow  # every test reads real torchrun/gloo recordings


@pytest.fixture(scope="module")
def fsdp2_run(recorded_run):
    return load_run(recorded_run("fsdp2"), workers=2)


def test_run_dir_loads(fsdp2_run):
    run = fsdp2_run
    assert run.source == "run_dir" and run.world_size == 2 and sorted(run.ranks) == [0, 1]
    assert run.missing == {}
    for r, rd in run.ranks.items():
        assert rd.inventory is not None and rd.info["rank"] == r
        assert rd.trace_meta["device_type"] == "cpu"
        assert list(rd.events.columns) == model.EVENT_COLUMNS
        assert (rd.events["rank"] == r).all()
        assert len(rd.memory_events) > 0 and (rd.memory_events["rank"] == r).all()
        # steps are the optimizer steps the recorder says it profiled
        assert sorted(rd.events["step"].dropna().unique()) == sorted(rd.info["profiler_steps"])


def test_gloo_collectives_per_step_match_fsdp_units(fsdp2_run):
    ev = run_events(fsdp2_run)
    comm = ev[ev["kind"] == "comm"]
    assert comm["name"].astype(str).str.startswith("gloo:").all()
    assert comm["collective"].notna().all() and comm["bytes"].notna().all()
    inv = fsdp2_run.ranks[0].inventory
    units = {u["fqn"]: u for u in inv["units"] if u["unsharded_numel"] > 0}
    n_units = len(units)
    counts = comm.groupby(["rank", "step", "collective"], observed=True).size().unstack("collective")
    # one reduce-scatter per unit per step; FULL_SHARD all-gathers every unit in forward and again in backward
    assert (counts["reduce_scatter"] == n_units).all()
    assert (counts["all_gather"] == 2 * n_units).all()
    # each collective is tagged with its unit, and its size is that unit's whole unsharded flat parameter
    vol = volume.collective_volume(comm, by=("rank", "step", "unit", "collective"))
    assert set(vol["unit"]) == set(units)
    for _, row in vol.iterrows():
        u = units[row["unit"]]
        per_call = row["bytes"] / row["count"]
        # FSDP2 pads each parameter to a multiple of the world size: at most (ws - 1) elements per parameter
        pad = (inv["world_size"] - 1) * 4 * len(u["param_fqns"])
        assert u["unsharded_bytes"] <= per_call <= u["unsharded_bytes"] + pad, (row["unit"], per_call)
    assert (vol["algbw_gbps"] > 0).all()
    assert np.allclose(vol["busbw_gbps"], vol["algbw_gbps"] * 0.5)       # n = 2: (n-1)/n
    phases = set(comm["fsdp_phase"].astype(str))
    assert phases == {"all_gather", "post_backward_reduce"}


def test_overlap_and_steps_are_consistent(fsdp2_run):
    ev = run_events(fsdp2_run)
    tot = overlap.overall_overlap(ev).set_index("rank")
    assert (tot["comm_us"] > 0).all() and (tot["compute_us"] > 0).all()
    assert np.allclose(tot["exposed_comm_us"] + tot["overlapped_comm_us"], tot["comm_us"])
    for by in (("rank", "step"), ("rank", "collective"), ("rank", "fsdp_phase", "unit"), ("rank", "step", "collective", "unit")):
        g = overlap.comm_overlap(ev, by=by)
        assert np.allclose(g["exposed_comm_us"] + g["overlapped_comm_us"], g["comm_us"])
        assert ((g["overlap_pct"] >= 0) & (g["overlap_pct"] <= 100)).all()
        # a finer grouping never loses comm time
        s = g.groupby("rank")["comm_us"].sum()
        assert (s >= tot["comm_us"] - 1e-6).all()
    sb = steps.step_breakdown(ev)
    assert len(sb) == 4
    # no memcpy on CPU: T_step = T_comp + T_comm - T_overlap + idle exactly
    assert np.allclose(sb["residual_us"], 0, atol=1e-6)
    assert (sb["idle_us"] >= 0).all() and (sb["compute_us"] > 0).all()
    # per-step comm inside the ProfilerStep window equals the comm launched in that step (gloo work finishes in-step)
    per_step = overlap.comm_overlap(ev, by=("rank", "step")).set_index(["rank", "step"])["comm_us"]
    assert np.allclose(sb.set_index(["rank", "step"])["comm_us"], per_step.reindex(sb.set_index(["rank", "step"]).index),
                       rtol=0.02)
    # compute is the leaf ops of the main thread only, never the gloo threads
    comm_lanes = set(ev.loc[ev["kind"] == "comm", "lane"].astype(str))
    comp_lanes = set(ev.loc[ev["kind"] == "compute", "lane"].astype(str))
    assert comm_lanes and comp_lanes and not (comm_lanes & comp_lanes)


def test_ranks_align_on_gloo(fsdp2_run):
    ev = run_events(fsdp2_run)
    rec, stats = matching.match_collectives(skew.collective_records(ev))
    print(f"recorded 2-rank gloo run: {stats.to_dict()}")
    # one host, the same calls on both ranks: every call matched, sizes known, no match of different identities
    assert stats.matched == len(rec) and stats.refused == stats.unmatched == 0 and stats.size_checked_pct == 100.0
    ok = rec.groupby("match_id").agg(c=("collective", "nunique"), b=("bytes", "nunique"), n=("rank", "size"))
    assert (ok["c"] == 1).all() and (ok["b"] == 1).all() and (ok["n"] == 2).all()
    sk, lag = skew.collective_skew(rec)
    n = ev[ev["kind"] == "comm"].groupby("rank").size()
    assert len(sk) == n.iloc[0] == n.iloc[1] and (sk["n_ranks"] == 2).all()
    assert set(sk["last_rank"]) <= {0, 1}
    st = skew.stragglers(sk, lag)
    assert st["times_last"].sum() == len(sk)
    # both ranks ran on one host and one clock: the alignment offsets are small next to a step
    step_us = steps.step_breakdown(ev)["step_us"].min()
    assert (st["clock_offset_us"].abs() < step_us).all()


def test_bad_or_absent_rank_in_run_dir(recorded_run, tmp_path):
    import shutil
    src = recorded_run("fsdp2")
    bad = tmp_path / "bad"
    shutil.copytree(src, bad)
    (bad / "rank-1" / "trace.json.gz").write_bytes(b"\x1f\x8b\x08\x00garbage")
    run = load_run(bad, workers=1)
    assert run.ranks[0].events is not None and len(run.ranks[0].events) > 0
    # rank 1 is listed as missing, but its inventory is still there for memory attribution
    assert "rank-1" in run.missing and "trace.json.gz" in run.missing["rank-1"]
    assert run.ranks[1].events is None and run.ranks[1].inventory is not None
    assert sorted(run_events(run)["rank"].unique()) == [0]
    gone = tmp_path / "gone"
    shutil.copytree(src, gone)
    shutil.rmtree(gone / "rank-1")
    run = load_run(gone, workers=1)
    assert sorted(run.ranks) == [0] and "rank-1" in run.missing and run.world_size == 2
