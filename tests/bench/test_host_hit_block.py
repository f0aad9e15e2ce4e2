"""The tiers rows' block (`gr_plugin.bench.block.host_hit_block`) on the CPU: what the tiers bench
and the tiers scripts rely on before they time anything."""

import torch

from gr_plugin.bench.block import host_hit_block, tiers_plan


def test_the_host_hit_block_holds_the_cached_history_in_the_host_tier():
    tokens, page, new = 2048 + 40, 128, 168  # a partial page cached: only full pages reach the host tier
    blk = host_hit_block(tokens, head_dim=32, page=page, new=new, device="cpu")
    m = blk.cache
    try:
        cached = tokens - new
        npg = -(-tokens // page)
        assert m.config.num_pages == 2 * npg + 8 and m.backend.host_table.shape[1] == 2 * npg + 8
        plan = blk.plan([1], tokens)  # still on the device: a device hit
        assert plan.onboard_tokens == [0] and plan.cached_lengths == [cached]
        m.abort(plan)
        m.evict([1])
        plan = blk.plan([1], tokens)  # the full pages come back from the host tier
        assert plan.onboard_tokens == [cached // page * page] and plan.cached_lengths == [cached // page * page]
        handle = m.onboard_launch(plan)
        handle.wait()
        src = plan.onboard_src[0][2]
        hb = plan.host_metadata
        a = plan.metadata.field_offsets["kv_indices"][0]
        dst = hb[a : a + src.numel()]
        assert torch.equal(m.kv_table[:, dst], m.backend.host_table[:, src])
        m.abort(plan)
        m.check()
    finally:
        m.close()


def test_the_tiers_bench_interleaves_gpu_hits_of_user_2_with_host_hits_of_user_1():
    """The tiers bench's rounds (`tiers_plan`): user 2 stays on the device through host hits of
    user 1 (each evicted, onboarded, aborted), so every GPU hit finds all its pages there."""
    tokens, page, new = 2048, 128, 128
    cached = tokens - new
    blk = host_hit_block(tokens, head_dim=32, page=page, new=new, device="cpu")
    m = blk.cache
    try:
        blk.fill([2], cached)
        for _ in range(3):
            for mode in ("gpu", "host", "layerwise", "gpu", "layerwise"):
                plan = tiers_plan(blk, tokens, cached, mode)  # asserts what each mode onboards
                if mode != "gpu":
                    m.onboard_launch(plan).wait()
                m.abort(plan)
                m.offload_flush()
        # the first host hit evicts user 1; after each abort user 1 is off the device again, and the
        # allocator evicted nobody (user 2 included)
        assert m.stats()["evicted_users"] == 1
        m.check()
    finally:
        m.close()
