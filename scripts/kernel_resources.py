"""Registers and local memory (spills) of the paged attention kernel's launches, compiled for the H200
here, without a GPU.

python scripts/kernel_resources.py [--module PATH] [--launch KEY=VALUE ...] [--cases DIM,PAGE,BS ...]
    [--dtype bfloat16|float16|float32] [--eager-only]

Triton compiles for a target it is given (sm_90, with the ptxas its wheel bundles), so what a kernel
change does to the compiled form can be read before spending device time. This script runs
`gr_plugin.ops.triton.hstu_attention.paged_hstu_attention` on CPU tensors of the block's shapes
(hidden 1024, 4 heads; head_dim 128 / page 128 and 256 / page 32; a 4096 history, 128 new + 256
candidates per user; bs 1 and 8) with the H200's SM count and shared memory, takes the arguments
its launch passes to the kernel, eagerly and as a launch captured into a CUDA graph takes them (TMA
loads where `_use_tma` allows them: not for head_dim 256's 64-key blocks on 32-token pages),
specialises them as Triton's launcher does and compiles for sm_90. It prints the cubin's registers
and local memory (``cuobjdump --dump-resource-usage``: ``REG`` and ``STACK``; the H200's
``n_spills`` in Triton is ``STACK / 4``) and the kernel's shared memory (Triton's
``metadata.shared``: how many programs fit on an SM).

``--module PATH``: the kernel module from another file (e.g. ``git show <commit>:gr_plugin/ops/
triton/hstu_attention.py > /tmp/k.py``; the helpers it imports come from this tree), to compare a
variant with the package's; ``--launch KEY=VALUE``: extra launch arguments (an int, True/False, a
tuple of ints, or a string), e.g. ``append=True`` where that module takes it, or
``blocks=64,64,8,2`` (the tiles: BLOCK_M, BLOCK_N, warps, stages); ``kernel=gluon``: the Gluon kernel
(`gr_plugin.ops.triton.hstu_gluon`, which the H200 takes for graphed launches), graphed only;
``full=True``: the full pass's launch (`hstu_attention_jagged`: the history and the candidates, every
token a query) instead of the cached step's. ``--dtype``: the inputs' dtype (default bf16, the block's);
each line also names the precision of the kernel's dots as its Triton IR (TTIR) states it (``dots``:
``inputPrecision`` of every ``tt.dot``, ``ieee`` where the attribute is absent). ``--eager-only``: the
eager launch alone.

Approximations: the index tensors are fresh CPU tensors (16-byte aligned); a graph bucket packs its
index fields into one buffer, where ``kv_indptr`` may start unaligned (one scalar load; the
registers matched the H200's either way). ``LIBDEVICE``-style constexprs that a variant derives
from ``q.is_cuda`` take their CPU value. It uses Triton's private launcher helpers
(``create_function_from_signature``, ``JITFunction._pack_args``), so a Triton upgrade may need it
updated. Checked against the H200 (docs/BENCHMARKS.md, the block section, 2026-12-01 from 13:02).
"""

from __future__ import annotations

import argparse
import importlib.util
import os
import re
import subprocess
import sys
import tempfile

os.environ.pop("TRITON_INTERPRET", None)  # (the tests' interpreter must not take the launch over)

import torch
import triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource, make_backend
from triton.experimental.gluon._runtime import GluonASTSource
from triton.runtime.jit import create_function_from_signature

from gr_plugin.ops.triton import hstu_gluon, tma_covers

TARGET = GPUTarget("cuda", 90, 32)
H200_SMS, H200_SHARED = 132, 232448  # SMs; shared memory a block may opt into (bytes)
HIST, NEW, CANDS, HEADS = 4096, 128, 256, 4
CASES = ((128, 128, 1), (128, 128, 8), (256, 32, 1), (256, 32, 8))  # head_dim, page, bs


def load(path: str | None):
    if path is None:
        from gr_plugin.ops.triton import hstu_attention
        return hstu_attention
    spec = importlib.util.spec_from_file_location("kernel_variant", path)
    mod = importlib.util.module_from_spec(spec)
    sys.modules["kernel_variant"] = mod
    spec.loader.exec_module(mod)
    return mod


