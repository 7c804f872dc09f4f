"""The event model: every device kernel labelled from the CPU op that launched it (step, stage, FSDP
phase, unit, collective type), its execution interval kept for overlap; one vocabulary for events and
memory; inputs recognised as what they are.  Hand-built traces with a lagging GPU, then the real ones."""
from __future__ import annotations

import json

import numpy as np
import pandas as pd
import pytest

from conftest import shared_data
from fsdpprof.analyze import model
from fsdpprof.analyze.comm import skew
from fsdpprof.analyze.memory import categorize as cz
from fsdpprof.analyze.pipeline import analyze_run
from fsdpprof.analyze.load.run import load_run, run_events
from fsdpprof.analyze.trace import load_trace, labels


class Trace:
    """A kineto-style trace built by hand: CPU ops on thread 1, kernels launched through cudaLaunchKernel."""

    def __init__(self, rank: int = 0, world: int = 2, runtime: str = "cudaLaunchKernel", dist: bool = True,
                 kernel_cat: str = "kernel", runtime_cat: str = "cuda_runtime"):
        self.ev: list[dict] = []
        self.rank, self.world, self.runtime, self.dist = rank, world, runtime, dist
        self.kernel_cat, self.runtime_cat = kernel_cat, runtime_cat
        self.corr = 100

    def cpu(self, name: str, ts: float, dur: float, cat: str = "cpu_op", **args) -> "Trace":
        e = {"ph": "X", "cat": cat, "name": name, "pid": 1, "tid": 1, "ts": ts, "dur": dur}
        if args:
            e["args"] = args
        self.ev.append(e)
        return self

    def kernel(self, name: str, launch: float | None, start: float, dur: float, stream: int = 7, **args) -> "Trace":
        """A kernel launched at CPU time ``launch`` (None: the launch is not in the trace) running at ``start``."""
        self.corr += 1
        if launch is not None:
            self.ev.append({"ph": "X", "cat": self.runtime_cat, "name": self.runtime, "pid": 1, "tid": 1, "ts": launch,
                            "dur": 0.5, "args": {"correlation": self.corr}})
        self.ev.append({"ph": "X", "cat": self.kernel_cat, "name": name, "pid": 0, "tid": stream, "ts": start,
                        "dur": dur, "args": {"stream": stream, "correlation": self.corr, "device": 0, **args}})
        return self

    def write(self, path) -> str:
        doc = {"schemaVersion": 1, "traceEvents": self.ev}
        if self.dist:
            doc["distributedInfo"] = {"backend": "nccl", "rank": self.rank, "world_size": self.world}
        path.write_text(json.dumps(doc))
        return str(path)


def _lagging_step(t: Trace) -> Trace:
    """Step 1 on the CPU: [0, 100); forward from 1, backward from 40, optimizer [70, 90).  The GPU lags:
    what the CPU launched in forward runs during the CPU's optimizer, the backward all-reduce after the step."""
    t.cpu("ProfilerStep#1", 0, 100, cat="user_annotation")
    t.cpu("FSDP::root_pre_forward", 1, 1, cat="user_annotation")
    t.cpu("FSDP::all_gather (layers.0)", 2, 6, cat="user_annotation")
    t.cpu("nccl:_all_gather_base", 3, 2, cat="cpu_op")
    t.cpu("autograd::engine::evaluate_function: MmBackward0", 40, 20)
    t.cpu("FSDP::post_backward_reduce (layers.0)", 45, 10, cat="user_annotation")
    t.cpu("nccl:_reduce_scatter_base", 46, 3)
    t.cpu("Optimizer.step#AdamW.step", 70, 20, cat="user_annotation")
    # an NCCL SendRecv kernel that runs the all-gather (NCCL does this for some sizes / versions)
    t.kernel("ncclKernel_SendRecv_RING_SIMPLE_Sum_int8_t(ncclDevComm*, unsigned long, ncclWork*)", 4, 75, 10,
             stream=20)
    t.kernel("void gemm_kernel", 10, 72, 8)
    t.kernel("recat_copy_async_kernel", 11, 81, 3)          # "async" is compute (HTA counts it so)
    t.kernel("ncclDevKernel_ReduceScatter_Sum_f32_RING_LL", 47, 105, 20, stream=20)   # after the step ended
    t.kernel("void adam_kernel", 75, 130, 5)
    t.kernel("void orphan_kernel", None, 1, 2)               # launched before the trace window
    return t


