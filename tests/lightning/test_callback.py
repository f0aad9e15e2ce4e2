"""Validate / test / predict with and without KVCacheCallback on a tiny model and synthetic data."""

import dataclasses

import lightning as L
import pytest
import torch
from torch.utils.data import DataLoader

from gr_plugin.cache.hashing import module_namespace
from gr_plugin.inference import batch_to_kjts
from gr_plugin.lightning import HSTURankingModule, KVCacheCallback
from tests.lightning.helpers import ranking_setup


def tiny_setup(seed: int = 0):
    return ranking_setup(seed)


def trainer(callbacks=()):
    return L.Trainer(accelerator="cpu", devices=1, logger=False, enable_checkpointing=False,
                     enable_progress_bar=False, enable_model_summary=False, callbacks=list(callbacks),
                     max_steps=3, limit_train_batches=3, num_sanity_val_steps=2)


def test_predict_with_and_without_the_callback_agree():
    dm, module = tiny_setup()
    plain = torch.cat([o["scores"] for o in trainer().predict(module, datamodule=dm)])
    cb = KVCacheCallback("native", page_size=4, num_pages=256, host_cache_gb=0.01)
    cached = torch.cat([o["scores"] for o in trainer([cb]).predict(module, datamodule=dm)])
    assert (plain - cached).abs().max() <= 1e-5
    m = cb.metrics["predict"]
    assert m["hit_rate"] > 0.3 and m["tokens_reused"] > 0 and m["tokens_computed"] > 0
    assert module.kv_cache is None and module.kv_plan is None  # detached after the loop


@pytest.mark.parametrize("stage", ["validate", "test"])
def test_eval_metrics_equal_and_cache_metrics_logged(stage):
    dm, module = tiny_setup(1)
    run = getattr(trainer(), stage)
    plain = run(module, datamodule=dm)[0]
    cb = KVCacheCallback("gpu", page_size=4, num_pages=512)
    cached = getattr(trainer([cb]), stage)(module, datamodule=dm)[0]
    prefix = "val" if stage == "validate" else "test"
    for k in (f"{prefix}/auc_liked", f"{prefix}/ndcg@10", f"{prefix}/hr@10", f"{prefix}/loss"):
        assert abs(plain[k] - cached[k]) <= 1e-5, k
    assert cached[f"kvcache/{prefix}/hit_rate"] > 0.3
    assert cached[f"kvcache/{prefix}/tokens_computed"] > 0
    assert f"kvcache/{prefix}/hit_rate" not in plain


def test_fit_uses_a_fresh_namespace_per_validation_and_forgets_the_sanity_check():
    dm, module = tiny_setup(2)
    cb = KVCacheCallback("native", page_size=4, num_pages=256, host_cache_gb=0.01)
    t = L.Trainer(accelerator="cpu", logger=False, enable_checkpointing=False, enable_progress_bar=False,
                  enable_model_summary=False, callbacks=[cb], max_epochs=2, limit_train_batches=2,
                  limit_val_batches=4, num_sanity_val_steps=2)
    t.fit(module, datamodule=dm)
    assert cb.cache.manager.namespace == module_namespace("gr_plugin", module.model,
                                                          dataclasses.asdict(module.model.config))
    assert "validate" in cb.metrics and cb.metrics["validate"]["tokens_computed"] > 0
    state = cb.state_dict()
    assert set(state) == {"metrics", "fallbacks"}
    cb2 = KVCacheCallback()
    cb2.load_state_dict(state)
    assert cb2.metrics == cb.metrics


def test_a_failing_step_rolls_the_cache_back():
    dm, module = tiny_setup(3)
    cb = KVCacheCallback("native", page_size=4, num_pages=256, host_cache_gb=0.01)
    calls = {"n": 0}
    original = module.score

    def flaky(batch):
        calls["n"] += 1
        if calls["n"] == 3:
            raise RuntimeError("model failed after allocate")
        return original(batch)

    module.score = flaky
    with pytest.raises(RuntimeError, match="model failed after allocate"):
        trainer([cb]).predict(module, datamodule=dm)
    cb.cache.manager.check()
    assert cb.cache.manager.stats()["plans_in_flight"] == 0
    assert cb.cache.manager.counters.aborts == 1


