#!/usr/bin/env bash
# The generation engine (eyas.engine.generate, behind eyas regenerate and eyas eval) on one H200: eyas's engine on
# ShareGPT's first turns, against transformers' static-cache generate (on prompts of one padded length) and
# continuous batching (bench/regenerate_throughput.py), eval's batch-1 loops, plain and speculative
# (bench/eval_speedup.py; an untrained draft, what a round costs, unless DRAFT=DIR names a trained one), then the
# GPU tests (CUDA graphs against eager decoding). Figures and what they mean: docs/BENCHMARKS.md, "Generation" and
# "eyas eval".
#
# Kind nvidia-h200. Either one call on SmolLM2-135M's config and tokenizer with random weights (no GGUF needed;
# every answer runs to --max-new-tokens: raw decoding speed on the real prompt lengths):
#   bash bench/gpu/generate.sh random   carry .whl .carry/smol-config .carry/sharegpt_prompts.jsonl.gz
#                                       .carry/mt_bench.jsonl                                    about 5 min
# or the real SmolLM2 in two calls back to back on one machine (its GGUF travels in two halves):
#   bash bench/gpu/generate.sh part0    carry .whl .carry/smol.part00 .carry/mt_bench.jsonl: the wheels, the
#                                       first half and MT-Bench's prompts in /tmp/g
#   bash bench/gpu/generate.sh real     carry .carry/smol.part01 .carry/sharegpt_prompts.jsonl.gz: joins the GGUF,
#                                       then the same runs on it (ShareGPT's 7 MB beside the wheels and the first
#                                       half no longer fit a call's 64 MiB with the tree)
# or, in one call of about 8 minutes on the random-weight model (the random mode's carry), what batch-1 decoding
# costs with each slot attention (bench/decode_profile.py: a plain step and a speculative round, timed and
# profiled), the GPU tests of the graphed steps, eval's loops on 4 MT-Bench questions against transformers'
# static generate, and the batched engine with each slot attention on 1,024 ShareGPT prompts:
#   bash bench/gpu/generate.sh quick
# or, in one call of about 3 minutes on the random-weight model, what one batched step of eyas regenerate costs
# by row count and live keys, with each slot attention, and where its time goes (bench/decode_profile.py --batched),
# then what one of its prefills costs by size, against the GPU's busy time (--prefill):
#   bash bench/gpu/generate.sh batched
# or, in one call of at most about 9 minutes (its timeouts) on the random-weight model, what a plain step and a
# speculative round cost (each round's parts graphed, and the whole round as one graph: eyas eval --fused-rounds)
# with FlexAttention, the draft's cache read by SDPA and by two matmuls around a masked softmax (DRAFT_ATTN;
# decode_profile.py --draft-attention; MAX_LEN=986 sizes the caches as eval's MT-Bench run does;
# DECODE_MLP=off,on,all: each layer's MLP block as inductor compiles it, as eyas' two Triton kernels in one-row
# forwards (eyas' default) and in verifications too, nopdl: those kernels launched without programmatic dependent
# launch; INDUCTOR: inductor settings to compare, as autotune's), and the GPU tests of the speculative loops, the
# frozen layers, the FlexAttention slot attention and the MLP kernels (TESTS: another pytest -k expression, such as
# decode_mlp alone):
#   bash bench/gpu/generate.sh rounds
# or, in one call of at most about 10 minutes on the random-weight model, the plain step and the speculative round
# (the draft's cache read as eval reads it on CUDA) under each inductor setting of INDUCTOR (bench/decode_profile.py
# --inductor; default: eyas as it runs, with Programmatic Dependent Launch, where a Triton kernel starts while the
# one before it ends, with coordinate-descent tuning of each generated kernel's block sizes, and with both; combo
# kernels, eyas' own, are undone with `combo_kernels=False`; `max_autotune_gemm=True`, Triton GEMM templates,
# measured slower at one row), each with its matmuls through cuBLAS and cuBLASLt (BLAS: decode_profile.py
# --blas) and the verifier's rotary table, final norm and the step's pick compiled (OUTER=off,on: also eagerly;
# decode_profile.py --outer; NORM_AHEAD=off,on: each layer's closing add apart and with the next norm,
# decode_profile.py --norm-ahead; DECODE_MLP=off,on,all: each layer's MLP block as inductor compiles it and as
# eyas' two Triton kernels in one-row forwards and in verifications too, decode_profile.py --decode-mlp), then the
# batched engine on 4,096 ShareGPT first turns:
#   bash bench/gpu/generate.sh autotune
# or, in one call of about 8 minutes on the real GGUF (after `generate.sh part0` on the same warm machine; carry
# .carry/smol.part01 .carry/sharegpt_prompts.jsonl.gz), what the recipe's runs cost where they slowed: a plain
# step and a speculative round with random drafts of one and two layers (train --num-layers), and regenerate on 8,192 ShareGPT first turns timed
# cold (compiles and graph recording included, as one `eyas regenerate` pays them), its prefills eager and compiled:
#   bash bench/gpu/generate.sh costs
# or, in one call of at most about 7 minutes on the random-weight model (the random mode's carry), a plain step
# and a speculative round with each layer's q/k/v and gate/up as separate matmuls and merged into one each
# (bench/decode_profile.py --merge off,on; eval merges by default, eyas.verifier.merged), and the GPU tests of
# the merged and the frozen layers:
#   bash bench/gpu/generate.sh merged
# Results: $OUT/results.jsonl (one JSON line a run), errs.txt (stderr tails), status.txt.
source bench/gpu/common.sh
mode=${1:-}
case "$mode" in
  random|part0|real|quick|batched|rounds|autotune|costs|merged) ;;
  *) sed -n '2,/^source/p' "$0" | sed '$d' >&2; exit 2 ;;
