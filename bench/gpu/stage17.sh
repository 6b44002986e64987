#!/usr/bin/env bash
# GPU stage 17 (kind nvidia-h200-x2, no carry). Working weights (eyas.precision: bf16 copies cast once per
# step, fp32 weight gradients accumulated by the matmuls) and the clip folded into the fused AdamW.
# GPU 0: the GPU tests (including working weights compiled == autocast), then a kernel profile at Llama dims in
# speculators' setting. GPU 1: the same setting with and without working weights (A/B in one call), then
# Kimi-K2.5 dims. Each JSON line carries a memory probe (held at a step's start, added by the step).
source bench/gpu/common.sh
W="--workdir /tmp/eb"; M="--freeze-lm-head --no-full-vocab-accuracy"
( export CUDA_VISIBLE_DEVICES=0
  run gpu_tests timeout 300 python3 -m pytest -q -p no:cacheprovider tests/gpu/test_flex.py
  run e_profile timeout 150 python3 bench/train_throughput.py $W --preset llama8b --steps 24 $M --torch-profile 5
  cp $OUT/e_profile.err $OUT/profile.txt ) &
( export CUDA_VISIBLE_DEVICES=1
  run e_llama_autocast timeout 120 python3 bench/train_throughput.py $W --preset llama8b --steps 40 $M --no-working-weights
  run e_llama_working timeout 120 python3 bench/train_throughput.py $W --preset llama8b --steps 40 $M
  run e_kimi_working timeout 250 python3 bench/train_throughput.py $W --preset kimi --steps 30 $M ) &
wait
cd $OUT && cat *.jsonl > results.jsonl && for f in *.err; do echo "=== $f"; tail -c 2500 $f; done > errs.txt
rm -f *.err $(ls *.jsonl | grep -v results.jsonl); cat status.txt
