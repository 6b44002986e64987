#!/usr/bin/env bash
# GPU stage 19 (kind nvidia-h200-x2, no carry): working weights made traceable (the matmuls stay inside the
# compiled regions, the fp32 weight gradient returned to autograd; stage 18's version wrote .grad itself, broke
# every compiled region at each linear and left the GPU waiting for the host 10 ms a step). GPU 0: the GPU
# tests, then Llama and Kimi-K2.5 dims in speculators' setting. GPU 1: the A/B without working weights, then a
# kernel profile with the GPU-idle analysis.
source bench/gpu/common.sh
W="--workdir /tmp/eb"; M="--freeze-lm-head --no-full-vocab-accuracy"
( export CUDA_VISIBLE_DEVICES=0
  run gpu_tests timeout 300 python3 -m pytest -q -p no:cacheprovider tests/gpu/test_flex.py
  run e_llama_working timeout 120 python3 bench/train_throughput.py $W --preset llama8b --steps 40 $M
  run e_kimi_working timeout 200 python3 bench/train_throughput.py $W --preset kimi --steps 30 $M ) &
( export CUDA_VISIBLE_DEVICES=1
  run e_llama_autocast timeout 150 python3 bench/train_throughput.py $W --preset llama8b --steps 40 $M --no-working-weights
  run e_profile timeout 150 python3 bench/train_throughput.py $W --preset llama8b --steps 24 $M --torch-profile 5
  cp $OUT/e_profile.err $OUT/profile.txt ) &
wait
cd $OUT && cat *.jsonl > results.jsonl && for f in *.err; do echo "=== $f"; tail -c 2500 $f; done > errs.txt
rm -f *.err $(ls *.jsonl | grep -v results.jsonl); cat status.txt
