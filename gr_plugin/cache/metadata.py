"""CSR batch metadata: what kernels need to read and write one batch's pages.

Owns `PagedBatchMetadata` (named views of one packed int64 buffer) and `build_metadata`, which
turns per-user page lists and lengths into that buffer in one host pass (in C++, the code the
manager's allocate runs) and moves it to the cache device with a single copy. It knows nothing
about users or tiers.

Shapes (``B`` users, ``N`` new tokens, ``T`` history tokens, ``M`` pages in the batch):
- ``kv_indptr [B+1]``, ``kv_indices [M]``, ``kv_last_page_len [B]``: the pages of each user's whole
  history after this step (cached + new tokens), last page partly filled;
- ``cached_lengths``, ``new_lengths``, ``total_lengths [B]`` and ``new_offsets``, ``total_offsets [B+1]``;
- ``new_token_batch``, ``new_token_positions`` ``[N]`` (absolute place in the history), and the
  derived ``new_token_slots [N]`` (``page * page_size + offset``, where append writes).
"""

from __future__ import annotations

import functools
from array import array

import torch

from gr_plugin.csrc.core.build import load as load_core

# Fields packed in the buffer, in order: (name, length in terms of B / pages / N).
_FIELDS = (
    ("kv_indptr", "B+1"),
    ("kv_last_page_len", "B"),
    ("cached_lengths", "B"),
    ("new_lengths", "B"),
    ("total_lengths", "B"),
    ("new_offsets", "B+1"),
    ("total_offsets", "B+1"),
    ("kv_indices", "M"),
    ("new_token_batch", "N"),
    ("new_token_positions", "N"),
)


class PagedBatchMetadata:
    """One batch's CSR metadata, packed in a single int64 ``buffer`` on the cache device.

    Each field (see the module docstring) is a view of ``buffer`` made on first access, so a
    step that copies the whole buffer into a static one (CUDA graphs) never builds the views, and
    a kernel may read the buffer at ``field_offsets`` directly. Host ints (``batch_size``,
    ``num_new_tokens``, ...) are plain attributes, so no field needs a device sync. Given the
    host buffer and another ``device``, the buffer moves there (one pinned, non-blocking copy on
    the current stream) the first time it is read: a step replayed from a CUDA graph, which
    packs the host buffer itself, never moves it.
    """

    __slots__ = ("__dict__", "_buffer", "_device", "_host", "batch_size", "field_offsets", "max_new_len",
                 "max_total_len", "num_batch_pages", "num_new_tokens", "num_total_tokens", "page_size")

    def __init__(self, buffer: torch.Tensor, *, page_size: int, batch_size: int, num_new_tokens: int,
                 num_total_tokens: int, num_batch_pages: int, max_new_len: int, max_total_len: int,
                 device: torch.device | str | None = None) -> None:
        target = buffer.device if device is None else torch.device(device)
        if target.type == "cuda" and target.index is None:
            target = torch.device("cuda", torch.cuda.current_device())
        elif target.type == "cpu":
            # NOTE: torch puts ``cpu:N`` tensors on ``cpu``, and ``cpu != cpu:0``: without this, a host
            # buffer would be "moved" to the CPU through pinned memory and CUDA calls
            target = torch.device("cpu")
        self._host = buffer
        self._device = target
        self._buffer = buffer if buffer.device == target else None
        self.page_size = page_size
        self.batch_size = batch_size
        self.num_new_tokens = num_new_tokens
        self.num_total_tokens = num_total_tokens
        self.num_batch_pages = num_batch_pages
        self.max_new_len = max_new_len
        self.max_total_len = max_total_len
        sizes = {"B": batch_size, "B+1": batch_size + 1, "M": num_batch_pages, "N": num_new_tokens}
        offsets, at = {}, 0
        for name, size in _FIELDS:
            offsets[name] = (at, at + sizes[size])
            at += sizes[size]
        assert at == buffer.numel(), f"metadata buffer has {buffer.numel()} entries, layout needs {at}"
        self.field_offsets = offsets

    @property
    def buffer(self) -> torch.Tensor:
        """The packed buffer on ``device`` (moved there on first read)."""
        if self._buffer is None:
            if torch.cuda.is_current_stream_capturing():
                # NOTE: a graph would keep the copy's source, a pinned buffer freed after this step
                raise RuntimeError("batch metadata first read on the device inside a CUDA graph capture: "
                                   "read it (e.g. `meta.buffer`) before capturing")
            # NOTE: two threads reading first at once would each copy (equal values): a plan is
            # read by the one thread running its step
            staged = torch.empty(self._host.shape, dtype=torch.int64, pin_memory=True)
            staged.copy_(self._host)
            self._buffer = staged.to(self._device, non_blocking=True)
        return self._buffer

    def start_copy(self) -> PagedBatchMetadata:
        """Queue the device copy now (on the current stream), not at the first read; a no-op once
        made. For a step that will read the metadata on the device: its copy then goes ahead of
        the step's first kernels instead of behind them."""
        _ = self.buffer
        return self

    def __getattr__(self, name: str) -> torch.Tensor:
        # NOTE: only called when the attribute is missing: builds and caches a field's view.
        try:
            offsets = object.__getattribute__(self, "field_offsets")
        except AttributeError:
            raise AttributeError(name) from None
        if name not in offsets:
            raise AttributeError(name)
        a, b = offsets[name]
        view = self.buffer[a:b]
        self.__dict__[name] = view
        return view

    @property
    def device(self) -> torch.device:
        return self._device

    @functools.cached_property
    def new_token_slots(self) -> torch.Tensor:
        """``[N]`` slot (``page * page_size + offset``) of each new token, where append writes.

        Derived on the metadata's device from the fields above the first time it is read
        (vectorised, no host work, no extra copy); kernels may compute it inline instead.
        """
        pos, P = self.new_token_positions, self.page_size
        page_of = torch.div(pos, P, rounding_mode="floor")
        return self.kv_indices[self.kv_indptr[:-1][self.new_token_batch] + page_of] * P + (pos - page_of * P)

    def __repr__(self) -> str:
        return (f"PagedBatchMetadata(batch_size={self.batch_size}, num_new_tokens={self.num_new_tokens}, "
                f"num_total_tokens={self.num_total_tokens}, num_batch_pages={self.num_batch_pages}, "
                f"page_size={self.page_size}, device={self.device})")


