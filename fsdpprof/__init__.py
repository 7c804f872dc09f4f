"""fsdpprof: profiler and trace analyzer for PyTorch FSDP training (collect -> run_dir -> analyze -> report)."""
from fsdpprof.version import __version__  # noqa: F401


def record(*args, **kwargs):
    """``with fsdpprof.record(out=...):`` around a training loop: :func:`fsdpprof.collect.api.record`."""
    from fsdpprof.collect.api import record as _record

    return _record(*args, **kwargs)


def load_run(path, **kwargs):
    """A run directory, a folder of traces or a snapshot: :func:`fsdpprof.analyze.load.run.load_run`."""
    from fsdpprof.analyze.load.run import load_run as _load_run

    return _load_run(path, **kwargs)


def critical_path(run, **kwargs):
    """What limits each step of a run (an Analysis, a Run or a path): :func:`fsdpprof.analyze.pipeline.critical_path`."""
    from fsdpprof.analyze.pipeline import critical_path as _critical_path

    return _critical_path(run, **kwargs)
