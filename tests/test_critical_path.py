"""The critical path across ranks and its counterfactuals (issue 37): hand-built multi-rank GPU traces with known
answers, the DLRM traces (the path of each step is the step), and the Python API."""
from __future__ import annotations

import gzip
import json
import sys

import numpy as np
import orjson
import pandas as pd
import pytest

import fsdpprof
from fsdpprof.analyze import model
from fsdpprof.analyze.comm import critical_path as cpm
from fsdpprof.analyze.compare.diff import diff_analyses
from fsdpprof.analyze.load.run import load_run
from fsdpprof.analyze.pipeline import analyze_run
from fsdpprof.analyze.summary import findings as fnd
from fsdpprof.analyze.whatif.contention import training_thread_contention

from conftest import EXAMPLE, made_once, run_fsdpprof, shared_data, shared_dir

CLOCK_SKEW_US = 1000.0      # rank 1's clock runs this far ahead (the analysis must align it)


# ----------------------------------------------------------------------------------------- hand-built GPU traces
def _x(name, cat, ts, dur, tid=1, pid=1, **args):
    e = {"ph": "X", "cat": cat, "name": name, "pid": pid, "tid": tid, "ts": ts, "dur": dur}
    if args:
        e["args"] = {k.replace("_", " "): v for k, v in args.items()}
    return e


class _Trace:
    """One rank's GPU trace: a ProfilerStep, FSDP annotations, kernels launched from the host (correlation ids)."""

    def __init__(self, rank: int, world: int = 2, skew_us: float = 0.0):
        self.rank, self.world, self.o = rank, world, skew_us
        self.ev = [_x("ProfilerStep#1", "user_annotation", self.o + 0, 2000)]
        self.corr = 0

    def annot(self, name, ts, dur=2):
        self.ev.append(_x(name, "user_annotation", self.o + ts, dur))

    def kernel(self, name, launch, ts, dur, stream=7, **args):
        self.corr += 1
        self.ev.append(_x("cudaLaunchKernel", "cuda_runtime", self.o + launch, 1, correlation=self.corr))
        self.ev.append({"ph": "X", "cat": "kernel", "name": name, "pid": 0, "tid": stream, "ts": self.o + ts,
                        "dur": dur, "args": {"stream": stream, "device": self.rank, "correlation": self.corr,
                                             **{k.replace("_", " "): v for k, v in args.items()}}})

    def all_gather(self, launch, ts, dur, nelems=1000):
        self.kernel("ncclDevKernel_AllGather_RING_LL", launch, ts, dur, stream=20, In_msg_nelems=nelems,
                    Out_msg_nelems=nelems * self.world, dtype="Float", Group_size=self.world)

    def write(self, folder):
        p = folder / f"rank-{self.rank}.json"
        p.write_bytes(orjson.dumps({"schemaVersion": 1, "distributedInfo": {"rank": self.rank,
                                                                            "world_size": self.world},
                                    "traceEvents": self.ev}))


def _ranks(n=2):
    return [_Trace(r, n, skew_us=CLOCK_SKEW_US * r) for r in range(n)]


def _analyse(tmp_path, traces):
    for t in traces:
        t.write(tmp_path)
    a = analyze_run(load_run(str(tmp_path)), workers=1)
    assert a.critical_path is not None, a.notes
    return a.critical_path


def _cf(cp, kind, **match):
    c = cp.counterfactuals
    c = c[c["kind"] == kind]
    for k, v in match.items():
        c = c[c[k] == v]
    assert len(c) == 1, cp.counterfactuals
    return float(c["saved_us_per_step"].iat[0])


def _two_units(t: _Trace, gemm_a_us=100.0, extra=None, gather_at=None, gather_us=50.0, gemm_b_at=None):
    """layers.0's gemm_a from 100 µs, [an extra kernel], then layers.1's all-gather (issued at ``gather_at``, default:
    when the compute before it ends) and gemm_b once it has arrived."""
    t.annot("FSDP::pre_forward (layers.0)", 40)
    t.kernel("void gemm_a", 50, 100, gemm_a_us)
    end = 100 + gemm_a_us
    if extra:
        name, dur = extra
        t.kernel(name, 60, end, dur)
        end += dur
    t.annot("FSDP::pre_forward (layers.1)", 65)
    return end


