"""The serving client: route users to replicas, send requests over Triton's HTTP API, replay streams.

Owns `route` (a user's replica: ``xxh64(user_id) % num_replicas``, the same in every client and
process, so a user keeps hitting the replica that holds its cache), `ServeClient` (one Triton HTTP
connection per thread and replica; `score` encodes a `RequestBatch` with `wire`, raises
`RequestRejected` with the server's message for a rejected request), `replay` (a request stream
from several threads, each user's requests in order), and the report: latency p50/p99, throughput,
and the cache's hit rate per tier from the replicas' ``/metrics`` (`scrape`, `tier_hit_rates`).
It holds no model and checks no scores.
"""

from __future__ import annotations

import dataclasses
import logging
import statistics
import threading
import time
import urllib.request
from collections import deque
from collections.abc import Callable, Iterable, Mapping, Sequence
from typing import Any

import numpy as np
import torch
import xxhash

from gr_plugin.data import RequestBatch
from gr_plugin.serving.metrics import cache_counters, tier_tokens
from gr_plugin.serving.wire import ERROR, SCORES, decode_scores, encode_batch, error_messages

logger = logging.getLogger(__name__)


class RequestRejected(ValueError):
    """The server validated the request and rejected it (``message`` says why)."""


def route(user_id: int, num_replicas: int) -> int:
    """The replica of ``user_id``: ``xxh64(int64 little-endian bytes) % num_replicas``."""
    if num_replicas < 1:
        raise ValueError(f"num_replicas must be >= 1, got {num_replicas}")
    return xxhash.xxh64_intdigest(int(user_id).to_bytes(8, "little", signed=True)) % num_replicas


def subset_batch(batch: RequestBatch, rows: Sequence[int]) -> RequestBatch:
    """The users at ``rows`` of ``batch`` (in that order) as a new `RequestBatch`."""
    idx = torch.as_tensor(list(rows), dtype=torch.int64)
    h_off, c_off = batch.history_offsets, batch.candidate_offsets

    def gather(values: torch.Tensor, offsets: torch.Tensor) -> torch.Tensor:
        return torch.cat([values[offsets[r]:offsets[r + 1]] for r in idx.tolist()])

    return RequestBatch(
        user_ids=batch.user_ids[idx], history_lengths=batch.history_lengths[idx],
        history_items=gather(batch.history_items, h_off), history_ratings=gather(batch.history_ratings, h_off),
        history_timestamps=gather(batch.history_timestamps, h_off),
        history_time_buckets=gather(batch.history_time_buckets, h_off),
        candidate_lengths=batch.candidate_lengths[idx], candidate_items=gather(batch.candidate_items, c_off),
        labels=gather(batch.labels, c_off), visit_index=batch.visit_index[idx],
    )


def split_by_replica(batch: RequestBatch, num_replicas: int) -> list[tuple[int, RequestBatch]]:
    """``(replica, sub-batch)`` for every replica that one of the batch's users routes to."""
    groups: dict[int, list[int]] = {}
    for row, user in enumerate(batch.user_ids.tolist()):
        groups.setdefault(route(user, num_replicas), []).append(row)
    if len(groups) == 1:
        return [(next(iter(groups)), batch)]
    return [(r, subset_batch(batch, rows)) for r, rows in sorted(groups.items())]


class ServeClient:
    """Scores `RequestBatch` es on replicas ``urls`` (Triton HTTP ``host:port``). Thread-safe: each
    thread gets its own connections."""

    def __init__(self, urls: Sequence[str], model_name: str = "hstu_ranker", *, timeout_s: float = 60.0) -> None:
        if not urls:
            raise ValueError("ServeClient needs at least one replica URL")
        self.urls = list(urls)
        self.model_name = model_name
        self.timeout_s = timeout_s
        self._local = threading.local()

    @property
    def num_replicas(self) -> int:
        return len(self.urls)

    def _connection(self, replica: int):
        import tritonclient.http as triton_http

        conns = getattr(self._local, "conns", None)
        if conns is None:
            conns = self._local.conns = {}
        if replica not in conns:
            conns[replica] = triton_http.InferenceServerClient(
                self.urls[replica], connection_timeout=self.timeout_s, network_timeout=self.timeout_s)
        return conns[replica]

    def replica_of(self, batch: RequestBatch) -> int:
        replicas = {route(u, self.num_replicas) for u in batch.user_ids.tolist()}
        if len(replicas) != 1:
            raise ValueError(f"the batch's users route to replicas {sorted(replicas)}; split it with "
                             "split_by_replica or pass replica=")
        return replicas.pop()

    def infer_raw(self, inputs: Mapping[str, np.ndarray], replica: int = 0,
                  model_name: str | None = None) -> dict[str, np.ndarray]:
        """Send raw input arrays (any names, dtypes, shapes: for tests of the boundary); returns
        ``{"scores", "error"}`` or raises tritonclient's ``InferenceServerException``."""
        import tritonclient.http as triton_http
        from tritonclient.utils import np_to_triton_dtype

        args = []
        for name, value in inputs.items():
            value = np.asarray(value)
            inp = triton_http.InferInput(name, list(value.shape), np_to_triton_dtype(value.dtype))
            inp.set_data_from_numpy(value)
            args.append(inp)
        outputs = [triton_http.InferRequestedOutput(SCORES), triton_http.InferRequestedOutput(ERROR)]
        result = self._connection(replica).infer(model_name or self.model_name, args, outputs=outputs)
        return {SCORES: result.as_numpy(SCORES), ERROR: result.as_numpy(ERROR)}

    def score(self, batch: RequestBatch, replica: int | None = None) -> np.ndarray:
        """Scores ``[sum(C), num_tasks]`` float32 of ``batch`` (users in order), from ``replica``
        (default: where its users route). Raises `RequestRejected` if the server rejected it."""
        replica = self.replica_of(batch) if replica is None else replica
        if not 0 <= replica < self.num_replicas:
            raise ValueError(f"replica {replica} outside 0..{self.num_replicas - 1}")
        out = self.infer_raw(encode_batch(batch), replica)
        errors = [e for e in error_messages(out[ERROR]) if e]
        if errors:
            raise RequestRejected(errors[0])
        return decode_scores(out[SCORES], batch.candidate_lengths.numpy())