def test_lagging_gpu_kernels_take_their_labels_from_the_launch(tmp_path):
    ev = load_trace(_lagging_step(Trace()).write(tmp_path / "rank-0.json")).events
    k = ev[ev["lane"].astype(str).str.startswith("stream:")]
    k = k.set_index(k["name"].astype(str).str.slice(0, 24))
    ag = k.loc["ncclKernel_SendRecv_RING"]
    # runs during the CPU's optimizer, launched in forward inside nccl:_all_gather_base and FSDP::all_gather
    assert ag["stage"] == "forward" and ag["collective"] == "all_gather"
    assert ag["fsdp_phase"] == "all_gather" and ag["unit"] == "layers.0" and ag["step"] == 1
    assert ag["ts_us"] == 75 and ag["dur_us"] == 10                      # execution interval kept
    rs = k.loc["ncclDevKernel_ReduceScat"]
    assert rs["stage"] == "backward" and rs["step"] == 1 and rs["collective"] == "reduce_scatter"
    assert rs["fsdp_phase"] == "post_backward_reduce" and rs["unit"] == "layers.0"
    assert k.loc["void adam_kernel", "stage"] == "optimizer"
    assert k.loc["void gemm_kernel", "stage"] == "forward"
    assert k.loc["recat_copy_async_kernel", "kind"] == "compute"
    orphan = k.loc["void orphan_kernel"]
    assert orphan["stage"] == "unknown" and np.isnan(orphan["step"])


def test_lagging_gpu_findings_name_the_launch_stage(tmp_path):
    t = _lagging_step(Trace())
    path = t.write(tmp_path / "rank-0.json")
    a = analyze_run(load_run(path))
    cp = a.comm_phase.set_index("collective")
    assert cp.loc["reduce_scatter", "stage"] == "backward" and cp.loc["all_gather", "stage"] == "forward"
    assert a.overview["unknown_launch_kernels"] == 1 and "launched before the trace window" in a.notes["communication"]
    for f in a.findings:
        assert "optimizer" not in f.title, f.title            # nothing was launched by the optimizer but Adam
        assert f.value <= 100 or f.unit != "%", f.title
    cu = a.comm_unit_step
    assert set(cu["unit"].dropna()) == {"layers.0"} and (cu["step"] == 1).all()


def test_collective_type_from_the_launching_op_and_kernel_name_fallback(tmp_path):
    t = Trace()
    t.cpu("ProfilerStep#1", 0, 100, cat="user_annotation")
    t.cpu("nccl:all_to_all", 5, 5)
    t.kernel("ncclKernel_SendRecv_RING_SIMPLE_Sum_int8_t(x)", 6, 20, 5, stream=20)
    t.cpu("nccl:send", 30, 2)
    t.kernel("ncclKernel_SendRecv_RING_SIMPLE_Sum_int8_t(x)", 31, 40, 5, stream=21)
    t.kernel("ncclDevKernel_Generic(ncclDevKernelArgs)", 50, 60, 5, stream=20)      # RCCL, no args, no op
    t.kernel("ncclDevKernel_Generic(ncclDevKernelArgs)", None, 70, 5, stream=20)    # launched before the window
    t.kernel("ncclDevKernel_AllGather_RING_LL(x)", None, 80, 5, stream=20)           # ... its name says the type
    ev = load_trace(t.write(tmp_path / "rank-0.json")).events
    c = ev[ev["kind"] == "comm"].sort_values("ts_us")["collective"].astype(str).tolist()
    # a kernel's name is never a collective type (it was "ncclDevKernel_Generic" in the volume table)
    assert c == ["all_to_all", "send_recv", model.UNKNOWN_COLLECTIVE, model.UNKNOWN_COLLECTIVE, "all_gather"]


