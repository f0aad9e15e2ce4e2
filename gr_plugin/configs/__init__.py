"""Hydra structured-config schemas (dataclasses registered in Hydra's ConfigStore).

`kvcache` holds the ``kvcache`` group's schema and is light (no torch), so the search-path plugin can
register it in any Hydra app; `schema` holds the recipes' schemas.
"""
