"""`FullStackGraphs`: full passes (no cache) of an `HSTURanker` as CUDA graphs, per shape bucket.

The recompute engine's counterpart of `CachedStackGraphs` (``RankingEngine(model, None,
cuda_graphs=True)``), so that a comparison of the two engines sets graphs against graphs: the
same packing of a step's ints on the host into one pinned copy (`PackedInputs`), the same capture
the ``capture_after``-th time a bucket is seen, at most ``max_buckets`` of them, the least recently
used given up once idle. A graph runs the embedding lookups, the layer stack (`full_stack`, whose
jagged attention a captured launch on Hopper takes on the Gluon kernel) and the head.

A bucket (`full_bucket_key`) is the users plus one padding user, each user's rows at most ``max_q``
(the longest sequence rounded up in steps of an eighth of the power of two at or above it: four
steps an octave, up to 25% more) and the rows rounded up in steps of an eighth of theirs, at most
``max_q``: a stream of growing histories takes a few buckets an octave. The padding rows (none
where the real rows fill the bucket) are the padding user's candidates with no history (each sees
only itself; its rows are dropped), padding users past it are empty and padding ids are 0 (a valid
row of every table). The kernels read every
length from the device, so a replay computes the eager pass over the same rows; the bucket's launch
(its ``max_q`` and rows) may cut the keys into other splits than the eager launch, which adds the
same products in another order.
"""

from __future__ import annotations

import dataclasses
import logging

import torch

from gr_plugin.modules.graphs import (
    _KEYS,
    Q_QUANTUM,
    GraphBuckets,
    PackedInputs,
    _pow2,
    _round_up,
    bucket_users,
    graphable,
    pack_layout,
)
from gr_plugin.modules.hstu import HSTURanker, full_stack
from gr_plugin.modules.tokens import TokenLayout

logger = logging.getLogger(__name__)


