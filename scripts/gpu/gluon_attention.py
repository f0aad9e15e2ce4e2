"""The paged attention's Gluon kernel (`gr_plugin.ops.triton.hstu_gluon`) side by side with the Triton
kernel (`gr_plugin.ops.triton.hstu_attention`), on the GPU.

python3 scripts/gpu/gluon_attention.py [check|time [DIM,PAGE,BS ...]|grid|full|stream] -> ``check``: every tile
of `TILES` at split counts None / 1 / 3 against an fp32 reference (the package's pure-torch op), next to the Triton
kernel's error (partial last pages with NaN in every slot no history holds); ``time``: graphed µs (the
norm gate included, min over interleaved rounds) of the Triton kernel's launch, the package's Gluon
launch, and each tile at each split count of `SPLITS`, at the block's shapes (4096 history, 128 new +
256 candidates, 4 heads) or the cases named; ``grid``: the package's Gluon tiles at each split count
of `SPLITS` over histories 1024 / 4096 / 16384 and bs 1-32, as JSON lines in $OUT/gluon_grid.jsonl
(`scripts/fit_makespan.py` fits the split rule to them); ``full``: the full pass (`hstu_attention_jagged`,
the block's 4096 history + 256 candidates) on the Gluon kernel, each tile of `FULL_TILES` against an fp32
reference next to the Triton kernel's error, then graphed µs of the Triton launch and each tile with the
query tiles heaviest first (the package's order) and in order; ``stream``: whether a balanced persistent
grid pays with programs sharing an SM: graphed µs of the Triton kernel's stream-K (`_launch`'s
``schedule="stream"``) at one, two and three programs per SM next to the package's split launches, bs
1-8. Registers and local memory without a GPU:
``python scripts/kernel_resources.py --launch kernel=gluon [full=True]``.
"""

from __future__ import annotations

import os
import sys

import torch
import triton

from gr_plugin.ops.triton import hstu_attention as tri


def launch(*args, num_splits=None, blocks=None, norm_gate=None):
    """The package's paged launch (``tri._launch``'s positional arguments up to ``max_q_len``, then
    ``max_kv_len``) on the Gluon kernel with these tiles and split count (None: its rule's)."""
    *pos, max_kv = args
    return tri._launch(*pos, paged=True, max_kv_len=max_kv, num_splits=num_splits, blocks=blocks, norm_gate=norm_gate,
                       kernel="gluon")


# head_dim -> the Gluon tiles tried (BLOCK_M, BLOCK_N, warps, stages)
TILES = {128: [(64, 64, 4, 2), (64, 64, 4, 3), (64, 64, 4, 4), (128, 64, 8, 2), (128, 64, 8, 3), (64, 128, 4, 2)],
         256: [(64, 32, 4, 2), (64, 32, 4, 3), (64, 32, 4, 4), (128, 32, 8, 2)]}  # (page 32: 32-key blocks)
SPLITS = (1, 2, 3, 4, 5, 6, 8, 11, 16)


