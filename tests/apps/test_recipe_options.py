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
    # (a negative or nan tolerance failed every batch after the whole run; inf turned the check off)
    (dict(tolerance=-1.0), r"tolerance must be a finite number >= 0 .*, got -1\.0"),
    (dict(tolerance=float("nan")), r"tolerance must be a finite number >= 0 .*, got nan"),
    (dict(tolerance=float("inf")), r"tolerance must be a finite number >= 0 .*, got inf"),
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
                  ["kvcache.tiers={cpu_cache_gb:0.5,remote_ttl_s:60}"],  # (a mapping: the keys it names)
                  ["kvcache={tiers:{cpu_cache_gb:0.5,remote_ttl_s:60}}"]):
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


@pytest.mark.parametrize("recipe, overrides, error", [
    ("infer", ["+kvcache=native", "+kvcache.page_sise=64"],
     r"kvcache\.page_sise \(did you mean kvcache\.page_size\?\)"),
    ("infer", ["+kvcache=flexkv", "+kvcache.tiers.cpu_cache=2"], r"kvcache\.tiers\.cpu_cache \(did you mean"),
    ("train", ["+trainer.max_step=3"], r"trainer\.max_step \(did you mean trainer\.max_steps\?\)"),
    ("export", ["+model.num_layrs=3"], r"model\.num_layrs"),
    ("serve", ["kvcache=gpu", "+kvcache.backnd=none"], r"kvcache\.backnd"),
])
def test_a_key_added_with_plus_that_no_schema_has_is_refused(recipe, overrides, error):
    """Hydra's ``+`` appends a key even to a structured config and ``OmegaConf.to_object`` then drops it:
    ``+kvcache.page_sise=64`` ran with page_size 32 and no word. The recipes' `to_object` refuses it."""
    from gr_plugin.configs.checked import to_object, unknown_keys

    with initialize_config_dir(config_dir=CONF, version_base="1.3"):
        cfg = compose(config_name=recipe, overrides=overrides)
        assert OmegaConf.to_object(cfg)  # (what the recipes did: no error)
        with pytest.raises(ValueError, match=error):
            to_object(cfg)
        for name in ("train", "infer", "export", "serve", "serve_client"):  # every recipe's defaults pass
            assert unknown_keys(compose(config_name=name, overrides=["+kvcache=flexkv"] if name == "infer" else [])) \
                == []


def _bad_tiers(tmp_path):
    from gr_plugin.cache.tiers import TierConfig

    (tmp_path / "file").write_text("")
    return TierConfig(ssd_cache_gb=1.0, ssd_cache_dir=str(tmp_path / "file" / "ssd"))


@pytest.mark.parametrize("opts, error", [
    (dict(backend="native", page_size=0), r"kvcache\.page_size must be a positive int, got 0"),
    (dict(backend="flexkv", num_pages=0), r"kvcache\.num_pages must be a positive int, got 0"),
    (dict(backend="gpu", dtype="float64"), r"kvcache\.dtype must be one of"),
    (dict(backend="flexkv", tier_config="/nonexistent/tiers.yaml"), r"'/nonexistent/tiers.yaml' cannot be read"),
    (dict(backend="flexkv", tiers="ttl0"), r"kvcache\.tiers\.remote_ttl_s must be an int"),
    (dict(backend="flexkv", tiers="file"), r"kvcache\.tiers\.ssd_cache_dir='.*file/ssd' cannot be created"),
    (dict(backend="nativ"), r"kvcache\.backend must be one of .* got 'nativ'"),
    # (a host tier larger than the machine: torch's 'alloc_cpu.cpp:127 ... can't allocate memory', late)
    (dict(backend="native", host_cache_gb=1e7), r"kvcache\.host_cache_gb=10000000\.0 asks for 1e\+07 GiB of host "
     r"memory; this machine has [0-9.]+ GiB"),
    (dict(backend="flexkv", tiers="huge"), r"kvcache\.tiers\.cpu_cache_gb=10000000\.0 asks for 1e\+07 GiB of host "
     r"memory; this machine has [0-9.]+ GiB"),
])
def test_bad_kvcache_values_fail_before_data_weights_or_training(tmp_path, monkeypatch, opts, error):
    """A bad ``kvcache`` value used to surface only when the cache was built: after the data loaded and,
    without a checkpoint, after training one. Now infer and train refuse it first, by the option's name."""
    from gr_plugin.cache.tiers import TierConfig

    def no_work(*args, **kwargs):
        raise AssertionError("data or weights were loaded before the kvcache options were checked")

    opts = dict(opts)
    if opts.get("tiers") == "ttl0":  # (a tier YAML's value: TierConfig itself refuses it on construction)
        (tmp_path / "tiers.yaml").write_text("remote_ttl_s: 0\n")
        opts["tiers"], opts["tier_config"] = TierConfig(), str(tmp_path / "tiers.yaml")
    elif opts.get("tiers") == "file":
        opts["tiers"] = _bad_tiers(tmp_path)
    elif opts.get("tiers") == "huge":
        opts["tiers"] = TierConfig(cpu_cache_gb=1e7)
    kv = KVCacheOptions(**opts)
    for module in (infer, train_app):
        monkeypatch.setattr(module, "make_datamodule", no_work)
    monkeypatch.setattr(infer, "_find_weights", no_work)
    cfg = tiny_cfg(tmp_path, kv)
    cfg.train_if_missing = True  # (no checkpoint: a run would train one first)
    with pytest.raises(ValueError, match=error):
        infer.run(cfg, tmp_path / "out")
    with pytest.raises(ValueError, match=error):
        train_app.run(TrainConfig(model=tiny_cfg(tmp_path).model, kvcache=kv, ckpt_out=str(tmp_path / "t.ckpt")))