esac
install_wheels
if [ "$mode" = part0 ]; then
  stash_part0
  exit 0
elif [ "$mode" = random ] || [ "$mode" = quick ] || [ "$mode" = batched ] || [ "$mode" = rounds ] \
    || [ "$mode" = autotune ] || [ "$mode" = merged ]; then
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
  join_gguf
  V=$GGUF
fi
P=$(carried sharegpt_prompts.jsonl.gz)
if [ "$mode" = batched ]; then
  run batched timeout ${BATCHED_TIMEOUT:-150} python3 bench/decode_profile.py --verifier $V --attention ${ATTN:-flex,sdpa} \
    --batched ${ROWS:-256,1024,2048} --live ${LIVE:-256,1024}
  run prefill timeout 120 python3 bench/decode_profile.py --verifier $V --prefill ${PREFILL:-2048,8192,32768} \
    --prefill-len ${PREFILL_LEN:-256}
  collect
  exit 0
fi
if [ "$mode" = autotune ]; then
  # coordinate-descent tuning also turns a one-row matmul into a Triton reduction that fuses with the work
  # around it (torch/_inductor/decomposition.py, mm; gpt-fast decodes so), where cuBLAS launches a GEMM alone
  TUNE="default;triton.enable_pdl=True;coordinate_descent_tuning=True"
  TUNE="$TUNE;triton.enable_pdl=True,coordinate_descent_tuning=True"
  run profile timeout 470 python3 bench/decode_profile.py --verifier $V --attention flex --freeze off \
    --draft-attention matmul --inductor "${INDUCTOR:-$TUNE}" \
    --outer "${OUTER:-on}" --blas "${BLAS:-default,cublaslt}" --norm-ahead "${NORM_AHEAD:-on}" \
    --decode-mlp "${DECODE_MLP:-on}"
  # 470 + 100 s keeps the call inside the device's 600 s with its setup (the batched run took 40 s at b502f3f)
  run regen_4096 timeout 100 python3 bench/regenerate_throughput.py --verifier $V --prompts $P --num-prompts 4096 \
    --max-new-tokens 256 --methods engine
  collect
  exit 0
