#!/usr/bin/env bash
# The real CUDA/NCCL path, once, on a GPU machine (the `device` tool when a task is lent one):
# records fsdpprof's example under FSDP2 with NCCL and a CUDA memory snapshot (world size 1, and 2
# when two GPUs exist), reports on it, checks the CUDA path with benchmarks/gpu_check.py, and leaves
# the small recorded traces, snapshots and inventories under $OUT (default ./gpu-check-out) to be
# committed as test data with their provenance (the GPU, driver, torch and NCCL versions in
# provenance.json).  About 2-4 minutes; nothing here runs on a CPU-only machine.
#
#   bash benchmarks/gpu_check.sh            # from the repository root, with torch (CUDA) importable
set -euo pipefail
cd "$(dirname "$0")/.."
OUT=${OUT:-$PWD/gpu-check-out}
mkdir -p "$OUT"
export PYTHONUNBUFFERED=1 OMP_NUM_THREADS=4
python3 -c "import torch, sys; sys.exit(0 if torch.cuda.is_available() else 'no CUDA device: run this on a GPU machine')"
python3 -m pip install -q --no-deps -e . >/dev/null 2>&1 || export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"
python3 -m pip install -q msgspec plotly tqdm >/dev/null 2>&1 || true
# NVML's per-process device memory for rank.json's process_memory (without it: torch.cuda.mem_get_info)
python3 -m pip install -q nvidia-ml-py >/dev/null 2>&1 || true
python3 -c "import pynvml" 2>/dev/null && echo "== NVML importable: per-process device memory" \
    || echo "== no pynvml: device memory from torch.cuda.mem_get_info"
NGPU=$(python3 -c "import torch; print(torch.cuda.device_count())")
WORLDS="1"; [ "$NGPU" -ge 2 ] && WORLDS="1 2"
ARGS=(--skip-steps 1 --warmup-steps 1 --active-steps 2)
TRAIN=(--strategy fsdp2 --steps 5 --mixed-precision bf16 --quiet)
for N in $WORLDS; do
    RUN=/tmp/fsdpprof-gpu-check-w$N
    rm -rf "$RUN"
    echo "== recording FSDP2 + NCCL, world size $N"
    python3 -m fsdpprof record --out "$RUN" "${ARGS[@]}" -- \
        python3 -m torch.distributed.run --standalone --nproc-per-node="$N" fsdpprof/examples/train_fsdp.py "${TRAIN[@]}"
    echo "== report"
    python3 -m fsdpprof report "$RUN" -o "$RUN/report.html"
    echo "== checks"
    python3 benchmarks/gpu_check.py "$RUN" "$OUT/w$N"
done
python3 benchmarks/gpu_check.py --provenance "$OUT/provenance.json"
ls -la "$OUT" "$OUT"/*
