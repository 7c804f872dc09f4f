"""The in-process recorder: a profiling window driven by optimizer steps (stdlib + torch only).

Installed in every Python process of the job by the bootstrap (or by :mod:`fsdpprof.collect.api`) through
torch's global optimizer step hooks. Steps count the completed steps of the first optimizer that steps:
``ProfilerStep#N`` in the trace is optimizer step N. The profiler starts after step ``skip-1``, warms up for
``warmup`` steps and records ``active`` steps. Inventory: grads before every active step, params before the
last one, optimizer state after it. Every error is caught, logged to collector.log and recorded in rank.json's
status; the training job goes on as without us.
"""
from __future__ import annotations

import atexit
import ctypes
import datetime as _dt
import errno
import gc
import gzip
import json
import os
import platform
import re
import signal
import socket
import sys
import threading
import time
import traceback
import weakref
import zlib

import torch

from fsdpprof.version import __version__
from fsdpprof import runfmt
from fsdpprof.collect import inventory as inv
from fsdpprof.collect.before_window import BeforeWindowMemory, register_fork_hooks
from fsdpprof.collect.process_memory import ProcessMemory

LOG_LINES_KEPT = 200        # collector.log lines held in memory while the file cannot be written
KINETO_TMP_SUFFIX = ".tmp"  # kineto exports a trace to <path>.tmp, renamed to <path> once complete
TRACE_GZIP_LEVEL = 6        # gzip's default: torch's own .gz export uses 9, line by line (about 8x the CPU)

_RECORDER = None            # the bootstrap's recorder
_API_RECORDERS: list = []   # those of fsdpprof.record() blocks, innermost last
_OURS = threading.local()   # .active while fsdpprof itself starts a profiler, .quiet while kineto is silenced
_GUARD_INSTALLED = False


def install_from_env(optimizer_module=None) -> None:
    """Called by the bootstrap once torch.optim.optimizer is loaded."""
    global _RECORDER
    run_dir = os.environ.get(runfmt.ENV_RUN_DIR)
    if not run_dir or _RECORDER is not None:
        return
    try:
        options = json.loads(os.environ.get(runfmt.ENV_OPTIONS) or "{}")
    except ValueError:
        options = {}
    _RECORDER = Recorder(run_dir, options)
    _RECORDER.install(optimizer_module, at_torch_import=True)


def active_recorder():
    return _RECORDER


def _is_child_process() -> bool:
    try:
        import multiprocessing

        return multiprocessing.parent_process() is not None
    except Exception:
        return False


