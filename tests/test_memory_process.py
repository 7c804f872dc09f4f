"""The process's memory beside the allocator's: sampled by the collector at every step of the window into rank.json
(fsdpprof.collect.process_memory), read by fsdpprof.analyze.memory.process into summary.json's
``memory[rank].process``, shown in the report's Memory section, and a finding naming NCCL's buffer settings when
a GPU process holds much outside the allocator.

On CPU for real: a recorded run (slow) and this process's own /proc/self/status against getrusage.  The CUDA
figures (NVML / mem_get_info beside torch.cuda.memory_reserved) cannot be recorded here: their reading is tested
on rank.json content shaped as the collector writes it, and benchmarks/gpu_check.py checks them on a GPU.
"""
from __future__ import annotations

import json
import resource

import pytest

from conftest import DEFAULT_RECORD_ARGS, run_fsdpprof
from fsdpprof import runfmt
from fsdpprof.analyze.summary import findings as fnd
from fsdpprof.analyze.memory.process import process_memory
from fsdpprof.collect.process_memory import ProcessMemory, read_proc_status

GIB = 1 << 30


def test_cpu_sample_is_this_process_rss_and_peak():
    """VmHWM is the peak RSS getrusage reports (ru_maxrss, KiB on Linux): two readings of one figure."""
    pm = ProcessMemory()
    if pm.cuda:
        pytest.skip("a CUDA machine samples the device, not the RSS")
    if not read_proc_status():
        pytest.skip("no /proc/self/status here")
    ballast = bytearray(64 << 20)        # 64 MiB touched: RSS and its peak grow
    for i in range(0, len(ballast), 4096):
        ballast[i] = 1
    pm.sample(7)
    peak_kib = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    doc = pm.to_doc()
    assert doc["source"] == runfmt.PROCESS_MEMORY_PROC_STATUS and doc["device"] == "cpu"
    (s,) = doc["samples"]
    assert s["step"] == 7 and 64 << 20 <= s["used_bytes"] <= s["used_peak_bytes"]
    assert abs(s["used_peak_bytes"] - peak_kib * 1024) <= 8 << 20
    del ballast


def _cuda_doc(samples, env=None, source=runfmt.PROCESS_MEMORY_NVML, note=None) -> dict:
    """rank.json content as the collector writes it on a GPU."""
    keys = ("used_bytes", "reserved_bytes", "max_reserved_bytes", "allocated_bytes", "max_allocated_bytes")
    return {"rank": 3, runfmt.RANK_PROCESS_MEMORY: {
        "source": source, "device": "cuda:3", "note": note, "nccl_env": env or {},
        "samples": [dict(zip(("step",) + keys, s)) for s in samples]}}


def test_cuda_outside_the_allocator_and_the_nccl_finding():
    # step, used, reserved, max reserved, allocated, max allocated
    info = _cuda_doc([(5, 70 * GIB, 60 * GIB, 62 * GIB, 50 * GIB, 55 * GIB),
                      (6, 73 * GIB, 61 * GIB, 64 * GIB, 51 * GIB, 56 * GIB),
                      (7, 72 * GIB, 63 * GIB, 64 * GIB, 52 * GIB, 57 * GIB)], env={"NCCL_BUFFSIZE": "16777216"})
    p, notes = process_memory(info, None)
    assert not notes
    assert p["used_peak_bytes"] == 73 * GIB and p["allocator_reserved_peak_bytes"] == 64 * GIB
    assert p["outside_allocator_peak_bytes"] == 12 * GIB          # the largest used - reserved at one sample
    assert [r["step"] for r in p["steps"]] == [5, 6, 7]
    (f,) = fnd.process_findings(p, 3)
    assert f.id == "outside_allocator" and f.value == 12 * GIB and f.rank == 3
    assert "NCCL_BUFFSIZE=16777216" in f.suggestion and "NCCL_MAX_NCHANNELS" in f.suggestion
    assert "cuda:3" in f.title
    # below the threshold: no finding; a device-wide figure says so
    small = _cuda_doc([(5, 10 * GIB, 9 * GIB, 9 * GIB, 8 * GIB, 8 * GIB)])
    assert fnd.process_findings(process_memory(small, None)[0]) == []
    wide = _cuda_doc([(5, 20 * GIB, 9 * GIB, 9 * GIB, 8 * GIB, 8 * GIB)], source=runfmt.PROCESS_MEMORY_MEM_GET_INFO,
                     note="device-wide figure")
    (f,) = fnd.process_findings(process_memory(wide, None)[0])
    assert "every process on it" in f.suggestion and "default 4 MiB" in f.suggestion


