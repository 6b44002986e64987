#!/usr/bin/env bash
# GPU stage 13 (kind nvidia-h200-x2, carry .whl .carry/whl-min), what the third session left unmeasured, in one
# call (its planned stage 12 became this, a kernel profile in place of a sequence-8192 run). GPU 0: extraction,
# each dtype twice with allocations counted (why a first pass is slow), then the windowed batching at 14M tokens
# end to end. GPU 1: a torch.profiler kernel table of eyas in speculators' setting at Llama dims (what the
# non-matmul half of a step is), then Kimi-K2.5 dims, eyas beside speculators 0.9.0 itself (never run before).
source bench/gpu/common.sh
python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/site .whl/*.whl .carry/whl-min/*.whl
W="--workdir /tmp/eb"; M="--freeze-lm-head --no-full-vocab-accuracy"
( export CUDA_VISIBLE_DEVICES=0
  run x_passes timeout 120 python3 bench/extract_throughput.py --verifier random-smollm2 --rows 6000 \
      --out /dev/shm/eyas-x --no-capture-only --order fp8,bf16 --passes 2
  run x_long timeout 250 python3 bench/extract_throughput.py --verifier random-smollm2 --rows 24000 \
      --out /dev/shm/eyas-x --no-capture-only ) &
( export CUDA_VISIBLE_DEVICES=1
  run e_profile timeout 130 python3 bench/train_throughput.py $W --preset llama8b --steps 24 $M --torch-profile 5
  cp $OUT/e_profile.err $OUT/profile.txt
  run e_kimi_matched timeout 150 python3 bench/train_throughput.py $W --preset kimi --steps 30 $M
  run s_kimi_matched timeout 190 python3 bench/speculators_train.py $W --preset kimi --steps 30 --mode matched ) &
wait
cd $OUT && cat *.jsonl > results.jsonl && for f in *.err; do echo "=== $f"; tail -c 2500 $f; done > errs.txt
rm -f *.err $(ls *.jsonl | grep -v results.jsonl); cat status.txt
