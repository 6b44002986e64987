#!/usr/bin/env bash
# GPU stage 7 (kind nvidia-h200, no carry): extraction throughput on SmolLM2-135M's architecture (random
# weights), 10,000 synthetic rows (about 5.8M tokens), features written to RAM and to local disk in one process
# (each shard deleted once durably written), with where the time went.
source bench/gpu/common.sh
run x timeout 280 python3 bench/extract_throughput.py --verifier random-smollm2 --rows 10000 \
    --out /dev/shm/eyas-x --out /tmp/eyas-x
cat $OUT/x.jsonl; tail -c 1500 $OUT/x.err
