"""Peak resident memory of one user's attention backward on the CPU: the gr_kv C++ op vs the reference.

    python scripts/cpu_attention_memory.py cpp|reference [--tokens 2048] [--heads 4] [--dim 32]

One process per path (``ru_maxrss`` only grows): the growth of the peak over the inputs, in MiB, for the C++
backward alone (``cpp``) or the reference's forward and backward (``reference``), 1 intra-op thread, next to
the size of one ``[H, n, n]`` fp32 score tensor.
"""

from __future__ import annotations

import argparse
import resource

import torch

from gr_plugin.ops import library  # noqa: F401 - loads the gr_kv ops
from gr_plugin.ops.pytorch import hstu_attention as ref


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("path", choices=["cpp", "reference"])
    ap.add_argument("--tokens", type=int, default=2048)
    ap.add_argument("--heads", type=int, default=4)
    ap.add_argument("--dim", type=int, default=32)
    args = ap.parse_args()
    torch.set_num_threads(1)
    n, h = args.tokens, args.heads
    offsets, cands = torch.tensor([0, n]), torch.tensor([64])
    q, k, v, dout = (torch.randn(n, h, args.dim) for _ in range(4))
    base = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    if args.path == "cpp":
        torch.ops.gr_kv.hstu_attention_jagged_backward(dout, q, k, v, offsets, cands, 0.3, 16.0)
    else:
        leaves = [t.requires_grad_() for t in (q, k, v)]
        ref.hstu_attention_jagged(*leaves, offsets, cands, alpha=0.3, n_norm=16.0, max_seq_len=n).backward(dout)
    grown = (resource.getrusage(resource.RUSAGE_SELF).ru_maxrss - base) / 1024
    print(f"{args.path}: peak +{grown:.0f} MiB; one [H, n, n] fp32 tensor {h * n * n * 4 / 2**20:.0f} MiB")


if __name__ == "__main__":
    main()
