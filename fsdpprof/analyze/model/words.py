"""The words every output says for the vocabulary (memory categories, collectives) and the one percentage and
millisecond formats: the page, the terminal and the sentences the analyses write (findings, explanations) read the
same."""
from __future__ import annotations

import math

from fsdpprof.analyze.model.memory import MemoryCategory as MC
from fsdpprof.runfmt import STAGE_DATA, STAGE_OPTIMIZER, STAGE_OUTSIDE, STAGE_POST_STEP, STAGE_UNKNOWN

__all__ = ["CATEGORY_WORDS", "category_words", "collective_words", "fmt_ms", "fmt_pct", "MISSING_WORD", "STAGE_WORDS",
           "stage_words"]

MISSING_WORD = "unknown"          # what a sentence or a cell says for a value that is not there

CATEGORY_WORDS = {c.value: text for c, text in (
    (MC.SHARDED_PARAM, "sharded params"), (MC.UNSHARDED_PARAM, "gathered params"),
    (MC.SHARDED_GRAD, "sharded grads"), (MC.UNSHARDED_GRAD, "unsharded grads"),
    (MC.PARAM, "params"), (MC.GRAD, "grads"), (MC.OPTIMIZER_STATE, "optimizer states"), (MC.ACTIVATION, "activations"),
    (MC.TEMPORARY, "temporaries"), (MC.INPUT, "inputs"), (MC.BEFORE_RECORDING, "allocated before recording"),
    (MC.OTHER_THREADS, "other threads (net)"), (MC.OTHER, "other"))}


def category_words(category) -> str:
    """A memory category in words ("optimizer states"); an unknown one with its underscores as spaces."""
    s = str(getattr(category, "value", category))
    return CATEGORY_WORDS.get(s, s.replace("_", " "))


# the stages in words where their names are not words
STAGE_WORDS = {STAGE_OPTIMIZER: "optimizer step", STAGE_POST_STEP: "after the optimizer step",
               STAGE_OUTSIDE: "outside the steps", STAGE_UNKNOWN: "unknown stage", STAGE_DATA: "data (before forward)"}


def stage_words(stage) -> str:
    """A stage in words ("after the optimizer step"); others with their underscores as spaces."""
    s = str(getattr(stage, "value", stage))
    return STAGE_WORDS.get(s, s.replace("_", " "))


def collective_words(collective) -> str:
    """A collective type as words: all_gather -> all-gather, reduce_scatter -> reduce-scatter."""
    return str(getattr(collective, "value", collective)).replace("_", "-")


def fmt_pct(x, missing: str = MISSING_WORD) -> str:
    """A percentage as every output shows it: 43% from 10 %, 7.2% below; ``missing`` for None / NaN."""
    try:
        v = float(x)
    except (TypeError, ValueError):
        return missing
    if math.isnan(v):
        return missing
    return f"{v:.0f}%" if abs(v) >= 10 else f"{v:.1f}%"


def fmt_ms(us: float) -> str:
    """A time given in µs as a sentence says it in milliseconds: 84.4 ms, 1234 ms."""
    ms = us / 1e3
    return f"{ms:.0f} ms" if abs(ms) >= 100 else f"{ms:.3g} ms"
