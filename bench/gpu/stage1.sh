#!/usr/bin/env bash
# GPU stage 1 (carry .carry/smol.part00 .carry/smol-prep .carry/smol-vocab .carry/whl-min .carry/mt_bench_question.jsonl):
# stash the first half of SmolLM2 and its data in /tmp/g, then the GPU checks (GPU 0) beside eyas' trainer at
# Llama-3.1-8B and Kimi-K2.5 dims (GPU 1).
source bench/gpu/common.sh
mkdir -p $G && cp .carry/smol.part00 $G/ && cp -r .carry/smol-prep .carry/smol-vocab .carry/mt_bench_question.jsonl $G/
python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/site .carry/whl-min/*.whl
python3 - > $OUT/env.txt 2>&1 <<'PY'
import importlib, platform
print("python", platform.python_version())
for m in ("torch", "transformers", "triton", "numpy", "pyarrow", "pandas", "huggingface_hub", "datasets", "gguf", "safetensors", "accelerate"):
    try:
        print(m, importlib.import_module(m).__version__)
    except Exception as e:
        print(m, "FAILED", type(e).__name__, e)
import torch; print("gpus", torch.cuda.device_count(), torch.cuda.get_device_name(0))
PY
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv >> $OUT/env.txt
( CUDA_VISIBLE_DEVICES=0 run gpu_tests python3 -m pytest -q -p no:cacheprovider tests/gpu ) &
( export CUDA_VISIBLE_DEVICES=1
  run train_llama8b python3 bench/train_throughput.py --preset llama8b --steps 50
  run train_kimi python3 bench/train_throughput.py --preset kimi --steps 40 ) &
wait
cat $OUT/status.txt $OUT/env.txt