def _case(bs, hist, dim, page, nan_tail=False):
    from tune_attention import case

    args, max_q, max_kv = case(bs, hist, 128, 256, 4, dim, page)
    if nan_tail:  # every slot past each user's history NaN: a masked read that is not zeroed would show
        kv, idx, indptr = args[3], args[4], args[5]
        pages = -(-hist // page)
        for b in range(bs):
            last = idx[indptr[b] + pages - 1]
            kv[last, :, hist - (pages - 1) * page:] = float("nan")
        spare = torch.ones(kv.shape[0], dtype=torch.bool, device=kv.device)
        spare[idx] = False
        kv[spare] = float("nan")
    return args, max_q, max_kv


def check() -> None:
    """Every tile against an fp32 reference (the package's pure-torch op) and the Triton kernel."""
    from gr_plugin.ops.pytorch import hstu_attention as ref_ops

    torch.manual_seed(0)
    for dim, page, bs, hist in ((128, 128, 1, 4096), (128, 128, 2, 4000), (128, 128, 8, 4096), (256, 32, 1, 4096),
                                (256, 32, 2, 1000), (128, 128, 3, 300)):
        args, max_q, max_kv = _case(bs, hist, dim, page, nan_tail=hist % page != 0)
        q, k, v, kv, idx, indptr, q_off, hl, nl = args
        ref = ref_ops.paged_hstu_attention(q.float(), k.float(), v.float(), kv.float(), idx, indptr, hl, q_off, nl,
                                           alpha=0.1, n_norm=4096.0, max_q_len=max_q, max_history_len=max_kv,
                                           num_history_tokens=int(hl.sum()))
        triton_out = tri._launch(*args, 0.1, 4096.0, max_q, paged=True, max_kv_len=max_kv, kernel="triton")
        tri_err = (triton_out.float() - ref).abs().max().item()
        for bl in TILES[dim]:
            if page % bl[1]:
                continue
            for sp in (None, 1, 3):
                out = launch(*args, 0.1, 4096.0, max_q, max_kv, num_splits=sp, blocks=bl)
                err = (out.float() - ref).abs().max().item()
                ok = err <= 2 * tri_err + 1e-6 and torch.isfinite(out).all().item()
                print(f"check d{dim} p{page} bs{bs} hist{hist} {bl} splits={sp}: gluon err {err:.2e}, triton err "
                      f"{tri_err:.2e} {'ok' if ok else 'FAIL'}")


def _gate(dim, rows):
    """The layer's norm gate for ``rows`` queries (bf16, as the model's): weight, bias, eps, u."""
    width = 4 * dim
    return (torch.ones(width, device="cuda", dtype=torch.bfloat16), torch.zeros(width, device="cuda",
            dtype=torch.bfloat16), 1e-5, torch.randn(rows, width, device="cuda", dtype=torch.bfloat16))


def _graphed_best(fns: dict, rounds: int) -> dict:
    """Graphed ms of each of ``fns`` (label -> launch), min over ``rounds`` interleaved rounds; a launch that
    does not compile or fit is reported and dropped from ``fns``."""
    best = {}
    for _ in range(rounds):
        for label, fn in list(fns.items()):
            try:
                ms = triton.testing.do_bench_cudagraph(fn, rep=50, return_mode="median")
            except Exception as e:
                print(f"  {label}: {type(e).__name__}: {str(e)[:200]}")
                del fns[label]
                best.pop(label, None)
                continue
            best[label] = min(best.get(label, float("inf")), ms)
    return best


def time_all(cases=((128, 128, 1), (128, 128, 2), (128, 128, 8), (256, 32, 1), (256, 32, 8)), rounds: int = 2):
    """Graphed µs, min over interleaved rounds: the Triton kernel's launch (its tiles and split rule), the
    package's Gluon launch, and each Gluon tile of `TILES` at each split count of `SPLITS` (and the Gluon
    rule's); the norm gate as the layer runs it."""
    for dim, page, bs in cases:
        args, max_q, max_kv = _case(bs, 4096, dim, page)
        gate = _gate(dim, args[0].shape[0])
        fns = {"triton": lambda: tri._launch(*args, 0.1, 4096.0, max_q, paged=True, max_kv_len=max_kv, norm_gate=gate,
                                             kernel="triton")}
        ref = fns["triton"]()
        fns["gluon, the package's tiles and rule"] = lambda: launch(*args, 0.1, 4096.0, max_q, max_kv, norm_gate=gate)
        for bl in TILES[dim]:
            rule = tri._gluon_splits(args[0].shape[0], bs, 4, max_q, max_kv, bl, dim, args[0].device, True)
            for sp in sorted({rule, *SPLITS}):
                if bs * 4 * -(-max_q // bl[0]) * sp > 6 * 132 or sp * 2 > -(-max_kv // bl[1]):
                    continue
                fns[f"gluon {bl} splits={sp}"] = (lambda bl=bl, sp=sp: launch(*args, 0.1, 4096.0, max_q, max_kv,
                                                                              num_splits=sp, blocks=bl, norm_gate=gate))
        best = _graphed_best(fns, rounds)
        print(f"time d{dim} p{page} bs{bs} (graphed µs, with the norm gate, min of {rounds} rounds):")
        for label, ms in sorted(best.items(), key=lambda kv: kv[1])[:14]:
            diff = (fns[label]().float() - ref.float()).abs().max().item()
            print(f"   {ms * 1000:8.2f}  {label}  (max diff vs triton {diff:.2e})")


def grid(rounds: int = 2) -> None:
    """Graphed ms (min of ``rounds``) of the package's Gluon tiles at each split count of `SPLITS`, norm gate
    included, over batch sizes and histories: one JSON line each in $OUT/gluon_grid.jsonl, to fit the
    split rule's constants to (``tri.GLUON_MAKESPAN``, `scripts/fit_makespan.py`)."""
    import json

    sink = open(os.path.join(os.environ.get("OUT", "/tmp"), "gluon_grid.jsonl"), "w")
    for dim, page, bl in ((128, 128, tri.GLUON_TILES[128]), (256, 32, tri.GLUON_TILES[256])):
        for hist in (1024, 4096, 16384):
            for bs in (1, 2, 4, 8, 16, 32):
                args, max_q, max_kv = _case(bs, hist, dim, page)
                gate = _gate(dim, args[0].shape[0])
                tiles = bs * 4 * -(-max_q // bl[0])
                for sp in SPLITS:
                    if tiles * sp > 6 * 132 or sp * 2 > -(-max_kv // bl[1]):
                        continue
                    def fn(sp=sp, args=args, gate=gate):
                        return launch(*args, 0.1, 4096.0, max_q, max_kv, num_splits=sp, blocks=bl, norm_gate=gate)

                    ms = min(triton.testing.do_bench_cudagraph(fn, rep=30, return_mode="median")
                             for _ in range(rounds))
                    row = dict(dim=dim, hist=hist, bs=bs, blocks=bl, splits=sp, ms=ms, programs=tiles * sp)
                    sink.write(json.dumps(row) + "\n")
                    print(row)
                del args, gate
                torch.cuda.empty_cache()
    sink.close()


# head_dim -> the Gluon tiles tried for the full pass
FULL_TILES = {128: [(64, 64, 4, 3), (64, 64, 4, 2), (128, 64, 8, 2), (128, 64, 8, 3), (128, 128, 8, 2)],
              256: [(64, 32, 4, 4), (64, 32, 4, 3), (128, 32, 8, 3), (128, 64, 8, 2)]}


def _full_case(bs, hist, cands, dim, seed=0):
    """The full pass's inputs as the model makes them: ``q, k, v`` views of one ``[T, 4 H D]`` projection."""
    g = torch.Generator(device="cuda").manual_seed(seed)
    lens = [hist + cands] * bs
    t = sum(lens)
    uvqk = torch.randn(t, 4 * 4 * dim, device="cuda", dtype=torch.bfloat16, generator=g)
    _, v, q, k = (x.reshape(t, 4, dim) for x in uvqk.chunk(4, dim=-1))
    offsets = torch.tensor([0, *lens], device="cuda", dtype=torch.int64).cumsum(0)
    return q, k, v, offsets, torch.full((bs,), cands, device="cuda", dtype=torch.int64), max(lens)


def _full(q, k, v, offsets, cands, max_len, **kw):
    return tri.hstu_attention_jagged(q, k, v, offsets, cands, alpha=0.1, n_norm=4096.0, max_seq_len=max_len, **kw)


class _InOrder:
    """Within it, the Gluon launches run the query tiles in order (not heaviest first)."""

    def __enter__(self):
        from gr_plugin.ops.triton import hstu_gluon

        self.real = real = hstu_gluon.launch
        hstu_gluon.launch = lambda *a: real(*a, heavy_first=False)

    def __exit__(self, *exc):
        from gr_plugin.ops.triton import hstu_gluon

        hstu_gluon.launch = self.real


def full(rounds: int = 2) -> None:
    """The full pass on the Gluon kernel: errors against fp32, then graphed µs against the Triton kernel."""
    from gr_plugin.ops.pytorch import hstu_attention as ref_ops

    for dim, bs, hist, cands in ((128, 2, 1000, 37), (128, 3, 300, 1), (256, 2, 700, 64), (64, 2, 500, 20)):
        q, k, v, off, cn, ml = _full_case(bs, hist, cands, dim)
        ref = ref_ops.hstu_attention_jagged(q.float(), k.float(), v.float(), off, cn, alpha=0.1, n_norm=4096.0,
                                            max_seq_len=ml)
        tri_err = (_full(q, k, v, off, cn, ml, kernel="triton").float() - ref).abs().max().item()
        for bl in FULL_TILES.get(dim, [(64, 64, 4, 3)]):
            for sp in (None, 2):
                out = _full(q, k, v, off, cn, ml, kernel="gluon", blocks=bl, num_splits=sp)
                with _InOrder():
                    same = torch.equal(out, _full(q, k, v, off, cn, ml, kernel="gluon", blocks=bl, num_splits=sp))
                err = (out.float() - ref).abs().max().item()
                ok = err <= 2 * tri_err + 1e-6 and torch.isfinite(out).all().item() and same
                print(f"full check d{dim} bs{bs} hist{hist}+{cands} {bl} splits={sp}: gluon err {err:.2e}, triton err "
                      f"{tri_err:.2e}, in order equal {same} {'ok' if ok else 'FAIL'}", flush=True)
    for dim in (128, 256):
        for bs in (1, 2, 8):
            case = _full_case(bs, 4096, 256, dim)
            fns = {"triton": lambda case=case: _full(*case, kernel="triton"),
                   "gluon, the package's tiles": lambda case=case: _full(*case, kernel="gluon")}
            for bl in FULL_TILES[dim]:
                fns[f"gluon {bl}"] = lambda bl=bl, case=case: _full(*case, kernel="gluon", blocks=bl)

                def in_order(bl=bl, case=case):
                    with _InOrder():
                        return _full(*case, kernel="gluon", blocks=bl)

                fns[f"gluon {bl} in order"] = in_order
            best = _graphed_best(fns, rounds)
            print(f"full time d{dim} bs{bs} 4096+256 (graphed µs, min of {rounds} rounds):", flush=True)
            for label, ms in sorted(best.items(), key=lambda kv: kv[1]):
                print(f"   {ms * 1000:9.1f}  {label}", flush=True)
            del case, fns
            torch.cuda.empty_cache()


def stream(rounds: int = 2) -> None:
    """Graphed µs (min of ``rounds``, the norm gate included, 4096 history, 128 new + 256 candidates) of the
    Triton kernel's stream-K with TMA loads at 1, 2 and 3 programs per SM (as many as its tiles leave
    resident) against the package's Triton and Gluon split launches: stream-K was measured at one
    program per SM only (docs/BENCHMARKS.md), where a program runs alone on its SM."""
    sms = torch.cuda.get_device_properties(0).multi_processor_count
    for dim, page, tiles in ((128, 128, ((64, 64, 4, 3), (64, 64, 4, 2))), (256, 32, ((64, 32, 4, 3), (64, 32, 4, 2)))):
        for bs in (1, 2, 4, 8):
            args, max_q, max_kv = _case(bs, 4096, dim, page)
            gate = _gate(dim, args[0].shape[0])

            def paged(**kw):
                return lambda: tri._launch(*args, 0.1, 4096.0, max_q, paged=True, max_kv_len=max_kv, norm_gate=gate,
                                           **kw)

            fns = {"triton split (the package's)": paged(kernel="triton"), "gluon split (the package's)": paged()}
            # (outputs compared eagerly, where a launch naming no kernel takes Triton: the Gluon row forced)
            eager = {**fns, "gluon split (the package's)": paged(kernel="gluon")}
            for bl in tiles:
                resident = tri._resident(bl, dim, 2, args[0].device)
                for per_sm in sorted({1, 2, resident}):
                    if per_sm <= resident:
                        label = f"triton stream-K + TMA {bl}, {per_sm}/SM ({per_sm * sms} programs)"
                        fns[label] = eager[label] = paged(schedule="stream", tma=True, blocks=bl,
                                                          programs=per_sm * sms)
            ref = fns["triton split (the package's)"]()
            best = _graphed_best(fns, rounds)
            print(f"stream d{dim} p{page} bs{bs} (graphed µs, with the norm gate, min of {rounds} rounds):", flush=True)
            for label, ms in sorted(best.items(), key=lambda kv: kv[1]):
                diff = (eager[label]().float() - ref.float()).abs().max().item()
                print(f"   {ms * 1000:8.2f}  {label}  (max diff vs triton split {diff:.2e})", flush=True)


if __name__ == "__main__":
    mode = sys.argv[1] if len(sys.argv) > 1 else "check"
    sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
    if mode == "time" and len(sys.argv) > 2:  # ``time DIM,PAGE,BS ...``: those cases only
        time_all(tuple(tuple(int(x) for x in c.split(",")) for c in sys.argv[2:]))
    else:
        {"check": check, "time": time_all, "grid": grid, "full": full, "stream": stream}[mode]()
