"""`fsdpprof compare`'s diff against the baseline, checked against HTA's trace_diff on real GPU traces
(same counts and durations per name with --iteration first) and end to end on real CPU recordings."""
from __future__ import annotations

import gzip
import json
import logging
import math
import shutil

import numpy as np
import pandas as pd
import pytest

from conftest import run_fsdpprof, shared_data
from fsdpprof.analyze.compare import diff
from fsdpprof.analyze import model
from fsdpprof.analyze.compare.runs import compare_analyses
from fsdpprof.analyze.compare.scope import SCOPE_ALL, Scope, parse_iteration
from fsdpprof.analyze.pipeline import analyze_run
from fsdpprof.analyze.load.frames import isin, on_device
from fsdpprof.analyze.load.run import load_run, run_events
from fsdpprof.errors import UserError

V100 = ("gpu-traces", "param-dlrm-8rank-v100")
ADDED_NAME = 'fsdpprof_test::added<img src=x onerror="alert(1)">'


def _events(path):
    with gzip.open(path, "rt") as fh:
        return json.load(fh)


def _write(doc, path):
    with gzip.open(path, "wt") as fh:
        json.dump(doc, fh)


def _edited_copy(src, dst):
    """A copy of a real trace with operators removed, fewer, more, stretched, renamed, and its step renumbered:
    every category of HTA's ops_diff appears between the two."""
    doc = _events(src)
    out = []
    slices = 0
    for e in doc["traceEvents"]:
        name = e.get("name", "")
        if e.get("ph") == "X":
            if name == "aten::sqrt":                                             # deleted (CPU operator)
                continue
            if e.get("cat") == "kernel" and "sqrt_kernel" in name:              # deleted (GPU kernel)
                continue
            if name == "aten::slice":                                            # decreased: every other call
                slices += 1
                if slices % 2:
                    continue
            if name == "aten::copy_":                                            # stretched: 3x as long
                e = dict(e, dur=e["dur"] * 3)
            if name == "aten::zero_":                                            # added (and aten::zero_ deleted)
                e = dict(e, name=ADDED_NAME)
            if name.startswith("ProfilerStep#"):                                 # another step number
                e = dict(e, name=f"ProfilerStep#{int(name.split('#')[1]) + 1}")
            if name == "aten::mul":                                              # increased: a second call
                out.append(dict(e, ts=e["ts"] + 1, dur=max(e["dur"] - 1, 0)))
        out.append(e)
    doc["traceEvents"] = out
    _write(doc, dst)


def _without_device_mirrors(src, dst):
    """A copy of a trace without its annotations' GPU mirrors (kineto's gpu_user_annotation: the device span of a
    CPU region, same name).  HTA's compare_traces counts such a region twice (its CPU annotation and its mirror,
    and adds their durations, from two timelines); fsdpprof's operators table counts it once, by its CPU annotation
    (docs/metrics.md), so HTA is given the trace without the mirrors to compare like with like."""
    doc = _events(src)
    kept = [e for e in doc["traceEvents"] if e.get("cat") != "gpu_user_annotation"]
    assert len(kept) < len(doc["traceEvents"])                      # the trace has mirrors: the case is tested
    doc["traceEvents"] = kept
    _write(doc, dst)


def _hta(control, test):
    """HTA's compare_traces and ops_diff (default scope: first rank, first iteration, CPU + GPU), and the HTA
    category of every name."""
    from hta.trace_diff import LabeledTrace, TraceDiff

    logging.getLogger("hta").setLevel(logging.ERROR)
    a, b = LabeledTrace("Control", trace_dir=str(control)), LabeledTrace("Test", trace_dir=str(test))
    cats = {}
    for lt in (a, b):
        s = lt.get_ops_summary(lt.extract_ops())
        cats.update(dict(zip(s["name"], s["cat"])))
    return TraceDiff.compare_traces(a, b), TraceDiff.ops_diff(a, b), cats


def _ours(control, test, iteration="first"):
    analyses = [analyze_run(load_run(str(p))) for p in (control, test)]
    c = compare_analyses(analyses, scope=Scope(parse_iteration(iteration)))
    return c, c.diff.ops.set_index("name")