def test_a_rank_delayed_by_a_known_compute_op(tmp_path):
    """Rank 1 runs a 200 µs kernel (layers.0, forward) before its all-gather: rank 0 waits for it."""
    slow_us, transfer_us = 200.0, 50.0
    traces = _ranks()
    for t in traces:
        end = _two_units(t, extra=("void slow_kernel", slow_us) if t.rank == 1 else None)
        t.all_gather(70, end, 400 + transfer_us - end)       # every rank's all-gather ends at 450
        t.kernel("void gemm_b", 80, 400 + transfer_us, 100)
    cp = _analyse(tmp_path, traces)
    step = cp.steps.iloc[0]
    seg = cp.segments
    assert step["limiting_rank"] == 1
    assert step["path_us"] == pytest.approx(step["length_us"], abs=1.0) and step["length_us"] == pytest.approx(450)
    slow = seg[seg["what"] == "void slow_kernel"]
    assert len(slow) == 1 and slow["rank"].iat[0] == 1 and slow["kind"].iat[0] == model.PATH_COMPUTE
    assert (slow["unit"].iat[0], slow["stage"].iat[0]) == ("layers.0", model.STAGE_FORWARD)
    # one segment per stretch of one kind, unit and stage: layers.0's compute, named by the op with most time in it
    assert slow["dur_us"].iat[0] == pytest.approx(100.0 + slow_us)
    # rank 0's wait for rank 1 is not on the path: its transfer is, then rank 1's work
    assert not (seg["kind"] == model.PATH_WAIT).any()
    assert _cf(cp, model.CHANGE_RANK, rank=1) == pytest.approx(slow_us, rel=0.01)
    assert cpm.straggler_cost_us(cp, 1) == pytest.approx(slow_us, rel=0.01)
    assert cpm.straggler_cost_us(cp, 0) == pytest.approx(0.0, abs=1.0)
    assert cp.counterfactuals.iloc[0]["kind"] == model.CHANGE_RANK and cp.counterfactuals.iloc[0]["rank"] == 1
    # hiding layers.1's all-gather saves its transfer only, never the wait for rank 1
    assert _cf(cp, model.CHANGE_COLLECTIVE, unit="layers.1") == pytest.approx(transfer_us, rel=0.01)


def _slow_rank_1(tmp_path, slow_us=200.0):
    """Rank 1's 300 µs of local work (gemm_a + a slow kernel) before layers.1's all-gather against rank 0's 100."""
    traces = _ranks()
    for t in traces:
        end = _two_units(t, extra=("void slow_kernel", slow_us) if t.rank == 1 else None)
        t.all_gather(70, end, 450 - end)
        t.kernel("void gemm_b", 80, 450, 100)
    return _analyse(tmp_path, traces)


def test_a_rank_slower_by_its_wait_for_a_core_is_the_hosts(tmp_path):
    """Rank 1 waits for a core c times as long as rank 0 (CPU contention): its 300 µs of work before the
    all-gather would take 300 / c, so "as fast as the median" (200 µs) is explained up to 300 - max(100, 300 / c);
    unknown without every rank's load, 0 for the rank waiting less."""
    cp = _slow_rank_1(tmp_path)
    assert cpm.straggler_cost_us(cp, 1) == pytest.approx(200.0)
    assert cpm.contended_cost_us(cp, 1) != cpm.contended_cost_us(cp, 1)           # NaN: not measured
    for c, explained in ((1.2, 50.0), (1.5, 100.0), (3.0, 200.0), (6.0, 200.0)):
        cp.contention = {0: 1.0, 1: c}
        assert cpm.contended_cost_us(cp, 1) == pytest.approx(explained, rel=1e-6)
        assert cpm.contended_cost_us(cp, 0) == 0.0
    cp.contention = {1: 3.0}
    assert cpm.contended_cost_us(cp, 1) != cpm.contended_cost_us(cp, 1)


