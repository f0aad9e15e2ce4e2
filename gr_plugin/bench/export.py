"""Eager cached inference vs the AOTInductor package of the whole cached step (from Python and from the
C++ runner), with and without cache hits.

Owns the "export" benchmark (``python -m recipes.bench suite=export``): an ``hstu_small``-shaped model
(random weights: only time is measured, plus a check against full recomputation) exported once, then
the same request stream scored by ``forward_cached`` (eager Python), by the package
(`PackagedCachedRanker`, loaded in Python) and, with ``cpp_runner``, by the C++ runner
(``gr_plugin/csrc/runner``) replaying the same requests recorded as a stream (`gr_plugin.export.stream`).
``hit``: returning users whose history is cached except the ``new_events`` newest; ``miss``: every
step's plan is aborted, so the whole history is computed. Timed in Python: the scoring call only
(token layout + the model), not lookup / allocate / commit; for the runner: its whole step (cache
lookup, allocate, inputs, the package, commit), and the package call alone (``package_ms_p50``).
``device=cuda``: the model, the KV table and the package on the GPU (fp32, TF32 off; each timed call
ends with a device synchronisation); the runner's stream is still recorded on the CPU (a copy of the
model), the runner replays it on the GPU (``--device cuda``) and its scores are checked to 1e-4.
"""

from __future__ import annotations

import copy
import dataclasses
import logging
import tempfile
import time
from pathlib import Path
from typing import Any

import torch
from torchrec.sparse.jagged_tensor import KeyedJaggedTensor

from gr_plugin.bench.common import summarize
from gr_plugin.cache import KVCacheConfig
from gr_plugin.csrc.runner.build import build_runner, run_runner
from gr_plugin.export.runner import PackagedCachedRanker, export_package
from gr_plugin.export.stream import StreamBatch, record_stream
from gr_plugin.modules import HSTUConfig, HSTURanker, KVCacheModule, cache_token_keys

logger = logging.getLogger(__name__)


