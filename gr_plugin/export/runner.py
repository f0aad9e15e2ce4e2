"""`PackagedCachedRanker`: cached inference with the layer stack from an AOTInductor package.

Owns the split between what runs in the package (the layer stack and its gr_kv ops, with the KV
table as a mutated input) and what stays in Python (the cache policy: lookup / allocate / commit,
the token layout and embeddings, the head). ``export_package`` writes the package;
``aoti_load_package`` reloads it; ``score`` runs one cached step through it.
"""

from __future__ import annotations

import logging
from pathlib import Path

import torch
from torchrec.sparse.jagged_tensor import KeyedJaggedTensor

from gr_plugin.cache import BatchPlan
from gr_plugin.export.stack import CachedLayerStack, export_stack
from gr_plugin.modules import HSTURanker, KVCacheModule
from gr_plugin.modules.tokens import build_token_layout

logger = logging.getLogger(__name__)


def stack_inputs(model: HSTURanker, cache: KVCacheModule, history: KeyedJaggedTensor,
                 candidates: KeyedJaggedTensor, plan: BatchPlan):
    """The layer stack's inputs for a prepared plan, and the token layout (for the head)."""
    meta = plan.metadata
    layout = build_token_layout(history, candidates, meta.cached_lengths, model.config.max_positions)
    x = model._embed(layout)
    args = (x, layout.q_offsets, layout.new_rows, meta.new_token_slots, meta.kv_indices, meta.kv_indptr,
            meta.total_lengths, meta.new_lengths, cache.kv_table)
    return args, layout


def export_package(model: HSTURanker, cache: KVCacheModule, history: KeyedJaggedTensor,
                   candidates: KeyedJaggedTensor, plan: BatchPlan, path: str | Path) -> str:
    """Export the cached layer stack (example inputs from ``plan``; shapes dynamic) and write an
    AOTInductor package at ``path``. The example step's appends are undone by the caller's abort."""
    args, _ = stack_inputs(model, cache, history, candidates, plan)
    with torch.no_grad():
        program = export_stack(CachedLayerStack(model).eval(), args)
        out = torch._inductor.aoti_compile_and_package(program, package_path=str(path))
    logger.info("wrote AOTInductor package %s", out)
    return out


class PackagedCachedRanker:
    def __init__(self, model: HSTURanker, cache: KVCacheModule, package: str | Path) -> None:
        self.model, self.cache = model, cache
        self.stack = torch._inductor.aoti_load_package(str(package))

    @torch.no_grad()
    def score(self, history: KeyedJaggedTensor, candidates: KeyedJaggedTensor, plan: BatchPlan) -> torch.Tensor:
        """Candidate logits ``[sum(C), num_tasks]`` of one prepared step (the caller commits)."""
        args, layout = stack_inputs(self.model, self.cache, history, candidates, plan)
        return self.model._head(self.stack(*args), layout)
