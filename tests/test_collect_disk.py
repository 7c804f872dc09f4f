"""A full disk, a read-only folder or an unwritable stderr never harm the job (issue 31): every write
fsdpprof makes (trace, inventory, rank.json, manifest, collector.log, run.json, launcher files, its
``fsdpprof:`` lines) may fail; the job goes on with its own output and exit code, what was half-written
is removed, and the reason ("disk full: <path>") is recorded.

Two kinds of test: fault injection in-process (every write made to fail in turn, cheap), and real
recordings on a 1 MiB tmpfs (skipped with the reason where this machine cannot mount one).
"""
from __future__ import annotations

import errno
import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import torch.nn as nn

from conftest import EXAMPLE, run_fsdpprof
from fsdpprof import cli, runfmt
from fsdpprof.collect import launcher, recorder

WINDOW = {"skip_steps": 1, "warmup_steps": 1, "active_steps": 2}
STEPS = 5


def hidden_files(folder: Path) -> list[str]:
    """Temporaries left behind: fsdpprof's are all hidden files (``.name.<pid>.<token>.tmp``, ``.trace.*``)."""
    return sorted(str(p.relative_to(folder)) for p in folder.rglob(".*"))


def unlisted_files(folder: Path) -> list[str]:
    """Files of each rank folder that its manifest does not list (``record --force`` could not remove them)."""
    left = []
    for rank in folder.glob("rank-*"):
        listed = set(runfmt.read_manifest(str(rank)) or [])
        left += [f"{rank.name}/{p.name}" for p in rank.iterdir() if p.name not in listed]
    return left


# -- fault injection: each write in turn raises ENOSPC ---------------------------------------------------
class FullDisk:
    """Counts fsdpprof's writes (``runfmt.write_all``, and kineto's trace export) and makes write number
    ``fail_at`` fail as a full disk does: half of it written, then ENOSPC (kineto: its ``<path>.tmp`` cut
    short and no error raised, as kineto does).  ``stays_full``: every later write fails too."""

    def __init__(self, monkeypatch, fail_at: int | None = None, stays_full: bool = False):
        self.fail_at, self.stays_full, self.count, self.failed = fail_at, stays_full, 0, []
        real_write, real_export = runfmt.write_all, torch.profiler.profile.export_chrome_trace

        def write_all(fd, data):
            if self._fails():
                self.failed.append(_fd_path(fd))
                real_write(fd, data[: len(data) // 2])
                raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))
            real_write(fd, data)

        def export_chrome_trace(prof, path, *args, **kwargs):
            if self._fails():
                self.failed.append(path)
                with open(path + ".tmp", "wb") as fh:
                    fh.write(b'{"traceEvents": [')
                return None
            return real_export(prof, path, *args, **kwargs)

        monkeypatch.setattr(runfmt, "write_all", write_all)
        monkeypatch.setattr(torch.profiler.profile, "export_chrome_trace", export_chrome_trace)

    def _fails(self) -> bool:
        self.count += 1
        return self.fail_at is not None and (self.count == self.fail_at or
                                             (self.stays_full and self.count > self.fail_at))


def _fd_path(fd: int) -> str:
    try:
        return os.readlink(f"/proc/self/fd/{fd}")
    except OSError:
        return f"fd {fd}"


def train_recorded(out: Path) -> tuple[list[float], recorder.Recorder]:
    """A small training loop recorded in this process (as the bootstrap would, without a launcher): the losses."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(16, 32), nn.ReLU(), nn.Linear(32, 4))
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    rec = recorder.Recorder(str(out), dict(WINDOW, memory=False))
    rec.install()
    losses = []
    try:
        for _ in range(STEPS):
            loss = model(torch.randn(8, 16)).square().mean()
            loss.backward()
            opt.step()
            opt.zero_grad()
            losses.append(loss.item())
        rec._save_on_exit("process exited", clean=True)   # (what its atexit does)
    finally:
        rec.uninstall()
    return losses, rec


@pytest.fixture()
def quiet_hooks(monkeypatch):
    """The recorder sets sys.excepthook and SIGTERM's handler in the window: put them back after each test."""
    import signal

    monkeypatch.setattr(sys, "excepthook", sys.excepthook)
    previous = signal.getsignal(signal.SIGTERM)
    yield
    signal.signal(signal.SIGTERM, previous)


