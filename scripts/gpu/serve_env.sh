#!/usr/bin/env bash
# Install PyTriton and the Triton stub's environment on the lent GPU machine (no package index
# there), from .serve_whl/ made on the dev box (see docs/BENCHMARKS.md, serving on the H200):
#   pytriton-slim.tar.xz      nvidia-pytriton 0.5.5 wheel contents, stubs other than Python 3.12 removed
#   numpy-1.26.4-slim.tar.xz  numpy 1.26.4 cp312 without tests/f2py (the stub needs numpy 1.x)
#   *.whl                     tritonclient and the HTTP client's dependencies, pyzmq, sh
# Usage (device command, after the .whl install into .site):  bash scripts/gpu/serve_env.sh .site
set -euo pipefail
site=${1:-.site}
src=.serve_whl
# NOTE: into the interpreter's own site-packages: PyTriton finds nvidia_pytriton.libs next to its
# package only there (anywhere else it assumes an editable install and looks inside the package).
purelib=$(python3 -c 'import site; print(site.getsitepackages()[0])')
tar -xJf "$src/pytriton-slim.tar.xz" -C "$purelib"
# NOTE: the stub embeds PyTriton's own libpython, whose stdlib search then lands on this machine's
# Python; where that Python builds modules such as _socket into itself (Ubuntu), they are missing.
# The machine's own shared libpython of the same version has them: the stub loads that one instead.
so=$(python3 -c 'import sysconfig as s, os; print(os.path.join(s.get_config_var("LIBDIR"), s.get_config_var("INSTSONAME") or "none"))')
if [ -f "$so" ]; then
  for f in "$purelib"/nvidia_pytriton.libs/libpython3-*.so.1.0; do ln -sf "$so" "$f"; echo "stub libpython -> $so"; done
fi
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target "$site" "$src"/*.whl
# The stub env (gr_plugin.serving.triton_env's default location), made here without pip.
env_dir=$(python3 -c 'import sys; print(sys.prefix)')/triton-stub
python3 -m venv --without-pip --clear "$env_dir"
sp=$("$env_dir/bin/python" -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])')
tar -xJf "$src/numpy-1.26.4-slim.tar.xz" -C "$sp"
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --target "$sp" "$src"/pyzmq-*.whl
PYTHONPATH=$site:$PWD python3 - "$env_dir" <<'PY'
import sys
from pathlib import Path
from gr_plugin.serving import triton_env as t
env = Path(sys.argv[1])
(env / t._STAMP).write_text("\n".join(t.STUB_REQUIREMENTS))
assert t.stub_env_ready(env), env
print("stub env ready:", env)
PY
