"""`fsdpprof report` on real recordings, real GPU traces and CUDA snapshots: numbers beside theory,
offline HTML, partial runs, bad input."""
from __future__ import annotations

import json
import re
import shutil

import pytest

from conftest import OFFLOAD_BF16, run_fsdpprof, shared_data
from fsdpprof.analyze.summary.theory import fmt_bytes
from fsdpprof.report.plotly_bundle import plotly_js_name


def _report(path, out_dir, *extra, fresh_process=False):
    out = out_dir / "report.html"
    p = run_fsdpprof("report", str(path), "-o", str(out), *extra, timeout=300, fresh_process=fresh_process)
    assert p.returncode == 0, p.stderr[-3000:]
    summary = json.loads((out_dir / "summary.json").read_text())
    return out.read_text(), summary, p.stdout


def _rows(summary, key, **match):
    return [r for r in summary[key] or [] if all(r.get(k) == v for k, v in match.items())]


def _assert_offline(html: str, folder):
    """plotly.js loaded from the file written beside the page, by a relative path; nothing from the network."""
    assert not re.search(r"\* plotly\.js v\d", html)  # the bundle's banner: not in the page
    srcs = re.findall(r"<script[^>]*\ssrc=\"([^\"]*)\"", html)
    assert srcs == [plotly_js_name()] and (folder / srcs[0]).is_file(), srcs
    assert not re.search(r"<link[^>]+href=[\"']?https?:", html)
    for section in ("overview", "findings", "memory", "communication", "steps", "ranks", "device"):
        assert f'id="{section}"' in html


@pytest.mark.slow
def test_fsdp2_report_theory_matches_measurement(recorded_run, tmp_path):
    run = recorded_run("fsdp2")
    html, s, stdout = _report(run, tmp_path, "--hta", fresh_process=True)   # (one `report` end to end)
    _assert_offline(html, tmp_path)
    inv = json.loads((run / "rank-0" / "inventory.json").read_text())
    t = s["theory"]
    assert s["overview"]["strategy"] == "FULL_SHARD" and t["canonical_strategy"] == "ZERO3"
    assert t["psi"] == inv["totals"]["psi"]
    n = t["N"]
    assert n == 2
    # FULL_SHARD model states per rank = (k_p + k_g + k_o) Psi / N, measured from the inventory
    assert t["model_states"]["total_bytes"] == pytest.approx((t["k_param"] + t["k_grad"] + t["k_opt"]) * t["psi"] / n)
    for row in _rows(s, "model_states", rank=0):
        assert row["measured_bytes"] == pytest.approx(row["theory_bytes"], rel=0.01), row
    # measured volume vs 2(N-1)/N S all-gather + (N-1)/N S reduce-scatter
    traffic = {r["collective"]: r for r in _rows(s, "traffic", rank=0)}
    assert set(traffic) >= {"all_gather", "reduce_scatter"}
    for c in ("all_gather", "reduce_scatter"):
        assert traffic[c]["wire_per_step_bytes"] == pytest.approx(traffic[c]["theory_wire_per_step_bytes"], rel=0.05)
    total = sum(traffic[c]["wire_per_step_bytes"] for c in ("all_gather", "reduce_scatter"))
    assert total == pytest.approx(3 * (n - 1) / n * t["psi"] * 4, rel=0.05)  # fp32 run: S = 4 Psi
    # formulas written out, then with the numbers put in
    assert "(k_p + k_g + k_o) * Psi / N" in html and t["model_states"]["substituted"] in html
    assert "3(N-1)/N * S" in html
    # memory and the peak estimate beside it
    # the estimate stands beside the rank that peaks highest (either rank may, from one recording to the next)
    peak = max(m["peak_allocated_bytes"] for m in s["memory"].values())
    assert peak > t["model_states"]["total_bytes"]
    pe = t["peak_estimate"]
    assert pe["measured_peak_bytes"] == peak and pe["diff_bytes"] == pytest.approx(peak - pe["estimate_bytes"])
    # steps: T_step ~ T_comp + T_comm - T_overlap + idle
    for st in s["steps"]:
        assert st["step_us"] > 0 and st["exposed_comm_us"] <= st["comm_us"] + 1e-6
    assert s["overview"]["step_time_us"] > 0
    # findings point at numbers; CPU trace: HTA (asked for with --hta) left out with a note
    for f in s["findings"]:
        assert f["metric"] and f["value"] == f["value"] and f["section"]
    assert "HTA" in s["notes"]["hta"] and "cpu" in s["notes"]["hta"]
    assert "fsdpprof report" in stdout and "report:" in stdout


