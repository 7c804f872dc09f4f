"""In-code recording: ``with fsdpprof.record(out="runs/x"):`` around a training loop.

Steps are counted as under ``fsdpprof record`` (optimizer steps completed inside the block). Every process
(rank) that enters the block records its own ``rank-<R>`` folder and writes ``launchers/<host>-<pid>.json``;
``run.json`` is created by the first and updated by each as it leaves (the last one leaves the final status).
"""
from __future__ import annotations

import contextlib
import datetime as _dt
import os
import sys

from fsdpprof import runfmt
from fsdpprof.collect import launcher
from fsdpprof.errors import UserError


@contextlib.contextmanager
def record(out: str | None = None, *, skip_steps: int = runfmt.DEFAULT_SKIP_STEPS,
           warmup_steps: int = runfmt.DEFAULT_WARMUP_STEPS, active_steps: int = runfmt.DEFAULT_ACTIVE_STEPS,
           ranks=None, memory: bool = True, with_stack: bool = False,
           max_memory_entries: int = runfmt.DEFAULT_MAX_MEMORY_ENTRIES):
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
    try:
        os.makedirs(out, exist_ok=True)
        run_json, launcher_path, entry = launcher.begin_run(out, [sys.executable, *sys.argv], dict(options, api=True),
                                                            None, {"api": True})
    except OSError as exc:  # never harm the job: its block runs unrecorded
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
            entry.update(exit_code=exit_code, ended_at=launcher._now())
            _, unwritten = launcher._end_run(out, run_json, launcher_path, entry)
            if unwritten:
                runfmt.say(f"fsdpprof: run directory {out} not finished: {'; '.join(unwritten)}")
        except Exception as exc:  # never harm the job
            runfmt.say(f"fsdpprof: could not finish the run directory {out}: {runfmt.write_error_text(exc)}")
