"""What the page claims (issue 38, items 5 and 8): nothing the input does not hold is shown as a value, and
the page says each number once, in one unit per column, with its sign.

Real data where it exists: the B200 trace (BF16 / FP8 / FP4 kernels, deviceProperties, one stream running
compute and communication), the 16-rank A100 trace (five SendRecv kernels launched before the window, no
collective sizes), the 2-rank A100 trace (an NCCL stream, sizes) and the FlexGen snapshot (fragmentation);
hand-built inputs for the rest.  Recording tests (what-if tables of a run) are slow."""
from __future__ import annotations

import gzip
from html import unescape
import json
import math
import re

import numpy as np
import pandas as pd
import pytest

from conftest import run_fsdpprof, shared_data
from fsdpprof.analyze import model
from fsdpprof.analyze.compare.diff import _pair, diff_analyses, scoped
from fsdpprof.analyze.summary import theory
from fsdpprof.analyze.trace.labels import lane_names
from fsdpprof.analyze.whatif.advice import MARGIN_PCT, recommend
from fsdpprof.report.page import CATEGORY_COLORS, Page, table

B200 = ("gpu-traces", "tracelens-b200-8rank")
A100_16 = ("gpu-traces", "hta-16rank-a100")
A100_2 = ("gpu-traces", "hta-nccl-2rank-a100")


def _analyse(*parts):
    from fsdpprof.commands.report import analyse_path

    return analyse_path(str(shared_data(*parts)))


@pytest.fixture(scope="module")
def b200():
    return _analyse(*B200)


@pytest.fixture(scope="module")
def a100_16():
    return _analyse(*A100_16)


def _raw(*parts) -> dict:
    with gzip.open(shared_data(*parts) / "rank-0.json.gz", "rt") as fh:
        return json.load(fh)


def _text(html: str) -> str:
    """The page's words, each cell or element ended by " | " (inline emphasis dropped)."""
    html = re.sub(r"<script.*?</script>", "", html, flags=re.S)
    html = re.sub(r"</?(b|i|code|a)( [^>]*)?>", "", html)
    return re.sub(r"(\s*\|\s*)+", " | ", unescape(re.sub(r"<[^>]+>", " | ", html)))


# --------------------------------------------------------------------------- 5. unknown is "unknown"
def test_b200_precision_is_inferred_from_kernel_names_and_said_so(b200):
    """The B200 trace has no inventory: mixed precision is what its kernels' names show, said to be inferred,
    counted as an independent reading of the raw file counts them; CPU offload is unknown, not "no"."""
    from fsdpprof.report.overview import overview_section

    kernels = [e["name"] for e in _raw(*B200)["traceEvents"] if e.get("cat") == "kernel"]
    low = [n.lower() for n in kernels]
    want = {"bf16": sum("bfloat16" in n or "bf16" in n for n in low),
            "fp8": sum(any(w in n for w in ("e4m3", "e5m2", "fp8", "float8")) for n in low),
            "fp4": sum("e2m1" in n or "fp4" in n for n in low)}
    seen = b200.overview["precisions_seen"]
    assert seen["by_dtype"] == {k: v for k, v in want.items() if v} and want["bf16"] > 500 and want["fp8"] > 100
    assert seen["kernels"] >= len(kernels) and seen["comm_dtypes"] == ["bfloat16"]
    assert b200.overview["mixed_precision"] is None and b200.overview["cpu_offload"] is None   # (summary: null)
    text = _text(overview_section(b200))
    assert re.search(r"mixed precision \| inferred from kernel names \(no inventory\): bf16 in 6\d\d", text), text
    assert "CPU offload | unknown (no inventory)" in text
    assert "mixed precision | none" not in text and "CPU offload | no " not in text


