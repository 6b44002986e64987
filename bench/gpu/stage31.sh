#!/usr/bin/env bash
# GPU stage 31 (kind nvidia-h200, carry .whl .carry/whl-min), written in the ninth session for the next device
# time: the GPU tests (the scored-rows loss compiled in bf16 is new, not yet run on a GPU), then what skipping
# unscored positions buys at Llama-3.1-8B dims: synthetic rows with a 64-token prompt (97% scored: the loss runs
# on every row) against rows with a 1088-token prompt (47% scored: the loss runs on one 1024-row chunk of two),
# in speculators' setting and then with the full-vocab accuracy on (eyas' default), where the verifier's head
# over the whole vocab also runs only at the half of the positions some step reads (tenth session) (about 9 min cold).
source bench/gpu/common.sh
python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/site .whl/*.whl .carry/whl-min/*.whl 2>/dev/null
W="--workdir /tmp/eb"; M="--freeze-lm-head --no-full-vocab-accuracy"
df -h /tmp | tail -1 | tee -a "$OUT/status.txt"
run gpu_tests timeout 240 python3 -m pytest -q -p no:cacheprovider tests/gpu/test_flex.py
run e_llama_p64 timeout 190 python3 bench/train_throughput.py $W --preset llama8b --steps 40 $M
run e_llama_p1088 timeout 120 python3 bench/train_throughput.py $W --preset llama8b --steps 40 $M --prompt-tokens 1088
F="--freeze-lm-head"
run e_llama_full_p64 timeout 120 python3 bench/train_throughput.py $W --preset llama8b --steps 40 $F
run e_llama_full_p1088 timeout 120 python3 bench/train_throughput.py $W --preset llama8b --steps 40 $F --prompt-tokens 1088
cd $OUT && cat *.jsonl > results.jsonl && for f in *.err; do echo "=== $f"; tail -c 2500 $f; done > errs.txt
rm -f *.err $(ls *.jsonl | grep -v results.jsonl); cat status.txt
