"""The lazily launched onboard handle's bookkeeping, with stand-in events (its CUDA behaviour, what
lands when, is tests/gpu/test_gpu_paths.py::test_raw_onboard_launches_each_layer_when_it_is_waited_for)."""

import pytest
import torch

from gr_plugin.cache.transfer import TransferError, _LazyCudaHandle, grouped_issue, layer_spans


class Event:
    def __init__(self, layer: int, log: list) -> None:
        self.layer, self.log = layer, log

    def synchronize(self) -> None:
        self.log.append(("sync", self.layer))

    def query(self) -> bool:
        return True


def issuer(log: list, fail_at: int | None = None):
    def issue(layer: int) -> Event:
        if layer == fail_at:
            raise RuntimeError(f"cudaMemcpyAsync failed at layer {layer}")
        log.append(("issue", layer))
        return Event(layer, log)
    return issue


def test_layers_zero_and_one_at_once_the_rest_when_everything_is_asked_for():
    log: list = []
    handle = _LazyCudaHandle(issuer(log), 4, 10)
    assert log == [("issue", 0), ("issue", 1)] and handle.num_layers == 4 and handle.num_pages == 10
    assert handle.done()  # done() launches every layer before it answers
    assert log == [("issue", 0), ("issue", 1), ("issue", 2), ("issue", 3)]
    handle.wait()  # waits on the last layer's event; nothing launched twice
    assert log[-1] == ("sync", 3) and [e for e in log if e[0] == "issue"] == log[:4]


class Stream:
    """The caller's stream: records which layer's event it was made to wait for."""

    def __init__(self, log: list) -> None:
        self.log = log

    def wait_event(self, event: Event) -> None:
        self.log.append(("wait", event.layer))


def test_each_wait_launches_one_layer_ahead(monkeypatch):
    log: list = []
    monkeypatch.setattr(torch.cuda, "current_stream", lambda: Stream(log))
    handle = _LazyCudaHandle(issuer(log), 4, 1)
    handle.wait_layer(0)
    assert log == [("issue", 0), ("issue", 1), ("wait", 0)]  # layer 1 was queued behind layer 0
    handle.wait_layer(1)
    assert log[-2:] == [("wait", 1), ("issue", 2)]  # the wait first, then the next layer's copy
    handle.wait_layer(3)  # up to 3 (and nothing past the last layer)
    assert log[-2:] == [("issue", 3), ("wait", 3)]
    one = _LazyCudaHandle(issuer(log := []), 1, 1)
    one.wait_layer(0)
    assert log == [("issue", 0), ("wait", 0)]


def test_wait_launches_what_is_left():
    log: list = []
    handle = _LazyCudaHandle(issuer(log), 3, 1)
    handle.wait()
    assert log == [("issue", 0), ("issue", 1), ("issue", 2), ("sync", 2)]


def test_a_failed_look_ahead_waits_for_what_went_and_raises_at_the_next_call():
    log: list = []
    handle = _LazyCudaHandle(issuer(log, fail_at=1), 3, 1)  # layer 0 went, layer 1 failed
    assert log == [("issue", 0), ("sync", 0)]  # layer 0's copy has run before anything can free its pages
    for call in (lambda: handle.wait_layer(0), handle.wait, handle.done):
        with pytest.raises(TransferError, match="at layer 1"):
            call()
    assert log == [("issue", 0), ("sync", 0)]  # nothing launched or waited for again


def test_a_failed_launch_is_never_retried():
    log: list = []
    handle = _LazyCudaHandle(issuer(log, fail_at=2), 4, 1)
    with pytest.raises(RuntimeError, match="at layer 2"):
        handle.launch()  # (layers 0 and 1 went at construction)
    assert log == [("issue", 0), ("issue", 1), ("sync", 1)]
    for call in (handle.launch, handle.wait, handle.done):
        with pytest.raises(TransferError, match="copy launch failed"):
            call()
    assert log == [("issue", 0), ("issue", 1), ("sync", 1)]


def test_a_layer_that_fails_partway_is_waited_for_through_the_mark():
    """A layer whose launch failed after some of its runs were queued: ``mark`` records an event
    behind them, and that is what the handle waits for."""
    log: list = []
    handle = _LazyCudaHandle(issuer(log, fail_at=1), 2, 1, mark=lambda: Event("mark", log))
    assert log == [("issue", 0), ("sync", "mark")]
    with pytest.raises(TransferError):
        handle.wait()


def test_a_layer_zero_issued_by_the_caller_is_not_issued_again():
    """The engine queues layer 0's copies before building the handle (``first``: their event)."""
    log: list = []
    handle = _LazyCudaHandle(issuer(log), 3, 1, first=Event(0, log))
    assert log == [("issue", 1)]  # only the look-ahead
    handle.wait()
    assert log == [("issue", 1), ("issue", 2), ("sync", 2)]
    one = _LazyCudaHandle(issuer(log := []), 1, 1, first=Event(0, log))
    assert log == [] and one.done()


