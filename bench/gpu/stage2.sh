#!/usr/bin/env bash
# GPU stage 2 (carry .carry/smol.part01 .whl), right after stage 1 on the same machine: join SmolLM2; GPU 0 runs
# the SmolLM2 pipeline (extract throughput, online training of a 32k-vocab draft on 2,000 ShareGPT conversations,
# speculative decoding speedup with it); GPU 1 runs speculators 0.9.0's trainer on the stage-1 inputs.
source bench/gpu/common.sh
cat $G/smol.part00 .carry/smol.part01 > $GGUF && rm $G/smol.part00
echo "b179c9523d0e6a0f98a330c7562b682750a6f8c8c15e5bc70ea373728110db53  $GGUF" | sha256sum -c | tee $OUT/status.txt
python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/site .whl/*.whl
( export CUDA_VISIBLE_DEVICES=0
  run extract python3 bench/extract_throughput.py --verifier $GGUF --rows 2000 --out /dev/shm/eyas-x
  run train_smol python3 -m eyas.cli train --online --verifier $GGUF --data $G/smol-prep --vocab $G/smol-vocab \
      --out $G/draft --epochs 3 --lr 3e-4 --batch-tokens 32768 --max-seq-len 2048 --val-ratio 0.02 \
      --verifier-name HuggingFaceTB/SmolLM2-135M-Instruct
  cp $G/draft/metrics.jsonl $OUT/smol_metrics.jsonl; cp $G/draft/training_curves.png $OUT/ 2>/dev/null
  run eval_smol python3 bench/eval_speedup.py --verifier $GGUF --draft $G/draft --prompts $G/mt_bench_question.jsonl \
      --num-prompts 6 --max-new-tokens 256 --modes reduce-overhead ) &
( export CUDA_VISIBLE_DEVICES=1
  run spec_llama8b_matched python3 bench/speculators_train.py --preset llama8b --steps 50 --mode matched
  run spec_llama8b_defaults python3 bench/speculators_train.py --preset llama8b --steps 50 --mode defaults
  run spec_kimi_matched python3 bench/speculators_train.py --preset kimi --steps 40 --mode matched ) &
wait
(cd $G/draft && tar cf - config.json model.safetensors | split -b 15000000 -d - $OUT/draft.tar.)
cat $OUT/status.txt
