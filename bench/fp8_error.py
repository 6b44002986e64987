"""What fp8 feature storage costs in accuracy: relative error of each token's stored state, per-(row, layer)
scale (what `eyas extract --dtype fp8` writes) against a per-token scale and bf16.

    PYTHONPATH=src python3 bench/fp8_error.py [--verifier smollm2] [--device cpu]

Runs the verifier (fp32) on a few chat rows rendered with its own template, captures the aux and last states
through `eyas.stages.extract.Extractor` and prints one JSON line per layer: median / max relative error
(|q - x| / |x| over each token's H-vector) for the three encodings, and the position-0 token's amax relative to
the median token's (the "massive activation" that a per-row scale must cover).
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
from pathlib import Path

import torch

try:
    import eyas  # noqa: F401
except ImportError:
    sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "src"))

from eyas.stages.extract import Extractor, InMemoryRows, plan_shards, plan_windows
from eyas.verifier.info import check_aux_layer_ids as check_layer_ids
from eyas.data.features import fp8_decode, fp8_encode, fp8_scale
from eyas.verifier.load import build_text_model, load_tokenizer, resolve

CHATS = [
    ("Explain speculative decoding and why a small draft model speeds up a large one.",
     "A draft model proposes several tokens; the large verifier checks them all in one forward pass and keeps "
     "the longest prefix it agrees with, so each expensive pass yields more than one token."),
    ("Write a Python function that returns the n-th Fibonacci number.",
     "def fib(n):\n    a, b = 0, 1\n    for _ in range(n):\n        a, b = b, a + b\n    return a"),
    ("What is the capital of Australia, and why is it not Sydney?",
     "Canberra. It was chosen in 1908 as a compromise between Sydney and Melbourne, the two largest cities."),
]  # fmt: skip


def rel(q: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
    return (q - x).norm(dim=-1) / x.norm(dim=-1).clamp_min(1e-12)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--verifier", default="smollm2")
    ap.add_argument("--device", default="cpu")
    args = ap.parse_args()
    info = resolve(args.verifier)
    tok = load_tokenizer(info)
    rows = []
    for user, answer in CHATS:
        msgs = [{"role": "user", "content": user}, {"role": "assistant", "content": answer}]
        ids = tok.apply_chat_template(msgs, tokenize=True, return_dict=True)["input_ids"]
        rows.append((ids, [1] * len(ids)))
    source = InMemoryRows(rows)
    model = build_text_model(info, dtype=torch.float32, device=args.device)
    layers = check_layer_ids(info.aux_layer_ids, info.num_hidden_layers)
    with tempfile.TemporaryDirectory() as tmp:
        Extractor(model, layer_ids=layers, dtype="fp32", batch_tokens=1).run(
            source, plan_windows(plan_shards(source.lengths, 10**9)), tmp, progress=False
        )
        from safetensors.torch import load_file  # one fp32 shard, no manifest: read it directly

        shard = load_file(next(Path(tmp).glob("rows_*.safetensors")))
    cu = shard["cu_seqlens"].tolist()
    states = [shard["hidden_states"][a:b] for a, b in zip(cu, cu[1:])]  # each [T, 4, H]
    names = [str(i) for i in layers] + ["last"]
    for k, name in enumerate(names):
        errs = {"row": [], "token": [], "bf16": []}
        ratio = []
        for x in states:
            x = x[:, k]  # [T, H]
            s_row = fp8_scale(x.abs().amax())
            errs["row"].append(rel(fp8_decode(fp8_encode(x, s_row), s_row), x))
            s_tok = fp8_scale(x.abs().amax(-1, keepdim=True))
            errs["token"].append(rel(fp8_decode(fp8_encode(x, s_tok), s_tok), x))
            errs["bf16"].append(rel(x.to(torch.bfloat16).float(), x))
            amax = x.abs().amax(-1)
            ratio.append((amax[0] / amax.median()).item())
        out = {"layer": name, "position0_amax_over_median": round(max(ratio), 1)}
        for key, v in errs.items():
            v = torch.cat(v)
            out[f"{key}_median"] = round(v.median().item(), 4)
            out[f"{key}_max"] = round(v.max().item(), 4)
        print(json.dumps(out))


if __name__ == "__main__":
    main()
