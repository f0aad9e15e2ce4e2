"""Does a graph bucket's padding row cost the e2e stream? (one call of the device tool)

python3 scripts/gpu/probe_bucket_padding.py [batch_size ...] -> per batch size, the graphed cached
engine's pipelined req/s over the e2e stream (`gr_plugin.bench.e2e`, one step in flight, median of
rounds taking turns) for two rules of a bucket's query rows (`gr_plugin.modules.graphs.bucket_key`):
"plus1", the rule until 2026-12-01 (the real rows + 1, up to a multiple of the token quantum: a step
of 384 * bs rows at an even bs took 256 padding rows) and "exact", the rule since (the real rows up
to a multiple: none there; at an odd bs both rules round 384 * bs up alike), with each rule's
attention launch as the split model picks it; plus each rule's max abs difference of the logits
against the eager cached engine over the same stream.
"""

import statistics
import sys

import torch

from gr_plugin.bench import e2e
from gr_plugin.inference import RankingEngine
from gr_plugin.modules import KVCacheModule
from gr_plugin.modules import graphs as graphs_mod

REAL_KEY = graphs_mod.bucket_key


def plus1_key(batch_size, num_query_tokens, num_new_tokens, max_q_len, token_quantum=graphs_mod.TOKEN_QUANTUM,
              new_quantum=graphs_mod.NEW_QUANTUM, q_quantum=graphs_mod.Q_QUANTUM):
    users, _, new, _ = REAL_KEY(batch_size, num_query_tokens, num_new_tokens, max_q_len, token_quantum,
                                new_quantum, q_quantum)
    tokens = graphs_mod._round_up(num_query_tokens + 1, token_quantum)
    return users, tokens, new, min(tokens, max(graphs_mod._round_up(max_q_len, q_quantum), token_quantum))


RULES = {"plus1": plus1_key, "exact": REAL_KEY}


def main(batch_sizes, rounds=5):
    torch.manual_seed(0)
    device = torch.device("cuda")
    model = e2e.stream_model(device)
    for bs in batch_sizes:
        batches = e2e.stream(bs, 24, 256, 4096, 128, 256)
        kv = e2e.stream_cache_config(device, 24)
        engines, caches = {}, []
        for name, rule in RULES.items():
            graphs_mod.bucket_key = rule
            cache = KVCacheModule(kv, "gpu")
            engines[name] = RankingEngine(model, cache, device, cuda_graphs=True)
            caches.append(cache)
            for b in e2e.other_users(batches, 1 << 20):  # warm: captures every bucket of the stream
                engines[name].score(b)
            cache.manager.evict_all()
        eager_cache = KVCacheModule(kv, "gpu")
        eager = RankingEngine(model, eager_cache, device)
        diffs = dict.fromkeys(RULES, 0.0)
        tokens = {}
        for b in batches:
            want = eager.score(b).logits.float()
            for name, engine in engines.items():
                graphs_mod.bucket_key = RULES[name]
                got = engine.score(b).logits.float()
                diffs[name] = max(diffs[name], (got - want).abs().max().item())
        for name, engine in engines.items():
            tokens[name] = sorted({k[1] for k in engine.graphs._buckets})
        passes = {name: [] for name in RULES}
        for _ in range(rounds):
            for name, engine in engines.items():
                graphs_mod.bucket_key = RULES[name]
                for c in caches:
                    c.manager.evict_all()
                for b in batches[:2]:
                    engine.score(b)
                passes[name].append(e2e._pipelined(engine, batches[2:], True))
        n = sum(b.batch_size for b in batches[2:])
        for name in RULES:
            secs = [s for s, _ in passes[name]]
            busy = statistics.median(1 - w / s for s, w in passes[name])
            print(f"bs {bs} {name}: {n / statistics.median(secs):.0f} req/s pipelined (passes "
                  f"{', '.join(f'{n / s:.0f}' for s in secs)}), host busy {busy:.3f}, bucket rows {tokens[name]}, "
                  f"max abs diff vs eager {diffs[name]:.4f}, replays {engines[name].graphs.replays}", flush=True)
        graphs_mod.bucket_key = REAL_KEY


if __name__ == "__main__":
    main([int(a) for a in sys.argv[1:]] or [8])
