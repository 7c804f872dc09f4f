"""Collectives matched across ranks by identity, every match checked (issue 37): hand-built records with missing,
reordered and different-size calls, sequence numbers, unnamed groups; the alignment's band; the real DLRM
8-rank traces; the straggler test (binomial p-value, cost)."""
from __future__ import annotations

import math
import re

import numpy as np
import pandas as pd
import pytest

from conftest import shared_data
from fsdpprof.analyze.comm import matching, skew
from fsdpprof.analyze.load.run import load_run, run_events
from fsdpprof.analyze.summary import findings as fnd

DLRM = ("gpu-traces", "param-dlrm-8rank-v100")


def _records(calls: list[tuple]) -> pd.DataFrame:
    """Rows (rank, collective, bytes, ts_us, dur_us[, seq[, pg[, group_size]]]) -> collective_records' frame."""
    rows = []
    for c in calls:
        rank, coll, nbytes, ts, dur = c[:5]
        seq = c[5] if len(c) > 5 else None
        pg = c[6] if len(c) > 6 else "0"
        gs = c[7] if len(c) > 7 else np.nan
        rows.append({"rank": rank, "pg": pg, "collective": coll, "key": np.nan if seq is None else float(seq),
                     "by_seq": seq is not None, "ts_us": float(ts), "end_us": float(ts + dur), "bytes": nbytes,
                     "dtype": "float32", "group_size": gs, "step": 1.0, "stage": "forward", "unit": None})
    r = pd.DataFrame(rows)
    order = r.groupby(["rank", "pg", "collective"]).cumcount().astype(float)
    r["key"] = np.where(r["by_seq"], r["key"], order)
    return r[skew.RECORD_COLUMNS]


def _pairs(out: pd.DataFrame) -> dict:
    """match_id -> {rank: (collective, bytes, ts_us)} of the matched rows."""
    m = out[out["match_status"] == matching.MATCHED]
    return {int(k): {int(r.rank): (r.collective, r.bytes, r.ts_us) for r in g.itertuples()}
            for k, g in m.groupby("match_id")}


def _same_identity(out: pd.DataFrame) -> int:
    """Checked matches whose members differ in type, size or dtype."""
    m = out[out["match_id"] >= 0]
    n = m.groupby("match_id").agg(c=("collective", "nunique"), b=("bytes", "nunique"), d=("dtype", "nunique"))
    return int(((n["c"] > 1) | (n["b"] > 1) | (n["d"] > 1)).sum())


def test_a_call_missing_on_one_rank_is_left_out_not_shifted():
    # rank 1's window opened after the first all_gather: raw order would pair each call with the next one
    calls = [(0, "all_gather", 100.0, 1000.0 * k, 300.0) for k in range(6)]
    calls += [(1, "all_gather", 100.0, 1000.0 * k + 20.0, 280.0) for k in range(1, 6)]
    out, st = matching.match_collectives(_records(calls))
    assert (st.matched, st.refused, st.unmatched) == (10, 0, 1)
    for members in _pairs(out).values():
        assert abs(members[0][2] - members[1][2]) < 100.0      # the same call: its starts 20 us apart
    lone = out[out["match_status"] == matching.UNMATCHED]
    assert lone["rank"].tolist() == [0] and lone["ts_us"].tolist() == [0.0]


def test_calls_missing_inside_the_window_are_left_out():
    # a sampled trace: rank 1 lacks calls 3 and 6 of 10 identical all-reduces, and has one (at 10.5 ms) rank 0 lacks
    calls = [(0, "all_reduce", 8.0, 1000.0 * k, 300.0) for k in range(10)]
    calls += [(1, "all_reduce", 8.0, 1000.0 * k + 15.0, 285.0) for k in range(10) if k not in (3, 6)]
    calls += [(1, "all_reduce", 8.0, 10_500.0, 100.0)]
    out, st = matching.match_collectives(_records(calls))
    assert (st.matched, st.refused, st.unmatched) == (16, 0, 3)
    assert all(abs(m[0][2] - m[1][2]) == 15.0 for m in _pairs(out).values())
    lone = out[out["match_status"] == matching.UNMATCHED].sort_values("ts_us")
    assert lone[["rank", "ts_us"]].values.tolist() == [[0, 3000.0], [0, 6000.0], [1, 10_500.0]]


