"""`CachedRankerProgram`: the whole cached ranking step as one exportable module, and its inputs.

Owns the graph the exporter sees for a cached step: the embedding lookups (plain ``F.embedding`` on the
model's torchrec tables, shared weights), the HSTU layer stack with its gr_kv ops (`CachedLayerStack`),
and the head over the candidates. Its inputs are tensors a C++ runner can build from a request and the
cache's cached lengths (docs/EXPORT.md, "Package inputs"); `program_inputs` builds them in Python. The
device KV table is an input that the program mutates (so a package writes the caller's cache). It does
not own the cache policy (lookup / allocate / commit: `KVCacheManager`) nor the token layout
(`gr_plugin.modules.tokens.build_token_layout`), which stay outside.
"""

from __future__ import annotations

import dataclasses
from array import array

import torch
import torch.nn.functional as F
from torch import nn
from torchrec.sparse.jagged_tensor import KeyedJaggedTensor

from gr_plugin.cache import BatchPlan
from gr_plugin.cache.metadata import PagedBatchMetadata, build_metadata
from gr_plugin.export.stack import CachedLayerStack
from gr_plugin.modules.hstu import HSTURanker
from gr_plugin.modules.tokens import EMBEDDING_KEYS, build_token_layout

INPUT_NAMES = ("token_ids", "q_offsets", "new_rows", "slots", "kv_indices", "kv_indptr", "history_lengths",
               "new_lengths", "candidate_rows", "kv_table")


class CachedRankerProgram(nn.Module):
    """One cached step: query tokens' ids -> candidate logits ``[sum(C), num_tasks]``; writes the new
    history events' K/V into ``kv_table``. Shares every parameter with ``model``."""

    def __init__(self, model: HSTURanker) -> None:
        super().__init__()
        tables = model.embeddings.embeddings
        # NOTE: torchrec's EmbeddingCollection (sequence embeddings, no pooling) is a row lookup per
        # feature, so F.embedding on its weights is the same computation, and exportable.
        self.tables = nn.ParameterList(tables[key].weight for key in EMBEDDING_KEYS)
        self.stack = CachedLayerStack(model)
        self.output_norm, self.head = model.output_norm, model.head

    def forward(self, token_ids: torch.Tensor, q_offsets: torch.Tensor, new_rows: torch.Tensor, slots: torch.Tensor,
                kv_indices: torch.Tensor, kv_indptr: torch.Tensor, history_lengths: torch.Tensor,
                new_lengths: torch.Tensor, candidate_rows: torch.Tensor, kv_table: torch.Tensor) -> torch.Tensor:
        """``token_ids [4, Nq]``: rows item, action, time bucket, position of each query token."""
        x = F.embedding(token_ids[0], self.tables[0])
        for i in range(1, len(EMBEDDING_KEYS)):
            x = x + F.embedding(token_ids[i], self.tables[i])
        x = x.to(self.output_norm.weight.dtype)
        y = self.stack(x, q_offsets, new_rows, slots, kv_indices, kv_indptr, history_lengths, new_lengths, kv_table)
        return self.head(self.output_norm(y[candidate_rows]))


@dataclasses.dataclass
class ProgramInputs:
    """The program's inputs for one prepared step, in `INPUT_NAMES` order (see docs/EXPORT.md)."""

    token_ids: torch.Tensor
    q_offsets: torch.Tensor
    new_rows: torch.Tensor
    slots: torch.Tensor
    kv_indices: torch.Tensor
    kv_indptr: torch.Tensor
    history_lengths: torch.Tensor
    new_lengths: torch.Tensor
    candidate_rows: torch.Tensor
    kv_table: torch.Tensor

    def args(self) -> tuple[torch.Tensor, ...]:
        return tuple(getattr(self, name) for name in INPUT_NAMES)


def program_inputs(model: HSTURanker, kv_table: torch.Tensor, history: KeyedJaggedTensor,
                   candidates: KeyedJaggedTensor, plan: BatchPlan) -> ProgramInputs:
    """Inputs for ``plan`` (prepared by the cache for this request): the token layout of the
    uncached events and candidates, and the plan's page metadata."""
    meta = plan.metadata
    if meta.batch_size != history.stride():
        raise ValueError(f"plan is for {meta.batch_size} users, the request has {history.stride()}")
    return _inputs(model, history, candidates, meta, kv_table)


def full_pass_inputs(model: HSTURanker, kv_table: torch.Tensor, history: KeyedJaggedTensor,
                     candidates: KeyedJaggedTensor) -> ProgramInputs:
    """Inputs that run a request as a full pass through the same program, without the cache: every
    history event is new and goes into a scratch table of the batch's own pages (``kv_table``'s
    layout and dtype, none of its storage; user ``b``'s pages follow user ``b-1``'s). What a runner
    does with a batch that does not fit in its cache."""
    page_size = kv_table.shape[3]
    lengths = history.lengths()[: history.stride()].tolist()
    page_lists, at = [], 0
    for n in lengths:
        count = -(-n // page_size)
        page_lists.append(array("q", range(at, at + count)))
        at += count
    meta = build_metadata(page_lists, [0] * len(lengths), lengths, page_size, kv_table.device)
    scratch = kv_table.new_zeros((kv_table.shape[0], max(at, 1), *kv_table.shape[2:]))
    return _inputs(model, history, candidates, meta, scratch)


def _inputs(model: HSTURanker, history: KeyedJaggedTensor, candidates: KeyedJaggedTensor,
            meta: PagedBatchMetadata, kv_table: torch.Tensor) -> ProgramInputs:
    """The token layout of the events ``meta`` leaves uncached, and its page metadata."""
    layout = build_token_layout(history, candidates, meta.cached_lengths, model.config.max_positions)
    n = layout.num_query_tokens
    return ProgramInputs(
        token_ids=layout.token_ids.view(len(EMBEDDING_KEYS), n), q_offsets=layout.q_offsets,
        new_rows=layout.new_rows, slots=meta.new_token_slots, kv_indices=meta.kv_indices, kv_indptr=meta.kv_indptr,
        history_lengths=meta.total_lengths, new_lengths=meta.new_lengths, candidate_rows=layout.candidate_rows,
        kv_table=kv_table)


def export_program(model: HSTURanker, example: ProgramInputs) -> torch.export.ExportedProgram:
    """``torch.export`` of the cached step with dynamic query tokens, new events, pages, users,
    candidates and table pages (``kv_table``'s page count: a caller may pass a scratch table of any
    size, e.g. to run a batch that does not fit in its cache as a full pass). ``example`` should have
    >= 2 users, candidates and new events and a table of >= 2 pages (sizes 0 and 1 would be
    specialised); the package then accepts any size, 0 new events included."""
    dim = torch.export.Dim
    tokens, new, pages = dim("tokens", min=1), dim("new", min=0), dim("pages", min=0)
    users, cands, table_pages = dim("users", min=1), dim("candidates", min=1), dim("table_pages", min=1)
    users1 = users + 1
    shapes = {"token_ids": {1: tokens}, "q_offsets": {0: users1}, "new_rows": {0: new}, "slots": {0: new},
              "kv_indices": {0: pages}, "kv_indptr": {0: users1}, "history_lengths": {0: users},
              "new_lengths": {0: users}, "candidate_rows": {0: cands}, "kv_table": {1: table_pages}}
    with torch.no_grad():
        return torch.export.export(CachedRankerProgram(model).eval(), example.args(), dynamic_shapes=shapes,
                                   strict=False)