def _ours_too(name, cats) -> bool:
    """A name of HTA's that is a row of ours too: every CPU operator, and of the runtime calls the ones that block the
    host (model.SYNC_CALLS: events of their own in fsdpprof's frame, the launch point of nothing)."""
    return cats.get(name) != "cuda_runtime" or name in model.SYNC_CALLS


def _hta_by_our_names(df, cats):
    """HTA's per-name rows without the launching runtime calls, under our names (diff.op_name): ProfilerStep#N ->
    one name."""
    keep = df[[_ours_too(n, cats) for n in df.index]]
    keep = keep.groupby(keep.index.map(diff.op_name)).sum()
    return keep[["Control_counts", "Test_counts", "Control_total_duration", "Test_total_duration"]]


def _assert_same_as_hta(ours, df, cats):
    """Per name: the same counts and total durations as HTA's compare_traces.  The one difference, explained:
    HTA also lists the CUDA runtime calls that launch work (cudaLaunchKernel, cudaMemcpyAsync, ... and the runtime
    events its symbol table names INVALID) as CPU operators; in fsdpprof's events such a call is the launch point of
    its kernel, not an event of its own, so those names are not in our table and nothing else is missing.  The calls
    that block the host (cudaStreamSynchronize, ...) are rows of both."""
    ref = _hta_by_our_names(df, cats)
    runtime = {diff.op_name(n) for n in df.index if not _ours_too(n, cats)}
    assert runtime and all(n.startswith("cuda") or n == "INVALID" for n in runtime)
    assert set(ours.index) == set(ref.index), (set(ours.index) ^ set(ref.index))
    assert set(ours.index).isdisjoint(runtime)
    o = ours.loc[ref.index]
    np.testing.assert_array_equal(o["baseline_count"].to_numpy(), ref["Control_counts"].to_numpy())
    np.testing.assert_array_equal(o["run_count"].to_numpy(), ref["Test_counts"].to_numpy())
    np.testing.assert_allclose(o["baseline_total_us"].to_numpy(), ref["Control_total_duration"].to_numpy(),
                               rtol=1e-12, atol=1e-6)
    np.testing.assert_allclose(o["run_total_us"].to_numpy(), ref["Test_total_duration"].to_numpy(),
                               rtol=1e-12, atol=1e-6)
    return ref


@pytest.mark.slow
def test_op_diff_equals_hta_on_two_v100_ranks(tmp_path):
    a, b = tmp_path / "rank0", tmp_path / "rank1"
    a.mkdir()
    b.mkdir()
    shutil.copy(shared_data(*V100, "rank-0.json.gz"), a)
    shutil.copy(shared_data(*V100, "rank-1.json.gz"), b)
    df, ops, cats = _hta(a, b)
    c, ours = _ours(a, b)
    ref = _assert_same_as_hta(ours, df, cats)
    assert len(ref) > 200 and ours["baseline_total_us"].sum() > 0
    # HTA's ops_diff lists, without the runtime calls, are ours
    for cat in ("added", "deleted", "increased", "decreased", "unchanged"):
        theirs = {diff.op_name(n) for n in ops[cat] if _ours_too(n, cats)}
        assert theirs == set(ours.index[ours["change"] == cat]), cat
    assert (ours["change"] == "increased").sum() >= 1        # rank 1 runs a few more operators
    # the scope: the first rank of each input, its first ProfilerStep
    assert c.diff.scope["per_run"][0].endswith("rank 0, step 10")
    assert c.diff.scope["per_run"][1].endswith("rank 1, step 10")


def _edited_pair(tmp_path):
    """(control, test): rank 0 of the V100 set, and beside it its _edited_copy."""
    a, b = tmp_path / "control", tmp_path / "test"
    a.mkdir()
    b.mkdir()
    src = shared_data(*V100, "rank-0.json.gz")
    shutil.copy(src, a)
    _edited_copy(src, b / "rank-0.json.gz")
    return a, b


