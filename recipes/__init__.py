"""Thin Hydra entry points: compose a config, instantiate, run (``python -m recipes.<name>``)."""
