#!/usr/bin/env bash
# GPU stage 32 (kind nvidia-h200; carry .whl: compressed-tensors 0.20.1 with pydantic, and datasets 5.1.0 with its
# pure-Python closure, list in docs/BENCHMARKS.md "int4 verifiers kept packed"): the verifier across devices (an
# int4 Kimi-like verifier split between the GPU and host memory, extraction and --online training against one
# GPU; the two-GPU tests skip on one GPU), then the packed against the dequantized memory of a random
# 2.2B-weight int4 Kimi-like checkpoint (about 90 s warm).
source bench/gpu/common.sh
python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/site .whl/*.whl 2>/dev/null
python3 -c "import compressed_tensors, datasets, transformers; print('compressed-tensors', compressed_tensors.__version__, 'datasets', datasets.__version__, 'transformers', transformers.__version__)" | tee -a "$OUT/status.txt"
run gpu_tests timeout 240 python3 -m pytest -q -p no:cacheprovider -rs tests/gpu/test_device_map.py
run int4_memory timeout 240 python3 bench/int4_memory.py
cd $OUT && cat int4_memory.jsonl > results.jsonl && cat gpu_tests.jsonl > tests.txt && for f in *.err; do echo "=== $f"; tail -c 4000 $f; done > errs.txt
rm -f *.err int4_memory.jsonl gpu_tests.jsonl; cat status.txt
