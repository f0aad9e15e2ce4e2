"""Training on a GPU (``python -m recipes.bench suite=train``): the attention's backward.

Owns the side-by-side measurement of what a training step's attention runs on CUDA: the Triton kernels
with their backward (`gr_plugin.ops.triton.hstu_attention_bwd`, what ``GR_PLUGIN_ATTENTION=auto`` takes)
against the pure-torch reference (``reference``: padded ``[B, H, S, S]`` scores, autograd), same inputs,
one process:
- ``attention``: forward + backward of the attention alone in bf16, ms, peak memory, and each path's
  gradient error against the fp32 reference's on the same bf16 inputs (the largest of dq, dk, dv, relative
  to its largest value; left out where the oracle does not fit);
- ``stack``: a training step (forward + backward, parameters' gradients) of the block bench's layer
  stack (8 layers, hidden 1024, 4 heads), bf16 parameters (not ``bf16-mixed``'s fp32 ones under
  autocast), each user a history and its candidates.
A path that runs out of device memory is recorded as ``oom`` (the reference's padded scores grow as S^2).
"""

from __future__ import annotations

import contextlib
import logging
import os
from typing import Any

import torch

from gr_plugin.bench.block import _Layout, _offsets, _time_ms
from gr_plugin.modules.hstu import HSTUConfig, HSTULayer, full_stack
from gr_plugin.ops import hstu_attention as attention

logger = logging.getLogger(__name__)

COLUMNS = ["part", "head_dim", "batch", "history", "candidates", "reference_ms", "triton_ms", "speedup",
           "reference_peak_mib", "triton_peak_mib", "reference_grad_err", "triton_grad_err"]
ALPHA = 0.35  # (a scale of the order 1 / sqrt(head_dim) * a few: scores of the order of 1)


@contextlib.contextmanager
def _mode(mode: str):
    old = os.environ.get("GR_PLUGIN_ATTENTION")
    os.environ["GR_PLUGIN_ATTENTION"] = mode
    try:
        yield
    finally:
        if old is None:
            os.environ.pop("GR_PLUGIN_ATTENTION", None)
        else:
            os.environ["GR_PLUGIN_ATTENTION"] = old


def _peak_mib(fn) -> float:
    torch.cuda.synchronize()
    torch.cuda.reset_peak_memory_stats()
    base = torch.cuda.memory_allocated()
    fn()
    torch.cuda.synchronize()
    return (torch.cuda.max_memory_allocated() - base) / 2**20


def _grads(mode: str, q, k, v, offsets, cands, max_len, dout, n_norm):
    leaves = [t.detach().clone().requires_grad_() for t in (q, k, v)]
    with _mode(mode):
        out = attention.hstu_attention_jagged(*leaves, offsets, cands, alpha=ALPHA, n_norm=n_norm,
                                              max_seq_len=max_len)
    out.backward(dout)
    return [t.grad for t in leaves]


def _attention_row(head_dim: int, bs: int, hist: int, cands: int, heads: int, repeats: int) -> dict[str, Any]:
    g = torch.Generator(device="cuda").manual_seed(0)
    lens = [hist + cands] * bs
    offsets = _offsets(lens)
    num_cands = torch.full((bs,), cands, device="cuda", dtype=torch.int64)
    n_norm = float(hist + cands)
    q, k, v, dout = (torch.randn(sum(lens), heads, head_dim, device="cuda", generator=g).bfloat16() for _ in range(4))
    row: dict[str, Any] = {"part": "attention", "head_dim": head_dim, "batch": bs, "history": hist,
                           "candidates": cands}
    try:  # the oracle: the fp32 reference on the same (bf16-rounded) inputs
        exact = _grads("reference", *(t.float() for t in (q, k, v)), offsets, num_cands, hist + cands, dout.float(),
                       n_norm)
    except torch.OutOfMemoryError:
        exact = None
        torch.cuda.empty_cache()
    for mode, name in (("reference", "reference"), ("auto", "triton")):
        def step(mode=mode):
            return _grads(mode, q, k, v, offsets, num_cands, hist + cands, dout, n_norm)

        if _measure(row, name, step, repeats, 4) and exact is not None:
            got = step()
            row[f"{name}_grad_err"] = max(float((a.float() - b).abs().max() / b.abs().max())
                                          for a, b in zip(got, exact))
    return _speedup(row)


def _measure(row: dict[str, Any], name: str, step, repeats: int, digits: int) -> bool:
    """``row[name_ms]`` and ``row[name_peak_mib]`` of ``step``, or ``oom`` in both where it ran out."""
    try:
        row[f"{name}_ms"] = round(_time_ms(step, repeats), digits)
        row[f"{name}_peak_mib"] = round(_peak_mib(step), 1)
        return True
    except torch.OutOfMemoryError:
        row[f"{name}_ms"] = row[f"{name}_peak_mib"] = "oom"
        torch.cuda.empty_cache()
        return False


def _speedup(row: dict[str, Any]) -> dict[str, Any]:
    ref, tri = row.get("reference_ms"), row.get("triton_ms")
    row["speedup"] = round(ref / tri, 2) if isinstance(ref, float) and isinstance(tri, float) else None
    return row


def _stack_row(head_dim: int, bs: int, hist: int, cands: int, heads: int, layers: int, hidden: int,
               repeats: int) -> dict[str, Any]:
    torch.manual_seed(0)
    cfg = HSTUConfig(embedding_dim=hidden, num_layers=layers, num_heads=heads, head_dim=head_dim, n_norm=4096.0)
    stack = [HSTULayer(cfg, device=torch.device("cuda")).bfloat16().train() for _ in range(layers)]
    lens = [hist + cands] * bs
    layout = _Layout(_offsets(lens), torch.full((bs,), cands, device="cuda"), hist + cands)
    x = torch.randn(sum(lens), hidden, device="cuda", dtype=torch.bfloat16)
    row: dict[str, Any] = {"part": "stack", "head_dim": head_dim, "batch": bs, "history": hist, "candidates": cands}
    for mode, name in (("reference", "reference"), ("auto", "triton")):
        def step(mode=mode):
            for p in (p for layer in stack for p in layer.parameters()):
                p.grad = None
            with _mode(mode):
                out = full_stack(stack, x, layout)
            out.float().square().mean().backward()

        _measure(row, name, step, repeats, 3)
    return _speedup(row)


def run(parts=("attention", "stack"), head_dims=(128, 256), batch_sizes=(1, 8), histories=(512, 2048, 4096),
        candidates: int = 256, heads: int = 4, layers: int = 8, hidden: int = 1024, stack_histories=(1024, 4096),
        repeats: int = 10) -> list[dict[str, Any]]:
    if not torch.cuda.is_available():
        raise RuntimeError("suite=train measures the CUDA training path: it needs a GPU")
    unknown = set(parts) - {"attention", "stack"}
    if unknown:
        raise ValueError(f"unknown parts {sorted(unknown)}; choose from attention, stack")
    rows = []
    for part in parts:
        for dim in head_dims:
            for bs in batch_sizes:
                for hist in (histories if part == "attention" else stack_histories):
                    if part == "attention":
                        row = _attention_row(dim, bs, hist, candidates, heads, repeats)
                    else:
                        row = _stack_row(dim, bs, hist, candidates, heads, layers, hidden, repeats)
                    logger.info("%s", row)
                    rows.append(row)
                    torch.cuda.empty_cache()
    return rows
