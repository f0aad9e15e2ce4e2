"""What ``recipes.serve`` runs: build one replica from a `ServeConfig`, serve until a signal, shut down.

Owns the mapping from the config to objects (weights as ``recipes.infer`` finds them, the cache
from ``kvcache``, the request limits from the model and ``limits``), the ready file, and the
process's signals: SIGTERM or SIGINT start a graceful shutdown (`RankingServer.stop`: drain
Triton, flush pending offloads). It does not parse the command line (Hydra does).
"""

from __future__ import annotations

import json
import logging
import os
import signal
import threading
from pathlib import Path
from typing import Any

import torch

from gr_plugin.apps.common import check_cache_options, make_cache, model_dtype, pick_device
from gr_plugin.apps.infer import _load_or_train
from gr_plugin.configs.serve import ServeConfig
from gr_plugin.inference import RankingEngine
from gr_plugin.serving.server import RankingServer
from gr_plugin.serving.service import RankingService
from gr_plugin.serving.validation import RequestLimits

logger = logging.getLogger(__name__)


def build_service(cfg: ServeConfig) -> tuple[RankingService, str]:
    """The replica's `RankingService` and a description of its weights."""
    dtype = model_dtype(cfg.dtype, cfg.kvcache, owner="the replica's dtype")
    check_cache_options(cfg.kvcache, cfg.model, cfg.dtype)  # (before the weights: a missing checkpoint trains)
    torch.manual_seed(cfg.seed)
    device = pick_device(cfg.device)
    module, weights = _load_or_train(cfg)
    model = module.model.to(device=device, dtype=dtype).eval()
    cache = make_cache(cfg.kvcache, cfg.model, device, dtype) if cfg.kvcache is not None else None
    limits = RequestLimits.for_model(cfg.model, max_users=cfg.triton.max_batch_size,
                                     max_history_len=cfg.limits.max_history_len,
                                     max_candidates=cfg.limits.max_candidates, max_user_id=cfg.limits.max_user_id)
    logger.info("replica %d: weights %s, device %s, kvcache %s", cfg.replica_id, weights, device,
                "none" if cache is None else cfg.kvcache.backend)
    return RankingService(RankingEngine(model, cache, device, cuda_graphs=cfg.cuda_graphs), limits), weights


def _write_ready(path: Path, info: dict[str, Any]) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text(json.dumps(info, indent=2))
    tmp.replace(path)  # NOTE: atomic, so a reader never sees half a file


def run(cfg: ServeConfig, stop: threading.Event | None = None) -> dict[str, Any]:
    """Serve until ``stop`` is set, a SIGTERM/SIGINT arrives (main thread only) or Triton dies;
    returns the final stats (``{"serve": ..., "kvcache": ...}``)."""
    stop = stop or threading.Event()
    service, weights = build_service(cfg)
    server = RankingServer(service, cfg.triton, replica_id=cfg.replica_id, metrics_address=cfg.metrics_address,
                           metrics_port=cfg.metrics_port, publish_interval_s=cfg.publish_interval_s)
    previous = {}
    if threading.current_thread() is threading.main_thread():
        def on_signal(signum: int, _frame: object) -> None:
            logger.info("signal %s: shutting down gracefully", signal.Signals(signum).name)
            stop.set()

        previous = {s: signal.signal(s, on_signal) for s in (signal.SIGTERM, signal.SIGINT)}
    ready = Path(cfg.ready_file) if cfg.ready_file else None
    try:
        server.start()
        if ready is not None:
            engine = service.engine
            _write_ready(ready, {"pid": os.getpid(), "weights": weights, "device": str(engine.device),
                                 "dtype": str(next(engine.model.parameters()).dtype).removeprefix("torch."),
                                 **server.endpoints})
        while not stop.wait(0.5):
            if not server.alive():
                logger.error("Triton or the model's proxy exited; shutting down")
                break
    finally:
        final = server.stop()
        if ready is not None:
            ready.unlink(missing_ok=True)
        for s, handler in previous.items():
            signal.signal(s, handler)
    return final
