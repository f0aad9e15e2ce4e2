"""Hydra composition: every kvcache option, typo rejection, the packaged group in a foreign app."""

from pathlib import Path

import pytest
from hydra import compose, initialize_config_dir
from hydra.errors import ConfigCompositionException
from omegaconf import OmegaConf

import gr_plugin.configs.schema  # noqa: F401
from gr_plugin.configs.kvcache import KVCacheOptions
from gr_plugin.configs.schema import InferConfig

CONF = str(Path(__file__).resolve().parents[2] / "conf")


@pytest.mark.parametrize("option", ["none", "gpu", "native", "flexkv"])
def test_every_kvcache_option_composes_to_the_schema(option):
    with initialize_config_dir(config_dir=CONF, version_base="1.3"):
        cfg = compose(config_name="infer", overrides=[f"+kvcache={option}", "kvcache.page_size=16"])
    obj = OmegaConf.to_object(cfg)
    assert isinstance(obj, InferConfig) and isinstance(obj.kvcache, KVCacheOptions)
    assert obj.kvcache.backend == option and obj.kvcache.page_size == 16


def test_no_kvcache_option_means_no_cache():
    with initialize_config_dir(config_dir=CONF, version_base="1.3"):
        assert compose(config_name="infer").kvcache is None


@pytest.mark.parametrize("overrides", [["+kvcache=flexkv", "kvcache.page_sise=64"], ["model.num_layrs=3"],
                                       ["data.batch_sise=3"], ["+kvcache=flexkv", "kvcache.page_size=big"]])
def test_typos_and_bad_types_are_rejected(overrides):
    with initialize_config_dir(config_dir=CONF, version_base="1.3"), pytest.raises(ConfigCompositionException):
        compose(config_name="infer", overrides=overrides)


def test_another_hydra_app_can_use_the_packaged_kvcache_group(tmp_path):
    (tmp_path / "app.yaml").write_text("lr: 0.1\n")
    with initialize_config_dir(config_dir=str(tmp_path), version_base="1.3"):
        cfg = compose(config_name="app", overrides=["+kvcache=native"])
        assert cfg.lr == 0.1 and cfg.kvcache.backend == "native" and cfg.kvcache.host_cache_gb == 1.0
        with pytest.raises(ConfigCompositionException):
            compose(config_name="app", overrides=["+kvcache=native", "kvcache.num_pagez=3"])


@pytest.mark.parametrize("graphs", [True, False])
def test_the_callback_gets_the_cuda_graphs_option(graphs):
    from gr_plugin.apps.common import make_callback

    with initialize_config_dir(config_dir=CONF, version_base="1.3"):
        cfg = compose(config_name="train", overrides=["+kvcache=native", f"kvcache.cuda_graphs={graphs}",
                                                       "kvcache.page_size=16"])
    cb = make_callback(OmegaConf.to_object(cfg).kvcache)
    assert cb.cuda_graphs is graphs and cb.page_size == 16 and cb.backend == "native"


def test_an_unknown_kvcache_option_lists_the_options_and_not_the_schema():
    """``+kvcache=bogus`` listed the schema, ``base_kvcache``, among the options (a UAT nit): it now lives in
    its own group, ``gr_plugin_schema``."""
    from hydra.errors import MissingConfigException

    with initialize_config_dir(config_dir=CONF, version_base="1.3"), pytest.raises(MissingConfigException) as err:
        compose(config_name="infer", overrides=["+kvcache=bogus"])
    listed = str(err.value).split("Available options in 'kvcache':")[1].split("Config search path")[0].split()
    assert listed == ["flexkv", "gpu", "native", "none"]
