"""The optimizer step at real draft dims: torch's fused AdamW followed by the working copies' refresh (eyas
until the ninth session) against eyas' FusedAdamW, one Triton kernel per weight that also writes its bf16
working copy (``eyas.precision``). Time per step and the bandwidth the bytes imply.

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


def _shapes(name: str) -> tuple[list[tuple[int, ...]], list[tuple[int, ...]]]:
    """(trainable weights, of which layer weights kept as working copies) of the draft at ``name``'s dims:
    fc, q/k/v (2H in), o, gate/up/down, four norms; lm_head frozen (speculators' setting)."""
    from synthetic import PRESETS

    d = PRESETS[name]
    H, q, kv = d.hidden, d.heads * d.head_dim, d.kv_heads * d.head_dim
    layer = [(q, 2 * H), (kv, 2 * H), (kv, 2 * H), (H, q), (d.intermediate, H), (d.intermediate, H),
             (H, d.intermediate)]  # fmt: skip
    return [(H, 3 * H), *layer, (H,), (H,), (H,), (H,)], layer


def main(argv: list[str] | None = None) -> list[dict]:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--dims", nargs="+", default=["kimi", "llama8b"])
    p.add_argument("--iters", type=int, default=20)
    p.add_argument("--smoke", action="store_true", help="CPU, tiny dims")
    a = p.parse_args(argv)

    import torch

    from eyas.precision import FusedAdamW, WorkingLinear

    if a.smoke:
        a.dims, a.iters = ["smoke"], 2
    dev = "cuda" if torch.cuda.is_available() and not a.smoke else "cpu"
    results = []
    for name in a.dims:
        shapes, layer = _shapes(name)
        numel = sum(torch.Size(s).numel() for s in shapes)
        layer_numel = sum(torch.Size(s).numel() for s in layer)
        for variant in ("torch-fused+refresh", "eyas-fused"):
            g = torch.Generator(device=dev).manual_seed(0)
            params = [torch.nn.Parameter(0.02 * torch.randn(s, generator=g, device=dev)) for s in shapes]
            for q in params:
                q.grad = 1e-3 * torch.randn(q.shape, generator=g, device=dev)
            # the layer weights as WorkingLinear modules, each with its bf16 copy, as eyas.train sets them up
            lins = []
            for q in params[1 : 1 + len(layer)]:
                m = torch.nn.Linear(q.shape[1], q.shape[0], bias=False, device="meta")
                m.__class__ = WorkingLinear
                m.weight, m.working_dtype, m.keep_working = q, torch.bfloat16, True
                m._working, m._working_key = q.detach().to(torch.bfloat16), None
                lins.append(m)
            groups = [{"params": [q for q in params if q.ndim == 2], "weight_decay": 0.01},
                      {"params": [q for q in params if q.ndim == 1], "weight_decay": 0.0}]  # fmt: skip
            kw = dict(lr=1e-4, betas=(0.9, 0.95), eps=1e-8)
            if variant == "eyas-fused":
                opt = FusedAdamW(groups, **kw)
                opt._working = {id(m.weight): m for m in lins}

                def step():
                    opt.step()
            else:
                opt = torch.optim.AdamW(groups, fused=True, **kw)

                def step():
                    opt.step()
                    for m in lins:
                        m._working.copy_(m.weight.detach())

            opt.grad_scale = torch.ones((), device=dev)  # the clip, as eyas.train.clip_gradients passes it
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
            del opt, params, lins
            if dev == "cuda":
                torch.cuda.empty_cache()
    return results


if __name__ == "__main__":
    main()
