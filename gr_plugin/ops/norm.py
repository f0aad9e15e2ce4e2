"""Dispatch of ``LayerNorm(a) * u`` (the HSTU layer's norm of the attention output, gated by ``u``):
the fused Triton kernel for CUDA inference, else the torch ops, which also define the semantics.

The torch form serves autograd (training), CPU tensors and graph capture by ``torch.compile`` /
``torch.export`` (Inductor fuses it there itself, and the exported graph stays free of Python
kernels). ``GR_PLUGIN_FUSED_NORM=0`` selects the torch form everywhere.
"""

from __future__ import annotations

import functools
import os

import torch
import torch.nn.functional as F


@functools.cache
def _triton_kernel():
    try:
        from gr_plugin.ops.triton.layer_norm import layer_norm_mul
    except Exception:
        return None
    return layer_norm_mul


def _check(a: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor, u: torch.Tensor) -> None:
    if a.dim() != 2 or u.shape != a.shape:
        raise ValueError(f"a and u must be [M, N] of one shape, got {tuple(a.shape)} and {tuple(u.shape)}")
    n = a.shape[1]
    if weight.shape != (n,) or bias.shape != (n,):
        raise ValueError(f"weight and bias must be [{n}], got {tuple(weight.shape)} and {tuple(bias.shape)}")
    if u.dtype != a.dtype or u.device != a.device:
        raise ValueError(f"u is {u.dtype} on {u.device}, a is {a.dtype} on {a.device}")


def use_fused(a: torch.Tensor, *params: torch.Tensor) -> bool:
    """Whether the fused kernel serves these inputs: CUDA, no gradient wanted, not being traced."""
    if os.environ.get("GR_PLUGIN_FUSED_NORM", "1") == "0" or not a.is_cuda:
        return False
    if torch.is_grad_enabled() and any(t.requires_grad for t in (a, *params)):
        return False
    return not torch.compiler.is_compiling() and _triton_kernel() is not None


def layer_norm_mul(a: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor, eps: float,
                   u: torch.Tensor, fused: bool | None = None) -> torch.Tensor:
    """``LayerNorm(a; weight, bias, eps) * u`` for ``a, u [M, N]`` (last dimension contiguous).
    ``fused`` None picks the kernel by `use_fused`; True forces the Triton kernel (tests)."""
    _check(a, weight, bias, u)
    if fused is None:
        fused = use_fused(a, weight, bias, u)
    if fused and a.stride(-1) == 1 and u.stride(-1) == 1:
        return _triton_kernel()(a, weight, bias, eps, u)
    return F.layer_norm(a, (a.shape[1],), weight, bias, eps) * u
