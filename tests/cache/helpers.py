"""Test helpers for the cache core: tiny configs, deterministic K/V, one step end to end."""

from __future__ import annotations

import torch

from gr_plugin.cache import CacheRequest, KVCacheConfig, KVCacheManager, paged_ops


def tiny_config(**overrides) -> KVCacheConfig:
    base = dict(num_layers=2, num_heads=2, head_dim=4, page_size=4, num_pages=16, namespace="test")
    base.update(overrides)
    return KVCacheConfig(**base)


def history_tokens(user: int, length: int, edit_at: int | None = None, features: int = 2) -> torch.Tensor:
    """Deterministic token rows ``[length, features]`` of a user's history (an optional edited row)."""
    pos = torch.arange(length, dtype=torch.int64)
    rows = torch.stack([pos * 7 + user * 1000 + f for f in range(features)], dim=1)
    if edit_at is not None and edit_at < length:
        rows[edit_at, 0] += 1
    return rows


def expected_kv(tokens: torch.Tensor, layer: int, num_heads: int, head_dim: int,
                dtype: torch.dtype = torch.float32) -> tuple[torch.Tensor, torch.Tensor]:
    """K/V ``[L, H, D]`` that depend on the whole prefix (like a causal model's), exact in fp32."""
    L = tokens.shape[0]
    w = torch.arange(1, L + 1, dtype=torch.int64)
    mixed = torch.cumsum(tokens[:, 0] * w + tokens[:, -1], dim=0) % 4093
    base = (mixed * 3 + layer * 17).to(torch.float32)
    hd = torch.arange(num_heads * head_dim, dtype=torch.float32).view(1, num_heads, head_dim)
    k = base.view(L, 1, 1) + hd
    return k.to(dtype), (-k - 0.5).to(dtype)


def run_step(manager: KVCacheManager, users: list[int], histories: list[torch.Tensor], *,
             outcome: str = "commit", check_values: bool = True):
    """lookup → allocate → onboard → per layer (wait, append, read back) → commit/abort.

    Returns ``(lookup, plan)``; ``plan`` is None when allocate returned None. Asserts that every
    token of every history read back from the pages equals ``expected_kv``.
    """
    req = CacheRequest(users, [h.shape[0] for h in histories], torch.cat(histories))
    return finish_step(manager, manager.lookup(req), histories, outcome=outcome, check_values=check_values)


def finish_step(manager: KVCacheManager, lookup, histories: list[torch.Tensor], *, outcome: str = "commit",
                check_values: bool = True):
    """`run_step` from its allocate on, for a ``lookup`` of ``histories`` made earlier."""
    cfg = manager.config
    plan = manager.allocate(lookup)
    if plan is None:
        return lookup, None
    handle = manager.onboard_launch(plan)
    meta = plan.metadata
    slots = paged_ops.sequence_slots(meta.kv_indices, meta.kv_indptr, meta.total_lengths,
                                     meta.total_offsets, cfg.page_size, meta.num_total_tokens)
    for layer in range(cfg.num_layers):
        handle.wait_layer(layer)
        ks, vs = [], []
        for b, h in enumerate(histories):
            k, v = expected_kv(h, layer, cfg.num_heads, cfg.head_dim, cfg.torch_dtype)
            ks.append(k[plan.cached_lengths[b]:])
            vs.append(v[plan.cached_lengths[b]:])
        manager.append(layer, torch.cat(ks), torch.cat(vs), plan)
        if check_values:
            k_all, v_all = paged_ops.gather_kv(manager.kv_table[layer], slots)
            want = [expected_kv(h, layer, cfg.num_heads, cfg.head_dim, cfg.torch_dtype) for h in histories]
            assert torch.equal(k_all, torch.cat([w[0] for w in want])), f"K mismatch at layer {layer}"
            assert torch.equal(v_all, torch.cat([w[1] for w in want])), f"V mismatch at layer {layer}"
    if outcome == "commit":
        manager.commit(plan)
    elif outcome == "abort":
        manager.abort(plan)
    return lookup, plan
