"""A replica's cache namespace names its weights: replicas of other weights never share K/V through Redis."""

from __future__ import annotations

from pathlib import Path

from hydra import compose, initialize_config_dir
from omegaconf import OmegaConf

import gr_plugin.configs.serve  # noqa: F401 - registers the schemas
from tests.serving.helpers import MODEL_OVERRIDES, save_tiny_checkpoint

CONF = str(Path(__file__).resolve().parents[2] / "conf")


def test_the_replicas_namespace_is_salted_with_its_weights(tmp_path, tiny_ckpt):
    from gr_plugin.serving.app import build_service

    other = save_tiny_checkpoint(tmp_path / "other.ckpt", seed=1)

    def namespace(ckpt: Path) -> str:
        with initialize_config_dir(config_dir=CONF, version_base="1.3"):
            cfg = compose(config_name="serve", overrides=[*MODEL_OVERRIDES, f"ckpt_path={ckpt}", "kvcache=native",
                                                          "kvcache.namespace=v3"])
        service, _ = build_service(OmegaConf.to_object(cfg))
        return service.engine.cache.manager.namespace

    first, again, theirs = namespace(tiny_ckpt), namespace(tiny_ckpt), namespace(other)
    assert first.startswith("v3:w") and first == again  # every replica of these weights shares its K/V
    assert theirs.startswith("v3:w") and theirs != first
