"""Where a paged attention launch's time goes, per program: clock stamps inside the kernel.

python3 scripts/gpu/probe_attention_timeline.py [case ...]   (cases: `CASES`; all by default)

A copy of `gr_plugin.ops.triton.hstu_attention`, written to a temporary file with stamps added (the
kernel itself is untouched), records for every program of the split grid: the SM it ran on, the
global timer at its start and end, and the SM clock at its start, when the loop begins (the user's
lengths loaded), after the loop over full key blocks (its sum needed: the tensor-core work done),
after the masked blocks, after the candidates' own keys (a tile's first program; the others
only pass the stamp), and after its output's store is issued. It
prints, per case: the launch's span on the global timer, how the programs' starts spread, and the
median / p90 of each stage's time and of one full key block's, in microseconds. The stamps cost a
reduction over the accumulator at each; the span is checked against the untouched kernel's
graphed time in the same run, and the output against the untouched kernel's.
"""

from __future__ import annotations

import importlib.util
import inspect
import os
import statistics
import sys
import tempfile

import torch
import triton

from gr_plugin.ops.triton import hstu_attention as tri

_CLOCK = '''
@triton.jit
def _clk(dep):
    return tl.inline_asm_elementwise("mov.u64 $0, %clock64;", "=l,r", [dep], dtype=tl.int64, is_pure=False, pack=1)


@triton.jit
def _gclk(dep):
    return tl.inline_asm_elementwise("mov.u64 $0, %globaltimer;", "=l,r", [dep], dtype=tl.int64, is_pure=False,
                                     pack=1)


@triton.jit
def _smid(dep):
    return tl.inline_asm_elementwise("mov.u32 $0, %smid;", "=r,r", [dep], dtype=tl.int32, is_pure=False, pack=1)


'''

# (text in the module, what replaces it): each must occur exactly once
_PATCHES = [
    ("@triton.jit\ndef _load_kv(", _CLOCK + "@triton.jit\ndef _load_kv("),
    ("TMA: tl.constexpr, WS: tl.constexpr):\n    \"\"\"The fp32 sum",
     "TMA: tl.constexpr, WS: tl.constexpr, Stamps):\n    \"\"\"The fp32 sum"),
    ("    for n0 in tl.range(kv_lo, full_hi, BLOCK_N, warp_specialize=WS):",
     "    t1 = _clk(full_hi)\n    for n0 in tl.range(kv_lo, full_hi, BLOCK_N, warp_specialize=WS):"),
    ("    for n0 in range(full_hi, kv_hi, BLOCK_N):",
     "    t2 = _clk(tl.sum(acc).to(tl.int32))\n    for n0 in range(full_hi, kv_hi, BLOCK_N):"),
    ("    # A candidate also sees itself,",
     "    t25 = _clk(tl.sum(acc).to(tl.int32))\n    # A candidate also sees itself,"),
    ("    return acc\n\n\n@triton.jit\ndef _stream_tiles(",
     "    res = acc\n"
     "    t3 = _clk(tl.sum(res).to(tl.int32))\n"
     "    slot = ((b * tl.num_programs(2) + h) * tl.num_programs(0) + tl.program_id(0)) * 16\n"
     "    tl.store(Stamps + slot + 3, t1)\n    tl.store(Stamps + slot + 4, t2)\n    tl.store(Stamps + slot + 5, t3)\n"
     "    tl.store(Stamps + slot + 11, t25)\n"
     "    tl.store(Stamps + slot + 8, (tl.cdiv(full_hi - kv_lo, BLOCK_N)).to(tl.int64))\n"
     "    tl.store(Stamps + slot + 9, (tl.cdiv(kv_hi - full_hi, BLOCK_N)).to(tl.int64))\n"
     "    return res\n\n\n@triton.jit\ndef _stream_tiles("),
    ("        pid_m = tl.program_id(0) // splits\n",
     "        t0 = _clk(splits)\n        g0 = _gclk(splits)\n        pid_m = tl.program_id(0) // splits\n"),
    ("PAGE_SIZE, PAGED, HEAD_DIM, BLOCK_M, BLOCK_N, DOTS, FAST, TMA, WS)\n        rows = m0",
     "PAGE_SIZE, PAGED, HEAD_DIM, BLOCK_M, BLOCK_N, DOTS, FAST, TMA, WS, Done)\n        rows = m0"),
    ("        tl.store(out_ptrs, (acc * inv_norm).to(Out.dtype.element_ty), mask=row_ok[:, None])\n    else:",
     "        tl.store(out_ptrs, (acc * inv_norm).to(Out.dtype.element_ty), mask=row_ok[:, None])\n"
     "        t4 = _clk(tl.sum(acc).to(tl.int32))\n        g4 = _gclk(tl.sum(acc).to(tl.int32))\n"
     "        slot = ((b * tl.num_programs(2) + h) * tl.num_programs(0) + tl.program_id(0)) * 16\n"
     "        tl.store(Done + slot + 0, g0)\n        tl.store(Done + slot + 1, g4)\n"
     "        tl.store(Done + slot + 2, t0)\n        tl.store(Done + slot + 6, t4)\n"
     "        tl.store(Done + slot + 7, _smid(splits).to(tl.int64))\n        tl.store(Done + slot + 10, 1)\n"
     "    else:"),
    ("        part, done = target, q_offsets\n", "        part, done = target, PROBE[0]\n"),
]


