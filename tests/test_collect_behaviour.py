"""`fsdpprof record` never harms the job and loses nothing: pass-through, crashes, SIGTERM, the
user's own sitecustomize and profiler, scripts without torch.distributed or without an optimizer,
bad command lines, and the Python API. Real processes throughout (torchrun + gloo where distributed).
"""
from __future__ import annotations

import gzip
import json
import os
import signal
import subprocess
import sys
import textwrap
import time

import pytest

from conftest import EXAMPLE, run_fsdpprof

WINDOW = ("--skip-steps", "1", "--warmup-steps", "1", "--active-steps", "2")

# A single-process training script without torch.distributed; behaviour switched by argv.
SCRIPT = textwrap.dedent('''
    import os, sys, time
    import torch
    import torch.nn as nn

    mode = sys.argv[1] if len(sys.argv) > 1 else "train"
    if mode == "killed-as-trace-lands":  # as a scheduler's SIGKILL after its grace period, at the worst moment
        import signal, threading
        def kill_when_saved(path=os.environ["TRACE_PATH"]):
            while not os.path.exists(path):
                time.sleep(0.0002)
            os.kill(os.getpid(), signal.SIGKILL)
        threading.Thread(target=kill_when_saved, daemon=True).start()
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(32, 64), nn.ReLU(), nn.Linear(64, 8))
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9) if mode != "no-optimizer" else None
    prof = None
    if mode == "own-profiler":
        prof = torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU])
        prof.__enter__()
    for step in range(6):
        if mode == "late-profiler" and step == 2:  # inside fsdpprof's window (steps 2-3)
            prof = torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU])
            prof.__enter__()
        loss = model(torch.randn(16, 32)).square().mean()
        loss.backward()
        if mode == "sleep-in-window" and step == 3:
            open(os.environ["READY_FILE"], "w").close()
            time.sleep(120)
        if opt is not None:
            opt.step()
            opt.zero_grad()
    if prof is not None:
        prof.__exit__(None, None, None)
        prof.export_chrome_trace(os.environ["OWN_TRACE"])
    print("script done", mode)
''')


@pytest.fixture()
def script(tmp_path):
    path = tmp_path / "script.py"
    path.write_text(SCRIPT)
    return path


def rank_json(run, rank=0) -> dict:
    return json.loads((run / f"rank-{rank}" / "rank.json").read_text())


def trace_names(run, rank=0) -> set:
    with gzip.open(run / f"rank-{rank}" / "trace.json.gz", "rt") as fh:
        return {e.get("name") for e in json.load(fh)["traceEvents"]}


def no_temp_files(run) -> bool:
    return not [p for p in run.rglob(".*") if p.is_file()]


@pytest.mark.slow
def test_passthrough_and_cheap_bootstrap(tmp_path):
    """stdout, stdin and exit code pass through; a process that never imports torch stays torch-free."""
    out = tmp_path / "run"
    code = ("import sys; data = sys.stdin.read(); "
            "print('torch' in sys.modules, 'fsdpprof' in sys.modules, data.upper()); sys.exit(7)")
    proc = run_fsdpprof("record", "--out", str(out), "--", sys.executable, "-c", code, input="hello")
    assert proc.returncode == 7
    assert proc.stdout == "False False HELLO\n"
    meta = json.loads((out / "run.json").read_text())
    assert meta["exit_code"] == 7 and meta["status"] == "failed"
    launcher = json.loads(next((out / "launchers").glob("*.json")).read_text())
    assert launcher["exit_code"] == 7 and launcher["command"][0] == sys.executable


