"""A synthetic request stream and an `HSTURankingModule` sized for it (the Lightning tests')."""

import torch

from gr_plugin.data import RecDataModule
from gr_plugin.lightning import HSTURankingModule
from gr_plugin.modules import HSTUConfig


def ranking_setup(seed: int = 0, *, num_users: int = 12, min_len: int = 20, max_len: int = 60, num_items: int = 40,
                  num_candidates: int = 6, max_next: int = 2, max_visit_len: int = 6, visits: int = 3,
                  max_positions: int = 128, embedding_dim: int = 16, head_dim: int = 8, n_norm: float = 64.0):
    """``(datamodule, module)``: synthetic users (4 a batch, ``visits`` val and test visits each) and a
    2-layer, 2-head model over their items (defaults: the CPU tests' tiny sizes)."""
    dm = RecDataModule("synthetic", source_kwargs=dict(num_users=num_users, min_len=min_len, max_len=max_len,
                                                        num_items=num_items),
                       batch_size=4, num_candidates=num_candidates, max_next=max_next, max_visit_len=max_visit_len,
                       num_val_visits=visits, num_test_visits=visits, seed=seed)
    torch.manual_seed(seed)
    module = HSTURankingModule(HSTUConfig(num_items=num_items, num_time_buckets=dm.num_time_buckets,
                                          max_positions=max_positions, embedding_dim=embedding_dim, num_layers=2,
                                          num_heads=2, head_dim=head_dim, n_norm=n_norm))
    return dm, module
