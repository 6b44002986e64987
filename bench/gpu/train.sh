#!/usr/bin/env bash
# eyas train against speculators 0.9.0's trainer, its kernels, and its scaling over two GPUs, on synthetic inputs
# at Llama-3.1-8B and Kimi-K2.5 draft dims (bench/synthetic.py; TTT 3, AdamW, one 2048-token sequence a step
# unless said). eyas runs in speculators' setting ($SPEC: frozen head, accuracy within the draft vocab) unless
# said; speculators runs `--mode matched` (AdamW, plain layout, full attention, eager loss). Figures and what
# they mean: docs/BENCHMARKS.md, "Training".
#
# Kind nvidia-h200 (one H200) for every call but `dist` (nvidia-h200-x2). Carry `.whl` (bench/gpu/prepare_carry.sh:
# speculators and its closure; eyas alone needs none of it). One call each, timeouts sized for a fresh machine
# (no Inductor or Triton cache; a warm one takes about half):
#   bash bench/gpu/train.sh tests       the trainer's GPU tests (tests/gpu/test_flex.py: flex == SDPA, compiled ==
#                                       eager, working weights and deferred weight gradients == autocast, the fused
#                                       loss and AdamW kernels == references)                    about 5 min
#   bash bench/gpu/train.sh llama       eyas, speculators, eyas again at Llama-3.1-8B dims       about 8 min
#   bash bench/gpu/train.sh kimi        speculators, eyas, eyas --gradient-checkpointing at Kimi-K2.5 dims   about 9 min
#   bash bench/gpu/train.sh seq8192     memory where activations dominate: eyas --gradient-checkpointing and
#                                       speculators at sequence 8192, then eyas without checkpointing if time is left
#   bash bench/gpu/train.sh defaults    each trainer at its own defaults: eyas (head trained, full-vocab accuracy)
#                                       at both dims, speculators (Muon, its three norm flags, 2048 window) and eyas
#                                       in that setting (--optimizer muon --layout speculators) at Llama dims
#   bash bench/gpu/train.sh ab kimi     eyas' step choices one at a time against the default, Kimi-K2.5 dims:
#                                       --torch-adamw, --no-deferred-wgrad
#   bash bench/gpu/train.sh ab llama8b  the same at Llama-3.1-8B dims: --no-working-weights, --no-loader-embeddings,
#                                       --no-deferred-wgrad
#   bash bench/gpu/train.sh scored      what skipping unscored positions buys: rows with a 64-token prompt (97% of
#                                       positions scored) against a 1088-token prompt (47%), without and with the
#                                       full-vocab accuracy, Llama dims
#   bash bench/gpu/train.sh profile     torch.profiler kernel tables and where the GPU waits for the host, both dims
#   bash bench/gpu/train.sh kernels     the loss chunk, the TTT attention (both dims at TTT step 2, Kimi dims at
#                                       steps 0 and 1) and the AdamW step on their own
#   bash bench/gpu/train.sh dist        (nvidia-h200-x2) one GPU, then DDP, then FSDP2 on both, on the same rows
#   bash bench/gpu/train.sh online      the online trainer's verifier forward on SmolLM2-135M's architecture
#                                       (random weights, synthetic ShareGPT-like rows, 32,768-token micro-batches):
#                                       rows padded to the longest, the trainer's groups (eager, and through
#                                       compiled layers), the packed sequences with per-row positions (eager,
#                                       compiled as the trainer runs them, and compiled through flex_attention:
#                                       train --verifier-attention flex) (bench/online_verifier.py)   about 5 min
# Results: $OUT/results.jsonl (one JSON line a run), errs.txt (stderr tails), status.txt, profile_*.txt.
source bench/gpu/common.sh
mode=${1:-}
case "$mode" in
  tests|llama|kimi|seq8192|defaults|scored|profile|kernels|dist|online) ;;
  ab) [ "${2:-}" = kimi ] || [ "${2:-}" = llama8b ] || mode= ;;
  *) mode= ;;