def probed_module():
    src = inspect.getsource(tri)
    for old, new in _PATCHES:
        if src.count(old) != 1:
            raise RuntimeError(f"the kernel's source changed: {old[:60]!r} occurs {src.count(old)} times")
        src = src.replace(old, new)
    src += "\nPROBE = [None]\n"
    f = tempfile.NamedTemporaryFile("w", suffix="_probed_attention.py", delete=False)
    f.write(src)
    f.close()
    try:  # (Triton reads a kernel's source when the module is run: the file may go afterwards)
        spec = importlib.util.spec_from_file_location("probed_attention", f.name)
        mod = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(mod)
    finally:
        os.unlink(f.name)
    return mod


CASES = {  # name: (bs, history, head_dim, page, blocks or None, splits or None)
    "bs1": (1, 4096, 128, 128, None, None),
    "bs1x6": (1, 4096, 128, 128, (64, 64, 4, 2), 6),
    "bs1x22": (1, 4096, 128, 128, (64, 64, 4, 2), 22),
    "bs1big": (1, 4096, 128, 128, (128, 128, 8, 2), 11),
    "bs1s3": (1, 4096, 128, 128, (64, 64, 4, 3), 11),
    "bs2": (2, 4096, 128, 128, None, None),
    "bs8": (8, 4096, 128, 128, None, None),
    "d256": (1, 4096, 256, 32, None, None),
}


def pct(xs, p):
    xs = sorted(xs)
    return xs[min(len(xs) - 1, int(p * len(xs)))]


