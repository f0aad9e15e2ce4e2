"""Token layout of a ranking step: which history events and candidates are computed, and where.

Owns the mapping from the request's jagged inputs (history and candidate `KeyedJaggedTensor`s) to
the jagged *query* sequence the layers run on: per user ``b``, its uncached history events
(positions ``cached[b] .. L[b]-1``) followed by its candidates. A full pass is the case
``cached = 0``. Also owns the cache identity of a history event (`cache_token_keys`).
Models wrap `build_token_layout` for ``torch.fx`` (it needs host ints), so they stay traceable.
"""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Sequence

import numpy as np
import torch
from torchrec.sparse.jagged_tensor import KeyedJaggedTensor

from gr_plugin.csrc.core import build as core_build
from gr_plugin.ops.jagged import complete_cumsum

HISTORY_KEYS = ("item", "action", "time")
CANDIDATE_KEYS = ("item",)
EMBEDDING_KEYS = ("item", "action", "time", "position")

_ITEM_BITS, _ACTION_BITS, _TIME_BITS = 39, 8, 16
_HOST_NUMPY = True  # CPU layouts through `_host_layout` (tests switch it off to check the torch path there)


def validate_values(history: KeyedJaggedTensor, candidates: KeyedJaggedTensor, *, num_items: int,
                    num_actions: int, num_time_buckets: int) -> None:
    """Value checks of a request, on the host (they read values: call them before moving the
    request to a device). Every user needs >= 1 history event and >= 1 candidate; ids must be
    inside the embedding tables (an id past a table would read another row or fault)."""
    check_inputs(history, candidates)
    # NOTE: KJT-level values/lengths (the history keys share one length per user, key-major values):
    # per-key KJT access costs more host time than the checks.
    bsz = history.stride()
    per_key = history.lengths().view(len(HISTORY_KEYS), bsz)
    if bsz and not bool((per_key == per_key[0]).all()):
        raise ValueError(f"history keys {list(HISTORY_KEYS)} must have the same length per user, got "
                         f"{per_key.tolist()}")
    validate_ids(per_key[0], history.values().view(len(HISTORY_KEYS), -1), candidates.lengths(),
                 candidates.values(), num_items=num_items, num_actions=num_actions,
                 num_time_buckets=num_time_buckets)


def validate_ids(history_lengths: torch.Tensor, history_columns: Sequence[torch.Tensor],
                 candidate_lengths: torch.Tensor, candidate_items: torch.Tensor, *, num_items: int,
                 num_actions: int, num_time_buckets: int) -> None:
    """The checks of `validate_values` on a request's columns: per-user lengths ``[B]``, the
    history's item, action and time columns (``[3, N]`` or three ``[N]``) and the candidates'
    items. Raises ValueError naming the first bad value. Where the C++ core is loaded, in one pass
    there (``torch.ops.gr_kv_core.validate_columns``; the numpy form here is its reference)."""
    cols = tuple(history_columns)
    if len(cols) == 3 and _native_ready((history_lengths, *cols, candidate_lengths, candidate_items)):
        torch.ops.gr_kv_core.validate_columns(history_lengths, *cols, candidate_lengths, candidate_items, num_items,
                                              num_actions, num_time_buckets)
        return
    _numpy_validate(history_lengths, cols, candidate_lengths, candidate_items, num_items, num_actions,
                    num_time_buckets)


def _numpy_validate(history_lengths, history_columns, candidate_lengths, candidate_items, num_items, num_actions,
                    num_time_buckets) -> None:
    for name, size in (("num_items", num_items), ("num_actions", num_actions), ("num_time_buckets", num_time_buckets)):
        if size < 0:  # (the C++ op refuses them too: its `num - 1` would overflow for INT64_MIN)
            raise ValueError(f"{name} must be >= 0, got {size}")
    for name, lengths in (("history", history_lengths), ("candidates", candidate_lengths)):
        if lengths.numel() and _id_range(lengths)[0] <= 0:
            b = int((lengths <= 0).nonzero()[0])
            raise ValueError(
                f"user at batch index {b} has {int(lengths[b])} {name} events; at least 1 is required")
    items, actions, times = history_columns
    num_events = _checked_sum(history_lengths.cpu().numpy(), "history")
    num_candidates = _checked_sum(candidate_lengths.cpu().numpy(), "candidate")
    for key, values, want in (("item", items, num_events), ("action", actions, num_events),
                              ("time", times, num_events), ("candidate item", candidate_items, num_candidates)):
        if values.numel() != want:
            raise ValueError(f"{key} column has {values.numel()} entries but the lengths sum to {want}")
    for key, values, lo, hi in (("item", items, 1, num_items),
                                ("action", actions, 0, num_actions - 1),
                                ("time", times, 0, num_time_buckets - 1),
                                ("candidate item", candidate_items, 1, num_items)):
        if values.numel():
            vmin, vmax = _id_range(values)
            if vmin < lo or vmax > hi:
                raise ValueError(f"{key} id {vmin if vmin < lo else vmax} is outside the table range [{lo}, {hi}]")


