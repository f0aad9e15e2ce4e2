"""The ``gr_kv`` custom-op namespace: the Python side of the tensor-only ops the exported graph calls.

The op schemas (frozen once released: see docs/EXPORT.md), their boundary checks and their CPU kernels
live in C++ (``gr_plugin/csrc/gr_kv_ops.cpp``, built and loaded on first import by
`gr_plugin.csrc.build`), so a compiled package runs them without Python. This module owns what stays
in Python: the fake (meta) kernels, and the CUDA kernels (the Triton kernels of
``gr_plugin.ops.triton``) registered onto the C++-defined ops. Stateful cache policy (lookup, LRU,
allocation) stays outside the graph; the graph sees the cache table and small metadata tensors only.

- ``gr_kv::append_kv(kv_layer!, k, v, slots, rows) -> ()``: token ``i`` = row ``rows[i]`` of ``k``/``v``
  ``[M, H, D]`` is written at ``slots[i]`` of ``kv_layer [num_pages, 2, P, H, D]``.
- ``gr_kv::paged_hstu_attention(q, k, v, kv_layer, kv_indices, kv_indptr, history_lengths,
  q_offsets, new_lengths, alpha, n_norm) -> Tensor [Nq, H, D]``.
- ``gr_kv::hstu_attention_jagged(q, k, v, seq_offsets, num_candidates, alpha, n_norm) -> [T, H, D]``, and
  ``gr_kv::hstu_attention_jagged_backward(grad_out, q, k, v, seq_offsets, num_candidates, alpha, n_norm)
  -> (dq, dk, dv)``, its gradient (CPU only: what CPU training runs, `gr_plugin.ops.cpu_attention`).
- ``gr_kv::append_kv_layer(kv_table!, layer, k, v, slots, rows)`` and
  ``gr_kv::paged_hstu_attention_layer(q, k, v, kv_table, layer, ...)``: the two ops above on layer
  ``layer`` of the whole table ``[L, num_pages, 2, P, H, D]`` (what the exported stack calls: a graph
  then mutates the table itself, not a per-layer view; see gr_plugin/export/stack.py).
- ``gr_kv::gather_pages(kv_table, pages) -> [L, M, 2, P, H, D]``: pages ``pages [M]`` of every layer of
  ``kv_table [L, num_pages, 2, P, H, D]``, as one contiguous staging tensor (what an offload reads).
- ``gr_kv::scatter_pages(kv_table!, staging, pages) -> ()``: the reverse (what an onboard writes);
  ``pages`` must be distinct. One C++ kernel (ATen index ops) serves every device; on CUDA the page
  ids are not checked (range, duplicates), as for the other ops' index values.
On the CPU the C++ kernels read the (host) metadata; on CUDA the sizes the Triton kernels need as host
ints are upper bounds from tensor shapes, so no op syncs the device.

How the CUDA kernels reach an AOTInductor package: ``torch.library.triton_op`` cannot be used (it
defines the op itself, in Python, and these schemas are defined in C++), so this module does what it
does for an existing op: a ``FunctionalTensorMode`` rule (``register_torch_dispatch``) that, when
Inductor (not ``torch.export``) traces a CUDA call, decomposes it into the Triton launch with the
kernels wrapped in ``torch.library.wrap_triton``. The package then holds the compiled kernels (no
call back into Python); CPU calls stay opaque and run the C++ kernels. See docs/EXPORT.md.
"""

from __future__ import annotations

import functools
import types

import torch

from gr_plugin.csrc.build import load_library

LIBRARY_PATH = load_library()  # defines the gr_kv schemas and CPU kernels (C++)


def _check_table(kv_layer: torch.Tensor, k: torch.Tensor, name: str = "k") -> None:
    if kv_layer.dim() != 5 or kv_layer.shape[1] != 2:
        raise ValueError(f"kv_layer must be [num_pages, 2, P, H, D], got {tuple(kv_layer.shape)}")
    if k.dim() != 3 or tuple(k.shape[1:]) != tuple(kv_layer.shape[3:]):
        raise ValueError(f"{name} must be [M, {kv_layer.shape[3]}, {kv_layer.shape[4]}], got {tuple(k.shape)}")
    if k.dtype != kv_layer.dtype or k.device != kv_layer.device:
        raise ValueError(f"{name} is {k.dtype} on {k.device}, kv_layer is {kv_layer.dtype} on {kv_layer.device}")


def _check_index(name: str, t: torch.Tensor, device: torch.device) -> None:
    if t.dtype != torch.int64 or t.dim() != 1:
        raise ValueError(f"{name} must be a 1-D int64 tensor, got {t.dtype} of shape {tuple(t.shape)}")
    if t.device != device:
        raise ValueError(f"{name} is on {t.device}, expected {device}")


# NOTE: the CUDA kernels repeat the C++ checks that need no device data (dtypes, devices, shapes), with
# the same messages; value checks (offsets, lengths, page ids) would sync the device, so CUDA skips them.
def check_append(kv_layer, k, v, slots, rows) -> None:
    _check_table(kv_layer, k, "k")
    _check_table(kv_layer, v, "v")
    for name, t in (("slots", slots), ("rows", rows)):
        _check_index(name, t, kv_layer.device)
    if slots.numel() != rows.numel():
        raise ValueError(f"slots has {slots.numel()} entries, rows has {rows.numel()}")


