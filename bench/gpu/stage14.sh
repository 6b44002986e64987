#!/usr/bin/env bash
# GPU stage 14 (kind nvidia-h200-x2, carry .whl .carry/whl-min). GPU 0: why a batch shape's first forward is
# slow (bench/gpu/cold_shapes.py). GPU 1: speculators 0.9.0 at Kimi-K2.5 dims, matched, with room to compile
# (stage 13 gave it 190 s, not enough).
source bench/gpu/common.sh
python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/site .whl/*.whl .carry/whl-min/*.whl
W="--workdir /tmp/eb"
( export CUDA_VISIBLE_DEVICES=0
  run cold timeout 200 python3 bench/gpu/cold_shapes.py
  cp $OUT/cold.err $OUT/cold_profile.txt ) &
( export CUDA_VISIBLE_DEVICES=1
  run s_kimi_matched timeout 430 python3 bench/speculators_train.py $W --preset kimi --steps 30 --mode matched ) &
wait
cd $OUT && cat *.jsonl > results.jsonl && for f in *.err; do echo "=== $f"; tail -c 2500 $f; done > errs.txt
rm -f *.err $(ls *.jsonl | grep -v results.jsonl); cat status.txt