@pytest.mark.slow
def test_ddp_and_shard_grad_op_theory(recorded_run, tmp_path):
    d = tmp_path / "ddp"
    d.mkdir()
    _, s, _ = _report(recorded_run("ddp"), d)
    t = s["theory"]
    assert t["canonical_strategy"] == "DDP"
    assert t["model_states"]["total_bytes"] == pytest.approx((t["k_param"] + t["k_grad"] + t["k_opt"]) * t["psi"])
    for row in _rows(s, "model_states", rank=0):
        assert row["measured_bytes"] == pytest.approx(row["theory_bytes"], rel=0.01), row
    g = tmp_path / "sgo"
    g.mkdir()
    html, s2, _ = _report(recorded_run("fsdp2-no-reshard"), g)
    t2 = s2["theory"]
    assert s2["overview"]["strategy"] == "SHARD_GRAD_OP" and t2["canonical_strategy"] == "ZERO2"
    # one all-gather per step (params kept from forward to backward)
    ag = _rows(s2, "traffic", rank=0, collective="all_gather")[0]
    assert ag["wire_per_step_bytes"] == pytest.approx(t2["traffic"]["all_gather_bytes"], rel=0.05)
    assert t2["traffic"]["all_gather_bytes"] == pytest.approx(0.5 * t2["psi"] * 4)
    # the note counts the gathered parameters (rank 0's param row) against ZeRO-2's k_p Psi, both from this run
    par = _rows(s2, "model_states", rank=0, role="param")[0]
    note = t2["model_states_explanation"]
    assert "counted as SHARD_GRAD_OP holds them" in note and "not in ZeRO-2's formula" in note, note
    assert fmt_bytes(par["measured_bytes"]) in note and fmt_bytes(par["theory_bytes"]) in note, note
    assert par["measured_bytes"] == pytest.approx(par["theory_bytes"], rel=0.05)   # all units gathered: the full model


@pytest.mark.slow
def test_partial_run_gets_a_banner(recorded_run, tmp_path):
    src = recorded_run("fsdp2")
    run = tmp_path / "partial"
    shutil.copytree(src, run, ignore=shutil.ignore_patterns("report.html", "summary.json"))
    shutil.rmtree(run / "rank-1")
    html, s, stdout = _report(run, tmp_path)
    assert "1" in " ".join(s["missing"]) or any("1" in k for k in s["missing"]), s["missing"]
    assert "Partial run" in html and "PARTIAL" in stdout
    assert s["overview"]["ranks_present"] == [0]


@pytest.mark.slow
def test_partial_run_words_count_and_name_what_was_analysed(recorded_run, tmp_path):
    """rank 1 kept for its inventory but without its trace: not counted as analysed; each missing rank named
    once (before: "ranks analysed 2" beside "PARTIAL: missing rank-1", and "rank-1: rank-1: no ...")."""
    src = recorded_run("fsdp2")
    run = tmp_path / "no-trace"
    shutil.copytree(src, run, ignore=shutil.ignore_patterns("report.html", "summary.json"))
    (run / "rank-1" / "trace.json.gz").unlink()
    html, s, stdout = _report(run, tmp_path)
    assert s["overview"]["ranks_present"] == [0] and s["overview"]["ranks_analysed"] == 1
    assert "ranks analysed 1," in stdout and "PARTIAL: missing rank-1: no trace.json.gz" in stdout, stdout
    assert s["missing"] == {"rank-1": "no trace.json.gz (status complete)"}
    assert "rank-1: rank-1" not in stdout and "rank-1: rank-1" not in html


@pytest.mark.slow
def test_run_still_being_recorded_is_said_so(recorded_run, tmp_path):
    """run.json ``running`` with a launcher alive: a rank not saved yet is "still being recorded", not "did not
    record or died early"."""
    import os

    src = recorded_run("fsdp2")
    run = tmp_path / "running"
    shutil.copytree(src, run, ignore=shutil.ignore_patterns("report.html", "summary.json"))
    shutil.rmtree(run / "rank-1")
    meta = json.loads((run / "run.json").read_text())
    meta.update(status="running", exit_code=None, ended_at=None)
    (run / "run.json").write_text(json.dumps(meta))
    launcher = next((run / "launchers").glob("*.json"))
    doc = json.loads(launcher.read_text())
    doc.update(exit_code=None, pid=os.getpid(), pid_start=None)     # this test's process: alive
    launcher.write_text(json.dumps(doc))
    html, s, stdout = _report(run, tmp_path / "alive")
    assert s["missing"]["rank-1"] == "no rank directory (not saved yet: the run is still being recorded)"
    assert "still being recorded" in stdout and "did not record" not in stdout and "died early" not in stdout
    assert "rank-1: rank-1" not in stdout
    # the same run once its launcher is gone: interrupted, and the rank did not record
    doc.update(pid=2 ** 22 + 12345)
    launcher.write_text(json.dumps(doc))
    _, s, stdout = _report(run, tmp_path / "gone")
    assert "did not record or died early" in s["missing"]["rank-1"] and "still being recorded" not in stdout


