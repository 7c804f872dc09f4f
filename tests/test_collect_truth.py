"""The run directory loses nothing of the user's and tells the truth about the run (issue 8):
`record --force` removes only what fsdpprof wrote; every file is as readable as the traces; short
jobs, killed ranks, the job's own profiler, two processes claiming one rank and a killed launcher
each get a truthful status; fsdpprof adds no kineto lines to the job's stderr.
Real recordings throughout (single-process python jobs: fast, and enough for each of these).
"""
from __future__ import annotations

import gzip
import json
import os
import signal
import stat
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest

from conftest import ROOT, run_fsdpprof

WINDOW = ("--skip-steps", "1", "--warmup-steps", "1", "--active-steps", "2")   # recorded steps 2-3

SCRIPT = textwrap.dedent('''
    import os, signal, sys, time
    import torch
    import torch.nn as nn

    mode = sys.argv[1] if len(sys.argv) > 1 else "train"
    steps = int(os.environ.get("STEPS", "5"))
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(16, 32), nn.ReLU(), nn.Linear(32, 4))
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    prof = None
    for step in range(steps):
        if mode == "late-profiler" and step == 2:   # inside fsdpprof's window
            prof = torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU])
            prof.__enter__()
        model(torch.randn(8, 16)).square().mean().backward()
        if mode == "kill-in-window" and step == 3:  # before the window's last step is saved
            os.kill(os.getpid(), signal.SIGKILL)
        opt.step()
        opt.zero_grad()
    if prof is not None:
        prof.__exit__(None, None, None)
    if os.environ.get("READY_FILE"):
        open(os.environ["READY_FILE"], "w").close()
        while not os.path.exists(os.environ["GO_FILE"]):
            time.sleep(0.05)
    print("done", mode, flush=True)
''')


@pytest.fixture()
def script(tmp_path):
    path = tmp_path / "script.py"
    path.write_text(SCRIPT)
    return path


def record(out, script, *args, force=False, env=None, extra=()):
    return run_fsdpprof("record", "--out", str(out), *WINDOW, *(["--force"] if force else []), *extra, "--",
                        sys.executable, str(script), *args, env=env)


def load(path: Path) -> dict:
    return json.loads(path.read_text())


def tree(path: Path) -> dict[str, bytes]:
    """Every file under ``path`` with its bytes (to prove nothing of the user's changed)."""
    return {str(p.relative_to(path)): p.read_bytes() for p in sorted(path.rglob("*")) if p.is_file()}


def one_line_error(proc, *words) -> None:
    assert proc.returncode == 2, proc.stderr
    assert len(proc.stderr.strip().splitlines()) == 1, proc.stderr
    for word in words:
        assert word in proc.stderr, proc.stderr


def user_files(folder: Path) -> dict[str, bytes]:
    (folder / "rank-analysis").mkdir(parents=True)
    (folder / "rank-analysis" / "plot.txt").write_text("my analysis")
    (folder / "rank-notes.txt").write_text("my notes")
    (folder / "notes.txt").write_text("more notes")
    return tree(folder)


# -- 1. nothing of the user's is lost ----------------------------------------------------------

@pytest.mark.slow
def test_force_never_removes_user_files(tmp_path, script):
    out = tmp_path / "out"
    mine = user_files(out)
    # rank-* entries of the user's do not make a run: refused without --force, naming what is in the way
    proc = record(out, script)
    one_line_error(proc, "not empty", "rank-notes.txt", "rank-analysis/", "--force")
    assert tree(out) == mine
    # --force records beside them and removes nothing
    assert record(out, script, force=True).returncode == 0
    assert {k: v for k, v in tree(out).items() if k in mine} == mine
    first = load(out / "rank-0" / "rank.json")
    # now a run: --force replaces exactly what fsdpprof wrote
    assert record(out, script, force=True).returncode == 0
    after = tree(out)
    assert {k: v for k, v in after.items() if k in mine} == mine
    assert load(out / "rank-0" / "rank.json")["pid"] != first["pid"]
    assert len(list((out / "launchers").glob("*.json"))) == 1
    assert set(after) - set(mine) == {"run.json", next(k for k in after if k.startswith("launchers/"))} | {
        f"rank-0/{n}" for n in ("manifest.json", "rank.json", "collector.log", "trace.json.gz", "inventory.json")}
    # a file of the user's inside the run's rank folder: refused, nothing removed
    (out / "rank-0" / "my.txt").write_text("mine")
    before = tree(out)
    one_line_error(record(out, script, force=True), "rank-0/my.txt", "did not write", "nothing was removed")
    assert tree(out) == before
    # a run.json without fsdpprof's schema is not a run, and --force never replaces it
    other = tmp_path / "other"
    other.mkdir()
    (other / "run.json").write_text('{"my": "config"}')
    one_line_error(record(other, script), "not empty", "run.json")
    one_line_error(record(other, script, force=True), "run.json", "did not write")
    assert tree(other) == {"run.json": b'{"my": "config"}'}


