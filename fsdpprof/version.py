"""fsdpprof's version (what run.json, the reports and ``--version`` say), on its own so that any module can
import it without importing the ``fsdpprof`` package's API (which imports collect and analyze lazily)."""
__version__ = "0.1.0"