def test_kernels_launched_inside_a_collective_op_are_its_communication(tmp_path):
    """Whatever the kernel is called: symmetric-memory and custom all-reduces are communication, typed (and
    sized) from the op that launched them; a tensor op nested in a collective keeps its kernel compute."""
    bf16 = {"Input Dims": [[1024]], "Input type": ["c10::BFloat16"]}
    t = Trace()
    t.cpu("ProfilerStep#1", 0, 300, cat="user_annotation")
    t.cpu("vllm::all_reduce", 10, 20, **bf16)
    t.cpu("aten::copy_", 11, 2)
    t.kernel("void at::native::elementwise_kernel<copy>", 12, 100, 2)                 # the copy into the buffer
    t.cpu("symm_mem::multimem_all_reduce_", 14, 6, **bf16, **{"External id": 7})
    t.kernel("void (anonymous namespace)::multimem_all_reduce_kernel<c10::BFloat16, 16>(c10::BFloat16*)", 15,
             110, 20, **{"External id": 7})
    t.cpu("_C_custom_ar::all_reduce", 40, 5)
    t.kernel("void vllm::cross_device_reduce_1stage<__nv_bfloat16, 8>(x)", 41, 140, 10)
    t.cpu("aten::broadcast_tensors", 50, 3)                                          # not a collective
    t.kernel("void broadcast_kernel", 51, 160, 5)
    t.cpu("c10d::allgather_", 60, 20)
    t.cpu("nccl:all_gather", 61, 3, cat="user_annotation")
    t.kernel("ncclDevKernel_AllGather_RING_LL(x)", 62, 170, 5, stream=20)
    t.cpu("aten::copy_", 70, 3)                                                     # c10d's copy-out of the list
    t.kernel("void at::native::elementwise_kernel<copy>", 71, 180, 2, stream=20)
    t.kernel("void (anonymous namespace)::multimem_all_reduce_kernel<c10::BFloat16, 16>(c10::BFloat16*)", None,
             190, 5)                                                                  # no launch: its name alone
    ev = load_trace(t.write(tmp_path / "rank-0.json")).events.sort_values("ts_us")
    k = ev[ev["lane"].astype(str).str.startswith("stream:")]
    got = list(zip(k["kind"].astype(str), k["collective"].astype(object).where(k["collective"].notna(), None)))
    assert got == [("compute", None), ("comm", "all_reduce"), ("comm", "all_reduce"), ("compute", None),
                   ("comm", "all_gather"), ("compute", None), ("compute", None)]
    multimem = k.iloc[1]
    assert multimem["bytes"] == 2048 and multimem["dtype"] == "bfloat16"              # the op's 1024 bf16
    assert model.is_collective_op("vllm::all_reduce") and model.is_collective_op("trtllm::allreduce")
    assert model.is_collective_op("symm_mem::one_shot_all_reduce")
    assert not model.is_collective_op("aten::broadcast_tensors") and not model.is_collective_op("vllm::moe_forward")
    assert not model.is_collective_op("## all2all_data:kjt splits ##")


def test_symmetric_memory_all_reduce_on_b200_is_communication():
    """tracelens-b200: the 73 multimem_all_reduce_kernel launches under vllm::all_reduce (symm_mem) were counted
    as compute ("exposed communication 0.0 %")."""
    a = analyze_run(load_run(str(shared_data("gpu-traces", "tracelens-b200-8rank")), lazy=True))
    v = a.volume.set_index("collective")
    assert v.loc["all_reduce", "count"] == 73 and v.loc["all_gather", "count"] == 1
    assert v.loc["all_reduce", "bytes"] > 0
    assert float(a.overlap_overall["exposed_comm_us"].sum()) > 0
    assert set(a.comm_phase["collective"]) <= set(model.COLLECTIVES)


