"""The eager cached pass in its two forms, side by side in one process: `HSTURanker.forward_cached`
with ``silu_pass=False`` (the projection's SiLU taken in `ops.silu_append_kv` and the norm gate's pass,
the graphed step's form; the eager default from eb90a7f until this script measured it) against
``silu_pass=True`` (the projection activated first and the manager's append: the default).

python3 scripts/gpu/ab_eager.py [--cprofile] [--tiny] [bs ...]

The e2e suite's model (8 layers, hidden 1024, 4 heads of 128, page 128; bf16 on CUDA, fp32 on the CPU),
``bs`` users (default 1 and 8) with 3968 events cached and 128 new, 256 candidates each. Each round begins a
step, builds its token layout on the host and copies it to the device (untimed, as `RankingEngine.prepare`
does), runs one form, and aborts, so every round reads the same pages; the two forms take turns, each
first in every other round (before 2026-12-02 04:30 the pre-SiLU form ran first in every round). Prints
each form's median wall ms (device synchronised around the call; p10 and p90) over ``ROUNDS`` rounds per
form, the median of the rounds' paired differences and in how many rounds the first form took longer, the
median host ms until the call returns, the device time of a round's kernels and copies (torch.profiler,
the mean of 5 rounds; the layout's copy is in both forms' totals) and the kernels whose time differs by
more than 0.5 µs, and the largest difference between their logits; ``--cprofile``: each form's host time
by function (cProfile, whole rounds). On the CPU it only checks that it runs (``--tiny``: a 2-layer,
hidden-64 model with a 256-event history)."""

from __future__ import annotations

import cProfile
import io
import pstats
import statistics
import sys
import time

import torch

from gr_plugin.bench.block import kernel_times
from gr_plugin.bench.e2e import stream_cache_config, stream_model
from gr_plugin.bench.export import _Stream
from gr_plugin.modules import KVCacheModule
from gr_plugin.modules.tokens import build_token_layout

ROUNDS = 30


def layout_of(model, history, candidates, plan, device):
    """The plan's token layout built on the host and copied to ``device`` before the timed call, as
    `RankingEngine.prepare` does for the eager step (``forward_cached(..., layout=...)``)."""
    cached = torch.tensor(plan.cached_lengths, dtype=torch.int64)
    return build_token_layout(history, candidates, cached, model.config.max_positions).to(device)


def main() -> None:
    flags = {a for a in sys.argv[1:] if a.startswith("--")}
    if flags - {"--tiny", "--cprofile"}:
        raise SystemExit(f"unknown flags {sorted(flags - {'--tiny', '--cprofile'})}: --tiny, --cprofile")
    args = [a for a in sys.argv[1:] if not a.startswith("--")]
    tiny = "--tiny" in sys.argv
    device = torch.device("cuda" if torch.cuda.is_available() and not tiny else "cpu")
    dims = dict(hidden=64, layers=2, heads=2, head_dim=16) if tiny else {}
    hist, new, cands, page = (256, 32, 16, 16) if tiny else (3968, 128, 256, 128)
    sync = torch.cuda.synchronize if device.type == "cuda" else (lambda: None)
    torch.manual_seed(0)
    model = stream_model(device, **dims)
    for bs in [int(a) for a in args] or [1, 8]:
        kv = stream_cache_config(device, bs, hist + new, new, dims.get("layers", 8), dims.get("heads", 4),
                                 dims.get("head_dim", 128), page)
        cache = KVCacheModule(kv, "gpu")
        stream = _Stream(model.config, bs, seed=bs)  # the export bench's users: random events, growing
        stream.grow(hist)
        h0, c0, _, k0 = stream.request(cands)
        stream.grow(new)
        h1, candidates, _, k1 = stream.request(cands)
        users = list(range(bs))
        with torch.no_grad():
            plan = cache.begin(users, [hist] * bs, k0)
            model.forward_cached(h0, c0, cache, plan, layout=layout_of(model, h0, c0, plan, device))
            cache.commit(plan)
            forms = {"silu_pass=False (pre-SiLU, eb90a7f)": lambda p, lay: model.forward_cached(
                         h1, candidates, cache, p, layout=lay, silu_pass=False),
                     "silu_pass=True (the default)": lambda p, lay: model.forward_cached(
                         h1, candidates, cache, p, layout=lay, silu_pass=True)}
            walls, hosts = ({name: [] for name in forms} for _ in range(2))
            logits = {}

            def one(name, fn, r=None):
                plan = cache.begin(users, [hist + new] * bs, k1)
                if plan.metadata.cached_lengths.sum() != bs * hist:
                    raise RuntimeError(f"expected {bs * hist} cached events, got {plan.metadata.cached_lengths}")
                layout = layout_of(model, h1, candidates, plan, device)
                sync()
                t0 = time.perf_counter()
                logits[name] = fn(plan, layout)
                t1 = time.perf_counter()
                sync()
                if r is not None and r >= 2:
                    walls[name].append(time.perf_counter() - t0)
                    hosts[name].append(t1 - t0)
                cache.abort(plan)

            for r in range(ROUNDS + 2):  # two warm-up rounds; each form first in every other round
                for name, fn in (list(forms.items()) if r % 2 else list(forms.items())[::-1]):
                    one(name, fn, r)
            if "--cprofile" in sys.argv:  # the host's time by function, 10 calls of each form
                for name, fn in forms.items():
                    prof = cProfile.Profile()
                    prof.enable()
                    for _ in range(10):
                        one(name, fn)
                    prof.disable()
                    text = io.StringIO()
                    pstats.Stats(prof, stream=text).sort_stats("tottime").print_stats(25)
                    print(f"--- bs {bs} {name}: host profile (10 rounds: begin, the layout, the call, abort)\n"
                          f"{text.getvalue()}")
            kernels = {name: kernel_times(lambda name=name, fn=fn: one(name, fn), steps=5)[0]
                       for name, fn in forms.items()} if device.type == "cuda" else {}
        a, b = logits.values()
        print(f"=== bs {bs} ({device.type}): max abs diff {(a.float() - b.float()).abs().max().item():.3g}", flush=True)
        for name, w in walls.items():
            q = statistics.quantiles(w, n=10)
            print(f"  {1e3 * statistics.median(w):8.3f} ms wall (p10 {1e3 * q[0]:.3f}, p90 {1e3 * q[-1]:.3f}), host "
                  f"{1e3 * statistics.median(hosts[name]):.3f} ms to return"
                  + (f", kernels {1e-3 * sum(kernels[name].values()):.3f} ms" if kernels else "") + f"  {name}",
                  flush=True)
        (na, wa), (nb, wb) = walls.items()
        paired = [x - y for x, y in zip(wa, wb)]  # the same round's two walls
        print(f"  paired: {na} minus {nb}, median {1e3 * statistics.median(paired):+.3f} ms a round, "
              f"{sum(d > 0 for d in paired)} of {len(paired)} rounds positive", flush=True)
        if kernels:
            ka, kb = kernels.values()
            for k in sorted(set(ka) | set(kb), key=lambda k: -abs(ka[k] - kb[k])):
                if abs(ka[k] - kb[k]) > 0.5:
                    print(f"    {ka[k]:9.1f} {kb[k]:9.1f} µs  {k[:90]}", flush=True)


if __name__ == "__main__":
    main()
