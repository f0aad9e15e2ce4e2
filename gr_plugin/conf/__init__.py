"""Packaged Hydra configs (``pkg://gr_plugin.conf``): the ``kvcache`` group any Hydra app can use."""