def test_findings_about_a_rank_leave_its_wait_for_a_core_to_the_host(tmp_path):
    """The limiting-rank finding fires on rank 1's 200 µs; not when its longer wait for a core explains them all
    (x3 the other rank's contention), and it says the part explained when that is only some (x1.5: 100 µs)."""
    cp = _slow_rank_1(tmp_path)

    def limiting(c):
        cp.contention = {0: 1.0, 1: c} if c else {}
        cf = cp.counterfactuals
        cf["contended_us"] = [cpm.contended_cost_us(cp, int(r)) if k == model.CHANGE_RANK else float("nan")
                              for k, r in zip(cf["kind"], cf["rank"])]
        return [f for f in fnd.critical_path_findings(cp) if f.id.startswith("limiting_rank")]

    assert [f.rank for f in limiting(None)] == [1] and "wait for a core" not in limiting(None)[0].title
    half = limiting(1.5)
    assert [f.rank for f in half] == [1] and "its longer wait for a core explains 0.1 ms of it" in half[0].title
    assert half[0].stake_us == pytest.approx(200.0)
    assert limiting(3.0) == []


@pytest.mark.parametrize("t, n, p", [(5.841, 4, 0.005), (63.657, 2, 0.005), (2.764, 11, 0.01), (2.132, 5, 0.05),
                                     (-2.132, 5, 0.95), (1.0, 31, 0.1627)])
def test_the_t_test_of_a_ranks_saving_matches_the_t_table(t, n, p):
    """One-sided Student's t p-values against the table (t, n - 1 degrees of freedom), odd and even degrees."""
    x = np.linspace(-1.0, 1.0, n)
    x = x / x.std(ddof=1) + t / np.sqrt(n)          # mean / (sd / sqrt(n)) = t
    assert cpm.t_test_greater(x) == pytest.approx(p, rel=2e-3)
    assert cpm.t_test_greater(x[:1]) != cpm.t_test_greater(x[:1])      # one step: NaN
    assert cpm.t_test_greater(np.full(4, 3.0)) == 0.0


def test_a_ranks_contention_is_its_training_threads(tmp_path):
    """rank.json cpu: the training thread's wait where recorded (what stretches the rank's own work), else the
    process's; nothing on an accelerator run."""
    proc = {"usable_cores": 2, "local_world_size": 2, "wall_us": 1e6, "run_us": 8e5, "runqueue_us": 8e5}
    loads = {0: {**proc, "training_run_us": 4e5, "training_runqueue_us": 1e5}, 1: proc}
    assert training_thread_contention(loads, "cpu") == {0: pytest.approx(1.25), 1: pytest.approx(2.0)}
    assert training_thread_contention(loads, "cuda") == {}


def test_an_all_gather_exposed_because_it_is_issued_late(tmp_path):
    """Both ranks issue layers.1's all-gather only when gemm_a is done: its 300 µs are exposed."""
    transfer_us = 300.0
    traces = _ranks()
    for t in traces:
        end = _two_units(t)
        t.all_gather(70, end, transfer_us)
        t.kernel("void gemm_b", 80, end + transfer_us, 100)
    cp = _analyse(tmp_path, traces)
    seg = cp.segments
    ag = seg[seg["kind"] == model.PATH_COLLECTIVE]
    assert len(ag) == 1 and ag["what"].iat[0] == model.ALL_GATHER
    assert (ag["unit"].iat[0], ag["stage"].iat[0]) == ("layers.1", model.STAGE_FORWARD)
    assert ag["dur_us"].iat[0] == pytest.approx(transfer_us)
    first = cp.counterfactuals.iloc[0]
    assert (first["kind"], first["unit"], first["stage"], first["collective"]) == (
        model.CHANGE_COLLECTIVE, "layers.1", model.STAGE_FORWARD, model.ALL_GATHER)
    assert first["saved_us_per_step"] == pytest.approx(transfer_us, rel=0.01)
    assert cpm.straggler_cost_us(cp, 0) == pytest.approx(0.0, abs=1.0)


