"""Tiny HSTU fixtures: a 2-layer model, a cache for it, KJTs from per-user histories."""

from __future__ import annotations

import torch
from torchrec.sparse.jagged_tensor import KeyedJaggedTensor

from gr_plugin.cache import KVCacheConfig
from gr_plugin.modules import HSTUConfig, HSTURanker, KVCacheModule, cache_token_keys

NUM_ITEMS = 50


def tiny_model(seed: int = 0, head_dim: int = 8, **kw) -> HSTURanker:
    torch.manual_seed(seed)
    cfg = HSTUConfig(num_items=NUM_ITEMS, num_actions=6, num_time_buckets=8, max_positions=64,
                     embedding_dim=16, num_layers=2, num_heads=2, head_dim=head_dim, n_norm=32.0, **kw)
    model = HSTURanker(cfg)
    with torch.no_grad():  # torchrec initialises tables to small values; make them matter
        for p in model.parameters():
            p.normal_(0, 0.3) if p.dim() > 1 else None
    return model.eval()


def tiny_cache(model: HSTURanker, num_pages: int = 64, page_size: int = 4, backend: str = "native",
               host_pages: int = 64, **kw) -> KVCacheModule:
    c = model.config
    cfg = KVCacheConfig(num_layers=c.num_layers, num_heads=c.num_heads, head_dim=c.head_dim,
                        page_size=page_size, num_pages=num_pages, **kw)
    if backend != "gpu":
        cfg.host_cache_bytes = host_pages * cfg.page_bytes
    return KVCacheModule(cfg, backend)


class User:
    """A user's growing history of (item, action, time bucket) events."""

    def __init__(self, uid: int, g: torch.Generator):
        self.uid, self.g = uid, g
        self.items = torch.zeros(0, dtype=torch.int64)
        self.actions = torch.zeros(0, dtype=torch.int64)
        self.times = torch.zeros(0, dtype=torch.int64)

    def grow(self, n: int) -> None:
        self.items = torch.cat([self.items, torch.randint(1, NUM_ITEMS + 1, (n,), generator=self.g)])
        self.actions = torch.cat([self.actions, torch.randint(1, 6, (n,), generator=self.g)])
        self.times = torch.cat([self.times, torch.randint(0, 8, (n,), generator=self.g)])

    def edit(self, at: int) -> None:
        self.items = self.items.clone()
        self.items[at] = self.items[at] % NUM_ITEMS + 1

    def candidates(self, n: int) -> torch.Tensor:
        return torch.randint(1, NUM_ITEMS + 1, (n,), generator=self.g)


def make_inputs(users: list[User], cands: list[torch.Tensor]):
    lengths = torch.tensor([u.items.numel() for u in users])
    history = KeyedJaggedTensor(
        keys=["item", "action", "time"],
        values=torch.cat([torch.cat([getattr(u, f) for u in users]) for f in ("items", "actions", "times")]),
        lengths=lengths.repeat(3),
    )
    candidates = KeyedJaggedTensor(keys=["item"], values=torch.cat(cands),
                                   lengths=torch.tensor([c.numel() for c in cands]))
    keys = cache_token_keys(torch.cat([u.items for u in users]), torch.cat([u.actions for u in users]),
                            torch.cat([u.times for u in users]))
    return history, candidates, lengths.tolist(), keys


def cached_scores(model: HSTURanker, cache: KVCacheModule, users: list[User], cands: list[torch.Tensor],
                  outcome: str = "commit", **forward_kw):
    """``model.forward_cached``'s scores for these users and candidates (``forward_kw`` passed on),
    the step committed (or aborted), and its plan; (None, None) where the batch does not fit."""
    history, candidates, lengths, keys = make_inputs(users, cands)
    plan = cache.begin([u.uid for u in users], lengths, keys)
    if plan is None:
        return None, None
    with torch.no_grad():
        out = model.forward_cached(history, candidates, cache, plan, **forward_kw)
    (cache.commit if outcome == "commit" else cache.abort)(plan)
    return out, plan


def full_scores(model: HSTURanker, users: list[User], cands: list[torch.Tensor]) -> torch.Tensor:
    history, candidates, _, _ = make_inputs(users, cands)
    with torch.no_grad():
        return model(history, candidates)
