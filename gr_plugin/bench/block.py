"""HSTU block benchmarks on a GPU (``python -m recipes.bench suite=block``).

Owns the measurements of the layer stack the published anchors use (8 layers, hidden 1024, 4 heads;
head_dim 128 with page 128, head_dim 256 with page 32; 256 candidates per user), each row measured
side by side in one run:
- ``block``: cached step (new history events + candidates, history K/V read from pages) vs a full
  recomputation of history + candidates, eager and as CUDA graphs, with achieved TFLOP/s against a
  bf16 matrix product measured in the same run;
- ``transfer``: onboard / offload of a user's pages (all layers) vs a raw pinned ``copy_`` of the
  same bytes;
- ``tiers``: one user, history in device pages (GPU hit) vs in the pinned host tier, onboarded all
  at once or layer by layer (each layer waits only for its own pages), next to the transfer floor;
  the block runs as the engine's graphs (one for the stack; layer segments for a layerwise onboard,
  whose waits sit between the replays).
Embedding lookup and the token layout are not part of "the block"; host overhead of lookup and
allocate has its own suite.
"""

from __future__ import annotations

import collections
import dataclasses
import logging
import statistics
import time
from typing import Any

import numpy as np
import torch

from gr_plugin.cache import CacheRequest, HostTier, KVCacheConfig, KVCacheManager
from gr_plugin.cache.config import DTYPE_NAMES
from gr_plugin.modules.hstu import HSTUConfig, HSTULayer, full_stack, next_layer
from gr_plugin.ops import append_kv

logger = logging.getLogger(__name__)


@dataclasses.dataclass
class _Layout:
    q_offsets: torch.Tensor
    candidate_lengths: torch.Tensor
    max_q_len: int


def _time_ms(fn, repeats: int, warmup: int = 3) -> float:
    for _ in range(warmup):
        fn()
    torch.cuda.synchronize()
    times = []
    for _ in range(repeats):
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        fn()
        b.record()
        b.synchronize()
        times.append(a.elapsed_time(b))
    return statistics.median(times)


def kernel_times(fn, steps: int = 10) -> tuple[collections.Counter, collections.Counter]:
    """Device time (µs) and launch count per kernel name of one call of ``fn``, averaged over
    ``steps`` calls under torch.profiler after three warm-up calls (the profile scripts' breakdowns)."""
    from torch.profiler import ProfilerActivity, profile

    with torch.no_grad():
        for _ in range(3):
            fn()
        torch.cuda.synchronize()
        with profile(activities=[ProfilerActivity.CUDA]) as prof:
            for _ in range(steps):
                fn()
            torch.cuda.synchronize()
    times, counts = collections.Counter(), collections.Counter()
    for e in prof.events():
        if e.device_type == torch.autograd.DeviceType.CUDA:
            times[e.name] += e.device_time / steps
            counts[e.name] += 1 / steps
    return times, counts


def _graph(fn):
    """Capture ``fn`` (after a warm-up on a side stream) and return its replay."""
    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):
        for _ in range(2):
            fn()
    torch.cuda.current_stream().wait_stream(s)
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        fn()
    return g.replay


def matmul_peak_tflops(n: int = 8192) -> float:
    a = torch.randn(n, n, device="cuda", dtype=torch.bfloat16)
    b = torch.randn(n, n, device="cuda", dtype=torch.bfloat16)
    ms = _time_ms(lambda: a @ b, 10)
    return 2 * n**3 / (ms * 1e-3) / 1e12


def _offsets(lengths: list[int], device: str = "cuda") -> torch.Tensor:
    return torch.tensor([0, *torch.cumsum(torch.tensor(lengths), 0).tolist()], dtype=torch.int64, device=device)


def _flops(cfg: HSTUConfig, tokens: int, attn_pairs: int) -> float:
    d, hd = cfg.embedding_dim, cfg.num_heads * cfg.head_dim
    linear = tokens * (d * 4 * hd + hd * d) * 2
    attention = attn_pairs * cfg.num_heads * cfg.head_dim * 4
    return cfg.num_layers * (linear + attention)


