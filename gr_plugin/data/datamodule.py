"""`RecDataModule`: an `InteractionLog` as Lightning train/val/test/predict dataloaders of `RequestBatch`.

Owns the per-user time split and the loaders. Each user's visits (`split_visits`) are split by
time: the last ``num_test_visits`` go to test, the ``num_val_visits`` before them to val, and the
events before the first held-out visit are the user's training prefix. Training samples one random
cut per user per epoch in that prefix (history = events before the cut, positives = the next
``max_next`` events); val/test/predict replay held-out visits in `replay_order`, several per user,
so a KV cache gets hits. It does not own a model or the cache.
"""

from __future__ import annotations

import functools
import logging
from collections.abc import Iterator, Mapping
from typing import Any

import lightning
import torch
from torch.utils.data import DataLoader, Dataset, Sampler

from gr_plugin.data._util import check_counts, check_int, mix_seed
from gr_plugin.data.batch import RequestBatch
from gr_plugin.data.features import DEFAULT_NUM_TIME_BUCKETS
from gr_plugin.data.log import InteractionLog
from gr_plugin.data.movielens import load_movielens_1m
from gr_plugin.data.requests import (
    Request,
    build_requests,
    collate_requests,
    group_requests,
    make_request,
    replay_order,
)
from gr_plugin.data.synthetic import synthetic_log
from gr_plugin.data.visits import DEFAULT_SESSION_GAP_S, Visits, split_visits

logger = logging.getLogger(__name__)

SOURCES = ("ml-1m", "synthetic")
SYNTHETIC_DEFAULTS: dict[str, int] = {"num_users": 256, "min_len": 256, "max_len": 4096, "num_items": 50_000}


def _select_visits(visits: Visits, keep: torch.Tensor) -> Visits:
    """The visits where ``keep [V]`` is true, same users."""
    user_of_visit = torch.repeat_interleave(torch.arange(visits.num_users), visits.counts)
    counts = torch.bincount(user_of_visit[keep], minlength=visits.num_users)
    offsets = torch.zeros(visits.num_users + 1, dtype=torch.int64)
    torch.cumsum(counts, 0, out=offsets[1:])
    return Visits(offsets=offsets, starts=visits.starts[keep], ends=visits.ends[keep])


class _RequestGroups(Dataset):
    """Ordered groups of requests, collated on access (so eval histories are not all held at once)."""

    def __init__(self, groups: list[list[Request]], log: InteractionLog, num_time_buckets: int) -> None:
        self.groups, self.log, self.num_time_buckets = groups, log, num_time_buckets

    def __len__(self) -> int:
        return len(self.groups)

    def __getitem__(self, i: int) -> RequestBatch:
        return collate_requests(self.groups[i], self.log, num_time_buckets=self.num_time_buckets)


def _identity(batch: RequestBatch) -> RequestBatch:
    return batch


class _EpochShuffle(Sampler):
    """Seeded permutation of ``0..n-1`` per epoch; yields ``(index, epoch)`` keys."""

    def __init__(self, n: int, seed: int) -> None:
        self.n, self.seed, self.epoch = n, seed, 0

    def set_epoch(self, epoch: int) -> None:
        self.epoch = epoch

    def __len__(self) -> int:
        return self.n

    def __iter__(self) -> Iterator[tuple[int, int]]:
        g = torch.Generator().manual_seed(mix_seed(self.seed, self.epoch))
        return iter([(i, self.epoch) for i in torch.randperm(self.n, generator=g).tolist()])


class _TrainCuts(Dataset):
    """One random cut in each training user's prefix; key ``(position, epoch)`` -> `Request`."""

    def __init__(
        self, log: InteractionLog, rows: list[int], max_cuts: list[int], train_ends: list[int], **kw: Any
    ):
        self.log, self.rows, self.max_cuts, self.train_ends, self.kw = log, rows, max_cuts, train_ends, kw

    def __len__(self) -> int:
        return len(self.rows)

    def __getitem__(self, key: tuple[int, int]) -> Request:
        pos, epoch = key
        u, seed = self.rows[pos], self.kw["seed"]
        g = torch.Generator().manual_seed(mix_seed(seed, epoch, int(self.log.user_ids[u])))
        cut = int(torch.randint(self.kw["min_history"], self.max_cuts[pos] + 1, (1,), generator=g))
        return make_request(
            self.log,
            u,
            cut,
            min(cut + self.kw["max_next"], self.train_ends[pos]),
            visit_index=0,
            num_candidates=self.kw["num_candidates"],
            max_next=self.kw["max_next"],
            seed=mix_seed(seed, epoch),
        )


