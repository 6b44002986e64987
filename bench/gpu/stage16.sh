#!/usr/bin/env bash
# GPU stage 16 (kind nvidia-h200, no carry): stage 15's extraction at 14M tokens again, with every shard buffer
# of a run at the run's largest shard size (stage 15's bf16 run pinned 5 new 1 GiB buffers, 1.15 s, mid-run).
source bench/gpu/common.sh
run x_long timeout 330 python3 bench/extract_throughput.py --verifier random-smollm2 --rows 24000 \
    --out /dev/shm/eyas-x --no-capture-only
cat $OUT/x_long.jsonl; tail -c 400 $OUT/x_long.err
