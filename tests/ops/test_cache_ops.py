"""The tensor-only cache ops ``gr_kv::cache_*`` (gr_plugin/csrc/core/request_ops.cpp): opcheck, exact page
ids and cached lengths against `KVCacheManager` on a scripted stream, boundary checks that leave the
cache unchanged, and a ``torch.export`` that keeps the stateful ops in the graph."""

import pytest
import torch

from gr_plugin.cache import CacheRequest, KVCacheManager
from gr_plugin.ops import cache_ops

from ..cache.helpers import history_tokens, tiny_config

OPS = torch.ops.gr_kv
PAGE, NUM_PAGES, NS = 4, 12, "test"
OK = cache_ops.STATUS["ok"]
# Opcheck utils that run the op at most once each. test_aot_dispatch_dynamic runs an op twice on one state and
# compares the outputs, which a non-idempotent stateful op cannot pass; the export test covers tracing.
SINGLE_CALL_UTILS = ("test_schema", "test_autograd_registration", "test_faketensor")


def _request(visits: dict[int, int], edits: dict[int, int] | None = None):
    users = sorted(visits)
    rows = [history_tokens(u, visits[u], (edits or {}).get(u)) for u in users]
    return torch.tensor(users), torch.tensor([visits[u] for u in users]), torch.cat(rows)


def _step(state, req, outcome="commit"):
    out = OPS.cache_allocate(state, *req)
    if out[0][0] == OK:
        if outcome == "commit":
            OPS.cache_commit(state, out[0], req[1], req[2])
        else:
            OPS.cache_abort(state, out[0])
    return out


def _visited():
    """A cache after a first visit of users 1 and 2, and a second-visit request (hits)."""
    state = OPS.cache_create(NUM_PAGES, PAGE, NS)
    _step(state, _request({1: 6, 2: 9}))
    return state, _request({1: 10, 2: 9})


def test_opcheck_lookup_and_create():
    state, req = _visited()
    assert OPS.cache_lookup(state, *req).tolist() == [6, 9]  # hits, including a partial last page
    torch.library.opcheck(OPS.cache_lookup.default, (state, *req), test_utils="ALL")
    torch.library.opcheck(OPS.cache_create.default, (NUM_PAGES, PAGE, NS), test_utils=SINGLE_CALL_UTILS)


@pytest.mark.parametrize("util", SINGLE_CALL_UTILS)
def test_opcheck_mutating_ops(util):
    # NOTE: a fresh cache per util: each call changes it (a second allocate of the same users would
    # find them in flight), so every util sees the same second visit.
    state, req = _visited()
    torch.library.opcheck(OPS.cache_allocate.default, (state, *req), test_utils=util)
    state, req = _visited()
    plan = OPS.cache_allocate(state, *req)[0]
    torch.library.opcheck(OPS.cache_commit.default, (state, plan, req[1], req[2]), test_utils=util)
    plan = OPS.cache_allocate(state, *_request({3: 5}))[0]
    torch.library.opcheck(OPS.cache_abort.default, (state, plan), test_utils=util)
    torch.library.opcheck(OPS.cache_destroy.default, (state,), test_utils=util)


def _manager():
    return KVCacheManager(tiny_config(page_size=PAGE, num_pages=NUM_PAGES, namespace=NS))


STREAM = [  # (visits, edits, outcome)
    ({1: 6, 2: 9}, None, "commit"),
    ({1: 10, 3: 4}, None, "commit"),  # user 1 extends its partial page; user 3 is new
    ({2: 9, 4: 7}, {2: 5}, "abort"),  # user 2's history edited at row 5: whole pages only
    ({2: 12, 4: 7}, None, "commit"),
    ({5: 16, 6: 8}, None, "commit"),  # needs eviction (12 pages)
    ({1: 10, 5: 17}, None, "commit"),
    ({7: 60}, None, "commit"),  # more pages than the cache has: too big
]