def test_unknown_stage_is_rejected():
    with pytest.raises(ValueError, match="'fit'"):
        KVCacheCallback(stages=("fit",))


def _loader(batches):
    return DataLoader(batches, batch_size=None)  # (the batches as they are)


def _predict_scores(t, module, batches):
    return torch.cat([o["scores"] for o in t.predict(module, _loader(batches))])


class _GraphsSpy:
    """Stands in for an engine's `CachedStackGraphs` on the CPU: declines every step (the eager step
    runs) and counts `clear` calls."""

    def __init__(self):
        self.steps = self.cleared = 0

    def step(self, layout, plan):
        self.steps += 1
        return None

    def clear(self):
        self.cleared += 1


class _DirtySpy(_GraphsSpy):
    """`_GraphsSpy` that also says whether a step ran since the last `clear` (graphs captured then)."""

    dirty = False

    def step(self, layout, plan):
        self.dirty = True
        return super().step(layout, plan)

    def clear(self):
        self.dirty = False
        super().clear()


def _spy_engines(monkeypatch) -> list[_DirtySpy]:
    """Every engine the callback builds from now on gets a `_DirtySpy` for graphs (listed)."""
    import gr_plugin.lightning.callback as callback_mod

    spies = []

    class Engine(callback_mod.RankingEngine):
        def __init__(self, *args, **kwargs):
            super().__init__(*args, **kwargs)
            self.graphs = _DirtySpy()
            spies.append(self.graphs)

    monkeypatch.setattr(callback_mod, "RankingEngine", Engine)
    return spies


def test_the_engine_is_kept_across_calls_and_its_graphs_cleared_when_the_weights_move():
    dm, module = tiny_setup(4)
    dm.setup("predict")
    batches = list(dm.predict_dataloader())
    plain = _predict_scores(trainer(), module, batches)
    cb = KVCacheCallback("gpu", page_size=4, num_pages=512)
    first = _predict_scores(trainer([cb]), module, batches[:3])
    engine = cb.engine
    assert engine is not None and engine.graphs is None and engine.cache is cb.cache
    engine.graphs = spy = _GraphsSpy()
    rest = _predict_scores(trainer([cb]), module, batches[3:])
    assert cb.engine is engine and spy.steps == len(batches) - 3
    # at the call's start (the first weights this engine's graphs see) and by its teardown (Lightning
    # moves the module off the device then)
    assert spy.cleared == 2
    assert (torch.cat([first, rest]) - plain).abs().max() <= 1e-5
    assert cb.metrics["predict"]["tokens_reused"] > 0
    # weights that moved (new tensors, same values, as `Module.to` moves them): the same engine and
    # cache, its graphs cleared before the first step (and at the teardown), the K/V kept
    for p in module.model.parameters():
        p.data = p.data.clone()
    seen = []
    spy.step = lambda layout, plan: seen.append(spy.cleared)
    again = _predict_scores(trainer([cb]), module, batches)
    assert cb.engine is engine and cb.engine.cache is cb.cache
    assert seen[0] == 3 and spy.cleared == 4
    assert (again - plain).abs().max() <= 1e-5
    assert cb.metrics["predict"]["hit_rate"] > 0.5  # every user's history came back from the cache


def test_a_failure_inside_the_cached_pass_aborts_the_step_once_and_drops_the_graphs(monkeypatch):
    spies = _spy_engines(monkeypatch)
    dm, module = tiny_setup(5)
    cb = KVCacheCallback("native", page_size=4, num_pages=256, host_cache_gb=0.01)
    calls = {"n": 0}
    original = module.model.forward_cached

    def flaky(*args, **kwargs):
        calls["n"] += 1
        if calls["n"] == 2:
            raise RuntimeError("kernel failed mid-step")
        return original(*args, **kwargs)

    module.model.forward_cached = flaky
    with pytest.raises(RuntimeError, match="kernel failed mid-step"):
        trainer([cb]).predict(module, datamodule=dm)
    cb.cache.manager.check()
    assert cb.cache.manager.stats()["plans_in_flight"] == 0
    assert cb.cache.manager.counters.aborts == 1  # by the engine; the callback's hook saw it aborted
    assert module.kv_engine is None and module.kv_step is None
    # (Lightning skips the callbacks' teardown after an exception: `on_exception` drops the graphs)
    assert len(spies) == 1 and spies[0].steps == 2 and not spies[0].dirty


