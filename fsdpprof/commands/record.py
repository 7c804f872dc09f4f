"""``fsdpprof record [options] -- CMD ARGS...``: run a training command and record a run directory.

The mechanics (run directory, bootstrap environment, status) live in :mod:`fsdpprof.collect.launcher`.
"""
from fsdpprof.collect.launcher import add_arguments, run  # noqa: F401
