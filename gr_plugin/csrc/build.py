"""Build and load the gr_kv C++ ops (``gr_kv_ops.cpp``): a JIT build with ``torch.utils.cpp_extension``.

Owns where the shared library is built and how it is loaded: ``load_library()`` compiles it once
(ninja, ``-O2``, one translation unit, no Python bindings) into a build directory keyed by the torch
version, the sources' content and the checkout's location (`gr_plugin.csrc.build_lock.build_key`: each
checkout keeps its own build), reuses it while the sources and flags are unchanged, and loads it into
the process, which defines the ``gr_kv`` op schemas and their CPU kernels. ``library_path()`` is the
``.so`` a C++ program ``dlopen``s to get the same ops (next to libtorch). It does not own the ops'
Python registrations (fake and CUDA kernels: `gr_plugin.ops.library`).

``python -m gr_plugin.csrc.build`` builds it and prints the path (``scripts/setup.sh`` calls it);
``GR_PLUGIN_BUILD_DIR`` overrides the root of the build directories (default ``~/.cache/gr_plugin/ops``).

Processes that build or load the same directory take turns (`gr_plugin.csrc.build_lock`: an flock,
under which a build lock left by a killed build is removed instead of waited on forever).
"""

from __future__ import annotations

import argparse
import functools
import logging
import os
import shutil
import sys
from pathlib import Path

import torch

from gr_plugin.csrc.build_lock import build_key, build_turn
from gr_plugin.csrc.toolchain import libstdcxx_ldflags

logger = logging.getLogger(__name__)

NAME = "gr_kv_ops"
SOURCES = (Path(__file__).resolve().with_name("gr_kv_ops.cpp"),)  # resolved: the paths build_key keys on
CFLAGS = ("-O2", "-fopenmp")
# NOTE: --as-needed drops libtorch_python (cpp_extension always adds it; nothing here uses it), so a C++
# program without libpython can load the library.
LDFLAGS = ("-fopenmp", "-Wl,--as-needed")


def build_directory() -> Path:
    """Per torch build and Python ABI: a library built against another torch must not be loaded."""
    root = os.environ.get("GR_PLUGIN_BUILD_DIR") or Path.home() / ".cache" / "gr_plugin" / "ops"
    tag = f"torch{torch.__version__}-py{sys.version_info.major}{sys.version_info.minor}".replace("+", "_")
    # NOTE: and per source content and location: checkouts (same sources or not) must not rebuild each
    # other's library (build.ninja holds absolute paths).
    return Path(root) / f"{tag}-{build_key(SOURCES)}"


@functools.cache
def load_library(verbose: bool = False) -> str:
    """Build (if its sources changed) and load the library; returns its path. Once per process."""
    from torch.utils import cpp_extension

    venv_bin = str(Path(sys.executable).parent)
    if shutil.which("ninja") is None and shutil.which("ninja", path=venv_bin):
        os.environ["PATH"] = venv_bin + os.pathsep + os.environ.get("PATH", "")  # pip's ninja, venv not activated
    directory = build_directory()
    directory.mkdir(parents=True, exist_ok=True)
    # NOTE: is_python_module=False: a plain shared library (no pybind11 module), loaded with
    # torch.ops.load_library; its static TORCH_LIBRARY blocks register the ops. The same file serves
    # a C++ program, which needs no Python to load it.
    try:
        with build_turn(directory, directory / f"{NAME}.so"):
            cpp_extension.load(name=NAME, sources=[str(s) for s in SOURCES], extra_cflags=list(CFLAGS),
                               extra_ldflags=[*LDFLAGS, *libstdcxx_ldflags()], build_directory=str(directory),
                               is_python_module=False, verbose=verbose)
    except (RuntimeError, OSError, FileNotFoundError) as e:
        raise RuntimeError(f"building the gr_kv C++ ops in {directory} failed (needs a C++ compiler and ninja; "
                           f"run `python -m gr_plugin.csrc.build --verbose` to see the compiler output): {e}") from e
    path = library_path()
    logger.debug("gr_kv ops loaded from %s", path)
    return str(path)


def library_path() -> Path:
    """The built ``.so`` (it exists once `load_library` or ``python -m gr_plugin.csrc.build`` ran)."""
    return build_directory() / f"{NAME}.so"


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description="Build the gr_kv C++ ops and print the shared library's path.")
    parser.add_argument("--verbose", action="store_true", help="show the compiler commands and output")
    args = parser.parse_args(argv)
    print(load_library(verbose=args.verbose))


if __name__ == "__main__":
    main()
