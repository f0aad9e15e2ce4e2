"""The C++ cache core (torch.classes.gr_kv_core) against the Python semantics it replaced.

`RefCore` is the policy as the Python manager implemented it before the core moved to C++ (a pool
with readers and zombies, its free pages now runs as in `ExtentAllocator`; OrderedDict LRU,
prefix-hash matching with python-xxhash, eviction in `_make_room` order). Random sequences of
lookup / allocate / commit / abort / evict / offload pins / namespace switches run on both; page
ids, eviction order, plans and metadata must agree exactly, and `check()` must hold after every
step. Bad input raises ValueError naming the value and changes nothing. C++ digests equal
python-xxhash digests.
"""

from __future__ import annotations

import os
import random
from collections import Counter, OrderedDict

import pytest
import torch
import xxhash

from gr_plugin.cache import metadata
from gr_plugin.cache.hashing import (
    StreamHasher,
    as_int64,
    from_pairs,
    longest_matching_prefix,
    namespace_seed,
    page_digests,
    prefix_hash,
    to_pairs,
)
from gr_plugin.cache.page_pool import PagePool
from gr_plugin.csrc.core.build import load

load()
OPS = torch.ops.gr_kv_core
OK, IN_FLIGHT, CHANGED, NO_FIT, TOO_BIG = range(5)


def new_core(num_pages: int, page_size: int, namespace: str = "test"):
    core = torch.classes.gr_kv_core.CacheCore(num_pages, page_size)
    core.set_namespace(namespace, as_int64(namespace_seed(namespace)))
    return core


# --------------------------------------------------------------------------------- hashing
@pytest.mark.skipif(not OPS.hashing_available(), reason="core built without libxxhash")
@pytest.mark.parametrize("features", [1, 2, 3])
def test_cpp_digests_equal_python_xxhash(features):
    rng = random.Random(features)
    for n in (0, 1, 3, 15, 16, 17, 31, 64, 129, 600):
        rows = torch.tensor([[rng.randrange(-(2**63), 2**63) for _ in range(features)] for _ in range(n)],
                            dtype=torch.int64).view(n, features)
        if features == 1:
            rows = rows.view(n)
        for seed in (0, 7, 2**63 + 5, namespace_seed("model-v3")):
            got = from_pairs(OPS.hash_rows(rows, 0, n, as_int64(seed)))[0]
            assert got == prefix_hash(rows, 0, n, seed)
            if n > 2:
                got = from_pairs(OPS.hash_rows(rows, 1, n - 2, as_int64(seed)))[0]
                assert got == xxhash.xxh3_128_intdigest(rows[1 : n - 1].numpy().tobytes(), seed=seed)
    for name in ("default", "test", "a-much-longer-namespace/with/version:17", "ü"):
        assert OPS.namespace_seed(name) & (2**64 - 1) == namespace_seed(name)