def test_point_to_point_stays_out_of_skew_and_stragglers(tmp_path):
    paths = []
    for r in range(2):
        t = Trace(rank=r)
        t.cpu("ProfilerStep#1", 0, 100, cat="user_annotation")
        t.cpu("nccl:all_reduce", 5, 2)
        t.kernel("ncclDevKernel_AllReduce_Sum_f32_RING_LL", 6, 10 + r, 5, stream=20, Seq=1)
        t.cpu("nccl:send" if r == 0 else "nccl:recv", 20, 2)
        t.kernel("ncclKernel_SendRecv_RING_SIMPLE_Sum_int8_t(x)", 21, 30 + 40 * r, 5, stream=21)  # 40 us apart
        paths.append(t.write(tmp_path / f"rank-{r}.json"))
    run = load_run(str(tmp_path))
    rec = skew.collective_records(run_events(run))
    assert set(rec["collective"]) == {"all_reduce"}
    a = analyze_run(run)
    assert len(a.skew) == 1 and a.skew.iloc[0]["start_skew_us"] < 5
    assert set(a.p2p["collective"]) == {"send_recv"}


def test_comm_outside_every_step_is_not_divided_by_a_step(tmp_path):
    t = Trace()
    t.cpu("ProfilerStep#1", 0, 100, cat="user_annotation")
    t.cpu("ProfilerStep#2", 100, 100, cat="user_annotation")
    t.kernel("void gemm_kernel", 10, 10, 80)
    t.kernel("void gemm_kernel", 110, 110, 80)
    t.cpu("nccl:all_reduce", 300, 2)                                  # a barrier after the window, say
    t.kernel("ncclDevKernel_AllReduce_Sum_f32_RING_LL", 301, 310, 900, stream=20)
    a = analyze_run(load_run(t.write(tmp_path / "rank-0.json")))
    out = a.comm_outside_steps
    assert len(out) == 1 and out.iloc[0]["collective"] == "all_reduce" and out.iloc[0]["comm_us"] == 900
    assert all(f.value <= 100 for f in a.findings if f.unit == "%")
    assert not any("all_reduce" in f.title for f in a.findings)


def test_device_type_from_the_trace(tmp_path):
    rocm = Trace(runtime="hipLaunchKernel")
    rocm.cpu("ProfilerStep#1", 0, 100, cat="user_annotation")
    rocm.kernel("Cijk_Ailk_Bljk_HHS_BH", 5, 10, 20)
    assert load_trace(rocm.write(tmp_path / "rocm.json")).meta["device_type"] == "rocm"
    mtia = Trace(runtime="mtiaLaunch", kernel_cat="mtia_ccp_events", runtime_cat="mtia_runtime")
    mtia.cpu("ProfilerStep#1", 0, 100, cat="user_annotation")
    mtia.cpu("aten::mm", 4, 3)
    mtia.kernel("mtia_gemm", 5, 10, 20)
    td = load_trace(mtia.write(tmp_path / "mtia.json"))
    assert td.meta["device_type"] == "mtia"
    ev = td.events
    # device kernels are the compute; the CPU op that launched one is not
    assert ev.loc[ev["name"] == "mtia_gemm", "kind"].tolist() == ["compute"]
    assert ev.loc[ev["name"] == "aten::mm", "kind"].tolist() == ["cpu_op"]


def test_rank_from_distributed_info_then_explicit_name_then_position(tmp_path):
    d = tmp_path / "traces"
    d.mkdir()
    for name in ("trace_1016005.json", "worker3.pt.trace.json", "zz_trace.json"):
        t = Trace(dist=False)
        t.cpu("ProfilerStep#1", 0, 10, cat="user_annotation")
        t.kernel("void k", 1, 2, 3)
        t.write(d / name)
    run = load_run(str(d))
    by_file = {rd.label: r for r, rd in run.ranks.items()}
    assert by_file["worker3.pt.trace.json"] == 3              # explicit pattern
    assert by_file["trace_1016005.json"] == 0                 # a number is not a rank: its position, warned
    assert by_file["zz_trace.json"] == 2
    assert sum("taken from its position" in w for w in run.warnings) == 2
    a = analyze_run(run)
    assert a.overview["ranks_analysed"] == 3


