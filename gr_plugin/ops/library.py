"""The ``gr_kv`` custom-op namespace: tensor-only ops the exported graph calls.

Owns the op schemas (frozen once released: see docs/EXPORT.md), their fake (meta) implementations
and their dispatch to the Triton kernels (CUDA) or the pure-torch references (CPU). Stateful cache
policy (lookup, LRU, allocation) stays outside the graph; the graph sees the cache table and small
metadata tensors only. Mutation is declared in the schema (``mutates_args``).

- ``gr_kv::append_kv(kv_layer!, k, v, slots, rows) -> ()``: token ``i`` = row ``rows[i]`` of ``k``/``v``
  ``[M, H, D]`` is written at ``slots[i]`` of ``kv_layer [num_pages, 2, P, H, D]``.
- ``gr_kv::paged_hstu_attention(q, k, v, kv_layer, kv_indices, kv_indptr, history_lengths,
  q_offsets, new_lengths, alpha, n_norm) -> Tensor [Nq, H, D]``.
- ``gr_kv::hstu_attention_jagged(q, k, v, seq_offsets, num_candidates, alpha, n_norm) -> [T, H, D]``.
Sizes the kernels need as host ints (longest segment, history tokens) are derived inside: on the CPU
from the (host) metadata, on CUDA as upper bounds from tensor shapes, so no op syncs the device.
"""

from __future__ import annotations

import torch

from gr_plugin.cache import paged_ops
from gr_plugin.ops.pytorch import hstu_attention as _ref


def _check_table(kv_layer: torch.Tensor, k: torch.Tensor) -> None:
    if kv_layer.dim() != 5 or kv_layer.shape[1] != 2:
        raise ValueError(f"kv_layer must be [num_pages, 2, P, H, D], got {tuple(kv_layer.shape)}")
    if k.dim() != 3 or tuple(k.shape[1:]) != tuple(kv_layer.shape[3:]):
        raise ValueError(f"k must be [M, {kv_layer.shape[3]}, {kv_layer.shape[4]}], got {tuple(k.shape)}")
    if k.dtype != kv_layer.dtype or k.device != kv_layer.device:
        raise ValueError(f"k is {k.dtype} on {k.device}, kv_layer is {kv_layer.dtype} on {kv_layer.device}")


def _check_index(name: str, t: torch.Tensor, device: torch.device) -> None:
    if t.dtype != torch.int64 or t.dim() != 1:
        raise ValueError(f"{name} must be a 1-D int64 tensor, got {t.dtype} of shape {tuple(t.shape)}")
    if t.device != device:
        raise ValueError(f"{name} is on {t.device}, expected {device}")


@torch.library.custom_op("gr_kv::append_kv", mutates_args=("kv_layer",))
def append_kv(kv_layer: torch.Tensor, k: torch.Tensor, v: torch.Tensor, slots: torch.Tensor,
              rows: torch.Tensor) -> None:
    _check_table(kv_layer, k)
    _check_table(kv_layer, v)
    for name, t in (("slots", slots), ("rows", rows)):
        _check_index(name, t, kv_layer.device)
    if slots.numel() != rows.numel():
        raise ValueError(f"slots has {slots.numel()} entries, rows has {rows.numel()}")
    if kv_layer.is_cuda:
        from gr_plugin.ops.triton.append_kv import append_kv as tri

        tri(kv_layer, k, v, slots, rows)
    else:
        paged_ops.append_kv(kv_layer, k, v, slots, rows)


@append_kv.register_fake
def _(kv_layer, k, v, slots, rows) -> None:
    return None


@torch.library.custom_op("gr_kv::paged_hstu_attention", mutates_args=())
def paged_hstu_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, kv_layer: torch.Tensor,
                         kv_indices: torch.Tensor, kv_indptr: torch.Tensor, history_lengths: torch.Tensor,
                         q_offsets: torch.Tensor, new_lengths: torch.Tensor, alpha: float,
                         n_norm: float) -> torch.Tensor:
    _check_table(kv_layer, k)
    if q.shape != k.shape or v.shape != k.shape:
        raise ValueError(f"q, k, v must share a shape, got {tuple(q.shape)}, {tuple(k.shape)}, {tuple(v.shape)}")
    for name, t in (("kv_indices", kv_indices), ("kv_indptr", kv_indptr), ("history_lengths", history_lengths),
                    ("q_offsets", q_offsets), ("new_lengths", new_lengths)):
        _check_index(name, t, q.device)
    if q.is_cuda:
        from gr_plugin.ops.triton import hstu_attention as tri

        nq = q.shape[0]
        return tri.paged_hstu_attention(q, k, v, kv_layer, kv_indices, kv_indptr, history_lengths, q_offsets,
                                        new_lengths, alpha=alpha, n_norm=n_norm, max_q_len=nq,
                                        max_history_len=kv_layer.shape[0] * kv_layer.shape[2],
                                        num_history_tokens=0)
    q_len = q_offsets[1:] - q_offsets[:-1]
    return _ref.paged_hstu_attention(
        q, k, v, kv_layer, kv_indices, kv_indptr, history_lengths, q_offsets, new_lengths, alpha=alpha,
        n_norm=n_norm, max_q_len=int(q_len.max()) if q_len.numel() else 0,
        max_history_len=max(int(history_lengths.max()) if history_lengths.numel() else 0, 1),
        num_history_tokens=int(history_lengths.sum()))


@paged_hstu_attention.register_fake
def _(q, k, v, kv_layer, kv_indices, kv_indptr, history_lengths, q_offsets, new_lengths, alpha, n_norm):
    return torch.empty_like(q)


@torch.library.custom_op("gr_kv::hstu_attention_jagged", mutates_args=())
def hstu_attention_jagged(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, seq_offsets: torch.Tensor,
                          num_candidates: torch.Tensor, alpha: float, n_norm: float) -> torch.Tensor:
    if q.shape != k.shape or v.shape != k.shape or q.dim() != 3:
        raise ValueError(f"q, k, v must share a [T, H, D] shape, got {tuple(q.shape)}, {tuple(k.shape)}")
    for name, t in (("seq_offsets", seq_offsets), ("num_candidates", num_candidates)):
        _check_index(name, t, q.device)
    if q.is_cuda:
        from gr_plugin.ops.triton import hstu_attention as tri

        return tri.hstu_attention_jagged(q, k, v, seq_offsets, num_candidates, alpha=alpha, n_norm=n_norm,
                                         max_seq_len=q.shape[0])
    lengths = seq_offsets[1:] - seq_offsets[:-1]
    return _ref.hstu_attention_jagged(q, k, v, seq_offsets, num_candidates, alpha=alpha, n_norm=n_norm,
                                      max_seq_len=int(lengths.max()) if lengths.numel() else 0)


@hstu_attention_jagged.register_fake
def _(q, k, v, seq_offsets, num_candidates, alpha, n_norm):
    return torch.empty_like(q)
