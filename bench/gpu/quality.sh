#!/usr/bin/env bash
# SmolLM2-135M-Instruct from nothing to a measured draft (configs/smollm2-gpu.toml's recipe): regenerate (ShareGPT
# answered by the verifier itself, every turn), prepare, vocab, online training at each learning rate of $LRS side
# by side, then `eyas eval` of the draft with the best validation tau: MT-Bench (both turns) and HumanEval at K=3
# with the plain baseline, then K=5,7 on MT-Bench; bench/quality_results.py gathers the run into one JSON. Figures: docs/BENCHMARKS.md, "SmolLM2 from nothing".
#
# Kind nvidia-h200. The GGUF travels in two halves (build them and the prompt files with prepare_carry.sh):
#   bash bench/gpu/quality.sh part0   carry .whl .carry/smol.part00 .carry/sharegpt_prompts.jsonl.gz
#                                     .carry/mt_bench.jsonl .carry/humaneval.jsonl.gz: installs the wheels, keeps
#                                     the first half and the prompts in /tmp/g
#   bash bench/gpu/quality.sh run     carry .carry/smol.part01 (first call; later calls carry nothing): joins the
#                                     GGUF, then runs the stages in order within the call's $BUDGET seconds. A stage
#                                     cut by the budget resumes in the next `run` call (made at once, while the
#                                     machine is warm); finished stages skip themselves, and a stage starts only
#                                     after the one before it finished. Calls until status.txt says "all stages done".
# The default sizes are the whole recipe: every ShareGPT prompt and turn, all 80 MT-Bench questions and all 164
# HumanEval prompts (about three `run` calls). For the earlier, smaller run: SAMPLES=3000 TURNS=2 NEW=384 STEPS=400.
# Sizes shrink for a dry run on a CPU: SAMPLES, TURNS, NEW, STEPS, EPOCHS, LRS, MT_PROMPTS, HE_PROMPTS, VOCAB, SEQ,
# BATCH, EVAL_NEW, EVAL_NEEDS (seconds an eval stage needs to start), DEVICE, GGUF_FILE (another checkpoint), DATA (the prompt files' folder; default /tmp/g, filled by part0).
# What each stage printed, its exit code and seconds, the manifests, metrics and eval reports land in
# $OUT/run.tar.gz as each stage finishes, and $OUT/status.txt.
set -u
source "$(dirname "$0")/common.sh"
D=${DATA:-$G}; GGUF=${GGUF_FILE:-$GGUF}  # GGUF_FILE: another checkpoint (a dry run), used as it is
R=${R:-/tmp/q}; BUDGET=${BUDGET:-570}
SAMPLES=${SAMPLES:-}; TURNS=${TURNS:-}; NEW=${NEW:-512}; STEPS=${STEPS:-}; EPOCHS=${EPOCHS:-3}
LRS=${LRS:-1.5e-3}; VOCAB=${VOCAB:-32000}; SEQ=${SEQ:-2048}; BATCH=${BATCH:-16384}
MT_PROMPTS=${MT_PROMPTS:-80}; HE_PROMPTS=${HE_PROMPTS:-164}; EVAL_NEW=${EVAL_NEW:-256}; EVAL_NEEDS=${EVAL_NEEDS:-420}
DEV=${DEVICE:+--device $DEVICE}
mkdir -p "$R/logs"
T0=$SECONDS
stage() {  # stage NAME NEEDS CMD...: skipped once done; run within what is left of $BUDGET, started only with at
  # least NEEDS seconds left (eval does not resume: it starts where it can finish); output to $R/logs/NAME.log
  local name=$1 needs=$2; shift 2
  [ -e "$R/logs/$name.done" ] && return 0
  local left=$((BUDGET - (SECONDS - T0)))
  if [ $left -lt $((needs > 20 ? needs : 20)) ]; then echo "[$name] not started: the call's budget is spent; call again" | tee -a "$OUT/status.txt"; exit 0; fi
  local t0=$SECONDS
  timeout "$left" "$@" >> "$R/logs/$name.log" 2>&1
  local rc=$?
  echo "[$name] exit $rc after $((SECONDS - t0)) s" | tee -a "$OUT/status.txt"
  echo "$name $((SECONDS - t0))" >> "$R/logs/seconds.txt"  # minutes per stage: the sum over calls
  (cd "$R" && tar czf "$OUT/run.tar.gz" --exclude='*.safetensors' --exclude='*.arrow' --exclude='checkpoints' \
     --exclude='tensorboard' --exclude='conversations.jsonl' --exclude='.parts' . 2>/dev/null)
  if [ $rc -eq 124 ]; then echo "[$name] cut by the budget: call again to resume it" | tee -a "$OUT/status.txt"; exit 0; fi
  [ $rc -eq 0 ] || { echo "[$name] failed: see logs/$name.log in run.tar.gz" | tee -a "$OUT/status.txt"; exit 1; }
  touch "$R/logs/$name.done"
}
case "${1:-}" in
  part0) install_wheels; stash_part0; exit 0 ;;
  run) ;;
  *) echo "usage: bash bench/gpu/quality.sh part0|run" >&2; exit 2 ;;
