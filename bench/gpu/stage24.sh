#!/usr/bin/env bash
# GPU stage 24 (kind nvidia-h200, carry .whl .carry/whl-min), seventh session: the Llama-3.1-8B pair in one call on
# one GPU, in turn (speculators 0.9.0 matched, then eyas in speculators' setting), so the ratio has a same-run
# baseline on the one-GPU kind stage 23 ran on. The loss chunk now compiles with Inductor's defaults, static shapes
# first (stage 23: the split-reduction option made no difference).
source bench/gpu/common.sh
python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/site .whl/*.whl .carry/whl-min/*.whl
W="--workdir /tmp/eb"; M="--freeze-lm-head --no-full-vocab-accuracy"
python3 -c "import sys; sys.path.insert(0, 'bench'); import synthetic; from pathlib import Path
synthetic.inputs(Path('/tmp/eb'), 'llama8b', rows=42, seq_len=2048)"
run s_llama timeout 190 python3 bench/speculators_train.py $W --preset llama8b --steps 40 --mode matched
run e_llama timeout 120 python3 bench/train_throughput.py $W --preset llama8b --steps 40 $M
cd $OUT && cat *.jsonl > results.jsonl && for f in *.err; do echo "=== $f"; tail -c 2500 $f; done > errs.txt
rm -f *.err $(ls *.jsonl | grep -v results.jsonl); cat status.txt