@pytest.mark.slow
def test_op_diff_equals_hta_on_an_edited_trace(tmp_path):
    a, b = _edited_pair(tmp_path)
    df, ops, cats = _hta(a, b)
    c, ours = _ours(a, b)
    _assert_same_as_hta(ours, df, cats)
    ch = ours["change"]
    assert ch["aten::sqrt"] == "deleted" and ch[ADDED_NAME] == "added" and ch["aten::zero_"] == "deleted"
    assert ch["aten::slice"] == "decreased" and ch["aten::mul"] == "increased"
    sqrt_kernels = [n for n in ours.index if "sqrt_kernel" in n]
    assert sqrt_kernels and all(ch[n] == "deleted" for n in sqrt_kernels)
    copy_ = ours.loc["aten::copy_"]
    assert ch["aten::copy_"] == "unchanged" and copy_["time_change"] == "slower"
    assert copy_["run_total_us"] == pytest.approx(3 * copy_["baseline_total_us"])
    for cat in ("added", "deleted", "increased", "decreased", "unchanged"):
        theirs = {diff.op_name(n) for n in ops[cat] if _ours_too(n, cats)}
        mine = set(ours.index[ch == cat])
        if cat in ("added", "deleted"):
            # HTA's one other difference, reproduced: it compares ProfilerStep#10 with ProfilerStep#11 as two
            # operators (one deleted, one added); fsdpprof compares the step under one name
            assert {n for n in ops[cat] if n.startswith("ProfilerStep#")} == \
                {"ProfilerStep#11" if cat == "added" else "ProfilerStep#10"}
            theirs -= {diff.STEP_OP}
        if cat == "unchanged":
            assert diff.STEP_OP not in theirs and diff.STEP_OP in mine
            mine -= {diff.STEP_OP}
        assert theirs == mine, (cat, theirs ^ mine)
    # ranked by the time they add to the step: the stretched operator first among the operators
    assert list(ours["diff_total_us"]) == sorted(ours["diff_total_us"], reverse=True)
    assert ours.index[0] in ("aten::copy_", diff.STEP_OP)


@pytest.mark.slow
def test_hta_rounding_of_nanosecond_traces_reproduced(tmp_path, monkeypatch):
    """Traces with sub-microsecond timestamps: HTA rounds each event inward to whole microseconds (start up,
    end down: hta.common.trace_parser.round_down_time_stamps) unless HTA_DISABLE_NS_ROUNDING=1.  Without the
    rounding HTA's totals are ours; with it, rounding our own events the same way gives HTA's totals."""
    a, b, ha, hb = (tmp_path / d for d in ("control", "test", "hta-control", "hta-test"))
    for d in (a, b, ha, hb):
        d.mkdir()
    src = shared_data("gpu-traces", "hta-nccl-2rank-a100", "rank-0.json.gz")
    shutil.copy(src, a)
    _edited_copy(src, b / "rank-0.json.gz")
    # HTA reads the same traces less their annotations' GPU mirrors, which it would count twice (with them, 5 of
    # 172 names differ: '## backward ##', DistributedDataParallel.forward, Optimizer.step#SGD.step 1 against 2,
    # nccl:all_reduce 5 against 10, nccl:broadcast 2 against 4)
    _without_device_mirrors(a / "rank-0.json.gz", ha / "rank-0.json.gz")
    _without_device_mirrors(b / "rank-0.json.gz", hb / "rank-0.json.gz")
    c, ours = _ours(a, b)
    monkeypatch.setenv("HTA_DISABLE_NS_ROUNDING", "1")
    df, _, cats = _hta(ha, hb)
    ref = _assert_same_as_hta(ours, df, cats)
    assert ours["baseline_count"].sum() > 1000
    monkeypatch.delenv("HTA_DISABLE_NS_ROUNDING")
    df_rounded, _, _ = _hta(ha, hb)
    rounded = _hta_by_our_names(df_rounded, cats)
    assert not np.allclose(rounded["Control_total_duration"], ref["Control_total_duration"])  # it does differ
    ev = run_events(load_run(str(a)))
    first = ev["step"].min()
    ev = ev[(ev["step"] == first).to_numpy()
            & ~(isin(ev["kind"], [model.KIND_ANNOTATION]) & on_device(ev["lane"]))]      # (no mirrors, as above)
    hta_dur = np.floor(ev["ts_us"] + ev["dur_us"]) - np.ceil(ev["ts_us"])
    mine = hta_dur.groupby(ev["name"].astype(str).map(diff.op_name).to_numpy()).sum()
    np.testing.assert_allclose(mine.reindex(rounded.index).fillna(0.0).to_numpy(),
                               rounded["Control_total_duration"].to_numpy(), atol=1e-6)


