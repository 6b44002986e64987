#!/usr/bin/env bash
# GPU stage 3 (carry nothing), same machine: memory where activations dominate (sequence 8192, both trainers, one GPU
# each), then eyas on both GPUs (DDP, FSDP2), then data-parallel extraction of SmolLM2 on two ranks.
source bench/gpu/common.sh
( CUDA_VISIBLE_DEVICES=0 run train_llama8b_s8192 python3 bench/train_throughput.py --preset llama8b --seq-len 8192 --steps 20 ) &
( CUDA_VISIBLE_DEVICES=1 run spec_llama8b_s8192 python3 bench/speculators_train.py --preset llama8b --seq-len 8192 --steps 20 --mode matched ) &
wait
run train_llama8b_ddp2 torchrun --standalone --nproc-per-node 2 bench/train_throughput.py --preset llama8b --steps 50
run train_llama8b_fsdp2 torchrun --standalone --nproc-per-node 2 bench/train_throughput.py --preset llama8b --steps 50 --dist fsdp
run eval_smol_eager python3 bench/eval_speedup.py --verifier $GGUF --draft $G/draft --prompts $G/mt_bench_question.jsonl \
    --num-prompts 4 --max-new-tokens 256 --modes none --no-hf-generate
cat $OUT/status.txt
