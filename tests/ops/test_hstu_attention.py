"""The attention references against a plain loop written independently here."""

import pytest
import torch
import torch.nn.functional as F

from gr_plugin.cache import paged_ops
from gr_plugin.ops import jagged
from gr_plugin.ops.pytorch.hstu_attention import hstu_attention_jagged, paged_hstu_attention

from .paged_inputs import scatter_into_pages

H, D, ALPHA, NORM = 2, 3, 0.7, 5.0


def loop_attention(q, k, v, hist_len, num_cand, q_first_pos=0):
    """One user. Tokens: history [0, hist_len) then candidates. ``q`` holds the queries of the
    tokens from position ``q_first_pos`` on; ``k``/``v`` hold every token's keys/values."""
    out = torch.zeros_like(q)
    for qi in range(q.shape[0]):
        i = q_first_pos + qi
        for j in range(hist_len + num_cand):
            is_cand_i = i >= hist_len
            ok = (j < hist_len or j == i) if is_cand_i else j <= i
            if ok:
                w = F.silu((q[qi] * k[j]).sum(-1) * ALPHA) / NORM  # [H]
                out[qi] += w.unsqueeze(-1) * v[j]
    return out


CASES = [  # (history lengths, candidates, cached) per user
    ([5], [1], [0]),
    ([5, 0, 9], [3, 2, 1], [0, 0, 0]),
    ([7, 3], [4, 1], [7, 3]),  # all cached: only candidates are queries
    ([9, 4, 1], [2, 5, 1], [4, 0, 1]),
    ([1], [6], [0]),
]


@pytest.mark.parametrize("use_fbgemm", [True, False])
@pytest.mark.parametrize(("hist", "cand", "cached"), CASES)
def test_jagged_matches_loop(monkeypatch, use_fbgemm, hist, cand, cached):
    if not use_fbgemm:
        monkeypatch.setattr(jagged, "_use_fbgemm", lambda op, t: False)
    g = torch.Generator().manual_seed(len(hist) * 13 + sum(hist))
    lens = [h + c for h, c in zip(hist, cand)]
    T = sum(lens)
    q, k, v = (torch.randn(T, H, D, generator=g) for _ in range(3))
    offsets = torch.tensor([0, *torch.cumsum(torch.tensor(lens), 0).tolist()])
    out = hstu_attention_jagged(q, k, v, offsets, torch.tensor(cand), alpha=ALPHA, n_norm=NORM,
                                max_seq_len=max(lens))
    want = torch.cat([loop_attention(q[a:b], k[a:b], v[a:b], h, c)
                      for a, b, h, c in zip(offsets[:-1], offsets[1:], hist, cand)])
    torch.testing.assert_close(out, want, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("page_size", [1, 2, 4])
@pytest.mark.parametrize(("hist", "cand", "cached"), CASES)
def test_paged_matches_loop(page_size, hist, cand, cached):
    g = torch.Generator().manual_seed(len(hist) * 7 + sum(cached))
    B = len(hist)
    # every token's q/k/v as a full pass would see them
    full = [tuple(torch.randn(h + c, H, D, generator=g) for _ in range(3)) for h, c in zip(hist, cand)]
    table, indices, indptr = scatter_into_pages(full, hist, page_size, 2, g)
    new = [h - c for h, c in zip(hist, cached)]
    qs, ks, vs, wants = [], [], [], []
    for b in range(B):
        q_all, k_all, v_all = full[b]
        sl = slice(cached[b], hist[b] + cand[b])
        qs.append(q_all[sl])
        ks.append(k_all[sl])
        vs.append(v_all[sl])
        wants.append(loop_attention(q_all[sl], k_all, v_all, hist[b], cand[b], q_first_pos=cached[b]))
    q_len = [n + c for n, c in zip(new, cand)]
    q_offsets = torch.tensor([0, *torch.cumsum(torch.tensor(q_len), 0).tolist()])
    out = paged_hstu_attention(
        torch.cat(qs), torch.cat(ks), torch.cat(vs), table, torch.tensor(indices, dtype=torch.int64),
        torch.tensor(indptr), torch.tensor(hist), q_offsets, torch.tensor(new), alpha=ALPHA, n_norm=NORM,
        max_q_len=max(q_len), max_history_len=max(max(hist), 1), num_history_tokens=sum(hist))
    torch.testing.assert_close(out, torch.cat(wants), rtol=1e-5, atol=1e-6)


def test_candidates_do_not_see_each_other():
    g = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(6, H, D, generator=g) for _ in range(3))
    offsets, cand = torch.tensor([0, 6]), torch.tensor([3])
    base = hstu_attention_jagged(q, k, v, offsets, cand, alpha=ALPHA, n_norm=NORM, max_seq_len=6)
    k2, v2 = k.clone(), v.clone()
    k2[5] += 10  # change the last candidate only
    v2[5] -= 3
    moved = hstu_attention_jagged(q, k2, v2, offsets, cand, alpha=ALPHA, n_norm=NORM, max_seq_len=6)
    assert torch.equal(moved[:5], base[:5])  # history and the other candidates unchanged
    assert not torch.equal(moved[5], base[5])


