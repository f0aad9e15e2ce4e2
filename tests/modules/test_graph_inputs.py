"""The cached graph step's input packing on the host: ``torch.ops.gr_kv_core.pack_cached_step``
(``gr_plugin/csrc/core/step_inputs.cpp``) against its numpy reference `pack_cached_numpy`, both held to
what the fields mean (the token layout's ids and offsets, the plan's pages, each new token's slot as
the metadata derives it), the tails reset by a smaller step, the same error for each bad input with the
buffer left as it was, and `CachedStackGraphs._load` taking the C++ form where the core is loaded."""


import numpy as np
import pytest
import torch

from gr_plugin.bench import e2e
from gr_plugin.csrc.core import build as core_build
from gr_plugin.inference import RankingEngine
from gr_plugin.modules import KVCacheModule
from gr_plugin.modules import graphs as gm

PAGE = 4
NUM_PAGES = 8 * (-(-(40 + 2 * 6) // PAGE) + 1) + 8  # the fixture's cache (`e2e.stream_cache_config`, 8 users)


@pytest.fixture(scope="module")
def steps():
    """Prepared cached steps of a tiny stream on the CPU (bs 3 then bs 1: returning users with cached
    pages, partial last pages, one new user), a bucket big enough for all, and the engine."""
    core_build.load()
    torch.manual_seed(0)
    model = e2e.stream_model(torch.device("cpu"), hidden=16, layers=2, heads=2, head_dim=8)
    kv = e2e.stream_cache_config(torch.device("cpu"), 8, max_len=40, stride=6, layers=2, heads=2, head_dim=8,
                                 page_size=PAGE)
    kv.host_cache_bytes = 16 * kv.page_bytes
    assert kv.num_pages == NUM_PAGES
    cache = KVCacheModule(kv, "native")
    eng = RankingEngine(model, cache, "cpu")
    batches = e2e.stream(3, 3, 10, 40, 6, 9)
    for b in batches[:2]:
        eng.score(b)
    big = eng.prepare(batches[2])
    small = eng.prepare(e2e.other_users(e2e.stream(1, 1, 10, 10, 6, 8), 100)[0])  # a new user
    graphs = gm.CachedStackGraphs(model, cache, token_quantum=64, new_quantum=32, q_quantum=32)
    graphs._scratch = cache.manager.reserve_scratch_pages(1)[0]
    key = gm.bucket_key(3, big.layout.num_query_tokens, big.plan.metadata.num_new_tokens, big.layout.max_q_len,
                        64, 32, 32)
    bucket = graphs._new_bucket((*key, None), 64, torch.device("cpu"))
    yield eng, graphs, bucket, big, small
    eng.discard(big)
    eng.discard(small)


def args(bucket, step):
    """The packing's arguments for ``step`` into ``bucket``'s current host buffer, as tensors."""
    layout, plan = step.layout, step.plan
    meta = plan.metadata
    spans = [x for name in gm._META_FIELDS for x in meta.field_offsets[name]]
    return [bucket.inputs.staging(), list(bucket.spans), layout.token_ids.reshape(-1), layout.q_offsets,
            layout.new_rows, layout.candidate_rows, plan.host_metadata, spans, meta.page_size, NUM_PAGES,
            bucket.scratch_slots]


def numpy_args(a):
    return [x.numpy() if isinstance(x, torch.Tensor) else x for x in a]


def pack(form, a) -> int:
    if form == "C++":
        return torch.ops.gr_kv_core.pack_cached_step(*a)
    return gm.pack_cached_numpy(*numpy_args(a))


@pytest.mark.parametrize("form", ["C++", "numpy"])
def test_each_field_holds_what_it_means_and_a_smaller_step_resets_the_tails(steps, form):
    _, _, bucket, big, small = steps
    p = bucket.inputs
    f = p.fields
    tokens = bucket.tokens
    for step in (big, small):
        p.buffer()[:] = -7  # stale ints everywhere: every read part must be written
        end = pack(form, args(bucket, step))
        buf = p.buffer()
        layout, meta = step.layout, step.plan.metadata
        nq, n, m, bsz = layout.num_query_tokens, meta.num_new_tokens, meta.num_batch_pages, meta.batch_size
        ids = buf[f["ids"][0]:f["ids"][1]].reshape(4, tokens)
        np.testing.assert_array_equal(ids[:, :nq], layout.token_ids.reshape(4, nq).numpy())
        assert (ids[:, nq:] == 0).all()
        q = buf[f["q_offsets"][0]:f["q_offsets"][1]]
        np.testing.assert_array_equal(q[: bsz + 1], layout.q_offsets.numpy())
        assert (q[bsz + 1:] == tokens).all()  # the padding user holds [nq, tokens), the users past it none
        cand = buf[f["cand_rows"][0]:f["cand_rows"][1]]
        np.testing.assert_array_equal(cand[: layout.candidate_rows.numel()], layout.candidate_rows.numpy())
        assert (cand[layout.candidate_rows.numel():] == 0).all()
        rows = buf[f["rows"][0]:f["rows"][1]]
        np.testing.assert_array_equal(rows[:n], layout.new_rows.numpy())
        assert (rows[n:] == 0).all()
        slots = buf[f["slots"][0]:f["slots"][1]]
        np.testing.assert_array_equal(slots[:n], meta.new_token_slots.numpy())  # the metadata's own derivation
        np.testing.assert_array_equal(slots[n:], bucket.scratch_slots[n:].numpy())
        assert slots[n:].min() // PAGE == slots[n:].max() // PAGE == graphs_scratch(steps)
        indptr = buf[f["kv_indptr"][0]:f["kv_indptr"][1]]
        np.testing.assert_array_equal(indptr[: bsz + 1], meta.kv_indptr.numpy())
        assert (indptr[bsz + 1:] == m).all()
        for name in ("total_lengths", "new_lengths"):
            got = buf[f[name][0]:f[name][1]]
            np.testing.assert_array_equal(got[:bsz], getattr(meta, name).numpy())
            assert (got[bsz:] == 0).all()
        a = f["kv_indices"][0]
        np.testing.assert_array_equal(buf[a:a + m], meta.kv_indices.numpy())
        assert end == a + m
        assert (buf[a + m:] == -7).all()  # past the batch's pages nothing is read, nothing written


def graphs_scratch(steps) -> int:
    return steps[1]._scratch


def test_both_forms_write_the_same_ints(steps):
    _, _, bucket, big, small = steps
    for step in (big, small, big):
        written = []
        for form in ("C++", "numpy"):
            bucket.inputs.buffer()[:] = -7
            end = pack(form, args(bucket, step))
            written.append((end, bucket.inputs.buffer().copy()))
        assert written[0][0] == written[1][0]
        np.testing.assert_array_equal(written[0][1], written[1][1])


def _meta_at(a, name):
    """(start, end) of metadata field ``name`` in ``a``'s host metadata."""
    i = gm._META_FIELDS.index(name)
    return a[7][2 * i], a[7][2 * i + 1]


def _edge_inputs(a, bucket):
    """(error, arguments) pairs: each a bad input for the packing (``error``: its message's first line)
    or, with ``error`` None, a valid one at the edge of a check."""
    meta = a[6]
    f = bucket.inputs.fields

    def with_meta(change):
        b = list(a)
        b[6] = meta.clone()
        change(b)
        return b

    def field(name, delta):
        b = list(a)
        b[1] = list(a[1])
        b[1][2 * gm._CACHED_FIELDS.index(name) + 1] += delta
        return b

    def at(name, i, value):
        def change(b):
            s, _ = _meta_at(b, name)
            b[6][s + i] = value
        return change

    def arg(i, value):
        return [*a[:i], value, *a[i + 1:]]

    def room(name):
        return f[name][1] - f[name][0]

    ip0, ip1 = _meta_at(a, "kv_indptr")
    indptr = meta[ip0:ip1]
    bsz = ip1 - ip0 - 1
    n = _meta_at(a, "new_token_batch")[1] - _meta_at(a, "new_token_batch")[0]
    pages = _meta_at(a, "kv_indices")[1] - _meta_at(a, "kv_indices")[0]
    last = int(indptr[bsz] - indptr[bsz - 1])  # the last user's pages (the last new token is theirs)
    first = int(indptr[1] - indptr[0])  # the first user's (the first new token is theirs)
    slots = NUM_PAGES * PAGE
    bad_scratch = torch.cat([torch.tensor([-1]), a[10][1:]])
    return [
        ("page_size must be >= 1, got 0", arg(8, 0)),
        ("fields takes 18 ints, got 16", [a[0], a[1][:-2], *a[2:8], 0, *a[9:]]),  # (and page_size 0)
        ("meta_fields takes 12 ints, got 11", [*a[:7], a[7][:-1], -1, *a[9:]]),  # (and page_size -1)
        ("num_pages -1 of 4 slots is not a table size", arg(9, -1)),
        (f"num_pages {2 ** 62} of 4 slots is not a table size", arg(9, 2 ** 62)),
        (f"dst field kv_indices [{f['kv_indices'][0]}, {f['kv_indices'][1] + 10 ** 6}) is not inside "
         f"[0, {a[0].numel()})", field("kv_indices", 10 ** 6)),
        (f"metadata field new_lengths [{a[7][-2]}, {a[6].numel() + 1}) is not inside [0, {a[6].numel()})",
         [*a[:7], [*a[7][:-1], a[6].numel() + 1], *a[8:]]),
        (f"the ids field holds {room('ids') - 1} ints, not 4 rows of one length", field("ids", -1)),
        (f"token_ids has {a[2].numel() - 1} entries, not 4 rows of one length", arg(2, a[2][:-1])),
        (f"ids has {bucket.tokens + 1} rows but its field holds {bucket.tokens}",
         arg(2, torch.zeros(4 * (bucket.tokens + 1), dtype=torch.int64))),
        (None, arg(2, torch.zeros(4 * bucket.tokens, dtype=torch.int64))),
        (f"q_offsets has {room('q_offsets') + 1} entries but its field holds {room('q_offsets')}",
         arg(3, torch.zeros(room("q_offsets") + 1, dtype=torch.int64))),
        (None, arg(3, torch.zeros(room("q_offsets"), dtype=torch.int64))),
        (f"rows has {room('rows') + 1} entries but its field holds {room('rows')}",
         arg(4, torch.zeros(room("rows") + 1, dtype=torch.int64))),
        (f"cand_rows has {room('cand_rows') + 1} entries but its field holds {room('cand_rows')}",
         arg(5, torch.zeros(room("cand_rows") + 1, dtype=torch.int64))),
        (None, arg(5, torch.zeros(room("cand_rows"), dtype=torch.int64))),
        (f"metadata fields disagree: kv_indptr 0, total_lengths {bsz}, new_lengths {bsz}, new_token_batch {n}, "
         f"new_token_positions {n}", [*a[:7], [ip0, ip0, *a[7][2:]], *a[8:]]),  # bsz -1
        (f"scratch_slots has {room('slots') + 1} entries for a slots field of {room('slots')}",
         arg(10, torch.cat([a[10], a[10][:1]]))),
        (f"scratch_slots[0] = {slots} is not a slot of the table's {slots}",
         arg(10, torch.cat([torch.tensor([slots]), a[10][1:]]))),
        (None, arg(10, torch.cat([torch.tensor([slots - 1]), a[10][1:]]))),
        (f"kv_indptr[{bsz - 1}:{bsz + 1}] = [{int(indptr[bsz - 1])}, {pages + 1}] is not a range inside [0, {pages}]",
         with_meta(at("kv_indptr", bsz, pages + 1))),
        (f"kv_indptr[0:2] = [0, -1] is not a range inside [0, {pages}]", with_meta(at("kv_indptr", 1, -1))),
        (f"kv_indices[{pages - 1}] = {NUM_PAGES} is not a page of the table's {NUM_PAGES}",
         with_meta(at("kv_indices", pages - 1, NUM_PAGES))),
        (None, with_meta(at("kv_indices", pages - 1, NUM_PAGES - 1))),
        (f"kv_indices[0] = -1 is not a page of the table's {NUM_PAGES}", with_meta(at("kv_indices", 0, -1))),
        (f"new token {n - 1} belongs to batch row {bsz} of {bsz}", with_meta(at("new_token_batch", n - 1, bsz))),
        (f"new token 0 belongs to batch row -1 of {bsz}", with_meta(at("new_token_batch", 0, -1))),
        (f"new token {n - 1} at position {last * PAGE} lies past user {bsz - 1}'s {last} pages of {PAGE}",
         with_meta(at("new_token_positions", n - 1, last * PAGE))),
        (None, with_meta(at("new_token_positions", n - 1, last * PAGE - 1))),
        (f"new token 0 at position -1 lies past user 0's {first} pages of {PAGE}",
         with_meta(at("new_token_positions", 0, -1))),
        (f"new_rows must be a contiguous 1-D int64 CPU tensor, got Int [{a[4].numel()}] on cpu", arg(4, a[4].int())),
        (None, arg(9, (2 ** 63 - 1) // PAGE)),  # the largest table whose slots fit int64
        (f"scratch_slots[0] = {int(a[10][0])} is not a slot of the table's 0", arg(9, 0)),
        # two bad inputs at once: the first in the op's order is named
        ("num_pages -1 of 4 slots is not a table size", [*field("kv_indices", 10 ** 6)[:9], -1, a[10]]),
        (f"scratch_slots[0] = -1 is not a slot of the table's {slots}",
         [*with_meta(at("kv_indptr", 1, -1))[:10], bad_scratch]),
        (f"scratch_slots[0] = -1 is not a slot of the table's {slots}",
         [*with_meta(at("kv_indices", 0, -1))[:10], bad_scratch]),
        (f"kv_indptr[0:2] = [0, -1] is not a range inside [0, {pages}]",
         with_meta(lambda b: (at("kv_indptr", 1, -1)(b), at("kv_indices", 0, -1)(b)))),
        (f"kv_indices[0] = -1 is not a page of the table's {NUM_PAGES}",
         with_meta(lambda b: (at("kv_indices", 0, -1)(b), at("new_token_positions", 0, -1)(b)))),
    ]


EDGES = 38


def test_every_edge_case_is_listed(steps):
    _, _, bucket, big, _ = steps
    assert len(_edge_inputs(args(bucket, big), bucket)) == EDGES


@pytest.mark.parametrize("case", range(EDGES))
def test_each_check_refuses_past_its_edge_in_both_forms_alike_and_writes_nothing(steps, case):
    """Each bad input raises the same first ValueError in both forms, the buffer left as it was; each
    valid input at a check's edge is taken, both forms writing the same ints."""
    _, _, bucket, big, _ = steps
    what, edge = _edge_inputs(args(bucket, big), bucket)[case]
    results = []
    for form in ("C++", "numpy"):
        if form == "numpy" and what is not None and "must be a contiguous" in what:
            continue  # (numpy takes any integer array: only the C++ op reads raw int64 memory)
        bucket.inputs.buffer()[:] = -7
        if what is None:
            end = pack(form, edge)
            results.append((end, bucket.inputs.buffer().tobytes()))
            continue
        with pytest.raises(ValueError) as err:
            pack(form, edge)
        assert str(err.value).splitlines()[0] == what, form
        assert (bucket.inputs.buffer() == -7).all(), f"{form} wrote before refusing ({what})"
        results.append(str(err.value).splitlines()[0])
    assert len(set(results)) == 1, results


def test_load_takes_the_op_where_the_core_is_loaded_and_numpy_elsewhere(steps, monkeypatch):
    _, graphs, bucket, big, _ = steps
    calls = []
    op = torch.ops.gr_kv_core.pack_cached_step

    class Ops:
        @staticmethod
        def pack_cached_step(*a):
            calls.append("C++")
            assert a[9] == graphs.cache.config.num_pages == NUM_PAGES  # the table's pages bound every slot
            return op(*a)

    monkeypatch.setattr(gm.torch.ops, "gr_kv_core", Ops, raising=False)
    graphs._load(bucket, big.layout, big.plan)
    native = bucket.inputs.ints.clone()
    assert calls == ["C++"]
    monkeypatch.setattr(gm.core_build, "loaded", lambda: False)
    bucket.inputs.ints.fill_(-1)
    graphs._load(bucket, big.layout, big.plan)
    assert calls == ["C++"]
    end = gm.pack_cached_numpy(*numpy_args(args(bucket, big)))  # (the last buffer sent, refilled alike)
    torch.testing.assert_close(bucket.inputs.ints[:end], native[:end], rtol=0, atol=0)