def _checked_sum(lengths: np.ndarray, what: str) -> int:
    """The sum of non-negative lengths, or ValueError where it passes int64 (numpy's sum would wrap,
    and a wrapped sum could match a column's size)."""
    total = sum(lengths.tolist())
    if total > np.iinfo(np.int64).max:
        raise ValueError(f"{what} lengths sum past 2**63 - 1")
    return total


def _id_range(t: torch.Tensor) -> tuple[int, int]:
    """``(min, max)`` of a non-empty 1-D integer tensor; through numpy on the CPU (about a third
    of `torch.aminmax`'s host time at 32K values), `torch.aminmax` elsewhere."""
    if t.device.type == "cpu" and not t.requires_grad:
        a = t.numpy()
        return int(a.min()), int(a.max())
    lo, hi = torch.aminmax(t)
    return int(lo), int(hi)


@dataclasses.dataclass
class TokenLayout:
    """Where each query token comes from. ``[B]``/``[B+1]`` per user, ``[Nq]`` per query token.

    - ``token_ids [4 * Nq]``: each query token's ``item, action, time, position`` ids, key-major
      (the values of ``features``);
    - ``features``: the same as a KJT (keys ``item, action, time, position``, lengths ``q_lengths``),
      built on first use: a step whose tables are read by direct lookups or replayed from a CUDA
      graph never needs it;
    - ``q_offsets [B+1]``, ``max_q_len``: the jagged query sequence (new history, then candidates);
    - ``new_lengths``/``candidate_lengths``/``history_lengths [B]``;
    - ``candidate_rows [sum C]``: rows of the candidates, in the candidates' input order;
    - ``new_rows [N]``: rows of the new history events, in batch order.
    """

    token_ids: torch.Tensor
    q_offsets: torch.Tensor
    max_q_len: int
    num_query_tokens: int
    history_lengths: torch.Tensor
    new_lengths: torch.Tensor
    candidate_lengths: torch.Tensor
    candidate_rows: torch.Tensor
    new_rows: torch.Tensor

    @functools.cached_property
    def features(self) -> KeyedJaggedTensor:
        q_len = self.q_offsets[1:] - self.q_offsets[:-1]
        return _features(self.token_ids, q_len.repeat(len(EMBEDDING_KEYS)), self.num_query_tokens)

    def to(self, device: torch.device | str) -> TokenLayout:
        """This layout on ``device``: every index tensor in one pinned host buffer and one
        non-blocking copy (no device sync, one transfer instead of eight). A no-op on the same device."""
        device = torch.device(device)
        src = self.token_ids
        if src.device == device or (device.type == src.device.type and device.index is None):
            return self
        parts = [src, self.q_offsets, self.history_lengths, self.new_lengths, self.candidate_lengths,
                 self.candidate_rows, self.new_rows]
        sizes = [t.numel() for t in parts]
        buf = torch.empty(sum(sizes), dtype=torch.int64, pin_memory=device.type == "cuda")
        torch.cat([t.to(torch.int64) for t in parts], out=buf)
        (ids, q_off, hist, new, cand, cand_rows, new_rows) = buf.to(device, non_blocking=True).split(sizes)
        return dataclasses.replace(self, token_ids=ids, q_offsets=q_off, history_lengths=hist, new_lengths=new,
                                   candidate_lengths=cand, candidate_rows=cand_rows, new_rows=new_rows)


def _features(values: torch.Tensor, lengths: torch.Tensor, n: int) -> KeyedJaggedTensor:
    """The query tokens' KJT; each key has ``n`` values, given as host ints so torchrec never syncs."""
    k = len(EMBEDDING_KEYS)
    return KeyedJaggedTensor(keys=list(EMBEDDING_KEYS), values=values, lengths=lengths,
                             stride=lengths.numel() // k, length_per_key=[n] * k,
                             offset_per_key=[i * n for i in range(k + 1)])