def test_a_batch_with_an_unknown_item_is_refused_before_the_cache_changes():
    dm, module = tiny_setup(6)
    dm.setup("predict")
    good, bad = list(dm.predict_dataloader())[:2]
    bad.candidate_items[0] = 41  # the model has 40 items: ids 1..40
    cb = KVCacheCallback("gpu", page_size=4, num_pages=256)
    with pytest.raises(ValueError, match=r"candidate item id 41 is outside the table range \[1, 40\]"):
        trainer([cb]).predict(module, _loader([good, bad]))
    m = cb.cache.manager
    m.check()
    stats = m.stats()
    assert stats["plans_in_flight"] == 0 and m.counters.aborts == 0
    assert stats["device_users"] == good.batch_size  # the good batch's users, committed; nothing of the bad one


def test_a_batch_that_does_not_fit_runs_the_full_pass_and_counts_a_fallback():
    dm, module = tiny_setup(7)
    plain = torch.cat([o["scores"] for o in trainer().predict(module, datamodule=dm)])
    cb = KVCacheCallback("gpu", page_size=4, num_pages=6)  # 24 slots: no batch of 4 users fits
    cached = torch.cat([o["scores"] for o in trainer([cb]).predict(module, datamodule=dm)])
    assert (plain - cached).abs().max() <= 1e-5
    assert cb.metrics["predict"]["fallbacks"] == len(dm.predict_dataloader())
    assert cb.metrics["predict"]["tokens_reused"] == 0 and cb.cache.manager.stats()["plans_in_flight"] == 0


def test_fit_trains_with_no_graphs_held_from_a_validation(monkeypatch):
    spies = _spy_engines(monkeypatch)

    class Probe(L.Callback):
        def __init__(self):
            self.seen = []

        def on_train_batch_start(self, trainer, pl_module, batch, batch_idx):
            self.seen.append(spies[-1].dirty)

    dm, module = tiny_setup(8)
    cb, probe = KVCacheCallback("gpu", page_size=4, num_pages=512), Probe()
    t = L.Trainer(accelerator="cpu", logger=False, enable_checkpointing=False, enable_progress_bar=False,
                  enable_model_summary=False, callbacks=[cb, probe], max_epochs=2, limit_train_batches=2,
                  limit_val_batches=4, num_sanity_val_steps=2)
    t.fit(module, datamodule=dm)
    assert len(spies) == 1 and spies[0].steps == 2 + 2 * 4  # the sanity check's batches and two validations'
    assert probe.seen == [False] * 4  # every training batch: the last validation's graphs dropped


def test_a_module_that_scores_without_the_prepared_step_gets_it_aborted_not_committed():
    dm, module = tiny_setup(9)
    plain = torch.cat([o["scores"] for o in trainer().predict(module, datamodule=dm)])
    original = module.predict_step

    def predict_step(batch, batch_idx):
        if batch_idx % 2 == 0:  # the full pass, ignoring the callback's step: its pages stay unwritten
            scores = torch.sigmoid(module.model(*batch_to_kjts(batch)))
            return {"user_ids": batch.user_ids, "candidate_lengths": batch.candidate_lengths, "scores": scores}
        return original(batch, batch_idx)

    module.predict_step = predict_step
    cb = KVCacheCallback("gpu", page_size=4, num_pages=512)
    cached = torch.cat([o["scores"] for o in trainer([cb]).predict(module, datamodule=dm)])
    assert (plain - cached).abs().max() <= 1e-5  # no later hit read the unwritten pages
    m = cb.cache.manager
    assert m.counters.aborts == len(dm.predict_dataloader()) // 2 + len(dm.predict_dataloader()) % 2
    assert cb.metrics["predict"]["tokens_reused"] > 0 and m.stats()["plans_in_flight"] == 0


