#!/usr/bin/env bash
# GPU stage 18 (kind nvidia-h200-x2, no carry): stage 17's runs again after RMSNorm began scaling in its input's
# dtype (under autocast an fp32 weight had promoted every activation to fp32, and each working-weight matmul
# cast its input back). GPU 0: a kernel profile at Llama dims in speculators' setting, with where the GPU waits
# for the host, then the run without profiler. GPU 1: the A/B without working weights, then Kimi-K2.5 dims.
source bench/gpu/common.sh
W="--workdir /tmp/eb"; M="--freeze-lm-head --no-full-vocab-accuracy"
( export CUDA_VISIBLE_DEVICES=0
  run e_profile timeout 150 python3 bench/train_throughput.py $W --preset llama8b --steps 24 $M --torch-profile 5
  cp $OUT/e_profile.err $OUT/profile.txt
  run e_llama_working2 timeout 120 python3 bench/train_throughput.py $W --preset llama8b --steps 40 $M ) &
( export CUDA_VISIBLE_DEVICES=1
  run e_llama_autocast timeout 120 python3 bench/train_throughput.py $W --preset llama8b --steps 40 $M --no-working-weights
  run e_llama_working timeout 120 python3 bench/train_throughput.py $W --preset llama8b --steps 40 $M
  run e_kimi_working timeout 250 python3 bench/train_throughput.py $W --preset kimi --steps 30 $M ) &
wait
cd $OUT && cat *.jsonl > results.jsonl && for f in *.err; do echo "=== $f"; tail -c 2500 $f; done > errs.txt
rm -f *.err $(ls *.jsonl | grep -v results.jsonl); cat status.txt