@pytest.mark.skipif(not OPS.hashing_available(), reason="core built without libxxhash")
def test_committed_page_hashes_equal_python_streaming_hashes():
    P = 4
    core = new_core(16, P)
    seed = namespace_seed("test")
    tokens = torch.arange(2 * 23, dtype=torch.int64).view(23, 2) * 7919
    for length in (9, 23):  # the second commit extends the first with the entry's stream hasher
        dev, ver = core.lookup([5], [0, length], tokens[:length].contiguous(), None, None, None)
        status, plan_id, _, _ = core.allocate([5], [length], dev, ver, [0])
        assert status == OK
        core.commit(plan_id, [0, length], tokens[:length].contiguous(), None, None, None)
        info, _pages, hashes = core.entry(0, 5)
        assert info[0] == length
        assert from_pairs(hashes) == page_digests(tokens, 0, length, P, seed)
        assert from_pairs(hashes) == [prefix_hash(tokens, 0, (i + 1) * P, seed) for i in range(length // P)]
    assert core.check() == ""


def test_digest_pairs_round_trip():
    ds = [0, 1, 2**64 - 1, 2**64, 2**128 - 1, (2**127) | 12345]
    assert from_pairs(to_pairs(ds)) == ds


def test_metadata_field_order_is_shared():
    assert OPS.metadata_fields() == [name for name, _ in metadata._FIELDS]


# --------------------------------------------------------------------------------- page pool
def test_pool_runs_readers_and_zombies():
    pool = PagePool(6)
    assert pool.allocate(3) == [0, 1, 2]
    assert pool.allocate(4) is None and pool.num_free == 3  # nothing taken
    pool.add_readers([1, 1, 2])
    pool.free([2, 0, 1])
    assert pool._free == [0, 3, 4, 5] and pool.num_zombies == 2
    pool.check([])
    pool.remove_readers([1])  # one reader left on page 1
    assert pool.num_zombies == 2 and pool.is_read(1)
    assert pool.allocate(2) == [3, 4]  # the first run that fits whole, not page 0 and page 3
    pool.remove_readers([2, 1])
    assert pool._free == [0, 1, 2, 5] and pool.num_zombies == 0
    assert pool.allocate(4) == [0, 1, 2, 5]  # no run fits: pieces of the lowest runs
    pool.check([0, 1, 2, 3, 4, 5])
    pool.free([4, 3, 1])  # freed pages merge with free neighbours: 1 alone, 3..4 one run
    assert pool.allocate(2) == [3, 4] and pool._free == [1]


@pytest.mark.parametrize("seed", range(4))
def test_pool_runs_match_the_reference_past_the_scan_limit(seed):
    """Hundreds of free runs (more than the 64 an allocation scans for one that fits whole), then
    random allocations and frees: the C++ pool hands out exactly `RefRuns`' pages."""
    rng = random.Random(seed)
    pool, ref = PagePool(600), RefRuns(600)
    singles = pool.allocate(600)
    assert singles == ref.take(600) == list(range(600))
    for pages in (singles[1::2], singles[::4]):  # 300 runs of one page, then some of three
        pool.free(pages)
        ref.release(pages)
    held = [[p] for p in singles[2::4]]
    assert len(ref.runs) > 64 and pool._free == list(ref)
    for _ in range(400):
        if held and rng.random() < 0.45:
            pages = held.pop(rng.randrange(len(held)))
            rng.shuffle(pages)
            pool.free(pages)
            ref.release(pages)
        else:
            n = rng.randint(1, 9)
            got = pool.allocate(n)
            assert got == (ref.take(n) if n <= len(ref) else None)
            if got:
                held.append(got)
        assert pool._free == list(ref) and pool.num_free == len(ref)
    pool.check([p for h in held for p in h])


def test_pool_bad_input_raises_and_changes_nothing():
    pool = PagePool(4)
    pool.allocate(2)
    pool.add_readers([0])
    state = (pool._free, pool.num_zombies, pool.is_read(0))
    with pytest.raises(ValueError, match="page 3 is already free"):
        pool.free([1, 3])
    with pytest.raises(ValueError, match="page 1 is already free"):
        pool.free([1, 1])
    with pytest.raises(ValueError, match=r"page 9 out of range \[0, 4\)"):
        pool.free([9])
    with pytest.raises(ValueError, match="page 1 has no reader"):
        pool.remove_readers([0, 1])
    with pytest.raises(ValueError, match="page 2 is not in use"):
        pool.add_readers([2])
    with pytest.raises(ValueError, match="negative page count -1"):
        pool.allocate(-1)
    assert (pool._free, pool.num_zombies, pool.is_read(0)) == state
    pool.check([0, 1])
    with pytest.raises(AssertionError, match="1 pages leaked"):
        pool.check([0])
    with pytest.raises(AssertionError, match="owned twice"):
        pool.check([0, 1, 1])


# --------------------------------------------------------------------------------- reference
class RefRuns:
    """Free pages as sorted ``[start, length]`` runs (kv_core.h's ``ExtentAllocator``): `take`
    returns one run when one of the first 64 fits, else pieces of the lowest runs; `release`
    merges freed pages with their free neighbours."""

    def __init__(self, num_pages: int) -> None:
        self.runs = [[0, num_pages]] if num_pages else []

    def __len__(self) -> int:
        return sum(n for _, n in self.runs)

    def __iter__(self):
        return (p for s, n in self.runs for p in range(s, s + n))

    def take(self, n: int) -> list[int]:
        for i, (s, length) in enumerate(self.runs[:64]):
            if length >= n:
                self.runs[i : i + 1] = [[s + n, length - n]] if length > n else []
                return list(range(s, s + n))
        out: list[int] = []
        while len(out) < n:
            s, length = self.runs[0]
            k = min(length, n - len(out))
            out += range(s, s + k)
            self.runs[0:1] = [[s + k, length - k]] if length > k else []
        return out

    def release(self, pages: list[int]) -> None:
        free = sorted([*self, *pages])
        assert len(set(free)) == len(free), "a page freed twice"
        self.runs = []
        for p in free:
            if self.runs and p == self.runs[-1][0] + self.runs[-1][1]:
                self.runs[-1][1] += 1
            else:
                self.runs.append([p, 1])


class RefCore:
    """The pre-C++ Python policy (manager.py / page_pool.py at e112ebf), minus tiers and copies;
    free pages are runs (`RefRuns`), as the C++ pool's are since the FIFO queue was replaced."""

    def __init__(self, num_pages: int, page_size: int, namespace: str = "test") -> None:
        self.num_pages, self.P = num_pages, page_size
        self.free = RefRuns(num_pages)
        self.readers: Counter[int] = Counter()
        self.zombies: set[int] = set()
        self.entries: OrderedDict = OrderedDict()
        self.plans: dict[int, dict] = {}
        self.clock = 0
        self.next_plan = 0
        self.set_namespace(namespace)

    def set_namespace(self, ns):
        self.ns, self.seed = ns, namespace_seed(ns)

    def tick(self):
        self.clock += 1
        return self.clock

    def pool_free(self, pages):
        now = []
        for p in pages:
            if self.readers[p]:
                self.zombies.add(p)
            else:
                now.append(p)
        self.free.release(now)

    def remove_readers(self, pages):
        now = []
        for p in pages:
            self.readers[p] -= 1
            if not self.readers[p]:
                del self.readers[p]
                if p in self.zombies:
                    self.zombies.discard(p)
                    now.append(p)
        self.free.release(now)

    def lookup(self, users, offsets, tokens):
        dev, ver = [], []
        for b, u in enumerate(users):
            e = self.entries.get((self.ns, u))
            start, length = offsets[b], offsets[b + 1] - offsets[b]
            d = 0
            if e is not None and e["n"]:
                n = e["n"]
                if length >= n and prefix_hash(tokens, start, n, self.seed) == e["digest"]:
                    d = n
                else:
                    d = longest_matching_prefix(e["hashes"], tokens, start, length, self.P, self.seed) * self.P
            dev.append(d)
            ver.append(-1 if e is None else e["version"])
        return dev, ver

    def evictable(self, exclude):
        return sum(len(e["pages"]) for k, e in self.entries.items()
                   if not e["in_plan"] and not e["offloads"] and k not in exclude)

    def make_room(self, demand, exclude):
        evicted = []
        if len(self.free) >= demand:
            return True, evicted
        if len(self.free) + self.evictable(exclude) < demand:
            return False, evicted
        for k in list(self.entries):
            if len(self.free) >= demand:
                break
            e = self.entries[k]
            if not e["in_plan"] and not e["offloads"] and k not in exclude:
                self.pool_free(e["pages"])
                del self.entries[k]
                evicted.append(k)
        return True, evicted

    def allocate(self, users, lengths, dev, ver, hp):
        P, keys = self.P, [(self.ns, u) for u in users]
        for b, k in enumerate(keys):
            e = self.entries.get(k)
            if e is not None and e["in_plan"]:
                return IN_FLIGHT, b, None
        if any((-1 if self.entries.get(k) is None else self.entries[k]["version"]) != v for k, v in zip(keys, ver)):
            return CHANGED, -1, None
        keep, cached, dvs, fresh = [], [], [], []
        for b in range(len(users)):
            d = dev[b]
            if hp[b] * P > d:
                k, c, dv = d // P, hp[b] * P, (d // P) * P
            else:
                k, c, dv = -(-d // P), d, d
            keep.append(k)
            cached.append(c)
            dvs.append(dv)
            fresh.append(-(-lengths[b] // P) - k)
        demand = sum(fresh)
        if demand > self.num_pages:
            return TOO_BIG, -1, None
        ok, evicted = self.make_room(demand, set(keys))
        if not ok:
            return NO_FIT, -1, None
        fresh_all = self.free.take(demand)
        lists, fresh_lists, pos = [], [], 0
        for b, k in enumerate(keys):
            e = self.entries.get(k)
            if e is None:
                e = self.entries[k] = dict(pages=[], n=0, hashes=[], digest=0, in_plan=False, offloads=0,
                                           version=self.tick())
            else:
                self.entries.move_to_end(k)
            e["in_plan"] = True
            mine = fresh_all[pos : pos + fresh[b]]
            pos += fresh[b]
            lists.append(e["pages"][: keep[b]] + mine)
            fresh_lists.append(mine)
        pid = self.next_plan
        self.next_plan += 1
        self.plans[pid] = dict(keys=keys, lists=lists, fresh=fresh_lists, keep=keep, dev=dvs, totals=list(lengths))
        return OK, pid, dict(lists=lists, cached=cached, evicted=evicted, keep=keep, device_tokens=dvs)

    def commit(self, pid, offsets, tokens):
        plan = self.plans.pop(pid)
        P = self.P
        # NOTE: the one deliberate change: hash with the seed of the plan's namespace (the Python
        # manager used the namespace current at commit, so a switch mid-step stored hashes that
        # could never match again).
        seed = namespace_seed(plan["keys"][0][0])
        for b, k in enumerate(plan["keys"]):
            e = self.entries[k]
            start, total = offsets[b], plan["totals"][b]
            self.pool_free(e["pages"][plan["keep"][b] :])
            valid = min(len(e["hashes"]), plan["dev"][b] // P)
            h = StreamHasher(seed)
            h.update(tokens, start, start + valid * P)
            hashes = e["hashes"][:valid]
            for i in range(valid, total // P):
                h.update(tokens, start + i * P, start + (i + 1) * P)
                hashes.append(h.digest())
            e.update(pages=plan["lists"][b], hashes=hashes, n=total, in_plan=False, version=self.tick(),
                     digest=prefix_hash(tokens, start, total, seed))
            if total == 0 and e["offloads"] == 0:
                del self.entries[k]

    def abort(self, pid):
        plan = self.plans.pop(pid)
        for b, k in enumerate(plan["keys"]):
            e = self.entries[k]
            self.pool_free(plan["fresh"][b])
            e["in_plan"] = False
            if e["n"] == 0 and not e["pages"] and e["offloads"] == 0:
                del self.entries[k]


def snapshot(core, namespaces):
    """Everything observable about a core: free pages, zombies, LRU per namespace, entries."""
    pool = core.pool()
    out = [pool.free_pages(), pool.num_zombies(), core.plan_ids(), core.num_entries()]
    for ns_id in namespaces:
        users = core.lru_order(ns_id)
        out.append(users)
        for u in users:
            info, pages, hashes = core.entry(ns_id, u)
            out.append((info, pages.tolist(), hashes.tolist()))
    return out


# --------------------------------------------------------------------------------- randomized model test
def _history(rng, old: torch.Tensor | None) -> torch.Tensor:
    if old is None or old.shape[0] == 0 or rng.random() < 0.1:
        return torch.tensor([[rng.randrange(1000), rng.randrange(3)] for _ in range(rng.randrange(0, 14))],
                            dtype=torch.int64).view(-1, 2)
    action = rng.choice(["grow", "grow", "same", "edit", "shrink"])
    h = old.clone()
    if action == "grow":
        h = torch.cat([h, torch.randint(0, 1000, (rng.randrange(1, 9), 2), dtype=torch.int64,
                                        generator=torch.Generator().manual_seed(rng.randrange(2**31)))])
    elif action == "edit":
        h[rng.randrange(h.shape[0]), 1] += 1
    elif action == "shrink":
        h = h[: rng.randrange(h.shape[0])].clone()
    return h


def _run_random(seed: int, steps: int, caller_digests: bool) -> None:
    rng = random.Random(seed)
    P, N = rng.choice([2, 3, 4]), rng.choice([6, 10, 16])
    core, ref = new_core(N, P), RefCore(N, P)
    ns_ids = {"test": 0}
    truth: dict[tuple[str, int], torch.Tensor] = {}
    pending: list[tuple[int, list[int], torch.Tensor, list[int]]] = []  # in-flight plans
    pins: list[tuple[str, int, list[int]]] = []  # (ns, user, pages being read) of fake offloads
    for _ in range(steps):
        op = rng.choices(["step", "finish", "evict", "pin", "unpin", "namespace"], [6, 3, 1, 1, 1, 1])[0]
        ns = ref.ns
        if op == "step":
            busy = {u for _, us, _, _ in pending for u in us} if rng.random() < 0.8 else set()
            free_users = [u for u in range(6) if u not in busy] or [0]
            users = rng.sample(free_users, k=min(len(free_users), 1 + rng.randrange(2)))
            hists = [_history(rng, truth.get((ns, u))) for u in users]
            for u, h in zip(users, hists):
                truth[(ns, u)] = h
            lengths = [h.shape[0] for h in hists]
            offsets = [0]
            for n in lengths:
                offsets.append(offsets[-1] + n)
            tokens = torch.cat(hists).contiguous()
            digests = _caller_digests(core, ns_ids[ns], users, offsets, tokens, P, ref.seed, "lookup") \
                if caller_digests else (None, None, None)
            dev, ver = core.lookup(users, offsets, tokens, *digests)
            assert (dev, ver) == ref.lookup(users, offsets, tokens)
            host = [rng.randrange(0, n // P + 1) if rng.random() < 0.3 else 0 for n in lengths]
            status, value, buf, info = core.allocate(users, lengths, dev, ver, host)
            rstatus, rvalue, rinfo = ref.allocate(users, lengths, dev, ver, host)
            assert (status, value if status == IN_FLIGHT else 0) == (rstatus, rvalue if rstatus == IN_FLIGHT else 0)
            if status == OK:
                B = len(users)
                assert info[1] == len(rinfo["evicted"])
                assert info[8 : 8 + B] == rinfo["keep"]
                assert info[8 + 2 * B : 8 + 3 * B] == rinfo["cached"]
                want = metadata.build_metadata(rinfo["lists"], rinfo["cached"], lengths, P, torch.device("cpu"))
                assert buf.tolist() == want.buffer.tolist()
                pending.append((value, users, tokens, offsets))
        elif op == "finish" and pending:
            pid, users, tokens, offsets = pending.pop(rng.randrange(len(pending)))
            if rng.random() < 0.75:
                digests = _caller_digests(core, None, users, offsets, tokens, P, _seed_of(ref, pid), "commit") \
                    if caller_digests else (None, None, None)
                core.commit(pid, offsets, tokens, *digests)
                ref.commit(pid, offsets, tokens)
            else:
                core.abort(pid)
                ref.abort(pid)
        elif op == "evict":
            users = rng.sample(range(6), k=2)
            in_plan = any(ref.entries.get((ns, u), {}).get("in_plan") for u in users)
            if in_plan:
                before = snapshot(core, ns_ids.values())
                with pytest.raises(ValueError, match="in an in-flight step"):
                    core.evict(ns_ids[ns], users)
                assert snapshot(core, ns_ids.values()) == before
            else:
                # the manager drains in-flight copies of these users first (evict_blockers)
                assert core.evict_blockers(ns_ids[ns], users) == any((kns, u) in ((ns, v) for v in users)
                                                                     for kns, u, _ in pins)
                for pin in [p for p in pins if p[0] == ns and p[1] in users]:
                    pins.remove(pin)
                    _unpin(core, ref, ns_ids, *pin)
                got = core.evict(ns_ids[ns], users)
                dropped = [u for u in users if (ns, u) in ref.entries]
                for u in dropped:
                    ref.pool_free(ref.entries.pop((ns, u))["pages"])
                assert got[0] == len(dropped)
        elif op == "pin":
            owned = [(k, e) for k, e in ref.entries.items() if e["pages"] and k[0] == ns]
            if owned:
                (kns, u), e = rng.choice(owned)
                pages = e["pages"][: 1 + rng.randrange(len(e["pages"]))]
                core.add_offload(ns_ids[kns], u)
                core.pool().add_readers(pages)
                e["offloads"] += 1
                ref.readers.update(pages)
                pins.append((kns, u, pages))
        elif op == "unpin" and pins:
            _unpin(core, ref, ns_ids, *pins.pop(rng.randrange(len(pins))))
        elif op == "namespace":
            name = rng.choice(["test", "v2"])
            ns_ids[name] = core.set_namespace(name, as_int64(namespace_seed(name)))
            ref.set_namespace(name)
        # after every step: accounting holds, and the core is the reference, page for page
        assert core.check() == ""
        assert core.pool().free_pages() == list(ref.free)
        assert core.pool().num_zombies() == len(ref.zombies)
        for name, ns_id in ns_ids.items():
            assert core.lru_order(ns_id) == [u for (n, u) in ref.entries if n == name]
        for (name, u), e in ref.entries.items():
            info, pages, hashes = core.entry(ns_ids[name], u)
            assert info == [e["n"], int(e["in_plan"]), e["offloads"], info[3]]
            assert pages.tolist() == e["pages"]
            assert from_pairs(hashes) == e["hashes"]


def _unpin(core, ref, ns_ids, ns, user, pages):
    core.pool().remove_readers(pages)
    core.offload_done(ns_ids[ns], user)
    ref.remove_readers(pages)
    if (ns, user) in ref.entries:
        ref.entries[(ns, user)]["offloads"] -= 1


def _seed_of(ref: RefCore, pid: int) -> int:
    return namespace_seed(ref.plans[pid]["keys"][0][0])


def _caller_digests(core, ns_id, users, offsets, tokens, P, seed, purpose):
    pages, tails, tail_tokens = [], [], []
    cached = core.cached_tokens(ns_id, users) if purpose == "lookup" else None
    for b in range(len(users)):
        start, length = offsets[b], offsets[b + 1] - offsets[b]
        pages.extend(page_digests(tokens, start, length, P, seed))
        n = length if purpose == "commit" else cached[b]
        n = n if 0 <= n <= length else -1
        tails.append(prefix_hash(tokens, start, n, seed) if n >= 0 else 0)
        tail_tokens.append(n)
    return to_pairs(pages), to_pairs(tails), tail_tokens


STEPS = int(os.environ.get("GR_PROP_EXAMPLES", "40"))


@pytest.mark.skipif(not OPS.hashing_available(), reason="core built without libxxhash")
@pytest.mark.parametrize("seed", range(12))
def test_random_sequences_match_the_python_policy(seed):
    _run_random(seed, steps=STEPS * 2, caller_digests=False)


@pytest.mark.parametrize("seed", range(4))
def test_random_sequences_with_caller_digests(seed):
    _run_random(100 + seed, steps=STEPS * 2, caller_digests=True)


# --------------------------------------------------------------------------------- exact behaviour
def _step(core, users, hists, outcome="commit", host=None):
    lengths = [h.shape[0] for h in hists]
    offsets = [0]
    for n in lengths:
        offsets.append(offsets[-1] + n)
    tokens = torch.cat(hists).contiguous()
    dev, ver = core.lookup(users, offsets, tokens, None, None, None)
    status, value, _buf, info = core.allocate(users, lengths, dev, ver, host or [0] * len(users))
    if status == OK and outcome == "commit":
        core.commit(value, offsets, tokens, None, None, None)
    elif status == OK and outcome == "abort":
        core.abort(value)
    return status, value, dev, info


def _hist(user, n):
    return (torch.arange(n, dtype=torch.int64) * 7 + user * 1000).view(n, 1)


@pytest.mark.skipif(not OPS.hashing_available(), reason="core built without libxxhash")
def test_exact_page_ids_and_lru_eviction_order():
    core = new_core(8, 4)
    for u in (1, 2, 3):
        _step(core, [u], [_hist(u, 8)])
    assert [core.entry(0, u)[1].tolist() for u in (1, 2, 3)] == [[0, 1], [2, 3], [4, 5]]
    _step(core, [1], [_hist(1, 8)])
    assert core.lru_order(0) == [2, 3, 1]
    status, _, _, info = _step(core, [4], [_hist(4, 16)])  # 2 free: evicts user 2 only
    assert status == OK and info[1:3] == [1, 2] and core.lru_order(0) == [3, 1, 4]
    assert core.entry(0, 4)[1].tolist() == [2, 3, 6, 7]  # no free run of 4: the lowest runs
    # user 3 (LRU) grows by 4 pages: evicting 3 itself is not allowed -> 1 then 4 go
    status, _, dev, info = _step(core, [3], [_hist(3, 24)])
    assert dev == [8] and info[1:3] == [2, 6] and core.lru_order(0) == [3]
    assert core.check() == ""


@pytest.mark.skipif(not OPS.hashing_available(), reason="core built without libxxhash")
def test_pinned_users_are_skipped_and_no_fit_changes_nothing():
    core = new_core(6, 4)
    _step(core, [1], [_hist(1, 8)])
    status, held, _, _ = _step(core, [2], [_hist(2, 8)], outcome="none")
    core.add_offload(0, 1)  # user 1's pages are being read: not evictable either
    before = snapshot(core, [0])
    assert _step(core, [3], [_hist(3, 12)])[0] == NO_FIT
    assert _step(core, [3], [_hist(3, 28)])[0] == TOO_BIG
    assert _step(core, [2], [_hist(2, 4)])[0:2] == (IN_FLIGHT, 0)
    assert snapshot(core, [0]) == before
    core.offload_done(0, 1)
    status, _, _, info = _step(core, [3], [_hist(3, 12)])
    assert status == OK and info[1] == 1 and core.lru_order(0) == [2, 3]
    core.commit(held, [0, 8], _hist(2, 8), None, None, None)
    assert core.check() == ""


@pytest.mark.skipif(not OPS.hashing_available(), reason="core built without libxxhash")
def test_bad_input_to_core_entry_points_raises_and_changes_nothing():
    core = new_core(8, 4)
    _step(core, [1], [_hist(1, 6)])
    _, pid, _, _ = _step(core, [2], [_hist(2, 5)], outcome="none")
    before = snapshot(core, [0])
    t = _hist(1, 6)
    cases = [
        (lambda: core.lookup([1], [0, 5], t, None, None, None), "tokens has 6 rows but history_offsets end at 5"),
        (lambda: core.lookup([1], [0, 6], t.int(), None, None, None), "tokens must be int64"),
        (lambda: core.lookup([1, 2], [0, 4, 2], t, None, None, None), "decrease at index 2: 4 -> 2"),
        (lambda: core.lookup([1], [0, 6], torch.zeros(2, 6, dtype=torch.int64).t(), None, None, None), "contiguous"),
        (lambda: core.allocate([], [], [], [], []), "empty batch"),
        (lambda: core.allocate([3, 3], [4, 4], [0, 0], [-1, -1], [0, 0]), "user 3 appears more than once"),
        (lambda: core.allocate([3], [4, 4], [0], [-1], [0]), "2 entries for 1 users"),
        (lambda: core.allocate([3], [-4], [0], [-1], [0]), "negative history length -4 for user 3"),
        (lambda: core.allocate([1], [8], [5], [core.entry(0, 1)[0][3]], [0]), "device tokens 5 are not a reusable"),
        (lambda: core.allocate([3], [4], [0], [-1], [2]), "host pages 2 do not fit"),
        (lambda: core.commit(pid + 7, [0, 5], _hist(2, 5), None, None, None), f"plan {pid + 7} is not in flight"),
        (lambda: core.commit(pid, [0, 4], _hist(2, 4), None, None, None),
         "history of 4 tokens, the plan was made for 5"),
        (lambda: core.abort(99), "plan 99 is not in flight"),
        (lambda: core.evict(0, [2]), "user 2 is in an in-flight step"),
        (lambda: core.evict_all(), "1 steps are in flight"),
        (lambda: core.add_offload(0, 42), "user 42 has no device entry"),
        (lambda: core.offload_done(0, 1), "user 1 has no offload in flight"),
        (lambda: core.set_namespace("", None), "non-empty"),
        (lambda: core.lookup([1], [0, 6], t, to_pairs([1]), None, None), "tail_digests"),
    ]
    for fn, match in cases:
        with pytest.raises(ValueError, match=match):
            fn()
        assert snapshot(core, [0]) == before, match
    with pytest.raises(ValueError, match=r"belongs to a CacheCore, which alone allocates and frees"):
        core.pool().free([99])
    with pytest.raises(ValueError, match=r"page 99 out of range"):
        core.pool().add_readers([99])
    assert snapshot(core, [0]) == before
    core.abort(pid)
    assert core.check() == ""


def test_caller_digests_give_the_same_answers_as_cpp_hashing():
    P, seed = 4, namespace_seed("test")
    core = new_core(16, P)
    hist = _hist(3, 14)
    tails = [prefix_hash(hist, 0, 14, seed)]
    status, pid, _, _ = core.allocate([3], [14], [0], [-1], [0])
    assert status == OK
    core.commit(pid, [0, 14], hist, to_pairs(page_digests(hist, 0, 14, P, seed)), to_pairs(tails), [14])
    assert from_pairs(core.entry(0, 3)[2]) == page_digests(hist, 0, 14, P, seed)
    edited = hist.clone()
    edited[9, 0] += 1  # page 2 differs: 8 tokens match
    for req, want in ((hist, 14), (edited, 8), (hist[:10].contiguous(), 8)):
        n = req.shape[0]
        tail = [prefix_hash(req, 0, 14, seed)] if n >= 14 else [0]
        got = core.lookup([3], [0, n], req, to_pairs(page_digests(req, 0, n, P, seed)), to_pairs(tail),
                          [14 if n >= 14 else -1])
        assert got[0] == [want]
        if OPS.hashing_available():
            assert core.lookup([3], [0, n], req, None, None, None)[0] == [want]
    with pytest.raises(ValueError, match="no caller digest for the first 14 tokens"):
        core.lookup([3], [0, 14], hist, to_pairs(page_digests(hist, 0, 14, P, seed)), to_pairs([0]), [-1])
    assert core.check() == ""
