"""The scope of a comparison: which steps and ranks ``fsdpprof compare`` puts side by side (no pandas here:
the command checks ``--iteration`` / ``--rank`` before it imports the analysis).  Re-exported by
:mod:`fsdpprof.analyze.compare.diff`."""
from __future__ import annotations

from dataclasses import dataclass

from fsdpprof.errors import UserError
from fsdpprof.options import STEP_NUMBER, shown

SCOPE_MEDIAN, SCOPE_FIRST, SCOPE_ALL = "median", "first", "all"


@dataclass
class Scope:
    """Which steps and ranks are compared: ``iteration`` is ``median`` | ``first`` | ``all`` | a step number;
    ``rank`` one rank of every input (None: all ranks, medians across them)."""

    iteration: str | int = SCOPE_MEDIAN
    rank: int | None = None

    def describe(self) -> str:
        it = self.iteration
        what = {SCOPE_MEDIAN: "per-step medians over the recorded steps",
                SCOPE_FIRST: "the first ProfilerStep (CPU operators and GPU kernels together, as HTA's compare_traces)",
                SCOPE_ALL: "all recorded steps summed"}.get(it, f"step {it} (ProfilerStep#{it})")
        if self.rank is not None:
            return f"{what}, rank {self.rank}"
        return what + (", the first rank" if it == SCOPE_FIRST else ", medians across ranks")


def parse_iteration(text) -> str | int:
    """``--iteration`` as a Scope.iteration: first | all | median | a step number (>= 0)."""
    t = str(text).strip().lower()
    if t in (SCOPE_FIRST, SCOPE_ALL, SCOPE_MEDIAN):
        return t
    try:
        return STEP_NUMBER.check(t)
    except ValueError as exc:
        why = "is not first, all, median or a step number (ProfilerStep#N)" if str(exc) == "is not a number" else exc
        raise UserError(f"--iteration {shown(text)} {why}: give first, all, median or {STEP_NUMBER.describe()}"
                        ) from None
