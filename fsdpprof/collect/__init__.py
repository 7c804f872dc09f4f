"""collect: everything that runs inside (or launches) the user's job; stdlib + torch only.

- ``launcher``  the ``fsdpprof record [options] -- CMD`` sub-command: validates, writes run.json and
  launchers/<host>-<pid>.json, runs CMD with ``bootstrap/`` first on PYTHONPATH, passes stdio, signals
  and the exit code through, derives run.json's final status from all launchers and ranks.
- ``bootstrap/sitecustomize.py``  loaded by every Python process of the job: imports nothing heavy,
  hooks the import of ``torch.optim.optimizer`` and chains to the next sitecustomize on sys.path.
- ``recorder``  the per-process state machine driven by torch's global optimizer step hooks:
  profiler window (skip / warmup / active steps), inventory captures, rank.json, collector.log,
  crash / SIGTERM / own-profiler handling.
- ``inventory``  model discovery and ``inventory.json`` (framework, strategy, units, tensors).
- ``cuda_memory``  CUDA memory history + allocation tags + memory_snapshot.pickle (GPU only).
- ``api``  ``fsdpprof.record(out=...)`` context manager for in-code use.
"""
