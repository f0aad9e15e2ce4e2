"""The C++ host half of a step's inputs (``gr_plugin/csrc/core/step_inputs.cpp``) against its numpy
reference: the token layout (``torch.ops.gr_kv_core.token_layout`` vs `host_token_layout` with
``native=False``: the same tensors for random batches, the same errors for bad ones, and the numpy
form where the C++ one cannot take the input), the request checks (``validate_columns`` vs the
numpy `validate_ids`: the same first error for each bad value) and the cache keys (``cache_keys`` vs
`cache_token_keys` with ``native=False``: the same keys, the same first error)."""

import dataclasses
import re

import pytest
import torch

from gr_plugin.csrc.core import build as core_build
from gr_plugin.modules.tokens import (
    _ACTION_BITS,
    _ITEM_BITS,
    _TIME_BITS,
    _numpy_validate,
    cache_token_keys,
    host_token_layout,
    validate_ids,
)


@pytest.fixture(scope="module", autouse=True)
def core():
    core_build.load()


def batch(g: torch.Generator, bsz: int, max_hist: int = 300, max_cand: int = 40):
    hl = torch.randint(1, max_hist, (bsz,), generator=g)
    cl = torch.randint(0, max_cand, (bsz,), generator=g)
    ca = (torch.rand(bsz, generator=g) * (hl + 1)).long().clamp(max=hl)
    ca[0] = hl[0]  # a user with every event cached
    n = int(hl.sum())
    cols = (torch.randint(1, 1000, (n,), generator=g), torch.randint(0, 5, (n,), generator=g),
            torch.randint(0, 32, (n,), generator=g))
    return hl, cols, cl, torch.randint(1, 1000, (int(cl.sum()),), generator=g), ca


def assert_same(a, b):
    for f in dataclasses.fields(a):
        x, y = getattr(a, f.name), getattr(b, f.name)
        if isinstance(x, torch.Tensor):
            assert torch.equal(x, y), f.name
        else:
            assert x == y, f.name


def counting(monkeypatch, name):
    """Route ``torch.ops.gr_kv_core.<name>`` through a counter; returns the list of its calls."""
    calls, real = [], getattr(torch.ops.gr_kv_core, name)

    class Ops:
        pass

    setattr(Ops, name, staticmethod(lambda *args: calls.append(args) or real(*args)))
    monkeypatch.setattr(torch.ops, "gr_kv_core", Ops)
    return calls


@pytest.mark.parametrize("seed", range(6))
def test_the_cpp_layout_equals_the_numpy_one(seed, monkeypatch):
    g = torch.Generator().manual_seed(seed)
    bsz = [1, 2, 3, 8, 17, 1][seed]
    hl, cols, cl, cand, ca = batch(g, bsz)
    hl[-1] = 0 if bsz > 1 else hl[-1]  # a user without history (the layout allows it; validation does not)
    ca[-1] = min(int(ca[-1]), int(hl[-1]))
    cols = tuple(c[: int(hl.sum())].clone() for c in cols)  # the columns of the shortened histories
    calls = counting(monkeypatch, "token_layout")
    runs = 0
    for cached in (ca, None):
        for max_positions, max_q in ((8192, None), (50, 999), (1, None)):  # 50 and 1: positions clipped
            got = host_token_layout(hl, cols, cl, cand, cached, max_positions, max_q)
            want = host_token_layout(hl, cols, cl, cand, cached, max_positions, max_q, native=False)
            assert_same(got, want)
            runs += 1
    stacked = torch.stack(cols)  # the [3, N] form of the columns (build_token_layout's)
    assert_same(host_token_layout(hl, stacked, cl, cand, ca, 4096),
                host_token_layout(hl, stacked, cl, cand, ca, 4096, native=False))
    assert len(calls) == runs + 1  # every native=True call above went through the C++ op


def test_the_cpp_layout_is_taken_where_it_can_be(monkeypatch):
    g = torch.Generator().manual_seed(7)
    hl, cols, cl, cand, ca = batch(g, 4)
    calls = counting(monkeypatch, "token_layout")
    host_token_layout(hl, cols, cl, cand, ca, 4096)
    assert len(calls) == 1
    strided = (torch.stack([cols[0], cols[0]], 1)[:, 0], cols[1], cols[2])  # a non-contiguous column: numpy
    assert_same(host_token_layout(hl, strided, cl, cand, ca, 4096),
                host_token_layout(hl, cols, cl, cand, ca, 4096, native=False))
    host_token_layout(hl, cols, cl, cand.int(), ca, 4096)  # int32 candidates: numpy
    monkeypatch.setattr(core_build, "loaded", lambda: False)  # the core not loaded in this process: numpy
    host_token_layout(hl, cols, cl, cand, ca, 4096)
    assert len(calls) == 1


