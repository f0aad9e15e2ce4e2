"""The full pass as CUDA graphs (`FullStackGraphs`, marker ``gpu``): replays against the eager full
pass under the project's bf16 rule (within 2x the eager pass's error against an fp32 oracle), the
padding user and padding rows, bucket reuse across shapes, and the engine's use of the graphs."""

import pytest
import torch

from tests.modules.helpers import User, make_inputs, tiny_model

pytestmark = pytest.mark.gpu


def _visits(head_dim: int, n_users: int, grows, capture_after: int = 1, **graph_kwargs):
    """Score each visit's batch with the graphs, the eager bf16 pass and an fp32 CPU oracle; return the
    worst graphed and eager errors against the oracle, the worst graphed-eager difference, the graphs."""
    from gr_plugin.modules.full_graphs import FullStackGraphs
    from gr_plugin.modules.tokens import build_token_layout

    ref = tiny_model(0, head_dim=head_dim)
    model = tiny_model(0, head_dim=head_dim).cuda().to(torch.bfloat16)
    graphs = FullStackGraphs(model, capture_after=capture_after, **graph_kwargs)
    assert graphs.supported(torch.device("cuda"))
    g = torch.Generator().manual_seed(11)
    users = [User(u, g) for u in range(n_users)]
    worst_graph = worst_eager = worst_apart = 0.0
    for grow in grows:
        for i, u in enumerate(users):
            u.grow(grow + 5 * i)  # users of different lengths
        cands = [u.candidates(3 + 2 * i) for i, u in enumerate(users)]
        history, candidates, _, _ = make_inputs(users, cands)
        with torch.no_grad():
            exact = ref(history, candidates)
            layout = build_token_layout(history, candidates, None, model.config.max_positions)
            graphed = graphs.step(layout)
            assert graphed is not None
            eager = model(history.to("cuda"), candidates.to("cuda"))
        graphed, eager = graphed.float().cpu(), eager.float().cpu()
        assert graphed.shape == eager.shape == exact.shape
        worst_graph = max(worst_graph, (graphed - exact).abs().max().item())
        worst_eager = max(worst_eager, (eager - exact).abs().max().item())
        worst_apart = max(worst_apart, (graphed - eager).abs().max().item())
    return worst_graph, worst_eager, worst_apart, graphs


@pytest.mark.parametrize("head_dim", [16, 128])
def test_graphed_full_passes_score_as_the_eager_pass(head_dim):
    """Histories growing over five visits (3 users of different lengths and candidate counts): every
    visit replays a bucket (captured on first sight), within the bf16 rule against the fp32 oracle.
    head_dim 128 in bf16 on Hopper takes the Gluon kernel inside the graph, the eager pass Triton's."""
    worst_graph, worst_eager, apart, graphs = _visits(head_dim, 3, [40, 30, 60, 200, 7])
    assert worst_graph <= 2 * worst_eager + 1e-3, (worst_graph, worst_eager)
    assert apart <= 2 * worst_eager + 1e-3, apart
    # visits of 150 and of 1065 rows: at least two buckets, each captured once
    assert graphs.replays == 5 and graphs.captures == len(graphs._buckets) >= 2


def test_one_bucket_replays_every_shape_it_covers():
    """Visits whose row counts and longest sequence round to one bucket share its graph: the padding
    rows (a padding user of candidates only) change nothing in the real rows' scores."""
    worst_graph, worst_eager, apart, graphs = _visits(16, 2, [30, 3, 4, 5])
    assert worst_graph <= 2 * worst_eager + 1e-3 and apart <= 2 * worst_eager + 1e-3, (worst_graph, worst_eager)
    assert graphs.captures == 1 and graphs.replays == 4 and len(graphs._buckets) == 1


def test_rows_that_fill_their_bucket_replay_with_an_empty_padding_user():
    """3 users of 22 / 27 / 32 events and 3 / 5 / 7 candidates: 96 rows, a multiple of the bucket's
    step (16 with ``q_quantum=1``), so the bucket holds no padding row and its padding user is empty."""
    worst_graph, worst_eager, apart, graphs = _visits(16, 3, [22], q_quantum=1)
    assert worst_graph <= 2 * worst_eager + 1e-3 and apart <= 2 * worst_eager + 1e-3, (worst_graph, worst_eager)
    assert list(graphs._buckets) == [(4, 96, 40)] and graphs.replays == 1


def test_full_graph_buckets_give_up_the_least_recently_used_when_idle():
    """Room for one bucket, two shapes in turn: with no idle time required each visit drops the other
    shape's bucket; with the default idle time the second shape's visits run eagerly (None)."""
    from gr_plugin.modules.full_graphs import FullStackGraphs
    from gr_plugin.modules.tokens import build_token_layout

    model = tiny_model(0, head_dim=16).cuda().to(torch.bfloat16)
    g = torch.Generator().manual_seed(3)
    short, long = User(0, g), User(1, g)
    short.grow(20)
    long.grow(700)
    cands = [torch.arange(1, 4)]
    layouts = [build_token_layout(*make_inputs([u], cands)[:2], None, model.config.max_positions)
               for u in (short, long)]
    eager_room = FullStackGraphs(model, max_buckets=1, capture_after=1)
    no_idle = FullStackGraphs(model, max_buckets=1, capture_after=1, idle_steps=0)
    with torch.no_grad():
        ran = [(eager_room.step(layouts[i % 2]) is not None, no_idle.step(layouts[i % 2]) is not None)
               for i in range(4)]
    assert ran == [(True, True), (False, True), (True, True), (False, True)]
    assert no_idle.captures == 4 and no_idle.evictions == 3 and eager_room.captures == 1


