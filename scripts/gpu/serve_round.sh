#!/usr/bin/env bash
# One device call of serving measurements (results under $OUT): the GPU serving test, then the serve
# bench's long workload on hstu_large in bf16, with and without the cache; replica logs in $OUT/logs.
# Usage (device):  source scripts/gpu/setup_device.sh serve && bash scripts/gpu/serve_round.sh [requests]
set -o pipefail
out=${OUT:-/tmp/out}; mkdir -p "$out"
n=${1:-256}
echo "=== gpu serving test ($(date +%T))"
python3 -m pytest -q -x tests/gpu/test_gpu_serving.py 2>&1 | tail -5 | tee "$out/gpu_serving_test.txt"
echo "=== serve bench ($(date +%T))"
python3 -m recipes.bench suite=serve 'serve.workloads=[long]' serve.model=hstu_large \
  'serve.server_overrides=["dtype=bfloat16"]' serve.num_requests="$n" serve.log_dir="$out/logs" out_dir="$out" \
  hydra/job_logging=disabled 2>&1 | grep -v "fbgemm\|cannot determine\|^\s*$\|^WARNING:root\|\[0m\|\[33m" | tail -25 \
  | tee "$out/serve.txt"
rc=$?
for f in "$out"/logs/*.log; do echo "--- $f"; grep -v "^\s*$" "$f" | tail -15; done
exit $rc
