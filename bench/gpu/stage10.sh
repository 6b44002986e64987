#!/usr/bin/env bash
# GPU stage 10 (kind nvidia-h200, no carry): extraction end to end at a realistic size, 24,000 synthetic rows
# (about 14M tokens), to RAM, against the bare forward in the same process.
source bench/gpu/common.sh
run x timeout 290 python3 bench/extract_throughput.py --verifier random-smollm2 --rows 24000 --out /dev/shm/eyas-x \
    --no-capture-only
cat $OUT/x.jsonl; tail -c 1000 $OUT/x.err