class Recorder:
    """State machine: idle -> window -> done (or aside / failed)."""

    def __init__(self, run_dir: str, options: dict | None = None, *, announce: bool = True):
        self.run_dir = os.path.abspath(run_dir)
        self.options = dict(runfmt.RECORD_DEFAULTS)
        self.options.update({k: v for k, v in (options or {}).items() if v is not None or k == "ranks"})
        self.skip = int(self.options["skip_steps"])
        self.warmup = int(self.options["warmup_steps"])
        self.active = int(self.options["active_steps"])
        self.first_active = self.skip + self.warmup
        self.last_active = self.first_active + self.active - 1
        self.announce = announce
        self.pid = os.getpid()
        self.state = "idle"
        self.lock = threading.RLock()
        self.steps_done = 0
        self.trace_steps_done = 0  # optimizer steps completed when the trace was saved
        self.primary = None        # weakref to the first optimizer that steps
        self.optimizers: list = []  # weakrefs, in order of first step
        self.handles: list = []
        self.fwd_handle = self.prof = self.fallback_prof = self.cuda = None
        self.reg_handle = None     # the parameter-registration hook that starts the record before the window
        self.before = None         # BeforeWindowMemory (CPU runs): live allocations before the window
        self.before_window = None  # its result, inventory.json's "before_window"
        self.deferred_start = False  # the window's profiler starts at the first active step (after the record)
        self.rank, self.world_size, self.local_rank = None, 1, 0
        self.rdir = self.info = self.clock_anchor = None
        self.manifest_writer, self.manifest_files, self.files = None, [], []
        self.log_lines: list[str] = []
        self.tensors_grads: list[dict] = []
        self.tensors_params: list[dict] = []
        self.tensors_opt: list[dict] = []
        self.opt_captured: set = set()
        self.trace_written = False
        self.window_trace = True   # False when the trace is the no-optimizer fallback
        self.finished = self.saving = False
        self.prev_sigterm = self.pending_signal = None
        self.error = self.exception_text = None
        self.note = None           # rank.json "note": e.g. the window was cut short by a clean exit
        self.cpu_start = None      # _cpu_sample() at the start of the first active step
        self.cpu_window = None     # rank.json "cpu"
        self.process_memory = None  # ProcessMemory: rank.json "process_memory"
        self.process_memory_error = None  # why sampling stopped
        self.write_error = None    # the first write of a file of the run that failed, in words ("disk full: <path>")
        self.log_error = None      # collector.log could not take every line (why)
        self.log_lost = False      # lines were dropped while collector.log could not be written

    # -- installation ---------------------------------------------------------------------
    def install(self, optimizer_module=None, at_torch_import: bool = False) -> None:
        """Hook the optimizer steps and module calls; ``at_torch_import``: called as torch is imported (the
        bootstrap), before any tensor of the job, so c10's count of every thread's CPU bytes starts now."""
        try:
            if optimizer_module is None:
                import torch.optim.optimizer as optimizer_module
            self.handles.append(optimizer_module.register_optimizer_step_pre_hook(self._pre_hook))
            self.handles.append(optimizer_module.register_optimizer_step_post_hook(self._post_hook))
            mod = sys.modules.get("torch.nn.modules.module")
            if mod is not None and hasattr(mod, "register_module_forward_pre_hook"):
                self.fwd_handle = mod.register_module_forward_pre_hook(self._first_forward)
            if mod is not None and hasattr(mod, "register_module_parameter_registration_hook") \
                    and self._wants_before_window():
                self.reg_handle = mod.register_module_parameter_registration_hook(self._first_parameter)
                register_fork_hooks(lambda: self.before)
                if at_torch_import and self._records_this_rank():
                    self.before = BeforeWindowMemory(self._log, _quiet_kineto)
                    self.before.count_from_import()
            atexit.register(self._atexit)
        except Exception as exc:  # never harm the job
            self._log(f"install failed: {exc!r}")

    def uninstall(self) -> None:
        for h in self.handles + [self.fwd_handle, self.reg_handle]:
            try:
                if h is not None:
                    h.remove()
            except Exception:
                pass
        self.handles, self.fwd_handle, self.reg_handle = [], None, None
        self._drop_before_window("recording ended before the window")

    # -- the memory record before the window (CPU runs) ------------------------------------------
    def _wants_before_window(self) -> bool:
        """A CPU run with memory on, in the process that installed us: record memory before the window."""
        try:
            return bool(self.options["memory"]) and not torch.cuda.is_available() and not _is_child_process()
        except Exception:
            return False

    def _start_before_window(self, why: str) -> None:
        """Start the memory record before the window, once, if this process will record a window (never raises)."""
        try:
            handle, self.reg_handle = self.reg_handle, None
            if handle is not None:
                handle.remove()
            if (self.before is not None and (self.before.started_by or self.before.error)) or self.state != "idle" \
                    or os.getpid() != self.pid or self.steps_done >= self.skip or not self._wants_before_window() \
                    or _user_profiler_running() or not self._records_this_rank():
                return
            _patch_user_profiler_guard()
            self.before = self.before or BeforeWindowMemory(self._log, _quiet_kineto)
            self.before.start(why)
        except Exception as exc:
            self._log(f"memory record before the window not started: {exc!r}")

    def _records_this_rank(self) -> bool:
        ranks = self.options.get("ranks")
        return ranks is None or int(os.environ.get("RANK", "0") or 0) in {int(r) for r in ranks}

    def _before_window_running(self) -> bool:
        return self.before is not None and self.before.running

    def _drop_before_window(self, why: str) -> None:
        before = self.before
        if before is not None and self.before_window is None:   # (also one only counting since torch's import)
            before.drop(why)

    def _finish_before_window(self) -> None:
        """Stop the record as the window's profiler starts; its result goes into inventory.json."""
        if self.before is not None and self.before_window is None \
                and (self.before.started_by or self.before.error):
            self.before_window = self.before.finish()
            self._log(f"memory record before the window: {len(self.before_window['allocations'])} allocations "
                      f"({self.before_window['alive_bytes']} B) alive at the window's start, "
                      f"{self.before_window['events']} events, {self.before_window['fold_ms']} ms folding"
                      + (f"; not used: {self.before_window['error']}" if self.before_window["error"] else ""))

    def _first_parameter(self, module, name, param):
        """The model's construction begins: start the memory record before the window."""
        self._start_before_window("model's first parameter registration")
        return None

    def _remove_forward_hook(self) -> None:
        handle, self.fwd_handle = self.fwd_handle, None
        if handle is not None:
            try:
                handle.remove()
            except Exception:
                pass

    # -- logging and files ----------------------------------------------------------------
    def _log(self, message: str) -> None:
        line = f"{time.strftime('%Y-%m-%dT%H:%M:%S')} pid={os.getpid()} {message}"
        if len(self.log_lines) >= LOG_LINES_KEPT:
            self.log_lines, self.log_lost = self.log_lines[1:], True
        self.log_lines.append(line)
        if not self.rdir:
            return
        path = os.path.join(self.rdir, runfmt.COLLECTOR_LOG)
        try:
            runfmt.append_bytes(path, ("\n".join(self.log_lines) + "\n").encode("utf-8", "backslashreplace"))
            self.log_lines = []
            if not self.log_lost:
                self.log_error = None   # what failed before is written now
        except Exception as exc:
            if self.log_error is None:
                self.log_error = runfmt.write_error_text(exc, path)

    def _fail(self, where: str, exc: BaseException, path: str | None = None) -> None:
        """An error of ours, logged; a failed write (``OSError``) also becomes the rank's ``write_error``
        ("disk full: <path> (where)"), ``path`` naming the file meant when ``exc`` names a temporary one."""
        if isinstance(exc, OSError):
            self.error = f"{runfmt.write_error_text(exc, path)} ({where})"
            self.write_error = self.write_error or self.error
        else:
            self.error = f"{where}: {type(exc).__name__}: {exc}"
        self._log(f"ERROR {self.error}\n{traceback.format_exc()}")

    def _identify(self) -> bool:
        """Rank, world size and local rank of this process; True when ``ranks`` selects it."""
        self.rank = int(os.environ.get("RANK", "0") or 0)
        self.world_size = int(os.environ.get("WORLD_SIZE", "1") or 1)
        self.local_rank = int(os.environ.get("LOCAL_RANK", "0") or 0)
        try:
            import torch.distributed as dist

            if dist.is_available() and dist.is_initialized():
                self.rank, self.world_size = dist.get_rank(), dist.get_world_size()
        except Exception:
            pass
        ranks = self.options.get("ranks")
        return ranks is None or self.rank in {int(r) for r in ranks}

    def _open_rank_dir(self) -> bool:
        """Claim ``rank-<R>/`` (created exclusively, with its manifest). False when it cannot be made, or another
        process holds it (two jobs, or two processes without torch.distributed, on one --out)."""
        if self.rdir is not None:
            return True
        if self.state in ("done", "failed"):
            return False
        path = runfmt.rank_dir(self.run_dir, self.rank)
        writer = {"role": "rank", "rank": self.rank, "host": socket.gethostname(), "pid": os.getpid(),
                  "pid_start": runfmt.process_start_ticks(os.getpid())}
        files = [runfmt.MANIFEST_JSON, runfmt.COLLECTOR_LOG, runfmt.RANK_JSON]
        try:
            os.makedirs(self.run_dir, exist_ok=True)
            claimed = runfmt.claim_dir(path, writer, files)
        except OSError as exc:  # a full disk, a read-only folder: this rank records nothing, the job goes on
            self.error = self.write_error = f"{runfmt.write_error_text(exc, path)} (creating the rank folder)"
            self._stand_down("failed")
            if self.announce:
                runfmt.say(f"fsdpprof: rank {self.rank} recorded nothing: {self.write_error}")
            return False
        if not claimed:
            self._clash(path)
            return False
        self.rdir, self.manifest_writer, self.manifest_files = path, writer, files
        self._log(f"rank {self.rank}/{self.world_size} recording into {self.rdir} with options {self.options}")
        return True

    def _will_write(self, *names: str) -> None:
        """List ``names`` in the rank's manifest before creating them (``record --force`` removes only listed
        files); raises the ``OSError`` when the manifest cannot be written (then they must not be written)."""
        new = [n for n in names if n not in self.manifest_files]
        if self.rdir is None or not new:
            return
        runfmt.write_manifest(self.rdir, self.manifest_writer, self.manifest_files + new)
        self.manifest_files.extend(new)

    def _drop_profilers(self) -> None:
        """Stop our profilers without exporting anything (never raises)."""
        profs, self.prof, self.fallback_prof = (self.prof, self.fallback_prof), None, None
        for prof in profs:
            if prof is not None:
                try:
                    prof.on_trace_ready = None
                    with _quiet_kineto():
                        prof.stop()
                except Exception as exc:
                    self._log(f"stopping a profiler without its trace: {exc!r}")

    def _stand_down(self, state: str) -> None:
        """Record nothing more: no hooks, no profilers."""
        self.state = state
        self.uninstall()
        self._drop_profilers()

    def _clash(self, path: str) -> None:
        """Another process holds rank-<R>/: record nothing, write a clash note, say so in one line."""
        self._stand_down("done")
        holder = _claim_holder(path)
        host, pid = socket.gethostname(), os.getpid()
        name = f"rank-{self.rank}-{host}-{pid}.json"
        note = {"schema": runfmt.CLASH_SCHEMA, "rank": self.rank, "host": host, "pid": pid,
                "claimed_by": holder or None, "at": _dt.datetime.now(_dt.timezone.utc).isoformat(),
                "files": [f"{runfmt.CLASHES_DIR}/{name}"]}
        unwritten = ""
        try:
            runfmt.atomic_write_json(os.path.join(self.run_dir, runfmt.CLASHES_DIR, name), note)
        except Exception as exc:
            unwritten = f" (its note not written: {runfmt.write_error_text(exc)})"
        if self.announce:
            by = f"pid {holder.get('pid')} on {holder.get('host')}" if holder.get("pid") else "another process"
            runfmt.say(f"fsdpprof: rank {self.rank} is already recorded by {by} in {path}: "
                       f"this process (pid {pid}) records nothing{unwritten}")

    # -- hooks ----------------------------------------------------------------------------
    def _first_forward(self, module, args):
        """First module call of the process: start a fallback trace in case no optimizer ever steps."""
        self._remove_forward_hook()
        try:
            if os.getpid() != self.pid or self.primary is not None or self.state != "idle" or _is_child_process():
                return None
            if not self._before_window_running() and _user_profiler_running():
                return None  # (the record before the window and a profiler of the job's never run together)
            if _optimizer_exists():
                self._start_before_window("first module call")
                return None  # an optimizer will step (the usual case): no fallback trace needed
            if not self._identify():
                return None
            self._drop_before_window("no optimizer at the first module call: a trace of the whole process instead")
            self.fallback_prof = self._make_profiler(schedule=None)
            self._start_profiler(self.fallback_prof)
        except Exception as exc:
            self.fallback_prof = None
            self._log(f"fallback trace not started: {exc!r}")
        return None

    def _pre_hook(self, opt, args, kwargs):
        if os.getpid() != self.pid or self.state in ("done", "failed"):
            return None
        with self.lock:
            try:
                if self.primary is None:
                    self.primary = weakref.ref(opt)
                    self._remove_forward_hook()
                    self._drop_profilers()   # the fallback trace: an optimizer steps after all
                if not any(r() is opt for r in self.optimizers):
                    self.optimizers.append(weakref.ref(opt))
                n = self.steps_done
                if self.state == "window" and self.first_active <= n <= self.last_active:
                    self.tensors_grads.extend(self.info.grad_entries(inv.optimizer_params([opt]), n))
                    if n == self.last_active and opt is self.primary():
                        self.tensors_params = self.info.param_entries(n)
                if self.cuda is not None:
                    self.cuda.set_phase(runfmt.STAGE_OPTIMIZER, None)
            except Exception as exc:
                self._fail(f"optimizer pre-step hook (step {self.steps_done})", exc)
                self._abort()
        return None

    def _post_hook(self, opt, args, kwargs):
        if os.getpid() != self.pid or self.state in ("done", "failed"):
            return None
        with self.lock:
            try:
                n = self.steps_done
                if self.state == "window" and n == self.last_active and id(opt) not in self.opt_captured:
                    if not self.opt_captured:  # replace the window-start capture
                        self.tensors_opt = []
                    self.opt_captured.add(id(opt))
                    self.tensors_opt.extend(self.info.optimizer_entries([opt], n))
                if self.primary is None or opt is not self.primary():
                    return None
                if self._before_window_running():
                    self.before.stepped()
                self.steps_done = n + 1
                if self.cuda is not None:
                    self.cuda.set_phase(runfmt.STAGE_FORWARD, None)
                if self.state == "idle" and self.steps_done == self.skip:
                    self._start_window()
                elif self.state == "window" and self.deferred_start and self.steps_done == self.first_active:
                    self._sample_process_memory(n)
                    self._start_window_profiler()
                elif self.state in ("window", "aside"):
                    if self.state == "window":
                        self._sample_process_memory(n)
                    if n == self.last_active:
                        self._end_cpu_window()
                    if self.prof is not None:
                        with _quiet_kineto():
                            self.prof.step()
                    if n == self.last_active:
                        if self.state == "window":
                            self._finish("complete")
                        else:
                            self._finish("partial" if self.trace_written else runfmt.RANK_STEPPED_ASIDE)
                if self.state == "window" and self.steps_done == self.first_active:
                    self.cpu_start = _cpu_sample()
            except Exception as exc:
                self._fail(f"optimizer post-step hook (step {self.steps_done})", exc)
                self._abort()
        return None

    # -- the window -----------------------------------------------------------------------
    def _optimizers(self) -> list:
        return [o for o in (r() for r in self.optimizers) if o is not None]

    def _start_window(self) -> None:
        if _is_child_process() or not self._identify():
            self._stand_down("done")
            return
        if not self._open_rank_dir():
            return
        self.state = "window"
        model = inv.find_model(self._optimizers())
        self.info = inv.ModelInfo(model, self.world_size)
        self._log(f"model: {type(model).__name__ if model is not None else None}, framework {self.info.framework}, "
                  f"strategy {self.info.strategy}, {len(self.info.units)} units")
        # what exists now, in case the window does not end normally
        self.tensors_params = [dict(t, captured_at="after_step") for t in self.info.param_entries(self.skip - 1)]
        self.tensors_opt = self.info.optimizer_entries(self._optimizers(), self.skip - 1)
        self._install_signal_handlers()
        if not self._before_window_running() and _user_profiler_running():
            self.state = "aside"
            self.error = "torch.profiler was already running in this process: fsdpprof stepped aside (no trace)"
            self._log("WARNING " + self.error)
            self._write_rank_json(runfmt.RANK_STEPPED_ASIDE, self.error)
            return
        # what rank.json says if the process is killed before the window ends (rewritten once the trace is saved)
        self._write_rank_json("failed", f"no trace saved: the process ended or was killed inside the recording "
                                        f"window (steps {self.skip}-{self.last_active}) before fsdpprof saved it")
        if self.options["memory"] and torch.cuda.is_available():
            try:
                from fsdpprof.collect.cuda_memory import CudaMemoryRecorder

                entries = self.options.get("max_memory_entries") or runfmt.DEFAULT_MAX_MEMORY_ENTRIES
                self.cuda = CudaMemoryRecorder(self.info, int(entries))
                self.cuda.start()
            except Exception as exc:
                self.cuda = None
                self._fail("CUDA memory history", exc)
        if self._before_window_running() and self.first_active > self.skip:
            # the record runs on through the warmup steps (up to the first recorded one), and the window's
            # profiler starts then: two profilers cannot run at once, and a CPU-only profiler has no device
            # buffers for a warmup to settle
            self.deferred_start = True
            return
        self._start_window_profiler()

    def _start_window_profiler(self) -> None:
        """Stop the memory record before the window, then start the window's profiler at step ``steps_done``."""
        self.deferred_start = False
        self._finish_before_window()
        self.prof = self._make_profiler(schedule=self._schedule)
        self.prof.step_num = self.steps_done
        self.prof.current_action = self._schedule(self.steps_done)
        if hasattr(self.prof, "_prev_schedule_action"):
            self.prof._prev_schedule_action = self.prof.current_action
        self._start_profiler(self.prof)

    def _schedule(self, n: int):
        from torch.profiler import ProfilerAction

        if n < self.skip or n > self.last_active:
            return ProfilerAction.NONE
        if n < self.first_active:
            return ProfilerAction.WARMUP
        return ProfilerAction.RECORD_AND_SAVE if n == self.last_active else ProfilerAction.RECORD

    def _make_profiler(self, schedule):
        from torch.profiler import ProfilerActivity, profile

        activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if torch.cuda.is_available() else [])
        kwargs = {"schedule": schedule} if schedule is not None else {}
        return profile(activities=activities, record_shapes=True, profile_memory=bool(self.options["memory"]),
                       with_stack=bool(self.options["with_stack"]), on_trace_ready=self._trace_ready, **kwargs)

    def _start_profiler(self, prof) -> None:
        _patch_user_profiler_guard()
        _OURS.active = True
        try:
            with _quiet_kineto():
                prof.start()
        finally:
            _OURS.active = False
        self.clock_anchor = {"wall_ns": time.time_ns(), "profiler_us": None}

    def _trace_ready(self, prof) -> None:
        final = None
        try:
            if not self._open_rank_dir():
                return
            if self.window_trace and self.info is not None and not self.finished:
                # the inventory first: small, and kept if the process is killed while the (long) export runs
                self._write_inventory("partial", "written before the trace: the process ended or was killed "
                                                 "before fsdpprof finished saving")
            final = os.path.join(self.rdir, runfmt.TRACE_FILE)
            json_name = runfmt.TRACE_TEMP_FMT.format(pid=os.getpid())
            tmp_name = json_name + ".gz"
            # (kineto writes <json>.tmp and renames it: listed too, so that --force may remove what a crash left)
            self._will_write(json_name, json_name + KINETO_TMP_SUFFIX, tmp_name, runfmt.TRACE_FILE)
            tmp = os.path.join(self.rdir, tmp_name)
            export_trace_gz(prof, os.path.join(self.rdir, json_name), tmp)
            try:
                os.replace(tmp, final)
            except BaseException:
                runfmt.remove_quietly(tmp)
                raise
            self.trace_written = True
            self.trace_steps_done = self.steps_done
            # trace ts (µs) + baseTimeNanoseconds / 1000 is the Unix time in kineto's traces: anchor with it
            base = _trace_base_time_ns(final)
            if self.clock_anchor and base is not None:
                self.clock_anchor.update(base_time_ns=base, profiler_us=(self.clock_anchor["wall_ns"] - base) / 1000.0)
            if runfmt.TRACE_FILE not in self.files:
                self.files.append(runfmt.TRACE_FILE)
            self._log(f"trace written: {final} ({os.path.getsize(final)} bytes)")
            if not self.finished and self.window_trace:
                self._write_rank_json("partial", "trace saved; the process ended or was killed before fsdpprof "
                                                 "wrote the final inventory and this file's final status")
        except Exception as exc:
            self._fail("exporting the trace", exc, final)

    def _stop_profiler_saving(self) -> None:
        """Stop a running window profiler, exporting what it recorded (if it was recording)."""
        prof, self.prof = self.prof, None
        if prof is None:
            return
        try:
            with _quiet_kineto():
                prof.stop()
        except Exception as exc:
            self._fail("stopping the profiler", exc)

    def step_aside_for_user(self) -> None:
        """The job starts its own torch.profiler: drop the fallback trace, or end the window saving what it has."""
        with self.lock:
            try:
                if self._before_window_running():
                    self._log("WARNING the job started its own torch.profiler: fsdpprof stopped its memory record "
                              "before the window (memory allocated before the window is seen only where freed in it)")
                    self._drop_before_window("the job started its own torch.profiler")
                if self.fallback_prof is not None:
                    self._log("WARNING the job started its own torch.profiler: fsdpprof dropped its fallback trace")
                    self._drop_profilers()
                if self.prof is not None and self.state == "window":
                    self._log("WARNING the job started its own torch.profiler inside fsdpprof's window: "
                              "fsdpprof stepped aside (saved what it had)")
                    self._stop_profiler_saving()
                    self.state = "aside"
                    self.error = "the job started its own torch.profiler during the window: fsdpprof stepped aside"
                    if not self.trace_written:
                        self._write_rank_json(runfmt.RANK_STEPPED_ASIDE, self.error)
            except Exception as exc:
                self._fail("stepping aside", exc)

    def _finish(self, status: str, error: str | None = None) -> None:
        """Write inventory, snapshot and rank.json; remove every hook."""
        if self.finished:
            return
        self.finished = True
        self.state = "done"
        self.uninstall()
        self._restore_signal_handlers()
        error = error or self.error
        if self.before is not None:
            counted = self.before.stop_counting()
            if self.before_window is not None:
                self.before_window[runfmt.WINDOW_COUNTS_EVERY_THREAD] = counted and self.trace_written
        if self.cuda is not None:
            try:
                self._will_write(runfmt.SNAPSHOT_FILE)
                self.cuda.finish(self.rdir)
                self.files.append(runfmt.SNAPSHOT_FILE)
            except Exception as exc:
                self._fail("writing the CUDA memory snapshot", exc, os.path.join(self.rdir, runfmt.SNAPSHOT_FILE))
                error = error or self.error
            self.cuda = None
        if self.info is not None and not self._write_inventory("complete" if status == "complete" else "partial",
                                                               error):
            error = error or self.error
            status = "partial" if status == "complete" else status
        if status == "complete" and not self.trace_written:
            status, error = "partial", error or "no trace was written"
        if self.write_error:  # a file of the run could not be written: say which and why, first
            status = "partial" if status == "complete" else status
            if not error or self.write_error not in error:
                error = f"{self.write_error}; {error}" if error else self.write_error
        unwritten = self._write_rank_json(status, error)
        if self.announce:
            try:
                steps = self._steps_recorded()
                what = f"steps {steps[0]}-{steps[-1]}" if steps else "trace" if self.trace_written else "no trace"
                for extra in (self.note, self.write_error, unwritten and f"rank.json not written: {unwritten}"):
                    if extra:
                        what += f"; {extra}"
                label = "stepped aside for the job's own torch.profiler" if status == runfmt.RANK_STEPPED_ASIDE \
                    else status
                runfmt.say(f"fsdpprof: rank {self.rank} {label} ({what}) -> {self.rdir}")
            except Exception:
                pass

    def _write_inventory(self, status: str, error) -> bool:
        """Write inventory.json from what is captured so far (atomic; again at the finish); False if it failed."""
        path = os.path.join(self.rdir, runfmt.INVENTORY_JSON)
        try:
            doc = inv.build_inventory(self.info, rank=self.rank, world_size=self.world_size,
                                      optimizers=self._optimizers(),
                                      tensors=self.tensors_params + self.tensors_grads + self.tensors_opt,
                                      status=status, error=error)
            if self.before_window is not None:
                doc[runfmt.INVENTORY_BEFORE_WINDOW] = self.before_window
            self._will_write(runfmt.INVENTORY_JSON)
            runfmt.atomic_write_json(path, doc)
            if runfmt.INVENTORY_JSON not in self.files:
                self.files.append(runfmt.INVENTORY_JSON)
            return True
        except Exception as exc:
            self._fail("writing the inventory", exc, path)
            return False

    def _abort(self) -> None:
        """An error of ours: stop everything, keep what was written."""
        try:
            self._stop_profiler_saving()
            self._drop_profilers()
            if self.rdir is not None:
                self._finish("failed" if not self.trace_written else "partial")
            else:
                self.state = "failed"
                self.uninstall()
        except Exception:
            self.state = "failed"

    def _write_rank_json(self, status: str, error) -> str | None:
        """Write rank.json (never raises); returns None, or why it could not be written ("disk full: <path>")."""
        if self.rdir is None:
            return None
        path = os.path.join(self.rdir, runfmt.RANK_JSON)
        try:
            if torch.cuda.is_available():
                idx = torch.cuda.current_device()
                device, device_name = f"cuda:{idx}", torch.cuda.get_device_name(idx)
            else:
                device, device_name = "cpu", platform.processor() or platform.machine() or "cpu"
            steps = self._steps_recorded()
            doc = {"schema": runfmt.RANK_SCHEMA, "rank": self.rank, "local_rank": self.local_rank,
                   "world_size": self.world_size, "host": socket.gethostname(), "pid": os.getpid(),
                   "device": device, "device_name": device_name, **_distributed(),
                   "steps_recorded": steps, "profiler_steps": steps,
                   "window": {"skip_steps": self.skip, "warmup_steps": self.warmup, "active_steps": self.active},
                   "optimizer_steps_seen": self.steps_done,
                   "clock_anchor": self.clock_anchor, **({"cpu": self.cpu_window} if self.cpu_window else {}),
                   **self._process_memory_doc(),
                   "status": status, "error": error, "note": self._note_text(),
                   **({"write_error": self.write_error} if self.write_error else {}),
                   "files": sorted(set(self.files + [runfmt.COLLECTOR_LOG])), "fsdpprof_version": __version__}
            runfmt.write_status_json(path, doc)
            self._log(f"rank.json: status {status}" + (f" ({error})" if error else ""))
            return None
        except Exception as exc:
            why = runfmt.write_error_text(exc, path)
            self._log(f"writing rank.json failed: {why}")
            return why

    def _note_text(self):
        """rank.json's "note": the window cut short, collector.log incomplete (None when neither)."""
        notes = [n for n in (self.note, self.log_error and f"collector.log incomplete: {self.log_error}") if n]
        return "; ".join(notes) or None

    def _end_cpu_window(self) -> None:
        """rank.json's "cpu" from the samples at the start and the end of the active steps (never raises)."""
        try:
            self.cpu_window = _cpu_window(self.cpu_start, _cpu_sample())
        except Exception as exc:
            self.cpu_window = None
            self._log(f"CPU use over the window not recorded: {exc!r}")

    def _sample_process_memory(self, step: int) -> None:
        """The process's memory at the end of ``step`` (never raises; after a failure, logged, no more samples)."""
        if self.process_memory_error:
            return
        try:
            self.process_memory = self.process_memory or ProcessMemory()
            self.process_memory.sample(step)
        except Exception as exc:
            self.process_memory_error = f"process memory not sampled after step {step}: {exc!r}"
            self._log(self.process_memory_error)

    def _process_memory_doc(self) -> dict:
        """rank.json's "process_memory" ({} when there is none; never raises)."""
        try:
            doc = self.process_memory.to_doc() if self.process_memory else None
            if self.process_memory_error:
                doc = dict(doc or {}, error=self.process_memory_error)
        except Exception as exc:
            self._log(f"process memory not written: {exc!r}")
            doc = None
        return {runfmt.RANK_PROCESS_MEMORY: doc} if doc else {}

    def _steps_recorded(self) -> list[int]:
        """Steps whose ProfilerStep the trace holds in full (a crash or an early exit cuts the window short)."""
        if not (self.trace_written and self.window_trace):
            return []
        return list(range(self.first_active, min(self.last_active, self.trace_steps_done - 1) + 1))

    # -- endings --------------------------------------------------------------------------
    def _exit_exception(self):
        """Text of the exception that is ending the process, if any (sys.last_value is set by then)."""
        if self.exception_text:
            return self.exception_text
        value = getattr(sys, "last_value", None)
        if isinstance(value, BaseException) and not (isinstance(value, SystemExit) and value.code in (0, None)):
            return f"{type(value).__name__}: {value}"[:500]
        return None

    def _save_on_exit(self, reason: str, clean: bool = False) -> None:
        """Save what the window holds as the process ends; ``clean``: it ends normally (not killed)."""
        with self.lock:
            if os.getpid() != self.pid or self.finished or self.saving:
                return
            self.saving = True
            try:
                self._drop_before_window(f"{reason} before the window's profiler started")
                exc_text = self._exit_exception()
                if self.state in ("window", "aside"):
                    self._save_window(reason, clean, exc_text)
                elif self.state == "idle" and self.primary is None and self.fallback_prof is not None \
                        and self._open_rank_dir():
                    prof, self.fallback_prof = self.fallback_prof, None
                    with _quiet_kineto():
                        prof.stop()  # exports through on_trace_ready
                    self.window_trace = False
                    self.info = inv.ModelInfo(inv.find_model([]), self.world_size)
                    self.tensors_params = [dict(t, captured_at="at_exit") for t in self.info.param_entries(-1)]
                    if exc_text:
                        self._finish("failed", f"{reason} with {exc_text} before any optimizer step; the trace "
                                               "covers the process from its first module call to its exit")
                    else:
                        self._finish(runfmt.RANK_NO_OPTIMIZER, "no optimizer step was seen: the trace covers the "
                                     "process from its first module call to its exit (no step window); the "
                                     "inventory lists parameters only, captured at exit")
                elif self.state == "idle" and self.primary is not None and not _is_child_process():
                    if self._identify() and self._open_rank_dir():
                        why = (f"{reason} after {self.steps_done} optimizer steps, before the window "
                               f"(steps {self.skip}-{self.last_active}) began")
                        why += f": {exc_text}" if exc_text else "; lower --skip-steps or run more steps"
                        self._finish("failed", why)
            except Exception as exc:
                self._fail("saving at exit", exc)
            finally:
                self.saving = False
            if self.pending_signal is not None:  # a SIGTERM came while we were saving: die by it now
                signum, self.pending_signal = self.pending_signal, None
                self._resend(signum, None)

    def _save_window(self, reason: str, clean: bool, exc_text) -> None:
        """The process ends inside the window: save the trace so far and a status saying how far it got."""
        self._log(f"{reason} during the recording window (step {self.steps_done})")
        self._stop_profiler_saving()
        if self.info is not None and not any(t["step"] == self.steps_done for t in self.tensors_grads):
            # what the gradients held when the process ended (e.g. crash between backward and step)
            grads = self.info.grad_entries(inv.optimizer_params(self._optimizers()), self.steps_done)
            self.tensors_grads.extend(dict(t, captured_at="at_exit") for t in grads)
        why = f"{reason} at step {self.steps_done}, inside the window {self.skip}-{self.last_active}"
        if exc_text:
            why += f": {exc_text}"
        recorded = self._steps_recorded()
        clean_window = clean and not exc_text and self.state == "window"
        if self.state == "aside" and not self.trace_written:
            self._finish(runfmt.RANK_STEPPED_ASIDE, f"{self.error}; {why}" if self.error else why)
        elif clean_window and recorded:  # a short job ended normally inside the window: what it ran is recorded
            self.note = (f"window cut short: the job ended after step {self.steps_done - 1}, "
                         f"{len(recorded)} of {self.active} active steps recorded")
            self._finish("complete")
        elif clean_window:
            self._finish("failed", f"no recorded step: the job ended normally after {self.steps_done} optimizer "
                                   f"steps, before step {self.first_active} (the first recorded one) finished; lower "
                                   "--skip-steps or --warmup-steps, or run more steps")
        elif self.trace_written:
            self._finish("partial", why)
        else:
            self._finish("failed", f"no trace saved: {why}")

    def _atexit(self) -> None:
        self._save_on_exit("process exited", clean=True)

    def _install_signal_handlers(self) -> None:
        if threading.current_thread() is not threading.main_thread():
            return
        try:
            self.prev_sigterm = signal.getsignal(signal.SIGTERM)
            signal.signal(signal.SIGTERM, self._on_sigterm)
        except Exception as exc:
            self.prev_sigterm = None
            self._log(f"no SIGTERM handler: {exc!r}")

        def excepthook(etype, value, tb, _prev=sys.excepthook):
            self.exception_text = f"{etype.__name__}: {value}"[:500]
            _prev(etype, value, tb)

        sys.excepthook = excepthook

    def _restore_signal_handlers(self) -> None:
        try:
            if self.prev_sigterm is not None and threading.current_thread() is threading.main_thread() \
                    and signal.getsignal(signal.SIGTERM) == self._on_sigterm:
                signal.signal(signal.SIGTERM, self.prev_sigterm)
        except Exception:
            pass

    def _on_sigterm(self, signum, frame):
        if self.saving:  # interrupting our own save (e.g. the exit after an exception): let it finish
            self._log("SIGTERM received while saving: finishing the save first")
            self.pending_signal = signum
            return
        self._save_on_exit("SIGTERM received")
        self._resend(signum, frame)

    def _resend(self, signum, frame):
        """Behave as the job would have without us: the previous handler, or the default action."""
        prev = self.prev_sigterm
        try:
            signal.signal(signal.SIGTERM, prev if prev is not None else signal.SIG_DFL)
        except Exception:
            pass
        if callable(prev):
            prev(signum, frame)
        elif prev != signal.SIG_IGN:
            os.kill(os.getpid(), signal.SIGTERM)


