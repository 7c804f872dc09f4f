"""Is a difference between two runs measured, or inside their noise?  The one test compare's verdict and its noise
note share: a bootstrap interval of the difference of medians of per-step samples (every rank's every step), with a
fixed seed, so the same runs give the same answer.  A difference is measured when its interval excludes 0.  µs."""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import pandas as pd

from fsdpprof.analyze.model import fmt_ms

BOOTSTRAP_RESAMPLES = 4000
BOOTSTRAP_SEED = 0
INTERVAL_LEVEL = 0.95           # two-sided


@dataclass(frozen=True)
class Difference:
    """``b`` against ``a`` of one metric: ``median_a_us`` / ``median_b_us`` of their per-step samples,
    ``diff_us`` = b - a, its INTERVAL_LEVEL bootstrap interval ``low_us`` .. ``high_us``, sample counts;
    ``measured``: the interval excludes 0."""

    metric: str
    median_a_us: float
    median_b_us: float
    diff_us: float
    low_us: float
    high_us: float
    n_a: int
    n_b: int

    @property
    def measured(self) -> bool:
        return bool(self.low_us > 0 or self.high_us < 0)

    def words(self) -> str:
        """'+88.5 ms, 95% interval +70.1 to +101 ms over 6 and 6 steps x ranks'."""
        def signed(x: float) -> str:
            return ("+" if x >= 0 else "-") + fmt_ms(abs(x))

        return (f"{signed(self.diff_us)}, {INTERVAL_LEVEL:.0%} interval {signed(self.low_us)} to "
                f"{signed(self.high_us)} over {self.n_a} and {self.n_b} steps x ranks")


def step_samples(steps: pd.DataFrame | None, col: str) -> np.ndarray:
    """Every rank's every step of ``col`` (µs), NaN left out."""
    if steps is None or steps.empty or col not in steps:
        return np.empty(0)
    v = steps[col].to_numpy(np.float64)
    return v[np.isfinite(v)]


def median_difference(a: np.ndarray, b: np.ndarray, metric: str = "", resamples: int = BOOTSTRAP_RESAMPLES,
                      seed: int = BOOTSTRAP_SEED) -> Difference | None:
    """The bootstrap interval of median(b) - median(a) (each sample resampled with replacement ``resamples``
    times, percentile interval); None when either has fewer than 2 samples (no spread to test against)."""
    a, b = np.asarray(a, np.float64), np.asarray(b, np.float64)
    if a.size < 2 or b.size < 2:
        return None
    rng = np.random.default_rng(seed)
    ma = np.median(a[rng.integers(0, a.size, (resamples, a.size))], axis=1)
    mb = np.median(b[rng.integers(0, b.size, (resamples, b.size))], axis=1)
    tail = 100.0 * (1.0 - INTERVAL_LEVEL) / 2
    lo, hi = np.percentile(mb - ma, [tail, 100.0 - tail])
    return Difference(metric, float(np.median(a)), float(np.median(b)), float(np.median(b) - np.median(a)),
                      float(lo), float(hi), int(a.size), int(b.size))


class NoiseTest:
    """The per-step samples of each run (label -> metric -> samples) and the one answer for each pair, cached."""

    def __init__(self, samples: dict):
        self.samples = samples
        self._done: dict = {}

    @classmethod
    def of_steps(cls, steps_by_run: dict, metrics) -> "NoiseTest":
        """From label -> steps table (rank, step, metric columns)."""
        return cls({lab: {m: step_samples(st, m) for m in metrics} for lab, st in steps_by_run.items()})

    def test(self, a: str, b: str, metric: str) -> Difference | None:
        """Run ``b`` against run ``a`` in ``metric`` (None: not testable).  One bootstrap per pair: ``a`` against
        ``b`` is this one negated, so the verdict and the noise note, which may ask in either order, agree."""
        x, y = sorted((a, b), key=str)
        key = (x, y, metric)
        if key not in self._done:
            sx, sy = (self.samples.get(r, {}).get(metric, np.empty(0)) for r in (x, y))
            self._done[key] = median_difference(sx, sy, metric)
        d = self._done[key]
        if d is None or (x, y) == (a, b):
            return d
        return Difference(metric, d.median_b_us, d.median_a_us, -d.diff_us, -d.high_us, -d.low_us, d.n_b, d.n_a)
