"""Training (``python -m recipes.bench suite=train [train.device=cpu]``): the attention's backward.

Owns the side-by-side measurement of what a training step's attention runs: the kernels with their
backward that ``GR_PLUGIN_ATTENTION=auto`` takes (``kernels``: on CUDA the Triton kernels,
`gr_plugin.ops.triton.hstu_attention_bwd`; on the CPU the gr_kv C++ kernels, `gr_plugin.ops.cpu_attention`)
against the pure-torch reference (``reference``: padded ``[B, H, S, S]`` scores, autograd), same inputs,
one process:
- ``attention``: forward + backward of the attention alone (``dtype``: by default bf16 on CUDA, fp32 on the
  CPU), ms, peak
  device memory (CUDA), and each path's gradient error against the fp32 reference's on the same inputs
  (the largest of dq, dk, dv, relative to its largest value; left out where the oracle does not fit);
- ``stack``: a training step (forward + backward, parameters' gradients) of a layer stack (by default the
  block bench's: 8 layers, hidden 1024, 4 heads; parameters in ``dtype``: bf16 ones on CUDA by default, not
  ``bf16-mixed``'s fp32 ones under autocast), each user a history and its candidates.
Every user of a batch has the same length, so the reference pads nothing (real batches favour the kernels
more). A path that runs out of device memory is recorded as ``oom`` (the reference's scores grow as S^2).
"""

from __future__ import annotations

import contextlib
import logging
import os
import statistics
from typing import Any

import torch

from gr_plugin.bench import common
from gr_plugin.bench.block import _Layout, _offsets, _time_ms
from gr_plugin.cache.config import DTYPE_NAMES, DTYPES
from gr_plugin.modules.hstu import HSTUConfig, HSTULayer, full_stack
from gr_plugin.ops import hstu_attention as attention

logger = logging.getLogger(__name__)

COLUMNS = ["part", "device", "dtype", "head_dim", "batch", "history", "candidates", "reference_ms", "kernels_ms",
           "speedup", "reference_peak_mib", "kernels_peak_mib", "reference_grad_err", "kernels_grad_err"]
PATHS = (("reference", "reference"), ("auto", "kernels"))  # (GR_PLUGIN_ATTENTION, column prefix)
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


def _time(fn, repeats: int, device: str) -> float:
    """Median ms of ``fn``: CUDA events on CUDA, the host's clock on the CPU (after 3 warm-up calls)."""
    if device == "cuda":
        return _time_ms(fn, repeats)
    for _ in range(3):
        fn()
    return statistics.median(common.timed_us(fn, repeats)[0]) / 1e3


def _peak_mib(fn, device: str) -> float | None:
    if device != "cuda":
        fn()
        return None
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


def _attention_row(head_dim: int, bs: int, hist: int, cands: int, heads: int, repeats: int,
                   device: str, dtype: torch.dtype) -> dict[str, Any]:
    g = torch.Generator(device=device).manual_seed(0)
    lens = [hist + cands] * bs
    offsets = _offsets(lens, device)
    num_cands = torch.full((bs,), cands, device=device, dtype=torch.int64)
    n_norm = float(hist + cands)
    q, k, v, dout = (torch.randn(sum(lens), heads, head_dim, device=device, generator=g).to(dtype) for _ in range(4))
    row: dict[str, Any] = {"part": "attention", "device": device, "dtype": DTYPE_NAMES[dtype], "head_dim": head_dim,
                           "batch": bs, "history": hist, "candidates": cands}
    try:  # the oracle: the fp32 reference on the same (rounded) inputs (fp64 where the inputs are fp32)
        oracle = torch.float32 if dtype.itemsize == 2 else torch.float64
        exact = _grads("reference", *(t.to(oracle) for t in (q, k, v)), offsets, num_cands, hist + cands,
                       dout.to(oracle), n_norm)
    except torch.OutOfMemoryError:
        exact = None
        torch.cuda.empty_cache()
    for mode, name in PATHS:
        def step(mode=mode):
            return _grads(mode, q, k, v, offsets, num_cands, hist + cands, dout, n_norm)

        if _measure(row, name, step, repeats, 4, device) and exact is not None:
            got = step()
            row[f"{name}_grad_err"] = max(float((a.double() - b).abs().max() / b.abs().max())
                                          for a, b in zip(got, exact))
    return _speedup(row)