# -- helpers ------------------------------------------------------------------------------
def _claim_holder(path: str, wait_s: float = 2.0) -> dict:
    """Host and pid of the process that claimed the rank folder ``path``, from its manifest; {} when unknown.
    The holder writes its manifest just after creating the folder: wait up to ``wait_s`` seconds for it."""
    deadline = time.monotonic() + wait_s
    while True:
        try:
            writer = runfmt.read_json(os.path.join(path, runfmt.MANIFEST_JSON)).get("writer") or {}
            return {k: writer.get(k) for k in ("host", "pid")}
        except Exception:
            if time.monotonic() >= deadline:
                return {}
            time.sleep(0.02)


def _optimizer_exists() -> bool:
    return any(issubclass(type(o), torch.optim.Optimizer) for o in gc.get_objects())


def _user_profiler_running() -> bool:
    try:
        from torch.autograd import profiler as autograd_profiler

        return bool(autograd_profiler._is_profiler_enabled) or bool(torch._C._autograd._profiler_enabled())
    except Exception:
        return False


def _patch_user_profiler_guard() -> None:
    """When the user's code starts a profiler while ours runs, ours steps aside first (no clash)."""
    global _GUARD_INSTALLED
    if _GUARD_INSTALLED:
        return
    _GUARD_INSTALLED = True
    from torch.autograd import profiler as autograd_profiler

    original = autograd_profiler.profile._prepare_trace

    def _prepare_trace(self_, *a, **kw):
        if not getattr(_OURS, "active", False):
            rec = _RECORDER if _RECORDER is not None else _API_RECORDERS[-1] if _API_RECORDERS else None
            if rec is not None:
                rec.step_aside_for_user()
        result = original(self_, *a, **kw)
        quiet = getattr(_OURS, "quiet", None)
        if quiet is not None:  # our own prepare may have initialised kineto, which sets its log level
            quiet.requiet()
        return result

    autograd_profiler.profile._prepare_trace = _prepare_trace