def test_one_fsdp_parser_for_events_and_memory():
    assert model.parse_fsdp("FullyShardedDataParallel._pre_backward_hook") == ("pre_backward", None, "fsdp1")
    assert model.parse_fsdp("FullyShardedDataParallel._post_backward_hook_reshard_only")[0] == \
        "post_backward_reshard_only"
    assert model.parse_fsdp("FSDP::backward_prefetch for layers.1") == ("backward_prefetch", "layers.1", "fsdp2")
    assert model.parse_fsdp("FSDP::pre_forward") == ("pre_forward", "", "fsdp2")            # the root unit
    assert model.parse_fsdp("FSDP::root_pre_forward") == ("root_pre_forward", None, "fsdp2")
    assert model.parse_fsdp("aten::mm") == (None, None, None)
    # the memory side reads the same annotations through the same parser
    events = pd.DataFrame({"name": pd.Categorical(["FullyShardedDataParallel._pre_backward_hook",
                                                   "FSDP::backward_prefetch for layers.1"]),
                           "ts_us": [0.0, 10.0], "dur_us": [5.0, 5.0], "lane": pd.Categorical(["thread:1"] * 2)})
    iv = labels.fsdp_intervals(events)
    assert iv["fsdp_phase"].tolist() == ["pre_backward", "backward_prefetch"]
    assert pd.isna(iv["unit"].iloc[0]) and iv["unit"].iloc[1] == "layers.1"


def test_stage_at_step_marks():
    marks = pd.DataFrame({"step": [1.0, 2.0], "start_us": [0.0, 100.0], "end_us": [100.0, 200.0],
                          "fwd_us": [10.0, np.nan], "bwd_us": [40.0, 140.0], "opt_us": [70.0, np.nan],
                          "opt_end_us": [80.0, np.nan]})
    ts = np.array([-5, 5, 10, 39, 40, 69, 70, 80, 85, 100, 139, 150, 250.0])
    assert model.stage_at(ts, marks).tolist() == [
        "outside_step", "data", "forward", "forward", "backward", "backward", "optimizer", "optimizer", "post_step",
        "forward", "forward", "backward", "outside_step"]
    # step 1's forward ends at 30 (a whole-forward marker): a collective launched after it and before the
    # backward is input distribution (data); anything else there (the loss) stays forward
    marks["fwd_end_us"] = [30.0, np.nan]
    ts = np.array([20, 35, 35, 45, 120, 125.0])
    coll = np.array([True, True, False, True, True, False])
    assert model.stage_at(ts, marks, coll).tolist() == ["forward", "data", "forward", "backward", "forward",
                                                        "forward"]
    assert model.stage_at(ts, marks).tolist() == ["forward", "forward", "forward", "backward", "forward", "forward"]


def test_forward_marker_and_input_distribution_from_the_trace(tmp_path):
    """``## forward ##`` starts a forward like ``## backward ##`` starts a backward; the all-to-all launched
    after the forward and before the backward is data."""
    t = Trace()
    t.cpu("ProfilerStep#1", 0, 200, cat="user_annotation")
    t.cpu("## forward ##", 10, 40, cat="user_annotation")
    t.cpu("nccl:all_to_all", 20, 2, cat="user_annotation")
    t.kernel("ncclKernel_SendRecv_RING_SIMPLE_Sum_int8_t(x)", 21, 30, 5, stream=20)
    t.kernel("void loss_kernel", 55, 60, 5)                                              # after forward: the loss
    t.cpu("## sparse_data_dist ##", 60, 20, cat="user_annotation")
    t.cpu("nccl:all_to_all", 65, 2, cat="user_annotation")
    t.kernel("ncclKernel_SendRecv_RING_SIMPLE_Sum_int8_t(x)", 66, 70, 5, stream=20)
    t.cpu("## backward ##", 90, 50, cat="user_annotation")
    t.cpu("nccl:all_reduce", 100, 2, cat="user_annotation")
    t.kernel("ncclKernel_AllReduce_RING_LL_Sum_float(x)", 101, 110, 5, stream=20)
    ev = load_trace(t.write(tmp_path / "rank-0.json")).events
    k = ev[ev["lane"].astype(str).str.startswith("stream:")].sort_values("ts_us")
    assert k["stage"].astype(str).tolist() == ["forward", "forward", "data", "backward"]
    marks = labels.step_marks(ev)
    assert marks[["fwd_us", "fwd_end_us", "bwd_us"]].iloc[0].tolist() == [10.0, 50.0, 90.0]


