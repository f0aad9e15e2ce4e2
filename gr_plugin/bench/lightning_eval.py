"""Lightning evaluation (``python -m recipes.bench suite=lightning``): `Trainer.predict` of an
`HSTURankingModule` over the e2e suite's request stream (`e2e.stream`: histories growing by
``stride`` events a visit, ``num_candidates`` each), as a Lightning user runs it, three ways in
one process on the same module: without a callback (the full pass), with `KVCacheCallback`
running the cached pass eagerly (``cuda_graphs=False``), and with the callback's default (the
cached steps replayed as CUDA graphs on CUDA; eager elsewhere).

Each way predicts, in one `Trainer.predict` call, the same stream for other users first (Triton
compiles, graph captures; Lightning moves the module off the device when a call ends, so graphs are
captured again in every call) and then the timed stream, in a cache that holds both: requests/s
from the first timed batch's start to the end of the epoch, and the median interval between batch
starts (a batch's whole cost in the loop: loading, the move to the device, the cache step's
prepare, the scores' copy back, the commit, Lightning's own hooks). Reports the cached ways'
largest score difference against the full pass, hit rate and fallbacks over the whole call, and
the graphs' replays and captures while timed.
"""

from __future__ import annotations

import statistics
import time
from typing import Any

import lightning as L
import torch
from lightning.pytorch.callbacks import Callback
from torch.utils.data import DataLoader

from gr_plugin.bench.e2e import other_users, stream, stream_cache_config, stream_model
from gr_plugin.lightning import HSTURankingModule, KVCacheCallback

COLUMNS = ["batch", "requests", "batches", "full_req_s", "eager_req_s", "graph_req_s", "eager_x", "graph_x",
           "full_ms_p50", "eager_ms_p50", "graph_ms_p50", "hit_rate", "fallbacks", "graph_replays",
           "captures_measured", "eager_max_abs_diff", "graph_max_abs_diff"]


class _BatchClock(Callback):
    """When each predict batch starts and the epoch ends (``perf_counter``), with ``probe()`` at each
    batch start."""

    def __init__(self, probe) -> None:
        self.probe = probe
        self.starts: list[float] = []
        self.probes: list[Any] = []
        self.end = 0.0

    def on_predict_batch_start(self, trainer, pl_module, batch, batch_idx, dataloader_idx=0) -> None:
        self.probes.append(self.probe())
        self.starts.append(time.perf_counter())

    def on_predict_epoch_end(self, trainer, pl_module) -> None:
        self.end = time.perf_counter()


def _graph_counts(cb: KVCacheCallback | None) -> tuple[int, int]:
    graphs = cb.engine.graphs if cb is not None and cb.engine is not None else None
    return (graphs.captures, graphs.replays) if graphs is not None else (0, 0)


def run(batch_sizes=(1, 8), num_users: int = 24, min_len: int = 256, max_len: int = 4096, stride: int = 128,
        num_candidates: int = 256, hidden: int = 1024, layers: int = 8, heads: int = 4, head_dim: int = 128,
        page_size: int = 128) -> list[dict[str, Any]]:
    """One row per batch size (see the module docstring)."""
    cuda = torch.cuda.is_available()
    device = torch.device("cuda" if cuda else "cpu")
    torch.manual_seed(0)
    module = HSTURankingModule(stream_model(device, hidden, layers, heads, head_dim).config)
    module.to(device=device, dtype=torch.bfloat16 if cuda else torch.float32)
    # a cache that holds the warm-up's users and the timed ones at once
    kv = stream_cache_config(device, 2 * num_users, max_len, stride, layers, heads, head_dim, page_size)
    rows = []
    for bs in batch_sizes:
        batches = stream(bs, num_users, min_len, max_len, stride, num_candidates)
        warm = other_users(batches, 1 << 20)
        row: dict[str, Any] = {"batch": bs, "requests": sum(b.batch_size for b in batches), "batches": len(batches)}
        full = None
        for way in ("full", "eager", "graph"):
            cb = None if way == "full" else KVCacheCallback("gpu", page_size=page_size, num_pages=kv.num_pages,
                                                            cuda_graphs=way == "graph")
            clock = _BatchClock(lambda cb=cb: _graph_counts(cb))  # (first: its start precedes the step's prepare)
            trainer = L.Trainer(accelerator="gpu" if cuda else "cpu", devices=1, logger=False,
                                enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False,
                                callbacks=[clock] + ([cb] if cb else []))
            out = trainer.predict(module, DataLoader(warm + batches, batch_size=None))
            scores = torch.cat([o["scores"] for o in out[len(warm):]]).float()
            t0 = clock.starts[len(warm)]
            row[f"{way}_req_s"] = row["requests"] / (clock.end - t0)
            steps = [b - a for a, b in zip(clock.starts[len(warm):], [*clock.starts[len(warm) + 1:], clock.end])]
            row[f"{way}_ms_p50"] = statistics.median(steps) * 1e3
            if full is None:
                full = scores
                continue
            row[f"{way}_max_abs_diff"] = (scores - full).abs().max().item()
            row[f"{way}_x"] = row[f"{way}_req_s"] / row["full_req_s"]
            if way == "graph":
                m = cb.metrics["predict"]
                row.update(hit_rate=m["hit_rate"], fallbacks=int(m["fallbacks"]))
                (c0, r0), (c1, r1) = clock.probes[len(warm)], _graph_counts(cb)
                row.update(graph_replays=r1 - r0, captures_measured=c1 - c0)
        rows.append(row)
    return rows
