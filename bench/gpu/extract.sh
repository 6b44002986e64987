#!/usr/bin/env bash
# The verifier's side at scale: eyas extract against the bare forward on the same batches, why a batch shape's
# first forward is slow, an int4 verifier kept packed against dequantized, and a verifier spread over devices.
# Figures and what they mean: docs/BENCHMARKS.md, "eyas extract" and "int4 verifiers".
#
# Kind nvidia-h200 unless said. One call each:
#   bash bench/gpu/extract.sh throughput  (no carry) 24,000 synthetic rows (14.3M tokens) of SmolLM2-135M's
#                                         architecture with random weights (the same work per token as the real
#                                         model), bf16 and fp8 features to RAM, against the bare forward with
#                                         torch's default attention and with extraction's             about 5 min
#   bash bench/gpu/extract.sh disk        (no carry) 10,000 rows to RAM and to local disk in one process, each
#                                         dtype twice (first passes), and the disk's own fsync rate   about 5 min
#   bash bench/gpu/extract.sh cold        (no carry) bench/gpu/cold_shapes.py: a forward, a matmul and SDPA on
#                                         shapes seen and unseen, and a profile of one cold forward   about 3 min
#   bash bench/gpu/extract.sh int4        (carry .whl: compressed-tensors with pydantic and loguru)
#                                         bench/int4_memory.py: a random int4 MoE checkpoint of Kimi-K2.5's layer
#                                         dims (18B weights, 12 GB packed) loaded packed against the same model in
#                                         bf16: memory, extract's and online training's forward, decoding with CUDA
#                                         graphs, the int4 kernels, after the GPU tests of eyas' int4 kernel
#                                         (tests/gpu/test_int4_gpu.py); prints $OUT/int4.json (COMMIT=... names
#                                         the commit measured)                                          about 3.5 min
#   bash bench/gpu/extract.sh int4-tests  (carry .whl: compressed-tensors, datasets) the device-map GPU tests (an
#                                         int4 Kimi-like verifier split between the GPU and host memory against one
#                                         GPU, for extraction and --online training)                  about 2 min
#   bash bench/gpu/extract.sh devices     (kind nvidia-h200-x2, carry .whl) the same GPU tests on two GPUs: a
#                                         verifier whose layers are split over both extracts what one GPU does
# Any other verifier eyas resolves (the real SmolLM2 after generate.sh part0 and real: /tmp/g/*.gguf) goes after
# `throughput` or `disk`: `bash bench/gpu/extract.sh throughput /tmp/g/SmolLM2-135M-Instruct.Q4_1.gguf`.
# Results: $OUT/results.jsonl (one JSON line a run), errs.txt (stderr tails), status.txt, cold_profile.txt.
source bench/gpu/common.sh
mode=${1:-}
V=${2:-random-smollm2}
case "$mode" in
  throughput|disk|cold|int4|int4-tests|devices) ;;
  *) sed -n '2,/^source/p' "$0" | sed '$d' >&2; exit 2 ;;
esac
install_wheels
X="python3 bench/extract_throughput.py --verifier $V"
case "$mode" in
  throughput)
    run x_long timeout 420 $X --rows 24000 --out /dev/shm/eyas-x --no-capture-only ;;
  disk)
    run x_ram_disk timeout 280 $X --rows 10000 --out /dev/shm/eyas-x --out /tmp/eyas-x
    run x_passes timeout 150 $X --rows 6000 --out /dev/shm/eyas-x --no-capture-only --order fp8,bf16 --passes 2
    dd if=/dev/zero of=/tmp/ddtest bs=16M count=256 conv=fsync 2>&1 | tail -1 | tee -a "$OUT/status.txt"
    rm -f /tmp/ddtest ;;
  cold)
    run cold timeout 200 python3 bench/gpu/cold_shapes.py
    cp "$OUT/cold.err" "$OUT/cold_profile.txt" ;;
  int4)
    python3 -c "import compressed_tensors; print('compressed-tensors', compressed_tensors.__version__)" \
      | tee -a "$OUT/status.txt"
    run int4_tests timeout 240 python3 -m pytest -q -p no:cacheprovider -rs tests/gpu/test_int4_gpu.py
    run int4_memory timeout "${INT4_TIMEOUT:-300}" python3 bench/int4_memory.py --out "$OUT" \
      --budget-s "${INT4_BUDGET_S:-240}" ${COMMIT:+--commit "$COMMIT"} ${INT4_ARGS:-}
    rm -rf /tmp/eyas-int4  # the 12 GB checkpoint: the disk is the next suite's while the machine stays warm
    cat "$OUT/int4.json" ;;
  int4-tests|devices)
    python3 -c "import compressed_tensors, datasets; print('compressed-tensors', compressed_tensors.__version__,
'datasets', datasets.__version__)" | tee -a "$OUT/status.txt"
    run gpu_tests timeout 300 python3 -m pytest -q -p no:cacheprovider -rs tests/gpu/test_device_map.py ;;
esac
collect
