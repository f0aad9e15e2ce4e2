"""`build_token_layout` against a per-user reference written from its contract."""

import pytest
import torch
from torchrec.sparse.jagged_tensor import KeyedJaggedTensor

from gr_plugin.modules import tokens
from gr_plugin.modules.tokens import EMBEDDING_KEYS, HISTORY_KEYS, build_token_layout, validate_values


def _inputs(g, hist_lens, cand_lens):
    b = len(hist_lens)
    total, num_c = sum(hist_lens), sum(cand_lens)
    item = torch.randint(1, 100, (total,), generator=g)
    action = torch.randint(0, 6, (total,), generator=g)
    time = torch.randint(0, 8, (total,), generator=g)
    history = KeyedJaggedTensor(keys=list(HISTORY_KEYS), values=torch.cat([item, action, time]),
                                lengths=torch.tensor(hist_lens * 3))
    cands = torch.randint(1, 100, (num_c,), generator=g)
    candidates = KeyedJaggedTensor(keys=["item"], values=cands, lengths=torch.tensor(cand_lens))
    assert history.stride() == b
    return history, candidates, (item, action, time, cands)


def _reference(cols, hist_lens, cand_lens, cached, max_positions):
    item, action, time, cands = cols
    feats, q_lens, new_rows, cand_rows = [[] for _ in EMBEDDING_KEYS], [], [], []
    h0 = c0 = row = 0
    for length, c, k in zip(hist_lens, cand_lens, cached):
        for p in range(k, length):
            for f, v in zip(feats, (item[h0 + p], action[h0 + p], time[h0 + p], min(p, max_positions - 1))):
                f.append(int(v))
            new_rows.append(row)
            row += 1
        for j in range(c):
            for f, v in zip(feats, (cands[c0 + j], 0, 0, min(length, max_positions - 1))):
                f.append(int(v))
            cand_rows.append(row)
            row += 1
        q_lens.append(length - k + c)
        h0, c0 = h0 + length, c0 + c
    return feats, q_lens, new_rows, cand_rows


@pytest.mark.parametrize("numpy_path", [True, False])
@pytest.mark.parametrize("host_ints", [False, True])
@pytest.mark.parametrize("seed", range(6))
def test_layout_matches_the_per_user_reference(seed, host_ints, numpy_path, monkeypatch):
    monkeypatch.setattr(tokens, "_HOST_NUMPY", numpy_path)  # False: the torch ops a device runs
    g = torch.Generator().manual_seed(seed)
    b = int(torch.randint(1, 6, (1,), generator=g))
    hist_lens = torch.randint(1, 40, (b,), generator=g).tolist()
    cand_lens = torch.randint(1, 7, (b,), generator=g).tolist()
    # all cached, none cached, and anything between (at least one event stays cached or new at random)
    cached = [int(torch.randint(0, n + 1, (1,), generator=g)) for n in hist_lens]
    cached[0] = hist_lens[0] if seed % 2 else 0
    history, candidates, cols = _inputs(g, hist_lens, cand_lens)
    max_positions = 32  # some positions clamp
    feats, q_lens, new_rows, cand_rows = _reference(cols, hist_lens, cand_lens, cached, max_positions)
    n, num_c = sum(q_lens), sum(cand_lens)
    args = (n, max(q_lens), num_c) if host_ints else (None, None, None)
    layout = build_token_layout(history, candidates, torch.tensor(cached), max_positions, *args)
    values = layout.features.values().view(len(EMBEDDING_KEYS), -1)
    for key, got, want in zip(EMBEDDING_KEYS, values, feats):
        assert got.tolist() == want, key
    assert layout.features.lengths().tolist() == q_lens * len(EMBEDDING_KEYS)
    assert layout.q_offsets.tolist() == [sum(q_lens[:i]) for i in range(b + 1)]
    assert layout.num_query_tokens == n and layout.max_q_len == max(q_lens)
    assert layout.new_rows.tolist() == new_rows and layout.candidate_rows.tolist() == cand_rows
    assert layout.new_lengths.tolist() == [h - k for h, k in zip(hist_lens, cached)]
    assert layout.history_lengths.tolist() == hist_lens and layout.candidate_lengths.tolist() == cand_lens


def test_validate_rejects_history_keys_of_different_lengths():
    history = KeyedJaggedTensor(keys=list(HISTORY_KEYS), values=torch.ones(7, dtype=torch.int64),
                                lengths=torch.tensor([2, 3, 2]))
    candidates = KeyedJaggedTensor(keys=["item"], values=torch.ones(1, dtype=torch.int64), lengths=torch.tensor([1]))
    with pytest.raises(ValueError, match="same length per user"):
        validate_values(history, candidates, num_items=10, num_actions=6, num_time_buckets=8)


def test_validate_names_an_out_of_range_id():
    g = torch.Generator().manual_seed(0)
    history, candidates, _ = _inputs(g, [3, 2], [1, 2])
    with pytest.raises(ValueError, match=r"^item id \d+ is outside the table range \[1, 5\]"):
        validate_values(history, candidates, num_items=5, num_actions=6, num_time_buckets=8)
    bad = KeyedJaggedTensor(keys=["item"], values=torch.tensor([7, 101, 3]), lengths=torch.tensor([1, 2]))
    with pytest.raises(ValueError, match=r"candidate item id 101 is outside the table range \[1, 100\]"):
        validate_values(history, bad, num_items=100, num_actions=6, num_time_buckets=8)


def test_cache_keys_without_checks_are_the_same_keys_and_fit_only_validated_tables():
    from gr_plugin.modules.tokens import cache_token_keys, keys_fit

    items, actions, times = torch.tensor([1, 2**38, 7]), torch.tensor([0, 255, 3]), torch.tensor([0, 65535, 9])
    assert torch.equal(cache_token_keys(items, actions, times, check=False), cache_token_keys(items, actions, times))
    with pytest.raises(ValueError, match="action id 256 is outside"):
        cache_token_keys(items, torch.tensor([0, 256, 3]), times)
    assert keys_fit(3706, 6, 32) and keys_fit(2**39 - 1, 256, 65536)
    assert not keys_fit(2**39, 6, 32) and not keys_fit(10, 257, 32) and not keys_fit(10, 6, 65537)
