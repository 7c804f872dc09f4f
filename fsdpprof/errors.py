"""The one exception type that the CLI turns into a one-line message and exit code 2."""
from __future__ import annotations

import contextlib


# in the message of a UserError that stands for an unexpected exception (see unexpected_as_user_error)
BUG_MARK = "this is a bug in fsdpprof"


class UserError(Exception):
    """Bad input from the user: the message is one line saying what is wrong and what to do."""

    exit_code = 2


@contextlib.contextmanager
def unexpected_as_user_error(what: str):
    """Last resort at an API boundary (load_trace, load_snapshot, load_run): an exception that is not a
    UserError (a bug, or an input nothing checked) becomes a one-line UserError naming ``what`` (the
    file), chained to the original (``__cause__``) so that tests and the fuzz campaign can tell it apart
    from a checked error.  MemoryError is said as such; KeyboardInterrupt and SystemExit pass."""
    try:
        yield
    except UserError:
        raise
    except MemoryError:
        raise UserError(f"{what}: out of memory while reading it; free memory or analyse fewer ranks at once "
                        f"(--workers 1)") from None
    except Exception as exc:
        detail = (str(exc).splitlines() or [""])[0][:300]
        raise UserError(f"{what} could not be analysed: unexpected {type(exc).__name__}"
                        f"{f' ({detail})' if detail else ''}; {BUG_MARK}, please report it with the file") from exc
