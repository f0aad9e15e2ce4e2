"""The paged attention kernel as compiled for the H200 (sm_90), read here without a GPU
(`scripts/kernel_resources.py`): at the block's head_dim 128 and head_dim 256 / bs 1 launches it must
not spill. On the H200 two kernel changes that spilled, or rose to the register limit, ran 5-100%
slower (docs/BENCHMARKS.md, the block section, 2026-12-01 from 13:02); head_dim 256 at bs 8 (64x32
tiles) already spills and is not pinned here."""

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]


def test_attention_compiles_for_the_h200_without_spills():
    try:
        from triton.backends.nvidia.compiler import get_ptxas

        get_ptxas(90)
    except Exception as exc:  # pragma: no cover - a triton without its CUDA backend or ptxas
        pytest.skip(f"no ptxas for sm_90 here: {exc}")
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    out = subprocess.run([sys.executable, str(ROOT / "scripts" / "kernel_resources.py"), "--cases", "128,128,1",
                          "128,128,8", "256,32,1"], capture_output=True, text=True, env=env, cwd=ROOT, timeout=600)
    assert out.returncode == 0, out.stderr[-3000:]
    lines = [ln for ln in out.stdout.splitlines() if ln.startswith("head_dim")]
    assert len(lines) == 6, out.stdout  # three shapes, eager and TMA
    for line in lines:
        m = re.search(r"(\d+) registers, spill stores/loads (\d+)/(\d+) bytes", line)
        assert m, line
        assert int(m.group(1)) <= 255 and m.group(2) == m.group(3) == "0", line
