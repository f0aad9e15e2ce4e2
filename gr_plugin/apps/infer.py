"""``recipes.infer``: replay request batches through the cached model and, side by side, the full pass.

Owns the inference run: load the model (a checkpoint, or train the default first, or say that the
weights are random), replay the data module's request stream (several visits per user, users
interleaved), score each batch with the cache and then without it, check that every score agrees,
and report hit rates per tier, tokens reused/computed, latency with and without the cache, and
ranking metrics. Writes JSON, CSV and a PNG under the run's output directory.
"""

from __future__ import annotations

import copy
import csv
import dataclasses
import json
import logging
import math
import statistics
import time
from pathlib import Path
from typing import Any

import lightning as L
import torch
from omegaconf import OmegaConf
from torchmetrics.classification import BinaryAUROC
from torchmetrics.retrieval import RetrievalHitRate, RetrievalNormalizedDCG
from tqdm import tqdm

from gr_plugin.apps import train as train_app
from gr_plugin.apps.common import (
    cache_namespace,
    check_cache_options,
    load_module,
    make_cache,
    make_datamodule,
    model_dtype,
    pick_device,
)
from gr_plugin.cache.tiers.flexkv_config import redact
from gr_plugin.configs.schema import InferConfig, TrainConfig, WeightsConfig
from gr_plugin.inference import RankingEngine
from gr_plugin.lightning import HSTURankingModule

logger = logging.getLogger(__name__)

_LOADERS = {"predict": "predict_dataloader", "test": "test_dataloader", "val": "val_dataloader"}  # stage: its loader
STAGES = tuple(_LOADERS)


def check_options(cfg: InferConfig) -> None:
    """Refuse a bad ``stage``, ``max_batches``, ``tolerance`` or ``kvcache`` value before any expensive work."""
    check_cache_options(cfg.kvcache, cfg.model, cfg.dtype)
    if cfg.stage not in STAGES:
        raise ValueError(f"stage must be one of {list(STAGES)}, got {cfg.stage!r}")
    if cfg.max_batches is not None and cfg.max_batches < 1:
        raise ValueError(f"max_batches must be a positive int or null (every batch), got {cfg.max_batches!r}")
    # NOTE: a negative or nan tolerance failed every batch, after the whole run; inf passed anything
    if not (math.isfinite(cfg.tolerance) and cfg.tolerance >= 0):
        raise ValueError(f"tolerance must be a finite number >= 0 (the largest max abs diff allowed between the "
                         f"cached and the recomputed scores), got {cfg.tolerance!r}")


def _load_or_train(cfg: WeightsConfig) -> tuple[HSTURankingModule, str]:
    """The model's weights and a description of them. Also salts ``cfg.kvcache.namespace`` with the
    weights' fingerprint (`cache_namespace`), so every cache made from ``cfg`` afterwards (infer,
    export, serve) holds these weights' K/V only."""
    module, weights = _find_weights(cfg)
    if cfg.kvcache is not None:
        cfg.kvcache = dataclasses.replace(cfg.kvcache, namespace=cache_namespace(cfg.kvcache.namespace, module))
    return module, weights


def _find_weights(cfg: WeightsConfig) -> tuple[HSTURankingModule, str]:
    if cfg.ckpt_path:
        return load_module(cfg.ckpt_path, cfg.model), f"checkpoint {cfg.ckpt_path}"
    if Path(cfg.default_ckpt).is_file():
        return load_module(cfg.default_ckpt, cfg.model), f"checkpoint {cfg.default_ckpt} (default)"
    if not cfg.train_if_missing:
        logger.warning("no checkpoint and train_if_missing=false: the model's weights are RANDOM")
        return HSTURankingModule(cfg.model), "random weights (no checkpoint)"
    base = TrainConfig(
        model=cfg.model,
        data=dataclasses.replace(cfg.data, max_users=None, batch_size=32, max_history_len=256),
        trainer=dataclasses.replace(cfg.trainer, max_epochs=20, max_steps=400, limit_val_batches=20,
                                    enable_progress_bar=True),
        ckpt_out=cfg.default_ckpt,
    )
    tcfg = OmegaConf.to_object(OmegaConf.merge(OmegaConf.structured(base), cfg.train))
    logger.warning("no checkpoint at %s: training this model first (%d steps); "
                   "later runs reuse it", cfg.default_ckpt, tcfg.trainer.max_steps)
    out = train_app.run(tcfg)
    desc = f"trained now ({out['steps']} steps) -> {out['checkpoint']}"  # (max_epochs may stop it before max_steps)
    return load_module(out["checkpoint"], cfg.model), desc


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _pct(values: list[float], q: float) -> float:
    if not values:
        return float("nan")
    s = sorted(values)
    return s[min(len(s) - 1, round(q * (len(s) - 1)))]


