"""``python -m recipes.train [+kvcache=native] [model=...] [data=...] [trainer.max_steps=...]``"""

from __future__ import annotations

import hydra
from omegaconf import OmegaConf

import gr_plugin.configs.schema  # noqa: F401 - registers the schemas
from gr_plugin.apps import train
from gr_plugin.configs.schema import TrainConfig


@hydra.main(config_path="../conf", config_name="train", version_base="1.3")
def main(cfg) -> None:
    obj: TrainConfig = OmegaConf.to_object(cfg)
    out = train.run(obj, logger_dir=hydra.core.hydra_config.HydraConfig.get().runtime.output_dir)
    print(f"checkpoint: {out['checkpoint']}")
    for k, v in sorted(out["metrics"].items()):
        print(f"  {k}: {v:.4f}")


if __name__ == "__main__":
    main()