def check_inputs(history: KeyedJaggedTensor, candidates: KeyedJaggedTensor) -> None:
    """Keys and per-key lengths of the two KJTs (host-side checks only)."""
    if tuple(history.keys()) != HISTORY_KEYS:
        raise ValueError(f"history KJT must have keys {list(HISTORY_KEYS)}, got {history.keys()}")
    if tuple(candidates.keys()) != CANDIDATE_KEYS:
        raise ValueError(f"candidates KJT must have keys {list(CANDIDATE_KEYS)}, got {candidates.keys()}")
    if history.stride() != candidates.stride():
        raise ValueError(f"history has {history.stride()} users but candidates have {candidates.stride()}")


def build_token_layout(
    history: KeyedJaggedTensor,
    candidates: KeyedJaggedTensor,
    cached_lengths: torch.Tensor | None,
    max_positions: int,
    num_query_tokens: int | None = None,
    max_q_len: int | None = None,
    num_candidates: int | None = None,
) -> TokenLayout:
    """Query layout for ``history`` (keys item/action/time) and ``candidates`` (key item).

    ``cached_lengths [B]`` events of each history are already cached (None: a full pass).
    ``num_query_tokens``, ``max_q_len`` (an upper bound is fine) and ``num_candidates`` (host ints)
    avoid device syncs when the caller knows them.
    Positions are absolute (clamped to ``max_positions - 1``); a candidate sits at position
    ``L[b]``, with action and time 0.
    """
    # NOTE: KJT-level values()/lengths() (no to_dict, no length_per_key): no device sync, and the
    # same on every torchrec version. The history keys share one length per user. Per-user terms
    # are combined on [B] before one gather to [Nq] each: the op count is what costs on the host.
    bsz = history.stride()
    hist_len = history.lengths()[:bsz].to(torch.int64)
    hist_vals = history.values().view(len(HISTORY_KEYS), -1).to(torch.int64)
    cand_len = candidates.lengths().to(torch.int64)
    device = hist_len.device
    cached = torch.zeros_like(hist_len) if cached_lengths is None else cached_lengths.to(torch.int64)
    on_host = device.type == cached.device.type == candidates.values().device.type == "cpu"
    if _HOST_NUMPY and on_host:
        return host_token_layout(hist_len, hist_vals, cand_len, candidates.values().to(torch.int64), cached,
                                 max_positions, max_q_len)
    new_len = hist_len - cached
    q_len = new_len + cand_len
    q_off = complete_cumsum(q_len)
    if num_query_tokens is None:
        num_query_tokens = int(q_off[-1])
    n = num_query_tokens
    h_off = complete_cumsum(hist_len)
    c_off = complete_cumsum(cand_len)
    q_start = q_off[:-1]
    batch = torch.repeat_interleave(torch.arange(bsz, device=device), q_len, output_size=n)
    local = torch.arange(n, device=device) - q_start[batch]
    is_hist = local < new_len[batch]
    # per user: where its new events start in the history values, its candidates in theirs (offset
    # by the new events that come first in its query segment), and its candidates' position
    per_user = torch.stack([h_off[:-1] + cached, c_off[:-1] - new_len, cached,
                            hist_len.clamp(max=max_positions - 1)])[:, batch]
    hist_src = torch.where(is_hist, per_user[0] + local, 0)
    values = torch.empty(len(EMBEDDING_KEYS), n, dtype=torch.int64, device=device)
    if hist_vals.numel():
        torch.index_select(hist_vals, 1, hist_src, out=values[:3])
        values[1:3] *= is_hist  # candidates: action and time 0
    else:
        values[:3].zero_()
    cand_items = candidates.values().to(torch.int64)
    if cand_items.numel():
        cand_src = torch.where(is_hist, 0, per_user[1] + local)
        torch.where(is_hist, values[0], cand_items[cand_src], out=values[0])
    torch.where(is_hist, (per_user[2] + local).clamp_(max=max_positions - 1), per_user[3], out=values[3])
    if num_candidates is None:  # host sync (boolean masks); fine on the CPU and in training
        rows = torch.arange(n, device=device)
        candidate_rows, new_rows = rows[~is_hist], rows[is_hist]
    else:
        ar = torch.arange(bsz, device=device)
        num_new = n - num_candidates
        bn = torch.repeat_interleave(ar, new_len, output_size=num_new)
        new_rows = (q_start - complete_cumsum(new_len)[:-1])[bn] + torch.arange(num_new, device=device)
        bc = torch.repeat_interleave(ar, cand_len, output_size=num_candidates)
        candidate_rows = (q_start + new_len - c_off[:-1])[bc] + torch.arange(num_candidates, device=device)
    return TokenLayout(
        token_ids=values.view(-1),
        q_offsets=q_off,
        max_q_len=int(q_len.max()) if max_q_len is None else max_q_len,
        num_query_tokens=n,
        history_lengths=hist_len,
        new_lengths=new_len,
        candidate_lengths=cand_len,
        candidate_rows=candidate_rows,
        new_rows=new_rows,
    )