def test_dlrm_sparse_data_distribution_is_data():
    """param-dlrm: TorchRec's sparse data distribution (## sparse_data_dist ##, three all-to-alls launched
    after ## forward ## ends and before ## backward ##) is data; the forward's all-to-all stays forward."""
    for r in (0, 5):
        ev = load_trace(str(shared_data("gpu-traces", "param-dlrm-8rank-v100", f"rank-{r}.json.gz"))).events
        marks = labels.step_marks(ev)
        fwd = ev[ev["name"].astype(str) == "## forward ##"]
        assert marks["fwd_us"].iloc[0] == fwd["ts_us"].min()
        assert marks["fwd_end_us"].iloc[0] == (fwd["ts_us"] + fwd["dur_us"]).max()
        c = ev[(ev["kind"] == "comm") & (ev["stage"] != "unknown")]
        by_stage = c.groupby("stage", observed=True)["collective"].agg(list).to_dict()
        assert by_stage["data"] == ["all_to_all"] * 3
        assert by_stage["forward"] == ["all_to_all"]
        assert sorted(by_stage["backward"]) == ["all_reduce"] * 3 + ["all_to_all"]
        launch = c.loc[c["stage"] == "data", "launch_ts_us"]
        assert (launch > marks["fwd_end_us"].iloc[0]).all() and (launch < marks["bwd_us"].iloc[0]).all()


# --------------------------------------------------------------------------- attribution passes
def _allocs(**cols) -> pd.DataFrame:
    n = len(next(iter(cols.values())))
    base = {"addr": np.arange(n, dtype=np.int64) * 4096, "alloc_us": np.arange(n, dtype=float),
            "free_us": np.full(n, np.nan), "stage": [None] * n, "free_stage": [None] * n, "fsdp_phase": [None] * n,
            "free_fsdp_phase": [None] * n, "unit": [None] * n, "step_idx": np.zeros(n, int),
            "free_step_idx": np.full(n, 1 << 30), "frame_sig": pd.Categorical([""] * n)}
    base.update(cols)
    return pd.DataFrame(base)


def test_attribution_passes_fill_only_what_is_open():
    inv = pd.DataFrame({"addr": [0], "category": ["optimizer_state"], "ref_us": [0.5], "unit": ["layers.0"],
                        "name": ["exp_avg"]})
    df = _allocs(stage=["optimizer", "forward", "forward", "backward", "forward", "data"],
                 free_stage=[None, "backward", "forward", "optimizer", None, "forward"],
                 free_us=[np.nan, 9.0, 3.0, 8.0, np.nan, 7.0],
                 free_step_idx=[1 << 30, 0, 0, 0, 1 << 30, 0],
                 fsdp_phase=["all_gather", None, None, None, "all_gather", None])
    cat, src = cz.label_columns(df, inv_tensors=inv)
    # 0: the inventory wins over the FSDP tag; 1: forward -> backward is an activation; 2: freed in its own
    # stage is a temporary; 3: backward -> optimizer is a gradient; 4: the all-gather output; 5: input data
    assert cat.tolist() == ["optimizer_state", "activation", "temporary", "sharded_grad", "unsharded_param", "input"]
    assert src.tolist() == ["inventory", "lifetime", "lifetime", "lifetime", "tags", "lifetime"]


