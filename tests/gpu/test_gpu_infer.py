"""``recipes.infer`` on the GPU (marker ``gpu``): both passes replay CUDA graphs (``kvcache.cuda_graphs``,
the default) or run eagerly, and every cached score equals the recomputed one within the run's tolerance
(fp32), or keeps the bf16 rule against the fp32 recomputation (``dtype=bfloat16``)."""

import dataclasses

import pytest
import torch

from gr_plugin.apps import infer
from gr_plugin.configs.kvcache import KVCacheOptions
from tests.apps.test_infer import tiny_cfg

pytestmark = pytest.mark.gpu


@pytest.mark.parametrize("graphs", [True, False])
@pytest.mark.parametrize("backend", ["gpu", "native"])
def test_infer_on_cuda_replays_graphs_and_matches_the_recompute(tmp_path, backend, graphs):
    torch.backends.cuda.matmul.allow_tf32 = False
    opts = KVCacheOptions(backend=backend, page_size=16, num_pages=96, host_cache_gb=0.01, cuda_graphs=graphs)
    cfg = tiny_cfg(tmp_path, opts, device="cuda")
    cfg.model = dataclasses.replace(cfg.model, head_dim=32, embedding_dim=64)  # (a size the graphed kernels serve)
    summary = infer.run(cfg, tmp_path / "out")
    assert summary["device"].startswith("cuda") and summary["equivalence"] == "PASS", summary["max_abs_diff"]
    assert summary["hit_rate"] > 0.05 and summary["fallbacks"] == 0
    if graphs:
        assert summary["cached_graph_replays"] > 0 and summary["full_graph_replays"] > 0, summary
    else:
        assert "cached_graph_replays" not in summary and "full_graph_replays" not in summary


@pytest.mark.parametrize("graphs", [True, False])
def test_infer_in_bf16_on_cuda_keeps_the_bf16_rule(tmp_path, graphs):
    torch.backends.cuda.matmul.allow_tf32 = False
    opts = KVCacheOptions(backend="native", page_size=16, num_pages=96, host_cache_gb=0.01, cuda_graphs=graphs)
    cfg = tiny_cfg(tmp_path, opts, device="cuda", dtype="bfloat16")
    cfg.model = dataclasses.replace(cfg.model, head_dim=32, embedding_dim=64)
    summary = infer.run(cfg, tmp_path / "out")
    cached, full = summary["max_err_cached_vs_fp32"], summary["max_err_full_vs_fp32"]
    assert 0 < full and cached <= 2 * full and summary["equivalence"] == "PASS", (cached, full)
    assert summary["hit_rate"] > 0.05 and summary["fallbacks"] == 0
    if graphs:
        assert summary["cached_graph_replays"] > 0 and summary["full_graph_replays"] > 0, summary