def test_a_host_gap(tmp_path):
    """Rank 1's host launches layers.1's gemm_b 250 µs late: the device idles."""
    gap_us = 250.0
    traces = _ranks()
    for t in traces:
        end = _two_units(t)
        t.all_gather(70, 100, 50)                              # hidden under gemm_a
        late = gap_us if t.rank == 1 else 0.0
        t.annot("FSDP::pre_forward (layers.1)", 180 + late)
        t.kernel("void gemm_b", 190 + late, end + late, 100)
    cp = _analyse(tmp_path, traces)
    seg = cp.segments
    gap = seg[seg["kind"] == model.PATH_HOST_GAP]
    assert len(gap) == 1 and gap["rank"].iat[0] == 1 and gap["dur_us"].iat[0] == pytest.approx(gap_us)
    assert (gap["unit"].iat[0], gap["stage"].iat[0]) == ("layers.1", model.STAGE_FORWARD)
    assert cp.steps.iloc[0]["limiting_rank"] == 1
    assert _cf(cp, model.CHANGE_HOST_GAPS) == pytest.approx(gap_us, rel=0.01)


def test_a_rank_waiting_in_a_collective_for_a_slow_peer(tmp_path):
    """Rank 2 of 4 is slow (its gemm_a takes 300 µs, not 100): the others wait in layers.1's all-gather."""
    delay_us, transfer_us = 200.0, 40.0
    traces = _ranks(4)
    for t in traces:
        slow = t.rank == 2
        end = _two_units(t, gemm_a_us=100.0 + (delay_us if slow else 0.0))
        t.all_gather(70, end, 400 + transfer_us - end)       # every rank's all-gather ends at 440
        t.kernel("void gemm_b", 80, 400 + transfer_us, 100)
    cp = _analyse(tmp_path, traces)
    seg = cp.segments
    assert cp.steps.iloc[0]["limiting_rank"] == 2
    a = seg[seg["what"] == "void gemm_a"]
    assert list(a["rank"]) == [2] and a["dur_us"].iat[0] == pytest.approx(100.0 + delay_us)
    assert (a["unit"].iat[0], a["stage"].iat[0]) == ("layers.0", model.STAGE_FORWARD)
    assert _cf(cp, model.CHANGE_RANK, rank=2) == pytest.approx(delay_us, rel=0.01)
    # the waiting ranks' exposed all-gather is their wait for rank 2: hiding it saves the transfer alone
    assert _cf(cp, model.CHANGE_COLLECTIVE, unit="layers.1") == pytest.approx(transfer_us, rel=0.01)
    assert cp.steps.iloc[0]["path_us"] == pytest.approx(cp.steps.iloc[0]["length_us"], abs=1.0)


# ----------------------------------------------------------------------------------------- real traces
def test_dlrm_path_of_each_step_is_the_step():
    """DLRM's 8 V100 ranks: each step's path adds up to the step (from the start of the rank it begins on to the
    end of the last rank) within the alignment residual, begins at a rank's step start and names a rank."""
    a = analyze_run(load_run(str(shared_data("gpu-traces", "param-dlrm-8rank-v100"))), workers=1)
    cp = a.critical_path
    assert len(cp.steps) == 1
    for s in cp.steps.itertuples():
        assert s.ranks == 8 and s.limiting_rank in range(8)
        assert abs(s.path_us - s.length_us) <= max(s.residual_us, 1.0)
        assert s.residual_us <= 1.5
    win = a.steps.groupby("rank")["step_us"].max()
    # the path is no longer than the longest rank's window and no shorter than the shortest one
    assert win.min() - 1 <= cp.steps["length_us"].iat[0] <= win.max() + 1
    assert set(cp.segments["kind"]) <= set(model.PATH_KINDS)
    assert fsdpprof.critical_path(a) is cp