def _eighth(x: int, quantum: int) -> int:
    """``x`` rounded up to a multiple of an eighth of the power of two at or above it (at least of
    ``quantum``): a quarter of the octave's lower end, so up to 25% more just past a power of two,
    four steps an octave."""
    return _round_up(max(x, 1), max(quantum, _pow2(x) // 8))


def full_bucket_key(batch_size: int, num_tokens: int, max_q_len: int,
                    q_quantum: int = Q_QUANTUM) -> tuple[int, int, int]:
    """``(users, tokens, max_q)`` of a full pass's bucket: the users plus one padding user
    (`bucket_users`); each user's rows at most ``max_q`` (``max_q_len`` rounded up by `_eighth`, at
    least to ``q_quantum``: the attention's ``max_seq_len``); the rows up to a multiple of an eighth
    of the power of two at or above ``num_tokens`` (at least ``q_quantum``) or of ``max_q``,
    whichever is smaller, so that the padding user's rows fit in ``max_q`` (none where the real ones
    fill the bucket: the padding user is then empty, as `bucket_key`'s)."""
    if batch_size < 1 or num_tokens < batch_size or max_q_len < 1:
        raise ValueError(f"a full pass needs users with rows, got {batch_size} users, {num_tokens} rows, at "
                         f"most {max_q_len} a user")
    max_q = _eighth(max_q_len, q_quantum)
    tokens = _round_up(num_tokens, min(max(q_quantum, _pow2(num_tokens) // 8), max_q))
    return bucket_users(batch_size), tokens, max_q


@dataclasses.dataclass
class _Rows:
    """The token layout a graph's layers read (`HSTULayer.attend_jagged`): views of the bucket's ints."""

    q_offsets: torch.Tensor
    candidate_lengths: torch.Tensor
    max_q_len: int


@dataclasses.dataclass
class _FullBucket:
    users: int
    tokens: int
    max_q: int
    inputs: PackedInputs  # ids, q_offsets, candidate_lengths, cand_rows
    rows: _Rows
    last_used: int = 0
    graph: tuple[torch.cuda.CUDAGraph, torch.Tensor] | None = None  # the graph, its logits


class FullStackGraphs(GraphBuckets):
    """See the module docstring; the buckets' bookkeeping is `GraphBuckets`'."""

    def __init__(self, model: HSTURanker, max_buckets: int = 32, capture_after: int = 2, q_quantum: int = Q_QUANTUM,
                 idle_steps: int | None = None) -> None:
        super().__init__(max_buckets, capture_after, idle_steps)
        if q_quantum < 1:
            raise ValueError(f"q_quantum must be >= 1, got {q_quantum}")
        self.model, self.q_quantum = model, q_quantum

    def supported(self, device: torch.device) -> bool:
        """Whether full passes on ``device`` can be graphed (`graphable`)."""
        return graphable(self.model, self.model.config.head_dim, device)

    def _forward(self, b: _FullBucket) -> torch.Tensor:
        x = self.model.embed_ids(b.inputs.view("ids").view(_KEYS, b.tokens))
        return self.model.head_rows(full_stack(self.model.layers, x, b.rows), b.inputs.view("cand_rows"))

    def _new_bucket(self, key: tuple[int, int, int], device: torch.device) -> _FullBucket:
        users, tokens, max_q = key
        inputs = PackedInputs((("ids", _KEYS * tokens), ("q_offsets", users + 1), ("candidate_lengths", users),
                               ("cand_rows", tokens)), device)
        rows = _Rows(inputs.view("q_offsets"), inputs.view("candidate_lengths"), max_q)
        return _FullBucket(users, tokens, max_q, inputs, rows)

    def _load(self, b: _FullBucket, layout: TokenLayout) -> None:
        """Pack the pass's ints into a pinned buffer and copy it to the bucket in one non-blocking copy
        (`PackedInputs`); every tail is reset (the bucket's previous pass may have had more rows)."""
        bsz = layout.candidate_lengths.numel()
        p = b.inputs
        st = p.begin()
        pack_layout(p, layout, b.tokens)
        p.put("candidate_lengths", layout.candidate_lengths.numpy(), 0)
        st[p.fields["candidate_lengths"][0] + bsz] = b.tokens - layout.num_query_tokens  # the padding user's
        p.send()

    def _capture(self, b: _FullBucket) -> None:
        # warm-up outside the capture (the allocator, the kernels an eager pass runs); on Hopper a
        # captured attention takes the Gluon kernel instead, compiled on its first capture
        self._warm_up(b.inputs.ints.device, lambda: self._forward(b))
        b.graph = self._graph(lambda: self._forward(b))
        self.captures += 1
        logger.info("captured the full pass for bucket %s", (b.users, b.tokens, b.max_q))

    def step(self, layout: TokenLayout) -> torch.Tensor | None:
        """The full pass's candidate logits ``[sum C, num_tasks]`` (a fresh tensor) for ``layout``
        (built on the host, nothing cached), or None when it runs eagerly (`GraphBuckets`: a bucket
        not made yet, or whose capture failed). Graphs hold the addresses of the model's weights:
        moving them needs a new `FullStackGraphs`."""
        if layout.q_offsets.device.type != "cpu":
            raise ValueError(f"FullStackGraphs.step needs the layout built on the host, got one on "
                             f"{layout.q_offsets.device}")
        if not torch.equal(layout.new_lengths, layout.history_lengths):
            raise ValueError(f"FullStackGraphs.step takes a full pass's layout (no history cached), got new "
                             f"lengths {layout.new_lengths.tolist()} of histories {layout.history_lengths.tolist()}")
        device = self.model.output_norm.weight.device
        key = full_bucket_key(layout.candidate_lengths.numel(), layout.num_query_tokens, layout.max_q_len,
                              self.q_quantum)
        def replay(b: _FullBucket) -> torch.Tensor:
            g, logits = b.graph
            g.replay()
            return logits

        return self._step(key, device, lambda: self._new_bucket(key, device), lambda b: self._load(b, layout),
                          lambda b: b.graph is not None, self._capture, replay, layout.candidate_rows.numel())
