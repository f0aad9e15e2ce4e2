"""Request streams for the C++ runner (gr_plugin.export.stream): what is written reads back exactly,
Python's package inputs are saved per batch, and bad streams or caches are clear errors."""

from __future__ import annotations

import pytest
import torch

from gr_plugin.export.model import INPUT_NAMES, program_inputs
from gr_plugin.export.stream import StreamBatch, read_stream, record_stream
from gr_plugin.modules import cache_token_keys

from ..modules.helpers import User, make_inputs, tiny_cache, tiny_model


def _batches(users, visits):
    out = []
    for grow, ncand in visits:
        for u in users:
            u.grow(grow)
        history, candidates, _, _ = make_inputs(users, [u.candidates(ncand + u.uid) for u in users])
        out.append(StreamBatch([u.uid for u in users], history, candidates))
    return out


def test_stream_round_trip(tmp_path):
    model = tiny_model(0, head_dim=16)
    g = torch.Generator().manual_seed(0)
    users = [User(u, g) for u in range(2)]
    batches = (_batches(users, [(6, 1), (3, 2), (0, 1)]))
    path = record_stream(model, tiny_cache(model, backend="gpu"), batches, tmp_path / "s")
    s = read_stream(path)
    assert s.header["page_size"] == 4 and s.header["num_batches"] == 3 and s.header["namespace"] == "default"
    assert s.arrays["batch_offsets"].tolist() == [0, 2, 4, 6]
    assert s.arrays["cached_lengths"].tolist() == [0, 0, 6, 6, 9, 9]
    replay = tiny_cache(model, backend="gpu")
    for t, want in enumerate(batches):
        got = s.batch(t)
        assert got.user_ids == want.user_ids
        assert torch.equal(got.history.values(), want.history.values())
        assert torch.equal(got.candidates.values(), want.candidates.values())
        with torch.no_grad():
            assert (s.scores(t) - model(want.history, want.candidates)).abs().max() <= 1e-5
        # the saved inputs are what program_inputs builds for the same cache state
        h, c = want.history, want.candidates
        ev = h.values().view(3, -1)
        plan = replay.begin(want.user_ids, h.lengths()[:2].tolist(), cache_token_keys(ev[0], ev[1], ev[2]))
        inputs = program_inputs(model, replay.kv_table, h, c, plan)
        replay.commit(plan)
        sizes = s.arrays["input_sizes"][t].tolist()
        start = int(s.arrays["input_sizes"][:t].sum())
        flat = s.arrays["input_values"][start : start + sum(sizes)].split(sizes)
        for name, value in zip(INPUT_NAMES, flat):
            assert torch.equal(value, getattr(inputs, name).reshape(-1)), name


def test_stream_errors(tmp_path):
    model = tiny_model(0, head_dim=16)
    g = torch.Generator().manual_seed(1)
    users = [User(u, g) for u in range(2)]
    batches = (_batches(users, [(5, 1)]))
    with pytest.raises(ValueError, match="no SSD or remote tier"):
        record_stream(model, tiny_cache(model, backend="flexkv"), batches, tmp_path / "a")
    # the host tier: its size goes in the header (the runner keeps one as big)
    hosted = read_stream(record_stream(model, tiny_cache(model, backend="native", host_pages=12), batches,
                                       tmp_path / "h"))
    with pytest.raises(ValueError, match="write_through=True"):
        cache = tiny_cache(model, backend="native")
        cache.manager.write_through = False
        record_stream(model, cache, batches, tmp_path / "w")
    assert hosted.header["host_slots"] == 12 and "host_slots" not in read_stream(
        record_stream(model, tiny_cache(model, backend="gpu"), batches, tmp_path / "g")).header
    # a batch that does not fit is recorded as a full pass: nothing cached, full recomputation's scores
    small = read_stream(record_stream(model, tiny_cache(model, backend="gpu", num_pages=2), batches, tmp_path / "b"))
    assert int(small.arrays["cached_lengths"].sum()) == 0
    with torch.no_grad():
        full = model(small.batch(0).history, small.batch(0).candidates)
    assert (small.scores(0) - full).abs().max().item() <= 1e-6
    path = record_stream(model, tiny_cache(model, backend="gpu"), batches, tmp_path / "c")
    (path / "scores.bin").write_bytes((path / "scores.bin").read_bytes()[:-1])
    with pytest.raises(ValueError, match=r"scores\.bin has 23 bytes, the header says 24"):
        read_stream(path)
    with pytest.raises(ValueError, match="is not a stream"):
        read_stream(tmp_path / "missing")


def test_array_names_cannot_leave_the_stream_directory(tmp_path):
    from gr_plugin.export.stream import FORMAT, VERSION, read_stream

    (tmp_path / "header.txt").write_text(f"{FORMAT} {VERSION}\narray ../x int64 1\n")
    with pytest.raises(ValueError, match="bad array line"):
        read_stream(tmp_path)
