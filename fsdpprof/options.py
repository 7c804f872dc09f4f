"""The range of every numeric option of every command, in one place (argparse ``type=`` and the Python API).

A value out of range is refused in one line naming the range, before anything runs.  Standard library only:
``collect``'s launcher uses it before the user's job starts."""
from __future__ import annotations

import argparse
import math
import re

from fsdpprof.errors import UserError

SIZE_UNITS = {"": 1, "b": 1, "kb": 10**3, "mb": 10**6, "gb": 10**9, "tb": 10**12,
              "kib": 2**10, "mib": 2**20, "gib": 2**30, "tib": 2**40}
COUNT_UNITS = {"": 1, "k": 10**3, "m": 10**6, "b": 10**9, "g": 10**9, "t": 10**12}


def shown(text, limit: int = 40) -> str:
    """``repr(text)`` cut to ``limit`` characters, for one-line error messages."""
    r = repr(text)
    return r if len(r) <= limit else r[: limit - 4] + "...'"


def _fmt(x) -> str:
    """1000000 -> '1000000', 10**15 -> '1e15', 0.001 -> '0.001'."""
    if isinstance(x, int) and abs(x) <= 10**7:
        return str(x)
    return re.sub(r"e\+?0*", "e", f"{x:g}")


class Number:
    """A number from ``lo`` to ``hi`` (both included), whole when ``whole``; ``units``: suffixes accepted and
    their factors (40GB, 7.5B); ``unit``: what it counts, said in the range.  As argparse ``type=`` it returns
    the value (int when whole) or raises ArgumentTypeError."""

    def __init__(self, lo, hi, *, whole: bool = True, unit: str = "", units: dict | None = None,
                 example: str | None = None):
        self.lo, self.hi, self.whole, self.unit, self.units, self.example = lo, hi, whole, unit, units, example
        self.__name__ = "number"            # (argparse names a type by it)

    def describe(self) -> str:
        """'a whole number from 1 to 1000000', 'a number from 1 to 1e15 parameters (e.g. 7.5e9 or 7.5B)'."""
        return (f"{'a whole number' if self.whole else 'a number'} from {_fmt(self.lo)} to {_fmt(self.hi)}{self.unit}"
                + (f" (e.g. {self.example})" if self.example else ""))

    def check(self, text):
        """The value, or ValueError with what is wrong with ``text`` (a few words)."""
        if isinstance(text, bool):
            raise ValueError("is not a number")
        value = text if isinstance(text, (int, float)) else self._read(str(text))
        if isinstance(value, float) and math.isnan(value):
            raise ValueError("is not a number")
        if value > self.hi or value < self.lo:
            raise ValueError("is too large" if value > self.hi else "is too small")
        if self.whole and value != int(value):
            raise ValueError("is not a whole number")
        return int(value) if self.whole else float(value)

    def _read(self, text: str):
        s = text.strip().replace("_", "").replace(",", "")
        i = len(s)
        while i > 0 and s[i - 1].isalpha():
            i -= 1
        num, suffix = s[:i].strip(), s[i:].lower()
        if not num:
            raise ValueError("is not a number")
        if suffix and not self.units:
            num, suffix = s, ""           # (float() knows 'inf' and 'nan'; anything else: not a number)
        if suffix not in (self.units or {"": 1}):
            raise ValueError(f"has an unknown unit {shown(suffix, 12)} (use {', '.join(u for u in self.units if u)})")
        try:
            value = int(num) if num.lstrip("+-").isdigit() else float(num)   # (int: exact, however long)
        except ValueError:
            raise ValueError("is not a number") from None
        return value * (self.units or {"": 1})[suffix]

    def __call__(self, text):
        try:
            return self.check(text)
        except ValueError as exc:
            raise argparse.ArgumentTypeError(f"{shown(text)} {exc}: give {self.describe()}") from None

    def parse(self, text, what: str):
        """The value of option ``what`` given as ``text``; UserError naming the range otherwise."""
        try:
            return self.check(text)
        except ValueError as exc:
            raise UserError(f"{what} {shown(text)} {exc}: give {self.describe()}") from None


