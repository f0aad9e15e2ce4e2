"""The recipes' cache namespace names the weights: K/V of other weights are never read (shared Redis tier)."""

import dataclasses

import torch

from gr_plugin.apps import infer
from gr_plugin.cache.hashing import weights_fingerprint, weights_namespace
from gr_plugin.cache.tiers import TierConfig
from gr_plugin.configs.kvcache import KVCacheOptions
from gr_plugin.lightning import HSTURankingModule
from tests.apps.test_infer import tiny_cfg


def _checkpoint(path, model, seed):
    torch.manual_seed(seed)
    module = HSTURankingModule(model)
    torch.save({"hyper_parameters": dict(module.hparams), "state_dict": module.state_dict()}, path)
    return module


def test_the_fingerprint_follows_the_weights_and_the_config(tmp_path):
    model = tiny_cfg(tmp_path).model
    a, b = _checkpoint(tmp_path / "a.ckpt", model, 0).model, _checkpoint(tmp_path / "b.ckpt", model, 1).model
    conf = dataclasses.asdict(model)
    fp = weights_fingerprint(a.state_dict(), conf)
    assert len(fp) == 16 and fp == weights_fingerprint({k: v.clone() for k, v in a.state_dict().items()}, conf)
    assert fp != weights_fingerprint(b.state_dict(), conf)
    assert fp != weights_fingerprint(a.state_dict(), conf | {"n_norm": 1.0})
    state = a.state_dict()
    name = next(iter(state))
    state[name] = state[name].clone()
    state[name].view(-1)[0] += 1e-6
    assert fp != weights_fingerprint(state, conf)
    assert weights_namespace("gr_plugin", fp) == f"gr_plugin:w{fp}"
    assert weights_namespace(f"gr_plugin:w{fp}", fp) == f"gr_plugin:w{fp}"  # (salting twice changes nothing)


def test_a_shared_redis_tier_never_serves_another_checkpoints_kv(tmp_path, redis_url):
    """Weights A fill Redis; weights B (same model config) in a fresh cache must not read them, and A
    again reads its own. (Before: B read A's K/V, 95% remote hits, scores off by 1e-1.)"""
    model = tiny_cfg(tmp_path).model
    for seed, name in ((0, "A"), (1, "B")):
        _checkpoint(tmp_path / f"{name}.ckpt", model, seed)

    def run(name: str, i: int) -> dict:
        tiers = TierConfig(cpu_cache_gb=0.0005, ssd_cache_gb=0.0, ssd_cache_dir=str(tmp_path / f"ssd{i}"),
                           enable_3rd_remote=True, remote_url=redis_url)
        opts = KVCacheOptions(backend="flexkv", page_size=4, num_pages=96, namespace="salt", tiers=tiers)
        cfg = tiny_cfg(tmp_path, opts, ckpt_path=str(tmp_path / f"{name}.ckpt"), max_batches=12)
        return infer.run(cfg, tmp_path / f"out{i}")

    a, b, a2 = run("A", 0), run("B", 1), run("A", 2)
    assert a["equivalence"] == "PASS" and a2["equivalence"] == "PASS"
    assert b["equivalence"] == "PASS", f"weights B read other weights' K/V: max abs diff {b['max_abs_diff']:.2e}"
    assert a2["hit_rate_remote"] > b["hit_rate_remote"]  # A's pages are still found by A
    assert a["kvcache_namespace"].startswith("salt:w") and a["kvcache_namespace"] == a2["kvcache_namespace"]
    assert b["kvcache_namespace"] != a["kvcache_namespace"]
