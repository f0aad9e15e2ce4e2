"""`RankingService`: the inference callable a replica binds into Triton, around one `RankingEngine`.

Owns what happens to one Triton batch (the requests Triton's dynamic batcher merged): each request
is validated on its own (`validation.parse_request`); a rejected request gets its message in the
``error`` output and never reaches the engine, so it changes no cache state and fails no other
request. The valid ones are scored under the replica's lock (the engine and its cache take one step
at a time), split into sub-batches of distinct users when a user occurs twice (its requests run in
arrival order), and their logits go back to each request, padded as `wire` says. It also publishes
finished offloads between steps (`publish`) and flushes them on shutdown (`close`). It does not own
Triton, ports or signals (see `server`).
"""

from __future__ import annotations

import dataclasses
import logging
import threading
import time
from collections.abc import Mapping, Sequence
from typing import Any

import numpy as np
import torch

from gr_plugin.data import RequestBatch
from gr_plugin.inference import RankingEngine
from gr_plugin.serving.validation import RequestLimits, parse_request
from gr_plugin.serving.wire import ERROR, SCORES

logger = logging.getLogger(__name__)


@dataclasses.dataclass
class ServingCounters:
    """Monotonic counters of one replica (exported as ``gr_serve_*``)."""

    batches: int = 0  # Triton batches (calls of the service)
    steps: int = 0  # engine steps (sub-batches of distinct users)
    requests: int = 0
    requests_rejected: int = 0
    users_scored: int = 0
    candidates_scored: int = 0
    steps_fell_back: int = 0
    step_seconds: float = 0.0


def distinct_user_groups(batches: Sequence[RequestBatch]) -> list[list[int]]:
    """Indices of ``batches`` grouped into steps with no user twice, order kept per user.

    A batch goes to the first group after every group holding one of its users, so a user's
    requests run in the order given and each request stays whole.
    """
    last: dict[int, int] = {}
    groups: list[list[int]] = []
    for i, b in enumerate(batches):
        users = b.user_ids.tolist()
        k = max((last[u] + 1 for u in users if u in last), default=0)
        while len(groups) <= k:
            groups.append([])
        groups[k].append(i)
        for u in users:
            last[u] = k
    return groups


def concat_batches(batches: Sequence[RequestBatch]) -> RequestBatch:
    """One `RequestBatch` of the users of ``batches`` (distinct), in order."""
    if len(batches) == 1:
        return batches[0]
    fields = {f.name: torch.cat([getattr(b, f.name) for b in batches]) for f in dataclasses.fields(RequestBatch)}
    return RequestBatch(**fields)


def _rows_and_width(inputs: Mapping[str, Any]) -> tuple[int, int]:
    """(users, candidate row width) of a possibly malformed request, for the shape of its answer."""
    users, cand = inputs.get("user_id"), inputs.get("candidate_items")
    b = users.shape[0] if isinstance(users, np.ndarray) and users.ndim >= 1 and users.shape[0] > 0 else 1
    w = cand.shape[1] if isinstance(cand, np.ndarray) and cand.ndim == 2 else 0
    return b, w


