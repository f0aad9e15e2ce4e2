"""Tiny serving fixtures: a tiny checkpoint, its oracle, synthetic visits, replica overrides."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import torch

from gr_plugin.apps.common import load_module
from gr_plugin.data import RecDataModule, RequestBatch
from gr_plugin.inference import RankingEngine
from gr_plugin.lightning import HSTURankingModule
from gr_plugin.modules import HSTUConfig
from gr_plugin.serving import RequestLimits

NUM_ITEMS = 60
TINY = HSTUConfig(num_items=NUM_ITEMS, num_time_buckets=32, max_positions=256, embedding_dim=16, num_layers=2,
                  num_heads=2, head_dim=8, n_norm=64.0)
MAX_BATCH = 8
MODEL_OVERRIDES = ["model=hstu_tiny", f"model.num_items={NUM_ITEMS}", "model.max_positions=256", "device=cpu",
                   f"triton.max_batch_size={MAX_BATCH}", "limits.max_history_len=200", "limits.max_candidates=32"]


def save_tiny_checkpoint(path: Path, seed: int = 0) -> Path:
    torch.manual_seed(seed)
    module = HSTURankingModule(TINY)
    with torch.no_grad():  # make the weights matter (torchrec initialises tables small)
        for p in module.parameters():
            if p.dim() > 1:
                p.normal_(0, 0.3)
    torch.save({"hyper_parameters": dict(module.hparams), "state_dict": module.state_dict()}, path)
    return path


def oracle(ckpt: Path) -> RankingEngine:
    """Full recomputation with the checkpoint's weights (what every served score must equal)."""
    return RankingEngine(load_module(ckpt, TINY).model.eval(), None)


def tiny_limits() -> RequestLimits:
    return RequestLimits.for_model(TINY, max_users=MAX_BATCH, max_history_len=200, max_candidates=32)


def visits(num_users: int = 12, seed: int = 0) -> list[RequestBatch]:
    """One single-user request per visit (several per user, users interleaved), synthetic data."""
    dm = RecDataModule("synthetic", source_kwargs=dict(num_users=num_users, min_len=20, max_len=120,
                                                        num_items=NUM_ITEMS), batch_size=1, num_candidates=8,
                       max_next=2, max_visit_len=12, num_val_visits=2, num_test_visits=2, seed=seed,
                       interleave_users=4)
    dm.setup("predict")
    return list(dm.predict_dataloader())


def max_abs_diff(a: np.ndarray, b: torch.Tensor | np.ndarray) -> float:
    b = b.detach().cpu().numpy() if isinstance(b, torch.Tensor) else b
    assert a.shape == b.shape, (a.shape, b.shape)
    return float(np.abs(a.astype(np.float64) - b.astype(np.float64)).max())