@pytest.mark.slow
def test_force_replaces_a_run_of_the_previous_version(tmp_path, script):
    """A run without manifests (recorded before them): --force removes run.json, launchers/ and the
    rank-<R>/ folders that hold fsdpprof's rank.json, nothing else."""
    out = tmp_path / "run"
    assert record(out, script).returncode == 0
    (out / "rank-0" / "manifest.json").unlink(missing_ok=True)   # as the previous version wrote it
    for path in (out / "launchers").glob("*.json"):
        doc = load(path)
        for key in ("files", "heartbeat_s", "pid_start"):
            doc.pop(key, None)
        path.write_text(json.dumps(doc))
    old_pid = load(out / "rank-0" / "rank.json")["pid"]
    (out / "notes.txt").write_text("mine")
    (out / "rank-notes.txt").write_text("mine too")
    (out / "rank-7").mkdir()                                  # a rank-like folder of the user's
    (out / "rank-7" / "data.csv").write_text("1,2")
    before = tree(out)
    one_line_error(record(out, script, force=True), "rank-7/", "nothing was removed")
    assert tree(out) == before
    (out / "rank-7" / "data.csv").unlink()
    (out / "rank-7").rmdir()
    assert record(out, script, force=True).returncode == 0
    assert (out / "notes.txt").read_text() == "mine" and (out / "rank-notes.txt").read_text() == "mine too"
    assert load(out / "rank-0" / "rank.json")["pid"] != old_pid
    assert (out / "rank-0" / "manifest.json").exists()


@pytest.mark.slow
def test_force_never_removes_a_user_file_inside_a_rank_folder(tmp_path, script):
    """rank-0/my_notes.txt of the user's in an old run: with its manifest intact, without a manifest (a run
    recorded before them) or with one damaged (emptied, not JSON, not ours), --force refuses in one line and
    removes nothing; it never removes a whole rank folder."""
    import shutil

    recorded = tmp_path / "recorded"
    assert record(recorded, script).returncode == 0
    cases = {"intact": None, "no manifest": "remove", "emptied": b"", "not JSON": b"{\"schema\": ",
             "not ours": b'{"files": ["my_notes.txt"]}'}
    for case, manifest in cases.items():
        out = tmp_path / case.replace(" ", "-")
        shutil.copytree(recorded, out)
        if manifest == "remove":
            (out / "rank-0" / "manifest.json").unlink()
        elif manifest is not None:
            (out / "rank-0" / "manifest.json").write_bytes(manifest)
        (out / "rank-0" / "my_notes.txt").write_text("mine")
        before = tree(out)
        proc = record(out, script, force=True)
        if manifest is None or manifest == "remove":
            one_line_error(proc, "rank-0/my_notes.txt", "did not write", "nothing was removed")
        else:
            one_line_error(proc, "rank-0/manifest.json is damaged", "nothing", "rank-0/")
        assert tree(out) == before, case
    # without the user's file, an old run without manifests is replaced: fsdpprof's own files only
    out = tmp_path / "no-manifest"
    (out / "rank-0" / "my_notes.txt").unlink()
    (out / "rank-0" / ".trace.123.tmp.json.gz").write_bytes(b"left by a killed export")
    assert record(out, script, force=True).returncode == 0
    assert load(out / "rank-0" / "manifest.json")["files"] and not (out / "rank-0" / ".trace.123.tmp.json.gz").exists()
    # a damaged manifest beside nothing of the user's still stops --force: it proves nothing
    out = tmp_path / "emptied"
    (out / "rank-0" / "my_notes.txt").unlink()
    before = tree(out)
    one_line_error(record(out, script, force=True), "rank-0/manifest.json is damaged (empty)")
    assert tree(out) == before


