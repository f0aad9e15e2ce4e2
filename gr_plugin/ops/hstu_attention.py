"""Dispatch of the HSTU attention ops: the Triton kernel for CUDA tensors it supports; for CPU tensors,
the ``gr_kv`` C++ CPU kernels (`gr_plugin.ops.library`: per user, no padding; the ops an exported package
runs); else the pure-torch reference (``gr_plugin.ops.pytorch.hstu_attention``, which also defines the
semantics).

``GR_PLUGIN_ATTENTION=reference|triton|auto`` (default ``auto``) overrides the choice, e.g. to run
the kernel under ``TRITON_INTERPRET=1`` on CPU tensors in tests, or the reference on the CPU. When
autograd needs the attention's gradient (training), the full (jagged) form in bf16/fp16, and in fp32 on
tf32x3 dots up to head_dim 128, takes the Triton kernels with their backward
(`gr_plugin.ops.triton.hstu_attention_bwd`) where the forward's would serve (fp32 at head_dim 256 or on
IEEE dots keeps the reference: measured faster there); on CPU tensors, the C++
kernels with their C++ backward (`gr_plugin.ops.cpu_attention`). The paged form's kernels are
forward-only: there ``auto`` takes the reference, whose torch ops have a backward, and ``triton`` is
an error rather than a silently cut gradient.
"""

from __future__ import annotations

import functools
import logging
import os

import torch

from gr_plugin.ops import cpu_attention, norm
from gr_plugin.ops.pytorch import hstu_attention as _ref

logger = logging.getLogger(__name__)


@functools.cache
def _cpu_ops():
    """``torch.ops.gr_kv`` with its CPU kernels loaded (built at first use, `gr_plugin.csrc.build`), or
    None where they cannot be built or loaded (then the CPU takes the reference, with one warning)."""
    try:
        from gr_plugin.ops import library  # noqa: F401 - loads the C++ ops
    except Exception as e:
        logger.warning("the gr_kv C++ CPU attention is unavailable, the CPU takes the pure-torch reference: %s", e)
        return None
    return torch.ops.gr_kv


@functools.cache
def _triton_ops():
    try:
        from gr_plugin.ops.triton import hstu_attention as tri
    except Exception:
        return None
    return tri


@functools.cache
def _triton_training():
    from gr_plugin.ops.triton import hstu_attention_bwd

    return hstu_attention_bwd


def _needs_grad(*ts: torch.Tensor) -> bool:
    return torch.is_grad_enabled() and any(t.requires_grad for t in ts)


def _use_triton(q: torch.Tensor, *more: torch.Tensor, backward: bool = False) -> bool:
    """Whether the Triton kernel serves these inputs (``q`` and the other differentiable inputs);
    ``backward``: the caller has a Triton backward for them (the full form), so a gradient may be needed."""
    mode = os.environ.get("GR_PLUGIN_ATTENTION", "auto")
    if mode not in ("auto", "reference", "triton"):
        raise ValueError(f"GR_PLUGIN_ATTENTION must be auto, reference or triton, got {mode!r}")
    if mode == "reference":
        return False
    needs_grad = _needs_grad(q, *more)
    tri = _triton_ops()
    if mode == "triton":
        if tri is None:
            raise ValueError("GR_PLUGIN_ATTENTION=triton but triton cannot be imported here")
        if needs_grad and not backward:
            raise ValueError("GR_PLUGIN_ATTENTION=triton, but q/k/v require grad and the paged Triton HSTU "
                             "attention kernel is forward-only: unset it (auto) to train through the torch reference")
        return True
    # NOTE: fp32 trains through the kernels on tf32x3 dots up to head_dim 128 only. On the H200
    # (`hstu_attention_bwd.blocks`; bs 8, 2048-event histories) their forward + backward took 1.2 / 1.6 / 3.3 /
    # 7.0 ms at head_dim 16 / 32 / 64 / 128 against the reference's 8.5 / 8.5 / 10.1 / 12.6, but 25.7 against
    # 18.4 at 256; on IEEE dots they were slower at 128 too.
    if not (q.is_cuda and tri is not None and q.shape[-1] in tri.SUPPORTED_HEAD_DIMS
            and q.dtype in (torch.bfloat16, torch.float16, torch.float32)):
        return False
    if not needs_grad:
        return True
    if not backward or any(t.dtype != q.dtype for t in more):
        return False
    return q.dtype.itemsize == 2 or (q.shape[-1] <= 128 and tri.dot_precision(q.dtype) == "tf32x3")


