"""Why do AOTInductor packages and C++ exceptions from JIT-built extensions crash on the lent GPU
machine? (docs/EXPORT.md, "On the GPU"). One device call; prints one line per experiment.

python3 scripts/gpu/aoti_probe.py [workdir] [experiment ...]   (default: all; names below)

Experiments, each in a fresh subprocess (exit code and the last lines of its output):
- ``maps``: which libstdc++ / libgcc_s / libunwind the torch process maps, what torch's libraries link;
- ``ext``: a JIT extension that captures a c10 backtrace, throws a plain std exception and a
  c10::Error (TORCH_CHECK) caught inside the extension, and one that reaches Python; ``ext_fp``: the
  same built with frame pointers kept; ``ext_preload``: with the system libstdc++/libgcc_s preloaded;
  ``ext2``: which side crashes: sizeof(c10::Error) in the headers, std exceptions, a c10::Error
  thrown inside libtorch and caught in the extension, a c10::ValueError thrown by the extension;
  ``ext3``: TORCH_CHECK / TORCH_CHECK_VALUE / an explicit ``throw c10::ValueError`` reaching Python;
- ``aoti``: a plain CPU AOTInductor package (``silu(x) * 2``): compile, then load in a fresh process
  (``aoti_preload``: the load with the system libraries preloaded);
- ``tools``: the compilers and debuggers on the machine; ``ext_O0`` / ``ext_nosplit``: ``ext`` built
  with ``-O0`` / without hot-cold function splitting; ``gdb``: the crashing ``TORCH_CHECK`` and the
  package load under gdb (native backtrace), when gdb is there; ``bt``: the same two with a SIGSEGV
  handler that prints the native frames (``backtrace_symbols_fd``), for machines without gdb;
  ``aoti_O0``: the package compiled with its wrapper at ``-O0``, then loaded.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import textwrap
from pathlib import Path

WORK = Path(sys.argv[1] if len(sys.argv) > 1 else "/tmp/aoti_probe")

MAPS = """
import torch, re
pat = r'libstdc|libgcc_s|libunwind|libc\\+\\+'
libs = sorted({l.split()[-1] for l in open('/proc/self/maps') if re.search(pat, l)})
print('mapped:', libs)
print('torch', torch.__version__, 'cxx11abi', torch.compiled_with_cxx11_abi())
print([l.strip() for l in torch.__config__.show().splitlines() if 'GCC' in l or 'CXX_COMPILER' in l][:3])
"""

EXT = r"""
import torch
from torch.utils.cpp_extension import load_inline
src = '''
#include <torch/extension.h>
int64_t throw_caught(int64_t x) {
  try { TORCH_CHECK(x < 0, "x must be negative, got ", x); } catch (const c10::Error& e) { return 1; }
  return 0;
}
int64_t throw_plain(int64_t x) {
  try { throw std::runtime_error("plain"); } catch (const std::exception&) { return 2; }
}
int64_t throw_out(int64_t x) { TORCH_CHECK(x < 0, "x must be negative, got ", x); return 0; }
int64_t backtrace_len(int64_t x) { return static_cast<int64_t>(c10::get_backtrace().size()); }
'''
m = load_inline(NAME, cpp_sources=src, functions=["throw_caught", "throw_plain", "throw_out", "backtrace_len"],
                build_directory=BUILD, extra_cflags=FLAGS, extra_ldflags=LDFLAGS, verbose=False)
print("plain caught:", m.throw_plain(1), flush=True)
print("c10 backtrace chars:", m.backtrace_len(0), flush=True)
print("c10 caught:", m.throw_caught(1), flush=True)
try:
    m.throw_out(1)
except RuntimeError as e:
    print("c10 reached python:", str(e).splitlines()[0], flush=True)
"""

COMPILE = """
import torch
class M(torch.nn.Module):
    def forward(self, x):
        return torch.nn.functional.silu(x) * 2
