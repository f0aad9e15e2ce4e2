"""KVCacheCallback on the GPU (marker ``gpu``): Lightning's predict, validate and fit with the cached
steps replayed as CUDA graphs (the callback's default), against the full pass and the eager cached
pass; in bf16 the graphed scores' error against an fp32 oracle is at most 2x the full pass's."""

import copy

import lightning as L
import pytest
import torch

from gr_plugin.lightning import KVCacheCallback
from tests.lightning.helpers import ranking_setup

pytestmark = pytest.mark.gpu


def _setup(seed: int = 0):  # (head_dim 32: a size the graphed step's Triton kernels serve)
    return ranking_setup(seed, num_users=16, min_len=60, max_len=200, num_items=500, num_candidates=8, max_next=4,
                         max_visit_len=8, visits=4, max_positions=512, embedding_dim=64, head_dim=32, n_norm=256.0)


def _trainer(callbacks=(), **kw):
    return L.Trainer(accelerator="gpu", devices=1, logger=False, enable_checkpointing=False,
                     enable_progress_bar=False, enable_model_summary=False, callbacks=list(callbacks), **kw)


def _scores(module, dm, callbacks=()):
    return torch.cat([o["scores"] for o in _trainer(callbacks).predict(module, datamodule=dm)]).float()


@pytest.mark.parametrize(("dtype", "backend"), [(torch.float32, "gpu"), (torch.bfloat16, "gpu"),
                                              (torch.bfloat16, "native")])
def test_predict_replays_graphs_and_matches_the_full_pass(dtype, backend):
    torch.backends.cuda.matmul.allow_tf32 = False
    dm, module = _setup()
    oracle = _scores(copy.deepcopy(module).float(), dm)  # fp32 full pass
    module.to(dtype)
    full = _scores(module, dm)
    eager_cb = KVCacheCallback("gpu", page_size=16, num_pages=512, cuda_graphs=False)
    eager = _scores(module, dm, [eager_cb])
    graph_cb = KVCacheCallback(backend, page_size=16, num_pages=512, host_cache_gb=0.05)
    graphed = _scores(module, dm, [graph_cb])
    graphs = graph_cb.engine.graphs
    assert eager_cb.engine.graphs is None
    assert graphs is not None and graphs.captures > 0 and graphs.replays > 0, (graphs.captures, graphs.replays)
    assert graph_cb.metrics["predict"]["hit_rate"] > 0.3 and graph_cb.metrics["predict"]["fallbacks"] == 0
    if backend == "native":  # the write-through offload to the pinned host tier ran (a cache built in
        stats = graph_cb.cache.manager.stats()  # inference mode could not be read by its copy thread)
        assert stats["host_pages_written"] > 0 and stats["offload_failed"] == 0, stats
    # a second call: Lightning moved the weights to the CPU at the first one's end and back now, so the
    # same graphs object captures again (keeping its one scratch page) and reads the weights' new addresses
    scratch, captured = graphs._scratch, graphs.captures
    again = _scores(module, dm, [graph_cb])
    assert graph_cb.engine.graphs is graphs and graphs._scratch == scratch and graphs.captures > captured
    errs = {name: (s - oracle).abs().max().item() for name, s in
            (("full", full), ("eager", eager), ("graphed", graphed), ("again", again))}
    if dtype == torch.float32:
        assert max(errs.values()) <= 1e-4, errs
    else:  # bf16: each cached way no worse than 2x the full pass in the same precision
        assert max(errs[k] for k in ("eager", "graphed", "again")) <= 2 * errs["full"] + 1e-3, errs


def test_fit_drops_the_graphs_after_each_validation_and_validate_captures_again():
    torch.backends.cuda.matmul.allow_tf32 = False
    dm, module = _setup(1)
    cb = KVCacheCallback("gpu", page_size=16, num_pages=512)
    t = _trainer([cb], max_epochs=2, limit_train_batches=2, limit_val_batches=8, num_sanity_val_steps=0)
    t.fit(module, datamodule=dm)
    graphs = cb.engine.graphs
    assert graphs is not None and graphs.captures >= 2 and graphs.replays > 0  # in both validations
    assert len(graphs._buckets) == 0  # dropped when each validation ended: training had the memory back
    assert cb.metrics["validate"]["tokens_reused"] > 0
    captured = graphs.captures
    plain = _trainer(limit_val_batches=8).validate(module, datamodule=dm)[0]
    cached = _trainer([cb], limit_val_batches=8).validate(module, datamodule=dm)[0]
    # the same graphs object captured again in this call, and dropped at its end (teardown)
    assert cb.engine.graphs is graphs and graphs.captures > captured and len(graphs._buckets) == 0
    for k in ("val/loss", "val/auc_liked", "val/ndcg@10", "val/hr@10"):
        assert abs(plain[k] - cached[k]) <= 1e-4, (k, plain[k], cached[k])
    assert cached["kvcache/val/hit_rate"] > 0.3


def test_bf16_mixed_predict_caches_bf16_and_keeps_the_bf16_rule_eager_and_graphed():
    torch.backends.cuda.matmul.allow_tf32 = False
    dm, module = _setup(2)
    oracle = _scores(module, dm)  # fp32 weights, no autocast

    def mixed(callbacks=()):
        t = _trainer(callbacks, precision="bf16-mixed")
        return torch.cat([o["scores"] for o in t.predict(module, datamodule=dm)]).float()

    full = mixed()
    eager_cb = KVCacheCallback("gpu", page_size=16, num_pages=512, cuda_graphs=False)
    graph_cb = KVCacheCallback("native", page_size=16, num_pages=512, host_cache_gb=0.05)
    eager, graphed = mixed([eager_cb]), mixed([graph_cb])
    graphs = graph_cb.engine.graphs
    assert graphs is not None and graphs.captures > 0 and graphs.replays > 0, (graphs.captures, graphs.replays)
    for cb in (eager_cb, graph_cb):
        assert cb.cache.kv_table.dtype == torch.bfloat16
        assert cb.metrics["predict"]["hit_rate"] > 0.3 and cb.metrics["predict"]["fallbacks"] == 0
    errs = {name: (s - oracle).abs().max().item() for name, s in
            (("full", full), ("eager", eager), ("graphed", graphed))}
    assert errs["full"] > 0, errs  # autocast ran
    assert max(errs["eager"], errs["graphed"]) <= 2 * errs["full"] + 1e-3, errs
