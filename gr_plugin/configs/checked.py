"""`to_object`: a recipe's composed config as its dataclass, refusing keys its schema does not have.

Owns one check Hydra leaves out: an override with ``+`` (``+kvcache.page_sise=64``) appends a key
even to a structured config, and ``OmegaConf.to_object`` then drops it without a word, so the run
goes on with the default the user meant to change. Imports no torch.
"""

from __future__ import annotations

import dataclasses
import difflib
from typing import Any

from omegaconf import DictConfig, OmegaConf


def unknown_keys(cfg: DictConfig, path: str = "") -> list[str]:
    """Dotted keys of ``cfg`` (and of its structured sub-configs) that are no field of their dataclass,
    each with a close field name where one exists."""
    out: list[str] = []
    kind = OmegaConf.get_type(cfg)
    fields = {f.name for f in dataclasses.fields(kind)} if dataclasses.is_dataclass(kind) else None
    for key in cfg.keys():
        name = f"{path}{key}"
        if fields is not None and key not in fields:
            close = difflib.get_close_matches(str(key), sorted(fields), n=1)
            out.append(name + (f" (did you mean {path}{close[0]}?)" if close else ""))
            continue
        node = cfg._get_node(key)
        if isinstance(node, DictConfig) and not node._is_none() and not node._is_missing():
            out += unknown_keys(node, name + ".")
    return out


def to_object(cfg: DictConfig) -> Any:
    """``OmegaConf.to_object(cfg)``, after refusing keys no schema field takes (`unknown_keys`)."""
    bad = unknown_keys(cfg)
    if bad:
        raise ValueError(f"unknown config key{'s' if len(bad) > 1 else ''}: {', '.join(bad)} (a '+' override adds a "
                         "key the schema does not have; the run would ignore it)")
    return OmegaConf.to_object(cfg)
