"""End to end on a GPU (``python -m recipes.bench suite=e2e``): request streams through the whole
model (embeddings, token layout, 8 HSTU layers, head) with and without the KV cache.

The stream: ``num_users`` synthetic users whose histories grow from ``min_len`` to ``max_len``
events, ``stride`` new events per visit (so each user visits ``(max_len - min_len) / stride + 1``
times and asks each time to score ``num_candidates`` items). ``interleave_users`` users (default:
the batch size) are served round-robin, so a user's next visit comes after the others' current
ones. Each batch is scored, in the same loop, by the cached engine with CUDA graphs, the cached
engine without them, and the full recomputation, eager and (on CUDA) as CUDA graphs
(`FullStackGraphs`), each step timed alone (synchronised: latency).
Reports throughput (requests/s), latency, hit rate and the largest score difference against the
full pass; then each engine's throughput with one step in flight (what a server overlapping the
next step's host work with the current step's GPU work gets). Before timing, the same stream runs
for other users so one-time costs (Triton compiles per kernel variant, graph captures per bucket)
stay out of the figures; the row says how many captures still happened while timing.
"""

from __future__ import annotations

import dataclasses
import logging
import math
import statistics
import time
from typing import Any

import torch

from gr_plugin.cache import KVCacheConfig
from gr_plugin.data import RecDataModule
from gr_plugin.inference import RankingEngine
from gr_plugin.modules import HSTUConfig, HSTURanker, KVCacheModule

logger = logging.getLogger(__name__)


def stream(batch_size: int, num_users: int, min_len: int, max_len: int, stride: int, num_candidates: int,
           interleave_users: int | None = None) -> list:
    """The request batches of the growing-history stream (CPU ``RequestBatch`` list)."""
    if max_len < min_len or (max_len - min_len) % stride:
        raise ValueError(f"max_len - min_len must be a non-negative multiple of stride={stride}, "
                         f"got min_len={min_len}, max_len={max_len}")
    visits = (max_len - min_len) // stride + 1
    # NOTE: every user has max_len + stride events, so fixed-stride visits start at min_len, ..., max_len.
    length = max_len + stride
    dm = RecDataModule("synthetic", source_kwargs=dict(num_users=num_users, min_len=length, max_len=length,
                                                        num_items=50_000), batch_size=batch_size,
                       num_candidates=num_candidates, max_next=8, stride=stride, min_history=min_len,
                       num_val_visits=0, num_test_visits=visits, interleave_users=interleave_users or batch_size)
    dm.setup("predict")
    return list(dm.predict_dataloader())


def stream_model(device: torch.device, hidden: int = 1024, layers: int = 8, heads: int = 4,
                 head_dim: int = 128) -> HSTURanker:
    """The suite's model (the block suite's shape), bf16 on CUDA, fp32 elsewhere, in eval mode."""
    cfg = HSTUConfig(num_items=50_000, num_time_buckets=32, max_positions=8192, embedding_dim=hidden,
                     num_layers=layers, num_heads=heads, head_dim=head_dim, n_norm=4096.0)
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    return HSTURanker(cfg).to(device=device, dtype=dtype).eval()


