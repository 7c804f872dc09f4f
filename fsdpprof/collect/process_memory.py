"""The process's memory beside the allocator's, sampled at the end of every step of the window (stdlib + torch).

rank.json's ``process_memory``: ``source``, ``device``, ``note`` (why the figures are not this process's alone),
``nccl_env`` (the NCCL settings that size its buffers) and ``samples``, one per step, in bytes. On CUDA
``used_bytes`` is NVML's per-process figure when ``pynvml`` lists this process, else the device's used memory
(``torch.cuda.mem_get_info``), with the allocator's reserved / allocated bytes and their peaks; on CPU
``used_bytes`` / ``used_peak_bytes`` are VmRSS / VmHWM of /proc/self/status.
"""
from __future__ import annotations

import os

import torch

from fsdpprof import runfmt

PROC_STATUS = "/proc/self/status"


def read_proc_status(path: str = PROC_STATUS) -> dict:
    """VmRSS and VmHWM of ``path`` in bytes ({} where there is no such file, e.g. not Linux)."""
    out = {}
    try:
        with open(path) as fh:
            for line in fh:
                key, _, rest = line.partition(":")
                if key in ("VmRSS", "VmHWM"):
                    parts = rest.split()
                    out[key] = int(parts[0]) * (1024 if parts[1:2] == ["kB"] else 1)
    except (OSError, ValueError, IndexError):
        return {}
    return out


class ProcessMemory:
    """Samples of one process's memory; every method may raise (the recorder catches and logs)."""

    def __init__(self) -> None:
        self.cuda = torch.cuda.is_available()
        self.device = self.source = self.note = None
        self.samples: list[dict] = []
        self._nvml = None          # (pynvml module, device handle) once NVML lists this process
        self._nvml_tried = False

    def _nvml_used(self, idx: int) -> int | None:
        """This process's memory on device ``idx`` from NVML; None when NVML is not there or does not list it
        (a container's PID namespace hides the host PIDs NVML reports)."""
        if self._nvml is None:
            if self._nvml_tried:
                return None
            self._nvml_tried = True
            try:
                import pynvml      # optional (nvidia-ml-py): imported only on CUDA, only here
            except ImportError:
                return None
            pynvml.nvmlInit()
            handle = _nvml_handle(pynvml, idx)
            if handle is None:
                return None
            self._nvml = (pynvml, handle)
        pynvml, handle = self._nvml
        procs = list(pynvml.nvmlDeviceGetComputeRunningProcesses(handle))
        try:
            procs += list(pynvml.nvmlDeviceGetGraphicsRunningProcesses(handle))
        except pynvml.NVMLError:
            pass
        used = [p.usedGpuMemory for p in procs if p.pid == os.getpid() and isinstance(p.usedGpuMemory, int)]
        return sum(used) if used else None

    def _cuda_sample(self, step: int) -> dict:
        idx = torch.cuda.current_device()
        self.device = f"cuda:{idx}"
        used = None
        if self.source in (None, runfmt.PROCESS_MEMORY_NVML):
            used = self._nvml_used(idx)
            if used is not None:
                self.source = runfmt.PROCESS_MEMORY_NVML
        if used is None:
            free, total = torch.cuda.mem_get_info(idx)
            used = int(total) - int(free)
            if self.source is None:
                self.source = runfmt.PROCESS_MEMORY_MEM_GET_INFO
                self.note = _shared_device_note(idx)
            elif self.note is None:     # NVML listed this process before, not now
                self.note = (f"NVML did not list this process after step {step}: from then on the device's used "
                             f"memory (torch.cuda.mem_get_info, every process on cuda:{idx})")
        return {"step": step, "used_bytes": int(used), "reserved_bytes": int(torch.cuda.memory_reserved(idx)),
                "max_reserved_bytes": int(torch.cuda.max_memory_reserved(idx)),
                "allocated_bytes": int(torch.cuda.memory_allocated(idx)),
                "max_allocated_bytes": int(torch.cuda.max_memory_allocated(idx))}

    def _cpu_sample(self, step: int) -> dict | None:
        st = read_proc_status()
        if "VmRSS" not in st:
            self.note = f"{PROC_STATUS} not readable here: no process memory on this platform"
            return None
        self.device, self.source = "cpu", runfmt.PROCESS_MEMORY_PROC_STATUS
        return {"step": step, "used_bytes": st["VmRSS"], "used_peak_bytes": st.get("VmHWM", st["VmRSS"])}

    def sample(self, step: int) -> None:
        """The process's memory at the end of optimizer step ``step``."""
        s = self._cuda_sample(step) if self.cuda else self._cpu_sample(step)
        if s is not None:
            self.samples.append(s)

    def to_doc(self) -> dict | None:
        """rank.json's ``process_memory`` (None before the first sample and without a note)."""
        if not self.samples and not self.note:
            return None
        return {"source": self.source, "device": self.device, "note": self.note,
                "nccl_env": {k: os.environ[k] for k in runfmt.NCCL_BUFFER_ENV if k in os.environ},
                "samples": list(self.samples)}


def _nvml_handle(pynvml, idx: int):
    """NVML's handle of torch's device ``idx`` (by UUID: CUDA_VISIBLE_DEVICES renumbers devices), None if unknown."""
    uuid = getattr(torch.cuda.get_device_properties(idx), "uuid", None)
    if uuid is not None:
        for cand in (str(uuid), "GPU-" + str(uuid)):
            try:
                return pynvml.nvmlDeviceGetHandleByUUID(cand)
            except pynvml.NVMLError:
                continue
    if not os.environ.get("CUDA_VISIBLE_DEVICES"):
        return pynvml.nvmlDeviceGetHandleByIndex(idx)
    return None


def _shared_device_note(idx: int) -> str:
    """What torch.cuda.mem_get_info's figure includes: every process on the device (several ranks on a host
    that runs more ranks than it has devices)."""
    note = (f"device-wide figure (torch.cuda.mem_get_info, NVML not available): cuda:{idx}'s used memory, every "
            f"process on it included")
    lws, n_dev = os.environ.get("LOCAL_WORLD_SIZE", ""), torch.cuda.device_count()
    if lws.isdigit() and int(lws) > n_dev:
        note += f"; {lws} ranks share this host's {n_dev} device(s), so several of them count here"
    return note