@pytest.mark.slow
def test_single_process_with_own_sitecustomize(tmp_path, script):
    """No torch.distributed, user's sitecustomize on PYTHONPATH: it still runs, and we record rank 0."""
    site = tmp_path / "site"
    site.mkdir()
    marker = tmp_path / "marker.txt"
    (site / "sitecustomize.py").write_text(
        f"import os\nopen({str(marker)!r}, 'a').write('job\\n' if 'FSDPPROF_RUN_DIR' in os.environ else 'launcher\\n')\n")
    out = tmp_path / "run"
    proc = run_fsdpprof("record", "--out", str(out), *WINDOW, "--", sys.executable, str(script),
                        env={"PYTHONPATH": str(site)})
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout == "script done train\n"
    # the user's sitecustomize ran once in the launcher's own process and exactly once in the job
    assert sorted(marker.read_text().split()) == ["job", "launcher"]
    meta = json.loads((out / "run.json").read_text())
    assert meta["status"] == "complete" and meta["ranks_seen"] == [0]
    info = rank_json(out)
    assert info["status"] == "complete" and info["world_size"] == 1 and info["backend"] is None
    assert {"ProfilerStep#2", "ProfilerStep#3"} <= trace_names(out)
    inv = json.loads((out / "rank-0" / "inventory.json").read_text())
    assert inv["framework"] == "none" and inv["totals"]["psi"] == 32 * 64 + 64 + 64 * 8 + 8
    momentum = [t for t in inv["tensors"] if t["role"] == "optimizer_state"]
    assert sum(t["bytes"] for t in momentum) == inv["totals"]["param_bytes"]  # SGD momentum = 1 x params
    ours = [line for line in proc.stderr.splitlines() if line.startswith("fsdpprof:")]
    assert len(ours) == 2  # one line for the rank, one for the run


@pytest.mark.slow
def test_no_optimizer_script(tmp_path, script):
    out = tmp_path / "run"
    proc = run_fsdpprof("record", "--out", str(out), *WINDOW, "--", sys.executable, str(script), "no-optimizer")
    assert proc.returncode == 0 and proc.stdout == "script done no-optimizer\n"
    info = rank_json(out)
    assert info["status"] == "no_optimizer" and "no optimizer step" in info["error"]
    assert info["steps_recorded"] == []
    names = trace_names(out)
    assert "aten::addmm" in names  # the trace still covers the model's work
    meta = json.loads((out / "run.json").read_text())
    assert meta["status"] == "partial" and meta["exit_code"] == 0


@pytest.mark.slow
def test_own_profiler_steps_aside(tmp_path, script):
    out = tmp_path / "run"
    own = tmp_path / "own.json"
    proc = run_fsdpprof("record", "--out", str(out), *WINDOW, "--", sys.executable, str(script), "own-profiler",
                        env={"OWN_TRACE": str(own)})
    assert proc.returncode == 0, proc.stderr
    assert "aten::addmm" in {e.get("name") for e in json.loads(own.read_text())["traceEvents"]}
    info = rank_json(out)
    assert info["status"] == "stepped_aside" and "stepped aside" in info["error"]
    assert "stepped aside" in (out / "rank-0" / "collector.log").read_text()
    assert (out / "rank-0" / "inventory.json").exists()  # the inventory costs nothing: still written
    # run.json says so (it used to say `complete` with nothing recorded), and so does report, in one line
    meta = json.loads((out / "run.json").read_text())
    assert meta["status"] == "stepped_aside" and meta["rank_status"] == {"0": "stepped_aside"}
    assert "fsdpprof: run stepped aside" in proc.stderr
    report = run_fsdpprof("report", str(out))
    assert report.returncode == 2 and len(report.stderr.strip().splitlines()) == 1
    assert "stepped aside" in report.stderr and "own torch.profiler" in report.stderr


@pytest.mark.slow
def test_profiler_started_inside_window_wins(tmp_path, script):
    """The job starts its own profiler while fsdpprof's runs: ours stops first (saving), theirs works."""
    out = tmp_path / "run"
    own = tmp_path / "own.json"
    proc = run_fsdpprof("record", "--out", str(out), *WINDOW, "--", sys.executable, str(script), "late-profiler",
                        env={"OWN_TRACE": str(own)})
    assert proc.returncode == 0, proc.stderr
    assert "aten::addmm" in {e.get("name") for e in json.loads(own.read_text())["traceEvents"]}
    info = rank_json(out)
    assert info["status"] in ("partial", "stepped_aside") and "stepped aside" in info["error"]
    assert "stepped aside" in (out / "rank-0" / "collector.log").read_text()