class RecDataModule(lightning.LightningDataModule):
    """Request batches for ranking, from an `InteractionLog` or a named source.

    ``source``: an `InteractionLog`, ``"ml-1m"`` (`load_movielens_1m`, ``source_kwargs`` passed on)
    or ``"synthetic"`` (`synthetic_log` with `SYNTHETIC_DEFAULTS` and ``seed`` updated by
    ``source_kwargs``). Visits: ``session_gap_s`` sessions cut into chunks of ``max_visit_len``
    events, or with ``stride`` set (which then replaces both) every ``stride`` events; see
    `split_visits`. ``max_users`` keeps the log's first rows;
    ``max_history_len`` drops held-out requests with longer histories and caps training cuts.
    ``interleave_users`` (default ``4 * batch_size``) users are replayed round-robin; keep it at
    least ``batch_size``, since a batch never holds a user twice. Train batches have ``visit_index``
    0; predict replays val and test visits together.
    """

    def __init__(
        self,
        source: InteractionLog | str = "ml-1m",
        *,
        source_kwargs: Mapping[str, Any] | None = None,
        batch_size: int = 32,
        num_candidates: int = 64,
        max_next: int = 8,
        session_gap_s: float | None = DEFAULT_SESSION_GAP_S,
        max_visit_len: int | None = 32,
        stride: int | None = None,
        min_history: int = 1,
        num_val_visits: int = 2,
        num_test_visits: int = 2,
        interleave_users: int | None = None,
        max_users: int | None = None,
        max_history_len: int | None = None,
        num_time_buckets: int = DEFAULT_NUM_TIME_BUCKETS,
        seed: int = 0,
        num_workers: int = 0,
        pin_memory: bool = False,
    ) -> None:
        super().__init__()
        if isinstance(source, str) and source not in SOURCES:
            raise ValueError(f"source must be an InteractionLog or one of {SOURCES}, got {source!r}")
        if not isinstance(source, (str, InteractionLog)):
            raise ValueError(
                f"source must be an InteractionLog or one of {SOURCES}, got {type(source).__name__}"
            )
        check_counts(num_candidates, max_next)
        for name, value, lo in (
            ("batch_size", batch_size, 1),
            ("min_history", min_history, 1),
            ("num_val_visits", num_val_visits, 0),
            ("num_test_visits", num_test_visits, 0),
            ("num_time_buckets", num_time_buckets, 2),
            ("num_workers", num_workers, 0),
        ):
            check_int(name, value, min_value=lo)
        check_int("interleave_users", interleave_users, min_value=1, allow_none=True)
        check_int("max_users", max_users, min_value=1, allow_none=True)
        check_int("max_history_len", max_history_len, min_value=1, allow_none=True)
        self.save_hyperparameters(ignore=["source"] if isinstance(source, InteractionLog) else None)
        self.source = source
        self.source_kwargs = dict(source_kwargs or {})
        self.batch_size = batch_size
        self.num_candidates = num_candidates
        self.max_next = max_next
        self.visit_kwargs = {
            "session_gap_s": session_gap_s,
            "max_visit_len": None if stride is not None else max_visit_len,
            "stride": stride,
            "min_history": min_history,
        }
        self.min_history = min_history
        self.num_val_visits = num_val_visits
        self.num_test_visits = num_test_visits
        self.interleave_users: int = interleave_users or 4 * batch_size
        if self.interleave_users < batch_size:
            logger.warning("interleave_users=%d < batch_size=%d: a batch never holds a user twice, so replayed "
                           "batches hold at most %d requests", self.interleave_users, batch_size,
                           self.interleave_users)
        self.max_users = max_users
        self.max_history_len = max_history_len
        self.num_time_buckets = num_time_buckets
        self.seed = seed
        self.num_workers = num_workers
        self.pin_memory = pin_memory
        self._log: InteractionLog | None = None
        self._splits: dict[str, Any] | None = None
        self._eval_groups: dict[str, list[list[Request]]] = {}

    # -- data -------------------------------------------------------------------------------------

    def _load(self) -> InteractionLog:
        if isinstance(self.source, InteractionLog):
            return self.source
        if self.source == "ml-1m":
            return load_movielens_1m(**self.source_kwargs)
        return synthetic_log(**{**SYNTHETIC_DEFAULTS, "seed": self.seed, **self.source_kwargs})

    @property
    def log(self) -> InteractionLog:
        """The log in use (after ``max_users``); loaded on first access."""
        if self._log is None:
            log = self._load()
            if self.max_users is not None and self.max_users < log.num_users:
                log = log.subset(torch.arange(self.max_users))
            self._log = log
        return self._log

    @property
    def num_items(self) -> int:
        """Item vocabulary size, excluding the padding id 0 (embedding tables need ``num_items + 1``)."""
        return self.log.num_items

    @property
    def max_history_len_seen(self) -> int:
        """The longest history any batch of any of this module's loaders can carry."""
        return self._get_splits()["max_history_len_seen"]

    def _get_splits(self) -> dict[str, Any]:
        if self._splits is None:
            self._splits = self._split(self.log)
        return self._splits

    def _split(self, log: InteractionLog) -> dict[str, Any]:
        visits = split_visits(log, **self.visit_kwargs)
        user_of_visit = torch.repeat_interleave(torch.arange(log.num_users), visits.counts)
        from_end = (
            visits.counts[user_of_visit]
            - 1
            - (torch.arange(visits.num_visits) - visits.offsets[user_of_visit])
        )
        is_test = from_end < self.num_test_visits
        is_val = ~is_test & (from_end < self.num_test_visits + self.num_val_visits)
        held_out = is_test | is_val
        # A user's training prefix ends where its first held-out visit starts.
        train_ends = log.lengths.clone()
        train_ends.scatter_reduce_(0, user_of_visit[held_out], visits.starts[held_out], reduce="amin")
        max_cuts = train_ends - 1
        if self.max_history_len is not None:
            max_cuts.clamp_(max=self.max_history_len)
        train_rows = torch.nonzero(max_cuts >= self.min_history).flatten()
        held_starts = visits.starts[held_out]
        if self.max_history_len is not None:
            held_starts = held_starts[held_starts <= self.max_history_len]
        seen = [int(max_cuts[train_rows].max()) if train_rows.numel() else 0]
        seen.append(int(held_starts.max()) if held_starts.numel() else 0)
        splits = {
            "train_rows": train_rows.tolist(),
            "max_cuts": max_cuts[train_rows].tolist(),
            "train_ends": train_ends[train_rows].tolist(),
            "val": _select_visits(visits, is_val),
            "test": _select_visits(visits, is_test),
            "predict": _select_visits(visits, held_out),
            "max_history_len_seen": max(seen),
        }
        logger.info(
            "split %d users: %d train users, %d val / %d test visits, longest history %d",
            log.num_users,
            len(splits["train_rows"]),
            int(is_val.sum()),
            int(is_test.sum()),
            splits["max_history_len_seen"],
        )
        return splits

    # -- Lightning hooks --------------------------------------------------------------------------

    def prepare_data(self) -> None:
        if self.source == "ml-1m":
            load_movielens_1m(**self.source_kwargs)  # NOTE: parses once and fills the on-disk cache

    def setup(self, stage: str | None = None) -> None:
        self._get_splits()

    def train_dataloader(self) -> DataLoader:
        splits = self._get_splits()
        dataset = _TrainCuts(
            self.log,
            splits["train_rows"],
            splits["max_cuts"],
            splits["train_ends"],
            seed=self.seed,
            min_history=self.min_history,
            max_next=self.max_next,
            num_candidates=self.num_candidates,
        )
        return DataLoader(
            dataset,
            batch_size=self.batch_size,
            sampler=_EpochShuffle(len(dataset), self.seed),
            collate_fn=functools.partial(
                collate_requests, log=self.log, num_time_buckets=self.num_time_buckets
            ),
            num_workers=self.num_workers,
            pin_memory=self.pin_memory,
        )

    def _eval_dataloader(self, stage: str) -> DataLoader:
        if stage not in self._eval_groups:
            requests = build_requests(
                self.log,
                self._get_splits()[stage],
                num_candidates=self.num_candidates,
                max_next=self.max_next,
                seed=self.seed,
                max_history_len=self.max_history_len,
            )
            ordered = replay_order(requests, interleave_users=self.interleave_users, seed=self.seed)
            self._eval_groups[stage] = group_requests(ordered, self.batch_size)
        return DataLoader(
            _RequestGroups(self._eval_groups[stage], self.log, self.num_time_buckets),
            batch_size=None,
            shuffle=False,
            collate_fn=_identity,
            num_workers=self.num_workers,
            pin_memory=self.pin_memory,
        )

    def val_dataloader(self) -> DataLoader:
        return self._eval_dataloader("val")

    def test_dataloader(self) -> DataLoader:
        return self._eval_dataloader("test")

    def predict_dataloader(self) -> DataLoader:
        return self._eval_dataloader("predict")