def test_host_cache_gb_under_a_backend_that_does_not_read_it_is_warned_about():
    """``+kvcache=flexkv kvcache.host_cache_gb=4`` was silently ignored (flexkv's host tier is
    ``tiers.cpu_cache_gb``), and so was any host cache under ``gpu``."""
    import warnings

    from gr_plugin.apps.common import resolve_backend

    with pytest.warns(UserWarning, match=r"host_cache_gb=4.0 is not read by the flexkv backend: .*cpu_cache_gb"):
        resolve_backend(KVCacheOptions(backend="flexkv", host_cache_gb=4.0))
    with pytest.warns(UserWarning, match=r"kvcache.host_cache_gb=2.0 is not read by the gpu backend"):
        resolve_backend(KVCacheOptions(backend="gpu", host_cache_gb=2.0))
    with initialize_config_dir(config_dir=CONF, version_base="1.3"), warnings.catch_warnings():
        warnings.simplefilter("error")  # (each option's own YAML defaults warn about nothing)
        for option in ("gpu", "native", "flexkv"):
            resolve_backend(OmegaConf.to_object(compose(config_name="infer", overrides=[f"+kvcache={option}"])).kvcache)


def test_results_csv_keeps_every_row_under_its_header(tmp_path):
    """A sweep over ``kvcache=none,native`` appended rows with more columns under the first job's header
    (a malformed CSV); the file now grows to the union of the columns and every row reads back right."""
    import csv

    path = tmp_path / "sweep" / "results.csv"
    infer.append_row(path, {"kvcache": "none", "full_ms_p50": 2.0})
    infer.append_row(path, {"kvcache": "native", "full_ms_p50": 3.0, "hit_rate": 0.5, "equivalence": "PASS"})
    infer.append_row(path, {"kvcache": "none", "full_ms_p50": 4.0})
    rows = list(csv.DictReader(open(path, newline="")))
    assert open(path).readline().strip() == "kvcache,full_ms_p50,hit_rate,equivalence"
    assert rows == [{"kvcache": "none", "full_ms_p50": "2.0", "hit_rate": "", "equivalence": ""},
                    {"kvcache": "native", "full_ms_p50": "3.0", "hit_rate": "0.5", "equivalence": "PASS"},
                    {"kvcache": "none", "full_ms_p50": "4.0", "hit_rate": "", "equivalence": ""}]


def test_a_sweep_records_its_swept_keys(tmp_path):
    """Each job's row of ``results.csv`` leads with its overrides (before: only page_size and batch_size were
    recorded, and a none/flexkv sweep wrote rows under the wrong header)."""
    import csv

    cmd = [sys.executable, "-m", "recipes.infer", "-m", *TINY_SYNTHETIC, "+kvcache=none,flexkv", "data.batch_size=2,4",
           "max_batches=2", "train_if_missing=false", f"default_ckpt={tmp_path}/none.ckpt",
           f"hydra.sweep.dir={tmp_path}/sweep", "hydra/job_logging=disabled"]
    out = subprocess.run(cmd, cwd=tmp_path, capture_output=True, text=True, timeout=300,
                         env={**os.environ, "PYTHONPATH": str(ROOT)})
    assert out.returncode == 0, out.stderr[-3000:]
    rows = list(csv.DictReader(open(tmp_path / "sweep" / "results.csv", newline="")))
    assert sorted((r["kvcache"], r["data.batch_size"]) for r in rows) == [("flexkv", "2"), ("flexkv", "4"),
                                                                         ("none", "2"), ("none", "4")]
    assert all(r["data.source_kwargs.num_users"] == "8" for r in rows)
    assert all(r["equivalence"] == ("PASS" if r["kvcache"] == "flexkv" else "") for r in rows)
    assert all(bool(r["hit_rate"]) == (r["kvcache"] == "flexkv") for r in rows)