# -- kineto's own stderr lines ------------------------------------------------------------------
# libkineto prints "USDT: ... profiler_start" / "profiler_stop" on stderr at severity USDT (5), above its
# threshold libkineto::Logger::severityLevel_ (ERROR, 4, unless KINETO_LOG_LEVEL says otherwise). fsdpprof
# raises that exported int only during its own profiler calls and puts back what it found.
_KINETO_SEVERITY_SYMBOL = "_ZN9libkineto6Logger14severityLevel_E"
_KINETO_QUIET = 6           # above USDT: nothing of kineto's is printed during our calls
_KINETO_LEVEL = None        # ctypes.c_int over the symbol, or False when not found


def _kineto_level():
    global _KINETO_LEVEL
    if _KINETO_LEVEL is None:
        _KINETO_LEVEL = False
        for name in ("libtorch_cpu.so", "libtorch.so", "libtorch_cuda.so"):
            try:        # (inside the user's job: nothing here may raise, torch.__file__ included)
                path = os.path.join(os.path.dirname(torch.__file__), "lib", name)
                if os.path.exists(path):
                    _KINETO_LEVEL = ctypes.c_int.in_dll(ctypes.CDLL(path), _KINETO_SEVERITY_SYMBOL)
                    break
            except Exception:
                continue
    return _KINETO_LEVEL


