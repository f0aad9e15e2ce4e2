"""Why does the C++ runner fail on CUDA where the same package works from Python? (docs/EXPORT.md)

python3 scripts/gpu/runner_gpu_probe.py [workdir]

Exports the export test's tiny model on CUDA, records a short stream on the CPU (a copy of the
model), replays it in Python through the package on a fresh CUDA cache (per-batch max abs diff vs
the stream's scores), then runs the C++ runner on it with ``--device cuda --verbose`` and
``CUDA_LAUNCH_BLOCKING=1`` (its stderr, so the failing batch and kernel show).
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

from gr_plugin.csrc.build import load_library  # noqa: E402
from gr_plugin.csrc.runner.build import build_runner  # noqa: E402
from gr_plugin.export.runner import PackagedCachedRanker, export_package  # noqa: E402
from gr_plugin.export.stream import StreamBatch, read_stream, record_stream  # noqa: E402
from gr_plugin.modules.tokens import cache_token_keys  # noqa: E402
from tests.modules.helpers import User, make_inputs, tiny_cache, tiny_model  # noqa: E402


def main() -> None:
    work = Path(sys.argv[1] if len(sys.argv) > 1 else "/tmp/runner_gpu_probe")
    work.mkdir(parents=True, exist_ok=True)
    torch.backends.cuda.matmul.allow_tf32 = False
    cpu_model = tiny_model(2, head_dim=16)  # the Triton kernels take head_dim >= 16
    model = copy.deepcopy(cpu_model).to(DEVICE)
    g = torch.Generator().manual_seed(3)
    users = [User(u, g) for u in range(3)]
    batches = []
    for grow in (9, 4, 0, 6):
        for u in users:
            u.grow(grow)
        history, candidates, _, _ = make_inputs(users, [u.candidates(2) for u in users])
        batches.append(StreamBatch([u.uid for u in users], history, candidates))
    stream = record_stream(cpu_model, tiny_cache(cpu_model, backend="gpu", num_pages=96, page_size=4), batches,
                           work / "stream")
    s = read_stream(stream)
    print("stream batches:", len(batches), "cached lengths:", s.arrays["cached_lengths"].tolist(), flush=True)
    cache = tiny_cache(model, backend="gpu", num_pages=96, page_size=4, device=DEVICE)
    b0 = batches[0]
    lengths = b0.history["item"].lengths().tolist()
    keys = cache_token_keys(b0.history["item"].values(), b0.history["action"].values(), b0.history["time"].values())
    plan = cache.begin(list(range(-3, 0)), lengths, keys)
    package = export_package(model, cache, b0.history.to(DEVICE), b0.candidates.to(DEVICE), plan, work / "m.pt2")
    cache.abort(plan)
    packaged = PackagedCachedRanker(model, cache, package)
    at = 0
    for t, b in enumerate(batches):
        lengths = b.history["item"].lengths().tolist()
        keys = cache_token_keys(b.history["item"].values(), b.history["action"].values(), b.history["time"].values())
        plan = cache.begin(b.user_ids, lengths, keys)
        with torch.no_grad():
            got = packaged.score(b.history.to(DEVICE), b.candidates.to(DEVICE), plan).cpu()
        cache.commit(plan)
        want = s.arrays["scores"][at : at + got.shape[0]]
        at += got.shape[0]
        print(f"python package batch {t}: cached {plan.cached_lengths} max abs diff {(got - want).abs().max():.3g}",
              flush=True)
    exe = build_runner()
    env = {**os.environ, "CUDA_LAUNCH_BLOCKING": "1"}
    proc = subprocess.run([str(exe), "--package", str(package), "--stream", str(stream), "--ops", load_library(),
                           "--device", DEVICE, "--verbose", "--tolerance", "1e-4"], capture_output=True, text=True,
                          env=env, timeout=300)
    print("runner exit", proc.returncode)
    print(proc.stdout[-3000:])
    print(proc.stderr[-5000:])


if __name__ == "__main__":
    main()
