"""Dispatch of the HSTU layer's fused norms: the Triton kernels for CUDA inference, else the torch
ops, which also define the semantics.
- ``layer_norm_mul``: ``LayerNorm(a) * u`` (the norm of the attention output, gated by ``u``);
- ``add_layer_norm``: the residual add ``y = x + o`` and the next layer's input norm of ``y``;
- ``NormGate``: the first as an attention op's epilogue (the split attention adds its parts in it).

The torch form serves autograd (training), CPU tensors and graph capture by ``torch.compile`` /
``torch.export`` (Inductor fuses it there itself, and the exported graph stays free of Python
kernels). ``GR_PLUGIN_FUSED_NORM=0`` selects the torch form everywhere.
"""

from __future__ import annotations

import functools
import os
from typing import NamedTuple

import torch
import torch.nn.functional as F


class NormGate(NamedTuple):
    """The HSTU layer's ``LayerNorm(a; weight, bias, eps) * u`` as an epilogue an attention op takes
    (`gr_plugin.ops.paged_hstu_attention`'s ``norm_gate``)."""

    weight: torch.Tensor
    bias: torch.Tensor
    eps: float
    u: torch.Tensor


@functools.cache
def _triton_kernels():
    try:
        from gr_plugin.ops.triton import layer_norm
    except Exception:
        return None
    return layer_norm


def _check(a: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor, u: torch.Tensor, names: str = "au") -> None:
    na, nu = names
    if a.dim() != 2 or u.shape != a.shape:
        raise ValueError(f"{na} and {nu} must be [M, N] of one shape, got {tuple(a.shape)} and {tuple(u.shape)}")
    n = a.shape[1]
    if weight.shape != (n,) or bias.shape != (n,):
        raise ValueError(f"weight and bias must be [{n}], got {tuple(weight.shape)} and {tuple(bias.shape)}")
    if u.device != a.device:
        raise ValueError(f"{nu} is on {u.device}, {na} is on {a.device}")


def _kernel_serves(*ts: torch.Tensor | None) -> bool:
    """One dtype (mixed ones, e.g. an fp32 residual stream and bf16 matmul outputs under autocast,
    take the torch form, which promotes) and contiguous rows."""
    ts = tuple(t for t in ts if t is not None)
    return all(t.dtype == ts[0].dtype and t.stride(-1) == 1 for t in ts)


def use_fused(a: torch.Tensor, *params: torch.Tensor) -> bool:
    """Whether the fused kernel serves these inputs: CUDA, no gradient wanted, not being traced."""
    if os.environ.get("GR_PLUGIN_FUSED_NORM", "1") == "0" or not a.is_cuda:
        return False
    if torch.is_grad_enabled() and any(t.requires_grad for t in (a, *params)):
        return False
    return not torch.compiler.is_compiling() and _triton_kernels() is not None


def takes_kernel(a: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor, u: torch.Tensor,
                 fused: bool | None = None) -> bool:
    """Whether `layer_norm_mul` runs the Triton kernel for these inputs (``fused`` as there); an
    attention op with a `NormGate` epilogue asks the same before it fuses its parts' sum in."""
    if fused is None:
        fused = use_fused(a, weight, bias, u)
    return fused and _kernel_serves(a, u)


def layer_norm_mul(a: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor, eps: float,
                   u: torch.Tensor, fused: bool | None = None, silu_u: bool = False) -> torch.Tensor:
    """``LayerNorm(a; weight, bias, eps) * u`` for ``a, u [M, N]`` (last dimension contiguous);
    ``* F.silu(u)`` with ``silu_u`` (``u`` a layer's pre-SiLU projection: the kernel applies it in
    its pass). ``fused`` None picks the kernel by `use_fused`; True forces the Triton kernel (tests)."""
    _check(a, weight, bias, u)
    if takes_kernel(a, weight, bias, u, fused):
        return _triton_kernels().layer_norm_mul(a, weight, bias, eps, u, silu_u)
    return F.layer_norm(a, (a.shape[1],), weight, bias, eps) * (F.silu(u) if silu_u else u)


def add_layer_norm(x: torch.Tensor, o: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor, eps: float,
                   out: torch.Tensor | None = None, normed_out: torch.Tensor | None = None,
                   fused: bool | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """``(y, LayerNorm(y; weight, bias, eps))`` with ``y = x + o`` for ``x, o [M, N]`` (last
    dimension contiguous), written into ``out`` / ``normed_out`` when given (static buffers).
    ``fused`` as for `layer_norm_mul`."""
    _check(x, weight, bias, o, "xo")
    for name, t in (("out", out), ("normed_out", normed_out)):
        if t is not None and (t.shape != x.shape or t.dtype != x.dtype or t.device != x.device):
            raise ValueError(f"{name} must be {tuple(x.shape)} {x.dtype} on {x.device}, got {tuple(t.shape)} "
                             f"{t.dtype} on {t.device}")
    if fused is None:
        fused = use_fused(x, o, weight, bias)
    if fused and _kernel_serves(x, o, out, normed_out):
        return _triton_kernels().add_layer_norm(x, o, weight, bias, eps, out, normed_out)
    y = x + o if out is None else torch.add(x, o, out=out)
    z = F.layer_norm(y, (y.shape[1],), weight, bias, eps)
    return y, z if normed_out is None else normed_out.copy_(z)
