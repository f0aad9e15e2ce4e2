"""``python -m recipes.export [+kvcache=gpu] [ckpt_path=...]``: export the whole cached step
(embeddings, layer stack, head) to an AOTInductor package, reload it, replay request batches with
eager and packaged cached inference, and check both against full recomputation."""

from __future__ import annotations

from pathlib import Path

import hydra
from hydra.core.hydra_config import HydraConfig

import gr_plugin.configs.schema  # noqa: F401 - registers the schemas
from gr_plugin.apps import export
from gr_plugin.apps.common import single_log_lines
from gr_plugin.configs.checked import to_object


@hydra.main(config_path="../conf", config_name="export", version_base="1.3")
def main(cfg) -> None:
    single_log_lines()
    summary = export.run(to_object(cfg), Path(HydraConfig.get().runtime.output_dir))
    for k, v in summary.items():
        print(f"{k:<32} {v:.4g}" if isinstance(v, float) else f"{k:<32} {v}")
    if not summary["equal"]:
        raise SystemExit("packaged or eager cached scores differ from full recomputation")


if __name__ == "__main__":
    main()
