"""Outputs under pressure: two commands writing the same pair at once (a lock: never one's HTML beside the
other's JSON), a SIGTERM or Ctrl-C in the middle of the write (no temporary left, no half pair), the
temporaries a killed write left (removed by the next write of the same output), and stdout on a full disk
(one line, exit 1)."""
from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest

from conftest import ROOT, shared_data
from fsdpprof.report import outputs

DLRM = ("gpu-traces", "param-dlrm-8rank-v100")


def _pair(tmp_path: Path):
    return str(tmp_path / "r.html"), str(tmp_path / "r.summary.json")


def _write_two_at_once(tmp_path, monkeypatch):
    """Writer A is slowed after its first rename (an injected delay); writer B writes its whole pair in that
    gap.  Returns what is on disk after both."""
    html, js = _pair(tmp_path)
    real_replace = os.replace
    a_between = threading.Event()

    def slow_replace(src, dst, *args, **kwargs):
        real_replace(src, dst, *args, **kwargs)
        if threading.current_thread().name == "A" and dst == html:
            a_between.set()
            time.sleep(0.5)

    monkeypatch.setattr(os, "replace", slow_replace)
    errors = []

    def writer(tag):
        if tag == "B":
            a_between.wait(10)
        try:
            outputs.write_files([(html, f"<html>{tag}".encode()), (js, f'{{"run": "{tag}"}}'.encode())])
        except Exception as exc:      # (said in the assertion below)
            errors.append(exc)

    threads = [threading.Thread(target=writer, args=(t,), name=t) for t in "AB"]
    for t in threads:
        t.start()
    for t in threads:
        t.join(30)
    assert not errors and a_between.is_set()
    return Path(html).read_text()[-1], Path(js).read_text()[-3]


def test_two_writers_of_one_pair_never_mix(tmp_path, monkeypatch):
    assert _write_two_at_once(tmp_path, monkeypatch) == ("B", "B")      # B waited for A's whole pair
    assert sorted(p.name for p in tmp_path.iterdir()) == ["r.html", "r.summary.json"]   # no lock, no temp left


def test_without_the_lock_the_same_writers_mix(tmp_path, monkeypatch):
    """The control: the injected delay does make the two writes interleave when nothing orders them."""
    monkeypatch.setattr(outputs, "output_locks", lambda paths: contextlib.nullcontext())
    assert _write_two_at_once(tmp_path, monkeypatch) == ("B", "A")


def _dead_pid() -> int:
    """The pid of a process that has ended (and was reaped)."""
    p = subprocess.Popen([sys.executable, "-c", "pass"])
    p.wait()
    return p.pid


def test_stale_temporaries_of_ours_are_removed_by_the_next_write(tmp_path):
    html, js = _pair(tmp_path)
    old = time.time() - 2 * outputs.STALE_TEMP_S
    live, dead = os.getppid(), _dead_pid()
    ours_old = [f".r.html.{live}.0badc0de.tmp", ".r.html.x7_k2mq9.tmp", f".r.summary.json.{live}.deadbeef.tmp"]
    ours_dead = [f".r.html.{dead}.0badc0de.tmp", f".r.summary.json.{dead}.feedf00d.tmp"]   # fresh, pid dead
    ours_fresh = [f".r.html.{live}.feedf00d.tmp", ".r.html.k2mq9x7_.tmp", f".r.html.{os.getpid()}.abcdef01.tmp"]
    not_ours = [".r.html.notes.tmp", f".r.html.{dead}.0badc0de.tmp.keep", f"r.html.{dead}.0badc0de.tmp",
                f".other.html.{dead}.0badc0de.tmp"]
    for name in ours_old + ours_dead + ours_fresh + not_ours:
        (tmp_path / name).write_text("x")
    for name in ours_old + not_ours:
        os.utime(tmp_path / name, (old, old))
    outputs.write_files([(html, b"<html>"), (js, b"{}")])
    left = {p.name for p in tmp_path.iterdir()}
    assert left == {"r.html", "r.summary.json", *ours_fresh, *not_ours}


CHILD = """
import os, sys, time
from fsdpprof import cli
real_fsync = os.fsync
def fsync_then_wait(fd):        # the first temporary is written: say so, then wait for the signal
    real_fsync(fd)
    open({mark!r}, "w").close()
    time.sleep(120)
os.fsync = fsync_then_wait
sys.exit(cli.main(["report", {trace!r}, "-o", {out!r}]))
"""