ep = torch.export.export(M(), (torch.randn(4, 8),))
print(torch._inductor.aoti_compile_and_package(ep, package_path=PKG))
"""

EXT2 = r"""
import torch
from torch.utils.cpp_extension import load_inline
src = '''
#include <torch/extension.h>
#include <stdexcept>
int64_t error_size(int64_t x) { return static_cast<int64_t>(sizeof(c10::Error)); }
int64_t catch_torch_internal(int64_t x) {  // thrown inside libtorch, caught here
  try { auto t = at::empty({-1}); } catch (const c10::Error& e) { return 1; }
  return 0;
}
int64_t catch_std_invalid(int64_t x) {
  try { throw std::invalid_argument("bad"); } catch (const std::exception&) { return 3; }
}
int64_t throw_std_invalid(int64_t x) { throw std::invalid_argument("bad value " + std::to_string(x)); }
int64_t throw_value_error(int64_t x) { throw c10::ValueError({__func__, __FILE__, 1}, "bad value"); }
'''
m = load_inline(NAME, cpp_sources=src, functions=["error_size", "catch_torch_internal", "catch_std_invalid",
                "throw_std_invalid", "throw_value_error"], build_directory=BUILD, extra_ldflags=LDFLAGS, verbose=False)
print("sizeof(c10::Error) in the headers:", m.error_size(0), flush=True)
print("std::invalid_argument caught:", m.catch_std_invalid(0), flush=True)
try:
    m.throw_std_invalid(7)
except Exception as e:
    print("std::invalid_argument reached python as", type(e).__name__, str(e), flush=True)
try:
    torch.empty(-1)
except RuntimeError as e:
    print("torch-internal c10::Error reached python:", str(e).splitlines()[0], flush=True)
print("torch-internal c10::Error caught in the extension:", m.catch_torch_internal(0), flush=True)
try:
    m.throw_value_error(0)
except Exception as e:
    print("c10::ValueError reached python as", type(e).__name__, flush=True)
"""

EXT3 = r"""
import torch
from torch.utils.cpp_extension import load_inline
src = '''
#include <torch/extension.h>
int64_t check_out(int64_t x) { TORCH_CHECK(x < 0, "x must be negative, got ", x); return 0; }
int64_t check_value_out(int64_t x) { TORCH_CHECK_VALUE(x < 0, "x must be negative, got ", x); return 0; }
int64_t throw_explicit(int64_t x) {
  if (x >= 0) throw c10::ValueError({__func__, __FILE__, 1}, c10::str("x must be negative, got ", x));
  return 0;
}
'''
m = load_inline(NAME, cpp_sources=src, functions=["check_out", "check_value_out", "throw_explicit"],
                build_directory=BUILD, extra_ldflags=LDFLAGS, verbose=False)
for f in ("throw_explicit", "check_value_out", "check_out"):
    try:
        getattr(m, f)(1)
    except Exception as e:
        print(f, "reached python as", type(e).__name__, str(e).splitlines()[0], flush=True)
"""

CRASH_CHECK = r"""
import torch
from torch.utils.cpp_extension import load_inline
src = '''
#include <torch/extension.h>
int64_t throw_caught(int64_t x) {
  try { TORCH_CHECK(x < 0, "x must be negative, got ", x); } catch (const c10::Error& e) { return 1; }
  return 0;
}
'''
m = load_inline(NAME, cpp_sources=src, functions=["throw_caught"], build_directory=BUILD, extra_ldflags=LDFLAGS,
                verbose=False)
