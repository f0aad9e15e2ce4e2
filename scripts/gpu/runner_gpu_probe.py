"""Why does the C++ runner fail on CUDA where the same package works from Python? (docs/EXPORT.md)

python3 scripts/gpu/runner_gpu_probe.py [workdir] [tiny|bench]

``tiny``: the export test's tiny model; ``bench``: the export bench's model and stream shape
(``hstu_small``-shaped, 8 users, 256 events, page 16; `gr_plugin.bench.export`). Exports the model on
CUDA, records the stream on the CPU (a copy of the model), replays every batch of it in Python
through the package on a fresh CUDA cache (per-batch max abs diff vs the stream's scores), then runs
the C++ runner on it with ``--device cuda --verbose``: plain, with ``CUDA_LAUNCH_BLOCKING=1`` and
AOTInductor's input checks, and under ``compute-sanitizer`` (its stderr, so the failing batch and kernel
show).
"""

from __future__ import annotations

import copy
import os
import subprocess
import sys
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[2]
DEVICE = os.environ.get("PROBE_DEVICE", "cuda")  # cpu: the same checks on a CPU machine
sys.path.insert(0, str(ROOT))

from gr_plugin.cache import KVCacheConfig  # noqa: E402
from gr_plugin.csrc.build import load_library  # noqa: E402
from gr_plugin.csrc.runner.build import build_runner  # noqa: E402
from gr_plugin.export.runner import PackagedCachedRanker, export_package  # noqa: E402
from gr_plugin.export.stream import StreamBatch, read_stream, record_stream  # noqa: E402
from gr_plugin.modules import HSTUConfig, HSTURanker, KVCacheModule, cache_token_keys  # noqa: E402
from tests.modules.helpers import User, make_inputs, tiny_cache, tiny_model  # noqa: E402


def tiny_setup():
    cpu_model = tiny_model(2, head_dim=16)  # the Triton kernels take head_dim >= 16
    g = torch.Generator().manual_seed(3)
    users = [User(u, g) for u in range(3)]
    batches = []
    for grow in (9, 4, 0, 6):
        for u in users:
            u.grow(grow)
        history, candidates, _, _ = make_inputs(users, [u.candidates(2) for u in users])
        batches.append(StreamBatch([u.uid for u in users], history, candidates))

    def cache(model, device):
        return tiny_cache(model, backend="gpu", num_pages=96, page_size=4, device=device)
    return cpu_model, batches, cache, batches[0]


def bench_setup():
    from gr_plugin.bench.export import _Stream

    cfg = HSTUConfig(num_items=3706, num_time_buckets=32, embedding_dim=64, num_layers=2, num_heads=2, head_dim=32,
                     n_norm=512.0)
    torch.manual_seed(0)
    cpu_model = HSTURanker(cfg).eval()
    batch, steps, new = 8, int(os.environ.get("PROBE_STEPS", "23")), 8  # the bench: 3 warm-ups + 20 steps
    pages = 4 * batch * (-(-(256 + steps * new) // 16) + 1)
    ex = _Stream(cfg, batch, seed=99)
    ex.grow(256)
    history, cands, _, _ = ex.request(16)
    example = StreamBatch(list(range(-batch, 0)), history, cands)
    s = _Stream(cfg, batch, seed=1)
    s.grow(256 - new)
    users = list(range(1000, 1000 + batch))
    batches = []
    for _ in range(steps + 1):
        history, cands, _, _ = s.request(16)
        batches.append(StreamBatch(users, history, cands))
        s.grow(new)

    def cache(model, device):
        c = KVCacheConfig(num_layers=cfg.num_layers, num_heads=cfg.num_heads, head_dim=cfg.head_dim, page_size=16,
                          num_pages=pages, device=device)
        return KVCacheModule(c, "gpu")
    return cpu_model, batches, cache, example


def keys_of(b: StreamBatch) -> tuple[list[int], torch.Tensor]:
    h = b.history
    return h["item"].lengths().tolist(), cache_token_keys(h["item"].values(), h["action"].values(), h["time"].values())


def main() -> None:
    work = Path(sys.argv[1] if len(sys.argv) > 1 else "/tmp/runner_gpu_probe")
    shape = sys.argv[2] if len(sys.argv) > 2 else "tiny"
    work.mkdir(parents=True, exist_ok=True)
    torch.backends.cuda.matmul.allow_tf32 = False
    cpu_model, batches, make_cache, example = {"tiny": tiny_setup, "bench": bench_setup}[shape]()
    model = copy.deepcopy(cpu_model).to(DEVICE)
    stream = record_stream(cpu_model, make_cache(cpu_model, "cpu"), batches, work / "stream")
    s = read_stream(stream)
    print(shape, "stream batches:", len(batches), "cached lengths:", s.arrays["cached_lengths"].tolist(), flush=True)
    cache = make_cache(model, DEVICE)
    lengths, keys = keys_of(example)
    plan = cache.begin(example.user_ids, lengths, keys)
    package = export_package(model, cache, example.history.to(DEVICE), example.candidates.to(DEVICE), plan,
                             work / "m.pt2")
    cache.abort(plan)
    packaged = PackagedCachedRanker(model, cache, package)
    at = 0
    for t, b in enumerate(batches):
        lengths, keys = keys_of(b)
        plan = cache.begin(b.user_ids, lengths, keys)
        with torch.no_grad():
            got = packaged.score(b.history.to(DEVICE), b.candidates.to(DEVICE), plan).cpu()
        cache.commit(plan)
        want = s.arrays["scores"][at : at + got.shape[0]]
        at += got.shape[0]
        print(f"python package batch {t}: cached {plan.cached_lengths} max abs diff {(got - want).abs().max():.3g}",
              flush=True)
    exe = build_runner()
    cmd = [str(exe), "--package", str(package), "--stream", str(stream), "--ops", load_library(), "--device", DEVICE,
           "--verbose", "--tolerance", "1e-4"]
    sanitizer = ["compute-sanitizer", "--tool", "memcheck", "--print-limit", "5"]
    for prefix, extra in (([], {}), ([], {"CUDA_LAUNCH_BLOCKING": "1", "AOTI_RUNTIME_CHECK_INPUTS": "1"}),
                          (sanitizer, {})):
        if prefix and DEVICE == "cpu":
            continue
        proc = subprocess.run(prefix + cmd, capture_output=True, text=True, env={**os.environ, **extra}, timeout=400)
        print("runner", prefix[:1], extra, "exit", proc.returncode)
        print(proc.stdout[-3000:])
        print(proc.stderr[-5000:], flush=True)


if __name__ == "__main__":
    main()