def test_native_ready_takes_only_contiguous_1d_int64_cpu_tensors(monkeypatch):
    from gr_plugin.modules.tokens import _native_ready

    monkeypatch.setattr(core_build, "loaded", lambda: True)
    ok = torch.arange(6)
    assert _native_ready([ok, ok.clone()])
    for bad in (ok.view(2, 3), ok[::2], ok.int(), torch.empty(6, dtype=torch.int64, device="meta")):
        assert not _native_ready([ok, bad]), bad


BAD = [
    (lambda hl, cols, cl, cand, ca: (hl, cols, cl, cand, ca.index_fill(0, torch.tensor([1]), 10**6)),
     r"cached_lengths\[1\] = 1000000 is outside \[0, \d+\] \(the history length\)"),
    (lambda hl, cols, cl, cand, ca: (hl, cols, cl, cand, ca.index_fill(0, torch.tensor([2]), -1)),
     r"cached_lengths\[2\] = -1 is outside"),
    (lambda hl, cols, cl, cand, ca: (hl, (cols[0][:-1], cols[1], cols[2]), cl, cand, ca),
     r"item column has \d+ entries but the history lengths sum to \d+"),
    (lambda hl, cols, cl, cand, ca: (hl, (cols[0], cols[1], torch.cat([cols[2], cols[2][:1]])), cl, cand, ca),
     r"time column has \d+ entries but the history lengths sum to"),
    (lambda hl, cols, cl, cand, ca: (hl, cols, cl, cand[:-1], ca),
     r"candidate item column has \d+ entries but the candidate lengths sum to"),
    (lambda hl, cols, cl, cand, ca: (hl, cols, cl.index_fill(0, torch.tensor([0]), -3), cand, ca),
     r"candidate_lengths\[0\] = -3 is negative"),
    (lambda hl, cols, cl, cand, ca: (hl, cols, cl[:-1], cand, ca), r"candidate_lengths has 3 entries for 4 users"),
    (lambda hl, cols, cl, cand, ca: (hl, cols, cl, cand, ca[:-1]), r"cached_lengths has 3 entries for 4 users"),
]


@pytest.mark.parametrize("native", [True, False])
@pytest.mark.parametrize("case", range(len(BAD)))
def test_bad_input_raises_the_same_error_both_ways(native, case):
    g = torch.Generator().manual_seed(11)
    hl, cols, cl, cand, ca = batch(g, 4)
    ca[1] = hl[1] - 1  # (so the mutations below are the only bad values)
    make, message = BAD[case]
    args = make(hl, cols, cl, cand, ca)
    with pytest.raises(ValueError, match=message):
        host_token_layout(*args[:4], args[4], 4096, native=native)
    with pytest.raises(ValueError, match="max_positions must be at least 1, got 0"):
        host_token_layout(hl, cols, cl, cand, ca, 0, native=native)
    with pytest.raises(ValueError, match="history_columns must be the item, action and time columns, got 2"):
        host_token_layout(hl, cols[:2], cl, cand, ca, 4096, native=native)


def test_an_empty_batch_and_a_user_with_nothing_to_compute():
    empty = torch.zeros(0, dtype=torch.int64)
    for native in (True, False):
        for max_q in (0, None):
            got = host_token_layout(empty, (empty, empty, empty), empty, empty, empty, 4096, max_q, native=native)
            assert got.num_query_tokens == 0 and got.q_offsets.tolist() == [0] and got.token_ids.numel() == 0
            assert got.max_q_len == 0
    one = torch.tensor([5])
    cols = (torch.arange(1, 6), torch.zeros(5, dtype=torch.int64), torch.ones(5, dtype=torch.int64))
    got = host_token_layout(one, cols, torch.tensor([0]), empty, one, 4096, native=True)
    assert got.num_query_tokens == 0 and got.q_offsets.tolist() == [0, 0] and got.new_lengths.tolist() == [0]
    assert_same(got, host_token_layout(one, cols, torch.tensor([0]), empty, one, 4096, native=False))


