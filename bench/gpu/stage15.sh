#!/usr/bin/env bash
# GPU stage 15 (kind nvidia-h200-x2, carry .whl .carry/whl-min). GPU 0: extraction at 14M tokens end to end
# with flash / memory-efficient attention first (eyas.verifier.varying_shape_attention), against the bare forward
# with the same order and with torch's default (cuDNN on an H200), first passes over unseen shapes included.
# GPU 1: eyas at Kimi-K2.5 dims in speculators' setting (its JSON: memory, MFU), beside stage 14's speculators run.
source bench/gpu/common.sh
python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/site .whl/*.whl .carry/whl-min/*.whl
W="--workdir /tmp/eb"; M="--freeze-lm-head --no-full-vocab-accuracy"
( export CUDA_VISIBLE_DEVICES=0
  run x_long timeout 420 python3 bench/extract_throughput.py --verifier random-smollm2 --rows 24000 \
      --out /dev/shm/eyas-x --no-capture-only ) &
( export CUDA_VISIBLE_DEVICES=1
  run e_kimi_matched timeout 330 python3 bench/train_throughput.py $W --preset kimi --steps 30 $M ) &
wait
cd $OUT && cat *.jsonl > results.jsonl && for f in *.err; do echo "=== $f"; tail -c 2500 $f; done > errs.txt
rm -f *.err $(ls *.jsonl | grep -v results.jsonl); cat status.txt
