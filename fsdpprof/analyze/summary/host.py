"""The host's share of a CPU run's step: host time outside every operator (Python, the dispatcher, FSDP's hooks:
the steps table's ``idle_us`` on a CPU trace) and CPU oversubscription (rank.json's ``cpu`` load: time runnable
over time on a CPU, i.e. runnable threads per core), each a finding ranked by the share of the step it takes.
Every time of a CPU run is contended when its ranks share the host's cores: the findings say so. µs, %."""
from __future__ import annotations

import math

import numpy as np
import pandas as pd

from fsdpprof.analyze import model
from fsdpprof.analyze.model import fmt_ms
from fsdpprof.analyze.summary.findings import Finding, _fires, _share_finding, rank_words
from fsdpprof.analyze.summary.headline import share_of_step, step_medians
from fsdpprof.analyze.whatif.contention import rank_contention

HOST_TIME_PCT = 20.0        # host time outside operators, % of the step (CPU traces)
OVERSUBSCRIBED = 1.25       # runnable threads per core (median over ranks) from which a CPU run is oversubscribed


def contention_spread(cpu_load: dict | None, device_type: str | None) -> dict:
    """A CPU run's contention (rank -> rank.json "cpu", :func:`host_load`: time runnable / time on a CPU, >= 1,
    the runnable threads per core) as :func:`headline.step_spread` states a column: ``value`` the median over
    ranks, ``min`` / ``max``, ``worst_rank`` with ``worst``, ``ranks``; NaN when no rank measured it or the run
    is not on CPU."""
    out = {"value": np.nan, "min": np.nan, "max": np.nan, "worst_rank": None, "worst": np.nan, "ranks": 0,
           "steps": 0}
    c = pd.Series(rank_contention(cpu_load, device_type), dtype=float)
    if c.empty:
        return out
    top = c.max()
    out.update(value=float(c.median()), min=float(c.min()), max=float(top),
               worst_rank=int(min(r for r, x in c.items() if x == top)), worst=float(top), ranks=int(c.size),
               steps=int(c.size))
    return out


def contended_words(c: dict) -> str:
    """What a CPU run's times are worth: "timings are contended (x3.8 runnable threads per core, median over 2
    ranks)", or the plain statement when the load was not recorded."""
    if c["value"] == c["value"]:
        return (f"timings are contended: the ranks share the host's cores (x{c['value']:.2f} runnable threads per "
                f"core, median over {c['ranks']} rank{'s' if c['ranks'] != 1 else ''})")
    return "timings are contended: the ranks share the host's cores (the load was not recorded)"


def host_findings(steps: pd.DataFrame | None, cpu_load: dict | None, device_type: str | None) -> list[Finding]:
    """A CPU run's host findings, as shares of the step (:func:`findings.share_words`): host time outside operators
    (``idle_us``) from HOST_TIME_PCT, CPU oversubscription from OVERSUBSCRIBED runnable threads per core (its
    stake: the step's time waiting for a core, ``step_us x (1 - 1 / contention)``).  None on an accelerator run."""
    if (device_type or model.DEVICE_CPU) != model.DEVICE_CPU or steps is None or steps.empty \
            or "step_us" not in steps:
        return []
    out: list[Finding] = []
    c = contention_spread(cpu_load, device_type)
    contended = contended_words(c)
    if "idle_us" in steps:
        s = share_of_step(steps, "idle_us")
        top = _fires(s, HOST_TIME_PCT)
        if top == top:
            out.append(_share_finding(
                "host_time", "high" if top >= 2 * HOST_TIME_PCT else "medium",
                f"Host time outside operators is {model.fmt_pct(s['pct'])} of the step ({fmt_ms(s['us'])} per step; "
                f"{rank_words(s)}): Python, the dispatcher and FSDP's hooks, covered by no operator; {contended}",
                "steps.idle_us / steps.step_us on a CPU trace (median over ranks)", s, HOST_TIME_PCT,
                "on a CPU run this is mostly the ranks waiting for a core and the framework's own Python: give each "
                "rank its own cores (fewer ranks per host, torch.set_num_threads / OMP_NUM_THREADS = usable cores / "
                "ranks per host) before reading the other times; on an accelerator the same overhead would leave "
                "the device waiting (torch.compile, CUDA graphs, larger work per op)"))
    v = c["value"]
    if v == v and max(v, c["worst"]) >= OVERSUBSCRIBED:
        med = step_medians(steps)["step_us"]
        wait_pct = 100.0 * (1.0 - 1.0 / v)
        worst_pct = 100.0 * (1.0 - 1.0 / c["worst"])
        s = {"us": med * (1.0 - 1.0 / v) if med == med else math.nan, "pct": wait_pct, "worst_rank": c["worst_rank"],
             "worst_pct": worst_pct, "ranks": c["ranks"]}
        out.append(_share_finding(
            "cpu_oversubscribed", "high" if v >= 2 * OVERSUBSCRIBED else "medium",
            f"CPU oversubscribed: x{v:.2f} runnable threads per core (median over {c['ranks']} ranks, worst rank "
            f"{c['worst_rank']}: x{c['worst']:.2f}): up to {model.fmt_pct(wait_pct)} of the step "
            f"({fmt_ms(s['us'])}) is waiting for a core ({rank_words(s)}); every time of this run is contended",
            "rank.json cpu: (run_us + runqueue_us) / run_us, median over ranks; share = 1 - 1 / contention", s,
            100.0 * (1.0 - 1.0 / OVERSUBSCRIBED),
            "run fewer ranks (or fewer threads per rank: torch.set_num_threads, OMP_NUM_THREADS) per host, or stop "
            "the other work on it; times of runs under different loads differ by the load alone (compare notes it)",
            "overview"))
    return out
