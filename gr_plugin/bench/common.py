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
