"""Interval arithmetic, overlap, volume, steps and rank skew on hand-built data with known answers."""
from __future__ import annotations

import orjson
import numpy as np
import pandas as pd

from fsdpprof.analyze import model
import pytest

from conftest import shared_data
from fsdpprof.analyze.comm import intervals
from fsdpprof.analyze.comm import overlap
from fsdpprof.analyze.comm import skew
from fsdpprof.analyze.comm import steps
from fsdpprof.analyze.comm import volume
from fsdpprof.analyze.load.run import load_run, run_events
from fsdpprof.analyze.trace import load_trace


# ---------------------------------------------------------------- intervals vs brute force on a grid
def _grid(starts, ends, n=2000):
    cov = np.zeros(n, dtype=bool)
    for s, e in zip(starts, ends):
        cov[int(s):int(e)] = True
    return cov


@pytest.mark.parametrize("seed", range(5))
@pytest.mark.parametrize("offset", [0.0, -1000.0, -1e6])
def test_intervals_match_brute_force(seed, offset):
    """Against a grid of the same intervals; ``offset`` moves every interval (lengths do not change): part or all
    of them before time 0, as a trace's timestamps may be (the union once ended such a group at 0)."""
    rng = np.random.default_rng(seed)
    a_s = rng.integers(0, 1900, 60).astype(float)
    a_e = a_s + rng.integers(0, 100, 60)
    b_s = rng.integers(0, 1900, 40).astype(float)
    b_e = b_s + rng.integers(0, 100, 40)
    ga, gb = _grid(a_s, a_e), _grid(b_s, b_e)
    a_s, a_e, b_s, b_e = a_s + offset, a_e + offset, b_s + offset, b_e + offset
    assert intervals.total(a_s, a_e) == ga.sum()
    s, e = intervals.intersect(a_s, a_e, b_s, b_e)
    assert (e - s).sum() == (ga & gb).sum()
    assert (np.diff(s) > 0).all() and (s[1:] >= e[:-1]).all()          # disjoint and sorted
    per = intervals.overlap_with(a_s, a_e, b_s, b_e)
    want = [gb[int(x - offset):int(y - offset)].sum() for x, y in zip(a_s, a_e)]
    assert np.allclose(per, want)
    g, gs, ge = intervals.grouped_union(np.zeros(a_s.size, dtype=np.int64), a_s, a_e)
    us, ue = intervals.union(a_s, a_e)
    assert gs.tolist() == us.tolist() and ge.tolist() == ue.tolist()


def test_innermost_nested():
    # [0,100) contains [10,50) which contains [20,30); [60,90) sibling
    s = np.array([0, 10, 20, 60.0])
    e = np.array([100, 50, 30, 90.0])
    q = np.array([5, 15, 25, 55, 70, 100, 150.0])
    assert intervals.innermost(s, e, q).tolist() == [0, 1, 2, 0, 3, -1, -1]


