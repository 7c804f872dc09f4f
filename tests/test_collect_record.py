"""`fsdpprof record` on the real example under every strategy (torchrun + gloo, shared recordings).

The expected numbers come from the model itself (the example's TinyTransformer built here with
the same sizes), not from earlier recordings: Psi, parameter names, and per-unit shard sizes.
"""
from __future__ import annotations

import gzip
import json
import os

import pytest

from conftest import OFFLOAD_BF16, OFFLOAD_BF16_SIZES
from fsdpprof import runfmt

# (strategy, nproc, train_args, framework, strategy name, shard group, replicate group)
CASES = [
    ("fsdp2", 2, (), "fsdp2", "FULL_SHARD", 2, 1),
    ("fsdp2-no-reshard", 2, (), "fsdp2", "SHARD_GRAD_OP", 2, 1),
    ("fsdp1-full", 2, (), "fsdp1", "FULL_SHARD", 2, 1),
    ("fsdp1-grad-op", 2, (), "fsdp1", "SHARD_GRAD_OP", 2, 1),
    ("fsdp1-no-shard", 2, (), "fsdp1", "NO_SHARD", 1, 2),
    ("ddp", 2, (), "ddp", "DDP", 1, 2),
    ("none", 2, (), "none", "NONE", 1, 1),
    ("hsdp", 4, (), "fsdp2", "HYBRID_SHARD", 2, 2),
    ("fsdp1-hybrid", 4, (), "fsdp1", "HYBRID_SHARD", 2, 2),
]
# window passed by conftest: skip 1, warmup 1, active 2 -> optimizer steps 2 and 3 recorded
ACTIVE_STEPS = [2, 3]


def model_params(**sizes) -> dict[str, int]:
    from fsdpprof.examples.train_fsdp import TinyTransformer    # (torch: imported where it runs, not to collect)

    kw = dict(vocab=1024, dim=256, layers=4, heads=4, seq=64)
    kw.update(sizes)
    return {name: p.numel() for name, p in TinyTransformer(**kw).named_parameters()}


def unit_of(name: str) -> str:
    parts = name.split(".")
    return ".".join(parts[:2]) if parts[0] == "layers" else ""


def load_trace(path) -> dict:
    with gzip.open(path, "rt") as fh:
        return json.load(fh)


def check_cpu_load(cpu: dict, trace: dict, nproc: int) -> None:
    """rank.json "cpu": this host's cores and ranks, and the process's times over exactly the active steps
    (the window is the ProfilerStep#s' span, within 10 %: it is read at the same optimizer step hooks)."""
    assert cpu["usable_cores"] == len(os.sched_getaffinity(0)) and cpu["cpu_count"] == os.cpu_count()
    assert cpu["local_world_size"] == nproc and cpu["torch_threads"] >= 1
    steps = [e for e in trace["traceEvents"] if str(e.get("name", "")).startswith("ProfilerStep#")]
    span_us = max(e["ts"] + e["dur"] for e in steps) - min(e["ts"] for e in steps)
    assert cpu["wall_us"] == pytest.approx(span_us, rel=0.1)
    assert (cpu["end_unix_ns"] - cpu["start_unix_ns"]) / 1e3 == pytest.approx(cpu["wall_us"], rel=0.05, abs=2e3)
    # on a CPU and waiting for one (schedstat, the threads alive at the end): the process ran, and no thread ran
    # longer than the window; the process's CPU time (process_time: every thread, ended ones too) is no less
    assert 0 < cpu["run_us"] <= cpu["threads"] * cpu["wall_us"] and cpu["runqueue_us"] >= 0 and cpu["threads"] >= 1
    assert cpu["cpu_us"] >= 0.95 * cpu["run_us"]
    # the training thread's share: one of the threads, so no more than the process's and no longer than the window
    assert 0 < cpu["training_run_us"] <= min(cpu["run_us"], cpu["wall_us"])
    assert 0 <= cpu["training_runqueue_us"] <= cpu["runqueue_us"]


