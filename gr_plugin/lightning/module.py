"""`HSTURankingModule`: training and evaluation of `HSTURanker` with Lightning.

Owns the loss (BCE over the two tasks: liked, watched), the optimiser and the metrics (AUC per
task; NDCG@10 and HR@10 of the "watched" logit within each request). It runs the full pass unless a
`KVCacheCallback` has prepared a cache step for the current batch (``kv_engine`` and ``kv_step``;
or ``kv_cache`` and ``kv_plan`` set by hand), in which case it runs the cached pass; it works
unchanged without the callback.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import lightning as L
import torch
import torch.nn.functional as F
from torchmetrics import MetricCollection
from torchmetrics.classification import BinaryAUROC
from torchmetrics.retrieval import RetrievalHitRate, RetrievalNormalizedDCG

from gr_plugin.data import RequestBatch
from gr_plugin.inference import PreparedStep, RankingEngine
from gr_plugin.inference.inputs import batch_to_kjts, host_batch
from gr_plugin.modules import HSTUConfig, HSTURanker, KVCacheModule

TASKS = ("liked", "watched")


def _metrics(prefix: str) -> MetricCollection:
    return MetricCollection(
        {"auc_liked": BinaryAUROC(), "auc_watched": BinaryAUROC(),
         "ndcg@10": RetrievalNormalizedDCG(top_k=10), "hr@10": RetrievalHitRate(top_k=10)},
        prefix=prefix,
    )


class HSTURankingModule(L.LightningModule):
    def __init__(self, model: HSTUConfig | dict[str, Any], lr: float = 1e-3, weight_decay: float = 0.0) -> None:
        super().__init__()
        config = model if isinstance(model, HSTUConfig) else HSTUConfig(**model)
        self.save_hyperparameters({"model": dataclasses.asdict(config), "lr": lr, "weight_decay": weight_decay})
        self.model = HSTURanker(config)
        self.lr, self.weight_decay = lr, weight_decay
        self.val_metrics = _metrics("val/")
        self.test_metrics = _metrics("test/")
        # Set by KVCacheCallback around each evaluation batch (the step's engine and its prepared
        # step; its cache and plan); None: the full pass.
        self.kv_engine: RankingEngine | None = None
        self.kv_step: PreparedStep | None = None
        self.kv_cache: KVCacheModule | None = None
        self.kv_plan = None
        self._requests_seen = 0

    @property
    def config(self) -> HSTUConfig:
        return self.model.config

    def score(self, batch: RequestBatch) -> torch.Tensor:
        """Candidate logits ``[sum(C), 2]``: cached when a cache step is prepared, else full."""
        if self.kv_engine is not None and self.kv_step is not None:
            return self.kv_engine.forward(self.kv_step)  # (its full pass where the cache fell back)
        history, candidates = batch_to_kjts(batch)
        if self.kv_cache is not None and self.kv_plan is not None:
            cand = host_batch(batch).candidate_lengths
            return self.model.forward_cached(history, candidates, self.kv_cache, self.kv_plan,
                                             num_candidates=int(cand.sum()), max_candidates=int(cand.max()))
        return self.model(history, candidates)

    def _loss(self, logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        return F.binary_cross_entropy_with_logits(logits, labels)

    def training_step(self, batch: RequestBatch, batch_idx: int) -> torch.Tensor:
        logits = self.model(*batch_to_kjts(batch))
        loss = self._loss(logits, batch.labels)
        self.log("train/loss", loss, prog_bar=True, batch_size=batch.batch_size)
        return loss

    def _eval_step(self, batch: RequestBatch, metrics: MetricCollection, stage: str) -> torch.Tensor:
        logits = self.score(batch)
        loss = self._loss(logits, batch.labels)
        self.log(f"{stage}/loss", loss, batch_size=batch.batch_size, prog_bar=stage == "val")
        # NOTE: retrieval metrics group by request id and bincount them: ids must be unique within
        # the epoch and small, so they count requests seen.
        first = self._requests_seen
        self._requests_seen += batch.batch_size
        request = torch.repeat_interleave(torch.arange(first, first + batch.batch_size, device=logits.device),
                                          batch.candidate_lengths)
        liked, watched = batch.labels[:, 0].long(), batch.labels[:, 1].long()
        metrics["auc_liked"].update(logits[:, 0], liked)
        metrics["auc_watched"].update(logits[:, 1], watched)
        metrics["ndcg@10"].update(logits[:, 1], watched.bool(), indexes=request)
        metrics["hr@10"].update(logits[:, 1], watched.bool(), indexes=request)
        return loss

    def on_validation_epoch_start(self) -> None:
        self._requests_seen = 0

    def on_test_epoch_start(self) -> None:
        self._requests_seen = 0

    def validation_step(self, batch: RequestBatch, batch_idx: int) -> torch.Tensor:
        return self._eval_step(batch, self.val_metrics, "val")

    def test_step(self, batch: RequestBatch, batch_idx: int) -> torch.Tensor:
        return self._eval_step(batch, self.test_metrics, "test")

    def on_validation_epoch_end(self) -> None:
        self.log_dict(self.val_metrics.compute(), prog_bar=True)
        self.val_metrics.reset()

    def on_test_epoch_end(self) -> None:
        self.log_dict(self.test_metrics.compute())
        self.test_metrics.reset()

    def predict_step(self, batch: RequestBatch, batch_idx: int) -> dict[str, torch.Tensor]:
        logits = self.score(batch)
        return {"user_ids": batch.user_ids.cpu(), "candidate_lengths": batch.candidate_lengths.cpu(),
                "scores": torch.sigmoid(logits).cpu()}

    def configure_optimizers(self):
        return torch.optim.AdamW(self.parameters(), lr=self.lr, weight_decay=self.weight_decay)
