"""The gr_kv custom ops: schemas and CPU kernels in C++ (gr_plugin/csrc/gr_kv_ops.cpp), opcheck (schema,
fake, mutation, dynamic shapes), agreement with the pure-torch references, boundary checks raised
from C++ before any write, and the CUDA decomposition into Triton kernels (Triton's interpreter)."""

import pytest
import torch

from gr_plugin.cache import paged_ops
from gr_plugin.ops import library
from gr_plugin.ops.pytorch import hstu_attention as ref

from .test_triton_attention import build

OPS = torch.ops.gr_kv
ALPHA, NORM = 0.3, 16.0
PAGED_ARGS = ("q", "k", "v", "kv_layer", "kv_indices", "kv_indptr", "history_lengths", "q_offsets", "new_lengths")


def _paged(device="cpu", dtype=torch.float32):
    _, paged = build([37, 0, 20], [3, 2, 1], [20, 0, 20], 8, 2, 16, dtype, device)
    return paged


def _call_paged(p):
    return OPS.paged_hstu_attention(*(p[a] for a in PAGED_ARGS), ALPHA, NORM)


def _ref_paged(p):
    return ref.paged_hstu_attention(*(p[a] for a in PAGED_ARGS), alpha=ALPHA, n_norm=NORM, max_q_len=p["max_q_len"],
                                    max_history_len=p["max_history_len"], num_history_tokens=p["num_history_tokens"])


@pytest.mark.parametrize("op", ["append_kv", "paged_hstu_attention", "hstu_attention_jagged",
                                "hstu_attention_jagged_backward", "append_kv_layer", "paged_hstu_attention_layer"])
def test_cpu_kernels_and_schemas_are_cpp(op):
    dump = torch._C._dispatch_dump(f"gr_kv::{op}")
    lines = {line.split(":")[0]: line for line in dump.splitlines()}
    assert "gr_kv_ops.cpp" in lines["debug"]  # the schema is defined in C++
    assert "gr_kv_ops.cpp" in lines["CPU"]  # and so is the CPU kernel
    assert library.LIBRARY_PATH.endswith("gr_kv_ops.so")


def test_opcheck_paged_attention():
    p = _paged()
    args = (*(p[a] for a in PAGED_ARGS), ALPHA, NORM)
    torch.library.opcheck(OPS.paged_hstu_attention.default, args)
    torch.testing.assert_close(OPS.paged_hstu_attention(*args), _ref_paged(p), rtol=0, atol=1e-5)


def test_opcheck_jagged_attention():
    jag, _ = build([37, 5], [3, 2], [0, 0], 8, 2, 16, torch.float32, "cpu")
    args = (jag["q"], jag["k"], jag["v"], jag["seq_offsets"], jag["num_candidates"], ALPHA, NORM)
    torch.library.opcheck(OPS.hstu_attention_jagged.default, args)


def test_opcheck_append_mutates_the_table_only():
    table = torch.randn(5, 2, 4, 2, 16)
    k, v = torch.randn(9, 2, 16), torch.randn(9, 2, 16)
    slots, rows = torch.tensor([0, 5, 19]), torch.tensor([8, 0, 3])
    torch.library.opcheck(OPS.append_kv.default, (table.clone(), k, v, slots, rows))
    want = table.clone()
    paged_ops.append_kv(want, k, v, slots, rows)
    OPS.append_kv(table, k, v, slots, rows)
    assert torch.equal(table, want)


def _random_case(seed):
    g = torch.Generator().manual_seed(seed)
    bsz = int(torch.randint(1, 6, (1,), generator=g))
    hist = torch.randint(0, 70, (bsz,), generator=g).tolist()
    cand = torch.randint(1, 10, (bsz,), generator=g).tolist()
    cached = [int(torch.randint(0, h + 1, (1,), generator=g)) for h in hist]
    page_size = (4, 8, 16)[seed % 3]
    return hist, cand, cached, page_size


