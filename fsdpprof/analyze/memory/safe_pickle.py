"""Restricted unpickler for CUDA memory snapshots (``torch.cuda.memory._snapshot()`` pickles).

Only builtin containers and scalars (dict, list, tuple, str, bytes, int, float, bool, None) can
be rebuilt: every pickle global (``GLOBAL``/``STACK_GLOBAL``/``INST``/``OBJ``, copyreg extension
codes) and every persistent id is refused *before* anything is looked up, so no callable from a
user's file is ever imported or executed. gzip-compressed pickles are recognised by their magic.
"""
from __future__ import annotations

import io
import os
import pickle
import zlib

from fsdpprof.analyze.load.gc_pause import gc_paused
from fsdpprof.errors import UserError

_GZIP_MAGIC = b"\x1f\x8b"


class _RestrictedUnpickler(pickle.Unpickler):
    """The C unpickler with every route to a callable closed."""

    def __init__(self, fh, label: str):
        super().__init__(fh)
        self._label = label

    def find_class(self, module, name):  # noqa: D401 - pickle API
        raise UserError(
            f"{self._label}: refusing to load pickle global {module}.{name!s} (only plain data is allowed "
            f"in a memory snapshot); re-create it with torch.cuda.memory._dump_snapshot()")

    def persistent_load(self, pid):
        raise UserError(
            f"{self._label}: refusing pickle persistent id (only plain data is allowed in a memory snapshot)")



def _gunzip(data: bytes, label: str, max_bytes: int | None) -> bytes:
    """Inflate gzip ``data`` (all members), stopping with a UserError once more than ``max_bytes`` came out."""
    out = []
    total = 0
    try:
        while data:
            d = zlib.decompressobj(wbits=31)
            while not d.eof:
                chunk = d.decompress(data, 64 << 20)
                data = d.unconsumed_tail
                if not chunk and not data:
                    raise EOFError("compressed file ended before the end-of-stream marker was reached")
                total += len(chunk)
                if max_bytes is not None and total > max_bytes:
                    raise UserError(f"{label}: inflates to more than {max_bytes / 2**30:.3g} GiB, the limit for a "
                                    f"memory snapshot; refusing it (load_snapshot(path, max_bytes=N) raises the limit)")
                out.append(chunk)
            data = d.unused_data.lstrip(b"\x00")          # another member, or zero padding
            if data and data[:2] != _GZIP_MAGIC:
                raise zlib.error("data after the end of the gzip stream")
    except (zlib.error, EOFError) as exc:
        raise UserError(f"{label}: gzip data is corrupt or truncated ({exc}); copy the file again") from None
    return b"".join(out)


def loads(data: bytes, label: str = "<bytes>", *, max_bytes: int | None = None):
    """Unpickle ``data`` (plain or gzip) allowing only builtin containers and scalars; a pickle of
    more than ``max_bytes`` (decompressed) is refused."""
    if data[:2] == _GZIP_MAGIC:
        data = _gunzip(data, label, max_bytes)
    elif max_bytes is not None and len(data) > max_bytes:
        raise UserError(f"{label}: {len(data) / 2**30:.3g} GiB is more than the limit for a memory snapshot "
                        f"({max_bytes / 2**30:.3g} GiB); refusing it (load_snapshot(path, max_bytes=N) raises the limit)")
    if not data:
        raise UserError(f"{label}: file is empty; expected a pickle from torch.cuda.memory._snapshot()")
    try:
        with gc_paused():
            return _RestrictedUnpickler(io.BytesIO(data), label).load()
    except UserError:
        raise
    except RecursionError:
        raise UserError(f"{label}: the pickle nests containers too deeply to be a memory snapshot") from None
    except (pickle.UnpicklingError, EOFError, ValueError, TypeError, IndexError, KeyError,
            AttributeError, MemoryError, OverflowError) as exc:
        msg = str(exc).splitlines()[0] if str(exc) else type(exc).__name__
        raise UserError(f"{label}: not a readable pickle (truncated or corrupt: {msg}); "
                        f"expected a file from torch.cuda.memory._dump_snapshot()") from None


def load_sized(path: str | os.PathLike, *, max_bytes: int | None = None) -> tuple[object, int]:
    """(object, bytes of pickle once decompressed) of the file at ``path`` (plain or gzip), restricted-
    unpickled; more than ``max_bytes`` decompressed is refused (checked while inflating)."""
    label = os.fspath(path)
    try:
        with open(path, "rb") as fh:
            data = fh.read()
    except OSError as exc:
        raise UserError(f"{label}: cannot read ({exc.strerror or exc}); check the path") from None
    if data[:2] == _GZIP_MAGIC:
        data = _gunzip(data, label, max_bytes)
    return loads(data, label, max_bytes=max_bytes), len(data)


def load(path: str | os.PathLike, *, max_bytes: int | None = None):
    """Read and restricted-unpickle the file at ``path`` (plain or gzip)."""
    return load_sized(path, max_bytes=max_bytes)[0]
