"""Where does the host time before a layerwise onboard's first copy go? (the 2K tiers row of
docs/BENCHMARKS.md: the GPU idles from the request's first event until the first copy starts)

python3 scripts/gpu/probe_onboard_host.py [tokens] [repeats]

The tiers bench's bs-1 block (head_dim 128, page 128, 128 new events) with every cached page in the
host tier. Times ``onboard_launch`` unprofiled: host µs from the call to its first raw copy launch
and to its return (medians); when each step of the launch is entered (one more pass with each step
wrapped to note the time, ~0.3 µs a wrapper); then the host cost of each step, each in a loop of its
own (the raw copies there move 64 bytes, so the copy engine never holds the host up).
"""

from __future__ import annotations

import statistics
import sys
import time

import torch

from gr_plugin.bench.block import host_hit_block
from gr_plugin.cache import cudart, transfer
from gr_plugin.cache.transfer import joint_runs


def _loop_us(fn, n: int = 2000) -> float:
    fn()
    t = time.perf_counter()
    for _ in range(n):
        fn()
    return (time.perf_counter() - t) / n * 1e6


def main(tokens: int = 2048, repeats: int = 50) -> None:
    new, page = 128, 128
    blk = host_hit_block(tokens, 128, page, new)
    m = blk.cache
    rt = cudart.runtime()
    raw_memcpy = rt.memcpy_async
    first: list[float] = []

    def spy(*args):  # the first raw copy's launch time of each onboard
        if not first:
            first.append(time.perf_counter())
        raw_memcpy(*args)

    rt.memcpy_async = spy
    marks: dict[str, list[float]] = {}

    def onboards(passes: int) -> tuple[list[float], list[float]]:
        to_first, total = [], []
        with torch.no_grad():
            for r in range(passes + 3):
                m.evict([1])
                plan = blk.plan([1], tokens)
                torch.cuda.synchronize()
                first.clear()
                marks.clear()
                t0 = time.perf_counter()
                handle = m.onboard_launch(plan)
                t1 = time.perf_counter()
                handle.wait()
                torch.cuda.synchronize()
                if r >= 3:
                    to_first.append((first[0] - t0) * 1e6)
                    total.append((t1 - t0) * 1e6)
                    for name, ts in marks.items():
                        seen.setdefault(name, []).append((ts[0] - t0) * 1e6)
                m.abort(plan)
                m.offload_flush()
        return to_first, total

    seen: dict[str, list[float]] = {}
    to_first, total = onboards(repeats)
    print(f"tokens {tokens}: onboard_launch host us: to first copy {statistics.median(to_first):.1f}, "
          f"return {statistics.median(total):.1f} (look-ahead {m.transfer.onboard_lookahead})")

    def note(name: str, fn):
        def wrapped(*args, **kwargs):
            marks.setdefault(name, []).append(time.perf_counter())
            return fn(*args, **kwargs)
        return wrapped

    eng = m.transfer
    saved = {n: getattr(eng, n) for n in ("copy", "_onboard", "_raw_copier", "_fence")}
    for n, fn in saved.items():
        setattr(eng, n, note(n, fn))
    lazy_init, joint = transfer._LazyCudaHandle.__init__, transfer.joint_runs
    transfer._LazyCudaHandle.__init__ = note("_LazyCudaHandle", lazy_init)
    transfer.joint_runs = note("joint_runs", joint)
    seen.clear()
    to_first, total = onboards(repeats)
    for n in saved:
        delattr(eng, n)
    transfer._LazyCudaHandle.__init__, transfer.joint_runs = lazy_init, joint
    print("  entered at (us from the call, wrapped): " + ", ".join(
        f"{n} {statistics.median(v):.1f}" for n, v in sorted(seen.items(), key=lambda kv: statistics.median(kv[1])))
        + f", first copy {statistics.median(to_first):.1f}, return {statistics.median(total):.1f}")
    rt.memcpy_async = raw_memcpy

    m.evict([1])
    plan = blk.plan([1], tokens)
    host = plan.host_metadata
    ind = plan.metadata.field_offsets["kv_indices"][0]
    slots = plan.onboard_src[0][2]
    dst = host[ind : ind + slots.numel()]
    stream = eng.h2d_stream
    src_t, dst_t = m.backend.host_table, m.kv_table
    event = rt.create_event()
    small_h = torch.zeros(256, dtype=torch.uint8, pin_memory=True)
    small_d = torch.zeros(256, dtype=torch.uint8, device="cuda")
    hp, dp = small_h.data_ptr(), small_d.data_ptr()

    def live() -> None:
        with m._lock:
            m._check_live(plan)

    steps = {
        "manager lock + _check_live": live,
        "int(host_metadata[i])": lambda: int(host[ind]),
        "host_metadata slice": lambda: host[ind : ind + slots.numel()],
        "joint_runs(tolist, tolist)": lambda: joint_runs(slots.tolist(), dst.tolist()),
        "_raw_copier (cached)": lambda: eng._raw_copier(src_t, dst_t),
        "_fence (record + wait, raw)": lambda: eng._fence(stream),
        "raw copy, 64 bytes": lambda: rt.memcpy_async(dp, hp, 64, cudart.H2D, stream),
        "raw 2-D copy, 2 rows of 64 bytes": lambda: rt.memcpy2d_async(dp, 128, hp, 128, 64, 2, cudart.H2D, stream),
        "torch.cuda.Event() + record": lambda: torch.cuda.Event().record(stream),
        "raw cudaEventRecord": lambda: rt._record(event, stream.cuda_stream),
    }
    for name, fn in steps.items():
        us = _loop_us(fn)
        torch.cuda.synchronize()
        print(f"  {name:>36}: {us:6.2f} us")
    m.abort(plan)
    m.close()


if __name__ == "__main__":
    args = sys.argv[1:]
    main(int(args[0]) if args else 2048, int(args[1]) if len(args) > 1 else 50)