class _QuietKineto:
    """Silence kineto's stderr lines during one of fsdpprof's profiler calls (start, step, stop)."""

    def __enter__(self):
        # a KINETO_LOG_LEVEL of the user's own is a request for kineto's lines: leave them
        self.level = _kineto_level() if "KINETO_LOG_LEVEL" not in os.environ else False
        self.restore = None
        if self.level:
            self.restore = self.level.value
            self.level.value = _KINETO_QUIET
            _OURS.quiet = self
        return self

    def requiet(self) -> None:
        """Called after a prepare: if kineto initialised inside it, keep its new level to restore later."""
        if self.level and self.level.value != _KINETO_QUIET:
            self.restore = self.level.value
            self.level.value = _KINETO_QUIET

    def __exit__(self, *exc):
        if self.level:
            _OURS.quiet = None
            if self.level.value == _KINETO_QUIET:
                self.level.value = self.restore
        return False


_quiet_kineto = _QuietKineto


def export_trace_gz(prof, json_path: str, gz_path: str, level: int = TRACE_GZIP_LEVEL) -> None:
    """The profiler's chrome trace into ``gz_path`` (gzip at ``level``, in 1 MiB blocks), through ``json_path``
    (kineto writes the JSON itself; removed after). Nothing half-written is left when it fails."""
    done = False
    folder = os.path.dirname(os.path.abspath(json_path))
    try:
        prof.export_chrome_trace(json_path)
        cut = False
        if not os.path.exists(json_path):
            cut = os.path.isfile(json_path + KINETO_TMP_SUFFIX)     # kineto began writing, and its write failed
            if not runfmt.out_of_space(folder):
                # kineto wrote nothing, yet there is room now (another rank's failed export freed it): once more
                _drop_kineto_tmp(json_path)
                try:
                    prof.export_chrome_trace(json_path)
                except RuntimeError:     # a kineto that saves a trace once ("Trace is already saved")
                    pass
        if not os.path.exists(json_path):  # kineto reports a failed write on its log only: say why
            # (a write cut short on a disk that has room again: another rank's failed export freed what filled it)
            code = errno.ENOSPC if cut or runfmt.out_of_space(folder) else errno.EIO
            raise OSError(code, "the profiler wrote no trace file", json_path)
        compressor = zlib.compressobj(level, zlib.DEFLATED, 16 + zlib.MAX_WBITS)   # (16 +: the gzip format)
        fd = os.open(gz_path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | getattr(os, "O_CLOEXEC", 0), 0o666)
        try:
            with open(json_path, "rb") as fin:
                for block in iter(lambda: fin.read(1 << 20), b""):
                    runfmt.write_all(fd, compressor.compress(block))
            runfmt.write_all(fd, compressor.flush())
        finally:
            os.close(fd)
        done = True
    finally:
        _drop_kineto_tmp(json_path)
        runfmt.remove_quietly(json_path)
        if not done:
            runfmt.remove_quietly(gz_path)


