"""Bounds checks of the C++ CPU kernels (gr_plugin/csrc/gr_kv_ops.cpp) found by review. Each call runs
in a forked child: without the checks these inputs crash the process (SIGFPE / SIGSEGV)."""

from __future__ import annotations

import pytest
import torch

import gr_plugin.ops.library  # noqa: F401  (loads the gr_kv ops)
from tests.crash import run_in_child

H, D = 1, 2
_Q = torch.ones(1, H, D)  # one candidate query of one user (1 task: the kernel runs inline, no OpenMP)


def _paged(kv_layer, history_lengths):
    return torch.ops.gr_kv.paged_hstu_attention(
        _Q, _Q, _Q, kv_layer, torch.zeros(0, dtype=torch.int64), torch.tensor([0, 0]),
        torch.tensor(history_lengths), torch.tensor([0, 1]), torch.tensor([0]), 1.0, 1.0)


def test_paged_attention_zero_page_size_raises_value_error():
    # kv_layer [num_pages, 2, P=0, H, D]: the page count (hist + P - 1) / P divides by zero.
    outcome = run_in_child(lambda: _paged(torch.zeros(4, 2, 0, H, D), [1]))
    assert outcome[0] == "value_error", outcome


def test_paged_attention_history_length_overflow_is_rejected():
    # (hist + P - 1) overflows int64: the page count goes negative, the kv_indptr and kv_indices
    # checks pass for 0 pages, and the kernel reads kv_indices[0] of an empty tensor and on.
    outcome = run_in_child(lambda: _paged(torch.zeros(4, 2, 4, H, D), [2**63 - 1]))
    assert outcome[0] == "value_error", outcome


def test_append_rejects_a_slot_written_twice_and_writes_nothing():
    table = torch.zeros(2, 2, 4, H, D)
    k = v = torch.ones(3, H, D)
    with pytest.raises(ValueError, match="slots has slot 5 more than once"):
        torch.ops.gr_kv.append_kv(table, k, v, torch.tensor([5, 1, 5]), torch.tensor([0, 1, 2]))
    assert not table.any()
