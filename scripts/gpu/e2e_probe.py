"""Do the e2e suite's engines return finite, matching logits? (one device call)

python3 scripts/gpu/e2e_probe.py [bs] [batches] -> per batch: NaN/inf counts of each engine's logits
(graph, eager, full) and their max abs differences to full. GR_PLUGIN_FUSED_NORM=0 turns the norm
kernels off; PROBE_SMALL_TILES=1 gives the paged attention its former 64x64 tiles.
"""

import os
import sys

import torch

from gr_plugin.bench.e2e import stream
from gr_plugin.cache import KVCacheConfig
from gr_plugin.inference import RankingEngine
from gr_plugin.modules import HSTUConfig, HSTURanker, KVCacheModule

if os.environ.get("PROBE_SMALL_TILES") == "1":
    from gr_plugin.ops.triton import hstu_attention as tri

    tri._blocks = lambda dim, dtype, paged: (64, 32, 4, 2) if dim >= 256 else (64, 64, 4, 3)
bs, n = (int(a) for a in (sys.argv[1:] + ["8", "6"][len(sys.argv) - 1:])[:2])
torch.manual_seed(0)
cfg = HSTUConfig(num_items=50_000, num_time_buckets=32, max_positions=8192, embedding_dim=1024, num_layers=8,
                 num_heads=4, head_dim=128, n_norm=4096.0)
model = HSTURanker(cfg).to(device="cuda", dtype=torch.bfloat16).eval()
kv = KVCacheConfig(num_layers=8, num_heads=4, head_dim=128, page_size=128, num_pages=24 * 36 + 8, dtype="bfloat16",
                   device="cuda")
engines = {"graph": RankingEngine(model, KVCacheModule(kv, "gpu"), torch.device("cuda"), cuda_graphs=True),
           "eager": RankingEngine(model, KVCacheModule(kv, "gpu"), torch.device("cuda")),
           "full": RankingEngine(model, None, torch.device("cuda"))}
for i, batch in enumerate(stream(bs, 24, 256, 4096, 128, 256, None)[:n]):
    out = {name: e.score(batch).logits.float() for name, e in engines.items()}
    bad = {name: int((~torch.isfinite(x)).sum()) for name, x in out.items()}
    diff = {name: (out[name] - out["full"]).abs().max().item() for name in ("graph", "eager")}
    print(f"batch {i}: non-finite {bad} max|x - full| {diff} rows {out['full'].shape}")
