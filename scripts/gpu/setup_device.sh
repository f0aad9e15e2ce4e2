#!/usr/bin/env bash
# Set up a fresh lent GPU machine for a device call (no package index there): the wheels it lacks
# (.whl/, from ../shared/device/wheels.sh), optionally PyTriton (.serve_whl/, see serve_env.sh),
# and the C++ extensions. Source it from the working tree's root:
#   source scripts/gpu/setup_device.sh [serve]
# Afterwards PYTHONPATH holds .site and the tree.
set -eo pipefail
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target .site .whl/*.whl
if [ "${1:-}" = serve ]; then bash scripts/gpu/serve_env.sh .site; fi
export PYTHONPATH=$PWD/.site:$PWD PYTHONUNBUFFERED=1
python3 -m gr_plugin.csrc.build > /dev/null
python3 -m gr_plugin.csrc.core.build > /dev/null
nvidia-smi --query-gpu=name,driver_version,clocks.max.sm --format=csv,noheader
python3 -c 'import torch, triton; print("torch", torch.__version__, "triton", triton.__version__)'
set +eo pipefail
