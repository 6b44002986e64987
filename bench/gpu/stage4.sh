#!/usr/bin/env bash
# GPU stage 4 (kind nvidia-h200-x2, carry .carry/whl-min): the GPU correctness tests and a torch.profiler table of
# eyas' trainer at Llama-3.1-8B dims (GPU 0) beside extraction throughput on SmolLM2-135M's architecture with the
# streaming shard writer (GPU 1), to RAM and to local disk; then eyas' trainer on both GPUs (DDP, FSDP2).
source bench/gpu/common.sh
python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/site .carry/whl-min/*.whl
{ nvidia-smi --query-gpu=name,memory.total --format=csv; nproc; free -g | head -2; df -h /tmp /dev/shm; } > $OUT/env.txt 2>&1
( export CUDA_VISIBLE_DEVICES=0
  run gpu_tests timeout 200 python3 -m pytest -q -p no:cacheprovider tests/gpu
  t0=$SECONDS; timeout 240 python3 bench/train_throughput.py --preset llama8b --steps 24 --torch-profile 5 \
      > $OUT/profile.jsonl 2> $OUT/profile.txt; echo "[profile] exit $? after $((SECONDS - t0)) s" >> $OUT/status.txt ) &
( export CUDA_VISIBLE_DEVICES=1
  run extract_ram timeout 120 python3 bench/extract_throughput.py --verifier random-smollm2 --rows 6000 --out /dev/shm/eyas-x
  run extract_ram_t4 timeout 120 python3 bench/extract_throughput.py --verifier random-smollm2 --rows 6000 --out /dev/shm/eyas-x --writer-threads 4
  run extract_disk timeout 120 python3 bench/extract_throughput.py --verifier random-smollm2 --rows 6000 --out /tmp/eyas-x
  dd if=/dev/zero of=/tmp/ddtest bs=16M count=256 conv=fsync 2>> $OUT/env.txt; rm -f /tmp/ddtest
  run train_1gpu timeout 120 python3 bench/train_throughput.py --preset llama8b --steps 60 ) &
wait
# the same 62 rows as train_1gpu: 30 steps of 2 x 2048 tokens
run train_ddp2 timeout 100 torchrun --standalone --nproc-per-node 2 bench/train_throughput.py --preset llama8b --steps 30
run train_fsdp2 timeout 100 torchrun --standalone --nproc-per-node 2 bench/train_throughput.py --preset llama8b --steps 30 --dist fsdp
cd $OUT && cat *.jsonl > results.jsonl && for f in *.err; do echo "=== $f"; tail -c 2500 $f; done > errs.txt
rm -f *.err $(ls *.jsonl | grep -v results.jsonl); cat status.txt
