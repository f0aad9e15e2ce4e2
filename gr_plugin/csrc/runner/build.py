"""Build and run the C++ runner (``gr_plugin/csrc/runner``): CMake + ninja against the torch wheel's libtorch.

Owns where the runner is built (next to the gr_kv ops library, keyed by the torch version: a runner
built against another torch must not load its packages), how it is configured (Release, ``-O2``, the
cache core with libxxhash) and how it is invoked (`run_runner`: the gr_kv ops library passed with
``--ops``, the JSON report read back). It does not own what the runner does (``main.cpp``).

``python -m gr_plugin.csrc.runner.build`` builds it and prints the executable's path.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import logging
import os
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

import torch

from gr_plugin.csrc.build import build_directory, load_library
from gr_plugin.csrc.toolchain import libstdcxx_ldflags

logger = logging.getLogger(__name__)

SOURCE_DIR = Path(__file__).resolve().parent  # (resolved, as the library's sources: `build_lock.build_key`)
NAME = "gr_runner"


def runner_directory() -> Path:
    return build_directory() / "runner"


def _tool(name: str) -> str:
    found = shutil.which(name) or shutil.which(name, path=str(Path(sys.executable).parent))
    if found is None:
        raise RuntimeError(f"building the C++ runner needs {name!r} on PATH")
    return found


def build_runner(verbose: bool = False) -> Path:
    """Configure (CMake, Ninja, Release) and build the runner; ninja rebuilds only what changed.
    Returns the executable's path."""
    directory = runner_directory()
    directory.mkdir(parents=True, exist_ok=True)
    cmake, ninja = _tool("cmake"), _tool("ninja")
    configure = [cmake, "-S", str(SOURCE_DIR), "-B", str(directory), "-G", "Ninja", "-DCMAKE_BUILD_TYPE=Release",
                 f"-DCMAKE_MAKE_PROGRAM={ninja}", f"-DCMAKE_PREFIX_PATH={torch.utils.cmake_prefix_path}",
                 f"-DGR_KV_EXTRA_LINK_LIBS={';'.join(libstdcxx_ldflags())}"]
    for cmd in (configure, [cmake, "--build", str(directory)]):
        proc = subprocess.run(cmd, capture_output=not verbose, text=True)
        if proc.returncode != 0:
            raise RuntimeError(f"building the C++ runner failed: {' '.join(cmd)}\n{proc.stdout}\n{proc.stderr}")
    path = directory / NAME
    logger.debug("C++ runner built at %s", path)
    return path


@dataclasses.dataclass
class RunnerResult:
    """The runner's exit status, its report (empty when it failed before writing one) and output."""

    returncode: int
    report: dict
    stdout: str
    stderr: str


def run_runner(package: str | Path, stream: str | Path, *, mode: str = "hit", warmup: int = 0,
               tolerance: float = 1e-5, scores_out: str | Path | None = None, runner: str | Path | None = None,
               timeout: float | None = 600, device: str = "cpu") -> RunnerResult:
    """Run the runner on ``package`` and ``stream`` (building it and the ops library if needed);
    ``device``: where the KV table and the inputs live (the package's device)."""
    exe = str(runner) if runner is not None else str(build_runner())
    with tempfile.TemporaryDirectory() as tmp:
        report = Path(tmp) / "report.json"
        cmd = [exe, "--package", str(package), "--stream", str(stream), "--ops", load_library(), "--mode", mode,
               "--warmup", str(warmup), "--tolerance", repr(tolerance), "--report", str(report), "--device", device]
        if scores_out is not None:
            cmd += ["--scores-out", str(scores_out)]
        env = {k: v for k, v in os.environ.items() if k != "GR_KV_OPS_LIB"}
        proc = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout, env=env)
        data = json.loads(report.read_text()) if report.is_file() else {}
    return RunnerResult(proc.returncode, data, proc.stdout, proc.stderr)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description="Build the C++ runner and print the executable's path.")
    parser.add_argument("--verbose", action="store_true", help="show CMake's and the compiler's output")
    args = parser.parse_args(argv)
    print(build_runner(verbose=args.verbose))


if __name__ == "__main__":
    main()
