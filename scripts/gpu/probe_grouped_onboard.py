"""Does grouping the onboard's copies make a layerwise host hit faster, in the engine and in
this script's bare copies? (the 2K tiers row of docs/BENCHMARKS.md; the engine groups its copies
since 002a4d6, `gr_plugin.cache.transfer.layer_spans`)

python3 scripts/gpu/probe_grouped_onboard.py [tokens ...] [repeats=N]   (default 2048 4096, 100)

The tiers bench's bs-1 block and static step (`gr_plugin.bench.block`: head_dim 128, page 128, 128
new events, 256 candidates) with every cached page in the host tier. Each request is timed as the
bench times its layerwise host hit (an event, the onboard, the metadata load, the layer segments
each behind its layer's wait, an event), the onboard done these ways, interleaved (each way first
in turn), medians and quartiles:
- ``engine``: the transfer engine's (`KVCacheManager.onboard_launch`), as the bench (its copies
  grouped as ``pairs``, every layer's queued at launch);
- ``engine_per_layer``: the engine with ``group_layers`` off (one copy per layer and run);
- ``engine_lazy``: the engine one layer ahead (``onboard_lookahead=1``: layer ``i + 1``'s copy,
  and its pair's other layer, queued at the first wait for layer ``i``);
- ``layers``: this script's raw copies (`cudart.raw_copier`), one per layer and run, every layer
  queued at once, an event after each layer;
- ``pairs``: the engine's groups, layers 0 | 1 2 | 3 4 | 5 6 | 7 (for 8 layers), each group one
  2-D copy per run, the group's layers' waits on the event after it;
- ``front``: 0 1 | 2 3 | 4 5 | 6 | 7, the pairs first.
``layers`` against the groups isolates the grouping; ``engine`` against ``pairs`` the engine's
launch path, and ``engine_lazy`` against ``engine`` the lazy launch of the layers past the pair
1 2.
The transfer floor (one pinned copy of the same bytes, as the bench) is printed next to them. Before
the first request of each way the onboarded device pages are made NaN; after it they must equal the
host pages, and no page outside the plan may have changed.
"""

from __future__ import annotations

import statistics
import sys

import torch

from gr_plugin.bench.block import StaticStep, host_hit_block, transfer_floor_ms
from gr_plugin.cache import cudart
from gr_plugin.cache.transfer import joint_runs, layer_spans


def groupings(layers: int) -> dict[str, list[list[int]]]:
    """Each way's groups of layers, in copy order (the last layer always alone: the step's tail
    waits for it)."""
    spans = layer_spans(layers)
    pairs = [[i + k for k in range(span)] for i, span in enumerate(spans) if span]
    front = [[i, i + 1] for i in range(0, layers - 2, 2)] + [[i] for i in range(layers - 2 + layers % 2, layers)]
    return {"layers": [[i] for i in range(layers)], "pairs": pairs, "front": front}


def _pages(m, plan) -> tuple[list[int], list[int]]:
    """The plan's onboard as host slots and device pages (as `KVCacheManager.onboard_launch` reads them)."""
    hb, offsets = plan.host_metadata.numpy(), plan.metadata.field_offsets
    indptr, indices = offsets["kv_indptr"][0], offsets["kv_indices"][0]
    src, dst = [], []
    for b, first, slots in plan.onboard_src:
        at = indices + int(hb[indptr + b]) + first
        src += slots.tolist()
        dst += hb[at : at + slots.numel()].tolist()
    return src, dst


def onboard(m, plan, groups: list[list[int]], copier) -> list[torch.cuda.Event]:
    """Every group's copies queued on the engine's copy stream behind the caller's stream; each
    layer's event. ``copier``: `cudart.raw_copier` of the host and device tables."""
    runs = joint_runs(*_pages(m, plan))
    stream = m.transfer.h2d_stream
    m.transfer._fence(stream)  # (the engine's raw fence: `wait_stream` costs tens of µs)
    events: list = [None] * m.config.num_layers
    for g in groups:
        for s0, d0, n in runs:
            copier(g[0], s0, d0, n, stream, len(g))
        ev = torch.cuda.Event()
        ev.record(stream)
        for i in g:
            events[i] = ev
    return events


def one(tokens: int, repeats: int, new: int = 128, candidates: int = 256, page: int = 128) -> None:
    cached = tokens - new
    blk = host_hit_block(tokens, 128, page, new)
    m = blk.cache
    floor = transfer_floor_ms(blk, cached, repeats)
    num_layers = m.config.num_layers
    engine_ways = {"engine": {}, "engine_per_layer": {"group_layers": False},
                   "engine_lazy": {"onboard_lookahead": 1}}  # the engine's settings per way
    ways = {**dict.fromkeys(engine_ways), **groupings(num_layers)}
    copier = cudart.raw_copier(m.backend.host_table, m.kv_table)
    assert copier is not None, "no raw copies on this machine"
    times: dict[str, list[float]] = {w: [] for w in ways}
    with torch.no_grad():
        plan = blk.plan([1], tokens)
        step = StaticStep(blk, plan, 1, tokens - plan.cached_lengths[0], candidates)
        m.abort(plan)
        for r in range(repeats + 2):
            names = list(ways)
            for name in names[r % len(names) :] + names[: r % len(names)]:  # each way first in turn
                groups = ways[name]
                m.evict([1])
                plan = blk.plan([1], tokens)
                assert plan.onboard_tokens == [cached // page * page], plan.onboard_tokens
                if r == 0:  # the onboarded pages made NaN first, so the check below sees the copy
                    src, dst = _pages(m, plan)
                    m.kv_table[:, dst] = float("nan")
                    before = m.kv_table.clone()
                if groups is None:  # (set before the request's first event)
                    for key, value in {"group_layers": True, "onboard_lookahead": None, **engine_ways[name]}.items():
                        setattr(m.transfer, key, value)
                torch.cuda.synchronize()
                a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
                a.record()
                if groups is None:
                    wait = m.onboard_launch(plan).wait_layer
                else:
                    events = onboard(m, plan, groups, copier)

                    def wait(i: int, events=events) -> None:
                        torch.cuda.current_stream().wait_event(events[i])
                step.load(plan)
                step.run(wait=wait)
                b.record()
                b.synchronize()
                if r == 0:  # the onboarded pages hold the host's, and no page outside the plan changed
                    assert torch.equal(m.kv_table[:, dst].cpu(), m.backend.host_table[:, src]), name
                    a0, e0 = plan.metadata.field_offsets["kv_indices"]
                    mine = set(plan.host_metadata[a0:e0].tolist())
                    others = [p for p in range(m.kv_table.shape[1]) if p not in mine]
                    assert torch.equal(m.kv_table[:, others], before[:, others]), name
                if r >= 2:
                    times[name].append(a.elapsed_time(b))
                m.abort(plan)
                m.offload_flush()
    print(f"tokens {tokens} (cached {cached}), floor {floor:.4f} ms; median (quartiles) ms, median / floor:")
    for w, t in times.items():
        q = statistics.quantiles(t, n=4)
        print(f"  {w:>6}: {q[1]:.4f} ({q[0]:.4f}-{q[2]:.4f}), {q[1] / floor:.3f}x")
    m.close()


if __name__ == "__main__":
    opts = dict(a.split("=", 1) for a in sys.argv[1:] if "=" in a)
    for t in [int(a) for a in sys.argv[1:] if "=" not in a] or [2048, 4096]:
        one(t, int(opts.get("repeats", 100)))
