"""Model-based property test: random request sequences against a dictionary model of the cache.

The model predicts, exactly, what each lookup finds on the device and in the host tier, whether
allocate fits, which users are evicted (LRU order) and what the host tier holds. After every
step: the K/V read back from the pages equal what the model says was written (`run_step` checks
every token of every layer), the host tier's bytes equal the model's, `check()` holds.
"""

from __future__ import annotations

import os
from collections import OrderedDict

import torch
from hypothesis import settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, rule

from gr_plugin.cache import HostTier, KVCacheManager

from .helpers import expected_kv, run_step, tiny_config

P = 4
NUM_PAGES = 12
HOST_SLOTS = 10
USERS = range(5)


def common_prefix(a: torch.Tensor | None, b: torch.Tensor) -> int:
    if a is None:
        return 0
    n = min(a.shape[0], b.shape[0])
    diff = (a[:n] != b[:n]).any(dim=1).nonzero()
    return n if diff.numel() == 0 else int(diff[0])


def pages(n: int) -> int:
    return -(-n // P)


class CacheMachine(RuleBasedStateMachine):
    def __init__(self):
        super().__init__()
        cfg = tiny_config(page_size=P, num_pages=NUM_PAGES, host_cache_bytes=HOST_SLOTS * tiny_config(
            page_size=P).page_bytes)
        self.m = KVCacheManager(cfg, HostTier())
        self.ns = "test"
        self.truth: dict[tuple[str, int], torch.Tensor] = {}  # each user's current true history
        self.dev: OrderedDict[tuple[str, int], torch.Tensor] = OrderedDict()
        self.host: OrderedDict[tuple[str, int], torch.Tensor] = OrderedDict()
        self.counter = 10_000
        self.evicted = 0

    # ---------------------------------------------------------------- history edits
    def _new_rows(self, n: int) -> torch.Tensor:
        base = torch.arange(self.counter, self.counter + n, dtype=torch.int64)
        self.counter += n
        return torch.stack([base, base * 3 % 11], dim=1)

    def _history(self, user: int, action: str, amount: int) -> torch.Tensor:
        key = (self.ns, user)
        h = self.truth.get(key, torch.zeros(0, 2, dtype=torch.int64))
        if action == "grow" or h.shape[0] == 0:
            h = torch.cat([h, self._new_rows(amount)])
        elif action == "edit":
            h = h.clone()
            h[amount % h.shape[0], 1] += 1
        elif action == "shrink":
            h = h[: max(1, h.shape[0] - amount)].clone()
        self.truth[key] = h
        return h

    # ---------------------------------------------------------------- model of one step
    def _predict(self, keys, hists):
        used = sum(pages(h.shape[0]) for h in self.dev.values())
        dev_hits, host_hits, keep, demand = [], [], [], 0
        for key, h in zip(keys, hists):
            L, e = h.shape[0], self.dev.get(key)
            if e is not None and e.shape[0] and L >= e.shape[0] and common_prefix(e, h) >= e.shape[0]:
                d = e.shape[0]
            else:
                d = P * min(common_prefix(e, h) // P, (0 if e is None else e.shape[0]) // P, L // P)
            he = self.host.get(key)
            hp = 0
            if he is not None and L // P > d // P and he.shape[0] // P > d // P:
                hp = min(common_prefix(he, h) // P, he.shape[0] // P, L // P)
            k = d // P if hp * P > d else pages(d)
            dev_hits.append(d)
            host_hits.append(hp)
            keep.append(k)
            demand += pages(L) - k
        free = NUM_PAGES - used
        evictable = sum(pages(h.shape[0]) for k, h in self.dev.items() if k not in keys)
        if demand > NUM_PAGES or free + evictable < demand:
            return dev_hits, host_hits, None
        evicted = []
        for k in list(self.dev):
            if free >= demand:
                break
            if k not in keys:
                free += pages(self.dev.pop(k).shape[0])
                evicted.append(k)
        return dev_hits, host_hits, evicted

    def _write_through(self, keys, hists):
        busy: set = set()
        for key, h in zip(keys, hists):
            full = h.shape[0] // P
            held = self.host.get(key)
            held_n = 0 if held is None else held.shape[0] // P
            have = min(common_prefix(held, h) // P, held_n, full)
            if have >= full:
                continue
            n, stale = full - have, held_n - have
            used = sum(x.shape[0] // P for x in self.host.values())
            evictable = sum(x.shape[0] // P for k, x in self.host.items() if k != key and k not in busy)
            if n > HOST_SLOTS or HOST_SLOTS - used + stale + evictable < n:
                continue
            free = HOST_SLOTS - used + stale
            for k in list(self.host):
                if free >= n:
                    break
                if k != key and k not in busy:
                    free += self.host.pop(k).shape[0] // P
            self.host[key] = h[: full * P].clone()
            self.host.move_to_end(key)
            busy.add(key)

    # ---------------------------------------------------------------- rules
    @rule(users=st.lists(st.sampled_from(USERS), min_size=1, max_size=3, unique=True),
          action=st.sampled_from(["grow", "grow", "same", "edit", "shrink"]),
          amount=st.integers(1, 9), outcome=st.sampled_from(["commit", "commit", "commit", "abort"]))
    def request(self, users, action, amount, outcome):
        keys = [(self.ns, u) for u in users]
        hists = [self._history(u, action, amount) for u in users]
        dev_hits, host_hits, evicted = self._predict(keys, hists)
        before = self.m.counters.evicted_users
        lookup, plan = run_step(self.m, users, hists, outcome=outcome)
        assert lookup.device_tokens == dev_hits
        assert [t // P if t > d else 0 for t, d in zip(lookup.tier_tokens["host"], dev_hits)] == [
            h if h * P > d else 0 for h, d in zip(host_hits, dev_hits)]
        if evicted is None:
            assert plan is None
            return
        assert plan is not None
        assert self.m.counters.evicted_users - before == len(evicted)
        for key, hp, d in zip(keys, host_hits, dev_hits):
            if key not in self.dev:
                self.dev[key] = torch.zeros(0, 2, dtype=torch.int64)
            self.dev.move_to_end(key)
            if hp * P > d:
                self.host.move_to_end(key)
        if outcome == "commit":
            for key, h in zip(keys, hists):
                self.dev[key] = h
                if h.shape[0] == 0:
                    del self.dev[key]
            self._write_through(keys, hists)
        else:
            for key in keys:
                if self.dev[key].shape[0] == 0:
                    del self.dev[key]
        self.m.offload_flush()

    @rule(ns=st.sampled_from(["test", "v2"]))
    def switch_namespace(self, ns):
        self.ns = ns
        self.m.set_namespace(ns)

    @rule(user=st.sampled_from(USERS))
    def evict_user(self, user):
        self.m.evict([user])
        self.dev.pop((self.ns, user), None)

    @rule()
    def evict_everything_on_device(self):
        self.m.evict_all()
        self.dev.clear()

    # ---------------------------------------------------------------- invariants
    @invariant()
    def accounting_and_order(self):
        self.m.check()
        assert self.m.lru_order() == [u for (ns, u) in self.dev if ns == self.ns]
        assert self.m.backend.lru_order() == list(self.host)
        for key in self.dev:
            assert self.m._entries[key].num_tokens == self.dev[key].shape[0]

    @invariant()
    def host_bytes_are_what_was_written(self):
        cfg = self.m.config
        table = self.m.backend.host_table
        for key, h in self.host.items():
            slots = self.m.backend.pages_of(key)
            assert len(slots) == h.shape[0] // P
            for layer in range(cfg.num_layers):
                k, v = expected_kv(h, layer, cfg.num_heads, cfg.head_dim)
                got = table[layer, slots]  # [n, 2, P, H, D]
                assert torch.equal(got[:, 0].reshape(-1, cfg.num_heads, cfg.head_dim), k)
                assert torch.equal(got[:, 1].reshape(-1, cfg.num_heads, cfg.head_dim), v)


TestCacheMachine = CacheMachine.TestCase
# GR_PROP_EXAMPLES=600 for a deeper search (done before landing changes to the core).
TestCacheMachine.settings = settings(
    max_examples=int(os.environ.get("GR_PROP_EXAMPLES", "40")), stateful_step_count=30, deadline=None
)
