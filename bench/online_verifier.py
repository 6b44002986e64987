"""The online trainer's verifier forward, three ways on the same micro-batches: tokens/s and whether they agree.

`eyas train --online` runs the verifier on every micro-batch for its hidden states. Its rows have very different
lengths (SmolLM2's regenerated answers: 368 tokens on average, some 2,000), so how they are batched decides how
much padding the forward computes on:

- ``one_batch``: every row right-padded to the micro-batch's longest (4.2x the real tokens on those answers);
- ``grouped``: the trainer's fallback and check (``StepData._verifier_rows``): longest first, in groups of at most a
  micro-batch's tokens, each padded to its own longest row (1.9x);
- ``packed``: the packed ``[B, S]`` sequences themselves, rows side by side, with each row's positions starting
  at 0 and no attention mask, so transformers' masks keep every row to itself (its packed-sequence detection
  from ``position_ids``, ``transformers.masking_utils.find_packed_sequence_indices``): what the trainer runs
  (``Trainer._packed_states``); no padding, one forward,
  but attention over whole sequences under a block-diagonal mask;
- ``grouped_compiled``: the trainer's groups through the verifier's decoder layers compiled with symbolic shapes
  (``eyas.verifier.compile.compiled_layers(dynamic=True)``, the regional compile the engine's prefills use): a
  small verifier's eager forward is bound by its element-wise kernels (RMSNorm, RoPE, SiLU in several passes
  each), which the compiled layers fuse. Its compile is the warm-up micro-batch's;
- ``packed_compiled``: ``packed`` through the compiled layers, what ``eyas train --online`` runs by default
  (``--verifier-attention sdpa``): SDPA under the dense block-diagonal mask, every sequence's whole length of
  keys for every query (the recipe's rows average about 320 tokens in sequences of 2,048);
- ``packed_flex_compiled``: the same with transformers' ``flex_attention`` implementation (``--verifier-attention
  flex``): the mask as a ``BlockMask``, so the attention reads only the key blocks a query's row shares with it.

Each way's states on the real tokens are compared with ``one_batch``'s (max relative difference); tokens/s
counts real tokens over the forward's wall time (device synced), the first micro-batch left out as warm-up.
Prints one JSON line.

    PYTHONPATH=src python3 bench/online_verifier.py --verifier random-smollm2 --micro-batches 40   # GPU, synthetic
    PYTHONPATH=src python3 bench/online_verifier.py --verifier V --data PREPARED                   # real rows
    PYTHONPATH=src python3 bench/online_verifier.py --smoke                                        # CPU check
"""

from __future__ import annotations

import argparse
import contextlib
import json
import shutil
import sys
import tempfile
import time
from pathlib import Path

import numpy as np
import torch

try:
    import eyas  # noqa: F401
except ImportError:  # run from a checkout without installing
    sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "src"))
sys.path.insert(0, str(Path(__file__).resolve().parent))

from extract_throughput import random_smollm2, synthetic_rows, tiny_verifier  # noqa: E402

from eyas.training.batches import PreparedRows, Row, StepData, plan_epoch  # noqa: E402
from eyas.verifier.info import default_aux_layer_ids  # noqa: E402
from eyas.verifier.compile import run_dynamic  # noqa: E402
from eyas.verifier.load import build_text_model, forward_hidden_states, resolve  # noqa: E402


class _Synthetic:
    """Synthetic rows (``extract_throughput.synthetic_rows``) as the trainer's online row source."""

    online = True

    def __init__(self, rows) -> None:
        self.rows, self.lengths = rows, np.asarray(rows.lengths)

    def row(self, i: int) -> Row:
        ids, mask = self.rows.fetch(i, i + 1)[0]
        return Row(torch.as_tensor(ids, dtype=torch.long), torch.as_tensor(mask, dtype=torch.bool))


def _states(model, ids, layer_ids, **kw) -> torch.Tensor:
    aux, last = forward_hidden_states(model, ids, layer_ids=layer_ids, **kw)
    return torch.cat([aux, last], -1)  # [rows, T, 4H]


@contextlib.contextmanager
def attention_implementation(model, name: str):
    """``model`` attending through transformers' implementation ``name`` inside the block."""
    before = model.config._attn_implementation
    model.set_attn_implementation(name)
    try:
        yield
    finally:
        model.set_attn_implementation(before)


def run_way(model, mb: dict[str, torch.Tensor], layer_ids: list[int], device: torch.device, way: str) -> torch.Tensor:
    """One way's states of the micro-batch's real tokens, in the packed batch's order (by ``dst``): ``[N, 4H]``."""
    ids, attn, src, dst = (mb[k].to(device) for k in ("row_ids", "row_attn", "src", "dst"))
    order = torch.argsort(dst)
    if way == "one_batch":  # every row padded to the longest: row n's tokens are [n, :L_n] of the output
        full = _states(model, ids, layer_ids, attention_mask=attn)  # [n, Lmax, 4H]
        rows, cols = torch.nonzero(attn, as_tuple=True)  # row-major: the rows in group order, as src lists them
        return full[rows, cols][order]
    if way.startswith("grouped"):
        parts = [_states(model, ids[s:e, :w], layer_ids, attention_mask=attn[s:e, :w]).flatten(0, 1)
                 for s, e, w in mb["row_groups"].tolist()]  # fmt: skip
        return torch.cat(parts)[src][order]
    B, S = mb["input_ids"].shape
    packed = _states(model, mb["input_ids"].to(device), layer_ids, position_ids=mb["position_ids"].to(device))
    return packed.reshape(B * S, -1)[dst][order]  # [B, S, 4H] -> the real tokens


