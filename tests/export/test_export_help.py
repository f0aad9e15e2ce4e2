"""``python -m recipes.export --help``: its own help, as recipes.infer, train and bench have (UAT #3:
it showed Hydra's default help, which lists the internal ``gr_plugin_schema: kvcache`` group)."""

import re
import subprocess
import sys
from pathlib import Path

from omegaconf import OmegaConf

ROOT = Path(__file__).resolve().parents[2]


def test_export_help_says_how_to_run_it_and_hides_the_schema_group():
    out = subprocess.run([sys.executable, "-m", "recipes.export", "--help"], capture_output=True, text=True,
                         cwd=ROOT, timeout=120)
    assert out.returncode == 0, out.stderr[-2000:]
    usage, rest = out.stdout.split("== Config ==")
    assert usage.startswith("recipes.export: export the whole cached step") and "python -m recipes.export" in usage
    assert "gr_plugin_schema" not in out.stdout and "Configuration groups" not in out.stdout
    groups = {"kvcache": ROOT / "gr_plugin" / "conf" / "kvcache", "model": ROOT / "conf" / "model",
              "data": ROOT / "conf" / "data", "trainer": ROOT / "conf" / "trainer"}
    for group, folder in groups.items():
        options = {p.stem for p in folder.glob("*.yaml")}
        line = re.search(rf"^{group}:(.*?)(?:^\S|\Z)", usage, re.M | re.S).group(1)  # (to the next unindented line)
        assert options and all(re.search(rf"\b{o}\b", line) for o in options), (group, options, line)
    config = OmegaConf.create(rest.split("Powered by Hydra")[0])
    assert config.kvcache is None and config.stream is True and config.max_batches == 24
    for key in ("ckpt_path", "device", "max_batches", "stream", "tolerance", "stage", "compare", "dtype", "seed",
                "warmup_batches", "results_csv"):  # (every key the help names is one of the config's)
        assert key in usage and key in config, key


def test_export_refuses_kvcache_none_before_any_work(tmp_path):
    """``recipes.export +kvcache=none`` failed after loading the weights with "'NoneType' object has no
    attribute 'close'" (there is no cache to export)."""
    out = subprocess.run([sys.executable, "-m", "recipes.export", "+kvcache=none", f"hydra.run.dir={tmp_path}"],
                         capture_output=True, text=True, cwd=ROOT, timeout=120)
    assert out.returncode != 0
    assert "+kvcache=none has no cache: choose +kvcache=gpu, native or flexkv" in out.stderr
    assert "NoneType" not in out.stderr and not (tmp_path / "cached_model.pt2").exists()
