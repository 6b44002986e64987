#!/usr/bin/env bash
# GPU stage 9 (kind nvidia-h200-x2, no carry): DDP scaling on two GPUs against one GPU on the same rows (the
# one-GPU run beside extraction throughput on the other GPU, bench/gpu/stage7.sh's run), then DDP.
source bench/gpu/common.sh
( export CUDA_VISIBLE_DEVICES=0
  run train_1gpu timeout 200 python3 bench/train_throughput.py --preset llama8b --steps 60 ) &
( export CUDA_VISIBLE_DEVICES=1
  run extract timeout 240 python3 bench/extract_throughput.py --verifier random-smollm2 --rows 10000 \
      --out /dev/shm/eyas-x --out /tmp/eyas-x ) &
wait
# the same 62 rows as train_1gpu: 30 steps of 2 x 2048 tokens
run train_ddp2 timeout 260 torchrun --standalone --nproc-per-node 2 bench/train_throughput.py --preset llama8b --steps 30
cd $OUT && cat *.jsonl > results.jsonl && for f in *.err; do echo "=== $f"; tail -c 2500 $f; done > errs.txt
rm -f *.err $(ls *.jsonl | grep -v results.jsonl); cat status.txt
