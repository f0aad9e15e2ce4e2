"""`PackagedCachedRanker`: cached inference with the whole step from an AOTInductor package.

Owns the split between what runs in the package (embeddings, the layer stack and its gr_kv ops with
the KV table as a mutated input, the head: `gr_plugin.export.model`) and what stays in Python (the
cache policy: lookup / allocate / commit, and the token layout that turns the request and the cache's
cached lengths into the package's inputs). ``export_package`` writes the package;
``aoti_load_package`` reloads it; ``score`` runs one cached step through it.
"""

from __future__ import annotations

import logging
from pathlib import Path

import torch
from torchrec.sparse.jagged_tensor import KeyedJaggedTensor

from gr_plugin.cache import BatchPlan
from gr_plugin.csrc.toolchain import libstdcxx_libraries
from gr_plugin.export.model import export_program, program_inputs
from gr_plugin.modules import HSTURanker, KVCacheModule

logger = logging.getLogger(__name__)


def aoti_link_configs() -> dict:
    """Inductor configs that keep a package's libstdc++ shared where the compiler would link it
    statically (`gr_plugin.csrc.toolchain`; a package built so segfaults when loaded)."""
    libs = libstdcxx_libraries()
    if not libs:
        return {}
    if not hasattr(torch._inductor.config.aot_inductor, "custom_op_libs"):
        raise RuntimeError("this compiler links libstdc++ statically into shared libraries and this torch has no "
                           "aot_inductor.custom_op_libs to link it shared: install the libstdc++ development package "
                           "(libstdc++.so) for the compiler")
    return {"aot_inductor.custom_op_libs": [*(torch._inductor.config.aot_inductor.custom_op_libs or []), *libs]}


def export_package(model: HSTURanker, cache: KVCacheModule, history: KeyedJaggedTensor,
                   candidates: KeyedJaggedTensor, plan: BatchPlan, path: str | Path) -> str:
    """Export the cached step (example inputs from ``plan``; shapes dynamic) and write an
    AOTInductor package at ``path``. Exporting only traces: the example step writes nothing, and the
    caller aborts ``plan``."""
    program = export_program(model, program_inputs(model, cache.kv_table, history, candidates, plan))
    with torch.no_grad():
        out = torch._inductor.aoti_compile_and_package(program, package_path=str(path),
                                                       inductor_configs=aoti_link_configs())
    logger.info("wrote AOTInductor package %s", out)
    return out


class PackagedCachedRanker:
    def __init__(self, model: HSTURanker, cache: KVCacheModule, package: str | Path) -> None:
        self.model, self.cache = model, cache
        self.program = torch._inductor.aoti_load_package(str(package))

    @torch.no_grad()
    def score(self, history: KeyedJaggedTensor, candidates: KeyedJaggedTensor, plan: BatchPlan) -> torch.Tensor:
        """Candidate logits ``[sum(C), num_tasks]`` of one prepared step (the caller commits)."""
        inputs = program_inputs(self.model, self.cache.kv_table, history, candidates, plan)
        # NOTE: the package reads every layer's pages at once: pages onboarded from a lower tier must
        # all have landed first (the eager path waits layer by layer).
        for layer in range(self.model.config.num_layers):
            self.cache.manager.wait_layer(plan, layer)
        return self.program(*inputs.args())