def test_cuda_snapshot_report(tmp_path):
    snap = shared_data("cuda-snapshots", "multi-device-expandable-oom.pickle")
    html, s, _ = _report(snap, tmp_path)
    m = s["memory"]["0"]
    assert m["source"] == "cuda_snapshot" and m["peak_allocated_bytes"] > 0 and m["oom"]
    assert "Out of memory" in html
    assert "inventory" in s["notes"]["theory"] and "no trace events" in s["notes"]["communication"]


@pytest.mark.slow
def test_gpu_traces_get_device_breakdowns_and_hta_on_request(tmp_path):
    folder = shared_data("gpu-traces", "param-dlrm-8rank-v100")
    plain = tmp_path / "plain"
    plain.mkdir()
    _, s0, _ = _report(folder, plain)
    assert len(s0["temporal"]) == 8 and s0["kernel_types"] and s0["idle"] and s0["hta"] == {}   # ours, no HTA
    html, s, _ = _report(folder, tmp_path, "--hta")
    assert s["overview"]["device_type"] == "cuda" and s["overview"]["world_size"] == 8
    assert {"kernel_type", "temporal", "idle"} <= set(s["hta"])
    assert len(s["hta"]["temporal"]) == 8
    # HTA's figures beside ours: each rank's idle share within half a point (tests/test_breakdowns.py
    # explains the rest; HTA drops the last step and rounds to whole µs by default)
    ours = {r["rank"]: r["idle_time_pct"] for r in s["temporal"]}
    for r in s["hta"]["temporal"]:
        assert abs(ours[r["rank"]] - r["idle_time_pctg"]) < 5, (r, ours)     # wiring; the precise check is there
    assert s["skew"] and s["stragglers"]
    assert sum(r["times_last"] for r in s["stragglers"]) == len(s["skew"])  # every matched collective has a last rank
    assert "Temporal breakdown of device time" in html and "own tables (--hta)" in html


@pytest.mark.parametrize("make", ["empty_dir", "random_files", "missing", "evil_snapshot"])
def test_report_bad_input_one_line(tmp_path, make):
    target = tmp_path / "notarun"
    if make == "evil_snapshot":  # a pickle that would run a command if loaded with pickle.load
        target = tmp_path / "memory_snapshot.pickle"
        target.write_bytes(b"cos\nsystem\n(S'touch " + str(tmp_path / "pwned").encode() + b"'\ntR.")
    elif make == "empty_dir":
        target.mkdir()
    elif make == "random_files":
        target.mkdir()
        (target / "notes.txt").write_text("hello")
        (target / "data.json").write_text('{"a": 1}')
    p = run_fsdpprof("report", str(target), "-o", str(tmp_path / "r.html"), timeout=120)
    assert p.returncode == 2, (p.stdout, p.stderr)
    lines = [ln for ln in p.stderr.splitlines() if ln.strip()]
    assert len(lines) == 1 and lines[0].startswith("fsdpprof report: error:"), p.stderr
    assert not (tmp_path / "r.html").exists() and not (tmp_path / "pwned").exists()


@pytest.mark.slow
def test_fsdp1_no_shard_all_reduce_volume_matches_2_n_minus_1_over_n(recorded_run, tmp_path):
    _, s, _ = _report(recorded_run("fsdp1-no-shard"), tmp_path)
    t = s["theory"]
    assert s["overview"]["strategy"] == "NO_SHARD" and t["canonical_strategy"] == "DDP"
    n = t["N"]
    ar = _rows(s, "traffic", rank=0, collective="all_reduce")[0]
    assert t["traffic"]["all_reduce_bytes"] == pytest.approx(2 * (n - 1) / n * t["psi"] * 4)  # fp32 grads
    assert ar["wire_per_step_bytes"] == pytest.approx(t["traffic"]["all_reduce_bytes"], rel=0.05)
    assert any(f["id"] == "replicated_model_states" for f in s["findings"])