esac
[ -n "${GGUF_FILE:-}" ] || join_gguf
V="--verifier $GGUF"
stage regenerate 0 python3 -m eyas.cli regenerate $V $DEV --data $D/sharegpt_prompts.jsonl.gz --out $R/regen \
  ${SAMPLES:+--max-samples $SAMPLES} ${TURNS:+--max-turns $TURNS} --max-new-tokens $NEW --max-seq-len $SEQ
stage prepare 0 python3 -m eyas.cli prepare $V --data $R/regen --out $R/prep --max-seq-len $SEQ --num-proc 16
stage vocab 0 python3 -m eyas.cli vocab --data $R/prep --out $R/vocab --draft-vocab-size $VOCAB
TR="--data $R/prep --vocab $R/vocab --online --epochs $EPOCHS --batch-tokens $BATCH --max-seq-len $SEQ --num-workers 2 \
  ${STEPS:+--max-steps $STEPS} --save-every 100 --verifier-name HuggingFaceTB/SmolLM2-135M-Instruct $DEV"
train_all() {  # one training per learning rate, side by side on the one GPU
  local pids=() rc=0 lr
  for lr in ${LRS//,/ }; do
    python3 -m eyas.cli train $V $TR --out $R/draft_lr$lr --lr $lr > "$R/logs/train_lr$lr.log" 2>&1 & pids+=($!)
  done
  for p in "${pids[@]}"; do wait "$p" || rc=1; done
  return $rc
}
export -f train_all
export V TR R
stage train 0 bash -c train_all
BEST=$(python3 - "$R" <<'PY'
import json, pathlib, sys
best = None
for m in sorted(pathlib.Path(sys.argv[1]).glob("draft_lr*/manifest.json")):
    tau = (json.loads(m.read_text()).get("outputs", {}).get("val") or {}).get("tau", 0.0)
    print(f"{m.parent.name}: validation tau {tau:.3f}", file=sys.stderr)
    if best is None or tau > best[0]:
        best = (tau, m.parent)
print(best[1] if best else "")
PY
)
echo "best draft: ${BEST:-none} ($((SECONDS - T0)) s into this call)" | tee -a "$OUT/status.txt"
[ -n "$BEST" ] || exit 1
E="python3 -m eyas.cli eval $V $DEV --draft $BEST --max-new-tokens $EVAL_NEW"
stage eval_mtbench $EVAL_NEEDS $E --prompts $D/mt_bench.jsonl --num-prompts $MT_PROMPTS --draft-tokens 3 --out $R/eval_mtbench.json
stage eval_humaneval $EVAL_NEEDS $E --prompts $D/humaneval.jsonl.gz --num-prompts $HE_PROMPTS --draft-tokens 3 --out $R/eval_humaneval.json
stage eval_mtbench_k57 $EVAL_NEEDS $E --prompts $D/mt_bench.jsonl --num-prompts $MT_PROMPTS --draft-tokens 5,7 --no-baseline \
  --out $R/eval_mtbench_k57.json
python3 bench/quality_results.py "$R" --out "$OUT/smollm2-quality.json" | tee -a "$OUT/status.txt"
echo "all stages done: $OUT/smollm2-quality.json (for bench/results/)" | tee -a "$OUT/status.txt"
