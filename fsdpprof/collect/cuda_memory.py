"""CUDA memory history for the window (used only behind ``torch.cuda.is_available()``).

Records ``torch.cuda.memory._record_memory_history`` (bounded entries, python stacks), tags every allocation with
the FSDP phase and unit through ``_set_memory_metadata`` (the ``user_metadata`` of each trace entry: see
:func:`metadata`) and writes ``memory_snapshot.pickle`` at the end of the window.
"""
from __future__ import annotations

import os
import pickle

import torch

from fsdpprof import runfmt


def metadata(phase: str, unit: str | None) -> str:
    return f"fsdpprof phase={phase} unit={unit if unit is not None else ''}"


class CudaMemoryRecorder:
    def __init__(self, info, max_entries: int = runfmt.DEFAULT_MAX_MEMORY_ENTRIES):
        self.info = info
        self.max_entries = max_entries
        self.handles = []
        self.unit_stack: list[str] = []

    def set_phase(self, phase: str, unit: str | None) -> None:
        try:
            torch.cuda.memory._set_memory_metadata(metadata(phase, unit))
        except Exception:
            pass

    def start(self) -> None:
        torch.cuda.memory._record_memory_history(enabled="all", context="all", stacks="python",
                                                 max_entries=self.max_entries)
        self.install_phase_hooks()

    def install_phase_hooks(self) -> None:
        """Global module hooks that tag allocations with (forward|backward, unit) while the window runs."""
        units = dict(self.info.unit_modules) if self.info is not None else {}
        if not units:
            return
        from torch.nn.modules import module as module_mod

        def pre(module, args):
            unit = units.get(id(module))
            if unit is not None:
                self.unit_stack.append(unit)
                self.set_phase(runfmt.STAGE_FORWARD, unit)

        def post(module, args, output):
            unit = units.get(id(module))
            if unit is None:
                return None
            if self.unit_stack:
                self.unit_stack.pop()
            self.set_phase(runfmt.STAGE_FORWARD, self.unit_stack[-1] if self.unit_stack else None)
            # the gradient w.r.t. this unit's output arrives when its backward starts; an outer unit returning
            # the same tensor keeps the innermost unit's tag
            for t in output if isinstance(output, (tuple, list)) else (output,):
                if isinstance(t, torch.Tensor) and t.requires_grad:
                    if not getattr(t, "_fsdpprof_tagged", False):
                        t._fsdpprof_tagged = True
                        t.register_hook(lambda g, _u=unit: self.set_phase(runfmt.STAGE_BACKWARD, _u))
                    break
            return None

        self.handles.append(module_mod.register_module_forward_pre_hook(pre))
        self.handles.append(module_mod.register_module_forward_hook(post))

    def finish(self, rank_dir: str) -> None:
        """Remove the hooks, write ``memory_snapshot.pickle`` into ``rank_dir`` and stop the history."""
        for h in self.handles:
            h.remove()
        self.handles = []
        try:
            runfmt.atomic_write_bytes(os.path.join(rank_dir, runfmt.SNAPSHOT_FILE),
                                      pickle.dumps(torch.cuda.memory._snapshot()))
        finally:
            torch.cuda.memory._record_memory_history(enabled=None)
            self.set_phase("", None)