@pytest.mark.slow
def test_mixed_precision_all_gather_in_param_dtype_reduce_scatter_in_reduce_dtype(recorded_run, tmp_path):
    """FSDP2 MixedPrecisionPolicy(param_dtype=bf16, reduce_dtype=fp32): all-gathers move 2 bytes per
    parameter, reduce-scatters 4, and the theory says so before the measurement confirms it (the run offloads
    its sharded states to the CPU too: conftest.OFFLOAD_BF16)."""
    run = recorded_run(*OFFLOAD_BF16)
    _, s, _ = _report(run, tmp_path)
    t = s["theory"]
    assert (t["unsharded_param_dtype"], t["reduce_dtype"]) == ("bfloat16", "float32")
    n, psi = t["N"], t["psi"]
    assert t["traffic"]["all_gather_bytes"] == pytest.approx(2 * (n - 1) / n * psi * 2)
    assert t["traffic"]["reduce_scatter_bytes"] == pytest.approx((n - 1) / n * psi * 4)
    traffic = {r["collective"]: r for r in _rows(s, "traffic", rank=0)}
    for c in ("all_gather", "reduce_scatter"):
        assert traffic[c]["wire_per_step_bytes"] == pytest.approx(traffic[c]["theory_wire_per_step_bytes"], rel=0.05)
    # sharded states stay fp32: model states as in the fp32 run
    for row in _rows(s, "model_states", rank=0):
        assert row["measured_bytes"] == pytest.approx(row["theory_bytes"], rel=0.01)


def test_summary_json_written_key_by_key_is_json_dumps():
    """summary.json is written one key at a time (a run of many ranks never holds all its plain values at
    once): the bytes are exactly json.dumps of the whole plain summary, on a real 8-rank GPU input and on
    strings with line breaks, NaN, infinities and empty containers."""
    import json

    import numpy as np
    import pandas as pd

    from fsdpprof.analyze.pipeline import analyze_run
    from fsdpprof.analyze.load.run import load_run
    from fsdpprof.report.outputs import json_bytes
    from fsdpprof.analyze.load.frames import json_safe
    from fsdpprof.report.summary import summary

    a = analyze_run(load_run(str(shared_data("gpu-traces", "param-dlrm-8rank-v100")), lazy=True), ops=False)
    assert json_bytes(summary(a, plain=False)) == json.dumps(summary(a), indent=1, allow_nan=False).encode()
    odd = {"a": [1, {"s": "x\ny", "e": [], "d": {}}], "f": pd.DataFrame({"x": [1.5, np.nan], "s": ["b\nc", "}"]}),
           "inf": {"k": [float("inf")]}, "none": None}
    assert json_bytes(odd) == json.dumps(json_safe(odd), indent=1, allow_nan=False).encode()
    assert json_bytes({}) == b"{}" and json.loads(json_bytes(odd))["f"][1]["x"] is None


def test_records_a_column_at_a_time_equal_json_safe_of_each_value():
    """frames.records converts a column at a time; every kind of column gives what json_safe of each value
    (row by row, as itertuples yields them) gives: NaN / infinities as null, numpy numbers as plain ones."""
    import math

    import numpy as np
    import pandas as pd

    from fsdpprof.analyze.load.frames import json_safe, records

    def row_by_row(df):
        cols = [str(c) for c in df.columns]
        return [{c: json_safe(v) for c, v in zip(cols, row)} for row in df.itertuples(index=False, name=None)]

    nan, inf = float("nan"), float("inf")
    df = pd.DataFrame({
        "f": [1.5, nan, inf, -inf], "f32": np.array([1.1, 2.2, nan, 4.4], dtype=np.float32),
        "i": np.array([1, -2, 3, 2**62], dtype=np.int64), "u8": np.array([1, 2, 3, 250], dtype=np.uint8),
        "b": [True, False, True, False], "o": ["x", None, nan, 3], "c": pd.Categorical(["a", None, "b", "a"]),
        "t": pd.to_datetime(["2024-01-01", None, "2024-01-02", "2024-01-03"]),
        "n": pd.array([1, None, 3, 4], dtype="Int64"), "F": pd.array([1.5, None, nan, 3.5], dtype="Float64"),
        "s": pd.array(["a", None, "c", "d"], dtype="string"), 7: [np.int32(1), np.float64(nan), {"k": nan}, [inf]]})
    dup = pd.DataFrame([[1, 2.0], [3, nan]], columns=["a", "a"])
    for frame in (df, dup, df.iloc[:0], pd.DataFrame(index=range(3)), df[["o", "f"]].iloc[::-1]):
        got, want = records(frame), row_by_row(frame)
        assert got == want or repr(got) == repr(want), (got, want)
    out = records(df)
    assert [r["f"] for r in out] == [1.5, None, None, None] and all(type(r["i"]) is int for r in out)
    assert [r["b"] for r in out] == [True, False, True, False] and out[0]["f32"] == float(np.float32(1.1))
    assert not any(isinstance(v, float) and not math.isfinite(v) for r in out for v in r.values())
    assert records(None) is None
