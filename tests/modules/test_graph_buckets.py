"""`bucket_key`: the padded shape a cached step's CUDA graph is captured for (no GPU needed).

Every user of every batch mapped to a bucket must fit the bucket's ``max_q`` (the attention kernel
computes no query row past it), and the key must let the attention split its keys as the real
users allow (`_query_tiles`).
"""

import pytest
import torch

from gr_plugin.modules.graphs import EXACT_USERS, HISTORY_QUANTUM, bucket_key, history_bound
from gr_plugin.ops.triton import hstu_attention as tri


@pytest.mark.parametrize(("token_quantum", "new_quantum", "q_quantum"), [(256, 128, 128), (100, 7, 48), (64, 64, 256)])
def test_every_user_of_a_batch_fits_its_bucket(token_quantum, new_quantum, q_quantum):
    """For batches of 1..10 users with query rows 1..300 each (the padding user takes the rest of the
    bucket's rows): users, rows and new rows are covered, every real user's rows and the padding
    user's rows are at most ``max_q``, and ``max_q`` is at most the bucket's rows, with any quanta."""
    g = torch.Generator().manual_seed(0)
    for bs in range(1, 11):
        for _ in range(20):
            lens = torch.randint(1, 301, (bs,), generator=g).tolist()
            new = int(torch.randint(0, 100, (1,), generator=g))
            users, tokens, new_rows, max_q = bucket_key(bs, sum(lens), new, max(lens), token_quantum, new_quantum,
                                                        q_quantum)
            assert users >= bs + 1 and tokens >= sum(lens) and new_rows >= max(new, 1)
            assert tokens % token_quantum == 0 and new_rows % new_quantum == 0
            assert max(lens) <= max_q <= tokens and tokens - sum(lens) <= max_q
            # an upper bound on the users' rows (what a caller may pass) keys no smaller max_q
            assert bucket_key(bs, sum(lens), new, max(lens) + 5, token_quantum, new_quantum, q_quantum)[3] >= max_q


def test_small_buckets_count_their_users_exactly():
    """Below `EXACT_USERS` (the padding user included) the users are exact, so no empty user past
    the padding one counts as holding query rows (the padding user itself is empty where the real
    rows fill the bucket); from there on they round up to a power of two."""
    assert [bucket_key(bs, 384 * bs, 128 * bs, 384)[0] for bs in range(1, 10)] == [2, 3, 4, 5, 6, 7, 8, 16, 16]
    assert EXACT_USERS == 8


def test_engine_buckets_take_the_splits_of_their_real_users(monkeypatch):
    """The e2e suite's requests (128 new events + 256 candidates per user, history 4096, head_dim
    128, an H200's 132 SMs): the tiles and split count of the bucket's attention launch (its users,
    rows, ``max_q`` and history bound, as `CachedStackGraphs._attend` passes them) is what the real
    users plus the padding user allow. Before (d3b28d0: a power of two of users, ``max_q_len`` = all
    rows, the grid counted) bs 2 and 4 took one split (H200, `scripts/gpu/tune_attention.py bucket`:
    0.073 / 0.084 ms a layer against 0.035 / 0.054 at 3 / 2 splits)."""
    monkeypatch.setattr(tri, "_num_sms", lambda device: 132)
    monkeypatch.setattr(tri, "_shared_memory", lambda device: 232448)
    cpu = torch.device("cpu")
    got = {}
    for bs in (1, 2, 4, 8):
        users, tokens, _, max_q = bucket_key(bs, 384 * bs, 128 * bs, 384)
        hist = history_bound(4096, 4 * 4096)
        blocks = tri._launch_blocks(tokens, users, 4, max_q, hist, 128, torch.bfloat16, True, cpu)  # the launch's
        got[bs] = blocks[0], tri._default_splits(tokens, users, 4, max_q, hist, blocks, 128, 2, cpu)
    # bs 1 and 2 take 64-row tiles by the few-tile rule, bs 4 and 8 by the makespan model (the padding
    # user counts as a user: 2 splits at bs 4). 384 * bs rows fill their bucket (no padding row): bs 8's
    # 252 counted programs (63 tiles x 4 heads, the empty users counted) fit one wave of 2 x 132, so 1 split
    # (4 with the 256 padding rows it had until 2026-12-01: 268 programs, two waves)
    assert got == {1: (64, 7), 2: (64, 4), 4: (64, 2), 8: (64, 1)}


