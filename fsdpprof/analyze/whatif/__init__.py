"""What if: a recorded run's peak memory and step time predicted under another strategy or world size
(the model: docs/whatif-model.md)."""
from __future__ import annotations

from fsdpprof.analyze.whatif.predict import predict_run, rank_predictions, reduce_predictions
from fsdpprof.analyze.whatif.targets import Source, Target, make_target, standard_targets, target_of_source

__all__ = ["Source", "Target", "make_target", "predict_run", "rank_predictions", "reduce_predictions",
           "standard_targets", "target_of_source"]
