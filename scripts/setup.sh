#!/usr/bin/env bash
# Set up .venv with gr_plugin and its pinned dependencies on a CPU machine (Python 3.11).
# Idempotent: a stamp of the requirement files skips the work when nothing changed.
# The order matters (see requirements/*.txt): torch first, torchrec without its deps.
set -euo pipefail
cd "$(dirname "$0")/.."
venv=${VENV:-.venv}
stamp="$venv/.gr-setup-stamp"
want=$(cat requirements/*.txt pyproject.toml scripts/setup.sh | sha256sum | cut -c1-16)
# The gr_kv C++ ops and the C++ cache policy core (gr_plugin/csrc, docs/EXPORT.md; torch.utils.cpp_extension
# + ninja): built once per change of their sources, their builders, the venv or the checkout's place (the build
# directories are keyed by content and location, gr_plugin/csrc/build_lock.py).
ops_stamp="$venv/.gr-ops-stamp"
ops_want=$(find gr_plugin/csrc gr_plugin/csrc/core -maxdepth 1 -type f \( -name '*.py' -o -name '*.cpp' -o -name '*.h' \
  -o -name CMakeLists.txt \) -print0 | LC_ALL=C sort -z | xargs -0 cat | cat - <(echo "$want") <(pwd -P) \
  | sha256sum | cut -c1-16)
build_ops() {
  if [ ! -f "$ops_stamp" ] || [ "$(cat "$ops_stamp")" != "$ops_want" ]; then
    command -v ninja >/dev/null 2>&1 || [ -x "$venv/bin/ninja" ] || "$venv/bin/python" -m pip install -q ninja
    "$venv/bin/python" -m gr_plugin.csrc.build >/dev/null
    "$venv/bin/python" -m gr_plugin.csrc.core.build
    echo "$ops_want" > "$ops_stamp"
    echo "setup: gr_kv C++ ops and policy core built"
  fi
}
if [ -f "$stamp" ] && [ "$(cat "$stamp")" = "$want" ]; then
  build_ops
  exit 0
fi
[ -x "$venv/bin/python" ] || "${PYTHON:-python3}" -m venv "$venv"
pip=("$venv/bin/python" -m pip install -q --disable-pip-version-check)
"${pip[@]}" -r requirements/cpu.txt
"${pip[@]}" --no-deps -r requirements/nodeps.txt
"${pip[@]}" -r requirements/base.txt
"${pip[@]}" --no-deps --no-build-isolation -e . 2>/dev/null || "${pip[@]}" --no-deps -e .
"$venv/bin/python" -c "import gr_plugin.cache, torchrec, fbgemm_gpu, lightning, hydra"
# PyTriton's bundled Triton Python backend needs numpy 1: give it its own small venv (docs/SCALING.md)
"$venv/bin/python" -m gr_plugin.serving.triton_env
echo "$want" > "$stamp"
build_ops
echo "setup: $venv ready"
