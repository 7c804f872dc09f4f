"""In-code recording: ``with fsdpprof.record(out="runs/x"):`` around a training loop.

Steps are counted exactly as under ``fsdpprof record``: optimizer steps completed inside the
``with`` block (the first optimizer that steps), window ``skip_steps``, ``warmup_steps``,
``active_steps``. Every process (rank) that enters the block records its own ``rank-<R>``
folder; each writes ``launchers/<host>-<pid>.json`` and ``run.json`` is created by the first and
updated by each as it leaves, so the last one to finish leaves the final status.
"""
from __future__ import annotations

import contextlib
import datetime as _dt
import os
import socket
import sys

from fsdpprof import runfmt
from fsdpprof.collect import launcher
from fsdpprof.errors import UserError


@contextlib.contextmanager
def record(out: str | None = None, *, skip_steps: int = 5, warmup_steps: int = 1, active_steps: int = 3,
           ranks=None, memory: bool = True, with_stack: bool = False, max_memory_entries: int = 100_000):
    """Record the optimizer-step window of the code inside the block into run directory ``out``."""
    window = launcher.window_options(skip_steps, warmup_steps, active_steps, max_memory_entries, ranks,
                                     prefix="fsdpprof.record: ")
    from fsdpprof.collect import recorder       # (torch: after the arguments are judged)

    if recorder.active_recorder() is not None:  # already under `fsdpprof record`
        runfmt.say("fsdpprof: record() inside `fsdpprof record`: the launcher's recording is used")
        yield None
        return
    out = os.path.abspath(out or os.path.join(os.getcwd(), "fsdpprof-runs",
                                              _dt.datetime.now().strftime("%Y%m%d-%H%M%S")))
    if os.path.isfile(os.path.join(out, runfmt.RUN_JSON)):
        meta = launcher.run_meta(out)
        if meta is None:
            raise UserError(f"fsdpprof.record: {out} holds a run.json that fsdpprof did not write: choose another out")
        if meta.get("status") != runfmt.STATUS_RUNNING:  # a finished run; a running one is joined (other ranks)
            raise UserError(f"fsdpprof.record: {out} already holds a run (status {meta.get('status')}): choose a new "
                            "out folder or remove that run first")
    options = dict(window, memory=bool(memory), with_stack=bool(with_stack))
    cmd = [sys.executable, *sys.argv]
    started = _dt.datetime.now(_dt.timezone.utc).isoformat()
    meta = {"schema": runfmt.RUN_SCHEMA, "command": cmd, "cwd": os.getcwd(), "started_at": started,
            "ended_at": None, "exit_code": None, "status": runfmt.STATUS_RUNNING, "versions": launcher._versions(),
            "host": socket.gethostname(), "options": dict(options, api=True), "ranks_expected": None,
            "ranks_seen": []}
    run_json = os.path.join(out, runfmt.RUN_JSON)
    name = f"{socket.gethostname()}-{os.getpid()}.json"
    launcher_path = os.path.join(out, runfmt.LAUNCHERS_DIR, name)
    created = False
    try:
        os.makedirs(out, exist_ok=True)
        created = runfmt.exclusive_create_json(run_json, meta)
        entry = {"host": socket.gethostname(), "pid": os.getpid(),
                 "pid_start": runfmt.process_start_ticks(os.getpid()), "command": cmd, "started_at": started,
                 "ended_at": None, "exit_code": None, "api": True,
                 # what this process writes in the run directory besides its rank folder (--force removes only that)
                 "files": ([runfmt.RUN_JSON] if created else []) + [f"{runfmt.LAUNCHERS_DIR}/{name}"]}
        runfmt.atomic_write_json(launcher_path, entry)
    except OSError as exc:  # never harm the job: its block runs unrecorded
        if created:
            runfmt.remove_quietly(run_json)
        runfmt.say(f"fsdpprof: not recording: {out} cannot be written ({runfmt.write_error_text(exc)})")
        yield None
        return
    rec = recorder.Recorder(out, options)
    rec.install()
    recorder._API_RECORDERS.append(rec)
    exit_code = 0
    try:
        yield rec
    except BaseException:
        exit_code = 1
        raise
    finally:
        try:
            rec._save_on_exit("left the fsdpprof.record block" if exit_code == 0 else "exception in the block",
                              clean=exit_code == 0)
            rec.uninstall()
            if rec in recorder._API_RECORDERS:
                recorder._API_RECORDERS.remove(rec)
            entry.update(exit_code=exit_code, ended_at=_dt.datetime.now(_dt.timezone.utc).isoformat())
            _, unwritten = launcher._end_run(out, run_json, launcher_path, entry)
            if unwritten:
                runfmt.say(f"fsdpprof: run directory {out} not finished: {'; '.join(unwritten)}")
        except Exception as exc:  # never harm the job
            runfmt.say(f"fsdpprof: could not finish the run directory {out}: {runfmt.write_error_text(exc)}")
