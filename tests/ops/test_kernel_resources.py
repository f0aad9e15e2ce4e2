"""The paged attention kernel as compiled for the H200 (sm_90), read here without a GPU
(`scripts/kernel_resources.py`). On the H200 two kernel changes ran 5-100% slower (docs/BENCHMARKS.md,
the block section, 2026-12-01 from 13:02): one spilled; the other compiled to 245-251 registers
without spills, against the package's 204 / 230 (head_dim 128, eager / graphed) and 236 (head_dim
256, bs 1). So at those launches the kernel must compile without local memory and at most 240 / 244
registers. head_dim 256 at bs 8 (64x32 tiles) already spills (56-360 bytes) and is not pinned here.
head_dim 128 at bs 1 and 8 compile to the same kernel today; both are kept in case their tiles part.
The Gluon kernel, which the H200 takes for graphed launches (`hstu_gluon`), compiles without local memory
at all four shapes (160-165 registers at head_dim 128, 250 at 256 when this test was written)."""

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
BUDGET = {128: 240, 256: 244}  # registers, by head_dim
GLUON_BUDGET = {128: 176, 256: 252}


def _compiled(*args: str) -> list[tuple[int, int, int]]:
    """``(head_dim, registers, local bytes)`` of each launch `scripts/kernel_resources.py` compiles."""
    lines = _compile_lines(*args)
    found = [re.match(r"head_dim (\d+) .*: (\d+) registers, (\d+) bytes of local memory", ln) for ln in lines]
    assert found and all(found), lines
    return [tuple(int(g) for g in m.groups()) for m in found]


def _compile_lines(*args: str) -> list[str]:
    """The lines `scripts/kernel_resources.py` prints for the launches it compiles (one per launch)."""
    try:
        from triton.backends.nvidia.compiler import get_ptxas

        get_ptxas(90)
    except Exception as exc:  # pragma: no cover - a triton without its CUDA backend or ptxas
        pytest.skip(f"no ptxas for sm_90 here: {exc}")
    # (settings that change the launch or the compiled code stay out; the cache may stay)
    env = {k: v for k, v in os.environ.items()
           if not k.startswith(("TRITON_", "GR_PLUGIN_")) or k in ("TRITON_CACHE_DIR", "TRITON_HOME")}
    env["PYTHONPATH"] = os.pathsep.join([str(ROOT), env.get("PYTHONPATH", "")]).rstrip(os.pathsep)
    out = subprocess.run([sys.executable, str(ROOT / "scripts" / "kernel_resources.py"), *args],
                         capture_output=True, text=True, env=env, cwd=ROOT, timeout=900)
    assert out.returncode == 0, out.stderr[-3000:]
    return [ln for ln in out.stdout.splitlines() if ln.startswith("head_dim")]


def test_attention_compiles_for_the_h200_without_spills():
    got = _compiled("--cases", "128,128,1", "128,128,8", "256,32,1")
    assert len(got) == 6, got  # three shapes, eager and graphed
    for dim, regs, local in got:
        assert local == 0 and regs <= BUDGET[dim], got


def test_gluon_attention_compiles_for_the_h200_without_spills():
    got = _compiled("--launch", "kernel=gluon", "--cases", "128,128,1", "128,128,8", "256,32,1", "256,32,8")
    assert len(got) == 4, got  # graphed only
    for dim, regs, local in got:
        assert local == 0 and regs <= GLUON_BUDGET[dim], got


def test_gluon_full_pass_compiles_for_the_h200_without_spills():
    """The full pass's launch on the Gluon kernel (`GLUON_FULL_TILES`: the keys and values from ``k`` / ``v``,
    160 registers at head_dim 128 and 252 at 256 when this test was written)."""
    got = _compiled("--launch", "kernel=gluon", "full=True", "--cases", "128,128,1", "128,128,8", "256,32,8")
    assert len(got) == 3, got
    for dim, regs, local in got:
        assert local == 0 and regs <= GLUON_BUDGET[dim], got


def test_fp32_dots_compile_at_the_precision_asked_for():
    """The precision `FP32_DOTS` / ``fp32_dots`` names reaches every ``tt.dot`` of the compiled kernel (the
    interpreter, which the other CPU tests run, ignores it): tf32x3 by default, IEEE or TF32 when asked
    for; 16-bit inputs keep Triton's default."""
    def dots(*args: str) -> str:
        lines = _compile_lines("--cases", "64,16,1", "--eager-only", *args)
        assert len(lines) == 1, lines
        return re.search(r"dots (\S+)$", lines[0]).group(1)

    assert dots("--dtype", "float32") == "tf32x3"
    assert dots("--dtype", "float32", "--launch", "fp32_dots=ieee") == "ieee"
    assert dots("--dtype", "float32", "--launch", "fp32_dots=tf32") == "tf32"
    assert dots("--launch", "fp32_dots=ieee") == "tf32"  # (bf16: not fp32's setting)
