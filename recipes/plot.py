"""``python -m recipes.plot``: draw the PNG plots of the benchmark tables named in ``conf/plot.yaml``
(`gr_plugin.bench.plots`) from the tables recorded in ``source`` (docs/BENCHMARKS.md) into ``out_dir``."""

from __future__ import annotations

from pathlib import Path

import hydra
from hydra.utils import to_absolute_path
from omegaconf import DictConfig, OmegaConf

from gr_plugin.bench.plots import PlotSpec, plot_table, read_tables, select


@hydra.main(config_path="../conf", config_name="plot", version_base="1.3")
def main(cfg: DictConfig) -> None:
    source = Path(to_absolute_path(cfg.source))
    out = Path(to_absolute_path(cfg.out_dir))
    tables = read_tables(source.read_text())
    for raw in OmegaConf.to_container(cfg.plots, resolve=True):
        spec = PlotSpec(**raw)
        path = plot_table(select(tables, spec), spec, out / f"{spec.name}.png",
                          source=f"{cfg.source}, section '{spec.section}'")
        print(path)


if __name__ == "__main__":
    main()
