"""recipes.infer end to end on a tiny model: every kvcache option equals full recomputation."""

import csv
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from gr_plugin.apps import infer
from gr_plugin.apps.common import load_module
from gr_plugin.configs.kvcache import KVCacheOptions
from gr_plugin.configs.schema import DataOptions, InferConfig
from gr_plugin.lightning import HSTURankingModule
from gr_plugin.modules import HSTUConfig

ROOT = Path(__file__).resolve().parents[2]


def tiny_cfg(tmp_path, kvcache=None, **kw) -> InferConfig:
    model = HSTUConfig(num_items=60, num_time_buckets=32, max_positions=256, embedding_dim=16, num_layers=2,
                       num_heads=2, head_dim=8, n_norm=64.0)
    data = DataOptions(source="synthetic", source_kwargs=dict(num_users=16, min_len=20, max_len=120, num_items=60),
                       batch_size=4, num_candidates=8, max_next=2, max_visit_len=10, num_val_visits=3,
                       num_test_visits=3)
    return InferConfig(model=model, data=data, kvcache=kvcache, train_if_missing=False,
                       default_ckpt=str(tmp_path / "none.ckpt"), results_csv=str(tmp_path / "results.csv"),
                       warmup_batches=0, **kw)


@pytest.mark.parametrize("backend", ["none", "gpu", "native", "flexkv"])
def test_every_option_matches_recompute(tmp_path, backend):
    opts = KVCacheOptions(backend=backend, page_size=4, num_pages=96, host_cache_gb=0.002)
    summary = infer.run(tiny_cfg(tmp_path, opts), tmp_path / "out")
    if backend == "none":
        assert summary["kvcache"] == "none" and "equivalence" not in summary
    else:
        assert summary["equivalence"] == "PASS" and summary["max_abs_diff"] <= 1e-5
        assert summary["evicted_users"] > 0  # 96 device pages do not hold everyone...
        if backend == "gpu":
            assert 0.05 < summary["hit_rate"] < 0.3
        else:  # ...and the host tier brings the evicted users back
            assert summary["hit_rate"] > 0.6 and summary["hit_rate_host"] > 0.4
    assert (tmp_path / "out" / "latency.png").stat().st_size > 0
    assert (tmp_path / "results.csv").read_text().count("\n") == 2


@pytest.mark.parametrize("graphs", [True, False])
def test_both_passes_get_the_cuda_graphs_option(tmp_path, monkeypatch, graphs):
    made = []

    class Spy(infer.RankingEngine):
        def __init__(self, *args, **kwargs):
            made.append(kwargs.get("cuda_graphs"))
            super().__init__(*args, **kwargs)

    monkeypatch.setattr(infer, "RankingEngine", Spy)
    opts = KVCacheOptions(backend="gpu", page_size=4, num_pages=96, cuda_graphs=graphs)
    summary = infer.run(tiny_cfg(tmp_path, opts, max_batches=4), tmp_path / "out")
    assert made == [graphs, graphs]  # the cached engine and the recompute's
    assert summary["equivalence"] == "PASS" and "cached_graph_replays" not in summary  # (no graphs on the CPU)


def test_half_precision_holds_the_cached_scores_to_the_fp32_recompute(tmp_path, monkeypatch):
    # NOTE: the reference attention computes bf16 inputs in bf16, so cached and recomputed scores differ
    # (which the rule is for); the C++ CPU kernels that ``auto`` takes compute in fp32 and, at this tiny
    # model, give the two passes equal bits (the next test).
    monkeypatch.setenv("GR_PLUGIN_ATTENTION", "reference")
    opts = KVCacheOptions(backend="native", page_size=4, num_pages=96, host_cache_gb=0.002)
    summary = infer.run(tiny_cfg(tmp_path, opts, dtype="bfloat16"), tmp_path / "out")
    assert summary["dtype"] == "bfloat16" and summary["hit_rate"] > 0.6
    cached, full = summary["max_err_cached_vs_fp32"], summary["max_err_full_vs_fp32"]
    assert 0 < full < 0.1 and cached <= 2 * full and summary["equivalence"] == "PASS"  # bf16 ran; the rule held
    assert summary["max_abs_diff"] > 1e-5  # (the fp32 tolerance would have failed it)
    assert "max error vs fp32" in infer.format_table(summary)
    # (the line said 'PASS (3.12e-02)' beside tolerance 1e-5: it names the rule it passed under)
    line = next(x for x in infer.format_table(summary).splitlines() if x.startswith("equivalence"))
    assert "PASS" in line and "bfloat16" in line and "2x" in line and "tolerance" not in line, line


def test_the_equivalence_line_names_the_tolerance_it_passed_under(tmp_path):
    opts = KVCacheOptions(backend="native", page_size=4, num_pages=96, host_cache_gb=0.002)
    summary = infer.run(tiny_cfg(tmp_path, opts, max_batches=3, tolerance=2e-5), tmp_path / "out")
    line = next(x for x in infer.format_table(summary).splitlines() if x.startswith("equivalence"))
    assert "PASS" in line and "<= tolerance 2e-05" in line, line


def test_half_precision_on_the_cpu_kernels(tmp_path):
    from gr_plugin.ops import hstu_attention as dispatch

    assert dispatch._cpu_ops() is not None  # (``auto`` runs the C++ CPU kernels here)
    opts = KVCacheOptions(backend="native", page_size=4, num_pages=96, host_cache_gb=0.002)
    summary = infer.run(tiny_cfg(tmp_path, opts, dtype="bfloat16"), tmp_path / "out")
    cached, full = summary["max_err_cached_vs_fp32"], summary["max_err_full_vs_fp32"]
    assert summary["hit_rate"] > 0.6 and summary["equivalence"] == "PASS"
    assert 0 < full < 0.1 and cached <= 2 * full
    assert summary["max_abs_diff"] <= 1e-6  # the attention in fp32 in both passes: they agree to fp32's rounding


