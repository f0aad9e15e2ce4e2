"""Shared benchmark plumbing: timing, device-sync counting, result tables.

Owns how a figure is measured and written (JSON + a Markdown table with the command, the machine
and the date); each suite module owns what it measures.
"""

from __future__ import annotations

import contextlib
import datetime as _dt
import json
import logging
import platform
import statistics
import sys
import time
import warnings
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import torch

logger = logging.getLogger(__name__)


# Each suite's counts and sizes and the least each may be: ``(least, "int")`` for one, ``(least, "ints")``
# for a non-empty list of them, a dict for a dict of options (block's per-part kwargs). Options not
# named here are the suite's own to check (names, paths, URLs, flags).
# (the e2e stream, which step_host takes too, labels up to 8 next events among the candidates: 8 at least)
_STREAM = {"batch_sizes": (1, "ints"), "num_users": (1, "int"), "min_len": (1, "int"), "max_len": (1, "int"),
           "stride": (1, "int"), "num_candidates": (8, "int"), "hidden": (1, "int"), "layers": (1, "int"),
           "heads": (1, "int"), "head_dim": (1, "int"), "page_size": (1, "int")}
OPTION_RULES: dict[str, dict[str, Any]] = {
    "host_overhead": {"batch_sizes": (1, "ints"), "history_lens": (1, "ints"), "page_size": (1, "int"),
                      "new_tokens": (1, "int"), "repeats": (1, "int")},
    "step_host": {"batch_sizes": (1, "ints"), "history_lens": (1, "ints"), "new_tokens": (1, "int"),
                  "num_candidates": (8, "int"), "page_size": (1, "int"), "repeats": (1, "int")},
    # (soak draws 1 to 3/2 page_size - 1 new events a request: a page of one event draws from nothing)
    "soak": {"num_requests": (1, "int"), "num_users": (1, "int"), "max_history": (1, "int"),
             "page_size": (2, "int"), "num_pages": (1, "int"), "host_pages": (1, "int"), "ssd_pages": (0, "int"),
             "verify_every": (1, "int"), "checkpoints": (1, "int")},
    "tiers": {"ssd_total_mb": (1, "int")},
    "block": {"block_kwargs": {"head_dims": (1, "ints"), "batch_sizes": (1, "ints"), "candidates": (1, "int"),
                               "repeats": (1, "int")},
              "transfer_kwargs": {"tokens_list": (1, "ints"), "head_dim": (1, "int"), "page": (1, "int"),
                                  "repeats": (1, "int")},
              "tiers_kwargs": {"tokens_list": (1, "ints"), "head_dim": (1, "int"), "page": (1, "int"),
                               "new": (1, "int"), "candidates": (1, "int"), "repeats": (1, "int"),
                               "lookaheads": (1, "ints")}},
    "e2e": {**_STREAM, "warmup_batches": (0, "int"), "pipelined_rounds": (1, "int")},
    "lightning": dict(_STREAM),
    "serve": {"num_requests": (1, "int"), "num_threads": (1, "int"), "max_queue_delay_us": (0, "int"),
              "warmup_requests": (0, "int")},
    "export": {"batch": (1, "int"), "history_len": (1, "int"), "new_events": (1, "int"), "candidates": (1, "int"),
               "steps": (1, "int"), "warmup": (0, "int"), "page_size": (1, "int")},
    "train": {"head_dims": (1, "ints"), "batch_sizes": (1, "ints"), "histories": (1, "ints"),
              "stack_histories": (1, "ints"), "candidates": (1, "int"), "heads": (1, "int"), "hidden": (1, "int"),
              "layers": (1, "int"), "repeats": (1, "int")},
}


def _is_int(v: Any) -> bool:
    return isinstance(v, int) and not isinstance(v, bool)


