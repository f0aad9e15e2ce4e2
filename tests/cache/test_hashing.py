import torch
from hypothesis import given
from hypothesis import strategies as st

from gr_plugin.cache.hashing import StreamHasher, longest_matching_prefix, namespace_seed, prefix_hash


def test_stream_equals_one_shot_and_seed_separates_namespaces():
    t = torch.arange(40, dtype=torch.int64).view(20, 2)
    s = namespace_seed("m1")
    h = StreamHasher(s)
    h.update(t, 0, 8)
    assert h.digest() == prefix_hash(t, 0, 8, s)
    assert h.digest_with(t, 8, 11) == prefix_hash(t, 0, 11, s)
    assert h.num_tokens == 8
    assert prefix_hash(t, 0, 8, namespace_seed("m2")) != prefix_hash(t, 0, 8, s)


def test_every_feature_is_part_of_identity():
    a = torch.zeros(8, 3, dtype=torch.int64)
    b = a.clone()
    b[5, 2] = 1  # only the third feature differs
    assert prefix_hash(a, 0, 8, 1) != prefix_hash(b, 0, 8, 1)
    assert prefix_hash(a, 0, 5, 1) == prefix_hash(b, 0, 5, 1)


@given(st.integers(0, 12), st.integers(0, 60), st.integers(1, 5))
def test_longest_matching_prefix_is_first_differing_page(edit_page, length, page_size):
    seed = 7
    stored_tokens = torch.arange(64, dtype=torch.int64)
    stored = [prefix_hash(stored_tokens, 0, (i + 1) * page_size, seed) for i in range(64 // page_size)]
    req = stored_tokens[:length].clone()
    edit = edit_page * page_size
    if edit < length:
        req[edit] += 100
    got = longest_matching_prefix(stored, req, 0, length, page_size, seed)
    want = min(length // page_size, edit_page if edit < length else 10**9, len(stored))
    assert got == want
