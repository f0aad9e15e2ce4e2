"""Time the paged HSTU attention kernel over block configs on the GPU (one call of the device tool).
python3 scripts/gpu/tune_attention.py [quick|schedules|splits|small|bucket [bs ...]|grid DIM HIST BS...] -> a table of
ms per (case, BLOCK_M, BLOCK_N, warps, stages, splits); ``quick``: the default config and the exact SiLU only;
``schedules``: the paged form's grids side by side (split vs stream-K, plain vs TMA loads, split counts, warp
specialisation, programs per SM) only; ``splits``: the split grid's variants only, with more small-batch cases;
``bucket``: a CUDA graph bucket's attention launch, before and after its key (`gr_plugin.modules.graphs.bucket_key`);
``small``: bs 1, 2 and 4 at head_dim 128 and bs 1 and 2 at 256, every block config with every split count, graphed
(the eager sweep's times at bs 1 are the host's launch cost, not the kernel's); ``small gate [bs ...]``: the same,
every launch with the layer's norm and gate as its epilogue (``norm_gate``, as the cached loops launch it: a split
launch's parts are summed in the norm's pass), so the split counts are weighed with the sum they cost there; ``small
wide ...``: split counts up to 6 programs per SM instead of 3; ``grid DIM HIST BS...``: every measurement of
`GRID_CONFIGS` x `GRID_SPLITS` at one head size and history, with the norm gate (to fit the split rule to;
$OUT/grid.jsonl)
"""

import itertools
import sys
import time

import torch
import triton

from gr_plugin.ops.triton import hstu_attention as tri