def _measure(row: dict[str, Any], name: str, step, repeats: int, digits: int, device: str) -> bool:
    """``row[name_ms]`` and ``row[name_peak_mib]`` of ``step``, or ``oom`` in both where it ran out."""
    try:
        row[f"{name}_ms"] = round(_time(step, repeats, device), digits)
        peak = _peak_mib(step, device)
        row[f"{name}_peak_mib"] = None if peak is None else round(peak, 1)
        return True
    except torch.OutOfMemoryError:
        row[f"{name}_ms"] = row[f"{name}_peak_mib"] = "oom"
        torch.cuda.empty_cache()
        return False


def _speedup(row: dict[str, Any]) -> dict[str, Any]:
    ref, fast = row.get("reference_ms"), row.get("kernels_ms")
    row["speedup"] = round(ref / fast, 2) if isinstance(ref, float) and isinstance(fast, float) else None
    return row


def _stack_row(head_dim: int, bs: int, hist: int, cands: int, heads: int, layers: int, hidden: int,
               repeats: int, device: str, dtype: torch.dtype) -> dict[str, Any]:
    torch.manual_seed(0)
    cfg = HSTUConfig(embedding_dim=hidden, num_layers=layers, num_heads=heads, head_dim=head_dim, n_norm=4096.0)
    stack = [HSTULayer(cfg, device=torch.device(device)).to(dtype).train() for _ in range(layers)]
    lens = [hist + cands] * bs
    layout = _Layout(_offsets(lens, device), torch.full((bs,), cands, device=device), hist + cands)
    x = torch.randn(sum(lens), hidden, device=device, dtype=dtype)
    row: dict[str, Any] = {"part": "stack", "device": device, "dtype": DTYPE_NAMES[dtype], "head_dim": head_dim,
                           "batch": bs, "history": hist, "candidates": cands}
    for mode, name in PATHS:
        def step(mode=mode):
            for p in (p for layer in stack for p in layer.parameters()):
                p.grad = None
            with _mode(mode):
                out = full_stack(stack, x, layout)
            out.float().square().mean().backward()

        _measure(row, name, step, repeats, 3, device)
    return _speedup(row)


def run(parts=("attention", "stack"), head_dims=(128, 256), batch_sizes=(1, 8), histories=(512, 2048, 4096),
        candidates: int = 256, heads: int = 4, layers: int = 8, hidden: int = 1024, stack_histories=(1024, 4096),
        repeats: int = 10, device: str = "cuda", dtype: str | None = None) -> list[dict[str, Any]]:
    """``dtype`` (None: bfloat16 on CUDA, float32 on the CPU): the inputs' and the stack's parameters'."""
    if device not in ("cuda", "cpu"):
        raise ValueError(f"train.device must be cuda or cpu, got {device!r}")
    name = dtype or ("bfloat16" if device == "cuda" else "float32")
    if name not in DTYPES or (device == "cpu" and name != "float32"):
        allowed = sorted(DTYPES) if device == "cuda" else ["float32"]
        raise ValueError(f"train.dtype on {device} must be one of {allowed} or null, got {dtype!r}")
    torch_dtype = DTYPES[name]
    if device == "cuda" and not torch.cuda.is_available():
        raise RuntimeError("suite=train with train.device=cuda needs a GPU (train.device=cpu measures the CPU path)")
    if device == "cpu":  # (a CPU out-of-memory is no OutOfMemoryError: refuse what cannot fit)
        s_max = max([*histories, *stack_histories]) + candidates
        big = max(batch_sizes) * heads * s_max**2 * 8  # the fp64 oracle's padded scores, one tensor
        if big > 2**31:
            raise ValueError(f"train.device=cpu at batch {max(batch_sizes)}, {heads} heads and {s_max} tokens a "
                             f"user needs {big / 2**30:.1f} GiB per score tensor: pick smaller sizes (the "
                             f"docs' command: docs/BENCHMARKS.md, 'CPU training')")
    unknown = set(parts) - {"attention", "stack"}
    if unknown:
        raise ValueError(f"unknown parts {sorted(unknown)}; choose from attention, stack")
    rows = []
    for part in parts:
        for dim in head_dims:
            for bs in batch_sizes:
                for hist in (histories if part == "attention" else stack_histories):
                    if part == "attention":
                        row = _attention_row(dim, bs, hist, candidates, heads, repeats, device, torch_dtype)
                    else:
                        row = _stack_row(dim, bs, hist, candidates, heads, layers, hidden, repeats, device,
                                         torch_dtype)
                    logger.info("%s", row)
                    rows.append(row)
                    if device == "cuda":
                        torch.cuda.empty_cache()
    return rows