@pytest.mark.parametrize("sig,code,word", [(signal.SIGTERM, 143, "terminated"), (signal.SIGINT, 130, "interrupted")])
def test_a_signal_during_the_write_leaves_nothing_behind(tmp_path, sig, code, word):
    out_dir = tmp_path / "new" / "deeper"            # made for the outputs: removed with them
    mark = tmp_path / "writing"
    src = CHILD.format(mark=str(mark), trace=str(shared_data(*DLRM, "rank-0.json.gz")), out=str(out_dir / "r.html"))
    env = dict(os.environ, PYTHONPATH=str(ROOT), OMP_NUM_THREADS="1")
    p = subprocess.Popen([sys.executable, "-c", src], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                         env=env, cwd=tmp_path)
    try:
        deadline = time.monotonic() + 240
        while not mark.exists() and p.poll() is None and time.monotonic() < deadline:
            time.sleep(0.05)
        assert mark.exists(), p.communicate(timeout=30)
        assert any(n.endswith(".tmp") for n in os.listdir(out_dir))   # caught in the middle of the write
        p.send_signal(sig)
        _, err = p.communicate(timeout=60)
    finally:
        if p.poll() is None:
            p.kill()
    assert p.returncode == code, err
    assert err.strip().splitlines() == [f"fsdpprof report: {word}"], err
    assert sorted(os.listdir(tmp_path)) == ["writing"]               # no temporary, no lock, no folder, no half pair


CHILD_AT_CREATION = """
import os, sys
from fsdpprof import cli
real_open = os.open
def open_then_interrupted(path, flags, mode=0o777, *args, **kwargs):
    fd = real_open(path, flags, mode, *args, **kwargs)
    if str(path).endswith(".tmp"):  # Ctrl-C the moment the first temporary exists, before its writer returns
        raise KeyboardInterrupt
    return fd
os.open = open_then_interrupted
sys.exit(cli.main(["report", {trace!r}, "-o", {out!r}]))
"""


def test_an_interrupt_as_a_temporary_is_created_leaves_nothing_behind(tmp_path):
    """hostile.py once found `.plotly-<v>.min.js.<pid>.<hex>.tmp` left by a SIGINT between the temporary's creation
    and its listing for removal: it is listed before it exists."""
    out_dir = tmp_path / "new" / "deeper"
    src = CHILD_AT_CREATION.format(trace=str(shared_data(*DLRM, "rank-0.json.gz")), out=str(out_dir / "r.html"))
    env = dict(os.environ, PYTHONPATH=str(ROOT), OMP_NUM_THREADS="1")
    p = subprocess.run([sys.executable, "-c", src], capture_output=True, text=True, env=env, cwd=tmp_path, timeout=600)
    assert p.returncode == 130, p.stderr
    assert p.stderr.strip().splitlines() == ["fsdpprof report: interrupted"], p.stderr
    assert os.listdir(tmp_path) == []                                 # no temporary, no lock, no folder


def _stdout_full(argv, cwd):
    env = dict(os.environ, PYTHONPATH=str(ROOT), OMP_NUM_THREADS="1")
    with open("/dev/full", "w") as full:
        return subprocess.run([sys.executable, "-m", "fsdpprof", *argv], stdout=full, stderr=subprocess.PIPE,
                              text=True, env=env, cwd=cwd, timeout=600)


def _assert_stdout_full(argv, cwd):
    p = _stdout_full(argv, cwd)
    assert p.returncode == 1, p.stderr
    lines = p.stderr.splitlines()
    assert len(lines) == 1 and "Traceback" not in p.stderr, p.stderr
    assert lines[0].startswith(f"fsdpprof {argv[0]}: error: cannot write to standard output (No space left"), lines


needs_dev_full = pytest.mark.skipif(not os.path.exists("/dev/full"), reason="no /dev/full on this system")


@needs_dev_full
@pytest.mark.parametrize("cmd", ["report", "overlap", "plan", "plan-json"])
def test_stdout_on_a_full_disk_is_one_line_exit_1(tmp_path, cmd):
    trace = str(shared_data(*DLRM))
    argv = {"report": ["report", trace, "-o", str(tmp_path / "r.html")],
            "overlap": ["overlap", trace], "plan": ["plan", "--params", "7B", "--world", "8"],
            "plan-json": ["plan", "--params", "7B", "--world", "8", "--json"]}[cmd]
    _assert_stdout_full(argv, tmp_path)


@pytest.mark.slow
@needs_dev_full
@pytest.mark.parametrize("json_flag", [[], ["--json"]], ids=["text", "json"])
def test_whatif_stdout_on_a_full_disk_is_one_line_exit_1(tmp_path, recorded_run, json_flag):
    _assert_stdout_full(["whatif", str(recorded_run("fsdp2")), *json_flag], tmp_path)
