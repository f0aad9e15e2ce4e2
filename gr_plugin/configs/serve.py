"""Structured-config schemas of the serving recipes (``serve``, ``serve_client``), in ConfigStore.

Owns `ServeConfig` (``serve_schema``: one replica: model weights, the KV cache, Triton's addresses,
ports and batching, request limits, the replica's metrics endpoint) and `ServeClientConfig`
(``serve_client_schema``: which replicas, which requests, how many threads). A misspelt key is an
error, as for the other recipes.
"""

from __future__ import annotations

import dataclasses

from hydra.core.config_store import ConfigStore

from gr_plugin.configs.schema import DataOptions, WeightsConfig


@dataclasses.dataclass
class TritonOptions:
    """Triton's endpoints and the model's batching. Every endpoint binds ``address`` (loopback by
    default); ``metrics_port`` is Triton's own Prometheus endpoint (``nv_inference_*``).
    ``max_batch_size``: users per request and per dynamic batch; ``max_queue_delay_us``: how long
    the dynamic batcher waits to fill a batch. ``stub_env``: the Python env of Triton's
    Python-backend stub (null: ``<venv>/triton-stub``, created on first start; see
    ``gr_plugin.serving.triton_env``). ``workspace_dir``: where PyTriton's workspace is made (null:
    ``~/.cache/pytriton``)."""

    address: str = "127.0.0.1"
    http_port: int = 8000
    grpc_port: int = 8001
    metrics_port: int = 8002
    model_name: str = "hstu_ranker"
    max_batch_size: int = 32
    max_queue_delay_us: int = 2000
    exit_timeout_s: int = 30
    log_verbose: int = 0
    stub_env: str | None = None
    workspace_dir: str | None = None


@dataclasses.dataclass
class LimitOptions:
    """Per-user request limits (validated before anything reaches the model or the cache);
    ``max_user_id`` null = any non-negative int64."""

    max_history_len: int = 4096
    max_candidates: int = 1024
    max_user_id: int | None = None


@dataclasses.dataclass
class ServeConfig(WeightsConfig):
    """``recipes.serve``: one replica. Weights as in ``recipes.infer`` (``ckpt_path``, else
    ``default_ckpt``, else train it when ``train_if_missing``; ``data``/``trainer``/``train`` only
    matter then). ``metrics_port``: the replica's own ``/metrics`` (serving and cache counters; 0:
    any free port). ``ready_file``: written (JSON: pid, device, dtype, ports) once the server answers.
    ``dtype``: what the model runs in (``bfloat16`` on a GPU uses the tensor-core kernels).
    ``cuda_graphs``: on a GPU, replay the cached layer stack as CUDA graphs per shape bucket
    (`gr_plugin.modules.graphs`), or without a cache the full passes (`gr_plugin.modules.full_graphs`);
    ignored on a CPU.
    Replicas that share a Redis tier share pages where their weights are equal: the namespace they use is
    ``kvcache.namespace`` salted with a fingerprint of the weights (`gr_plugin.apps.common.cache_namespace`)."""

    dtype: str = "float32"  # the replica's weights and activations: float32 | bfloat16 | float16
    cuda_graphs: bool = True
    seed: int = 0
    replica_id: int = 0
    triton: TritonOptions = dataclasses.field(default_factory=TritonOptions)
    limits: LimitOptions = dataclasses.field(default_factory=LimitOptions)
    metrics_address: str = "127.0.0.1"
    metrics_port: int = 8003
    publish_interval_s: float = 0.05
    ready_file: str | None = None


@dataclasses.dataclass
class ServeClientConfig:
    """``recipes.serve_client``: replay the data module's predict visits (one request per visit,
    users interleaved) against ``urls`` (Triton HTTP ``host:port``, one per replica) from
    ``num_threads`` threads. A user goes to replica ``route(user_id) % len(urls)``;
    ``metrics_urls`` (one per replica, the replicas' ``/metrics``) give the cache's hit rate per
    tier. ``max_requests`` null = all; ``users_per_request`` > 1 sends several users per request.
    ``user_id_offset`` is added to every user id: the same visits as other users (a warm-up pass
    that shares no cache entries with the replay that follows)."""

    data: DataOptions = dataclasses.field(default_factory=DataOptions)
    urls: list[str] = dataclasses.field(default_factory=lambda: ["127.0.0.1:8000"])
    metrics_urls: list[str] = dataclasses.field(default_factory=lambda: ["http://127.0.0.1:8003/metrics"])
    model_name: str = "hstu_ranker"
    num_threads: int = 4
    max_requests: int | None = None
    users_per_request: int = 1
    timeout_s: float = 60.0
    warmup_requests: int = 10
    user_id_offset: int = 0
    results_json: str | None = None


def register() -> None:
    cs = ConfigStore.instance()
    cs.store(name="serve_schema", node=ServeConfig)
    cs.store(name="serve_client_schema", node=ServeClientConfig)


register()
