"""The suite's CLI fork server (tests/cli_server.py) gives what a fresh ``python -m fsdpprof`` gives: the
same exit code, stdout and stderr, the call's own folder and environment, a timeout as subprocess.run's."""
from __future__ import annotations

import os
import subprocess
import sys

import pytest

import cli_server
from conftest import _cli_env, run_fsdpprof


def fresh(*args, cwd):
    return subprocess.run([sys.executable, "-m", "fsdpprof", *args], cwd=cwd, env=_cli_env(),
                          capture_output=True, text=True, timeout=120)


@pytest.mark.parametrize("args", [
    ("plan", "--params", "7.5e9", "--world", "8", "--json"),        # exit 0, stdout
    ("plan", "--params", "1e400", "--world", "8"),                  # a UserError: exit 2, one line
    ("report", "/dev/null"),                            # refused after the command's imports
    ("report", "missing-folder"),                       # a path relative to the call's folder
    ("--version",),                                                 # argparse's SystemExit(0)
    ("nosuchcommand",),                                             # argparse's error: exit 2
    (),                                                             # the help on stderr, exit 2
])
def test_forked_call_is_the_fresh_process(tmp_path, args):
    forked = run_fsdpprof(*args, cwd=tmp_path)
    plain = fresh(*args, cwd=tmp_path)
    assert (forked.returncode, forked.stdout, forked.stderr) == (plain.returncode, plain.stdout, plain.stderr)
    assert forked.returncode == (0 if args[:1] in (("--version",), ("plan",)) and "1e400" not in args else 2)
    assert os.listdir(tmp_path) == []


def test_forked_calls_are_separate_processes_with_their_own_folder_and_environment(tmp_path):
    server = cli_server.ForkServer(_cli_env())
    try:
        (tmp_path / "a").mkdir()
        env = dict(_cli_env(), COLUMNS="33")
        first = server.run(("plan", "--help"), tmp_path / "a", env, None, 60)
        wide = server.run(("plan", "--help"), tmp_path, _cli_env(), None, 60)
        assert first.returncode == wide.returncode == 0
        assert len(first.stdout.splitlines()) > len(wide.stdout.splitlines())     # argparse read COLUMNS=33
        code = server.run(("report", str(tmp_path / "nothing-here")), tmp_path, _cli_env(), None, 60)
        assert code.returncode == 2 and code.stderr.startswith("fsdpprof report: error: ")
        with pytest.raises(subprocess.TimeoutExpired):
            server.run(("report", os.devnull), tmp_path, _cli_env(), None, 0.0)
        after = server.run(("plan", "--params", "1e9", "--world", "2"), tmp_path, _cli_env(), None, 60)
        assert after.returncode == 0 and after.stdout and after.stderr == ""        # the server lives on
    finally:
        server.close()


def test_start_up_variables_take_a_fresh_process():
    base = {"HOME": "/root", "OMP_NUM_THREADS": "1"}
    assert not cli_server.needs_fresh_process(dict(base, FSDPPROF_X="1"), base)
    assert cli_server.needs_fresh_process(dict(base, PYTHONWARNINGS="error"), base)
    assert cli_server.needs_fresh_process(dict(base, OMP_NUM_THREADS="4"), base)
    assert cli_server.needs_fresh_process({"HOME": "/root"}, base)
