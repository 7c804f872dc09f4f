"""CPU contention: how much slower a CPU rank runs when the target puts more (or fewer) ranks on a host.

Processor sharing of the host's C cores: L runnable threads give each thread a contention (wall time runnable /
time on a CPU) of ``max(1, L / C)``; a rank's measured contention is ``1 + runqueue / run`` and its demand
(cores) ``(run + runqueue) / wall`` (rank.json ``cpu``, µs). What the job's ranks leave of ``C x contention`` is
the other load. A CPU run's whole step stretches by the target's contention over the model's at the run's own
ranks per host; accelerator ranks are not scaled.
"""
from __future__ import annotations

from dataclasses import dataclass

from fsdpprof.analyze import model
from fsdpprof.analyze.whatif.targets import Source, Target, ranks_on_host


@dataclass(frozen=True)
class HostLoad:
    """One rank's measured CPU load: ``cores`` usable on its host, ``ranks`` of the job on it, ``demand``
    (cores, uncontended) and ``contention`` (>= 1)."""

    cores: int
    ranks: int
    demand: float
    contention: float

    @property
    def other_load(self) -> float:
        """Runnable threads of everything else on the host."""
        return max(0.0, self.cores * self.contention - self.ranks * self.demand)

    def contention_at(self, ranks: int) -> float:
        """The model's contention (>= 1) of a rank with ``ranks`` ranks of this demand on the host."""
        return max(1.0, (ranks * self.demand + self.other_load) / self.cores)

    def step_scale(self, ranks: int) -> float:
        """Step time with ``ranks`` ranks on the host / step time as recorded."""
        return self.contention_at(ranks) / self.contention_at(self.ranks)


def host_load(cpu: dict | None, ranks_on_host: int | None = None) -> HostLoad | None:
    """A rank's :class:`HostLoad` from its rank.json ``cpu`` (None when the fields lack or do not add up);
    ``ranks_on_host`` stands in for an unrecorded LOCAL_WORLD_SIZE."""
    if not isinstance(cpu, dict):
        return None
    try:
        cores = int(cpu.get("usable_cores") or cpu.get("cpu_count") or 0)
        ranks = int(cpu.get("local_world_size") or ranks_on_host or 0)
        wall, run, wait = float(cpu["wall_us"]), float(cpu["run_us"]), float(cpu["runqueue_us"])
    except (KeyError, TypeError, ValueError):
        return None
    if cores < 1 or ranks < 1 or not (wall > 0 and run > 0 and wait >= 0):
        return None
    return HostLoad(cores=cores, ranks=ranks, demand=(run + wait) / wall, contention=1.0 + wait / run)


def rank_contention(cpu_load: dict | None, device_type: str | None) -> dict[int, float]:
    """rank -> its measured contention (>= 1, runnable threads per core: :func:`host_load`) of a CPU run's ranks
    that recorded their load (rank.json ``cpu``); empty on an accelerator run."""
    if (device_type or model.DEVICE_CPU) != model.DEVICE_CPU:
        return {}
    loads = {int(r): host_load(cpu) for r, cpu in sorted((cpu_load or {}).items())}
    return {r: float(x.contention) for r, x in loads.items() if x is not None}


def training_thread_contention(cpu_load: dict | None, device_type: str | None) -> dict[int, float]:
    """rank -> the contention of its training thread (the one that steps the optimizer: 1 + its run-queue wait /
    its time on a CPU, rank.json ``cpu`` ``training_*``), where recorded, else the process's
    (:func:`rank_contention`): what stretches the rank's own work; empty on an accelerator run."""
    out = rank_contention(cpu_load, device_type)
    for r in out:
        cpu = cpu_load[r] if r in (cpu_load or {}) else (cpu_load or {}).get(str(r))
        try:
            run, wait = float(cpu["training_run_us"]), float(cpu["training_runqueue_us"])
        except (KeyError, TypeError, ValueError):
            continue
        if run > 0 and wait >= 0:
            out[r] = 1.0 + wait / run
    return out


def cpu_step_scale(load: HostLoad | None, source: Source, target: Target) -> tuple[float, list[str], list[str]]:
    """(step time scale, kept, assumed) of a target: 1 on an accelerator run or without a measured load."""
    if source.device_type != "cpu":
        return 1.0, [], []
    ranks = ranks_on_host(source, target)
    if load is None:
        return 1.0, [], ["CPU contention unknown (rank.json has no \"cpu\" load: recorded before fsdpprof measured "
                         "it): compute and communication kept as measured, whatever the ranks per host"]
    kept = ["the run's CPU load per rank (rank.json cpu: the host's usable cores, the job's ranks on it, the "
            "rank's time on a CPU and waiting for one over the active steps)"]
    assumed = [f"{ranks} ranks per host; processor sharing of the host's cores: contention = max(1, (ranks x "
               f"a rank's demand + the other load) / cores), every part of a CPU step (compute, the rest, gloo "
               f"communication) stretched by the target's contention over the run's"]
    return load.step_scale(ranks), kept, assumed
