"""The cached pass's pre-SiLU form (`forward_cached(..., silu_pass=False)`: `KVCacheModule.forward` with
``activated=False``, `ops.silu_append_kv`, the norm gate's SiLU of ``u``), the graphed step's form, against
the default eager form (the projection activated first, the manager's append) written out on its own.
On the CPU both forms run torch's ops, so they agree to fp32 rounding, not bit for bit: torch's CPU
SiLU of a strided [N, H, D] view and of the whole projection can round an element differently (its
vectorised and scalar ``exp``: 1-2 ulp apart). On the GPU the graphed step's equality of bits with the
SiLU-pass form is `tests/bench/test_block_step.py`'s."""

from __future__ import annotations

import pytest
import torch

from gr_plugin.modules.hstu import next_layer
from gr_plugin.modules.tokens import build_token_layout
from tests.modules.helpers import User, cached_scores, full_scores, make_inputs, tiny_cache, tiny_model


def _activated_scores(model, cache, users, cands):
    """`forward_cached`'s loop with the projection activated first and the manager's append (its
    default form), written out here so that the test does not share the switch it checks."""
    history, candidates, lengths, keys = make_inputs(users, cands)
    plan = cache.begin([u.uid for u in users], lengths, keys)
    layout = build_token_layout(history, candidates, plan.metadata.cached_lengths, model.config.max_positions)
    with torch.no_grad():
        x, normed = model._embed(layout), None
        for i, layer in enumerate(model.layers):
            u, q, k, v = layer.project(x, normed)
            gated = cache.attend(i, q, k, v, layout, plan, alpha=layer.alpha, n_norm=layer.n_norm,
                                 norm_gate=layer.norm_gate(u))
            x, normed = layer.finish_gated_and_norm(x, gated, next_layer(model.layers, i))
        out = model._head(x, layout)
    cache.commit(plan)
    return out


def _visits(seed=0):
    g = torch.Generator().manual_seed(seed)
    users = [User(1, g), User(2, g)]
    for u, n in zip(users, (5, 9)):
        u.grow(n)
    return g, users


def test_pre_silu_cached_pass_equals_the_activated_pass():
    model = tiny_model()
    a, b = tiny_cache(model), tiny_cache(model)
    _, users = _visits()
    for visit in range(3):  # a cold visit, then two that read the first visits' pages
        cands = [u.candidates(3) for u in users]
        got, plan = cached_scores(model, a, users, cands, silu_pass=False)
        want = _activated_scores(model, b, users, cands)
        assert plan.metadata.cached_lengths.sum() > 0 or visit == 0
        torch.testing.assert_close(got, want, rtol=1e-6, atol=1e-6, msg=f"visit {visit}")
        torch.testing.assert_close(a.kv_table, b.kv_table, rtol=1e-6, atol=1e-6, msg=f"visit {visit}")
        torch.testing.assert_close(got, full_scores(model, users, cands), rtol=1e-4, atol=1e-4)
        for u in users:
            u.grow(2)


def _begun(seed):
    """A begun step of a tiny model on an empty cache: its plan, layout, layer 0's projection before
    its SiLU, and a copy of the table."""
    model = tiny_model()
    cache = tiny_cache(model)
    _, users = _visits(seed)
    history, candidates, lengths, keys = make_inputs(users, [u.candidates(2) for u in users])
    plan = cache.begin([u.uid for u in users], lengths, keys)
    layout = build_token_layout(history, candidates, plan.metadata.cached_lengths, model.config.max_positions)
    projected = model.layers[0].project(model._embed(layout), activate=False)
    return model, cache, plan, layout, projected, cache.kv_table.clone()


def test_pre_silu_attend_without_the_norm_gate_is_refused_and_writes_nothing():
    model, cache, plan, layout, (_, q, k, v), before = _begun(1)
    layer = model.layers[0]
    with torch.no_grad(), pytest.raises(ValueError, match="activated=False needs norm_gate"):
        cache.attend(0, q, k, v, layout, plan, alpha=layer.alpha, n_norm=layer.n_norm, activated=False)
    assert torch.equal(cache.kv_table, before)
    cache.abort(plan)
    cache.manager.check()


@pytest.mark.parametrize("bad", ["k_rows", "v_dtype", "layer", "dead_plan"])
def test_pre_silu_attend_checks_before_writing(bad):
    model, cache, plan, layout, (u, q, k, v), before = _begun(2)
    layer, index = model.layers[0], 0
    if bad == "k_rows":
        k, match = k[:-1], "must have shape"
    elif bad == "v_dtype":
        v, match = v.double(), "v must be torch.float32"
    elif bad == "layer":
        index, match = model.config.num_layers, "out of range"
    else:  # a plan no longer in flight: its pages may be another step's now
        cache.abort(plan)
        match = "not in flight"
    with torch.no_grad(), pytest.raises(ValueError, match=match):
        cache.attend(index, q, k, v, layout, plan, alpha=layer.alpha, n_norm=layer.n_norm,
                     norm_gate=layer.norm_gate(u), activated=False)
    assert torch.equal(cache.kv_table, before)
    if bad != "dead_plan":
        cache.abort(plan)  # the plan stays in flight: a failed call leaves it to its owner
    cache.manager.check()


@pytest.mark.parametrize("kwargs, activated", [({}, True), ({"silu_pass": True}, True),
                                               ({"silu_pass": False}, False)])
def test_forward_cached_hands_each_layer_the_form_asked(kwargs, activated, monkeypatch):
    """The switch reaches every layer's attend, and the default is the activated-first form (the
    tolerance of the equality test above cannot tell the two forms apart)."""
    model = tiny_model()
    cache = tiny_cache(model)
    _, users = _visits(3)
    seen, attend = [], cache.attend

    def spy(*args, **kw):
        seen.append(kw["activated"])
        return attend(*args, **kw)

    monkeypatch.setattr(cache, "attend", spy)
    cands = [u.candidates(2) for u in users]
    got, _ = cached_scores(model, cache, users, cands, **kwargs)
    assert seen == [activated] * model.config.num_layers
    torch.testing.assert_close(got, full_scores(model, users, cands), rtol=1e-4, atol=1e-4)
