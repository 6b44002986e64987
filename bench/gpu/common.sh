# Sourced by the stage scripts: the environment every GPU run uses.
export PYTHONUNBUFFERED=1 TOKENIZERS_PARALLELISM=false HF_HUB_OFFLINE=1
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1  # never NVLink multicast
export PYTHONPATH=src:/tmp/site
G=/tmp/g                                   # SmolLM2 and its data, kept while the machine stays warm
GGUF=$G/SmolLM2-135M-Instruct.Q4_1.gguf
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"
run() {  # run NAME CMD...: stdout (JSON lines) to $OUT/NAME.jsonl, stderr tail to $OUT/NAME.err
  local name=$1; shift
  local t0=$SECONDS
  "$@" > "$OUT/$name.jsonl" 2> >(tail -c 20000 > "$OUT/$name.err")
  echo "[$name] exit $? after $((SECONDS - t0)) s" | tee -a "$OUT/status.txt"
}
