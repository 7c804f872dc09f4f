"""CPU contention: how much slower a CPU rank runs when the target puts more (or fewer) ranks on a host.

The collector records in rank.json ``cpu`` (over the active steps): the host's usable cores, the job's
ranks on it (LOCAL_WORLD_SIZE), and the process's wall time, on-CPU time and run-queue wait time (µs,
from the threads' schedstat), in total and for the training thread. The model, stated:

1. **Processor sharing.** The host's runnable threads share its cores fairly: with L threads runnable on
   C cores each gets min(1, C / L) of a core, so a thread's contention (wall time runnable / time on a CPU)
   is ``max(1, L / C)``. The measured contention of a rank is ``1 + runqueue / run``.
2. **Demand.** A rank's uncontended CPU demand, in cores, is its runnable threads on average:
   ``(run + runqueue) / wall`` (run stretched by contention over a wall time stretched alike). What the
   measured contention leaves of the host's runnable threads once the job's ranks are counted is the
   other load: ``C x contention - ranks x demand`` (at least 0), kept for the target.
3. **Target.** ``ranks_t`` ranks of the same demand plus the other load: ``max(1, (ranks_t x demand +
   other) / C)``. On a CPU run every part of the step is CPU-bound (compute and the rest on the training
   thread; gloo's transfers on its threads, and the peers a collective waits for are slowed alike), so the
   whole step stretches by the ratio of the target's contention to the model's at the run's own ranks per
   host (the run predicted from itself is left unchanged).

Accelerator ranks are not scaled (their compute does not share the host's cores).
"""
from __future__ import annotations

from dataclasses import dataclass

from fsdpprof.analyze.whatif.targets import Source, Target, ranks_on_host


@dataclass(frozen=True)
class HostLoad:
    """One rank's measured CPU load over the active steps: ``cores`` usable on its host, ``ranks`` of the job
    on that host, ``demand`` (cores, uncontended) and ``contention`` (>= 1)."""

    cores: int
    ranks: int
    demand: float
    contention: float

    @property
    def other_load(self) -> float:
        """Runnable threads of everything else on the host (processor sharing, see the module docstring)."""
        return max(0.0, self.cores * self.contention - self.ranks * self.demand)

    def contention_at(self, ranks: int) -> float:
        """The model's contention (>= 1) of a rank with ``ranks`` ranks of this demand on the host."""
        return max(1.0, (ranks * self.demand + self.other_load) / self.cores)

    def step_scale(self, ranks: int) -> float:
        """Step time with ``ranks`` ranks on the host / step time as recorded."""
        return self.contention_at(ranks) / self.contention_at(self.ranks)


def host_load(cpu: dict | None, ranks_on_host: int | None = None) -> HostLoad | None:
    """A rank's :class:`HostLoad` from its rank.json ``cpu`` (None when the run lacks the fields or they do
    not add up). ``ranks_on_host``: when LOCAL_WORLD_SIZE was not recorded (the run's hosts layout)."""
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


def cpu_step_scale(load: HostLoad | None, source: Source, target: Target) -> tuple[float, list[str], list[str]]:
    """(step time scale, kept, assumed) of a target on a CPU run: the scale is 1 on an accelerator run and on a
    run whose rank.json has no CPU load (recorded before fsdpprof measured it), which ``assumed`` says."""
    if source.device_type != "cpu":
        return 1.0, [], []
    ranks = ranks_on_host(source, target)
    if load is None:
        return 1.0, [], ["CPU contention unknown (rank.json has no \"cpu\" load: recorded before fsdpprof measured "
                         "it): compute and communication kept as measured, whatever the ranks per host"]
    scale = load.step_scale(ranks)
    kept = ["the run's CPU load per rank (rank.json cpu: the host's usable cores, the job's ranks on it, the "
            "rank's time on a CPU and waiting for one over the active steps)"]
    assumed = [f"{ranks} ranks per host; processor sharing of the host's cores: contention = max(1, (ranks x "
               f"a rank's demand + the other load) / cores), every part of a CPU step (compute, the rest, gloo "
               f"communication) stretched by the target's contention over the run's"]
    return scale, kept, assumed
