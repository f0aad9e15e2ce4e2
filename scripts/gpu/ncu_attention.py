"""Nsight Compute counters of the attention launches the block bench times (what bounds them?).

ncu --kernel-name regex:_hstu_fwd --launch-skip 3 --launch-count 1 --section SpeedOfLight \
    --section ComputeWorkloadAnalysis --section MemoryWorkloadAnalysis --section WarpStateStats \
    --section Occupancy --section LaunchStats [--section SchedulerStats] \
    python3 scripts/gpu/ncu_attention.py CASE [tma]

CASE: ``cached1`` / ``cached8`` (the cached step's paged launch at bs 1 / 8: 4096-token histories,
128 new + 256 candidates per user, head_dim 128, page 128, 4 heads, the split rule's launch) or
``full1`` (the full pass's jagged launch, one user of 4096 + 256 tokens). The script launches the
kernel five times (ncu skips the first three: compilation and warm-up) and checks nothing: it is
the workload for the profiler, not a test. ``tma``: the paged launch reads its full key blocks through
the TMA descriptor, as it does when captured into a CUDA graph (an eager launch reads them with
per-thread loads: `hstu_attention._use_tma`).
"""

from __future__ import annotations

import sys

import torch

from gr_plugin.ops.triton import hstu_attention as tri

HEADS, DIM, PAGE, HIST, NEW, CANDIDATES = 4, 128, 128, 4096, 128, 256


def launches(name: str, tma: bool = False):
    g = torch.Generator(device="cuda").manual_seed(0)
    alpha, n_norm = DIM ** -0.5, 4096.0
    if name == "full1":
        t = HIST + CANDIDATES
        q, k, v = (torch.randn(t, HEADS, DIM, device="cuda", generator=g).to(torch.bfloat16) for _ in range(3))
        offsets = torch.tensor([0, t], device="cuda")
        cands = torch.tensor([CANDIDATES], device="cuda")
        return lambda: tri.hstu_attention_jagged(q, k, v, offsets, cands, alpha=alpha, n_norm=n_norm, max_seq_len=t)
    bs = {"cached1": 1, "cached8": 8}[name]
    per_user = -(-HIST // PAGE)
    kv = torch.randn(bs * per_user + 4, 2, PAGE, HEADS, DIM, device="cuda", generator=g).to(torch.bfloat16)
    idx = torch.randperm(bs * per_user + 4, device="cuda", generator=g)[: bs * per_user]
    indptr = torch.arange(bs + 1, device="cuda") * per_user
    nq = bs * (NEW + CANDIDATES)
    q, k, v = (torch.randn(nq, HEADS, DIM, device="cuda", generator=g).to(torch.bfloat16) for _ in range(3))
    q_off = torch.arange(bs + 1, device="cuda") * (NEW + CANDIDATES)
    hist = torch.full((bs,), HIST, device="cuda")
    new = torch.full((bs,), NEW, device="cuda")
    return lambda: tri.paged_hstu_attention(q, k, v, kv, idx, indptr, hist, q_off, new, alpha=alpha, n_norm=n_norm,
                                            max_q_len=NEW + CANDIDATES, max_history_len=HIST,
                                            num_history_tokens=bs * HIST, tma=tma or None)


if __name__ == "__main__":
    fn = launches(sys.argv[1] if len(sys.argv) > 1 else "cached1", "tma" in sys.argv[2:])
    for _ in range(5):
        fn()
    torch.cuda.synchronize()