def test_pages_and_cached_lengths_equal_the_managers():
    manager, state = _manager(), OPS.cache_create(NUM_PAGES, PAGE, NS)
    for visits, edits, outcome in STREAM:
        users, lengths, tokens = req = _request(visits, edits)
        request = CacheRequest(users, lengths, tokens)
        lookup = manager.lookup(request)
        assert OPS.cache_lookup(state, *req).tolist() == lookup.device_tokens
        plan = manager.allocate(lookup)
        out = _step(state, req, outcome)
        if plan is None:
            assert out[0][0].item() == cache_ops.STATUS["too_big"]
            continue
        meta = plan.metadata
        assert out[0][0].item() == OK and out[0][1].item() == plan.plan_id
        assert out[1].tolist() == meta.kv_indices.tolist()
        assert out[2].tolist() == meta.kv_indptr.tolist()
        assert out[3].tolist() == plan.cached_lengths
        assert out[4].tolist() == meta.new_token_slots.tolist()
        manager.commit(plan) if outcome == "commit" else manager.abort(plan)
    manager.check()
    OPS.cache_destroy(state)


def _bad_inputs(state, req):
    users, lengths, tokens = req
    return [
        ("state names no live cache", (torch.tensor([999, 0]), users, lengths, tokens)),
        ("state must have shape", (state[:1], users, lengths, tokens)),
        ("user_ids must be int64", (state, users.int(), lengths, tokens)),
        ("empty batch", (state, users[:0], lengths[:0], tokens[:0])),
        ("history_lengths has 1 entries", (state, users, lengths[:1], tokens)),
        ("negative history length -1", (state, users, torch.tensor([-1, 9]), tokens)),
        ("tokens has 19 rows but history_lengths sum to 18", (state, users, lengths - torch.tensor([1, 0]), tokens)),
        ("tokens must be int64", (state, users, lengths, tokens.float())),
        ("tokens must be", (state, users, lengths, tokens.view(-1, 1, 2))),
        ("appears more than once", (state, torch.tensor([1, 1]), lengths, tokens)),
    ]


def test_bad_inputs_raise_and_leave_the_cache_unchanged():
    state, req = _visited()
    before, epoch = OPS.cache_lookup(state, *req), state[1].item()
    for message, args in _bad_inputs(state, req):
        for op in (OPS.cache_lookup, OPS.cache_allocate):
            with pytest.raises(ValueError, match=message):
                op(*args)
    plan = OPS.cache_allocate(state, *req)[0]
    with pytest.raises(ValueError, match="tokens has 18 rows but history_lengths sum to 19"):
        OPS.cache_commit(state, plan, req[1], req[2][:-1])
    with pytest.raises(ValueError, match="history_lengths has 1 entries"):
        OPS.cache_commit(state, plan, req[1][:1], req[2])
    with pytest.raises(ValueError, match="plan must have shape"):
        OPS.cache_abort(state, plan[:2])
    with pytest.raises(ValueError, match="in flight; commit or abort"):
        OPS.cache_destroy(state)
    OPS.cache_abort(state, plan)
    with pytest.raises(ValueError, match="is not in flight"):
        OPS.cache_abort(state, plan)
    refused = OPS.cache_allocate(state, *_request({9: 60}))[0]
    with pytest.raises(ValueError, match="allocate refused it"):
        OPS.cache_commit(state, refused, torch.tensor([60]), history_tokens(9, 60))
    assert torch.equal(OPS.cache_lookup(state, *req), before)
    assert state[1].item() == epoch + 2  # the allocate and the abort
    OPS.cache_destroy(state)
    with pytest.raises(ValueError, match="no live cache"):
        OPS.cache_lookup(torch.tensor([state[0].item(), 0]), *req)


def test_export_keeps_the_stateful_ops():
    class Step(torch.nn.Module):
        def forward(self, state, users, lengths, tokens):
            hits = OPS.cache_lookup(state, users, lengths, tokens)
            plan, kv_indices, kv_indptr, cached, slots = OPS.cache_allocate(state, users, lengths, tokens)
            OPS.cache_abort(state, plan)
            return hits, kv_indices, kv_indptr, cached, slots

    state, req = _visited()
    ep = torch.export.export(Step(), (state.clone(), *req), strict=False)
    targets = [str(n.target) for n in ep.graph.nodes]
    for op in ("cache_lookup", "cache_allocate", "cache_abort"):
        assert any(op in t for t in targets), targets
    functional = ep.run_decompositions()
    assert "state" in functional.graph_signature.user_inputs_to_mutate.values()
    twin, _ = _visited()  # NOTE: the abort changed the free pages: compare on a twin cache
    want, got = Step()(state, *req), ep.module()(twin, *req)
    assert got[1].numel() > 0 and got[0].tolist() == [6, 9]
    for a, b in zip(got, want):
        assert torch.equal(a, b)
    OPS.cache_destroy(state)
    OPS.cache_destroy(twin)
