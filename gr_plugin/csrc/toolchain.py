"""Make native builds (our C++ extensions, AOTInductor packages, the C++ runner) link the shared
libstdc++ that torch itself uses.

Owns one toolchain check. When the compiler driver cannot find ``libstdc++.so`` (the development
symlink) but finds ``libstdc++.a``, ``g++ -shared`` silently links the *static* archive into the
library: the library then carries its own copy of the locale and iostream machinery next to the
process's ``libstdc++.so.6``, and the first use of that copy (``c10::str`` formatting an integer in a
failing ``TORCH_CHECK``, ``std::regex`` in an AOTInductor wrapper's constructor) segfaults. That is
what happened on the lent H200 image (native backtraces in docs/EXPORT.md). The fix is to name the
runtime library on the link line, after the objects (``-l:libstdc++.so.6``): it resolves every
libstdc++ symbol, so the driver's trailing ``-lstdc++`` pulls nothing from the archive. Putting the
symlink on ``LIBRARY_PATH`` does not work: gcc searches its own directory, where the archive is,
first. Imports only the standard library.
"""

from __future__ import annotations

import functools
import os
import shutil
import subprocess

RUNTIME = "libstdc++.so.6"


def _print_file_name(cxx: str, name: str) -> str:
    try:
        out = subprocess.run([cxx, f"-print-file-name={name}"], capture_output=True, text=True, timeout=30)
    except (OSError, subprocess.SubprocessError):
        return name
    return out.stdout.strip() or name


@functools.lru_cache(maxsize=4)
def links_static_libstdcxx(cxx: str | None = None) -> bool:
    """Whether ``cxx -shared`` (default ``$CXX``, else g++) would link libstdc++ statically."""
    cxx = cxx or os.environ.get("CXX") or shutil.which("g++") or shutil.which("c++")
    if cxx is None:
        return False
    return (not os.path.isabs(_print_file_name(cxx, "libstdc++.so"))
            and os.path.isabs(_print_file_name(cxx, "libstdc++.a"))
            and os.path.isabs(_print_file_name(cxx, RUNTIME)))


def libstdcxx_ldflags() -> list[str]:
    """Link flags (after the objects) that keep libstdc++ shared on this machine; [] when not needed."""
    return [f"-l:{RUNTIME}"] if links_static_libstdcxx() else []


def libstdcxx_libraries() -> list[str]:
    """The same as library names (``-l<name>``), for AOTInductor's ``aot_inductor.custom_op_libs``."""
    return [f":{RUNTIME}"] if links_static_libstdcxx() else []


if __name__ == "__main__":
    print("links libstdc++ statically:", links_static_libstdcxx(), "flags:", libstdcxx_ldflags())
