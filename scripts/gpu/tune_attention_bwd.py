"""Sweep the tiles of the jagged HSTU attention's Triton backward (`gr_plugin.ops.triton.hstu_attention_bwd`).

    python3 scripts/gpu/tune_attention_bwd.py [--dims 128 256] [--dtypes bf16 fp32] [--configs M,N,W,S ...]
        [--fp32-dots tf32x3 ieee]
    python3 scripts/gpu/tune_attention_bwd.py --against OLD.py [--rounds 20]

Per head_dim and dtype: bs 8 users of a 2048-event history + 256 candidates, 4 heads; the backward alone (both
kernels) per config, ms (median of CUDA-event-timed calls), next to the torch reference's forward + backward
and the Triton forward; one JSON line per row. A config that fails to compile (shared memory) is reported. fp32 runs
once per ``--fp32-dots`` precision (`hstu_attention.dot_precision`), the row naming it.

``--against``: another version of the backward module (a file, e.g. ``git show REV:gr_plugin/ops/triton/
hstu_attention_bwd.py``) timed beside this tree's at each dim's default tiles, in interleaved rounds (each first
in turn), on q/k/v given two ways: contiguous tensors, and views of one [T, 4, H, D] projection as a layer
hands them over (this tree's kernels read those at their strides; a version that copies pays the copies).
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import statistics

import torch

from gr_plugin.bench.block import _time_ms as time_ms
from gr_plugin.ops.pytorch import hstu_attention as ref
from gr_plugin.ops.triton import hstu_attention as fwd
from gr_plugin.ops.triton import hstu_attention_bwd as bwd

DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}
CONFIGS = ["64,64,8,1", "64,64,4,1", "64,64,8,2", "32,64,4,1", "64,32,4,1", "32,32,4,1", "128,64,8,1", "64,128,8,1",
           "32,128,8,1", "16,32,4,1", "32,32,8,1", "16,16,4,1"]


def _load(path: str):
    spec = importlib.util.spec_from_file_location("_bwd_against", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def against(path: str, dims: list[int], rounds: int, bs: int, history: int) -> None:
    """This tree's backward against ``path``'s, side by side (one JSON line per dim and input layout)."""
    other = _load(path)
    cands, heads, dtype = 256, 4, torch.bfloat16
    lens = [history + cands] * bs
    offsets = torch.tensor([0, *torch.cumsum(torch.tensor(lens), 0).tolist()], device="cuda")
    nc = torch.full((bs,), cands, device="cuda")
    kw = dict(alpha=0.35, n_norm=float(max(lens)), max_seq_len=max(lens))
    for dim in dims:
        proj = torch.randn(sum(lens), 4, heads, dim, device="cuda", dtype=dtype)
        do = torch.randn(sum(lens), heads, dim, device="cuda", dtype=dtype)
        layouts = {"contiguous": [proj[:, i].contiguous() for i in range(3)],
                   "views": [proj[:, i] for i in range(3)]}
        tiles = bwd.blocks(dim, dtype, do.device)
        for layout, (q, k, v) in layouts.items():
            ways = {"this": lambda: bwd.hstu_attention_jagged_backward(do, q, k, v, offsets, nc, tiles=tiles, **kw),
                    "against": lambda: other.hstu_attention_jagged_backward(do, q, k, v, offsets, nc, tiles=tiles,
                                                                            **kw)}
            a, b = (w() for w in ways.values())
            same = all(torch.equal(x, y) for x, y in zip(a, b))
            times = {name: [] for name in ways}
            for r in range(rounds):
                order = list(ways) if r % 2 == 0 else list(ways)[::-1]
                for name in order:
                    times[name].append(time_ms(ways[name], 5))
            row = {"dim": dim, "layout": layout, "tiles": tiles, "bs": bs, "history": history, "rounds": rounds,
                   "same_bits": same}
            for name, ts in times.items():
                row[f"{name}_ms"] = round(statistics.median(ts), 4)
                row[f"{name}_min_ms"] = round(min(ts), 4)
            row["this_over_against"] = round(row["this_ms"] / row["against_ms"], 3)
            print(json.dumps(row), flush=True)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--dims", type=int, nargs="+", default=[64, 128, 256])
    ap.add_argument("--dtypes", nargs="+", default=["bf16", "fp32"])
    ap.add_argument("--configs", nargs="+", default=CONFIGS)
    ap.add_argument("--bs", type=int, default=8)
    ap.add_argument("--history", type=int, default=2048)
    ap.add_argument("--against", help="another backward module's file, timed beside this tree's")
    ap.add_argument("--rounds", type=int, default=20)
    ap.add_argument("--fp32-dots", nargs="+", default=[None], help="fp32 dot precisions (default FP32_DOTS)")
    args = ap.parse_args()
    if args.against:
        against(args.against, args.dims, args.rounds, args.bs, args.history)
        return
    cands, heads = 256, 4
    for dim in args.dims:
        for name, dots in ((n, d) for n in args.dtypes for d in (args.fp32_dots if n == "fp32" else [None])):
            dtype = DTYPES[name]
            lens = [args.history + cands] * args.bs
            offsets = torch.tensor([0, *torch.cumsum(torch.tensor(lens), 0).tolist()], device="cuda")
            nc = torch.full((args.bs,), cands, device="cuda")
            q, k, v, do = (torch.randn(sum(lens), heads, dim, device="cuda", dtype=dtype) for _ in range(4))
            kw = dict(alpha=0.35, n_norm=float(max(lens)), max_seq_len=max(lens))
            row = {"dim": dim, "dtype": name, "dots": fwd.dot_precision(dtype, dots), "bs": args.bs,
                   "history": args.history, "default": bwd.blocks(dim, dtype, q.device, dots)}
            forward_ms = time_ms(lambda: fwd.hstu_attention_jagged(q, k, v, offsets, nc, fp32_dots=dots, **kw), 10)
            row["triton_forward_ms"] = round(forward_ms, 4)

            def reference():
                leaves = [t.detach().requires_grad_() for t in (q, k, v)]
                ref.hstu_attention_jagged(*leaves, offsets, nc, **kw).backward(do)

            try:
                row["reference_fwd_bwd_ms"] = round(time_ms(reference, 3), 3)
            except torch.OutOfMemoryError:
                row["reference_fwd_bwd_ms"] = "oom"
            torch.cuda.empty_cache()
            for cfg in args.configs:
                tiles = tuple(int(x) for x in cfg.split(","))
                try:
                    ms = time_ms(lambda tiles=tiles: bwd.hstu_attention_jagged_backward(
                        do, q, k, v, offsets, nc, tiles=tiles, fp32_dots=dots, **kw), 10)
                    row[cfg] = round(ms, 4)
                except Exception as e:  # (a config past the shared memory: reported, the sweep goes on)
                    row[cfg] = f"error: {type(e).__name__}: {str(e)[:80]}"
            print(json.dumps(row), flush=True)


if __name__ == "__main__":
    main()