# ---------------------------------------------------------------- a hand-built GPU trace with known intervals
def _gpu_trace(tmp_path, rank=0, offset=0.0):
    """Step 1 = [0, 100) CPU; kernels (launch at t -> runs later on the GPU):
    compute stream 7: [10,40) and [60,80); comm stream 20: [30,70) all_gather 4000 B (n=4)
    and [90,95) reduce_scatter 1000 B; memcpy [40,50) on stream 7."""
    o = offset
    ev = [{"ph": "X", "cat": "user_annotation", "name": "ProfilerStep#1", "pid": 1, "tid": 1, "ts": o, "dur": 100.0},
          {"ph": "X", "cat": "user_annotation", "name": "FSDP::pre_forward (layers.0)", "pid": 1, "tid": 1, "ts": o + 1, "dur": 4.0},
          {"ph": "X", "cat": "user_annotation", "name": "FSDP::all_gather (layers.0)", "pid": 1, "tid": 1, "ts": o + 2, "dur": 2.0},
          {"ph": "X", "cat": "user_annotation", "name": "FSDP::post_backward_reduce (layers.1)", "pid": 1, "tid": 1, "ts": o + 8, "dur": 2.0}]
    kernels = [  # name, stream, start, dur, launch ts, extra args
        ("void gemm_kernel", 7, 10, 30, 6, {}),
        ("Memcpy DtoD (Device -> Device)", 7, 40, 10, 6.5, {}),
        ("void elementwise_kernel", 7, 60, 20, 7, {}),
        ("ncclDevKernel_AllGather_RING_LL", 20, 30, 40, 3, {"Collective name": "_allgather_base", "In msg nelems": 250,
                                                           "Out msg nelems": 1000, "dtype": "Float", "Group size": 4,
                                                           "Process Group Name": "0", "Seq": 1}),
        ("ncclDevKernel_ReduceScatter_Sum_f32_RING_LL", 20, 90, 5, 9, {"Collective name": "_reduce_scatter_base",
                                                                       "In msg nelems": 250, "Out msg nelems": 62,
                                                                       "dtype": "Float", "Group size": 4,
                                                                       "Process Group Name": "0", "Seq": 2}),
    ]
    for i, (name, stream, start, dur, launch, extra) in enumerate(kernels):
        ev.append({"ph": "X", "cat": "cuda_runtime", "name": "cudaLaunchKernel", "pid": 1, "tid": 1, "ts": o + launch,
                   "dur": 0.5, "args": {"correlation": 100 + i}})
        cat = "gpu_memcpy" if name.startswith("Memcpy") else "kernel"
        ev.append({"ph": "X", "cat": cat, "name": name, "pid": 0, "tid": stream, "ts": o + start, "dur": float(dur),
                   "args": {"stream": stream, "correlation": 100 + i, "device": 0, **extra}})
    doc = {"schemaVersion": 1, "distributedInfo": {"backend": "nccl", "rank": rank, "world_size": 4}, "traceEvents": ev}
    p = tmp_path / f"rank-{rank}.json"
    p.write_bytes(orjson.dumps(doc))
    return p


def test_known_overlap_gpu(tmp_path):
    ev = load_trace(str(_gpu_trace(tmp_path))).events
    kinds = ev.groupby("kind", observed=True).size().to_dict()
    assert kinds["compute"] == 2 and kinds["comm"] == 2 and kinds["memcpy"] == 1
    o = overlap.overall_overlap(ev).iloc[0]
    # compute [10,40) u [60,80) = 50; comm [30,70) u [90,95) = 45; overlap [30,40) + [60,70) = 20
    assert o["compute_us"] == 50 and o["comm_us"] == 45 and o["overlapped_comm_us"] == 20
    assert o["exposed_comm_us"] == 25 and o["comp_comm_overlap_pct"] == pytest.approx(100 * 20 / 45)
    by = overlap.comm_overlap(ev, by=("rank", "collective", "fsdp_phase", "unit")).set_index("collective")
    assert by.loc["all_gather", "comm_us"] == 40 and by.loc["all_gather", "overlapped_comm_us"] == 20
    assert by.loc["all_gather", "fsdp_phase"] == "all_gather" and by.loc["all_gather", "unit"] == "layers.0"
    assert by.loc["reduce_scatter", "exposed_comm_us"] == 5 and by.loc["reduce_scatter", "unit"] == "layers.1"
    assert by.loc["reduce_scatter", "fsdp_phase"] == "post_backward_reduce"

    v = volume.collective_volume(ev).set_index("collective")
    # all_gather S = 1000 floats = 4000 B in 40 us -> 0.1 GB/s; busbw * 3/4
    assert v.loc["all_gather", "bytes"] == 4000 and v.loc["all_gather", "algbw_gbps"] == pytest.approx(0.1)
    assert v.loc["all_gather", "busbw_gbps"] == pytest.approx(0.075)
    assert v.loc["reduce_scatter", "bytes"] == 1000 and v.loc["reduce_scatter", "algbw_gbps"] == pytest.approx(0.2)

    s = steps.step_breakdown(ev).iloc[0]
    # GPU step window: first to last device event of step 1 = [10, 95)
    assert s["step"] == 1 and s["step_us"] == 85
    assert s["compute_us"] == 50 and s["comm_us"] == 45 and s["overlapped_comm_us"] == 20
    # idle: [80,90) only; memcpy [40,50) is under comm [30,70) so residual 0
    assert s["idle_us"] == 10 and s["residual_us"] == 0


