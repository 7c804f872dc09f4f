"""The memory-only record before the profiling window (CPU runs): stdlib + torch only.

The window's trace sees an allocation made before it only when the window frees it, and the inventory names only
params, grads and optimizer state; DDP's gradient buckets (made at construction or in step 1, alive to the end) are
neither.  From the model's construction (its first parameter registration, or the first module call) to the first
recorded step, a profiler with ``profile_memory`` and nothing else runs (no op events, shapes or stacks: its only
record-function scope is one training never enters).  Every FOLD_EVERY_STEPS optimizer steps, at a fork and at the
window's start it is stopped and its allocation events are folded into the set of live allocations (address ->
bytes, step); only that set is kept.  What is still alive when the window starts goes into inventory.json's
``before_window``, with c10's own count of the bytes every thread allocated since the start and still holds (its
CPU allocator's ``caffe2_report_cpu_memory_usage`` flag, on from the record's start to the window's end): a
buffer a gloo thread freed looks alive to any profiler, and the analysis drops as many bytes of such as the two
differ by.  In the window, the flag makes each ``[memory]`` event's "Total Allocated" c10's count of every
thread's bytes: what gloo's threads allocate and free unseen shows there (``window_counts_every_thread``).

Runs inside the user's job: every method catches its errors (the record stops, with the reason kept) and never
raises.  Cost: the folds (their wall time is written as ``fold_ms``), one allocator callback per allocation before
the window (and a locked size-table update in c10); inside the window, that update for the allocations of the
threads the profiler does not record (the recorded thread pays it anyway).
"""
from __future__ import annotations

import bisect
import contextlib
import os
import threading
import time

import torch

from fsdpprof import runfmt
from fsdpprof.runfmt import BEFORE_WINDOW_SOURCE

_DEVICE_CPU = "cpu"
C10_INFO = 0           # c10's INFO log level (FLAGS_caffe2_log_level; WARNING, its default, is 2)
COUNT_FROM_IMPORT = runfmt.COUNT_FROM_IMPORT
FOLD_EVERY_STEPS = 8   # fold (stop, read, restart: ~the cost of the record) every this many optimizer steps