# --------------------------------------------------------------------------- the real GPU traces
def test_real_sendrecv_kernels_take_the_type_of_the_op_that_launched_them():
    ev = run_events(load_run(str(shared_data("gpu-traces", "hta-16rank-a100"))))
    c = ev[ev["kind"] == "comm"]
    launched = c[c["stage"] != "unknown"]
    # every SendRecv kernel with its launch in the trace was launched by an all_to_all, all_reduce,
    # all_gather or reduce_scatter op: none of them is point-to-point
    assert len(launched) >= 70 and not launched["collective"].isin(model.P2P).any()
    assert set(launched["collective"]) == {"all_to_all", "all_reduce", "all_gather", "reduce_scatter"}
    # DDP's all-reduce is launched in backward (the report used to stage it 'optimizer' from its execution)
    assert set(launched.loc[launched["collective"] == "all_reduce", "stage"]) == {"backward"}
    assert not c["collective"].isna().any() and "?" not in set(c["collective"].astype(str))


@pytest.mark.parametrize("rel", ["hta-16rank-a100", "hta-nccl-2rank-a100", "tracelens-b200-8rank",
                                 "param-dlrm-8rank-v100"])
def test_real_traces_are_recognised_and_stay_within_bounds(rel):
    a = analyze_run(load_run(str(shared_data("gpu-traces", rel)), lazy=True))
    o = a.overview
    assert o["device_type"] == "cuda" and o["input_kind"] in ("ddp", "distributed")
    assert o["ranks_analysed"] == len(a.overview["ranks_present"]) >= 1
    for f in a.findings:
        assert not (f.unit == "%" and f.value > 100), f.title
        assert "FSDP" not in f.suggestion and "reshard" not in f.suggestion, f.suggestion    # not an FSDP input
    for df in (a.comm_phase, a.comm_unit_step):
        assert (df["overlap_pct"].dropna() <= 100 + 1e-9).all()
        assert (df["exposed_comm_us"] >= -1e-6).all()
    assert not any(c in ("?", "nan") for c in a.comm_phase["collective"].astype(str))


def _as_pd_concat(frames: list[pd.DataFrame]) -> pd.DataFrame:
    """What pandas gives: pd.concat, then the categorical columns back to categories (sorted union)."""
    ref = pd.concat(frames, ignore_index=True)
    for c in model.CATEGORICAL_EVENT_COLUMNS:
        if not isinstance(ref[c].dtype, pd.CategoricalDtype):
            ref[c] = ref[c].astype("category")
    return ref


def test_concat_events_is_pd_concat_with_categories_kept():
    """run_events(run) joins the ranks' frames without per-row objects: equal to pd.concat + astype("category"), on
    8 real ranks (names and lanes differ per rank) and on frames whose categories are unused, empty or None."""
    run = load_run(str(shared_data("gpu-traces", "param-dlrm-8rank-v100")), progress=False)
    frames = [rd.events for _, rd in sorted(run.ranks.items())]
    assert len({tuple(f["name"].cat.categories) for f in frames}) > 1          # (the remapping path is taken)
    pd.testing.assert_frame_equal(labels.concat_events(frames), _as_pd_concat(frames))
    a, b = frames[0].head(50).copy(), frames[1].head(30).copy()
    a["name"] = a["name"].cat.add_categories(["never used"])                   # a category no row uses
    b["unit"] = pd.Categorical([None] * len(b))                                 # only missing values
    b["pg"] = b["pg"].cat.set_categories(["zz", "0", "a"])                     # another order, some unused
    got = labels.concat_events([a, b])
    assert "never used" not in set(got["name"].cat.categories)
    pd.testing.assert_frame_equal(got.astype({"name": object, "pg": object, "unit": object}),
                                  _as_pd_concat([a, b]).astype({"name": object, "pg": object, "unit": object}))
    assert list(got["pg"].cat.categories) == sorted(set(got["pg"].dropna()))