def test_ring_factors():
    """One definition (model.ring_factor) serves busbw (volume) and bytes on the wire (traffic)."""
    f = model.ring_factor(["all_gather", "reduce_scatter", "all_reduce", "broadcast", "all_to_all", "send_recv",
                           "barrier", None], [8, 8, 8, 8, 8, 2, 8, 8])
    assert np.allclose(f[:7], [7 / 8, 7 / 8, 14 / 8, 1, 7 / 8, 1, 0]) and np.isnan(f[7])


def test_skew_recovers_known_offsets_and_straggler(tmp_path):
    # three ranks, same collectives; clocks shifted by 0, +1000, -500 us; rank 2 arrives 7 us late
    rows = []
    offsets = {0: 0.0, 1: 1000.0, 2: -500.0}
    for r, off in offsets.items():
        for k in range(5):
            start = 100.0 * k + (7.0 if r == 2 else 0.0)
            end = 100.0 * k + 50.0
            rows.append({"rank": r, "lane": "stream:1", "kind": "comm", "name": "nccl", "ts_us": start + off,
                         "dur_us": end - start, "collective": "all_reduce", "bytes": 8.0, "dtype": "float32",
                         "group_size": 3.0, "pg": "0", "seq": float(k), "step": 1.0, "stage": "forward", "fsdp_phase": None, "unit": None})
    ev = pd.DataFrame(rows)
    rec = skew.collective_records(ev)
    off = skew.clock_offsets(rec)
    assert (off - off.loc[0]).round(6).to_dict() == {0: 0.0, 1: 1000.0, 2: -500.0}
    sk, lag = skew.collective_skew(rec)
    assert len(sk) == 5 and (sk["n_ranks"] == 3).all()
    assert np.allclose(sk["start_skew_us"], 7.0) and np.allclose(sk["end_skew_us"], 0.0)
    assert (sk["last_rank"] == 2).all()
    # the records of each rank alone are enough (the per-rank map sends only those)
    per_rank = pd.concat([skew.collective_records(ev[ev["rank"] == r]) for r in range(3)], ignore_index=True)
    sk2, lag2 = skew.collective_skew(per_rank)
    pd.testing.assert_frame_equal(sk.reset_index(drop=True), sk2.reset_index(drop=True))
    st = skew.stragglers(sk, lag).set_index("rank")
    assert st.loc[2, "times_last"] == 5 and st.loc[0, "times_last"] == 0
    assert st.loc[2, "mean_start_lag_us"] == pytest.approx(7.0) and st.loc[1, "mean_start_lag_us"] == pytest.approx(0.0)


def test_dlrm_8_ranks_alignment():
    run = load_run(shared_data("gpu-traces", "param-dlrm-8rank-v100"), workers=2)
    ev = run_events(run)
    sk, lag = skew.collective_skew(skew.collective_records(ev))
    coll = (ev["kind"] == "comm") & ~ev["collective"].isin(model.P2P)   # point-to-point is never matched
    n_comm = ev[coll].groupby("rank").size()
    assert (n_comm == n_comm.iloc[0]).all()                       # every rank ran the same collectives
    assert len(sk) == n_comm.iloc[0] and (sk["n_ranks"] == 8).all()
    # aligning on ends makes the ends tight and leaves the starts spread
    assert sk["end_skew_us"].median() < sk["start_skew_us"].median()
    assert (sk["start_skew_us"] >= 0).all() and (sk["end_skew_us"] >= 0).all()
    st = skew.stragglers(sk, lag)
    assert st["times_last"].sum() == len(sk) and sorted(st["rank"]) == list(range(8))
    assert st.loc[st["times_last"].idxmax(), "rank"] == sk["last_rank"].mode().iloc[0]


