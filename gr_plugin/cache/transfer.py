"""Asynchronous page copies between two KV tables, layer by layer.

Owns the copy engines and their handles; decides nothing about which pages move.
- `ThreadTransferEngine`: one worker thread runs copies in FIFO order (CPU tables, CI); each layer
  sets its own `threading.Event`.
- `CudaTransferEngine`: copies run on dedicated side streams (one host→device, one device→host);
  each layer's copy records a CUDA event (a raw onboard copies some layers in pairs, the pair's
  layers sharing its event). Host memory is pinned and staged through the caching host allocator,
  so nothing on the request path synchronises with the device.

A `CopyHandle` is the per-layer wait handle the model calls: ``wait_layer(l)`` returns once layer
``l`` is usable by the caller (on CUDA it only makes the current stream wait, without blocking the
host), ``wait()`` blocks until every layer is done, ``done()`` never blocks.
"""

from __future__ import annotations

import functools
import logging
import queue
import threading
import weakref
from abc import ABC, abstractmethod
from collections.abc import Callable
from typing import Any

import torch

from gr_plugin.cache import cudart
from gr_plugin.cache.cudart import raw_copier
from gr_plugin.cache.paged_ops import copy_pages

logger = logging.getLogger(__name__)


class TransferError(RuntimeError):
    """A page copy failed; the pages it was writing must not be published."""


class CopyHandle(ABC):
    num_layers: int
    num_pages: int

    @abstractmethod
    def wait_layer(self, layer: int) -> None: ...

    @abstractmethod
    def wait(self) -> None: ...

    @abstractmethod
    def done(self) -> bool: ...

    def check(self) -> None:
        """Raise `TransferError` if the (finished) copy failed; never blocks."""
        return None


class DoneHandle(CopyHandle):
    """A copy of nothing: every wait returns at once."""

    def __init__(self, num_layers: int = 0) -> None:
        self.num_layers = num_layers
        self.num_pages = 0

    def wait_layer(self, layer: int) -> None:
        return None

    def wait(self) -> None:
        return None

    def done(self) -> bool:
        return True


class TransferEngine(ABC):
    @abstractmethod
    def copy(
        self,
        src: torch.Tensor,
        src_pages: torch.Tensor,
        dst: torch.Tensor,
        dst_pages: torch.Tensor,
    ) -> CopyHandle:
        """Copy pages ``src[:, src_pages] -> dst[:, dst_pages]`` for every layer, asynchronously.

        ``src_pages``/``dst_pages`` are int64 CPU ``[n]``. Work already queued on the caller's
        stream (e.g. appends of the step being committed) is ordered before the copy.
        """

    def close(self) -> None:
        return None


class _ThreadHandle(CopyHandle):
    def __init__(self, num_layers: int, num_pages: int) -> None:
        self.num_layers = num_layers
        self.num_pages = num_pages
        self._events = [threading.Event() for _ in range(num_layers)]
        self.error: BaseException | None = None

    def _raise(self) -> None:
        if self.error is not None:
            raise TransferError(f"page copy failed: {self.error!r}") from self.error

    def wait_layer(self, layer: int) -> None:
        self._events[layer].wait()
        self._raise()

    def wait(self) -> None:
        if self.num_layers:
            self._events[-1].wait()
        self._raise()

    def done(self) -> bool:
        return not self.num_layers or self._events[-1].is_set()

    def check(self) -> None:
        self._raise()


class ThreadTransferEngine(TransferEngine):
    """Copies on one worker thread; the same code path as CUDA, for CPU tables."""

    def __init__(self, name: str = "gr-kv-transfer") -> None:
        self._queue: queue.SimpleQueue = queue.SimpleQueue()
        # NOTE: the worker holds the queue, not the engine, so a dropped engine is collected and
        # its finalizer stops the thread.
        self._thread = threading.Thread(target=_worker, args=(self._queue,), name=name, daemon=True)
        self._thread.start()
        self._finalizer = weakref.finalize(self, _stop_worker, self._queue, self._thread)

    def copy(self, src, src_pages, dst, dst_pages) -> CopyHandle:
        handle = _ThreadHandle(src.shape[0], src_pages.numel())
        if src_pages.numel() == 0:
            for ev in handle._events:
                ev.set()
            return handle
        self._queue.put((handle, lambda layer: copy_pages(src, src_pages, dst, dst_pages, layer)))
        return handle

    def close(self) -> None:
        self._finalizer()


