"""gr_plugin: a paged KV cache for HSTU generative recommenders.

Layers point one way: integrations (Lightning, Hydra, serving) -> modules (model, cache module)
-> ops (custom ops, kernels, references) -> ``gr_plugin.cache`` (pure torch + stdlib + xxhash).
"""

__version__ = "0.1.0"