def test_a_module_that_runs_forward_cached_itself_still_works():
    """The protocol before the callback's engine: ``kv_cache``/``kv_plan`` and ``model.forward_cached``."""

    class OwnPass(HSTURankingModule):
        def score(self, batch):
            history, candidates = batch_to_kjts(batch)
            if self.kv_cache is not None and self.kv_plan is not None:
                return self.model.forward_cached(history, candidates, self.kv_cache, self.kv_plan)
            return self.model(history, candidates)

    dm, module = tiny_setup(10)
    plain = torch.cat([o["scores"] for o in trainer().predict(module, datamodule=dm)])
    own = OwnPass(module.model.config)
    own.load_state_dict(module.state_dict())
    cb = KVCacheCallback("native", page_size=4, num_pages=256, host_cache_gb=0.01)
    cached = torch.cat([o["scores"] for o in trainer([cb]).predict(own, datamodule=dm)])
    assert (plain - cached).abs().max() <= 1e-5
    assert cb.metrics["predict"]["hit_rate"] > 0.3 and cb.cache.manager.counters.aborts == 0


def test_predict_then_fit_with_one_callback():
    """The cache is built outside Lightning's inference mode: fit's validation (under no_grad) and the
    host tier's copy thread can write it after a predict built it."""
    dm, module = tiny_setup(11)
    cb = KVCacheCallback("native", page_size=4, num_pages=256, host_cache_gb=0.01)
    trainer([cb]).predict(module, datamodule=dm)
    stats = cb.cache.manager.stats()
    assert stats["host_pages_written"] > 0 and stats["offload_failed"] == 0  # the write-through offload ran
    t = L.Trainer(accelerator="cpu", logger=False, enable_checkpointing=False, enable_progress_bar=False,
                  enable_model_summary=False, callbacks=[cb], max_epochs=1, limit_train_batches=2,
                  limit_val_batches=4, num_sanity_val_steps=0)
    t.fit(module, datamodule=dm)
    assert cb.metrics["validate"]["tokens_computed"] > 0


def _predict(module, dm, callbacks=(), precision="32-true"):
    t = L.Trainer(accelerator="cpu", devices=1, logger=False, enable_checkpointing=False, enable_progress_bar=False,
                  enable_model_summary=False, callbacks=list(callbacks), precision=precision)
    return torch.cat([o["scores"].float() for o in t.predict(module, datamodule=dm)])


def test_mixed_precision_caches_the_autocast_dtype_and_keeps_the_bf16_rule():
    dm, module = tiny_setup(9)
    oracle = _predict(module, dm)
    plain = _predict(module, dm, precision="bf16-mixed")
    cb = KVCacheCallback("native", page_size=4, num_pages=256, host_cache_gb=0.01)
    cached = _predict(module, dm, [cb], precision="bf16-mixed")
    # K/V leave the projections in bf16 under autocast: the pages hold them as they are
    assert cb.cache.kv_table.dtype == torch.bfloat16
    assert cb.metrics["predict"]["hit_rate"] > 0.3 and cb.metrics["predict"]["fallbacks"] == 0
    plain_err = (plain - oracle).abs().max()
    assert 0 < plain_err < 0.05  # bf16 really ran
    assert (cached - oracle).abs().max() <= 2 * plain_err  # the bf16 rule, against the fp32 oracle
    # the same callback at full precision: a cache of float32 pages, its users' K/V starting empty
    again = _predict(module, dm, [cb])
    assert cb.cache.kv_table.dtype == torch.float32 and (again - oracle).abs().max() <= 1e-5
    assert cb.metrics["predict"]["tokens_reused"] > 0


def test_any_precision_plugin_that_autocasts_gets_its_dtype():
    import contextlib

    from lightning.pytorch.plugins.precision import Precision

    class Autocasting(Precision):  # (not MixedPrecision: like FSDP's, it autocasts in its forward context)
        @contextlib.contextmanager
        def forward_context(self):
            with torch.autocast("cpu", dtype=torch.bfloat16):
                yield

    def run(callbacks=()):
        t = L.Trainer(accelerator="cpu", devices=1, logger=False, enable_checkpointing=False,
                      enable_progress_bar=False, enable_model_summary=False, callbacks=list(callbacks),
                      plugins=[Autocasting()])
        return torch.cat([o["scores"].float() for o in t.predict(module, datamodule=dm)])

    dm, module = tiny_setup(13)
    oracle, plain = _predict(module, dm), run()
    cb = KVCacheCallback("gpu", page_size=4, num_pages=256)
    cached = run([cb])
    assert cb.cache.kv_table.dtype == torch.bfloat16 and cb.metrics["predict"]["hit_rate"] > 0.3
    plain_err = (plain - oracle).abs().max()
    assert 0 < plain_err and (cached - oracle).abs().max() <= 2 * plain_err  # the bf16 rule


