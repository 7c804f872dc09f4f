"""msgspec, imported without typing_extensions where that changes nothing: a quick command's start-up.

msgspec's first import pulls in typing_extensions -- and with it ``inspect``, ``ast``, ``dis`` and
``tokenize``: ~20 ms of a cold ``fsdpprof overlap`` on the 2-core machine we measure on -- for two things,
each with a fallback to ``typing`` when that import fails: ``get_type_hints`` (which msgspec always calls
with ``include_extras=True``) and ``Required`` / ``NotRequired``.  From Python 3.11 on the fallback is the
same thing: typing_extensions' ``Required`` / ``NotRequired`` are typing's own objects, and its
``get_type_hints(..., include_extras=True)`` returns typing's result untouched (it post-processes only on
3.10, or without ``include_extras``).  So on 3.11+, when neither module is imported yet and no other thread
could be importing, msgspec is imported with typing_extensions hidden for that moment; whatever imports
typing_extensions afterwards gets the real module.  A msgspec that needs it after all (an ImportError) is
imported again the normal way.
"""
from __future__ import annotations

import sys


def import_msgspec():
    """The msgspec module, imported once (see the module docstring for how)."""
    mod = sys.modules.get("msgspec")
    if mod is not None:
        return mod
    threading = sys.modules.get("threading")
    if (sys.version_info < (3, 11) or "typing_extensions" in sys.modules
            or (threading is not None and threading.active_count() > 1)):
        import msgspec
        return msgspec
    sys.modules["typing_extensions"] = None        # `import typing_extensions` raises ImportError meanwhile
    try:
        import msgspec
    except ImportError:                            # a msgspec that needs it: import it the normal way
        for name in [n for n in sys.modules if n == "msgspec" or n.startswith("msgspec.")]:
            del sys.modules[name]
        del sys.modules["typing_extensions"]
        import msgspec
    finally:
        if "typing_extensions" in sys.modules and sys.modules["typing_extensions"] is None:
            del sys.modules["typing_extensions"]
    return msgspec
