#!/usr/bin/env bash
# SmolLM2-135M-Instruct from nothing to a measured draft: regenerate (ShareGPT's first two turns answered by the
# verifier), prepare, vocab, two online trainings side by side (two learning rates), then eyas eval of the one
# with the better validation tau: 48 MT-Bench questions (both turns) at K=3 with the plain baseline, all of
# HumanEval at K=3 (tau only), then K=5,7 on MT-Bench while time remains. Figures: docs/BENCHMARKS.md, "SmolLM2
# from nothing".
#
# Kind nvidia-h200, two calls back to back on one machine (the GGUF travels in two halves; build them and the
# prompt files with bench/gpu/prepare_carry.sh):
#   bash bench/gpu/quality.sh part0   carry .whl .carry/smol.part00 .carry/sharegpt_prompts.jsonl.gz
#                                     .carry/mt_bench.jsonl .carry/humaneval.jsonl.gz: installs the wheels, keeps
#                                     the first half and the prompts in /tmp/g
#   bash bench/gpu/quality.sh part1   carry .carry/smol.part01: joins the GGUF, then every stage (about 9.5 min;
#                                     a stage cut by its limit resumes when the same call is made again, the
#                                     finished stages skip themselves)
# Sizes can be shrunk for a dry run on a CPU: SAMPLES, NEW, STEPS, MT_PROMPTS, HE_PROMPTS, VOCAB, SEQ, BATCH, DEVICE,
# GGUF (a tiny checkpoint), DATA (where the prompt files are; default /tmp/g, filled by part0).
# What each stage printed, its exit code and seconds, the manifests, metrics and eval reports land in
# $OUT/run.tar.gz as each stage finishes, and $OUT/status.txt.
set -u
export PYTHONUNBUFFERED=1 TOKENIZERS_PARALLELISM=false HF_HUB_OFFLINE=1 PYTHONPATH=src:/tmp/site
G=/tmp/g; D=${DATA:-$G}; GGUF=${GGUF:-$G/SmolLM2-135M-Instruct.Q4_1.gguf}; OUT=${OUT:-/tmp/out}; R=${R:-/tmp/q}
SAMPLES=${SAMPLES:-3000}; NEW=${NEW:-384}; STEPS=${STEPS:-400}; VOCAB=${VOCAB:-32000}
MT_PROMPTS=${MT_PROMPTS:-48}; HE_PROMPTS=${HE_PROMPTS:-164}; SEQ=${SEQ:-2048}; BATCH=${BATCH:-16384}
DEV=${DEVICE:+--device $DEVICE}
mkdir -p "$OUT" "$R/logs"
stage() {  # stage NAME SECONDS CMD...: output to $R/logs/NAME.log, a line in status.txt, the run collected
  local name=$1 limit=$2; shift 2
  local t0=$SECONDS
  timeout "$limit" "$@" > "$R/logs/$name.log" 2>&1
  echo "[$name] exit $? after $((SECONDS - t0)) s" | tee -a "$OUT/status.txt"
  (cd "$R" && tar czf "$OUT/run.tar.gz" --exclude='*.safetensors' --exclude='*.arrow' --exclude='checkpoints' \
     --exclude='tensorboard' --exclude='conversations.jsonl' --exclude='.parts' . 2>/dev/null)
}
if [ "${1:-}" = part0 ]; then
  python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/site .whl/*.whl 2>/dev/null
  mkdir -p $G && cp .carry/smol.part00 .carry/sharegpt_prompts.jsonl.gz .carry/mt_bench.jsonl .carry/humaneval.jsonl.gz $G/
  ls -la $G | tee -a "$OUT/status.txt"
  nvidia-smi --query-gpu=name,memory.total --format=csv,noheader | tee -a "$OUT/status.txt"
  exit 0
fi
[ -e "$GGUF" ] || cat $G/smol.part00 .carry/smol.part01 > "$GGUF"
[ -f "$GGUF" ] && echo "gguf sha256 $(sha256sum "$GGUF" | cut -c1-16) (want b179c9523d0e6a0f)" | tee -a "$OUT/status.txt"
T0=$SECONDS
V="--verifier $GGUF"
stage regenerate 150 python3 -m eyas.cli regenerate $V $DEV --data $D/sharegpt_prompts.jsonl.gz --out $R/regen \
  --max-samples $SAMPLES --max-turns 2 --max-new-tokens $NEW --max-seq-len $SEQ
stage prepare 60 python3 -m eyas.cli prepare $V --data $R/regen --out $R/prep --max-seq-len $SEQ --num-proc 16
stage vocab 30 python3 -m eyas.cli vocab --data $R/prep --out $R/vocab --draft-vocab-size $VOCAB
TR="--data $R/prep --vocab $R/vocab --online --epochs 3 --batch-tokens $BATCH --max-seq-len $SEQ --num-workers 2 \
  --max-steps $STEPS --save-every 100 --verifier-name HuggingFaceTB/SmolLM2-135M-Instruct $DEV"
stage train_a 190 python3 -m eyas.cli train $V $TR --out $R/draft_a --lr 5e-4 &
stage train_b 190 python3 -m eyas.cli train $V $TR --out $R/draft_b --lr 1.5e-3 &
wait
BEST=$(python3 - "$R" <<'PY'
import json, pathlib, sys
best = None
for d in ("a", "b"):
    m = pathlib.Path(sys.argv[1], f"draft_{d}", "manifest.json")
    if m.is_file():
        tau = (json.loads(m.read_text()).get("outputs", {}).get("val") or {}).get("tau", 0.0)
        print(f"draft_{d}: validation tau {tau:.3f}", file=sys.stderr)
        if best is None or tau > best[0]:
            best = (tau, d)
print(pathlib.Path(sys.argv[1], f"draft_{best[1]}") if best else "")
PY
)
echo "best draft: ${BEST:-none} ($((SECONDS - T0)) s in)" | tee -a "$OUT/status.txt"
[ -n "$BEST" ] || exit 1
E="python3 -m eyas.cli eval $V $DEV --draft $BEST --max-new-tokens 256"
stage eval_mtbench 170 $E --prompts $D/mt_bench.jsonl --num-prompts $MT_PROMPTS --draft-tokens 3 \
  --out $R/eval_mtbench.json
stage eval_humaneval 120 $E --prompts $D/humaneval.jsonl.gz --num-prompts $HE_PROMPTS --draft-tokens 3 --no-baseline \
  --out $R/eval_humaneval.json
left=$((575 - (SECONDS - T0)))
[ $left -gt 45 ] && stage eval_mtbench_k57 $left $E --prompts $D/mt_bench.jsonl --num-prompts $MT_PROMPTS \
  --draft-tokens 5,7 --no-baseline --out $R/eval_mtbench_k57.json
cat "$OUT/status.txt"