# --- the ranges: far beyond any real job, small enough that everything derived stays a finite number
MAX_WORLD = 10**7                 # ranks
WORLD = Number(1, MAX_WORLD, unit=" ranks", units=COUNT_UNITS, example="8")
RANK = Number(0, MAX_WORLD - 1)
WORKERS = Number(1, 10**6, example="4; it is capped at the ranks and the CPU cores")
# record's profiling window (optimizer steps) and CUDA memory history
SKIP_STEPS = Number(1, 10**9)
WINDOW_STEPS = Number(1, 10**6)            # --warmup-steps, --active-steps
MEMORY_ENTRIES = Number(1, 10**9)
# analysis
TRACE_BYTES = Number(1, 10**15, unit=" bytes", units=SIZE_UNITS, example="8GiB")  # --max-trace-bytes
MEMORY_BYTES = Number(1 << 20, 10**15, unit=" bytes", units=SIZE_UNITS, example="16GiB")  # --max-memory
STEP_NUMBER = Number(0, 10**12)           # compare --iteration N (ProfilerStep#N)
CONNECT_TIMEOUT_S = Number(0.01, 3600, whole=False, unit=" seconds")
DEFAULT_CONNECT_TIMEOUT_S = 10.0
# plan (a model that does not exist yet)
PARAMS = Number(1, 10**15, whole=False, unit=" parameters", units=COUNT_UNITS, example="7.5e9 or 7.5B")
GPU_MEM = Number(1, 10**18, whole=False, unit=" bytes", units=SIZE_UNITS, example="40GB or 80GiB")
COMPRESSION = Number(1, 10**6, whole=False, example="4: a quarter of the gradient bytes")
# whatif
BATCH_SCALE = Number(0.001, 1024, whole=False, example="2 or 0.5")
# the CUDA device of a snapshot (report / compare / whatif --device N|all)
MAX_CUDA_DEVICE = 1 << 14                 # device indices a snapshot may hold (0 .. MAX_CUDA_DEVICE)
CUDA_DEVICE = Number(0, MAX_CUDA_DEVICE, example="1")
ALL_DEVICES = "all"
# demo
MAX_DEMO_NPROC = 16                       # CPU processes per recording (gloo); more only slows the demo down
DEMO_NPROC = Number(1, MAX_DEMO_NPROC)


def _numbers(text, number: Number) -> list[int]:
    """'3, 1' -> [1, 3]: comma-separated values of ``number``; ValueError for an empty item ('', '0,,1')."""
    items = [v.strip() for v in str(text).split(",")]
    if not all(items):
        raise ValueError
    return sorted({number.check(v) for v in items})


def _ranks_hint(text) -> str:
    return (f"{shown(text)} is not a list of ranks: give 'all' or comma-separated ranks, each {RANK.describe()}, "
            f"e.g. 0,1")


def ranks_list(text) -> list[int] | None:
    """record ``--ranks`` (argparse ``type=``): 'all' -> None (every rank), '0,2' -> [0, 2]."""
    try:
        return None if str(text).strip().lower() == "all" else _numbers(text, RANK)
    except ValueError:
        raise argparse.ArgumentTypeError(_ranks_hint(text)) from None


def parse_ranks(value, what: str = "--ranks") -> list[int] | None:
    """:func:`ranks_list` of a string, or a list of ranks, or None (all); UserError otherwise."""
    if value is None or isinstance(value, (list, tuple)) and value and all(
            isinstance(v, int) and not isinstance(v, bool) and 0 <= v <= RANK.hi for v in value):
        return sorted(set(value)) if value is not None else None
    try:
        return ranks_list(value)
    except argparse.ArgumentTypeError:
        raise UserError(f"{what}: {_ranks_hint(value)}") from None


def device_choice(text) -> int | str:
    """``--device``: a CUDA device index (int) or 'all' (every device of a snapshot), as argparse ``type=``."""
    t = str(text).strip().lower()
    try:
        return ALL_DEVICES if t == ALL_DEVICES else CUDA_DEVICE.check(t)
    except ValueError as exc:
        raise argparse.ArgumentTypeError(f"{shown(text)} {exc}: give {CUDA_DEVICE.describe()} (the N of cuda:N) "
                                         f"or '{ALL_DEVICES}'") from None


def parse_device(value, what: str = "--device") -> int | str | None:
    """:func:`device_choice` of a value given another way (the Python API): None (the default), an int or 'all';
    UserError otherwise."""
    if value is None or isinstance(value, int) and not isinstance(value, bool):
        return None if value is None else CUDA_DEVICE.parse(value, what)
    try:
        return device_choice(value)
    except argparse.ArgumentTypeError as exc:
        raise UserError(f"{what} {exc}") from None


def steps_list(text) -> list[int]:
    """timeline ``--steps`` (argparse ``type=``): '2,3' -> [2, 3] (ProfilerStep numbers, each STEP_NUMBER)."""
    try:
        return _numbers(text, STEP_NUMBER)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{shown(text)} is not a list of steps: give comma-separated step numbers, "
                                         f"each {STEP_NUMBER.describe()}, e.g. 2,3") from None


def reshard_after_forward(text):
    """whatif ``--reshard-after-forward``: true | false | a whole number of ranks (FSDP2 resharding)."""
    t = str(text).strip().lower()
    if t in ("true", "yes", "on", "false", "no", "off", "0"):
        return t in ("true", "yes", "on")
    try:
        return WORLD.check(t)
    except ValueError as exc:
        raise argparse.ArgumentTypeError(f"{shown(text)} {exc}: give true, false or {WORLD.describe()}") from None