class Block:
    """An HSTU layer stack with a KV cache for it, on CUDA, bf16."""

    def __init__(self, head_dim: int, page_size: int, num_layers: int = 8, hidden: int = 1024, heads: int = 4,
                 num_pages: int = 4096, host_pages: int = 0, dtype: torch.dtype = torch.bfloat16,
                 device: str = "cuda") -> None:
        torch.manual_seed(0)
        self.device = device
        self.cfg = HSTUConfig(embedding_dim=hidden, num_layers=num_layers, num_heads=heads, head_dim=head_dim,
                              n_norm=4096.0)
        self.layers = [HSTULayer(self.cfg, device=torch.device(device)).to(dtype).eval() for _ in range(num_layers)]
        kv = KVCacheConfig(num_layers=num_layers, num_heads=heads, head_dim=head_dim, page_size=page_size,
                           num_pages=num_pages, dtype=DTYPE_NAMES[dtype],
                           device=device, host_cache_bytes=0)
        if host_pages:
            kv.host_cache_bytes = host_pages * kv.page_bytes
        # the model's append (`KVCacheModule`): the Triton kernel, reading the new rows in place
        self.cache = KVCacheManager(kv, HostTier() if host_pages else None, append_fn=append_kv)
        self.dtype = dtype

    # -- inputs ----------------------------------------------------------------------------------
    def fill(self, users: list[int], cached: int) -> None:
        """Put ``cached`` random history tokens of each user into the cache (committed)."""
        if cached == 0:
            return
        req = CacheRequest(users, [cached] * len(users), torch.cat([torch.arange(cached) + u * 10**7 for u in users]))
        plan = self.cache.allocate(self.cache.lookup(req))
        n = plan.metadata.num_new_tokens
        c = self.cfg
        for layer in range(c.num_layers):
            k = torch.randn(n, c.num_heads, c.head_dim, device=self.device, dtype=self.dtype)
            self.cache.append(layer, k, torch.randn_like(k), plan)
        self.cache.commit(plan)

    def plan(self, users: list[int], total: int):
        req = CacheRequest(users, [total] * len(users), torch.cat([torch.arange(total) + u * 10**7 for u in users]))
        return self.cache.allocate(self.cache.lookup(req))

    # -- forward (the model's: `full_stack` as `HSTURanker.forward_layout`; `forward_cached`'s loop) --
    def full_fn(self, bs: int, hist: int, cands: int):
        c = self.cfg
        lens = [hist + cands] * bs
        x = torch.randn(sum(lens), c.embedding_dim, device=self.device, dtype=self.dtype)
        layout = _Layout(_offsets(lens, self.device), torch.full((bs,), cands, device=self.device), hist + cands)

        def run():
            return full_stack(self.layers, x, layout)

        pairs = bs * (hist * (hist + 1) // 2 + cands * (hist + 1))
        return run, _flops(c, sum(lens), pairs)

    def cached_fn(self, plan, bs: int, new: int, cands: int):
        """The cached step as the engine runs it (`HSTULayer.attend_pages` from the projection before
        its SiLU), launched eagerly."""
        c = self.cfg
        meta = plan.metadata
        qlen = [new + cands] * bs
        x = torch.randn(sum(qlen), c.embedding_dim, device=self.device, dtype=self.dtype)
        q_off = _offsets(qlen, self.device)
        rows = torch.cat([torch.arange(int(q_off[b]), int(q_off[b]) + new, device=self.device) for b in range(bs)])
        table = self.cache.kv_table
        slots = meta.new_token_slots  # derived once, on the device

        def run():
            y, normed = x, None
            for i, layer in enumerate(self.layers):
                a = layer.attend_pages(layer.project(y, normed, activate=False), table[i], slots, rows,
                                       meta.kv_indices, meta.kv_indptr, meta.total_lengths, q_off, meta.new_lengths,
                                       max_q_len=new + cands, max_history_len=meta.max_total_len,
                                       num_history_tokens=meta.num_total_tokens, activated=False)
                y, normed = layer.finish_gated_and_norm(y, a, next_layer(self.layers, i))
            return y

        hist = meta.max_total_len
        cached = hist - new
        pairs = bs * (sum(cached + i + 1 for i in range(new)) + cands * (hist + 1))
        return run, _flops(c, sum(qlen), pairs)


class StaticStep:
    """The cached block over static buffers, captured as the engine's graphed step captures it
    (`gr_plugin.modules.graphs`): one CUDA graph for the whole stack, and the stack in layer
    segments (segment ``i`` ends with layer ``i``'s projection, segment ``i + 1`` starts with its
    append) for a layerwise onboard, whose wait for layer ``i``'s pages sits between the two.

    ``load(plan)`` packs a plan's metadata and its append slots on the host (numpy, from the plan's
    ``host_metadata``) into one pinned buffer and copies it to the static one in one non-blocking
    copy, as the engine's graphed step does. Every plan loaded must have the first plan's shape
    (users, pages, new tokens).
    """

    def __init__(self, blk: Block, plan, bs: int, new: int, cands: int, silu_pass: bool = False) -> None:
        self.blk = blk
        self.silu_pass = silu_pass  # the projection's SiLU as a pass of its own (the step before dc902f6)
        meta = plan.metadata
        self.size, self.num_new = plan.host_metadata.numel(), meta.num_new_tokens
        self.ints = torch.zeros(self.size + self.num_new, dtype=torch.int64, device=blk.device)
        self.staging = torch.zeros(self.ints.shape, dtype=torch.int64, pin_memory=True)
        self.staged = torch.cuda.Event()
        self.offsets = dict(meta.field_offsets)
        self.static = {f: self.ints[a:e] for f, (a, e) in self.offsets.items()}
        self.slots = self.ints[self.size :]
        self.load(plan)
        c = blk.cfg
        qlen = [new + cands] * bs
        self.x = torch.randn(sum(qlen), c.embedding_dim, device=blk.device, dtype=blk.dtype)
        self.q_off = _offsets(qlen, blk.device)
        self.rows = torch.cat([torch.arange(int(self.q_off[b]), int(self.q_off[b]) + new, device=blk.device)
                               for b in range(bs)])
        self.max_q, self.max_hist, self.num_hist = new + cands, meta.max_total_len, meta.num_total_tokens
        layers = len(blk.layers)
        self.ys = [self.x] + [torch.empty_like(self.x) for _ in blk.layers]
        self.normed = [torch.empty_like(self.x) for _ in blk.layers]
        self.projected: list = [None] * layers  # each layer's u, q, k, v, held across its segments

        def segment(i: int) -> None:
            if i:
                self._attend(i - 1, self.projected[i - 1])
            if i < layers:
                self.projected[i] = self._project(i)

        def whole() -> None:
            for i in range(layers):
                self._attend(i, self._project(i))

        with torch.no_grad():
            # NOTE: each graph has its own pool; the last (captured) call of segment i leaves
            # projected[i] in that pool, where segment i + 1's graph reads it. Segment i is
            # replayed once before segment i + 1 is warmed up, so the warm-up reads real values.
            self.segments = []
            for i in range(layers + 1):
                self.segments.append(_graph(lambda i=i: segment(i)))
                self.segments[-1]()
            self.whole = _graph(whole)

    def _project(self, i: int):
        return self.blk.layers[i].project(self.ys[i], self.normed[i] if i else None, activate=self.silu_pass)

    def _attend(self, i: int, projected) -> None:
        layer, st = self.blk.layers[i], self.static
        a = layer.attend_pages(projected, self.blk.cache.kv_table[i], self.slots, self.rows, st["kv_indices"],
                               st["kv_indptr"], st["total_lengths"], self.q_off, st["new_lengths"],
                               max_q_len=self.max_q, max_history_len=self.max_hist, num_history_tokens=self.num_hist,
                               activated=self.silu_pass)
        nxt = next_layer(self.blk.layers, i)
        layer.finish_gated_and_norm(self.ys[i], a, nxt, out=self.ys[i + 1],
                                    normed_out=None if nxt is None else self.normed[i + 1])

    def load(self, plan) -> None:
        meta = plan.metadata
        if meta.field_offsets != self.offsets or meta.num_new_tokens != self.num_new:
            raise ValueError(f"plan metadata laid out as {meta.field_offsets} with {meta.num_new_tokens} new tokens, "
                             f"the static step holds {self.offsets} / {self.num_new}")
        self.staged.synchronize()  # the previous load's copy may still read the staging buffer
        st, hb = self.staging.numpy(), plan.host_metadata.numpy()
        st[: self.size] = hb

        def host(name: str) -> np.ndarray:
            a, e = self.offsets[name]
            return hb[a:e]

        pos, page_size = host("new_token_positions"), meta.page_size
        page = pos // page_size
        st[self.size :] = (host("kv_indices")[host("kv_indptr")[host("new_token_batch")] + page] * page_size
                           + (pos - page * page_size))
        self.ints.copy_(self.staging, non_blocking=True)
        self.staged.record()

    def run(self, wait=None) -> None:
        """The whole stack in one replay, or with ``wait(i)`` before layer ``i``'s append."""
        if wait is None:
            self.whole()
            return
        self.segments[0]()
        for i, replay in enumerate(self.segments[1:]):
            wait(i)
            replay()


def block(head_dims=(128, 256), batch_sizes=(1, 2, 4, 8), histories=((4096, 3968), (2048, 1920), (1024, 896),
          (512, 384), (128, 0)), candidates: int = 256, repeats: int = 20, graphs: bool = True) -> list[dict[str, Any]]:
    peak = matmul_peak_tflops()
    rows = []
    for hd in head_dims:
        page = {128: 128, 256: 32}.get(hd, 64)
        for hist, cached in histories:
            for bs in batch_sizes:
                blk = Block(hd, page, num_pages=bs * (-(-hist // page) + 2) + 8)
                users = list(range(bs))
                blk.fill(users, cached)
                plan = blk.plan(users, hist)
                with torch.no_grad():
                    full, f_flops = blk.full_fn(bs, hist, candidates)
                    cached_run, c_flops = blk.cached_fn(plan, bs, hist - cached, candidates)
                    row = {"head_dim": hd, "page": page, "batch": bs, "history": hist, "cached": cached,
                           "candidates": candidates}
                    row["full_ms"] = _time_ms(full, repeats)
                    row["cached_ms"] = _time_ms(cached_run, repeats)
                    if graphs:
                        row["full_graph_ms"] = _time_ms(_graph(full), repeats)
                        row["cached_graph_ms"] = _time_ms(_graph(cached_run), repeats)
                best_f = min(row["full_ms"], row.get("full_graph_ms", 1e9))
                best_c = min(row["cached_ms"], row.get("cached_graph_ms", 1e9))
                row["speedup"] = best_f / best_c
                row["cached_tflops"] = c_flops / (best_c * 1e-3) / 1e12
                row["full_tflops"] = f_flops / (best_f * 1e-3) / 1e12
                row["matmul_peak_tflops"] = peak
                blk.cache.abort(plan)
                blk.cache.close()
                rows.append(row)
                logger.info("block %s", row)
                del blk
                torch.cuda.empty_cache()
    return rows


def _transfer_one(tokens: int, head_dim: int, page: int, repeats: int) -> dict[str, Any]:
    npg = tokens // page
    blk = Block(head_dim, page, num_pages=2 * npg + 8, host_pages=2 * npg + 8)
    m = blk.cache
    blk.fill([1], tokens)
    m.offload_flush()
    nbytes = npg * m.config.page_bytes
    host = torch.empty(nbytes // 2, dtype=torch.bfloat16, pin_memory=True)
    dev = torch.empty_like(host, device="cuda")
    raw_h2d = _time_ms(lambda: dev.copy_(host, non_blocking=True), repeats)
    raw_d2h = _time_ms(lambda: host.copy_(dev, non_blocking=True), repeats)
    src = torch.tensor(m.backend.pages_of((m.namespace, 1)), dtype=torch.int64)
    dst = torch.tensor(m.pages_of(1), dtype=torch.int64)

    def onboard():
        m.transfer.copy(m.backend.host_table, src, m.kv_table, dst).wait_layer(m.config.num_layers - 1)

    def offload():
        h = m.transfer.copy(m.kv_table, dst, m.backend.host_table, src)
        torch.cuda.current_stream().wait_event(h._events[-1])

    on, off = _time_ms(onboard, repeats), _time_ms(offload, repeats)
    gb = nbytes / 1e9
    m.close()
    return {"tokens": tokens, "bytes_mb": round(nbytes / 2**20, 1), "onboard_gbs": gb / (on * 1e-3),
            "raw_h2d_gbs": gb / (raw_h2d * 1e-3), "onboard_vs_raw": raw_h2d / on, "offload_gbs": gb / (off * 1e-3),
            "raw_d2h_gbs": gb / (raw_d2h * 1e-3), "offload_vs_raw": raw_d2h / off}


def transfer(tokens_list=(4096, 16384), head_dim: int = 128, page: int = 128,
             repeats: int = 10) -> list[dict[str, Any]]:
    """Onboard/offload of one user's pages (8 layers) vs a raw pinned copy of the same bytes."""
    rows = []
    for tokens in tokens_list:
        rows.append(_transfer_one(tokens, head_dim, page, repeats))
        logger.info("transfer %s", rows[-1])
    return rows


def _request(blk: Block, step: StaticStep, tokens: int, cached: int, mode: str, raw_copies: bool = True,
             lookahead: int | None = None, group_layers: bool = True) -> tuple[float, float]:
    """ms of one bs-1 request from an idle GPU: event, [onboard launch], metadata load, the stack's
    replay (`StaticStep.run`), event; and the host µs of the onboard launch. ``mode``: ``gpu`` (the
    pages are on the device) and ``host`` (onboarded from the host tier, every layer's pages before
    the first layer) replay the whole-stack graph; ``layerwise`` replays the layer segments, layer
    ``l``'s append waiting only for its own pages. ``raw_copies`` False: the transfer engine
    launches its copies through ``Tensor.copy_`` instead of raw ``cudaMemcpyAsync``;
    ``lookahead``: the layers a raw onboard keeps queued past the last one waited for (None: the
    engine's setting as it is, by default every layer at launch); ``group_layers`` False: a raw
    onboard copies each layer alone instead of in pairs (`layer_spans`). The evict, lookup and
    allocate before the first event are not timed (`tiers_plan`), nor is setting the engine's
    knobs."""
    m = blk.cache
    prior = m.transfer.raw_copies, m.transfer.onboard_lookahead, m.transfer.group_layers
    try:
        m.transfer.raw_copies = raw_copies
        m.transfer.onboard_lookahead = prior[1] if lookahead is None else lookahead
        m.transfer.group_layers = group_layers
        plan = tiers_plan(blk, tokens, cached, mode)
        torch.cuda.synchronize()
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        t0 = time.perf_counter()
        handle = m.onboard_launch(plan) if mode != "gpu" else None
        launch = (time.perf_counter() - t0) * 1e6
        step.load(plan)
        if mode == "layerwise":
            step.run(wait=handle.wait_layer)  # layer i waits only for its own pages
        else:
            if handle is not None:
                handle.wait_layer(m.config.num_layers - 1)  # every layer's pages before the first layer
            step.run()
        b.record()
        b.synchronize()
        m.abort(plan)
        m.offload_flush()
    finally:
        m.transfer.raw_copies, m.transfer.onboard_lookahead, m.transfer.group_layers = prior
    return a.elapsed_time(b), launch


def tiers_plan(blk: Block, tokens: int, cached: int, mode: str):
    """The plan of one tiers request (`_request`'s ``mode``): a GPU hit is user 2's history, kept
    on the device (`_tiers_one` fills it), a host hit user 1's, evicted first so that its full pages
    come from the host tier; both ``cached`` tokens long."""
    m, page = blk.cache, blk.cache.config.page_size
    if mode != "gpu":
        m.evict([1])
    plan = blk.plan([2 if mode == "gpu" else 1], tokens)
    want = [0] if mode == "gpu" else [cached // page * page]
    assert plan.onboard_tokens == want, (mode, plan.onboard_tokens)
    return plan


def host_hit_block(tokens: int, head_dim: int = 128, page: int = 128, new: int = 128,
                   device: str = "cuda") -> Block:
    """The tiers rows' bs-1 block: user 1's first ``tokens - new`` events cached, their full pages
    written through to the host tier; device pages and host slots for two such histories."""
    npg = -(-tokens // page)
    blk = Block(head_dim, page, num_pages=2 * npg + 8, host_pages=2 * npg + 8, device=device)
    blk.fill([1], tokens - new)
    blk.cache.offload_flush()
    return blk


def transfer_floor_ms(blk: Block, cached: int, repeats: int) -> float:
    """The tiers rows' floor: one pinned host->device copy of ``cached`` tokens' full pages' bytes."""
    cfg = blk.cache.config
    host = torch.empty((cached // cfg.page_size) * cfg.page_bytes // 2, dtype=torch.bfloat16, pin_memory=True)
    dev = torch.empty_like(host, device="cuda")
    return _time_ms(lambda: dev.copy_(host, non_blocking=True), repeats)


def _tiers_one(tokens: int, head_dim: int, page: int, new: int, candidates: int, repeats: int,
               lookaheads=()) -> dict[str, Any]:
    cached = tokens - new
    blk = host_hit_block(tokens, head_dim, page, new)
    m = blk.cache
    blk.fill([2], cached)  # the GPU hits' user (`_request`): the host hits' user 1 is evicted before each
    floor = transfer_floor_ms(blk, cached, repeats)
    with torch.no_grad():
        plan = blk.plan([1], tokens)
        step = StaticStep(blk, plan, 1, tokens - plan.cached_lengths[0], candidates)
        replays = _time_ms(step.run, repeats)
        m.abort(plan)
        row = {"tokens": tokens, "cached": cached, "gpu_hit_replays_ms": replays}
        ways = {"gpu_hit": {"mode": "gpu"}, "host_hit": {"mode": "host"}, "host_hit_layerwise": {"mode": "layerwise"},
                "host_hit_layerwise_per_layer": {"mode": "layerwise", "group_layers": False},
                "host_hit_layerwise_tensor_copy": {"mode": "layerwise", "raw_copies": False},
                **{f"host_hit_layerwise_ahead{n}": {"mode": "layerwise", "lookahead": n} for n in lookaheads}}
        names = list(ways)
        times: dict[str, list[float]] = {w: [] for w in names}
        launches: dict[str, list[float]] = {w: [] for w in names}
        for r in range(repeats + 2):  # one request of each way a round, each way first in turn
            for name in names[r % len(names) :] + names[: r % len(names)]:
                ms, us = _request(blk, step, tokens, cached, **ways[name])
                if r >= 2:
                    times[name].append(ms)
                    launches[name].append(us)
        for name in names:
            row[f"{name}_ms"] = statistics.median(times[name])
            if ways[name]["mode"] == "layerwise":
                row[f"{name}_launch_us"] = statistics.median(launches[name])
        row["transfer_floor_ms"] = floor
    row["layerwise_vs_bound"] = row["host_hit_layerwise_ms"] / max(row["gpu_hit_ms"], floor)
    m.close()
    return row


def tiers(tokens_list=(2048, 4096, 8192, 16384), head_dim: int = 128, page: int = 128, new: int = 128,
          candidates: int = 256, repeats: int = 50, lookaheads=(1, 2)) -> list[dict[str, Any]]:
    """GPU hit vs host hit vs host hit + layerwise, bs 1, next to the transfer floor. Each request is
    timed alone from an idle GPU, the same way in every column (`_request`); the columns' requests
    are interleaved (a round runs one of each, each first in turn), medians of ``repeats`` rounds
    (the host's launch time varies from request to request and from stretch to stretch of a run,
    and at 2K tokens the launch's return comes 13-27% into the request); ``gpu_hit_replays_ms`` is
    the whole-stack graph's replay alone, back to back. ``host_hit_layerwise_per_layer_ms``: the
    layerwise request with every layer copied alone (the engine's default copies them in pairs,
    `layer_spans`). ``lookaheads``: the layerwise request again with the onboard keeping each of
    these many layers' copies queued ahead (``host_hit_layerwise_ahead<n>_ms`` and ``_launch_us``;
    the table shows 1 and 2; the engine's default, every layer at launch, is
    ``host_hit_layerwise_ms``)."""
    rows = []
    for tokens in tokens_list:
        rows.append(_tiers_one(tokens, head_dim, page, new, candidates, repeats, tuple(lookaheads)))
        logger.info("tiers %s", rows[-1])
    return rows


def run(parts=("block", "transfer", "tiers"), block_kwargs=None, transfer_kwargs=None,
        tiers_kwargs=None) -> list[dict[str, Any]]:
    if not torch.cuda.is_available():
        raise ValueError("suite=block needs a CUDA device")
    rows: list[dict[str, Any]] = []
    for name, fn, kw in (("block", block, block_kwargs), ("transfer", transfer, transfer_kwargs),
                         ("tiers", tiers, tiers_kwargs)):
        if name in parts:
            rows += [{"part": name, **r} for r in fn(**(kw or {}))]
    return rows


COLUMNS = ["part", "head_dim", "page", "batch", "history", "cached", "full_ms", "full_graph_ms", "cached_ms",
           "cached_graph_ms", "speedup", "cached_tflops", "full_tflops", "matmul_peak_tflops", "tokens",
           "onboard_gbs", "raw_h2d_gbs", "onboard_vs_raw", "offload_gbs", "raw_d2h_gbs", "offload_vs_raw",
           "gpu_hit_replays_ms", "gpu_hit_ms", "host_hit_ms", "host_hit_layerwise_ms", "host_hit_layerwise_launch_us",
           "host_hit_layerwise_per_layer_ms",
           "host_hit_layerwise_tensor_copy_ms", "host_hit_layerwise_tensor_copy_launch_us",
           "host_hit_layerwise_ahead1_ms", "host_hit_layerwise_ahead1_launch_us", "host_hit_layerwise_ahead2_ms",
           "transfer_floor_ms", "layerwise_vs_bound"]
