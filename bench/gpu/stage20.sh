#!/usr/bin/env bash
# GPU stage 20 (kind nvidia-h200-x2, carry .whl .carry/whl-min): the session's result beside speculators 0.9.0.
# The draft layer now compiles as two regions around attention (was six modules, seven regions a TTT step), on top
# of working weights and RMSNorm scaling in its input's dtype. GPU 0: the GPU tests, then eyas at Llama-3.1-8B
# and Kimi-K2.5 dims in speculators' setting. GPU 1, at the same time: speculators 0.9.0 matched, same inputs.
source bench/gpu/common.sh
python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/site .whl/*.whl .carry/whl-min/*.whl
W="--workdir /tmp/eb"; M="--freeze-lm-head --no-full-vocab-accuracy"
python3 -c "import sys; sys.path.insert(0, 'bench'); import synthetic; from pathlib import Path; synthetic.inputs(Path('/tmp/eb'), 'llama8b', rows=42, seq_len=2048)"
( export CUDA_VISIBLE_DEVICES=0
  run gpu_tests timeout 250 python3 -m pytest -q -p no:cacheprovider tests/gpu/test_flex.py
  run e_llama timeout 100 python3 bench/train_throughput.py $W --preset llama8b --steps 40 $M
  run e_kimi timeout 170 python3 bench/train_throughput.py $W --preset kimi --steps 30 $M ) &
( export CUDA_VISIBLE_DEVICES=1
  run s_llama timeout 160 python3 bench/speculators_train.py $W --preset llama8b --steps 40 --mode matched
  run s_kimi timeout 320 python3 bench/speculators_train.py $W --preset kimi --steps 30 --mode matched ) &
wait
cd $OUT && cat *.jsonl > results.jsonl && for f in *.err; do echo "=== $f"; tail -c 2500 $f; done > errs.txt
rm -f *.err $(ls *.jsonl | grep -v results.jsonl); cat status.txt