def check_run_dir(run, nproc: int) -> dict[int, dict]:
    meta = json.loads((run / "run.json").read_text())
    assert meta["schema"] == "fsdpprof.run/1"
    assert meta["status"] == "complete", meta
    assert meta["exit_code"] == 0 and meta["ranks_expected"] == nproc and meta["ranks_seen"] == list(range(nproc))
    assert len(list((run / "launchers").glob("*.json"))) == 1
    invs = {}
    for r in range(nproc):
        rd = run / f"rank-{r}"
        info = json.loads((rd / "rank.json").read_text())
        assert info["status"] == "complete" and info["error"] is None, info
        assert info["rank"] == r and info["world_size"] == nproc
        assert info["steps_recorded"] == ACTIVE_STEPS and info["profiler_steps"] == ACTIVE_STEPS
        assert set(info["files"]) >= {"trace.json.gz", "inventory.json", "collector.log"}
        assert (rd / "collector.log").stat().st_size > 0
        trace = load_trace(rd / "trace.json.gz")
        names = {e.get("name") for e in trace["traceEvents"]}
        assert {f"ProfilerStep#{s}" for s in ACTIVE_STEPS} <= names
        assert "ProfilerStep#1" not in names  # warm-up step not recorded
        assert any(e.get("name") == "[memory]" for e in trace["traceEvents"])  # profile_memory on
        assert any(e.get("args", {}).get("Input Dims") is not None for e in trace["traceEvents"])  # record_shapes
        # clock anchor: trace ts + baseTimeNanoseconds/1000 is wall-clock microseconds
        anchor = info["clock_anchor"]
        assert anchor["profiler_us"] * 1000 + trace["baseTimeNanoseconds"] == pytest.approx(anchor["wall_ns"], abs=1e4)
        assert not [p for p in rd.iterdir() if p.name.startswith(".")]  # no temporary files left
        check_cpu_load(info["cpu"], trace, nproc)
        invs[r] = json.loads((rd / "inventory.json").read_text())
    return invs


def check_adam_and_grads(inv: dict) -> None:
    t = inv["tensors"]
    params = [x for x in t if x["role"] == "param"]
    local_param_bytes = sum(x["bytes"] for x in params)
    assert inv["totals"]["param_bytes"] == local_param_bytes > 0
    for step in ACTIVE_STEPS:  # grads captured before every active optimizer step, fp32 like the params
        grads = [x for x in t if x["role"] == "grad" and x["step"] == step]
        assert {x["name"] for x in grads} == {x["name"] for x in params}
        assert sum(x["bytes"] for x in grads) == local_param_bytes
    state = [x for x in t if x["role"] == "optimizer_state"]
    assert {x["step"] for x in state} == {ACTIVE_STEPS[-1]} and {x["captured_at"] for x in state} == {"after_step"}
    moments = [x for x in state if x["name"].split("/")[-1] in ("exp_avg", "exp_avg_sq")]
    steps = [x for x in state if x["name"].endswith("/step")]
    assert sum(x["bytes"] for x in moments) == 2 * local_param_bytes  # Adam: 2 x local fp32 params
    assert len(steps) == len(params) and all(x["numel"] == 1 for x in steps)
    assert inv["totals"]["optimizer_state_bytes"] == sum(x["bytes"] for x in state)
    assert inv["optimizer"]["class"] == "AdamW" and {"exp_avg", "exp_avg_sq"} <= set(inv["optimizer"]["state_keys"])
    for x in t:
        assert x["device"] == "cpu" and x["storage_ptr"] > 0 and x["storage_nbytes"] >= x["bytes"]
        assert x["storage_ptr"] <= x["data_ptr"] < x["storage_ptr"] + max(x["storage_nbytes"], 1)


@pytest.mark.slow
@pytest.mark.parametrize("strategy,nproc,train_args,framework,name,shard,replicate", CASES,
                         ids=[c[0] for c in CASES])