def test_op_table_cap_keeps_totals():
    """Past the row cap the names with least time are summed into (other): counts and time per step kept."""
    ev = run_events(load_run(str(shared_data("gpu-traces", "hta-16rank-a100", "rank-0.json.gz"))))
    full = diff.op_table(ev)
    assert len(full) < diff.OPS_ROWS_MAX   # the real traces fit: the cap does not touch the HTA comparison
    capped = diff.op_table(ev, rows_max=60)
    assert len(capped) <= 60 and (capped["name"] == diff.OTHER_OPS).any()
    for col in ("count", "total_us"):
        assert capped.groupby("step")[col].sum().to_dict() == pytest.approx(full.groupby("step")[col].sum().to_dict())
    kept = capped[capped["name"] != diff.OTHER_OPS]
    top = full.groupby("name")["total_us"].sum().sort_values(ascending=False)
    assert set(kept["name"]) == set(top.index[:kept["name"].nunique()])
    # names: ProfilerStep#N under one name, long names cut and kept distinct
    assert diff.op_name("ProfilerStep#12") == diff.STEP_OP
    long_a, long_b = "k" * 300 + "a", "k" * 300 + "b"
    assert diff.op_name(long_a) != diff.op_name(long_b) and len(diff.op_name(long_a)) == diff.OPS_NAME_CHARS


def test_scope_arguments_and_errors(tmp_path):
    a, b = tmp_path / "a", tmp_path / "b"
    a.mkdir()
    b.mkdir()
    for r in range(2):
        shutil.copy(shared_data(*V100, f"rank-{r}.json.gz"), a)
        shutil.copy(shared_data(*V100, f"rank-{r + 1}.json.gz"), b)     # b: ranks 1-2
    with pytest.raises(UserError, match="not first, all, median or a step number"):
        parse_iteration("last")
    analyses = [analyze_run(load_run(str(p))) for p in (a, b)]
    c = compare_analyses(analyses)                               # default: medians across ranks
    assert c.models_known is False and c.comparable and any("Model unknown" in n for n in c.notes)
    table = c.table.set_index("metric")
    assert table.loc["model_states_theory_bytes"].isna().all()
    ops = c.diff.ops.set_index("name")
    # medians across ranks of each input's per-name counts (one step per rank here)
    per_rank = {p: analyses[i].op_stats.groupby(["rank", "name"])["count"].sum().unstack(0).fillna(0)
                for i, p in enumerate((a, b))}
    np.testing.assert_allclose(ops["baseline_count"], per_rank[a].median(axis=1).reindex(ops.index).fillna(0))
    np.testing.assert_allclose(ops["run_count"], per_rank[b].median(axis=1).reindex(ops.index).fillna(0))
    c1 = compare_analyses(analyses, scope=Scope(10, rank=1))
    assert c1.diff.scope["per_run"] == [f"{c1.labels[0]}: rank 1, step 10", f"{c1.labels[1]}: rank 1, step 10"]
    with pytest.raises(UserError, match=r"step 3 \(ProfilerStep#3\) is not in .* \(its steps: 10\)"):
        compare_analyses(analyses, scope=Scope(3))
    with pytest.raises(UserError, match=r"rank 2 has no trace in .* \(ranks 0-1\)"):
        compare_analyses(analyses, scope=Scope(SCOPE_ALL, rank=2))


