"""`KVCacheModule`: the paged KV cache as a torchrec-style ``nn.Module``.

Owns a `KVCacheManager` whose device table is a *non-persistent* buffer, so the cache moves with
the model (``.to()``, ``device=``, the meta device) while checkpoints stay weights-only. Its
``forward`` is one layer's cached attention, jagged in and out: wait for the layer's onboarded
pages, append the new history K/V into pages, attend over cached + new history and candidates.
It does not decide when a step begins or ends (``begin``/``commit``/``abort`` are called by the
integrations: the Lightning callback, the inference loop, the server).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence

import torch
from torch import nn

from gr_plugin.cache import (
    BatchPlan,
    CacheRequest,
    HostTier,
    KVBackend,
    KVCacheConfig,
    KVCacheManager,
    LookupResult,
    TieredBackend,
)
from gr_plugin.cache.tiers.flexkv_config import TierConfig
from gr_plugin.modules.tokens import TokenLayout
from gr_plugin.ops import append_kv, paged_hstu_attention, silu_append_kv
from gr_plugin.ops.norm import NormGate

BACKENDS = ("gpu", "native", "flexkv")


def make_backend(name: str, tiers: TierConfig | None = None) -> KVBackend | None:
    """``gpu``: device pages only; ``native``: + the pinned host tier; ``flexkv``: + SSD and remote
    tiers as ``tiers`` says (gr_plugin's built-in tiered engine)."""
    if name == "gpu":
        return None
    if name == "native":
        return HostTier()
    if name == "flexkv":
        return TieredBackend(tiers if tiers is not None else TierConfig())
    raise ValueError(f"unknown cache backend {name!r}; choose one of {list(BACKENDS)}")


class KVCacheModule(nn.Module):
    def __init__(self, config: KVCacheConfig, backend: str | KVBackend | None = "native",
                 device: torch.device | str | None = None, *, write_through: bool = True,
                 tiers: TierConfig | None = None) -> None:
        super().__init__()
        if device is not None:
            config = dataclasses.replace(config, device=str(torch.device(device)))
        if isinstance(backend, str):
            backend = make_backend(backend, tiers)
        if backend is not None and config.host_cache_bytes == 0:
            raise ValueError("a lower-tier backend needs host_cache_bytes > 0 (kvcache host_cache_gb)")
        self.manager = KVCacheManager(config, backend, write_through=write_through, append_fn=append_kv)
        self.register_buffer("kv_table", self.manager.kv_table, persistent=False)

    @property
    def config(self) -> KVCacheConfig:
        return self.manager.config

    def _apply(self, fn, recurse: bool = True):
        super()._apply(fn, recurse)
        if self.kv_table is not self.manager.kv_table:
            self.manager.rebind(self.kv_table)
        return self

    # ------------------------------------------------------------------ step lifecycle
    def lookup(self, user_ids: Sequence[int], history_lengths: Sequence[int],
               token_keys: torch.Tensor) -> LookupResult:
        """What the cache holds for these users; lower-tier reads start here (they overlap
        whatever the caller does before `begin`). ``token_keys``: int64 CPU ``[sum(L)]``."""
        return self.manager.lookup(CacheRequest(user_ids, history_lengths, token_keys))

    def begin(self, lookup_or_users: LookupResult | Sequence[int], history_lengths: Sequence[int] | None = None,
              token_keys: torch.Tensor | None = None) -> BatchPlan | None:
        """Allocate + launch the onboard copy, from a `lookup` result (or users, lengths, keys).
        ``None``: the batch does not fit; run the full pass instead."""
        lookup = lookup_or_users
        if not isinstance(lookup, LookupResult):
            lookup = self.lookup(lookup_or_users, history_lengths, token_keys)
        plan = self.manager.allocate(lookup)
        if plan is not None:
            try:
                self.manager.onboard_launch(plan)
            except BaseException:
                self.manager.abort(plan)  # NOTE: else its users would stay in flight
                raise
        return plan

    def commit(self, plan: BatchPlan) -> None:
        self.manager.commit(plan)

    def close(self) -> None:
        """Stop the manager's transfers and close its tiers (threads, files, an SSD directory's lock,
        a Redis connection); idempotent. Works with ``contextlib.closing``."""
        self.manager.close()

    def abort(self, plan: BatchPlan) -> None:
        self.manager.abort(plan)

    # ------------------------------------------------------------------ one layer
    def forward(self, layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, layout: TokenLayout,
                plan: BatchPlan, *, alpha: float, n_norm: float, norm_gate: NormGate | None = None,
                activated: bool = True) -> torch.Tensor:
        """Cached attention of ``layer``: ``q, k, v [Nq, H, D]`` in ``layout``'s query order
        (per user: new history events, then candidates) -> ``[Nq, H, D]``; with ``norm_gate``
        (`gr_plugin.ops.norm.NormGate`), ``LayerNorm(out.flatten(1)) * u`` ``[Nq, H*D]``.
        ``activated=False``: ``q, k, v`` and the gate's ``u`` are the layer's projection before its
        SiLU (`HSTULayer.project` with ``activate=False``; the gate is then required): one pass takes
        the SiLU of ``q, k, v`` and appends (`gr_plugin.ops.silu_append_kv`, not the manager's
        ``append_fn``), the norm's pass takes ``u``'s, as the graphed step does (`HSTULayer.attend_pages`)."""
        if not activated and norm_gate is None:
            raise ValueError("activated=False needs norm_gate: the SiLU of its u is taken in the norm's pass")
        self.manager.wait_layer(plan, layer)
        meta = plan.metadata
        if activated:
            self.manager.append(layer, k, v, plan, rows=layout.new_rows)
        else:
            self.manager.check_append(layer, k, v, plan, rows=layout.new_rows)
            q, k, v = silu_append_kv(self.kv_table[layer], q, k, v, meta.new_token_slots, layout.new_rows)
        plan.appended_layers.add(layer)
        return paged_hstu_attention(
            q, k, v, self.kv_table[layer], meta.kv_indices, meta.kv_indptr, meta.total_lengths,
            layout.q_offsets, meta.new_lengths, alpha=alpha, n_norm=n_norm, max_q_len=layout.max_q_len,
            max_history_len=max(meta.max_total_len, 1), num_history_tokens=meta.num_total_tokens, norm_gate=norm_gate,
            silu_gate=not activated,
        )

    attend = forward

    def stats(self) -> dict:
        return self.manager.stats()

    def extra_repr(self) -> str:
        c = self.config
        backend = type(self.manager.backend).__name__ if self.manager.backend is not None else "gpu"
        return (f"layers={c.num_layers}, heads={c.num_heads}, head_dim={c.head_dim}, "
                f"page_size={c.page_size}, "
                f"num_pages={c.num_pages}, dtype={c.dtype}, backend={backend}")
