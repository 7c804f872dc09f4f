"""Loading: find a run's files (``files``), read its ranks (``run``), run per-rank work here, in a local pool or
on Dask (``engines``); label masks (``frames``), the collector paused while reading (``gc_pause``), HTA (``hta``)."""