def test_reference_page_ops_used_consistently():
    # the paged op reads exactly what append_kv wrote
    table = torch.zeros(3, 2, 2, H, D)
    k, v = torch.randn(3, H, D), torch.randn(3, H, D)
    slots = torch.tensor([4, 5, 0])
    paged_ops.append_kv(table, k, v, slots)
    k2, v2 = paged_ops.gather_kv(table, slots)
    assert torch.equal(k2, k) and torch.equal(v2, v)


def test_cpu_dispatch_takes_the_cpp_kernels_with_and_without_a_gradient(monkeypatch):
    """`gr_plugin.ops` on CPU tensors: the gr_kv C++ kernels under ``auto`` (where a gradient is needed,
    with their C++ backward), the reference where ``GR_PLUGIN_ATTENTION=reference``; outputs and
    gradients agree."""
    from gr_plugin.ops import hstu_attention as dispatch
    from gr_plugin.ops.pytorch import hstu_attention as ref

    calls = []
    for name in ("hstu_attention_jagged", "paged_hstu_attention"):
        real = getattr(ref, name)
        monkeypatch.setattr(ref, name, lambda *a, _real=real, _name=name, **kw: calls.append(_name) or _real(*a, **kw))
    g = torch.Generator().manual_seed(0)
    lens, cands = [9, 1, 14], [2, 1, 3]  # (a user of one candidate and no history)
    q, k, v = (torch.randn(sum(lens), 2, 8, generator=g) for _ in range(3))
    offsets = torch.tensor([0, 9, 10, 24])
    args = (q, k, v, offsets, torch.tensor(cands))
    kw = dict(alpha=0.3, n_norm=8.0, max_seq_len=14)
    monkeypatch.setenv("GR_PLUGIN_ATTENTION", "auto")
    with torch.no_grad():
        fast = dispatch.hstu_attention_jagged(*args, **kw)
    assert calls == []  # the C++ kernel served it
    monkeypatch.setenv("GR_PLUGIN_ATTENTION", "reference")
    slow = dispatch.hstu_attention_jagged(*args, **kw)
    assert calls == ["hstu_attention_jagged"]
    torch.testing.assert_close(fast, slow, rtol=0, atol=1e-6)
    grads = {}
    for mode in ("auto", "reference"):  # training: the C++ kernels both ways, then the reference's autograd
        monkeypatch.setenv("GR_PLUGIN_ATTENTION", mode)
        leaves = [t.clone().requires_grad_() for t in (q, k, v)]
        out = dispatch.hstu_attention_jagged(*leaves, *args[3:], **kw)
        assert (type(out.grad_fn).__name__ == "CppJaggedAttentionBackward") == (mode == "auto")
        (out * torch.linspace(-1, 1, out.numel()).view_as(out)).sum().backward()
        grads[mode] = [t.grad for t in leaves]
    assert calls == ["hstu_attention_jagged"] * 2
    for a, b in zip(grads["auto"], grads["reference"]):
        assert b.abs().sum() > 0
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6)
    monkeypatch.setenv("GR_PLUGIN_ATTENTION", "auto")
    with torch.no_grad():  # int32 offsets and counts, which the reference takes too
        torch.testing.assert_close(dispatch.hstu_attention_jagged(q, k, v, offsets.int(), args[4].int(), **kw), fast)
    with torch.no_grad(), pytest.raises(ValueError, match="seq_offsets"):  # the C++ kernel's own checks
        dispatch.hstu_attention_jagged(q, k, v, torch.tensor([0, 9, 5, 24]), torch.tensor(cands), **kw)


