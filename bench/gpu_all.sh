#!/usr/bin/env bash
# Issue 67's GPU measurements as two device calls of at most 10 minutes each, on one H100 or H200. Prepare here first:
#   bash ../shared/gpu/prepare.sh && .venv/bin/python bench/bench_gpu.py --pack-tokenizers .device/tokenizers.tgz
# then, there, from the project's root (carry .device/whl .device/assets.tgz .device/remote.sh .device/tokenizers.tgz):
#   bash bench/gpu_all.sh 1    # the fused scorer's gpu tests; the 8B evaluation: first trial (requests built, compile
#                              # cold), a later trial's (requests and kernels cached), the profiles before (eager) and
#                              # after (fused), a 128 x 512 trial, and last the eager pass over every item
#   bash bench/gpu_all.sh 2    # every gpu-marked test; lm-eval's HFLM on the same shape
# or, when the lease must also bring Ray (its wheel comes in two halves, one per call: ray.aa, then ray.ab), three
# shorter calls, the first with the wheels (.device/whl, assets, tokenizers, remote.sh), the others with one half each:
#   bash bench/gpu_all.sh recovery   # recovery at the 8B shape: kd at 8 x 512, seconds per step and peak
#   bash bench/gpu_all.sh tests      # every gpu-marked test          (carry .device/ray.aa ray.name ray.sha256)
#   bash bench/gpu_all.sh sweep      # paper_grid_20 and tpe_asha through Ray with gpu: 1, then the report (ray.ab)
# Issues 83 and 84 (the answer keys, the aligned layouts), two calls with the wheels, assets and tokenizers:
#   bash bench/gpu_all.sh 84   # the 8B evaluation: a first pass, a later one (answered from the keys the first kept),
#                              # the later one profiled (device-busy share), and lm-eval's HFLM beside them, last
#   bash bench/gpu_all.sh 83   # the fused tests; 128 x 512 trials in the layouts aligned to 64, free and uniform
#                              # (each trial's zero-shot seconds and prefill speedup)
# Issue 92's streamed pass (issue 95, must-show 3), one call with the wheels (no tokenizers, no data: random weights):
#   bash bench/gpu_all.sh streamed   # 8B at 128 x 512, streamed against in memory (seconds, peak, agreement); then a
#                                    # 70B-shaped model at 32 x 512, streamed, its layers made on the GPU one at a time
# Each writes its results under $OUT as it goes (a call cut by its limit still returns what was done).
set -uo pipefail
step=${1:?usage: gpu_all.sh 1|2|83|84|recovery|tests|sweep|streamed}  # not "part": remote.sh loops over a variable of that name
source .device/remote.sh
mkdir -p /tmp/tok && tar xzf .device/tokenizers.tgz -C /tmp/tok
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader | tee "$OUT/gpu.txt"
bench=(python3 bench/bench_gpu.py --shapes llama-3-8b --tokenizers /tmp/tok)
case $step in
1)
  python3 -m pytest -q -m gpu tests/test_gpu.py -k fused 2>&1 | tail -3 | tee "$OUT/tests_fused.txt"
  "${bench[@]}" --passes prefix_fused,prefix_fused --profile 300 --profile-passes prefix,prefix_fused \
      --importance 128x512 --last prefix --json "$OUT/gpu_fused.json" 2>&1 | grep -v "it/s\]" | tail -40
  ;;
2)
  python3 -m pytest -q -m gpu tests/test_gpu.py tests/recovery/test_recovery.py 2>&1 | tail -3 | tee "$OUT/tests.txt"
  "${bench[@]}" --passes hflm --importance none --json "$OUT/gpu_hflm.json" 2>&1 | grep -v "it/s\]" | tail -20
  ;;
84)
  "${bench[@]}" --passes prefix_fused,prefix_fused --profile 300 --profile-passes prefix_fused --importance none \
      --last hflm --json "$OUT/gpu_84.json" 2>&1 | grep -v "it/s\]" | tail -30
  ;;
83)
  python3 -m pytest -q -m gpu tests/test_gpu.py -k fused 2>&1 | tail -3 | tee "$OUT/tests_fused.txt"
  "${bench[@]}" --passes none --importance 128x512 --trial-layouts align64,free,uniform \
      --json "$OUT/gpu_83.json" 2>&1 | grep -v "it/s\]" | tail -30
  ;;
recovery)
  "${bench[@]}" --recovery 8x512 --recovery-steps 2,10 --passes none --importance none \
      --json "$OUT/gpu_recovery.json" 2>&1 | grep -v "it/s\]" | tail -8
  ;;
tests)
  python3 -m pytest -q -m gpu tests/test_gpu.py tests/recovery/test_recovery.py 2>&1 | tail -3 | tee "$OUT/tests.txt"
  ;;
sweep)
  python3 bench/bench_gpu_sweep.py --tokenizers /tmp/tok --json "$OUT/gpu_sweep.json" 2>&1 | tail -60
  ;;
streamed)
  python3 bench/bench_streamed.py --random-shape llama-3-8b --device cuda --samples 128 --seq-len 512 --compare \
      --out "$OUT/streamed.jsonl" 2>&1 | tail -4
  python3 bench/bench_streamed.py --random-shape llama-3-70b --device cuda --samples 32 --seq-len 512 \
      --out "$OUT/streamed.jsonl" 2>&1 | tail -2
  ;;
*) echo "gpu_all.sh: step 1, 2, 83, 84, recovery, tests, sweep or streamed, not $step"; exit 2 ;;
esac
