"""``recipes.train``: train the HSTU ranker with Lightning and write a checkpoint.

Validation runs through `KVCacheCallback` when a ``kvcache`` option is given (``+kvcache=...``);
``validate=false`` skips it (no validation batch runs).
"""

from __future__ import annotations

import logging
from pathlib import Path

import lightning as L

from gr_plugin.apps.common import check_cache_options, make_callback, make_datamodule, make_trainer
from gr_plugin.configs.schema import TrainConfig
from gr_plugin.lightning import HSTURankingModule

logger = logging.getLogger(__name__)


def run(cfg: TrainConfig, *, enable_checkpointing: bool = False, logger_dir: str | None = None) -> dict:
    check_cache_options(cfg.kvcache, cfg.model, "float32")  # (before the data loads)
    L.seed_everything(cfg.seed, workers=True)
    dm = make_datamodule(cfg.data)
    if cfg.model.num_items < dm.num_items:
        raise ValueError(f"model.num_items={cfg.model.num_items} but the data has {dm.num_items} items")
    module = HSTURankingModule(cfg.model, lr=cfg.lr, weight_decay=cfg.weight_decay)
    callbacks = [cb for cb in (make_callback(cfg.kvcache),) if cb is not None]
    loggers = L.pytorch.loggers.CSVLogger(logger_dir) if logger_dir else False
    no_val = {} if cfg.validate else {"limit_val_batches": 0}
    trainer = make_trainer(cfg.trainer, callbacks, enable_checkpointing=enable_checkpointing, logger=loggers, **no_val)
    trainer.fit(module, datamodule=dm)
    out = Path(cfg.ckpt_out)
    out.parent.mkdir(parents=True, exist_ok=True)
    trainer.save_checkpoint(out, weights_only=True)
    metrics = {k: float(v) for k, v in trainer.callback_metrics.items()}
    logger.info("wrote %s; metrics %s", out, metrics)
    return {"checkpoint": str(out), "metrics": metrics, "steps": trainer.global_step}