@pytest.mark.slow
def test_run_files_readable_like_the_traces(tmp_path, script):
    """run.json and inventory.json used to be 0600 (mkstemp): every file now follows the umask as open() does."""
    out = tmp_path / "run"
    env = dict(os.environ, OMP_NUM_THREADS="1")
    for mask, want in ((0o022, 0o644), (0o077, 0o600)):
        target = out / f"umask-{mask:03o}"
        proc = subprocess.run([sys.executable, "-m", "fsdpprof", "record", "--out", str(target), *WINDOW, "--",
                               sys.executable, str(script)], env=env, capture_output=True, text=True,
                              timeout=300, preexec_fn=lambda m=mask: os.umask(m))
        assert proc.returncode == 0, proc.stderr
        files = [p for p in target.rglob("*") if p.is_file()]
        modes = {str(p.relative_to(target)): stat.S_IMODE(p.stat().st_mode) for p in files}
        assert set(modes.values()) == {want}, modes
        assert {p.name for p in files} >= {"run.json", "inventory.json", "rank.json", "trace.json.gz",
                                            "manifest.json", "collector.log"}


# -- 2. truthful statuses ----------------------------------------------------------------------

@pytest.mark.slow
def test_short_job_is_complete_with_a_note(tmp_path, script):
    """The job ends cleanly after step 2, inside the window 2-3: complete, the cut window noted."""
    out = tmp_path / "run"
    proc = record(out, script, env={"STEPS": "3"})
    assert proc.returncode == 0, proc.stderr
    info = load(out / "rank-0" / "rank.json")
    assert info["status"] == "complete" and info["steps_recorded"] == [2]
    assert "window cut short" in info["note"] and "1 of 2 active steps" in info["note"]
    meta = load(out / "run.json")
    assert meta["status"] == "complete" and any("1 of 2 active steps" in n for n in meta["notes"])
    assert "run complete" in proc.stderr and "1 of 2 active steps" in proc.stderr
    # ended in the warm-up: no step of the window recorded, so the recording failed (the job did not)
    early = tmp_path / "early"
    proc = record(early, script, env={"STEPS": "2"})
    assert proc.returncode == 0, proc.stderr
    info = load(early / "rank-0" / "rank.json")
    assert info["status"] == "failed" and "no recorded step" in info["error"] and info["steps_recorded"] == []
    assert load(early / "run.json")["status"] == "failed"


@pytest.mark.slow
def test_rank_killed_before_its_trace_is_failed(tmp_path, script):
    out = tmp_path / "run"
    proc = record(out, script, "kill-in-window")
    assert proc.returncode == 128 + signal.SIGKILL
    info = load(out / "rank-0" / "rank.json")
    assert info["status"] == "failed" and "no trace saved" in info["error"]
    assert not (out / "rank-0" / "trace.json.gz").exists()
    meta = load(out / "run.json")
    assert meta["status"] == "failed" and meta["rank_status"] == {"0": "failed"}
    one_line_error(run_fsdpprof("report", str(out)), "no trace saved")


def test_a_loser_waits_for_the_holders_manifest(tmp_path):
    """The holder creates rank-0/ and only then writes its manifest: a loser that looks in between
    still names the holder (once it failed on a loaded CI machine with claimed_by null)."""
    import threading

    from fsdpprof import runfmt
    from fsdpprof.collect.recorder import _claim_holder

    folder = tmp_path / "rank-0"
    folder.mkdir()
    writer = {"role": "rank", "rank": 0, "host": "h", "pid": 4242}
    late = threading.Timer(0.3, runfmt.write_manifest, (str(folder), writer, [runfmt.RANK_JSON]))
    late.start()
    try:
        assert _claim_holder(str(folder), wait_s=5.0) == {"host": "h", "pid": 4242}
    finally:
        late.join()
    empty = tmp_path / "rank-1"
    empty.mkdir()
    assert _claim_holder(str(empty), wait_s=0.1) == {}  # a holder killed before its manifest: nobody named


@pytest.mark.slow
def test_two_processes_claiming_rank_0(tmp_path, script):
    """A job that starts two processes without torch.distributed: both are rank 0. One records,
    the other records nothing; no file of one lies beside the other's; run.json and report name it."""
    out = tmp_path / "run"
    job = ("import subprocess, sys\n"
           f"ps = [subprocess.Popen([sys.executable, {str(script)!r}]) for _ in range(2)]\n"
           "sys.exit(max(p.wait() for p in ps))")
    proc = run_fsdpprof("record", "--out", str(out), *WINDOW, "--", sys.executable, "-c", job)
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout == "done train\ndone train\n"
    clashes = [load(p) for p in (out / "clashes").glob("*.json")]
    assert len(clashes) == 1
    holder, loser = clashes[0]["claimed_by"]["pid"], clashes[0]["pid"]
    assert holder != loser
    assert load(out / "rank-0" / "rank.json")["pid"] == holder
    assert load(out / "rank-0" / "manifest.json")["writer"]["pid"] == holder
    with gzip.open(out / "rank-0" / "trace.json.gz", "rt") as fh:
        pids = {e["pid"] for e in json.load(fh)["traceEvents"] if e.get("cat") == "cpu_op"}
    assert pids == {holder}
    assert all(f"pid={holder} " in line for line in (out / "rank-0" / "collector.log").read_text().splitlines()
               if line.startswith("20"))
    assert f"this process (pid {loser}) records nothing" in proc.stderr
    meta = load(out / "run.json")
    assert any("claimed by two processes" in n for n in meta["notes"])
    assert meta["clashes"][0]["pid"] == loser
    report = run_fsdpprof("report", str(out), "-o", str(tmp_path / "report.html"))
    assert report.returncode == 0, report.stderr
    warning = [line for line in report.stdout.splitlines() if "claimed by two processes" in line]
    assert len(warning) == 1 and warning[0].startswith("  warning:") and str(loser) in warning[0]


