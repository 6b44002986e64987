#!/usr/bin/env bash
# GPU stage 28 (kind nvidia-h200, carry .whl .carry/whl-min), written in the eighth session for the next device
# time. Timeouts are for a cold machine (a fresh one has no Inductor or Triton cache: stage 25 lost a whole call to
# timeouts sized on a warm one), and every run removes its output after measuring (stage 27 filled the 64 GiB
# disk). Two calls, back to back on one machine (call the second within the 30 s idle release):
# `bash bench/gpu/stage28.sh llama`: eyas (deferred weight gradients, the default now), speculators 0.9.0, eyas
#   again at Llama-3.1-8B dims, then the attention kernels (about 9 min cold);
# `bash bench/gpu/stage28.sh kimi`: speculators at Kimi-K2.5 dims again (its only figure is stage 21's), eyas
#   beside it, and eyas with --gradient-checkpointing (about 8.5 min).
source bench/gpu/common.sh
python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/site .whl/*.whl .carry/whl-min/*.whl 2>/dev/null
W="--workdir /tmp/eb"; M="--freeze-lm-head --no-full-vocab-accuracy"
df -h /tmp | tail -1 | tee -a "$OUT/status.txt"
if [ "$1" = llama ]; then
  run e_llama_1 timeout 200 python3 bench/train_throughput.py $W --preset llama8b --steps 40 $M
  run s_llama_1 timeout 190 python3 bench/speculators_train.py $W --preset llama8b --steps 40 --mode matched
  run e_llama_2 timeout 80 python3 bench/train_throughput.py $W --preset llama8b --steps 40 $M
  run attention timeout 60 python3 bench/attention_kernel.py
else
  run s_kimi timeout 230 python3 bench/speculators_train.py $W --preset kimi --steps 24 --mode matched
  run e_kimi timeout 170 python3 bench/train_throughput.py $W --preset kimi --steps 24 $M
  run e_kimi_ckpt timeout 110 python3 bench/train_throughput.py $W --preset kimi --steps 24 $M --gradient-checkpointing
fi
cd $OUT && cat *.jsonl > results.jsonl && for f in *.err; do echo "=== $f"; tail -c 2500 $f; done > errs.txt
rm -f *.err $(ls *.jsonl | grep -v results.jsonl); cat status.txt
