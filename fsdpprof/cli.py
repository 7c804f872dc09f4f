"""The ``fsdpprof`` command: maps sub-commands to their modules (``add_arguments(parser)``, ``run(args) -> int``).

A :class:`fsdpprof.errors.UserError` becomes one line on stderr and exit code 2."""
from __future__ import annotations

import argparse
import importlib
import os
import signal
import sys

from fsdpprof.errors import UserError
from fsdpprof.version import __version__

COMMANDS = {  # sub-command -> one-line help (its module: fsdpprof.commands.<name>)
    "record": "run a training command and record a run directory",
    "report": "analyse a run directory (or traces/snapshots) into report.html",
    "compare": "put several runs side by side in compare.html",
    "overlap": "per rank, communication overlapped with compute and exposed; per collective, volume and bandwidth",
    "plan": "per-rank model-state memory and traffic per strategy, before running",
    "timeline": "every rank on one clock in one chrome trace (Perfetto), with fsdpprof's steps, stages, FSDP units, "
                "exposed communication, memory and findings as tracks",
    "whatif": "predict peak memory and step time of a run under another strategy",
    "demo": "record the built-in CPU example under several strategies and report",
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
    """The ``fsdpprof`` parser.  With ``argv``, only the sub-command it names imports its module and gets its
    arguments (``fsdpprof --help`` and ``plan`` import no other command, nor pandas or torch); without, all do."""
    parser = _Parser(prog="fsdpprof", description="Profiler and trace analyzer for PyTorch FSDP training: where "
                                                  "memory went, how much communication is exposed.")
    parser.add_argument("--version", action="version", version=f"fsdpprof {__version__}")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")
    parser.commands = {}
    # (the top level has no option taking a value: the command is the first argument, when it is one)
    wanted = set(COMMANDS) if argv is None else set(argv[:1]) & set(COMMANDS)
    for name, help_text in COMMANDS.items():
        p = parser.commands[name] = sub.add_parser(name, help=help_text, description=help_text)
        if name in wanted:
            module = importlib.import_module(f"fsdpprof.commands.{name}")
            module.add_arguments(p)
            p.set_defaults(_module=module)
    return parser


def main(argv: list[str] | None = None) -> int:
    _fill_closed_streams()
    argv = sys.argv[1:] if argv is None else list(argv)
    real_stdout, sys.stdout = sys.stdout, _WatchedStdout(sys.stdout)
    real_stderr, sys.stderr = sys.stderr, _QuietStderr(sys.stderr)
    command = None
    try:
        try:
            parser = build_parser(argv)
            # `record` passes everything after `--` to the user's command untouched.
            args, unknown = parser.parse_known_args(argv)
            if unknown:  # said by the sub-command's parser: "fsdpprof report: error: ..."
                parser.commands.get(getattr(args, "command", None), parser).error(
                    f"unrecognized arguments: {' '.join(unknown)}")
        except SystemExit:                  # --help, --version, a bad command line (said on stderr): argparse's
            sys.stdout.check()              # exit, once what it wrote on stdout is known to be there
            raise
        if not getattr(args, "_module", None):
            parser.print_help(sys.stderr)
            return 2
        command = args.command
        code = int(args._module.run(args) or 0)
        sys.stdout.check()          # (a full disk behind stdout says so here, not at exit)
        return code
    except UserError as exc:
        _say(f"{_who(command)}: error: {one_line(str(exc))}")
        return exc.exit_code
    except KeyboardInterrupt as exc:        # Ctrl-C; SIGTERM / SIGHUP while outputs are written (Terminated)
        signum = getattr(exc, "signum", signal.SIGINT)
        _say(f"{_who(command)}: {'interrupted' if signum == signal.SIGINT else 'terminated'}")
        return 128 + signum
    except BrokenPipeError:             # `fsdpprof report ... | head`: the reader went away
        _drop_stdout(real_stdout)
        return 141
    except StdoutError as exc:          # stdout on a full disk (`> /dev/full`), a closed terminal, ...
        _drop_stdout(real_stdout)
        _say(f"{_who(command)}: error: cannot write to standard output "
             f"({exc.strerror or exc}); free space where it goes or redirect it elsewhere")
        return 1
    finally:
        sys.stdout, sys.stderr = real_stdout, real_stderr
        for stream in (real_stdout, real_stderr):   # what they still hold: now, not at exit (a failure there
            try:                                    # would change the exit code and print a traceback)
                stream.flush()
            except (OSError, ValueError, AttributeError):
                _drop_stdout(stream)


def _who(command: str | None) -> str:
    return f"fsdpprof {command}" if command else "fsdpprof"


def _fill_closed_streams() -> None:
    """Standard streams closed by the caller (``>&-``, ``2>&-``, a daemon): /dev/null in their place, so that
    what is said there goes nowhere (the exit code still says the outcome), no file fsdpprof opens takes their
    descriptor (and with it a job's output), and ``sys.stdout`` / ``sys.stderr`` are streams."""
    for fd, name, mode in ((0, "stdin", "r"), (1, "stdout", "w"), (2, "stderr", "w")):
        filled = False
        try:
            os.fstat(fd)
        except OSError:
            try:
                null = os.open(os.devnull, os.O_RDWR)
            except OSError:
                continue
            if null != fd:
                os.dup2(null, fd)
                os.close(null)
            filled = True
        if getattr(sys, name) is None:      # closed at start-up: the descriptor is ours now, or (taken by a file
            try:                            # opened since) not the stream's: /dev/null on a descriptor of its own
                setattr(sys, name, open(fd if filled else os.devnull, mode, encoding="utf-8",
                                        errors="backslashreplace", closefd=not filled))
            except OSError:
                pass


class StdoutError(OSError):
    """Writing to stdout failed (told apart from the OSErrors of the command's own files)."""


class _WatchedStdout:
    """``sys.stdout`` during a command: the same stream, its write errors raised as StdoutError (a broken pipe
    stays a BrokenPipeError)."""

    def __init__(self, stream):
        self._stream = stream
        self.failed: OSError | None = None      # the first write error, even one a caller swallowed (argparse)

    def __getattr__(self, name):
        attr = getattr(self._stream, name)
        if name not in ("write", "writelines", "flush"):
            return attr

        def watched(*args):
            try:
                return attr(*args)
            except BrokenPipeError as exc:
                self.failed = self.failed or exc
                raise
            except OSError as exc:
                self.failed = self.failed or StdoutError(exc.errno, exc.strerror)
                raise StdoutError(exc.errno, exc.strerror) from None
        return watched

    def check(self) -> None:
        """Flush; raise the first write error, also one that a caller caught."""
        self.flush()
        if self.failed is not None:
            raise self.failed


class _QuietStderr:
    """``sys.stderr`` during a command: the same stream; a write or flush it cannot take (``2>/dev/full``) is
    dropped: what stderr cannot take cannot be said, and the exit code still says the outcome."""

    def __init__(self, stream):
        self._stream = stream

    def __getattr__(self, name):
        attr = getattr(self._stream, name)
        if name not in ("write", "writelines", "flush"):
            return attr

        def quiet(*args):
            try:
                return attr(*args)
            except (OSError, ValueError):
                return len(args[0]) if name == "write" and args else None
        return quiet


def _drop_stdout(stream) -> None:
    """Point ``stream`` (stdout, or stderr) at /dev/null: what is left in its buffer goes nowhere at exit (no
    second error)."""
    try:
        devnull = os.open(os.devnull, os.O_WRONLY)
        os.dup2(devnull, stream.fileno())
        os.close(devnull)
    except (OSError, ValueError, AttributeError):
        pass


def _say(line: str) -> None:
    """One line on stderr, unless stderr cannot take it (``2>/dev/full``, closed): the exit code still says it."""
    try:
        print(line, file=sys.stderr, flush=True)
    except (OSError, ValueError):
        pass