def _cpu_kernels(q: torch.Tensor, *more: torch.Tensor, backward: bool = False):
    """``torch.ops.gr_kv`` where its C++ CPU kernels serve these inputs (``auto``, CPU tensors; a gradient
    only where the caller has the C++ backward, ``backward``: the full form), else None.

    NOTE: the reference pads every user to the batch's longest sequence and builds the mask as
    ``[B, S, S]`` tensors; the C++ kernels run each user at its own length, in place. Measured on the
    CPU dev box (docs/BENCHMARKS.md, "The CPU attention"): the main job's recomputation 37.1 ms p50
    a batch through the reference, 8.9 ms here; its cached pass 17.8 and 7.0 ms."""
    if os.environ.get("GR_PLUGIN_ATTENTION", "auto") != "auto" or q.device.type != "cpu":
        return None
    if not backward and _needs_grad(q, *more):
        return None
    return _cpu_ops()


def hstu_attention_jagged(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, seq_offsets: torch.Tensor,
                          num_candidates: torch.Tensor, *, alpha: float, n_norm: float,
                          max_seq_len: int) -> torch.Tensor:
    """Full-sequence HSTU attention ``[T, H, D]``; see the reference for the semantics."""
    grad = _needs_grad(q, k, v)
    if _use_triton(q, k, v, backward=True):
        impl = _triton_training() if grad else _triton_ops()
        return impl.hstu_attention_jagged(q, k, v, seq_offsets, num_candidates, alpha=alpha, n_norm=n_norm,
                                          max_seq_len=max_seq_len)
    cpu = _cpu_kernels(q, k, v, backward=True)
    if cpu is not None:
        # (int64 as the C++ ops require; the reference took any integer type: ``long()`` copies only then)
        if grad:  # training: the C++ forward and backward (`cpu_attention`)
            return cpu_attention.hstu_attention_jagged(q, k, v, seq_offsets.long(), num_candidates.long(),
                                                       alpha=alpha, n_norm=n_norm)
        return cpu.hstu_attention_jagged(q, k, v, seq_offsets.long(), num_candidates.long(), alpha, n_norm)
    return _ref.hstu_attention_jagged(q, k, v, seq_offsets, num_candidates, alpha=alpha, n_norm=n_norm,
                                      max_seq_len=max_seq_len)


def paged_hstu_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, kv_layer: torch.Tensor,
                         kv_indices: torch.Tensor, kv_indptr: torch.Tensor, history_lengths: torch.Tensor,
                         q_offsets: torch.Tensor, new_lengths: torch.Tensor, *, alpha: float, n_norm: float,
                         max_q_len: int, max_history_len: int, num_history_tokens: int,
                         norm_gate: norm.NormGate | None = None, silu_gate: bool = False) -> torch.Tensor:
    """Cached-step HSTU attention over paged history K/V ``[Nq, H, D]``; see the reference for the
    semantics. With ``norm_gate`` it returns ``norm.layer_norm_mul(out.flatten(1), *norm_gate)``
    ``[Nq, H*D]`` (to one rounding step, `triton.layer_norm.sum_layer_norm_mul`). Where the Triton
    kernel and the fused norm both serve, a launch split over the keys adds its fp32 parts inside
    the norm's pass instead of writing the output and reading it back (one kernel fewer).
    ``silu_gate``: the gate's ``u`` is the layer's projection before its SiLU (`HSTULayer.project`
    with ``activate=False``), gated by ``F.silu(u)``: the norm's pass takes it as it loads ``u``."""
    if silu_gate and norm_gate is None:
        raise ValueError("silu_gate=True names the SiLU of norm_gate's u, and norm_gate is None")
    triton_attention = _use_triton(q, k, v, kv_layer)
    impl = _triton_ops() if triton_attention else _ref
    args = (q, k, v, kv_layer, kv_indices, kv_indptr, history_lengths, q_offsets, new_lengths)
    sizes = dict(alpha=alpha, n_norm=n_norm, max_q_len=max_q_len, max_history_len=max_history_len,
                 num_history_tokens=num_history_tokens)
    if norm_gate is None:
        return _unfused(impl, triton_attention, args, sizes)
    weight, bias, eps, u = norm_gate
    if triton_attention and norm.takes_kernel(q, weight, bias, u) and u.shape == (q.shape[0], q.shape[1] * q.shape[2]):
        return impl.paged_hstu_attention(*args, **sizes, norm_gate=tuple(norm_gate), silu_gate=silu_gate)
    out = _unfused(impl, triton_attention, args, sizes)
    return norm.layer_norm_mul(out.flatten(1), weight, bias, eps, u, silu_u=silu_gate)


def _unfused(impl, triton_attention: bool, args: tuple, sizes: dict) -> torch.Tensor:
    """The paged attention's output alone: the Triton kernel's, the C++ CPU kernel's where it serves
    (`_cpu_kernels`), else the reference's."""
    cpu = None if triton_attention else _cpu_kernels(*args[:4])
    if cpu is not None:
        return cpu.paged_hstu_attention(*args[:4], *(t.long() for t in args[4:]), sizes["alpha"], sizes["n_norm"])
    return impl.paged_hstu_attention(*args, **sizes)