fi
if [ "$mode" = costs ]; then
  run layers timeout 240 python3 bench/decode_profile.py --verifier $V --attention flex --freeze off --draft-layers 1,2
  run regen_cold timeout 330 python3 bench/regenerate_throughput.py --verifier $V --prompts $P --num-prompts 8192 \
    --max-new-tokens 384 --methods engine,engine-compiled-prefill --cold
  collect
  exit 0
fi
if [ "$mode" = merged ]; then
  run profile timeout 240 python3 bench/decode_profile.py --verifier $V --attention flex --freeze off --merge off,on
  run gpu_tests timeout 150 python3 -m pytest -q -p no:cacheprovider tests/gpu/test_generate_gpu.py -k "merged or frozen"
  collect
  exit 0
fi
if [ "$mode" = rounds ]; then
  run profile timeout ${PROFILE_TIMEOUT:-300} python3 bench/decode_profile.py --verifier $V --attention flex \
    --freeze off --draft-attention ${DRAFT_ATTN:-sdpa,matmul} ${MAX_LEN:+--max-len $MAX_LEN} \
    --decode-mlp "${DECODE_MLP:-on}" --inductor "${INDUCTOR:-default}"
  run gpu_tests timeout 220 python3 -m pytest -q -p no:cacheprovider tests/gpu/test_generate_gpu.py \
    -k "${TESTS:-speculative or flex or row_count or frozen or decode_mlp}"
  collect
  exit 0
fi
if [ "$mode" = quick ]; then
  run profile timeout 100 python3 bench/decode_profile.py --verifier $V --attention sdpa,flex
  cp "$OUT/profile.jsonl" "$OUT/profile.keep"  # eval runs the attention that decoded faster here
  best=$(python3 -c "import json,sys; r=[json.loads(l) for l in open(sys.argv[1]) if 'plain_tokens_per_s' in l]; \
print(max(r, key=lambda x: x['plain_tokens_per_s'])['attention'] if r else 'sdpa')" "$OUT/profile.keep")
  run gpu_tests timeout 120 python3 -m pytest -q -p no:cacheprovider tests/gpu/test_generate_gpu.py \
    -k "plain_decode or speculative or flex"
  run eval_4 timeout 160 python3 bench/eval_speedup.py --verifier $V --draft random --prompts "$(carried mt_bench.jsonl)" \
    --num-prompts 4 --max-new-tokens 256 --modes graphs --attention "$best" --draft-tokens 3
  run regen_1024 timeout 90 python3 bench/regenerate_throughput.py --verifier $V --prompts $P --num-prompts 1024 \
    --max-new-tokens 256 --methods engine-flex,engine-sdpa
  rm -f "$OUT/profile.keep"
  collect
  exit 0
fi
# the benches first, each bounded, the GPU tests last (other modes run them too). transformers' static generate
# compiles once per padded length: over ShareGPT's lengths (up to 2,048) it did not finish 2,048 prompts in 200 s,
# twice, so it runs beside the engine on prompts of one padded length (at most 128 tokens)
run regen_2048 timeout 90 python3 bench/regenerate_throughput.py --verifier $V --prompts $P --num-prompts 2048 \
  --max-new-tokens 256 --methods engine
run regen_static timeout 150 python3 bench/regenerate_throughput.py --verifier $V --prompts $P --num-prompts 1024 \
  --max-prompt-len 128 --max-new-tokens 256 --methods engine,hf-static
run regen_cb_256 timeout 120 python3 bench/regenerate_throughput.py --verifier $V --prompts $P --num-prompts 256 \
  --max-new-tokens 256 --methods engine,hf-cb
run eval_8 timeout 150 python3 bench/eval_speedup.py --verifier $V --draft ${DRAFT:-random} \
  --prompts "$(carried mt_bench.jsonl)" --num-prompts 8 --max-new-tokens 256 --modes graphs --draft-tokens 3
run gpu_tests timeout 200 python3 -m pytest -q -x -p no:cacheprovider tests/gpu/test_generate_gpu.py
collect