@pytest.mark.parametrize("native", [True, False])
def test_lengths_summing_past_int64_are_refused_before_anything_is_read(native):
    """A wrapped sum could equal a column's size (here 0: empty columns) and let the fill run past it."""
    huge = torch.full((4,), 2**62, dtype=torch.int64)
    empty = torch.zeros(0, dtype=torch.int64)
    ones = torch.ones(4, dtype=torch.int64)
    with pytest.raises(ValueError, match=r"history lengths sum past 2\*\*63 - 1"):
        host_token_layout(huge, (empty, empty, empty), ones, torch.ones(4, dtype=torch.int64), None, 4096,
                          native=native)
    with pytest.raises(ValueError, match=r"candidate lengths sum past 2\*\*63 - 1"):
        host_token_layout(ones, (ones, ones, ones), huge, empty, None, 4096, native=native)
    check = validate_ids if native else (lambda *a, **k: _numpy_validate(*a, *k.values()))
    with pytest.raises(ValueError, match=r"history lengths sum past 2\*\*63 - 1"):
        check(huge, (empty, empty, empty), ones, ones, **TABLES)
    # a user without candidates is named before the history's sum, as the reference orders its checks
    with pytest.raises(ValueError, match=r"^user at batch index 0 has 0 candidates events"):
        check(huge[:2], (empty, empty, empty), torch.tensor([0, 1]), ones[:1], **TABLES)


@pytest.mark.parametrize("native", [True, False])
def test_with_several_bad_lengths_both_name_the_same_first_one(native):
    hl, cl = torch.tensor([3, -1]), torch.tensor([-1, 1])
    cols = tuple(torch.ones(2, dtype=torch.int64) for _ in range(3))
    with pytest.raises(ValueError, match=r"history_lengths\[1\] = -1 is negative"):
        host_token_layout(hl, cols, cl, torch.ones(0, dtype=torch.int64), torch.tensor([5, 0]), 4096, native=native)
    with pytest.raises(ValueError, match=r"candidate_lengths\[0\] = -1 is negative"):
        host_token_layout(torch.tensor([3, 1]), tuple(torch.ones(4, dtype=torch.int64) for _ in range(3)), cl,
                          torch.ones(0, dtype=torch.int64), torch.tensor([5, 0]), 4096, native=native)


TABLES = dict(num_items=999, num_actions=5, num_time_buckets=32)


def checked(hl, cols, cl, cand):
    """validate_ids through the C++ op (it must be the one taken) and through numpy: the same outcome."""
    errors = []
    for run in (lambda: validate_ids(hl, cols, cl, cand, **TABLES),
                lambda: _numpy_validate(hl, cols, cl, cand, *TABLES.values())):
        try:
            run()
            errors.append(None)
        except ValueError as e:
            errors.append(str(e))
    assert errors[0] == errors[1], errors
    return errors[0]


VALIDATE_BAD = [
    (lambda hl, cols, cl, cand: (hl.index_fill(0, torch.tensor([2]), 0), cols, cl, cand),
     "user at batch index 2 has 0 history events; at least 1 is required"),
    (lambda hl, cols, cl, cand: (hl, cols, cl.index_fill(0, torch.tensor([1]), -1), cand),
     "user at batch index 1 has -1 candidates events; at least 1 is required"),
    (lambda hl, cols, cl, cand: (hl, (cols[0][:-1], *cols[1:]), cl, cand),
     "item column has"),
    (lambda hl, cols, cl, cand: (hl, cols, cl, torch.cat([cand, cand[:2]])), "candidate item column has"),
    (lambda hl, cols, cl, cand: (hl, (cols[0].index_fill(0, torch.tensor([5]), 0), *cols[1:]), cl, cand),
     "item id 0 is outside the table range [1, 999]"),
    (lambda hl, cols, cl, cand: (hl, (cols[0].index_fill(0, torch.tensor([7]), 1000), *cols[1:]), cl, cand),
     "item id 1000 is outside the table range [1, 999]"),
    (lambda hl, cols, cl, cand: (hl, (cols[0], cols[1].index_fill(0, torch.tensor([3]), 5), cols[2]), cl, cand),
     "action id 5 is outside the table range [0, 4]"),
    (lambda hl, cols, cl, cand: (hl, (*cols[:2], cols[2].index_fill(0, torch.tensor([0]), -4)), cl, cand),
     "time id -4 is outside the table range [0, 31]"),
    (lambda hl, cols, cl, cand: (hl, cols, cl, cand.index_fill(0, torch.tensor([1]), 10**9)),
     "candidate item id 1000000000 is outside the table range [1, 999]"),
    # two bad columns: the first in the reference's order (item, action, time, candidate item) is named
    (lambda hl, cols, cl, cand: (hl, (cols[0], cols[1].index_fill(0, torch.tensor([4]), 9),
                                      cols[2].index_fill(0, torch.tensor([2]), 99)), cl, cand),
     "action id 9 is outside the table range [0, 4]"),
    # one column bad both ways: its min is named
    (lambda hl, cols, cl, cand: (hl, (*cols[:2], cols[2].index_fill(0, torch.tensor([1]), 40)
                                      .index_fill(0, torch.tensor([6]), -2)), cl, cand),
     "time id -2 is outside the table range [0, 31]"),
]