def _drop_kineto_tmp(json_path: str) -> None:
    """Remove kineto's temporary of a failed export of ``json_path``, emptied first (kineto keeps it open until
    the profiler is freed, and an unlinked open file keeps its blocks)."""
    kineto_tmp = json_path + KINETO_TMP_SUFFIX
    if os.path.isfile(kineto_tmp) and not os.path.islink(kineto_tmp):
        try:
            os.truncate(kineto_tmp, 0)
        except OSError:
            pass
    runfmt.remove_quietly(kineto_tmp)


def _trace_base_time_ns(path: str):
    """``baseTimeNanoseconds`` from the head of an exported chrome trace (None when absent)."""
    try:
        with (gzip.open if path.endswith(".gz") else open)(path, "rb") as fh:
            match = re.search(rb'"baseTimeNanoseconds"\s*:\s*(\d+)', fh.read(1 << 16))
        return int(match.group(1)) if match else None
    except Exception:
        return None


def _distributed() -> dict:
    """rank.json's "backend" and "process_groups" (name, size, ranks): None and [] without torch.distributed."""
    doc = {"backend": None, "process_groups": []}
    try:
        import torch.distributed as dist
        from torch.distributed import distributed_c10d as c10d

        if dist.is_available() and dist.is_initialized():
            doc["backend"] = str(dist.get_backend())
            world = c10d._world
            for pg, ranks_map in list(world.pg_group_ranks.items()):
                name = world.pg_names.get(pg) if hasattr(world, "pg_names") else None
                ranks = sorted(int(r) for r in ranks_map.keys())
                doc["process_groups"].append({"name": str(name or getattr(pg, "group_name", "")),
                                              "size": len(ranks), "ranks": ranks})
    except Exception:
        pass
    return doc


