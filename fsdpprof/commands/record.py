"""``fsdpprof record [options] -- CMD ARGS...``: :mod:`fsdpprof.collect.launcher` runs it."""
from fsdpprof.collect.launcher import add_arguments, run  # noqa: F401
