"""What if: from one recorded run, predict peak memory and step time under another strategy or world size.

- :mod:`.targets`  the run's configuration (:class:`~.targets.Source`) and the one to predict
  (:class:`~.targets.Target`), checked; the standard strategies at the run's world size
- :mod:`.units`    the FSDP units and their sizes under any shard group
- :mod:`.memory`   the recorded allocation timeline replayed under the target's rules (the peak is the
  maximum of the replayed timeline)
- :mod:`.timing`   latency + bytes / bandwidth fitted per collective on the run's own collectives (the
  latency at most the fastest call on any rank), the target's collectives placed on the recorded compute
  timeline, exposure by the report's interval code; the family's own CPU work swapped for the target's
- :mod:`.contention` CPU runs: the host's cores shared by its ranks (processor sharing, rank.json ``cpu``)
- :mod:`.predict`  per rank (map: memory, and what time is replayed from) and per run (reduce: the fits
  with the run's latency floor, time), as small dicts

Every prediction lists what it kept from the measurement and what it assumed.
"""
from __future__ import annotations

from fsdpprof.analyze.whatif.predict import predict_run, rank_predictions, reduce_predictions
from fsdpprof.analyze.whatif.targets import Source, Target, make_target, standard_targets, target_of_source

__all__ = ["Source", "Target", "make_target", "predict_run", "rank_predictions", "reduce_predictions",
           "standard_targets", "target_of_source"]