@pytest.mark.parametrize("bad", [[1, 2], {"source": "vmstat", "samples": []}, {"source": "nvml", "samples": 3},
                                 {"source": "proc_status", "samples": [{"step": 1, "used_bytes": -5}]}])
def test_unreadable_process_memory_is_left_out_with_a_note(bad):
    p, notes = process_memory({"rank": 0, runfmt.RANK_PROCESS_MEMORY: bad}, 100)
    assert p is None and len(notes) >= 1 and "process_memory" in notes[-1]


@pytest.mark.slow
def test_recorded_cpu_run_process_memory(recorded_run, tmp_path):
    """Every step of the window sampled into rank.json; summary.json's process peak at least the allocator's peak,
    per rank; the report shows it as its own bar beside the categories and in a table."""
    run = recorded_run("fsdp2")
    skip = int(DEFAULT_RECORD_ARGS[DEFAULT_RECORD_ARGS.index("--skip-steps") + 1])
    warm = int(DEFAULT_RECORD_ARGS[DEFAULT_RECORD_ARGS.index("--warmup-steps") + 1])
    active = int(DEFAULT_RECORD_ARGS[DEFAULT_RECORD_ARGS.index("--active-steps") + 1])
    proc = run_fsdpprof("report", str(run), "-o", str(tmp_path / "r.html"))
    assert proc.returncode == 0, proc.stderr[-2000:]
    summary = json.loads((tmp_path / "r.summary.json").read_text())
    ranks = sorted(p.name for p in run.glob("rank-*"))
    assert len(ranks) == 2
    for name in ranks:
        rank_json = json.loads((run / name / runfmt.RANK_JSON).read_text())
        pm = rank_json[runfmt.RANK_PROCESS_MEMORY]
        assert pm["source"] == runfmt.PROCESS_MEMORY_PROC_STATUS
        assert [s["step"] for s in pm["samples"]] == list(range(skip, skip + warm + active))
        assert all(0 < s["used_bytes"] <= s["used_peak_bytes"] for s in pm["samples"])
        m = summary["memory"][str(rank_json["rank"])]
        p = m["process"]
        assert p["source"] == "proc_status"
        assert p["used_peak_bytes"] == max(s["used_peak_bytes"] for s in pm["samples"])
        assert p["used_peak_bytes"] >= m["peak_allocated_bytes"] > 0
        assert p["allocator_reserved_peak_bytes"] == m["peak_allocated_bytes"]
        assert p["outside_allocator_peak_bytes"] == p["used_peak_bytes"] - m["peak_allocated_bytes"]
    page = (tmp_path / "r.html").read_text()
    sec = page[page.index('<section id="memory">'):]
    sec = sec[:sec.index("</section>")]
    assert "The process&#x27;s memory beside the allocator&#x27;s" in sec or \
        "The process's memory beside the allocator's" in sec
    assert '"outside the allocator"' in sec                     # the bar beside the categories
    assert "process peak (device used / RSS) (MiB)" in sec and "outside the allocator (MiB)" in sec
    assert not any(f["id"] == "outside_allocator" for f in summary["findings"])      # CPU: nothing to tune