def _task_schedstat() -> dict:
    """Per thread of this process (Linux): tid -> (ns on a CPU, ns waiting on a run queue); {} elsewhere."""
    out = {}
    try:
        tids = os.listdir("/proc/self/task")
    except OSError:
        return out
    for tid in tids:
        try:
            with open(f"/proc/self/task/{tid}/schedstat") as f:
                fields = f.read().split()
            out[tid] = (int(fields[0]), int(fields[1]))
        except (OSError, ValueError, IndexError):
            continue   # a thread that ended meanwhile, or no schedstats in this kernel
    return out


def _cpu_sample() -> dict | None:
    """Wall clock, process CPU time and per-thread schedstat now (None if any of it fails)."""
    try:
        return {"unix_ns": time.time_ns(), "mono_ns": time.perf_counter_ns(), "cpu_ns": time.process_time_ns(),
                "tasks": _task_schedstat(), "tid": str(threading.get_native_id())}
    except Exception:
        return None


def _cpu_window(start: dict | None, end: dict | None) -> dict | None:
    """rank.json "cpu": the host's usable cores, the ranks on it, torch's threads and, between the two samples,
    this process's wall, CPU, on-CPU and run-queue wait time (µs; the last two from the threads' schedstat,
    summed over the threads alive at the end: absent without /proc), and the same two of the training thread (the
    one that steps the optimizer: ``training_run_us``, ``training_runqueue_us``). None without both samples."""
    if not start or not end:
        return None
    try:
        usable = len(os.sched_getaffinity(0))
    except (AttributeError, OSError):
        usable = os.cpu_count()
    doc = {"usable_cores": usable, "cpu_count": os.cpu_count(), "torch_threads": torch.get_num_threads(),
           "start_unix_ns": start["unix_ns"], "end_unix_ns": end["unix_ns"],
           "wall_us": (end["mono_ns"] - start["mono_ns"]) / 1e3, "cpu_us": (end["cpu_ns"] - start["cpu_ns"]) / 1e3}
    lws = os.environ.get("LOCAL_WORLD_SIZE")
    if lws and lws.strip().isdigit():
        doc["local_world_size"] = int(lws)
    if end["tasks"]:
        run = wait = 0
        for tid, (r1, w1) in end["tasks"].items():
            r0, w0 = start["tasks"].get(tid, (0, 0))   # a thread started inside the window counts from zero
            run, wait = run + max(r1 - r0, 0), wait + max(w1 - w0, 0)
        doc.update(run_us=run / 1e3, runqueue_us=wait / 1e3, threads=len(end["tasks"]))
        tid = end.get("tid")
        if tid is not None and tid == start.get("tid") and tid in end["tasks"] and tid in start["tasks"]:
            (r0, w0), (r1, w1) = start["tasks"][tid], end["tasks"][tid]
            doc.update(training_run_us=max(r1 - r0, 0) / 1e3, training_runqueue_us=max(w1 - w0, 0) / 1e3)
    return doc