def _worker(q: queue.SimpleQueue) -> None:
    while True:
        item = q.get()
        if item is None:
            return
        handle, fn = item
        try:
            for layer in range(handle.num_layers):
                fn(layer)
                handle._events[layer].set()
        except BaseException as exc:
            logger.exception("page copy failed")
            handle.error = exc
        finally:
            for ev in handle._events:
                ev.set()


def _stop_worker(q: queue.SimpleQueue, thread: threading.Thread) -> None:
    # NOTE: queued copies finish first (FIFO); a worker still inside a torch op while the
    # interpreter tears down would abort the process, and weakref.finalize runs at exit too.
    q.put(None)
    if thread is not threading.current_thread():
        thread.join(timeout=30)


class _CudaHandle(CopyHandle):
    def __init__(self, events: list, num_pages: int, finalize: Callable[[], None] | None) -> None:
        self.num_layers = len(events)
        self.num_pages = num_pages
        self._events = events
        self._finalize = finalize
        self._lock = threading.Lock()

    def wait_layer(self, layer: int) -> None:
        torch.cuda.current_stream().wait_event(self._events[layer])

    def _finish(self) -> None:
        with self._lock:
            if self._finalize is not None:
                fn, self._finalize = self._finalize, None
                fn()

    def wait(self) -> None:
        if self._events:
            self._events[-1].synchronize()
        self._finish()

    def done(self) -> bool:
        if self._events and not self._events[-1].query():
            return False
        self._finish()
        return True


def _drain(stream: torch.cuda.Stream) -> None:
    """Block until everything queued on ``stream`` so far has run (after a failed copy launch); a
    failure to wait (a broken CUDA context) is logged, not raised over the launch's own error."""
    try:
        ev = torch.cuda.Event()
        ev.record(stream)
        ev.synchronize()
    except Exception:
        logger.warning("waiting for a failed copy launch's queued copies failed", exc_info=True)


class _LazyCudaHandle(_CudaHandle):
    """An onboard whose copies are launched layer by layer, ``ahead`` layers ahead: layers
    ``0..ahead`` at once, layers up to ``i + ahead`` by the first ``wait_layer(j >= i)``, every
    layer by ``wait``, ``done`` or ``launch`` (``issue(layer)`` may copy more than that layer:
    `grouped_issue`). A failed launch first waits (host) for whatever this onboard had queued, a
    failed layer's first runs included (``mark`` records an event after them), so no copy of it is
    still writing when the error reaches a caller that frees its pages; from then on every call
    raises `TransferError` and nothing is launched again.

    The first layer's copy is what the first layer waits for, so it goes first; the later layers'
    copies go onto the copy stream behind it, fenced behind what the caller had queued at the
    launch. Launching only some layers ahead spreads their host time over the step's waits
    instead of spending it before the caller's first kernels; it keeps copies queued behind the
    one running only while the host's time from one wait to the next stays under a layer's copy
    (~75 µs at 2K tokens; the tiers profile at 1ee68ad showed a 79 µs gap before layer 1's copy
    with none ahead). How far ahead is `CudaTransferEngine`'s ``onboard_lookahead``, by default
    every layer: in the tiers bench's interleaved requests on a slow host, one layer ahead took
    0.747 ms at 2K tokens against 0.702 with every layer at launch; from 4K tokens on they were
    within the bench's resolution (~20 µs), and on a faster host at 2K within 5 µs
    (docs/BENCHMARKS.md, tiers). A manager reaping finished copies for another plan meanwhile
    calls ``done`` and so launches the rest early: correct, only not lazy. A caller that issued
    layer 0 itself (before building the handle, so the first copy goes without waiting for this
    bookkeeping) passes that layer's event as ``first``.
    """

    def __init__(self, issue: Callable[[int], torch.cuda.Event], num_layers: int, num_pages: int,
                 mark: Callable[[], torch.cuda.Event] | None = None, ahead: int = 1,
                 first: torch.cuda.Event | None = None) -> None:
        if ahead < 1:
            raise ValueError(f"ahead must be at least 1 layer, got {ahead}")
        super().__init__([] if first is None else [first], num_pages, None)
        self.num_layers = num_layers
        self.ahead = ahead
        self._issue, self._mark = issue, mark
        self._failed: BaseException | None = None
        self._upto(0)  # (nothing to do when the caller issued layer 0 itself: ``first``, its event)
        self._ahead(ahead)

    def _settle(self) -> None:
        """Block until every copy this onboard queued has run (after a failed launch)."""
        try:
            tail = self._mark() if self._mark is not None else None
        except Exception:  # the launched layers' events still cover their copies
            tail = None
        tail = tail if tail is not None else (self._events[-1] if self._events else None)
        if tail is not None:
            try:
                tail.synchronize()
            except Exception:
                logger.warning("waiting for a failed onboard's queued copies failed", exc_info=True)

    def _ahead(self, layer: int) -> None:
        """Launch up to ``layer`` (at most the last) now; a failure is kept for the next call to raise."""
        layer = min(layer, self.num_layers - 1)
        if layer >= len(self._events):
            try:
                self._upto(layer)
            except Exception:  # recorded in self._failed: every later call raises it
                logger.debug("an onboard's look-ahead copy launch failed", exc_info=True)

    def _upto(self, layer: int) -> None:
        with self._lock:
            if self._failed is not None:
                # NOTE: never retried: the manager may already have released the host slots of a
                # copy whose launch failed (it counts as a failed copy)
                raise TransferError(f"the onboard's copy launch failed: {self._failed}") from self._failed
            while len(self._events) <= layer:
                try:
                    self._events.append(self._issue(len(self._events)))
                except BaseException as exc:
                    self._failed = exc
                    self._settle()
                    raise

    def launch(self) -> None:
        self._upto(self.num_layers - 1)

    def wait_layer(self, layer: int) -> None:
        if not 0 <= layer < self.num_layers:
            raise ValueError(f"layer {layer} is outside [0, {self.num_layers})")
        self._upto(layer)
        super().wait_layer(layer)
        self._ahead(layer + self.ahead)

    def wait(self) -> None:
        self.launch()
        super().wait()

    def done(self) -> bool:
        self.launch()
        return super().done()


