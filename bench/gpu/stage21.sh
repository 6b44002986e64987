#!/usr/bin/env bash
# GPU stage 21 (kind nvidia-h200-x2, carry .whl .carry/whl-min), written in the fifth session and revised in the
# sixth (which had no device time): run stage22.sh first, whose GPU tests check the sixth session's compiled
# region on CUDA. What stage 20 left unmeasured, with limits long enough for compilation (the layer now compiles
# one graph per TTT step: about 1.5x the compile time, measured on CPU). GPU 0: eyas at Llama-3.1-8B dims in
# speculators' setting (the tree's code: working weights, the layer's TTT step one compiled region, the
# embedding looked up by the loader), then Kimi-K2.5 dims. GPU 1, at the same time: speculators 0.9.0 matched
# at both dims. Inputs are built before either side starts. (The loader-embedding memory A/B is in stage 22.)
source bench/gpu/common.sh
python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/site .whl/*.whl .carry/whl-min/*.whl
W="--workdir /tmp/eb"; M="--freeze-lm-head --no-full-vocab-accuracy"
python3 -c "import sys; sys.path.insert(0, 'bench'); import synthetic; from pathlib import Path
synthetic.inputs(Path('/tmp/eb'), 'llama8b', rows=42, seq_len=2048); synthetic.inputs(Path('/tmp/eb'), 'kimi', rows=32, seq_len=2048)"
( export CUDA_VISIBLE_DEVICES=0
  run e_llama timeout 240 python3 bench/train_throughput.py $W --preset llama8b --steps 40 $M
  run e_kimi timeout 300 python3 bench/train_throughput.py $W --preset kimi --steps 30 $M ) &
( export CUDA_VISIBLE_DEVICES=1
  run s_llama timeout 240 python3 bench/speculators_train.py $W --preset llama8b --steps 40 --mode matched
  run s_kimi timeout 260 python3 bench/speculators_train.py $W --preset kimi --steps 30 --mode matched ) &
wait
cd $OUT && cat *.jsonl > results.jsonl && for f in *.err; do echo "=== $f"; tail -c 2500 $f; done > errs.txt
rm -f *.err $(ls *.jsonl | grep -v results.jsonl); cat status.txt
