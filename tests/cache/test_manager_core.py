"""The manager over the C++ core: digests it stores equal python-xxhash's, and the whole manager
behaves the same when the core cannot hash (built without libxxhash) and Python passes digests."""

from __future__ import annotations

import inspect

import pytest
import torch
from hypothesis import settings

from gr_plugin.cache import CacheRequest, KVCacheManager
from gr_plugin.cache.hashing import namespace_seed, page_digests, prefix_hash

from . import test_manager, test_properties
from .helpers import history_tokens, run_step, tiny_config


@pytest.fixture
def caller_digests(monkeypatch):
    """Every manager made in the test passes Python-computed digests to the core."""
    init = KVCacheManager.__init__

    def patched(self, *args, **kwargs):
        init(self, *args, **kwargs)
        self._caller_digests = True

    monkeypatch.setattr(KVCacheManager, "__init__", patched)


def test_core_page_hashes_are_python_xxhash_prefix_hashes():
    m = KVCacheManager(tiny_config())
    h = history_tokens(3, 10)
    run_step(m, [3], [h])
    run_step(m, [3], [history_tokens(3, 19)])  # extends with the entry's stream hasher
    seed = namespace_seed("test")
    entry = m._entries[("test", 3)]
    assert entry.page_hashes == page_digests(history_tokens(3, 19), 0, 19, 4, seed)
    assert entry.page_hashes[-1] == prefix_hash(history_tokens(3, 19), 0, 16, seed)
    assert entry.num_tokens == 19 and entry.pages == m.pages_of(3)
    m.check()


_PLAIN_TESTS = [f for name, f in vars(test_manager).items()
                if name.startswith("test_") and not inspect.signature(f).parameters]


@pytest.mark.parametrize("test", _PLAIN_TESTS, ids=lambda f: f.__name__)
def test_manager_behaviour_with_caller_digests(caller_digests, test):
    test()


def test_caller_digests_and_cpp_hashing_give_the_same_plans(caller_digests):
    a = KVCacheManager(tiny_config())
    b = KVCacheManager(tiny_config())
    b._caller_digests = False
    if not torch.ops.gr_kv_core.hashing_available():
        pytest.skip("core built without libxxhash")
    for hist in (history_tokens(1, 9), history_tokens(1, 14), history_tokens(1, 14, edit_at=5),
                 history_tokens(1, 6)):
        plans = [run_step(m, [1], [hist])[1] for m in (a, b)]
        assert plans[0].cached_lengths == plans[1].cached_lengths
        assert torch.equal(plans[0].metadata.buffer, plans[1].metadata.buffer)
        assert a._entries[("test", 1)] == b._entries[("test", 1)]
    req = CacheRequest([1], [6], history_tokens(1, 6))
    assert a.lookup(req).device_tokens == b.lookup(req).device_tokens == [6]


class CallerDigestMachine(test_properties.CacheMachine):
    def __init__(self):
        super().__init__()
        self.m._caller_digests = True


TestCallerDigestMachine = CallerDigestMachine.TestCase
TestCallerDigestMachine.settings = settings(max_examples=10, stateful_step_count=20, deadline=None)
