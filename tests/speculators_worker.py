"""Runs speculators 0.9.0 itself, in its own process, for tests/e2e/test_speculators_crosscheck.py.

Started with ``PYTHONPATH=<the dir make setup installed speculators into>`` so speculators' pinned
transformers (<=5.19) and its pydantic registry never enter the test process. It never imports eyas: every
number it returns comes from speculators' own classes and code paths.

Usage: ``python speculators_worker.py JOBS.json`` where the file holds a list of jobs; each job's result is
printed as one JSON line. Jobs:

- ``{"cmd": "make", "out", "verifier", "draft_vocab_size", "layout": {...}, "sliding_window", "seed",
  "arch", "num_layers"}``: build a tiny random draft with speculators' trainer factory
  (``Eagle3DraftModel.from_training_args``) over a Llama or Qwen3 decoder config (its ``--draft-arch``) of
  ``num_layers`` layers (its ``--num-layers``; default 1), and save it with ``save_pretrained``.
- ``{"cmd": "convert", "eagle", "verifier", "out", "aux_layer_ids"}``: speculators' own EAGLE-3 converter.
- ``{"cmd": "logits", "draft", "inputs", "out", "steps"}``: load a draft with
  ``Eagle3DraftModel.from_pretrained`` and record the draft logits of each TTT step (the output of its
  ``lm_head``) for the ids and aux hidden states in ``inputs``.
"""

from __future__ import annotations

import importlib.metadata
import json
import sys
import warnings

import torch
from safetensors import safe_open
from safetensors.torch import load_file, save_file


