"""The fused loss' per-chunk kernel (``eyas.training.loss._soft_ce_chunk``: both log-softmaxes over the draft vocab, KL,
its gradient, the argmax) compiled several ways: time per call, achieved bandwidth, error against fp64.

The chunk reads the draft's and the verifier's logits ([C, N] each, bf16) and writes the gradient ([C, N]);
anything beyond one pass over those bytes is overhead. Inductor's default splits a long row reduction into
partial and final kernels (and then gives up its online softmax), which the profiles recorded in commit 3a5aab6
showed at about 0.5 TB/s on an H200.

    python bench/loss_kernel.py                   # on the GPU: one JSON line per variant
    python bench/loss_kernel.py --rows 64 --vocab 1000 --iters 3   # on CPU: proves it runs
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "src"))

VARIANTS = {  # name -> torch.compile keyword arguments (None: eager)
    "eager": None,
    "dynamic": dict(dynamic=True),
    "dynamic-nosplit": dict(dynamic=True, options={"split_reductions": False}),
    "static": dict(dynamic=False),
    "static-nosplit": dict(dynamic=False, options={"split_reductions": False}),
    "eyas": "the setting eyas.training.loss compiles with",
}


def main(argv: list[str] | None = None) -> list[dict]:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--rows", type=int, nargs="+", default=[1024, 2048], help="chunk sizes (tokens)")
    p.add_argument("--vocab", type=int, default=32000, help="draft vocab")
    p.add_argument("--iters", type=int, default=50)
    a = p.parse_args(argv)

    import torch

    from eyas.training.loss import _chunk_fn, _soft_ce_chunk

    dev = "cuda" if torch.cuda.is_available() else "cpu"
    results = []
    for C in a.rows:
        g = torch.Generator(device=dev).manual_seed(0)
        x = (3 * torch.randn(C, a.vocab, generator=g, device=dev)).to(torch.bfloat16)
        t = (3 * torch.randn(C, a.vocab, generator=g, device=dev)).to(torch.bfloat16)
        w = torch.rand(C, generator=g, device=dev)
        ref = _soft_ce_chunk(x.double(), t.double(), w.double())
        for name, kw in VARIANTS.items():
            torch._dynamo.reset()
            if name == "eyas":
                fn = _chunk_fn(True)
            else:
                fn = _soft_ce_chunk if kw is None else torch.compile(_soft_ce_chunk, **kw)
            t0 = time.perf_counter()
            out = fn(x, t, w)  # compiles
            compile_s = time.perf_counter() - t0
            for _ in range(3):
                fn(x, t, w)
            if dev == "cuda":
                torch.cuda.synchronize()
            t0 = time.perf_counter()
            for _ in range(a.iters):
                fn(x, t, w)
            if dev == "cuda":
                torch.cuda.synchronize()
            us = 1e6 * (time.perf_counter() - t0) / a.iters
            moved = 3 * C * a.vocab * 2  # two bf16 inputs read, one bf16 gradient written
            res = {"bench": "loss-chunk", "variant": name, "rows": C, "vocab": a.vocab, "us_per_call": round(us, 1),
                   "gb_per_s_one_pass": round(moved / us / 1e3, 1), "compile_s": round(compile_s, 1),
                   "grad_err": float((out[0].double() - ref[0]).abs().max()),
                   "kl_err": float((out[1].double() - ref[1]).abs().max()),
                   "argmax_equal": bool((out[2] == ref[2]).all()), "device": dev}  # fmt: skip
            print(json.dumps(res), flush=True)
            results.append(res)
    return results


if __name__ == "__main__":
    main()
