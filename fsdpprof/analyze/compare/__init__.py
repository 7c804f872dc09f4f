"""Cross-run comparison: several runs side by side with a verdict (``runs``), what changed in each against the
first (``diff``), in the steps and ranks the comparison covers (``scope``)."""
