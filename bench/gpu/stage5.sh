#!/usr/bin/env bash
# GPU stage 5 (kind nvidia-h200-x2, carry .whl): eyas' trainer (GPU 0) beside speculators 0.9.0's (GPU 1) on the
# same synthetic inputs (each GPU builds its own copy in its own workdir, same seed): Llama-3.1-8B dims at sequence
# 2048 and 8192 and Kimi-K2.5 dims, eyas at its defaults and at speculators' setting (frozen lm_head, no
# full-vocab accuracy), and in its low-memory mode (--gradient-checkpointing).
source bench/gpu/common.sh
python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/site .whl/*.whl
M="--freeze-lm-head --no-full-vocab-accuracy"
( export CUDA_VISIBLE_DEVICES=0; W="--workdir /tmp/eb0"
  run e_llama_default timeout 100 python3 bench/train_throughput.py $W --preset llama8b --steps 50
  run e_llama_matched timeout 80 python3 bench/train_throughput.py $W --preset llama8b --steps 50 $M
  run e_llama_s8192_matched timeout 110 python3 bench/train_throughput.py $W --preset llama8b --seq-len 8192 --steps 20 $M
  run e_llama_s8192_ckpt timeout 80 python3 bench/train_throughput.py $W --preset llama8b --seq-len 8192 --steps 20 $M --gradient-checkpointing
  run e_kimi_matched timeout 150 python3 bench/train_throughput.py $W --preset kimi --steps 30 $M ) &
( export CUDA_VISIBLE_DEVICES=1; W="--workdir /tmp/eb1"
  run s_llama_matched timeout 150 python3 bench/speculators_train.py $W --preset llama8b --steps 50 --mode matched
  run s_llama_s8192_matched timeout 150 python3 bench/speculators_train.py $W --preset llama8b --seq-len 8192 --steps 20 --mode matched
  run s_kimi_matched timeout 200 python3 bench/speculators_train.py $W --preset kimi --steps 30 --mode matched ) &
wait
cd $OUT && cat *.jsonl > results.jsonl && for f in *.err; do echo "=== $f"; tail -c 2500 $f; done > errs.txt
rm -f *.err $(ls *.jsonl | grep -v results.jsonl); cat status.txt