def _consecutive(slots: list[int]) -> bool:
    return slots == list(range(slots[0], slots[0] + len(slots)))


def contiguous_runs(slots: list[int]) -> list[tuple[int, int, int]]:
    """``(first index, first slot, length)`` of each run of consecutive slots, in order."""
    if slots and _consecutive(slots):
        return [(0, slots[0], len(slots))]  # the usual case, at C speed (a loop: ~0.3 µs a page)
    runs: list[tuple[int, int, int]] = []
    for i, s in enumerate(slots):
        if runs and s == runs[-1][1] + runs[-1][2] and i == runs[-1][0] + runs[-1][2]:
            first, start, n = runs[-1]
            runs[-1] = (first, start, n + 1)
        else:
            runs.append((i, s, 1))
    return runs


def joint_runs(src: list[int], dst: list[int]) -> list[tuple[int, int, int]]:
    """``(first src, first dst, length)`` of each run where both sides are consecutive."""
    if src and len(src) == len(dst) and _consecutive(src) and _consecutive(dst):
        return [(src[0], dst[0], len(src))]
    runs: list[tuple[int, int, int]] = []
    for s, d in zip(src, dst):
        if runs and s == runs[-1][0] + runs[-1][2] and d == runs[-1][1] + runs[-1][2]:
            a, b, n = runs[-1]
            runs[-1] = (a, b, n + 1)
        else:
            runs.append((s, d, 1))
    return runs


@functools.cache
def layer_spans(num_layers: int, grouped: bool = True) -> tuple[int, ...]:
    """How many layers each layer's onboard copy covers, 0 for a layer copied with the one before
    it. Grouped: layer 0 alone (the first layer waits only for it), layers from 1 on in pairs
    (one 2-D copy per run of pages), the last layer alone (the step's tail after the last copy is
    that one layer's work), and layer L-2 alone too when L is odd. Each copy fewer saves the copy
    engine ~3.5 µs, and a pair's first layer waits at most one layer's copy longer, which the
    copies still ahead of the step hide (docs/BENCHMARKS.md, tiers)."""
    spans = [1] * num_layers
    if grouped:
        for first in range(1, num_layers - 2, 2):
            spans[first], spans[first + 1] = 2, 0
    return tuple(spans)


def grouped_issue(spans: tuple[int, ...], copy: Callable[[int, int], Any]) -> Callable[[int], Any]:
    """`_LazyCudaHandle`'s ``issue`` over `layer_spans`: a span's first layer runs ``copy(layer,
    span)`` (its copies, then an event after them) and gets that event; a layer copied with the one
    before it gets the same event, and nothing is copied again. The handle issues layers in order,
    each once, and never again after a ``copy`` raised (else a later layer would get the event of
    the last pair that went)."""
    queued: list = []

    def issue(layer: int):
        if spans[layer]:
            queued.append(copy(layer, spans[layer]))
        return queued[-1]
    return issue


_UNSET = object()


