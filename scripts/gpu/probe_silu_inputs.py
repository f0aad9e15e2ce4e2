"""What the SiLU applied by the cached layer's ops costs each of them (``silu_inputs`` / ``silu`` / ``silu_u``).

python3 scripts/gpu/probe_silu_inputs.py

At the block's shapes (hidden 1024, 4 heads; head_dim 128 / page 128 and 256 / page 32; 4096 history,
3968 cached, 128 new + 256 candidates per user; bs 1 and 8), graphed (min of 3 interleaved rounds of
20 replays, medians): the paged attention with its norm gate, the page append and the gate alone,
each on the activated projection and on the raw one with the op's SiLU flag, next to ``F.silu`` of
the whole projection (the launch the flags remove). Prints each new compiled variant's registers
and spills (Triton's compiled kernel), which is where a SiLU applied to a matmul operand in
registers would show.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from gr_plugin.bench.block import Block, _graph, _time_ms
from gr_plugin.ops import paged_hstu_attention
from gr_plugin.ops.norm import NormGate, layer_norm_mul
from gr_plugin.ops.triton import append_kv as tri_append
from gr_plugin.ops.triton import hstu_attention as tri
from gr_plugin.ops.triton import layer_norm as tri_norm

HIST, CACHED, CANDS = 4096, 3968, 256


def compiled(fn):
    """{key: (registers, spills)} of the variants Triton has compiled of ``fn``."""
    out = {}
    for cache in fn.device_caches.values():
        kernels = cache[0] if isinstance(cache, tuple) else cache
        for key, k in kernels.items():
            try:
                k._init_handles()
            except Exception:
                pass
            out[key] = (getattr(k, "n_regs", None), getattr(k, "n_spills", None))
    return out


def best(fn, rounds=3):
    return min(_time_ms(fn, 20) for _ in range(rounds)) * 1e3


def case(dim, page, bs):
    blk = Block(dim, page, num_pages=bs * (HIST // page + 2) + 8)
    users = list(range(bs))
    blk.fill(users, CACHED)
    plan = blk.plan(users, HIST)
    meta = plan.metadata
    new = HIST - CACHED
    n = bs * (new + CANDS)
    hd = 4 * dim
    dev, dt = blk.device, blk.dtype
    y = torch.randn(n, 4 * hd, device=dev, dtype=dt) * 2
    act = F.silu(y)
    q_off = torch.arange(0, n + 1, new + CANDS, device=dev)
    rows = torch.cat([torch.arange(b * (new + CANDS), b * (new + CANDS) + new, device=dev) for b in range(bs)])
    layer = blk.layers[0]
    gate = layer.norm_gate(torch.empty(0))
    table = blk.cache.kv_table

    def views(t):
        u, v, q, k = t.chunk(4, dim=-1)
        shape = (n, 4, dim)
        return u, q.reshape(shape), k.reshape(shape), v.reshape(shape)

    def attention(t, silu, mode=None):
        u, q, k, v = views(t)
        op, extra = (paged_hstu_attention, {}) if mode is None else (tri.paged_hstu_attention, {"silu_mode": mode})
        return lambda: op(
            q, k, v, table[0], meta.kv_indices, meta.kv_indptr, meta.total_lengths, q_off, meta.new_lengths,
            alpha=layer.alpha, n_norm=layer.n_norm, max_q_len=new + CANDS, max_history_len=meta.max_total_len,
            num_history_tokens=meta.num_total_tokens, norm_gate=NormGate(gate.weight, gate.bias, gate.eps, u),
            silu_inputs=silu, **extra)

    def append(t, silu):
        _, _, k, v = views(t)
        return lambda: tri_append.append_kv(table[0], k, v, meta.new_token_slots, rows, silu=silu)

    a = torch.randn(n, hd, device=dev, dtype=dt)

    def gate_only(t, silu):
        u = views(t)[0]
        return lambda: layer_norm_mul(a, gate.weight, gate.bias, gate.eps, u, silu_u=silu)

    print(f"=== head_dim {dim} page {page} bs {bs}: {n} query rows")
    # the attention's ways of applying the SiLU (`_tile`'s SILU): 1 in registers, 2 the queries staged
    # through a scratch in global memory, 3 the candidates' own keys and values too, 4 in registers with
    # the tanh.approx SiLU
    with torch.no_grad():
        graphs = {"activated": _graph(attention(act, False))}
        for mode in (1, 2, 3, 4):
            before = compiled(tri._hstu_fwd)
            graphs[f"mode {mode}"] = _graph(attention(y, True, mode))
            for key, (regs, spills) in compiled(tri._hstu_fwd).items():
                if key not in before:
                    print(f"    mode {mode} compiled _hstu_fwd: {regs} registers, {spills} spills")
        times = {k: [] for k in graphs}
        for _ in range(3):
            for k, g in graphs.items():
                times[k].append(best(g, 1))
        print("  attention + gate: " + ", ".join(f"{k} {min(v):.2f} us" for k, v in times.items()))
    for name, make, fns in (("attention + gate", attention, (tri._hstu_fwd, tri_norm._sum_ln_mul, tri_norm._ln_mul)),
                            ("append", append, (tri_append._append,)),
                            ("gate alone", gate_only, (tri_norm._ln_mul,))):
        before = [compiled(f) for f in fns]
        with torch.no_grad():
            plain, flagged = _graph(make(act, False)), _graph(make(y, True))
            times = [[], []]
            for _ in range(3):
                times[0].append(best(plain, 1))
                times[1].append(best(flagged, 1))
        print(f"  {name}: activated {min(times[0]):7.2f} us, raw + SiLU flag {min(times[1]):7.2f} us")
        for f, old in zip(fns, before):
            for key, (regs, spills) in compiled(f).items():
                if key not in old:
                    print(f"    compiled {f.fn.__name__}: {regs} registers, {spills} spills")
    with torch.no_grad():
        silu = _graph(lambda: F.silu(y))
        print(f"  F.silu of the projection {best(silu):7.2f} us")


for args in ((128, 128, 1), (128, 128, 8), (256, 32, 1), (256, 32, 8)):
    case(*args)
