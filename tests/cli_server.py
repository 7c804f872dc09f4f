"""A fork server for the suite's CLI calls: ``fsdpprof report / compare / plan / whatif / overlap`` run as
real processes of their own (own exit code, own stdout and stderr, own cwd), forked from one process per
pytest worker that has already imported fsdpprof, pandas and plotly, instead of a new interpreter each.

Why: the suite runs about 200 CLI commands; a fresh ``python -m fsdpprof report`` spends ~0.2 s starting
Python and ~0.7 s importing pandas and fsdpprof's analysis before it reads a byte.  A forked child starts
with those modules imported and nothing else: no command has run in the server, so no cache, warning
registry or option of an earlier command is carried into the next (each child is a fresh fork of the
same untouched server).  What a child does not share with a fresh interpreter: modules it would not have
imported (tests of what a command imports run ``python -X importtime`` themselves) and the process's
start (interpreter flags and environment variables read at start-up are the server's: a call whose
environment differs in those is run as a plain subprocess, see ``needs_fresh_process``).

The protocol: one JSON line per call on the server's stdin (argv, cwd, env, files for stdin/stdout/stderr,
timeout), one JSON line back on its stdout ({"returncode": N} or {"timeout": true}).  The server answers
calls one at a time (each pytest worker has its own server and runs one test at a time).
"""
from __future__ import annotations

import json
import os
import subprocess
import sys
import tempfile
import threading
from pathlib import Path

# environment variables that Python, numpy or torch read when they start or import, not when a command runs
START_UP_PREFIXES = ("PYTHON", "OMP_", "MKL_", "OPENBLAS_", "NUMEXPR_", "LC_", "LANG", "TZ")

SERVER = r'''
import json, os, select, signal, sys
chan_in = os.fdopen(os.dup(0), "rb", buffering=0)
chan_out = os.fdopen(os.dup(1), "wb", buffering=0)
null = os.open(os.devnull, os.O_RDWR)
os.dup2(null, 0); os.dup2(null, 1)
import atexit, runpy, threading
import fsdpprof.cli
for name in ("fsdpprof.commands.report", "fsdpprof.commands.compare", "fsdpprof.commands.whatif",
             "fsdpprof.commands.overlap", "fsdpprof.commands.plan", "fsdpprof.analyze.pipeline",
             "fsdpprof.report.run_page", "fsdpprof.report.compare_page", "fsdpprof.report.summary", "fsdpprof.report.text"):
    __import__(name)


def child(req):
    os.chdir(req["cwd"])
    os.environ.clear()
    os.environ.update(req["env"])
    for fd, path, flags in ((0, req["stdin"] or os.devnull, os.O_RDONLY),
                            (1, req["stdout"], os.O_WRONLY | os.O_TRUNC),
                            (2, req["stderr"], os.O_WRONLY | os.O_TRUNC)):
        f = os.open(path, flags)
        os.dup2(f, fd)
        os.close(f)
    chan_in.close(); chan_out.close()
    sys.argv = ["-m", *req["argv"]]
    code = 0
    try:
        runpy.run_module("fsdpprof", run_name="__main__", alter_sys=True)   # what `python -m fsdpprof` runs
    except SystemExit as exc:                               # as the interpreter reads SystemExit
        if exc.code is None:
            code = 0
        elif isinstance(exc.code, int):
            code = exc.code
        else:
            print(exc.code, file=sys.stderr)
            code = 1
    except BaseException:                                   # an uncaught exception: traceback, exit 1
        sys.excepthook(*sys.exc_info())
        code = 1
    try:                                                    # the interpreter's shutdown
        threading._shutdown()
        atexit._run_exitfuncs()
        sys.stdout.flush(); sys.stderr.flush()
    finally:
        os._exit(code & 0xFF)


while True:
    line = chan_in.readline()
    if not line:
        break
    req = json.loads(line)
    sys.stdout.flush(); sys.stderr.flush()
    pid = os.fork()
    if pid == 0:
        child(req)
    pidfd = os.pidfd_open(pid)
    ready, _, _ = select.select([pidfd], [], [], req["timeout"])
    if not ready:
        os.kill(pid, signal.SIGKILL)
    _, status = os.waitpid(pid, 0)
    os.close(pidfd)
    answer = {"timeout": True} if not ready else {"returncode": os.waitstatus_to_exitcode(status)}
    chan_out.write((json.dumps(answer) + "\n").encode())
'''


def needs_fresh_process(env: dict, base_env: dict) -> bool:
    """A call whose environment differs from the server's in a variable read at start-up."""
    keys = set(env) | set(base_env)
    return any(k.startswith(START_UP_PREFIXES) and env.get(k) != base_env.get(k) for k in keys)


class ForkServer:
    """One per process (pytest worker); started on first use, stopped at exit."""

    def __init__(self, env: dict):
        self.env = dict(env)
        self.proc: subprocess.Popen | None = None
        self.lock = threading.Lock()

    def _start(self) -> subprocess.Popen:
        if self.proc is None or self.proc.poll() is not None:
            self.proc = subprocess.Popen([sys.executable, "-c", SERVER], stdin=subprocess.PIPE,
                                         stdout=subprocess.PIPE, env=self.env)
        return self.proc

    def run(self, args, cwd, env: dict, input: str | None, timeout: float) -> subprocess.CompletedProcess:
        """Like ``subprocess.run([python, -m, fsdpprof, *args], capture_output=True, text=True)``."""
        with self.lock, tempfile.TemporaryDirectory(prefix="fsdpprof-cli-") as tmp:
            files = {k: os.path.join(tmp, k) for k in ("stdin", "stdout", "stderr")}
            for k in ("stdout", "stderr"):
                open(files[k], "w").close()
            if input is not None:
                with open(files["stdin"], "w") as fh:
                    fh.write(input)
            req = {"argv": list(args), "cwd": str(cwd or os.getcwd()), "env": env, "timeout": timeout,
                   "stdin": files["stdin"] if input is not None else None,
                   "stdout": files["stdout"], "stderr": files["stderr"]}
            proc = self._start()
            proc.stdin.write((json.dumps(req) + "\n").encode())
            proc.stdin.flush()
            line = proc.stdout.readline()
            if not line:
                raise RuntimeError("the suite's CLI fork server died (tests/cli_server.py)")
            answer = json.loads(line)
            out, err = (Path(files[k]).read_text(encoding="utf-8", errors="replace") for k in ("stdout", "stderr"))
            cmd = [sys.executable, "-m", "fsdpprof", *args]
            if answer.get("timeout"):
                raise subprocess.TimeoutExpired(cmd, timeout, output=out, stderr=err)
            return subprocess.CompletedProcess(cmd, answer["returncode"], out, err)

    def close(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.stdin.close()
            self.proc.wait(timeout=30)