def test_overlap_groups_add_up_on_real_traces():
    ev = run_events(load_run(shared_data("gpu-traces", "hta-nccl-2rank-a100"), workers=1))
    tot = overlap.overall_overlap(ev).iloc[0]
    by_step = overlap.comm_overlap(ev, by=("rank", "step"))
    assert by_step["comm_us"].sum() == pytest.approx(tot["comm_us"])           # one comm stream: no cross-step overlap
    assert by_step["overlapped_comm_us"].sum() == pytest.approx(tot["overlapped_comm_us"])
    assert np.allclose(by_step["exposed_comm_us"] + by_step["overlapped_comm_us"], by_step["comm_us"])
    sb = steps.step_breakdown(ev)
    assert len(sb) == 3 and (sb["residual_us"] >= -1e-6).all() and (sb["idle_us"] >= 0).all()
    assert np.allclose(sb["step_us"], sb["compute_us"] + sb["comm_us"] - sb["overlapped_comm_us"] + sb["idle_us"]
                       + sb["residual_us"])
    # residual is memcpy/memset time not under compute or comm: at most their total duration
    mem = ev[ev["kind"].isin(["memcpy", "memset"])].groupby("step")["dur_us"].sum()
    assert (sb.set_index("step")["residual_us"] <= mem.reindex(sb["step"]).to_numpy() + 1e-6).all()


def test_volume_per_rank_and_collective_edge_cases():
    """Unknown collectives (sorted last), sizes known for some events of a group only, a rank without
    communication, group sizes of one (no bus bandwidth)."""
    cats = pd.CategoricalDtype(["reduce_scatter", "all_gather", "barrier"])
    ev = pd.DataFrame({
        "rank": np.array([1, 1, 1, 0, 0, 0, 2], dtype=np.int32),
        "kind": pd.Categorical(["comm", "comm", "comm", "comm", "comm", "comm", "compute"]),
        "collective": pd.Categorical(["all_gather", None, "reduce_scatter", "all_gather", "all_gather", None, None],
                                     dtype=cats),
        "bytes": [100.0, np.nan, 50.0, np.nan, 40.0, 7.0, np.nan],
        "group_size": [2.0, 2.0, 1.0, 2.0, 2.0, np.nan, np.nan],
        "dur_us": [10.0, 5.0, 2.0, 3.0, 4.0, 1.0, 9.0]})
    fast = volume.collective_volume(ev)
    assert list(fast["rank"]) == [0, 0, 1, 1, 1] and fast["collective"].isna().tolist() == [False, True, False, False, True]
    ag0 = fast.iloc[0]
    assert ag0["count"] == 2 and ag0["bytes"] == 40.0 and ag0["algbw_gbps"] == pytest.approx(40.0 / 4e3)


def test_grouped_overlap_equals_a_loop_over_the_groups():
    """comm_overlap by several keys (one grouping, every group's intervals merged at once) against a plain loop:
    for each of its rows, the union of that group's comm events and its intersection with the rank's compute
    (missing keys a group of their own), on a real 8-rank GPU input; every comm event is in one row."""
    from fsdpprof.analyze import model
    from fsdpprof.analyze.comm import intervals
    from fsdpprof.analyze.load.run import load_run

    ev = run_events(load_run(str(shared_data("gpu-traces", "param-dlrm-8rank-v100")), progress=False))
    comm = ev[(ev["kind"] == model.KIND_COMM).to_numpy()]
    comp = ev[(ev["kind"] == model.KIND_COMPUTE).to_numpy()]
    for by in (("rank", "step"), ("rank", "step", "collective", "pg"), ("rank", "stage", "fsdp_phase")):
        got = overlap.comm_overlap(ev, by=by)
        assert list(got.columns[:len(by)]) == list(by) and len(got) > 1
        rows = 0
        for _, row in got.iterrows():
            sel = np.ones(len(comm), dtype=bool)
            for k in by:
                col = comm[k].astype(object)
                sel &= (col.isna() if pd.isna(row[k]) else col == row[k]).to_numpy()
            rows += int(sel.sum())
            c = comm[sel]
            s, e = c["ts_us"].to_numpy(float), (c["ts_us"] + c["dur_us"]).to_numpy(float)
            p = comp[(comp["rank"] == row["rank"]).to_numpy()]
            i_s, i_e = intervals.intersect(s, e, p["ts_us"].to_numpy(float), (p["ts_us"] + p["dur_us"]).to_numpy(float))
            assert row["comm_us"] == pytest.approx(intervals.total(s, e), abs=1e-6)
            assert row["overlapped_comm_us"] == pytest.approx(float((i_e - i_s).sum()), abs=1e-6)
        assert rows == len(comm)
