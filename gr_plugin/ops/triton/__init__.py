"""Triton kernels (GPU; also run by the CPU tests under ``TRITON_INTERPRET=1``)."""

from __future__ import annotations

import os

import torch
import triton
import triton.language as tl
from triton.language.extra import libdevice


def table_layout(kv: torch.Tensor, layer: int | None) -> tuple[int, tuple[int, ...]]:
    """``(layer_pages, (stride_pp, stride_pkv, stride_pt, stride_ph))`` of a paged K/V table for the
    kernels: ``kv`` is one layer ``[num_pages, 2, P, H, D]`` (``layer`` None) or the whole table
    ``[L, num_pages, 2, P, H, D]`` and ``layer`` one of its layers. The kernels take the whole table
    itself, not a per-layer view, so a compiled graph (Inductor, AOTInductor) mutates its input in
    place instead of copying the table around each layer's write; page ``p`` of layer ``layer`` is
    page ``layer_pages + p`` of the table seen as ``[L * num_pages, 2, P, H, D]``."""
    if layer is None:
        if kv.dim() != 5:
            raise ValueError(f"kv_layer must be [num_pages, 2, P, H, D], got {tuple(kv.shape)}")
        return 0, tuple(kv.stride()[:4])
    if kv.dim() != 6:
        raise ValueError(f"kv_table must be [L, num_pages, 2, P, H, D], got {tuple(kv.shape)}")
    if not 0 <= layer < kv.shape[0]:
        raise ValueError(f"layer {layer} is outside [0, {kv.shape[0]}) (layers of kv_table)")
    if kv.stride(0) != kv.shape[1] * kv.stride(1):
        raise ValueError(f"kv_table's layers must follow each other page after page, got shape {tuple(kv.shape)} "
                         f"and strides {kv.stride()}")
    return layer * kv.shape[1], tuple(kv.stride()[1:5])


def tma_covers(kv: torch.Tensor) -> bool:
    """Whether one TMA descriptor covers the paged table ``kv`` seen as rows of ``H * D`` elements
    (what the attention kernels' TMA loads read): contiguous 16-bit values, not empty, a 16-byte
    aligned base, fewer than 2^31 rows (the descriptor's coordinates are 32-bit)."""
    return (kv.is_contiguous() and kv.dtype.itemsize == 2 and kv.numel() > 0 and kv.data_ptr() % 16 == 0
            and kv.numel() // kv.stride(-3) < 2 ** 31)


def tma_covers_rows(t: torch.Tensor) -> bool:
    """Whether one TMA descriptor covers keys or values ``t [T, H, D]`` seen as ``T`` rows of ``H * D``
    elements (the full pass's loads in the Gluon kernel): 16-bit values, heads packed (``D`` apart, the
    last dimension contiguous), rows and base 16-byte aligned, ``0 < T < 2^31``."""
    return (t.dim() == 3 and t.dtype.itemsize == 2 and t.stride(2) == 1 and t.stride(1) == t.shape[2]
            and 0 < t.shape[0] < 2 ** 31 and t.shape[1] * t.shape[2] > 0 and t.stride(0) % 8 == 0
            and t.data_ptr() % 16 == 0)


# GR_PLUGIN_EXACT_SILU=1: the kernels that take a layer's projection before its SiLU (`silu`) use torch's
# formula with libdevice's exp and a correctly rounded division (torch's bits) instead of the approximate
# ones. NOTE: off by default. Measured on the H200 (docs/BENCHMARKS.md, scripts/gpu/tune_silu_append.py):
# the exact form cost 0.3-3.6 us a layer more, and the approximate one gave torch's bits in every case there.
EXACT_SILU = os.environ.get("GR_PLUGIN_EXACT_SILU", "0") == "1"


def exact_silu(t: torch.Tensor) -> bool:
    """`silu`'s ``EXACT`` for a launch on ``t``: `EXACT_SILU` on CUDA (the interpreter has no libdevice)."""
    return EXACT_SILU and t.is_cuda


@triton.jit
def silu(x, EXACT: tl.constexpr):
    """``SiLU(x)`` of a loaded tensor in fp32 (the caller rounds it to the tensor's dtype, as torch's
    ``F.silu`` rounds its output): ``x / (1 + exp(-x))``. ``EXACT``: torch's bits, with libdevice's
    ``expf`` (the accurate one torch's CUDA kernel calls) and a correctly rounded division; else
    ``tl.exp`` and Triton's division (what the interpreter runs, with numpy's exp)."""
    x = x.to(tl.float32)
    if EXACT:
        return tl.math.div_rn(x, 1.0 + libdevice.exp(-x))
    return x / (1.0 + tl.exp(-x))
