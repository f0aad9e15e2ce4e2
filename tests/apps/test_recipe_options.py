"""The recipes' options as a user writes them: bad values fail early and name the value; ``cpu:N``;
``validate=false``; one default checkpoint per model; a train sweep's jobs keep their checkpoints apart."""

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from hydra import compose, initialize_config_dir
from omegaconf import OmegaConf

import gr_plugin.configs.schema
import gr_plugin.configs.serve  # noqa: F401
from gr_plugin.apps import infer
from gr_plugin.apps import train as train_app
from gr_plugin.cache.metadata import build_metadata
from gr_plugin.configs.kvcache import KVCacheOptions
from gr_plugin.configs.schema import TrainConfig, TrainerOptions
from tests.apps.test_infer import tiny_cfg

ROOT = Path(__file__).resolve().parents[2]
CONF = str(ROOT / "conf")
TINY_SYNTHETIC = ["model=hstu_tiny", "model.num_items=60", "model.max_positions=256", "data=synthetic",
                  "data.source_kwargs.num_users=8", "data.source_kwargs.min_len=10", "data.source_kwargs.max_len=40",
                  "data.source_kwargs.num_items=60", "data.num_candidates=8", "data.max_visit_len=8",
                  "data.batch_size=4", "data.max_history_len=64"]


@pytest.mark.parametrize("overrides, error", [
    (dict(stage="valid"), r"stage must be one of \['predict', 'test', 'val'\], got 'valid'"),
    (dict(max_batches=0), r"max_batches must be a positive int or null \(every batch\), got 0"),
    (dict(max_batches=-2), r"max_batches .* got -2"),
])
def test_bad_run_options_fail_before_any_work(tmp_path, monkeypatch, overrides, error):
    def no_work(*args, **kwargs):
        raise AssertionError("data or weights were loaded before the options were checked")

    monkeypatch.setattr(infer, "make_datamodule", no_work)
    monkeypatch.setattr(infer, "_load_or_train", no_work)
    with pytest.raises(ValueError, match=error):
        infer.run(tiny_cfg(tmp_path, **overrides), tmp_path / "out")


@pytest.mark.parametrize("device", ["cpu:0", "cpu:1"])
def test_a_cpu_device_with_an_index_is_the_cpu(tmp_path, device):
    from gr_plugin.apps.common import pick_device

    assert pick_device(device) == torch.device("cpu")  # (one spelling: no copies between cpu and cpu:N)
    meta = build_metadata([[0, 1]], [0], [5], 4, torch.device(device))
    assert meta.buffer.device.type == "cpu" and meta.new_token_slots.tolist() == [0, 1, 2, 3, 4]
    opts = KVCacheOptions(backend="native", page_size=4, num_pages=96, host_cache_gb=0.002)
    summary = infer.run(tiny_cfg(tmp_path, opts, device=device, max_batches=6), tmp_path / "out")
    assert summary["equivalence"] == "PASS" and summary["hit_rate"] > 0


def test_validate_false_runs_no_validation(tmp_path, monkeypatch):
    cfg = tiny_cfg(tmp_path)
    seen, step = [], train_app.HSTURankingModule.validation_step
    monkeypatch.setattr(train_app.HSTURankingModule, "validation_step",
                        lambda self, *a, **k: seen.append(1) or step(self, *a, **k))
    tcfg = TrainConfig(model=cfg.model, data=cfg.data, validate=False, ckpt_out=str(tmp_path / "t.ckpt"),
                       trainer=TrainerOptions(max_steps=2, limit_train_batches=2, limit_val_batches=2,
                                              enable_progress_bar=False))
    out = train_app.run(tcfg)
    assert seen == [] and Path(out["checkpoint"]).is_file()
    train_app.run(TrainConfig(**{**vars(tcfg), "validate": True}))
    assert seen  # (the spy sees validation when it runs)


def _compose(name, overrides):
    with initialize_config_dir(config_dir=CONF, version_base="1.3"):
        return OmegaConf.to_object(compose(config_name=name, overrides=overrides))


def test_the_default_checkpoint_is_one_per_model():
    paths = {m: _compose("infer", [f"model={m}"]).default_ckpt for m in ("hstu_small", "hstu_tiny", "hstu_large")}
    assert len(set(paths.values())) == 3
    for name in ("train", "export", "serve"):  # what train writes is what the others read, per model
        for m, path in paths.items():
            cfg = _compose(name, [f"model={m}"])
            assert (cfg.ckpt_out if name == "train" else cfg.default_ckpt) == path