def test_strategy_inventory_matches_model(recorded_run, strategy, nproc, train_args, framework, name, shard,
                                          replicate):
    run = recorded_run(strategy, nproc=nproc, train_args=train_args)
    invs = check_run_dir(run, nproc)
    expected = model_params()
    psi = sum(expected.values())
    for r, inv in invs.items():
        assert inv["schema"] == "fsdpprof.inventory/1" and inv["status"] == "complete"
        assert (inv["rank"], inv["world_size"]) == (r, nproc)
        assert (inv["framework"], inv["strategy"]) == (framework, name)
        assert (inv["shard_group_size"], inv["replicate_group_size"]) == (shard, replicate)
        assert inv["mixed_precision"] is None and inv["cpu_offload"] is False
        assert inv["totals"]["psi"] == psi
        assert inv["totals"]["unsharded_param_bytes"] == 4 * psi
        check_adam_and_grads(inv)
        params = [x for x in inv["tensors"] if x["role"] == "param"]
        if framework == "fsdp1":
            # one FlatParameter per unit: the root and each block
            assert sorted(u["fqn"] for u in inv["units"]) == sorted([""] + [f"layers.{i}" for i in range(4)])
            assert sorted(x["name"] for x in params) == sorted(
                ["_flat_param"] + [f"layers.{i}._flat_param" for i in range(4)])
            assert sorted(f for u in inv["units"] for f in u["param_fqns"]) == sorted(expected)
        else:
            assert {x["name"]: None for x in params}.keys() == expected.keys()
        if framework in ("fsdp1", "fsdp2"):
            for u in inv["units"]:
                want = sum(n for p, n in expected.items() if unit_of(p) == u["fqn"])
                assert u["unsharded_numel"] == want
                assert u["unsharded_bytes"] == 4 * want and u["local_bytes"] == 4 * u["local_numel"]
                if shard == 1:
                    assert u["local_numel"] == want
                elif framework == "fsdp1":  # flat shard padded to a multiple of the shard group size
                    assert 0 <= shard * u["local_numel"] - want < shard
                else:  # FSDP2 shards every parameter on dim 0: at most one row of padding per parameter
                    assert abs(shard * u["local_numel"] - want) <= shard * 1024 * len(u["param_fqns"])
            assert {x["unit"] for x in params} == {u["fqn"] for u in inv["units"]}
        if shard == 1:  # NO_SHARD, DDP, none: every rank holds everything
            assert inv["totals"]["param_bytes"] == 4 * psi
        else:
            assert inv["totals"]["param_bytes"] == pytest.approx(4 * psi / shard, rel=0.01)
    if framework == "fsdp2" and shard > 1:  # FSDP2 local shards of a shard group add up exactly
        for group in [list(range(i, i + shard)) for i in range(0, nproc, shard)]:
            for k, u in enumerate(invs[group[0]]["units"]):
                assert sum(invs[r]["units"][k]["local_numel"] for r in group) == u["unsharded_numel"]
    if replicate > 1 and shard > 1:  # replicas hold the same shard sizes
        assert [u["local_numel"] for u in invs[0]["units"]] == [u["local_numel"] for u in invs[shard]["units"]]


@pytest.mark.slow
def test_bf16_mixed_precision_and_cpu_offload(recorded_run):
    """The bf16 case: FSDP2 with a bf16 param dtype and CPU offload (pin_memory=False), the example's own
    fsdp2-offload strategy (the suite's one recording of both: conftest.OFFLOAD_BF16)."""
    run = recorded_run(*OFFLOAD_BF16)
    invs = check_run_dir(run, 2)
    expected = model_params(**OFFLOAD_BF16_SIZES)
    for inv in invs.values():
        assert inv["mixed_precision"] == {"param_dtype": "bfloat16", "reduce_dtype": "float32"}
        assert inv["cpu_offload"] is True
        assert inv["totals"]["psi"] == sum(expected.values())
        # sharded parameters stay fp32 under mixed precision
        assert {x["dtype"] for x in inv["tensors"] if x["role"] == "param"} == {"float32"}
        check_adam_and_grads(inv)