@dataclasses.dataclass
class ReplayReport:
    """What a replay measured. ``latencies_s`` per request (send to answer); ``errors``: (request
    index, message)."""

    requests: int = 0
    users: int = 0
    wall_s: float = 0.0
    latencies_s: list[float] = dataclasses.field(default_factory=list)
    per_replica: dict[int, int] = dataclasses.field(default_factory=dict)
    errors: list[tuple[int, str]] = dataclasses.field(default_factory=list)

    def summary(self, warmup: int = 0) -> dict[str, Any]:
        lat = sorted(self.latencies_s[warmup:] or self.latencies_s)
        pick = (lambda q: 1e3 * lat[min(len(lat) - 1, round(q * (len(lat) - 1)))]) if lat else (lambda q: float("nan"))
        return {"requests": self.requests, "users": self.users, "errors": len(self.errors), "wall_s": self.wall_s,
                "latency_ms_p50": pick(0.5), "latency_ms_p99": pick(0.99),
                "latency_ms_mean": 1e3 * statistics.fmean(lat) if lat else float("nan"),
                "throughput_rps": self.requests / self.wall_s if self.wall_s else float("nan"),
                "throughput_users_ps": self.users / self.wall_s if self.wall_s else float("nan"),
                "per_replica": dict(sorted(self.per_replica.items())),
                "first_error": self.errors[0][1] if self.errors else None}


def replay(client: ServeClient, requests: Iterable[tuple[int, RequestBatch]], *, num_threads: int = 4,
           on_result: Callable[[int, RequestBatch, np.ndarray], None] | None = None) -> ReplayReport:
    """Send ``(replica, batch)`` requests from ``num_threads`` threads, in stream order except that
    a request waits until every earlier request of one of its users has been answered (a user's
    visits stay in order; other users overtake). ``on_result(index, batch, scores)`` runs in the
    worker thread. A rejected or failed request is counted in ``errors`` and the replay goes on."""
    if num_threads < 1:
        raise ValueError(f"num_threads must be >= 1, got {num_threads}")
    items = list(requests)
    order: dict[int, deque[int]] = {}
    for i, (_, batch) in enumerate(items):
        for u in batch.user_ids.tolist():
            order.setdefault(u, deque()).append(i)
    cond = threading.Condition()
    cursor = [0]
    report = ReplayReport(requests=len(items), users=sum(b.batch_size for _, b in items))
    latencies: list[tuple[int, float]] = []

    def worker() -> None:
        while True:
            with cond:
                if cursor[0] >= len(items):
                    return
                i = cursor[0]
                cursor[0] += 1
                replica, batch = items[i]
                users = batch.user_ids.tolist()
                cond.wait_for(lambda i=i, users=users: all(order[u][0] == i for u in users))
            t0 = time.perf_counter()
            try:
                scores = client.score(batch, replica)
                dt = time.perf_counter() - t0
                if on_result is not None:
                    on_result(i, batch, scores)
                error = None
            except Exception as exc:  # a failed request is reported, not fatal
                dt, error = time.perf_counter() - t0, f"{type(exc).__name__}: {exc}"
            with cond:
                if error is None:
                    latencies.append((i, dt))
                    report.per_replica[replica] = report.per_replica.get(replica, 0) + 1
                else:
                    report.errors.append((i, error))
                for u in users:
                    order[u].popleft()
                cond.notify_all()

    t0 = time.perf_counter()
    threads = [threading.Thread(target=worker, name=f"replay-{k}", daemon=True) for k in range(num_threads)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    report.wall_s = time.perf_counter() - t0
    report.latencies_s = [dt for _, dt in sorted(latencies)]
    for i, msg in report.errors[:5]:
        logger.warning("request %d failed: %s", i, msg)
    return report


def scrape(url: str, timeout_s: float = 10.0) -> str:
    """The text of a Prometheus endpoint."""
    with urllib.request.urlopen(url, timeout=timeout_s) as resp:
        return resp.read().decode()


def tier_hit_rates(before: Sequence[str], after: Sequence[str]) -> dict[str, float]:
    """Hit rate per tier between two scrapes of each replica's ``/metrics`` (summed over replicas):
    reused history tokens of each tier / history tokens requested."""
    tiers = {"device": 0.0, "host": 0.0, "ssd": 0.0, "remote": 0.0}
    requested = 0.0
    for b_text, a_text in zip(before, after):
        b, a = cache_counters(b_text), cache_counters(a_text)
        delta = {k: a[k] - b.get(k, 0.0) for k in a}
        delta["page_size"] = a.get("page_size", 0.0)
        requested += delta.get("tokens_requested", 0.0)
        for tier, tokens in tier_tokens(delta).items():
            tiers[tier] += tokens
    out = {f"hit_rate_{t}": (v / requested if requested else 0.0) for t, v in tiers.items()}
    out["hit_rate"] = sum(tiers.values()) / requested if requested else 0.0
    out["tokens_requested"] = requested
    return out
