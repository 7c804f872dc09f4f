"""The ``fsdpprof`` command: maps sub-commands to functions; no business logic here.

Each sub-command module exposes ``add_arguments(parser)`` and ``run(args) -> int``.
A :class:`fsdpprof.errors.UserError` becomes one line on stderr and exit code 2.
"""
from __future__ import annotations

import argparse
import importlib
import os
import signal
import sys

from fsdpprof.version import __version__
from fsdpprof.errors import UserError

# sub-command -> (module, one-line help)
COMMANDS = {
    "record": ("fsdpprof.commands.record", "run a training command and record a run directory"),
    "report": ("fsdpprof.commands.report", "analyse a run directory (or traces/snapshots) into report.html"),
    "compare": ("fsdpprof.commands.compare", "put several runs side by side in compare.html"),
    "overlap": ("fsdpprof.commands.overlap", "per rank, communication overlapped with compute and exposed; per "
                                             "collective, volume and bandwidth"),
    "plan": ("fsdpprof.commands.plan", "per-rank model-state memory and traffic per strategy, before running"),
    "timeline": ("fsdpprof.commands.timeline", "every rank on one clock in one chrome trace (Perfetto), with "
                                               "fsdpprof's steps, stages, FSDP units, exposed communication, "
                                               "memory and findings as tracks"),
    "whatif": ("fsdpprof.commands.whatif", "predict peak memory and step time of a run under another strategy"),
    "demo": ("fsdpprof.commands.demo", "record the built-in CPU example under several strategies and report"),
}


class _Parser(argparse.ArgumentParser):
    """argparse with fsdpprof's error format: one line on stderr (no usage block), exit code 2."""

    def error(self, message: str):
        message = one_line(" ".join(str(message).split()))
        self.exit(2, f"{self.prog}: error: {message}; see `{self.prog} --help`\n")


def one_line(text: str) -> str:
    """``text`` with control characters (a newline in a file name, ...) written as escapes: one line."""
    return "".join(c if c.isprintable() or c == " " else ascii(c)[1:-1] for c in text)


def build_parser(argv: list[str] | None = None) -> argparse.ArgumentParser:
    """The ``fsdpprof`` parser.  With ``argv``, only the sub-command it names gets its module imported and
    its arguments (``fsdpprof --help`` and ``fsdpprof plan`` import no other command, nor pandas or torch);
    without, every sub-command does."""
    parser = _Parser(
        prog="fsdpprof",
        description="Profiler and trace analyzer for PyTorch FSDP training: where memory went, "
                    "how much communication is exposed.",
    )
    parser.add_argument("--version", action="version", version=f"fsdpprof {__version__}")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")
    parser.commands = {}
    # (the top level has no option taking a value: the command is the first argument, when it is one)
    wanted = set(COMMANDS) if argv is None else {argv[0]} & set(COMMANDS) if argv else set()
    for name, (module_name, help_text) in COMMANDS.items():
        p = sub.add_parser(name, help=help_text, description=help_text)
        if name in wanted:
            module = importlib.import_module(module_name)
            module.add_arguments(p)
            p.set_defaults(_module=module)
        parser.commands[name] = p
    return parser


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else list(argv)
    parser = build_parser(argv)
    # `record` passes everything after `--` to the user's command untouched.
    args, unknown = parser.parse_known_args(argv)
    if unknown:  # said by the sub-command's parser: "fsdpprof report: error: ..."
        parser.commands.get(getattr(args, "command", None), parser).error(
            f"unrecognized arguments: {' '.join(unknown)}")
    if not getattr(args, "_module", None):
        parser.print_help(sys.stderr)
        return 2
    real_stdout, sys.stdout = sys.stdout, _WatchedStdout(sys.stdout)
    try:
        code = int(args._module.run(args) or 0)
        sys.stdout.flush()          # (a full disk behind stdout says so here, not at exit)
        return code
    except UserError as exc:
        _say(f"fsdpprof {args.command}: error: {one_line(str(exc))}")
        return exc.exit_code
    except KeyboardInterrupt as exc:        # Ctrl-C; SIGTERM / SIGHUP while outputs are written (Terminated)
        signum = getattr(exc, "signum", signal.SIGINT)
        _say(f"fsdpprof {args.command}: {'interrupted' if signum == signal.SIGINT else 'terminated'}")
        return 128 + signum
    except BrokenPipeError:
        # `fsdpprof report ... | head`: the reader went away; nothing more to say.
        _drop_stdout(real_stdout)
        return 141
    except StdoutError as exc:
        # stdout on a full disk (`> /dev/full`), a closed or revoked terminal, ...: one line, exit 1
        _drop_stdout(real_stdout)
        _say(f"fsdpprof {args.command}: error: cannot write to standard output ({exc.strerror or exc}); "
             f"free space where it goes or redirect it elsewhere")
        return 1
    finally:
        sys.stdout = real_stdout


class StdoutError(OSError):
    """Writing to stdout failed (told apart from the OSErrors of the command's own files)."""


class _WatchedStdout:
    """``sys.stdout`` during a command: the same stream, its write errors raised as StdoutError (a broken
    pipe stays a BrokenPipeError)."""

    def __init__(self, stream):
        self._stream = stream

    def _call(self, fn, *args):
        try:
            return fn(*args)
        except BrokenPipeError:
            raise
        except OSError as exc:
            raise StdoutError(exc.errno, exc.strerror) from None

    def write(self, text):
        return self._call(self._stream.write, text)

    def writelines(self, lines):
        return self._call(self._stream.writelines, lines)

    def flush(self):
        return self._call(self._stream.flush)

    def __getattr__(self, name):
        return getattr(self._stream, name)


def _drop_stdout(stream) -> None:
    """Point ``stream`` (stdout) at /dev/null: what is left in its buffer goes nowhere at exit (no second error)."""
    try:
        devnull = os.open(os.devnull, os.O_WRONLY)
        os.dup2(devnull, stream.fileno())
        os.close(devnull)
    except (OSError, ValueError):
        pass


def _say(line: str) -> None:
    """One line on stderr, unless stderr cannot take it (``2>/dev/full``, closed): the exit code still says it."""
    try:
        print(line, file=sys.stderr, flush=True)
    except (OSError, ValueError):
        pass


if __name__ == "__main__":
    sys.exit(main())