def test_a_rebuilt_cache_lets_go_of_the_old_one_first(tmp_path):
    from gr_plugin.cache.tiers import TierConfig

    dm, module = tiny_setup(12)
    tiers = TierConfig(cpu_cache_gb=0.01, ssd_cache_gb=0.01, ssd_cache_dir=str(tmp_path / "ssd"))
    cb = KVCacheCallback("flexkv", page_size=4, num_pages=256, tiers=tiers)
    _predict(module, dm, [cb], precision="bf16-mixed")
    old = cb.cache
    again = _predict(module, dm, [cb])  # float32 now: a new cache on the same SSD directory
    assert cb.cache is not old and cb.cache.kv_table.dtype == torch.float32
    assert old.manager.backend._pool._shutdown  # the old tiers closed (their directory lock released)
    assert (again - _predict(module, dm)).abs().max() <= 1e-5 and cb.metrics["predict"]["tokens_reused"] > 0


def test_the_old_tables_are_freed_before_the_new_cache_is_built(monkeypatch):
    import weakref

    dm, module = tiny_setup(14)
    cb = KVCacheCallback("native", page_size=4, num_pages=256, host_cache_gb=0.01)
    _predict(module, dm, [cb], precision="bf16-mixed")
    old = [weakref.ref(cb.cache.kv_table), weakref.ref(cb.cache.manager.backend.host_table)]
    alive_at_build = []
    build = cb._build

    def probing_build(*args):
        alive_at_build.append([r() is not None for r in old])
        return build(*args)

    monkeypatch.setattr(cb, "_build", probing_build)
    _predict(module, dm, [cb])  # float32: rebuilt
    assert alive_at_build == [[False, False]]  # (else a rebuild holds two caches' memory at once)


def test_close_lets_another_callback_use_the_same_ssd_directory(tmp_path):
    from gr_plugin.cache.tiers import TierConfig

    dm, module = tiny_setup(15)
    tiers = TierConfig(cpu_cache_gb=0.01, ssd_cache_gb=0.01, ssd_cache_dir=str(tmp_path / "ssd"))
    first = KVCacheCallback("flexkv", page_size=4, num_pages=256, tiers=tiers)
    _predict(module, dm, [first])
    first.close()
    assert first.cache is None
    second = KVCacheCallback("flexkv", page_size=4, num_pages=256, tiers=tiers)
    assert (_predict(module, dm, [second]) - _predict(module, dm)).abs().max() <= 1e-5
    assert second.metrics["predict"]["tokens_reused"] > 0


def test_a_half_precision_model_caches_its_parameters_dtype():
    dm, module = tiny_setup(10)
    oracle = _predict(module, dm)
    plain = _predict(module, dm, precision="bf16-true")
    cb = KVCacheCallback("gpu", page_size=4, num_pages=256)
    cached = _predict(module, dm, [cb], precision="bf16-true")
    assert cb.cache.kv_table.dtype == torch.bfloat16 and cb.metrics["predict"]["hit_rate"] > 0.3
    plain_err = (plain - oracle).abs().max()
    assert 0 < plain_err and (cached - oracle).abs().max() <= 2 * plain_err


def test_an_explicit_cache_dtype_that_is_not_what_the_model_computes_is_refused_cleanly():
    dm, module = tiny_setup(11)
    cb = KVCacheCallback("gpu", page_size=4, num_pages=256, dtype="float16")
    with pytest.raises(ValueError, match=r"k must be torch\.float16, got torch\.float32"):
        _predict(module, dm, [cb])
    cb.cache.manager.check()
    assert cb.cache.manager.stats()["plans_in_flight"] == 0 and cb.cache.manager.stats()["device_users"] == 0


