"""HTA's own kernel, temporal and idle-time tables (optional: the ``fsdpprof[hta]`` extra, ``report --hta``).

fsdpprof computes what its report needs itself; this adapter runs HolisticTraceAnalysis (or its
renamed successor traceinsight: both import as ``hta``) on the run's traces for users who want HTA's
tables as they know them.  HTA is asked only for the ranks that exist in the input.
"""
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
    sink = io.StringIO()
    try:
        for lg in loggers:
            lg.setLevel(logging.ERROR)
        with contextlib.redirect_stdout(sink), contextlib.redirect_stderr(sink):
            yield
    finally:
        for lg, level in zip(loggers, levels):
            lg.setLevel(level)


def hta_breakdowns(run) -> dict:
    """HTA's kernel, temporal and idle-time breakdowns (GPU traces only): name -> DataFrame."""
    from hta.trace_analysis import TraceAnalysis  # noqa: PLC0415  (optional, heavy)

    out = {}
    with tempfile.TemporaryDirectory(prefix="fsdpprof-hta-") as tmp, _quiet_hta():
        ranks = []
        for r, d in sorted(run.ranks.items()):
            if d.trace_path and d.trace_pid is not None:     # a merged timeline: HTA reads one file per rank
                write_rank_part(d.trace_path, {"rank": r, "pid": d.trace_pid, "trace": d.trace_meta},
                                os.path.join(tmp, f"rank-{r}.json.gz"))
                ranks.append(r)
            elif d.trace_path:
                ext = ".json.gz" if d.trace_path.endswith(".gz") else ".json"
                os.symlink(os.path.abspath(d.trace_path), os.path.join(tmp, f"rank-{r}{ext}"))
                ranks.append(r)
        ta = TraceAnalysis(trace_dir=tmp)
        kt, kb = ta.get_gpu_kernel_breakdown(visualize=False)
        out["kernel_type"] = kt
        out["kernels"] = kb.head(50) if kb is not None else None
        out["temporal"] = ta.get_temporal_breakdown(visualize=False)
        idle = ta.get_idle_time_breakdown(ranks=ranks, visualize=False)
        out["idle"] = idle[0] if isinstance(idle, tuple) else idle
    return {k: v for k, v in out.items() if isinstance(v, pd.DataFrame)}
