"""`KVCacheCallback`: the KV cache around Lightning's validate / test / predict loops.

Owns a `KVCacheModule` and the `RankingEngine` that runs its steps, for the stages it serves:
builds them on the LightningModule's device at the first batch (again for another model object,
whose users' K/V start empty), prepares a cache step before each batch (`RankingEngine.prepare`: id
checks, lookup, allocate, onboard, the token layout on the host), commits it after the batch if a
forward pass wrote its every layer (else aborts it: the next visit misses instead of reading
unwritten pages), aborts it on an exception, and logs
``kvcache/<stage>/hit_rate``, tokens reused and computed, and bytes moved (summed over the ranks
under DDP, where each rank caches the users its batches hold). On CUDA the cached steps
replay CUDA graphs of their shape buckets (``cuda_graphs``, `CachedStackGraphs`), as a server's
engine does: the eager cached pass is bound by the host's kernel launches there. The sanity check's
batches are forgotten.

K/V of older weights are never read: the cache's namespace is ``namespace`` salted with a fingerprint of
the model's weights and config (`gr_plugin.cache.hashing.module_namespace`, the recipes' rule), taken at
each validate / test / predict loop's start. Weights changed since the last loop (a training step, a
checkpoint loaded with ``ckpt_path``, ``load_state_dict``, writes through ``.data``, a fused optimizer's
step) give another namespace, and the loop starts on an empty device cache; the lower tiers keep the
other namespaces' pages, which no key of the new one reaches. Unchanged weights keep their K/V across
trainer calls, Lightning's device moves and processes (DDP ranks, a shared remote tier).

A validation's graphs are dropped at its end during ``fit`` (their memory goes back to training); as
Lightning moves the module off the device between trainer calls, each call captures its graphs
again. Its ``state_dict`` holds statistics only.

The LightningModule must expose ``model`` (an `HSTURanker`). Before each batch the callback sets
``kv_engine`` and ``kv_step`` (score with ``kv_engine.forward(kv_step)``, see
`HSTURankingModule.score`) and ``kv_cache``/``kv_plan`` (the same step for a module that runs
``model.forward_cached`` itself, eagerly); without this callback the module runs the full pass.
"""

from __future__ import annotations

import dataclasses
import gc
import logging
import os
import warnings
from collections.abc import Mapping
from typing import Any

import lightning as L
import torch
from lightning.pytorch.callbacks import Callback
from typing_extensions import override

from gr_plugin.cache import KVCacheConfig
from gr_plugin.cache.config import DTYPE_NAMES, DTYPES, check_namespace
from gr_plugin.cache.hashing import module_namespace
from gr_plugin.cache.tiers.flexkv_config import TierConfig, load_tier_config, redact
from gr_plugin.inference import RankingEngine
from gr_plugin.modules import KVCacheModule
from gr_plugin.modules.kv_cache import BACKENDS

logger = logging.getLogger(__name__)

_STAGES = ("validate", "test", "predict")
_LOGGED = ("hit_rate", "tokens_reused", "tokens_reused_host", "tokens_reused_ssd", "tokens_reused_remote",
           "tokens_computed", "onboard_bytes", "offload_bytes", "evicted_users", "fallbacks", "ssd_pages_fetched",
           "remote_pages_fetched", "tasks_launched", "tasks_timed_out", "tasks_failed")


def _check_ssd_dirs(tiers: TierConfig) -> None:
    """An SSD directory given without a size is ignored (warned); one that cannot be created or
    written is refused now, not at the first batch."""
    if tiers.ssd_cache_gb == 0:
        if tiers.ssd_cache_dirs:
            warnings.warn(f"KVCacheCallback tiers.ssd_cache_dir={tiers.ssd_cache_dir!r} is not used: "
                          "tiers.ssd_cache_gb is 0, so there is no SSD tier (give ssd_cache_gb > 0 to have one)",
                          UserWarning, stacklevel=3)
        return
    for d in tiers.ssd_cache_dirs:
        try:
            os.makedirs(d, exist_ok=True)
        except OSError as exc:
            raise ValueError(f"KVCacheCallback tiers.ssd_cache_dir={d!r} cannot be created: "
                             f"{exc.strerror or exc}") from exc
        if not os.access(d, os.W_OK | os.X_OK):
            raise ValueError(f"KVCacheCallback tiers.ssd_cache_dir={d!r} is not writable by this process")