def test_a_bad_dtype_is_a_clear_error(tmp_path):
    with pytest.raises(ValueError, match=r"dtype must be one of .*got 'bf16'"):
        infer.run(tiny_cfg(tmp_path, dtype="bf16"), tmp_path / "out")
    opts = KVCacheOptions(backend="gpu", dtype="float32")
    with pytest.raises(ValueError, match=r"kvcache.dtype='float32' differs from dtype='bfloat16'"):
        infer.run(tiny_cfg(tmp_path, opts, dtype="bfloat16"), tmp_path / "out")


def test_checkpoint_of_another_model_is_a_clear_error(tmp_path):
    cfg = tiny_cfg(tmp_path)
    other = HSTURankingModule(HSTUConfig(num_items=60, embedding_dim=32, num_layers=1))
    path = tmp_path / "other.ckpt"
    torch.save({"hyper_parameters": dict(other.hparams), "state_dict": other.state_dict()}, path)
    with pytest.raises(ValueError, match=r"another model config.*embedding_dim: checkpoint 32 vs config 16"):
        load_module(path, cfg.model)
    with pytest.raises(FileNotFoundError, match=r"missing\.ckpt"):
        load_module(tmp_path / "missing.ckpt", cfg.model)


def test_missing_dataset_is_a_clear_error(tmp_path):
    cfg = tiny_cfg(tmp_path)
    cfg.data = DataOptions(source="ml-1m", source_kwargs={"path": str(tmp_path / "no-such.inter")})
    with pytest.raises(FileNotFoundError, match=r"no-such\.inter"):
        infer.run(cfg, tmp_path / "out")


def test_multirun_sweep_writes_one_row_per_run(tmp_path):
    cmd = [sys.executable, "-m", "recipes.infer", "-m", "+kvcache=native", "kvcache.page_size=4,8",
           "data.batch_size=2,4", "model=hstu_tiny", "model.num_items=60", "model.max_positions=256",
           "data=synthetic", "data.source_kwargs.num_users=8", "data.source_kwargs.min_len=10",
           "data.source_kwargs.max_len=40", "data.source_kwargs.num_items=60", "data.num_candidates=8",
           "data.max_visit_len=8", "kvcache.num_pages=256", "kvcache.host_cache_gb=0.01", "train_if_missing=false",
           f"default_ckpt={tmp_path}/none.ckpt", f"hydra.sweep.dir={tmp_path}/sweep", "hydra/job_logging=disabled"]
    out = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=600)
    assert out.returncode == 0, out.stderr[-3000:]
    rows = list(csv.DictReader(open(tmp_path / "sweep" / "results.csv", newline="")))
    assert len(rows) == 4  # one per run, each led by its overrides
    assert {(r["kvcache.page_size"], r["data.batch_size"]) for r in rows} == {("4", "2"), ("4", "4"), ("8", "2"),
                                                                              ("8", "4")}
    assert all(r["page_size"] == r["kvcache.page_size"] and r["equivalence"] == "PASS" for r in rows)


def test_a_cache_option_warning_is_given_once(tmp_path):
    """``+kvcache=native kvcache.tiers.enable_3rd_remote=true`` printed its UserWarning twice: building the
    cache and naming its engine both resolved the backend."""
    import warnings

    from gr_plugin.cache.tiers import TierConfig

    opts = KVCacheOptions(backend="native", page_size=4, num_pages=96, host_cache_gb=0.002,
                          tiers=TierConfig(enable_3rd_remote=True))
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        summary = infer.run(tiny_cfg(tmp_path, opts, max_batches=2), tmp_path / "out")
    assert summary["kvcache"] == "native"
    assert [str(w.message) for w in caught if "backend 'native' ignores them" in str(w.message)] != []
    assert len([w for w in caught if "backend 'native' ignores them" in str(w.message)]) == 1


def test_a_remote_tier_outage_is_counted_in_the_summary_and_table(tmp_path):
    """With fail_open the run went on through a Redis outage and showed only 'remote 0.0%', as if the
    tier had no pages; the summary and the table now count its errors."""
    from gr_plugin.cache.tiers import TierConfig

    tiers = TierConfig(cpu_cache_gb=0.0005, enable_3rd_remote=True, remote_url="redis://127.0.0.1:1/0",
                       fail_open=True, task_timeout_s=2.0)
    opts = KVCacheOptions(backend="flexkv", page_size=4, num_pages=96, tiers=tiers)
    summary = infer.run(tiny_cfg(tmp_path, opts, max_batches=12), tmp_path / "out")
    assert summary["equivalence"] == "PASS" and summary["hit_rate_remote"] == 0
    assert summary["remote_errors"] + summary["remote_skipped_while_down"] > 0, summary
    line = next(x for x in infer.format_table(summary).splitlines() if x.startswith("remote tier"))
    assert f"{summary['remote_errors']} / {summary['remote_skipped_while_down']}" in line
    none = infer.run(tiny_cfg(tmp_path, KVCacheOptions(backend="native", page_size=4, num_pages=96,
                                                       host_cache_gb=0.002), max_batches=2), tmp_path / "out2")
    assert "remote_errors" not in none and "remote tier" not in infer.format_table(none)