def test_different_sizes_under_the_same_order_never_match():
    # the case: an all_to_all of 384 elements against one of 339,738,624 at the same position
    small, big = 384 * 4.0, 339_738_624 * 4.0
    calls = [(0, "all_to_all", small, 0.0, 50.0), (0, "all_to_all", big, 1000.0, 900.0),
             (0, "all_to_all", small, 3000.0, 50.0), (0, "all_to_all", big, 4000.0, 900.0)]
    calls += [(1, "all_to_all", big, 1010.0, 890.0), (1, "all_to_all", small, 3005.0, 45.0),
              (1, "all_to_all", big, 4020.0, 880.0)]
    out, st = matching.match_collectives(_records(calls))
    assert _same_identity(out) == 0
    assert (st.matched, st.unmatched) == (6, 1) and st.size_checked_pct == 100.0
    raw = _records(calls).sort_values(["rank", "ts_us"])
    first = raw.groupby("rank").head(1)                 # what matching by order pairs: 384 with 339,738,624
    assert first["bytes"].nunique() == 2


def test_reordered_calls_keep_the_longest_common_order():
    # rank 1 ran two collectives of different sizes in the other order: one of them cannot be matched in order
    calls = [(0, "all_gather", 10.0, 0.0, 100.0), (0, "reduce_scatter", 20.0, 200.0, 100.0),
             (0, "all_gather", 30.0, 400.0, 100.0), (0, "all_reduce", 40.0, 600.0, 100.0)]
    calls += [(1, "all_gather", 10.0, 0.0, 100.0), (1, "all_gather", 30.0, 200.0, 100.0),
              (1, "reduce_scatter", 20.0, 400.0, 100.0), (1, "all_reduce", 40.0, 600.0, 100.0)]
    out, st = matching.match_collectives(_records(calls), tolerance_us=1000.0)
    assert _same_identity(out) == 0
    assert st.matched == 6 and st.unmatched == 2 and st.collectives == 3


def test_matches_that_do_not_overlap_in_time_are_refused():
    # sequence numbers pair them, but rank 2's seq 2 ran 50 ms after the others' ended: refused, the rest kept
    calls = [(r, "all_reduce", 8.0, 1000.0 * k + r, 100.0, k) for r in range(3) for k in range(5)]
    calls = [c if c[0] != 2 or c[5] != 2 else (2, "all_reduce", 8.0, 52_000.0, 100.0, 2) for c in calls]
    out, st = matching.match_collectives(_records(calls), tolerance_us=50.0)
    assert st.reasons == {matching.REASON_ENDS: 1} and (st.matched, st.collectives) == (14, 5)
    bad = out[out["match_status"] == matching.REFUSED]
    assert bad[["rank", "key"]].values.tolist() == [[2, 2.0]]
    # two ranks: neither member of the pair can be trusted
    two = [c for c in calls if c[0] < 2]
    two = [c if c[0] != 1 or c[5] != 3 else (1, "all_reduce", 8.0, 40_000.0, 100.0, 3) for c in two]
    out, st = matching.match_collectives(_records(two), tolerance_us=50.0)
    assert st.reasons == {matching.REASON_ENDS: 2} and st.matched == 8
    # without sequence numbers the alignment does not pair them at all: both left unmatched
    loose = [c[:5] for c in two]
    out, st = matching.match_collectives(_records(loose), tolerance_us=50.0)
    assert (st.matched, st.refused, st.unmatched) == (8, 0, 2)