class _Stream:
    """``batch`` users with growing random histories and fresh candidates each step."""

    def __init__(self, cfg: HSTUConfig, batch: int, seed: int) -> None:
        self.cfg, self.g = cfg, torch.Generator().manual_seed(seed)
        self.events = [torch.zeros(3, 0, dtype=torch.int64) for _ in range(batch)]

    def grow(self, n: int) -> None:
        c = self.cfg
        for b, e in enumerate(self.events):
            new = torch.stack([torch.randint(1, c.num_items + 1, (n,), generator=self.g),
                               torch.randint(1, c.num_actions, (n,), generator=self.g),
                               torch.randint(0, c.num_time_buckets, (n,), generator=self.g)])
            self.events[b] = torch.cat([e, new], dim=1)

    def request(self, candidates: int) -> tuple[KeyedJaggedTensor, KeyedJaggedTensor, list[int], torch.Tensor]:
        lengths = torch.tensor([e.shape[1] for e in self.events])
        flat = torch.cat(self.events, dim=1)  # [3, sum(L)]
        history = KeyedJaggedTensor(keys=["item", "action", "time"], values=flat.reshape(-1),
                                    lengths=lengths.repeat(3))
        cands = torch.randint(1, self.cfg.num_items + 1, (len(self.events) * candidates,), generator=self.g)
        cand_kjt = KeyedJaggedTensor(keys=["item"], values=cands,
                                     lengths=torch.full((len(self.events),), candidates))
        return history, cand_kjt, lengths.tolist(), cache_token_keys(flat[0], flat[1], flat[2])


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _scenario(model: HSTURanker, cache: KVCacheModule, packaged: PackagedCachedRanker, scenario: str, *,
              batch: int, history_len: int, new_events: int, candidates: int, steps: int, warmup: int,
              seed: int, device: torch.device) -> tuple[list[dict[str, Any]], list[StreamBatch], list[torch.Tensor]]:
    """Rows of the two Python modes, and the requests in order with their full recomputation (what the
    C++ runner replays: the priming request of ``hit`` first)."""
    stream = _Stream(model.config, batch, seed)
    users = list(range(seed * 1000, seed * 1000 + batch))
    stream.grow(history_len - new_events)
    requests: list[StreamBatch] = []
    fulls: list[torch.Tensor] = []
    if scenario == "hit":  # the history so far is cached
        history, cands, lengths, keys = stream.request(candidates)
        requests.append(StreamBatch(users, history, cands))
        history, cands = history.to(device), cands.to(device)
        plan = cache.begin(users, lengths, keys)
        with torch.no_grad():
            model.forward_cached(history, cands, cache, plan)
            fulls.append(model(history, cands).cpu())
        cache.commit(plan)
    times: dict[str, list[float]] = {"eager": [], "package": []}
    diffs: dict[str, float] = {"eager": 0.0, "package": 0.0}
    query_tokens = []
    for step in range(warmup + steps):
        if scenario == "hit" or step == 0:
            stream.grow(new_events)
        history, cands, lengths, keys = stream.request(candidates)
        requests.append(StreamBatch(users, history, cands))
        history, cands = history.to(device), cands.to(device)
        with torch.no_grad():
            full = model(history, cands)
        fulls.append(full.cpu())
        for mode in ("eager", "package"):
            plan = cache.begin(users, lengths, keys)
            if plan is None:
                raise RuntimeError(f"the cache ({cache.config.num_pages} pages) cannot hold batch {batch}")
            with torch.no_grad():
                _sync(device)
                t0 = time.perf_counter()
                got = (model.forward_cached(history, cands, cache, plan) if mode == "eager"
                       else packaged.score(history, cands, plan))
                _sync(device)
                dt = (time.perf_counter() - t0) * 1e3
            # NOTE: both modes see the same cache state: eager's step is rolled back; the package's is
            # committed on a hit (the next step's cached prefix) and rolled back on a miss.
            (cache.commit if scenario == "hit" and mode == "package" else cache.abort)(plan)
            if step >= warmup:
                times[mode].append(dt)
                diffs[mode] = max(diffs[mode], (got - full).abs().max().item())
        if step >= warmup:
            query_tokens.append(sum(lengths) - sum(plan.cached_lengths) + batch * candidates)
    rows = []
    for mode in ("eager", "package"):
        s = summarize(times[mode])
        rows.append({"scenario": scenario, "mode": "eager cached (Python)" if mode == "eager" else "AOTI package",
                     "batch": batch, "history": history_len, "query_tokens": round(sum(query_tokens) / steps),
                     "ms_p50": s["p50"], "ms_p90": s["p90"], "max_abs_diff_vs_full": diffs[mode]})
    return rows, requests, fulls


def _cpp_row(model: HSTURanker, cache_cfg: KVCacheConfig, package: str, runner: Path, scenario: str,
             requests: list[StreamBatch], fulls: list[torch.Tensor], untimed: int, tmp: Path,
             query_tokens: int, device: torch.device) -> dict[str, Any]:
    """The C++ runner on ``requests``: recorded as a stream (eager cached scores, a fresh device-only
    cache), replayed with commits (``hit``) or aborts (``miss``) on ``device``; its scores checked
    against ``fulls``. ``model`` and ``cache_cfg`` are on the CPU (where streams are recorded)."""
    stream = record_stream(model, KVCacheModule(cache_cfg, "gpu"), requests, tmp / f"{scenario}.stream",
                           with_inputs=scenario == "hit")
    scores_path = tmp / f"{scenario}.scores"
    res = run_runner(package, stream, mode=scenario, warmup=untimed, scores_out=scores_path, runner=runner,
                     device=str(device), tolerance=1e-5 if device.type == "cpu" else 1e-4)
    if res.returncode != 0:
        raise RuntimeError(f"the C++ runner failed ({res.returncode}) on the {scenario} stream:\n{res.stderr}")
    num_tasks = model.config.num_tasks
    scores = torch.from_file(str(scores_path), size=sum(f.numel() for f in fulls), dtype=torch.float32)
    got = scores.view(-1, num_tasks).split([f.shape[0] for f in fulls])
    diff = max((g - f).abs().max().item() for g, f in zip(got[untimed:], fulls[untimed:]))
    r = res.report
    return {"scenario": scenario, "mode": "C++ runner (AOTI package)", "batch": len(requests[0].user_ids),
            "history": None, "query_tokens": query_tokens, "ms_p50": r["step_ms_p50"], "ms_p90": r["step_ms_p90"],
            "package_ms_p50": r["run_ms_p50"], "max_abs_diff_vs_full": diff, "hit_rate": r["hit_rate"]}