def test_a_train_sweep_writes_one_checkpoint_per_job(tmp_path):
    cmd = [sys.executable, "-m", "recipes.train", "-m", *TINY_SYNTHETIC, "lr=1e-3,5e-3", "trainer.max_steps=1",
           "trainer.limit_train_batches=1", "validate=false", "trainer.enable_progress_bar=false",
           f"hydra.sweep.dir={tmp_path}/sweep", "hydra/job_logging=disabled"]
    out = subprocess.run(cmd, cwd=tmp_path, capture_output=True, text=True, timeout=300,
                         env={**os.environ, "PYTHONPATH": str(ROOT)})
    assert out.returncode == 0, out.stderr[-3000:]
    written = [ln.split(": ", 1)[1] for ln in out.stdout.splitlines() if ln.startswith("checkpoint: ")]
    assert len(written) == 2 and written[0] != written[1], out.stdout
    for job, path in enumerate(written):
        assert Path(path).parent == tmp_path / "sweep" / str(job) and Path(path).is_file()
    assert not (tmp_path / "outputs").exists()  # the default checkpoint, what recipes.infer loads, is untouched


def test_a_negative_host_cache_is_refused_by_its_option_name():
    from gr_plugin.apps.common import make_cache
    from gr_plugin.modules.hstu import HSTUConfig

    opts = KVCacheOptions(backend="native", page_size=4, num_pages=8, host_cache_gb=-1.0)
    with pytest.raises(ValueError, match=r"kvcache.host_cache_gb must be >= 0, got -1.0"):
        make_cache(opts, HSTUConfig(embedding_dim=16, num_layers=1, num_heads=2, head_dim=8), torch.device("cpu"),
                   torch.float32)


def test_configs_made_in_python_take_the_same_default_checkpoint():
    from gr_plugin.configs.schema import InferConfig
    from gr_plugin.modules.hstu import HSTUConfig

    tiny = HSTUConfig(embedding_dim=16, num_layers=2, num_heads=2, head_dim=8)
    assert InferConfig(model=tiny).default_ckpt == TrainConfig(model=tiny).ckpt_out == \
        "outputs/checkpoints/hstu-ml-1m-L2-D16-H2x8.ckpt"
    assert TrainConfig(ckpt_out="x.ckpt").ckpt_out == "x.ckpt"


@pytest.mark.parametrize("recipe", ["infer", "train"])
def test_recipe_help_offers_the_groups_options_and_not_the_kvcache_schema(recipe):
    """``python -m recipes.infer|train --help`` names every option of its kvcache, model, data and trainer
    groups (Hydra's default help listed the kvcache group's schema, ``base_kvcache``, as an option)."""
    out = subprocess.run([sys.executable, "-m", f"recipes.{recipe}", "--help"], capture_output=True, text=True,
                         cwd=ROOT, timeout=120)
    assert out.returncode == 0, out.stderr[-2000:]
    usage = out.stdout.split("== Config ==")[0]
    assert f"python -m recipes.{recipe}" in usage and "base_kvcache" not in out.stdout
    groups = {"kvcache": ROOT / "gr_plugin" / "conf" / "kvcache", "model": ROOT / "conf" / "model",
              "data": ROOT / "conf" / "data", "trainer": ROOT / "conf" / "trainer"}
    for group, folder in groups.items():
        options = {p.stem for p in folder.glob("*.yaml")}
        line = re.search(rf"^{group}:(.*?)(?:^\S|\Z)", usage, re.M | re.S).group(1)  # (to the next unindented line)
        assert options and all(re.search(rf"\b{o}\b", line) for o in options), (group, options, line)
    config = OmegaConf.create(out.stdout.split("== Config ==")[1].split("Powered by Hydra")[0])
    assert config.kvcache is None and ("stage" in config) == (recipe == "infer")


def test_bench_help_names_every_suite_and_not_the_other_recipes_groups():
    """``python -m recipes.bench --help`` says how to pick a suite and names each one `SUITES` holds; the
    config groups it does not read (Hydra's default help lists every group on the search path) are not
    offered as options."""
    from recipes.bench import SUITES

    out = subprocess.run([sys.executable, "-m", "recipes.bench", "--help"], capture_output=True, text=True,
                         cwd=ROOT, timeout=120)
    assert out.returncode == 0, out.stderr[-2000:]
    usage = out.stdout.split("== Config ==")[0]
    listed = set(re.findall(r"[a-z0-9_]+", usage.split("\nsuite:")[1].split(";")[0])) - {"default", "or"}
    assert "suite=<name>" in usage and listed == set(SUITES), usage
    assert "Configuration groups" not in out.stdout and "kvcache: base_kvcache" not in out.stdout
    config = OmegaConf.create(out.stdout.split("== Config ==")[1].split("Powered by Hydra")[0])
    assert config.suite == "host_overhead" and set(SUITES) <= set(config)  # (each suite's settings)


