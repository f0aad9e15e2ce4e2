"""Structured-config schemas of the recipes (``train``, ``infer``), registered in ConfigStore.

Owns the dataclasses Hydra validates the recipes' YAML and overrides against, so a misspelt key
is an error. The ``model`` group is `HSTUConfig` itself; ``kvcache`` is optional (``+kvcache=...``).
"""

from __future__ import annotations

import dataclasses
from typing import Any

from hydra.core.config_store import ConfigStore

from gr_plugin.configs.kvcache import KVCacheOptions
from gr_plugin.modules import HSTUConfig


def default_checkpoint(data: DataOptions, model: HSTUConfig) -> str:
    """The recipes' checkpoint where none is named: one per data source and model shape, what
    ``recipes.train`` writes (``ckpt_out``) and ``recipes.infer`` / ``export`` / ``serve`` load (``default_ckpt``)."""
    return (f"outputs/checkpoints/hstu-{data.source}-L{model.num_layers}-D{model.embedding_dim}"
            f"-H{model.num_heads}x{model.head_dim}.ckpt")


@dataclasses.dataclass
class DataOptions:
    """`RecDataModule` arguments (see its docstring); ``source`` is ``ml-1m`` or ``synthetic``."""

    source: str = "ml-1m"
    source_kwargs: dict[str, Any] = dataclasses.field(default_factory=dict)
    batch_size: int = 8
    num_candidates: int = 64
    max_next: int = 8
    session_gap_s: float | None = 1800.0
    max_visit_len: int | None = 32
    stride: int | None = None
    min_history: int = 1
    num_val_visits: int = 2
    num_test_visits: int = 2
    interleave_users: int | None = None
    max_users: int | None = None
    max_history_len: int | None = None
    num_time_buckets: int = 32
    seed: int = 0
    num_workers: int = 0


@dataclasses.dataclass
class TrainerOptions:
    """The `lightning.Trainer` arguments the recipes expose."""

    accelerator: str = "cpu"
    devices: Any = 1
    max_epochs: int = 1
    max_steps: int = -1
    limit_train_batches: Any = 1.0
    limit_val_batches: Any = 1.0
    val_check_interval: Any = 1.0
    num_sanity_val_steps: int = 0
    log_every_n_steps: int = 20
    precision: str = "32-true"
    gradient_clip_val: float | None = 1.0
    enable_progress_bar: bool = True


@dataclasses.dataclass
class TrainConfig:
    model: HSTUConfig = dataclasses.field(default_factory=HSTUConfig)
    data: DataOptions = dataclasses.field(default_factory=DataOptions)
    trainer: TrainerOptions = dataclasses.field(default_factory=TrainerOptions)
    kvcache: KVCacheOptions | None = None
    lr: float = 2e-3
    weight_decay: float = 0.0
    seed: int = 0
    ckpt_out: str | None = None  # None: `default_checkpoint`
    validate: bool = True

    def __post_init__(self) -> None:
        if self.ckpt_out is None:
            self.ckpt_out = default_checkpoint(self.data, self.model)


@dataclasses.dataclass
class WeightsConfig:
    """What the inference recipes (infer, export, serve) share: the model, its cache, and where its
    weights come from (``ckpt_path``, else ``default_ckpt``, else trained when ``train_if_missing``;
    ``data``/``trainer``/``train`` only matter then), and the device."""

    model: HSTUConfig = dataclasses.field(default_factory=HSTUConfig)
    data: DataOptions = dataclasses.field(default_factory=DataOptions)
    trainer: TrainerOptions = dataclasses.field(default_factory=TrainerOptions)
    kvcache: KVCacheOptions | None = None
    ckpt_path: str | None = None
    default_ckpt: str | None = None  # None: `default_checkpoint`
    train_if_missing: bool = True
    train: dict[str, Any] = dataclasses.field(default_factory=dict)
    device: str = "auto"

    def __post_init__(self) -> None:
        if self.default_ckpt is None:
            self.default_ckpt = default_checkpoint(self.data, self.model)


@dataclasses.dataclass
class InferConfig(WeightsConfig):
    """``recipes.infer``: replay request batches with the cache and, side by side, without it.

    ``dtype``: what the model runs in (``float32``, or ``bfloat16``/``float16``: the tensor-core kernels on
    a GPU); in half precision each batch is also scored by the fp32 recomputation, and the cached scores'
    error against it must be at most twice the half-precision recomputation's (``tolerance`` is fp32's)."""

    dtype: str = "float32"
    stage: str = "predict"
    max_batches: int | None = None
    compare: bool = True
    tolerance: float = 1e-5
    warmup_batches: int = 3
    seed: int = 0
    results_csv: str | None = None


@dataclasses.dataclass
class ExportConfig(InferConfig):
    """``recipes.export``: ``stream`` also writes the replayed request stream with the eager cached
    scores next to the package (``<out>/stream``, CPU only), what the C++ runner replays."""

    stream: bool = True


def register() -> None:
    cs = ConfigStore.instance()
    cs.store(name="train_schema", node=TrainConfig)
    cs.store(name="infer_schema", node=InferConfig)
    cs.store(name="export_schema", node=ExportConfig)


register()
