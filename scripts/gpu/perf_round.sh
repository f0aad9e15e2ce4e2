#!/usr/bin/env bash
# One device call's worth of GPU performance checks (results under $OUT):
#   tests/gpu (gputests), the kernel GPU tests with the tanh.approx SiLU (kernels), e2e at bs 8 and 1, the e2e profile at bs 8,
#   step_host on this host, the block table's 4096/3968 rows; the tiers and transfer tables (tiers), a profile of
#   the layerwise host hit (tiers_profile), the AOTInductor/extension crash probe (aoti_probe); fp32: the fp32
#   kernel's tiles at the head sizes not yet swept (16, 32) with the old tiles beside them, and `recipes.infer`'s
#   default model and `hstu_large` in fp32 (fp32); the jagged attention's Triton backward: its GPU tests (bwdtests),
#   its tile sweep and the training bench, Triton vs the reference (train).
# Usage (device):  source scripts/gpu/setup_device.sh && bash scripts/gpu/perf_round.sh [parts...]
parts=${*:-"kernels e2e profile step_host block"}
out=${OUT:-/tmp/out}; mkdir -p "$out"
for p in $parts; do
  echo "=== $p ($(date +%T))"
  case $p in
    gputests) python3 -m pytest -q -x tests/gpu 2>&1 | tail -15 | tee "$out/gputests.txt" ;;
    kernels) GR_PLUGIN_FAST_SILU=1 python3 -m pytest -q -x tests/ops/test_triton_attention.py tests/ops/test_hstu_attention.py \
               2>&1 | tail -15 | tee "$out/kernels.txt" ;;
    e2e) python3 -m recipes.bench suite=e2e 'e2e.batch_sizes=[8,1]' out_dir="$out" hydra/job_logging=disabled \
           2>&1 | tail -30 | tee "$out/e2e.txt" ;;
    profile) python3 scripts/gpu/profile_e2e.py 8 > "$out/profile.txt" 2>&1; head -5 "$out/profile.txt" ;;
    step_host) OMP_NUM_THREADS=1 python3 -m recipes.bench suite=step_host step_host.repeats=200 out_dir="$out" \
                 hydra/job_logging=disabled 2>&1 | tail -12 | tee "$out/step_host.txt" ;;
    block) python3 -m recipes.bench suite=block 'block.parts=[block]' \
             '+block.block_kwargs.histories=[[4096,3968]]' '+block.block_kwargs.batch_sizes=[1,8]' out_dir="$out" \
             hydra/job_logging=disabled 2>&1 | tail -20 | tee "$out/block.txt" ;;
    tiers) python3 -m recipes.bench suite=block 'block.parts=[transfer,tiers]' out_dir="$out" \
             hydra/job_logging=disabled 2>&1 | tail -20 | tee "$out/tiers.txt" ;;
    tiers_profile) python3 scripts/gpu/profile_tiers.py > "$out/profile_tiers.txt" 2>&1; grep "===\|busy" "$out/profile_tiers.txt" ;;
    fp32) python3 scripts/gpu/tune_fp32_attention.py --dims 32 16 --configs 64,64,4,3 32,64,4,1 32,32,4,1 16,32,4,1 \
            2>&1 | grep '^{' | tee "$out/fp32_tiles.jsonl"
          for m in hstu_small hstu_large; do
            python3 scripts/gpu/profile_infer.py gpu device=cuda train_if_missing=false model=$m 2>&1 \
              | grep -A30 '^== ' | tee -a "$out/fp32_infer.txt"
          done ;;
    bwdtests) python3 -m pytest -q tests/ops/test_triton_attention_bwd.py \
                tests/ops/test_triton_attention.py::test_gpu_training_gradients_equal_the_reference \
                2>&1 | tail -15 | tee "$out/bwdtests.txt" ;;
    train) python3 scripts/gpu/tune_attention_bwd.py 2>&1 | grep '^{' | tee "$out/bwd_tiles.jsonl"
           python3 -m recipes.bench suite=train out_dir="$out" hydra/job_logging=disabled 2>&1 | tail -20 \
             | tee "$out/train.txt" ;;
    aoti_probe) python3 scripts/gpu/aoti_probe.py /tmp/ap tools ext3 bt gdb ext_O0 ext_nosplit aoti aoti_O0 \
                  > "$out/aoti_probe.txt" 2>&1; grep -- "^---" "$out/aoti_probe.txt" ;;
  esac
done