def test_precision_unknown_when_kernel_names_say_nothing():
    from fsdpprof.report.overview import precision_text

    assert precision_text({"has_inventory": False, "precisions_seen": {"kernels": 10, "by_dtype": {},
                                                                       "comm_dtypes": []}}).startswith("unknown")
    assert precision_text({"has_inventory": False, "precisions_seen": None}) == "unknown (no inventory)"
    assert precision_text({"has_inventory": True, "mixed_precision": None}) == "none"      # the inventory says so
    assert model.kernel_precisions("ampere_bf16_s16816gemm_bf16_128x64") == ("bf16",)
    assert model.kernel_precisions("void at::native::vectorized_elementwise_kernel<4, float>") == ()
    assert model.kernel_precisions("sm90_xmma_gemm_f16f16_f16f32_f32_tn_n") == ("fp16",)


def test_b200_device_named_from_device_properties(b200):
    from fsdpprof.report.overview import context_line, device_text

    props = _raw(*B200)["deviceProperties"]
    assert {p["name"] for p in props} == {"NVIDIA B200"}
    assert b200.overview["device_name"] == "NVIDIA B200"
    assert b200.overview["device_memory_bytes"] == props[0]["totalGlobalMem"] == 191_503_138_816
    assert device_text(b200.overview) == "cuda (NVIDIA B200, 178 GiB)"      # 191.5e9 B, in the page's binary units
    assert "NVIDIA B200" in context_line(b200) and "cuda nccl" not in context_line(b200)


def test_device_of_picks_the_entry_or_says_nothing():
    a = {"id": 0, "name": "A", "totalGlobalMem": 10}
    b = {"id": 1, "name": "B", "totalGlobalMem": 20}
    assert model.device_of([a, dict(a, id=1)]) == ("A", 10)
    assert model.device_of([a, b]) == (None, None)              # two kinds, no id: not guessed
    assert model.device_of([a, b], 1) == ("B", 20)
    assert model.device_of(None) == (None, None) and model.device_of([{"id": 0}]) == (None, None)


def test_streams_are_named_by_what_runs_on_them(b200):
    """B200: one stream runs 855 compute / copy kernels and 74 communication kernels (1 NCCL): not "(NCCL)".
    The 2-rank A100's NCCL stream still is."""
    raw = _raw(*B200)["traceEvents"]
    on7 = [e for e in raw if e.get("cat") in ("kernel", "gpu_memcpy", "gpu_memset") and e.get("args", {}).get("stream") == 7]
    nccl = [e for e in on7 if e["name"].lower().startswith("nccl")]
    assert len(on7) > 900 and len(nccl) == 1
    names = set(b200.lanes.loc[b200.lanes["lane"] == "stream:7", "lane_name"])
    assert names == {"CUDA stream 7 (compute + communication)"}, names
    a = _analyse(*A100_2)
    assert set(a.lanes.loc[a.lanes["lane"] == "stream:40", "lane_name"]) == {"CUDA stream 40 (NCCL)"}
    n = lane_names(["stream:1", "stream:2", "stream:3", "stream:4"], comm_lanes={"stream:1", "stream:2", "stream:3"},
                   nccl_lanes={"stream:1", "stream:3"}, comm_share={"stream:1": 0.95, "stream:2": 0.5, "stream:3": 0.01})
    assert n == {"stream:1": "GPU stream 1 (NCCL)", "stream:2": "GPU stream 2 (compute + communication)",
                 "stream:3": "GPU stream 3 (compute + NCCL)", "stream:4": "GPU stream 4"}


