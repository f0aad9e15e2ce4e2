"""The C++ runner (gr_plugin/csrc/runner): built with CMake against the wheel's libtorch, it replays a
recorded stream through the AOTInductor package with its own cache (the C++ core) and must give the
Python path's scores (1e-5, fp32, CPU), the same inputs and cached lengths, hits on repeat visits, and
a clear error with a non-zero exit for a bad stream. Slow: exports a package and builds the runner."""

from __future__ import annotations

import shutil
import struct
import subprocess

import pytest
import torch

from gr_plugin.csrc.runner.build import build_runner, run_runner
from gr_plugin.export.runner import export_package
from gr_plugin.export.stream import StreamBatch, read_stream, record_stream

from ..modules.helpers import User, make_inputs, tiny_cache, tiny_model

pytestmark = pytest.mark.slow

# (users visiting, new events per user, candidates): a first visit, returning users with new events,
# an all-cached visit, histories past max_positions (64), a user back after others, a batch too big for
# the cache (a full pass), then users back again (they hit what they had before it).
VISITS = [((0, 1, 2), 0, 3), ((1, 2, 3), 2, 2), ((0, 1, 2), 3, 4), ((1, 2, 3), 0, 1), ((0, 1, 2), 60, 3),
          ((0, 3), 1, 2), ((0, 1, 2, 3), 5, 2), ((0, 1, 2, 3), 100, 2), ((1, 2), 1, 1)]
FULL_PASS = 7  # the batch of VISITS too big for the 96-page cache: a full pass (Python's and the runner's)


@pytest.fixture(scope="module")
def exported(tmp_path_factory):
    out = tmp_path_factory.mktemp("runner")
    model = tiny_model(1, head_dim=16)
    g = torch.Generator().manual_seed(3)
    users = [User(u, g) for u in range(4)]
    for u in users:
        u.grow(5 + 3 * u.uid)
    cache = tiny_cache(model, backend="gpu", num_pages=96, page_size=4)
    history, candidates, lengths, keys = make_inputs(users[:3], [u.candidates(3) for u in users[:3]])
    plan = cache.begin([0, 1, 2], lengths, keys)
    package = export_package(model, cache, history, candidates, plan, out / "model.pt2")
    cache.abort(plan)
    batches = []
    for uids, grow, ncand in VISITS:
        sel = [users[u] for u in uids]
        for u in sel:
            u.grow(grow + (u.uid if grow else 0))
        history, candidates, _, _ = make_inputs(sel, [u.candidates(ncand + u.uid % 2) for u in sel])
        batches.append(StreamBatch(list(uids), history, candidates))
    stream = record_stream(model, tiny_cache(model, backend="gpu", num_pages=96, page_size=4), batches,
                           out / "stream")
    return model, package, stream, out


@pytest.fixture(scope="module")
def runner():
    return build_runner()


def test_runner_scores_equal_python_path(exported, runner):
    model, package, stream_dir, out = exported
    res = run_runner(package, stream_dir, runner=runner, scores_out=out / "scores.bin")
    assert res.returncode == 0, res.stderr
    r, stream = res.report, read_stream(stream_dir)
    assert r["ok"] is True and r["max_abs_diff"] <= 1e-5
    assert r["batches"] == len(VISITS)
    # the C++ layout and page inputs equal Python's, and its cache reused what Python's did
    assert r["inputs_compared"] == r["inputs_equal"] == len(VISITS)
    assert r["cached_lengths_equal_batches"] == len(VISITS)
    cached = stream.arrays["cached_lengths"]
    assert r["cached_tokens"] == int(cached.sum()) and r["hit_rate"] > 0.3
    # the batch that does not fit ran as a full pass through the package (scratch table), in both
    off = stream.arrays["batch_offsets"].tolist()
    full_pass = range(off[FULL_PASS], off[FULL_PASS + 1])
    assert r["full_pass_batches"] == 1 and int(cached[full_pass.start : full_pass.stop].sum()) == 0
    assert int(stream.arrays["history_lengths"].max()) > model.config.max_positions  # clamped positions
    first = {}
    for i, u in enumerate(stream.arrays["user_ids"].tolist()):
        if u in first and i not in full_pass:  # a repeat visit reuses the history cached before
            assert int(cached[i]) > 0
        first.setdefault(u, i)
    # the runner's scores also equal a full recomputation
    scores = torch.from_file(str(out / "scores.bin"), size=stream.arrays["scores"].numel(), dtype=torch.float32)
    scores = scores.view_as(stream.arrays["scores"])
    at = 0
    for t in range(stream.num_batches):
        b = stream.batch(t)
        with torch.no_grad():
            full = model(b.history, b.candidates)
        assert (scores[at : at + full.shape[0]] - full).abs().max().item() <= 1e-5
        at += full.shape[0]
    assert at == scores.shape[0]