CASES = [  # history lengths, candidates, cached, page size
    ([37, 0, 90], [3, 2, 1], [20, 0, 64], 8),  # mixed, an empty history, partial last pages
    ([64, 17], [1, 40], [64, 17], 16),  # all cached: only candidates are queries
    ([50, 9], [1, 7], [0, 0], 8),  # nothing cached; one and many candidates
    ([1], [1], [1], 4),  # one cached event, one candidate
    *[_random_case(s) for s in range(8)],
]


@pytest.mark.parametrize(("hist", "cand", "cached", "page_size"), CASES)
def test_cpp_kernels_match_the_references(hist, cand, cached, page_size):
    jag, paged = build(hist, cand, cached, page_size, 2, 16, torch.float32, "cpu", seed=sum(hist))
    torch.testing.assert_close(_call_paged(paged), _ref_paged(paged), rtol=0, atol=1e-5)
    got = OPS.hstu_attention_jagged(jag["q"], jag["k"], jag["v"], jag["seq_offsets"], jag["num_candidates"],
                                    ALPHA, NORM)
    want = ref.hstu_attention_jagged(jag["q"], jag["k"], jag["v"], jag["seq_offsets"], jag["num_candidates"],
                                     alpha=ALPHA, n_norm=NORM, max_seq_len=jag["max_seq_len"])
    torch.testing.assert_close(got, want, rtol=0, atol=1e-5)


@pytest.mark.parametrize("threads", [1, 2, 3])
@pytest.mark.parametrize("heads", [1, 3, 4])
def test_cpp_kernels_cut_a_long_user_by_heads_with_equal_results(threads, heads):
    """A batch whose one long history costs more than an even share of the threads' work is cut into head
    ranges run in parallel (`for_each_piece`); other users run whole, costliest first. Equal to the
    references at every thread count and head count, and the same bits run to run."""
    before = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        jag, paged = build([300, 5, 0, 17, 9], [4, 1, 2, 3, 1], [250, 5, 0, 10, 0], 8, heads, 16, torch.float32,
                           "cpu", seed=heads)
        got = _call_paged(paged)
        torch.testing.assert_close(got, _ref_paged(paged), rtol=0, atol=1e-5)
        assert torch.equal(_call_paged(paged), got)
        args = [jag[n] for n in ("q", "k", "v", "seq_offsets", "num_candidates")]
        got = OPS.hstu_attention_jagged(*args, ALPHA, NORM)
        torch.testing.assert_close(got, ref.hstu_attention_jagged(*args, alpha=ALPHA, n_norm=NORM,
                                                                  max_seq_len=jag["max_seq_len"]), rtol=0, atol=1e-5)
        assert torch.equal(OPS.hstu_attention_jagged(*args, ALPHA, NORM), got)
    finally:
        torch.set_num_threads(before)


def test_cpp_kernels_read_strided_views_and_other_dtypes():
    """q/k/v as the layers make them (chunks of one projection: strided), in fp64 and bf16."""
    p = _paged(dtype=torch.float64)
    nq, h, d = p["q"].shape
    packed = torch.cat([p["q"], p["k"], p["v"]], dim=-1).reshape(nq, 3 * h * d)  # [Nq, 3*H*D]
    qs, ks, vs = (t.reshape(nq, h, 3 * d)[..., i * d:(i + 1) * d] for i, t in enumerate([packed] * 3))
    assert not qs.is_contiguous()
    strided = {**p, "q": qs, "k": ks, "v": vs}
    torch.testing.assert_close(_call_paged(strided), _ref_paged(p), rtol=0, atol=1e-12)
    low = {**p, **{a: p[a].to(torch.bfloat16) for a in ("q", "k", "v", "kv_layer")}}
    torch.testing.assert_close(_call_paged(low).double(), _ref_paged(p), rtol=0, atol=2e-2)