@pytest.mark.parametrize("kwargs, error", [
    (dict(backend="natve"), r"backend must be one of \['gpu', 'native', 'flexkv'\], got 'natve'"),
    (dict(page_size=0), r"page_size must be a positive int, got 0"),
    (dict(num_pages=12.5), r"num_pages must be a positive int, got 12.5"),
    (dict(host_cache_gb=-1), r"host_cache_gb must be a number >= 0, got -1"),
    (dict(dtype="fp16"), r"dtype must be None or one of .*got 'fp16'"),
    (dict(namespace=""), r"namespace must be a non-empty str, got ''"),
    (dict(tiers={"cpu_cache_gb": 0.01}), r"tiers apply to backend='flexkv' .* got backend='native'"),
    (dict(backend="flexkv", tiers={"cpu_cache_gb": 0.01, "write_back": True}), r"unknown key\(s\) \['write_back'\]"),
    (dict(backend="flexkv", tiers={"remote_ttl_s": 0}), r"remote_ttl_s must be an int in \[1, .*got 0"),
    (dict(backend="flexkv", host_cache_gb=0.5, tiers={"cpu_cache_gb": 0.01}),
     r"host_cache_gb=0.5 disagrees with tiers.cpu_cache_gb=0.01"),
    (dict(write_through="false"), r"write_through must be a bool, got 'false'"),  # (a truthy str: was on)
    (dict(cuda_graphs=0), r"cuda_graphs must be a bool, got 0"),
    (dict(stages="fitt"), r"stage 'fitt' is not one of"),  # (was: "stage 'f'")
])
def test_bad_arguments_are_refused_when_the_callback_is_made(kwargs, error):
    """A bad argument fails where the user wrote it, not at the first batch of a later trainer call."""
    with pytest.raises(ValueError, match=error):
        KVCacheCallback(**kwargs)


def test_one_stage_may_be_given_by_name():
    assert KVCacheCallback(stages="predict").stages == ("predict",)


def test_an_ssd_directory_is_checked_at_construction_and_one_without_a_size_is_warned_about(tmp_path):
    """``tiers={"ssd_cache_dir": ...}`` without ``ssd_cache_gb`` (0: no SSD tier) was silently ignored; a
    directory that cannot be created failed only at the first batch (UAT)."""
    with pytest.warns(UserWarning, match=r"tiers\.ssd_cache_dir='/proc/x' is not used: tiers\.ssd_cache_gb is 0"):
        KVCacheCallback("flexkv", tiers={"ssd_cache_dir": "/proc/x"})
    with pytest.raises(ValueError, match=r"tiers\.ssd_cache_dir='/proc/x' cannot be created"):
        KVCacheCallback("flexkv", tiers={"ssd_cache_dir": "/proc/x", "ssd_cache_gb": 0.1})
    KVCacheCallback("flexkv", tiers={"ssd_cache_dir": str(tmp_path / "ssd"), "ssd_cache_gb": 0.1})
    assert (tmp_path / "ssd").is_dir()


def test_tiers_may_be_a_mapping_or_a_yaml_file_and_set_the_host_size(tmp_path):
    """``tiers`` as a mapping or a FlexKV tier YAML file's path is read as `load_tier_config` reads it
    (a mapping used to fail at the first batch: ``'dict' object has no attribute 'write_policy'``), and
    its ``cpu_cache_gb`` sizes the host tier (the callback's 0.25 GB default used to win silently)."""
    from gr_plugin.cache.tiers import TierConfig

    cb = KVCacheCallback("flexkv", tiers={"cpu_cache_gb": 0.01, "remote_ttl_s": 60})
    assert cb.tiers == TierConfig(cpu_cache_gb=0.01, remote_ttl_s=60) and cb.host_cache_gb == 0.01
    path = tmp_path / "tiers.yaml"
    path.write_text("cpu_cache_gb: 0.02\nssd_cache_gb: 0.01\nssd_cache_dir: " + str(tmp_path / "ssd") + "\n")
    cb = KVCacheCallback("flexkv", tiers=str(path), host_cache_gb=0.02)
    assert cb.tiers.ssd_cache_gb == 0.01 and cb.host_cache_gb == 0.02
    assert KVCacheCallback("native").host_cache_gb == 0.25 and KVCacheCallback("flexkv").tiers is None
