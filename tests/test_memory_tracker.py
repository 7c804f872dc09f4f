"""Our FSDP2 attribution against torch's own FSDPMemTracker on the same model and step.

One short 2-process gloo run of the example's model under
``torch.distributed._tools.fsdp2_mem_tracker.FSDPMemTracker`` (its peak snapshot per category),
compared with our analysis of the shared ``recorded_run("fsdp2")`` recording (same model, same
seed, same data, the same optimizer step).
"""
from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

from conftest import ROOT
from fsdpprof.analyze.memory import memory_analysis
from fsdpprof.analyze.load.run import load_run

pytestmark = pytest.mark.slow  # a real 2-process torchrun job

SCRIPT = r'''
import json, os, sys
import torch
import torch.nn.functional as F
from fsdpprof.examples import train_fsdp as ex
from torch.distributed._tools.fsdp2_mem_tracker import FSDPMemTracker

out_dir, track_step = sys.argv[1], int(sys.argv[2])
args = ex.parse_args(["--strategy", "fsdp2"])
rank, world, _ = ex.setup_distributed("cpu")
torch.manual_seed(args.seed)
model = ex.wrap(ex.TinyTransformer(args.vocab, args.dim, args.layers, args.heads, args.seq), args,
                torch.device("cpu"), world)
opt = torch.optim.AdamW(model.parameters(), lr=args.lr)
gen = torch.Generator().manual_seed(args.seed + 1000 + rank)

def step(tokens):
    logits = model(tokens[:, :-1])
    loss = F.cross_entropy(logits.float().reshape(-1, args.vocab), tokens[:, 1:].reshape(-1))
    loss.backward()
    opt.step()
    opt.zero_grad(set_to_none=True)

for i in range(track_step + 1):
    tokens = torch.randint(0, args.vocab, (args.batch, args.seq + 1), generator=gen)
    if i < track_step:
        step(tokens)
        continue
    mt = FSDPMemTracker(model, opt)
    mt.track_inputs((tokens,))
    with mt:
        step(tokens)
    peak = mt.get_tracker_snapshot("peak")
    res = {str(k).split(".")[-1]: int(v) for dev, snap in peak.items() for k, v in snap.items()}
with open(os.path.join(out_dir, f"tracker-rank{rank}.json"), "w") as fh:
    json.dump(res, fh)
import torch.distributed as dist
dist.barrier()
dist.destroy_process_group()
'''


@pytest.fixture(scope="module")
def tracker(recorded_run, tmp_path_factory):
    run = load_run(str(recorded_run("fsdp2")))
    first_step = run.ranks[0].info["steps_recorded"][0]
    d = tmp_path_factory.mktemp("memtracker")
    (d / "mt.py").write_text(SCRIPT)
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONPATH=str(ROOT))
    proc = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node=2",
                           str(d / "mt.py"), str(d), str(first_step)], env=env, capture_output=True, text=True,
                          timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return run, {r: json.loads((d / f"tracker-rank{r}.json").read_text()) for r in (0, 1)}


def test_against_fsdp_mem_tracker(tracker):
    run, theirs = tracker
    for r, t in theirs.items():
        m = memory_analysis(run.ranks[r])
        ours = m.breakdown_at_peak.set_index("category")["bytes"]
        inv = run.ranks[r].inventory
        unit_local = {u["fqn"]: u["local_bytes"] for u in inv["units"]}
        # their categories in ours: the all-gather output and the unsharded params are both our
        # "unsharded param (all-gather output)"; reduce-scatter buffers and unsharded grads our "unsharded grad"
        pairs = {"sharded_param": t["SHARDED_PARAM"], "unsharded_param": t["UNSHARDED_PARAM"] + t["ALL_GATHER"],
                 "sharded_grad": t["SHARDED_GRAD"], "unsharded_grad": t["UNSHARDED_GRAD"] + t["REDUCE_SCATTER"],
                 "optimizer_state": t["OPT"], "activation": t["ACT"], "temporary": t["TEMP"], "input": t["INP"]}
        table = "\n".join(f"  {k:16s} ours {ours[k] / 2**20:8.3f} MiB  tracker {v / 2**20:8.3f} MiB" for k, v in pairs.items())
        print(f"rank {r}: ours peak {m.peak_allocated_bytes / 2**20:.2f} MiB ({m.peak_stage}/{m.peak_fsdp_phase}), "
              f"tracker peak {t['Total'] / 2**20:.2f} MiB\n{table}")

        def close(k):
            return abs(ours[k] - pairs[k]) <= 0.05 * pairs[k]

        # Within 5 %: what does not depend on the instant of the peak, and the gathered parameters (one
        # unit in use, one prefetched, plus the root).
        for k in ("sharded_param", "optimizer_state", "input", "unsharded_param"):
            assert close(k), (r, k, ours[k], pairs[k])
        # Temporaries are what is alive at one instant: the tracker's own figure at its peak moves between
        # runs of the same code (3.25 and 4.27 MiB seen on rank 1, gloo's threads decide which instant is
        # its peak), and so does ours (usually 3.26 MiB; 0.25 MiB once, when gloo's timing put rank 1's peak
        # at another all-gather's copy-out). So: at the peak at most twice theirs, and the most alive at one
        # instant of our record of their order (3.3-7.0 MiB seen over 6 ranks of 3 recordings).
        assert ours["temporary"] <= 2 * pairs["temporary"], (r, ours, pairs)
        most = float(m.timeline["temporary"].max())
        assert 0.5 * pairs["temporary"] <= most <= 3 * pairs["temporary"], (r, most, pairs)
        # Different by design: the peaks are different instants. gloo implements FSDP's collectives with C++
        # buffers that a dispatch-level tracker never sees but the allocator counts (other threads' bytes), so
        # our peak is at least theirs, at the instant gloo's buffers and the step's own bytes are most together:
        # usually later in backward, after more units have reduced their grads (whole units of sharded grads
        # more) and freed their activations; when a gloo buffer is alive at an earlier all-gather, there (more
        # activations, fewer grads: 17.0 against 13.0 MiB of activations, no sharded grad yet, seen on rank 1).
        # Along our curve each gradient side reaches their level.
        assert m.peak_allocated_bytes >= t["Total"]
        for k in ("unsharded_grad", "sharded_grad"):
            assert m.timeline[k].max() >= pairs[k], (r, k, m.timeline[k].max(), pairs[k])
        extra = ours["sharded_grad"] - pairs["sharded_grad"]
        if extra >= 0 and ours["activation"] <= pairs["activation"]:      # (our peak the later instant)
            assert ours["unsharded_grad"] >= pairs["unsharded_grad"]
            assert extra == 0 or extra in {v for v in unit_local.values()} | {2 * v for v in unit_local.values()}, extra
        else:                                                               # (the earlier one)
            assert m.peak_stage == "backward" and ours["sharded_grad"] < pairs["sharded_grad"]
            assert ours["activation"] > pairs["activation"]
        # ... and our curve does pass through their activation level during the step
        assert m.timeline["activation"].max() >= 0.95 * pairs["activation"]
