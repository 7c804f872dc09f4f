"""Analyses: run_dir -> Run (pandas DataFrames) -> pure analysis functions -> numbers.

Never imports ``fsdpprof.report``; never needs a GPU or torch.distributed.
"""


def load_run(path, **kwargs):
    from fsdpprof.analyze.run import load_run as _load_run

    return _load_run(path, **kwargs)