class CudaTransferEngine(TransferEngine):
    """Copies between a CUDA table and a pinned host table on dedicated streams, an event per
    layer's copy (a raw onboard's pair of layers: one).

    Host slots are read and written in runs of consecutive slots, each run of a layer one
    ``cudaMemcpyAsync`` (launched raw through ctypes where it can be: `gr_plugin.cache.cudart`; a
    raw onboard copies a run of two layers as one 2-D copy, `layer_spans`) straight from/to the
    pinned host table (the host tier allocates a user's pages as one run when it can); else the
    device side goes through a device staging buffer and one
    gather/scatter kernel. When the host side is badly fragmented (more than ``max_runs`` runs) it
    falls back to gathering on the host into pinned staging first.
    """

    def __init__(self, device: torch.device, max_runs: int = 64, raw_copies: bool = True,
                 onboard_lookahead: int | None = None, group_layers: bool = True) -> None:
        self.onboard_lookahead = onboard_lookahead  # (checked before any stream is made)
        self.device = device
        self.max_runs = max_runs
        self.raw_copies = raw_copies  # False: every copy through Tensor.copy_ (the bench compares both)
        self.group_layers = group_layers  # False: a raw onboard copies every layer alone (`layer_spans`)
        self.h2d_stream = torch.cuda.Stream(device=device)
        self.d2h_stream = torch.cuda.Stream(device=device)
        self._index = device.index if device.index is not None else torch.cuda.current_device()
        self._copiers: dict[tuple, Callable | None] = {}
        self._fence_event: int | None = None
        self._fence_lock = threading.Lock()

    @property
    def onboard_lookahead(self) -> int | None:
        """Layers a raw onboard keeps queued past the last one waited for (`_LazyCudaHandle`; up to
        the end of the pair holding the last of them, `grouped_issue`); None: every layer's copies
        queued at launch, layer 0's first."""
        return self._lookahead

    @onboard_lookahead.setter
    def onboard_lookahead(self, layers: int | None) -> None:
        if layers is not None and (type(layers) is not int or layers < 1):
            raise ValueError(f"onboard_lookahead must be None or an int of at least 1 layer, got {layers!r}")
        self._lookahead = layers

    def _raw_copier(self, src: torch.Tensor, dst: torch.Tensor) -> Callable | None:
        """`raw_copier` of two tables, remembered per layout (the transfer engine's tables live long)."""
        if not self.raw_copies:
            return None
        key = (src.data_ptr(), src.shape, src.stride(), src.dtype, dst.data_ptr(), dst.shape, dst.stride(), dst.dtype)
        copier = self._copiers.get(key, _UNSET)  # no check-then-index: other threads may clear it
        if copier is _UNSET:
            copier = raw_copier(src, dst)
            if len(self._copiers) > 64:
                self._copiers.clear()
            self._copiers[key] = copier
        return copier

    def _fence(self, stream: torch.cuda.Stream) -> None:
        """``stream`` waits for what the caller queued on its current stream so far (raw calls: the
        Python ``wait_stream`` costs tens of µs on the request path)."""
        rt = cudart.runtime()
        with self._fence_lock:
            if self._fence_event is None:
                self._fence_event = rt.create_event()
            rt.fence(self._fence_event, stream.cuda_stream, torch._C._cuda_getCurrentRawStream(self._index))

    def copy(self, src, src_pages, dst, dst_pages) -> CopyHandle:
        n = src_pages.numel()
        if n == 0:
            return DoneHandle(src.shape[0])
        if dst.is_cuda and not src.is_cuda:
            copy, stream = self._onboard, self.h2d_stream
        elif src.is_cuda and not dst.is_cuda:
            copy, stream = self._offload, self.d2h_stream
        else:
            raise ValueError(f"CudaTransferEngine copies host<->device, got {src.device} -> {dst.device}")
        try:
            return copy(src, src_pages, dst, dst_pages)
        except BaseException:
            # NOTE: a failure partway through queuing leaves the copies queued before it in flight,
            # with no handle to wait on: wait for them here, so none is still writing when the error
            # reaches a caller that frees (and hands out again) the pages or slots it wrote into.
            _drain(stream)
            raise

    def _onboard(self, src, src_pages, dst, dst_pages) -> CopyHandle:
        num_layers, n = src.shape[0], src_pages.numel()
        stream = self.h2d_stream
        both = joint_runs(src_pages.tolist(), dst_pages.tolist())
        events = []
        raw = self._raw_copier(src, dst) if len(both) <= self.max_runs else None
        if raw is not None:
            # NOTE: host slots and device pages both consecutive: copy straight into the pages, one raw
            # copy per run and group of layers (`layer_spans`; gr_plugin.cache.cudart). The launch's
            # host time is what delays the first layer of a layerwise onboard, so no Python stream
            # context here.
            self._fence(stream)

            def copy(layer: int, layers: int) -> torch.cuda.Event:
                for s0, d0, length in both:
                    raw(layer, s0, d0, length, stream, layers)
                return mark()

            def mark() -> torch.cuda.Event:
                ev = torch.cuda.Event()
                ev.record(stream)
                return ev
            # NOTE: layer 0 first, then the handle's bookkeeping: the step's first wait is for these
            # copies, and until they are queued the copy engine idles (a failure here is
            # `CudaTransferEngine.copy`'s, which waits for whatever of layer 0 was queued before raising)
            issue = grouped_issue(layer_spans(num_layers, self.group_layers), copy)
            first = issue(0)
            return _LazyCudaHandle(issue, num_layers, n, mark, ahead=self.onboard_lookahead or num_layers, first=first)
        caller = torch.cuda.current_stream(self.device)
        if len(both) <= self.max_runs:
            # per-layer views of each run from one slice + unbind
            pairs = [(dst[:, d0 : d0 + length].unbind(0), src[:, s0 : s0 + length].unbind(0))
                     for s0, d0, length in both]
            with torch.cuda.stream(stream):
                stream.wait_stream(caller)
                for layer in range(num_layers):
                    for d, s in pairs:
                        d[layer].copy_(s[layer], non_blocking=True)
                    ev = torch.cuda.Event()
                    ev.record(stream)
                    events.append(ev)
            return _CudaHandle(events, n, None)
        runs = contiguous_runs(src_pages.tolist())
        with torch.cuda.stream(stream):
            stream.wait_stream(caller)
            idx = _pinned(dst_pages).to(self.device, non_blocking=True)
            stage = torch.empty((n, *src.shape[2:]), dtype=src.dtype, device=self.device)
            for layer in range(num_layers):
                if len(runs) <= self.max_runs:
                    for first, start, length in runs:
                        stage[first : first + length].copy_(src[layer, start : start + length], non_blocking=True)
                else:
                    host = torch.empty(stage.shape, dtype=src.dtype, pin_memory=True)
                    torch.index_select(src[layer], 0, src_pages, out=host)
                    stage.copy_(host, non_blocking=True)
                dst[layer].index_copy_(0, idx, stage)
                ev = torch.cuda.Event()
                ev.record(stream)
                events.append(ev)
        return _CudaHandle(events, n, None)

    def _offload(self, src, src_pages, dst, dst_pages) -> CopyHandle:
        caller = torch.cuda.current_stream(self.device)
        stream = self.d2h_stream
        both = joint_runs(src_pages.tolist(), dst_pages.tolist())
        if len(both) <= self.max_runs and dst.is_pinned():
            raw = self._raw_copier(src, dst)
            with torch.cuda.stream(stream):
                stream.wait_stream(caller)
                for layer in range(src.shape[0]):
                    for s0, d0, length in both:
                        if raw is not None:
                            raw(layer, s0, d0, length, stream)
                        else:
                            dst[layer, d0 : d0 + length].copy_(src[layer, s0 : s0 + length], non_blocking=True)
                ev = torch.cuda.Event()
                ev.record(stream)
            return _CudaHandle([ev], src_pages.numel(), None)
        runs = contiguous_runs(dst_pages.tolist())
        with torch.cuda.stream(stream):
            stream.wait_stream(caller)
            idx = _pinned(src_pages).to(self.device, non_blocking=True)
            gathered = src.index_select(1, idx)
            finalize = None
            if len(runs) <= self.max_runs and dst.is_pinned():
                for layer in range(src.shape[0]):
                    for first, start, length in runs:
                        dst[layer, start : start + length].copy_(gathered[layer, first : first + length],
                                                                 non_blocking=True)
            else:
                staged = torch.empty(gathered.shape, dtype=src.dtype, pin_memory=True)
                staged.copy_(gathered, non_blocking=True)

                def finalize() -> None:
                    dst.index_copy_(1, dst_pages, staged)

            ev = torch.cuda.Event()
            ev.record(stream)
        return _CudaHandle([ev], src_pages.numel(), finalize)


def _pinned(t: torch.Tensor) -> torch.Tensor:
    out = torch.empty(t.shape, dtype=t.dtype, pin_memory=True)
    out.copy_(t)
    return out


def make_transfer_engine(device: torch.device) -> TransferEngine:
    if device.type == "cuda":
        return CudaTransferEngine(device)
    return ThreadTransferEngine()