def test_runner_without_hits(exported, runner):
    _, package, stream_dir, _ = exported
    res = run_runner(package, stream_dir, runner=runner, mode="miss")
    assert res.returncode == 0, res.stderr
    assert res.report["cached_tokens"] == 0 and res.report["max_abs_diff"] <= 1e-5
    assert res.report["inputs_compared"] == 0  # Python's inputs were recorded with hits


@pytest.mark.parametrize("device_pages, host_pages", [(24, 64), (12, 7)])
def test_runner_with_a_host_tier_reuses_what_python_did(exported, runner, tmp_path, device_pages, host_pages):
    """A small device cache and a pinned host tier: users evicted from the device come back and are
    onboarded from the host tier, in Python (recording) and in the runner (HostCore both). With 7
    host pages a batch's write-through competes for slots: every user's reservation comes before any
    publish, so a later user's reserve fails rather than dropping an earlier user of the batch."""
    model, package, _, _ = exported
    g = torch.Generator().manual_seed(11)
    users = [User(u, g) for u in range(6)]
    for u in users:
        u.grow(12 + 2 * u.uid)
    visits = [((0, 1), 0), ((2, 3), 0), ((4, 5), 0), ((0, 1), 2), ((2, 3), 0), ((4, 5), 3), ((0, 2), 1),
              ((1, 3, 5), 2), ((1, 3), 1), ((5, 0), 1)]
    batches = []
    for uids, grow in visits:
        sel = [users[u] for u in uids]
        for u in sel:
            u.grow(grow)
        history, candidates, _, _ = make_inputs(sel, [u.candidates(2) for u in sel])
        batches.append(StreamBatch(list(uids), history, candidates))
    cache = tiny_cache(model, backend="native", num_pages=device_pages, page_size=4, host_pages=host_pages)
    stream_dir = record_stream(model, cache, batches, tmp_path / "hosted")
    stats = cache.manager.stats()
    python_host_tokens = stats["tokens_reused_host"]
    assert python_host_tokens > 0  # the scenario does reach the host tier
    if host_pages == 7:
        assert stats["host_reserve_failed"] > 0 and stats["host_evicted_users"] > 0
    res = run_runner(package, stream_dir, runner=runner)
    assert res.returncode == 0, res.stderr
    r = res.report
    assert r["ok"] is True and r["max_abs_diff"] <= 1e-5 and r["host_slots"] == host_pages
    assert r["inputs_compared"] == r["inputs_equal"] == len(visits)
    assert r["cached_lengths_equal_batches"] == len(visits)
    assert r["host_hit_tokens"] == python_host_tokens and r["host_pages_written"] > 0


def _corrupt(src, dst, name, fn):
    shutil.copytree(src, dst)
    path = dst / name
    if name.endswith(".bin"):
        path.write_bytes(fn(path.read_bytes()))
    else:
        path.write_text(fn(path.read_text()))
    return dst


@pytest.mark.parametrize("name, fn, message", [
    ("scores.bin", lambda b: b[:-4], "bytes, the header says"),
    ("header.txt", lambda s: s.replace("gr_plugin_stream 1", "gr_plugin_stream 7"), "first line must be"),
    ("header.txt", lambda s: s.replace("page_size 4", "page_size 0"), "page_size must be > 0, got 0"),
    ("history_events.bin", lambda b: (999).to_bytes(8, "little") + b[8:], "item id 999 is outside [1, 50]"),
    ("batch_offsets.bin", lambda b: b[:8] + (100).to_bytes(8, "little") + b[16:], "batch_offsets must increase"),
])
def test_runner_rejects_an_invalid_stream(exported, runner, tmp_path, name, fn, message):
    _, package, stream_dir, _ = exported
    bad = _corrupt(stream_dir, tmp_path / "bad", name, fn)
    res = run_runner(package, bad, runner=runner)
    assert res.returncode == 2
    assert "invalid stream" in res.stderr and message in res.stderr, res.stderr


