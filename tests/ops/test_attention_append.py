"""The paged attention's ``append``: the step's new tokens are not in the pages yet; the op writes
them into their page slots itself (the Triton kernel within its own launch) and attends as if they
were there. Its result and the table it leaves must equal the separate append followed by the
attention. The new tokens' slots start as NaN, so a read of a slot before its write would show."""

import pytest
import torch

from gr_plugin import ops
from gr_plugin.ops.triton import hstu_attention as tri

from .test_attention_norm_gate import gate_for
from .test_triton_attention import CASES, build, run

DEVICES = [pytest.param("cpu", id="interpreter"), pytest.param("cuda", marks=pytest.mark.gpu, id="gpu")]


def interpreter_only(device):
    if device == "cpu" and torch.cuda.is_available():
        pytest.skip("the interpreter runs where there is no GPU")


def new_slots(paged):
    """``[(page, offset)]`` of every new token (history positions ``cached`` on)."""
    page_size = paged["kv_layer"].shape[-3]
    out = []
    indices, indptr = paged["kv_indices"].tolist(), paged["kv_indptr"].tolist()
    for b, (hist, new) in enumerate(zip(paged["history_lengths"].tolist(), paged["new_lengths"].tolist())):
        for pos in range(hist - new, hist):
            out.append((indices[indptr[b] + pos // page_size], pos % page_size))
    return out


def without_new_tokens(paged):
    """``paged`` with the new tokens' page slots set to NaN (the table before this step's append)."""
    table = paged["kv_layer"].clone()
    for page, off in new_slots(paged):
        table[page, :, off] = float("nan")
    return {**paged, "kv_layer": table}


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize(("hist", "cand", "cached"), [*CASES, ([300, 520], [40, 9], [250, 460])])
@pytest.mark.parametrize(("page_size", "splits", "gated"), [(8, 1, False), (64, 3, True), (16, None, True)])
def test_append_in_the_attention_equals_append_then_attention(device, hist, cand, cached, page_size, splits, gated):
    interpreter_only(device)
    dtype = torch.float32 if device == "cpu" else torch.bfloat16
    dim = 16 if device == "cpu" else 128
    _, paged = build(hist, cand, cached, page_size, 2, dim, dtype, device)
    extra = {} if splits is None else {"num_splits": splits}
    if gated:
        extra["norm_gate"] = tuple(gate_for(paged["q"]))
    want = run(tri, "paged", {**paged, **extra})
    before = without_new_tokens(paged)
    got = run(tri, "paged", {**before, **extra, "append": True})
    assert torch.equal(got, want)
    assert torch.equal(before["kv_layer"], paged["kv_layer"])  # every new slot written, nothing else touched


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("programs", [3, 7])
def test_append_under_stream_k(device, programs):
    interpreter_only(device)
    dtype = torch.float32 if device == "cpu" else torch.bfloat16
    _, paged = build([37, 0, 90], [3, 2, 1], [20, 0, 64], 8, 2, 16, dtype, device)
    launch = {"schedule": "stream", "programs": programs}
    want = run(tri, "paged", {**paged, **launch})
    before = without_new_tokens(paged)
    got = run(tri, "paged", {**before, **launch, "append": True})
    assert torch.equal(got, want)
    assert torch.equal(before["kv_layer"], paged["kv_layer"])


@pytest.mark.parametrize("mode", ["reference", "triton"])
def test_dispatch_appends_on_either_path(monkeypatch, mode):
    """`ops.paged_hstu_attention(append=True)`: the reference appends with `paged_ops.append_kv` first."""
    interpreter_only("cpu")
    monkeypatch.setenv("GR_PLUGIN_ATTENTION", mode)
    _, paged = build([37, 0, 90], [3, 2, 1], [20, 0, 64], 8, 2, 16, torch.float32, "cpu")
    gate = gate_for(paged["q"])
    want = run(ops, "paged", {**paged, "norm_gate": gate})
    before = without_new_tokens(paged)
    got = run(ops, "paged", {**before, "norm_gate": gate, "append": True})
    torch.testing.assert_close(got, want, rtol=0, atol=0)
    assert torch.equal(before["kv_layer"], paged["kv_layer"])


def test_jagged_form_refuses_append():
    jag, _ = build([37], [3], [20], 8, 2, 16, torch.float32, "cpu")
    with pytest.raises(ValueError, match="append applies to the paged form"):
        run(tri, "jagged", {**jag, "append": True})
