"""The one exception type that the CLI turns into a one-line message and exit code 2."""
from __future__ import annotations

import contextlib

BUG_MARK = "this is a bug in fsdpprof"   # in a UserError that stands for an unexpected exception


class UserError(Exception):
    """Bad input from the user: the message is one line saying what is wrong and what to do."""

    exit_code = 2

    def __init__(self, message: str = "", exit_code: int = 2):
        super().__init__(message)
        self.exit_code = exit_code


@contextlib.contextmanager
def unexpected_as_user_error(what: str):
    """At an API boundary: an exception that is not a UserError (a bug, an input nothing checked) becomes a
    one-line UserError naming ``what``, chained to it (``__cause__``); KeyboardInterrupt and SystemExit pass."""
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
