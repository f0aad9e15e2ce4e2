"""KVCacheCallback when the weights change between uses of its cache (training, a ``ckpt_path`` load,
a ``load_state_dict`` by hand, writes through ``.data``, a fused optimizer's step): K/V of older weights are
never read; unchanged weights keep theirs, in another callback too (another process, a DDP rank)."""

import dataclasses

import lightning as L
import pytest
import torch

from gr_plugin.cache.hashing import module_namespace
from gr_plugin.lightning import KVCacheCallback
from tests.lightning.helpers import ranking_setup

_VAL_METRICS = ("val/loss", "val/auc_liked", "val/ndcg@10", "val/hr@10")


def _trainer(callbacks=(), **kwargs):
    return L.Trainer(accelerator="cpu", devices=1, logger=False, enable_checkpointing=False,
                     enable_progress_bar=False, enable_model_summary=False, callbacks=list(callbacks), **kwargs)


def _callback():
    return KVCacheCallback("native", page_size=4, num_pages=256, host_cache_gb=0.01)


def _predict(t, module, dm, **kwargs):
    return torch.cat([o["scores"] for o in t.predict(module, datamodule=dm, **kwargs)])


@pytest.fixture(scope="module")
def trained_ckpt(tmp_path_factory):
    """A checkpoint of `ranking_setup`'s module after a few training steps (other weights than its init)."""
    dm, module = ranking_setup(0)
    module.lr = 1e-2
    t = _trainer(max_steps=4, limit_val_batches=0)
    t.fit(module, datamodule=dm)
    path = tmp_path_factory.mktemp("ckpt") / "trained.ckpt"
    t.save_checkpoint(path)
    return str(path)


@pytest.mark.parametrize("fused", [False, True])
def test_predict_after_fit_equals_the_uncached_predict(fused):
    dm, module = ranking_setup(2)
    module.lr = 1e-2
    if fused:  # (its steps do not bump the parameters' version counters)
        module.configure_optimizers = lambda: torch.optim.AdamW(module.parameters(), lr=1e-2, fused=True)
    cb = _callback()
    t = _trainer([cb], max_steps=3, limit_train_batches=2, limit_val_batches=4, num_sanity_val_steps=0)
    t.fit(module, datamodule=dm)  # validates after step 2 (the cache filled), trains step 3
    assert cb.metrics["validate"]["tokens_computed"] > 0
    plain = _predict(_trainer(), module, dm)
    assert (_predict(t, module, dm) - plain).abs().max() <= 1e-5
    first = cb.metrics["predict"]["hit_rate"]
    assert (_predict(t, module, dm) - plain).abs().max() <= 1e-5
    assert cb.metrics["predict"]["hit_rate"] > first  # no training since: the first predict's K/V are read


def test_predict_with_ckpt_path_equals_the_uncached_predict_of_the_checkpoint(trained_ckpt):
    dm, module = ranking_setup(0)
    cb = _callback()
    t = _trainer([cb])
    initial = _predict(t, module, dm)  # the cache filled by the initial weights
    cached = _predict(t, module, dm, ckpt_path=trained_ckpt)
    plain = _predict(_trainer(), module, dm, ckpt_path=trained_ckpt)
    assert (initial - plain).abs().max() > 1e-3  # (the checkpoint's weights are others)
    assert (cached - plain).abs().max() <= 1e-5


def test_validate_with_ckpt_path_equals_the_run_without_the_callback(trained_ckpt):
    dm, module = ranking_setup(0)
    t = _trainer([_callback()])
    t.validate(module, datamodule=dm, verbose=False)  # the cache filled by the initial weights
    cached = t.validate(module, datamodule=dm, ckpt_path=trained_ckpt, verbose=False)[0]
    plain = _trainer().validate(module, datamodule=dm, ckpt_path=trained_ckpt, verbose=False)[0]
    for k in _VAL_METRICS:
        assert abs(cached[k] - plain[k]) <= 1e-5, (k, cached[k], plain[k])


@pytest.mark.parametrize("assign", [False, True])
def test_a_load_state_dict_by_hand_between_predicts_is_seen(assign):
    dm, module = ranking_setup(3)
    _, other = ranking_setup(4)  # (the same sizes, another init)
    cb = _callback()
    t = _trainer([cb])
    _predict(t, module, dm)
    module.load_state_dict(other.state_dict(), assign=assign)
    assert (_predict(t, module, dm) - _predict(_trainer(), other, dm)).abs().max() <= 1e-5


def test_repeated_predicts_with_unchanged_weights_hit_the_cache():
    dm, module = ranking_setup(5)
    plain = _predict(_trainer(), module, dm)
    cb = _callback()
    first = _predict(_trainer([cb]), module, dm)
    first_rate, namespace = cb.metrics["predict"]["hit_rate"], cb.cache.manager.namespace
    again = _predict(_trainer([cb]), module, dm)  # (another trainer, the same callback)
    assert cb.metrics["predict"]["hit_rate"] > max(first_rate, 0.5)  # the first call's K/V are read
    assert cb.cache.manager.namespace == namespace == _namespace(module)
    assert (first - plain).abs().max() <= 1e-5 and (again - plain).abs().max() <= 1e-5


def _namespace(module):
    return module_namespace("gr_plugin", module.model, dataclasses.asdict(module.model.config))


@pytest.mark.parametrize("how", ["fused_step", "data_copy", "data_assign"])
def test_weights_changed_outside_every_hook_are_seen(how):
    """A fused optimizer's step and writes through ``.data`` bump no version counter and run no hook: the
    fingerprint taken at the loop's start sees them."""
    dm, module = ranking_setup(6)
    _, other = ranking_setup(7)
    cb = _callback()
    t = _trainer([cb])
    _predict(t, module, dm)
    before = cb.cache.manager.namespace
    if how == "fused_step":
        for p in module.parameters():
            p.grad = torch.ones_like(p)
        torch.optim.AdamW(module.parameters(), lr=1e-2, fused=True).step()
    else:
        for p, q in zip(module.parameters(), other.parameters(), strict=True):
            if how == "data_copy":
                p.data.copy_(q.data)
            else:
                p.data = q.data.clone()
    assert (_predict(t, module, dm) - _predict(_trainer(), module, dm)).abs().max() <= 1e-5
    assert cb.cache.manager.namespace == _namespace(module) != before


def test_callbacks_with_equal_weights_share_a_namespace_and_others_do_not():
    """The namespace is the weights' (as the recipes'): another callback, e.g. another process or DDP rank
    on a shared remote tier, with equal weights reads the same keys; with other weights, none of them."""
    dm, module = ranking_setup(8)
    _, twin = ranking_setup(8)
    _, other = ranking_setup(9)
    names = []
    for m in (module, twin, other):
        cb = _callback()
        _predict(_trainer([cb]), m, dm)
        names.append(cb.cache.manager.namespace)
        cb.close()
    assert names[0] == names[1] != names[2] and names[0].startswith("gr_plugin:w")
