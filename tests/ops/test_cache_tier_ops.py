"""The host tier's tensor-only ops ``gr_kv::cache_{attach_host, allocate_tiered, offload_launch,
offload_reap}`` (gr_plugin/csrc/core/request_ops.cpp): the same decisions as `KVCacheManager` with
its pinned host tier on a scripted stream (evictions, returns, a tight host tier), the K/V bytes moved
by ``gather_pages`` / ``scatter_pages`` arriving where the plans say, opcheck, and bad inputs."""

import pytest
import torch

from gr_plugin.cache import CacheRequest, HostTier, KVCacheManager
from gr_plugin.ops import cache_ops, library  # noqa: F401  (library: the page ops' kernels)

from ..cache.helpers import history_tokens, tiny_config

OPS = torch.ops.gr_kv
PAGE, DEVICE_PAGES, HOST_SLOTS, NS = 4, 10, 9, "test"
OK = cache_ops.STATUS["ok"]
SINGLE_CALL_UTILS = ("test_schema", "test_autograd_registration", "test_faketensor")
# (users visiting, events per user after the visit): devices hold ~2 users, the host ~2-3
STREAM = [((1, 2), 9), ((3, 4), 10), ((1, 2), 12), ((5,), 14), ((3, 4), 13), ((1, 5), 15), ((2, 3, 4), 14),
          ((1, 2), 17)]


def _value(user: int, pos: int, layer: int, kv: int) -> float:
    return user * 1000.0 + pos + layer * 0.25 + kv * 0.5


def _request(users, length):
    users = sorted(users)
    return (torch.tensor(users), torch.tensor([length] * len(users)),
            torch.cat([history_tokens(u, length) for u in users]))


def _write_new_tokens(table, users, lengths, cached, slots):
    """What a step's appends write: each new token's K and V, a value naming (user, position, layer)."""
    at = 0
    for u, total, c in zip(users, lengths, cached):
        for pos in range(c, total):
            page, off = divmod(int(slots[at]), PAGE)
            for layer in range(table.shape[0]):
                for kv in (0, 1):
                    table[layer, page, kv, off] = _value(u, pos, layer, kv)
            at += 1