@pytest.mark.slow
def test_crash_at_step_2_keeps_partial_data(tmp_path):
    """torchrun job whose rank 0 raises in step 2 (inside the window 2-3); torchrun then stops rank 1
    (gloo error and/or SIGTERM). The exit code passes through, every rank keeps the trace and
    inventory of what it recorded, run.json says partial."""
    out = tmp_path / "run"
    proc = run_fsdpprof("record", "--out", str(out), *WINDOW, "--", sys.executable, "-m", "torch.distributed.run",
                        "--standalone", "--nproc-per-node=2", str(EXAMPLE), "--strategy", "fsdp2", "--steps", "5",
                        "--crash-at-step", "2", "--crash-rank", "0")
    assert proc.returncode != 0
    assert "deliberate crash at step 2" in proc.stderr
    meta = json.loads((out / "run.json").read_text())
    assert meta["exit_code"] == proc.returncode and meta["status"] == "partial"
    assert meta["rank_status"] == {"0": "partial", "1": "partial"}
    for r in (0, 1):
        info = rank_json(out, r)
        assert info["status"] == "partial" and info["error"]
        assert "ProfilerStep#2" in trace_names(out, r)
        inv = json.loads((out / f"rank-{r}" / "inventory.json").read_text())
        assert inv["status"] == "partial" and inv["totals"]["psi"] > 0
        assert {t["role"] for t in inv["tensors"]} >= {"param", "grad", "optimizer_state"}
    info0 = rank_json(out, 0)
    assert "deliberate crash" in info0["error"] and info0["steps_recorded"] == []
    inv0 = json.loads((out / "rank-0" / "inventory.json").read_text())
    # the crash came between backward and optimizer.step: grads as they were at exit
    assert {(t["step"], t["captured_at"]) for t in inv0["tensors"] if t["role"] == "grad"} == {(2, "at_exit")}
    assert rank_json(out, 1)["steps_recorded"] in ([], [2])  # rank 1 may have finished step 2
    assert no_temp_files(out)