class RankingService:
    """``service(requests) -> responses``: PyTriton's inference callable for one replica.

    ``requests``: PyTriton requests (or plain mappings) of `wire` inputs; returns one dict per
    request with ``scores`` float32 ``[B, Wc, num_tasks]`` and ``error`` bytes ``[B, 1]``.
    """

    def __init__(self, engine: RankingEngine, limits: RequestLimits) -> None:
        self.engine = engine
        self.limits = limits
        self.num_tasks = engine.model.config.num_tasks
        self.counters = ServingCounters()
        self._lock = threading.Lock()  # one engine step at a time
        self._counters_lock = threading.Lock()  # short: metrics scrapes never wait for a step
        self._closed = False

    @property
    def cache(self):
        return self.engine.cache

    def __call__(self, requests: Sequence[Any]) -> list[dict[str, np.ndarray]]:
        inputs = [r.data if hasattr(r, "data") else r for r in requests]
        parsed: list[RequestBatch | str] = []
        for i, x in enumerate(inputs):
            try:
                parsed.append(parse_request(x, self.limits))
            except ValueError as exc:
                logger.warning("rejected request %d of a batch of %d: %s", i, len(inputs), exc)
                parsed.append(str(exc))
        valid = [i for i, p in enumerate(parsed) if isinstance(p, RequestBatch)]
        logits: dict[int, np.ndarray] = {}
        if valid:
            logits = self._score([parsed[i] for i in valid])
            logits = {valid[j]: v for j, v in logits.items()}
        out = []
        for i, p in enumerate(parsed):
            if isinstance(p, str):
                b, w = _rows_and_width(inputs[i])
                out.append({SCORES: np.full((b, w, self.num_tasks), np.nan, dtype=np.float32),
                            ERROR: np.full((b, 1), p.encode("utf-8"), dtype=object)})
                continue
            w = inputs[i]["candidate_items"].shape[1]
            scores = np.full((p.batch_size, w, self.num_tasks), np.nan, dtype=np.float32)
            scores[np.arange(w)[None, :] < p.candidate_lengths.numpy()[:, None]] = logits[i]
            out.append({SCORES: scores, ERROR: np.full((p.batch_size, 1), b"", dtype=object)})
        with self._counters_lock:
            self.counters.batches += 1
            self.counters.requests += len(parsed)
            self.counters.requests_rejected += len(parsed) - len(valid)
        return out

    def _score(self, batches: list[RequestBatch]) -> dict[int, np.ndarray]:
        """Logits ``[sum(C_i), T]`` per index of ``batches``, one engine step per user-distinct group."""
        out: dict[int, np.ndarray] = {}
        with self._lock:
            if self._closed:
                raise RuntimeError("the ranking service is shutting down")
            for group in distinct_user_groups(batches):
                merged = concat_batches([batches[i] for i in group])
                t0 = time.perf_counter()
                res = self.engine.score(merged)
                scores = res.logits.float().cpu().numpy()
                with self._counters_lock:
                    c = self.counters
                    c.step_seconds += time.perf_counter() - t0
                    c.steps += 1
                    c.steps_fell_back += int(res.fell_back)
                    c.users_scored += merged.batch_size
                    c.candidates_scored += scores.shape[0]
                sizes = [int(batches[i].candidate_lengths.sum()) for i in group]
                for i, part in zip(group, np.split(scores, np.cumsum(sizes)[:-1])):
                    out[i] = part
        return out

    def publish(self) -> None:
        """Publish finished offloads (device -> host, and on from there to SSD / Redis) if no step
        is running; a step publishes them itself. Called by the server between requests, so a
        replica's pages reach the shared tier while it is idle."""
        if self.cache is None or not self._lock.acquire(blocking=False):
            return
        try:
            if not self._closed:
                self.cache.manager.offload_try_wait()
        finally:
            self._lock.release()

    def _counters(self) -> dict[str, Any]:
        with self._counters_lock:
            out = dataclasses.asdict(self.counters)
        graphs = self.engine.graphs if self.engine.graphs is not None else self.engine.full_graphs
        if graphs is not None:  # CUDA-graph captures (one-time, slow) and replays of the engine
            out.update(graph_captures=graphs.captures, graph_replays=graphs.replays)
        return out

    def stats(self) -> dict[str, Any]:
        """The service's counters and, with a cache, the cache's `stats()` (``page_size`` included)."""
        out: dict[str, Any] = {"serve": self._counters()}
        if self.cache is not None:
            out["kvcache"] = {**self.cache.stats(), "page_size": self.cache.config.page_size}
        return out

    def close(self) -> dict[str, Any]:
        """Stop scoring, wait for every pending offload and lower-tier write, close the cache.

        Returns the final `stats`. Idempotent.
        """
        with self._lock:
            if self._closed:
                return {}
            self._closed = True
            if self.cache is not None:
                manager = self.cache.manager
                manager.offload_flush()
                flush_writes = getattr(manager.backend, "flush_writes", None)
                if flush_writes is not None:
                    flush_writes()
        final = {"serve": self._counters()}
        if self.cache is not None:
            final["kvcache"] = {**self.cache.stats(), "page_size": self.cache.config.page_size}
            self.cache.manager.close()
        logger.info("ranking service closed: %s", final)
        return final
