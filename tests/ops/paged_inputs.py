"""Test helper: lay histories' K/V out in a page table at random pages (shared by the op tests)."""

import torch


def scatter_into_pages(full, hist, page_size, spare, g):
    """``full[b] = (q, k, v)`` of user ``b``; the first ``hist[b]`` rows of k/v go into pages drawn
    at random from ``sum(pages) + spare``. Returns ``(table [num_pages, 2, P, H, D], indices, indptr)``."""
    heads, dim = full[0][1].shape[1:]
    npages = sum(-(-h // page_size) for h in hist) + spare
    table = torch.zeros(npages, 2, page_size, heads, dim)
    perm = torch.randperm(npages, generator=g).tolist()
    indices, indptr = [], [0]
    for b, h in enumerate(hist):
        n = -(-h // page_size)
        pages, perm = perm[:n], perm[n:]
        indices += pages
        indptr.append(len(indices))
        for t in range(h):  # history K/V (cached and new) live in the pages
            table[pages[t // page_size], 0, t % page_size] = full[b][1][t]
            table[pages[t // page_size], 1, t % page_size] = full[b][2][t]
    return table, indices, indptr