def _assert_history_in_pages(table, users, cached, kv_indices, kv_indptr):
    for b, (u, c) in enumerate(zip(users, cached)):
        for pos in range(c):
            page = int(kv_indices[int(kv_indptr[b]) + pos // PAGE])
            for layer in range(table.shape[0]):
                for kv in (0, 1):
                    got = table[layer, page, kv, pos % PAGE]
                    assert torch.all(got == _value(u, pos, layer, kv)), (u, pos, layer, kv)


def _tables():
    cfg = tiny_config(num_pages=DEVICE_PAGES)
    shape = (cfg.num_layers, DEVICE_PAGES, 2, PAGE, cfg.num_heads, cfg.head_dim)
    return cfg, torch.zeros(shape), torch.zeros((*shape[:1], HOST_SLOTS, *shape[2:]))


def test_tier_ops_make_the_managers_decisions_and_move_the_bytes():
    cfg, kv_table, host_table = _tables()
    cfg.host_cache_bytes = HOST_SLOTS * cfg.page_bytes
    manager = KVCacheManager(cfg, HostTier())
    state = OPS.cache_create(DEVICE_PAGES, PAGE, NS)
    OPS.cache_attach_host(state, HOST_SLOTS)
    onboarded = 0
    for users, length in STREAM:
        req = _request(users, length)
        plan = manager.prepare(CacheRequest(*req))  # allocate + onboard launch
        out = OPS.cache_allocate_tiered(state, *req)
        status, kv_indices, kv_indptr, cached, slots, onboard_slots, onboard_pages = out
        if plan is None:  # more pages than the device has: both refuse, nothing changes
            assert status[0].item() == cache_ops.STATUS["too_big"] and onboard_slots.numel() == 0
            continue
        assert status[0].item() == OK and status[1].item() == plan.plan_id
        assert cached.tolist() == plan.cached_lengths and kv_indices.tolist() == plan.metadata.kv_indices.tolist()
        assert onboard_slots.numel() * PAGE == sum(plan.onboard_tokens)
        # onboard: the host slots' pages into the plan's pages, then the step's appends
        OPS.scatter_pages(kv_table, OPS.gather_pages(host_table, onboard_slots), onboard_pages)
        onboarded += onboard_slots.numel()
        _assert_history_in_pages(kv_table, req[0].tolist(), cached.tolist(), kv_indices, kv_indptr)
        _write_new_tokens(kv_table, req[0].tolist(), req[1].tolist(), cached.tolist(), slots)
        OPS.cache_commit(state, status, req[1], req[2])
        manager.commit(plan)
        manager.offload_flush()
        # write-through: the committed users' new full pages into host slots
        ticket, src_pages, dst_slots = OPS.cache_offload_launch(state, req[0])
        OPS.scatter_pages(host_table, OPS.gather_pages(kv_table, src_pages), dst_slots)
        OPS.cache_offload_reap(state, ticket, True)
    stats = manager.stats()
    assert onboarded * PAGE == stats["tokens_reused_host"] > 0  # the stream reaches the host tier
    assert stats["host_evicted_users"] > 0  # and it is tight
    manager.check()
    OPS.cache_destroy(state)


def _attached():
    state = OPS.cache_create(DEVICE_PAGES, PAGE, NS)
    OPS.cache_attach_host(state, HOST_SLOTS)
    return state


@pytest.mark.parametrize("util", SINGLE_CALL_UTILS)
def test_opcheck_tier_ops(util):
    state = OPS.cache_create(DEVICE_PAGES, PAGE, NS)
    torch.library.opcheck(OPS.cache_attach_host.default, (state, HOST_SLOTS), test_utils=util)
    state = _attached()
    req = _request((1, 2), 9)
    torch.library.opcheck(OPS.cache_allocate_tiered.default, (state, *req), test_utils=util)
    state = _attached()
    plan = OPS.cache_allocate_tiered(state, *req)[0]
    OPS.cache_commit(state, plan, req[1], req[2])
    torch.library.opcheck(OPS.cache_offload_launch.default, (state, req[0]), test_utils=util)
    state = _attached()
    plan = OPS.cache_allocate_tiered(state, *req)[0]
    OPS.cache_commit(state, plan, req[1], req[2])
    ticket = OPS.cache_offload_launch(state, req[0])[0]
    torch.library.opcheck(OPS.cache_offload_reap.default, (state, ticket, True), test_utils=util)


def test_tier_ops_bad_inputs_raise_and_change_nothing():
    state = OPS.cache_create(DEVICE_PAGES, PAGE, NS)
    req = _request((1, 2), 9)
    with pytest.raises(ValueError, match="no host tier"):
        OPS.cache_allocate_tiered(state, *req)
    with pytest.raises(ValueError, match="num_slots must be > 0, got 0"):
        OPS.cache_attach_host(state, 0)
    OPS.cache_attach_host(state, HOST_SLOTS)
    with pytest.raises(ValueError, match="already has a host tier"):
        OPS.cache_attach_host(state, HOST_SLOTS)
    plan = OPS.cache_allocate_tiered(state, *req)[0]
    OPS.cache_commit(state, plan, req[1], req[2])
    ticket, src_pages, dst_slots = OPS.cache_offload_launch(state, req[0])
    assert ticket[0].item() > 0 and src_pages.numel() == dst_slots.numel() == 4  # 2 full pages each
    assert ticket[1].item() == 0  # nobody refused
    with pytest.raises(ValueError, match="names no offload in flight"):
        OPS.cache_offload_reap(state, ticket + torch.tensor([1, 0]), True)
    with pytest.raises(ValueError, match=r"ticket must have shape \[2\]"):
        OPS.cache_offload_reap(state, ticket[:1], True)
    with pytest.raises(ValueError, match="offloads are in flight"):
        OPS.cache_destroy(state)
    OPS.cache_offload_reap(state, ticket, False)  # given back: nothing published
    again = OPS.cache_offload_launch(state, req[0])  # so the pages are still to write
    assert again[1].tolist() == src_pages.tolist()
    OPS.cache_offload_reap(state, again[0], True)
    assert OPS.cache_offload_launch(state, req[0])[0].tolist() == [0, 0]  # nothing new: no ticket
    OPS.cache_destroy(state)


def test_offloads_are_reaped_in_launch_order():
    state = _attached()
    first = _request((1,), 9)
    plan = OPS.cache_allocate_tiered(state, *first)[0]
    OPS.cache_commit(state, plan, first[1], first[2])
    a = OPS.cache_offload_launch(state, first[0])[0]
    second = _request((1, 2), 13)
    plan = OPS.cache_allocate_tiered(state, *second)[0]
    OPS.cache_commit(state, plan, second[1], second[2])
    b = OPS.cache_offload_launch(state, torch.tensor([2, 1]))[0]
    epoch = state[1].item()
    with pytest.raises(ValueError, match=f"reap ticket {a[0].item()} before ticket {b[0].item()}"):
        OPS.cache_offload_reap(state, b, True)
    assert state[1].item() == epoch  # nothing changed: both still reap, in order
    OPS.cache_offload_reap(state, a, True)
    OPS.cache_offload_reap(state, b, True)
    OPS.cache_destroy(state)


def test_pages_an_offload_reads_are_not_handed_out_before_its_reap():
    state = OPS.cache_create(6, PAGE, NS)
    OPS.cache_attach_host(state, HOST_SLOTS)
    req = _request((1,), 8)
    plan = OPS.cache_allocate_tiered(state, *req)[0]
    OPS.cache_commit(state, plan, req[1], req[2])
    ticket, src_pages, _ = OPS.cache_offload_launch(state, req[0])
    assert src_pages.tolist() == [0, 1]
    # user 1's history edited at its first event: its old pages are freed by this commit
    users, lengths = torch.tensor([1]), torch.tensor([8])
    edited = history_tokens(1, 8, edit_at=0)
    plan = OPS.cache_allocate_tiered(state, users, lengths, edited)[0]
    OPS.cache_commit(state, plan, lengths, edited)
    other = _request((2,), 8)
    kv_indices = OPS.cache_allocate_tiered(state, *other)[1]
    assert not set(kv_indices.tolist()) & {0, 1}  # still read by the offload: not reused yet
    OPS.cache_offload_reap(state, ticket, True)


def test_export_keeps_a_tiered_step():
    """allocate_tiered, the onboard copy (gather/scatter), the commit and the write-through ops in one
    exported program: every op stays in the graph, the tables and the state are mutated inputs, and the
    program makes the same decisions as eager calls on a twin cache."""

    class Step(torch.nn.Module):
        def forward(self, state, users, lengths, tokens, kv_table, host_table):
            plan, _, _, cached, _, onboard_slots, onboard_pages = OPS.cache_allocate_tiered(
                state, users, lengths, tokens)
            OPS.scatter_pages(kv_table, OPS.gather_pages(host_table, onboard_slots), onboard_pages)
            OPS.cache_commit(state, plan, lengths, tokens)
            ticket, src_pages, dst_slots = OPS.cache_offload_launch(state, users)
            OPS.scatter_pages(host_table, OPS.gather_pages(kv_table, src_pages), dst_slots)
            OPS.cache_offload_reap(state, ticket, True)
            return cached, onboard_pages

    def warm():
        state = OPS.cache_create(DEVICE_PAGES, PAGE, NS)
        OPS.cache_attach_host(state, HOST_SLOTS)
        _, kv_table, host_table = _tables()
        for users, length in (((1,), 9), ((2, 3), 13)):  # user 1 is written through, then evicted
            Step()(state, *_request(users, length), kv_table, host_table)
        return state, kv_table, host_table

    state, kv_table, host_table = warm()
    req = _request((1,), 11)
    ep = torch.export.export(Step(), (state.clone(), *req, kv_table.clone(), host_table.clone()), strict=False)
    targets = " ".join(str(n.target) for n in ep.graph.nodes)
    for op in ("cache_allocate_tiered", "scatter_pages", "cache_commit", "cache_offload_launch", "cache_offload_reap"):
        assert op in targets, targets
    mutated = set(ep.run_decompositions().graph_signature.user_inputs_to_mutate.values())
    assert {"state", "kv_table", "host_table"} <= mutated, mutated
    twin = warm()
    want = Step()(state, *req, kv_table, host_table)
    got = ep.module()(twin[0], *req, twin[1], twin[2])
    assert want[0].tolist() == got[0].tolist() == [8] and want[1].numel() == 2  # onboarded from the host
    assert torch.equal(want[1], got[1]) and torch.equal(kv_table, twin[1]) and torch.equal(host_table, twin[2])