def test_cpu_dispatch_of_the_paged_form_with_and_without_the_norm_gate(monkeypatch):
    """The paged form on CPU tensors under ``inference_mode``: the C++ kernel alone, with the layer's
    norm gate after it, and with the gate's SiLU, equal to the reference's (which ``reference`` runs)."""
    from gr_plugin.ops import hstu_attention as dispatch
    from gr_plugin.ops import norm
    from gr_plugin.ops.pytorch import hstu_attention as ref

    from .test_triton_attention import build

    calls = []
    real = ref.paged_hstu_attention
    monkeypatch.setattr(ref, "paged_hstu_attention", lambda *a, **kw: calls.append(1) or real(*a, **kw))
    _, p = build([37, 0, 90], [3, 2, 1], [20, 0, 64], 8, 2, 16, torch.float32, "cpu")
    args = [p[n] for n in ("q", "k", "v", "kv_layer", "kv_indices", "kv_indptr", "history_lengths", "q_offsets",
                           "new_lengths")]
    sizes = dict(alpha=0.3, n_norm=8.0, max_q_len=p["max_q_len"], max_history_len=p["max_history_len"],
                 num_history_tokens=p["num_history_tokens"])
    g = torch.Generator().manual_seed(1)
    gate = norm.NormGate(torch.randn(32, generator=g), torch.randn(32, generator=g), 1e-5,
                         torch.randn(p["q"].shape[0], 32, generator=g))
    outs = {}
    for mode in ("auto", "reference"):
        monkeypatch.setenv("GR_PLUGIN_ATTENTION", mode)
        with torch.inference_mode():
            outs[mode] = [dispatch.paged_hstu_attention(*args, **sizes),
                          dispatch.paged_hstu_attention(*args, **sizes, norm_gate=gate),
                          dispatch.paged_hstu_attention(*args, **sizes, norm_gate=gate, silu_gate=True)]
        assert len(calls) == (0 if mode == "auto" else 3)  # auto: the C++ kernel served all three
    for fast, slow in zip(outs["auto"], outs["reference"]):
        torch.testing.assert_close(fast, slow, rtol=0, atol=1e-5)


def test_cpu_dispatch_falls_back_to_the_reference_where_the_cpp_ops_cannot_load(monkeypatch, caplog):
    """Where the gr_kv C++ ops cannot be built or loaded, CPU inference takes the reference, with one warning."""
    import sys

    from gr_plugin.ops import hstu_attention as dispatch
    from gr_plugin.ops.pytorch import hstu_attention as ref

    calls = []
    real = ref.hstu_attention_jagged
    monkeypatch.setattr(ref, "hstu_attention_jagged", lambda *a, **kw: calls.append(1) or real(*a, **kw))
    import gr_plugin.ops

    monkeypatch.setitem(sys.modules, "gr_plugin.ops.library", None)  # (an import of it raises ImportError)
    monkeypatch.delattr(gr_plugin.ops, "library", raising=False)
    dispatch._cpu_ops.cache_clear()
    try:
        q, k, v = (torch.randn(7, 2, 8, generator=torch.Generator().manual_seed(i)) for i in range(3))
        with torch.no_grad(), caplog.at_level("WARNING", logger=dispatch.__name__):
            for _ in range(2):
                dispatch.hstu_attention_jagged(q, k, v, torch.tensor([0, 7]), torch.tensor([2]), alpha=0.3,
                                               n_norm=8.0, max_seq_len=7)
        assert calls == [1, 1]
        assert [r.message for r in caplog.records].count(caplog.records[0].message) == 1  # warned once
        assert "the CPU takes the pure-torch reference" in caplog.records[0].message
    finally:
        monkeypatch.undo()
        dispatch._cpu_ops.cache_clear()
    assert dispatch._cpu_ops() is not None