def test_example_blocks_are_units():
    from fsdpprof.examples.train_fsdp import Block, TinyTransformer

    model = TinyTransformer(1024, 256, 4, 4, 64)
    assert sum(isinstance(m, Block) for m in model.modules()) == 4
    assert 3_000_000 < sum(p.numel() for p in model.parameters()) < 5_000_000  # "a few M params"


@pytest.mark.slow
def test_ranks_no_memory_with_stack(recorded_run):
    """--ranks 1: only rank 1 records; --no-memory: no memory events; --with-stack: Python frames in the trace."""
    run = recorded_run("fsdp2", record_args=("--ranks", "1", "--no-memory", "--with-stack"))
    meta = json.loads((run / "run.json").read_text())
    assert meta["status"] == "complete" and meta["ranks_seen"] == [1] and meta["options"]["ranks"] == [1]
    assert not (run / "rank-0").exists()
    info = json.loads((run / "rank-1" / "rank.json").read_text())
    assert info["status"] == "complete"
    trace = load_trace(run / "rank-1" / "trace.json.gz")
    events = trace["traceEvents"]
    assert not any(e.get("name") == "[memory]" for e in events)
    assert any(e.get("cat") == "python_function" for e in events)
    assert json.loads((run / "rank-1" / "inventory.json").read_text())["totals"]["psi"] == sum(model_params().values())


@pytest.mark.slow
def test_traces_open_in_hta(recorded_run, tmp_path):
    """The recorded traces are torch's own chrome-trace export: HTA parses them as they are."""
    import logging
    import shutil

    hta = pytest.importorskip("hta.trace_analysis")
    run = recorded_run("fsdp2")
    for r in (0, 1):
        shutil.copy(run / f"rank-{r}" / "trace.json.gz", tmp_path / f"rank-{r}.json.gz")
    logging.disable(logging.WARNING)
    try:
        analysis = hta.TraceAnalysis(trace_dir=str(tmp_path))
    finally:
        logging.disable(logging.NOTSET)
    assert sorted(analysis.t.traces) == [0, 1]
    for r in (0, 1):
        df = analysis.t.get_trace(r)
        names = set(analysis.t.symbol_table.sym_table[i] for i in df["name"].unique())
        assert "ProfilerStep#2" in names and "aten::mm" in names  # (HTA leaves out the last ProfilerStep)
        assert len(df) > 1000