def test_the_cpp_checks_pass_a_good_request_and_raise_the_reference_error_for_each_bad_one(monkeypatch):
    g = torch.Generator().manual_seed(3)
    hl, cols, cl, cand, _ = batch(g, 5)
    cl = cl + 1  # at least one candidate each
    cand = torch.randint(1, 1000, (int(cl.sum()),), generator=g)
    calls = counting(monkeypatch, "validate_columns")
    assert checked(hl, cols, cl, cand) is None and len(calls) == 1
    for make, message in VALIDATE_BAD:
        got = checked(*make(hl, cols, cl, cand))
        assert got is not None and got.startswith(message), (got, message)
    assert len(calls) == 1 + len(VALIDATE_BAD)


@pytest.mark.parametrize("n", [1, 7, 8, 9, 12, 15, 33, 1000, 4100])
def test_the_cpp_range_check_finds_a_bad_id_at_every_position(n):
    # the check's loop is vectorised (lanes of 2-8 values, then leftover loops of 4 and 1): a bad id in
    # the first lane, the middle, and each of the last four positions fails, with the reference's message
    g = torch.Generator().manual_seed(n)
    hl, cl = torch.tensor([n]), torch.tensor([1])
    cols = (torch.randint(1, 1000, (n,), generator=g), torch.randint(0, 5, (n,), generator=g),
            torch.randint(0, 32, (n,), generator=g))
    cand = torch.tensor([3])
    assert checked(hl, cols, cl, cand) is None
    for at in sorted({0, n // 2} | {max(0, n - k) for k in range(1, 5)}):
        for bad, message in ((-(2**63), f"time id {-(2**63)} is outside"), (2**63 - 1, f"time id {2**63 - 1} is"),
                             (32, "time id 32 is outside the table range [0, 31]"), (-1, "time id -1 is outside")):
            got = checked(hl, (*cols[:2], cols[2].index_fill(0, torch.tensor([at]), bad)), cl, cand)
            assert got is not None and got.startswith(message), (at, bad, got)


def test_negative_table_sizes_are_refused_before_anything_is_read(monkeypatch):
    hl, cl = torch.tensor([2]), torch.tensor([1])
    cols = (torch.tensor([1, 2]), torch.tensor([0, 0]), torch.tensor([0, 1]))
    for native in (True, False):
        if not native:
            monkeypatch.setattr(core_build, "loaded", lambda: False)
        with pytest.raises(ValueError, match=r"^num_actions must be >= 0, got -1"):
            validate_ids(hl, cols, cl, torch.tensor([1]), num_items=5, num_actions=-1, num_time_buckets=4)
    with pytest.raises(ValueError, match=rf"^num_time_buckets must be >= 0, got {-(2**63)}"):
        torch.ops.gr_kv_core.validate_columns(hl, *cols, cl, torch.tensor([1]), 5, 3, -(2**63))


def test_a_table_without_valid_ids_refuses_every_id_both_ways():
    hl, cl = torch.tensor([2]), torch.tensor([1])
    cols = (torch.tensor([1, 2]), torch.tensor([0, 0]), torch.tensor([0, 1]))
    for run in (lambda: validate_ids(hl, cols, cl, torch.tensor([1]), num_items=5, num_actions=0,
                                     num_time_buckets=4),
                lambda: _numpy_validate(hl, cols, cl, torch.tensor([1]), 5, 0, 4)):
        with pytest.raises(ValueError, match=r"^action id 0 is outside the table range \[0, -1\]"):
            run()


def key_columns(g: torch.Generator, n: int):
    return (torch.randint(0, 2**39, (n,), generator=g), torch.randint(0, 256, (n,), generator=g),
            torch.randint(0, 2**16, (n,), generator=g))


@pytest.mark.parametrize("n", [0, 1, 7, 9, 12, 15, 4099])
def test_the_cpp_cache_keys_equal_the_numpy_ones(n, monkeypatch):
    g = torch.Generator().manual_seed(n)
    cols = key_columns(g, n)
    if n:  # the fields' edges
        cols[0][0], cols[1][0], cols[2][0] = 2**_ITEM_BITS - 1, 2**_ACTION_BITS - 1, 2**_TIME_BITS - 1
    calls = counting(monkeypatch, "cache_keys")
    for check in (True, False):
        got = cache_token_keys(*cols, check=check)
        assert got.dtype == torch.int64 and torch.equal(got, cache_token_keys(*cols, check=check, native=False))
    assert len(calls) == 2
    # unchecked, ids outside the fields wrap as numpy's shifts do (negative, past 2**39, past 2**63 / 2**24)
    wild = (torch.tensor([-1, 2**39, 2**62, 5]), torch.tensor([-7, 256, 0, 2**60]),
            torch.tensor([-(2**63), 2**16, 1, 0]))
    assert torch.equal(cache_token_keys(*wild, check=False), cache_token_keys(*wild, check=False, native=False))


# (column, value, message); the C++ op's field widths are its own constants: these cases tie them to
# the Python ones (`_ITEM_BITS`, ...), which `keys_fit` reads
KEYS_BAD = [(0, -1, f"item id -1 is outside [0, 2**{_ITEM_BITS})"),
            (0, 2**_ITEM_BITS, f"item id {2**_ITEM_BITS} is outside [0, 2**{_ITEM_BITS})"),
            (1, 2**_ACTION_BITS, f"action id {2**_ACTION_BITS} is outside [0, 2**{_ACTION_BITS})"),
            (1, -(2**63), f"action id {-(2**63)} is outside"),
            (2, 2**_TIME_BITS, f"time bucket id {2**_TIME_BITS} is outside [0, 2**{_TIME_BITS})"),
            (2, -5, "time bucket id -5 is outside")]


@pytest.mark.parametrize("case", range(len(KEYS_BAD)))
def test_the_cpp_cache_keys_raise_the_reference_error(case, monkeypatch):
    column, value, message = KEYS_BAD[case]
    g = torch.Generator().manual_seed(case)
    cols = list(key_columns(g, 37))
    calls = counting(monkeypatch, "cache_keys")
    for at in (0, 18, 33, 34, 35, 36):
        bad = [c.clone() for c in cols]
        bad[column][at] = value
        if column == 1:  # a later column is bad too: the first bad column is named
            bad[2][at] = -3
        for native in (True, False):
            with pytest.raises(ValueError, match="^" + re.escape(message)):
                cache_token_keys(*bad, native=native)
    assert len(calls) == 6  # every native=True call went through the C++ op


def test_a_key_column_bad_both_ways_names_its_min_both_ways():
    items, actions = torch.tensor([1, 2, 3, 4]), torch.tensor([0, 1, 2, 3])
    times = torch.tensor([0, 2**_TIME_BITS, 5, -9])
    for native in (True, False):
        with pytest.raises(ValueError, match=r"^time bucket id -9 is outside"):
            cache_token_keys(items, actions, times, native=native)


@pytest.mark.parametrize("native", [True, False])
def test_cache_keys_refuse_columns_of_other_sizes_both_ways(native):
    with pytest.raises(ValueError, match=r"^time bucket column has 2 entries, the item column 3"):
        cache_token_keys(torch.tensor([1, 2, 3]), torch.tensor([0, 1, 2]), torch.tensor([0, 1]), native=native)
    with pytest.raises(ValueError, match=r"^action column has 1 entries, the item column 0"):
        cache_token_keys(torch.zeros(0, dtype=torch.int64), torch.tensor([-1]), torch.zeros(0, dtype=torch.int64),
                         check=False, native=native)