def _native_ready(tensors) -> bool:
    """Whether the C++ step-input ops (`validate_ids`, `host_token_layout`, `cache_token_keys`) can
    take these tensors: the core is loaded in this process (the cache loads it) and each is a
    contiguous 1-D int64 CPU tensor."""
    # NOTE: `is_cpu` and `ndim`, not `device.type` and `dim()`: this runs on ~15 tensors per step, and
    # a device object built per tensor cost about as much as the rest of the check.
    return core_build.loaded() and all(t.dtype is torch.int64 and t.ndim == 1 and t.is_cpu and t.is_contiguous()
                                       for t in tensors)


def host_token_layout(history_lengths: torch.Tensor, history_columns: Sequence[torch.Tensor],
                      candidate_lengths: torch.Tensor, candidate_items: torch.Tensor,
                      cached_lengths: torch.Tensor | None, max_positions: int,
                      max_q_len: int | None = None, *, native: bool = True) -> TokenLayout:
    """`build_token_layout` from a request's CPU columns: int64 lengths ``[B]``, the history's
    item, action and time columns (``[3, N]`` or three ``[N]``, their sizes the lengths' sum; only
    the uncached events are read) and the candidates' items. No concatenated history (the serving
    step builds its layout here). Where the C++ core is loaded (``native``, the default) one pass
    in C++ (``torch.ops.gr_kv_core.token_layout``, ``gr_plugin/csrc/core/step_inputs.cpp``),
    else numpy, ~30 ops of a few microseconds each; the numpy form is the reference the tests hold
    the C++ one to. Bad lengths or column sizes raise ValueError naming the value."""
    cols = tuple(history_columns)
    if len(cols) != 3:
        raise ValueError(f"history_columns must be the item, action and time columns, got {len(cols)}")
    opt = () if cached_lengths is None else (cached_lengths,)
    if native and _native_ready((history_lengths, *cols, candidate_lengths, candidate_items, *opt)):
        ids, q_off, nl, cand_rows, new_rows = torch.ops.gr_kv_core.token_layout(
            history_lengths, *cols, candidate_lengths, candidate_items, cached_lengths, max_positions)
        return TokenLayout(
            token_ids=ids, q_offsets=q_off,
            max_q_len=(int((nl + candidate_lengths).max()) if nl.numel() else 0) if max_q_len is None else max_q_len,
            num_query_tokens=cand_rows.numel() + new_rows.numel(), history_lengths=history_lengths,
            new_lengths=nl, candidate_lengths=candidate_lengths, candidate_rows=cand_rows, new_rows=new_rows)
    return _numpy_layout(history_lengths, cols, candidate_lengths, candidate_items, cached_lengths, max_positions,
                         max_q_len)


