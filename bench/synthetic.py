"""Synthetic inputs for the training benchmarks, at real model dimensions, written in the real formats.

- a *head-only verifier*: a Llama ``config.json`` with the target's dimensions and a ``model.safetensors`` holding
  only ``model.embed_tokens.weight``, ``lm_head.weight`` and ``model.norm.weight`` (random). Offline training
  reads nothing else from a verifier; speculators' trainer reads the same three tensors.
- eyas feature shards (:mod:`eyas.data.features`, random bf16 states, rows of fixed length with a prompt prefix
  outside the loss mask) and their manifest, as ``eyas extract`` would write them;
- a draft vocab (``d2t.npy``/``t2d.npy``) of random target ids.

Everything is seeded, so two benchmark commands on the same machine build identical inputs (and reuse them).
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch


@dataclass(frozen=True)
class Dims:
    hidden: int
    layers: int
    heads: int
    kv_heads: int
    head_dim: int
    intermediate: int
    vocab: int
    draft_vocab: int
    rope_theta: float = 500000.0


#: Llama-3.1-8B and Kimi-K2.5 (its DeepseekV3 text model: the draft gets plain GQA 64/8, head_dim 7168/64)
PRESETS = {
    "llama8b": Dims(
        hidden=4096, layers=32, heads=32, kv_heads=8, head_dim=128, intermediate=14336, vocab=128256, draft_vocab=32000
    ),  # fmt: skip
    "kimi": Dims(
        hidden=7168,
        layers=61,
        heads=64,
        kv_heads=8,
        head_dim=112,
        intermediate=18432,
        vocab=163840,
        draft_vocab=32000,
        rope_theta=50000.0,
    ),  # fmt: skip
    "smoke": Dims(hidden=64, layers=8, heads=4, kv_heads=2, head_dim=16, intermediate=128, vocab=512, draft_vocab=256),
}


def _done(path: Path) -> bool:
    return (path / ".complete").is_file()


def head_only_verifier(path: Path, d: Dims, *, seed: int = 0) -> Path:
    from safetensors.torch import save_file

    if _done(path):
        return path
    path.mkdir(parents=True, exist_ok=True)
    g = torch.Generator().manual_seed(seed)
    cfg = {
        "architectures": ["LlamaForCausalLM"], "model_type": "llama", "hidden_size": d.hidden,
        "num_hidden_layers": d.layers, "num_attention_heads": d.heads, "num_key_value_heads": d.kv_heads,
        "head_dim": d.head_dim, "intermediate_size": d.intermediate, "vocab_size": d.vocab, "rms_norm_eps": 1e-5,
        "rope_theta": d.rope_theta, "max_position_embeddings": 131072, "hidden_act": "silu",
        "tie_word_embeddings": False, "torch_dtype": "bfloat16", "bos_token_id": 1, "eos_token_id": 2,
        "initializer_range": 0.02,
    }  # fmt: skip
    (path / "config.json").write_text(json.dumps(cfg, indent=2))
    tensors = {
        "model.embed_tokens.weight": (torch.randn(d.vocab, d.hidden, generator=g) * 0.02).bfloat16(),
        "lm_head.weight": (torch.randn(d.vocab, d.hidden, generator=g) * 0.02).bfloat16(),
        "model.norm.weight": (1 + 0.1 * torch.randn(d.hidden, generator=g)).bfloat16(),
    }
    save_file(tensors, str(path / "model.safetensors"), metadata={"format": "pt"})
    (path / ".complete").write_text("")
    return path


def draft_vocab(path: Path, d: Dims, *, seed: int = 0) -> Path:
    if _done(path):
        return path
    path.mkdir(parents=True, exist_ok=True)
    used = np.sort(np.random.default_rng(seed).permutation(d.vocab)[: d.draft_vocab])
    np.save(path / "d2t.npy", (used - np.arange(d.draft_vocab)).astype(np.int64))
    t2d = np.zeros(d.vocab, dtype=bool)
    t2d[used] = True
    np.save(path / "t2d.npy", t2d)
    (path / "manifest.json").write_text(json.dumps({"stage": "vocab", "synthetic": True}))
    (path / ".complete").write_text("")
    return path


def features(path: Path, verifier: Path, d: Dims, *, rows: int, seq_len: int, prompt: int = 64, seed: int = 0,
             shard_rows: int = 16) -> Path:  # fmt: skip
    """``rows`` rows of ``seq_len`` tokens; the first ``prompt`` tokens of each are outside the loss mask (an eighth
    of the row when ``prompt`` would leave no answer: the smoke runs' 64-token rows)."""
    from eyas.data.features import FORMAT, shard_tensors, write_shard
    from eyas.core.manifest import write_manifest
    from eyas.verifier.info import default_aux_layer_ids, fingerprint, resolve

    if _done(path):
        return path
    path.mkdir(parents=True, exist_ok=True)
    info = resolve(verifier)
    layer_ids = default_aux_layer_ids(d.layers)
    g = torch.Generator().manual_seed(seed)
    shards = []
    for start in range(0, rows, shard_rows):
        end = min(start + shard_rows, rows)
        ids, masks, states = [], [], []
        for _ in range(start, end):
            ids.append(torch.randint(3, d.vocab, (seq_len,), generator=g))
            masks.append(torch.arange(seq_len) >= (prompt if prompt < seq_len else seq_len // 8))
            states.append(torch.randn(seq_len, 4, d.hidden, generator=g).bfloat16())  # [T, 4, H]
        shards.append(write_shard(path, start=start, end=end, tensors=shard_tensors(ids, masks, states),
                                  layer_ids=layer_ids))  # fmt: skip
    tokens = rows * seq_len
    nbytes = sum(s["bytes"] for s in shards)
    write_manifest(path, stage="extract", inputs={"verifier": fingerprint(info), "data": {"synthetic": seed}},
                   settings={"format": FORMAT, "layer_ids": layer_ids, "dtype": "bf16"},
                   outputs={"rows": rows, "tokens": tokens, "bytes": nbytes, "shards": shards}, format=FORMAT,
                   layer_ids=layer_ids, last_hidden_normed=False, dtype="bf16", hidden_size=d.hidden, num_rows=rows,
                   verifier_path=str(verifier), data_path="synthetic")  # fmt: skip
    (path / ".complete").write_text("")
    return path


def features_dir(workdir: Path, preset: str, *, rows: int, seq_len: int, prompt: int = 64) -> Path:
    """Where :func:`inputs` writes a preset's features (``.complete`` inside once they are whole)."""
    return workdir / preset / (f"features-{rows}x{seq_len}" + (f"-p{prompt}" if prompt != 64 else ""))


def inputs(workdir: Path, preset: str, *, rows: int, seq_len: int, prompt: int = 64) -> dict[str, Path]:
    """The verifier, vocab and features for a preset under ``workdir`` (built once, then reused); ``prompt``: the
    tokens at the start of each row outside the loss mask."""
    d = PRESETS[preset]
    root = workdir / preset
    verifier = head_only_verifier(root / "verifier", d)
    return {
        "verifier": verifier,
        "vocab": draft_vocab(root / "vocab", d),
        "features": features(
            features_dir(workdir, preset, rows=rows, seq_len=seq_len, prompt=prompt),
            verifier,
            d,
            rows=rows,
            seq_len=seq_len,
            prompt=prompt,
        ),
        "dims": d,
    }
