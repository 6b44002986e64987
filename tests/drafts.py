"""Random drafts of every layout eyas exports, saved as `eyas train` saves them: shared by the export tests and
the speculators cross-checks."""

from __future__ import annotations

from pathlib import Path

import torch

from eyas.draft.checkpoint import save_draft
from eyas.draft.model import DraftConfig, Eagle3Draft
from eyas.verifier.info import resolve
from eyas.verifier.load import load_head_tensors

LAYOUTS = {
    "eagle3": {},  # the plain EAGLE-3 layout every engine serves
    "speculators_default": {"norm_before_residual": True, "norm_before_fc": True, "norm_output": True},
    "eagle31_qwen3_two_layers": {"fc_norm": True, "norm_output": True, "draft_arch": "qwen3", "num_hidden_layers": 2},
}


def random_draft(verifier, *, N: int = 96, seed: int = 0, aux_layer_ids=None, **layout) -> Eagle3Draft:
    """A draft with every weight random (norms too, so a misplaced norm shows), vocab maps over a random
    ascending subset of the verifier vocab, and weights exactly representable in bf16 (what checkpoints hold)."""
    info = resolve(verifier)
    cfg = DraftConfig.from_verifier(info.text_config, draft_vocab_size=N,
                                    aux_layer_ids=aux_layer_ids or info.aux_layer_ids, **layout)  # fmt: skip
    torch.manual_seed(seed)
    m = Eagle3Draft(cfg)
    with torch.no_grad():
        for name, p in m.named_parameters():
            if name.endswith("norm.weight"):
                p.copy_(1.0 + 0.1 * torch.randn_like(p))
            elif name != "embed_tokens.weight":
                p.normal_(0.0, 0.05)
            p.copy_(p.to(torch.bfloat16).float())
        m.embed_tokens.weight.copy_(load_head_tensors(info).embed)
    ids = torch.randperm(cfg.vocab_size)[:N].sort().values
    t2d = torch.zeros(cfg.vocab_size, dtype=torch.bool)
    t2d[ids] = True
    m.set_vocab(d2t=ids - torch.arange(N), t2d=t2d)
    return m.eval()


def save(m: Eagle3Draft, path: Path, verifier, **kw) -> Path:
    return save_draft(path, m, verifier_name_or_path=str(verifier), verifier_architectures=["LlamaForCausalLM"],
                      ttt_steps=3, **kw)  # fmt: skip
