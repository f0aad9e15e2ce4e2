"""Ops on the hot path: a dispatching entry point per op, a pure-torch reference under
``pytorch/`` (the oracle, and the CPU path where autograd needs it), the ``gr_kv`` C++ CPU kernels
(`library`; CPU inference's attention) and GPU kernels beside it when present."""

from gr_plugin.ops.append_kv import append_kv, silu_append_kv
from gr_plugin.ops.hstu_attention import hstu_attention_jagged, paged_hstu_attention

__all__ = ["append_kv", "hstu_attention_jagged", "paged_hstu_attention", "silu_append_kv"]