def stream_cache_config(device: torch.device, num_users: int, max_len: int = 4096, stride: int = 128,
                        layers: int = 8, heads: int = 4, head_dim: int = 128, page_size: int = 128) -> KVCacheConfig:
    """A cache that holds every user of a `stream` at once (their longest history plus a visit)."""
    return KVCacheConfig(num_layers=layers, num_heads=heads, head_dim=head_dim, page_size=page_size,
                         num_pages=num_users * (-(-(max_len + 2 * stride) // page_size) + 1) + 8,
                         dtype="bfloat16" if device.type == "cuda" else "float32", device=str(device))


def _time(engine: RankingEngine, batch, cuda: bool):
    if cuda:
        torch.cuda.synchronize()
    t0 = time.perf_counter()
    res = engine.score(batch)
    if cuda:
        torch.cuda.synchronize()
    return res, time.perf_counter() - t0


def worst_diff(a: float, b: float) -> float:
    """The larger of two max abs differences, NaN if either is (``max`` would drop a NaN: a
    non-finite score must show in the table, not read as a match)."""
    return math.nan if math.isnan(a) or math.isnan(b) else max(a, b)


def other_users(batches: list, offset: int) -> list:
    """The same batches for other users (ids shifted by ``offset``): same shapes, no shared pages."""
    return [dataclasses.replace(b, user_ids=b.user_ids + offset) for b in batches]


def _pipelined(engine: RankingEngine, batches: list, cuda: bool) -> tuple[float, float]:
    """``(seconds, waited)`` to score ``batches`` with one step in flight, as a throughput-bound
    server runs: step ``i + 1`` is prepared and launched on the host while the GPU runs step ``i``,
    whose logits come back through a pinned buffer (`Fetcher`) and are waited for only then. ``waited``: the
    host's time blocked on those waits for the step before (near 0: the host is the bound). Waits
    inside a step (e.g. for a staging buffer's previous copy) count as host work."""
    if cuda:
        torch.cuda.synchronize()
    t0 = time.perf_counter()
    pending, waited, fetch = None, 0.0, Fetcher(cuda)
    for batch in batches:
        out, done = fetch(engine.score(batch).logits)
        if pending is not None and pending[1] is not None:
            w = time.perf_counter()
            pending[1].synchronize()
            waited += time.perf_counter() - w
        pending = (out, done)
    if pending is not None and pending[1] is not None:
        w = time.perf_counter()
        pending[1].synchronize()
        waited += time.perf_counter() - w
    return time.perf_counter() - t0, waited


class Fetcher:
    """Brings each step's logits to the host, as a server stages its outputs: through two pinned
    buffers taken in turn (grown when a step has more rows), each with its event, so a step allocates
    nothing. ``fetcher(logits)`` starts the copy: ``(host view, event to wait on)``, the view valid
    until two calls later (its buffer is then reused; the loop has waited for its copy by then); off
    CUDA the logits themselves and no event."""

    def __init__(self, cuda: bool) -> None:
        self.cuda = cuda
        self._buffers: list[torch.Tensor | None] = [None, None]
        self._events = [torch.cuda.Event(), torch.cuda.Event()] if cuda else None
        self._turn = 0

    def __call__(self, logits: torch.Tensor) -> tuple[torch.Tensor, torch.cuda.Event | None]:
        if not self.cuda:
            return logits, None
        i = self._turn
        self._turn ^= 1
        self._events[i].synchronize()  # the copy two calls ago (already waited for by the loop)
        buf = self._buffers[i]
        if buf is None or buf.dtype != logits.dtype or buf.numel() < logits.numel():
            buf = self._buffers[i] = torch.empty(logits.numel(), dtype=logits.dtype, pin_memory=True)
        out = buf[: logits.numel()].view(logits.shape)
        out.copy_(logits, non_blocking=True)
        self._events[i].record()
        return out, self._events[i]


def run(batch_sizes=(1, 2, 4, 8), num_users: int = 24, min_len: int = 256, max_len: int = 4096, stride: int = 128,
        num_candidates: int = 256, hidden: int = 1024, layers: int = 8, heads: int = 4, head_dim: int = 128,
        page_size: int = 128, warmup_batches: int = 2, interleave_users: int | None = None,
        warm_pass: bool = True, pipelined: bool = True, pipelined_rounds: int = 3,
        device: str = "cuda") -> list[dict[str, Any]]:
    """One row per batch size. ``warm_pass``: first run the same stream for other users through
    every engine (Triton compiles each kernel variant and the graph engine captures its buckets
    there, once per process, as a server's warm-up would), then empty the caches. ``pipelined``:
    also each engine's throughput with one step in flight (`_pipelined`), the caches emptied
    before each engine's pass, the median of ``pipelined_rounds`` passes per engine. ``device``:
    ``cuda`` (the suite; refused at once where there is no CUDA device) or ``cpu``, which only
    small shapes (the tests') finish on: the default model at the default histories ran for minutes
    without a row on a CPU."""
    if device not in ("cuda", "cpu"):
        raise ValueError(f"e2e.device must be cuda or cpu, got {device!r}")
    if device == "cuda" and not torch.cuda.is_available():
        raise ValueError("suite=e2e needs a CUDA device (e2e.device=cpu runs it on the CPU, for small shapes "
                         "only: the default model and histories take far too long there)")
    if type(pipelined_rounds) is not int or pipelined_rounds < 1:
        raise ValueError(f"pipelined_rounds must be an int >= 1, got {pipelined_rounds!r}")
    device = torch.device(device)
    cuda = device.type == "cuda"
    torch.manual_seed(0)
    model = stream_model(device, hidden, layers, heads, head_dim)
    rows = []
    for bs in batch_sizes:
        batches = stream(bs, num_users, min_len, max_len, stride, num_candidates, interleave_users)
        if len(batches) <= warmup_batches:
            raise ValueError(f"e2e.warmup_batches={warmup_batches} leaves no batch to time: the stream has "
                             f"{len(batches)} batches at batch size {bs}")
        kv = stream_cache_config(device, num_users, max_len, stride, layers, heads, head_dim, page_size)
        graph_cache, eager_cache = KVCacheModule(kv, "gpu"), KVCacheModule(kv, "gpu")
        engines = {"graph": RankingEngine(model, graph_cache, device, cuda_graphs=cuda),
                   "eager": RankingEngine(model, eager_cache, device),
                   "full": RankingEngine(model, None, device)}
        full_graph = RankingEngine(model, None, device, cuda_graphs=cuda)
        if full_graph.full_graphs is not None:  # the recompute as CUDA graphs too: graphs against graphs
            engines["full_graph"] = full_graph
        caches = (graph_cache, eager_cache)
        warm_s = 0.0
        if warm_pass:
            t0 = time.perf_counter()
            for batch in other_users(batches, 1 << 20):
                for engine in engines.values():
                    engine.score(batch)
            if cuda:
                torch.cuda.synchronize()
            warm_s = time.perf_counter() - t0
            for c in caches:
                c.manager.evict_all()
        graphs = engines["graph"].graphs
        full_graphs = engines["full_graph"].full_graphs if "full_graph" in engines else None
        captures_before = graphs.captures if graphs is not None else 0
        replays_before = graphs.replays if graphs is not None else 0
        full_before = (full_graphs.captures, full_graphs.replays) if full_graphs is not None else (0, 0)
        times: dict[str, list[float]] = {name: [] for name in engines}
        diff, full_diff, hits = 0.0, 0.0, []
        for i, batch in enumerate(batches):
            logits = {}
            for name, engine in engines.items():
                res, dt = _time(engine, batch, cuda)
                if i >= warmup_batches:
                    times[name].append(dt)
                logits[name] = res.logits.float()
                if name == "graph":
                    hits.append(res.cached_tokens / max(1, res.cached_tokens + res.computed_tokens))
            for n in ("graph", "eager"):
                diff = worst_diff(diff, (logits[n] - logits["full"]).abs().max().item())
            if "full_graph" in logits:
                full_diff = worst_diff(full_diff, (logits["full_graph"] - logits["full"]).abs().max().item())
        measured = batches[warmup_batches:]
        n_req = sum(b.batch_size for b in measured)
        rate = {name: n_req / sum(t) for name, t in times.items()}
        row = {"batch": bs, "requests": n_req, "batches": len(batches),
               "graph_replays": (graphs.replays - replays_before) if graphs is not None else 0,
               "captures_measured": (graphs.captures if graphs is not None else 0) - captures_before,
               "warm_pass_s": warm_s,
               "graph_req_s": rate["graph"], "eager_req_s": rate["eager"], "full_req_s": rate["full"],
               "graph_ms_p50": 1e3 * statistics.median(times["graph"]),
               "eager_ms_p50": 1e3 * statistics.median(times["eager"]),
               "full_ms_p50": 1e3 * statistics.median(times["full"]),
               "graph_ms_mean": 1e3 * statistics.fmean(times["graph"]),
               "full_ms_mean": 1e3 * statistics.fmean(times["full"]),
               "hit_rate": statistics.fmean(hits), "max_abs_diff": diff}
        row["throughput_graph_x"] = rate["graph"] / rate["full"]
        row["throughput_eager_x"] = rate["eager"] / rate["full"]
        if full_graphs is not None:
            row.update({"full_graph_req_s": rate["full_graph"],
                        "full_graph_ms_p50": 1e3 * statistics.median(times["full_graph"]),
                        "throughput_graph_x_full_graph": rate["graph"] / rate["full_graph"],
                        "full_graph_replays": full_graphs.replays - full_before[1],
                        "full_graph_captures_measured": full_graphs.captures - full_before[0],
                        "full_graph_max_abs_diff": full_diff})
        if pipelined:
            # NOTE: a pass is short (~0.1 s for the graphed engine at bs 8) and single passes spread
            # 10-30% from call to call: the engines take turns for ``pipelined_rounds`` rounds and
            # each reports its median pass.
            passes: dict[str, list[tuple[float, float]]] = {name: [] for name in engines}
            for _ in range(pipelined_rounds):
                for name, engine in engines.items():
                    for c in caches:
                        c.manager.evict_all()
                    # the warm-up batches of the latency loop run first, untimed, as there
                    for batch in batches[:warmup_batches]:
                        engine.score(batch)
                    passes[name].append(_pipelined(engine, measured, cuda))
            piped = {name: n_req / statistics.median(s for s, _ in p) for name, p in passes.items()}
            row.update({f"{name}_req_s_pipelined": r for name, r in piped.items()})
            row["throughput_graph_x_pipelined"] = piped["graph"] / piped["full"]
            if "full_graph" in piped:
                row["throughput_graph_x_pipelined_full_graph"] = piped["graph"] / piped["full_graph"]
            # the share of the graphed pass the host spent not blocked on the step before's logits
            row["graph_host_busy_pipelined"] = statistics.median(1 - w / s for s, w in passes["graph"])
        rows.append(row)
        logger.info("e2e %s", row)
        graph_cache.manager.close()
        eager_cache.manager.close()
    return rows


COLUMNS = ["batch", "requests", "batches", "graph_replays", "captures_measured", "graph_req_s", "eager_req_s",
           "full_req_s", "throughput_graph_x", "throughput_eager_x", "graph_ms_p50", "eager_ms_p50", "full_ms_p50",
           "graph_ms_mean", "full_ms_mean", "graph_req_s_pipelined", "full_req_s_pipelined",
           "throughput_graph_x_pipelined", "graph_host_busy_pipelined", "hit_rate", "max_abs_diff",
           "full_graph_req_s", "full_graph_ms_p50", "throughput_graph_x_full_graph", "full_graph_req_s_pipelined",
           "throughput_graph_x_pipelined_full_graph", "full_graph_replays", "full_graph_captures_measured",
           "full_graph_max_abs_diff"]
