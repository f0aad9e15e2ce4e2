"""Registers and spills of the paged attention kernel's launches, compiled for the H200 here, without a GPU.

python scripts/kernel_resources.py [--module PATH] [--launch KEY=VALUE ...] [--cases DIM,PAGE,BS ...]

Triton compiles for a target it is given (sm_90, with the ptxas its wheel bundles), so what a kernel
change does to the compiled form (registers, spills, shared memory) can be read before spending device
time. This script runs `gr_plugin.ops.triton.hstu_attention.paged_hstu_attention` on CPU tensors of the
block's shapes (hidden 1024, 4 heads; head_dim 128 / page 128 and 256 / page 32; a 4096 history, 3968
cached, 128 new + 256 candidates per user; bs 1 and 8) with the H200's SM count and shared memory, takes
the arguments its launch passes to the kernel (eager, and with the TMA loads a graphed launch takes),
specialises them as Triton's launcher does, compiles for sm_90 and prints ptxas' resource line.

``--module PATH``: the kernel module from another file (e.g. ``git show <commit>:gr_plugin/ops/triton/
hstu_attention.py > /tmp/k.py``), to compare a variant with the package's; ``--launch KEY=VALUE``: extra
launch arguments (ints or True/False), e.g. ``append=True`` where that module takes it; ``--cases``:
which of the shapes (default all four).

Checked against the H200 (docs/BENCHMARKS.md, the block section, 2026-12-01 from 13:02): the
package's kernel compiled there to 204 and 230 registers with no spills at head_dim 128, 236 at head_dim
256, bs 1, and 255 with 14 and 90 spills at head_dim 256, bs 8.
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
from triton.runtime.jit import create_function_from_signature

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


def captured_launch(mod, dim: int, page: int, bs: int, tma: bool, extra: dict):
    """``(args, kwargs)`` the launch passes to ``mod._hstu_fwd``, on CPU tensors of the block's shapes."""
    qlen = NEW + CANDS
    nq = bs * qlen
    pages_per_user = -(-HIST // page)
    bf16 = dict(dtype=torch.bfloat16)
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

    saved = {n: getattr(mod, n) for n in ("_hstu_fwd", "_sum_parts", "_shared_memory", "_num_sms")}
    mod._hstu_fwd, mod._sum_parts = Capture(seen), Capture([])  # (the parts' sum is not compiled here)
    mod._shared_memory, mod._num_sms = (lambda device: H200_SHARED), (lambda device: H200_SMS)
    try:
        mod.paged_hstu_attention(q, k, v, kv, kv_indices, kv_indptr, hist, q_offsets, new, alpha=0.1, n_norm=4096.0,
                                 max_q_len=qlen, max_history_len=HIST, num_history_tokens=bs * HIST, fast=True,
                                 tma=tma, **extra)
    finally:
        for n, f in saved.items():
            setattr(mod, n, f)
    return saved["_hstu_fwd"], seen[0]


def compile_for_h200(fn, args, kwargs):
    """Specialise the arguments as Triton's launcher does (`JITFunction.run`) and compile for sm_90."""
    backend = make_backend(TARGET)
    binder = create_function_from_signature(fn.signature, fn.params, backend)
    bound, specialization, options = binder(*args, **kwargs)
    options, signature, constexprs, attrs = fn._pack_args(backend, kwargs, bound, specialization, options)
    return triton.compile(ASTSource(fn, signature, constexprs, attrs), target=TARGET, options=options.__dict__)


def ptxas_line(kernel) -> str:
    """ptxas' resource line for the kernel's PTX (the flags Triton passes, with -v)."""
    from triton.backends.nvidia.compiler import get_ptxas

    with tempfile.TemporaryDirectory() as d:
        src = os.path.join(d, "k.ptx")
        with open(src, "w") as f:
            f.write(kernel.asm["ptx"])
        out = subprocess.run([get_ptxas(TARGET.arch).path, "-lineinfo", "-v", "--gpu-name=sm_90a", src, "-o",
                              os.path.join(d, "k.o")], capture_output=True, text=True, check=True)
    log = out.stdout + out.stderr
    regs = re.search(r"Used (\d+) registers", log)
    spills = re.search(r"(\d+) bytes spill stores, (\d+) bytes spill loads", log)
    return (f"{regs.group(1) if regs else '?'} registers, spill stores/loads "
            f"{spills.group(1) if spills else '?'}/{spills.group(2) if spills else '?'} bytes")


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--module")
    p.add_argument("--launch", nargs="*", default=[])
    p.add_argument("--cases", nargs="*", default=[",".join(map(str, c)) for c in CASES])
    a = p.parse_args()
    extra = {}
    for item in a.launch:
        key, value = item.split("=", 1)
        extra[key] = {"True": True, "False": False}.get(value, value)
        if isinstance(extra[key], str):
            extra[key] = int(value)
    mod = load(a.module)
    for dim, page, bs in (tuple(int(x) for x in c.split(",")) for c in a.cases):
        for tma in (False, True):
            fn, (args, kwargs) = captured_launch(mod, dim, page, bs, tma, extra)
            kernel = compile_for_h200(fn, args, kwargs)
            tiles = (kwargs["BLOCK_M"], kwargs["BLOCK_N"], kwargs.get("num_warps"), kwargs.get("num_stages"))
            print(f"head_dim {dim} page {page} bs {bs} {'TMA  ' if tma else 'eager'} tiles {tiles} "
                  f"splits {args[fn.arg_names.index('splits')]}: {ptxas_line(kernel)}", flush=True)


if __name__ == "__main__":
    main()
