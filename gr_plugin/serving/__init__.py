"""Serving: the ranking model with its KV cache behind a stock Triton Inference Server (PyTriton).

Layers, leaf first: `wire` (tensor names, padding) <- `validation` (request arrays -> a checked
`RequestBatch`) <- `service` (the inference callable: per-request validation, user-distinct engine
steps under one lock, offload publishing and flush) <- `server` (PyTriton binding, /metrics,
shutdown order; `triton_env` fixes the server's environment) <- `app` (a replica from a
`ServeConfig`, signals). Beside them: `client` (routing by user id, threaded replay, hit rates per
tier), `metrics` (Prometheus text), `launch` (a replica as a child process). PyTriton is imported
only when a server starts.
"""

from gr_plugin.serving.client import RequestRejected, ServeClient, replay, route, split_by_replica, tier_hit_rates
from gr_plugin.serving.server import RankingServer
from gr_plugin.serving.service import RankingService
from gr_plugin.serving.validation import RequestLimits, parse_request
from gr_plugin.serving.wire import bucket_width, decode_scores, encode_batch

__all__ = [
    "RankingServer",
    "RankingService",
    "RequestLimits",
    "RequestRejected",
    "ServeClient",
    "bucket_width",
    "decode_scores",
    "encode_batch",
    "parse_request",
    "replay",
    "route",
    "split_by_replica",
    "tier_hit_rates",
]
