"""The kinds of segment a step's critical path is made of (:mod:`fsdpprof.analyze.comm.critical_path`), the
changes its counterfactuals make, and their words."""
from __future__ import annotations

__all__ = ["PATH_COMPUTE", "PATH_COLLECTIVE", "PATH_HOST_GAP", "PATH_SYNC", "PATH_DATA", "PATH_WAIT", "PATH_KINDS",
           "PATH_KIND_WORDS", "CHANGE_RANK", "CHANGE_COLLECTIVE", "CHANGE_HOST_GAPS", "CHANGE_DATA", "CHANGE_SYNC",
           "CHANGE_TYPE", "CHANGE_ALL_COMM", "CHANGE_KINDS"]

PATH_COMPUTE = "compute"              # an op / kernel running (op, FSDP unit, stage)
PATH_COLLECTIVE = "collective"        # a collective nothing else hides (type, FSDP unit, stage)
PATH_HOST_GAP = "host_gap"            # nothing running: the host is late launching the next work (Python, launches)
PATH_SYNC = "sync"                    # nothing running while the host blocks in a synchronisation
PATH_DATA = "data_loading"            # nothing running while the host fetches the next batch (DataLoader)
PATH_WAIT = "wait"                    # waiting in a collective for a later rank whose own path is not in the input
PATH_KINDS = [PATH_COMPUTE, PATH_COLLECTIVE, PATH_HOST_GAP, PATH_SYNC, PATH_DATA, PATH_WAIT]
PATH_KIND_WORDS = {PATH_COMPUTE: "compute", PATH_COLLECTIVE: "exposed collective", PATH_HOST_GAP: "host / launch gap",
                   PATH_SYNC: "synchronisation", PATH_DATA: "data loading", PATH_WAIT: "waiting for a rank"}

# what one counterfactual changes
CHANGE_RANK = "rank_as_median"        # one rank's local work as fast as the median rank's, between each two calls
CHANGE_COLLECTIVE = "collective_hidden"   # one unit's collective (type, stage) costs no time once its ranks arrived
CHANGE_TYPE = "collective_type_hidden"   # every call of one collective type in one stage (all units) hidden
CHANGE_ALL_COMM = "all_comm_hidden"       # every collective hidden
CHANGE_HOST_GAPS = "no_host_gaps"
CHANGE_DATA = "data_ready"
CHANGE_SYNC = "no_syncs"
CHANGE_KINDS = [CHANGE_RANK, CHANGE_COLLECTIVE, CHANGE_TYPE, CHANGE_ALL_COMM, CHANGE_HOST_GAPS, CHANGE_DATA, CHANGE_SYNC]
