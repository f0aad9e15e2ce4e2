"""Every suite's counts and sizes are checked before any work (`common.check_options`), by the
option's command-line name and the rule."""

import inspect
import subprocess
import sys
from pathlib import Path

import pytest
from omegaconf import OmegaConf

from gr_plugin.bench import block, common, e2e
from recipes.bench import SUITES

ROOT = Path(__file__).resolve().parents[2]


def _rules(rules, prefix):
    for key, rule in rules.items():
        if isinstance(rule, dict):
            yield from _rules(rule, (*prefix, key))
        else:
            yield (*prefix, key), rule


CASES = [(suite, path, rule) for suite, rules in common.OPTION_RULES.items() for path, rule in _rules(rules, ())]


def _nest(path, value):
    for key in reversed(path):
        value = {key: value}
    return value


def test_the_uat_command_names_the_option_and_the_rule(tmp_path):
    """``recipes.bench suite=host_overhead host_overhead.repeats=-1`` ended in ``statistics.StatisticsError:
    no median for empty data`` after setting up the cache (UAT #2)."""
    out = subprocess.run([sys.executable, "-m", "recipes.bench", "suite=host_overhead", "host_overhead.repeats=-1",
                          f"hydra.run.dir={tmp_path}"], capture_output=True, text=True, cwd=ROOT, timeout=120)
    assert out.returncode != 0
    assert "ValueError: host_overhead.repeats=-1: must be an int >= 1" in out.stderr, out.stderr[-2000:]
    assert "StatisticsError" not in out.stderr


@pytest.mark.parametrize(("suite", "path", "rule"), CASES, ids=[".".join((s, *p)) for s, p, _ in CASES])
def test_each_count_below_its_least_is_refused_by_name(suite, path, rule):
    least, kind = rule
    name = ".".join((suite, *path))
    bad = [least - 1] if kind == "ints" else least - 1
    with pytest.raises(ValueError, match=rf"^{name}={bad!r}: must be .*>= {least}".replace("[", r"\[")):
        common.check_options(suite, _nest(path, bad))
    for other in ([], "x", 2.5, True) if kind == "ints" else ("x", 2.5, [least]):
        with pytest.raises(ValueError, match=rf"^{name}="):
            common.check_options(suite, _nest(path, other))
    common.check_options(suite, _nest(path, [least + 128] if kind == "ints" else least + 128))


def test_every_rule_names_a_parameter_of_its_suite():
    params = {suite: set(inspect.signature(fn).parameters) for suite, (fn, _, _) in SUITES.items()}
    parts = {"block_kwargs": block.block, "transfer_kwargs": block.transfer, "tiers_kwargs": block.tiers}
    for suite, path, _ in CASES:
        assert path[0] in params[suite], (suite, path)
        if len(path) == 2:
            assert path[1] in inspect.signature(parts[path[0]]).parameters, (suite, path)


def test_the_shipped_settings_pass():
    cfg = OmegaConf.load(ROOT / "conf" / "bench.yaml")
    for suite in SUITES:
        common.check_options(suite, OmegaConf.to_container(cfg[suite]))


@pytest.mark.parametrize(("suite", "hist", "error"), [
    ("host_overhead", 127, r"host_overhead\.history_lens=\[1024, 127\]: each must be >= host_overhead\.new_tokens=128"),
    ("step_host", 128, r"step_host\.history_lens=\[1024, 128\]: each must be > step_host\.new_tokens=128"),
])
def test_a_history_shorter_than_the_new_tokens_is_refused(suite, hist, error):
    with pytest.raises(ValueError, match=error):
        common.check_options(suite, {"history_lens": [1024, hist], "new_tokens": 128})
    common.check_options(suite, {"history_lens": [1024, hist + 1], "new_tokens": 128})


def test_e2e_warmup_batches_must_leave_a_batch_to_time():
    with pytest.raises(ValueError, match=r"e2e\.warmup_batches=6 leaves no batch to time: the stream has 6 batches"):
        e2e.run(batch_sizes=(2,), num_users=3, min_len=32, max_len=96, stride=32, num_candidates=8, hidden=32,
                layers=2, heads=2, head_dim=16, page_size=16, warmup_batches=6, device="cpu")