def test_a_tier_yaml_overrides_only_the_keys_it_names(tmp_path):
    """``kvcache.tier_config``: the keys a FlexKV tier file names (aliases too) override ``kvcache.tiers``;
    the others keep theirs (the file's defaults for unnamed keys once replaced them: ``remote_ttl_s``, ours,
    which no FlexKV file names, was dropped)."""
    from gr_plugin.apps.common import tier_config
    from gr_plugin.cache.tiers import TierConfig

    path = tmp_path / "flexkv_tiers.yaml"
    path.write_text("cpu_cache_gb: 2\nenable_3rd_remote: true\nredis_host: cache\nredis_port: 6380\n")
    tiers = TierConfig(cpu_cache_gb=0.5, ssd_cache_gb=1.0, ssd_cache_dir=str(tmp_path / "ssd"), remote_ttl_s=60,
                       task_timeout_s=0.5)
    got = tier_config(KVCacheOptions(backend="flexkv", tiers=tiers, tier_config=str(path)))
    assert (got.cpu_cache_gb, got.enable_3rd_remote, got.remote_url) == (2.0, True, "redis://cache:6380/0")
    assert (got.remote_ttl_s, got.ssd_cache_gb, got.ssd_cache_dir, got.task_timeout_s) == \
        (60, 1.0, str(tmp_path / "ssd"), 0.5)
    got = tier_config(KVCacheOptions(backend="flexkv", tiers=tiers, tier_config=str(path)),
                      command_line={"cpu_cache_gb", "remote_url"})  # (the command line wins)
    assert (got.cpu_cache_gb, got.enable_3rd_remote, got.remote_url) == (0.5, True, tiers.remote_url)
    path.write_text("cpu_cache_gb: 2\nwrite_back: true\n")
    with pytest.raises(ValueError, match=r"unknown key\(s\) \['write_back'\]"):
        tier_config(KVCacheOptions(backend="flexkv", tiers=tiers, tier_config=str(path)))


def test_kvcache_tiers_on_the_command_line_beat_the_tier_yaml(tmp_path):
    """As in Hydra, a key given on the command line wins over the same key in ``kvcache.tier_config``'s file,
    which wins over the config group's value."""
    from hydra.core.hydra_config import HydraConfig

    from gr_plugin.apps.common import command_line_tier_keys, tier_config

    path = tmp_path / "flexkv_tiers.yaml"
    path.write_text("cpu_cache_gb: 2\nssd_cache_gb: 3\nfail_open: false\n")
    assert command_line_tier_keys() == set()  # (no Hydra run)
    for tiers in (["kvcache.tiers.cpu_cache_gb=0.5", "kvcache.tiers.remote_ttl_s=60"],
                  ["kvcache.tiers={cpu_cache_gb:0.5,remote_ttl_s:60}"]):  # (a mapping: the keys it names)
        with initialize_config_dir(config_dir=CONF, version_base=None):
            cfg = compose(config_name="infer", overrides=["+kvcache=flexkv", f"kvcache.tier_config={path}", *tiers],
                          return_hydra_config=True)
        HydraConfig.instance().set_config(cfg)
        try:
            assert command_line_tier_keys() == {"cpu_cache_gb", "remote_ttl_s"}
            got = tier_config(OmegaConf.to_object(cfg.kvcache))
        finally:
            HydraConfig.instance().cfg = None
        assert (got.cpu_cache_gb, got.ssd_cache_gb, got.fail_open, got.remote_ttl_s) == (0.5, 3.0, False, 60)


def test_the_tier_log_line_and_the_run_summary_hold_no_password(tmp_path, caplog):
    """A remote tier's URL may carry a password: the run's log line and summary.json show ``***@``."""
    import json
    import logging

    from gr_plugin.apps.common import tier_config
    from gr_plugin.cache.tiers import TierConfig

    url = "redis://user:s3cret@127.0.0.1:6399/0"
    with caplog.at_level(logging.INFO, logger="gr_plugin.apps.common"):
        tier_config(KVCacheOptions(backend="flexkv", tiers=TierConfig(enable_3rd_remote=True, remote_url=url)))
    assert "redis://***@127.0.0.1:6399/0" in caplog.text and "s3cret" not in caplog.text
    cfg = tiny_cfg(tmp_path)
    cfg.kvcache = KVCacheOptions(backend="flexkv", tiers=TierConfig(remote_url=url))
    infer._write(tmp_path / "out", {"equivalence": "PASS"}, [], cfg)
    text = (tmp_path / "out" / "summary.json").read_text()
    assert "s3cret" not in text and json.loads(text)["config"]["kvcache"]["tiers"]["remote_url"] == \
        "redis://***@127.0.0.1:6399/0"


def test_tiers_set_for_another_backend_are_warned_about(tmp_path):
    """Only flexkv reads ``kvcache.tiers`` / ``kvcache.tier_config``: set under another backend they were
    silently ignored (e.g. a Redis tier asked for under ``native``)."""
    import warnings

    from gr_plugin.apps.common import resolve_backend
    from gr_plugin.cache.tiers import TierConfig

    with pytest.warns(UserWarning, match=r"apply to the flexkv backend .*backend 'native' ignores them"):
        resolve_backend(KVCacheOptions(backend="native", tiers=TierConfig(enable_3rd_remote=True)))
    with pytest.warns(UserWarning, match=r"backend 'gpu' ignores them"):
        resolve_backend(KVCacheOptions(backend="gpu", tier_config=str(tmp_path / "t.yaml")))
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert resolve_backend(KVCacheOptions(backend="native")) == "native"
        assert resolve_backend(KVCacheOptions(backend="flexkv", tiers=TierConfig(remote_ttl_s=60))) == "flexkv"
