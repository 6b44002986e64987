"""The optimizer step: AdamW (torch's fused one on CPU, eyas' fused kernel on CUDA) or speculators' Muon
groups, the learning-rate schedule, and gradient clipping folded into the fused AdamW's read of the gradients."""

from __future__ import annotations

import math

import torch
from torch import nn

from eyas.core.errors import EyasError
from eyas.training.precision import FusedAdamW


def lr_factor(step: int, *, total: int, warmup: int, schedule: str) -> float:
    """Linear warmup to 1 over ``warmup`` steps, then ``cosine`` / ``linear`` decay to 0 at ``total``, or ``constant``."""
    if step < warmup:
        return (step + 1) / warmup
    if schedule == "constant":
        return 1.0
    frac = min(1.0, (step - warmup) / max(1, total - warmup))
    return 0.5 * (1 + math.cos(math.pi * frac)) if schedule == "cosine" else 1.0 - frac


def build_optimizers(model: nn.Module, *, name: str, lr: float, weight_decay: float, fused: bool) -> list:
    """AdamW over every trainable parameter (no decay on norms), or speculators' default: Muon on the
    2-D weights of the layer and fc, AdamW on the rest (norms, lm_head)."""
    params = [(n, p) for n, p in model.named_parameters() if p.requires_grad]
    decay = [p for n, p in params if p.ndim >= 2]
    no_decay = [p for n, p in params if p.ndim < 2]
    adamw = dict(lr=lr, betas=(0.9, 0.95), eps=1e-8)
    # fused: torch's fused AdamW on CPU, one Triton kernel per weight on CUDA that also writes its working copy
    AdamW = FusedAdamW if fused else torch.optim.AdamW
    if name == "adamw":
        return [AdamW([{"params": decay, "weight_decay": weight_decay},
                       {"params": no_decay, "weight_decay": 0.0}], **adamw)]  # fmt: skip
    if not hasattr(torch.optim, "Muon"):
        raise EyasError(f"--optimizer muon needs torch.optim.Muon (torch >= 2.9); this is torch {torch.__version__}")
    muon = [p for n, p in params if p.ndim == 2 and "lm_head" not in n]
    rest = [p for n, p in params if not (p.ndim == 2 and "lm_head" not in n)]
    # speculators 0.9's Muon defaults (train/config/schema.py): momentum 0.95, decay 0.1, lr adjusted to AdamW's RMS.
    return [torch.optim.Muon(muon, lr=lr, weight_decay=0.1, momentum=0.95, adjust_lr_fn="match_rms_adamw"),
            AdamW([{"params": [p for p in rest if p.ndim >= 2], "weight_decay": weight_decay},
                   {"params": [p for p in rest if p.ndim < 2], "weight_decay": 0.0}], **adamw)]  # fmt: skip


def clip_gradients(params: list[torch.Tensor], optimizers: list, max_norm: float) -> torch.Tensor:
    """Clip the gradients' total norm to ``max_norm`` for the coming optimizer step; returns the norm before.

    With one fused AdamW the gradients are not rescaled in a pass of their own: the fused kernel divides each
    gradient by the optimizer's ``grad_scale`` as it reads it (the hook ``torch.amp.GradScaler`` unscales
    through), so clipping costs one read of the gradients (the norm) instead of three (norm, then a read and
    a write to scale). ``max(1, (norm + 1e-6) / max_norm)`` is ``clip_grad_norm_``'s factor
    ``min(1, max_norm / (norm + 1e-6))`` inverted."""
    if len(optimizers) == 1 and isinstance(optimizers[0], torch.optim.AdamW) and optimizers[0].defaults.get("fused"):
        norm = torch.nn.utils.get_total_norm([p.grad for p in params if p.grad is not None])
        optimizers[0].grad_scale = ((norm + 1e-6) / max_norm).clamp(min=1.0)
        return norm
    norm = torch.nn.utils.clip_grad_norm_(params, max_norm)
    return norm.full_tensor() if hasattr(norm, "full_tensor") else norm