def run(cfg: InferConfig, out_dir: Path, columns: dict[str, Any] | None = None) -> dict[str, Any]:
    """Replay and compare (module docstring); writes under ``out_dir`` and appends a row to
    ``cfg.results_csv``, led by ``columns`` (the recipe's: the overrides of this run, e.g. a sweep's
    swept keys)."""
    check_options(cfg)
    L.seed_everything(cfg.seed)
    device = pick_device(cfg.device)
    dm = make_datamodule(cfg.data)
    if cfg.model.num_items < dm.num_items:
        raise ValueError(f"model.num_items={cfg.model.num_items} but the data has {dm.num_items} items")
    dtype = model_dtype(cfg.dtype, cfg.kvcache)
    module, weights = _load_or_train(cfg)
    model = module.model.to(device).eval()
    # NOTE: in half precision the cached and the recomputed scores differ by rounding, so each is held
    # to the fp32 recomputation (the project's rule: the cached error at most twice the recomputation's).
    oracle = RankingEngine(copy.deepcopy(model), None, device) if dtype != torch.float32 and cfg.compare else None
    model = model.to(dtype)
    cache = make_cache(cfg.kvcache, cfg.model, device, dtype) if cfg.kvcache is not None else None
    try:  # (closed at the end: a sweep's next job in this process opens the same SSD directory)
        # (make_cache resolved the backend and warned about options it ignores; once is enough)
        engine_name = "none" if cache is None else cfg.kvcache.backend
        dm.setup(cfg.stage)
        loader = getattr(dm, _LOADERS[cfg.stage])()
        # NOTE: on CUDA both passes replay CUDA graphs per shape bucket (``kvcache.cuda_graphs``): timed
        # side by side, the cached pass is not compared against a recompute slowed by its kernel launches.
        graphs = cfg.kvcache is not None and cfg.kvcache.cuda_graphs
        cached_engine = RankingEngine(model, cache, device, cuda_graphs=graphs) if cache is not None else None
        full_engine = RankingEngine(model, None, device, cuda_graphs=graphs)

        rows: list[dict[str, Any]] = []
        logits_all, labels_all, req_all = [], [], []
        max_diff = 0.0
        errs = {"cached": 0.0, "full": 0.0}  # against the fp32 recomputation (half precision only)
        total = len(loader) if cfg.max_batches is None else min(cfg.max_batches, len(loader))
        for i, batch in enumerate(tqdm(loader, total=total, desc="infer", unit="batch")):
            if i >= total:
                break
            row: dict[str, Any] = {"batch": i, "users": batch.batch_size,
                                   "returning": bool((batch.visit_index > 0).all()),
                                   "history_tokens": int(batch.history_lengths.sum())}
            ref = None
            if cached_engine is not None:
                _sync(device)
                t0 = time.perf_counter()
                res = cached_engine.score(batch)
                _sync(device)
                row["cached_ms"] = (time.perf_counter() - t0) * 1e3
                row.update(reused=res.cached_tokens, onboarded=res.onboarded_tokens, computed=res.computed_tokens,
                           fell_back=res.fell_back)
                ref = res.logits
            if cached_engine is None or cfg.compare:
                _sync(device)
                t0 = time.perf_counter()
                full = full_engine.score(batch).logits
                _sync(device)
                row["full_ms"] = (time.perf_counter() - t0) * 1e3
                if ref is not None:
                    diff = (ref.float() - full.float()).abs().max().item()
                    row["max_abs_diff"] = diff
                    max_diff = max(max_diff, diff)
                    if oracle is not None:
                        exact = oracle.score(batch).logits.float()
                        for name, got in (("cached", ref), ("full", full)):
                            errs[name] = max(errs[name], (got.float() - exact).abs().max().item())
                else:
                    ref = full
            logits_all.append(ref.float().cpu())
            labels_all.append(batch.labels)
            request_ids = torch.full((batch.batch_size,), i) * 1000 + torch.arange(batch.batch_size)
            req_all.append(torch.repeat_interleave(request_ids, batch.candidate_lengths))
            rows.append(row)

        logits, labels, req = torch.cat(logits_all), torch.cat(labels_all), torch.cat(req_all)
        quality = {
            "auc_liked": BinaryAUROC()(logits[:, 0], labels[:, 0].long()).item(),
            "auc_watched": BinaryAUROC()(logits[:, 1], labels[:, 1].long()).item(),
            "ndcg@10": RetrievalNormalizedDCG(top_k=10)(logits[:, 1], labels[:, 1].bool(), indexes=req).item(),
            "hr@10": RetrievalHitRate(top_k=10)(logits[:, 1], labels[:, 1].bool(), indexes=req).item(),
        }
        timed = rows[cfg.warmup_batches:] or rows
        summary: dict[str, Any] = {
            "weights": weights, "device": str(device), "dtype": cfg.dtype, "kvcache": engine_name,
            "kvcache_option": None if cfg.kvcache is None else cfg.kvcache.backend,
            "kvcache_namespace": None if cache is None else cfg.kvcache.namespace,
            # (the tiers that ran: a FlexKV tier YAML's values over the config group's, no password)
            **({"kvcache_tiers": redact(dataclasses.asdict(cache.manager.backend.tiers))}
               if engine_name == "flexkv" else {}),
            "batches": len(rows), "requests": sum(r["users"] for r in rows),
            "returning_batches": sum(r["returning"] for r in rows), **quality,
        }
        for name, eng in (("cached", cached_engine), ("full", full_engine)):
            g = None if eng is None else (eng.graphs or eng.full_graphs)
            if g is not None:  # (CUDA graphs: each shape bucket is captured at its second sighting)
                summary[f"{name}_graph_captures"], summary[f"{name}_graph_replays"] = g.captures, g.replays
        for key in ("cached_ms", "full_ms"):
            vals = [r[key] for r in timed if key in r]
            rep = [r[key] for r in timed if key in r and r["returning"]]
            if vals:
                summary[f"{key}_p50"], summary[f"{key}_p99"] = _pct(vals, 0.5), _pct(vals, 0.99)
                summary[f"{key}_mean"] = statistics.fmean(vals)
            if rep:
                summary[f"{key}_p50_returning"] = _pct(rep, 0.5)
        if cache is not None:
            cache.manager.offload_flush()
            stats = cache.stats()
            req_tokens = stats["tokens_requested"] or 1
            lower = {t: stats.get(f"tokens_reused_{t}", 0) for t in ("ssd", "remote")}
            summary.update(
                hit_rate=stats["hit_rate"], hit_rate_device=stats["tokens_reused_device"] / req_tokens,
                hit_rate_host=(stats["tokens_reused_host"] - sum(lower.values())) / req_tokens,
                hit_rate_ssd=lower["ssd"] / req_tokens, hit_rate_remote=lower["remote"] / req_tokens,
                tier_tasks=stats.get("tasks_launched", 0), tier_task_timeouts=stats.get("tasks_timed_out", 0),
                tier_task_ms_mean=1e3 * stats.get("task_latency_s_sum", 0.0) / max(1, stats.get("tasks_ready", 0)),
                tokens_reused=stats["tokens_reused"],
                tokens_computed=stats["tokens_computed"], tokens_requested=stats["tokens_requested"],
                evicted_users=stats["evicted_users"], onboard_bytes=stats["onboard_bytes"],
                offload_bytes=stats["offload_bytes"], fallbacks=sum(bool(r.get("fell_back")) for r in rows),
            )
            if engine_name == "flexkv" and cache.manager.backend.tiers.enable_3rd_remote:
                # (with fail_open an outage reads as misses: 'remote 0.0%' alone looks like no pages)
                summary.update(remote_errors=stats.get("remote_errors", 0),
                               remote_skipped_while_down=stats.get("remote_skipped_while_down", 0))
            if "full_ms_mean" in summary:
                summary["speedup_mean"] = summary["full_ms_mean"] / summary["cached_ms_mean"]
                if "cached_ms_p50_returning" in summary:
                    summary["speedup_p50_returning"] = (summary["full_ms_p50_returning"]
                                                        / summary["cached_ms_p50_returning"])
        if cache is not None and cfg.compare:
            summary["max_abs_diff"] = max_diff
            if oracle is None:
                summary["equivalence"] = "PASS" if max_diff <= cfg.tolerance else "FAIL"
                summary["equivalence_rule"] = f"max abs diff <= tolerance {cfg.tolerance:g}"
            else:
                # (the tolerance is for float32: in half precision the two passes round differently)
                summary["equivalence_rule"] = (f"{cfg.dtype}: cached error vs the fp32 recompute <= 2x the "
                                               f"{cfg.dtype} recompute's")
                summary["max_err_cached_vs_fp32"], summary["max_err_full_vs_fp32"] = errs["cached"], errs["full"]
                summary["equivalence"] = "PASS" if errs["cached"] <= 2 * errs["full"] else "FAIL"
        _write(out_dir, summary, rows, cfg, columns)
        return summary
    finally:
        if cache is not None:
            cache.manager.close()