def make(job: dict) -> dict:
    from transformers import AutoConfig, LlamaConfig, Qwen3Config

    from speculators.models.eagle3 import Eagle3DraftModel
    from speculators.train.vocab_mapping import build_vocab_mappings_from_distribution

    torch.manual_seed(job["seed"])
    vcfg = AutoConfig.from_pretrained(job["verifier"])
    window = job.get("sliding_window")
    # The decoder config speculators' CLI builds (train/cli.py create_transformer_layer_config): the verifier's
    # shape, --num-layers layers, sliding unless listed in --full-attention-indices, --draft-arch's class.
    n = job.get("num_layers", 1)
    layer_types = ["sliding_attention" if window else "full_attention"] * n
    config_class = {"llama": LlamaConfig, "qwen3": Qwen3Config}[job.get("arch", "llama")]
    draft_layer = config_class(
        vocab_size=vcfg.vocab_size, hidden_size=vcfg.hidden_size, intermediate_size=vcfg.intermediate_size,
        num_hidden_layers=n, num_attention_heads=vcfg.num_attention_heads,
        num_key_value_heads=vcfg.num_key_value_heads, hidden_act=vcfg.hidden_act,
        max_position_embeddings=vcfg.max_position_embeddings, initializer_range=vcfg.initializer_range,
        rms_norm_eps=vcfg.rms_norm_eps, tie_word_embeddings=False, sliding_window=window or 2048,
        use_sliding_window=bool(window), layer_types=layer_types,
        head_dim=vcfg.hidden_size // vcfg.num_attention_heads,
    )  # fmt: skip
    # A token-frequency table with ties and fewer distinct tokens than the draft vocab, so speculators'
    # tie-breaking and padding rules shape d2t/t2d (train/vocab_mapping.py).
    g = torch.Generator().manual_seed(job["seed"])
    seen = torch.randperm(vcfg.vocab_size, generator=g)[: job["draft_vocab_size"] * 3 // 4]
    freq = {int(t): int(c) for t, c in zip(seen, torch.randint(1, 6, (len(seen),), generator=g))}
    d2t, t2d = build_vocab_mappings_from_distribution(freq, job["draft_vocab_size"], vcfg.vocab_size)
    layout = job["layout"]
    m = Eagle3DraftModel.from_training_args(
        draft_layer, t2d=t2d, d2t=d2t, verifier_name_or_path=job["verifier"],
        draft_vocab_size=job["draft_vocab_size"], ttt_steps=3, draft_attn_impl="eager", **layout,
    )  # fmt: skip
    with torch.no_grad():
        for name, p in m.named_parameters():
            if name.startswith(("verifier_", "embed_tokens")):
                continue
            if name.endswith("norm.weight") or name.startswith("fc_norm"):
                p.copy_(1.0 + 0.1 * torch.randn_like(p))  # not all-ones: a misplaced norm must show
            else:
                p.normal_(0.0, 0.05)
            p.copy_(p.to(torch.bfloat16).float())  # exactly representable in the bf16 eyas writes
    m.save_pretrained(job["out"])
    return {"saved": job["out"], "flags": {k: getattr(m.config, k) for k in layout}}


def convert(job: dict) -> dict:
    from speculators.convert.entrypoints import convert_model

    convert_model(model=job["eagle"], verifier=job["verifier"], algorithm="eagle3", output_path=job["out"],
                  eagle_aux_hidden_state_layer_ids=job["aux_layer_ids"])  # fmt: skip
    return {"saved": job["out"]}


def logits(job: dict) -> dict:
    from speculators.models.eagle3 import Eagle3DraftModel, Eagle3SpeculatorConfig

    cfg = Eagle3SpeculatorConfig.from_pretrained(job["draft"])
    # speculators forces flex attention when none is set (models/eagle3/core.py __init__); flex needs CUDA for
    # these lengths, so ask for its eager path, as its trainer's draft_attn_impl="eager" does.
    cfg.transformer_layer_config._attn_implementation = "eager"
    m = Eagle3DraftModel.from_pretrained(job["draft"], config=cfg, dtype=torch.float32).eval()
    with safe_open(f"{job['draft']}/model.safetensors", framework="pt") as f:
        has_embed = "embed_tokens.weight" in f.keys()
    if not has_embed:
        # speculators marks embed_tokens "not loaded" by filling it with NaN in __init__ (model.py
        # DraftVocabMixin._init_vocab) and copies the verifier's only where it is still NaN
        # (_load_verifier_weights). transformers 5 builds the model on the meta device and materialises a
        # missing weight with uninitialised memory, so the NaN marker is usually gone and the embedding is
        # garbage. Ask speculators' own loader to copy the verifier's embedding explicitly.
        m._load_verifier_weights(overwrite_embed_tokens=True)
    x = load_file(job["inputs"])
    ids, aux = x["input_ids"], x["aux_hidden"]
    T = ids.shape[1]
    captured = []
    hook = m.lm_head.register_forward_hook(lambda mod, inp, out: captured.append(out.detach().clone()))
    with torch.no_grad(), warnings.catch_warnings():
        warnings.simplefilter("ignore")
        # speculators' shift_batch pairing (models/eagle3/data.py): slot t holds token x_{t+1} and aux_t.
        m(aux[:, :-1], ids[:, 1:], torch.zeros(1, T - 1, dtype=torch.long), ttt_steps=job["steps"])
    hook.remove()
    save_file({f"step{k}": t.contiguous() for k, t in enumerate(captured)}, job["out"])
    c = m.config
    return {
        "class": type(m).__name__,
        "attn": m._attn_impl,
        "layout": {k: getattr(c, k) for k in ("norm_before_residual", "norm_before_fc", "fc_norm", "norm_output")},
        "arch": c.transformer_layer_config.model_type,
        "num_layers": len(m.layers),
        "layer_classes": [type(layer).__name__ for layer in m.layers],
        "aux_layer_ids": c.eagle_aux_hidden_state_layer_ids,
        "draft_vocab_size": c.draft_vocab_size,
        "vocab_size": c.transformer_layer_config.vocab_size,
        "sliding_window_layers": m.sliding_window_indices,
        "had_embed": has_embed,
        "speculative_tokens": c.speculators_config.proposal_methods[0].speculative_tokens,
        "verifier": c.speculators_config.verifier.name_or_path,
        "transformers": __import__("transformers").__version__,
        "speculators": importlib.metadata.version("speculators"),
    }


if __name__ == "__main__":
    import logging

    logging.disable(logging.WARNING)
    from loguru import logger

    logger.remove()  # speculators logs INFO lines for every file it opens
    jobs = json.loads(open(sys.argv[1]).read())
    for job in jobs:
        print(json.dumps({"make": make, "convert": convert, "logits": logits}[job["cmd"]](job)), flush=True)
