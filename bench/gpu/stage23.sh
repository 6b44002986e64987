#!/usr/bin/env bash
# GPU stage 23 (kind nvidia-h200, no carry), seventh session; written for two GPUs beside speculators, run on one
# (only the one-GPU kind was lent by then), so speculators' figures are stage 21's of the same session. Stage 22's
# A/B showed the same peak with and without --loader-embeddings: the trainer's blanket .to(device) copied the host
# table to the device. Fixed here, with the loss chunk compiled without split reductions (bench/loss_kernel.py
# compares the variants). In turn: eyas at Llama-3.1-8B then Kimi-K2.5 dims (speculators' setting), the
# loss-kernel variants, the GPU tests.
source bench/gpu/common.sh
W="--workdir /tmp/eb"; M="--freeze-lm-head --no-full-vocab-accuracy"
python3 -c "import sys; sys.path.insert(0, 'bench'); import synthetic; from pathlib import Path
synthetic.inputs(Path('/tmp/eb'), 'llama8b', rows=42, seq_len=2048); synthetic.inputs(Path('/tmp/eb'), 'kimi', rows=32, seq_len=2048)"
run e_llama timeout 130 python3 bench/train_throughput.py $W --preset llama8b --steps 40 $M
run e_kimi timeout 150 python3 bench/train_throughput.py $W --preset kimi --steps 30 $M
run loss_kernel timeout 80 python3 bench/loss_kernel.py
run gpu_tests timeout 250 python3 -m pytest -q -p no:cacheprovider tests/gpu/test_flex.py
cd $OUT && cat *.jsonl > results.jsonl && for f in *.err; do echo "=== $f"; tail -c 2500 $f; done > errs.txt
rm -f *.err $(ls *.jsonl | grep -v results.jsonl); cat status.txt
