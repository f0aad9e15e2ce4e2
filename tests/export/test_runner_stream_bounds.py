"""The C++ runner's stream validation on hostile streams (sizes/lengths that overflow int64; found by
review). Slow: builds the runner with CMake.

A stream that is invalid must be rejected by Stream::load ("invalid stream", exit 2) before the
package is even loaded. Here the package path is bogus on purpose: a stream that passes validation
reaches the package load and fails with "cannot load the package" instead."""

from __future__ import annotations

import subprocess
from pathlib import Path

import numpy as np
import pytest

from gr_plugin.csrc.build import load_library
from gr_plugin.csrc.runner.build import build_runner

HEADER = {"namespace": "t", "page_size": 4, "num_pages": 8, "max_positions": 16, "num_layers": 1, "num_heads": 1,
          "head_dim": 4, "num_tasks": 2, "num_items": 10, "num_actions": 4, "num_time_buckets": 4,
          "num_batches": 1, "has_inputs": 0}


pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def runner():
    return build_runner(), load_library()


def write_stream(d: Path, arrays: dict, *, dims: dict | None = None, header: dict | None = None) -> Path:
    """arrays: name -> (dtype, np array); dims overrides the header's dims of an array."""
    d.mkdir(parents=True, exist_ok=True)
    lines = ["gr_plugin_stream 1"] + [f"{k} {v}" for k, v in {**HEADER, **(header or {})}.items()]
    for name, (dtype, a) in arrays.items():
        a = np.ascontiguousarray(a, dtype=np.int64 if dtype == "int64" else np.float32)
        shape = (dims or {}).get(name, a.shape)
        lines.append(f"array {name} {dtype} " + " ".join(str(int(x)) for x in shape))
        a.tofile(d / f"{name}.bin")
    (d / "header.txt").write_text("\n".join(lines) + "\n")
    return d


def base(users=1, L=(2,), C=(1,)):
    E, NC = sum(L), sum(C)
    ev = np.stack([np.arange(E) % 10 + 1, np.zeros(E), np.zeros(E)], 1)
    return {"batch_offsets": ("int64", [0, users]), "user_ids": ("int64", np.arange(users)),
            "history_lengths": ("int64", list(L)), "candidate_lengths": ("int64", list(C)),
            "cached_lengths": ("int64", [0] * users), "history_events": ("int64", ev),
            "candidate_items": ("int64", np.ones(NC)), "scores": ("float32", np.zeros((NC, 2)))}


def run(runner, d: Path):
    exe, ops = runner
    proc = subprocess.run([str(exe), "--package", str(d / "missing.pt2"), "--stream", str(d), "--ops", ops],
                          capture_output=True, text=True, timeout=30)
    return proc.returncode, proc.stderr


def test_valid_stream_reaches_the_package_load(runner, tmp_path):
    rc, err = run(runner, write_stream(tmp_path / "s", base()))
    assert rc == 2 and "cannot load the package" in err, err  # control: the stream itself is accepted


def test_array_byte_size_overflow_is_rejected_not_read(runner, tmp_path):
    # history_events declared [2**61, 3]: numel * 8 wraps to 0 bytes, matching an empty file;
    # validation then walks 2**61 events of an empty buffer.
    arrays = base()
    arrays["history_lengths"] = ("int64", [2**61])
    arrays["history_events"] = ("int64", np.zeros((0, 3)))
    rc, err = run(runner, write_stream(tmp_path / "s", arrays, dims={"history_events": (2**61, 3)}))
    assert rc == 2 and "invalid stream" in err, (rc, err)


def test_history_lengths_summing_past_int64_are_rejected(runner, tmp_path):
    # 4 users of 2**62, 2**62, 2**62, 2**62 + 3 events: the sum wraps to 3 = the events in the file.
    # Accepted, the runner hashes 2**62 keys of a 3-key buffer (core.match) and lays out past token_ids.
    arrays = base(users=4, L=(3, 0, 0, 0), C=(1, 1, 1, 1))
    arrays["history_lengths"] = ("int64", np.array([2**62, 2**62, 2**62, 2**62 + 3], dtype=np.uint64).view(np.int64))
    rc, err = run(runner, write_stream(tmp_path / "s", arrays))
    assert rc == 2 and "invalid stream" in err, (rc, err)


def test_candidate_lengths_summing_past_int64_are_rejected(runner, tmp_path):
    arrays = base(users=4, L=(1, 1, 1, 1), C=(2, 0, 0, 0))
    arrays["candidate_lengths"] = ("int64", np.array([2**62, 2**62, 2**62, 2**62 + 2], dtype=np.uint64).view(np.int64))
    rc, err = run(runner, write_stream(tmp_path / "s", arrays))
    assert rc == 2 and "invalid stream" in err, (rc, err)


def test_input_sizes_summing_past_int64_are_rejected(runner, tmp_path):
    # batch 0's sizes wrap to -1000: batch 1's inputs then point 1000 values before input_values.
    arrays = base(users=2, L=(2, 2), C=(1, 1))
    arrays["batch_offsets"] = ("int64", [0, 1, 2])
    s = np.zeros((2, 9), dtype=np.uint64)
    s[0, 0] = s[0, 1] = 2**63 - 1
    s[0, 2] = 2  # sum so far 0 (mod 2**64)
    s[0, 3] = 2**63 - 1
    s[0, 4] = 2**63 - 1 - 998  # batch 0 sums to -1000 (mod 2**64)
    s[1, 0] = 1010  # batch 1: sum 1010 -> total 10
    arrays["input_sizes"] = ("int64", s.view(np.int64))
    arrays["input_values"] = ("int64", np.zeros(10))
    rc, err = run(runner, write_stream(tmp_path / "s", arrays, header={"num_batches": 2, "has_inputs": 1}))
    assert rc == 2 and "invalid stream" in err, (rc, err)