def _write(out_dir: Path, summary: dict[str, Any], rows: list[dict[str, Any]], cfg: InferConfig,
           columns: dict[str, Any] | None = None) -> None:
    out_dir.mkdir(parents=True, exist_ok=True)
    config = redact(OmegaConf.to_container(OmegaConf.structured(cfg)))  # (no password of a remote tier's URL)
    (out_dir / "summary.json").write_text(json.dumps({"summary": summary, "config": config}, indent=2, default=str))
    keys = sorted({k for r in rows for k in r})
    with open(out_dir / "batches.csv", "w", newline="") as f:
        w = csv.DictWriter(f, fieldnames=keys)
        w.writeheader()
        w.writerows(rows)
    if cfg.results_csv:
        flat = {**(columns or {}), "page_size": getattr(cfg.kvcache, "page_size", None),
                "batch_size": cfg.data.batch_size,
                **{k: v for k, v in summary.items() if not isinstance(v, (dict, list))}}
        append_row(Path(cfg.results_csv), flat)
    _plot(out_dir / "latency.png", rows, summary)


_UNLABELLED = "unlabelled_values"


def append_row(path: Path, row: dict[str, Any]) -> None:
    """Append ``row`` to the CSV at ``path`` (a sweep's ``results.csv``, one row per job). A row with
    columns the file lacks (a job without a cache has no hit rates, one with has no fewer) rewrites the
    file under the union of the columns, old columns first: every row stays under its header."""
    path.parent.mkdir(parents=True, exist_ok=True)
    header: list[str] = []
    if path.exists() and path.stat().st_size:
        with open(path, newline="") as f:
            header = next(csv.reader(f), [])
    missing = [k for k in row if k not in header]
    if header and missing:
        with open(path, newline="") as f:
            old = list(csv.DictReader(f, restkey=_UNLABELLED))
        if any(_UNLABELLED in r for r in old):  # (a file an earlier version wrote: rows longer than the header)
            logger.warning("%s has rows with more values than its header; their extra values are kept in the "
                           "column %r", path, _UNLABELLED)
            for r in old:
                if _UNLABELLED in r:
                    r[_UNLABELLED] = ";".join(r[_UNLABELLED])
            if _UNLABELLED not in header + missing:
                missing.append(_UNLABELLED)
        fields = header + missing
        tmp = path.with_name(path.name + ".tmp")
        try:
            with open(tmp, "w", newline="") as f:
                w = csv.DictWriter(f, fieldnames=fields)
                w.writeheader()
                w.writerows(old)
                w.writerow(row)
            tmp.replace(path)
        finally:
            tmp.unlink(missing_ok=True)
        return
    with open(path, "a", newline="") as f:
        w = csv.DictWriter(f, fieldnames=header or list(row))
        if not header:
            w.writeheader()
        w.writerow(row)


