"""HTA, the suite's oracle: one TraceAnalysis per (trace, include_last_profiler_step, rounding) and process,
from which every figure the tests compare with is taken (overlap, temporal / kernel-type / idle-time
breakdowns).  HTA's parse is what costs (4 s for hta-16rank-a100 here, its analyses 0.05-0.2 s each), and
test_analyze_hta and test_breakdowns ask for the same traces.

Taking the figures from one TraceAnalysis gives what a fresh one gives for each: checked on every real
trace (the overlap after the three breakdowns equals a fresh TraceAnalysis's, and a rank's overlap in the
folder's analysis equals the analysis of that rank's file alone, param-dlrm-8rank-v100 ranks 0-7, both
include_last settings)."""
from __future__ import annotations

import logging
import os
import tempfile

import pytest

# folders whose rank files HTA analyses together (test_breakdowns compares the whole folder): a rank file
# of these takes its figures from the folder's analysis
FOLDERS = frozenset({"param-dlrm-8rank-v100"})
_CACHE: dict = {}


def hta_results(target: str, include_last: bool, rounding: bool = True) -> dict:
    """HTA's figures for one trace file or a folder of rank files, made once per process:
    {"temporal", "kernel_type", "kernels", "idle", "overlap"} (HTA's DataFrames);
    ``rounding=False``: with HTA's own switch HTA_DISABLE_NS_ROUNDING=1 (exact times)."""
    target = str(target)
    key = (target, include_last, rounding)
    if key in _CACHE:
        return _CACHE[key]
    hta_ta = pytest.importorskip("hta.trace_analysis")
    files = [os.path.join(target, f) for f in sorted(os.listdir(target))] if os.path.isdir(target) else [target]
    logging.disable(logging.WARNING)
    old = os.environ.get("HTA_DISABLE_NS_ROUNDING")
    os.environ["HTA_DISABLE_NS_ROUNDING"] = "0" if rounding else "1"
    try:
        with tempfile.TemporaryDirectory(prefix="hta-") as d:
            for f in files:
                os.symlink(f, os.path.join(d, os.path.basename(f)))
            ta = hta_ta.TraceAnalysis(trace_dir=d, include_last_profiler_step=include_last)
            ranks = sorted(ta.t.traces)
            out = {"temporal": ta.get_temporal_breakdown(visualize=False)}
            out["kernel_type"], out["kernels"] = ta.get_gpu_kernel_breakdown(visualize=False)
            out["idle"] = ta.get_idle_time_breakdown(ranks=ranks, visualize=False)[0]
            out["overlap"] = ta.get_comm_comp_overlap(visualize=False)
    finally:
        logging.disable(logging.NOTSET)
        if old is None:
            os.environ.pop("HTA_DISABLE_NS_ROUNDING")
        else:
            os.environ["HTA_DISABLE_NS_ROUNDING"] = old
    _CACHE[key] = out
    return out


def hta_overlap_pct(trace: str, include_last: bool) -> float:
    """HTA's ``comp_comm_overlap_pctg`` of one rank's trace file (%)."""
    folder, name = os.path.split(str(trace))
    if os.path.basename(folder) in FOLDERS:
        res = hta_results(folder, include_last)["overlap"]
        rank = int(name.split("-")[1].split(".")[0])
        return float(res.set_index("rank").loc[rank, "comp_comm_overlap_pctg"])
    res = hta_results(trace, include_last)["overlap"]
    assert len(res) == 1
    return float(res["comp_comm_overlap_pctg"].iloc[0])
