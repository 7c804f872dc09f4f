"""Checks of the CUDA path on a run recorded by benchmarks/gpu_check.sh, and the test data it keeps.

``gpu_check.py RUN OUT_DIR`` prints each check with the numbers and exits 1 when one fails:
- NCCL all-gather and reduce-scatter kernels are found (world size > 1), each staged from its launch
  (forward / backward, not 'unknown'), with its FSDP phase and unit from the launching annotation;
- the CUDA snapshot's allocations carry fsdpprof's tags, attribution covers the peak (coverage %);
- the attributed sharded parameters and optimizer state equal the inventory's bytes;
- the process's memory in rank.json (every step of the window): device used >= reserved >= allocated at each
  sample, and summary's memory[rank].process has memory outside the allocator (> 0: the CUDA context, and NCCL's
  buffers when world size > 1), its source (nvml or cuda_mem_get_info) said.
It copies rank 0's trace.json.gz, memory_snapshot.pickle (gzipped) and inventory.json into OUT_DIR.
``gpu_check.py --provenance FILE`` writes the GPU, driver, CUDA, torch and NCCL versions.
"""
from __future__ import annotations

import gzip
import json
import os
import shutil
import sys


def provenance(path: str) -> None:
    import subprocess

    import torch

    smi = subprocess.run(["nvidia-smi", "--query-gpu=name,driver_version", "--format=csv,noheader"],
                         capture_output=True, text=True).stdout.strip()
    doc = {"gpu": torch.cuda.get_device_name(0), "nvidia_smi": smi, "torch": torch.__version__,
           "cuda": torch.version.cuda, "nccl": ".".join(map(str, torch.cuda.nccl.version())),
           "recorded_by": "benchmarks/gpu_check.sh (fsdpprof's example, FSDP2, bf16, NCCL)"}
    with open(path, "w") as fh:
        json.dump(doc, fh, indent=1)
    print(json.dumps(doc, indent=1))


def check_process_memory(rd, m, r: int, world: int, ok) -> None:
    """rank.json's process_memory and memory[rank].process on a GPU."""
    pm = (rd.info or {}).get("process_memory")
    ok(isinstance(pm, dict) and bool(pm.get("samples")), f"rank {r}: rank.json has process memory samples")
    if not isinstance(pm, dict) or not pm.get("samples"):
        return
    steps = [s["step"] for s in pm["samples"]]
    print(f"rank {r}: process memory from {pm.get('source')} ({pm.get('note') or 'no note'}), steps {steps}, "
          f"NCCL settings {pm.get('nccl_env') or 'none set'}")
    ok(pm.get("source") in ("nvml", "cuda_mem_get_info"), f"rank {r}: device memory source {pm.get('source')}")
    for s in pm["samples"]:
        ok(s["used_bytes"] >= s["reserved_bytes"] >= s["allocated_bytes"] > 0,
           f"rank {r} step {s['step']}: device used {s['used_bytes']} >= reserved {s['reserved_bytes']} >= "
           f"allocated {s['allocated_bytes']} B")
        ok(s["max_reserved_bytes"] >= s["reserved_bytes"], f"rank {r} step {s['step']}: max reserved >= reserved")
    p = getattr(m, "process", None) or {}
    outside = p.get("outside_allocator_peak_bytes")
    ok(outside is not None and outside > 0,
       f"rank {r}: {0 if outside is None else outside / 2**20:.0f} MiB outside the allocator"
       + (" (CUDA context + NCCL buffers)" if world > 1 else " (CUDA context)"))
    ok((p.get("used_peak_bytes") or 0) >= (p.get("allocator_reserved_peak_bytes") or 0) > 0,
       f"rank {r}: used peak {p.get('used_peak_bytes')} >= allocator reserved peak "
       f"{p.get('allocator_reserved_peak_bytes')} B")


def check(run_dir: str, out_dir: str) -> int:
    from fsdpprof.analyze import analyze_run, load_run, memory_analysis, run_events

    failures = []

    def ok(cond: bool, what: str) -> None:
        print(("PASS " if cond else "FAIL ") + what)
        if not cond:
            failures.append(what)

    run = load_run(run_dir)
    a = analyze_run(run)
    ev = run_events(run)
    world = run.world_size or 1
    comm = ev[ev["kind"] == "comm"]
    print(f"world size {world}, {len(ev)} events, {len(comm)} comm kernels, device {a.overview['device_type']}")
    ok(a.overview["device_type"] == "cuda", "device type from the trace is cuda")
    if world > 1:
        colls = set(comm["collective"].astype(str))
        ok({"all_gather", "reduce_scatter"} <= colls, f"NCCL all-gather and reduce-scatter found ({sorted(colls)})")
        staged = comm["stage"].astype(str)
        ok(not (staged == "unknown").any(), f"every NCCL kernel staged from its launch ({staged.value_counts().to_dict()})")
        ag = comm[comm["collective"] == "all_gather"]
        ok(set(ag["stage"].astype(str)) <= {"forward", "backward"}, "all-gathers launched in forward / backward")
        ok(ag["fsdp_phase"].notna().mean() > 0.9, f"all-gathers carry an FSDP phase ({ag['fsdp_phase'].notna().mean():.0%})")
        ok(ag["unit"].notna().mean() > 0.9, f"all-gathers carry an FSDP unit ({ag['unit'].notna().mean():.0%})")
    for r, rd in sorted(run.ranks.items()):
        if not rd.snapshot_path:
            ok(False, f"rank {r} has a CUDA memory snapshot")
            continue
        m = memory_analysis(rd)
        al = m.allocations
        tagged = al["user_metadata"].astype(str).str.startswith("fsdpprof").mean()
        ok(tagged > 0.5, f"rank {r}: {tagged:.0%} of allocations carry fsdpprof's tags")
        ok(m.coverage_pct >= 90, f"rank {r}: {m.coverage_pct:.1f}% of the peak attributed")
        bd = m.breakdown_at_peak.groupby("category", observed=True)["bytes"].sum()
        totals = (rd.inventory or {}).get("totals") or {}
        for cat, key in (("sharded_param", "param_bytes"), ("optimizer_state", "optimizer_state_bytes")):
            want = float(totals.get(key) or 0)
            got = float(bd.get(cat, 0))
            ok(want > 0 and abs(got - want) <= 0.01 * want, f"rank {r}: {cat} {got:.0f} B vs inventory {want:.0f} B")
        print(f"rank {r}: peak {m.peak_allocated_bytes / 2**20:.1f} MiB, reserved {(m.reserved_bytes or 0) / 2**20:.1f} MiB")
        check_process_memory(rd, m, r, world, ok)
    os.makedirs(out_dir, exist_ok=True)
    d0 = os.path.join(run_dir, "rank-0")
    for name in ("trace.json.gz", "inventory.json", "rank.json"):
        if os.path.exists(os.path.join(d0, name)):
            shutil.copy(os.path.join(d0, name), os.path.join(out_dir, name))
    snap = os.path.join(d0, "memory_snapshot.pickle")
    if os.path.exists(snap):
        with open(snap, "rb") as src, gzip.open(os.path.join(out_dir, "memory_snapshot.pickle.gz"), "wb") as dst:
            shutil.copyfileobj(src, dst)
    print(f"{len(failures)} check(s) failed" if failures else "all checks passed")
    return 1 if failures else 0


if __name__ == "__main__":
    if sys.argv[1:2] == ["--provenance"]:
        provenance(sys.argv[2])
    else:
        sys.exit(check(sys.argv[1], sys.argv[2]))
