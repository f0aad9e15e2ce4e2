"""Dispatch of the HSTU attention ops: the GPU kernel when one serves the inputs, else the
pure-torch reference (``gr_plugin.ops.pytorch.hstu_attention``, which also defines the semantics).
"""

from __future__ import annotations

import torch

from gr_plugin.ops.pytorch import hstu_attention as _ref


def hstu_attention_jagged(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, seq_offsets: torch.Tensor,
                          num_candidates: torch.Tensor, *, alpha: float, n_norm: float,
                          max_seq_len: int) -> torch.Tensor:
    """Full-sequence HSTU attention ``[T, H, D]``; see the reference for the semantics."""
    return _ref.hstu_attention_jagged(q, k, v, seq_offsets, num_candidates, alpha=alpha, n_norm=n_norm,
                                      max_seq_len=max_seq_len)


def paged_hstu_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, kv_layer: torch.Tensor,
                         kv_indices: torch.Tensor, kv_indptr: torch.Tensor, history_lengths: torch.Tensor,
                         q_offsets: torch.Tensor, new_lengths: torch.Tensor, *, alpha: float, n_norm: float,
                         max_q_len: int, max_history_len: int, num_history_tokens: int) -> torch.Tensor:
    """Cached-step HSTU attention over paged history K/V; see the reference for the semantics."""
    return _ref.paged_hstu_attention(q, k, v, kv_layer, kv_indices, kv_indptr, history_lengths, q_offsets,
                                     new_lengths, alpha=alpha, n_norm=n_norm, max_q_len=max_q_len,
                                     max_history_len=max_history_len, num_history_tokens=num_history_tokens)