@pytest.mark.slow
def test_sigterm_in_window_saves_and_passes_through(tmp_path, script):
    out = tmp_path / "run"
    ready = tmp_path / "ready"
    env = dict(os.environ, READY_FILE=str(ready), OMP_NUM_THREADS="1")
    proc = subprocess.Popen([sys.executable, "-m", "fsdpprof", "record", "--out", str(out), *WINDOW, "--",
                             sys.executable, str(script), "sleep-in-window"], env=env,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        deadline = time.time() + 120
        while not ready.exists() and time.time() < deadline and proc.poll() is None:
            time.sleep(0.1)
        assert ready.exists(), proc.communicate()[1]
        proc.send_signal(signal.SIGTERM)  # to the launcher, as a scheduler would
        _, err = proc.communicate(timeout=120)
    finally:
        if proc.poll() is None:
            proc.kill()
    assert proc.returncode == 128 + signal.SIGTERM, err
    meta = json.loads((out / "run.json").read_text())
    assert meta["exit_code"] == 128 + signal.SIGTERM and meta["status"] == "partial"
    info = rank_json(out)
    assert info["status"] == "partial" and "SIGTERM" in info["error"]
    assert "ProfilerStep#2" in trace_names(out)  # step 2 finished, step 3 was cut
    assert info["steps_recorded"] == [2]
    assert no_temp_files(out)


@pytest.mark.slow
def test_killed_as_the_trace_lands_keeps_the_inventory(tmp_path, script):
    """SIGKILL the moment the trace file appears (a scheduler's kill after its grace period, while fsdpprof saves):
    the inventory was written before the trace, and rank.json says partial."""
    out = tmp_path / "run"
    env = dict(os.environ, TRACE_PATH=str(out / "rank-0" / "trace.json.gz"), OMP_NUM_THREADS="1")
    proc = subprocess.run([sys.executable, "-m", "fsdpprof", "record", "--out", str(out), *WINDOW, "--",
                           sys.executable, str(script), "killed-as-trace-lands"], env=env,
                          capture_output=True, text=True, timeout=300)
    assert proc.returncode == 128 + signal.SIGKILL, proc.stderr
    assert {"ProfilerStep#2", "ProfilerStep#3"} <= trace_names(out)
    inv = json.loads((out / "rank-0" / "inventory.json").read_text())
    assert inv["status"] == "partial" and "before the trace" in inv["error"]
    assert {t["role"] for t in inv["tensors"]} == {"param", "grad", "optimizer_state"}
    assert {t["step"] for t in inv["tensors"] if t["role"] == "grad"} == {2, 3}
    assert rank_json(out)["status"] in ("failed", "partial")  # killed before or after it said the trace was saved
    meta = json.loads((out / "run.json").read_text())
    assert meta["status"] in ("partial", "failed") and meta["exit_code"] == 128 + signal.SIGKILL


@pytest.mark.slow
def test_python_api(tmp_path):
    out = tmp_path / "api-run"
    code = textwrap.dedent(f'''
        import torch, torch.nn as nn, fsdpprof
        model = nn.Linear(16, 16)
        opt = torch.optim.Adam(model.parameters())
        with fsdpprof.record(out={str(out)!r}, skip_steps=1, warmup_steps=1, active_steps=2):
            for _ in range(5):
                model(torch.randn(4, 16)).sum().backward()
                opt.step(); opt.zero_grad()
        print("ok")
    ''')
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300,
                          env=dict(os.environ, OMP_NUM_THREADS="1"))
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout == "ok\n"
    meta = json.loads((out / "run.json").read_text())
    assert meta["status"] == "complete" and meta["exit_code"] == 0
    assert rank_json(out)["steps_recorded"] == [2, 3]
    assert {"ProfilerStep#2", "ProfilerStep#3"} <= trace_names(out)
    inv = json.loads((out / "rank-0" / "inventory.json").read_text())
    adam = sum(t["bytes"] for t in inv["tensors"] if t["role"] == "optimizer_state" and not t["name"].endswith("/step"))
    assert adam == 2 * inv["totals"]["param_bytes"] == 2 * 4 * (16 * 16 + 16)


def test_python_api_rejects_bad_window():
    import fsdpprof
    from fsdpprof.errors import UserError

    with pytest.raises(UserError, match="active_steps 0 is too small: give a whole number from 1 to"):
        with fsdpprof.record(out="unused", active_steps=0):
            pass


BAD_USES = [
    ([], "no command"),
    (["--"], "no command after --"),
    (["--skip-steps", "0"], "--skip-steps: '0' is too small: give a whole number from 1 to 1e9"),
    (["--warmup-steps", "-1"], "--warmup-steps: '-1' is too small: give a whole number from 1 to"),
    (["--warmup-steps", "99999999999999999999999"], "--warmup-steps: '99999999999999999999999' is too large"),
    (["--active-steps", "two"], "--active-steps: 'two' is not a number"),
    (["--ranks", "a,b"], "--ranks: 'a,b' is not a list of ranks"),
    (["--ranks", ""], "--ranks: '' is not a list of ranks: give 'all' or comma-separated ranks"),
]


@pytest.mark.slow
@pytest.mark.parametrize("args,message", BAD_USES, ids=[m for _, m in BAD_USES])
def test_bad_use_one_line_exit_2_nothing_runs(tmp_path, args, message):
    marker = tmp_path / "ran"
    cmd = ["--", sys.executable, "-c", f"open({str(marker)!r}, 'w')"]
    if args and args[0] == "--":
        cmd = []
    elif not args:
        cmd = [sys.executable, "-c", f"open({str(marker)!r}, 'w')"]  # command without --
    proc = run_fsdpprof("record", "--out", str(tmp_path / "run"), *args, *cmd)
    assert proc.returncode == 2
    assert len(proc.stderr.strip().splitlines()) == 1 and message in proc.stderr
    assert not marker.exists() and not (tmp_path / "run").exists()


