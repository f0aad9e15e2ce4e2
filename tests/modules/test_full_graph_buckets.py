"""`full_bucket_key` and `FullStackGraphs`' host side (no GPU needed; capture and replay are in
tests/gpu/test_full_graphs.py): every user of a batch fits its bucket, the padding stays a bounded
share of the rows, a growing stream takes few buckets, bad input is refused."""

import types

import numpy as np
import pytest
import torch

from gr_plugin.modules import graphs as graphs_mod
from gr_plugin.modules.full_graphs import FullStackGraphs, full_bucket_key
from gr_plugin.modules.graphs import EXACT_USERS
from tests.modules.helpers import User, make_inputs, tiny_model


@pytest.mark.parametrize("q_quantum", [128, 48, 1])
def test_every_user_of_a_full_pass_fits_its_bucket(q_quantum):
    """Batches of 1..10 users of 1..5000 rows each: the users plus a padding user, at least the real
    rows, every real user's rows and the padding user's (the rest, none where the real ones fill
    the bucket) within ``max_q``; the padding under an eighth of the rows' power of two (or one
    ``q_quantum``), ``max_q`` under an eighth of the longest user's power of two above it."""
    g = torch.Generator().manual_seed(0)
    for bs in range(1, 11):
        for _ in range(30):
            lens = torch.randint(1, 5001, (bs,), generator=g).tolist()
            n, longest = sum(lens), max(lens)
            users, tokens, max_q = full_bucket_key(bs, n, longest, q_quantum)
            assert users >= bs + 1 and (users == bs + 1 or users & (users - 1) == 0)
            assert longest <= max_q and 0 <= tokens - n <= max_q
            pow2 = 1 << (n - 1).bit_length()  # the power of two at or above n
            assert tokens - n < max(q_quantum, pow2 // 8)
            assert max_q - longest < max(q_quantum, (1 << (longest - 1).bit_length()) // 8)


def test_a_growing_stream_takes_few_buckets():
    """The e2e suite's stream (histories 256 -> 4096 in steps of 128, 256 candidates, every user of
    a batch alike): 30 visits of each batch size map to 14-16 buckets, under the default
    ``max_buckets`` (32), so a warmed engine replays every step (22-23 while a bucket always had a
    padding row: a visit whose rows are a multiple of the step then took the next step up)."""
    for bs, count in ((1, 14), (2, 14), (4, 14), (8, 16)):
        keys = {full_bucket_key(bs, bs * (h + 256), h + 256) for h in range(256, 4097, 128)}
        assert len(keys) == count
        assert all(users == (bs + 1 if bs + 1 < EXACT_USERS else 16) for users, _, _ in keys)


def test_rows_that_fill_a_bucket_take_no_padding():
    assert full_bucket_key(8, 16384, 2048) == (16, 16384, 2048)  # the padding user empty
    assert full_bucket_key(1, 384, 384) == (2, 384, 384)
    assert full_bucket_key(8, 16385, 2049) == (16, 17920, 2560)  # one row past: the next step of each


def test_bad_shapes_and_settings_are_refused():
    with pytest.raises(ValueError, match="got 0 users, 10 rows, at most 10 a user"):
        full_bucket_key(0, 10, 10)
    with pytest.raises(ValueError, match="got 3 users, 2 rows"):
        full_bucket_key(3, 2, 1)
    model = tiny_model(0)
    with pytest.raises(ValueError, match="q_quantum must be >= 1, got 0"):
        FullStackGraphs(model, q_quantum=0)
    with pytest.raises(ValueError, match="max_buckets and capture_after must be >= 1, got 32 and 0"):
        FullStackGraphs(model, capture_after=0)


def test_a_cached_layout_is_refused_and_nothing_is_counted():
    """`FullStackGraphs.step` takes a full pass's layout only: one built with cached history is a
    ValueError naming the lengths, before any bucket is made or counted. On a CPU the graphs are
    not supported, and an engine asked for CUDA graphs there runs eagerly."""
    from gr_plugin.inference import RankingEngine
    from gr_plugin.modules.tokens import build_token_layout

    model = tiny_model(0)
    graphs = FullStackGraphs(model)
    assert not graphs.supported(torch.device("cpu"))
    g = torch.Generator().manual_seed(1)
    users = [User(0, g), User(1, g)]
    for u in users:
        u.grow(12)
    history, candidates, _, _ = make_inputs(users, [u.candidates(3) for u in users])
    cached = build_token_layout(history, candidates, torch.tensor([4, 0]), model.config.max_positions)
    with pytest.raises(ValueError, match=r"no history cached\), got new lengths \[8, 12\] of histories \[12, 12\]"):
        graphs.step(cached)
    assert graphs._steps == 0 and not graphs._seen and not graphs._buckets
    engine = RankingEngine(model, None, "cpu", cuda_graphs=True)
    assert engine.full_graphs is None and engine.graphs is None


def test_a_bucket_is_made_the_capture_after_th_time_its_key_is_seen():
    """`GraphBuckets._admit`: a key's bucket is made on its ``capture_after``-th sighting (room
    permitting); past 16 x ``max_buckets`` keys seen, the uncaptured ones are forgotten."""
    graphs = FullStackGraphs(tiny_model(0), max_buckets=2, capture_after=3)
    assert [graphs._admit("a") for _ in range(4)] == [False, False, True, True]
    graphs._buckets["a"] = object()  # "a" captured
    for i in range(32):
        graphs._admit(i)
    assert len(graphs._seen) == 33  # "a" and 0..31: 32 and 33 keys were not past 32 when counted
    graphs._admit("z")  # 33 keys seen: the uncaptured forgotten, then "z" counted
    assert graphs._seen == {"a": 4, "z": 1}


def test_a_full_set_counts_a_new_key_before_it_evicts_anything():
    """`GraphBuckets._admit` asks for room only once a key has been seen ``capture_after`` times: a
    first sighting leaves a full set of buckets (even one with an idle least recently used bucket)
    as it is; the second drops that bucket."""
    from types import SimpleNamespace

    graphs = FullStackGraphs(tiny_model(0), max_buckets=1, capture_after=2, idle_steps=0)
    graphs._buckets["old"] = SimpleNamespace(last_used=0)
    graphs._steps = 5
    assert not graphs._admit("new") and list(graphs._buckets) == ["old"] and graphs.evictions == 0
    assert graphs._admit("new") and not graphs._buckets and graphs.evictions == 1


def test_packed_inputs_fill_two_buffers_in_turn_and_reset_every_tail():
    """`PackedInputs` (off CUDA: plain buffers, no events): each step fills the other host buffer,
    `put` writes a field and its fill to the field's end, `send` copies the buffer (or its first
    ``end`` ints) into ``ints``."""
    from gr_plugin.modules.graphs import PackedInputs

    p = PackedInputs((("a", 4), ("b", 3)), torch.device("cpu"))
    first = p.begin()
    p.put("a", np.array([1, 2]), 9)
    p.put("b", np.array([5, 6, 7]), 0)
    p.send()
    assert p.view("a").tolist() == [1, 2, 9, 9] and p.view("b").tolist() == [5, 6, 7]
    second = p.begin()
    assert second is not first  # the buffer the first copy read is left alone
    p.put("a", np.array([3]), 0)
    p.send(end=4)  # only the first field goes
    assert p.view("a").tolist() == [3, 0, 0, 0] and p.view("b").tolist() == [5, 6, 7]
    assert p.begin() is first


def test_retired_host_buffers_are_held_until_their_copies_have_run(monkeypatch):
    """A dropped `PackedInputs` that copied through the runtime leaves its host buffers to `_RETIRED`
    (torch's pinned allocator does not know of those copies); they go, oldest first, once every event
    of theirs has completed, and not before."""
    from gr_plugin.modules import graphs

    class Event:
        def __init__(self, done):
            self.done = done

        def query(self):
            return self.done

    monkeypatch.setattr(graphs, "_RETIRED", __import__("collections").deque())
    first, second = [Event(True), Event(False)], [Event(True), Event(True)]
    graphs._retire(first, ["buffers of the first"])
    graphs._retire(second, ["buffers of the second"])
    graphs._prune_retired()
    assert [b for _, b in graphs._RETIRED] == [["buffers of the first"], ["buffers of the second"]]
    first[1].done = True
    graphs._prune_retired()
    assert not graphs._RETIRED


def test_a_full_pass_is_packed_with_its_padding_user_and_a_smaller_one_resets_the_tails():
    """`FullStackGraphs._load` on the host: the ids key-major with padding rows 0, the padding user
    ``[nq, tokens)`` all candidates, the users past it empty, the candidates' rows padded with 0;
    a later pass with fewer rows and users in the same bucket leaves nothing of the first behind."""
    from gr_plugin.modules.tokens import EMBEDDING_KEYS, build_token_layout

    model = tiny_model(0)
    graphs = FullStackGraphs(model)
    g = torch.Generator().manual_seed(2)

    def layout(sizes):
        users = []
        for i, n in enumerate(sizes):
            users.append(User(i, g))
            users[-1].grow(n)
        h, c, _, _ = make_inputs(users, [u.candidates(2 + i) for i, u in enumerate(users)])
        return build_token_layout(h, c, None, model.config.max_positions)

    big, small = layout([30, 20, 25]), layout([10, 5])
    b = graphs._new_bucket((8, 128, 64), torch.device("cpu"))
    for lay in (big, big, small, small):  # each host buffer holds the big pass, then the small one
        graphs._load(b, lay)
        nq, bsz = lay.num_query_tokens, lay.candidate_lengths.numel()
        ids = b.inputs.view("ids").view(len(EMBEDDING_KEYS), 128)
        assert torch.equal(ids[:, :nq], lay.token_ids.view(len(EMBEDDING_KEYS), nq)) and not ids[:, nq:].any()
        assert b.inputs.view("q_offsets").tolist() == lay.q_offsets.tolist() + [128] * (8 - bsz)
        assert b.inputs.view("candidate_lengths").tolist() == \
            lay.candidate_lengths.tolist() + [128 - nq] + [0] * (7 - bsz)
        rows = b.inputs.view("cand_rows")
        n = lay.candidate_rows.numel()
        assert torch.equal(rows[:n], lay.candidate_rows) and not rows[n:].any()


def test_the_shared_step_skeleton_makes_loads_captures_replays_and_stays_eager_after_a_failed_capture(monkeypatch):
    """`GraphBuckets._step`, the skeleton both engines' ``step`` run (here with stand-in callables, the
    CUDA device context a no-op): eager (None) until the key's ``capture_after``-th step and while
    ``make`` gives no bucket; then load, capture once, replay, a fresh copy of the first rows; a key
    whose capture raised stays eager without loading again."""
    import contextlib

    monkeypatch.setattr(graphs_mod.torch.cuda, "device", lambda d: contextlib.nullcontext())
    gb = graphs_mod.GraphBuckets(max_buckets=4, capture_after=2, idle_steps=None)
    log, logits = [], torch.arange(6.0)
    bucket = types.SimpleNamespace(graph=None, last_used=0)
    made = iter([None, bucket])  # the first make finds no room (e.g. no scratch page yet)

    def capture(b):
        log.append("capture")
        b.graph = "g"

    def step(key, capture=capture):
        return gb._step(key, None, lambda: next(made), lambda b: log.append("load"), lambda b: b.graph is not None,
                        capture, lambda b: log.append("replay") or logits, 4)

    assert step("a") is None and log == []  # first sighting: not admitted
    assert step("a") is None and "a" not in gb._buckets  # admitted, no bucket made
    out = step("a")
    assert log == ["load", "capture", "replay"] and torch.equal(out, logits[:4])
    assert out.data_ptr() != logits.data_ptr()  # a fresh tensor: the graph's output is overwritten by the next replay
    assert step("a") is not None and log[3:] == ["load", "replay"] and gb.replays == 2 and gb._steps == 4

    def broken(b):
        raise RuntimeError("operation not permitted when stream is capturing")

    made = iter([types.SimpleNamespace(graph=None, last_used=0)])
    log.clear()
    assert step("b", broken) is None  # first sighting: not admitted
    assert step("b", broken) is None and log == ["load"]  # admitted, loaded, its capture raised
    assert "b" in gb._failed and "b" not in gb._buckets
    made = iter([types.SimpleNamespace(graph=None, last_used=0)])  # (a bucket would be there to make)
    assert step("b") is None and log == ["load"]  # eager for good: not made, loaded or captured again
    assert gb._steps == 7 and gb.replays == 2 and "b" not in gb._buckets


def test_clear_drops_every_bucket_and_count_and_the_pool_and_keeps_the_failed_keys(monkeypatch):
    """`GraphBuckets.clear` (the Lightning callback's, when the weights move): every bucket, the
    counts of keys seen and the pool go, so a key is made again on its ``capture_after``-th sighting
    after it; a key whose capture failed stays eager; the counters stay."""
    import contextlib

    monkeypatch.setattr(graphs_mod.torch.cuda, "device", lambda d: contextlib.nullcontext())
    gb = graphs_mod.GraphBuckets(max_buckets=4, capture_after=2, idle_steps=None)
    made = []

    def step(key):
        def make():
            made.append(key)
            return types.SimpleNamespace(graph=None, last_used=0)

        return gb._step(key, None, make, lambda b: None, lambda b: b.graph is not None,
                        lambda b: setattr(b, "graph", "g"), lambda b: torch.zeros(2), 2)

    step("a"), step("a")
    gb._failed.add("bad")
    gb._pool = ("pool",)
    assert made == ["a"] and "a" in gb._buckets
    gb.clear()
    assert not gb._buckets and not gb._seen and gb._pool is None and gb._failed == {"bad"}
    assert gb.replays == 1 and gb._steps == 2
    assert step("a") is None and made == ["a"]  # seen once since the clear: eager
    assert step("a") is not None and made == ["a", "a"]  # made (and captured) again
