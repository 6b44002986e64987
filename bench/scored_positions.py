"""How much of the fused loss' work a prepared dataset lets `eyas train` skip: the share of positions some TTT
step scores (the rest are prompts and packing padding), and the share of loss rows that still run once the
scored positions are padded to whole chunks (``eyas.training.loss.scored_rows``), for a few packings and chunk sizes;
and the share of positions the verifier's head still runs on for the targets (``eyas.training.loss.target_rows``);
and, online, the tokens the verifier's forwards compute on against the real ones: each row right-padded in groups of
similar lengths (``StepData``'s ``row_groups``), against all of a micro-batch's rows padded to its longest.

    python bench/scored_positions.py --data PREPARED        # an `eyas prepare` output; one JSON line per setting
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "src"))


def main(argv: list[str] | None = None) -> list[dict]:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--data", required=True, help="an `eyas prepare` output directory")
    p.add_argument("--ttt-steps", type=int, default=3)
    p.add_argument("--settings", nargs="+", default=["2048:2048", "2048:16384", "4096:16384"],
                   help="max_seq_len:batch_tokens pairs")  # fmt: skip
    p.add_argument("--chunks", type=int, nargs="+", default=[1024, 512, 256])
    p.add_argument("--samples", type=int, default=60, help="micro-batches read per setting (spread over the epoch)")
    a = p.parse_args(argv)

    import numpy as np

    from eyas.training.batches import PreparedRows, StepData, plan_epoch
    from eyas.training.loss import step_masks

    src = PreparedRows(a.data)
    n = len(src)
    results = []
    for setting in a.settings:
        max_len, batch = map(int, setting.split(":"))
        lengths = np.minimum(src.lengths, max_len)
        plan = plan_epoch(np.arange(n), lengths, np.zeros((n, a.ttt_steps), np.int64), seed=0, epoch=0, shuffle=True,
                          max_len=max_len, seqs_per_micro_batch=batch // max_len, micro_batches_per_step=1)  # fmt: skip
        picks = range(0, len(plan), max(1, len(plan) // a.samples))
        for chunk in a.chunks:
            data = StepData(src, plan, rank=0, grad_accum=1, max_len=max_len, seqs=batch // max_len,
                            lengths=lengths, ttt_steps=a.ttt_steps, chunk=chunk)  # fmt: skip
            total = scored = run = positions = heads = real = grouped = one_batch = calls = 0
            for j in picks:
                mb = data[j]["micro_batches"][0]
                M = mb["loss_mask"].numel()
                padded = -(-M // chunk) * chunk  # what the loss runs without skipping
                total += padded
                scored += int(step_masks(mb["loss_mask"], mb["doc_ids"], a.ttt_steps).any(0).sum())
                run += mb["scored_rows"].numel() if "scored_rows" in mb else padded
                positions += M
                heads += mb["target_rows"].numel() if "target_rows" in mb else M
                real += int(mb["row_attn"].sum())
                grouped += sum((end - start) * width for start, end, width in mb["row_groups"].tolist())
                one_batch += mb["row_ids"].shape[0] * int(mb["row_groups"][0, 2]) if len(mb["row_groups"]) else 0
                calls += len(mb["row_groups"])
            res = {"bench": "scored-positions", "data": str(a.data), "max_seq_len": max_len, "batch_tokens": batch,
                   "chunk": chunk, "micro_batches": len(picks), "scored_share": round(scored / total, 3),
                   "loss_rows_share": round(run / total, 3),
                   "target_rows_share": round(heads / positions, 3),
                   "verifier_padding_grouped": round(grouped / max(real, 1), 3),
                   "verifier_padding_one_batch": round(one_batch / max(real, 1), 3),
                   "verifier_forwards_per_micro_batch": round(calls / len(picks), 2)}  # fmt: skip
            results.append(res)
            print(json.dumps(res), flush=True)
    return results


if __name__ == "__main__":
    main()
