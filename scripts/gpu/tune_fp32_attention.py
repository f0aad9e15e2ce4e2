"""Time the fp32 form of the Triton HSTU attention kernel over tile configs on the GPU (one device call).

python3 scripts/gpu/tune_fp32_attention.py [--dims 128 ...] [--forms jagged paged] [--configs M,N,W,S ...]
    [--dots tf32x3 ieee ...] [--out PATH]

The fp32 kernel (its dots at `FP32_DOTS`, "tf32x3", since 2026-12-02; "ieee" before: FMA, not tensor cores) is
what `recipes.infer` runs at its default ``dtype: float32``; at `hstu_large`'s shapes (4 heads of 128, page 32,
batch 8, 64 candidates, histories to 1024) the IEEE kernel on its old tiles took 2.29 ms a launch
(docs/BENCHMARKS.md, "`recipes.infer` on the H200"). Each case runs the jagged (full pass)
and the paged (cached step) form with every config of `CONFIGS`, the default's blocks (`_blocks`) first, and the
pure-torch reference (cuBLAS, TF32 off) beside them, once per ``--dots`` precision of the kernel's fp32 dots
(`hstu_attention.dot_precision`; default `FP32_DOTS`); each row reports its output's max abs difference from the
fp64 reference's (``err64``: the torch row's is the fp32 reference's own) and from the default tiles' at the same
precision (``max_err``).
Prints one JSON line per measurement (median ms of `triton.testing.do_bench`) and writes them to ``--out``.
"""

import argparse
import json

import torch
import triton

from gr_plugin.ops.pytorch import hstu_attention as ref
from gr_plugin.ops.triton import hstu_attention as tri

# (BLOCK_M, BLOCK_N, num_warps, num_stages). NOTE: the first sweep (head_dim 128, jagged, bs 8, H200,
# docs/BENCHMARKS.md) ran (64, 64, 4, 3), the default then, at 17.7 ms and (32, 64, 4, 1) at 1.02 ms; the
# configs here are the ones near the fast end of that sweep.
CONFIGS = [(16, 32, 4, 1), (16, 64, 4, 1), (16, 128, 4, 1), (32, 32, 4, 1), (32, 32, 4, 2), (32, 64, 4, 1),
           (32, 128, 4, 1), (32, 64, 8, 1), (64, 64, 8, 1), (64, 32, 4, 1)]
HEADS, PAGE, CANDS = 4, 32, 64
N_NORM = 4096.0


def ms(fn):
    return triton.testing.do_bench(fn, warmup=5, rep=40, return_mode="median")


def jagged_case(bs, hist, dim, g):
    n = hist + CANDS
    q, k, v = (torch.randn(bs * n, HEADS, dim, device="cuda", generator=g) for _ in range(3))
    off = torch.arange(0, bs + 1, device="cuda", dtype=torch.int64) * n
    cands = torch.full((bs,), CANDS, device="cuda", dtype=torch.int64)
    kw = dict(alpha=dim ** -0.5, n_norm=N_NORM, max_seq_len=n)
    return ((lambda **launch: tri.hstu_attention_jagged(q, k, v, off, cands, **kw, **launch)),
            (lambda t=torch.float32: ref.hstu_attention_jagged(q.to(t), k.to(t), v.to(t), off, cands, **kw)))


def paged_case(bs, hist, new, dim, g):
    per = -(-hist // PAGE)
    npg = bs * per + 4
    kv = torch.randn(npg, 2, PAGE, HEADS, dim, device="cuda", generator=g)
    idx = torch.randperm(npg, device="cuda", generator=g)[: bs * per].to(torch.int64)
    indptr = torch.arange(0, bs + 1, device="cuda", dtype=torch.int64) * per
    nq = new + CANDS
    q, k, v = (torch.randn(bs * nq, HEADS, dim, device="cuda", generator=g) for _ in range(3))
    q_off = torch.arange(0, bs + 1, device="cuda", dtype=torch.int64) * nq
    hl = torch.full((bs,), hist, device="cuda", dtype=torch.int64)
    nl = torch.full((bs,), new, device="cuda", dtype=torch.int64)
    kw = dict(alpha=dim ** -0.5, n_norm=N_NORM, max_q_len=nq, max_history_len=hist, num_history_tokens=bs * hist)
    return ((lambda **launch: tri.paged_hstu_attention(q, k, v, kv, idx, indptr, hl, q_off, nl, **kw, **launch)),
            (lambda t=torch.float32: ref.paged_hstu_attention(q.to(t), k.to(t), v.to(t), kv.to(t), idx, indptr, hl,
                                                              q_off, nl, **kw)))


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--dims", type=int, nargs="+", default=[128])
    ap.add_argument("--forms", nargs="+", default=["jagged", "paged"])
    ap.add_argument("--configs", nargs="+", default=None, help="BLOCK_M,BLOCK_N,warps,stages each (default CONFIGS)")
    ap.add_argument("--dots", nargs="+", default=[None], help="fp32 dot precisions (default FP32_DOTS)")
    ap.add_argument("--out", default=None)
    args = ap.parse_args()
    configs = [tuple(int(x) for x in c.split(",")) for c in args.configs] if args.configs else CONFIGS
    torch.backends.cuda.matmul.allow_tf32 = False
    g = torch.Generator(device="cuda").manual_seed(0)
    cases = {"jagged": [(8, 512, None)], "paged": [(8, 1024, 16)]}
    rows = []
    for dim, form in ((d, f) for d in args.dims for f in args.forms):
        for bs, hist, new in cases[form]:
            rows += sweep(form, bs, hist, new, dim, g, configs, args.dots)
    if args.out:
        with open(args.out, "w") as f:
            f.writelines(json.dumps(r) + "\n" for r in rows)


def sweep(form, bs, hist, new, dim, g, configs, precisions):
    rows = []
    launch, torch_ref = jagged_case(bs, hist, dim, g) if form == "jagged" else paged_case(bs, hist, new, dim, g)
    exact = torch_ref(torch.float64)
    want = torch_ref()
    head = dict(form=form, dim=dim, bs=bs, hist=hist, new=new)
    row = dict(head, config="torch", ms=ms(torch_ref), err64=(want.double() - exact).abs().max().item())
    rows.append(row)
    print(json.dumps(row), flush=True)
    default = tri._blocks(dim, torch.float32, form == "paged", exact.device)
    for dots in precisions:
        base = launch(fp32_dots=dots)
        for blocks in [None, *configs]:
            name = f"default{default}" if blocks is None else str(blocks)
            given = dict(fp32_dots=dots) if blocks is None else dict(fp32_dots=dots, blocks=blocks)
            row = dict(head, config=name, dots=tri.dot_precision(torch.float32, dots))
            try:
                out = launch(**given)
                row.update(ms=ms(lambda: launch(**given)), max_err=(out - base).abs().max().item(),
                           err64=(out.double() - exact).abs().max().item())
            except Exception as exc:  # a config that does not compile (shared memory, registers) is reported
                row.update(error=f"{type(exc).__name__}: {exc}"[:200])
            rows.append(row)
            print(json.dumps(row), flush=True)
    return rows


if __name__ == "__main__":
    main()