def _numpy_layout(history_lengths, history_columns, candidate_lengths, candidate_items, cached_lengths,
                  max_positions, max_q_len) -> TokenLayout:
    if max_positions < 1:
        raise ValueError(f"max_positions must be at least 1, got {max_positions}")
    hl, cl = history_lengths.numpy(), candidate_lengths.numpy()
    if cl.shape != hl.shape:
        raise ValueError(f"candidate_lengths has {cl.size} entries for {hl.size} users")
    ca = np.zeros_like(hl) if cached_lengths is None else cached_lengths.numpy()
    if ca.shape != hl.shape:
        raise ValueError(f"cached_lengths has {ca.size} entries for {hl.size} users")
    for name, lengths in (("history_lengths", hl), ("candidate_lengths", cl)):
        if (lengths < 0).any():
            b = int(np.nonzero(lengths < 0)[0][0])
            raise ValueError(f"{name}[{b}] = {int(lengths[b])} is negative")
    if (ca < 0).any() or (ca > hl).any():
        b = int(np.nonzero((ca < 0) | (ca > hl))[0][0])
        raise ValueError(f"cached_lengths[{b}] = {int(ca[b])} is outside [0, {int(hl[b])}] (the history length)")
    num_events, num_candidates = _checked_sum(hl, "history"), _checked_sum(cl, "candidate")
    for name, column, want, what in (("item", history_columns[0], num_events, "history"),
                                     ("action", history_columns[1], num_events, "history"),
                                     ("time", history_columns[2], num_events, "history"),
                                     ("candidate item", candidate_items, num_candidates, "candidate")):
        if column.numel() != want:
            raise ValueError(f"{name} column has {column.numel()} entries but the {what} lengths sum to {want}")
    nl = hl - ca
    ql = nl + cl
    bsz = hl.shape[0]
    q_off, h_off, c_off, n_off = (np.zeros(bsz + 1, dtype=np.int64) for _ in range(4))
    np.cumsum(ql, out=q_off[1:])
    np.cumsum(hl, out=h_off[1:])
    np.cumsum(cl, out=c_off[1:])
    np.cumsum(nl, out=n_off[1:])
    n, num_new = int(q_off[-1]), int(n_off[-1])
    users = np.arange(bsz)
    bn = np.repeat(users, nl)  # user of each new event
    new_local = np.arange(num_new) - n_off[:-1][bn]  # its index among its user's new events
    new_rows = q_off[:-1][bn] + new_local
    bc = np.repeat(users, cl)
    cand_rows = q_off[:-1][bc] + nl[bc] + np.arange(cl.sum()) - c_off[:-1][bc]
    values = np.zeros((len(EMBEDDING_KEYS), n), dtype=np.int64)
    src = h_off[:-1][bn] + ca[bn] + new_local
    for i, column in enumerate(history_columns):
        values[i, new_rows] = column.numpy()[src]
    values[3, new_rows] = np.minimum(ca[bn] + new_local, max_positions - 1)
    values[0, cand_rows] = candidate_items.numpy()
    values[3, cand_rows] = np.minimum(hl[bc], max_positions - 1)
    t = torch.from_numpy
    return TokenLayout(
        token_ids=t(values).view(-1),
        q_offsets=t(q_off),
        max_q_len=(int(ql.max()) if ql.size else 0) if max_q_len is None else max_q_len,
        num_query_tokens=n,
        history_lengths=history_lengths,
        new_lengths=t(nl),
        candidate_lengths=candidate_lengths,
        candidate_rows=t(cand_rows),
        new_rows=t(new_rows),
    )


def keys_fit(num_items: int, num_actions: int, num_time_buckets: int) -> bool:
    """Whether every id that passes `validate_values` for these table sizes packs losslessly."""
    return num_items < 1 << _ITEM_BITS and num_actions <= 1 << _ACTION_BITS and num_time_buckets <= 1 << _TIME_BITS


def cache_token_keys(items: torch.Tensor, actions: torch.Tensor, time_buckets: torch.Tensor, *,
                     check: bool = True, native: bool = True) -> torch.Tensor:
    """One int64 identity per history event: ``item << 24 | action << 16 | time_bucket``.

    Lossless within the checked ranges (item < 2**39, action < 2**8, time bucket < 2**16), so two
    histories share a cache key sequence only if every embedded feature agrees. CPU tensors.
    ``check=False`` skips the range checks: only for ids already validated against tables for
    which `keys_fit` holds. Where the C++ core is loaded, in one pass there
    (``torch.ops.gr_kv_core.cache_keys``; the numpy form here, ``native=False``, is its reference).
    """
    if native and _native_ready((items, actions, time_buckets)):
        return torch.ops.gr_kv_core.cache_keys(items, actions, time_buckets, check)
    for name, t in (("action", actions), ("time bucket", time_buckets)):
        if t.numel() != items.numel():
            raise ValueError(f"{name} column has {t.numel()} entries, the item column {items.numel()}")
    for name, t, bits in (("item", items, _ITEM_BITS), ("action", actions, _ACTION_BITS),
                          ("time bucket", time_buckets, _TIME_BITS)):
        if check and t.numel():
            tmin, tmax = _id_range(t)
            if tmin < 0 or tmax >= 1 << bits:
                raise ValueError(f"{name} id {tmin if tmin < 0 else tmax} is outside [0, 2**{bits}) "
                                 "and cannot be part of a cache key")
    if all(t.device.type == "cpu" and not t.requires_grad for t in (items, actions, time_buckets)):
        # NOTE: numpy, in place: two buffers and three passes instead of five torch ops
        keys = np.left_shift(items.numpy(), 24, dtype=np.int64)
        shifted = np.left_shift(actions.numpy(), 16, dtype=np.int64)
        keys |= shifted
        keys |= time_buckets.numpy()
        return torch.from_numpy(keys)
    return (items.to(torch.int64) << 24) | (actions.to(torch.int64) << 16) | time_buckets.to(torch.int64)