def check_options(suite: str, options: dict[str, Any], rules: dict[str, Any] | None = None,
                  prefix: str | None = None) -> None:
    """Refuse a suite's count or size that cannot run (`OPTION_RULES`) before any work, with a
    ValueError naming the option as given on the command line and the rule, e.g.
    ``host_overhead.repeats=-1: must be an int >= 1`` (a negative ``repeats`` used to end in
    ``statistics.StatisticsError: no median for empty data`` after the set-up)."""
    rules = OPTION_RULES.get(suite, {}) if rules is None else rules
    prefix = suite if prefix is None else prefix
    for key, rule in rules.items():
        if key not in options or options[key] is None:
            continue
        value, name = options[key], f"{prefix}.{key}"
        if isinstance(rule, dict):
            if not isinstance(value, dict):
                raise ValueError(f"{name}={value!r}: must be a dict of options")
            check_options(suite, value, rule, name)
            continue
        least, kind = rule
        if kind == "int" and not (_is_int(value) and value >= least):
            raise ValueError(f"{name}={value!r}: must be an int >= {least}")
        if kind == "ints" and not (isinstance(value, (list, tuple)) and value
                                   and all(_is_int(v) and v >= least for v in value)):
            raise ValueError(f"{name}={value!r}: must be a non-empty list of ints >= {least}, e.g. {name}=[{least}]")
    if prefix == suite and suite in ("host_overhead", "step_host"):
        # the cached part is the history less the new tokens; step_host's stream needs one event of it
        new, more = options.get("new_tokens", 128), int(suite == "step_host")
        if any(h < new + more for h in options.get("history_lens") or ()):
            raise ValueError(f"{suite}.history_lens={list(options['history_lens'])!r}: each must be "
                             f"{'>' if more else '>='} {suite}.new_tokens={new} (the cached part is the history "
                             f"less the new tokens)")


def machine_description() -> str:
    cpu = platform.processor() or platform.machine()
    try:
        import os

        cores = len(os.sched_getaffinity(0))
    except (AttributeError, OSError):
        cores = 0
    desc = (f"{platform.system()} {cpu}, {cores} cores, python {platform.python_version()}, "
            f"torch {torch.__version__}")
    if torch.cuda.is_available():
        desc += f", {torch.cuda.get_device_name()}"
    return desc


def timed_us(fn: Callable[[], Any], repeats: int) -> tuple[list[float], Any]:
    """Wall time of each call in microseconds (host time; the device is synchronised only if
    the caller's function does so)."""
    out = None
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        out = fn()
        times.append((time.perf_counter() - t0) * 1e6)
    return times, out


def interleaved_us(forms: dict[str, Callable[[], Any]], repeats: int) -> dict[str, list[float]]:
    """Wall µs of each call of each form, the forms taking turns call by call (so a host whose speed
    drifts, e.g. a shared VM, shifts all of them alike): ``{name: [µs per call]}``."""
    times: dict[str, list[float]] = {name: [] for name in forms}
    for _ in range(repeats):
        for name, fn in forms.items():
            t0 = time.perf_counter()
            fn()
            times[name].append((time.perf_counter() - t0) * 1e6)
    return times


def summarize(times: list[float]) -> dict[str, float]:
    s = sorted(times)
    return {"p50": statistics.median(s), "p90": s[int(0.9 * (len(s) - 1))], "mean": statistics.fmean(s)}


@contextlib.contextmanager
def count_device_syncs() -> Iterator[list[int]]:
    """Count synchronising CUDA calls inside the block (``torch.cuda.set_sync_debug_mode``).

    Yields a one-element list that holds the count afterwards; stays 0 where there is no CUDA.
    """
    box: list = [0]
    if not torch.cuda.is_available():
        yield box
        return
    prev = torch.cuda.get_sync_debug_mode()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        torch.cuda.set_sync_debug_mode("warn")
        try:
            yield box
        finally:
            torch.cuda.set_sync_debug_mode(prev)
    # NOTE: count only the debug mode's reports ("called a synchronizing CUDA operation"), not its
    # own "prototype feature" notice.
    hits = [str(w.message) for w in caught if "called a synchronizing" in str(w.message)]
    box[0] = len(hits)
    box.append(hits)


def write_results(name: str, rows: list[dict[str, Any]], columns: list[str], out_dir: Path,
                  title: str) -> str:
    """Write ``<name>.json`` and ``<name>.md`` under ``out_dir``; return the Markdown table."""
    out_dir.mkdir(parents=True, exist_ok=True)
    meta = {
        "command": "python -m " + " ".join(["recipes.bench", *sys.argv[1:]]),
        "machine": machine_description(),
        "date": _dt.date.today().isoformat(),
    }
    (out_dir / f"{name}.json").write_text(json.dumps({**meta, "rows": rows}, indent=2))
    lines = [f"### {title}", "", f"`{meta['command']}` — {meta['machine']} — {meta['date']}", "",
             "| " + " | ".join(columns) + " |", "|" + "---|" * len(columns)]
    for r in rows:
        cells = []
        for c in columns:
            v = r.get(c, "")
            cells.append(f"{v:.3g}" if isinstance(v, float) else ("" if v is None else str(v)))
        lines.append("| " + " | ".join(cells) + " |")
    table = "\n".join(lines) + "\n"
    (out_dir / f"{name}.md").write_text(table)
    return table