# ----------------------------------------------------------------------------------------- what users see
def test_summary_tables_and_timeline_of_the_path(tmp_path):
    """summary.json's critical_path (steps with segments, breakdown, counterfactuals), the same tables in --tables,
    the section in the page, a "critical path" track per rank in fsdpprof timeline."""
    traces = _ranks()
    for t in traces:
        end = _two_units(t, extra=("void slow_kernel", 200.0) if t.rank == 1 else None)
        t.all_gather(70, end, 450 - end)
        t.kernel("void gemm_b", 80, 450, 100)
        t.write(tmp_path)
    out = tmp_path / "out"
    proc = run_fsdpprof("report", str(tmp_path), "-o", str(out / "report.html"), "--tables", str(out / "tables"),
                        "--workers", "1")
    assert proc.returncode == 0, proc.stderr
    doc = json.loads((out / "summary.json").read_text())["critical_path"]
    st = doc["steps"][0]
    assert st["limiting_rank"] == 1 and st["path_us"] == pytest.approx(st["length_us"])
    assert {"rank", "kind", "what", "unit", "stage", "dur_us"} == set(st["segments"][0])
    assert sum(s["dur_us"] for s in st["segments"]) == pytest.approx(st["path_us"])
    first = doc["counterfactuals"][0]
    assert (first["kind"], first["rank"], first["unit"], first["stage"]) == (model.CHANGE_RANK, 1, "layers.0",
                                                                              model.STAGE_FORWARD)
    assert first["saved_us_per_step"] == pytest.approx(200.0, rel=0.01)
    tables = {p.name for p in (out / "tables").iterdir()}
    assert {"critical_path.steps.csv", "critical_path.steps.segments.csv", "critical_path.counterfactuals.csv",
            "critical_path.breakdown.csv"} <= tables
    html = (out / "report.html").read_text()
    assert html.index('id="critical_path"') < html.index('id="findings"')
    assert "Rank 1 limits the step" in html
    tl = tmp_path / "tl.json.gz"
    proc = run_fsdpprof("timeline", str(tmp_path), "-o", str(tl), "--workers", "1")
    assert proc.returncode == 0, proc.stderr
    ev = json.loads(gzip.decompress(tl.read_bytes()))["traceEvents"]
    names = {(e["pid"], e["tid"]): e["args"]["name"] for e in ev if e.get("ph") == "M" and e["name"] == "thread_name"}
    path = [e for e in ev if e.get("ph") == "X" and names.get((e["pid"], e["tid"])) == "fsdpprof: critical path"]
    assert {e["pid"] for e in path} == {0, 1}
    slow = [e for e in path if e["args"]["what"] == "void slow_kernel"]
    assert len(slow) == 1 and slow[0]["pid"] == 1 and slow[0]["dur"] == pytest.approx(300.0)


# ----------------------------------------------------------------------------------------- recorded CPU runs
# 300 ms: the host noise of a shared 2-core machine (up to ~25 ms a step seen against a 150 ms sleep) stays inside
# the 15 % the counterfactual is held to
SLEEP_MS, SLEEP_RANK, SLEEP_UNIT = 300.0, 1, "layers.2"
HOST_FINDINGS = ("cpu_oversubscribed", "host_time")
SMALL_MODEL = ("--dim", "64", "--seq", "32", "--batch", "2", "--vocab", "256", "--steps", "7")


def _record(tmp_path_factory, name: str, env: dict | None):
    folder = shared_dir(tmp_path_factory, f"critical-{name}")
    out = folder / "run"
    with made_once(folder) as first:
        if first:
            proc = run_fsdpprof("record", "--out", str(out), "--skip-steps", "1", "--warmup-steps", "1",
                                "--active-steps", "4", "--", sys.executable, "-m", "torch.distributed.run",
                                "--standalone", "--nproc-per-node=2", str(EXAMPLE), "--strategy", "fsdp2",
                                *SMALL_MODEL, env=env, timeout=600)
            assert proc.returncode == 0, proc.stderr[-3000:]
    return analyze_run(load_run(str(out)), workers=1)


