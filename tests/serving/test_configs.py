"""Hydra composition of the serving recipes: schemas, per-replica defaults, typo rejection."""

from __future__ import annotations

from pathlib import Path

import pytest
from hydra import compose, initialize_config_dir
from hydra.errors import ConfigCompositionException
from omegaconf import OmegaConf

import gr_plugin.configs.serve  # noqa: F401 - registers the schemas
from gr_plugin.configs.kvcache import KVCacheOptions
from gr_plugin.configs.serve import ServeClientConfig, ServeConfig

CONF = str(Path(__file__).resolve().parents[2] / "conf")


def _compose(name: str, overrides: list[str]):
    with initialize_config_dir(config_dir=CONF, version_base="1.3"):
        return compose(config_name=name, overrides=overrides, return_hydra_config=False)


def test_serve_composes_with_a_cache_and_loopback_defaults():
    obj = OmegaConf.to_object(_compose("serve", ["replica_id=1", "kvcache=native"]))
    assert isinstance(obj, ServeConfig) and isinstance(obj.kvcache, KVCacheOptions)
    assert obj.kvcache.backend == "native" and obj.triton.address == "127.0.0.1"
    assert obj.kvcache.tiers.ssd_cache_dir == "outputs/kvcache/ssd-replica1"  # replicas never share an SSD dir
    assert obj.triton.max_batch_size == 32 and obj.limits.max_history_len == 4096


def test_serve_client_composes():
    obj = OmegaConf.to_object(_compose("serve_client", ["urls=[a:1,b:2]", "metrics_urls=[]", "results_json=null"]))
    assert isinstance(obj, ServeClientConfig) and obj.urls == ["a:1", "b:2"] and obj.num_threads == 4


@pytest.mark.parametrize("name, overrides", [("serve", ["triton.http_prot=1"]), ("serve", ["limits.max_users=3"]),
                                             ("serve", ["triton.max_batch_size=many"]),
                                             ("serve_client", ["num_thread=2"])])
def test_typos_are_rejected(name, overrides):
    with pytest.raises(ConfigCompositionException):
        _compose(name, overrides)


def test_replica_dtype_is_checked_and_applied(tiny_ckpt):
    from gr_plugin.serving.app import build_service
    from tests.serving.helpers import MODEL_OVERRIDES

    cfg = OmegaConf.to_object(_compose("serve", [*MODEL_OVERRIDES, f"ckpt_path={tiny_ckpt}", "kvcache=native",
                                                 "dtype=bfloat16"]))
    service, _ = build_service(cfg)
    assert str(next(service.engine.model.parameters()).dtype) == "torch.bfloat16"
    assert service.engine.cache.config.dtype == "bfloat16"
    cfg.dtype = "float64"
    with pytest.raises(ValueError, match=r"dtype must be one of .* got 'float64'"):
        build_service(cfg)


def test_replica_dtype_and_an_explicit_kvcache_dtype_must_agree(tiny_ckpt):
    from gr_plugin.serving.app import build_service
    from tests.serving.helpers import MODEL_OVERRIDES

    cfg = OmegaConf.to_object(_compose("serve", [*MODEL_OVERRIDES, f"ckpt_path={tiny_ckpt}", "kvcache=native",
                                                 "dtype=bfloat16", "kvcache.dtype=float32"]))
    with pytest.raises(ValueError, match=r"kvcache.dtype='float32' differs from the replica's dtype='bfloat16'"):
        build_service(cfg)
