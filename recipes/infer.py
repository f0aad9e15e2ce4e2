"""``python -m recipes.infer +kvcache=flexkv`` (none | gpu | native | flexkv); ``-m`` sweeps work,
e.g. ``python -m recipes.infer -m +kvcache=native kvcache.page_size=16,32 data.batch_size=4,8``."""

from __future__ import annotations

import sys
from pathlib import Path

import hydra
from hydra.core.hydra_config import HydraConfig
from hydra.core.override_parser.overrides_parser import OverridesParser
from hydra.types import RunMode

import gr_plugin.configs.schema  # noqa: F401 - registers the schemas
from gr_plugin.apps import infer
from gr_plugin.apps.common import config_object, mask_passwords, refuse_cache_keys_without_cache, single_log_lines
from gr_plugin.cache.tiers.flexkv_config import redact


def override_columns(overrides: list[str]) -> dict[str, str]:
    """Each override of the run as a column of results.csv (``data.batch_size`` -> ``4``), so a sweep's rows
    say what was swept; values as Hydra parsed them (no quotes), URLs without their password. The
    summary's own columns win a clash (e.g. ``kvcache``: the engine that ran)."""
    out = {}
    for o in OverridesParser.create().parse_overrides(list(overrides)):
        if not o.is_delete():
            value = o.value()
            out[o.key_or_group] = redact(value if isinstance(value, str) else o.get_value_element_as_str())
    return out


@hydra.main(config_path="../conf", config_name="infer", version_base="1.3")
def main(cfg) -> None:
    single_log_lines()
    hc = HydraConfig.get()
    obj = config_object(cfg)
    if obj.results_csv is None:
        base = hc.sweep.dir if hc.mode == RunMode.MULTIRUN else hc.runtime.output_dir
        obj.results_csv = str(Path(base) / "results.csv")
    summary = infer.run(obj, Path(hc.runtime.output_dir), override_columns(hc.overrides.task))
    print(infer.format_table(summary))
    print(f"outputs: {hc.runtime.output_dir}")
    if summary.get("equivalence") == "FAIL":
        if "max_err_cached_vs_fp32" in summary:
            raise SystemExit(f"cached scores ({obj.dtype}) are further from the fp32 recomputation than twice the "
                             f"{obj.dtype} recomputation: {summary['max_err_cached_vs_fp32']:.3e} vs "
                             f"{summary['max_err_full_vs_fp32']:.3e}")
        raise SystemExit(f"cached scores differ from full recomputation: max abs diff {summary['max_abs_diff']:.3e}")


if __name__ == "__main__":
    mask_passwords()  # (before Hydra: it prints a failed job's overrides, a URL's password included)
    refuse_cache_keys_without_cache(sys.argv[1:])  # (Hydra's error: 'Unexpected type for root: NoneType')
    main()