def run(batch: int = 8, history_len: int = 256, new_events: int = 8, candidates: int = 16, steps: int = 20,
        warmup: int = 3, page_size: int = 16, model: dict | None = None,
        cpp_runner: bool = True, device: str = "cpu") -> list[dict[str, Any]]:
    """Rows for the ``hit`` and ``miss`` scenarios: eager, package and (``cpp_runner``: built here with
    CMake) the C++ runner, on ``device``. ``model``: `HSTUConfig` overrides (default ``hstu_small``'s shape,
    dropout off)."""
    torch.manual_seed(0)
    dev = torch.device(device)
    tf32 = torch.backends.cuda.matmul.allow_tf32
    torch.backends.cuda.matmul.allow_tf32 = False  # fp32 on the GPU too: compared with the CPU's scores
    try:
        return _run(batch, history_len, new_events, candidates, steps, warmup, page_size, model, cpp_runner, dev)
    finally:
        torch.backends.cuda.matmul.allow_tf32 = tf32


def _run(batch: int, history_len: int, new_events: int, candidates: int, steps: int, warmup: int, page_size: int,
         model: dict | None, cpp_runner: bool, dev: torch.device) -> list[dict[str, Any]]:
    cfg = HSTUConfig(**{"num_items": 3706, "num_time_buckets": 32, "embedding_dim": 64, "num_layers": 2,
                        "num_heads": 2, "head_dim": 32, "n_norm": 512.0, **(model or {})})
    net = HSTURanker(cfg).eval()
    cpu_net = copy.deepcopy(net) if dev.type != "cpu" else net  # streams are recorded on the CPU
    net = net.to(dev)
    pages = 4 * batch * (-(-(history_len + (warmup + steps) * new_events) // page_size) + 1)
    cache_cfg = KVCacheConfig(num_layers=cfg.num_layers, num_heads=cfg.num_heads, head_dim=cfg.head_dim,
                              page_size=page_size, num_pages=pages, device=str(dev))
    cache = KVCacheModule(cache_cfg, "gpu")
    runner = build_runner() if cpp_runner else None
    stream = _Stream(cfg, batch, seed=99)
    stream.grow(history_len)
    history, cands, lengths, keys = stream.request(candidates)
    history, cands = history.to(dev), cands.to(dev)
    plan = cache.begin(list(range(-batch, 0)), lengths, keys)
    with tempfile.TemporaryDirectory() as tmp:
        t0 = time.perf_counter()
        path = export_package(net, cache, history, cands, plan, Path(tmp) / "model.pt2")
        export_s = time.perf_counter() - t0
        cache.abort(plan)
        packaged = PackagedCachedRanker(net, cache, path)
        logger.info("export + AOTInductor compile: %.1f s", export_s)
        rows = []
        for i, scenario in enumerate(("hit", "miss")):
            py_rows, requests, fulls = _scenario(net, cache, packaged, scenario, batch=batch, history_len=history_len,
                                                 new_events=new_events, candidates=candidates, steps=steps,
                                                 warmup=warmup, seed=i + 1, device=dev)
            rows += py_rows
            if runner is not None:
                untimed = len(requests) - steps  # the priming request (hit) and the warm-ups
                row = _cpp_row(cpu_net, dataclasses.replace(cache_cfg, device="cpu"), path, runner, scenario,
                               requests, fulls, untimed, Path(tmp), py_rows[0]["query_tokens"], dev)
                rows.append({**row, "history": history_len})
    for r in rows:
        r["export_s"] = export_s
        r["device"] = str(dev)
    return rows


COLUMNS = ["device", "scenario", "mode", "batch", "history", "query_tokens", "ms_p50", "ms_p90", "package_ms_p50",
           "max_abs_diff_vs_full", "hit_rate", "export_s"]