print("c10 caught:", m.throw_caught(1), flush=True)
"""

SEGV_HANDLER = r"""
import torch
from torch.utils.cpp_extension import load_inline
hsrc = '''
#include <torch/extension.h>
#include <csignal>
#include <execinfo.h>
#include <unistd.h>
static void on_segv(int sig) {
  void* frames[64];
  int n = backtrace(frames, 64);
  const char msg[] = "native frames at SIGSEGV:\\n";
  write(2, msg, sizeof(msg) - 1);
  backtrace_symbols_fd(frames, n, 2);
  signal(sig, SIG_DFL);
  raise(sig);
}
int64_t install(int64_t x) { signal(SIGSEGV, on_segv); return 0; }
'''
h = load_inline("probe_segv", cpp_sources=hsrc, functions=["install"], build_directory=HBUILD, verbose=False)
h.install(0)
print("handler installed", flush=True)
"""

LOAD = """
import torch
runner = torch._inductor.aoti_load_package(PKG)
x = torch.randn(4, 8)
print("load ok, equal:", torch.allclose(runner(x), torch.nn.functional.silu(x) * 2))
"""


def run(name: str, code: str, env: dict | None = None, timeout: int = 240, prefix: list[str] | None = None,
        tail: int = 12) -> None:
    full = {**os.environ, **(env or {})}
    p = subprocess.run([*(prefix or []), sys.executable, "-X", "faulthandler", "-c", textwrap.dedent(code)],
                       env=full, capture_output=True, text=True, timeout=timeout)
    out = (p.stdout + p.stderr).strip().splitlines()
    keep = [line for line in out if "fbgemm" not in line.lower() and "compat" not in line and line.strip()]
    print(f"--- {name}: exit {p.returncode}")
    marks = [i for i, line in enumerate(keep) if line.startswith(("native frames", "Program received", "Thread 1"))]
    if marks:  # a native backtrace: its innermost frames matter most
        keep = keep[:3] + keep[marks[0]:marks[0] + tail]
    for line in keep[-tail:]:
        print("   ", line[:300])


def main() -> None:
    WORK.mkdir(parents=True, exist_ok=True)
    which = set(sys.argv[2:]) or {"maps", "ext", "ext2", "ext3", "ext_fp", "ext_preload", "aoti", "aoti_preload"}
    gdb = shutil.which("gdb")
    gdb_prefix = [gdb, "-q", "-batch", "-ex", "run", "-ex", "bt 40", "--args"] if gdb else None
    pkg = str(WORK / "plain.pt2")
    sys_libs = ":".join(p for p in ("/usr/lib/x86_64-linux-gnu/libstdc++.so.6", "/lib/x86_64-linux-gnu/libgcc_s.so.1")
                        if os.path.exists(p))

    def ext_defs(name: str, flags: list[str], ldflags: list[str] | None = None) -> str:
        build = WORK / name
        build.mkdir(exist_ok=True)
        return f"BUILD = {str(build)!r}\nNAME = {name!r}\nFLAGS = {flags!r}\nLDFLAGS = {ldflags or []!r}\n"

    if "maps" in which:
        run("maps", MAPS)
        import torch

        for lib in ("torch/lib/libtorch_cpu.so", "torch/lib/libc10.so"):
            path = Path(torch.__file__).parent.parent / lib
            p = subprocess.run(["bash", "-c", f"ldd {path} | grep -E 'stdc|gcc_s|unwind|c\\+\\+'"],
                               capture_output=True, text=True)
            print(f"--- ldd {lib}:\n{p.stdout.rstrip()}")
    if "ext" in which:
        run("extension exceptions", ext_defs("probe_ext", []) + EXT)
    if "ext2" in which:
        run("extension exceptions, which side crashes", ext_defs("probe_ext2", []) + EXT2 + "")
    if "ext3" in which:
        run("extension exceptions reaching python", ext_defs("probe_ext3", []) + EXT3)
    if "tools" in which:
        for tool in ("gdb", "g++", "clang++", "ld", "catchsegv"):
            path = shutil.which(tool)
            ver = (subprocess.run([path, "--version"], capture_output=True, text=True).stdout.splitlines()[:1]
                   if path else [])
            print(f"--- {tool}: {path} {ver}")
    if "ext_O0" in which:
        run("extension exceptions, -O0", ext_defs("probe_ext_O0", ["-O0"]) + EXT)
    if "ext_nosplit" in which:
        run("extension exceptions, -fno-reorder-blocks-and-partition",
            ext_defs("probe_ext_ns", ["-fno-reorder-blocks-and-partition"]) + EXT)
    hb = WORK / "probe_segv"
    hb.mkdir(exist_ok=True)
    handler = f"HBUILD = {str(hb)!r}\n" + SEGV_HANDLER
    if "bt" in which:
        run("failing TORCH_CHECK caught, SIGSEGV handler", handler + ext_defs("probe_crash", []) + CRASH_CHECK, tail=45)
    if "gdb" in which and gdb_prefix:
        run("failing TORCH_CHECK caught, under gdb", ext_defs("probe_crash", []) + CRASH_CHECK, prefix=gdb_prefix,
            tail=45, timeout=400)
    if "libs" in which:
        from gr_plugin.csrc.toolchain import compiler, libstdcxx_ldflags

        for name in ("libstdc++.so", "libstdc++.a", "libstdc++.so.6"):
            got = subprocess.run(["g++", f"-print-file-name={name}"], capture_output=True, text=True).stdout.strip()
            print(f"--- g++ -print-file-name={name}: {got}")
        print(f"--- toolchain: compiler {compiler()} (CXX={os.environ.get('CXX')}), flags {libstdcxx_ldflags()}")
        crash = WORK / "probe_crash" / "probe_crash.so"
        if crash.exists():
            for cmd in (f"readelf -d {crash} | grep NEEDED", f"nm -D --defined-only {crash} | grep -c 'St6locale'"):
                out = subprocess.run(["bash", "-c", cmd], capture_output=True, text=True).stdout.strip()
                print(f"--- {cmd}:\n{out}")
    if "fixed" in which:  # the fix of gr_plugin/csrc/toolchain.py, applied whatever its detection says
        fix = ["-l:libstdc++.so.6"]
        run("fixed: failing TORCH_CHECK caught", ext_defs("probe_crash_fixed", [], fix) + CRASH_CHECK)
        run("fixed: extension exceptions reaching python", ext_defs("probe_ext3_fixed", [], fix) + EXT3)
        pkgf = f"PKG = {str(WORK / 'plain_fixed.pt2')!r}\n"
        run("fixed: compile plain package with custom_op_libs=[':libstdc++.so.6']",
            pkgf + COMPILE.replace("package_path=PKG)",
                                   "package_path=PKG, inductor_configs={'aot_inductor.custom_op_libs': "
                                   "[':libstdc++.so.6']})"))
        run("fixed: load that package", pkgf + LOAD)
    if "ext_fp" in which:
        run("extension exceptions, -fno-omit-frame-pointer",
            ext_defs("probe_ext_fp", ["-fno-omit-frame-pointer", "-mno-omit-leaf-frame-pointer"]) + EXT)
    if "ext_preload" in which and sys_libs:
        run(f"extension exceptions, LD_PRELOAD={sys_libs}", ext_defs("probe_ext", []) + EXT, {"LD_PRELOAD": sys_libs})
    defs = f"PKG = {pkg!r}\n"
    if "aoti" in which:
        run("compile plain package", defs + COMPILE)
        run("load plain package", defs + LOAD)
    if "bt" in which and os.path.exists(pkg):
        run("load plain package, SIGSEGV handler", handler + defs + LOAD, tail=45)
    if "gdb" in which and gdb_prefix and os.path.exists(pkg):
        run("load plain package, under gdb", defs + LOAD, prefix=gdb_prefix, tail=45, timeout=400)
    if "aoti_O0" in which:
        pkg0 = f"PKG = {str(WORK / 'plain_O0.pt2')!r}\n"
        run("compile plain package, wrapper -O0",
            pkg0 + "import torch._inductor.config as c\nc.aot_inductor.compile_wrapper_opt_level = 'O0'\n" + COMPILE)
        run("load plain package compiled with wrapper -O0", pkg0 + LOAD, tail=45)
    if "aoti_preload" in which and sys_libs and os.path.exists(pkg):
        run(f"load plain package, LD_PRELOAD={sys_libs}", defs + LOAD, {"LD_PRELOAD": sys_libs})


if __name__ == "__main__":
    main()