@pytest.mark.parametrize(
    ("mutate", "match"),
    [
        (lambda a: a.update(k=a["k"].double()), "float64"),
        (lambda a: a.update(kv_indices=a["kv_indices"].int()), "kv_indices must be a 1-D int64"),
        (lambda a: a.update(q=a["q"][:-1]), "share a shape"),
        (lambda a: a.update(kv_layer=a["kv_layer"][:, :1]), r"\[num_pages, 2, P, H, D\]"),
        (lambda a: a.update(history_lengths=a["history_lengths"] - 40), r"history_lengths\[0\] = -3 is negative"),
        (lambda a: a.update(new_lengths=a["new_lengths"] + 30), r"new_lengths\[0\] = 47 is outside"),
        (lambda a: a.update(kv_indices=a["kv_indices"] + 100), r"kv_indices\[0\] = 1\d\d is outside"),
        (lambda a: a.update(kv_indptr=a["kv_indptr"][:-1]), "kv_indptr has 3 entries, expected 4"),
        (lambda a: a.update(q_offsets=a["q_offsets"] + 1), r"q_offsets\[0\] must be 0"),
    ],
)
def test_bad_inputs_are_named(mutate, match):
    p = _paged()
    table_before = p["kv_layer"].clone()
    mutate(p)
    with pytest.raises(ValueError, match=match):
        _call_paged(p)
    assert torch.equal(_paged()["kv_layer"], table_before)


@pytest.mark.parametrize(
    ("slots", "rows", "match"),
    [
        ([0, 1], [0], "slots has 2 entries, rows has 1"),
        ([0, 1, 20], [0, 1, 2], r"slots\[2\] = 20 is outside \[0, 20\)"),
        ([0, -1], [0, 1], r"slots\[1\] = -1 is outside"),
        ([0, 1], [0, 3], r"rows\[1\] = 3 is outside \[0, 3\)"),
    ],
)
def test_append_rejects_bad_indices_without_writing(slots, rows, match):
    table = torch.zeros(5, 2, 4, 2, 16)
    with pytest.raises(ValueError, match=match):
        OPS.append_kv(table, torch.ones(3, 2, 16), torch.ones(3, 2, 16), torch.tensor(slots), torch.tensor(rows))
    assert table.abs().sum() == 0  # the valid entries before the bad one were not written either


def test_jagged_rejects_bad_lengths():
    jag, _ = build([10, 5], [3, 2], [0, 0], 8, 2, 16, torch.float32, "cpu")
    with pytest.raises(ValueError, match=r"num_candidates\[1\] = 9 is outside \[0, 7\]"):
        OPS.hstu_attention_jagged(jag["q"], jag["k"], jag["v"], jag["seq_offsets"], torch.tensor([3, 9]), ALPHA, NORM)
    with pytest.raises(ValueError, match=r"seq_offsets\[-1\] = 20 but q has 20|seq_offsets must be non-decreasing"):
        OPS.hstu_attention_jagged(jag["q"], jag["k"], jag["v"], torch.tensor([0, 14, 12]), jag["num_candidates"],
                                  ALPHA, NORM)