def _plot(path: Path, rows: list[dict[str, Any]], summary: dict[str, Any]) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(1, 2, figsize=(11, 4))
    x = [r["batch"] for r in rows]
    for key, label in (("full_ms", "full recompute"), ("cached_ms", "cached")):
        if any(key in r for r in rows):
            ax[0].plot(x, [r.get(key, float("nan")) for r in rows], label=label, lw=0.8)
    ax[0].set(xlabel="batch (replay order)", ylabel="latency (ms)", title="per-batch latency")
    ax[0].legend()
    if any("reused" in r for r in rows):
        reused = [r.get("reused", 0) / max(r["history_tokens"], 1) for r in rows]
        ax[1].plot(x, reused, lw=0.8)
        ax[1].set(xlabel="batch", ylabel="history tokens reused", ylim=(0, 1.05),
                  title=f"hit rate (overall {summary.get('hit_rate', 0):.1%})")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def format_table(summary: dict[str, Any]) -> str:
    """The run's summary as an aligned text table."""
    def f(key: str, fmt: str = "{:.2f}") -> str:
        v = summary.get(key)
        return "-" if v is None else (fmt.format(v) if isinstance(v, float) else str(v))

    lines = [
        ("weights", f("weights")),
        ("device / kvcache", f"{f('device')} / {f('kvcache')} (option {f('kvcache_option')})"),
        ("kvcache namespace", f("kvcache_namespace")),
        ("requests (batches, returning batches)", f"{f('requests')} ({f('batches')}, {f('returning_batches')})"),
        ("hit rate: all / device / host / ssd / remote",
         f"{f('hit_rate', '{:.1%}')} / {f('hit_rate_device', '{:.1%}')} / {f('hit_rate_host', '{:.1%}')} / "
         f"{f('hit_rate_ssd', '{:.1%}')} / {f('hit_rate_remote', '{:.1%}')}"),
        ("lower-tier read tasks (timed out, mean ms)",
         f"{f('tier_tasks')} ({f('tier_task_timeouts')}, {f('tier_task_ms_mean')})"),
        *([("remote tier: errors / requests skipped while down",
             f"{f('remote_errors')} / {f('remote_skipped_while_down')}")] if "remote_errors" in summary else []),
        ("history tokens reused / computed", f"{f('tokens_reused')} / {f('tokens_computed')}"),
        ("latency ms p50 / p99, cached", f"{f('cached_ms_p50')} / {f('cached_ms_p99')}"),
        ("latency ms p50 / p99, full recompute", f"{f('full_ms_p50')} / {f('full_ms_p99')}"),
        ("p50 on returning users: cached / full", f"{f('cached_ms_p50_returning')} / {f('full_ms_p50_returning')}"),
        ("speedup: mean / p50 returning", f"{f('speedup_mean')}x / {f('speedup_p50_returning')}x"),
        ("AUC liked / watched", f"{f('auc_liked', '{:.4f}')} / {f('auc_watched', '{:.4f}')}"),
        ("NDCG@10 / HR@10 (watched)", f"{f('ndcg@10', '{:.4f}')} / {f('hr@10', '{:.4f}')}"),
        ("equivalence (max abs diff; rule)",
         f"{f('equivalence')} ({f('max_abs_diff', '{:.2e}')}; {f('equivalence_rule')})"),
    ]
    if "max_err_cached_vs_fp32" in summary:
        lines.append(("max error vs fp32, cached / recomputed (<= 2x)",
                      f"{f('max_err_cached_vs_fp32', '{:.2e}')} / {f('max_err_full_vs_fp32', '{:.2e}')}"))
    width = max(len(k) for k, _ in lines)
    return "\n".join(f"{k:<{width}}  {v}" for k, v in lines)
