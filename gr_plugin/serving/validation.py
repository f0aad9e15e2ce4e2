"""Request validation at the serving boundary: Triton input arrays -> a checked `RequestBatch`.

Owns `RequestLimits` (what one request may carry: users, history and candidate lengths, id ranges)
and `parse_request`, which checks every input of one request (presence, dtype, shape, batch size,
user ids, lengths against the padded rows and the limits, id ranges of the real entries) and
raises ``ValueError`` naming the input, the user and the offending value. Nothing here touches the
model or the cache, so a rejected request changes no state. The wire format is in `wire`.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping

import numpy as np
import torch

from gr_plugin.data import RequestBatch
from gr_plugin.modules import HSTUConfig
from gr_plugin.serving.wire import CANDIDATE_INPUTS, HISTORY_INPUTS, INPUTS, PER_USER_INPUTS, bucket_width

INT64_MAX = (1 << 63) - 1


@dataclasses.dataclass(frozen=True)
class RequestLimits:
    """What one request may carry. ``max_users``: users per request (Triton's ``max_batch_size``);
    ``max_history_len`` / ``max_candidates``: per user; ids: items ``1..num_items``, ratings
    ``0..num_actions-1``, time buckets ``0..num_time_buckets-1``, users ``0..max_user_id``. Padded
    rows may be at most `bucket_width` of the length limit wide."""

    max_users: int
    max_history_len: int
    max_candidates: int
    num_items: int
    num_actions: int
    num_time_buckets: int
    max_user_id: int = INT64_MAX

    def __post_init__(self) -> None:
        for f in dataclasses.fields(self):
            v = getattr(self, f.name)
            if isinstance(v, bool) or not isinstance(v, int) or v < 1:
                raise ValueError(f"RequestLimits.{f.name} must be an int >= 1, got {v!r}")

    @classmethod
    def for_model(cls, model: HSTUConfig, *, max_users: int, max_history_len: int, max_candidates: int,
                  max_user_id: int | None = None) -> RequestLimits:
        return cls(max_users=max_users, max_history_len=max_history_len, max_candidates=max_candidates,
                   num_items=model.num_items, num_actions=model.num_actions,
                   num_time_buckets=model.num_time_buckets,
                   max_user_id=INT64_MAX if max_user_id is None else max_user_id)


def _array(inputs: Mapping[str, np.ndarray], name: str) -> np.ndarray:
    a = inputs[name]
    if not isinstance(a, np.ndarray):
        raise ValueError(f"input {name!r} must be a numpy array, got {type(a).__name__}")
    if a.dtype != np.int64:
        raise ValueError(f"input {name!r} must be int64, got {a.dtype}")
    if a.ndim != 2:
        raise ValueError(f"input {name!r} must have 2 dims [users, ...], got shape {tuple(a.shape)}")
    return a


def _check_lengths(name: str, lengths: np.ndarray, users: np.ndarray, width: int, row_input: str,
                   limit: int, limit_name: str) -> None:
    for check, why in ((lengths < 0, "is negative"), (lengths == 0, "is 0 (at least 1 is required)"),
                       (lengths > width, f"exceeds the {width} entries of its {row_input!r} row"),
                       (lengths > limit, f"exceeds {limit_name}={limit}")):
        if check.any():
            b = int(np.argmax(check))
            raise ValueError(f"{name} {int(lengths[b])} of user {int(users[b])} {why}")


def _check_range(name: str, values: np.ndarray, owner: np.ndarray, lo: int, hi: int) -> None:
    bad = (values < lo) | (values > hi)
    if bad.any():
        i = int(np.argmax(bad))
        raise ValueError(f"{name}: value {int(values[i])} of user {int(owner[i])} is outside [{lo}, {hi}]")


def parse_request(inputs: Mapping[str, np.ndarray], limits: RequestLimits) -> RequestBatch:
    """One request's input arrays (see `wire`) -> a `RequestBatch` on the CPU, or ``ValueError``.

    The batch has zero timestamps, visit indices and labels (the model reads none of them).
    """
    missing = [n for n in INPUTS if n not in inputs]
    if missing:
        raise ValueError(f"missing input(s) {missing}; a request needs {list(INPUTS)}")
    unknown = sorted(set(inputs) - set(INPUTS))
    if unknown:
        raise ValueError(f"unknown input(s) {unknown}; a request takes {list(INPUTS)}")
    a = {n: _array(inputs, n) for n in INPUTS}
    num_users = a["user_id"].shape[0]
    if num_users == 0:
        raise ValueError("empty request: 'user_id' has no rows")
    if num_users > limits.max_users:
        raise ValueError(f"request of {num_users} users exceeds max_batch_size={limits.max_users}")
    for n in PER_USER_INPUTS:
        if a[n].shape != (num_users, 1):
            raise ValueError(f"input {n!r} must have shape [{num_users}, 1] (one row per user), got {a[n].shape}")
    for n in (*HISTORY_INPUTS, *CANDIDATE_INPUTS):
        if a[n].shape[0] != num_users:
            raise ValueError(f"input {n!r} has {a[n].shape[0]} rows but 'user_id' has {num_users} (one per user)")
    width = a["history_items"].shape[1]
    for n in HISTORY_INPUTS[1:]:
        if a[n].shape[1] != width:
            raise ValueError(f"input {n!r} rows are {a[n].shape[1]} wide but 'history_items' rows are {width}")
    max_hist_w, max_cand_w = bucket_width(limits.max_history_len), bucket_width(limits.max_candidates)
    if width > max_hist_w:
        raise ValueError(f"history rows are {width} wide; at most {max_hist_w} (max_history_len="
                         f"{limits.max_history_len}, padded)")
    cand_width = a["candidate_items"].shape[1]
    if cand_width > max_cand_w:
        raise ValueError(f"candidate rows are {cand_width} wide; at most {max_cand_w} (max_candidates="
                         f"{limits.max_candidates}, padded)")

    users = a["user_id"][:, 0]
    bad = (users < 0) | (users > limits.max_user_id)
    if bad.any():
        raise ValueError(f"user_id {int(users[np.argmax(bad)])} is outside [0, {limits.max_user_id}]")
    uniq, counts = np.unique(users, return_counts=True)
    if (counts > 1).any():
        raise ValueError(f"user {int(uniq[np.argmax(counts > 1)])} appears more than once in one request")
    hist, cand = a["history_length"][:, 0], a["candidate_length"][:, 0]
    _check_lengths("history_length", hist, users, width, "history_items", limits.max_history_len,
                   "max_history_len")
    _check_lengths("candidate_length", cand, users, cand_width, "candidate_items", limits.max_candidates,
                   "max_candidates")

    hist_mask = np.arange(width)[None, :] < hist[:, None]
    cand_mask = np.arange(cand_width)[None, :] < cand[:, None]
    hist_owner, cand_owner = np.repeat(users, hist), np.repeat(users, cand)
    values = {n: a[n][hist_mask] for n in HISTORY_INPUTS}
    candidates = a["candidate_items"][cand_mask]
    _check_range("history_items", values["history_items"], hist_owner, 1, limits.num_items)
    _check_range("history_ratings", values["history_ratings"], hist_owner, 0, limits.num_actions - 1)
    _check_range("history_time_buckets", values["history_time_buckets"], hist_owner, 0,
                 limits.num_time_buckets - 1)
    _check_range("candidate_items", candidates, cand_owner, 1, limits.num_items)

    total_hist, total_cand = int(hist.sum()), int(cand.sum())
    return RequestBatch(
        user_ids=torch.from_numpy(users.copy()),
        history_lengths=torch.from_numpy(hist.copy()),
        history_items=torch.from_numpy(values["history_items"]),
        history_ratings=torch.from_numpy(values["history_ratings"]),
        history_timestamps=torch.zeros(total_hist, dtype=torch.int64),
        history_time_buckets=torch.from_numpy(values["history_time_buckets"]),
        candidate_lengths=torch.from_numpy(cand.copy()),
        candidate_items=torch.from_numpy(candidates),
        labels=torch.zeros(total_cand, 2, dtype=torch.float32),
        visit_index=torch.zeros(num_users, dtype=torch.int64),
    )
