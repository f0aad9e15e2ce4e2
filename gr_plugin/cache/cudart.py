"""``cudaMemcpyAsync`` of the CUDA runtime torch already loaded, called through ctypes.

Owns finding that runtime and launching raw copies of contiguous byte ranges (and 2-D copies of
equally spaced ranges: one run of pages of several layers) on a stream. A copy
launched this way costs about a microsecond of host time, against ~10 µs for ``Tensor.copy_``
through the dispatcher; the transfer engine launches one per run of pages and layer (an onboard's
pairs of layers: one 2-D copy per run), on the request path, so that host time delays the first
layer of a layerwise onboard (docs/BENCHMARKS.md, tiers).
The caller keeps both tensors alive until the copy has run and orders it with events, as for any
``non_blocking`` copy; `runtime` answers None where the runtime cannot be found (no CUDA, a
statically linked runtime), and callers then use ``Tensor.copy_``.
"""

from __future__ import annotations

import ctypes
import functools
import logging

import torch

logger = logging.getLogger(__name__)

H2D, D2H = 1, 2  # cudaMemcpyKind


class Runtime:
    def __init__(self, lib: ctypes.CDLL) -> None:
        vp = ctypes.c_void_p
        sz = ctypes.c_size_t
        self._memcpy = _fn(lib.cudaMemcpyAsync, vp, vp, sz, ctypes.c_int, vp)
        self._memcpy2d = _fn(lib.cudaMemcpy2DAsync, vp, sz, vp, sz, sz, sz, ctypes.c_int, vp)
        self._create = _fn(lib.cudaEventCreateWithFlags, ctypes.POINTER(vp), ctypes.c_uint)
        self._record = _fn(lib.cudaEventRecord, vp, vp)
        self._wait = _fn(lib.cudaStreamWaitEvent, vp, vp, ctypes.c_uint)
        self._attribute = _fn(lib.cudaDeviceGetAttribute, ctypes.POINTER(ctypes.c_int), ctypes.c_int, ctypes.c_int)
        self._pitches: dict[int, int] = {}

    def memcpy_async(self, dst: int, src: int, nbytes: int, kind: int, stream: torch.cuda.Stream) -> None:
        err = self._memcpy(dst, src, nbytes, kind, stream.cuda_stream)
        if err != 0:
            _check(err, f"cudaMemcpyAsync({nbytes} bytes, kind {kind})")

    def memcpy2d_async(self, dst: int, dst_pitch: int, src: int, src_pitch: int, width: int, rows: int, kind: int,
                       stream: torch.cuda.Stream) -> None:
        """``rows`` byte ranges of ``width`` bytes, ``src_pitch`` apart in the source and ``dst_pitch``
        apart in the destination, in one copy (a pitch past the device's limit is an error)."""
        err = self._memcpy2d(dst, dst_pitch, src, src_pitch, width, rows, kind, stream.cuda_stream)
        if err != 0:
            _check(err, f"cudaMemcpy2DAsync({rows} rows of {width} bytes, pitches {src_pitch} / {dst_pitch}, "
                        f"kind {kind})")

    def max_pitch(self, device: int) -> int:
        """The largest pitch in bytes a 2-D copy on ``device`` takes (``cudaDevAttrMaxPitch``)."""
        if device not in self._pitches:
            value = ctypes.c_int()
            _check(self._attribute(ctypes.byref(value), 11, device), "cudaDeviceGetAttribute(cudaDevAttrMaxPitch)")
            self._pitches[device] = value.value
        return self._pitches[device]

    def create_event(self) -> int:
        """A CUDA event without timing (never destroyed: one per transfer engine)."""
        ev = ctypes.c_void_p()
        _check(self._create(ctypes.byref(ev), 2), "cudaEventCreateWithFlags")  # 2: cudaEventDisableTiming
        return ev.value

    def fence(self, event: int, waiting: int, on: int) -> None:
        """Raw stream ``waiting`` waits for the work queued so far on raw stream ``on`` (``event``
        recorded on ``on``, then waited on by ``waiting``: the caller serialises uses of ``event``)."""
        _check(self._record(event, on), "cudaEventRecord")
        _check(self._wait(waiting, event, 0), "cudaStreamWaitEvent")


def _fn(f, *argtypes):
    f.argtypes, f.restype = list(argtypes), ctypes.c_int
    return f


def _check(err: int, what: str) -> None:
    if err != 0:
        raise RuntimeError(f"{what} failed with CUDA error {err}")


@functools.cache
def runtime() -> Runtime | None:
    """The CUDA runtime library this process loaded (found in ``/proc/self/maps`` once CUDA is
    initialised), or None."""
    if not torch.cuda.is_available():
        return None
    torch.cuda.init()
    try:
        with open("/proc/self/maps") as f:
            paths = sorted({line.split()[-1] for line in f if "libcudart.so" in line})
    except OSError:
        paths = []
    for path in paths:
        try:
            rt = Runtime(ctypes.CDLL(path, mode=ctypes.RTLD_GLOBAL))
        except (OSError, AttributeError) as exc:
            logger.debug("cannot use %s: %s", path, exc)
            continue
        logger.debug("raw page copies through %s", path)
        return rt
    return None


def page_layout(table: torch.Tensor) -> tuple[int, int, int] | None:
    """``(address, bytes per layer, bytes per page)`` of a table ``[L, num_pages, ...]`` whose pages
    are contiguous and follow each other in each layer (so a run of pages of one layer is one byte
    range), and whose layers do not overlap (a layer's stride covers its pages), else None."""
    if table.dim() < 3 or table.shape[0] == 0 or table.shape[1] == 0 or not table[0, 0].is_contiguous():
        return None
    page = table[0, 0].numel()
    if table.stride(1) != page or (table.shape[0] > 1 and table.stride(0) < table.shape[1] * page):
        return None
    size = table.element_size()
    return table.data_ptr(), table.stride(0) * size, page * size


def raw_copier(src: torch.Tensor, dst: torch.Tensor):
    """``copy(layer, src_page, dst_page, count, stream, layers=1)``: a raw copy of a run of pages of
    layers ``layer .. layer + layers - 1`` from ``src`` to ``dst`` (one pinned host table, one CUDA
    table, the same page layout and dtype), or None where a raw copy cannot do it (then use
    ``Tensor.copy_``). Several layers go as one 2-D copy (the run's bytes, a layer apart on each
    side) where both tables' layer strides are within the device's pitch limit, else as one copy
    per layer."""
    rt = runtime()
    host = src if dst.is_cuda else dst
    if rt is None or src.dtype != dst.dtype or src.shape[2:] != dst.shape[2:] or not host.is_pinned() or \
            src.is_cuda == dst.is_cuda:
        return None
    a, b = page_layout(src), page_layout(dst)
    if a is None or b is None:
        return None
    (s_base, s_layer, page), (d_base, d_layer, _) = a, b
    kind = H2D if dst.is_cuda else D2H
    device = (dst if dst.is_cuda else src).device
    pitched = max(s_layer, d_layer) <= rt.max_pitch(device.index if device.index is not None else
                                                    torch.cuda.current_device())

    def copy(layer: int, src_page: int, dst_page: int, count: int, stream: torch.cuda.Stream,
             layers: int = 1) -> None:
        to, fro = d_base + layer * d_layer + dst_page * page, s_base + layer * s_layer + src_page * page
        if layers > 1 and pitched:
            rt.memcpy2d_async(to, d_layer, fro, s_layer, count * page, layers, kind, stream)
            return
        for i in range(layers):
            rt.memcpy_async(to + i * d_layer, fro + i * s_layer, count * page, kind, stream)
    return copy