def test_a_failed_look_ahead_behind_a_caller_issued_layer_0_waits_through_the_mark():
    log: list = []
    handle = _LazyCudaHandle(issuer(log, fail_at=1), 3, 1, mark=lambda: Event("mark", log), first=Event(0, log))
    assert log == [("sync", "mark")]  # whatever layer 1 queued, and layer 0, have run
    for call in (lambda: handle.wait_layer(0), handle.wait, handle.done):
        with pytest.raises(TransferError, match="at layer 1"):
            call()
    assert log == [("sync", "mark")]


def test_a_failed_first_launch_raises_from_the_constructor():
    log: list = []
    with pytest.raises(RuntimeError, match="at layer 0"):
        _LazyCudaHandle(issuer(log, fail_at=0), 2, 1)
    assert log == []  # nothing was queued, nothing to wait for


def test_a_deeper_look_ahead_keeps_that_many_layers_queued(monkeypatch):
    log: list = []
    monkeypatch.setattr(torch.cuda, "current_stream", lambda: Stream(log))
    handle = _LazyCudaHandle(issuer(log), 6, 1, ahead=3)
    assert log == [("issue", 0), ("issue", 1), ("issue", 2), ("issue", 3)]
    handle.wait_layer(0)  # layers 1..3 already queued: nothing new
    assert log[-1] == ("wait", 0) and len(log) == 5
    handle.wait_layer(1)
    assert log[-2:] == [("wait", 1), ("issue", 4)]
    handle.wait_layer(4)  # 5 is past 4 + 3 clipped to the last layer
    assert log[-2:] == [("wait", 4), ("issue", 5)]
    everything = _LazyCudaHandle(issuer(log := []), 3, 1, ahead=8)  # more than there are: all at once
    assert log == [("issue", 0), ("issue", 1), ("issue", 2)] and everything.done()
    with pytest.raises(ValueError, match="ahead must be at least 1 layer, got 0"):
        _LazyCudaHandle(issuer([]), 3, 1, ahead=0)


def test_a_failed_deeper_look_ahead_waits_for_what_went_and_raises_at_the_next_call():
    log: list = []
    handle = _LazyCudaHandle(issuer(log, fail_at=2), 4, 1, ahead=3)  # layers 0 and 1 went, 2 failed
    assert log == [("issue", 0), ("issue", 1), ("sync", 1)]
    for call in (lambda: handle.wait_layer(0), handle.wait, handle.done):
        with pytest.raises(TransferError, match="at layer 2"):
            call()
    assert log == [("issue", 0), ("issue", 1), ("sync", 1)]


def test_the_transfer_engine_rejects_a_look_ahead_below_one_layer():
    from gr_plugin.cache.transfer import CudaTransferEngine

    for bad in (0, -1, 1.5, True):
        with pytest.raises(ValueError, match=f"onboard_lookahead must be None or an int of at least 1 layer, "
                                             f"got {bad!r}"):
            CudaTransferEngine(torch.device("cuda"), onboard_lookahead=bad)
    engine = object.__new__(CudaTransferEngine)  # (no CUDA here: the setter alone)
    engine.onboard_lookahead = 3
    with pytest.raises(ValueError, match="got 0"):
        engine.onboard_lookahead = 0
    assert engine.onboard_lookahead == 3  # a rejected value leaves the engine as it was
    engine.onboard_lookahead = None  # every layer at launch (the default)
    assert engine.onboard_lookahead is None


def pair_copier(log: list, fail_at: int | None = None):
    """``copy(layer, layers)`` for `grouped_issue`: logs the copy, returns the event after it."""
    def copy(layer: int, layers: int) -> Event:
        if layer == fail_at:
            raise RuntimeError(f"cudaMemcpy2DAsync failed at layer {layer}")
        log.append(("copy", layer, layers))
        return Event(layer, log)
    return copy


def test_grouped_layers_share_their_copy_and_its_event(monkeypatch):
    log: list = []
    monkeypatch.setattr(torch.cuda, "current_stream", lambda: Stream(log))
    handle = _LazyCudaHandle(grouped_issue(layer_spans(6), pair_copier(log)), 6, 1, ahead=1)  # 0 | 1 2 | 3 4 | 5
    assert log == [("copy", 0, 1), ("copy", 1, 2)]  # one ahead of layer 0 is layer 1: the pair 1 2
    handle.wait_layer(1)
    assert log[2:] == [("wait", 1)]  # layer 2, one ahead, was copied with layer 1: nothing new
    handle.wait_layer(2)
    assert log[3:] == [("wait", 1), ("copy", 3, 2)]  # layer 2 waits on the pair's event
    handle.wait()
    assert log[5:] == [("copy", 5, 1), ("sync", 5)]
    assert [e for e in log if e[0] == "copy"] == [("copy", 0, 1), ("copy", 1, 2), ("copy", 3, 2), ("copy", 5, 1)]


def test_a_failed_pair_waits_for_what_went_and_every_later_call_raises():
    log: list = []
    handle = _LazyCudaHandle(grouped_issue(layer_spans(6), pair_copier(log, fail_at=3)), 6, 1, ahead=6)
    assert log == [("copy", 0, 1), ("copy", 1, 2), ("sync", 1)]  # the pair 3 4 failed: what went has run
    for layer in (2, 3, 4):
        with pytest.raises(TransferError, match="at layer 3"):
            handle.wait_layer(layer)
    assert log == [("copy", 0, 1), ("copy", 1, 2), ("sync", 1)]