def main(argv: list[str] | None = None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--verifier", default="random-smollm2", help="a checkpoint, or random-smollm2")
    ap.add_argument("--data", help="an `eyas prepare` output (default: synthetic ShareGPT-like rows)")
    ap.add_argument("--rows", type=int, default=8000, help="synthetic rows")
    ap.add_argument("--median-len", type=int, default=300, help="synthetic rows' median length")
    ap.add_argument("--max-seq-len", type=int, default=2048)
    ap.add_argument("--batch-tokens", type=int, default=32768, help="tokens a micro-batch (the recipe's)")
    ap.add_argument("--micro-batches", type=int, default=40)
    ap.add_argument("--device")
    ap.add_argument("--smoke", action="store_true", help="CPU, tiny random Llama, few rows: checks the script runs")
    a = ap.parse_args(argv)
    tmp = Path(tempfile.mkdtemp(prefix="eyas-bench-"))
    try:
        if a.smoke:
            a.verifier, a.device, a.rows, a.median_len, a.max_seq_len, a.batch_tokens, a.micro_batches = (
                str(tiny_verifier(tmp / "tiny")), "cpu", 64, 40, 128, 512, 3)  # fmt: skip
        if a.verifier == "random-smollm2":
            a.verifier = str(random_smollm2(tmp / "random-smollm2"))
        device = torch.device(a.device or ("cuda" if torch.cuda.is_available() else "cpu"))
        info = resolve(a.verifier)
        dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
        model = build_text_model(info, dtype=dtype, device=device)
        layer_ids = default_aux_layer_ids(info.num_hidden_layers)
        if a.data:
            source = PreparedRows(a.data)
            lengths = np.minimum(source.lengths, a.max_seq_len)
        else:
            source = _Synthetic(synthetic_rows(a.rows, info.vocab_size, median=a.median_len, max_len=a.max_seq_len))
            lengths = source.lengths
        n, seqs = len(lengths), a.batch_tokens // a.max_seq_len
        plan = plan_epoch(np.arange(n), lengths, np.zeros((n, 1), np.int64), seed=0, epoch=0, shuffle=True,
                          max_len=a.max_seq_len, seqs_per_micro_batch=seqs, micro_batches_per_step=1)  # fmt: skip
        data = StepData(source, plan, rank=0, grad_accum=1, max_len=a.max_seq_len, seqs=seqs, lengths=lengths)
        picks = list(range(min(a.micro_batches + 1, len(plan))))  # the first: warm-up
        seconds = dict.fromkeys(("one_batch", "grouped", "packed", "grouped_compiled", "packed_compiled",
                                 "packed_flex_compiled"), 0.0)  # fmt: skip
        worst = dict.fromkeys(list(seconds)[1:], 0.0)
        compiles = {w: True for w in seconds if w.endswith("_compiled")}  # until a compiler error says otherwise
        real = 0
        for j in picks:
            mb = data[j]["micro_batches"][0]
            got, t = {}, {}
            for way in seconds:  # timed one at a time: each way's forwards alone between two syncs
                if device.type == "cuda":
                    torch.cuda.synchronize(device)
                t0 = time.perf_counter()
                flex = way == "packed_flex_compiled"
                with attention_implementation(model, "flex_attention") if flex else contextlib.nullcontext():
                    if way in compiles:  # as the trainer runs it: eagerly after a compiler error
                        got[way], compiles[way] = run_dynamic(
                            model, lambda: run_way(model, mb, layer_ids, device, way), compile=compiles[way],
                            what=f"the {way} forwards")  # fmt: skip
                    else:
                        got[way] = run_way(model, mb, layer_ids, device, way)
                if device.type == "cuda":
                    torch.cuda.synchronize(device)
                t[way] = time.perf_counter() - t0
            ref = got["one_batch"].float()
            for way in worst:
                diff = (got[way].float() - ref).abs().max() / ref.abs().max().clamp_min(1e-12)
                worst[way] = max(worst[way], float(diff))
            if j:  # the first micro-batch compiles kernels and plans: left out
                real += int(mb["row_attn"].sum())
                for way in seconds:
                    seconds[way] += t[way]
        res = {"bench": "online-verifier", "verifier": a.verifier if not a.smoke else "tiny", "data": a.data or "synthetic",
               "device": torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu", "dtype": str(dtype),
               "micro_batches": len(picks) - 1, "real_tokens": real,
               "tokens_per_s": {w: round(real / s) if s else None for w, s in seconds.items()},
               "max_rel_diff_vs_one_batch": {w: round(v, 6) for w, v in worst.items()},
               "compiled": compiles,
               "torch": torch.__version__, "smoke": a.smoke}  # fmt: skip
        print(json.dumps(res), flush=True)
        return res
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


if __name__ == "__main__":
    main()