@pytest.mark.slow   # (34 profiler windows in this process: about 15 CPU-seconds)
def test_every_recorder_write_may_fail(tmp_path, monkeypatch, quiet_hooks, capfd):
    """Write N fails (once; or from N on, a disk that stays full), for every N of a recording: the loop's
    losses are those of a clean run, nothing raises, nothing half-written or unlisted is left, and a
    failed file of the run is named in rank.json ("disk full: <path>") or in the rank's one line."""
    clean_out = tmp_path / "clean"
    with monkeypatch.context() as m:
        counter = FullDisk(m)
        want, rec = train_recorded(clean_out)
    writes = counter.count
    assert json.loads((clean_out / "rank-0" / "rank.json").read_text())["status"] == "complete"
    assert writes >= 10, writes   # (manifest, rank.json, log lines, trace, inventory, the rank's line...)
    capfd.readouterr()
    for stays_full in (False, True):
        for n in range(1, writes + 1):
            out = tmp_path / f"{'full' if stays_full else 'once'}-{n}"
            with monkeypatch.context() as m:
                disk = FullDisk(m, n, stays_full)
                losses, rec = train_recorded(out)
            case = f"write {n} of {writes} ({disk.failed[0]}){' and after' if stays_full else ''}"
            said = capfd.readouterr().err
            assert losses == want, case
            assert hidden_files(out) == [] and unlisted_files(out) == [], case
            assert "Traceback" not in said, case
            failed = disk.failed[0]
            if not failed.startswith(str(out)) or stays_full:
                continue   # (stderr's own line failed: nothing to record; a disk that stays full: what it can)
            info_path = out / "rank-0" / "rank.json"
            name = os.path.basename(failed)
            if not info_path.exists():   # the claim of rank-0/ failed: the rank recorded nothing and said so
                assert not (out / "rank-0").exists() and "fsdpprof: rank 0 recorded nothing: disk full: " in said, case
                continue
            info = json.loads(info_path.read_text())
            if name == runfmt.COLLECTOR_LOG:   # its lines are written again with the next one: none cut in half
                log = (out / "rank-0" / name).read_text()
                assert log.endswith("\n") and all(re.match(r"\d{4}-\d\d-\d\dT\d\d:\d\d:\d\d pid=\d+ ", line)
                                                  for line in log.splitlines() if line[:2] == "20"), case
                assert info["status"] == "complete", case
            elif name.startswith("." + runfmt.RANK_JSON) or name == runfmt.RANK_JSON:
                assert info["status"] == "complete", case   # (rewritten by the next write of rank.json)
            elif name.endswith(".tmp.json"):
                # kineto's failed export says nothing; the disk has room after it (another rank's failed export
                # freed it, or it was never full): exported once more, the trace recorded
                assert info["status"] == "complete" and (out / "rank-0" / runfmt.TRACE_FILE).exists(), case
            else:
                assert info["status"] in ("partial", "failed"), case
                assert info["write_error"].startswith(f"disk full: {out / 'rank-0'}/"), case
                assert info["write_error"] in info["error"] and info["write_error"] in said, case


def record_in_process(out: Path, code: int) -> int:
    """``fsdpprof record --out OUT -- python -c 'exit(code)'`` in this process (the job is a process of its own)."""
    argv = ["record", "--out", str(out), "--", sys.executable, "-c", f"import sys; sys.exit({code})"]
    args, _ = cli.build_parser(argv).parse_known_args(argv)
    return launcher.run(args)


def test_every_launcher_write_may_fail(tmp_path, monkeypatch, capfd):
    """The launcher's writes fail in turn: before the job starts, one line and nothing left behind (exit 2, the
    job not run); after it, `record` still exits with the job's code, and run.json never stays `running`."""
    from fsdpprof.errors import UserError

    with monkeypatch.context() as m:
        counter = FullDisk(m)
        assert record_in_process(tmp_path / "clean", 7) == 7
    writes = counter.count
    capfd.readouterr()
    for stays_full in (False, True):
        for n in range(1, writes + 1):
            out = tmp_path / f"{'full' if stays_full else 'once'}-{n}"
            with monkeypatch.context() as m:
                disk = FullDisk(m, n, stays_full)
                try:
                    code = record_in_process(out, 7)
                except UserError as exc:
                    code = None
                    assert "cannot be written (disk full: " in str(exc) and "nothing was run" in str(exc)
            case = f"write {n} of {writes} ({disk.failed[0]}){' and after' if stays_full else ''}"
            said = capfd.readouterr().err
            assert hidden_files(out) == [], case
            if code is None:   # refused before the job: nothing of this launcher is left
                assert not (out / "run.json").exists() and not list(out.glob("launchers/*")), case
                continue
            assert code == 7 and "Traceback" not in said, case
            meta = json.loads((out / "run.json").read_text())
            if not stays_full:
                assert meta["status"] == "failed" and meta["exit_code"] == 7, case
            if disk.failed[0].startswith(str(out)) and not stays_full:
                assert "fsdpprof: run failed" in said, case


# -- real recordings on a small filesystem -----------------------------------------------------------------
@pytest.fixture()
def small_fs(tmp_path):
    """A 1 MiB tmpfs mounted at tmp_path/small (needs root or CAP_SYS_ADMIN; skipped with the reason otherwise)."""
    mnt = tmp_path / "small"
    mnt.mkdir()
    proc = subprocess.run(["mount", "-t", "tmpfs", "-o", "size=1m", "tmpfs", str(mnt)], capture_output=True,
                          text=True)
    if proc.returncode != 0:
        pytest.skip(f"cannot mount a 1 MiB tmpfs here ({(proc.stderr or proc.stdout).strip() or proc.returncode}): "
                    "run as root to test a full disk for real")
    try:
        yield mnt
    finally:
        subprocess.run(["umount", "-l", str(mnt)], capture_output=True)


