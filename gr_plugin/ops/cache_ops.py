"""Python side of the tensor-only cache ops ``gr_kv::cache_*``: loading and fake (meta) kernels.

The schemas, boundary checks and kernels are C++ (``gr_plugin/csrc/core/request_ops.cpp``, compiled into
the cache core extension that `gr_plugin.csrc.core.build` builds and loads); this module registers the
fake kernels that tracing (``torch.export``, ``torch.compile``, opcheck) needs. It owns no cache state:
each cache lives in the C++ registry, addressed by a ``state`` tensor (int64 CPU ``[2]``: handle, epoch).

- ``cache_create(num_pages, page_size, namespace) -> state [2]``
- ``cache_lookup(state, user_ids [B], history_lengths [B], tokens [sum(L)(, F)]) -> device tokens [B]``
- ``cache_allocate(state!, user_ids, history_lengths, tokens) -> (plan [6], kv_indices [M], kv_indptr [B+1],
  cached_lengths [B], new_token_slots [N])``; ``M`` and ``N`` are data-dependent.
- ``cache_commit(state!, plan, history_lengths, tokens)``, ``cache_abort(state!, plan)``, ``cache_destroy(state!)``.
- The pinned host tier (the C++ ``HostCore``, the Python host tier's policy): ``cache_attach_host(state!,
  num_slots)``; ``cache_allocate_tiered(state!, ...)`` -> ``cache_allocate``'s outputs + ``onboard_slots [K]``,
  ``onboard_pages [K]`` (copy host slots -> device pages before the step; the host pages stay pinned until
  commit/abort); ``cache_offload_launch(state!, user_ids) -> (ticket [2] (id, refused), src_pages [K],
  dst_slots [K])`` (the write-through of committed users: copy device pages -> host slots) and
  ``cache_offload_reap(state!, ticket, ok)`` (publishes them, or gives them back; in launch order). The
  bytes are the caller's: ``gr_kv::gather_pages`` / ``scatter_pages`` move them between the two tables.
  SSD and remote tiers stay `KVCacheManager`'s.
"""

from __future__ import annotations

import torch

from gr_plugin.csrc.core.build import load

LIBRARY_PATH = load()  # defines the gr_kv::cache_* schemas and kernels (C++)

PLAN_FIELDS = ("status", "plan_id", "index", "demand", "evicted_users", "evicted_pages")
STATUS = {"ok": 0, "in_flight": 1, "no_fit": 3, "too_big": 4}  # plan[0]; 2 (changed) cannot happen here


def _index(n) -> torch.Tensor:
    return torch.empty(n, dtype=torch.int64, device="cpu")


@torch.library.register_fake("gr_kv::cache_create")
def _(num_pages, page_size, namespace):
    return _index(2)


@torch.library.register_fake("gr_kv::cache_lookup")
def _(state, user_ids, history_lengths, tokens):
    return _index(user_ids.shape[0])


@torch.library.register_fake("gr_kv::cache_allocate")
def _(state, user_ids, history_lengths, tokens):
    ctx = torch.library.get_ctx()
    num_pages, num_new = ctx.new_dynamic_size(), ctx.new_dynamic_size()  # M, N: known after the policy runs
    B = user_ids.shape[0]
    return _index(len(PLAN_FIELDS)), _index(num_pages), _index(B + 1), _index(B), _index(num_new)


@torch.library.register_fake("gr_kv::cache_commit")
def _(state, plan, history_lengths, tokens) -> None:
    return None


@torch.library.register_fake("gr_kv::cache_abort")
def _(state, plan) -> None:
    return None


@torch.library.register_fake("gr_kv::cache_destroy")
def _(state) -> None:
    return None


@torch.library.register_fake("gr_kv::cache_attach_host")
def _(state, num_slots) -> None:
    return None


@torch.library.register_fake("gr_kv::cache_allocate_tiered")
def _(state, user_ids, history_lengths, tokens):
    ctx = torch.library.get_ctx()
    num_pages, num_new, num_onboard = ctx.new_dynamic_size(), ctx.new_dynamic_size(), ctx.new_dynamic_size()
    B = user_ids.shape[0]
    return (_index(len(PLAN_FIELDS)), _index(num_pages), _index(B + 1), _index(B), _index(num_new),
            _index(num_onboard), _index(num_onboard))


@torch.library.register_fake("gr_kv::cache_offload_launch")
def _(state, user_ids):
    num = torch.library.get_ctx().new_dynamic_size()
    return _index(2), _index(num), _index(num)


@torch.library.register_fake("gr_kv::cache_offload_reap")
def _(state, ticket, ok) -> None:
    return None
