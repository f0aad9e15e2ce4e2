"""The transfer engine's runs of pages (`contiguous_runs`, `joint_runs`): each run is one copy; and
its groups of layers (`layer_spans`): every layer in exactly one group."""

from hypothesis import given, settings
from hypothesis import strategies as st

from gr_plugin.cache.transfer import contiguous_runs, joint_runs, layer_spans

_slots = st.lists(st.integers(0, 40), max_size=30)


def _maximal_split(pairs):
    """Reference: split a sequence of (index, value...) at every break of +1 steps."""
    runs = []
    for p in pairs:
        if runs and all(a == b + runs[-1][1] for a, b in zip(p, runs[-1][0])):
            runs[-1][1] += 1
        else:
            runs.append([p, 1])
    return [(*start, n) for start, n in runs]


@settings(max_examples=200, deadline=None)
@given(_slots, st.integers(0, 5))
def test_contiguous_runs_are_the_maximal_runs(slots, shift):
    slots = slots or list(range(shift, shift + 7))  # the consecutive fast path, too
    runs = contiguous_runs(slots)
    assert runs == _maximal_split([(i, s) for i, s in enumerate(slots)])
    assert [s + k for _, s, n in runs for k in range(n)] == slots


@settings(max_examples=200, deadline=None)
@given(_slots, st.integers(0, 5), st.booleans())
def test_joint_runs_break_where_either_side_breaks(src, start, consecutive_dst):
    dst = list(range(start, start + len(src))) if consecutive_dst else [x * 2 for x in src]
    runs = joint_runs(src, dst)
    assert runs == _maximal_split(list(zip(src, dst)))
    assert [(s + k, d + k) for s, d, n in runs for k in range(n)] == list(zip(src, dst))


def test_consecutive_pages_are_one_run_and_a_gap_makes_two():
    assert joint_runs(list(range(3, 130)), list(range(7, 134))) == [(3, 7, 127)]
    assert joint_runs([3, 4, 5, 6], [7, 8, 10, 11]) == [(3, 7, 2), (5, 10, 2)]
    assert contiguous_runs([5, 6, 7]) == [(0, 5, 3)] and contiguous_runs([]) == []
    assert joint_runs([], []) == []


def test_layer_spans_copy_each_layer_once_first_and_last_alone_the_rest_in_pairs():
    assert layer_spans(8) == (1, 2, 0, 2, 0, 2, 0, 1)  # 0 | 1 2 | 3 4 | 5 6 | 7
    assert layer_spans(5) == (1, 2, 0, 1, 1)
    assert layer_spans(8, grouped=False) == (1,) * 8
    for n in range(1, 20):
        spans = layer_spans(n)
        firsts = [layer for layer, span in enumerate(spans) if span]
        covered = [layer + k for layer in firsts for k in range(spans[layer])]
        assert covered == list(range(n)), n  # every layer in exactly one copy, in order
        assert spans[0] == 1 and spans[-1] == 1 and set(spans) <= {0, 1, 2}, spans
