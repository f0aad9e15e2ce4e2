"""Make native builds (our C++ extensions, AOTInductor packages, the C++ runner) link the shared
libstdc++ that torch itself uses.

Owns one toolchain rule. On the lent H200 image the compiler that torch's builders invoke
(``$CXX=/opt/gcc/bin/g++``, a GCC install whose driver finds ``libstdc++.a`` but no ``libstdc++.so``)
linked the *static* archive into shared libraries (``readelf -d`` shows no ``libstdc++.so.6``;
``nm`` shows hundreds of ``std::locale`` symbols defined in the library). Such a library carries its own
copy of the locale and iostream machinery next to the process's ``libstdc++.so.6``, and the first
use of that copy (``c10::str`` formatting an integer in a failing ``TORCH_CHECK``, ``std::regex`` in
an AOTInductor wrapper's constructor) segfaults (native backtraces in docs/EXPORT.md). The rule:
name the runtime library on the link line after the objects (``-l:libstdc++.so.6``), on every Linux
machine where the compiler resolves it. It then resolves every libstdc++ symbol, so the driver's
trailing ``-lstdc++`` pulls nothing from an archive; where the link was shared anyway it names the
same library. Imports only the standard library.
"""

from __future__ import annotations

import functools
import os
import shutil
import subprocess
import sys

RUNTIME = "libstdc++.so.6"


def compiler() -> str | None:
    """The C++ compiler torch's builders use: ``$CXX``, else ``c++`` (cpp_extension's default)."""
    return os.environ.get("CXX") or shutil.which("c++") or shutil.which("g++")


def _print_file_name(cxx: str, name: str) -> str:
    try:
        out = subprocess.run([cxx, f"-print-file-name={name}"], capture_output=True, text=True, timeout=30)
    except (OSError, subprocess.SubprocessError):
        return name
    return out.stdout.strip() or name


@functools.lru_cache(maxsize=1)
def libstdcxx_ldflags() -> list[str]:
    """Link flags (after the objects) that keep libstdc++ shared; [] off Linux or without libstdc++."""
    cxx = compiler()
    if not sys.platform.startswith("linux") or cxx is None:
        return []
    return [f"-l:{RUNTIME}"] if os.path.isabs(_print_file_name(cxx, RUNTIME)) else []


def libstdcxx_libraries() -> list[str]:
    """The same as library names (``-l<name>``), for AOTInductor's ``aot_inductor.custom_op_libs``."""
    return [f":{RUNTIME}"] if libstdcxx_ldflags() else []


if __name__ == "__main__":
    cxx = compiler()
    print("compiler:", cxx, "CXX:", os.environ.get("CXX"))
    if cxx:
        for name in ("libstdc++.so", "libstdc++.a", RUNTIME):
            print(f"  -print-file-name={name}: {_print_file_name(cxx, name)}")
    print("link flags:", libstdcxx_ldflags())
