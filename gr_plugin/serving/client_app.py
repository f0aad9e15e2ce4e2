"""What ``recipes.serve_client`` runs: replay the data module's visits against running replicas.

Owns the replay run: requests from `RecDataModule`'s predict stream (held-out visits, several per
user, users interleaved; ``users_per_request`` users per request, split by replica), routing by
user id, ``num_threads`` sender threads, the replicas' ``/metrics`` scraped before and after, and
the summary (latency p50/p99, throughput, hit rate per tier) as a dict and a text table. It starts
no server (see `app` / `launch`).
"""

from __future__ import annotations

import dataclasses
import json
import logging
from pathlib import Path
from typing import Any

from gr_plugin.apps.common import make_datamodule
from gr_plugin.configs.serve import ServeClientConfig
from gr_plugin.serving.client import ServeClient, replay, scrape, split_by_replica, tier_hit_rates

logger = logging.getLogger(__name__)


def run(cfg: ServeClientConfig) -> dict[str, Any]:
    if cfg.user_id_offset < 0:
        raise ValueError(f"user_id_offset must be >= 0, got {cfg.user_id_offset}")
    if cfg.metrics_urls and len(cfg.metrics_urls) != len(cfg.urls):
        raise ValueError(f"metrics_urls has {len(cfg.metrics_urls)} entries but urls has {len(cfg.urls)}: "
                         "give one per replica, or none")
    dm = make_datamodule(dataclasses.replace(cfg.data, batch_size=cfg.users_per_request))
    dm.setup("predict")
    client = ServeClient(cfg.urls, cfg.model_name, timeout_s=cfg.timeout_s)
    requests = []
    for batch in dm.predict_dataloader():
        if cfg.user_id_offset:
            batch = dataclasses.replace(batch, user_ids=batch.user_ids + cfg.user_id_offset)
        requests.extend(split_by_replica(batch, client.num_replicas))
        if cfg.max_requests is not None and len(requests) >= cfg.max_requests:
            requests = requests[: cfg.max_requests]
            break
    logger.info("replaying %d requests against %d replica(s) from %d threads", len(requests),
                client.num_replicas, cfg.num_threads)
    before = [scrape(u) for u in cfg.metrics_urls]
    report = replay(client, requests, num_threads=cfg.num_threads)
    after = [scrape(u) for u in cfg.metrics_urls]
    summary = {**report.summary(warmup=cfg.warmup_requests), "threads": cfg.num_threads,
               "replicas": client.num_replicas, "users_per_request": cfg.users_per_request}
    if cfg.metrics_urls:
        summary.update(tier_hit_rates(before, after))
    if cfg.results_json:
        path = Path(cfg.results_json)
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(json.dumps({"summary": summary, "errors": report.errors[:50]}, indent=2, default=str))
    return summary


def format_table(summary: dict[str, Any]) -> str:
    """The replay's summary as an aligned text table."""
    def f(key: str, fmt: str = "{:.2f}") -> str:
        v = summary.get(key)
        return "-" if v is None else (fmt.format(v) if isinstance(v, float) else str(v))

    lines = [
        ("requests (users, errors)", f"{f('requests')} ({f('users')}, {f('errors')})"),
        ("replicas / threads / users per request", f"{f('replicas')} / {f('threads')} / {f('users_per_request')}"),
        ("requests per replica", f("per_replica")),
        ("latency ms p50 / p99 / mean", f"{f('latency_ms_p50')} / {f('latency_ms_p99')} / {f('latency_ms_mean')}"),
        ("throughput requests/s (users/s)", f"{f('throughput_rps')} ({f('throughput_users_ps')})"),
        ("hit rate: all / device / host / ssd / remote",
         " / ".join(f(k, "{:.1%}") for k in ("hit_rate", "hit_rate_device", "hit_rate_host", "hit_rate_ssd",
                                              "hit_rate_remote"))),
    ]
    width = max(len(k) for k, _ in lines)
    return "\n".join(f"{k:<{width}}  {v}" for k, v in lines)