def _torchtitan_layout(run_dir, root, windows):
    """run_dir's traces as torchtitan writes them: root/iteration_<s>/rank<r>_trace.json (plain JSON)."""
    for s in windows:
        d = root / f"iteration_{s}"
        d.mkdir(parents=True)
        for tr in sorted(run_dir.glob("rank-*/trace.json.gz")):
            r = int(tr.parent.name.split("-")[1])
            with gzip.open(tr, "rb") as src, open(d / f"rank{r}_trace.json", "wb") as dst:
                shutil.copyfileobj(src, dst)


def _json(path):
    return json.loads(path.read_text())


@pytest.mark.slow
def test_compare_cli_fsdp2_vs_no_reshard(recorded_run, tmp_path):
    """Real recordings end to end: FULL_SHARD against reshard_after_forward=False (SHARD_GRAD_OP)."""
    a, b = recorded_run("fsdp2"), recorded_run("fsdp2-no-reshard")
    p = run_fsdpprof("compare", str(a), str(b), "-o", str(tmp_path / "c.html"), "--iteration", "first", timeout=300)
    assert p.returncode == 0, p.stderr[-3000:]
    assert "changes against FULL_SHARD" in p.stdout
    c = _json(tmp_path / "c.json")
    d = c["diff"]
    assert c["models_known"] and d["baseline"] == c["labels"][0] and d["scope"]["iteration"] == "first"
    run_label = c["labels"][1]
    comm = pd.DataFrame(d["comm"])
    assert set(comm["run"]) == {run_label}
    # FULL_SHARD gathers each unit's parameters again in backward; without resharding there is no backward
    # all-gather at all: every such row is gone in the run
    bwd = comm[(comm["collective"] == "all_gather") & (comm["stage"] == "backward")]
    assert len(bwd) >= 4 and (bwd["baseline_count"] > 0).all() and (bwd["run_count"] == 0).all()
    assert (bwd["diff_exposed_comm_us"] == -bwd["baseline_exposed_comm_us"]).all()
    fwd = comm[(comm["collective"] == "all_gather") & (comm["stage"] == "forward")]
    assert len(fwd) >= 4 and (fwd["baseline_count"] == fwd["run_count"]).all()
    assert (fwd["baseline_bytes"] == fwd["run_bytes"]).all()
    rs = comm[comm["collective"] == "reduce_scatter"]
    assert len(rs) and (rs["baseline_count"] == rs["run_count"]).all()
    # the baseline's numbers, from its own events (first rank, first step): an independent count
    ev = run_events(load_run(str(a)))
    r0 = ev[(ev["rank"] == ev["rank"].min())]
    r0 = r0[r0["step"] == r0["step"].min()]
    coll = r0[(r0["kind"].astype(str) == "comm") & r0["collective"].notna()]
    by = coll.groupby([coll["collective"].astype(str), coll["stage"].astype(str)]).size()
    got = comm.groupby(["collective", "stage"])["baseline_count"].sum()
    assert got.to_dict() == pytest.approx({k: float(v) for k, v in by.items()})
    ops = pd.DataFrame(d["ops"]).set_index("name")
    names = r0["name"].astype(str).map(diff.op_name)
    counts = names.value_counts()
    assert ops["baseline_count"][ops["baseline_count"] > 0].to_dict() == pytest.approx(
        {k: float(v) for k, v in counts.items()})
    totals = r0["dur_us"].groupby(names.to_numpy()).sum()
    np.testing.assert_allclose(ops.loc[totals.index, "baseline_total_us"], totals.to_numpy(), rtol=1e-9)
    # step decomposition: the run's minus the baseline's, per metric
    steps = pd.DataFrame(d["steps"]).set_index("metric")
    assert list(steps.index) == diff.STEP_METRICS
    np.testing.assert_allclose(steps["diff_us"], steps["run_us"] - steps["baseline_us"])
    # memory at the peak: without resharding, the unsharded parameters stay alive
    mem = pd.DataFrame(d["memory"]).set_index("category")
    assert mem.loc["unsharded_param", "run_bytes"] > mem.loc["unsharded_param", "baseline_bytes"] > 0
    units = pd.DataFrame(d["memory_units"])
    assert len(units) and set(units["run"]) == {run_label}


