"""HTA's own kernel, temporal and idle-time tables (``report --hta``, the ``fsdpprof[hta]`` extra): HolisticTrace-
Analysis (or traceinsight, both import as ``hta``) run on the run's traces, asked only for the ranks there are."""
from __future__ import annotations

import contextlib
import io
import logging
import os
import tempfile

import pandas as pd

from fsdpprof.analyze.trace.timeline_file import write_rank_part


@contextlib.contextmanager
def _quiet_hta():
    """HTA logs and prints freely: silence it for the duration of the call only."""
    loggers = [logging.getLogger(n) for n in list(logging.root.manager.loggerDict) if n.startswith("hta")]
    loggers.append(logging.getLogger("hta"))
    levels = [lg.level for lg in loggers]
    try:
        for lg in loggers:
            lg.setLevel(logging.ERROR)
        with contextlib.redirect_stdout(io.StringIO()), contextlib.redirect_stderr(io.StringIO()):
            yield
    finally:
        for lg, level in zip(loggers, levels):
            lg.setLevel(level)


def hta_breakdowns(run) -> dict:
    """HTA's kernel, temporal and idle-time breakdowns (GPU traces only): name -> DataFrame."""
    from hta.trace_analysis import TraceAnalysis  # noqa: PLC0415  (optional, heavy)

    out = {}
    with tempfile.TemporaryDirectory(prefix="fsdpprof-hta-") as tmp, _quiet_hta():
        ranks = [r for r, d in sorted(run.ranks.items()) if d.trace_path]
        for r in ranks:
            d = run.ranks[r]
            if d.trace_pid is not None:     # a merged timeline: HTA reads one file per rank
                write_rank_part(d.trace_path, {"rank": r, "pid": d.trace_pid, "trace": d.trace_meta},
                                os.path.join(tmp, f"rank-{r}.json.gz"))
            else:
                ext = ".json.gz" if d.trace_path.endswith(".gz") else ".json"
                os.symlink(os.path.abspath(d.trace_path), os.path.join(tmp, f"rank-{r}{ext}"))
        ta = TraceAnalysis(trace_dir=tmp)
        out["kernel_type"], kb = ta.get_gpu_kernel_breakdown(visualize=False)
        out["kernels"] = kb.head(50) if kb is not None else None
        out["temporal"] = ta.get_temporal_breakdown(visualize=False)
        idle = ta.get_idle_time_breakdown(ranks=ranks, visualize=False)
        out["idle"] = idle[0] if isinstance(idle, tuple) else idle
    return {k: v for k, v in out.items() if isinstance(v, pd.DataFrame)}
