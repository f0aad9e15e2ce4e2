"""Hydra search-path plugin: makes ``+kvcache=<option>`` available to every Hydra app.

Adds ``pkg://gr_plugin.conf`` (the packaged ``kvcache`` group) to the search path and registers
the group's schema. Hydra discovers it through the ``hydra_plugins`` namespace package.
"""

from hydra.core.config_search_path import ConfigSearchPath
from hydra.plugins.search_path_plugin import SearchPathPlugin

import gr_plugin.configs.kvcache  # noqa: F401 - registers gr_plugin_schema/kvcache


class GrPluginSearchPathPlugin(SearchPathPlugin):
    def manipulate_search_path(self, search_path: ConfigSearchPath) -> None:
        search_path.append(provider="gr_plugin", path="pkg://gr_plugin.conf")