@pytest.mark.slow
def test_out_not_writable_or_a_file(tmp_path):
    marker = tmp_path / "ran"
    cmd = ["--", sys.executable, "-c", f"open({str(marker)!r}, 'w')"]
    a_file = tmp_path / "file"
    a_file.write_text("x")
    for out, message in ((a_file, "is not a directory"), (a_file / "sub", "not writable")):
        proc = run_fsdpprof("record", "--out", str(out), *cmd)
        assert proc.returncode == 2 and len(proc.stderr.strip().splitlines()) == 1 and message in proc.stderr
    assert not marker.exists()


@pytest.mark.slow
def test_existing_run_refused_without_force(tmp_path):
    out = tmp_path / "run"
    ok = run_fsdpprof("record", "--out", str(out), "--", sys.executable, "-c", "print(1)")
    assert ok.returncode == 0
    before = (out / "run.json").read_bytes()
    proc = run_fsdpprof("record", "--out", str(out), "--", sys.executable, "-c", "print(2)")
    assert proc.returncode == 2 and "already holds a run" in proc.stderr and "--force" in proc.stderr
    assert proc.stdout == "" and (out / "run.json").read_bytes() == before
    forced = run_fsdpprof("record", "--out", str(out), "--force", "--", sys.executable, "-c", "print(3)")
    assert forced.returncode == 0 and forced.stdout == "3\n"
    assert json.loads((out / "run.json").read_text())["command"][-1] == "print(3)"
    assert len(list((out / "launchers").glob("*.json"))) == 1
    other = tmp_path / "other"
    other.mkdir()
    (other / "notes.txt").write_text("mine")
    proc = run_fsdpprof("record", "--out", str(other), "--", sys.executable, "-c", "print(4)")
    assert proc.returncode == 2 and "not empty" in proc.stderr


def test_cuda_phase_tags_follow_units():
    """The CUDA path's allocation tags (forward/backward x unit), checked on CPU: the hooks are the same."""
    import torch
    import torch.nn as nn

    from fsdpprof.collect import inventory
    from fsdpprof.collect.cuda_memory import CudaMemoryRecorder, metadata

    model = nn.Sequential(nn.Linear(4, 4), nn.Linear(4, 4))
    info = inventory.ModelInfo(model, 1)
    info.unit_modules = {id(model): "", id(model[0]): "0", id(model[1]): "1"}
    tags = []

    class Recording(CudaMemoryRecorder):
        def set_phase(self, phase, unit):
            tags.append(metadata(phase, unit))

    rec = Recording(info)
    rec.install_phase_hooks()
    try:
        model(torch.randn(2, 4, requires_grad=True)).sum().backward()
    finally:
        for h in rec.handles:
            h.remove()
    want = ["fsdpprof phase=forward unit=", "fsdpprof phase=forward unit=0", "fsdpprof phase=forward unit=",
            "fsdpprof phase=forward unit=1", "fsdpprof phase=forward unit=", "fsdpprof phase=forward unit=",
            "fsdpprof phase=backward unit=1", "fsdpprof phase=backward unit=0"]
    assert tags == want


