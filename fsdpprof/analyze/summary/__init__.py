"""The numbers a person reads first and what to do about them: the headline (``headline``), findings
(``findings``), per-rank tables as distributions over ranks (``distributions``), the ZeRO formulas
(``theory``, numpy-free: ``fsdpprof plan`` uses it) and the model states they predict beside the measured
ones (``model_states``)."""
