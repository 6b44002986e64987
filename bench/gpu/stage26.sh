#!/usr/bin/env bash
# GPU stage 26 (kind nvidia-h200-x2, no carry), written in the seventh session for a session that is lent the
# two-GPU kind: DDP with the frozen embedding really in host memory (--loader-embeddings, the default; until the
# seventh session's fix the trainer had copied it to the device anyway, so DDP never saw a host parameter), in
# speculators' setting, against one GPU on the same rows; each rank's peak should sit about 1 GiB under stage 9's.
source bench/gpu/common.sh
W="--workdir /tmp/eb"; M="--freeze-lm-head --no-full-vocab-accuracy"
python3 -c "import sys; sys.path.insert(0, 'bench'); import synthetic; from pathlib import Path
synthetic.inputs(Path('/tmp/eb'), 'llama8b', rows=62, seq_len=2048)"
run train_1gpu timeout 150 env CUDA_VISIBLE_DEVICES=0 python3 bench/train_throughput.py $W --preset llama8b --steps 60 $M
run train_ddp2 timeout 200 torchrun --standalone --nproc-per-node 2 bench/train_throughput.py $W --preset llama8b --steps 30 $M
cd $OUT && cat *.jsonl > results.jsonl && for f in *.err; do echo "=== $f"; tail -c 2500 $f; done > errs.txt
rm -f *.err $(ls *.jsonl | grep -v results.jsonl); cat status.txt