def test_sequence_numbers_decide_and_a_disagreeing_member_is_refused():
    calls = [(r, "all_gather", 64.0, 100.0 * k, 50.0, k) for r in range(3) for k in range(4)]
    calls[5] = (1, "all_gather", 128.0, 100.0, 50.0, 1)               # rank 1's seq 1 is another size
    out, st = matching.match_collectives(_records(calls))
    assert st.reasons == {matching.REASON_IDENTITY: 1}
    assert (st.matched, st.refused, st.collectives) == (11, 1, 4)
    assert _same_identity(out) == 0


def test_unnamed_group_smaller_than_the_ranks_is_refused():
    # HSDP without group names: two pairs of ranks, each all-gathering in its own group of 2
    calls = [(r, "all_gather", 64.0, 100.0 * k, 50.0, None, matching.PG_UNNAMED, 2.0) for r in range(4)
             for k in range(3)]
    out, st = matching.match_collectives(_records(calls))
    assert st.matched == 0 and st.reasons == {matching.REASON_GROUP: 12}
    named = [(r, "all_gather", 64.0, 100.0 * k, 50.0, None, f"shard{r // 2}", 2.0) for r in range(4) for k in range(3)]
    out, st = matching.match_collectives(_records(named))
    assert st.matched == 12 and st.collectives == 6


def test_banded_alignment_equals_the_full_table(monkeypatch):
    rng = np.random.default_rng(7)
    a = rng.integers(0, 3, 300)
    b = np.delete(a, rng.choice(300, 25, replace=False))            # 25 calls missing on one side
    b = np.insert(b, rng.choice(b.size, 10), 9)                       # 10 calls the other never made

    def score(i, cols):
        return np.where(a[i] == b[cols], 1.0, -np.inf)

    full = matching.align(score, a.size, b.size)
    monkeypatch.setattr(matching, "DP_CELLS_MAX", 0)
    monkeypatch.setattr(matching, "BAND_HALF", 40)
    band = matching.align(score, a.size, b.size)
    assert len(full[0]) == len(band[0]) == 275                        # every common call found
    assert (a[full[0]] == b[full[1]]).all() and (a[band[0]] == b[band[1]]).all()
    assert (np.diff(band[0]) > 0).all() and (np.diff(band[1]) > 0).all()


def test_dlrm_every_match_checked_same_identity_and_aligned():
    ev = run_events(load_run(shared_data(*DLRM), workers=1, progress=False))
    rec = skew.collective_records(ev)
    out, st = matching.match_collectives(rec)
    print(f"DLRM: {st.to_dict()}")
    assert st.matched == len(rec) == 64 and st.refused == 0 and st.collectives == 8
    assert st.size_checked_pct == 100.0                 # sizes from the launching NCCL op's Input Dims
    assert _same_identity(out) == 0
    al, notes = skew.align_ranks(out, range(8), method=skew.ALIGN_COLLECTIVES)
    print(f"DLRM residuals (us): {al['residual_us'].round(3).tolist()}")
    assert al["residual_us"].max() <= 1.5 and not notes


def test_binomial_tail_equals_the_sum_of_terms():
    for k, n, p in [(0, 10, 0.5), (7, 10, 0.5), (38, 54, 0.5), (5, 8, 0.125), (30, 30, 0.25), (3, 2, 0.5)]:
        exact = sum(math.comb(n, x) * p ** x * (1 - p) ** (n - x) for x in range(k, n + 1))
        assert skew.binomial_tail(np.array([k]), np.array([n]), np.array([p]))[0] == pytest.approx(exact, rel=1e-9,
                                                                                                       abs=1e-300)


