"""`CachedStackGraphs`: whole cached ranking steps of an `HSTURanker` as CUDA graphs, per shape bucket.

Owns the static buffers and the graphs of the cached step: embedding lookups, the layer stack
(append + paged attention per layer) and the head. A bucket is the step's padded shape (users,
query tokens, new tokens, one user's query tokens: `bucket_key`) and the attention launch (tiles
and key splits) that a bound on its histories gives (`history_bound`); the first batch of a bucket that
is seen often enough is captured, later ones replay. A step's inputs (ids, token layout, page
metadata, append slots) are packed on the host, from the host layout and the plan's
``host_metadata``, into one pinned buffer in the bucket's fixed order and reach the device in one
copy, so a replayed step costs the host one copy and one graph launch. A step whose plan onboards
pages from a lower tier replays the bucket's layer segments instead (one graph from each layer's
append to the next layer's projection; embeddings in the first, the head in the last), with each
layer's onboard wait between its projection and its append, as in the eager step. Inputs that
vary inside a bucket (history lengths, pages) are read by the kernels from device tensors, so
replays compute exactly what the eager step computes.
"""

from __future__ import annotations

import collections
import dataclasses
import logging
import threading
import weakref
from collections.abc import Sequence

import numpy as np
import torch

from gr_plugin.cache import BatchPlan, cudart
from gr_plugin.csrc.core import build as core_build
from gr_plugin.modules.hstu import HSTURanker, next_layer
from gr_plugin.modules.kv_cache import KVCacheModule
from gr_plugin.modules.tokens import EMBEDDING_KEYS, TokenLayout
from gr_plugin.ops.hstu_attention import _use_triton

logger = logging.getLogger(__name__)

_TRITON_HEAD_DIMS = (16, 32, 64, 128, 256)  # the graphed layers need the Triton kernels (no host sizes)
_KEYS = len(EMBEDDING_KEYS)


