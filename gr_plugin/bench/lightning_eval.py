"""Lightning evaluation (``python -m recipes.bench suite=lightning``): `Trainer.predict` of an
`HSTURankingModule` over the e2e suite's request stream (`e2e.stream`: histories growing by
``stride`` events a visit, ``num_candidates`` each), as a Lightning user runs it, three ways in
one process on the same module: without a callback (the full pass), with `KVCacheCallback`
running the cached pass eagerly (``cuda_graphs=False``), and with the callback's default (the
cached steps replayed as CUDA graphs on CUDA; eager elsewhere).

Each way first predicts the same stream for other users (Triton compiles, graph captures), then
its cache is emptied and the stream is timed: requests/s from the first batch's start to the end of
the epoch, and the median interval between batch starts (a batch's whole cost in the loop: loading,
the move to the device, the cache step's prepare, the scores' copy back, the commit, Lightning's
own hooks). Reports the cached ways' largest score difference against the full pass, hit rate,
fallbacks, and the graphs' replays and captures while timed.
"""

from __future__ import annotations

import statistics
import time
from typing import Any

import lightning as L
import torch
from lightning.pytorch.callbacks import Callback
from torch.utils.data import DataLoader

from gr_plugin.bench.e2e import _other_users, stream, stream_model
from gr_plugin.lightning import HSTURankingModule, KVCacheCallback

COLUMNS = ["batch", "requests", "batches", "full_req_s", "eager_req_s", "graph_req_s", "eager_x", "graph_x",
           "full_ms_p50", "eager_ms_p50", "graph_ms_p50", "hit_rate", "fallbacks", "graph_replays",
           "captures_measured", "eager_max_abs_diff", "graph_max_abs_diff"]


class _BatchClock(Callback):
    """The time each predict batch starts and the epoch ends (``perf_counter``)."""

    def __init__(self) -> None:
        self.starts: list[float] = []
        self.end = 0.0

    def on_predict_batch_start(self, trainer, pl_module, batch, batch_idx, dataloader_idx=0) -> None:
        self.starts.append(time.perf_counter())

    def on_predict_epoch_end(self, trainer, pl_module) -> None:
        self.end = time.perf_counter()


def _predict(module: HSTURankingModule, batches: list, callbacks: list, cuda: bool) -> tuple[torch.Tensor, _BatchClock]:
    clock = _BatchClock()  # (first: its start precedes the cache step's prepare)
    trainer = L.Trainer(accelerator="gpu" if cuda else "cpu", devices=1, logger=False, enable_checkpointing=False,
                        enable_progress_bar=False, enable_model_summary=False, callbacks=[clock, *callbacks])
    out = trainer.predict(module, DataLoader(batches, batch_size=None))
    return torch.cat([o["scores"] for o in out]).float(), clock


def run(batch_sizes=(1, 8), num_users: int = 24, min_len: int = 256, max_len: int = 4096, stride: int = 128,
        num_candidates: int = 256, hidden: int = 1024, layers: int = 8, heads: int = 4, head_dim: int = 128,
        page_size: int = 128) -> list[dict[str, Any]]:
    """One row per batch size (see the module docstring)."""
    cuda = torch.cuda.is_available()
    device = torch.device("cuda" if cuda else "cpu")
    torch.manual_seed(0)
    module = HSTURankingModule(stream_model(device, hidden, layers, heads, head_dim).config)
    module.to(device=device, dtype=torch.bfloat16 if cuda else torch.float32)
    # every user of a stream at once: the longest history plus a visit, in pages, and a page to spare
    num_pages = num_users * (-(-(max_len + 2 * stride) // page_size) + 1) + 8
    rows = []
    for bs in batch_sizes:
        batches = stream(bs, num_users, min_len, max_len, stride, num_candidates)
        warm = _other_users(batches, 1 << 20)
        row: dict[str, Any] = {"batch": bs, "requests": sum(b.batch_size for b in batches), "batches": len(batches)}
        scores = {}
        for way in ("full", "eager", "graph"):
            cbs = [] if way == "full" else [KVCacheCallback("gpu", page_size=page_size, num_pages=num_pages,
                                                            cuda_graphs=way == "graph")]
            _predict(module, warm, cbs, cuda)
            if cbs:
                cbs[0].cache.manager.evict_all()
            graphs = cbs[0].engine.graphs if cbs else None
            captures, replays = (graphs.captures, graphs.replays) if graphs is not None else (0, 0)
            scores[way], clock = _predict(module, batches, cbs, cuda)
            row[f"{way}_req_s"] = row["requests"] / (clock.end - clock.starts[0])
            steps = [b - a for a, b in zip(clock.starts, [*clock.starts[1:], clock.end])]
            row[f"{way}_ms_p50"] = statistics.median(steps) * 1e3
            if way != "full":
                row[f"{way}_max_abs_diff"] = (scores[way] - scores["full"]).abs().max().item()
                row[f"{way}_x"] = row[f"{way}_req_s"] / row["full_req_s"]
            if way == "graph":
                m = cbs[0].metrics["predict"]
                row.update(hit_rate=m["hit_rate"], fallbacks=int(m["fallbacks"]))
                row["graph_replays"] = graphs.replays - replays if graphs is not None else 0
                row["captures_measured"] = graphs.captures - captures if graphs is not None else 0
        rows.append(row)
    return rows
