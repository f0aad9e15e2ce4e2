"""Pure-torch HSTU attention: the full jagged form and the paged (cached) form.

Owns the HSTU attention semantics that every kernel must reproduce:
``out_i = sum_j mask_ij * SiLU(alpha * <q_i, k_j>) / n_norm * v_j`` per head, where each user's
sequence is its history followed by its candidates, and ``mask_ij`` lets
- a history token see history tokens at or before its own position (causal), and
- a candidate see the whole history and itself, never another candidate.
``n_norm`` is a fixed model constant (never a property of the batch), so a cached step computes
exactly what a full pass computes. Shapes: ``[T, H, D]`` jagged tensors, ``offsets [B+1]`` int64.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from gr_plugin.cache import paged_ops
from gr_plugin.ops.jagged import complete_cumsum, jagged_to_padded, padded_to_jagged


def hstu_attention_jagged(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    seq_offsets: torch.Tensor,
    num_candidates: torch.Tensor,
    *,
    alpha: float,
    n_norm: float,
    max_seq_len: int,
) -> torch.Tensor:
    """Full-sequence attention; sequence ``b`` is ``seq_offsets[b]..seq_offsets[b+1]``, its last
    ``num_candidates[b]`` tokens are candidates. Returns ``[T, H, D]``."""
    total = q.shape[0]
    qd = jagged_to_padded(q, seq_offsets, max_seq_len)  # [B, S, H, D]
    kd = jagged_to_padded(k, seq_offsets, max_seq_len)
    vd = jagged_to_padded(v, seq_offsets, max_seq_len)
    scores = F.silu(torch.einsum("bihd,bjhd->bhij", qd, kd) * alpha) / n_norm
    lengths = (seq_offsets[1:] - seq_offsets[:-1]).view(-1, 1, 1)
    hist = lengths - num_candidates.view(-1, 1, 1)
    i = torch.arange(max_seq_len, device=q.device).view(1, -1, 1)
    j = torch.arange(max_seq_len, device=q.device).view(1, 1, -1)
    valid = (i < lengths) & (j < lengths)
    is_cand = i >= hist
    allowed = valid & torch.where(is_cand, (j < hist) | (i == j), j <= i)
    scores = scores * allowed.unsqueeze(1).to(scores.dtype)
    out = torch.einsum("bhij,bjhd->bihd", scores, vd)
    return padded_to_jagged(out, seq_offsets, total)


def paged_hstu_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    kv_layer: torch.Tensor,
    kv_indices: torch.Tensor,
    kv_indptr: torch.Tensor,
    history_lengths: torch.Tensor,
    q_offsets: torch.Tensor,
    new_lengths: torch.Tensor,
    *,
    alpha: float,
    n_norm: float,
    max_q_len: int,
    max_history_len: int,
    num_history_tokens: int,
) -> torch.Tensor:
    """Cached-step attention. Queries of user ``b`` (``q_offsets[b]..q_offsets[b+1]``) are its
    ``new_lengths[b]`` new history tokens, at positions ``history_lengths[b] - new_lengths[b] + i``,
    then its candidates. History K/V (cached and new, already appended) are read from the pages of
    ``kv_layer [num_pages, 2, P, H, D]`` via ``kv_indices``/``kv_indptr``; a candidate's own K/V
    come from ``k``/``v`` ``[Nq, H, D]``. Returns ``[Nq, H, D]``."""
    nq = q.shape[0]
    page_size = kv_layer.shape[2]
    hist_offsets = complete_cumsum(history_lengths)
    slots = paged_ops.sequence_slots(kv_indices, kv_indptr, history_lengths, hist_offsets, page_size,
                                     num_history_tokens)
    kh, vh = paged_ops.gather_kv(kv_layer, slots)
    qd = jagged_to_padded(q, q_offsets, max_q_len)  # [B, Q, H, D]
    kd = jagged_to_padded(kh, hist_offsets, max_history_len)  # [B, L, H, D]
    vd = jagged_to_padded(vh, hist_offsets, max_history_len)
    scores = F.silu(torch.einsum("bihd,bjhd->bhij", qd, kd) * alpha) / n_norm
    q_len = (q_offsets[1:] - q_offsets[:-1]).view(-1, 1, 1)
    new = new_lengths.view(-1, 1, 1)
    hist = history_lengths.view(-1, 1, 1)
    i = torch.arange(max_q_len, device=q.device).view(1, -1, 1)
    j = torch.arange(max_history_len, device=q.device).view(1, 1, -1)
    pos = hist - new + i  # absolute position of a new history token
    allowed = (i < q_len) & (j < hist) & ((i >= new) | (j <= pos))
    scores = scores * allowed.unsqueeze(1).to(scores.dtype)
    out = padded_to_jagged(torch.einsum("bhij,bjhd->bihd", scores, vd), q_offsets, nq)
    # candidates also see themselves
    batch = torch.repeat_interleave(torch.arange(q_offsets.numel() - 1, device=q.device),
                                    q_offsets[1:] - q_offsets[:-1], output_size=nq)
    is_cand = (torch.arange(nq, device=q.device) - q_offsets[:-1][batch]) >= new_lengths[batch]
    self_w = F.silu((q * k).sum(-1) * alpha) / n_norm  # [Nq, H]
    return out + (self_w * is_cand.unsqueeze(1).to(self_w.dtype)).unsqueeze(-1) * v
