#!/usr/bin/env bash
# GPU stage 6 (kind nvidia-h200-x2, carry .whl .carry/whl-min): extraction throughput with the pinned streaming
# writer (GPU 1, first), then speculators 0.9.0's trainer (GPU 1) beside eyas' (GPU 0) on one shared copy of the
# synthetic inputs at Llama-3.1-8B dims, sequences 2048 and 8192.
source bench/gpu/common.sh
python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/site .whl/*.whl .carry/whl-min/*.whl
W="--workdir /tmp/eb"; M="--freeze-lm-head --no-full-vocab-accuracy"
( t0=$SECONDS; python3 -c "
import sys; sys.path[:0] = ['bench', 'src']; import synthetic; from pathlib import Path
synthetic.inputs(Path('/tmp/eb'), 'llama8b', rows=42, seq_len=2048); synthetic.inputs(Path('/tmp/eb'), 'llama8b', rows=18, seq_len=8192)
" 2> $OUT/inputs.err && touch /tmp/eb.ready; echo "[inputs] after $((SECONDS - t0)) s" >> $OUT/status.txt ) &
ready() { while [ ! -e /tmp/eb.ready ]; do sleep 2; done; }
( export CUDA_VISIBLE_DEVICES=0; ready
  run e_llama_matched timeout 120 python3 bench/train_throughput.py $W --preset llama8b --steps 40 $M
  run e_llama_s8192_matched timeout 110 python3 bench/train_throughput.py $W --preset llama8b --seq-len 8192 --steps 16 $M
  run e_llama_s8192_ckpt timeout 110 python3 bench/train_throughput.py $W --preset llama8b --seq-len 8192 --steps 16 $M --gradient-checkpointing
  run e_llama_default timeout 110 python3 bench/train_throughput.py $W --preset llama8b --steps 40 ) &
( export CUDA_VISIBLE_DEVICES=1
  run x_ram timeout 100 python3 bench/extract_throughput.py --verifier random-smollm2 --rows 5000 --out /dev/shm/eyas-x
  run x_disk timeout 100 python3 bench/extract_throughput.py --verifier random-smollm2 --rows 5000 --out /tmp/eyas-x
  ready
  run s_llama_matched timeout 150 python3 bench/speculators_train.py $W --preset llama8b --steps 40 --mode matched
  run s_llama_s8192_matched timeout 130 python3 bench/speculators_train.py $W --preset llama8b --seq-len 8192 --steps 16 --mode matched ) &
wait
cd $OUT && cat *.jsonl > results.jsonl && for f in *.err; do echo "=== $f"; tail -c 2000 $f; done > errs.txt
rm -f *.err $(ls *.jsonl | grep -v results.jsonl); cat status.txt
