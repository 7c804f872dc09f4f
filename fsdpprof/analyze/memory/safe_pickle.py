"""Restricted unpickler for CUDA memory snapshots (``torch.cuda.memory._snapshot()`` pickles).

Only builtin containers and scalars (dict, list, tuple, str, bytes, int, float, bool, None) can
be rebuilt: every pickle global (``GLOBAL``/``STACK_GLOBAL``/``INST``/``OBJ``, copyreg extension
codes) and every persistent id is refused *before* anything is looked up, so no callable from a
user's file is ever imported or executed. gzip-compressed pickles are recognised by their magic.
"""
from __future__ import annotations

import contextlib
import gc
import gzip
import io
import os
import pickle
import zlib

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


@contextlib.contextmanager
def gc_paused():
    """Pause the cyclic garbage collector while a block builds many containers that stay alive (an
    unpickled snapshot: ~10^5-10^6 dicts and lists). Otherwise each collection rescans all of them
    for cycles there cannot be (about a third of a 2.5 MiB snapshot's load time). Reference counting
    still frees memory; the collector's previous state is restored."""
    was_enabled = gc.isenabled()
    gc.disable()
    try:
        yield
    finally:
        if was_enabled:
            gc.enable()


def loads(data: bytes, label: str = "<bytes>"):
    """Unpickle ``data`` (plain or gzip) allowing only builtin containers and scalars."""
    if data[:2] == _GZIP_MAGIC:
        try:
            data = gzip.decompress(data)
        except (OSError, EOFError, zlib.error) as exc:
            raise UserError(f"{label}: gzip data is corrupt or truncated ({exc}); copy the file again") from None
    if not data:
        raise UserError(f"{label}: file is empty; expected a pickle from torch.cuda.memory._snapshot()")
    try:
        with gc_paused():
            return _RestrictedUnpickler(io.BytesIO(data), label).load()
    except UserError:
        raise
    except (pickle.UnpicklingError, EOFError, ValueError, TypeError, IndexError, KeyError,
            AttributeError, MemoryError, OverflowError) as exc:
        msg = str(exc).splitlines()[0] if str(exc) else type(exc).__name__
        raise UserError(f"{label}: not a readable pickle (truncated or corrupt: {msg}); "
                        f"expected a file from torch.cuda.memory._dump_snapshot()") from None


def load(path: str | os.PathLike):
    """Read and restricted-unpickle the file at ``path`` (plain or gzip)."""
    label = os.fspath(path)
    try:
        with open(path, "rb") as fh:
            data = fh.read()
    except OSError as exc:
        raise UserError(f"{label}: cannot read ({exc.strerror or exc}); check the path") from None
    return loads(data, label)
