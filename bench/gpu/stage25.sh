#!/usr/bin/env bash
# GPU stage 25 (kind nvidia-h200, carry .whl .carry/whl-min), written in the seventh session for the next device
# time. Stage 24 paired eyas and speculators one after the other in one call and got 1.58x at Llama-3.1-8B dims,
# where stage 21 (both at once on two GPUs) got 1.90x and stage 23's eyas alone 1.94x of stage 21's speculators:
# the ratio needs a spread, not one pairing. Here: three eyas and two speculators runs alternating at Llama dims (
# the inductor caches stay warm after the first of each), the Kimi-K2.5 memory in eyas' low-memory mode
# (--gradient-checkpointing: 0.615x of speculators' peak without it), and the attention kernels (the seventh
# session's run timed the forwards without a warm-up), and the deferred weight gradients (--deferred-wgrad: its
# GPU test, then Kimi and Llama dims against the runs without it). Two calls, back to back on one warm machine:
# `bash bench/gpu/stage25.sh pairs` (about 8 min) and `bash bench/gpu/stage25.sh rest` (about 9 min).
source bench/gpu/common.sh
python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/site .whl/*.whl .carry/whl-min/*.whl
W="--workdir /tmp/eb"; M="--freeze-lm-head --no-full-vocab-accuracy"
python3 -c "import sys; sys.path.insert(0, 'bench'); import synthetic; from pathlib import Path
synthetic.inputs(Path('/tmp/eb'), 'llama8b', rows=42, seq_len=2048); synthetic.inputs(Path('/tmp/eb'), 'kimi', rows=26, seq_len=2048)"
if [ "$1" = pairs ]; then
  for i in 1 2; do
    run e_llama_$i timeout 100 python3 bench/train_throughput.py $W --preset llama8b --steps 40 $M
    run s_llama_$i timeout 160 python3 bench/speculators_train.py $W --preset llama8b --steps 40 --mode matched
  done
  run e_llama_3 timeout 80 python3 bench/train_throughput.py $W --preset llama8b --steps 40 $M
  run attention timeout 50 python3 bench/attention_kernel.py
else
  run gpu_tests timeout 150 python3 -m pytest -q -p no:cacheprovider tests/gpu/test_flex.py -k working_weights
  run e_kimi timeout 100 python3 bench/train_throughput.py $W --preset kimi --steps 24 $M
  run e_kimi_deferred timeout 100 python3 bench/train_throughput.py $W --preset kimi --steps 24 $M --deferred-wgrad
  run e_llama_deferred timeout 80 python3 bench/train_throughput.py $W --preset llama8b --steps 40 $M --deferred-wgrad
  run e_kimi_ckpt timeout 110 python3 bench/train_throughput.py $W --preset kimi --steps 24 $M --gradient-checkpointing
fi
cd $OUT && cat *.jsonl > results.jsonl && for f in *.err; do echo "=== $f"; tail -c 2500 $f; done > errs.txt
rm -f *.err $(ls *.jsonl | grep -v results.jsonl); cat status.txt