def check_paged(q, k, v, kv_layer, kv_indices, kv_indptr, history_lengths, q_offsets, new_lengths) -> None:
    _check_table(kv_layer, k)
    if q.shape != k.shape or v.shape != k.shape:
        raise ValueError(f"q, k, v must share a shape, got {tuple(q.shape)}, {tuple(k.shape)}, {tuple(v.shape)}")
    for name, t in (("kv_indices", kv_indices), ("kv_indptr", kv_indptr), ("history_lengths", history_lengths),
                    ("q_offsets", q_offsets), ("new_lengths", new_lengths)):
        _check_index(name, t, q.device)


def check_jagged(q, k, v, seq_offsets, num_candidates) -> None:
    if q.shape != k.shape or v.shape != k.shape or q.dim() != 3:
        raise ValueError(f"q, k, v must share a [T, H, D] shape, got {tuple(q.shape)}, {tuple(k.shape)}")
    for name, t in (("seq_offsets", seq_offsets), ("num_candidates", num_candidates)):
        _check_index(name, t, q.device)


@torch.library.register_fake("gr_kv::append_kv")
def _(kv_layer, k, v, slots, rows) -> None:
    return None


@torch.library.register_fake("gr_kv::paged_hstu_attention")
def _(q, k, v, kv_layer, kv_indices, kv_indptr, history_lengths, q_offsets, new_lengths, alpha, n_norm):
    return torch.empty_like(q)


@torch.library.register_fake("gr_kv::hstu_attention_jagged")
def _(q, k, v, seq_offsets, num_candidates, alpha, n_norm):
    return torch.empty_like(q)


@torch.library.register_fake("gr_kv::hstu_attention_jagged_backward")
def _(grad_out, q, k, v, seq_offsets, num_candidates, alpha, n_norm):
    return tuple(torch.empty_like(q, memory_format=torch.contiguous_format) for _ in range(3))


def _layer(kv_table: torch.Tensor, layer: int) -> torch.Tensor:
    if kv_table.dim() != 6:
        raise ValueError(f"kv_table must be [L, num_pages, 2, P, H, D], got {tuple(kv_table.shape)}")
    if not 0 <= layer < kv_table.shape[0]:
        raise ValueError(f"layer {layer} is outside [0, {kv_table.shape[0]}) (layers of kv_table)")
    return kv_table.select(0, layer)


@torch.library.register_fake("gr_kv::append_kv_layer")
def _(kv_table, layer, k, v, slots, rows) -> None:
    _layer(kv_table, layer)  # a bad layer fails when traced, not only when run
    return None


@torch.library.register_fake("gr_kv::paged_hstu_attention_layer")
def _(q, k, v, kv_table, layer, kv_indices, kv_indptr, history_lengths, q_offsets, new_lengths, alpha, n_norm):
    _layer(kv_table, layer)
    return torch.empty_like(q)


@torch.library.register_fake("gr_kv::gather_pages")
def _(kv_table, pages):
    return kv_table.new_empty((kv_table.shape[0], pages.shape[0], *kv_table.shape[2:]))


@torch.library.register_fake("gr_kv::scatter_pages")
def _(kv_table, staging, pages) -> None:
    return None


@functools.cache
def _triton(name: str) -> types.ModuleType:
    """A Triton module, imported on the first CUDA call (import-safe on CPU-only machines)."""
    if name == "append_kv":
        from gr_plugin.ops.triton import append_kv as mod
    else:
        from gr_plugin.ops.triton import hstu_attention as mod
    return mod


# ---- eager CUDA kernels: the Triton launchers, called directly ----

def _paged_cuda(tri, q, k, v, kv, kv_indices, kv_indptr, history_lengths, q_offsets, new_lengths, alpha,
                n_norm, layer=None, **kw):
    """``kv``: one layer's table, or the whole table and ``layer`` (the kernel gets the whole table)."""
    kv_layer = kv if layer is None else _layer(kv, layer)
    check_paged(q, k, v, kv_layer, kv_indices, kv_indptr, history_lengths, q_offsets, new_lengths)
    # (the table's capacity bounds the histories without a sync, loosely: the split rule only caps by it)
    return tri.paged_hstu_attention(q, k, v, kv, kv_indices, kv_indptr, history_lengths, q_offsets,
                                    new_lengths, alpha=alpha, n_norm=n_norm, max_q_len=q.shape[0],
                                    max_history_len=kv_layer.shape[0] * kv_layer.shape[2], num_history_tokens=0,
                                    layer=layer, tight_kv_len=False, **kw)


def _append_cuda(tri, kv, k, v, slots, rows, layer=None) -> None:
    check_append(kv if layer is None else _layer(kv, layer), k, v, slots, rows)
    tri.append_kv(kv, k, v, slots, rows, layer=layer)


