#!/usr/bin/env bash
# The generation engine on one H200 (kind nvidia-h200, carry .whl .carry): the GPU tests (CUDA graphs against
# eager decoding), then speed on SmolLM2-135M's shape with random weights (`random`: no GGUF needed; every
# answer runs to --max-new-tokens) or on the real SmolLM2 GGUF in /tmp/g (`real`): eyas's engine against
# transformers' static-cache generate and continuous batching on ShareGPT's first turns, and eval's batch-1
# loops (plain and speculative with an untrained draft: what a round costs).
#   bash bench/gpu/generate.sh random      # about 5 minutes on a fresh machine
source bench/gpu/common.sh
python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/site .whl/*.whl 2>/dev/null
nvidia-smi --query-gpu=name,memory.total --format=csv,noheader | tee -a "$OUT/status.txt"
if [ "$1" = random ]; then
  V=/tmp/smol-random
  python3 - <<'PY'
import shutil, torch
from transformers import AutoConfig, AutoModelForCausalLM
torch.manual_seed(0)
model = AutoModelForCausalLM.from_config(AutoConfig.from_pretrained(".carry/smol-config"), dtype=torch.bfloat16)
model.save_pretrained("/tmp/smol-random")
for f in ("tokenizer.json", "tokenizer_config.json", "chat_template.jinja"):
    shutil.copy(f".carry/smol-config/{f}", "/tmp/smol-random")
PY
else
  V=$GGUF
fi
P=".carry/sharegpt_prompts.jsonl.gz"
run gpu_tests timeout 200 python3 -m pytest -q -x -p no:cacheprovider tests/gpu/test_generate_gpu.py
run regen_2048 timeout 200 python3 bench/regenerate_throughput.py --verifier $V --prompts $P --num-prompts 2048 \
  --max-new-tokens 256 --methods engine,hf-static
run regen_cb_256 timeout 120 python3 bench/regenerate_throughput.py --verifier $V --prompts $P --num-prompts 256 \
  --max-new-tokens 256 --methods engine,hf-cb
run eval_8 timeout 150 python3 bench/eval_speedup.py --verifier $V --prompts .carry/mt_bench.jsonl --num-prompts 8 \
  --max-new-tokens 256 --modes graphs --draft-tokens 3
cd $OUT && cat *.jsonl > results.jsonl && for f in *.err; do echo "=== $f"; tail -c 3000 $f; done > errs.txt
rm -f *.err $(ls *.jsonl | grep -v results.jsonl); cat status.txt
