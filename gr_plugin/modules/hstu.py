"""The HSTU ranking model: torchrec embeddings, HSTU layers, a multi-task head over candidates.

Owns the model's parameters and its two forward paths over one set of weights:
- ``forward(history, candidates)``: the full pass (training, and the no-cache oracle);
- ``forward_cached(history, candidates, cache, plan)``: only the uncached history events and the
  candidates are embedded and projected; new history K/V go into the cache's pages and attention
  reads cached + new history from them.
Per layer: ``u, v, q, k = split(SiLU(Linear(LN(x))))``, ``a = attention(q, k, v)`` (HSTU mask,
fixed ``n_norm``), ``y = x + Linear(LN(a) * u)``. It does not own the cache's lifecycle
(lookup/commit): `KVCacheModule` and the integrations do.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Sequence
from typing import TYPE_CHECKING

import torch
import torch.nn.functional as F
from torch import nn
from torchrec.modules.embedding_configs import EmbeddingConfig
from torchrec.modules.embedding_modules import EmbeddingCollection
from torchrec.sparse.jagged_tensor import KeyedJaggedTensor

from gr_plugin.modules.tokens import (
    EMBEDDING_KEYS,
    TokenLayout,
    build_token_layout,
    check_inputs,
    validate_ids,
    validate_values,
)
from gr_plugin.ops import append_kv, hstu_attention_jagged, paged_hstu_attention, silu_append_kv
from gr_plugin.ops.norm import NormGate, add_layer_norm, layer_norm_mul

if TYPE_CHECKING:
    from gr_plugin.cache import BatchPlan
    from gr_plugin.modules.kv_cache import KVCacheModule


# NOTE: leaves for torch.fx: they need host ints (sizes) or check their inputs, so tracing records the calls,
# not their bodies.
torch.fx.wrap("build_token_layout")
torch.fx.wrap("check_inputs")
torch.fx.wrap("hstu_attention_jagged")
torch.fx.wrap("layer_norm_mul")
torch.fx.wrap("add_layer_norm")


@dataclasses.dataclass
class HSTUConfig:
    """Model shape. ``n_norm`` is the fixed attention normaliser; ``alpha`` defaults to
    ``1/sqrt(head_dim)``. Item ids are ``1..num_items`` (0 = padding); actions ``0..num_actions-1``
    (0 = unknown, used for candidates); positions at or past ``max_positions`` share the last one."""

    num_items: int = 3706
    num_actions: int = 6
    num_time_buckets: int = 64
    max_positions: int = 4096
    embedding_dim: int = 64
    num_layers: int = 2
    num_heads: int = 2
    head_dim: int = 32
    n_norm: float = 256.0
    alpha: float | None = None
    dropout: float = 0.0
    num_tasks: int = 2

    def __post_init__(self) -> None:
        for name in ("num_items", "num_actions", "num_time_buckets", "max_positions", "embedding_dim",
                     "num_layers", "num_heads", "head_dim", "num_tasks"):
            v = getattr(self, name)
            if isinstance(v, bool) or not isinstance(v, int) or v <= 0:
                raise ValueError(f"HSTUConfig.{name} must be a positive int, got {v!r}")
        if not self.n_norm > 0:
            raise ValueError(f"HSTUConfig.n_norm must be > 0, got {self.n_norm!r}")
        if self.alpha is not None and not self.alpha > 0:
            raise ValueError(f"HSTUConfig.alpha must be > 0 or None, got {self.alpha!r}")
        if not 0.0 <= self.dropout < 1.0:
            raise ValueError(f"HSTUConfig.dropout must be in [0, 1), got {self.dropout!r}")

    @property
    def attention_alpha(self) -> float:
        return self.alpha if self.alpha is not None else 1.0 / math.sqrt(self.head_dim)


def next_layer(layers, i: int) -> HSTULayer | None:
    """The layer after ``layers[i]`` (whose input norm `HSTULayer.finish_and_norm` computes), or None."""
    return layers[i + 1] if i + 1 < len(layers) else None


class HSTULayer(nn.Module):
    def __init__(self, config: HSTUConfig, device: torch.device | None = None) -> None:
        super().__init__()
        d, hd = config.embedding_dim, config.num_heads * config.head_dim
        self.num_heads, self.head_dim = config.num_heads, config.head_dim
        self.alpha, self.n_norm = config.attention_alpha, config.n_norm
        self.input_norm = nn.LayerNorm(d, device=device)
        self.uvqk = nn.Linear(d, 4 * hd, device=device)
        self.attn_norm = nn.LayerNorm(hd, device=device)
        self.output = nn.Linear(hd, d, device=device)
        self.dropout = nn.Dropout(config.dropout)

    def project(self, x: torch.Tensor, normed: torch.Tensor | None = None,
                activate: bool = True) -> tuple[torch.Tensor, ...]:
        """``x [N, D]`` -> ``u [N, H*Dh]`` and ``q, k, v [N, H, Dh]``; ``normed`` is ``input_norm(x)``
        when the caller has it (`finish` of the layer before computed it with its residual add).
        ``activate=False``: the parts before their SiLU, for `attend_pages` with ``activated=False``,
        which takes it in its append's pass and its norm's (no SiLU pass of its own)."""
        uvqk = self.uvqk(self.input_norm(x) if normed is None else normed)
        u, v, q, k = (F.silu(uvqk) if activate else uvqk).chunk(4, dim=-1)
        shape = (x.shape[0], self.num_heads, self.head_dim)
        return u, q.reshape(shape), k.reshape(shape), v.reshape(shape)

    def finish(self, x: torch.Tensor, u: torch.Tensor, attn: torch.Tensor,
               out: torch.Tensor | None = None) -> torch.Tensor:
        """``x + output(LayerNorm(attn) * u)``, written into ``out`` when given (a static buffer)."""
        return self.finish_gated_and_norm(x, self._gate(u, attn), None, out)[0]

    def finish_and_norm(self, x: torch.Tensor, u: torch.Tensor, attn: torch.Tensor, following: HSTULayer | None,
                        out: torch.Tensor | None = None,
                        normed_out: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor | None]:
        """`finish` and the next layer's input norm of its result, ``(y, following.input_norm(y))``
        (``None`` for the last layer), into ``out`` / ``normed_out`` when given: one pass on CUDA
        inference (`gr_plugin.ops.norm`); the next layer's `project` takes it as ``normed``."""
        return self.finish_gated_and_norm(x, self._gate(u, attn), following, out, normed_out)

    def norm_gate(self, u: torch.Tensor) -> NormGate:
        """``LayerNorm(attn) * u`` as the epilogue a cached attention takes (`KVCacheModule.attend`'s
        ``norm_gate``): its result goes to `finish_gated_and_norm`. ``u`` before its SiLU (`project`
        with ``activate=False``) goes with the attention's ``silu_gate=True`` (`attend_pages`)."""
        n = self.attn_norm
        return NormGate(n.weight, n.bias, n.eps, u)

    def finish_gated_and_norm(self, x: torch.Tensor, gated: torch.Tensor, following: HSTULayer | None,
                              out: torch.Tensor | None = None,
                              normed_out: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor | None]:
        """`finish_and_norm` from ``gated = LayerNorm(attn) * u`` (an attention op's `norm_gate`
        epilogue) on."""
        y = self.dropout(self.output(gated))
        if following is None:
            return (x + y if out is None else torch.add(x, y, out=out)), None
        n = following.input_norm
        return add_layer_norm(x, y, n.weight, n.bias, n.eps, out=out, normed_out=normed_out)

    def _gate(self, u: torch.Tensor, attn: torch.Tensor) -> torch.Tensor:
        n = self.attn_norm
        return layer_norm_mul(attn.flatten(1), n.weight, n.bias, n.eps, u)

    def attend_pages(self, projected: tuple[torch.Tensor, ...], table: torch.Tensor, slots: torch.Tensor,
                     rows: torch.Tensor, kv_indices: torch.Tensor, kv_indptr: torch.Tensor,
                     total_lengths: torch.Tensor, q_offsets: torch.Tensor, new_lengths: torch.Tensor, *,
                     max_q_len: int, max_history_len: int, num_history_tokens: int,
                     activated: bool = True) -> torch.Tensor:
        """The cached step's attention of this layer from `project`'s ``(u, q, k, v)``: the new
        tokens' keys and values (rows ``rows`` of ``k``, ``v``) appended at ``slots`` of ``table``
        (this layer's pages), then the paged attention over ``table``
        (`gr_plugin.ops.paged_hstu_attention`, whose arguments the rest are) with this layer's norm
        gate: ``LayerNorm(attn) * u`` ``[Nq, H*D]`` for `finish_gated_and_norm`. ``activated=False``:
        ``projected`` is `project`'s with ``activate=False``; one pass takes the SiLU of ``q, k, v``
        and appends (`gr_plugin.ops.silu_append_kv`), the norm's pass takes ``u``'s (``silu_gate``):
        no SiLU pass over the whole projection and no append launch of their own."""
        u, q, k, v = projected
        if activated:
            append_kv(table, k, v, slots, rows)
        else:
            q, k, v = silu_append_kv(table, q, k, v, slots, rows)
        return paged_hstu_attention(q, k, v, table, kv_indices, kv_indptr, total_lengths, q_offsets, new_lengths,
                                    alpha=self.alpha, n_norm=self.n_norm, max_q_len=max_q_len,
                                    max_history_len=max_history_len, num_history_tokens=num_history_tokens,
                                    norm_gate=self.norm_gate(u), silu_gate=not activated)

    def attend_jagged(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, layout: TokenLayout) -> torch.Tensor:
        """The full pass's attention over ``layout`` (history then candidates per user)."""
        return hstu_attention_jagged(q, k, v, layout.q_offsets, layout.candidate_lengths, alpha=self.alpha,
                                     n_norm=self.n_norm, max_seq_len=layout.max_q_len)

    def forward(self, x: torch.Tensor, layout: TokenLayout) -> torch.Tensor:
        u, q, k, v = self.project(x)
        return self.finish(x, u, self.attend_jagged(q, k, v, layout))