@pytest.mark.slow
def test_two_launchers_of_one_single_process_job(tmp_path, script):
    """Two `fsdpprof record -- python train.py` on one --out at once: the second launcher joins the
    run, its process finds rank 0 taken and records nothing."""
    out = tmp_path / "run"
    ready, go = tmp_path / "ready", tmp_path / "go"
    env = dict(os.environ, OMP_NUM_THREADS="1", READY_FILE=str(ready), GO_FILE=str(go))
    cmd = [sys.executable, "-m", "fsdpprof", "record", "--out", str(out), *WINDOW, "--", sys.executable, str(script)]
    first = subprocess.Popen(cmd, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    second = None
    try:
        deadline = time.time() + 120
        while not ready.exists() and time.time() < deadline:   # the first job has recorded rank 0
            time.sleep(0.05)
        second = subprocess.Popen(cmd, env=dict(env, READY_FILE=str(tmp_path / "ready2")),
                                  stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
        while not (tmp_path / "ready2").exists() and time.time() < deadline and second.poll() is None:
            time.sleep(0.05)
        go.write_text("")
        _, err2 = second.communicate(timeout=120)
        first.communicate(timeout=120)
    finally:
        for p in (first, second):
            if p is not None and p.poll() is None:
                p.kill()
    assert second.returncode == 0 and first.returncode == 0, err2
    clashes = [load(p) for p in (out / "clashes").glob("*.json")]
    assert len(clashes) == 1 and clashes[0]["claimed_by"]["pid"] == load(out / "rank-0" / "rank.json")["pid"]
    assert "records nothing" in err2
    assert len(list((out / "launchers").glob("*.json"))) == 2


@pytest.mark.slow
def test_killed_launcher_is_reported_as_interrupted(tmp_path, script):
    """SIGKILL to the launcher leaves run.json `running` for ever: report sees no live launcher and
    shows the run as interrupted, with one warning line (run.json itself is not changed)."""
    out = tmp_path / "run"
    ready, go = tmp_path / "ready", tmp_path / "go"
    env = dict(os.environ, OMP_NUM_THREADS="1", READY_FILE=str(ready), GO_FILE=str(go))
    launcher = subprocess.Popen([sys.executable, "-m", "fsdpprof", "record", "--out", str(out), *WINDOW, "--",
                                 sys.executable, str(script)], env=env,
                                stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        deadline = time.time() + 120
        while not ready.exists() and time.time() < deadline:
            time.sleep(0.05)
        assert ready.exists()
        launcher.send_signal(signal.SIGKILL)
        launcher.wait(timeout=30)
    finally:
        go.write_text("")  # the orphaned job ends by itself
        if launcher.poll() is None:
            launcher.kill()
    job_pid = load(out / "rank-0" / "rank.json")["pid"]
    deadline = time.time() + 60
    while time.time() < deadline:
        try:
            os.kill(job_pid, 0)
            time.sleep(0.1)
        except ProcessLookupError:
            break
    run_json = (out / "run.json").read_bytes()
    assert json.loads(run_json)["status"] == "running"
    report = run_fsdpprof("report", str(out), "-o", str(tmp_path / "report.html"),
                          "--summary", str(tmp_path / "summary.json"))
    assert report.returncode == 0, report.stderr
    warning = [line for line in report.stdout.splitlines() if "interrupted" in line]
    assert len(warning) == 1 and warning[0].startswith("  warning:") and "launcher" in warning[0]
    assert load(tmp_path / "summary.json")["overview"]["status"] == "interrupted"
    assert (out / "run.json").read_bytes() == run_json


@pytest.mark.slow
def test_a_live_launcher_is_not_interrupted(tmp_path):
    """The other side of staleness: while the launcher runs, report does not call the run interrupted."""
    from fsdpprof import runfmt

    out = tmp_path / "run"
    go = tmp_path / "go"
    launcher = subprocess.Popen([sys.executable, "-m", "fsdpprof", "record", "--out", str(out), "--",
                                 sys.executable, "-c",
                                 f"import os, time\nwhile not os.path.exists({str(go)!r}): time.sleep(0.05)"],
                                env=dict(os.environ, OMP_NUM_THREADS="1"))
    try:
        deadline = time.time() + 60
        while not list((out / "launchers").glob("*.json")) and time.time() < deadline:
            time.sleep(0.05)
        time.sleep(0.2)
        assert runfmt.run_liveness(str(out))[0] == "alive"
        path = next((out / "launchers").glob("*.json"))
        doc = load(path)
        # another host's launcher: alive while its heartbeat is recent, gone once it is stale
        doc["host"] = "another-host"
        assert runfmt.launcher_alive(doc, str(path)) is True
        assert runfmt.launcher_alive(doc, str(path), now=time.time() + 10 * runfmt.HEARTBEAT_S) is False
        assert runfmt.launcher_alive(dict(doc, heartbeat_s=None), str(path)) is None
    finally:
        go.write_text("")
        launcher.wait(timeout=60)
    assert runfmt.run_liveness(str(out))[0] == "gone"


# -- 3. the job's stderr -----------------------------------------------------------------------

def _stderr_lines(proc) -> list[str]:
    return [line for line in proc.stderr.splitlines() if line.strip()]


@pytest.mark.slow
def test_no_kineto_lines_added_to_the_jobs_stderr(tmp_path, script):
    """torch's `USDT ... profiler_start/stop` lines are silenced for fsdpprof's own profiler calls; the
    only lines fsdpprof adds are its own `fsdpprof:` lines and the CPUAllocator warning that docs/recording.md
    lists (README points there).
    The job's own profiler still prints its lines, as it does without fsdpprof."""
    env = dict(os.environ, OMP_NUM_THREADS="1")
    plain = subprocess.run([sys.executable, str(script)], env=env, capture_output=True, text=True, timeout=300)
    recorded = record(tmp_path / "run", script)
    assert plain.returncode == 0 and recorded.returncode == 0 and plain.stdout == recorded.stdout
    added = [line for line in _stderr_lines(recorded) if line not in _stderr_lines(plain)]
    ours = [line for line in added if line.startswith("fsdpprof: ")]
    allocator = [line for line in added if "CPUAllocator.cpp" in line and "Memory block of unknown size" in line]
    assert len(ours) == 2 and not [line for line in added if line not in ours + allocator], added
    assert "profiler_start" not in recorded.stderr and "USDT" not in recorded.stderr
    recording_doc = (ROOT / "docs" / "recording.md").read_text()
    assert "Memory block of unknown size was allocated before the profiling started" in recording_doc
    assert "docs/recording.md" in (ROOT / "README.md").read_text()
    # the job's own profiler (started inside fsdpprof's window) logs exactly as without fsdpprof
    own_plain = subprocess.run([sys.executable, str(script), "late-profiler"], env=env, capture_output=True,
                               text=True, timeout=300)
    own_recorded = record(tmp_path / "run-own", script, "late-profiler")
    usdt = [[line.split("]", 1)[1] for line in _stderr_lines(p) if line.startswith("USDT")]
            for p in (own_plain, own_recorded)]
    assert usdt[0] == usdt[1] == [" profiler_start", " profiler_stop"]


@pytest.mark.slow
def test_python_api_keeps_a_finished_run(tmp_path):
    """`fsdpprof.record(out=...)` into a folder that already holds a finished run is refused (it used to
    write its rank files over the old ones); a run.json that is not fsdpprof's is never touched."""
    out = tmp_path / "api-run"
    code = textwrap.dedent(f'''
        import torch, torch.nn as nn, fsdpprof
        from fsdpprof.errors import UserError
        model = nn.Linear(8, 8)
        opt = torch.optim.SGD(model.parameters(), lr=0.1)
        def train():
            with fsdpprof.record(out={str(out)!r}, skip_steps=1, warmup_steps=1, active_steps=1):
                for _ in range(3):
                    model(torch.randn(4, 8)).sum().backward()
                    opt.step(); opt.zero_grad()
        train()
        try:
            train()
        except UserError as exc:
            print("refused:", exc)
    ''')
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300,
                          env=dict(os.environ, OMP_NUM_THREADS="1"))
    assert proc.returncode == 0, proc.stderr
    assert "refused:" in proc.stdout and "already holds a run (status complete)" in proc.stdout
    assert load(out / "run.json")["status"] == "complete"
    assert not (out / "clashes").exists() and len(list((out / "launchers").glob("*.json"))) == 1
