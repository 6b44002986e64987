#!/usr/bin/env bash
# GPU stage 22 (kind nvidia-h200-x2, no carry), written in the sixth session (no device time was left to it). Run
# it before stage 21: its GPU tests check the new compiled region on CUDA before stage 21 spends time on it.
# What it checks: the sixth session's host-side changes to the training step (step masks, statistics, RoPE and
# embeddings once per TTT run instead of once per step; each TTT step of the draft one compiled region with
# flex attention inside; counted on CPU, the host dispatches 299 operators and 9 compiled graphs per step where
# it dispatched 497 and 21). GPU 0: the GPU tests (flex inside the compiled region: gradients), then a profile
# at Llama-3.1-8B dims (GPU busy and idle per step, what the host dispatches). GPU 1: a profile at Kimi-K2.5 dims,
# then Llama dims with the embedding on the device (`--no-loader-embeddings`: the loader embeddings' memory A/B).
source bench/gpu/common.sh
W="--workdir /tmp/eb"; M="--freeze-lm-head --no-full-vocab-accuracy"
python3 -c "import sys; sys.path.insert(0, 'bench'); import synthetic; from pathlib import Path
for r in (26, 42): synthetic.inputs(Path('/tmp/eb'), 'llama8b', rows=r, seq_len=2048)
synthetic.inputs(Path('/tmp/eb'), 'kimi', rows=26, seq_len=2048)"
( export CUDA_VISIBLE_DEVICES=0
  run gpu_tests timeout 300 python3 -m pytest -q -p no:cacheprovider tests/gpu/test_flex.py
  run e_llama_profile timeout 240 python3 bench/train_throughput.py $W --preset llama8b --steps 24 $M --torch-profile 5
  cp $OUT/e_llama_profile.err $OUT/profile_llama.txt ) &
( export CUDA_VISIBLE_DEVICES=1
  run e_kimi_profile timeout 280 python3 bench/train_throughput.py $W --preset kimi --steps 24 $M --torch-profile 5
  cp $OUT/e_kimi_profile.err $OUT/profile_kimi.txt
  # the memory A/B: the embedding on the device (peak memory does not depend on what the other GPU runs)
  run e_llama_device_embed timeout 200 python3 bench/train_throughput.py $W --preset llama8b --steps 40 $M --no-loader-embeddings ) &
wait
cd $OUT && cat *.jsonl > results.jsonl && for f in *.err; do echo "=== $f"; tail -c 2500 $f; done > errs.txt
rm -f *.err $(ls *.jsonl | grep -v results.jsonl); cat status.txt