def test_a_flexkv_runs_summary_holds_the_tiers_that_ran(tmp_path):
    """summary.json's config holds the config group's ``kvcache.tiers``; a tier YAML replaced some of them,
    and the summary now says which ran (``kvcache_tiers``)."""
    import json

    path = tmp_path / "tiers.yaml"
    path.write_text(f"cpu_cache_gb: 0.01\nssd_cache_gb: 0.02\nssd_cache_dir: {tmp_path / 'ssd'}\n")
    opts = KVCacheOptions(backend="flexkv", page_size=4, num_pages=96, tier_config=str(path))
    summary = infer.run(tiny_cfg(tmp_path, opts, max_batches=2), tmp_path / "out")
    saved = json.loads((tmp_path / "out" / "summary.json").read_text())
    assert saved["summary"]["kvcache_tiers"] == summary["kvcache_tiers"]
    assert (summary["kvcache_tiers"]["cpu_cache_gb"], summary["kvcache_tiers"]["ssd_cache_gb"]) == (0.01, 0.02)
    assert saved["config"]["kvcache"]["tiers"]["cpu_cache_gb"] == 1.0  # (the group's, as composed)


def test_the_weights_line_says_how_many_steps_training_ran(tmp_path):
    """Training a missing checkpoint stops at max_steps or max_epochs, whichever comes first: the summary
    said "trained now (400 steps)" (max_steps) even when two epochs of 2 steps ended it."""
    cfg = tiny_cfg(tmp_path, max_batches=1)
    cfg.train_if_missing = True
    cfg.train = {"trainer": {"max_epochs": 2, "enable_progress_bar": False}, "validate": False}
    summary = infer.run(cfg, tmp_path / "out")
    steps = int(re.search(r"trained now \((\d+) steps\)", summary["weights"]).group(1))
    assert 0 < steps < 400 and steps % 2 == 0  # (two epochs of the same number of batches)


def test_a_results_csv_an_earlier_version_wrote_malformed_is_repaired_not_crashed_on(tmp_path):
    """Rows longer than their header (what the old none/native sweep wrote) made the rewrite raise at the
    end of the run and leave results.csv.tmp behind; their extra values are kept in a column of their own."""
    import csv

    path = tmp_path / "results.csv"
    path.write_text("kvcache,full_ms_p50\nnone,2.0\nnative,3.0,0.5,PASS\n")
    infer.append_row(path, {"kvcache": "flexkv", "full_ms_p50": 4.0, "hit_rate": 0.7})
    rows = list(csv.DictReader(open(path, newline="")))
    assert [r["kvcache"] for r in rows] == ["none", "native", "flexkv"] and not (tmp_path / "results.csv.tmp").exists()
    assert rows[1]["unlabelled_values"] == "0.5;PASS" and rows[2]["hit_rate"] == "0.7" and rows[0]["hit_rate"] == ""


def test_override_columns_are_parsed_values_without_passwords():
    """results.csv's override columns: Hydra's parsed values (no quotes), a URL's password masked (the raw
    override text put ``redis://:hunter2@...`` in the file while summary.json was clean)."""
    from recipes.infer import override_columns

    cols = override_columns(["+kvcache=flexkv", "data.batch_size=4", "kvcache.tiers.remote_url='redis://:hunter2@h:1/0'",
                             "kvcache.tiers={remote_url:'redis://u:hunter2@h:1/0'}", "~kvcache.tier_config"])
    assert cols == {"kvcache": "flexkv", "data.batch_size": "4", "kvcache.tiers.remote_url": "redis://***@h:1/0",
                    "kvcache.tiers": "{remote_url:'redis://***@h:1/0'}"}


def test_a_bad_model_dtype_is_named_as_dtype_not_kvcache_dtype(tmp_path):
    with pytest.raises(ValueError, match=r"^dtype must be one of"):
        infer.run(tiny_cfg(tmp_path, KVCacheOptions(backend="native"), dtype="fp16"), tmp_path / "out")


