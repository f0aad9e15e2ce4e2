from array import array

import pytest
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


@pytest.mark.gpu
def test_device_metadata_moves_on_first_read_and_never_inside_a_capture():
    """A graphed step packs the host buffer itself: the device copy is made only when a field or
    the buffer is first read, on the current stream, and a first read inside a CUDA graph capture
    is refused (the graph would keep the copy's pinned source, freed after the step)."""
    if not torch.cuda.is_available():
        pytest.skip("gpu: no CUDA device here")
    pages, cached, total = [array("q", [7, 2, 5]), array("q", [1])], [5, 0], [9, 3]
    host = build_metadata(pages, cached, total, 4, torch.device("cpu"))
    meta = build_metadata(pages, cached, total, 4, torch.device("cuda"))
    assert meta._buffer is None and meta.device == torch.device("cuda", torch.cuda.current_device())
    assert meta.kv_indices.is_cuda and torch.equal(meta.buffer.cpu(), host.buffer)
    assert torch.equal(meta.new_token_slots.cpu(), host.new_token_slots)
    early = build_metadata(pages, cached, total, 4, torch.device("cuda"))
    assert early.start_copy() is early and early._buffer is not None and early.buffer is early._buffer
    unread = build_metadata(pages, cached, total, 4, torch.device("cuda"))
    g, stream = torch.cuda.CUDAGraph(), torch.cuda.Stream()
    with torch.cuda.stream(stream), pytest.raises(RuntimeError, match="inside a CUDA graph capture"):
        with torch.cuda.graph(g, stream=stream):
            _ = unread.kv_indptr
    assert unread._buffer is None