def test_launchless_sendrecv_stays_unknown_collective(a100_16):
    """The 16-rank A100 trace: five SendRecv kernels whose launch is not in the trace (an independent reading of
    the raw file: no runtime call with their correlation id) are an unknown collective, not send_recv; the
    launched ones keep the type of the CPU op that launched them."""
    from fsdpprof.analyze.load.run import load_run, run_events

    raw = _raw(*A100_16)["traceEvents"]
    launched = {e.get("args", {}).get("correlation") for e in raw if e.get("cat") in ("cuda_runtime", "cuda_driver")}
    sr = [e for e in raw if e.get("cat") == "kernel" and "SendRecv" in e["name"]]
    orphans = [e for e in sr if e.get("args", {}).get("correlation") not in launched]
    assert len(orphans) == 5 and len(sr) > 5
    ev = run_events(load_run(str(shared_data(*A100_16))))
    k = ev[ev["name"].astype(str).str.contains("SendRecv") & ev["lane"].astype(str).str.startswith("stream")]
    no_launch = k["launch_ts_us"].isna()
    assert int(no_launch.sum()) == 5
    assert set(k.loc[no_launch, "collective"].astype(str)) == {model.UNKNOWN_COLLECTIVE}
    assert model.SEND_RECV not in set(k["collective"].astype(str))
    assert set(k.loc[~no_launch, "collective"].astype(str)) <= {"all_to_all", "all_gather", "all_reduce",
                                                               "reduce_scatter"}
    assert not model.kernel_name_tells_collective("ncclKernel_SendRecv_RING_SIMPLE_Sum_int8_t(ncclDevComm*)")
    assert model.kernel_name_tells_collective("ncclDevKernel_AllGather_RING_LL(ncclDevKernelArgsStorage<4096ul>)")


def test_unknown_sizes_stay_unknown_through_compare():
    """A group whose size the input lacks: NaN through the sum over steps, the pairing and the difference; a group
    absent on one side: 0 there."""
    df = pd.DataFrame({"rank": [0, 0, 1, 1, 0], "step": [1.0, 2.0, 1.0, 2.0, 1.0],
                       "collective": ["ag", "ag", "ag", "ag", "rs"], "bytes": [np.nan, np.nan, np.nan, 4.0, 8.0],
                       "comm_us": [1.0, 2.0, 3.0, 4.0, 5.0]})
    sel = {0: [1.0, 2.0], 1: [1.0, 2.0]}
    med = scoped(df, ["collective"], ["bytes", "comm_us"], sel, "median").set_index("collective")
    tot = scoped(df, ["collective"], ["bytes", "comm_us"], sel, "all").set_index("collective")
    assert math.isnan(tot.loc["ag", "bytes"]) and tot.loc["ag", "comm_us"] == 5.0         # rank 1: 3 + 4, rank 0: 3
    assert med.loc["rs", "bytes"] == 2.0      # rank 0: median(8, 0) = 4, rank 1: 0 (absent): median 2
    assert med.loc["ag", "bytes"] == 4.0      # rank 0 unknown, left out; rank 1: median(NaN, 4) -> 4
    run = pd.DataFrame({"collective": ["ar", "rs"], "bytes": [np.nan, 1.0], "comm_us": [1.0, 1.0]})
    p = _pair(tot.reset_index(), run, ["collective"], ["bytes", "comm_us"]).set_index("collective")
    assert math.isnan(p.loc["ag", "baseline_bytes"]) and p.loc["ag", "run_bytes"] == 0.0
    assert math.isnan(p.loc["ag", "diff_bytes"])
    assert p.loc["ar", "baseline_bytes"] == 0.0 and math.isnan(p.loc["ar", "run_bytes"])
    assert p.loc["rs", "diff_bytes"] == 1.0 - 4.0


