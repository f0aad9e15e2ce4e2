"""``python -m recipes.bench suite=<name>``: run one benchmark suite and write its table.

Results go to ``out_dir/<suite>.json`` and ``.md`` (command, machine, date included); copy the
table into docs/BENCHMARKS.md.
"""

from __future__ import annotations

import logging
from pathlib import Path

import hydra
from hydra.utils import to_absolute_path
from omegaconf import DictConfig, OmegaConf

from gr_plugin.bench import block, common, e2e, export, host_overhead, lightning_eval, serve, soak, step_host, tiers
from gr_plugin.bench import train as train_bench

logger = logging.getLogger(__name__)

SUITES = {
    "host_overhead": (host_overhead.run, host_overhead.COLUMNS, "Host overhead of lookup + allocate"),
    "step_host": (step_host.run, step_host.COLUMNS, "Host time of a ranking step (prepare: validate, lookup, layout)"),
    "soak": (soak.run, soak.COLUMNS, "Soak: Zipf request stream through small tiers"),
    "tiers": (tiers.run, tiers.COLUMNS, "Lower tiers: SSD read, tier hit vs recompute, batched launch"),
    "block": (block.run, block.COLUMNS, "GPU: HSTU block cached vs full, transfers, GPU/host hits"),
    "e2e": (e2e.run, e2e.COLUMNS, "End to end: request streams with and without the cache"),
    "lightning": (lightning_eval.run, lightning_eval.COLUMNS,
                  "Lightning predict: no callback vs KVCacheCallback eager vs with CUDA graphs"),
    "serve": (serve.run, serve.COLUMNS, "Serving: Triton server latency and throughput with and without cache hits"),
    "export": (export.run, export.COLUMNS, "Export: eager cached step vs the AOTInductor package, hits and misses"),
    "train": (train_bench.run, train_bench.COLUMNS, "Training: the attention kernels and backward vs the reference"),
}


@hydra.main(config_path="../conf", config_name="bench", version_base="1.3")
def main(cfg: DictConfig) -> None:
    if cfg.suite not in SUITES:
        raise ValueError(f"unknown suite {cfg.suite!r}; choose one of {sorted(SUITES)}")
    fn, columns, title = SUITES[cfg.suite]
    kwargs = OmegaConf.to_container(cfg.get(cfg.suite, {}), resolve=True)
    common.check_options(cfg.suite, kwargs)
    rows = fn(**kwargs)
    table = common.write_results(cfg.suite, rows, columns, Path(to_absolute_path(cfg.out_dir)), title)
    print(table)


if __name__ == "__main__":
    main()
