"""Training: YAML config, data, a pure ``train_step``, the loop and ``hpfunc train``."""