_DECOMPOSE = """
import json, sys
import torch
from gr_plugin.ops import library
from torch._functorch.aot_autograd import aot_export_module
from tests.ops.test_triton_attention import build

library.decompose_on = lambda tensors: True  # as for CUDA tensors
_, p = build([37, 0, 20], [3, 2, 1], [20, 0, 20], 8, 2, 16, torch.float32, "cpu")

WHOLE_TABLE = sys.argv[1] == "layer"  # the whole-table ops (the exported stack's), on layer 1 of 2

class Step(torch.nn.Module):
    def forward(self, table, q, k, v, slots, rows, kv_indices, kv_indptr, hist, q_offsets, new):
        if WHOLE_TABLE:
            torch.ops.gr_kv.append_kv_layer(table, 1, k, v, slots, rows)
            return (torch.ops.gr_kv.paged_hstu_attention_layer(q, k, v, table, 1, kv_indices, kv_indptr, hist,
                                                               q_offsets, new, 0.3, 16.0),)
        torch.ops.gr_kv.append_kv(table, k, v, slots, rows)
        return (torch.ops.gr_kv.paged_hstu_attention(q, k, v, table, kv_indices, kv_indptr, hist, q_offsets, new,
                                                     0.3, 16.0),)

table = torch.stack([p["kv_layer"], p["kv_layer"]]) if WHOLE_TABLE else p["kv_layer"]
args = (table, p["q"], p["k"], p["v"], torch.tensor([63, 62]), torch.tensor([0, 1]), p["kv_indices"],
        p["kv_indptr"], p["history_lengths"], p["q_offsets"], p["new_lengths"])
gm, sig = aot_export_module(Step(), args, trace_joint=False)
from torch._higher_order_ops.triton_kernel_wrap import kernel_side_table

kernels = []
for n in gm.graph.nodes:
    if "triton_kernel_wrapper_functional" in str(n.target):
        kernel = kernel_side_table.get_kernel(n.kwargs["kernel_idx"])
        kv = n.kwargs["kwargs"]["KV"]
        kernels.append({"kernel": kernel.fn.__name__, "KV": kv.name if kv.op == "placeholder" else str(kv.target),
                        "layer_pages": n.kwargs["kwargs"]["layer_pages"]})
json.dump({"targets": sorted({str(n.target) for n in gm.graph.nodes}),
           "mutated": sorted(sig.user_inputs_to_mutate.values()),
           "pages": table.shape[-5], "kernels": kernels,
           "table_views": sorted({str(n.target) for n in gm.graph.nodes
                                  if any(str(a) == "arg0_1" for a in n.args) and "triton" not in str(n.target)})},
          sys.stdout)
"""


@pytest.mark.parametrize("form", ["view", "layer"])
def test_cuda_calls_decompose_into_triton_kernels_for_inductor(form):
    """What Inductor (AOTInductor's compile) traces for a CUDA call: the Triton kernels as
    ``triton_kernel_wrapper_functional`` nodes (compiled into the package), no gr_kv op, the
    append's write to the table kept as an input mutation, and the kernels given the table itself
    (layer ``layer`` as a page offset), not a per-layer view. Traced with fake tensors only (no kernel
    runs), in a fresh process: Triton's interpreter (set for the tests) makes kernels untraceable."""
    import json
    import os
    import subprocess
    import sys
    from pathlib import Path

    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    root = Path(__file__).resolve().parents[2]
    out = subprocess.run([sys.executable, "-c", _DECOMPOSE, form], env=env, cwd=root, capture_output=True,
                         text=True, timeout=300)
    assert out.returncode == 0, out.stderr[-3000:]
    got = json.loads(out.stdout)
    assert sum("triton_kernel_wrapper_functional" in t for t in got["targets"]) == 1, got
    assert not any("gr_kv" in t for t in got["targets"]), got
    # NOTE: without a GPU driver Triton cannot analyse which arguments a kernel writes, so every
    # argument counts as mutated; the table must be among them (on a GPU it is the only one).
    assert "arg0_1" in got["mutated"]
    append, attention = got["kernels"]
    assert (append["kernel"], attention["kernel"]) == ("_append", "_hstu_fwd"), got
    # the append writes into the input itself and the attention reads what it wrote
    assert append["KV"] == "arg0_1" and "getitem" in attention["KV"], got
    # NOTE: no view of the table at all (a select, then a select_scatter back, is what made Inductor
    # copy the whole table for every layer); only the copy back of the mutated input, if any, may use it
    assert set(got["table_views"]) <= {"aten.copy_.default"}, got
    # layer 1 of the table: its pages follow layer 0's (a layer mix-up would not show in the mutation)
    want = got["pages"] if form == "layer" else 0
    assert append["layer_pages"] == attention["layer_pages"] == want, got


def _table(pages=7, dtype=torch.float32):
    return torch.randn(3, pages, 2, 4, 2, 8).to(dtype)  # [L, num_pages, 2, P, H, D]


