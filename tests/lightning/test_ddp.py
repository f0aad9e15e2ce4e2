"""KVCacheCallback under DDP (two CPU processes, gloo): each rank caches the users its batches hold;
the evaluation's metrics equal the run without the callback, and the cache figures are the ranks' sums."""

import lightning as L
import pytest

from gr_plugin.lightning import KVCacheCallback
from tests.lightning.helpers import ranking_setup


def _validate(devices: int, callbacks=()):
    dm, module = ranking_setup(3)
    t = L.Trainer(accelerator="cpu", devices=devices, strategy="ddp_spawn" if devices > 1 else "auto",
                  logger=False, enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False,
                  callbacks=list(callbacks))
    return t.validate(module, datamodule=dm)[0]


def test_validate_under_ddp_equals_the_plain_run_and_sums_the_ranks_cache_figures():
    one = _validate(1, [KVCacheCallback("native", page_size=4, num_pages=256, host_cache_gb=0.01)])
    plain = _validate(2)
    cached = _validate(2, [KVCacheCallback("native", page_size=4, num_pages=256, host_cache_gb=0.01)])
    for k in ("val/loss", "val/auc_liked", "val/auc_watched", "val/ndcg@10", "val/hr@10"):
        assert abs(plain[k] - cached[k]) <= 1e-5, (k, plain[k], cached[k])
    # 36 visits split 18 / 18 (no padding): every visit's history is reused or computed on some rank
    total = one["kvcache/val/tokens_reused"] + one["kvcache/val/tokens_computed"]
    assert cached["kvcache/val/tokens_reused"] + cached["kvcache/val/tokens_computed"] == total
    assert cached["kvcache/val/tokens_reused"] > 0
    assert cached["kvcache/val/hit_rate"] == pytest.approx(cached["kvcache/val/tokens_reused"] / total)  # (float32)