def test_a100_compare_and_tables_say_unknown_not_0_b(a100_16):
    """The 16-rank A100 trace holds no sizes for its all-gathers and reduce-scatters (their NCCL ops carry no
    nelems; its all-reduces and all-to-alls get theirs from their NCCL ops' Input Dims): compare's table says
    "unknown" where it said 0 B, and the report's headings do not promise the size and bandwidth columns a trace
    without any size leaves out."""
    from dataclasses import replace

    from fsdpprof.report.communication import communication_section
    from fsdpprof.report.diff import _comm_html

    d = diff_analyses([a100_16, a100_16], ["base", "run"])
    sizeless = d.comm["collective"].isin([model.ALL_GATHER, model.REDUCE_SCATTER]).to_numpy()
    assert sizeless.any() and (~sizeless).any()
    assert d.comm.loc[sizeless, "baseline_bytes"].isna().all() and d.comm.loc[sizeless, "diff_bytes"].isna().all()
    assert d.comm.loc[~sizeless, "baseline_bytes"].notna().all()
    html = _comm_html(d.comm[sizeless])
    heads = re.findall(r"<th[^>]*>([^<]*)</th>", html)
    rows = [re.findall(r"<td[^>]*>([^<]*)</td>", r) for r in re.findall(r"<tr>(.*?)</tr>", html)]
    sizes = [r[heads.index(h)] for r in rows if r for h in ("size (base) (MiB)", "size (run) (MiB)")]
    assert sizes and set(sizes) == {"unknown"} and "0 B" not in _comm_html(d.comm)
    # the same trace with no size at all: the headings leave size, volume and bandwidth out
    blank = {c: np.nan for c in ("bytes", "algbw_gbps", "busbw_gbps")}
    none = replace(a100_16, volume=a100_16.volume.assign(**blank),
                   comm_phase=a100_16.comm_phase.assign(**{c: v for c, v in blank.items() if c in a100_16.comm_phase}))
    sec = _text(communication_section(none, Page(None)))
    assert "Per collective: count, time |" in sec and "size" not in sec.split("Per collective: ")[1][:20]
    assert "volume," not in sec.split("FSDP phase:")[1][:30]


def test_b200_headings_and_columns(b200):
    """B200: sizes known (the heading names them); no theory (no "vs theory"); kernel time equal to
    communication time is one column, not two."""
    from fsdpprof.report.communication import communication_section

    sec = _text(communication_section(b200, Page(None)))
    assert "Per collective: count, size, time, bandwidth" in sec
    assert "Measured volume (bytes each rank sends" in sec and "vs theory" not in sec
    op = b200.comm_phase
    assert np.allclose(op["time_us"], op["comm_us"], rtol=1e-3)
    part = sec.split("FSDP phase:")[1].split("Overall overlap")[0]
    assert "communication (ms)" in part and "| time (ms)" not in part


# --------------------------------------------------------------------------- 8. the page
def test_tables_flatten_nested_rows_integers_and_root_unit():
    from fsdpprof.report.tables import summary_tables, table_frame

    doc = {"whatif": {"predictions": [
        {"strategy": "DDP", "world_size": 2, "step_us": 1.5e5, "peak_allocated_bytes": 5.0e7,
         "breakdown": {"param": 1.4642688e7, "grad": 7.0}, "kept": ["a", "b"], "assumed": []},
        {"strategy": "FULL_SHARD", "world_size": 2, "step_us": 3.0e5, "peak_allocated_bytes": None,
         "breakdown": {"param": 3.0}, "kept": [], "assumed": ["c"]}]},
        "comm": [{"rank": 0.0, "step": 2.0, "unit": "", "bytes": 407040.0, "count": 1.0, "time_us": 5.0},
                 {"rank": 1.0, "step": 2.0, "unit": "layers.0", "bytes": 0.5, "count": 2.0, "time_us": 7.0}]}
    tabs = summary_tables(doc)
    assert set(tabs) == {"whatif.predictions", "comm"}
    w = table_frame(tabs["whatif.predictions"])
    assert list(w["breakdown.param"]) == [14642688, 3] and str(w["breakdown.param"].dtype) == "Int64"
    assert list(w["kept"]) == ["a; b", ""] and pd.isna(w.loc[1, "peak_allocated_bytes"])
    assert w["step_us"].dtype == float                                          # times stay times
    csv = w.to_csv(index=False)
    assert "14642688," in csv and "14642688.0" not in csv and "e+" not in csv
    c = table_frame(tabs["comm"])
    assert list(c["unit"]) == [model.ROOT_UNIT_TEXT, "layers.0"] and list(c["step"]) == [2, 2]
    assert c["bytes"].dtype == float            # 0.5 B (a median) is not a whole number: the column stays float


