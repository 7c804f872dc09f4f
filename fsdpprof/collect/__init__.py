"""collect: everything that runs inside (or launches) the user's job; stdlib + torch only.

``launcher`` (``fsdpprof record -- CMD``, run.json), ``bootstrap/sitecustomize.py`` (loaded by every process),
``recorder`` (the per-process profiling window), ``inventory`` (model states), ``process_memory``,
``cuda_memory`` (CUDA history and snapshot) and ``api`` (``fsdpprof.record()``).
"""
