"""The what-if page's one-line recommendation, from the predictions dict of
:func:`fsdpprof.analyze.whatif.predict.reduce_predictions`: each strategy is weighed against the run's own
configuration predicted the same way (like for like: both carry the replay's errors), never against the
measurement."""
from __future__ import annotations

from fsdpprof.analyze.model import fmt_bytes

MARGIN_PCT = 10.0       # a predicted difference smaller than this is not a reason to change (the replay's own error)
CONTENDED = 1.2         # a run whose CPU contention (1 + run-queue wait / time on a CPU) reaches this has noisy times


def _pct(x: float, base: float) -> float:
    return 100.0 * (x / base - 1.0)


def _faster(p: dict, own: dict) -> bool:
    """Whether ``p`` is predicted faster than ``own``: its step at least MARGIN_PCT shorter and, where both carry
    an interval (``step_low_us``..``step_high_us``), the two intervals apart (an order is stated only then)."""
    if _pct(p["step_us"], own["step_us"]) > -MARGIN_PCT:
        return False
    if p.get("step_high_us") is None or own.get("step_low_us") is None:
        return True
    return p["step_high_us"] < own["step_low_us"]


def recommend(result: dict, device_memory_bytes: int | None = None) -> str | None:
    """One line: the strategy to try (predicted faster than the run's own configuration's prediction by
    :func:`_faster`, its peak within ``device_memory_bytes`` when known), else the one that saves at
    least MARGIN_PCT of the peak without a step MARGIN_PCT longer, else keep the run's configuration; None
    without a prediction of the run's own configuration to weigh against."""
    preds = result.get("predictions") or []
    own = next((p for p in preds if p.get("is_run")), None)
    if own is None or own.get("step_us") is None or own.get("peak_allocated_bytes") is None:
        return None
    others = [p for p in preds if not p.get("is_run") and p.get("step_us") is not None
              and p.get("peak_allocated_bytes") is not None
              and (device_memory_bytes is None or p["peak_allocated_bytes"] <= device_memory_bytes)]
    step0, peak0 = own["step_us"], own["peak_allocated_bytes"]
    c = own.get("run_cpu_contention")
    caveat = (f" (times of a CPU run contended x{c:.2f}: confirm on the target hardware)"
              if c is not None and c >= CONTENDED else "")
    fast = min((p for p in others if _faster(p, own)), key=lambda p: p["step_us"], default=None)
    if fast is not None:
        return (f"try {fast['label']}: step {_pct(fast['step_us'], step0):+.0f}% and peak "
                f"{_pct(fast['peak_allocated_bytes'], peak0):+.0f}% ({fmt_bytes(fast['peak_allocated_bytes'])}) "
                f"against this run's configuration predicted the same way{caveat}")
    small = min((p for p in others if _pct(p["step_us"], step0) < MARGIN_PCT),
                key=lambda p: p["peak_allocated_bytes"], default=None)
    if small is not None and _pct(small["peak_allocated_bytes"], peak0) <= -MARGIN_PCT:
        return (f"keep {own['label']}; if memory is short, {small['label']} predicts a peak "
                f"{_pct(small['peak_allocated_bytes'], peak0):+.0f}% ({fmt_bytes(small['peak_allocated_bytes'])}) "
                f"at a step {_pct(small['step_us'], step0):+.0f}%{caveat}")
    return (f"keep {own['label']}: no strategy is predicted faster (by {MARGIN_PCT:.0f}%, with step-time intervals "
            f"apart), nor {MARGIN_PCT:.0f}% smaller in memory without a step {MARGIN_PCT:.0f}% longer{caveat}")
