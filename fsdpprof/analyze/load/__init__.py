"""Loading: find a run's files (``run``), load one rank, its inventory and trace (``rank``), run a function
over the ranks here, in a local pool or on Dask (``engines``); the masks every analysis tests label columns
with (``frames``); readers' garbage-collector pause (``gc_pause``); HTA's own tables (``hta``, optional)."""