def test_eight_users_and_passes_shrinking_within_a_bucket():
    """8 users (the bucket's users: 16, the padding user then 7 empty ones), visits whose rows first
    grow and then shrink within one bucket (its buffers' tails reset), each within the bf16 rule."""
    from gr_plugin.modules.full_graphs import FullStackGraphs, full_bucket_key
    from gr_plugin.modules.tokens import build_token_layout

    ref = tiny_model(0, head_dim=32)
    model = tiny_model(0, head_dim=32).cuda().to(torch.bfloat16)
    graphs = FullStackGraphs(model, capture_after=1)
    g = torch.Generator().manual_seed(5)
    worst_graph = worst_eager = 0.0
    keys = set()
    for sizes in ([35] * 8, [40] * 8, [30, 45, 20, 41, 33, 12, 50, 9], [36, 30, 40, 38, 39, 41, 33, 34]):
        users = []
        for i, n in enumerate(sizes):
            users.append(User(i, g))
            users[-1].grow(n)
        history, candidates, _, _ = make_inputs(users, [u.candidates(4) for u in users])
        with torch.no_grad():
            exact = ref(history, candidates)
            layout = build_token_layout(history, candidates, None, model.config.max_positions)
            keys.add(full_bucket_key(8, layout.num_query_tokens, layout.max_q_len))
            graphed = graphs.step(layout).float().cpu()
            eager = model(history.to("cuda"), candidates.to("cuda")).float().cpu()
        worst_graph = max(worst_graph, (graphed - exact).abs().max().item())
        worst_eager = max(worst_eager, (eager - exact).abs().max().item())
    assert worst_graph <= 2 * worst_eager + 1e-3, (worst_graph, worst_eager)
    assert len(keys) == 1 and next(iter(keys))[0] == 16  # one bucket: 8 users, the padding one, 7 empty
    assert graphs.captures == 1 and graphs.replays == 4


def test_a_capture_that_raises_leaves_its_shape_eager_for_good(monkeypatch):
    """A capture failing with an error (here a RuntimeError) drops its bucket and marks the shape:
    that step and every later one of the shape run eagerly (None) without capturing again."""
    from gr_plugin.modules.full_graphs import FullStackGraphs
    from gr_plugin.modules.tokens import build_token_layout

    model = tiny_model(0, head_dim=16).cuda().to(torch.bfloat16)
    graphs = FullStackGraphs(model, capture_after=1)
    calls = []

    def fail(b):
        calls.append(b)
        raise RuntimeError("operation not permitted when stream is capturing")

    monkeypatch.setattr(graphs, "_capture", fail)
    g = torch.Generator().manual_seed(6)
    user = User(0, g)
    user.grow(30)
    layout = build_token_layout(*make_inputs([user], [user.candidates(3)])[:2], None, model.config.max_positions)
    with torch.no_grad():
        assert graphs.step(layout) is None and graphs.step(layout) is None
    assert len(calls) == 1 and not graphs._buckets and len(graphs._failed) == 1 and graphs.replays == 0


def test_the_engine_without_a_cache_replays_the_full_pass_graphs():
    """``RankingEngine(model, None, cuda_graphs=True)`` scores through `FullStackGraphs` (the layout
    stays on the host for it): each shape's first step runs eagerly, every later one replays; the
    scores are within the bf16 rule against an fp32 engine on the CPU, next to the eager engine's."""
    import copy

    from gr_plugin.bench.e2e import stream
    from gr_plugin.inference import RankingEngine
    from gr_plugin.modules import HSTUConfig, HSTURanker
    from gr_plugin.modules.full_graphs import full_bucket_key

    torch.manual_seed(0)
    cfg = HSTUConfig(num_items=50_000, num_time_buckets=32, max_positions=1024, embedding_dim=64, num_layers=2,
                     num_heads=2, head_dim=32, n_norm=256.0)
    ref_model = HSTURanker(cfg).eval()
    model = copy.deepcopy(ref_model).to(device="cuda", dtype=torch.bfloat16)
    graphed = RankingEngine(model, None, "cuda", cuda_graphs=True)
    eager = RankingEngine(model, None, "cuda")
    oracle = RankingEngine(ref_model, None, "cpu")
    assert graphed.full_graphs is not None and eager.full_graphs is None and graphed.graphs is None
    worst_graph = worst_eager = 0.0
    batches = stream(2, 4, 32, 160, 32, 8)
    keys = set()
    for batch in batches:
        rows = batch.history_lengths + batch.candidate_lengths
        keys.add(full_bucket_key(2, int(rows.sum()), int(rows.max())))
        exact = oracle.score(batch).logits
        a, b = graphed.score(batch).logits.float().cpu(), eager.score(batch).logits.float().cpu()
        worst_graph = max(worst_graph, (a - exact).abs().max().item())
        worst_eager = max(worst_eager, (b - exact).abs().max().item())
    # capture_after=2: each bucket's first step ran eagerly, every other replayed
    assert graphed.full_graphs.replays == len(batches) - len(keys) > 0
    assert graphed.full_graphs.captures == len(graphed.full_graphs._buckets) == len(keys)
    assert worst_graph <= 2 * worst_eager + 1e-3, (worst_graph, worst_eager)
