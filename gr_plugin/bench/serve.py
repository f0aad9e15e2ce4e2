"""Serving (``python -m recipes.bench suite=serve``): the real server's latency and throughput with
and without KV-cache hits.

For each workload and ``kvcache`` option, one replica (``python -m recipes.serve``: stock
tritonserver through PyTriton) starts on free loopback ports and the workload's visit stream
(held-out visits, several per user, users interleaved) is replayed against it from ``num_threads``
client threads in this process, one user per request. ``none`` recomputes every history (no hits);
a cached option reuses returning users' pages. Reports client-side latency p50/p99 (send to
answer), throughput, the cache's hit rate per tier and the mean users per engine step (what
Triton's dynamic batcher merged) from the replica's ``/metrics``. Workloads: ``ml1m`` (MovieLens-1M,
histories 20..1024 events) and ``long`` (synthetic, 512..2048 events, visits of up to 64 new ones).
"""

from __future__ import annotations

import dataclasses
import logging
import tempfile
from pathlib import Path
from typing import Any

from gr_plugin.configs.schema import DataOptions
from gr_plugin.configs.serve import ServeClientConfig
from gr_plugin.serving import client_app
from gr_plugin.serving.client import scrape
from gr_plugin.serving.launch import ServerProcess
from gr_plugin.serving.metrics import parse_prometheus

logger = logging.getLogger(__name__)

COLUMNS = ["workload", "kvcache", "device", "dtype", "requests", "threads", "latency_ms_p50", "latency_ms_p99",
           "throughput_rps",
           "hit_rate", "hit_rate_device", "hit_rate_host", "hit_rate_ssd", "users_per_step", "engine_ms_per_step",
           "graph_captures", "errors"]


def workload(name: str, max_users: int) -> DataOptions:
    if name == "ml1m":
        return DataOptions(source="ml-1m", max_users=max_users, interleave_users=max(1, (2 * max_users) // 3),
                           max_history_len=1024)
    if name == "long":
        return DataOptions(source="synthetic", source_kwargs=dict(num_users=max_users, min_len=512, max_len=2048,
                                                                  num_items=3706),
                           max_visit_len=64, interleave_users=max(1, max_users // 4), max_history_len=4096)
    raise ValueError(f"unknown serving workload {name!r}; choose ml1m or long")


def run(workloads: tuple[str, ...] = ("ml1m", "long"), kvcache: tuple[str, ...] = ("none", "flexkv"),
        num_requests: int = 400, num_threads: int = 4, max_users: int | dict[str, int] | None = None,
        ckpt_path: str | None = None, model: str = "hstu_small", max_queue_delay_us: int = 2000,
        warmup_requests: int = 20, server_overrides: tuple[str, ...] = (),
        startup_timeout_s: float = 300.0, log_dir: str | None = None, warm_pass: bool = True) -> list[dict[str, Any]]:
    """One row per (workload, ``kvcache`` option). Weights: ``ckpt_path``, else the default
    checkpoint of ``recipes.train`` if it exists and ``model`` is its ``hstu_small``, else random
    (latency does not depend on them).
    ``max_users``: users of each workload (default 300 for ml1m, 64 for long). ``log_dir``: where
    each replica's log is copied after it stops (else it goes with the temporary directory).
    ``warm_pass``: first replay the same visits as other users (``user_id_offset``), untimed, so
    one-time costs (Triton compiles per kernel variant, CUDA-graph captures per shape bucket) stay
    out of the figures, as a server's warm-up would keep them out of its traffic. The warm pass's
    users stay in the replica's tiers, so the timed replay starts with them as full as traffic
    would have left them (its hit rates come from /metrics deltas of the timed replay)."""
    users = {"ml1m": 300, "long": 64}
    if isinstance(max_users, int):
        users = dict.fromkeys(users, max_users)
    elif max_users:
        users.update(max_users)
    rows = []
    with tempfile.TemporaryDirectory(prefix="gr-bench-serve-") as tmp:
        for name in workloads:
            data = workload(name, users[name])
            for option in kvcache:
                overrides = [f"model={model}", f"kvcache={option}", "train_if_missing=false",
                             f"triton.max_queue_delay_us={max_queue_delay_us}",
                             f"kvcache.tiers.ssd_cache_dir={Path(tmp) / ('ssd-' + name + '-' + option)}",
                             *server_overrides]
                if ckpt_path:
                    overrides.append(f"ckpt_path={ckpt_path}")
                elif model != "hstu_small":  # NOTE: the default checkpoint is recipes.train's hstu_small
                    overrides.append(f"default_ckpt={Path(tmp) / 'no-checkpoint.ckpt'}")
                server = ServerProcess(overrides, Path(tmp) / f"{name}-{option}", name=f"bench-{name}-{option}")
                try:
                    server.start(timeout_s=startup_timeout_s)
                    cfg = ServeClientConfig(data=data, urls=[server.info["http"]],
                                            metrics_urls=[server.info["metrics"]], num_threads=num_threads,
                                            max_requests=num_requests, warmup_requests=warmup_requests)
                    if warm_pass:
                        client_app.run(dataclasses.replace(cfg, metrics_urls=[], user_id_offset=1 << 20))
                    m0 = parse_prometheus(scrape(server.info["metrics"]), "gr_serve_")
                    summary = client_app.run(cfg)
                    m = parse_prometheus(scrape(server.info["metrics"]), "gr_serve_")
                    m = {k: v - m0.get(k, 0.0) for k, v in m.items()}  # the timed replay only
                    steps = max(1.0, m.get("gr_serve_steps_total", 0.0))
                    row = {"workload": name, "kvcache": option, "weights": server.info.get("weights"),
                           "device": server.info.get("device"), "dtype": server.info.get("dtype"), **summary,
                           "users_per_step": m.get("gr_serve_users_scored_total", 0.0) / steps,
                           "engine_ms_per_step": 1e3 * m.get("gr_serve_step_seconds_total", 0.0) / steps,
                           "graph_captures": m.get("gr_serve_graph_captures_total", 0.0)}
                    logger.info("%s, kvcache=%s:\n%s", name, option, client_app.format_table(summary))
                    rows.append(row)
                finally:
                    code = server.stop()
                    if log_dir:
                        Path(log_dir).mkdir(parents=True, exist_ok=True)
                        (Path(log_dir) / f"{server.name}.log").write_text(server.log())
                    if code != 0:
                        logger.warning("%s exited with %s; log tail:\n%s", server.name, code, server.log()[-3000:])
    return rows
