# Sourced by the GPU suites (train.sh, extract.sh, generate.sh, quality.sh): the environment every GPU run uses
# and the steps they share. What the suites carry is built by bench/gpu/prepare_carry.sh. DRY_RUN=1 (below) lists
# what a call would run without running it.
export PYTHONUNBUFFERED=1 TOKENIZERS_PARALLELISM=false HF_HUB_OFFLINE=1
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1  # never NVLink multicast
export PYTHONPATH=src:/tmp/site
G=/tmp/g                                   # SmolLM2 and the prompt files, kept while the machine stays warm
GGUF=$G/SmolLM2-135M-Instruct.Q4_1.gguf
GGUF_SHA256=b179c9523d0e6a0f98a330c7562b682750a6f8c8c15e5bc70ea373728110db53
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"
SPEC="--freeze-lm-head --no-full-vocab-accuracy"  # speculators 0.9.0's own setting for eyas (frozen head, draft-vocab accuracy)
W="--workdir /tmp/eb"                      # the synthetic training inputs, built once and reused while warm

run() {  # run NAME CMD...: stdout (JSON lines) to $OUT/NAME.jsonl, stderr tail to $OUT/NAME.err, a status line
  local name=$1; shift
  local t0=$SECONDS
  "$@" > "$OUT/$name.jsonl" 2> >(tail -c 20000 > "$OUT/$name.err")
  echo "[$name] exit $? after $((SECONDS - t0)) s" | tee -a "$OUT/status.txt"
}

install_wheels() {  # the carried .whl folder into /tmp/site (skipped in a call that carries none)
  if compgen -G ".whl/*.whl" > /dev/null; then
    python3 -m pip install -q --no-index --no-deps --no-compile --upgrade --target /tmp/site .whl/*.whl 2>/dev/null
  fi
  { nvidia-smi --query-gpu=name,memory.total --format=csv,noheader | head -1
    python3 -c "import torch, transformers; print('torch', torch.__version__, 'transformers', transformers.__version__)"
    df -h /tmp | tail -1; } | tee -a "$OUT/status.txt"
}

PROMPT_FILES="sharegpt_prompts.jsonl.gz mt_bench.jsonl humaneval.jsonl.gz"  # what prepare_carry.sh writes

stash_part0() {  # keep the GGUF's first half and the prompt files in $G for the next call (which joins them)
  mkdir -p $G && cp .carry/smol.part00 $G/
  for f in $PROMPT_FILES; do [ -e .carry/$f ] && cp .carry/$f $G/; done
  ls -la $G | tee -a "$OUT/status.txt"
}

keep_prompts() {  # keep_prompts DIR: the prompt files this call carries, in DIR beside those an earlier call kept
  # there (the same files: never replaced)
  for f in $PROMPT_FILES; do
    [ ! -e ".carry/$f" ] || [ -e "$1/$f" ] || { mkdir -p "$1" && cp ".carry/$f" "$1/"; }
  done
}

join_gguf() {  # the GGUF from $G/smol.part00 (an earlier call) and the carried .carry/smol.part01
  [ -e "$GGUF" ] || cat $G/smol.part00 .carry/smol.part01 > "$GGUF"
  echo "$GGUF_SHA256  $GGUF" | sha256sum -c | tee -a "$OUT/status.txt"
}

carried() {  # carried FILE: .carry/FILE when this call carries it, else the copy stash_part0 kept in $G
  if [ -e ".carry/$1" ]; then echo ".carry/$1"; else echo "$G/$1"; fi
}

collect() {  # every run's JSON lines in results.jsonl, their stderr tails in errs.txt, then the status lines
  cd "$OUT" || return
  cat *.jsonl > results.jsonl 2>/dev/null
  for f in *.err; do echo "=== $f"; tail -c 3000 "$f"; done > errs.txt
  rm -f *.err $(ls *.jsonl | grep -v '^results.jsonl$')
  cat status.txt
}

if [ -n "${DRY_RUN:-}" ]; then
  # DRY_RUN=1: a suite's own logic on any machine, without running its work (tests/e2e/test_gpu_suites.py): each
  # command it would run is written to $OUT/commands.txt (a bench's arguments, a GPU test selection), nothing is
  # installed, joined or written outside $OUT, and no time limit applies.
  record() { printf '%q ' "$@" >> "$OUT/commands.txt"; echo >> "$OUT/commands.txt"; }  # shell-quoted, one a line
  python3() {  # -c snippets run (they read the suite's own results); a heredoc script is read and dropped
    case "${1:-}" in
      -c) command python3 "$@" ;;
      -) cat > /dev/null ;;
      -m) [ "${2:-}" = pip ] || record python3 "$@" ;;
      *) record python3 "$@" ;;
    esac
  }
  torchrun() { record torchrun "$@"; }
  timeout() { while [ "${1#-}" != "$1" ]; do [ "$1" = -k ] && shift; shift; done; shift; "$@"; }
  env() { while [ "${1#*=}" != "$1" ]; do shift; done; "$@"; }
  nvidia-smi() { echo "dry run"; }
  dd() { record dd "$@"; }
  join_gguf() { echo "dry run: $GGUF not joined"; }
  stash_part0() { echo "dry run: nothing kept in $G"; }
  keep_prompts() { :; }
fi