def test_trace_export_leaves_the_gzip_only(tmp_path, monkeypatch):
    """recorder.export_trace_gz: kineto's JSON gzipped (the same bytes), the JSON removed; when the export or
    the compression fails, neither file is left behind and the error reaches the recorder (which logs it)."""
    from fsdpprof.collect.recorder import export_trace_gz

    body = b'{"traceEvents": [' + b",\n".join(b'{"ph": "X", "name": "op%d", "ts": %d, "dur": 1}' % (i, i)
                                             for i in range(50_000)) + b"]}"

    class Prof:
        def __init__(self, fail=False):
            self.fail = fail

        def export_chrome_trace(self, path):
            with open(path, "wb") as fh:
                fh.write(body[: len(body) // 2] if self.fail else body)
            if self.fail:
                raise RuntimeError("disk full")

    js, gz = tmp_path / "t.json", tmp_path / "t.json.gz"
    export_trace_gz(Prof(), str(js), str(gz))
    assert gzip.decompress(gz.read_bytes()) == body and not js.exists()
    assert len(gz.read_bytes()) < len(body) / 5
    gz.unlink()
    with pytest.raises(RuntimeError, match="disk full"):
        export_trace_gz(Prof(fail=True), str(js), str(gz))
    assert sorted(tmp_path.iterdir()) == []
    with pytest.raises(OSError):                       # the .gz cannot be written: its folder is missing
        export_trace_gz(Prof(), str(js), str(tmp_path / "missing" / "t.json.gz"))
    assert sorted(tmp_path.iterdir()) == []

    real_write = runfmt.write_all

    def half_then_full(fd, data):                      # the disk fills up halfway through the .gz
        real_write(fd, data[: len(data) // 2])
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(runfmt, "write_all", half_then_full)
    with pytest.raises(OSError, match="No space"):
        export_trace_gz(Prof(), str(js), str(gz))
    assert sorted(tmp_path.iterdir()) == []            # no half-written trace.json.gz

    class KinetoOnAFullDisk:                           # kineto's export: <path>.tmp cut short, no error raised
        def export_chrome_trace(self, path):
            with open(path + ".tmp", "wb") as fh:
                fh.write(body[:1000])

    with pytest.raises(OSError, match="the profiler wrote no trace file"):
        export_trace_gz(KinetoOnAFullDisk(), str(js), str(gz))
    assert sorted(tmp_path.iterdir()) == []            # kineto's temporary removed too


def test_trace_export_tried_again_when_the_disk_has_room_again(tmp_path, monkeypatch):
    """Ranks sharing a full disk: kineto's export fails on each (its <path>.tmp cut short, no error), the rank
    that looks first finds the disk full and removes its temporary, so the next one finds room.  That one exports
    once more (a real profiler): its trace if it fits now; if the retry fails too, the disk is said full when it
    is (before: "the profiler wrote no trace file" for that rank, 1 of 2 campaign runs on a 1 MiB tmpfs)."""
    import errno

    import torch

    from fsdpprof.collect.recorder import export_trace_gz

    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as prof:
        torch.ones(8, 8) @ torch.ones(8, 8)
    real_export = torch.profiler.profile.export_chrome_trace
    calls = []

    def fails_first(p, path):                          # kineto on a disk full for a moment
        calls.append(path)
        if len(calls) == 1:
            with open(path + ".tmp", "wb") as fh:
                fh.write(b'{"traceEvents": [')
            return None
        return real_export(p, path)

    monkeypatch.setattr(torch.profiler.profile, "export_chrome_trace", fails_first)
    js, gz = tmp_path / "t.json", tmp_path / "t.json.gz"
    export_trace_gz(prof, str(js), str(gz))
    assert len(calls) == 2 and "aten::mm" in gzip.decompress(gz.read_bytes()).decode()
    assert sorted(p.name for p in tmp_path.iterdir()) == ["t.json.gz"]

    def always_fails(p, path):                          # the retry fills the disk again
        calls.append(path)
        with open(path + ".tmp", "wb") as fh:
            fh.write(b'{"traceEvents": [')

    def full_after_the_retry(folder):
        return len(calls) > 3
    gz.unlink()
    monkeypatch.setattr(torch.profiler.profile, "export_chrome_trace", always_fails)
    monkeypatch.setattr(runfmt, "out_of_space", full_after_the_retry)
    with pytest.raises(OSError, match="the profiler wrote no trace file") as exc:
        export_trace_gz(prof, str(js), str(gz))
    assert len(calls) == 4 and exc.value.errno == errno.ENOSPC
    assert sorted(tmp_path.iterdir()) == []

    # torch 2.13's kineto saves a trace once: the retry raises "Trace is already saved" (a rank of a 2-rank run on
    # a 1 MiB tmpfs said that, not "disk full", 1 in 4 runs); the first write was cut short, so the disk was full
    def saved_once(p, path):
        calls.append(path)
        if len(calls) == 5:
            with open(path + ".tmp", "wb") as fh:
                fh.write(b'{"traceEvents": [')
            return None
        raise RuntimeError("Trace is already saved.")
    monkeypatch.setattr(torch.profiler.profile, "export_chrome_trace", saved_once)
    monkeypatch.setattr(runfmt, "out_of_space", lambda folder: False)       # room again when it looks
    with pytest.raises(OSError, match="the profiler wrote no trace file") as exc:
        export_trace_gz(prof, str(js), str(gz))
    assert len(calls) == 6 and exc.value.errno == errno.ENOSPC
    assert sorted(tmp_path.iterdir()) == []
