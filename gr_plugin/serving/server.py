"""`RankingServer`: one replica, a stock Triton Inference Server (through PyTriton) around a
`RankingService`.

Owns the replica's process-level pieces and their order: the Triton environment fixes
(`triton_env`), the model binding (inputs and outputs of `wire`, ``max_batch_size``, Triton's
dynamic batcher), the replica's ``/metrics`` endpoint (`metrics.MetricsServer`), a publisher thread
that moves finished offloads on while the replica is idle, and shutdown: stop Triton (it drains
in-flight requests for up to ``exit_timeout_s``), then flush every pending offload and lower-tier
write (`RankingService.close`), then the metrics endpoint. The inference callable runs in this
process (PyTriton proxies Triton's Python backend to it), so the model and the KV cache live here
across requests. Signals and the command line belong to `app`.
"""

from __future__ import annotations

import logging
import shutil
import tempfile
import threading
from pathlib import Path
from typing import Any

import numpy as np

from gr_plugin.configs.serve import TritonOptions
from gr_plugin.serving.metrics import MetricsServer
from gr_plugin.serving.service import RankingService
from gr_plugin.serving.wire import ERROR, HISTORY_INPUTS, PER_USER_INPUTS, SCORES

logger = logging.getLogger(__name__)


class RankingServer:
    """``start()`` serves ``service`` as model ``triton.model_name``; ``stop()`` shuts down in order
    and returns the service's final stats. Also a context manager."""

    def __init__(self, service: RankingService, triton: TritonOptions, *, replica_id: int = 0,
                 metrics_address: str = "127.0.0.1", metrics_port: int = 0,
                 publish_interval_s: float = 0.05) -> None:
        if triton.max_batch_size < 1:
            raise ValueError(f"triton.max_batch_size must be >= 1, got {triton.max_batch_size}")
        if triton.max_batch_size > service.limits.max_users:
            raise ValueError(f"triton.max_batch_size={triton.max_batch_size} exceeds the service's "
                             f"limit of {service.limits.max_users} users per request")
        if publish_interval_s <= 0:
            raise ValueError(f"publish_interval_s must be > 0, got {publish_interval_s}")
        self.service = service
        self.options = triton
        self.replica_id = replica_id
        self.publish_interval_s = publish_interval_s
        self._metrics_args = (metrics_address, metrics_port)
        self._triton = None
        self._metrics: MetricsServer | None = None
        self._publisher: threading.Thread | None = None
        self._stop_publishing = threading.Event()
        self._workspace: Path | None = None
        self._stopped = False
        self._final: dict[str, Any] = {}

    @property
    def endpoints(self) -> dict[str, Any]:
        o = self.options
        return {"http": f"{o.address}:{o.http_port}", "grpc": f"{o.address}:{o.grpc_port}",
                "triton_metrics": f"http://{o.address}:{o.metrics_port}/metrics",
                "metrics": (f"http://{self._metrics_args[0]}:{self._metrics.port}/metrics"
                            if self._metrics is not None else None),
                "model_name": o.model_name, "replica_id": self.replica_id}

    def start(self) -> RankingServer:
        try:
            self._start()
        except BaseException:
            self.stop()
            raise
        logger.info("replica %d serving: %s", self.replica_id, self.endpoints)
        return self

    def _start(self) -> None:
        from gr_plugin.serving.triton_env import prepare_triton_environment

        prepare_triton_environment(self.options.stub_env)
        from pytriton.model_config import DynamicBatcher, ModelConfig, Tensor
        from pytriton.triton import Triton, TritonConfig

        o = self.options
        config = TritonConfig(http_address=o.address, http_port=o.http_port, grpc_address=o.address,
                              grpc_port=o.grpc_port, allow_metrics=True, allow_gpu_metrics=False,
                              metrics_address=o.address, metrics_port=o.metrics_port,
                              exit_timeout_secs=o.exit_timeout_s, log_verbose=o.log_verbose)
        workspace = None
        if o.workspace_dir:
            Path(o.workspace_dir).mkdir(parents=True, exist_ok=True)
            self._workspace = Path(tempfile.mkdtemp(prefix="gr-triton-", dir=o.workspace_dir))
            workspace = self._workspace / "pytriton"  # PyTriton creates it and wants it new
        self._triton = Triton(config=config, workspace=workspace)
        num_tasks = self.service.num_tasks
        self._triton.bind(
            model_name=o.model_name,
            infer_func=self.service,
            inputs=[*(Tensor(name=n, dtype=np.int64, shape=(1,)) for n in PER_USER_INPUTS),
                    *(Tensor(name=n, dtype=np.int64, shape=(-1,)) for n in (*HISTORY_INPUTS, "candidate_items"))],
            outputs=[Tensor(name=SCORES, dtype=np.float32, shape=(-1, num_tasks)),
                     Tensor(name=ERROR, dtype=np.bytes_, shape=(1,))],
            config=ModelConfig(max_batch_size=o.max_batch_size,
                               batcher=DynamicBatcher(max_queue_delay_microseconds=o.max_queue_delay_us)),
        )
        self._triton.run()
        address, port = self._metrics_args
        self._metrics = MetricsServer(self.service.stats, address, port,
                                      labels={"replica": str(self.replica_id), "model": o.model_name}).start()
        self._publisher = threading.Thread(target=self._publish_loop, name="gr-kv-publisher", daemon=True)
        self._publisher.start()

    def _publish_loop(self) -> None:
        while not self._stop_publishing.wait(self.publish_interval_s):
            try:
                self.service.publish()
            except Exception:
                logger.warning("publishing finished offloads failed", exc_info=True)

    def alive(self) -> bool:
        """Triton and the model's proxy are up (False once either died or `stop` ran)."""
        return not self._stopped and self._triton is not None and self._triton.is_alive()

    def stop(self) -> dict[str, Any]:
        """Stop accepting requests (Triton drains the in-flight ones), flush the cache's pending
        offloads and writes, stop the metrics endpoint. Idempotent; returns the final stats."""
        if self._stopped:
            return self._final
        self._stopped = True
        self._stop_publishing.set()
        if self._publisher is not None:
            self._publisher.join(timeout=10)
        if self._triton is not None:
            try:
                self._triton.stop()
            except Exception:
                logger.warning("stopping Triton failed", exc_info=True)
        self._final = self.service.close()
        if self._metrics is not None:
            self._metrics.stop()
        if self._workspace is not None:
            shutil.rmtree(self._workspace, ignore_errors=True)
        logger.info("replica %d stopped", self.replica_id)
        return self._final

    def __enter__(self) -> RankingServer:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()
