#!/usr/bin/env bash
# GPU stage 29 (kind nvidia-h200, carry .whl .carry/whl-min), the ninth session.
# `bash bench/gpu/stage29.sh profile`: where the Kimi-K2.5-dims step goes now (deferred weight gradients, the
#   default since the eighth session) by torch.profiler's kernel table, and the TTT attention kernels at each TTT
#   step with q in the training's strided layout beside the contiguous one (about 6 min cold).
source bench/gpu/common.sh
python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/site .whl/*.whl .carry/whl-min/*.whl 2>/dev/null
W="--workdir /tmp/eb"; M="--freeze-lm-head --no-full-vocab-accuracy"
df -h /tmp | tail -1 | tee -a "$OUT/status.txt"
if [ "$1" = profile ]; then
  t0=$SECONDS
  timeout 300 python3 bench/train_throughput.py $W --preset kimi --steps 24 $M --torch-profile 5 \
    > "$OUT/e_kimi_prof.jsonl" 2> "$OUT/prof.txt"
  echo "[e_kimi_prof] exit $? after $((SECONDS - t0)) s" | tee -a "$OUT/status.txt"
  for k in 0 1 2; do run attention_$k timeout 100 python3 bench/attention_kernel.py --dims kimi --step $k; done
fi
cd $OUT && cat *.jsonl > results.jsonl && for f in *.err; do echo "=== $f"; tail -c 2500 $f; done > errs.txt
rm -f *.err $(ls *.jsonl | grep -v results.jsonl); cat status.txt