@pytest.mark.parametrize("op", ["gather_pages", "scatter_pages"])
def test_page_ops_schemas_and_kernel_are_cpp(op):
    dump = torch._C._dispatch_dump(f"gr_kv::{op}")
    lines = {line.split(":")[0]: line for line in dump.splitlines()}
    assert "gr_kv_ops.cpp" in lines["debug"] and "gr_kv_ops.cpp" in lines["CompositeExplicitAutograd[alias]"]


def test_opcheck_page_gather_and_scatter():
    table, pages = _table(), torch.tensor([5, 0, 3])
    torch.library.opcheck(OPS.gather_pages.default, (table, pages))
    staging = torch.randn(3, 3, 2, 4, 2, 8)
    torch.library.opcheck(OPS.scatter_pages.default, (table.clone(), staging, pages))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_page_gather_then_scatter_moves_whole_pages_of_every_layer(dtype):
    table, pages = _table(dtype=dtype), torch.tensor([6, 1, 2])
    staging = OPS.gather_pages(table, pages)
    assert staging.shape == (3, 3, 2, 4, 2, 8) and staging.is_contiguous()
    assert torch.equal(staging, table[:, pages])
    other = torch.zeros_like(table)
    OPS.scatter_pages(other, staging, torch.tensor([0, 4, 5]))
    assert torch.equal(other[:, [0, 4, 5]], table[:, pages])
    assert other[:, [1, 2, 3, 6]].abs().sum() == 0  # nothing else written
    assert OPS.gather_pages(table, torch.zeros(0, dtype=torch.int64)).shape == (3, 0, 2, 4, 2, 8)


@pytest.mark.parametrize(
    ("op", "args", "match"),
    [
        ("gather", lambda t: (t, torch.tensor([0, 7])), r"pages\[1\] = 7 is outside \[0, 7\)"),
        ("gather", lambda t: (t, torch.tensor([-1])), r"pages\[0\] = -1 is outside"),
        ("gather", lambda t: (t, torch.tensor([0], dtype=torch.int32)), "pages must be a 1-D int64"),
        ("gather", lambda t: (t[0], torch.tensor([0])), r"\[L, num_pages, 2, P, H, D\]"),
        ("scatter", lambda t: (t, torch.randn(3, 2, 2, 4, 2, 8), torch.tensor([1])), r"staging must be \[3, 1, 2"),
        ("scatter", lambda t: (t, torch.randn(3, 2, 2, 4, 2, 8).double(), torch.tensor([1, 2])),
         "staging is torch.float64"),
        ("scatter", lambda t: (t, torch.randn(3, 2, 2, 4, 2, 8), torch.tensor([3, 3])), "page 3 more than once"),
        ("scatter", lambda t: (t, torch.randn(3, 1, 2, 4, 2, 8), torch.tensor([9])), r"pages\[0\] = 9 is outside"),
        ("scatter", lambda t: (t, torch.randn(3, 3, 2, 4, 2, 8), torch.tensor([5]).expand(3)), "page 5 more than once"),
        ("scatter", lambda t: (t, torch.randn(3, 2, 2, 4, 2, 8), torch.tensor([1, 2, 1, 3])[::2]),
         "page 1 more than once"),
    ],
)
def test_page_ops_bad_inputs_are_named_and_change_nothing(op, args, match):
    table = _table()
    before = table.clone()
    fn = OPS.gather_pages if op == "gather" else OPS.scatter_pages
    with pytest.raises(ValueError, match=match):
        fn(*args(table))
    assert torch.equal(table, before)


