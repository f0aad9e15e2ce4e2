import math
import time
import types

import pytest
import torch

from gr_plugin.bench import e2e


def test_stream_grows_every_history_by_stride():
    batches = e2e.stream(2, 3, 32, 96, 32, 8)
    seen: dict[int, list[int]] = {}
    for b in batches:
        assert b.batch_size <= 2
        assert b.candidate_lengths.tolist() == [8] * b.batch_size
        for u, n in zip(b.user_ids.tolist(), b.history_lengths.tolist()):
            seen.setdefault(u, []).append(n)
    assert seen == {u: [32, 64, 96] for u in (1, 2, 3)}


def test_stream_rejects_a_range_that_is_not_a_multiple_of_stride():
    with pytest.raises(ValueError, match="stride=32"):
        e2e.stream(2, 3, 32, 100, 32, 8)


def test_cached_engines_equal_full_recompute_on_cpu():
    (row,) = e2e.run(batch_sizes=(2,), num_users=3, min_len=32, max_len=96, stride=32, num_candidates=8, hidden=32,
                     layers=2, heads=2, head_dim=16, page_size=16, device="cpu")
    assert row["requests"] == 5 and row["batches"] == 6
    assert row["hit_rate"] > 0.3
    assert row["max_abs_diff"] < 1e-5
    # three pipelined passes per engine; on the CPU nothing runs asynchronously: the host never waits
    assert row["graph_host_busy_pipelined"] == 1.0 and row["graph_req_s_pipelined"] > 0


def test_pipelined_counts_the_time_blocked_on_the_step_before(monkeypatch):
    class SlowEvent:  # the step's logits land 20 ms after the host has moved on
        def synchronize(self):
            time.sleep(0.02)

    class Engine:
        def score(self, batch):
            time.sleep(0.005)  # the host's own work per step
            return types.SimpleNamespace(logits=torch.zeros(1))

    monkeypatch.setattr(e2e, "Fetcher", lambda cuda: lambda logits: (logits, SlowEvent()))
    seconds, waited = e2e._pipelined(Engine(), [None] * 5, cuda=False)
    # every step's wait counts once (4 inside the loop, the last after it); the host's own work never
    assert waited >= 5 * 0.02 and seconds - waited >= 5 * 0.005


def test_without_cuda_the_suite_fails_at_once(monkeypatch):
    """The suite is a GPU one (README); with no CUDA it used to fall back to the CPU at the default
    shapes and run for minutes without a line of output (UAT): now it is refused before any work."""
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)

    def no_work(*a, **k):
        raise AssertionError("built the stream before refusing")

    monkeypatch.setattr(e2e, "stream", no_work)
    with pytest.raises(ValueError, match="suite=e2e needs a CUDA device"):
        e2e.run(batch_sizes=(1,), num_users=4)
    with pytest.raises(ValueError, match=r"e2e\.device must be cuda or cpu"):
        e2e.run(batch_sizes=(1,), num_users=4, device="gpu")


def test_pipelined_rounds_must_be_a_positive_int():
    with pytest.raises(ValueError, match="pipelined_rounds must be an int >= 1, got 0"):
        e2e.run(batch_sizes=(2,), num_users=3, min_len=32, max_len=96, stride=32, pipelined_rounds=0, device="cpu")


def test_worst_diff_keeps_a_nan():
    assert e2e.worst_diff(0.0, 0.5) == 0.5 and e2e.worst_diff(0.5, 0.25) == 0.5
    assert math.isnan(e2e.worst_diff(0.0, math.nan)) and math.isnan(e2e.worst_diff(math.nan, 0.1))


def test_fetcher_off_cuda_hands_back_the_logits():
    logits = torch.arange(6.0).view(3, 2)
    out, done = e2e.Fetcher(False)(logits)
    assert out is logits and done is None


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="gpu: no CUDA device here")
def test_fetcher_brings_each_step_back_through_two_reused_buffers():
    """`Fetcher` on the GPU: each step's logits arrive intact once its event is waited for, with the
    step before still pending (one step in flight); the two buffers are reused, and grown for a
    step with more rows."""
    fetch = e2e.Fetcher(True)
    pending, seen = None, []
    for i, rows in enumerate([4, 4, 3, 9, 2, 9]):
        logits = torch.full((rows, 2), float(i), device="cuda")
        out, done = fetch(logits)
        if pending is not None:
            pending[1].synchronize()
            assert torch.equal(pending[0], pending[2]), f"step {i - 1} came back wrong"
        pending = (out, done, logits.cpu())
        seen.append(out.untyped_storage().data_ptr())
    pending[1].synchronize()
    assert torch.equal(pending[0], pending[2])
    assert seen[0] == seen[2] == seen[4] and seen[3] == seen[5]  # reused (slot 1 grown at step 3, then kept)
    assert [b.numel() for b in fetch._buffers] == [8, 18]


def test_interleaved_us_times_every_form_in_turn():
    from gr_plugin.bench.common import interleaved_us

    order = []
    forms = {"a": lambda: order.append("a"), "b": lambda: (order.append("b"), time.sleep(0.002))}
    times = interleaved_us(forms, 3)
    assert order == ["a", "b"] * 3  # call by call, not form by form
    assert [len(t) for t in times.values()] == [3, 3] and min(times["b"]) >= 2000  # µs: b sleeps 2 ms a call
