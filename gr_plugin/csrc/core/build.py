"""Build and load the C++ cache policy core (``torch.classes.gr_kv_core``, ``torch.ops.gr_kv_core``).

Owns the JIT build of ``kv_core.cpp`` + ``host_core.cpp`` + ``page_pool.cpp`` + ``hashing.cpp`` + ``binding.cpp`` (+ the
request ops, ``request_ops.cpp``, and the host checks, cache keys and token layout of a step, ``step_inputs.cpp``)
with ``torch.utils.cpp_extension.load`` (ninja, -O3, C++17): the build directory is cached and ninja
rebuilds only when a source or a flag changes. ``python -m gr_plugin.csrc.core.build`` builds it
(``scripts/setup.sh`` does, once per machine). Imports only torch and the standard library, so
``gr_plugin.cache`` may load the core through it.

libxxhash: when the system library is found (``ctypes.util.find_library("xxhash")``, or the file
named by ``GR_KV_XXHASH_LIB``) the core links it and hashes token rows itself; otherwise (or with
``GR_KV_XXHASH=0``) it is built without and callers pass digests computed by Python's ``xxhash``.
The build directory is keyed by the torch version, the sources' content and the checkout's location
(`gr_plugin.csrc.build_lock.build_key`: each checkout keeps its own build); ``GR_KV_CORE_BUILD_DIR``
overrides its root (default ``~/.cache/gr_plugin/torch_extensions``).
"""

from __future__ import annotations

import argparse
import ctypes.util
import logging
import os
import shutil
import sys
import threading
from pathlib import Path

import torch

from gr_plugin.csrc.build_lock import build_key, build_turn
from gr_plugin.csrc.toolchain import libstdcxx_ldflags

logger = logging.getLogger(__name__)

NAME = "gr_kv_core"
SOURCE_DIR = Path(__file__).resolve().parent
SOURCES = ("page_pool.cpp", "hashing.cpp", "kv_core.cpp", "host_core.cpp", "binding.cpp", "request_ops.cpp",
           "step_inputs.cpp")
CFLAGS = ("-O3", "-std=c++17")  # -O3: the step-input checks and keys vectorise (step_inputs.cpp)

_lock = threading.Lock()
_loaded: str | None = None


def xxhash_library() -> str | None:
    """The libxxhash to link (a soname or a path), or None to build without it."""
    if os.environ.get("GR_KV_XXHASH", "1") == "0":
        return None
    explicit = os.environ.get("GR_KV_XXHASH_LIB")
    if explicit:
        return explicit
    return ctypes.util.find_library("xxhash")


def build_directory(with_xxhash: bool) -> Path:
    root = os.environ.get("GR_KV_CORE_BUILD_DIR")
    base = Path(root) if root else Path.home() / ".cache" / "gr_plugin" / "torch_extensions"
    tag = f"py{sys.version_info.major}{sys.version_info.minor}-torch{torch.__version__}"
    # NOTE: and per source content (headers too) and location: checkouts (a worktree, a CI clone; the same
    # sources or not) must not rebuild each other's library under a running process (build.ninja holds
    # absolute paths).
    key = build_key(sorted(SOURCE_DIR.glob("*.[ch]*")))
    return base / f"{NAME}-{tag}-{key}{'' if with_xxhash else '-noxxhash'}"


def loaded() -> bool:
    """Whether this process has loaded the core (`load`); a caller that only uses it when present
    asks this rather than building it."""
    return _loaded is not None


def _ensure_ninja() -> None:
    # NOTE: torch looks for `ninja` on PATH; a venv's own ninja (pip) sits next to its python.
    if shutil.which("ninja") is None:
        bindir = str(Path(sys.executable).parent)
        if shutil.which("ninja", path=bindir):
            os.environ["PATH"] = bindir + os.pathsep + os.environ.get("PATH", "")


def load(verbose: bool = False) -> str:
    """Build if needed and load the core into this process; returns the library path."""
    global _loaded
    with _lock:
        if _loaded is not None:
            return _loaded
        from torch.utils import cpp_extension

        lib = xxhash_library()
        cflags = [*CFLAGS, f"-DGR_KV_HAVE_XXHASH={1 if lib else 0}"]
        ldflags = list(libstdcxx_ldflags())
        if lib:
            ldflags.append(lib if os.sep in lib else f"-l:{lib}")
        build_dir = build_directory(lib is not None)
        build_dir.mkdir(parents=True, exist_ok=True)
        _ensure_ninja()
        name = NAME if lib else f"{NAME}_noxxhash"
        # (a build killed inside load() no longer hangs later ones)
        with build_turn(build_dir, build_dir / f"{name}.so"):
            path = cpp_extension.load(
                name=name,
                sources=[str(SOURCE_DIR / s) for s in SOURCES],
                extra_cflags=cflags,
                extra_ldflags=ldflags,
                build_directory=str(build_dir),
                is_python_module=False,
                verbose=verbose,
            )
        # NOTE: load() returns the library path when is_python_module=False and has loaded it
        # with torch.ops.load_library, which registers torch.classes.gr_kv_core.
        _loaded = str(path)
        logger.debug("gr_kv_core loaded from %s (libxxhash: %s)", _loaded, lib)
        return _loaded


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--verbose", action="store_true", help="show the compiler commands")
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(message)s")
    path = load(verbose=args.verbose)
    hashing = torch.ops.gr_kv_core.hashing_available()
    logger.info("gr_kv_core: %s (C++ hashing with libxxhash: %s)", path, "yes" if hashing else "no")


if __name__ == "__main__":
    main()
