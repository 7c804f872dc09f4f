"""fsdpprof's version (run.json, the reports, ``--version``), importable without the package's API."""
__version__ = "0.1.0"