def full_stack(layers, x: torch.Tensor, layout: TokenLayout) -> torch.Tensor:
    """The full pass of a layer stack over ``layout``, each layer's residual add fused with the next
    layer's input norm (`HSTULayer.finish_and_norm`)."""
    normed = None
    for i, layer in enumerate(layers):
        u, q, k, v = layer.project(x, normed)
        x, normed = layer.finish_and_norm(x, u, layer.attend_jagged(q, k, v, layout), next_layer(layers, i))
    return x


class HSTURanker(nn.Module):
    """HSTU ranking over a history KJT (keys ``item, action, time``) and a candidates KJT (key
    ``item``), both with ``B`` users; returns candidate logits ``[sum(C), num_tasks]``."""

    def __init__(self, config: HSTUConfig, device: torch.device | None = None) -> None:
        super().__init__()
        self.config = config
        d = config.embedding_dim
        sizes = {"item": config.num_items + 1, "action": config.num_actions,
                 "time": config.num_time_buckets, "position": config.max_positions}
        self.embeddings = EmbeddingCollection(
            tables=[EmbeddingConfig(name=k, embedding_dim=d, num_embeddings=sizes[k], feature_names=[k])
                    for k in EMBEDDING_KEYS],
            device=device,
        )
        self.layers = nn.ModuleList(HSTULayer(config, device) for _ in range(config.num_layers))
        self.output_norm = nn.LayerNorm(d, device=device)
        self.head = nn.Linear(d, config.num_tasks, device=device)

    @property
    def embeds_by_lookup(self) -> bool:
        """Whether the tables are read by direct lookups (`embed_ids`): an unsharded EmbeddingCollection."""
        return type(self.embeddings) is EmbeddingCollection

    def embed_ids(self, ids: torch.Tensor) -> torch.Tensor:
        """Summed embeddings ``[N, D]`` of ``ids [len(EMBEDDING_KEYS), N]`` (one row of ids per key),
        for unsharded tables (`embeds_by_lookup`): the same rows, summed in the same order, as the
        torchrec module, without its per-key KJT split (which costs more host time than the gathers)."""
        tables = self.embeddings.embeddings
        x = F.embedding(ids[0], tables[EMBEDDING_KEYS[0]].weight)
        for i, key in enumerate(EMBEDDING_KEYS[1:], 1):
            x = x + F.embedding(ids[i], tables[key].weight)
        return x.to(self.output_norm.weight.dtype)

    def _embed(self, layout: TokenLayout) -> torch.Tensor:
        if self.embeds_by_lookup:
            return self.embed_ids(layout.token_ids.view(len(EMBEDDING_KEYS), -1))
        out = self.embeddings(layout.features)
        x = out[EMBEDDING_KEYS[0]].values()
        for key in EMBEDDING_KEYS[1:]:
            x = x + out[key].values()
        # NOTE: torchrec may keep its tables (and outputs) in fp32 when the layers run in bf16.
        return x.to(self.output_norm.weight.dtype)

    def head_rows(self, x: torch.Tensor, rows: torch.Tensor) -> torch.Tensor:
        """Logits ``[len(rows), num_tasks]`` of the query rows ``rows`` of the last layer's ``x``."""
        return self.head(self.output_norm(x[rows]))

    def _head(self, x: torch.Tensor, layout: TokenLayout) -> torch.Tensor:
        return self.head_rows(x, layout.candidate_rows)

    def forward(self, history: KeyedJaggedTensor, candidates: KeyedJaggedTensor, num_query_tokens: int | None = None,
                max_seq_len: int | None = None, num_candidates: int | None = None) -> torch.Tensor:
        """The full pass: every history event and candidate is embedded and attended. The optional
        host ints (total tokens, longest sequence, total candidates) avoid device syncs."""
        check_inputs(history, candidates)
        layout = build_token_layout(history, candidates, None, self.config.max_positions, num_query_tokens,
                                    max_seq_len, num_candidates)
        return self.forward_layout(layout)

    def forward_layout(self, layout: TokenLayout) -> torch.Tensor:
        """The full pass over a layout the caller built (``cached_lengths=None``), e.g. on the host
        and moved with `TokenLayout.to`."""
        return self._head(full_stack(self.layers, self._embed(layout), layout), layout)

    def forward_cached(self, history: KeyedJaggedTensor, candidates: KeyedJaggedTensor,
                       cache: KVCacheModule, plan: BatchPlan, *, num_candidates: int | None = None,
                       max_candidates: int | None = None, layout: TokenLayout | None = None,
                       silu_pass: bool = True) -> torch.Tensor:
        """The cached pass for a prepared ``plan``: ``plan.cached_lengths`` events per user are
        read from the cache's pages; the rest are computed and appended. Same logits as
        ``forward`` (to float rounding). ``num_candidates``/``max_candidates`` (host ints)
        avoid device syncs; a ``layout`` the caller built for this plan is used as is.
        ``silu_pass`` (default): each layer's projection activated first, in a pass of its own, and
        the manager's append; False: the projection before its SiLU (`KVCacheModule.forward` with
        ``activated=False``: `ops.silu_append_kv`, the norm gate's SiLU of ``u``), the graphed step's
        form. NOTE: measured on the H200 (scripts/gpu/ab_eager.py, docs/BENCHMARKS.md): this eager
        pass is host-bound (the host's time to return was 99% of the wall, its kernels 7-23%), and
        the pre-SiLU form, whose kernels took 1.9-4% less device time, took 2.0-5.5% more wall at bs 8
        in four calls of four (inferred: its extra Python checks and launch arguments), -3.3% to
        +1.6% at bs 1, all inside the calls' spreads; the same logits in those runs."""
        check_inputs(history, candidates)
        meta = plan.metadata
        if meta.batch_size != history.stride():
            raise ValueError(f"plan is for {meta.batch_size} users, the request has {history.stride()}")
        if layout is None:
            layout = build_token_layout(
                history, candidates, meta.cached_lengths, self.config.max_positions,
                None if num_candidates is None else meta.num_new_tokens + num_candidates,
                None if max_candidates is None else meta.max_new_len + max_candidates,
                num_candidates,
            )
        x, normed = self._embed(layout), None
        for i, layer in enumerate(self.layers):
            u, q, k, v = layer.project(x, normed, activate=silu_pass)
            gated = cache.attend(i, q, k, v, layout, plan, alpha=layer.alpha, n_norm=layer.n_norm,
                                 norm_gate=layer.norm_gate(u), activated=silu_pass)
            x, normed = layer.finish_gated_and_norm(x, gated, next_layer(self.layers, i))
        return self._head(x, layout)

    def validate(self, history: KeyedJaggedTensor, candidates: KeyedJaggedTensor) -> None:
        """Host-side checks of a request against this model (keys, sizes, id ranges)."""
        c = self.config
        validate_values(history, candidates, num_items=c.num_items, num_actions=c.num_actions,
                        num_time_buckets=c.num_time_buckets)

    def validate_ids(self, history_lengths: torch.Tensor, history_columns: Sequence[torch.Tensor],
                     candidate_lengths: torch.Tensor, candidate_items: torch.Tensor) -> None:
        """`validate`'s length and id-range checks on a request's columns (`tokens.validate_ids`:
        the history's item, action and time ids, the candidates' items), without building KJTs."""
        c = self.config
        validate_ids(history_lengths, history_columns, candidate_lengths, candidate_items, num_items=c.num_items,
                     num_actions=c.num_actions, num_time_buckets=c.num_time_buckets)
