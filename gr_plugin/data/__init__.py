"""Interaction data for gr_plugin: logs, request streams and the Lightning datamodule.

Layers, leaf first: `log` (the CSR `InteractionLog`) <- `movielens` / `synthetic` (sources) and
`features` (per-event features) <- `visits` (where visits fall) <- `batch` / `requests` (requests,
replay order, batches) <- `datamodule` (Lightning). Only `datamodule` imports Lightning, and it is
loaded on first use of `RecDataModule`, so the rest stays importable without it. Nothing here
knows about the KV cache or the model.
"""

from typing import Any

from gr_plugin.data.batch import RequestBatch
from gr_plugin.data.features import DEFAULT_NUM_TIME_BUCKETS, time_gap_buckets
from gr_plugin.data.log import InteractionLog
from gr_plugin.data.movielens import cache_dir, default_ml1m_path, load_movielens_1m
from gr_plugin.data.requests import (
    Request,
    batch_requests,
    build_requests,
    collate_requests,
    group_requests,
    make_request,
    replay_order,
)
from gr_plugin.data.synthetic import synthetic_log
from gr_plugin.data.visits import DEFAULT_SESSION_GAP_S, Visits, split_visits

__all__ = [
    "DEFAULT_NUM_TIME_BUCKETS",
    "DEFAULT_SESSION_GAP_S",
    "InteractionLog",
    "RecDataModule",
    "Request",
    "RequestBatch",
    "Visits",
    "batch_requests",
    "build_requests",
    "cache_dir",
    "collate_requests",
    "default_ml1m_path",
    "group_requests",
    "load_movielens_1m",
    "make_request",
    "replay_order",
    "split_visits",
    "synthetic_log",
    "time_gap_buckets",
]


def __getattr__(name: str) -> Any:
    if name == "RecDataModule":
        from gr_plugin.data.datamodule import RecDataModule

        return RecDataModule
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
