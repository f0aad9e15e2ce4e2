"""Validate / test / predict with and without KVCacheCallback on a tiny model and synthetic data."""

import lightning as L
import pytest
import torch
from torch.utils.data import DataLoader

from gr_plugin.data import RecDataModule
from gr_plugin.lightning import HSTURankingModule, KVCacheCallback
from gr_plugin.modules import HSTUConfig


def tiny_setup(seed: int = 0):
    dm = RecDataModule("synthetic", source_kwargs=dict(num_users=12, min_len=20, max_len=60, num_items=40),
                       batch_size=4, num_candidates=6, max_next=2, max_visit_len=6, num_val_visits=3,
                       num_test_visits=3, seed=seed)
    torch.manual_seed(seed)
    module = HSTURankingModule(HSTUConfig(num_items=40, num_time_buckets=dm.num_time_buckets, max_positions=128,
                                          embedding_dim=16, num_layers=2, num_heads=2, head_dim=8, n_norm=64.0))
    return dm, module


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
    assert cb.cache.manager.namespace == f"gr_plugin@step{t.global_step}"
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


def test_the_engine_is_kept_across_calls_and_its_graphs_cleared_when_the_weights_move():
    dm, module = tiny_setup(4)
    dm.setup("predict")
    batches = list(dm.predict_dataloader())
    plain = _predict_scores(trainer(), module, batches)
    cb = KVCacheCallback("gpu", page_size=4, num_pages=512)
    assert cb.cuda_graphs  # (the default; on the CPU the engine has no graphs and runs eagerly)
    first = _predict_scores(trainer([cb]), module, batches[:3])
    engine = cb.engine
    assert engine is not None and engine.graphs is None and engine.cache is cb.cache
    engine.graphs = spy = _GraphsSpy()
    rest = _predict_scores(trainer([cb]), module, batches[3:])
    assert cb.engine is engine and spy.steps == len(batches) - 3
    assert spy.cleared == 1  # by the call's teardown (Lightning moves the module off the device then)
    assert (torch.cat([first, rest]) - plain).abs().max() <= 1e-5
    assert cb.metrics["predict"]["tokens_reused"] > 0
    # weights that moved (new tensors, same values): the same engine and cache, its graphs cleared
    # before the first step (and at the teardown), the K/V kept
    module.model.load_state_dict({k: v.clone() for k, v in module.model.state_dict().items()}, assign=True)
    seen = []
    spy.step = lambda layout, plan: seen.append(spy.cleared)
    again = _predict_scores(trainer([cb]), module, batches)
    assert cb.engine is engine and cb.engine.cache is cb.cache
    assert seen[0] == 2 and spy.cleared == 3
    assert (again - plain).abs().max() <= 1e-5
    assert cb.metrics["predict"]["hit_rate"] > 0.5  # every user's history came back from the cache


def test_a_failure_inside_the_cached_pass_aborts_the_step_once():
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
