"""The cyclic garbage collector paused while a reader builds many objects that hold no cycles (decoding a trace,
unpickling a snapshot): each collection would rescan them all, a third of a snapshot's load time."""
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
