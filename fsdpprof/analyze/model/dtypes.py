"""Element dtypes and byte sizes: the one table of dtype spellings and the one formatter of bytes."""
from __future__ import annotations

import functools
import re

from fsdpprof.errors import UserError
from fsdpprof.options import shown

__all__ = ["dtype_size", "dtype_bytes", "fmt_bytes", "LOW_PRECISION", "kernel_precisions"]

# spellings (traces, torch, the CLI) -> (torch name, bytes per element)
_DTYPES = {
    "float": ("float32", 4), "float32": ("float32", 4), "floatfloat": ("float32", 4), "fp32": ("float32", 4),
    "tf32": ("float32", 4), "double": ("float64", 8), "float64": ("float64", 8), "fp64": ("float64", 8),
    "half": ("float16", 2), "c10::half": ("float16", 2), "float16": ("float16", 2), "fp16": ("float16", 2),
    "bfloat16": ("bfloat16", 2), "c10::bfloat16": ("bfloat16", 2), "bf16": ("bfloat16", 2),
    "int": ("int32", 4), "int32": ("int32", 4),
    "long": ("int64", 8), "long int": ("int64", 8), "int64": ("int64", 8),
    "short": ("int16", 2), "short int": ("int16", 2), "int16": ("int16", 2),
    "byte": ("uint8", 1), "unsigned char": ("uint8", 1), "uint8": ("uint8", 1),
    "char": ("int8", 1), "signed char": ("int8", 1), "int8": ("int8", 1),
    "bool": ("bool", 1),
    "float8": ("float8_e4m3fn", 1), "fp8": ("float8_e4m3fn", 1),
    "float8_e4m3fn": ("float8_e4m3fn", 1), "c10::float8_e4m3fn": ("float8_e4m3fn", 1),
    "float8_e5m2": ("float8_e5m2", 1), "c10::float8_e5m2": ("float8_e5m2", 1),
}


def dtype_size(value) -> tuple[str | None, float]:
    """(torch dtype name, bytes per element) of a dtype spelling (``torch.bfloat16``, ``c10::Half``, ``bf16``);
    (the text, NaN) when unknown, (None, NaN) for a non-string."""
    if not isinstance(value, str):
        return None, float("nan")
    key = value.strip().lower()
    if key.startswith("torch."):
        key = key[6:]
    name, size = _DTYPES.get(key, (value, float("nan")))
    return name, float(size)


def dtype_bytes(dtype) -> int:
    """Bytes per element of a dtype spelling ('bf16', 'torch.float32', 'float16', ...); an unknown one is a
    UserError (the one policy: no size is guessed)."""
    _, size = dtype_size(str(dtype))
    if size != size:
        raise UserError(f"unknown dtype {shown(dtype)}: use one of fp32, bf16, fp16, fp8, fp64")
    return int(size)


# low-precision element types a kernel's name spells (templates, cuBLAS/cutlass/TRT-LLM tile names): short name ->
# pattern (case-insensitive); "bfloat16" must not read as fp16, so fp16 excludes a leading "b"
LOW_PRECISION = {
    "bf16": r"bfloat16|bf16",
    "fp16": r"(?<!b)float16|(?<![a-z])half(?![a-z])|__half|fp16|f16(?![0-9])(?<!bf16)",
    "fp8": r"e4m3|e5m2|float8|fp8",
    "fp4": r"e2m1|fp4",
}
_LOW_PRECISION_RE = {k: re.compile(v, re.IGNORECASE) for k, v in LOW_PRECISION.items()}


@functools.lru_cache(maxsize=1 << 16)       # a worker sees the same kernel names rank after rank
def kernel_precisions(name: str) -> tuple[str, ...]:
    """The low-precision element types (LOW_PRECISION's short names) a kernel's name spells, in LOW_PRECISION's
    order; () when it names none (a float32 kernel, or a name that does not say)."""
    return tuple(k for k, rx in _LOW_PRECISION_RE.items() if rx.search(str(name)))


_BINARY_UNITS = (("GiB", 2.0 ** 30), ("MiB", 2.0 ** 20), ("KiB", 2.0 ** 10))
_DECIMAL_UNITS = (("GB", 1e9), ("MB", 1e6), ("kB", 1e3))


def fmt_bytes(x, *, missing: str = "-", decimal: bool = False) -> str:
    """Bytes as text, the one formatter of every output: GiB / MiB / KiB (``decimal``: GB / MB / kB) at three
    significant digits, whole bytes below; ``missing`` for None, NaN or a non-number."""
    try:
        v = float(x)
    except (TypeError, ValueError):
        return missing
    if v != v:
        return missing
    for unit, scale in _DECIMAL_UNITS if decimal else _BINARY_UNITS:
        if abs(v) >= scale:
            m = v / scale
            a = abs(m)
            return f"{m:,.0f} {unit}" if a >= 100 else f"{m:.1f} {unit}" if a >= 10 else f"{m:.2f} {unit}"
    return f"{v:.0f} B"