def assert_disk_full_recorded(run: Path, ranks: list[int], said: str) -> None:
    assert hidden_files(run) == [] and unlisted_files(run) == []
    for rank in ranks:
        info = json.loads((run / f"rank-{rank}" / "rank.json").read_text())
        assert info["status"] in ("partial", "failed"), info
        assert info["write_error"].startswith(f"disk full: {run / f'rank-{rank}'}/"), info
        assert f"fsdpprof: rank {rank} {info['status']} (" in said and info["write_error"] in said
    meta = json.loads((run / "run.json").read_text())
    assert meta["status"] in ("partial", "failed") and meta["exit_code"] == 0, meta
    assert "Traceback" not in said and "OSError" not in said


@pytest.mark.slow
def test_example_on_a_full_disk_single_process(small_fs):
    """`record -- python -m fsdpprof.examples.train_fsdp` into 1 MiB: the trace does not fit; the job's output and
    exit code are those of the job alone, the rank says "disk full: <path>", nothing half-written is left."""
    job = [sys.executable, "-m", "fsdpprof.examples.train_fsdp", "--strategy", "fsdp2", "--steps", "10"]
    env = dict(os.environ, OMP_NUM_THREADS="1")
    alone = subprocess.run(job, capture_output=True, text=True, timeout=300, env=env)
    assert alone.returncode == 0, alone.stderr
    run = small_fs / "run"
    proc = run_fsdpprof("record", "--out", str(run), "--", *job, timeout=300)
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout == alone.stdout
    assert_disk_full_recorded(run, [0], proc.stderr)


@pytest.mark.slow
def test_example_on_a_full_disk_two_ranks(small_fs):
    """The same under torchrun with 2 ranks sharing the 1 MiB."""
    run = small_fs / "run"
    proc = run_fsdpprof("record", "--out", str(run), "--", sys.executable, "-m", "torch.distributed.run",
                        "--standalone", "--nproc-per-node=2", str(EXAMPLE), "--strategy", "fsdp2", "--steps", "10",
                        timeout=600)
    assert proc.returncode == 0, proc.stderr
    assert re.fullmatch(r"train_fsdp: strategy=fsdp2 world=2 steps=10 final_loss=\S+\n", proc.stdout), proc.stdout
    assert_disk_full_recorded(run, [0, 1], proc.stderr)


def _record_cmd(out: Path, job: str) -> list[str]:
    return [sys.executable, "-m", "fsdpprof", "record", "--out", str(out), "--", sys.executable, "-c", job]


@pytest.mark.slow
def test_launcher_on_a_full_or_read_only_disk_and_a_lost_stderr(small_fs):
    """The job fills the disk, or makes --out read-only, then exits 6: `record` exits 6, run.json says how the
    job ended (written in place when no temporary file fits) or the one line says why it could not; with
    stderr full or closed, `record` exits with the job's code."""
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONPATH=str(Path(__file__).resolve().parents[1]))
    fill = (f"import sys\ntry:\n    open({str(small_fs / 'filler')!r}, 'wb').write(b'x' * (2 << 20))\n"
            "except OSError:\n    print('full')\nsys.exit(6)")
    proc = subprocess.run(_record_cmd(small_fs / "full", fill), capture_output=True, text=True, env=env, timeout=120)
    assert (proc.returncode, proc.stdout) == (6, "full\n"), proc.stderr
    meta = json.loads((small_fs / "full" / "run.json").read_text())
    assert meta["status"] == "failed" and meta["exit_code"] == 6
    assert hidden_files(small_fs / "full") == [] and "Traceback" not in proc.stderr
    os.unlink(small_fs / "filler")

    read_only = (f"import subprocess, sys\nsubprocess.run(['mount', '-o', 'remount,ro', {str(small_fs)!r}], check=True)\n"
                 "sys.exit(6)")
    try:
        proc = subprocess.run(_record_cmd(small_fs / "ro", read_only), capture_output=True, text=True, env=env,
                              timeout=120)
    finally:
        subprocess.run(["mount", "-o", "remount,rw", str(small_fs)], capture_output=True)
    assert proc.returncode == 6 and "Traceback" not in proc.stderr, proc.stderr
    lines = [line for line in proc.stderr.splitlines() if line.startswith("fsdpprof:")]
    assert len(lines) == 1 and f"read-only file system: {small_fs / 'ro'}/" in lines[0], proc.stderr

    with open("/dev/full", "w") as full:
        for name, kwargs in (("devfull", {"stderr": full}), ("closed", {"preexec_fn": lambda: os.close(2)})):
            out = small_fs / name
            proc = subprocess.run(_record_cmd(out, "print('hi'); raise SystemExit(7)"), stdout=subprocess.PIPE,
                                  text=True, env=env, timeout=120, **kwargs)
            assert (proc.returncode, proc.stdout) == (7, "hi\n"), name
            assert json.loads((out / "run.json").read_text())["exit_code"] == 7
