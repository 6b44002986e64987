#!/usr/bin/env bash
# GPU stage 11 (kind nvidia-h200, no carry): why a dtype's first full extraction pass runs slower than its
# second (stage 10: fp8 0.67x then, 0.99x in stage 7's second pass): each dtype twice, with the device and
# pinned-host allocations made during each run and per-shard loop times.
source bench/gpu/common.sh
run x timeout 110 python3 bench/extract_throughput.py --verifier random-smollm2 --rows 6000 --out /dev/shm/eyas-x \
    --no-capture-only --order fp8,bf16 --passes 2
cat $OUT/x.jsonl; tail -c 600 $OUT/x.err
