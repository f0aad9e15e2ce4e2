"""The gr_kv custom ops: opcheck (schema, fake, mutation, dynamic shapes) and agreement with the
direct calls."""

import pytest
import torch

from gr_plugin.cache import paged_ops
from gr_plugin.ops import library  # noqa: F401 - registers gr_kv::*
from gr_plugin.ops.pytorch import hstu_attention as ref

from .test_triton_attention import build

OPS = torch.ops.gr_kv


def _paged(device="cpu", dtype=torch.float32):
    _, paged = build([37, 0, 20], [3, 2, 1], [20, 0, 20], 8, 2, 16, dtype, device)
    return paged


def test_opcheck_paged_attention():
    p = _paged()
    args = (p["q"], p["k"], p["v"], p["kv_layer"], p["kv_indices"], p["kv_indptr"], p["history_lengths"],
            p["q_offsets"], p["new_lengths"], 0.3, 16.0)
    torch.library.opcheck(OPS.paged_hstu_attention.default, args)
    want = ref.paged_hstu_attention(*args[:9], alpha=0.3, n_norm=16.0, max_q_len=p["max_q_len"],
                                    max_history_len=p["max_history_len"], num_history_tokens=p["num_history_tokens"])
    torch.testing.assert_close(OPS.paged_hstu_attention(*args), want, rtol=0, atol=0)


def test_opcheck_jagged_attention():
    jag, _ = build([37, 5], [3, 2], [0, 0], 8, 2, 16, torch.float32, "cpu")
    args = (jag["q"], jag["k"], jag["v"], jag["seq_offsets"], jag["num_candidates"], 0.3, 16.0)
    torch.library.opcheck(OPS.hstu_attention_jagged.default, args)


def test_opcheck_append_mutates_the_table_only():
    table = torch.randn(5, 2, 4, 2, 16)
    k, v = torch.randn(9, 2, 16), torch.randn(9, 2, 16)
    slots, rows = torch.tensor([0, 5, 19]), torch.tensor([8, 0, 3])
    torch.library.opcheck(OPS.append_kv.default, (table.clone(), k, v, slots, rows))
    want = table.clone()
    paged_ops.append_kv(want, k, v, slots, rows)
    OPS.append_kv(table, k, v, slots, rows)
    assert torch.equal(table, want)


@pytest.mark.parametrize(
    ("mutate", "match"),
    [
        (lambda a: a.update(k=a["k"].double()), "float64"),
        (lambda a: a.update(kv_indices=a["kv_indices"].int()), "kv_indices must be a 1-D int64"),
        (lambda a: a.update(q=a["q"][:-1]), "share a shape"),
        (lambda a: a.update(kv_layer=a["kv_layer"][:, :1]), r"\[num_pages, 2, P, H, D\]"),
    ],
)
def test_bad_inputs_are_named(mutate, match):
    p = _paged()
    table_before = p["kv_layer"].clone()
    mutate(p)
    with pytest.raises(ValueError, match=match):
        OPS.paged_hstu_attention(p["q"], p["k"], p["v"], p["kv_layer"], p["kv_indices"], p["kv_indptr"],
                                 p["history_lengths"], p["q_offsets"], p["new_lengths"], 0.3, 16.0)
    assert torch.equal(_paged()["kv_layer"], table_before)


def test_append_rejects_mismatched_rows_without_writing():
    table = torch.zeros(5, 2, 4, 2, 16)
    with pytest.raises(ValueError, match="slots has 2 entries, rows has 1"):
        OPS.append_kv(table, torch.ones(3, 2, 16), torch.ones(3, 2, 16), torch.tensor([0, 1]), torch.tensor([0]))
    assert table.abs().sum() == 0
