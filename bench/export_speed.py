"""How much `eyas export` costs beyond moving the bytes, on a draft of real size.

A Llama-3.1-8B-shaped EAGLE-3 draft (H 4096, 32 heads / 8 KV, MLP 14336, verifier vocab 128256, draft vocab
32000; ~0.85 GB in bf16 without the embedding) is written once in the native layout. Then, each in a fresh
process so peak memory is its own:

- baseline: safetensors load_file + save_file of the same file (the bytes moved, no checks);
- to_eagle: `eyas export --format eagle` (checks, rename, write, read back, hashes, manifest);
- from_eagle: `eyas export --from eagle` back to the native layout.

Prints wall time and peak RSS of each, and their ratios to the baseline.

    .venv/bin/python bench/export_speed.py [--workdir DIR]
"""

from __future__ import annotations

import argparse
import json
import resource
import subprocess
import sys
import tempfile
import time
from pathlib import Path


def make_draft(path: Path) -> int:
    import torch

    from eyas.draft.checkpoint import expected_shapes, save_tensors
    from eyas.draft.model import DraftConfig

    cfg = DraftConfig(hidden_size=4096, intermediate_size=14336, num_attention_heads=32, num_key_value_heads=8,
                      head_dim=128, vocab_size=128256, draft_vocab_size=32000, aux_layer_ids=[2, 16, 29],
                      rope_parameters={"rope_type": "default", "rope_theta": 500000.0},
                      max_position_embeddings=131072, rms_norm_eps=1e-5)  # fmt: skip
    g = torch.Generator().manual_seed(0)
    tensors = {}
    for key, shape in expected_shapes(cfg).items():
        if key in ("embed_tokens.weight", "d2t", "t2d"):
            continue
        tensors[key] = (torch.randn(shape, generator=g) * 0.02).to(torch.bfloat16)
    ids = torch.randperm(cfg.vocab_size, generator=g)[: cfg.draft_vocab_size].sort().values
    tensors["d2t"] = ids - torch.arange(cfg.draft_vocab_size)
    tensors["t2d"] = torch.zeros(cfg.vocab_size, dtype=torch.bool)
    tensors["t2d"][ids] = True
    save_tensors(path, cfg, tensors, verifier_name_or_path="meta-llama/Llama-3.1-8B-Instruct",
                 verifier_architectures=["LlamaForCausalLM"], speculative_tokens=3)  # fmt: skip
    return (path / "model.safetensors").stat().st_size


def step(name: str, work: Path) -> None:
    t = time.perf_counter()
    if name == "baseline":
        from safetensors.torch import load_file, save_file

        save_file(load_file(str(work / "native" / "model.safetensors")), str(work / "copy.safetensors"))
    else:
        from eyas.stages.export import export

        if name == "to_eagle":
            export(draft=str(work / "native"), out=str(work / "eagle"), format="eagle")
        else:
            export(draft=str(work / "eagle"), out=str(work / "back"), from_format="eagle",
                   verifier_name="meta-llama/Llama-3.1-8B-Instruct")  # fmt: skip
    seconds = time.perf_counter() - t
    rss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
    print(json.dumps({"step": name, "seconds": seconds, "peak_rss": rss}))


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--workdir")
    ap.add_argument("--step")
    args = ap.parse_args()
    work = Path(args.workdir or tempfile.mkdtemp(prefix="eyas-export-bench-"))
    if args.step:
        step(args.step, work)
        return
    size = make_draft(work / "native")
    print(f"draft: {size / 2**30:.2f} GiB in bf16 at {work}")
    results = {}
    for name in ("baseline", "to_eagle", "from_eagle"):
        r = subprocess.run([sys.executable, __file__, "--workdir", str(work), "--step", name],
                           capture_output=True, text=True, check=True)  # fmt: skip
        results[name] = json.loads(r.stdout.strip().splitlines()[-1])
    base = results["baseline"]
    for name, r in results.items():
        print(f"{name:>10}: {r['seconds']:7.2f} s ({r['seconds'] / base['seconds']:.2f}x baseline), peak RSS "
              f"{r['peak_rss'] / 2**30:.2f} GiB ({r['peak_rss'] / base['peak_rss']:.2f}x baseline)")  # fmt: skip
    same = (work / "native" / "model.safetensors").read_bytes() == (work / "back" / "model.safetensors").read_bytes()
    print(f"native -> eagle -> native is byte-identical: {same}")


if __name__ == "__main__":
    main()
