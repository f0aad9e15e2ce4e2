"""Jagged <-> padded conversions and offsets, on fbgemm where it has a kernel for the device.

Owns the choice between ``torch.ops.fbgemm.*`` and the pure-torch fallback: fbgemm's CPU build has
no CUDA kernels (and rejects float64), so each call checks the dispatcher for the tensor's device
and dtype. Shapes: ``values [T, *F]`` jagged by ``offsets [B+1]``; ``padded [B, max_len, *F]``.
"""

from __future__ import annotations

import functools

import torch

try:  # registers torch.ops.fbgemm.*
    import fbgemm_gpu  # noqa: F401

    _FBGEMM = True
except Exception:
    _FBGEMM = False


@functools.cache
def _fbgemm_has(op: str, device_type: str) -> bool:
    if not _FBGEMM:
        return False
    key = {"cpu": "CPU", "cuda": "CUDA"}.get(device_type)
    if key is None:
        return False
    try:
        return torch._C._dispatch_has_kernel_for_dispatch_key(f"fbgemm::{op}", key)
    except RuntimeError:
        return False


def _use_fbgemm(op: str, t: torch.Tensor) -> bool:
    return t.dtype not in (torch.float64,) and _fbgemm_has(op, t.device.type)


def complete_cumsum(lengths: torch.Tensor) -> torch.Tensor:
    """``[B] -> [B+1]`` offsets starting at 0 (int64)."""
    lengths = lengths.to(torch.int64)
    if _use_fbgemm("asynchronous_complete_cumsum", lengths):
        return torch.ops.fbgemm.asynchronous_complete_cumsum(lengths)
    return torch.nn.functional.pad(torch.cumsum(lengths, 0), (1, 0))


def jagged_to_padded(values: torch.Tensor, offsets: torch.Tensor, max_len: int,
                     padding_value: float = 0.0) -> torch.Tensor:
    """``[T, *F]`` jagged by ``offsets`` -> ``[B, max_len, *F]`` (rows past a length are padding)."""
    feat = values.shape[1:]
    flat = values.reshape(values.shape[0], -1)
    bsz = offsets.numel() - 1
    if _use_fbgemm("jagged_to_padded_dense_forward", flat):
        out = torch.ops.fbgemm.jagged_to_padded_dense(flat, [offsets], [max_len], padding_value)
    else:
        lengths = offsets[1:] - offsets[:-1]
        batch = torch.repeat_interleave(torch.arange(bsz, device=values.device), lengths,
                                        output_size=values.shape[0])
        pos = torch.arange(values.shape[0], device=values.device) - offsets[:-1][batch]
        out = flat.new_full((bsz, max_len, flat.shape[1]), padding_value)
        keep = pos < max_len
        out[batch[keep], pos[keep]] = flat[keep]
    return out.view(bsz, max_len, *feat)


def padded_to_jagged(padded: torch.Tensor, offsets: torch.Tensor, total: int) -> torch.Tensor:
    """``[B, max_len, *F]`` -> ``[total, *F]`` keeping the first ``length`` rows of each batch."""
    bsz, max_len = padded.shape[:2]
    feat = padded.shape[2:]
    flat = padded.reshape(bsz, max_len, -1)
    if _use_fbgemm("dense_to_jagged_forward", flat):
        out = torch.ops.fbgemm.dense_to_jagged(flat, [offsets], total)[0]
    else:
        lengths = offsets[1:] - offsets[:-1]
        batch = torch.repeat_interleave(torch.arange(bsz, device=padded.device), lengths, output_size=total)
        pos = torch.arange(total, device=padded.device) - offsets[:-1][batch]
        out = flat[batch, pos]
    return out.reshape(total, *feat)