def test_the_options_a_recipe_builds_itself_warn_about_nothing():
    """recipes.export's own device-only options (no kvcache given; the stream recording) warned that the
    gpu backend does not read host_cache_gb, a value the user never set."""
    import warnings

    from gr_plugin.apps.common import resolve_backend

    with warnings.catch_warnings():
        warnings.simplefilter("error")
        for opts in (KVCacheOptions(backend="gpu"), KVCacheOptions(backend="gpu", host_cache_gb=0.0),
                     KVCacheOptions(backend="flexkv")):
            resolve_backend(opts)


def test_a_recipe_prints_each_lightning_line_once(tmp_path):
    """Lightning's own console handlers and Hydra's root handler printed every Lightning record twice."""
    cmd = [sys.executable, "-m", "recipes.train", *TINY_SYNTHETIC, "trainer.max_steps=1",
           "trainer.limit_train_batches=1", "validate=false", "trainer.enable_progress_bar=false",
           f"ckpt_out={tmp_path}/t.ckpt", f"hydra.run.dir={tmp_path}/run"]
    out = subprocess.run(cmd, cwd=tmp_path, capture_output=True, text=True, timeout=300,
                         env={**os.environ, "PYTHONPATH": str(ROOT)})
    assert out.returncode == 0, out.stderr[-3000:]
    printed = out.stdout + out.stderr
    assert printed.count("Seed set to 0") == 1 and printed.count("`Trainer.fit` stopped") == 1, printed[-3000:]
    assert (tmp_path / "run" / "train.log").read_text().count("Seed set to 0") == 1  # (and the run's log has it)


@pytest.mark.parametrize("backend, option", [("native", "kvcache.host_cache_gb"),
                                             ("flexkv", "kvcache.tiers.cpu_cache_gb")])
def test_a_host_tier_that_cannot_be_allocated_is_named_by_its_option(tmp_path, monkeypatch, backend, option):
    """Below the machine's memory an allocation can still fail (other processes hold it): torch's
    allocator error is turned into one naming the option and the GiB asked for."""
    from gr_plugin.apps import common

    def no_memory(*args, **kwargs):
        raise RuntimeError("[enforce fail at alloc_cpu.cpp:127] data. DefaultCPUAllocator: can't allocate memory: "
                           "you tried to allocate 2147483648 bytes. Error code 12 (Cannot allocate memory)")

    monkeypatch.setattr(common, "KVCacheModule", no_memory)
    opts = KVCacheOptions(backend=backend, page_size=4, num_pages=96, host_cache_gb=0.002)
    with pytest.raises(ValueError, match=rf"{re.escape(option)}=.* GiB of host memory could not be allocated"):
        common.make_cache(opts, tiny_cfg(tmp_path).model, torch.device("cpu"), torch.float32)


@pytest.mark.parametrize("override, error", [
    ("kvcache.tiers.cpu_cache_gb=-1", r"^kvcache\.tiers\.cpu_cache_gb must be a finite number >= 0, got -1"),
    ("kvcache.tiers.write_policy=x", r"^kvcache\.tiers\.write_policy must be one of .*, got 'x'"),
    ("kvcache.tiers.remote_url=http://h:1", r"^kvcache\.tiers\.remote_url must be a redis://"),
    ("kvcache.tiers.remote_ttl_s=0", r"^kvcache\.tiers\.remote_ttl_s must be an int .*got 0"),
    ("kvcache.tiers.task_timeout_s=0", r"^kvcache\.tiers\.task_timeout_s must be a number > 0, got 0"),
])
@pytest.mark.parametrize("recipe", ["infer", "train", "serve"])
def test_a_bad_tier_value_is_named_by_its_kvcache_key(recipe, override, error):
    """The tiers' own check ran as the config became objects and named the library's class
    (``TierConfig.cpu_cache_gb must be ...``), not the key the user set."""
    from gr_plugin.apps.common import config_object

    with initialize_config_dir(config_dir=CONF, version_base="1.3"):
        cfg = compose(config_name=recipe, overrides=([] if recipe == "serve" else ["+kvcache=flexkv"]) + [override])
        with pytest.raises(ValueError, match=error):
            config_object(cfg)


