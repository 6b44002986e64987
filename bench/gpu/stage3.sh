#!/usr/bin/env bash
# GPU stage 3 (carry .whl), same machine: speculators 0.9.0's trainer beside eyas' (one GPU each), memory where
# activations dominate (sequence 8192), then eyas on both GPUs (DDP, FSDP2).
source bench/gpu/common.sh
python3 -m pip install -q --no-index --no-deps --no-compile --upgrade --target /tmp/site .whl/openai-*.whl
( export CUDA_VISIBLE_DEVICES=1
  run spec_llama8b_matched python3 bench/speculators_train.py --preset llama8b --steps 50 --mode matched
  run spec_llama8b_defaults python3 bench/speculators_train.py --preset llama8b --steps 50 --mode defaults
  run spec_llama8b_s8192 python3 bench/speculators_train.py --preset llama8b --seq-len 8192 --steps 20 --mode matched ) &
( export CUDA_VISIBLE_DEVICES=0
  run train_llama8b_s8192 python3 bench/train_throughput.py --preset llama8b --seq-len 8192 --steps 20
  run train_llama8b_muon python3 bench/train_throughput.py --preset llama8b --steps 50 --optimizer muon --layout speculators ) &
wait
run train_llama8b_ddp2 torchrun --standalone --nproc-per-node 2 bench/train_throughput.py --preset llama8b --steps 50
run train_llama8b_fsdp2 torchrun --standalone --nproc-per-node 2 bench/train_throughput.py --preset llama8b --steps 50 --dist fsdp
cd $OUT && for f in *.err; do echo "=== $f"; tail -c 1500 $f; done > errs.txt && rm -f *.err
cat $OUT/status.txt
