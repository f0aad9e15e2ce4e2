"""``python -m recipes.train [+kvcache=native] [model=...] [data=...] [trainer.max_steps=...]``

Writes ``ckpt_out`` (by default one checkpoint per data source and model shape, what ``recipes.infer``
loads); in a sweep (``-m``) each job writes its checkpoint into its own output directory instead,
unless ``ckpt_out`` is given on the command line."""

from __future__ import annotations

import sys
from pathlib import Path

import hydra
from hydra.core.hydra_config import HydraConfig
from hydra.types import RunMode

import gr_plugin.configs.schema  # noqa: F401 - registers the schemas
from gr_plugin.apps import train
from gr_plugin.apps.common import config_object, mask_passwords, refuse_cache_keys_without_cache, single_log_lines
from gr_plugin.configs.schema import TrainConfig


@hydra.main(config_path="../conf", config_name="train", version_base="1.3")
def main(cfg) -> None:
    single_log_lines()
    hc = HydraConfig.get()
    obj: TrainConfig = config_object(cfg)
    given = any(o.split("=", 1)[0].lstrip("+~") == "ckpt_out" for o in hc.overrides.task)
    if hc.mode == RunMode.MULTIRUN and not given:
        # NOTE: the jobs of a sweep must not overwrite one another, nor the default that recipes.infer loads
        obj.ckpt_out = str(Path(hc.runtime.output_dir) / Path(obj.ckpt_out).name)
    out = train.run(obj, logger_dir=hc.runtime.output_dir)
    print(f"checkpoint: {out['checkpoint']}")
    for k, v in sorted(out["metrics"].items()):
        print(f"  {k}: {v:.4f}")


if __name__ == "__main__":
    mask_passwords()  # (before Hydra: it prints a failed job's overrides, a URL's password included)
    refuse_cache_keys_without_cache(sys.argv[1:])  # (Hydra's error: 'Unexpected type for root: NoneType')
    main()
