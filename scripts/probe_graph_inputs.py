"""The cached graph step's input packing, C++ against numpy, in one process (CPU only).

python3 scripts/probe_graph_inputs.py [batch_size ...] -> per batch size (a returning user: 3968 tokens
cached, 128 new, 256 candidates each, the e2e stream's last visit), the median µs of
`CachedStackGraphs._load`'s packing (the copy excluded) through the core's ``pack_cached_step``, through
its numpy reference (`pack_cached_numpy`, with the op's checks) and through the numpy packing as it was
before the op (no page checks, kept here as `_before`), the forms taking turns call by call, so a host
whose speed drifts (a shared VM) shifts all alike. Checks first that the three write the same ints.
"""

import statistics
import sys

import numpy as np
import torch

from gr_plugin.bench import e2e
from gr_plugin.bench.common import interleaved_us
from gr_plugin.inference import RankingEngine
from gr_plugin.modules import KVCacheModule
from gr_plugin.modules import graphs as gm


def _before(b, layout, plan) -> int:
    """The numpy packing of `CachedStackGraphs._load` before the C++ op (commit 4f71d0e), for comparison."""
    meta = plan.metadata
    n, m = meta.num_new_tokens, meta.num_batch_pages
    p = b.inputs
    st = p.buffer()
    f, put = p.fields, p.put
    hb = plan.host_metadata.numpy()

    def host(name):
        a, e = meta.field_offsets[name]
        return hb[a:e]

    gm.pack_layout(p, layout, b.tokens)
    put("rows", layout.new_rows.numpy(), 0)
    indptr, indices = host("kv_indptr"), host("kv_indices")
    pos, page_size = host("new_token_positions"), meta.page_size
    page = pos // page_size
    slots = indices[indptr[host("new_token_batch")] + page] * page_size + (pos - page * page_size)
    put("slots", slots, b.scratch_slots.numpy()[n:])
    put("kv_indptr", indptr, m)
    put("total_lengths", host("total_lengths"), 0)
    put("new_lengths", host("new_lengths"), 0)
    a = f["kv_indices"][0]
    st[a : a + m] = indices
    return a + m


def main(batch_sizes, repeats=3000):
    torch.set_num_threads(1)
    for bs in batch_sizes:
        model = e2e.stream_model(torch.device("cpu"), hidden=64, layers=2, heads=4, head_dim=16)
        batches = e2e.stream(bs, bs, 3968, 4096, 128, 256)
        kv = e2e.stream_cache_config(torch.device("cpu"), bs, layers=2, heads=4, head_dim=16)
        kv.host_cache_bytes = 64 * kv.page_bytes
        cache = KVCacheModule(kv, "native")  # (loads the core)
        eng = RankingEngine(model, cache, "cpu")
        eng.score(batches[0])
        step = eng.prepare(batches[1])
        layout, plan = step.layout, step.plan
        graphs = gm.CachedStackGraphs(model, cache)
        graphs._scratch = cache.manager.reserve_scratch_pages(1)[0]
        key = gm.bucket_key(bs, layout.num_query_tokens, plan.metadata.num_new_tokens, layout.max_q_len)
        b = graphs._new_bucket((*key, None), 4096, torch.device("cpu"))
        p, meta = b.inputs, plan.metadata
        ids = layout.token_ids.reshape(-1)

        def spans():
            return [x for name in gm._META_FIELDS for x in meta.field_offsets[name]]

        forms = {
            "C++": lambda: torch.ops.gr_kv_core.pack_cached_step(
                p.staging(), b.spans, ids, layout.q_offsets, layout.new_rows, layout.candidate_rows,
                plan.host_metadata, spans(), meta.page_size, kv.num_pages, b.scratch_slots),
            "numpy": lambda: gm.pack_cached_numpy(
                p.buffer(), b.spans, ids.numpy(), layout.q_offsets.numpy(), layout.new_rows.numpy(),
                layout.candidate_rows.numpy(), plan.host_metadata.numpy(), spans(), meta.page_size, kv.num_pages,
                b.scratch_slots.numpy()),
            "numpy before": lambda: _before(b, layout, plan),
        }
        written = []
        for fn in forms.values():
            p.buffer()[:] = -7
            end = fn()
            written.append(p.buffer()[:end].copy())
        assert all(np.array_equal(written[0], w) for w in written[1:]), "the forms packed different ints"
        times = interleaved_us(forms, repeats)
        print(f"bs {bs} ({layout.num_query_tokens} rows, {meta.num_new_tokens} new, {meta.num_batch_pages} pages): "
              + ", ".join(f"{name} {statistics.median(t):.1f} µs" for name, t in times.items()), flush=True)
        eng.discard(step)


if __name__ == "__main__":
    main([int(a) for a in sys.argv[1:]] or [1, 8])