def test_report_tables_write_fragmentation_as_integers(tmp_path):
    """FlexGen's snapshot: the fragmentation table is written (it holds a list of size classes: JSON text), its
    sizes as integers."""
    out = tmp_path / "tables"
    proc = run_fsdpprof("report", str(shared_data("cuda-snapshots", "flexgen-state-only.pickle")),
                        "-o", str(tmp_path / "r.html"), "--tables", str(out))
    assert proc.returncode == 0, proc.stderr
    summary = json.loads((tmp_path / "r.summary.json").read_text())
    frag = summary["memory"]["0"]["fragmentation"]
    df = pd.read_csv(out / "memory.0.fragmentation.csv")
    assert len(df) == len(frag) and list(df["reserved_bytes"]) == [r["reserved_bytes"] for r in frag]
    text = (out / "memory.0.fragmentation.csv").read_text()
    assert not re.search(r",\d+\.0(,|$)", text, flags=re.M), text[:400]
    index = json.loads((out / "tables.json").read_text())
    assert "memory.0.fragmentation" in {t["table"] for t in index["tables"]}


def test_formula_numbers_are_written_out():
    k = theory.BytesPerParam(4.0, 4.0, 8.0)
    ms = theory.model_states(3_660_672, k, "FULL_SHARD", 2)
    assert ms.substituted == "(4 + 4 + 8) * 3,660,672 / 2"
    for m in theory.all_model_states(7.5e9, k, 8):
        assert not re.search(r"\de[+-]\d", m.substituted), m.substituted


def test_differences_are_signed_and_colours_distinct():
    html = table(pd.DataFrame({"collective": ["all_gather", "reduce_scatter"], "diff_pct": [0.0, -3.25],
                               "diff_bytes": [2.0 ** 20, -(2.0 ** 20)]}))
    assert "+0.0" in html and "-3.2" in html and "+1.00" in html and "measured - formula (%)" in html
    for a, b in (("param", "sharded_param"), ("grad", "sharded_grad"), ("param", "unsharded_param"),
                 ("grad", "unsharded_grad")):
        assert CATEGORY_COLORS[a] != CATEGORY_COLORS[b], (a, b)


def _pred(label, step_us, peak, is_run=False, contention=1.0):
    return {"label": label, "strategy": label, "step_us": step_us, "peak_allocated_bytes": peak, "is_run": is_run,
            "world_size": 2, "shard_group": 2, "compute_us": step_us / 2, "exposed_comm_us": step_us / 4,
            "rest_us": step_us / 4, "run_cpu_contention": contention, "kept": [], "assumed": [], "breakdown": {}}


def test_whatif_recommendation_rest_and_fits():
    from fsdpprof.report.whatif import whatif_body

    own = _pred("FULL_SHARD", 100e3, 40 * 2**20, is_run=True)
    faster = _pred("SHARD_GRAD_OP", 80e3, 48 * 2**20)
    close = _pred("NO_SHARD", 100e3 * (1 - MARGIN_PCT / 200), 60 * 2**20)
    assert recommend({"predictions": [own, faster]}).startswith("try SHARD_GRAD_OP: step -20% and peak +20%")
    assert recommend({"predictions": [own, close]}).startswith("keep FULL_SHARD")
    small = _pred("FULL_SHARD, 4 ranks", 105e3, 20 * 2**20)
    assert "if memory is short, FULL_SHARD, 4 ranks predicts a peak -50%" in recommend({"predictions": [own, small]})
    assert recommend({"predictions": [own, faster]}, device_memory_bytes=44 * 2**20).startswith("keep")
    assert recommend({"predictions": [faster]}) is None                     # nothing like for like to weigh against
    # an order is stated only where the step-time intervals lie apart (issue 38): overlapping ones -> no "try"
    own_iv = dict(own, step_low_us=70e3, step_high_us=140e3)
    assert recommend({"predictions": [own_iv, dict(faster, step_low_us=60e3, step_high_us=110e3)]}).startswith("keep")
    assert recommend({"predictions": [own_iv, dict(faster, step_low_us=50e3, step_high_us=69e3)]}).startswith("try")
    cpu = recommend({"predictions": [_pred("FULL_SHARD", 1e5, 2**20, True, 1.9), faster]})
    assert "contended x1.90" in cpu
    result = {"predictions": [own, faster], "measured": {"peak_allocated_bytes": 40 * 2**20, "step_us": 1.1e5},
              "fits": {"0": ["all-gather: 6 µs + wire bytes / 0.23 GB/s (36 collectives)"]}}
    result["recommendation"] = recommend(result)
    text = _text(whatif_body(result, Page(None)))
    assert "Recommendation: try SHARD_GRAD_OP" in text and "rest: the predicted step's time" in text
    assert "all-gather: 6 µs + wire bytes / 0.23 GB/s" in text
    # one unit per column: the header names it, the cells are bare numbers
    assert "predicted peak (MiB)" in text and "step time (ms)" in text and " MiB |" not in text.split("rest (ms)")[1][:200]


