"""The serving path on a GPU (marker ``gpu``): a replica's `RankingService` with CUDA graphs and the
host tier scores a visit stream as the same service without graphs does, and as full recomputation
does (bf16: no worse than 2x the full pass's own error against an fp32 oracle). The device cache is
small and the stream is replayed twice, so users come back from the host tier too."""

import numpy as np
import pytest
import torch

from gr_plugin.cache import KVCacheConfig
from gr_plugin.inference import RankingEngine
from gr_plugin.modules import HSTUConfig, HSTURanker, KVCacheModule
from gr_plugin.serving import RankingService, RequestLimits, decode_scores, encode_batch
from tests.serving.helpers import NUM_ITEMS, visits

pytestmark = pytest.mark.gpu

CFG = HSTUConfig(num_items=NUM_ITEMS, num_time_buckets=32, max_positions=256, embedding_dim=64, num_layers=2,
                 num_heads=2, head_dim=32, n_norm=64.0)


def _service(model, graphs: bool) -> RankingService:
    kv = KVCacheConfig(num_layers=CFG.num_layers, num_heads=CFG.num_heads, head_dim=CFG.head_dim, page_size=16,
                       num_pages=24, dtype="bfloat16", device="cuda", host_cache_bytes=1 << 22)
    engine = RankingEngine(model, KVCacheModule(kv, "native"), "cuda", cuda_graphs=graphs)
    return RankingService(engine, RequestLimits.for_model(CFG, max_users=8, max_history_len=200, max_candidates=32))


def test_graphed_service_scores_equal_the_eager_service_and_full_recomputation():
    torch.manual_seed(0)
    oracle = HSTURanker(CFG).eval()  # fp32 on the CPU
    with torch.no_grad():
        for p in oracle.parameters():
            if p.dim() > 1:
                p.normal_(0, 0.3)
    model = HSTURanker(CFG).to("cuda", torch.bfloat16).eval()
    model.load_state_dict(oracle.state_dict())
    full = RankingEngine(model, None, "cuda")
    graphed, eager = _service(model, True), _service(model, False)
    reqs = visits(num_users=12) * 2  # the second pass finds evicted users in the host tier
    worst = {"graphed": 0.0, "eager": 0.0, "full": 0.0, "graphed-eager": 0.0}
    for i in range(0, len(reqs), 2):
        chunk = reqs[i : i + 2]
        wire = [encode_batch(b) for b in chunk]
        outs = {"graphed": graphed(wire), "eager": eager(wire)}
        for j, b in enumerate(chunk):
            lens = b.candidate_lengths.numpy()
            with torch.no_grad():
                ref = oracle.forward(*_kjts(b)).double().numpy()
            got = {k: decode_scores(v[j]["scores"], lens).astype(np.float64) for k, v in outs.items()}
            got["full"] = full.score(b).logits.double().cpu().numpy()
            for k in ("graphed", "eager", "full"):
                worst[k] = max(worst[k], float(np.abs(got[k] - ref).max()))
            worst["graphed-eager"] = max(worst["graphed-eager"], float(np.abs(got["graphed"] - got["eager"]).max()))
    g = graphed.engine.graphs
    assert g.replays > 0, "no step replayed a graph"
    assert worst["graphed"] <= 2 * worst["full"] + 1e-3 and worst["eager"] <= 2 * worst["full"] + 1e-3, worst
    assert worst["graphed-eager"] <= 1e-2, worst
    stats = graphed.stats()["kvcache"]
    assert stats["tokens_reused_device"] > 0 and stats["tokens_reused_host"] > 0, stats
    graphed.close()
    eager.close()


def _kjts(batch):
    from gr_plugin.inference.inputs import batch_to_kjts, host_batch

    return batch_to_kjts(host_batch(batch))