@pytest.mark.slow
def test_compare_trace_folders_without_inventory(recorded_run, tmp_path):
    """A run directory against its own traces laid out as torchtitan writes them (no inventory): compared
    without --force, formulas left out with a note, every measured difference zero; the window is chosen by
    --iteration."""
    a = recorded_run("fsdp2")
    tt = tmp_path / "profile_trace"
    _torchtitan_layout(a, tt, (3, 5))
    p = run_fsdpprof("compare", str(a), str(tt), "-o", str(tmp_path / "c.html"), timeout=300)
    assert p.returncode == 0, p.stderr[-3000:]
    c = _json(tmp_path / "c.json")
    assert c["comparable"] and c["models_known"] is False
    assert any("Model unknown" in n and str(tt) in n for n in c["notes"])
    assert any("iteration_3, iteration_5" in n and n.endswith("iteration_5") for n in c["notes"])
    table = {r["metric"]: r for r in c["table"]}
    assert all(v is None for k, v in table["model_states_theory_bytes"].items() if k != "metric")
    d = c["diff"]
    comm, steps, ops = pd.DataFrame(d["comm"]), pd.DataFrame(d["steps"]), pd.DataFrame(d["ops"])
    assert len(comm) >= 8 and len(ops) > 50 and len(steps) == len(diff.STEP_METRICS)
    for df, cols in ((comm, ["diff_count", "diff_bytes", "diff_comm_us", "diff_exposed_comm_us"]),
                     (steps, ["diff_us"]), (ops, ["diff_count", "diff_total_us"])):
        assert (df[cols].abs().to_numpy() < 1e-6).all()
    assert set(ops["change"]) == {"unchanged"}
    p = run_fsdpprof("compare", str(tt), str(a), "-o", str(tmp_path / "c2.html"), "--iteration", "first", "--rank",
                     "1", timeout=300)
    assert p.returncode == 0, p.stderr[-3000:]
    c2 = _json(tmp_path / "c2.json")
    assert any(n.endswith("iteration_3") for n in c2["notes"])
    assert c2["diff"]["scope"]["per_run"][0].endswith("rank 1, step 2")
    # step N: the first window dumped after step N (torchtitan names a window after the step count at its end)
    p = run_fsdpprof("compare", str(tt), str(a), "-o", str(tmp_path / "c4.html"), "--iteration", "3", timeout=300)
    assert p.returncode == 0, p.stderr[-3000:]
    c4 = _json(tmp_path / "c4.json")
    assert any(n.endswith("iteration_5") for n in c4["notes"])
    assert c4["diff"]["scope"]["per_run"][0].endswith("ranks 0-1, step 3 (median across ranks)")
    # bad scope: one line, exit 2
    for args, words in ((("--rank", "7"), "rank 7 is not in"), (("--iteration", "99"), "is not in"),
                        (("--iteration", "last"), "not first, all, median")):
        p = run_fsdpprof("compare", str(a), str(tt), "-o", str(tmp_path / "c3.html"), *args, timeout=300)
        lines = [ln for ln in p.stderr.splitlines() if ln.strip()]
        assert p.returncode == 2 and len(lines) == 1 and words in lines[0], p.stderr


def test_render_diff_escapes_trace_strings(tmp_path):
    from fsdpprof.report.diff import diff_text, render_diff
    from fsdpprof.report.page import Page

    a, b = _edited_pair(tmp_path)
    c, ours = _ours(a, b)
    html = render_diff(c, Page())
    assert 'onerror="alert(1)"' not in html and "<img" not in html
    assert "fsdpprof_test::added&lt;img src=x onerror=&quot;alert(1)&quot;&gt;" in html
    assert html.startswith('<section id="diff">') and "aten::copy_" in html and "plotly" in html
    text = diff_text(c)
    n = ours["change"].value_counts()
    assert f"{n['added']} added, {n['deleted']} deleted" in text
    assert math.isfinite(float(ours["diff_total_us"].sum()))
