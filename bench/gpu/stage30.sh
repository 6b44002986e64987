#!/usr/bin/env bash
# GPU stage 30 (kind nvidia-h200, carry .whl .carry/whl-min), the ninth session.
# `bash bench/gpu/stage30.sh adamw`: eyas' Triton AdamW step (which also writes the working copies) tested against
#   torch's fused AdamW and timed beside it, then the Kimi-K2.5-dims training run with it and with torch's step
#   (about 6 min cold).
# `bash bench/gpu/stage30.sh kimi`: speculators 0.9.0 and eyas at Kimi-K2.5 dims, one after the other.
# `bash bench/gpu/stage30.sh llama`: eyas and speculators at Llama-3.1-8B dims, then speculators again at Kimi-K2.5
#   dims over more steps (three log windows; about 8.5 min cold).
source bench/gpu/common.sh
python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/site .whl/*.whl .carry/whl-min/*.whl 2>/dev/null
W="--workdir /tmp/eb"; M="--freeze-lm-head --no-full-vocab-accuracy"
df -h /tmp | tail -1 | tee -a "$OUT/status.txt"
python3 -c "import triton; print('triton', triton.__version__)" | tee -a "$OUT/status.txt"
if [ "$1" = adamw ]; then
  run gpu_tests timeout 120 python3 -m pytest -q -p no:cacheprovider tests/gpu/test_flex.py -k "adamw"
  run adamw timeout 90 python3 bench/adamw_kernel.py
  run e_kimi timeout 230 python3 bench/train_throughput.py $W --preset kimi --steps 24 $M
  run e_kimi_torch_adamw timeout 120 python3 bench/train_throughput.py $W --preset kimi --steps 24 $M --torch-adamw
elif [ "$1" = kimi ]; then
  run gpu_tests timeout 120 python3 -m pytest -q -p no:cacheprovider tests/gpu/test_flex.py -k "adamw"
  run s_kimi timeout 240 python3 bench/speculators_train.py $W --preset kimi --steps 24 --mode matched
  run e_kimi timeout 230 python3 bench/train_throughput.py $W --preset kimi --steps 24 $M
else
  run e_llama timeout 190 python3 bench/train_throughput.py $W --preset llama8b --steps 40 $M
  run s_llama timeout 170 python3 bench/speculators_train.py $W --preset llama8b --steps 40 --mode matched
  run s_kimi_long timeout 200 python3 bench/speculators_train.py $W --preset kimi --steps 34 --mode matched
fi
cd $OUT && cat *.jsonl > results.jsonl && for f in *.err; do echo "=== $f"; tail -c 2500 $f; done > errs.txt
rm -f *.err $(ls *.jsonl | grep -v results.jsonl); cat status.txt