def test_overlap_prints_the_reports_units(tmp_path):
    proc = run_fsdpprof("overlap", str(shared_data(*A100_2)))
    assert proc.returncode == 0, proc.stderr
    sizes = re.findall(r"\s(\d[\d.,]* (?:[KMG]i?B|B))\s", proc.stdout)
    assert sizes and all(s.endswith(("KiB", "MiB", "GiB", " B")) for s in sizes), sizes


def test_compare_diff_tables_one_unit_per_column():
    from fsdpprof.report.diff import _comm_html

    c = pd.DataFrame({"collective": ["all_gather", "reduce_scatter"], "stage": ["forward", "backward"],
                      "fsdp_phase": ["all_gather", "reduce_scatter"], "unit": ["layers.0", ""],
                      "baseline_count": [1.0, 0.0], "run_count": [1.0, 1.0],
                      "baseline_bytes": [2.0 ** 21, 0.0], "run_bytes": [np.nan, 400 * 2.0 ** 10],
                      "baseline_comm_us": [24_200.0, 0.0], "run_comm_us": [599.0, 575.0],
                      "diff_comm_us": [-23_601.0, 575.0], "baseline_exposed_comm_us": [0.0, 0.0],
                      "run_exposed_comm_us": [599.0, 0.0], "diff_exposed_comm_us": [599.0, 0.0]})
    html = _comm_html(c)
    heads = re.findall(r"<th[^>]*>([^<]*)</th>", html)
    assert {"size (base) (MiB)", "size (run) (KiB)", "comm time (base) (ms)", "change (ms)"} <= set(heads)
    cells = re.findall(r"<td[^>]*>([^<]*)</td>", html)
    assert "unknown" in cells and "400" in cells and "-23.6" in cells and "+0.575" in cells and "24.2" in cells
    assert not any(re.search(r"\d\s*(ms|µs|MiB|KiB|B)$", x) for x in cells), cells


@pytest.mark.slow
def test_recorded_run_tables_hold_the_whatif_predictions(recorded_run, tmp_path):
    """A recorded FSDP2 run: --tables writes the what-if predictions (nested breakdown as columns, bytes as
    integers) and names the root unit in the per-unit communication table."""
    out = tmp_path / "tables"
    proc = run_fsdpprof("report", str(recorded_run("fsdp2")), "-o", str(tmp_path / "r.html"), "--tables", str(out))
    assert proc.returncode == 0, proc.stderr
    summary = json.loads((tmp_path / "r.summary.json").read_text())
    preds = summary["whatif"]["predictions"]
    w = pd.read_csv(out / "whatif.predictions.csv")
    assert list(w["strategy"]) == [p["strategy"] for p in preds]
    assert list(w["breakdown.optimizer_state"]) == [p["breakdown"]["optimizer_state"] for p in preds]
    assert w["peak_allocated_bytes"].dtype.kind == "i" and w["breakdown.optimizer_state"].dtype.kind == "i"
    cu = pd.read_csv(out / "comm_unit_step.csv")
    assert model.ROOT_UNIT_TEXT in set(cu["unit"]) and cu["bytes"].dtype.kind == "i" and cu["step"].dtype.kind == "i"