def case(bs, hist, new, cands, heads, dim, page):
    g = torch.Generator(device="cuda").manual_seed(0)
    npg = bs * (-(-hist // page)) + 4
    kv = torch.randn(npg, 2, page, heads, dim, device="cuda", dtype=torch.bfloat16, generator=g)
    idx = torch.randperm(npg, device="cuda")[: bs * (-(-hist // page))].to(torch.int64)
    indptr = torch.arange(0, bs + 1, device="cuda", dtype=torch.int64) * (-(-hist // page))
    nq = bs * (new + cands)
    q, k, v = (torch.randn(nq, heads, dim, device="cuda", dtype=torch.bfloat16, generator=g) for _ in range(3))
    q_off = torch.arange(0, bs + 1, device="cuda", dtype=torch.int64) * (new + cands)
    hl = torch.full((bs,), hist, device="cuda", dtype=torch.int64)
    nl = torch.full((bs,), new, device="cuda", dtype=torch.int64)
    return (q, k, v, kv, idx, indptr, q_off, hl, nl), new + cands, hist


def bench(fn):
    return triton.testing.do_bench(fn, warmup=10, rep=50, return_mode="median")


# NOTE: each config compiles once (the split count is a runtime argument); an earlier sweep with the default split
# heuristic found nothing faster than (64, 64, 4, 3) at head_dim 128, but the split count sets the number of waves
# (programs over SMs x programs per SM), so here every config runs with every split count.
CONFIGS = [(64, 64, 4, 3), (64, 64, 4, 4), (64, 128, 4, 2), (128, 64, 8, 3), (128, 64, 8, 2), (128, 128, 8, 2),
           (64, 32, 4, 3)]
SPLITS = (1, 2, 4, 8)
MAIN = __name__ == "__main__"  # imported (`case`, by probe_attention_timeline.py): no sweep runs
if MAIN:  # the Triton kernel's tool: a graphed launch naming no tiles would take the Gluon kernel (hstu_gluon)
    tri.GLUON = False
if {"quick", "schedules", "splits", "bucket", "small", "grid"} & set(sys.argv[1:]):
    CONFIGS = []


def sweep(name, args, flops, dim, launch):
    results = []
    for (bm, bn, w, st), splits in itertools.product(CONFIGS, SPLITS):
        if dim == 256 and (bn == 128 or (bm == 128 and bn >= 64)):
            continue
        try:
            ms = bench(lambda: launch(args, splits, (bm, bn, w, st), True))
        except Exception as e:  # a config that does not compile is reported, not fatal
            print(f"   BM={bm} BN={bn} warps={w} stages={st} splits={splits}: {type(e).__name__}")
            ms = float("nan")
        results.append((ms, bm, bn, w, st, splits))
    results.sort(key=lambda r: (r[0] != r[0], r[0]))
    default = bench(lambda: launch(args, None, None, None))
    exact = bench(lambda: launch(args, None, None, False))
    print(f"{name}: default {default:.3f} ms ({flops / default / 1e9:.0f} TFLOP/s), exact SiLU {exact:.3f} ms; best:")
    for ms, bm, bn, w, st, sp in results[:6]:
        print(f"   {ms:.3f} ms  {flops / ms / 1e9:.0f} TFLOP/s  BM={bm} BN={bn} warps={w} stages={st} splits={sp}")


def graphed(fn):
    """GPU time per call, launches replayed from a CUDA graph (what the graph buckets run): the
    kernel's time without the host's launch cost, which `bench` includes once it exceeds the kernel."""
    return triton.testing.do_bench_cudagraph(fn, rep=50, return_mode="median")


def graphed_best(fns, ref, rounds=2):
    """``(best, diffs)``: each launch's graphed ms (min of ``rounds`` interleaved rounds) and its max
    difference from ``ref``; a launch that does not compile (shared memory) is reported and dropped."""
    best, diffs = {}, {}
    for label, fn in list(fns.items()):
        try:
            diffs[label] = (fn().float() - ref.float()).abs().max().item()
        except Exception as e:
            print(f"   {label}: {type(e).__name__}: {str(e)[:120]}")
            del fns[label]
    for _ in range(rounds):
        for label, fn in fns.items():
            best[label] = min(best.get(label, float("inf")), graphed(fn))
    return best, diffs


def eager_us(fn, n=200):
    """Wall time per call of ``n`` eager calls (host launch cost included), in microseconds."""
    fn()
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    for _ in range(n):
        fn()
    torch.cuda.synchronize()
    return (time.perf_counter() - t0) / n * 1e6


def schedules(name, args, flops, max_q, max_kv, sms, only_split=False):
    """The paged kernel's grids side by side in this one run: graphed ms (min over 3 interleaved
    rounds), TFLOP/s, eager wall us per call."""
    bs, heads = args[6].numel() - 1, args[0].shape[1]
    blocks = tri._blocks(args[0].shape[-1], args[0].dtype, True, args[0].device)
    bm, bn = blocks[:2]
    tiles, kv_blocks = bs * heads * -(-max_q // bm), -(-max_kv // bn)
    pow2 = max(1, min(sms // tiles, kv_blocks // 4, 32))
    pow2 = 1 << (pow2.bit_length() - 1)  # the split rule before commit "any split count"
    rule = tri._default_splits(args[0].shape[0], bs, heads, max_q, max_kv, blocks, args[0].shape[-1], 2,
                               args[0].device)
    wave = sms * tri._resident(blocks, args[0].shape[-1], 2, args[0].device)
    # NOTE: the split variants name `_blocks`' tiles, so that every split count runs on the tiles the
    # rule was counted for (a launch naming no blocks or splits takes `_launch_blocks`, 64-row tiles at bs 1-2)
    variants = {
        "split": dict(schedule="split", tma=False, blocks=blocks),
        "split + tma": dict(schedule="split", tma=True, blocks=blocks),
        **{f"split + tma, {n} splits{' (old rule)' if n == pow2 else ''}{' (> 1 wave)' if n * tiles > wave else ''}":
           dict(schedule="split", tma=True, num_splits=n, blocks=blocks)
           for n in sorted({pow2, rule, rule + 1, 2 * rule} - {1})},
        "stream": dict(schedule="stream", tma=False),
        "stream + tma": dict(schedule="stream", tma=True),
        "stream + tma + ws": dict(schedule="stream", tma=True, warp_specialize=True),
        "stream + tma, 1 program per tile": dict(schedule="stream", tma=True, programs=bs * heads * -(-max_q // 128)),
        "stream + tma, 64x64 2/SM": dict(schedule="stream", tma=True, blocks=(64, 64, 4, 3), programs=2 * sms),
        "stream, max_q = all tokens (graphs)": dict(schedule="stream", max_q=args[0].shape[0]),
    }
    ref = tri._launch(*args, 0.1, 4096.0, max_q, paged=True, max_kv_len=max_kv, schedule="split", tma=False)
    fns, best = {}, {}
    for label, kw in variants.items():
        if only_split and label.startswith("stream"):
            continue
        kw = dict(kw)
        mq = kw.pop("max_q", max_q)
        if (kw.get("blocks") or (0, 0))[1] > args[3].shape[-3] or (args[0].shape[-1] > 128 and
                                                                      kw.get("blocks") not in (None, blocks)):
            continue
        fn = (lambda mq, kw: lambda: tri._launch(*args, 0.1, 4096.0, mq, paged=True, max_kv_len=max_kv, **kw))(mq, kw)
        try:
            diff = (fn().float() - ref.float()).abs().max().item()
        except Exception as e:  # a variant that does not compile is reported, not fatal
            print(f"   {label}: {type(e).__name__}: {str(e)[:200]}")
            continue
        fns[label], best[label] = (fn, diff), float("inf")
    for _ in range(3):
        for label, (fn, _) in fns.items():
            best[label] = min(best[label], graphed(fn))
    print(f"{name}:")
    for label, (fn, diff) in fns.items():
        ms = best[label]
        print(f"   {ms:.3f} ms  {flops / ms / 1e9:.0f} TFLOP/s  eager {eager_us(fn):.0f} us/call  {label}  "
              f"(max diff vs split {diff:.2e})")


def bucket_case(bs, users, hist, new, cands, heads, dim, page, quantum=256):
    """`case` as a CUDA graph bucket of `gr_plugin.modules.graphs` holds it: ``users`` segments, the
    ``bs`` real users', then a padding user with no history owning the query rows up to the next
    multiple of ``quantum`` (`bucket_key`'s rule; none where the real ones fill it), then empty ones;
    ``max_history_len`` the cache's capacity (here 4x). Returns the args, the bucket's rows and that capacity."""
    args, _, max_kv = case(bs, hist, new, cands, heads, dim, page)
    q, k, v, kv, idx, indptr, q_off, hl, nl = args
    nq = q.shape[0]
    tokens = -(-nq // quantum) * quantum
    pad = torch.zeros(tokens - nq, heads, dim, device="cuda", dtype=q.dtype)
    q, k, v = (torch.cat([t, pad]) for t in (q, k, v))
    extra = users - bs
    zeros = torch.zeros(extra, device="cuda", dtype=torch.int64)
    args = (q, k, v, kv, idx, torch.cat([indptr, indptr[-1:].repeat(extra)]),
            torch.cat([q_off, q_off.new_full((extra,), tokens)]), torch.cat([hl, zeros]), torch.cat([nl, zeros]))
    return args, tokens, 4 * max_kv


if MAIN and "bucket" in sys.argv[1:]:
    # the attention launch of an engine bucket (e2e requests: 128 new + 256 candidates per user, history 4096,
    # head_dim 128), side by side: as commit d3b28d0 launched it (a power of two of users, max_q_len = every row,
    # splits counted from the grid), as 5753a8b did (the same launch, splits from `_query_tiles`), and as
    # `bucket_key` keys it (exact users below EXACT_USERS, max_q_len = each user's rows rounded up) with
    # max_history_len the cache's capacity and the one-wave rule (9511b71), and with `history_bound` and the
    # makespan model (now). The earlier launches count their splits by the one-wave rule, as they did.
    from gr_plugin.modules.graphs import _pow2, bucket_key, history_bound

    blocks = tri._blocks(128, torch.bfloat16, True, torch.device("cuda"))
    bm = blocks[0]
    for bs in [int(a) for a in sys.argv[2:]] or (1, 2, 4, 8):
        users, tokens, _, max_q = bucket_key(bs, 384 * bs, 128 * bs, 384)
        old_users = _pow2(bs + 1)
        old_args, _, max_kv = bucket_case(bs, old_users, 4096, 128, 256, 4, 128, 128)
        # the same inputs, without the empty users past the padding user (`case` draws its page order anew)
        new_args = (*old_args[:5], old_args[5][: users + 1], old_args[6][: users + 1], old_args[7][:users],
                    old_args[8][:users])
        grid = tri._splits(old_users * -(-tokens // bm) * 4, max_kv, blocks, 128, 2, old_args[0].device, model=False)
        # (the two earlier launches on the 128-row tiles they ran on; now: the launch's own choice, `_launch_blocks`)
        bound = history_bound(4096, max_kv)
        variants = {
            f"d3b28d0: {old_users} users, max_q_len {tokens}, {grid} splits (grid count)":
                (old_args, tokens, grid, blocks, max_kv, False),
            f"5753a8b: {old_users} users, max_q_len {tokens}, one-wave rule":
                (old_args, tokens, None, blocks, max_kv, False),
            f"9511b71: {users} users, max_q_len {max_q}, one-wave rule, max_history_len {max_kv} (capacity)":
                (new_args, max_q, None, None, max_kv, False),
            f"now: {users} users, max_q_len {max_q}, makespan rule, max_history_len {bound} (history_bound)":
                (new_args, max_q, None, None, bound, True),
        }
        ref = tri._launch(*new_args, 0.1, 4096.0, max_q, paged=True, max_kv_len=max_kv, num_splits=1)
        fns = {label: (lambda a=a, mq=mq, n=n, bl=bl, kv=kv, t=t: tri._launch(
                   *a, 0.1, 4096.0, mq, paged=True, max_kv_len=kv, num_splits=n, blocks=bl, tight_kv_len=t))
               for label, (a, mq, n, bl, kv, t) in variants.items()}
        best = dict.fromkeys(fns, float("inf"))
        for _ in range(3):
            for label, fn in fns.items():
                best[label] = min(best[label], graphed(fn))
        flops = bs * 4 * 384 * 4096 * 128 * 4
        print(f"bucket bs{bs} ({tokens} query rows):")
        for label, ms in best.items():
            diff = (fns[label]().float() - ref.float())[: bs * 384].abs().max().item()
            print(f"   {ms:.4f} ms  {flops / ms / 1e9:.0f} TFLOP/s  {label}  (max diff vs 1 split {diff:.2e})")
    sys.exit(0)

# (64, 64, 8, 2) at head_dim 128: added 2026-12-01 untimed; offline it compiles to 144 / 154 registers
# against 204 / 230 with 4 warps (scripts/kernel_resources.py, docs/BENCHMARKS.md)
SMALL_CONFIGS = {128: [(128, 128, 8, 2), (64, 128, 4, 2), (64, 128, 8, 2), (64, 64, 4, 3), (64, 64, 4, 2),
                       (64, 64, 8, 2), (128, 64, 8, 3), (128, 64, 8, 2), (64, 32, 4, 3)],
                 256: [(64, 32, 4, 2), (64, 32, 8, 2), (64, 32, 4, 3), (64, 64, 4, 2), (64, 64, 8, 2), (128, 32, 8, 2),
                       (32, 64, 4, 2), (32, 32, 4, 3)]}

if MAIN and "small" in sys.argv[1:]:
    # graphed ms (min of 2 rounds) of every (config, split count) at the small batches, against the default
    # launch (its config, the split rule); every output checked against the default's
    sms = torch.cuda.get_device_properties(0).multi_processor_count
    chosen = [int(a) for a in sys.argv[2:] if a.isdigit()]  # ``small 3 4``: those batch sizes at head_dim 128 only
    waves = 6 if "wide" in sys.argv[2:] else 3  # ``small wide``: split counts up to 6 programs per SM, not 3
    small_cases = ([(bs, 128, 128) for bs in chosen] if chosen else
                   [(1, 128, 128), (2, 128, 128), (4, 128, 128), (1, 256, 32), (2, 256, 32)])
    for bs, dim, page in small_cases:
        args, max_q, max_kv = case(bs, 4096, 128, 256, 4, dim, page)
        flops = bs * 4 * 384 * 4096 * dim * 4
        gate = {}
        if "gate" in sys.argv[2:]:  # u, weight, bias of the layer's norm and gate (bf16, as the model's)
            width = 4 * dim
            gate = {"norm_gate": (torch.ones(width, device="cuda", dtype=torch.bfloat16),
                                  torch.zeros(width, device="cuda", dtype=torch.bfloat16), 1e-5,
                                  torch.randn(args[0].shape[0], width, device="cuda", dtype=torch.bfloat16))}
        ref = tri._launch(*args, 0.1, 4096.0, max_q, paged=True, max_kv_len=max_kv, **gate)
        fns = {"default": lambda: tri._launch(*args, 0.1, 4096.0, max_q, paged=True, max_kv_len=max_kv, **gate)}
        for bl in SMALL_CONFIGS[dim]:
            tiles = bs * 4 * -(-max_q // bl[0])
            rule = tri._default_splits(args[0].shape[0], bs, 4, max_q, max_kv, bl, dim, 2, args[0].device)
            for sp in sorted({rule, 2, 3, 4, 6, 8, 11, 16, 22, 32}):
                if tiles * sp > waves * sms or sp * 2 > -(-max_kv // bl[1]):
                    continue
                label = f"BM={bl[0]} BN={bl[1]} warps={bl[2]} stages={bl[3]} splits={sp}"
                fns[label + (" (rule)" if sp == rule else "")] = (
                    lambda bl=bl, sp=sp: tri._launch(*args, 0.1, 4096.0, max_q, paged=True, max_kv_len=max_kv,
                                                     num_splits=sp, blocks=bl, **gate))
        best, diffs = graphed_best(fns, ref)
        tiles = tri._query_tiles(args[0].shape[0], bs, 3, 128) * 4
        gated = " with the norm gate" if gate else ""
        print(f"small bs{bs} d{dim} p{page} ({tiles} tiles of 128 rows x heads){gated}: "
              f"default {best['default']:.4f} ms")
        for label, ms in sorted(best.items(), key=lambda kv: kv[1])[:10]:
            print(f"   {ms:.4f} ms  {flops / ms / 1e9:.0f} TFLOP/s  {label}  (max diff vs default {diffs[label]:.2e})")
    sys.exit(0)

GRID_CONFIGS = {128: [(128, 128, 8, 2), (128, 64, 8, 2), (64, 128, 4, 2), (64, 64, 4, 2), (64, 64, 4, 3),
                      (64, 32, 4, 3)],
                256: [(64, 32, 4, 2), (64, 32, 8, 2), (64, 32, 4, 3), (64, 64, 8, 2), (32, 64, 4, 2)]}
GRID_SPLITS = (1, 2, 3, 4, 5, 6, 8, 11, 16)

if MAIN and "grid" in sys.argv[1:]:
    # ``grid DIM HIST BS...``: graphed ms (min of 2 rounds) of every (config, split count) of `GRID_CONFIGS`, the
    # norm gate as epilogue, up to 6 programs per SM, at one head size and history, for each batch size: every
    # measurement printed (and appended to $OUT/grid.jsonl where OUT is set), to fit a split rule to
    import json
    import os

    dim, hist = int(sys.argv[2]), int(sys.argv[3])
    page = 128 if dim <= 128 else 32
    sms = torch.cuda.get_device_properties(0).multi_processor_count
    sink = os.path.join(os.environ["OUT"], "grid.jsonl") if os.environ.get("OUT") else None
    for bs in [int(a) for a in sys.argv[4:]]:
        args, max_q, max_kv = case(bs, hist, 128, 256, 4, dim, page)
        width = 4 * dim
        gate = {"norm_gate": (torch.ones(width, device="cuda", dtype=torch.bfloat16),
                              torch.zeros(width, device="cuda", dtype=torch.bfloat16), 1e-5,
                              torch.randn(args[0].shape[0], width, device="cuda", dtype=torch.bfloat16))}
        ref = tri._launch(*args, 0.1, 4096.0, max_q, paged=True, max_kv_len=max_kv, **gate)
        fns = {("default", 0): lambda: tri._launch(*args, 0.1, 4096.0, max_q, paged=True, max_kv_len=max_kv, **gate)}
        for bl in GRID_CONFIGS[dim]:
            tiles = bs * 4 * -(-max_q // bl[0])
            for sp in GRID_SPLITS:
                if tiles * sp > 6 * sms or sp * 2 > -(-max_kv // bl[1]):
                    continue
                fns[(bl, sp)] = (lambda bl=bl, sp=sp: tri._launch(*args, 0.1, 4096.0, max_q, paged=True,
                                                                  max_kv_len=max_kv, num_splits=sp, blocks=bl, **gate))
        best, diffs = graphed_best(fns, ref)
        print(f"grid d{dim} h{hist} bs{bs}: default {best[('default', 0)]:.4f} ms", flush=True)
        rows = []
        for (bl, sp), ms in sorted(best.items(), key=lambda kv: kv[1]):
            print(f"   {ms:.4f} ms  {bl} splits={sp}  (max diff {diffs[(bl, sp)]:.1e})")
            rows.append(dict(dim=dim, hist=hist, bs=bs, blocks=bl, splits=sp, ms=ms, diff=diffs[(bl, sp)]))
        if sink:
            with open(sink, "a") as f:
                f.writelines(json.dumps(r) + "\n" for r in rows)
    sys.exit(0)

if MAIN and ("schedules" in sys.argv[1:] or "splits" in sys.argv[1:]):
    only_split = "splits" in sys.argv[1:]
    sms = torch.cuda.get_device_properties(0).multi_processor_count
    cases = {
        "paged bs8 h4096 d128 p128": (8, 4096, 128, 256, 4, 128, 128),
        "paged bs1 h4096 d128 p128": (1, 4096, 128, 256, 4, 128, 128),
        "paged bs4 h4096 d128 p128": (4, 4096, 128, 256, 4, 128, 128),
        "paged bs8 h1024 d128 p128": (8, 1024, 128, 256, 4, 128, 128),
        "paged bs8 h4096 d256 p32": (8, 4096, 128, 256, 4, 256, 32),
    }
    if only_split:  # the small batches, where the split count sets how many SMs work
        cases.update({"paged bs2 h4096 d128 p128": (2, 4096, 128, 256, 4, 128, 128),
                      "paged bs1 h1024 d128 p128": (1, 1024, 128, 256, 4, 128, 128),
                      "paged bs1 h4096 d256 p32": (1, 4096, 128, 256, 4, 256, 32),
                      "paged bs2 h4096 d256 p32": (2, 4096, 128, 256, 4, 256, 32),
                      "paged bs4 h4096 d256 p32": (4, 4096, 128, 256, 4, 256, 32)})
    for name, (bs, hist, new, cands, heads, dim, page) in cases.items():
        args, max_q, max_kv = case(bs, hist, new, cands, heads, dim, page)
        schedules(name, args, bs * heads * (new + cands) * hist * dim * 4, max_q, max_kv, sms, only_split)
    sys.exit(0)

def default_sweep() -> None:
    """Every config with every split count (`CONFIGS` x `SPLITS`), eager: the paged form at bs 8 and 1,
    and the full (jagged) pass the block's recompute uses."""
    for name, (bs, hist, new, cands, heads, dim, page) in {
        "paged bs8 h4096 d128 p128": (8, 4096, 128, 256, 4, 128, 128),
        "paged bs1 h4096 d128 p128": (1, 4096, 128, 256, 4, 128, 128),
        "paged bs8 h4096 d256 p32": (8, 4096, 128, 256, 4, 256, 32),
    }.items():
        args, max_q, max_kv = case(bs, hist, new, cands, heads, dim, page)
        flops = bs * heads * (new + cands) * hist * dim * 4
        sweep(name, args, flops, dim, lambda a, sp, bl, fast, max_q=max_q, max_kv=max_kv: tri._launch(
            *a, 0.1, 4096.0, max_q, paged=True, max_kv_len=max_kv, num_splits=sp, blocks=bl, fast=fast))
    # the full (jagged) pass: history 4096 + 256 candidates per user
    bs, hist, cands, heads, dim = 8, 4096, 256, 4, 128
    g = torch.Generator(device="cuda").manual_seed(0)
    n = bs * (hist + cands)
    q, k, v = (torch.randn(n, heads, dim, device="cuda", dtype=torch.bfloat16, generator=g) for _ in range(3))
    off = torch.arange(0, bs + 1, device="cuda", dtype=torch.int64) * (hist + cands)
    hl = torch.full((bs,), hist, device="cuda", dtype=torch.int64)
    flops = bs * heads * dim * 4 * (hist * (hist + 1) // 2 + cands * (hist + 1))
    sweep("jagged bs8 4096+256 d128", (q, k, v, None, None, None, off, hl, hl), flops, dim,
          lambda a, sp, bl, fast: tri._launch(*a, 0.1, 4096.0, hist + cands, paged=False, max_kv_len=hist + cands,
                                              num_splits=sp, blocks=bl, fast=fast))


if MAIN:
    default_sweep()