class BeforeWindowMemory:
    """Live CPU allocations from ``start`` to ``finish`` (one thread: the one that started it)."""

    def __init__(self, log=None, quiet=None):
        self.live: dict[int, tuple[int, int]] = {}   # address -> (bytes, optimizer steps completed at its allocation)
        self.running = False
        self.thread = None
        self.started_by = None     # what started it: "parameter registration" / "first module call"
        self.step = 0              # optimizer steps completed (the step new allocations are made in)
        self.step_ns: list[int] = []   # when each optimizer step ended (time.time_ns, the profiler's clock)
        self.events = 0            # allocation and free events folded
        self.frees_unseen = 0      # frees of allocations made before the record started
        self.frees_unseen_bytes = 0    # and their bytes (c10 knows them when it counts from torch's import)
        self.fold_ns = 0           # wall time spent stopping, folding and restarting
        self.error = None          # why the record stopped early
        self.paused = False        # stopped around a fork
        # c10's own count of the CPU bytes allocated (every thread, while its flag is on) before the first and
        # after the last event: their difference is what the record's allocations hold, frees on gloo's threads
        # (which no profiler records) included
        self.total_first = self.total_last = None
        self.flag = None           # ctypes view of c10's FLAGS_caffe2_report_cpu_memory_usage
        self.flag_was = None       # its value before the record
        self.flag_ok = False       # the flag was found (and set for the record)
        self.counted_from = None   # when the count began: COUNT_FROM_IMPORT (every CPU byte torch made) / "record start"
        self._log = log or (lambda msg: None)
        self._quiet = quiet or contextlib.nullcontext   # silences kineto's own lines around each profiler call

    # -- profiler calls -------------------------------------------------------------------------
    @staticmethod
    def _config():
        from torch._C._profiler import ProfilerConfig, ProfilerState, _ExperimentalConfig

        # (state, report_input_shapes, profile_memory, with_stack, with_flops, with_modules, experimental_config)
        return ProfilerConfig(ProfilerState.KINETO, False, True, False, False, False, _ExperimentalConfig())

    def _enable(self) -> None:
        from torch._C._profiler import ProfilerActivity, RecordScope

        cfg = self._config()
        with self._quiet() as quiet:
            torch._C._autograd._prepare_profiler(cfg, {ProfilerActivity.CPU})
            if hasattr(quiet, "requiet"):   # kineto may have set its log level as it initialised
                quiet.requiet()
            # one scope that training never enters: no op is recorded, only the allocator's events
            torch._C._autograd._enable_profiler(cfg, {ProfilerActivity.CPU}, {RecordScope.STATIC_RUNTIME_MODEL})

    def _disable_and_fold(self) -> None:
        with self._quiet():
            result = torch._C._autograd._disable_profiler()
        self.running = False
        allocs = []
        for ev in result.experimental_event_tree():
            stack = [ev]
            while stack:
                e = stack.pop()
                stack.extend(e.children)
                f = e.extra_fields
                if type(f).__name__ == "_ExtraFields_Allocation" and getattr(f.device, "type", None) == _DEVICE_CPU:
                    allocs.append((e.start_time_ns, int(f.ptr), int(f.alloc_size), int(f.total_allocated)))
        allocs.sort(key=lambda a: a[0])
        self.events += len(allocs)
        if allocs:
            if self.total_first is None:
                self.total_first = allocs[0][3] - allocs[0][2]
            self.total_last = allocs[-1][3]
        for t_ns, ptr, size, _ in allocs:
            if size > 0:
                self.live[ptr] = (size, bisect.bisect_right(self.step_ns, t_ns))
            elif self.live.pop(ptr, None) is None:
                self.frees_unseen += 1
                self.frees_unseen_bytes -= size

    # -- the record's life ----------------------------------------------------------------------
    def _count_every_thread(self, on: bool) -> None:
        """c10's CPU allocator counts the bytes of every thread (its flag on) or as before (never raises).  Not
        turned on where c10 logs at INFO level (it would then print a line per allocation into the job's stderr)."""
        try:
            if self.flag is None:
                import ctypes

                lib = ctypes.CDLL(os.path.join(os.path.dirname(torch.__file__), "lib", "libc10.so"))
                self.flag = ctypes.c_bool.in_dll(lib, "FLAGS_caffe2_report_cpu_memory_usage")
                self.flag_was = bool(self.flag.value)
                self.flag_ok = self.flag_was or ctypes.c_int.in_dll(lib, "FLAGS_caffe2_log_level").value > C10_INFO
                if not self.flag_ok:
                    self._log("c10 logs at INFO level: its count of every thread's CPU bytes left off (it would "
                              "print a line per allocation)")
            if self.flag_ok:
                self.flag.value = True if on else self.flag_was
        except Exception as exc:
            self.flag, self.flag_ok = False, False
            self._log(f"c10's count of every thread's CPU bytes unavailable: {exc!r}")

    def count_from_import(self) -> None:
        """Start c10's count of every thread's CPU bytes now, as torch is imported (before any tensor of the job):
        its count in the window is then every CPU byte alive (never raises)."""
        self._count_every_thread(True)
        if self.flag_ok:
            self.counted_from = COUNT_FROM_IMPORT

    def start(self, why: str) -> bool:
        """Start the record (True when it runs)."""
        if self.running or self.error:
            return self.running
        try:
            if self.counted_from is None:
                self._count_every_thread(True)
                self.counted_from = "record start" if self.flag_ok else None
            self._enable()
            self.running, self.thread, self.started_by = True, threading.get_ident(), why
            self._log(f"memory record before the window started at the {why}")
        except Exception as exc:
            self._stop_with(f"not started: {exc!r}")
        return self.running

    def _stop_with(self, why: str) -> None:
        self.error = self.error or why
        if self.flag_ok:
            self._count_every_thread(False)
        self._log(f"memory record before the window stopped: {why}")
        if self.running:
            try:
                with self._quiet():
                    torch._C._autograd._disable_profiler()
            except Exception:
                pass
        self.running = False

    def fold(self, *, restart: bool = True) -> None:
        """Fold the events so far into the live set; restart unless told not to (never raises)."""
        if not self.running:
            return
        if threading.get_ident() != self.thread:
            self._stop_with("the step ran on another thread than the one that started the record")
            return
        t0 = time.perf_counter_ns()
        try:
            self._disable_and_fold()
            if restart:
                self._enable()
                self.running = True
        except Exception as exc:
            self._stop_with(f"{exc!r}")
        finally:
            self.fold_ns += time.perf_counter_ns() - t0

    def stepped(self) -> None:
        """An optimizer step ended: count it; fold every FOLD_EVERY_STEPS steps (keeps the record's memory
        bounded: a few bytes per allocation event in between)."""
        self.step_ns.append(time.time_ns())
        self.step += 1
        if self.step % FOLD_EVERY_STEPS == 0:
            self.fold()

    def before_fork(self) -> None:
        if self.running and threading.get_ident() == self.thread:
            self.fold(restart=False)
            self.paused = True

    def after_fork_parent(self) -> None:
        if self.paused:
            self.paused = False
            try:
                self._enable()
                self.running = True
            except Exception as exc:
                self._stop_with(f"not restarted after a fork: {exc!r}")

    def after_fork_child(self) -> None:
        """The forked process (a data loader worker) records nothing."""
        self.paused = self.running = False
        self.error = self.error or "forked process"
        if self.flag_ok:
            self._count_every_thread(False)

    def stop_counting(self) -> bool:
        """The window ended: c10's count of every thread's bytes off again; True when it was on from the record's
        start until now (the window's ``[memory]`` events' "Total Allocated" then count every thread; never
        raises)."""
        on = bool(self.flag_ok and self.error is None)
        if self.flag_ok:
            self._count_every_thread(False)
        return on

    def drop(self, why: str) -> None:
        """Stop without keeping anything (the job's own profiler, a fallback trace): never raises."""
        self._stop_with(why)
        self.live = {}

    def finish(self) -> dict:
        """Stop and return inventory.json's ``before_window`` (never raises)."""
        try:
            self.fold(restart=False)
        except Exception as exc:
            self._stop_with(f"{exc!r}")
        allocs = sorted([a, b, s] for a, (b, s) in self.live.items())
        every_thread = self.total_last - self.total_first if self.flag_ok and self.total_first is not None else None
        return {"source": BEFORE_WINDOW_SOURCE, "started_by": self.started_by, "steps": self.step,
                "events": self.events, "frees_unseen": self.frees_unseen,
                "frees_unseen_bytes": self.frees_unseen_bytes, "fold_ms": round(self.fold_ns / 1e6, 3),
                "error": self.error, "alive_bytes": sum(a[1] for a in allocs),
                "alive_bytes_every_thread": every_thread,
                "every_thread_bytes_at_start": self.total_first if self.flag_ok else None,
                "every_thread_counted_from": self.counted_from if self.flag_ok else None, "allocations": allocs if not self.error else []}


def register_fork_hooks(get) -> None:
    """Pause the record around a fork of the process (``get()``: the current record or None); never raises."""
    def call(name):
        def hook():
            try:
                rec = get()
                if rec is not None:
                    getattr(rec, name)()
            except Exception:
                pass
        return hook

    try:
        os.register_at_fork(before=call("before_fork"), after_in_parent=call("after_fork_parent"),
                            after_in_child=call("after_fork_child"))
    except Exception:
        pass