esac
[ -n "$mode" ] || { sed -n '2,/^source/p' "$0" | sed '$d' >&2; exit 2; }
install_wheels
case "$mode" in
  online)
    run online_verifier timeout 400 python3 bench/online_verifier.py --verifier random-smollm2 --micro-batches 40 ;;
  tests)
    run gpu_tests timeout 540 python3 -m pytest -q -p no:cacheprovider -rs tests/gpu/test_flex.py ;;
  llama)
    run e_llama timeout 200 python3 bench/train_throughput.py $W --preset llama8b --steps 40 $SPEC
    run s_llama timeout 190 python3 bench/speculators_train.py $W --preset llama8b --steps 40 --mode matched
    run e_llama_2 timeout 80 python3 bench/train_throughput.py $W --preset llama8b --steps 40 $SPEC ;;
  kimi)
    run s_kimi timeout 230 python3 bench/speculators_train.py $W --preset kimi --steps 24 --mode matched
    run e_kimi timeout 200 python3 bench/train_throughput.py $W --preset kimi --steps 24 $SPEC
    run e_kimi_ckpt timeout 110 python3 bench/train_throughput.py $W --preset kimi --steps 24 $SPEC \
      --gradient-checkpointing ;;
  seq8192)
    S="--preset llama8b --seq-len 8192 --steps 16"
    run e_s8192_ckpt timeout 180 python3 bench/train_throughput.py $W $S $SPEC --gradient-checkpointing
    run s_s8192 timeout 240 python3 bench/speculators_train.py $W $S --mode matched
    left=$((570 - SECONDS))
    [ $left -gt 60 ] && run e_s8192 timeout $left python3 bench/train_throughput.py $W $S $SPEC ;;
  defaults)
    run e_llama_defaults timeout 200 python3 bench/train_throughput.py $W --preset llama8b --steps 40
    run s_llama_defaults timeout 190 python3 bench/speculators_train.py $W --preset llama8b --steps 40 --mode defaults
    run e_llama_muon timeout 90 python3 bench/train_throughput.py $W --preset llama8b --steps 40 --optimizer muon \
      --layout speculators
    left=$((570 - SECONDS))
    [ $left -gt 60 ] && run e_kimi_defaults timeout $left python3 bench/train_throughput.py $W --preset kimi --steps 24 ;;
  ab)
    case "$2" in
      kimi)
        P="--preset kimi --steps 24"
        run e_kimi timeout 200 python3 bench/train_throughput.py $W $P $SPEC
        run e_kimi_torch_adamw timeout 120 python3 bench/train_throughput.py $W $P $SPEC --torch-adamw
        run e_kimi_no_deferred timeout 150 python3 bench/train_throughput.py $W $P $SPEC --no-deferred-wgrad ;;
      llama8b)
        P="--preset llama8b --steps 40"
        run e_llama timeout 200 python3 bench/train_throughput.py $W $P $SPEC
        for flag in --no-working-weights --no-loader-embeddings --no-deferred-wgrad; do
          run "e_llama_${flag#--no-}" timeout 110 python3 bench/train_throughput.py $W $P $SPEC $flag
        done ;;
    esac ;;
  scored)
    P="--preset llama8b --steps 40"
    run e_llama_p64 timeout 190 python3 bench/train_throughput.py $W $P $SPEC
    run e_llama_p1088 timeout 120 python3 bench/train_throughput.py $W $P $SPEC --prompt-tokens 1088
    run e_llama_full_p64 timeout 120 python3 bench/train_throughput.py $W $P --freeze-lm-head
    run e_llama_full_p1088 timeout 120 python3 bench/train_throughput.py $W $P --freeze-lm-head --prompt-tokens 1088 ;;
  profile)
    run e_llama_profile timeout 200 python3 bench/train_throughput.py $W --preset llama8b --steps 24 $SPEC --torch-profile 5
    cp "$OUT/e_llama_profile.err" "$OUT/profile_llama.txt"
    run e_kimi_profile timeout 300 python3 bench/train_throughput.py $W --preset kimi --steps 24 $SPEC --torch-profile 5
    cp "$OUT/e_kimi_profile.err" "$OUT/profile_kimi.txt" ;;
  kernels)
    run loss_kernel timeout 80 python3 bench/loss_kernel.py
    run attention timeout 100 python3 bench/attention_kernel.py
    for k in 0 1; do run attention_kimi_step$k timeout 100 python3 bench/attention_kernel.py --dims kimi --step $k; done
    run adamw timeout 90 python3 bench/adamw_kernel.py ;;
  dist)
    P="--preset llama8b $SPEC"  # 62 rows: 60 steps of one sequence on one GPU, 30 steps of one per rank on two
    run train_1gpu timeout 150 env CUDA_VISIBLE_DEVICES=0 python3 bench/train_throughput.py $W $P --steps 60
    run train_ddp2 timeout 200 torchrun --standalone --nproc-per-node 2 bench/train_throughput.py $W $P --steps 30
    left=$((570 - SECONDS))
    [ $left -gt 60 ] && run train_fsdp2 timeout $left torchrun --standalone --nproc-per-node 2 \
      bench/train_throughput.py $W $P --steps 30 --dist fsdp ;;
esac
collect
