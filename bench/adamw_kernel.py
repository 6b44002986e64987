"""The optimizer step at real draft dims: torch's fused AdamW followed by the working copies' refresh (eyas
before commit b44b6f7) against eyas' FusedAdamW, one Triton kernel per weight that also writes its bf16
working copy (``eyas.training.precision``). Time per step and the bandwidth the bytes imply.

Bytes per step, the floor both approach: each trainable fp32 weight reads weight, gradient and two moments and
writes weight and moments (28 bytes per parameter); each layer weight's bf16 working copy adds a 2-byte write
(and, refreshed apart, a 4-byte read of the new weight).

    python bench/adamw_kernel.py                     # on the GPU: one JSON line per (dims, variant)
    python bench/adamw_kernel.py --smoke             # on CPU: tiny dims, torch's step only; proves it runs
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "src"))
sys.path.insert(0, str(Path(__file__).resolve().parent))


def _shapes(name: str) -> tuple[list[tuple[int, int]], list[tuple[int, ...]]]:
    """The draft's trainable weights at ``name``'s dims: (the layer's linears, kept as working copies: q/k/v
    with 2H inputs, o, gate/up/down; the rest: fc, four norms); lm_head frozen (speculators' setting)."""
    from synthetic import PRESETS

    d = PRESETS[name]
    H, q, kv = d.hidden, d.heads * d.head_dim, d.kv_heads * d.head_dim
    layer = [(q, 2 * H), (kv, 2 * H), (kv, 2 * H), (H, q), (d.intermediate, H), (d.intermediate, H),
             (H, d.intermediate)]  # fmt: skip
    return layer, [(H, 3 * H), (H,), (H,), (H,), (H,)]


def main(argv: list[str] | None = None) -> list[dict]:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--dims", nargs="+", default=["kimi", "llama8b"])
    p.add_argument("--iters", type=int, default=20)
    p.add_argument("--smoke", action="store_true", help="CPU, tiny dims")
    a = p.parse_args(argv)

    import torch

    from eyas.training.precision import FusedAdamW, refresh_working_weights, use_working_weights

    if a.smoke:
        a.dims, a.iters = ["smoke"], 2
    dev = "cuda" if torch.cuda.is_available() and not a.smoke else "cpu"
    results = []
    for name in a.dims:
        layer_shapes, other_shapes = _shapes(name)
        layer_numel = sum(o * i for o, i in layer_shapes)
        numel = layer_numel + sum(torch.Size(s).numel() for s in other_shapes)
        for variant in ("torch-fused+refresh", "eyas-fused"):
            g = torch.Generator(device=dev).manual_seed(0)
            # the layer's linears with their bf16 working copies, as eyas.stages.train sets them up
            layer = torch.nn.Sequential(*[torch.nn.Linear(i, o, bias=False, device=dev) for o, i in layer_shapes])
            use_working_weights(layer, torch.bfloat16)
            params = [
                *layer.parameters(),
                *(torch.nn.Parameter(0.02 * torch.randn(s, generator=g, device=dev)) for s in other_shapes),
            ]
            for q in params:
                q.grad = 1e-3 * torch.randn(q.shape, generator=g, device=dev)
            groups = [{"params": [q for q in params if q.ndim == 2], "weight_decay": 0.01},
                      {"params": [q for q in params if q.ndim == 1], "weight_decay": 0.0}]  # fmt: skip
            kw = dict(lr=1e-4, betas=(0.9, 0.95), eps=1e-8)
            if variant == "eyas-fused":
                opt = FusedAdamW(groups, **kw)
                opt.attach_working(layer)

                def step():
                    opt.step()
            else:
                opt = torch.optim.AdamW(groups, fused=True, **kw)

                def step():
                    opt.step()
                    refresh_working_weights(layer)  # what TTTObjective does before the next forward

            opt.grad_scale = torch.ones((), device=dev)  # the clip, as eyas.stages.train.clip_gradients passes it
            for _ in range(2):  # warm-up: state allocation, the kernel's compilation
                step()
            if dev == "cuda":
                torch.cuda.synchronize()
            t0 = time.perf_counter()
            for _ in range(a.iters):
                step()
            if dev == "cuda":
                torch.cuda.synchronize()
            ms = 1e3 * (time.perf_counter() - t0) / a.iters
            moved = 28 * numel + 2 * layer_numel + (4 * layer_numel if variant != "eyas-fused" else 0)
            res = {"bench": "adamw-step", "dims": name, "variant": variant, "device": dev, "params": numel,
                   "working_params": layer_numel, "ms": round(ms, 3), "gb_moved": round(moved / 1e9, 2),
                   "tb_per_s": round(moved / ms / 1e9, 2), "fast_path": isinstance(opt, FusedAdamW) and opt._fast()}  # fmt: skip
            results.append(res)
            print(json.dumps(res), flush=True)
            del opt, params, layer
            if dev == "cuda":
                torch.cuda.empty_cache()
    return results


if __name__ == "__main__":
    main()
