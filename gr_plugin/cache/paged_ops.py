"""Pure-torch reference of the page operations: the oracle for kernels and the CPU path.

Owns the tensor layout of a KV table and the reference ops on it:
- a table is ``[num_layers, num_pages, 2, page_size, num_heads, head_dim]``; ``table[l]`` is one
  layer, index 0 of dim 2 is K and 1 is V;
- a *slot* is ``page * page_size + offset``: the flat place of one token in every layer;
- ``append_kv`` writes new tokens' K/V at their slots, ``gather_kv`` reads sequences back through
  the CSR page metadata (``kv_indices``, ``kv_indptr``, ``kv_last_page_len``).
Everything here is tensor in / tensor out with shapes checked by the caller; kernels in
``gr_plugin.ops`` must agree with these functions bit for bit. No policy lives here.
"""

from __future__ import annotations

import torch


def new_kv_table(
    num_layers: int,
    num_pages: int,
    page_size: int,
    num_heads: int,
    head_dim: int,
    *,
    dtype: torch.dtype,
    device: torch.device | str,
    pin_memory: bool = False,
) -> torch.Tensor:
    """Zeroed table ``[num_layers, num_pages, 2, page_size, num_heads, head_dim]``."""
    shape = (num_layers, num_pages, 2, page_size, num_heads, head_dim)
    if pin_memory:
        return torch.zeros(shape, dtype=dtype, pin_memory=True)
    return torch.zeros(shape, dtype=dtype, device=device)


def _flat_kv_index(slots: torch.Tensor, page_size: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Rows of K and V in ``table[l].view(num_pages * 2 * page_size, H, D)`` for each slot."""
    pages = torch.div(slots, page_size, rounding_mode="floor")
    offsets = slots - pages * page_size
    k_rows = pages * (2 * page_size) + offsets
    return k_rows, k_rows + page_size


def append_kv(
    kv_layer: torch.Tensor, k: torch.Tensor, v: torch.Tensor, slots: torch.Tensor,
    rows: torch.Tensor | None = None,
) -> None:
    """Write ``k``/``v`` ``[N, H, D]`` into ``kv_layer`` ``[num_pages, 2, P, H, D]`` at ``slots`` ``[N]``.

    With ``rows`` ``[N]``, token ``i`` is row ``rows[i]`` of ``k``/``v`` (a superset of the new tokens).
    """
    if rows is not None:
        if rows.device.type == "cpu" and rows.numel() and (int(rows.min()) < 0 or int(rows.max()) >= k.shape[0]):
            # (the C++ op refuses these too; indexing would wrap a negative row around)
            raise ValueError(f"rows must lie in [0, {k.shape[0]}), got [{int(rows.min())}, {int(rows.max())}]")
        k, v = k[rows], v[rows]
    num_pages, _, page_size, num_heads, head_dim = kv_layer.shape
    flat = kv_layer.view(num_pages * 2 * page_size, num_heads, head_dim)
    k_rows, v_rows = _flat_kv_index(slots, page_size)
    flat.index_copy_(0, k_rows, k)
    flat.index_copy_(0, v_rows, v)


def sequence_slots(
    kv_indices: torch.Tensor,
    kv_indptr: torch.Tensor,
    lengths: torch.Tensor,
    offsets: torch.Tensor,
    page_size: int,
    num_tokens: int,
) -> torch.Tensor:
    """Slot ``[num_tokens]`` of every token of every sequence, in jagged order.

    ``lengths``/``offsets`` ``[B]``/``[B+1]`` are the tokens each sequence reads from its pages;
    ``num_tokens`` is ``offsets[-1]`` as a host int (so no device sync is needed).
    """
    batch = torch.repeat_interleave(
        torch.arange(lengths.numel(), device=lengths.device), lengths, output_size=num_tokens
    )
    positions = torch.arange(num_tokens, device=lengths.device) - offsets[:-1][batch]
    page_of = torch.div(positions, page_size, rounding_mode="floor")
    return kv_indices[kv_indptr[:-1][batch] + page_of] * page_size + (positions - page_of * page_size)


def gather_kv(
    kv_layer: torch.Tensor, slots: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """Read K and V ``[N, H, D]`` of ``slots`` ``[N]`` from ``kv_layer`` ``[num_pages, 2, P, H, D]``."""
    num_pages, _, page_size, num_heads, head_dim = kv_layer.shape
    flat = kv_layer.view(num_pages * 2 * page_size, num_heads, head_dim)
    k_rows, v_rows = _flat_kv_index(slots, page_size)
    return flat.index_select(0, k_rows), flat.index_select(0, v_rows)


def copy_pages(
    src: torch.Tensor, src_pages: torch.Tensor, dst: torch.Tensor, dst_pages: torch.Tensor, layer: int
) -> None:
    """``dst[layer, dst_pages] = src[layer, src_pages]`` for tables on the same device."""
    dst[layer].index_copy_(0, dst_pages, src[layer].index_select(0, src_pages))