@pytest.mark.parametrize("opts, error", [
    (dict(backend="flexkv", tiers=dict(ssd_cache_gb=0.00001, ssd_cache_dir="SSD")),
     r"^kvcache\.tiers\.ssd_cache_gb=1e-05 holds no page: .* at least [0-9.e-]+ GiB"),
    (dict(backend="flexkv", tiers=dict(cpu_cache_gb=0.0)),
     r"^kvcache\.tiers\.cpu_cache_gb=0\.0: the flexkv backend needs a host tier \(> 0 GiB"),
    (dict(backend="native", host_cache_gb=0.0), r"^kvcache\.host_cache_gb=0\.0: the native backend needs a host tier"),
])
def test_tier_sizes_the_cache_cannot_use_are_named_by_their_key(tmp_path, opts, error):
    """``ssd_cache_gb=0.00001`` said ``SSDPageStore.capacity_bytes=10737 holds no slot ...`` and
    ``cpu_cache_gb=0`` ``a lower-tier backend needs host_cache_bytes > 0``, both after the data loaded."""
    from gr_plugin.apps.common import check_cache_options
    from gr_plugin.cache.tiers import TierConfig

    opts = dict(opts)
    if "tiers" in opts:
        opts["tiers"] = TierConfig(**{k: str(tmp_path / v) if k == "ssd_cache_dir" else v
                                      for k, v in opts["tiers"].items()})
    with pytest.raises(ValueError, match=error):
        check_cache_options(KVCacheOptions(**opts), tiny_cfg(tmp_path).model, "float32")


def test_an_ssd_dir_another_run_holds_says_which_option_to_change(tmp_path):
    """Two runs in one directory clashed on the default SSD dir with 'is in use by another store:
    [Errno 11]', which did not say what to change."""
    from gr_plugin.apps.common import make_cache
    from gr_plugin.cache.tiers import TierConfig

    tiers = TierConfig(cpu_cache_gb=0.002, ssd_cache_gb=0.01, ssd_cache_dir=str(tmp_path / "ssd"))
    opts = KVCacheOptions(backend="flexkv", page_size=4, num_pages=96, tiers=tiers)
    model = tiny_cfg(tmp_path).model
    first = make_cache(opts, model, torch.device("cpu"), torch.float32)
    try:
        with pytest.raises(ValueError, match=r"in use by another store.*set kvcache\.tiers\.ssd_cache_dir to a "
                                             r"directory of its own"):
            make_cache(opts, model, torch.device("cpu"), torch.float32)
    finally:
        first.manager.close()


@pytest.mark.parametrize("mode", [[], ["-m"]])
def test_a_failed_run_prints_no_password_of_its_overrides(tmp_path, mode):
    """Hydra writes 'Error executing job with overrides: [...]' (sys.stderr.write, not logging) on any
    failed job, and a sweep logs each job's overrides: a Redis URL's password was printed in both."""
    url = "kvcache.tiers.remote_url=redis://:hunter2pw@127.0.0.1:6399/0"
    cmd = [sys.executable, "-m", "recipes.infer", *mode, "+kvcache=flexkv", url, "tolerance=-1",
           f"hydra.run.dir={tmp_path}/run", f"hydra.sweep.dir={tmp_path}/sweep"]
    out = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=300)
    printed = out.stdout + out.stderr
    assert out.returncode != 0 and "tolerance must be" in printed, printed[-3000:]
    assert "Error executing job with overrides" in printed and "://***@127.0.0.1" in printed
    assert "hunter2pw" not in printed, printed[-3000:]


@pytest.mark.parametrize("recipe", ["infer", "train"])
def test_cache_keys_without_a_cache_ask_to_choose_one(recipe):
    """``recipes.infer kvcache.page_size=16`` (no +kvcache=...) ended in Hydra's raw traceback
    'AssertionError: Unexpected type for root: NoneType'."""
    out = subprocess.run([sys.executable, "-m", f"recipes.{recipe}", "kvcache.page_size=16"], cwd=ROOT,
                         capture_output=True, text=True, timeout=300)
    assert out.returncode != 0 and "Unexpected type for root" not in out.stderr, out.stderr[-3000:]
    assert "kvcache.page_size=16" in out.stderr and "+kvcache=<none|gpu|native|flexkv>" in out.stderr


def test_cache_keys_with_a_cache_chosen_pass_the_pre_check():
    from gr_plugin.apps.common import refuse_cache_keys_without_cache

    for argv in (["+kvcache=native", "kvcache.page_size=16"], ["-m", "+kvcache=native,flexkv", "kvcache.page_size=8"],
                 ["data.batch_size=4"], ["--cfg", "job"]):
        refuse_cache_keys_without_cache(argv)
    with pytest.raises(SystemExit, match=r"kvcache\.tiers\.cpu_cache_gb=2.*choose a cache first"):
        refuse_cache_keys_without_cache(["kvcache.tiers.cpu_cache_gb=2"])
