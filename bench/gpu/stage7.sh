#!/usr/bin/env bash
# GPU stage 7 (kind nvidia-h200, no carry): extraction throughput with the pinned streaming writer on SmolLM2-135M's
# architecture (random weights), features in RAM, then on local disk.
source bench/gpu/common.sh
run x_ram timeout 60 python3 bench/extract_throughput.py --verifier random-smollm2 --rows 3000 --out /dev/shm/eyas-x
cat $OUT/x_ram.jsonl
run x_disk timeout 50 python3 bench/extract_throughput.py --verifier random-smollm2 --rows 3000 --out /tmp/eyas-x
cat $OUT/x_disk.jsonl; tail -c 1500 $OUT/x_ram.err
