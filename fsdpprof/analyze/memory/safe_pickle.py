"""Restricted unpickler for CUDA memory snapshots: only builtin containers and scalars are rebuilt; every pickle
global and persistent id is refused before anything is looked up.  Plain or gzip files, read as a stream."""
from __future__ import annotations

import io
import os
import pickle
import zlib

from fsdpprof.analyze.load.gc_pause import gc_paused
from fsdpprof.errors import UserError

_GZIP_MAGIC = b"\x1f\x8b"
PIECE_BYTES = 1 << 20          # bytes per read of the file, per inflate call and per piece of a long read
PEEK_BYTES = 1 << 17           # the unpickler's window on the file (what peek gives)
LINE_MAX_BYTES = 64 << 20      # longest line a text-protocol pickle may hold
ITEM_MAX_BYTES = 256 << 20     # longest string / bytes / frame a snapshot's pickle may hold (real ones: under 1 MiB)
_RAISE_LIMIT = "refusing it (load_snapshot(path, max_bytes=N) raises the limit)"


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


class _GunzipRaw(io.RawIOBase):
    """gzip ``fh`` (all members, zero padding after them allowed) inflated as it is read; more than ``max_bytes``
    out, or corrupt / truncated data: UserError.  ``total``: bytes inflated so far."""

    def __init__(self, fh, label: str, max_bytes: int | None) -> None:
        super().__init__()
        self._pieces = self._inflate(fh, label, max_bytes)
        self._left = memoryview(b"")
        self.total = 0

    def readable(self) -> bool:
        return True

    def readinto(self, b) -> int:
        while not self._left:
            piece = next(self._pieces, None)
            if piece is None:
                return 0
            self._left = memoryview(piece)
        n = min(len(b), len(self._left))
        b[:n] = self._left[:n]
        self._left = self._left[n:]
        return n

    def _inflate(self, fh, label: str, max_bytes: int | None):
        data = b""
        try:
            while True:
                d = zlib.decompressobj(wbits=31)
                while not d.eof:
                    if not data:
                        data = fh.read(PIECE_BYTES)
                        if not data:
                            raise EOFError("compressed file ended before the end-of-stream marker was reached")
                    piece = d.decompress(data, PIECE_BYTES)
                    data = d.unconsumed_tail
                    self.total += len(piece)
                    if max_bytes is not None and self.total > max_bytes:
                        raise UserError(f"{label}: inflates to more than {max_bytes / 2**30:.3g} GiB, the limit for a "
                                        f"memory snapshot; {_RAISE_LIMIT}")
                    if piece:
                        yield piece
                data = d.unused_data.lstrip(b"\x00")           # another member, or zero padding
                while not data or len(data) < 2 and data == _GZIP_MAGIC[:1]:
                    more = fh.read(PIECE_BYTES)
                    if not more:
                        break
                    data = (data + more).lstrip(b"\x00")
                if not data:
                    return
                if data[:2] != _GZIP_MAGIC:
                    raise zlib.error("data after the end of the gzip stream")
        except (zlib.error, EOFError) as exc:
            raise UserError(f"{label}: gzip data is corrupt or truncated ({exc}); copy the file again") from None


class _Stream:
    """A snapshot file as the unpickler reads it, plain or inflated as read: taken in windows of PEEK_BYTES, and a
    length a corrupt pickle claims is checked and read in pieces, never allocated ahead of the bytes there."""

    def __init__(self, fh, gz: bool, label: str, max_bytes: int | None) -> None:
        self.raw = _GunzipRaw(fh, label, max_bytes) if gz else fh
        self.file = io.BufferedReader(self.raw, PEEK_BYTES)
        self.peek = self.file.peek

    def readinto(self, b) -> int:
        _check_item(len(b))
        return self.file.readinto(b)

    def read(self, n: int = -1) -> bytes:
        if 0 <= n <= PIECE_BYTES:
            return self.file.read(n)
        _check_item(n)
        pieces = []
        while n != 0:
            piece = self.file.read(PIECE_BYTES if n < 0 else min(n, PIECE_BYTES))
            if not piece:
                break
            pieces.append(piece)
            n -= len(piece) if n > 0 else 0
        return b"".join(pieces)

    def readline(self, n: int = -1) -> bytes:
        return self.file.readline(LINE_MAX_BYTES if n < 0 else min(n, LINE_MAX_BYTES))

    def drain(self) -> int:
        """Read the rest (checking it, as inflating does); the bytes read in all."""
        while self.file.read(PIECE_BYTES):
            pass
        return self.raw.total if isinstance(self.raw, _GunzipRaw) else self.raw.tell()


def _check_item(nbytes: int) -> None:
    """Refuse a read of more than ITEM_MAX_BYTES for one item before anything is read."""
    if nbytes > ITEM_MAX_BYTES:
        raise pickle.UnpicklingError(f"an item of {nbytes:,} bytes, more than a memory snapshot holds "
                                     f"({ITEM_MAX_BYTES >> 20} MiB)")


def load_sized(path: str | os.PathLike, *, max_bytes: int | None = None) -> tuple[object, int]:
    """(object, bytes of pickle once decompressed) of the file at ``path``, restricted-unpickled as it is read;
    more than ``max_bytes`` decompressed is refused (a plain file by its size, a gzip one while inflating)."""
    label = os.fspath(path)
    try:
        with open(path, "rb", buffering=0) as fh:
            size = os.fstat(fh.fileno()).st_size
            gz = size >= 2 and fh.read(2) == _GZIP_MAGIC
            fh.seek(0)
            if not gz and max_bytes is not None and size > max_bytes:
                raise UserError(f"{label}: {size / 2**30:.3g} GiB is more than the limit for a memory snapshot "
                                f"({max_bytes / 2**30:.3g} GiB); {_RAISE_LIMIT}")
            stream = _Stream(fh, gz, label, max_bytes)
            if not stream.peek(1):
                raise UserError(f"{label}: file is empty; expected a pickle from torch.cuda.memory._snapshot()")
            with gc_paused():
                obj = _RestrictedUnpickler(stream, label).load()
            return obj, stream.drain()
    except UserError:
        raise
    except RecursionError:
        raise UserError(f"{label}: the pickle nests containers too deeply to be a memory snapshot") from None
    except OSError as exc:
        raise UserError(f"{label}: cannot read ({exc.strerror or exc}); check the path") from None
    except (pickle.UnpicklingError, EOFError, ValueError, TypeError, IndexError, KeyError,
            AttributeError, MemoryError, OverflowError) as exc:
        msg = str(exc).splitlines()[0] if str(exc) else type(exc).__name__
        raise UserError(f"{label}: not a readable pickle (truncated or corrupt: {msg}); "
                        f"expected a file from torch.cuda.memory._dump_snapshot()") from None


def load(path: str | os.PathLike, *, max_bytes: int | None = None):
    """Read and restricted-unpickle the file at ``path`` (plain or gzip)."""
    return load_sized(path, max_bytes=max_bytes)[0]