def _round_up(x: int, m: int) -> int:
    return -(-x // m) * m


def _pow2(x: int) -> int:
    return 1 << max(0, (x - 1).bit_length())


# NOTE: a capture that fails with one of these leaves its bucket eager for good (`GraphBuckets`): out of
# memory, or an error raised while capturing (e.g. an op that syncs with the host, or a kernel that
# cannot load); the eager step then runs, and raises itself if the step is at fault.
CAPTURE_ERRORS = (torch.OutOfMemoryError, RuntimeError)
EXACT_USERS = 8  # buckets of fewer users (padding user included) key on the exact count
TOKEN_QUANTUM, NEW_QUANTUM, Q_QUANTUM = 256, 128, 128  # `CachedStackGraphs`' default paddings
HISTORY_QUANTUM = 1024  # the least history bound (`history_bound`)


def history_bound(max_history_len: int, capacity: int) -> int:
    """The history bound whose attention launch a bucket keys on (`CachedStackGraphs._key`): the
    step's longest history (new tokens included) up to a power of two, at least `HISTORY_QUANTUM`,
    at most the cache's ``capacity`` in tokens. The bucket's attention launch takes it as
    ``max_history_len``, from which the split rule weighs a program's work
    (`gr_plugin.ops.triton.hstu_attention._makespan`); the kernel itself reads every user's length
    from the device, so the bound picks the launch only (a bucket whose launch another bound gives
    too replays past its own bound and computes the same)."""
    return max(1, min(capacity, max(HISTORY_QUANTUM, _pow2(max_history_len))))


def bucket_users(batch_size: int) -> int:
    """A bucket's users: the real ones plus one padding user, exactly below `EXACT_USERS`, else up
    to a power of two (the rest are empty)."""
    return batch_size + 1 if batch_size + 1 < EXACT_USERS else _pow2(batch_size + 1)


def graphable(model: HSTURanker, head_dim: int, device: torch.device) -> bool:
    """Whether a stack of ``model`` on ``device`` can run from CUDA graphs: CUDA, a head size the
    Triton kernels serve and serving the attention (not the reference, e.g. with
    ``GR_PLUGIN_ATTENTION=reference``: it needs host sizes), and embedding tables read by direct
    lookups (a sharded module runs eagerly)."""
    if device.type != "cuda" or head_dim not in _TRITON_HEAD_DIMS:
        return False
    probe = torch.empty(0, 1, head_dim, dtype=model.output_norm.weight.dtype, device=device)
    return _use_triton(probe) and model.embeds_by_lookup


def _put(dst: np.ndarray, span: tuple[int, int], values: np.ndarray, fill) -> None:
    """Field ``[a, e)`` of ``dst``: ``values``, then ``fill`` to its end."""
    a, e = span
    dst[a : a + len(values)] = values
    dst[a + len(values) : e] = fill


def _put_layout(dst: np.ndarray, fields: dict[str, tuple[int, int]], token_ids: np.ndarray, q_offsets: np.ndarray,
                candidate_rows: np.ndarray, nq: int, tokens: int) -> None:
    """A graph step's layout fields in ``dst``: ``ids`` (key-major, padding rows 0), ``q_offsets`` (the
    users past the real ones end at ``tokens``: the padding user holds ``[nq, tokens)``) and
    ``cand_rows`` (padded with row 0, dropped after the head)."""
    a = fields["ids"][0]
    ids = dst[a : a + _KEYS * tokens].reshape(_KEYS, tokens)
    ids[:, :nq] = token_ids.reshape(_KEYS, nq)
    ids[:, nq:] = 0
    _put(dst, fields["q_offsets"], q_offsets, tokens)
    _put(dst, fields["cand_rows"], candidate_rows, 0)


def pack_layout(p: PackedInputs, layout: TokenLayout, tokens: int) -> None:
    """A graph step's layout fields (`_put_layout`) from its host ``layout`` in ``p``'s current buffer."""
    _put_layout(p.buffer(), p.fields, layout.token_ids.numpy(), layout.q_offsets.numpy(),
                layout.candidate_rows.numpy(), layout.num_query_tokens, tokens)


# the cached bucket's packed fields, in order (`CachedStackGraphs._new_bucket`, `pack_cached_step`), and the
# plan metadata's fields the packing reads
_CACHED_FIELDS = ("ids", "q_offsets", "rows", "slots", "kv_indptr", "total_lengths", "new_lengths", "cand_rows",
                  "kv_indices")
_META_FIELDS = ("kv_indptr", "kv_indices", "new_token_batch", "new_token_positions", "total_lengths", "new_lengths")


def _spans(spans: Sequence[int], names: Sequence[str], size: int, what: str) -> dict[str, tuple[int, int]]:
    out = {}
    for i, name in enumerate(names):
        a, e = int(spans[2 * i]), int(spans[2 * i + 1])
        if not 0 <= a <= e <= size:
            raise ValueError(f"{what} field {name} [{a}, {e}) is not inside [0, {size})")
        out[name] = (a, e)
    return out


def _first_outside(name: str, values: np.ndarray, bound: int, what: str) -> None:
    bad = (values < 0) | (values >= bound)
    if bad.any():
        j = int(np.flatnonzero(bad)[0])
        raise ValueError(f"{name}[{j}] = {values[j]} is not {what} of the table's {bound}")


def pack_cached_numpy(dst: np.ndarray, spans: Sequence[int], token_ids: np.ndarray, q_offsets: np.ndarray,
                      new_rows: np.ndarray, candidate_rows: np.ndarray, metadata: np.ndarray,
                      meta_spans: Sequence[int], page_size: int, num_pages: int, scratch_slots: np.ndarray) -> int:
    """The numpy form of ``torch.ops.gr_kv_core.pack_cached_step`` (its reference; the op's comment in
    ``csrc/core/step_inputs.cpp`` says what goes where): the cached step's ints into ``dst`` at
    ``spans`` (`_CACHED_FIELDS`' ``[start, end)`` pairs), the page metadata read from ``metadata`` at
    ``meta_spans`` (`_META_FIELDS`'), for a table of ``num_pages`` pages of ``page_size``. Returns the
    copy's length. Raises the op's ValueError, in its order, before anything is written: more values
    than a field holds, a scratch slot outside the table, a user's pages outside the batch's, a page
    id outside the table, or a new token whose page is not one of its user's."""
    for arg, got, names in (("fields", spans, _CACHED_FIELDS), ("meta_fields", meta_spans, _META_FIELDS)):
        if len(got) != 2 * len(names):
            raise ValueError(f"{arg} takes {2 * len(names)} ints, got {len(got)}")
    page_size, num_pages = int(page_size), int(num_pages)  # (Python ints: numpy's int64 would wrap below)
    if page_size < 1:
        raise ValueError(f"page_size must be >= 1, got {page_size}")
    table_slots = num_pages * page_size
    if num_pages < 0 or table_slots >= 1 << 63:
        raise ValueError(f"num_pages {num_pages} of {page_size} slots is not a table size")
    f = _spans(spans, _CACHED_FIELDS, dst.size, "dst")
    m = _spans(meta_spans, _META_FIELDS, metadata.size, "metadata")
    room = {k: e - a for k, (a, e) in f.items()}
    tokens, rem = divmod(room["ids"], _KEYS)
    if rem:
        raise ValueError(f"the ids field holds {room['ids']} ints, not {_KEYS} rows of one length")
    nq, rem = divmod(token_ids.size, _KEYS)
    if rem:
        raise ValueError(f"token_ids has {token_ids.size} entries, not {_KEYS} rows of one length")
    meta = {k: metadata[a:e] for k, (a, e) in m.items()}
    indptr, indices, batch, pos = (meta[k] for k in _META_FIELDS[:4])
    bsz, pages, n = indptr.size - 1, indices.size, batch.size
    sizes = {"ids": nq, "q_offsets": q_offsets.size, "rows": new_rows.size, "slots": n, "kv_indptr": bsz + 1,
             "total_lengths": meta["total_lengths"].size, "new_lengths": meta["new_lengths"].size,
             "cand_rows": candidate_rows.size, "kv_indices": pages}
    for name in _CACHED_FIELDS:
        have = tokens if name == "ids" else room[name]
        if sizes[name] > have:
            raise ValueError(f"{name} has {sizes[name]} {'rows' if name == 'ids' else 'entries'} but its field "
                             f"holds {have}")
    if not (bsz >= 0 and sizes["total_lengths"] == bsz and sizes["new_lengths"] == bsz and pos.size == n):
        raise ValueError(f"metadata fields disagree: kv_indptr {bsz + 1}, total_lengths {sizes['total_lengths']}, "
                         f"new_lengths {sizes['new_lengths']}, new_token_batch {n}, new_token_positions {pos.size}")
    if scratch_slots.size != room["slots"]:
        raise ValueError(f"scratch_slots has {scratch_slots.size} entries for a slots field of {room['slots']}")
    _first_outside("scratch_slots", scratch_slots, table_slots, "a slot")
    bad_user = (indptr[:-1] < 0) | (indptr[:-1] > indptr[1:]) | (indptr[1:] > pages)
    if bad_user.any():
        u = int(np.flatnonzero(bad_user)[0])
        raise ValueError(f"kv_indptr[{u}:{u + 2}] = [{indptr[u]}, {indptr[u + 1]}] is not a range inside [0, {pages}]")
    _first_outside("kv_indices", indices, num_pages, "a page")
    bad_row = (batch < 0) | (batch >= bsz)
    row = np.where(bad_row, 0, batch)
    first, count = (indptr[row], indptr[row + 1] - indptr[row]) if bsz else (batch, batch)
    page = pos // page_size
    bad = bad_row | (pos < 0) | (page >= count)
    if bad.any():
        i = int(np.flatnonzero(bad)[0])
        if bad_row[i]:
            raise ValueError(f"new token {i} belongs to batch row {batch[i]} of {bsz}")
        raise ValueError(f"new token {i} at position {pos[i]} lies past user {batch[i]}'s {count[i]} pages of "
                         f"{page_size}")
    slots = indices[first + page] * page_size + (pos - page * page_size)
    _put_layout(dst, f, token_ids, q_offsets, candidate_rows, nq, tokens)
    _put(dst, f["rows"], new_rows, 0)
    _put(dst, f["slots"], slots, scratch_slots[n:])
    _put(dst, f["kv_indptr"], indptr, pages)
    _put(dst, f["total_lengths"], meta["total_lengths"], 0)
    _put(dst, f["new_lengths"], meta["new_lengths"], 0)
    a = f["kv_indices"][0]
    dst[a : a + pages] = indices  # only the batch's pages are read (kv_indptr says where they end)
    return a + pages


def bucket_key(batch_size: int, num_query_tokens: int, num_new_tokens: int, max_q_len: int,
               token_quantum: int = TOKEN_QUANTUM, new_quantum: int = NEW_QUANTUM,
               q_quantum: int = Q_QUANTUM) -> tuple[int, int, int, int]:
    """``(users, tokens, new, max_q)`` of a step's bucket: the users plus one padding user (exactly
    below `EXACT_USERS`, else up to a power of two: the rest are empty), the query rows rounded up
    (the padding user holds the padding rows, none where the real ones fill the bucket), the new rows
    rounded up, and each user's query
    rows at most (``max_q_len``, an upper bound is fine, rounded up; at least ``token_quantum``,
    which bounds the padding user's rows), the attention's ``max_q_len``.

    NOTE: the attention's key splits follow the users and rows that can hold a query tile
    (`gr_plugin.ops.triton.hstu_attention._query_tiles`): with empty padding users counted (a
    power of two of users) or every row as one user's (``max_q_len`` = all rows), a bs-4 bucket took
    1 split where 2 fill the SMs (H200: 0.084 vs 0.054 ms a layer, docs/BENCHMARKS.md). Until
    2026-12-01 a bucket always had a padding row, so a step of 384 * bs rows (the e2e stream's) at an
    even bs took 256 more (at an odd bs 384 * bs rounds up past itself either way); without them the
    bs-8 stream ran 6% faster (`scripts/gpu/probe_bucket_padding.py`)."""
    tokens = _round_up(max(num_query_tokens, 1), token_quantum)
    users = bucket_users(batch_size)
    max_q = min(tokens, max(_round_up(max_q_len, q_quantum), token_quantum))
    return users, tokens, _round_up(max(num_new_tokens, 1), new_quantum), max_q


# the events and host buffers of dropped `PackedInputs` whose raw copies may still be queued, oldest first
_RETIRED: collections.deque = collections.deque()


def _retire(events: list, buffers: list) -> None:
    """Keep a dropped `PackedInputs`' host buffers until its copies have run (`_prune_retired`)."""
    _RETIRED.append((events, buffers))


_RETIRED_LOCK = threading.Lock()  # engines on other threads prune too: check and pop the same head


def _prune_retired() -> None:
    """Let go of the retired host buffers, oldest first, whose copies have run (their events done)."""
    if not _RETIRED:
        return
    with _RETIRED_LOCK:
        while _RETIRED and all(e.query() for e in _RETIRED[0][0]):
            _RETIRED.popleft()


class PackedInputs:
    """A graphed step's int inputs: named fields packed in one device buffer (``ints``), which two
    pinned host buffers fill in turn, one non-blocking copy a step. `begin` hands out the next host
    buffer once its previous copy has run (a copy two steps ago may still read it); `put` writes a
    field and resets its tail (a bucket's previous step may have had more users or rows); `send`
    copies it."""

    def __init__(self, sizes: Sequence[tuple[str, int]], device: torch.device) -> None:
        self.fields: dict[str, tuple[int, int]] = {}  # name -> [start, end) in ``ints``
        at = 0
        for name, size in sizes:
            self.fields[name] = (at, at + size)
            at += size
        cuda = device.type == "cuda"  # (off CUDA, e.g. in CPU tests: plain buffers, no events)
        self.ints = torch.zeros(at, dtype=torch.int64, device=device)
        self._staging = [torch.zeros(at, dtype=torch.int64, pin_memory=cuda) for _ in range(2)]
        self._staging_np = [t.numpy() for t in self._staging]
        # recorded after each buffer's last copy
        self._staged = [torch.cuda.Event(), torch.cuda.Event()] if cuda else None
        self._turn = 0
        # NOTE: the copy goes through the runtime's cudaMemcpyAsync where it can (`cudart`; on the H200
        # host 5.2 µs against 14.2 for `Tensor.copy_` at bs 1, docs/BENCHMARKS.md). Unlike `copy_`, it
        # does not tell torch's pinned-memory allocator that the block is in use, so a host buffer freed
        # with its copy still queued could be handed out again and rewritten before the GPU reads it
        # (a dropped bucket's last replay, or a whole engine dropped, would then compute from it). The
        # buffers are therefore retired, not freed, when this object goes (`_retire`): held until
        # both events say their copies have run. The device buffer needs no such care: it is freed to
        # the caching allocator on the stream that queued the copy, whose later work runs after it.
        self._raw = cudart.runtime() if cuda else None
        if self._raw is not None:
            weakref.finalize(self, _retire, self._staged, self._staging)

    def view(self, name: str) -> torch.Tensor:
        a, b = self.fields[name]
        return self.ints[a:b]

    def begin(self) -> np.ndarray:
        """The host buffer this step fills (numpy), its previous copy done."""
        if self._staged is not None:
            self._staged[self._turn].synchronize()
        return self._staging_np[self._turn]

    def buffer(self) -> np.ndarray:
        """The current host buffer (numpy), as `begin` handed it out."""
        return self._staging_np[self._turn]

    def staging(self) -> torch.Tensor:
        """The current host buffer as a tensor (the same memory as `buffer`)."""
        return self._staging[self._turn]

    def put(self, name: str, values: np.ndarray, fill) -> None:
        """Field ``name`` of the current host buffer: ``values``, then ``fill`` to its end."""
        _put(self._staging_np[self._turn], self.fields[name], values, fill)

    def send(self, end: int | None = None) -> None:
        """Copy the current host buffer's first ``end`` ints (default: all) to ``ints``, non-blocking."""
        i = self._turn
        n = self.ints.numel() if end is None else end
        if self._raw is not None:
            _prune_retired()
            stream = torch.cuda.current_stream(self.ints.device)
            self._raw.memcpy_async(self.ints.data_ptr(), self._staging[i].data_ptr(), 8 * n, cudart.H2D, stream)
            self._staged[i].record(stream)
        else:
            self.ints[:n].copy_(self._staging[i][:n], non_blocking=True)
            if self._staged is not None:
                self._staged[i].record()
        self._turn ^= 1


@dataclasses.dataclass
class _Bucket:
    users: int  # batch rows of the graph (the real users, then padding users)
    tokens: int  # query rows of the graph
    new: int  # new-token rows of the graph
    max_q: int  # query rows of any one user, at most (the attention's grid; the padding user's too)
    hist: int  # the attention's max_history_len: a bound (`history_bound`) whose launch the bucket keys on
    inputs: PackedInputs  # every int input of the step (kv_indices last)
    spans: list[int]  # [start, end) of each of `_CACHED_FIELDS` in ``inputs``, flat (`pack_cached_step`)
    scratch_slots: torch.Tensor  # [new] int64 CPU: where padding new rows write (a reserved page)
    x: torch.Tensor
    ys: list[torch.Tensor]  # the residual stream: layer i reads ys[i], writes ys[i + 1]
    normed: list[torch.Tensor]  # normed[i]: layer i's input norm of ys[i] (i > 0), written by layer i - 1
    last_used: int = 0  # the engine's step count when it last ran
    whole: tuple[torch.cuda.CUDAGraph, torch.Tensor] | None = None  # one graph, its logits
    # layers + 1 segments (layer i's pages awaited before segment i + 1), logits
    layered: tuple[list[torch.cuda.CUDAGraph], torch.Tensor] | None = None

    def view(self, name: str) -> torch.Tensor:
        return self.inputs.view(name)


class GraphBuckets:
    """The buckets of captured graphs a step engine keeps (`CachedStackGraphs`, `FullStackGraphs`),
    least recently used first: a key's bucket is made the ``capture_after``-th time the key is seen
    (a capture costs far more than an eager step), at most ``max_buckets`` of them; when they are
    all taken, the least recently used one is dropped for a new one once idle ``idle_steps`` steps
    (default ``4 * max_buckets``), else the new shape runs eagerly; a key whose capture failed stays
    eager."""

    def __init__(self, max_buckets: int, capture_after: int, idle_steps: int | None) -> None:
        if max_buckets < 1 or capture_after < 1:
            raise ValueError(f"max_buckets and capture_after must be >= 1, got {max_buckets} and {capture_after}")
        self.max_buckets, self.capture_after = max_buckets, capture_after
        # NOTE: a full set of buckets gives up its least recently used one only when that has been
        # idle this many steps, so a round of more shapes than max_buckets runs some steps eagerly
        # instead of capturing on every step (a capture costs far more than an eager step).
        self.idle_steps = 4 * max_buckets if idle_steps is None else idle_steps
        self._buckets: collections.OrderedDict = collections.OrderedDict()  # key -> bucket, LRU first
        self._steps = 0
        self._seen: dict[tuple[int, ...], int] = {}
        self._failed: set[tuple[int, ...]] = set()  # buckets whose capture failed: eager from then on
        self._pool = None  # the graphs' one memory pool (`_graph`)
        self.captures = 0
        self.replays = 0
        self.evictions = 0

    def _admit(self, key: tuple) -> bool:
        """Count a step of a key with no bucket; whether to make its bucket now (seen often enough,
        room made)."""
        if len(self._seen) > 16 * self.max_buckets:  # many one-off shapes: forget the uncaptured
            self._seen = {k: n for k, n in self._seen.items() if k in self._buckets}
        self._seen[key] = self._seen.get(key, 0) + 1
        return self._seen[key] >= self.capture_after and self._make_room()

    def _use(self, key: tuple):
        """The bucket of ``key``, marked most recently used at this step."""
        self._buckets.move_to_end(key)
        b = self._buckets[key]
        b.last_used = self._steps
        return b

    def _warm_up(self, device: torch.device, fn) -> None:
        """Run ``fn`` once on a side stream, outside any capture (the allocator, the kernels' first
        launches), ordered after and before the current stream's work."""
        side = torch.cuda.Stream(device=device)
        side.wait_stream(torch.cuda.current_stream(device))
        with torch.cuda.stream(side), torch.no_grad():
            fn()
        torch.cuda.current_stream(device).wait_stream(side)

    def _graph(self, fn) -> tuple[torch.cuda.CUDAGraph, object]:
        """``fn`` captured into a CUDA graph in the one memory pool every graph of this object shares
        (they replay one after another on one stream): ``(graph, fn's result)``."""
        g = torch.cuda.CUDAGraph()
        with torch.no_grad(), torch.cuda.graph(g, pool=self._pool):
            out = fn()
        if self._pool is None:
            self._pool = g.pool()
        return g, out

    def _step(self, key: tuple, device: torch.device, make, load, ready, capture, replay, rows: int):
        """The skeleton of a graphed step, shared by both engines: count the step; a key whose capture
        failed, or with no bucket yet that `_admit` does not make (or ``make()`` gives None for),
        returns None (the caller runs eagerly); else the bucket (``make()`` if new) is marked used,
        ``load(b)`` packs its inputs, ``capture(b)`` runs where ``ready(b)`` says its graph is missing
        (a capture error leaves the key eager for good), and ``replay(b)`` gives the logits, of which
        a fresh copy of the first ``rows`` is returned."""
        self._steps += 1
        if key in self._failed:
            return None
        with torch.cuda.device(device):
            if key not in self._buckets:
                if not self._admit(key):
                    return None
                b = make()
                if b is None:
                    return None
                self._buckets[key] = b
            b = self._use(key)
            load(b)
            if not ready(b):
                try:
                    capture(b)
                except CAPTURE_ERRORS as exc:
                    # NOTE: a cached step's warm-up wrote this plan's own K/V (the eager step rewrites the same)
                    self._capture_failed(key, exc)
                    return None
            logits = replay(b)
            self.replays += 1
            return logits[:rows].clone()

    def clear(self) -> None:
        """Drop every captured bucket, its graphs and static buffers (their memory goes back to the
        caching allocator once queued replays have run, as `_make_room` says) and the counts of shapes
        seen, e.g. when a Lightning fit trains between validations; later steps capture again. Keys
        whose capture failed stay eager; `CachedStackGraphs` keeps its scratch page."""
        if self._buckets:
            logger.info("dropping %d captured buckets", len(self._buckets))
        self._buckets.clear()
        self._seen.clear()
        self._pool = None

    def _capture_failed(self, key: tuple, exc: BaseException) -> None:
        logger.warning("capturing bucket %s failed (%s): it runs eagerly from now on", key, exc)
        del self._buckets[key]
        self._failed.add(key)

    def _make_room(self) -> bool:
        """Whether a new bucket may be captured: below ``max_buckets``, or after dropping the least
        recently used one, if it has been idle ``idle_steps`` steps. Its graphs may still be
        running: CUDA frees an executable graph when its launches finish, and the pool's memory
        it held is taken only by later captures, whose replays queue behind it on this stream."""
        if len(self._buckets) < self.max_buckets:
            return True
        key, lru = next(iter(self._buckets.items()))
        if self._steps - lru.last_used <= self.idle_steps:
            return False
        del self._buckets[key]
        self._seen.pop(key, None)
        self.evictions += 1
        logger.info("dropped bucket %s (idle %d steps) for a new shape", key, self._steps - lru.last_used)
        return True


class CachedStackGraphs(GraphBuckets):
    """See the module docstring; the buckets' bookkeeping is `GraphBuckets`'. Shapes are padded up
    to buckets (`bucket_key`: users plus one padding user, exactly or up to a power of two; query
    rows to a multiple of ``token_quantum``, new rows to a multiple of ``new_quantum``, one user's
    query rows to a multiple of ``q_quantum``; and the attention launch of the longest history up to
    a power of two, `history_bound`: bounds that give the same launch share a bucket): padding query
    rows belong to a padding user with no history (they only see themselves, and are dropped),
    padding new rows write their K/V into a reserved scratch page, padding ids are 0 (a valid row
    of every table) and padding head rows are dropped."""

    def __init__(self, model: HSTURanker, cache: KVCacheModule, max_buckets: int = 32, capture_after: int = 2,
                 token_quantum: int = TOKEN_QUANTUM, new_quantum: int = NEW_QUANTUM,
                 q_quantum: int = Q_QUANTUM, idle_steps: int | None = None) -> None:
        super().__init__(max_buckets, capture_after, idle_steps)
        self.model, self.cache = model, cache
        self.token_quantum, self.new_quantum = token_quantum, new_quantum
        self.q_quantum = q_quantum
        cfg = cache.config
        self._max_history = cfg.num_pages * cfg.page_size
        self._launches: dict[tuple[int, ...], tuple] = {}  # (bucket shape, history bound) -> attention launch
        self._scratch: int | None = None
        self._table = None  # the KV table the graphs were captured on (they hold its address)
        self.layered_replays = 0

    def supported(self, device: torch.device) -> bool:
        """Whether steps on ``device`` can be graphed: CUDA, the Triton kernels serving attention
        (not the reference, e.g. with ``GR_PLUGIN_ATTENTION=reference``: it needs host sizes) and
        the append, and embedding tables read by direct lookups (a sharded module runs eagerly)."""
        if not graphable(self.model, self.cache.config.head_dim, device):
            return False
        try:
            import gr_plugin.ops.triton.append_kv  # noqa: F401
        except ImportError:
            return False
        return True

    # ------------------------------------------------------------------ what a graph runs
    def _embed(self, b: _Bucket) -> None:
        b.x.copy_(self.model.embed_ids(b.view("ids").view(_KEYS, b.tokens)))

    def _layer(self, b: _Bucket, i: int) -> None:
        self._attend(b, i, self._project(b, i))

    def _project(self, b: _Bucket, i: int) -> tuple[torch.Tensor, ...]:
        """Layer ``i``'s ``u, q, k, v`` before their SiLU, which the append's pass and the norm's take
        (`HSTULayer.attend_pages`): what it computes before it touches its pages."""
        return self.model.layers[i].project(b.ys[i], b.normed[i] if i else None, activate=False)

    def _attend(self, b: _Bucket, i: int, projected: tuple[torch.Tensor, ...]) -> None:
        """Layer ``i`` from its projection on: append its new K/V, attend over its pages, finish."""
        layer = self.model.layers[i]
        a = layer.attend_pages(projected, self.cache.kv_table[i], b.view("slots"), b.view("rows"), b.view("kv_indices"),
                               b.view("kv_indptr"), b.view("total_lengths"), b.view("q_offsets"), b.view("new_lengths"),
                               max_q_len=b.max_q, max_history_len=b.hist, num_history_tokens=0, activated=False)
        nxt = next_layer(self.model.layers, i)
        layer.finish_gated_and_norm(b.ys[i], a, nxt, out=b.ys[i + 1],
                                    normed_out=None if nxt is None else b.normed[i + 1])

    def _head(self, b: _Bucket) -> torch.Tensor:
        return self.model.head_rows(b.ys[-1], b.view("cand_rows"))

    # ------------------------------------------------------------------ inputs
    def _load(self, b: _Bucket, layout: TokenLayout, plan: BatchPlan) -> None:
        """Pack the step's ints into a pinned staging buffer (host) and copy it to the bucket in one
        non-blocking copy. Every tail is reset: a bucket's previous step may have had more users or
        tokens, and a stale slot would make a padding row overwrite a real page. Where the C++ core is
        loaded, in one pass there (``torch.ops.gr_kv_core.pack_cached_step``); `pack_cached_numpy` is
        its reference."""
        p = b.inputs
        p.begin()
        meta = plan.metadata
        spans = [x for name in _META_FIELDS for x in meta.field_offsets[name]]
        ids = layout.token_ids.reshape(-1)
        pages = self.cache.config.num_pages  # (every slot written lies in the table: `pack_cached_step`)
        if core_build.loaded():  # (the op checks its tensors itself: int64, 1-D, contiguous, on the host)
            end = torch.ops.gr_kv_core.pack_cached_step(p.staging(), b.spans, ids, layout.q_offsets, layout.new_rows,
                                                        layout.candidate_rows, plan.host_metadata, spans,
                                                        meta.page_size, pages, b.scratch_slots)
        else:
            end = pack_cached_numpy(p.buffer(), b.spans, ids.numpy(), layout.q_offsets.numpy(),
                                    layout.new_rows.numpy(), layout.candidate_rows.numpy(),
                                    plan.host_metadata.numpy(), spans, meta.page_size, pages,
                                    b.scratch_slots.numpy())
        p.send(end)

    def _new_bucket(self, key: tuple, hist: int, device: torch.device) -> _Bucket:
        users, tokens, new, max_q = key[:4]
        page = self.cache.config.page_size
        sizes = (("ids", _KEYS * tokens), ("q_offsets", users + 1), ("rows", new), ("slots", new),
                 ("kv_indptr", users + 1), ("total_lengths", users), ("new_lengths", users), ("cand_rows", tokens),
                 ("kv_indices", self.cache.config.num_pages))
        inputs = PackedInputs(sizes, device)
        d = self.model.config.embedding_dim
        x = torch.zeros(tokens, d, dtype=self.model.output_norm.weight.dtype, device=device)
        b = _Bucket(users=users, tokens=tokens, new=new, max_q=max_q, hist=hist,
                    inputs=inputs,
                    spans=[x for name in _CACHED_FIELDS for x in inputs.fields[name]],
                    scratch_slots=self._scratch * page + torch.arange(new, dtype=torch.int64) % page,
                    x=x, ys=[x] + [torch.empty_like(x) for _ in self.model.layers],
                    normed=[torch.empty_like(x) for _ in self.model.layers])
        return b

    # ------------------------------------------------------------------ capture and replay
    def _capture(self, b: _Bucket, plan: BatchPlan, layered: bool) -> None:
        layers = len(self.model.layers)

        def warm_up() -> None:
            # NOTE: warm-up writes this plan's own K/V into its own pages: the same values a replay writes.
            self._embed(b)
            for i in range(layers):
                projected = self._project(b, i)
                self.cache.manager.wait_layer(plan, i)
                self._attend(b, i, projected)
            self._head(b)

        self._warm_up(b.x.device, warm_up)
        if layered:
            # NOTE: segment i ends with layer i's projection and segment i + 1 starts with its
            # append, so a replay waits for layer i's pages between the two, as the eager step
            # does (`KVCacheModule.forward`): the projection runs while the pages are copied.
            # A projection crosses one graph boundary: it is held until the next segment is
            # captured, then dropped, so the pool may reuse its memory in later segments (they
            # replay after the one that reads it, on the same stream), not kept per layer.
            def segment(i: int, projected):
                if i == 0:
                    self._embed(b)
                else:
                    self._attend(b, i - 1, projected)
                return self._project(b, i) if i < layers else self._head(b)

            graphs, projected = [], None
            for i in range(layers + 1):
                g, out = self._graph(lambda i=i, projected=projected: segment(i, projected))
                graphs.append(g)
                projected = out if i < layers else None
            b.layered = (graphs, out)
        else:
            def whole() -> torch.Tensor:
                self._embed(b)
                for i in range(layers):
                    self._layer(b, i)
                return self._head(b)

            b.whole = self._graph(whole)
        self.captures += 1
        logger.info("captured the cached step for bucket %s (%s)", (b.users, b.tokens, b.new, b.max_q, b.hist),
                    "in layer segments" if layered else "whole")

    def _key(self, batch_size: int, num_query_tokens: int, num_new_tokens: int, max_q_len: int,
             max_total_len: int, table: torch.Tensor) -> tuple[tuple, int]:
        """``(key, history bound)`` of a step: its `bucket_key` and the attention launch its history
        bound gives (`hstu_attention.paged_launch`, remembered per shape and bound), so bounds that
        launch alike share one bucket. A new bucket's launch passes this bound; later steps replay
        the bucket with the bound it was made with (the same launch)."""
        shape = bucket_key(batch_size, num_query_tokens, num_new_tokens, max_q_len, self.token_quantum,
                           self.new_quantum, self.q_quantum)
        hist = history_bound(max_total_len, self._max_history)
        launch = self._launches.get((*shape, hist))
        if launch is None:
            from gr_plugin.ops.triton import hstu_attention as tri

            cfg = self.cache.config
            launch = tri.paged_launch(shape[1], shape[0], cfg.num_heads, shape[3], hist, cfg.head_dim, table.dtype,
                                      table.device, page_size=cfg.page_size)
            if len(self._launches) > 64 * self.max_buckets:
                self._launches.clear()
            self._launches[(*shape, hist)] = launch
        return (*shape, launch), hist

    def step(self, layout: TokenLayout, plan: BatchPlan) -> torch.Tensor | None:
        """The step's candidate logits ``[sum C, num_tasks]`` (a fresh tensor), or None when it
        runs eagerly (`GraphBuckets`: a bucket not made yet, or whose capture failed; or no
        scratch page yet). ``layout`` must be the one built on the host for ``plan``
        (`RankingEngine.prepare` keeps it there). Graphs hold the addresses of the cache's table
        and the model's weights: a moved cache drops them (they are captured again); after the
        model's weights move, `clear` them."""
        meta = plan.metadata
        if layout.q_offsets.device.type != "cpu":
            raise ValueError(f"CachedStackGraphs.step needs the layout built on the host, got one on "
                             f"{layout.q_offsets.device}")
        table = self.cache.kv_table
        if self._table is not table:
            if self._table is not None:
                logger.info("the cache's KV table moved: dropping %d captured buckets", len(self._buckets))
            self._buckets.clear()
            self._launches.clear()  # (a table on another device may launch otherwise)
            self._table = table
        key, hist = self._key(meta.batch_size, layout.num_query_tokens, meta.num_new_tokens, layout.max_q_len,
                              meta.max_total_len, table)
        layered = any(plan.onboard_tokens)  # pages coming up from the host tier: wait per layer

        def make() -> _Bucket | None:
            if self._scratch is None:
                # NOTE: one page for good, taken when the first bucket is made (so an engine that
                # never captures keeps every page); while every page is in use, eager.
                try:
                    self._scratch = self.cache.manager.reserve_scratch_pages(1)[0]
                except ValueError as exc:
                    logger.info("no page for the graphs' scratch page yet (%s): eager step", exc)
                    return None
            return self._new_bucket(key, hist, table.device)

        def replay(b: _Bucket) -> torch.Tensor:
            if not layered:
                g, logits = b.whole
                g.replay()
                return logits
            graphs, logits = b.layered
            graphs[0].replay()
            for i, g in enumerate(graphs[1:]):
                self.cache.manager.wait_layer(plan, i)
                g.replay()
            self.layered_replays += 1
            return logits

        return self._step(key, table.device, make, lambda b: self._load(b, layout, plan),
                          lambda b: (b.layered if layered else b.whole) is not None,
                          lambda b: self._capture(b, plan, layered), replay, layout.candidate_rows.numel())