def metadata_from_host(flat: torch.Tensor, *, page_size: int, batch_size: int, num_new_tokens: int,
                       num_total_tokens: int, num_batch_pages: int, max_new_len: int, max_total_len: int,
                       device: torch.device) -> PagedBatchMetadata:
    """Wrap a packed host buffer (int64 CPU, `_FIELDS` order) for ``device``: moved there in one
    copy the first time a field or the buffer is read (`PagedBatchMetadata.buffer`)."""
    return PagedBatchMetadata(
        flat, page_size=page_size, batch_size=batch_size, num_new_tokens=num_new_tokens,
        num_total_tokens=num_total_tokens, num_batch_pages=num_batch_pages, max_new_len=max_new_len,
        max_total_len=max_total_len, device=device,
    )


def build_metadata(
    page_lists: list[array],
    cached_lengths: list[int],
    total_lengths: list[int],
    page_size: int,
    device: torch.device,
) -> PagedBatchMetadata:
    """Build the batch metadata from host values in one pass; one host→device copy off the CPU.

    ``page_lists[b]`` (``array('q')`` or a list of ints) holds the pages of user ``b``'s first
    ``total_lengths[b]`` tokens (``ceil(total / page_size)`` of them), ``cached_lengths[b]`` of
    which are already in those pages. Bad lengths or page counts raise ValueError.
    """
    # NOTE: the C++ core packs the buffer (kv_core.cpp `build_metadata`, the same code the
    # manager's allocate runs), so the layout is written in one place.
    load_core()
    indices = array("q")
    for pages in page_lists:
        indices.extend(pages)
    kv_indices = torch.frombuffer(indices, dtype=torch.int64) if indices else torch.empty(0, dtype=torch.int64)
    flat = torch.ops.gr_kv_core.build_metadata(
        kv_indices, [len(p) for p in page_lists], list(cached_lengths), list(total_lengths), page_size)
    new_lengths = [t - c for t, c in zip(total_lengths, cached_lengths)]
    return metadata_from_host(
        flat, page_size=page_size, batch_size=len(total_lengths), num_new_tokens=sum(new_lengths),
        num_total_tokens=sum(total_lengths), num_batch_pages=len(indices), max_new_len=max(new_lengths),
        max_total_len=max(total_lengths), device=device,
    )
