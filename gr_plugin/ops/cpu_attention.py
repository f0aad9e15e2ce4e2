"""The full (jagged) HSTU attention with a gradient on the CPU: the ``gr_kv`` C++ kernels both ways.

Owns the autograd function CPU training runs (`gr_plugin.ops.hstu_attention` dispatches to it): the forward
is ``gr_kv::hstu_attention_jagged`` (each user at its own length, in place), the backward
``gr_kv::hstu_attention_jagged_backward`` (each user's ``[H, n, n]`` scores recomputed, no padding to the
batch's longest sequence), both in ``gr_plugin/csrc/gr_kv_ops.cpp``. The pure-torch reference pads every
user to the longest and keeps ``[B, H, S, S]`` tensors for autograd.
"""

from __future__ import annotations

import torch


class CppJaggedAttention(torch.autograd.Function):
    """``gr_kv::hstu_attention_jagged`` with ``gr_kv::hstu_attention_jagged_backward`` as its gradient (which
    computes dq, dk and dv; autograd keeps those asked for). The backward is not differentiable itself:
    asked for a graph of it (``create_graph=True``, which torch.func transforms also ask for) it raises
    rather than return gradients that silently lack their dependence on q, k, v."""

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
        if torch.is_grad_enabled():  # (autograd enables grad mode in a backward only for create_graph=True)
            raise RuntimeError("the C++ HSTU attention's backward is not differentiable (create_graph=True: a "
                               "double backward, or a torch.func transform): run the attention through the torch "
                               "reference (GR_PLUGIN_ATTENTION=reference) for those")
        q, k, v, seq_offsets, num_candidates = ctx.saved_tensors
        grads = torch.ops.gr_kv.hstu_attention_jagged_backward(dout, q, k, v, seq_offsets, num_candidates,
                                                               *ctx.scalars)
        return (*grads, None, None, None, None)


def hstu_attention_jagged(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, seq_offsets: torch.Tensor,
                          num_candidates: torch.Tensor, *, alpha: float, n_norm: float) -> torch.Tensor:
    """The C++ kernels' full-sequence attention ``[T, H, D]`` with a backward (int64 offsets and counts)."""
    from gr_plugin.ops import library  # noqa: F401 - builds / loads the gr_kv ops at first use

    return CppJaggedAttention.apply(q, k, v, seq_offsets, num_candidates, alpha, n_norm)