def captured_launch(mod, dim: int, page: int, bs: int, graphed: bool, extra: dict,
                    dtype: torch.dtype = torch.bfloat16):
    """``(kernel, (args, kwargs))`` of the launch ``mod`` makes at these shapes, on CPU tensors."""
    qlen = NEW + CANDS
    nq = bs * qlen
    pages_per_user = -(-HIST // page)
    bf16 = dict(dtype=dtype)
    q, k, v = (torch.empty(nq, HEADS, dim, **bf16) for _ in range(3))
    kv = torch.empty(bs * pages_per_user + 1, 2, page, HEADS, dim, **bf16)
    i64 = dict(dtype=torch.int64)
    kv_indices = torch.arange(bs * pages_per_user, **i64)
    kv_indptr = torch.arange(0, bs * pages_per_user + 1, pages_per_user, **i64)
    q_offsets = torch.arange(0, nq + 1, qlen, **i64)
    hist, new = torch.full((bs,), HIST, **i64), torch.full((bs,), NEW, **i64)
    seen = []

    class Capture:
        def __init__(self, into: list) -> None:
            self.into = into

        def __getitem__(self, grid):
            return lambda *a, **kw: self.into.append((a, kw))

    def use_tma(t, *form):  # `_use_tma` as on the H200, capturing (graphed) or not: (table or None, q);
        # (table, page_size, block_n) or (table,) in older kernel files (--module)
        page_ok = len(form) != 2 or form[0] % form[1] == 0
        return graphed and mod.TMA and page_ok and (t is None or tma_covers(t))

    names = ("_hstu_fwd", "_sum_parts", "_shared_memory", "_num_sms", "_use_tma")
    saved = {n: getattr(mod, n) for n in names}
    mod._hstu_fwd, mod._sum_parts = Capture(seen), Capture([])  # (the parts' sum is not compiled here)
    mod._shared_memory, mod._num_sms, mod._use_tma = (lambda d: H200_SHARED), (lambda d: H200_SMS), use_tma
    gluon_saved = (hstu_gluon._paged_fwd, hstu_gluon.supported)
    # kernel=gluon: the Gluon kernel's launch (`hstu_gluon`), its Hopper check passed as on the H200
    hstu_gluon._paged_fwd, hstu_gluon.supported = Capture(seen), (lambda *a: None)
    try:
        launch = {"fast": True, **extra}  # (the H200's default SiLU; --launch may override it)
        if launch.pop("full", False):  # the full pass: every token of a 4096 history and the candidates a query
            fq, fk, fv = (torch.empty(bs * (HIST + CANDS), HEADS, dim, **bf16) for _ in range(3))
            seq_offsets = torch.arange(0, bs * (HIST + CANDS) + 1, HIST + CANDS, **i64)
            mod.hstu_attention_jagged(fq, fk, fv, seq_offsets, torch.full((bs,), CANDS, **i64), alpha=0.1,
                                      n_norm=4096.0, max_seq_len=HIST + CANDS, **launch)
        else:
            mod.paged_hstu_attention(q, k, v, kv, kv_indices, kv_indptr, hist, q_offsets, new, alpha=0.1,
                                     n_norm=4096.0, max_q_len=qlen, max_history_len=HIST,
                                     num_history_tokens=bs * HIST, **launch)
    finally:
        for n, f in saved.items():
            setattr(mod, n, f)
        hstu_gluon._paged_fwd, hstu_gluon.supported = gluon_saved
    if not seen:
        raise RuntimeError("the launch did not reach the module's _hstu_fwd (a reference fallback?)")
    return (gluon_saved[0] if extra.get("kernel") == "gluon" else saved["_hstu_fwd"]), seen[0]


def compile_for_h200(fn, args, kwargs):
    """Specialise the arguments as Triton's launcher does (`JITFunction.run`) and compile for sm_90."""
    backend = make_backend(TARGET)
    binder = create_function_from_signature(fn.signature, fn.params, backend)
    bound, specialization, options = binder(*args, **kwargs)
    options, signature, constexprs, attrs = fn._pack_args(backend, kwargs, bound, specialization, options)
    source = (GluonASTSource if fn.is_gluon() else ASTSource)(fn, signature, constexprs, attrs)
    return triton.compile(source, target=TARGET, options=options.__dict__)


def resources(kernel) -> tuple[int, int]:
    """``(registers, local memory bytes)`` of the compiled cubin (``cuobjdump``: ``REG``, ``STACK``)."""
    from triton.backends.nvidia.compiler import get_ptxas

    cuobjdump = os.path.join(os.path.dirname(get_ptxas(TARGET.arch).path), "cuobjdump")
    with tempfile.TemporaryDirectory() as d:
        path = os.path.join(d, "k.cubin")
        with open(path, "wb") as f:
            f.write(kernel.asm["cubin"])
        out = subprocess.run([cuobjdump, "--dump-resource-usage", path], capture_output=True, text=True, check=True)
    regs, stack = re.search(r"REG:(\d+)", out.stdout), re.search(r"STACK:(\d+)", out.stdout)
    if regs is None or stack is None:
        raise RuntimeError(f"no REG / STACK in cuobjdump's output:\n{out.stdout}")
    return int(regs.group(1)), int(stack.group(1))


def dot_precisions(kernel) -> list[str]:
    """The ``inputPrecision`` of each ``tt.dot`` in the compiled kernel's TTIR (``ieee`` where absent; none
    for a Gluon kernel, which has no TTIR)."""
    lines = [ln for ln in kernel.asm.get("ttir", "").splitlines() if "tt.dot " in ln]
    found = [re.search(r"inputPrecision\s*=\s*(\w+)", ln) for ln in lines]
    return [m.group(1) if m else "ieee" for m in found]


def parse_launch(items: list[str]) -> dict:
    out = {}
    for item in items:
        key, sep, value = item.partition("=")
        if not sep or not key:
            raise SystemExit(f"--launch takes KEY=VALUE, got {item!r}")
        if value in ("True", "False"):
            out[key] = value == "True"
        elif "," in value:  # a tuple of ints, e.g. blocks=64,64,8,2
            out[key] = tuple(int(x) for x in value.split(","))
        else:
            try:
                out[key] = int(value)
            except ValueError:
                out[key] = value
    return out


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--module")
    p.add_argument("--launch", nargs="*", default=[])
    p.add_argument("--cases", nargs="*", default=[",".join(map(str, c)) for c in CASES])
    p.add_argument("--dtype", choices=("bfloat16", "float16", "float32"), default="bfloat16")
    p.add_argument("--eager-only", action="store_true")
    a = p.parse_args()
    dtype = getattr(torch, a.dtype)
    extra = parse_launch(a.launch)
    mod = load(a.module)
    for dim, page, bs in (tuple(int(x) for x in c.split(",")) for c in a.cases):
        ways = (True,) if extra.get("kernel") == "gluon" else (False,) if a.eager_only else (False, True)
        for graphed in ways:  # (Gluon: graphed only)
            fn, (args, kwargs) = captured_launch(mod, dim, page, bs, graphed, extra, dtype)
            kernel = compile_for_h200(fn, args, kwargs)
            regs, stack = resources(kernel)
            tiles = (kwargs["BLOCK_M"], kwargs["BLOCK_N"], kwargs.get("num_warps"),
                     kwargs.get("num_stages", kwargs.get("STAGES")))
            splits = args[fn.arg_names.index("splits")] if "splits" in fn.arg_names else "?"
            form = ("graphed, Gluon" if fn.is_gluon() else "graphed, TMA" if kwargs.get("TMA") else "graphed") \
                if graphed else "eager"
            print(f"head_dim {dim} page {page} bs {bs} {form}: tiles {tiles} splits {splits}: "
                  f"{regs} registers, {stack} bytes of local memory, {kernel.metadata.shared} bytes of shared memory, "
                  f"dots {','.join(sorted(set(dot_precisions(kernel)))) or 'n/a'}", flush=True)


if __name__ == "__main__":
    main()