@pytest.mark.slow
def test_two_launchers_share_one_run(tmp_path):
    """Multi-node style: a second launcher of the same command joins the running run (no refusal);
    each writes its own launcher file and run.json is created once and derived from both."""
    out = tmp_path / "run"
    go = tmp_path / "go"
    cmd = [sys.executable, "-c", f"import os, time\nwhile not os.path.exists({str(go)!r}): time.sleep(0.05)"]
    env = dict(os.environ, OMP_NUM_THREADS="1")
    first = subprocess.Popen([sys.executable, "-m", "fsdpprof", "record", "--out", str(out), "--", *cmd], env=env)
    try:
        deadline = time.time() + 60
        while not (out / "run.json").exists() and time.time() < deadline:
            time.sleep(0.05)
        started_at = json.loads((out / "run.json").read_text())["started_at"]
        second = subprocess.Popen([sys.executable, "-m", "fsdpprof", "record", "--out", str(out), "--", *cmd],
                                  env=env)
        while len(list((out / "launchers").glob("*.json"))) < 2 and time.time() < deadline:
            time.sleep(0.05)
        go.write_text("")
        assert second.wait(timeout=60) == 0 and first.wait(timeout=60) == 0
    finally:
        for p in (first,):
            if p.poll() is None:
                p.kill()
    launchers = [json.loads(p.read_text()) for p in (out / "launchers").glob("*.json")]
    assert len(launchers) == 2 and all(x["exit_code"] == 0 and x["ended_at"] for x in launchers)
    meta = json.loads((out / "run.json").read_text())
    assert meta["started_at"] == started_at and meta["exit_code"] == 0 and meta["ended_at"]
    assert meta["status"] == "failed"  # no rank ever made an optimizer step: nothing recorded


def test_launchers_ending_together_leave_the_final_status(tmp_path, monkeypatch):
    """The race CI met: launcher A derives "running" while B has not yet written that it ended, then
    B finalizes ("failed") and A writes its stale status after it. A must derive again and fix run.json."""
    from fsdpprof import runfmt
    from fsdpprof.collect import launcher as launcher_mod

    out = tmp_path / "run"
    (out / "launchers").mkdir(parents=True)
    run_json = str(out / "run.json")
    runfmt.atomic_write_json(run_json, {"schema": runfmt.RUN_SCHEMA, "status": "running", "started_at": "t0"})
    ended = {"host": "h", "command": ["x"], "exit_code": 0, "ended_at": "t1"}
    runfmt.atomic_write_json(str(out / "launchers" / "h-1.json"), {**ended, "pid": 1})
    runfmt.atomic_write_json(str(out / "launchers" / "h-2.json"), {**ended, "pid": 2, "exit_code": None})
    real_derive = launcher_mod.derive_status
    calls = []

    def derive_then_b_finishes(run_dir, meta, own=None):
        derived = real_derive(run_dir, meta, own)
        calls.append(derived["status"])
        if len(calls) == 1:  # B ends and finalizes between A's derive and A's write
            runfmt.atomic_write_json(str(out / "launchers" / "h-2.json"), {**ended, "pid": 2})
            b_meta = {**runfmt.read_json(run_json), **real_derive(run_dir, meta)}
            runfmt.atomic_write_json(run_json, b_meta)
            assert b_meta["status"] == "failed"
        return derived

    monkeypatch.setattr(launcher_mod, "derive_status", derive_then_b_finishes)
    meta, unwritten = launcher_mod._finalize(str(out), run_json)
    assert unwritten is None
    assert calls[0] == "running" and "failed" in calls[1:]
    on_disk = runfmt.read_json(run_json)
    assert on_disk["status"] == meta["status"] == "failed" and on_disk["exit_code"] == 0
    assert on_disk["started_at"] == "t0"


@pytest.mark.slow
def test_stale_running_run_is_not_joined(tmp_path):
    """run.json says running but its launcher is gone (killed hard): a new launcher refuses, it does not join."""
    out = tmp_path / "run"
    cmd = [sys.executable, "-c", "print(1)"]
    assert run_fsdpprof("record", "--out", str(out), "--", *cmd).returncode == 0
    meta = json.loads((out / "run.json").read_text())
    meta["status"] = "running"
    (out / "run.json").write_text(json.dumps(meta))
    launcher = next((out / "launchers").glob("*.json"))
    doc = json.loads(launcher.read_text())
    doc.update(exit_code=None, pid=2 ** 22 + 12345)  # a pid that does not exist
    launcher.write_text(json.dumps(doc))
    proc = run_fsdpprof("record", "--out", str(out), "--", *cmd)
    assert proc.returncode == 2 and "already holds a run (status running)" in proc.stderr
