"""The plain C++ core (no torch, no Python) built with its CMake project and its own test run:
what a C++ runtime links (gr_plugin/csrc/core/CMakeLists.txt, kv_core_test.cpp)."""

import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from gr_plugin.csrc.core.build import SOURCE_DIR

pytestmark = pytest.mark.slow


def _tool(name: str) -> str:
    found = shutil.which(name) or shutil.which(name, path=str(Path(sys.executable).parent))
    if found is None:
        pytest.skip(f"{name} is not installed")
    return found


def test_plain_core_builds_and_its_test_passes(tmp_path):
    cmake, ninja = _tool("cmake"), _tool("ninja")
    build = tmp_path / "core"
    for cmd in ([cmake, "-S", str(SOURCE_DIR), "-B", str(build), "-G", "Ninja", f"-DCMAKE_MAKE_PROGRAM={ninja}",
                 "-DGR_KV_WITH_TORCH=OFF"], [cmake, "--build", str(build)]):
        proc = subprocess.run(cmd, capture_output=True, text=True, timeout=300)
        assert proc.returncode == 0, proc.stdout + proc.stderr
    proc = subprocess.run([str(build / "kv_core_test")], capture_output=True, text=True, timeout=60)
    assert proc.returncode == 0 and "kv_core_test: ok" in proc.stdout, proc.stdout + proc.stderr
