"""The full (jagged) HSTU attention with a gradient on the CPU: the ``gr_kv`` C++ kernels both ways.

Owns the autograd function CPU training runs (`gr_plugin.ops.hstu_attention` dispatches to it): the forward
is ``gr_kv::hstu_attention_jagged`` (each user at its own length, in place), the backward
``gr_kv::hstu_attention_jagged_backward`` (each user's ``[H, n, n]`` scores recomputed, no padding to the
batch's longest sequence), both in ``gr_plugin/csrc/gr_kv_ops.cpp``. The pure-torch reference pads every
user to the longest and keeps ``[B, H, S, S]`` tensors for autograd.
"""

from __future__ import annotations

import torch

from gr_plugin.ops.kernel_grad import refuse_second_order


class CppJaggedAttention(torch.autograd.Function):
    """``gr_kv::hstu_attention_jagged`` with ``gr_kv::hstu_attention_jagged_backward`` as its gradient (which
    computes dq, dk and dv; autograd keeps those asked for); the backward is first-order only
    (`gr_plugin.ops.kernel_grad`)."""

    @staticmethod
    def forward(q, k, v, seq_offsets, num_candidates, alpha, n_norm):
        return torch.ops.gr_kv.hstu_attention_jagged(q, k, v, seq_offsets, num_candidates, alpha, n_norm)

    @staticmethod
    def setup_context(ctx, inputs, output):
        q, k, v, seq_offsets, num_candidates, alpha, n_norm = inputs
        ctx.save_for_backward(q, k, v, seq_offsets, num_candidates)
        ctx.scalars = (alpha, n_norm)

    @staticmethod
    def backward(ctx, dout):
        refuse_second_order("the C++")
        q, k, v, seq_offsets, num_candidates = ctx.saved_tensors
        grads = torch.ops.gr_kv.hstu_attention_jagged_backward(dout, q, k, v, seq_offsets, num_candidates,
                                                               *ctx.scalars)
        return (*grads, None, None, None, None)


def hstu_attention_jagged(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, seq_offsets: torch.Tensor,
                          num_candidates: torch.Tensor, *, alpha: float, n_norm: float) -> torch.Tensor:
    """The C++ kernels' full-sequence attention ``[T, H, D]`` with a backward (int64 offsets and counts)."""
    from gr_plugin.ops import library  # noqa: F401 - builds / loads the gr_kv ops at first use

    return CppJaggedAttention.apply(q, k, v, seq_offsets, num_candidates, alpha, n_norm)
