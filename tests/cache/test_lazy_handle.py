"""The lazily launched onboard handle's bookkeeping, with stand-in events (its CUDA behaviour, what
lands when, is tests/gpu/test_gpu_paths.py::test_raw_onboard_launches_each_layer_when_it_is_waited_for)."""

import pytest

from gr_plugin.cache.transfer import TransferError, _LazyCudaHandle


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


def test_layer_zero_at_once_the_rest_when_everything_is_asked_for():
    log: list = []
    handle = _LazyCudaHandle(issuer(log), 4, 10)
    assert log == [("issue", 0)] and handle.num_layers == 4 and handle.num_pages == 10
    assert handle.done()  # done() launches every layer before it answers
    assert log == [("issue", 0), ("issue", 1), ("issue", 2), ("issue", 3)]
    handle.wait()  # waits on the last layer's event; nothing launched twice
    assert log[-1] == ("sync", 3) and [e for e in log if e[0] == "issue"] == log[:4]


def test_wait_launches_what_is_left():
    log: list = []
    handle = _LazyCudaHandle(issuer(log), 3, 1)
    handle.wait()
    assert log == [("issue", 0), ("issue", 1), ("issue", 2), ("sync", 2)]


def test_a_failed_launch_is_never_retried():
    log: list = []
    handle = _LazyCudaHandle(issuer(log, fail_at=2), 4, 1)
    with pytest.raises(RuntimeError, match="at layer 2"):
        handle.launch()
    assert log == [("issue", 0), ("issue", 1)]
    for call in (handle.launch, handle.wait, handle.done):
        with pytest.raises(TransferError, match="copy launch failed"):
            call()
    assert log == [("issue", 0), ("issue", 1)]


def test_a_failed_first_launch_raises_from_the_constructor():
    with pytest.raises(RuntimeError, match="at layer 0"):
        _LazyCudaHandle(issuer([], fail_at=0), 2, 1)
