"""Every command with its stdout or stderr closed (``>&-``, ``2>&-``: daemons, some CI launchers) or on
``/dev/full``: real ``python -m fsdpprof`` processes whose descriptor 1 or 2 is really closed (not /dev/null).
The exit code is the outcome's (a closed stream takes nothing and loses nothing; a full one that stdout needed
is exit 1 with one line), never a traceback; ``record`` returns the job's code, 127 for a missing program."""
from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from conftest import ROOT, shared_data

# every case starts fresh `python -m fsdpprof` processes with a stream closed or full (about 3 minutes on 2 cores)
pytestmark = pytest.mark.slow

DLRM = shared_data("gpu-traces", "param-dlrm-8rank-v100")
TRACE = DLRM / "rank-0.json.gz"
ENV = dict(os.environ, PYTHONPATH=os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")])))


def run_closed(argv: list, cwd: Path, mode: str, timeout: float = 600) -> tuple[int, str, str]:
    """``python -m fsdpprof *argv`` with ``mode``: "stdout closed", "stderr closed", "both closed",
    "stdout full" (/dev/full), "stderr full".  (exit code, stdout, stderr); a closed / full stream reads ''."""
    closed = {"stdout closed": (1,), "stderr closed": (2,), "both closed": (1, 2)}.get(mode, ())
    out_f = err_f = subprocess.PIPE
    full = open("/dev/full", "wb") if mode.endswith("full") else None
    if mode == "stdout full":
        out_f = full
    elif mode == "stderr full":
        err_f = full

    def close_fds():
        for fd in closed:
            os.close(fd)
    try:
        p = subprocess.run([sys.executable, "-m", "fsdpprof", *map(str, argv)], cwd=cwd, env=ENV,
                           stdin=subprocess.DEVNULL, stdout=out_f, stderr=err_f, preexec_fn=close_fds,
                           timeout=timeout)
    finally:
        if full:
            full.close()
    return p.returncode, (p.stdout or b"").decode(errors="replace"), (p.stderr or b"").decode(errors="replace")


def _commands(tmp: Path) -> dict[str, tuple[list, int, list]]:
    """name -> (argv, exit code when nothing stops it, files it must leave)."""
    return {
        "report": (["report", TRACE, "-o", tmp / "r.html"], 0, [tmp / "r.html", tmp / "r.summary.json"]),
        "report --tables": (["report", TRACE, "-o", tmp / "t.html", "--tables", tmp / "tables"], 0,
                            [tmp / "tables" / "tables.json"]),
        "overlap": (["overlap", TRACE], 0, []),
        "plan": (["plan", "--params", "7B", "--world", "8"], 0, []),
        "plan --json": (["plan", "--params", "7B", "--world", "8", "--json"], 0, []),
        "timeline": (["timeline", DLRM, "-o", tmp / "t.json.gz"], 0, [tmp / "t.json.gz"]),
        "compare": (["compare", DLRM, TRACE, "-o", tmp / "c.html"], 0, [tmp / "c.html"]),
        "--help": (["--help"], 0, []),
        "--version": (["--version"], 0, []),
        "plan --help": (["plan", "--help"], 0, []),
        "bad input": (["report", tmp / "no-such-run"], 2, []),
        "record, job exits 7": (["record", "--out", tmp / "rec", "--", sys.executable, "-c",
                                 "import sys; print('job'); sys.exit(7)"], 7, [tmp / "rec" / "run.json"]),
    }


def _fresh(tmp: Path) -> None:
    for p in list(tmp.iterdir()):
        if p.is_dir():
            shutil.rmtree(p)
        else:
            p.unlink()


@pytest.mark.parametrize("mode", ["stdout closed", "stderr closed"])
def test_every_command_with_a_closed_stream(tmp_path, mode):
    failures = []
    for name, (argv, code, leaves) in _commands(tmp_path).items():
        _fresh(tmp_path)
        rc, out, err = run_closed(argv, tmp_path, mode)
        said = out + err
        if rc != code or "Traceback" in said or "Exception ignored" in said:
            failures.append(f"{name}: exit {rc} (want {code}): {said[-300:]!r}")
        failures += [f"{name}: {p} not written" for p in leaves if not p.exists()]
        if mode == "stderr closed" and code == 0 and name not in ("--help", "--version", "plan --help") \
                and not name.startswith("record") and not out.strip():
            failures.append(f"{name}: nothing on stdout")
        if mode == "stdout closed" and code == 2 and err.count("\n") != 1:
            failures.append(f"{name}: not one line on stderr: {err!r}")
    assert failures == []


def test_record_returns_the_jobs_code_with_both_streams_closed(tmp_path):
    rc, _, _ = run_closed(["record", "--out", tmp_path / "rec", "--", sys.executable, "-c",
                           "import sys; print('job'); print('err', file=sys.stderr); sys.exit(7)"],
                          tmp_path, "both closed")
    assert rc == 7
    assert json.loads((tmp_path / "rec" / "run.json").read_text())["exit_code"] == 7


@pytest.mark.parametrize("what,code", [("missing", 127), ("not executable", 126)])
def test_record_of_a_program_that_cannot_start_exits_as_a_shell(tmp_path, what, code):
    program = tmp_path / "prog"
    if what == "not executable":
        program.write_text("#!/bin/sh\nexit 0\n")
        program.chmod(0o644)                  # (no execute bit at all: execve refuses, root too)
    p = subprocess.run([sys.executable, "-m", "fsdpprof", "record", "--out", str(tmp_path / "rec"), "--",
                        str(program)], cwd=tmp_path, env=ENV, capture_output=True, text=True, timeout=120)
    assert p.returncode == code, p.stderr
    assert "could not start" in p.stderr and "Traceback" not in p.stderr
    assert json.loads((tmp_path / "rec" / "run.json").read_text())["exit_code"] == code


@pytest.mark.parametrize("name", ["report", "overlap", "plan", "plan --json", "timeline", "compare", "--help",
                                  "--version", "plan --help"])
def test_stdout_on_a_full_disk_is_one_line_exit_1(tmp_path, name):
    argv, _, _ = _commands(tmp_path)[name]
    rc, _, err = run_closed(argv, tmp_path, "stdout full")
    lines = err.strip().splitlines()
    assert rc == 1 and len(lines) == 1 and "cannot write to standard output" in lines[0], err


@pytest.mark.parametrize("name", ["report", "plan", "bad input", "record, job exits 7"])
def test_stderr_on_a_full_disk_keeps_the_outcome(tmp_path, name):
    argv, code, leaves = _commands(tmp_path)[name]
    rc, out, _ = run_closed(argv, tmp_path, "stderr full")
    assert rc == code and "Traceback" not in out and all(p.exists() for p in leaves)


@pytest.mark.slow
def test_whatif_and_demo_with_stdout_closed(tmp_path, recorded_run):
    run = recorded_run("fsdp2")
    for mode in ("stdout closed", "stderr closed"):
        rc, out, err = run_closed(["whatif", run], tmp_path, mode)
        assert rc == 0 and "Traceback" not in out + err, (mode, err[-500:])
    rc, out, err = run_closed(["demo", "--out", tmp_path / "demo", "--strategies", "fsdp2:2"], tmp_path,
                              "stdout closed", timeout=900)
    assert rc == 0 and "Traceback" not in err, err[-2000:]
    assert (tmp_path / "demo" / "compare.html").exists() or list((tmp_path / "demo").glob("report*.html"))