def run(mod, name):
    sys.path.insert(0, "scripts/gpu")
    from tune_attention import case

    bs, hist, dim, page, blocks, splits = CASES[name]
    args, max_q, max_kv = case(bs, hist, 128, 256, 4, dim, page)
    kw = dict(paged=True, max_kv_len=max_kv, tma=True, num_splits=splits, blocks=blocks)
    ref = tri._launch(*args, 0.1, 4096.0, max_q, **kw)
    graphed = triton.testing.do_bench_cudagraph(lambda: tri._launch(*args, 0.1, 4096.0, max_q, **kw), rep=50,
                                                return_mode="median")
    bl = blocks or tri._launch_blocks(args[0].shape[0], bs, 4, max_q, max_kv, dim, args[0].dtype, True,
                                           args[0].device)
    sp = splits or tri._default_splits(args[0].shape[0], bs, 4, max_q, max_kv, bl, dim, 2, args[0].device)
    n_prog = triton.cdiv(max_q, bl[0]) * sp * bs * 4
    stamps = torch.zeros(n_prog * 16, dtype=torch.int64, device="cuda")
    mod.PROBE[0] = stamps
    rounds = []
    for _ in range(5):  # the last of 5 launches (warm caches, compiled)
        stamps.zero_()
        out = mod._launch(*args, 0.1, 4096.0, max_q, **kw)
        torch.cuda.synchronize()
        rounds.append(stamps.view(n_prog, 16).cpu())
    diff = (out.float() - ref.float()).abs().max().item()
    s = rounds[-1]
    # which programs add the candidates' own keys: split 0 of a tile holding candidates (rows >= 128 new)
    pid0 = torch.arange(n_prog) % (n_prog // (bs * 4))
    own_all = (pid0 % sp == 0) & ((pid0 // sp) * bl[0] + bl[0] > 128)
    ran = s[:, 10] == 1  # programs that ran their tile (not past the user's queries)
    s, own = s[ran], own_all[ran]
    # the SM clock: cycles over global-timer ns of each program, median
    clock_ghz = statistics.median(((s[:, 6] - s[:, 2]).double() / (s[:, 1] - s[:, 0]).clamp(min=1).double()).tolist())
    us = 1e-3 / clock_ghz  # clock cycles -> us
    g0 = s[:, 0] - s[:, 0].min()
    span = (s[:, 1].max() - s[:, 0].min()).item() / 1e3
    stage = {
        "start -> loop (lengths loaded)": (s[:, 3] - s[:, 2]).tolist(),
        "full-block loop": (s[:, 4] - s[:, 3]).tolist(),
        "masked blocks": (s[:, 11] - s[:, 4]).tolist(),
        "own keys, tile's first program": (s[own, 5] - s[own, 11]).tolist(),
        "own keys, other programs (none)": (s[~own, 5] - s[~own, 11]).tolist(),
        "store issued": (s[:, 6] - s[:, 5]).tolist(),
        "program total": (s[:, 6] - s[:, 2]).tolist(),
    }
    per_block = [(c / max(n, 1)) for c, n in zip((s[:, 4] - s[:, 3]).tolist(), s[:, 8].tolist()) if n > 0]
    per_sm = torch.bincount(s[:, 7], minlength=1)
    print(f"{name}: blocks {bl} splits {sp}: {len(s)} programs on {int((per_sm > 0).sum())} SMs "
          f"(at most {int(per_sm.max())} per SM); graphed untouched {graphed * 1e3:.1f} us; probed span "
          f"{span:.1f} us (SM clock {clock_ghz:.2f} GHz); starts spread over {g0.max().item() / 1e3:.1f} us "
          f"(p50 {pct(g0.tolist(), .5) / 1e3:.1f}); "
          f"full blocks per program {pct(s[:, 8].tolist(), .5)} (max {s[:, 8].max().item()}), masked "
          f"{pct(s[:, 9].tolist(), .5)} (max {s[:, 9].max().item()}); max diff vs untouched {diff:.1e}")
    for label, xs in stage.items():
        if not xs:
            continue
        print(f"   {label:32s} p50 {pct(xs, .5) * us:6.2f}  p90 {pct(xs, .9) * us:6.2f}  max {max(xs) * us:6.2f} us")
    print(f"   {'one full key block':32s} p50 {pct(per_block, .5) * us:6.2f}  p90 {pct(per_block, .9) * us:6.2f} us")


def main(names):
    mod = probed_module()
    for name in names or list(CASES):
        run(mod, name)


if __name__ == "__main__":
    tri.GLUON = False  # the Triton kernel's probe: a graphed launch naming no tiles would take the Gluon kernel
    sys.path.insert(0, "scripts/gpu")
    main(sys.argv[1:])