def _jagged_cuda(tri, q, k, v, seq_offsets, num_candidates, alpha, n_norm, **kw):
    check_jagged(q, k, v, seq_offsets, num_candidates)
    return tri.hstu_attention_jagged(q, k, v, seq_offsets, num_candidates, alpha=alpha, n_norm=n_norm,
                                     max_seq_len=q.shape[0], **kw)


@torch.library.register_kernel("gr_kv::append_kv", "cuda")
def _(kv_layer, k, v, slots, rows) -> None:
    _append_cuda(_triton("append_kv"), kv_layer, k, v, slots, rows)


@torch.library.register_kernel("gr_kv::paged_hstu_attention", "cuda")
def _(*args):
    return _paged_cuda(_triton("hstu_attention"), *args)


@torch.library.register_kernel("gr_kv::hstu_attention_jagged", "cuda")
def _(*args):
    return _jagged_cuda(_triton("hstu_attention"), *args)


@torch.library.register_kernel("gr_kv::append_kv_layer", "cuda")
def _(kv_table, layer, k, v, slots, rows) -> None:
    _append_cuda(_triton("append_kv"), kv_table, k, v, slots, rows, layer=layer)


@torch.library.register_kernel("gr_kv::paged_hstu_attention_layer", "cuda")
def _(q, k, v, kv_table, layer, *rest):
    return _paged_cuda(_triton("hstu_attention"), q, k, v, kv_table, *rest, layer=layer)


# ---- CUDA inside compiled graphs: the same launchers, their kernels wrapped with wrap_triton ----

@functools.cache
def traceable_triton(name: str) -> types.SimpleNamespace:
    """The functions of Triton module ``name`` rebound to a copy of its globals in which every
    ``@triton.jit`` kernel is ``wrap_triton(kernel)``: the same launch code (block sizes, grids, checks),
    traceable by Inductor into ``triton_kernel_wrapper`` nodes. The module itself is left as it is."""
    from triton.runtime.jit import JITFunction

    mod = _triton(name)
    env = dict(vars(mod))
    for key, obj in vars(mod).items():
        if isinstance(obj, JITFunction):
            env[key] = torch.library.wrap_triton(obj)
        elif isinstance(obj, types.FunctionType) and obj.__module__ == mod.__name__:
            fn = types.FunctionType(obj.__code__, env, obj.__name__, obj.__defaults__, obj.__closure__)
            fn.__kwdefaults__ = obj.__kwdefaults__
            env[key] = fn
    return types.SimpleNamespace(**env)


def _decomposed(op_name: str, args: tuple):
    """The traced body of a CUDA call. NOTE: ``num_splits=1``: the launchers' split heuristic compares
    symbolic sizes, which dynamic shapes cannot do. The whole-table
    ops pass the table itself, never a per-layer view: Inductor re-inplaces a kernel's write to a
    graph input, while through a view (``select``, then ``select_scatter`` into the table) it may
    clone the whole table for every layer (and AOTInductor built with torch 2.11 read past the end of
    such a copy on the H200: docs/EXPORT.md)."""
    if op_name == "append_kv_layer":
        return _append_cuda(traceable_triton("append_kv"), args[0], *args[2:], layer=args[1])
    if op_name == "append_kv":
        return _append_cuda(traceable_triton("append_kv"), *args)
    tri = traceable_triton("hstu_attention")
    if op_name == "paged_hstu_attention_layer":
        return _paged_cuda(tri, *args[:4], *args[5:], layer=args[4], num_splits=1)
    if op_name == "paged_hstu_attention":
        return _paged_cuda(tri, *args, num_splits=1)
    return _jagged_cuda(tri, *args, num_splits=1)


def decompose_on(tensors: list[torch.Tensor]) -> bool:
    """Whether a traced call is decomposed into its Triton kernels: CUDA tensors (a seam for tests)."""
    return any(t.is_cuda for t in tensors)


def _register_triton_decomposition(op_name: str) -> None:
    from torch._subclasses.fake_tensor import FakeTensor
    from torch._subclasses.functional_tensor import FunctionalTensor, FunctionalTensorMode

    def rule(mode, op, types_, args, kwargs):
        # NOTE: as torch.library.triton_op does: torch.export keeps the op (a serializable graph);
        # Inductor's trace (AOTInductor's compile included) decomposes it.
        from torch.export._trace import custom_triton_ops_decomposition_disabled

        tensors = [a for a in args if isinstance(a, torch.Tensor)]
        if custom_triton_ops_decomposition_disabled() or not decompose_on(tensors):
            return mode.__torch_dispatch__(op, types_, args, kwargs)
        if any(not issubclass(t, FakeTensor | FunctionalTensor) and t is not torch.Tensor for t in types_):
            return NotImplemented
        with mode:
            return _decomposed(op_name, tuple(args) + tuple(kwargs.values()))

    torch.library.register_torch_dispatch(f"gr_kv::{op_name}", FunctionalTensorMode, rule)


for _name in ("append_kv", "paged_hstu_attention", "hstu_attention_jagged", "append_kv_layer",
              "paged_hstu_attention_layer"):
    _register_triton_decomposition(_name)