def _four_ranks(last_of, lag_us: float, n: int = 60) -> pd.DataFrame:
    """Records of 4 ranks over ``n`` collectives in 3 steps; collective k's last rank is ``last_of(k)``, late by
    ``lag_us``."""
    rows = []
    for k in range(n):
        last = last_of(k)
        for r in range(4):
            ts = 10_000.0 * k + (lag_us if r == last else 10.0 * r)
            rows.append((r, "all_gather", 64.0, ts, 10_000.0 * k + lag_us + 500.0 - ts, k))
    rec = _records(rows)
    rec["step"] = np.repeat(np.arange(n) * 3 // n, 4).astype(float)
    rec["unit"] = "layers.3"
    return rec


def test_straggler_needs_a_p_value_and_a_cost():
    step_us = 200_000.0                      # 20 collectives a step, each 10 ms apart
    sk, lag = skew.collective_skew(_four_ranks(lambda k: 2 if k % 5 else k % 4, 400.0))
    st = skew.stragglers(sk, lag).set_index("rank")
    assert st.loc[2, "p_value"] < 1e-10 and st.loc[0, "p_value"] > 0.5
    assert st.loc[2, "expected_last_pct"] == pytest.approx(25.0)
    # last into 48 + 3 (k % 5 == 0 and k % 4 == 2) of 60, each 400 - 10 us (the others' median start: ranks 0, 1,
    # 3 at 0, 10, 30 us) later: 51 * 390 / 3 steps
    assert st.loc[2, "times_last"] == 51 and st.loc[2, "lag_per_step_us"] == pytest.approx(51 * 390.0 / 3)
    # its cost is the critical path's counterfactual, which the pipeline fills in: none from skew alone, no finding
    assert st["cost_per_step_us"].isna().all() and fnd.rank_findings(st.reset_index(), step_us) == []
    st["cost_per_step_us"] = st["lag_per_step_us"]      # (a counterfactual that found the whole lag to cost)
    assert st.loc[2, "where"] == "forward, layers.3"
    out = fnd.rank_findings(st.reset_index(), step_us)
    assert [f.rank for f in out] == [2] and "p = " in out[0].title and out[0].stake_us == pytest.approx(6630.0)
    # the same lateness costs under 2 % of a 1 s step: no finding
    assert fnd.rank_findings(st.reset_index(), 1_000_000.0) == []
    # each rank last in turn, however late: chance, no finding
    sk, lag = skew.collective_skew(_four_ranks(lambda k: k % 4, 5000.0))
    st = skew.stragglers(sk, lag)
    assert (st["p_value"] > 0.4).all() and fnd.rank_findings(st, step_us) == []


def test_refused_calls_build_no_skew_row_and_no_straggler():
    # rank 2 ran seq 1 with another size and seq 3 far from the others: neither call reaches skew or stragglers
    late = {0: 0.0, 1: 0.0, 2: 300.0}      # rank 2 arrives 300 us late; every call ends at 1000 k + 400
    calls = [(r, "all_gather", 64.0, 1000.0 * k + late[r], 400.0 - late[r], k) for r in range(3) for k in range(6)]
    calls = [(2, "all_gather", 128.0, c[3], c[4], 1) if c[0] == 2 and c[5] == 1 else c for c in calls]
    calls = [(2, "all_gather", 64.0, 90_000.0, 400.0, 3) if c[0] == 2 and c[5] == 3 else c for c in calls]
    out, st = matching.match_collectives(_records(calls))
    assert st.reasons == {matching.REASON_IDENTITY: 1, matching.REASON_ENDS: 1}
    sk, lag = skew.collective_skew(out)
    assert len(sk) == 6 and sk.set_index("seq")["n_ranks"].to_dict() == {0: 3, 1: 2, 2: 3, 3: 2, 4: 3, 5: 3}
    assert (sk.loc[sk["n_ranks"] == 2, "last_rank"] != 2).all()      # rank 2's refused calls are not "last"
    st2 = skew.stragglers(sk, lag).set_index("rank")
    assert st2.loc[2, "times_last"] == 4 and st2.loc[2, "share_last_pct"] == 100.0   # of the 4 it is in
    assert lag.set_index("rank")["matches"].to_dict() == {0: 6, 1: 6, 2: 4}


def test_timeline_warns_when_the_clocks_leave_the_ends_apart():
    # anchors put rank 1 800 us off (within the 1 ms the anchors are trusted for): its ends then lie 400 us from
    # the mean, over the 250 us tolerance and the collectives' 100 us: said
    calls = [(r, "all_reduce", 8.0, 1000.0 * k, 100.0, k) for r in range(2) for k in range(8)]
    rec = _records(calls)
    al, notes = skew.align_ranks(rec, [0, 1], {0: 0.0, 1: 800.0})
    assert al["method"].iat[0] == skew.ALIGN_ANCHOR and al["residual_us"].max() == pytest.approx(400.0)
    assert any("400 µs" in n and "tolerance" in n for n in notes)
    assert not any(re.search(r"\d us\b", n) for n in notes), notes     # the page's unit, as everywhere on it
    al, notes = skew.align_ranks(rec, [0, 1], {0: 0.0, 1: 0.0})
    assert al["residual_us"].max() == 0.0 and not notes


def test_analysis_and_summary_count_the_matches(tmp_path):
    # two GPU ranks; rank 1's window opened after the first all_to_all (384 elements), so matching by order
    # would pair 384 with 339,738,624 elements
    from test_event_model import Trace
    from fsdpprof.analyze.pipeline import analyze_run
    from fsdpprof.report.summary import summary

    sizes = [384, 339_738_624, 384, 339_738_624]
    for r in range(2):
        t = Trace(rank=r)
        t.cpu("ProfilerStep#1", 0, 10_000, cat="user_annotation")
        for k, n in enumerate(sizes):
            if r == 1 and k == 0:
                continue
            at = 2000.0 * k + 10
            t.cpu("nccl:all_to_all", at, 20, **{"In msg nelems": n, "Out msg nelems": n, "dtype": "Float",
                                                "Process Group Name": "0", "Group size": 2})
            t.kernel("ncclDevKernel_SendRecv(ncclDevKernelArgsStorage<4096ul>)", at + 5, at + 100 + 7 * r, 500,
                     stream=20)
        t.write(tmp_path / f"rank-{r}.json")
    a = analyze_run(load_run(str(tmp_path), progress=False), workers=1, progress=False)
    assert a.matching["matched_calls"] == 6 and a.matching["unmatched_calls"] == 1
    assert a.matching["refused_calls"] == 0 and a.matching["size_checked_pct"] == 100.0
    assert _same_identity(a.matches) == 0 and len(a.skew) == 3 and (a.skew["n_ranks"] == 2).all()
    s = summary(a)
    assert s["matching"]["matched_collectives"] == 3 and "p_value" in s["stragglers"][0]
    assert not [f for f in a.findings if f.id == "straggler"]       # 3 collectives: nothing is unlikely by chance


def test_ranks_recorded_at_different_steps_pair_the_same_calls():
    # an FSDP-like step of 5 calls (3 all-gathers of one size, 2 reduce-scatters), 10 ms a step; rank 0 recorded
    # steps 0-2, rank 1 steps 1-3: the same sequences of identities, shifted by a whole step
    step = [("all_gather", 64.0), ("all_gather", 64.0), ("all_gather", 64.0), ("reduce_scatter", 64.0),
            ("reduce_scatter", 64.0)]
    calls = []
    for rank, steps in ((0, range(0, 3)), (1, range(1, 4))):
        for s in steps:
            for k, (coll, n) in enumerate(step):
                calls.append((rank, coll, n, 10_000.0 * s + 1500.0 * k + 7.0 * rank, 400.0))
    out, st = matching.match_collectives(_records(calls))
    assert (st.matched, st.refused, st.unmatched) == (20, 0, 10)
    for members in _pairs(out).values():
        assert abs(members[0][2] - members[1][2]) == 7.0            # each the same call, never a step apart
    # the same with rank 1's clock 3 ms off and fsdpprof's anchors saying so
    shifted = [c if c[0] == 0 else (c[0], c[1], c[2], c[3] + 3000.0, c[4]) for c in calls]
    out, st = matching.match_collectives(_records(shifted), clock_prior_us=pd.Series({0: 0.0, 1: 3000.0}))
    assert st.matched == 20 and all(abs(m[0][2] - m[1][2]) == 3007.0 for m in _pairs(out).values())