def test_runner_fails_on_a_score_mismatch(exported, runner, tmp_path):
    _, package, stream_dir, _ = exported
    def shift(b):
        return struct.pack("<f", struct.unpack("<f", b[:4])[0] + 1e-3) + b[4:]

    res = run_runner(package, _corrupt(stream_dir, tmp_path / "bad", "scores.bin", shift), runner=runner)
    assert res.returncode == 1 and res.report["ok"] is False
    assert 9e-4 < res.report["max_abs_diff"] < 1.1e-3
    assert "exceeds the tolerance" in res.stderr


def test_runner_reports_a_missing_package_or_ops_library(exported, runner, tmp_path):
    _, _, stream_dir, _ = exported
    res = run_runner(tmp_path / "none.pt2", stream_dir, runner=runner)
    assert res.returncode == 2 and "cannot load the package" in res.stderr and "none.pt2" in res.stderr
    proc = subprocess.run([str(runner), "--package", "x.pt2", "--stream", str(stream_dir)], capture_output=True,
                          text=True, env={"PATH": "/usr/bin"})
    assert proc.returncode == 2 and "no gr_kv ops library" in proc.stderr
    proc = subprocess.run([str(runner), "--package", "x.pt2", "--stream", str(stream_dir), "--ops", "x.so",
                           "--device", "tpu:x"], capture_output=True, text=True)
    assert proc.returncode == 2 and "--device must be cpu or cuda[:N], got 'tpu:x'" in proc.stderr
    proc = subprocess.run([str(runner), "--package", "x.pt2", "--stream", str(stream_dir), "--ops", "x.so",
                           "--device", "meta"], capture_output=True, text=True)
    assert proc.returncode == 2 and "--device must be cpu or cuda[:N], got 'meta'" in proc.stderr
    if not torch.cuda.is_available():
        res = run_runner(tmp_path / "none.pt2", stream_dir, runner=runner, device="cuda")
        assert res.returncode == 2 and "this libtorch has no CUDA" in res.stderr, res.stderr


def test_export_bench_has_cpp_runner_rows():
    from gr_plugin.bench import export as bench

    model = {"num_items": 50, "num_time_buckets": 8, "embedding_dim": 16, "num_heads": 2, "head_dim": 8,
             "n_norm": 32.0}
    rows = bench.run(batch=2, history_len=16, new_events=2, candidates=2, steps=3, warmup=1, page_size=4,
                     model=model)
    cpp = {r["scenario"]: r for r in rows if r["mode"].startswith("C++")}
    assert set(cpp) == {"hit", "miss"} and len(rows) == 6
    assert cpp["hit"]["hit_rate"] > 0.5 and cpp["miss"]["hit_rate"] == 0
    for r in rows:
        assert r["max_abs_diff_vs_full"] <= 1e-5 and r["ms_p50"] > 0


@pytest.mark.gpu
def test_export_bench_on_the_gpu_has_cpp_runner_rows():
    """The package compiled for CUDA, scored from Python and by the C++ runner (``--device cuda``)."""
    from gr_plugin.bench import export as bench

    model = {"num_items": 50, "num_time_buckets": 8, "embedding_dim": 32, "num_heads": 2, "head_dim": 16,
             "n_norm": 32.0}
    rows = bench.run(batch=2, history_len=16, new_events=2, candidates=2, steps=3, warmup=1, page_size=4,
                     model=model, device="cuda")
    cpp = {r["scenario"]: r for r in rows if r["mode"].startswith("C++")}
    assert set(cpp) == {"hit", "miss"} and len(rows) == 6
    assert cpp["hit"]["hit_rate"] > 0.5 and cpp["miss"]["hit_rate"] == 0
    for r in rows:
        assert r["device"] == "cuda" and r["max_abs_diff_vs_full"] <= 1e-4 and r["ms_p50"] > 0
