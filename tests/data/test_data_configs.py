"""The data group's options compose with every model shape (conf/data)."""

from pathlib import Path

import pytest
from hydra import compose, initialize_config_dir
from omegaconf import OmegaConf

import gr_plugin.configs.schema
import gr_plugin.configs.serve  # noqa: F401

CONF = str(Path(__file__).resolve().parents[2] / "conf")


@pytest.mark.parametrize("model", ["hstu_tiny", "hstu_small", "hstu_large"])
def test_synthetic_data_has_the_models_item_vocabulary(model):
    """``data=synthetic`` drew 50000 items while every model shape has 3706 (MovieLens-1M's), so
    ``recipes.infer data=synthetic`` failed with "model.num_items=3706 but the data has 50000 items"."""
    with initialize_config_dir(config_dir=CONF, version_base="1.3"):
        cfg = OmegaConf.to_object(compose(config_name="infer", overrides=["data=synthetic", f"model={model}"]))
    assert cfg.data.source_kwargs["num_items"] == cfg.model.num_items == 3706


def test_synthetic_data_without_a_model_keeps_movielens_vocabulary():
    with initialize_config_dir(config_dir=CONF, version_base="1.3"):
        cfg = compose(config_name="serve_client", overrides=["data=synthetic"])
    assert OmegaConf.to_container(cfg.data, resolve=True)["source_kwargs"]["num_items"] == 3706
