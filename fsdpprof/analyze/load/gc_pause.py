"""One context manager: the cyclic garbage collector paused while a reader builds many objects.

Decoding a trace or unpickling a snapshot makes 10^4-10^6 containers that stay alive and hold no
cycles; each collection the allocations trigger rescans them (and every module object of numpy and
pandas) for cycles there cannot be: about a third of a 2.5 MiB snapshot's load time, 15-19 % of
loading DLRM's eight traces. Reference counting still frees memory while paused; the collector's
previous state is restored on exit.
"""
from __future__ import annotations

import contextlib
import gc


@contextlib.contextmanager
def gc_paused():
    """Pause the cyclic garbage collector for the block (process-wide), then restore its state."""
    was_enabled = gc.isenabled()
    gc.disable()
    try:
        yield
    finally:
        if was_enabled:
            gc.enable()