@pytest.mark.slow
def test_recorded_straggler_is_named_and_costed(tmp_path_factory):
    """FSDP2 on 2 gloo ranks, rank 1 sleeping 150 ms in layers.2's forward every step: the path names rank 1,
    layers.2, forward in most steps; "rank 1 as fast as the median" saves the sleep within 15 %; the first finding
    names them."""
    a = _record(tmp_path_factory, "sleep", {"FSDPPROF_EXAMPLE_SLEEP": f"{SLEEP_RANK}:{SLEEP_UNIT}:{SLEEP_MS:g}"})
    cp = a.critical_path
    seg = cp.segments
    named = seg[(seg["rank"] == SLEEP_RANK) & (seg["unit"] == SLEEP_UNIT) & (seg["stage"] == model.STAGE_FORWARD)
                & (seg["dur_us"] >= 0.9 * SLEEP_MS * 1e3)]
    assert named["step"].nunique() > len(cp.steps) / 2, seg.sort_values("dur_us").tail(10)
    assert (cp.steps["limiting_rank"] == SLEEP_RANK).sum() > len(cp.steps) / 2
    assert cpm.straggler_cost_us(cp, SLEEP_RANK) == pytest.approx(SLEEP_MS * 1e3, rel=0.15)
    # the first finding about the step (the host's own findings, oversubscription and Python time, say how busy
    # the machine is: on a shared 2-core host they may come first)
    first = next(f for f in a.findings if f.id not in HOST_FINDINGS)
    assert f"rank {SLEEP_RANK}" in first.title.lower() and SLEEP_UNIT in first.title and "forward" in first.title, \
        [f.title for f in a.findings]
    assert first.rank == SLEEP_RANK and first.section == "critical_path"


@pytest.mark.slow
def test_recorded_run_without_a_straggler_names_none(tmp_path_factory):
    """The same job without the sleep: no rank limits the step by the critical path's measure and none is a
    straggler (beyond chance, beyond its wait for a core)."""
    a = _record(tmp_path_factory, "nosleep", None)
    assert a.critical_path is not None and len(a.critical_path.steps) >= 3
    named = [f for f in a.findings if f.id.startswith(("limiting_rank", "straggler"))]
    assert not named, [f.title for f in a.findings]


def test_compare_diffs_the_breakdowns(tmp_path):
    """compare's diff: the critical path's time per kind, run against baseline: a 250 µs host gap shows as +250."""
    def run(gap_us: float, where):
        where.mkdir()
        traces = _ranks()
        for t in traces:
            end = _two_units(t)
            t.all_gather(70, 100, 50)
            t.annot("FSDP::pre_forward (layers.1)", 180 + gap_us)
            t.kernel("void gemm_b", 190 + gap_us, end + gap_us, 100)
            t.write(where)
        return analyze_run(load_run(str(where)), workers=1)

    d = diff_analyses([run(0.0, tmp_path / "a"), run(250.0, tmp_path / "b")], ["a", "b"])
    c = d.critical.set_index("kind")
    assert c.loc[model.PATH_HOST_GAP, "diff_us"] == pytest.approx(250.0)
    assert c.loc[model.PATH_COMPUTE, "diff_us"] == pytest.approx(0.0, abs=1e-6)