def test_a_bucket_keys_on_a_power_of_two_bound_of_its_histories():
    """`history_bound`: the longest history up to a power of two, at least `HISTORY_QUANTUM`, at most
    the cache's capacity (so never above what any user can have); never below the real one within
    the capacity."""
    assert [history_bound(n, 1 << 20) for n in (0, 1, 1000, 1024, 1025, 4096, 4097)] == \
        [HISTORY_QUANTUM] * 4 + [2048, 4096, 8192]
    assert history_bound(5000, 6000) == 6000 and history_bound(10, 512) == 512
    for n in range(0, 20000, 37):
        assert n <= history_bound(n, 1 << 15) <= max(2 * n, HISTORY_QUANTUM)


def test_a_full_set_of_buckets_gives_up_only_an_idle_least_recently_used_one():
    """`CachedStackGraphs._make_room` (the policy only; capture and replay are GPU tests): below
    ``max_buckets`` there is room; when full, the least recently used bucket goes only once it has
    been idle more than ``idle_steps`` steps, and its shape must be seen ``capture_after`` times
    again before it is captured anew."""
    from types import SimpleNamespace

    from gr_plugin.modules.graphs import CachedStackGraphs
    from tests.modules.helpers import tiny_cache, tiny_model

    model = tiny_model(0)
    graphs = CachedStackGraphs(model, tiny_cache(model), max_buckets=2, idle_steps=3)
    assert graphs._make_room()
    graphs._buckets["a"] = SimpleNamespace(last_used=1)
    graphs._buckets["b"] = SimpleNamespace(last_used=2)
    graphs._buckets.move_to_end("a")  # "a" used again at step 4: "b" is now the least recent
    graphs._buckets["a"].last_used = 4
    graphs._seen = {"a": 2, "b": 2, "c": 2}
    graphs._steps = 5  # "b" idle 3 steps: not more than idle_steps
    assert not graphs._make_room() and list(graphs._buckets) == ["b", "a"] and graphs.evictions == 0
    graphs._steps = 6
    assert graphs._make_room() and list(graphs._buckets) == ["a"] and graphs.evictions == 1
    assert "b" not in graphs._seen and graphs._seen["c"] == 2
    with pytest.raises(ValueError, match="max_buckets and capture_after must be >= 1, got 0 and 2"):
        CachedStackGraphs(model, tiny_cache(model), max_buckets=0)


def test_buckets_key_on_the_attention_launch_their_history_bound_gives(monkeypatch):
    """`CachedStackGraphs._key`: the bucket shape plus the attention launch (tiles, split count) of
    the step's history bound, on an H200's sizes, head_dim 128, 4 heads, bf16, a cache of 16384
    tokens. bs 1 (a few-tile launch: 64-row tiles, 7 splits by the model) launches alike at every
    bound, so one bucket serves histories 500 to 4096, and so does bs 8 (one wave at every bound);
    bs 3 takes other split counts at 1024, 4096 and 16384 (the makespan model), so those are three
    buckets. The bound returned is the step's own, what the bucket's launch passes as
    ``max_history_len``."""
    from types import SimpleNamespace

    from gr_plugin.cache import KVCacheConfig
    from gr_plugin.modules.graphs import CachedStackGraphs

    monkeypatch.setattr(tri, "_num_sms", lambda device: 132)
    monkeypatch.setattr(tri, "_shared_memory", lambda device: 232448)
    cfg = KVCacheConfig(num_layers=2, num_heads=4, head_dim=128, page_size=128, num_pages=128)
    graphs = CachedStackGraphs(None, SimpleNamespace(config=cfg))
    table = torch.empty(0, dtype=torch.bfloat16)

    def key(bs, hist):
        return graphs._key(bs, 384 * bs, 128 * bs, 384, hist, table)

    ones = {key(1, h)[0] for h in (500, 1024, 1500, 2048, 3000, 4096)}
    assert len(ones) == 1 and next(iter(ones))[4] == ((64, 64, 4, 2), 7)
    assert [key(1, h)[1] for h in (500, 1500, 3000)] == [1024, 2048, 4096]
    threes = {h: key(3, h)[0] for h in (1000, 4096, 16384)}
    assert {h: k[4] for h, k in threes.items()} == {1000: ((64, 64, 4, 2), 2), 4096: ((64, 64, 4, 2), 5),
                                                    16384: ((64, 64, 4, 2), 8)}
    assert len(set(threes.values())) == 3
    assert len({key(8, h)[0] for h in (1000, 4096, 16384)}) == 1
    assert key(8, 20000)[1] == 16384  # at most the capacity
    assert key(8, 4096)[0][:4] == bucket_key(8, 384 * 8, 128 * 8, 384)