def test_exported_scatter_keeps_its_mutation():
    class Onboard(torch.nn.Module):
        def forward(self, kv_table, staging, pages):
            OPS.scatter_pages(kv_table, staging, pages)
            return OPS.gather_pages(kv_table, pages).sum()

    table, staging, pages = _table(), torch.randn(3, 2, 2, 4, 2, 8), torch.tensor([4, 1])
    ep = torch.export.export(Onboard(), (table.clone(), staging, pages)).run_decompositions()
    assert "kv_table" in ep.graph_signature.user_inputs_to_mutate.values()
    got_table = table.clone()
    out = ep.module()(got_table, staging, pages)
    assert torch.equal(got_table[:, pages], staging) and torch.allclose(out, staging.sum())


def test_layer_ops_equal_the_per_layer_ops_and_pass_opcheck():
    """append_kv_layer / paged_hstu_attention_layer on layer i of the whole table [L, ...] do what the
    per-layer ops do on table[i], and touch no other layer."""
    p = _paged()
    table = torch.stack([torch.randn_like(p["kv_layer"]), p["kv_layer"], torch.randn_like(p["kv_layer"])])
    args = [p[a] for a in PAGED_ARGS]
    torch.library.opcheck(OPS.paged_hstu_attention_layer.default, (*args[:3], table, 1, *args[4:], ALPHA, NORM))
    torch.testing.assert_close(OPS.paged_hstu_attention_layer(*args[:3], table, 1, *args[4:], ALPHA, NORM),
                               _call_paged(p), rtol=0, atol=0)
    k, v = torch.randn(9, 2, 16), torch.randn(9, 2, 16)
    slots, rows = torch.tensor([0, 5, 19]), torch.tensor([8, 0, 3])
    torch.library.opcheck(OPS.append_kv_layer.default, (table.clone(), 2, k, v, slots, rows))
    want = table.clone()
    OPS.append_kv(want[2], k, v, slots, rows)
    got = table.clone()
    OPS.append_kv_layer(got, 2, k, v, slots, rows)
    assert torch.equal(got, want) and torch.equal(got[:2], table[:2])


@pytest.mark.parametrize("layer", [-1, 3])
def test_layer_ops_name_a_bad_layer_and_change_nothing(layer):
    p = _paged()
    table = torch.stack([p["kv_layer"]] * 3)
    before = table.clone()
    with pytest.raises(ValueError, match=rf"layer {layer} is outside \[0, 3\)"):
        OPS.append_kv_layer(table, layer, torch.randn(2, 2, 16), torch.randn(2, 2, 16), torch.tensor([0, 1]),
                            torch.tensor([0, 1]))
    with pytest.raises(ValueError, match=rf"layer {layer} is outside \[0, 3\)"):
        args = [p[a] for a in PAGED_ARGS]
        OPS.paged_hstu_attention_layer(*args[:3], table, layer, *args[4:], ALPHA, NORM)
    assert torch.equal(table, before)


def test_eager_cuda_kernel_counts_splits_without_the_makespan_model(monkeypatch):
    """The custom op's eager kernel (``_paged_cuda``) bounds the histories by the table's capacity
    (no sync to read the real ones), a loose bound: its launch asks the split rule without the
    makespan model (``model=False``: the one-wave count) and the tiles without it (no bound given).
    Run through the real launcher, on Triton's interpreter."""
    from gr_plugin.ops.triton import hstu_attention as tri

    asked, tiles = [], []
    real, real_blocks = tri._splits, tri._launch_blocks
    monkeypatch.setattr(tri, "_splits", lambda *a: asked.append(a) or real(*a))
    monkeypatch.setattr(tri, "_launch_blocks", lambda *a: tiles.append(a) or real_blocks(*a))
    p = _paged()
    out = library._paged_cuda(tri, *(p[a] for a in PAGED_ARGS), ALPHA, NORM)
    torch.testing.assert_close(out, _ref_paged(p), rtol=1e-4, atol=1e-4)
    capacity = p["kv_layer"].shape[0] * p["kv_layer"].shape[2]
    ((_, kv_len, _, _, _, _, model),) = asked
    assert kv_len == capacity and model is False
    ((_, _, _, _, tile_kv_len, *_),) = tiles
    assert tile_kv_len is None