def test_to_dict_groups_segments_by_step_in_path_order():
    """CriticalPath.to_dict: each step gets its own segments in the frame's order (segments of several steps
    interleaved), NaN and infinities as None, categorical labels as strings."""
    seg = pd.DataFrame({"step": [2.0, 1.0, 2.0, 1.0, np.nan], "rank": [0, 1, 1, 0, 0],
                        "kind": pd.Categorical(["compute", "collective", "compute", None, "compute"]),
                        "what": ["a", "b", None, "d", "e"], "unit": [None] * 5, "stage": ["forward"] * 5,
                        "dur_us": [1.0, np.inf, 3.0, np.nan, 5.0]})
    steps = pd.DataFrame({"step": [1.0, 2.0, 3.0], "length_us": [10.0, np.nan, 1.0]})
    empty = pd.DataFrame({"x": []})
    d = cpm.CriticalPath(steps=steps, segments=seg, breakdown=empty, counterfactuals=empty).to_dict()
    assert [s["step"] for s in d["steps"]] == [1.0, 2.0, 3.0] and d["steps"][1]["length_us"] is None
    one, two, three = (s["segments"] for s in d["steps"])
    assert [(s["rank"], s["kind"], s["what"], s["dur_us"]) for s in one] == [(1, "collective", "b", None),
                                                                               (0, None, "d", None)]
    assert [(s["rank"], s["what"], s["dur_us"]) for s in two] == [(0, "a", 1.0), (1, None, 3.0)]
    assert three == [] and all("step" not in s for s in one + two)
    assert d["top"] == [] and d["breakdown"] == []


def test_chain_labels_as_codes():
    """rank_chain's label table: one code per label over every column, None and NaN -1; a column's categorical
    holds only its own labels, sorted, as pd.Categorical of the labels makes it."""
    labels = cpm._Labels()
    gap = labels.label("host_gap")
    kinds = labels.of(np.array(["compute", None, "host_gap", "compute", np.nan], dtype=object))
    assert kinds.tolist() == [1, -1, gap, 1, -1] and labels.label("compute") == 1
    col = labels.column(pd.Series(["b", None, "a", "b"], dtype="category"))
    units = col[np.array([3, 1, 2, 0])]
    want = ["b", None, "a", "b"]
    got = labels.categorical(units)
    ref = pd.Categorical(want)
    assert list(got.categories) == ["a", "b"] == list(ref.categories)
    assert got.codes.tolist() == ref.codes.tolist()
    assert list(labels.categorical(kinds).categories) == ["compute", "host_gap"]
    assert len(labels.categorical(np.full(3, -1, dtype=np.int32)).categories) == 0


def _replay_node_by_node(m, d, transfer):
    """The replay's rule, node by node: a node ends at its group's start + the local lengths so far + the longest
    wait so far in its (rank, step) group; a wait lasts until its call's last arrival + transfer; an issue node's
    end is its call's arrival; repeated until the arrivals settle."""
    arr = m.rec_arr.copy()
    t = np.zeros(len(d))
    for _ in range(len(arr) + 2):
        comp = m.last_arrival(arr) + transfer
        for g in range(len(m.g_first)):
            c = cm = 0.0
            for i in range(m.g_first[g], m.g_last[g] + 1):
                c += d[i]
                if m.node[i] == cpm.NODE_WAIT:
                    cm = max(cm, comp[m.node_rec[i]] - m.g_start[g] - c, 0.0)
                t[i] = m.g_start[g] + c + cm
        new = arr.copy()
        issue = np.flatnonzero(m.node == cpm.NODE_ISSUE)
        new[m.node_rec[issue]] = t[issue]
        if not len(issue) or np.max(np.abs(new - arr)) < cpm.REPLAY_TOL_US:
            break
        arr = new
    return t


def test_replay_equals_the_node_by_node_rule():
    """_Model.replay (a round reads only the waits and issue nodes) against the rule applied node by node, on the 8
    ranks of a real trace: as recorded, with every local length halved, and with the transfers doubled."""
    a = analyze_run(load_run(str(shared_data("gpu-traces", "param-dlrm-8rank-v100"))), workers=1)
    m = a.critical_path.model
    assert (m.node == cpm.NODE_WAIT).sum() > 10 and (m.node == cpm.NODE_ISSUE).sum() > 10
    for d, transfer in ((m.d, m.rec_transfer), (m.d * 0.5, m.rec_transfer), (m.d, m.rec_transfer * 2.0)):
        got = m.replay(d, transfer)
        want = _replay_node_by_node(m, d, transfer)
        assert got == pytest.approx(want, rel=1e-12, abs=1e-6)
