from array import array

import torch

from gr_plugin.cache import build_metadata


def test_hand_computed_batch():
    # user 0: 5 cached + 4 new = 9 tokens on pages [7, 2, 5] (page 4); user 1: 0 cached, 3 new on [1].
    meta = build_metadata([array("q", [7, 2, 5]), array("q", [1])], [5, 0], [9, 3], 4, torch.device("cpu"))
    assert meta.kv_indptr.tolist() == [0, 3, 4]
    assert meta.kv_indices.tolist() == [7, 2, 5, 1]
    assert meta.kv_last_page_len.tolist() == [1, 3]
    assert meta.cached_lengths.tolist() == [5, 0]
    assert meta.new_lengths.tolist() == [4, 3]
    assert meta.total_lengths.tolist() == [9, 3]
    assert meta.new_offsets.tolist() == [0, 4, 7]
    assert meta.total_offsets.tolist() == [0, 9, 12]
    assert meta.new_token_batch.tolist() == [0, 0, 0, 0, 1, 1, 1]
    assert meta.new_token_positions.tolist() == [5, 6, 7, 8, 0, 1, 2]
    # position 5 -> page 2 offset 1 = 9; 6 -> 10; 7 -> 11; 8 -> page 5 offset 0 = 20; user 1 -> 4, 5, 6
    assert meta.new_token_slots.tolist() == [9, 10, 11, 20, 4, 5, 6]
    assert (meta.num_new_tokens, meta.num_total_tokens, meta.num_batch_pages) == (7, 12, 4)
    assert (meta.max_new_len, meta.max_total_len, meta.batch_size) == (4, 9, 2)
    for t in (meta.kv_indices, meta.new_token_slots, meta.kv_indptr):
        assert t.dtype == torch.int64


def test_empty_history_user_has_no_pages():
    meta = build_metadata([array("q"), array("q", [3])], [0, 0], [0, 2], 4, torch.device("cpu"))
    assert meta.kv_indptr.tolist() == [0, 0, 1]
    assert meta.kv_last_page_len.tolist() == [0, 2]
    assert meta.new_token_slots.tolist() == [12, 13]
