#!/usr/bin/env bash
# GPU stage 27 (kind nvidia-h200, carry .whl .carry/whl-min), the eighth session. Stage 25's `rest` call ran on a
# cold machine (no Inductor or Triton cache) under timeouts sized for a warm one: every training run was killed
# and the deferred GPU test failed on its own setup (it converted fc to a kept copy, which train() never does).
# Here the same questions with timeouts for a cold machine, in two calls back to back:
# `bash bench/gpu/stage27.sh deferred` (the GPU test, Kimi-K2.5 dims without and with --deferred-wgrad, Llama dims
# with it) and `bash bench/gpu/stage27.sh pairs` (speculators and eyas alternating at Llama-3.1-8B dims).
source bench/gpu/common.sh
python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/site .whl/*.whl .carry/whl-min/*.whl
W="--workdir /tmp/eb"; M="--freeze-lm-head --no-full-vocab-accuracy"
if [ "$1" = deferred ]; then
  run gpu_tests timeout 100 python3 -m pytest -q -p no:cacheprovider tests/gpu/test_flex.py -k "working_weights and deferred"
  run e_kimi timeout 200 python3 bench/train_throughput.py $W --preset kimi --steps 24 $M
  run e_kimi_deferred timeout 150 python3 bench/train_throughput.py $W --preset kimi --steps 24 $M --deferred-wgrad
  run e_llama_deferred timeout 120 python3 bench/train_throughput.py $W --preset llama8b --steps 40 $M --deferred-wgrad
else
  run s_llama_1 timeout 180 python3 bench/speculators_train.py $W --preset llama8b --steps 40 --mode matched
  run e_llama_1 timeout 110 python3 bench/train_throughput.py $W --preset llama8b --steps 40 $M
  run s_llama_2 timeout 150 python3 bench/speculators_train.py $W --preset llama8b --steps 40 --mode matched
  run e_llama_2 timeout 100 python3 bench/train_throughput.py $W --preset llama8b --steps 40 $M
fi
cd $OUT && cat *.jsonl > results.jsonl && for f in *.err; do echo "=== $f"; tail -c 2500 $f; done > errs.txt
rm -f *.err $(ls *.jsonl | grep -v results.jsonl); cat status.txt