class KVCacheCallback(Callback):
    """Args:
        backend: ``"gpu"`` (device pages only), ``"native"`` (device pages + pinned host tier) or
            ``"flexkv"`` (+ SSD and remote tiers as ``tiers`` says: a `TierConfig`, a mapping of its
            keys or a FlexKV tier YAML file's path, checked here).
        page_size, num_pages: device pages; host_cache_gb: the host tier's capacity (default 0.25, or
            ``tiers.cpu_cache_gb`` where ``tiers`` is given; both given must agree).
        dtype: cache dtype (default: the dtype the model computes K/V in: the autocast dtype under a
            mixed-precision trainer, ``precision="bf16-mixed"`` or ``"16-mixed"``, else the parameters').
        namespace: identity salt (e.g. a model name); the cache's namespace adds a fingerprint of the
            weights (see the module's docstring).
        stages: which of validate/test/predict use the cache.
        cuda_graphs: on CUDA, replay the cached steps as CUDA graphs per shape bucket where the model
            supports it (`CachedStackGraphs.supported`); each bucket is captured the second time its
            shape is seen, earlier steps and unsupported models run eagerly. Same logits either way.

    After each served stage's epoch, ``metrics[stage]`` (``"validate"``, ``"test"``, ``"predict"``) holds
    that epoch's cache figures (hit_rate, tokens reused/computed, evictions, tier reads; summed over
    ranks), also logged as ``kvcache/<val|test|predict>/<name>`` where Lightning logs (not predict);
    ``cache`` is the `KVCacheModule` (its ``stats()``: the running totals) once a stage has started.
    """

    def __init__(self, backend: str = "native", *, page_size: int = 32, num_pages: int = 1024,
                 host_cache_gb: float | None = None, dtype: str | None = None, namespace: str = "gr_plugin",
                 write_through: bool = True, stages: tuple[str, ...] = _STAGES,
                 tiers: TierConfig | Mapping[str, Any] | str | os.PathLike | None = None,
                 cuda_graphs: bool = True) -> None:
        super().__init__()
        if isinstance(stages, str):  # (one stage by name: not its letters)
            stages = (stages,)
        for name, flag in (("write_through", write_through), ("cuda_graphs", cuda_graphs)):
            if not isinstance(flag, bool):
                raise ValueError(f"KVCacheCallback {name} must be a bool, got {flag!r}")
        for s in stages:
            if s not in _STAGES:
                raise ValueError(f"KVCacheCallback stage {s!r} is not one of {list(_STAGES)}")
        # (checked here, not at the first batch of a trainer call: `KVCacheConfig` checks them again)
        if backend not in BACKENDS:
            raise ValueError(f"KVCacheCallback backend must be one of {list(BACKENDS)}, got {backend!r}")
        for name, value in (("page_size", page_size), ("num_pages", num_pages)):
            if isinstance(value, bool) or not isinstance(value, int) or value <= 0:
                raise ValueError(f"KVCacheCallback {name} must be a positive int, got {value!r}")
        if host_cache_gb is not None and (isinstance(host_cache_gb, bool) or not isinstance(host_cache_gb, int | float)
                                          or not host_cache_gb >= 0):
            raise ValueError(f"KVCacheCallback host_cache_gb must be a number >= 0, got {host_cache_gb!r}")
        if tiers is not None:
            if backend != "flexkv":
                raise ValueError(f"KVCacheCallback tiers apply to backend='flexkv' (its SSD and remote tiers), got "
                                 f"backend={backend!r}")
            tiers = load_tier_config(tiers)
            if host_cache_gb is not None and float(host_cache_gb) != tiers.cpu_cache_gb:
                raise ValueError(f"KVCacheCallback host_cache_gb={host_cache_gb!r} disagrees with "
                                 f"tiers.cpu_cache_gb={tiers.cpu_cache_gb!r} (the host tier's size: give one)")
            host_cache_gb = tiers.cpu_cache_gb
            _check_ssd_dirs(tiers)
        elif host_cache_gb is None:
            host_cache_gb = 0.25
        if dtype is not None and dtype not in DTYPES:
            raise ValueError(f"KVCacheCallback dtype must be None or one of {sorted(DTYPES)}, got {dtype!r}")
        check_namespace(namespace, "KVCacheCallback namespace")
        self.backend, self.page_size, self.num_pages = backend, page_size, num_pages
        self.host_cache_gb, self.dtype, self.namespace = host_cache_gb, dtype, namespace
        self.write_through, self.stages, self.tiers = write_through, tuple(stages), tiers
        self.cuda_graphs = cuda_graphs
        self.cache: KVCacheModule | None = None
        self.engine: RankingEngine | None = None
        self._weights: tuple[int, ...] = ()  # the addresses the engine's graphs read the weights at
        self._cache_namespace = namespace  # the namespace of the weights the cache's K/V come from (`_attach`)
        self.metrics: dict[str, dict[str, float]] = {}
        self._fallbacks = 0
        self._epoch_start: dict[str, Any] = {}

    # ------------------------------------------------------------------ building
    def _kv_dtype(self, trainer: L.Trainer, pl_module: L.LightningModule, stage: str) -> str:
        """The cache's dtype: ``dtype``, else what the layers' projections return under the trainer."""
        if self.dtype:
            return self.dtype
        device = next(pl_module.parameters()).device.type
        plugin = trainer.precision_plugin
        step_context = {"validate": plugin.val_step_context, "test": plugin.test_step_context,
                        "predict": plugin.predict_step_context}[stage]
        # NOTE: the stage's steps run inside this context; under an autocast there (MixedPrecision,
        # FSDP's mixed precision, ...) K/V leave the projections in its dtype.
        with step_context():
            autocast = torch.is_autocast_enabled(device)
            computed = torch.get_autocast_dtype(device) if autocast else next(pl_module.parameters()).dtype
        if computed not in DTYPE_NAMES:
            raise ValueError(f"KVCacheCallback: no cache dtype for K/V computed in {computed} "
                             f"(precision {trainer.precision!r}); pass dtype=")
        return DTYPE_NAMES[computed]

    def _build(self, pl_module: L.LightningModule, dtype: str) -> KVCacheModule:
        mc = pl_module.model.config
        param = next(pl_module.parameters())
        probe = KVCacheConfig(num_layers=mc.num_layers, num_heads=mc.num_heads, head_dim=mc.head_dim,
                              page_size=self.page_size, num_pages=self.num_pages, dtype=dtype,
                              device=str(param.device), namespace=self._cache_namespace)
        host_bytes = int(self.host_cache_gb * (1 << 30)) if self.backend != "gpu" else 0
        probe.host_cache_bytes = host_bytes
        # NOTE: Lightning's evaluation runs under inference mode; tensors made there could never be
        # written outside it (fit's validation runs under no_grad) nor by the offload's copy thread.
        with torch.inference_mode(False):
            cache = KVCacheModule(probe, self.backend, write_through=self.write_through, tiers=self.tiers)
        logger.info("KV cache on %s: %s%s", param.device, cache.extra_repr(),
                    f"; tiers {redact(self.tiers.to_dict())}" if self.tiers is not None else "")
        return cache

    def _attach(self, trainer: L.Trainer, pl_module: L.LightningModule, stage: str) -> None:
        if stage not in self.stages:
            return
        model = pl_module.model
        dtype = self._kv_dtype(trainer, pl_module, stage)
        # NOTE: at every loop's start, not only after the hooks that change weights: a load_state_dict by
        # hand, a write through ``.data`` or a fused optimizer's step shows in no hook or version counter.
        # (2 ms for the default model, 58-152 for hstu_large on the CPU dev box: docs/BENCHMARKS.md, "The
        # weights' fingerprint".)
        namespace = module_namespace(self.namespace, model, dataclasses.asdict(model.config))
        if (self.cache is None or self.cache.kv_table.device != next(pl_module.parameters()).device
                or self.cache.config.dtype != dtype or self.engine is None or self.engine.model is not model):
            # NOTE: another model (e.g. loaded from a checkpoint) has other weights, and another precision
            # other K/V: its users' K/V start empty, the new engine's graphs take a scratch page of the new cache.
            self.close()  # (the old cache's memory, threads, SSD directory lock and connections first)
            self._cache_namespace = namespace
            self.cache = self._build(pl_module, dtype)
            self.engine = RankingEngine(model, self.cache, self.cache.kv_table.device, cuda_graphs=self.cuda_graphs)
        if namespace != self._cache_namespace:
            logger.info("KV cache: the weights changed, namespace %r (was %r); device pages dropped", namespace,
                        self._cache_namespace)
            self.cache.manager.evict_all()  # (the lower tiers' keys hold the namespace: never reached now)
            self.cache.manager.set_namespace(namespace)
            self._cache_namespace = namespace
        if self.engine.graphs is not None:
            weights = tuple(t.data_ptr() for t in model.state_dict(keep_vars=True).values())
            if weights != self._weights:
                # NOTE: graphs read the weights where they were captured, and Lightning moves the module
                # to the CPU when a trainer call ends and back at the next call's start (new addresses):
                # capture again. The K/V stay, as without graphs (``namespace`` names their weights).
                self._drop_graphs()
            self._weights = weights
        # NOTE: object.__setattr__ keeps the cache and the engine out of the module's children (no
        # DDP buffer broadcast, no summary entry); they hold no weights of their own.
        for name, value in (("kv_cache", self.cache), ("kv_engine", self.engine), ("kv_plan", None),
                            ("kv_step", None)):
            object.__setattr__(pl_module, name, value)
        self._epoch_start[stage] = self._snapshot()

    def _snapshot(self) -> dict[str, Any]:
        stats = self.cache.manager.stats()
        return {k: v for k, v in stats.items() if isinstance(v, int | float)} | {"fallbacks": self._fallbacks}

    def close(self) -> None:
        """Let go of the cache and its engine: graphs dropped, copies drained, tiers closed (threads
        stopped, the SSD directory unlocked), memory freed. A later trainer call builds a new cache
        (users' K/V start empty on the device). Call it when done with the callback, e.g. before
        another process or callback uses the same ``ssd_cache_dir``."""
        if self.cache is not None:
            self._drop_graphs()
            self.cache.manager.close()
            self.cache = self.engine = None
            self._weights = ()
            gc.collect()  # NOTE: the manager sits in reference cycles: free its tables now, not at a later GC

    def _drop_graphs(self) -> None:
        """Drop the engine's captured graphs (`GraphBuckets.clear`), which read the weights at their
        current addresses: before Lightning moves the module, and before training reuses the memory."""
        if self.engine is not None and self.engine.graphs is not None:
            self.engine.graphs.clear()

    def _detach(self, pl_module: L.LightningModule) -> None:
        for name in ("kv_cache", "kv_engine", "kv_plan", "kv_step"):
            object.__setattr__(pl_module, name, None)

    # ------------------------------------------------------------------ per batch
    def _begin(self, pl_module: L.LightningModule, batch: Any) -> None:
        if getattr(pl_module, "kv_engine", None) is None:
            return
        step = self.engine.prepare(batch)
        if step.fell_back:
            self._fallbacks += 1
        object.__setattr__(pl_module, "kv_step", step)
        object.__setattr__(pl_module, "kv_plan", step.plan)

    def _end(self, pl_module: L.LightningModule) -> None:
        plan = getattr(pl_module, "kv_plan", None)
        object.__setattr__(pl_module, "kv_step", None)
        if plan is None:
            return
        # NOTE: commit (or abort) before letting go of the plan: if it raises, `on_exception` aborts it.
        if plan.state != "allocated":
            pass  # aborted by `RankingEngine.forward`'s failure, which the module caught
        elif len(plan.appended_layers) < self.cache.config.num_layers:
            # NOTE: the module scored the batch without the prepared step (neither ``kv_engine.forward``
            # nor ``forward_cached``): its pages hold nothing of the new events, so publishing them would
            # serve wrong K/V to the users' next visits. Aborted: a miss next time, never a wrong answer.
            logger.warning("the batch's cache step ran %d of %d layers: aborted, not committed",
                           len(plan.appended_layers), self.cache.config.num_layers)
            self.cache.abort(plan)
        else:
            self.cache.commit(plan)
        object.__setattr__(pl_module, "kv_plan", None)

    def _epoch_end(self, trainer: L.Trainer, pl_module: L.LightningModule, stage: str, log: bool) -> None:
        if self.cache is None or stage not in self._epoch_start:
            return
        self.cache.manager.offload_flush()
        now = self._snapshot()
        start = self._epoch_start[stage]
        delta = {k: now[k] - start[k] for k in _LOGGED if k != "hit_rate" and k in now}
        delta["tokens_requested"] = now["tokens_requested"] - start["tokens_requested"]
        if trainer.world_size > 1:
            # NOTE: each rank caches its own share of the users: the epoch's figures are the ranks' sums.
            keys = sorted(delta)
            sums = trainer.strategy.reduce(torch.tensor([float(delta[k]) for k in keys], dtype=torch.float64,
                                                        device=pl_module.device), reduce_op="sum")
            delta = dict(zip(keys, sums.tolist()))
        requested = delta.pop("tokens_requested")
        delta["hit_rate"] = delta["tokens_reused"] / requested if requested else 0.0
        self.metrics[stage] = {k: float(v) for k, v in delta.items()}
        if log:
            name = {"validate": "val"}.get(stage, stage)
            pl_module.log_dict({f"kvcache/{name}/{k}": float(v) for k, v in delta.items()})

    # ------------------------------------------------------------------ hooks
    @override
    def on_validation_epoch_start(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        self._attach(trainer, pl_module, "validate")

    @override
    def on_test_epoch_start(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        self._attach(trainer, pl_module, "test")

    @override
    def on_predict_epoch_start(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        self._attach(trainer, pl_module, "predict")

    @override
    def on_validation_batch_start(self, trainer, pl_module, batch, batch_idx, dataloader_idx=0) -> None:
        self._begin(pl_module, batch)

    @override
    def on_test_batch_start(self, trainer, pl_module, batch, batch_idx, dataloader_idx=0) -> None:
        self._begin(pl_module, batch)

    @override
    def on_predict_batch_start(self, trainer, pl_module, batch, batch_idx, dataloader_idx=0) -> None:
        self._begin(pl_module, batch)

    @override
    def on_validation_batch_end(self, trainer, pl_module, outputs, batch, batch_idx, dataloader_idx=0) -> None:
        self._end(pl_module)

    @override
    def on_test_batch_end(self, trainer, pl_module, outputs, batch, batch_idx, dataloader_idx=0) -> None:
        self._end(pl_module)

    @override
    def on_predict_batch_end(self, trainer, pl_module, outputs, batch, batch_idx, dataloader_idx=0) -> None:
        self._end(pl_module)

    @override
    def on_validation_epoch_end(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        self._epoch_end(trainer, pl_module, "validate", log=not trainer.sanity_checking)
        self._detach(pl_module)
        if trainer.state.fn == "fit":
            self._drop_graphs()  # training follows: give it the memory back

    @override
    def on_test_epoch_end(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        self._epoch_end(trainer, pl_module, "test", log=True)
        self._detach(pl_module)

    @override
    def on_predict_epoch_end(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        self._epoch_end(trainer, pl_module, "predict", log=False)  # Lightning does not log in predict
        self._detach(pl_module)

    @override
    def on_sanity_check_end(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        if self.cache is not None:  # (the device's pages only: the remote tier is shared with other processes)
            self.cache.manager.evict_all()
        self.metrics.pop("validate", None)

    @override
    def on_exception(self, trainer: L.Trainer, pl_module: L.LightningModule, exception: BaseException) -> None:
        plan = getattr(pl_module, "kv_plan", None)
        # (a failure inside `RankingEngine.forward` has aborted the step already)
        if plan is not None and self.cache is not None and plan.state == "allocated":
            logger.warning("aborting the cache step of the failed batch: %r", exception)
            self.cache.abort(plan)
        self._detach(pl_module)
        self._drop_graphs()  # (Lightning's teardown after an exception skips the callbacks' `teardown`)

    @override
    def teardown(self, trainer: L.Trainer, pl_module: L.LightningModule, stage: str) -> None:
        if self.cache is not None:
            self.cache.manager.offload_flush()
        self._drop_graphs()  # Lightning moves the module off the device now

    # ------------------------------------------------------------------ checkpointing
    @override
    def state_dict(self) -> dict[str, Any]:
        return {"metrics": self.metrics, "fallbacks": self._fallbacks}

    @override
    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        self.metrics = dict(state_dict.get("metrics", {}))
        self._fallbacks = int(state_dict.get("fallbacks", 0))

