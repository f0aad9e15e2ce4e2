"""Triton kernels (GPU; also run by the CPU tests under ``TRITON_INTERPRET=1``).

Owns what the kernels share: the paged table's layout (`table_layout`) and programmatic dependent
launch (`pdl`, `wait_inputs`).
"""

from __future__ import annotations

import os

import torch
import triton
import triton.language as tl

# GR_PLUGIN_PDL=0: the kernels launch as plain stream launches (`pdl`).
PDL = os.environ.get("GR_PLUGIN_PDL", "1") == "1"
_HOPPER: dict[int, bool] = {}


def pdl(t: torch.Tensor) -> bool:
    """Whether a kernel writing ``t`` launches with programmatic dependent launch (CUDA on Hopper or
    newer, eager or captured into a CUDA graph; not a traced launch, whose wrapper Inductor writes):
    it may start while the kernel before it on the stream finishes, and waits for that kernel's
    results in `wait_inputs` before reading anything (its launch and scheduling overlap the other's
    tail instead of following it). ``PDL`` (``GR_PLUGIN_PDL=0``) turns it off."""
    if not (PDL and t.is_cuda) or torch.compiler.is_compiling():
        return False
    idx = t.device.index
    if idx not in _HOPPER:
        _HOPPER[idx] = torch.cuda.get_device_capability(idx)[0] >= 9
    return _HOPPER[idx]


def pdl_options(t: torch.Tensor) -> dict:
    """The launch keywords of a kernel taking ``PDL: tl.constexpr`` (`pdl`)."""
    return {"PDL": True, "launch_pdl": True} if pdl(t) else {"PDL": False}


@triton.jit
def wait_inputs(PDL: tl.constexpr):
    """First statement of every program of a kernel launched with ``launch_pdl``: wait until the
    kernel before it on the stream has finished and its writes are visible, then let the next kernel
    launch. NOTE: before any load and before any early return, in every program: then a kernel
    finishes only after the one before it has, so the order holds along a chain of such launches
    (the next kernel may read what any earlier one wrote), and the early trigger lets the next
    kernel's programs be scheduled, waiting, while this one's last programs run."""
    if PDL:
        tl.extra.cuda.gdc_wait()
        tl.extra.cuda.gdc_launch_dependents()


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
