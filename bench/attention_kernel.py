"""The draft's TTT attention at real dims: flex attention under eyas' block mask, forward and backward, in
several kernel settings, beside SDPA's fused kernels on the plain causal part (what a dedicated kernel attains).

TTT step k attends over (k+1)*T keys: the causal prefix of step 0 plus one diagonal key per earlier step
(``eyas.draft.model.TTTContext``). The profiles recorded in commit d42f3e5 put flex attention's backward at 3.8 ms of a 32 ms step at
Llama-3.1-8B dims and 8.9 ms of 63 ms at Kimi-K2.5 dims (H200), about 150 TFLOP/s by a causal FLOP count.

    python bench/attention_kernel.py                      # on the GPU: one JSON line per (dims, variant)
    python bench/attention_kernel.py --smoke              # on CPU: forward only, tiny dims; proves it runs

FLOPs per call (causal count, as bench/train_throughput.py): forward 4*B*heads*hd*(T(T+1)/2 + k*T), backward
2.5x the forward (the FlashAttention papers' convention).
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "src"))

DIMS = {"llama8b": (32, 8, 128), "kimi": (64, 8, 112), "smoke": (4, 2, 16)}  # heads, kv heads, head_dim
FLEX_VARIANTS = {
    "flex": {},
    "flex-tma": {"USE_TMA": True},
    "flex-rows-safe": {"ROWS_GUARANTEED_SAFE": True},  # every TTT query sees at least its own position
    "flex-strided": {},  # q as training makes it: a [B, T, h, d] projection seen as [B, h, T, d]
}


def _time(fn, iters: int, cuda: bool) -> float:
    import torch

    for _ in range(2):  # warm-up: a no-grad call compiles its own graph (and cuDNN builds its plan) on first use
        fn()
    if cuda:
        torch.cuda.synchronize()
    t0 = time.perf_counter()
    for _ in range(iters):
        fn()
    if cuda:
        torch.cuda.synchronize()
    return 1e3 * (time.perf_counter() - t0) / iters


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--dims", nargs="+", default=["kimi", "llama8b"], choices=list(DIMS))
    p.add_argument("--seq-len", type=int, default=2048)
    p.add_argument("--step", type=int, default=2, help="TTT step k: (k+1)*T keys")
    p.add_argument("--iters", type=int, default=20)
    p.add_argument("--smoke", action="store_true", help="CPU, tiny dims, forward only")
    a = p.parse_args(argv)

    import torch
    import torch.nn.functional as F
    from torch.nn.attention import SDPBackend, sdpa_kernel
    from torch.nn.attention.flex_attention import flex_attention

    from eyas.draft.model import TTTContext

    if a.smoke:
        a.dims, a.seq_len, a.iters = ["smoke"], 128, 2
    cuda = torch.cuda.is_available() and not a.smoke
    dev, dtype = ("cuda", torch.bfloat16) if cuda else ("cpu", torch.float32)
    T, k = a.seq_len, a.step
    for name in a.dims:
        heads, kv, hd = DIMS[name]
        g = torch.Generator(device=dev).manual_seed(0)
        q = torch.randn(1, heads, T, hd, generator=g, device=dev, dtype=dtype, requires_grad=cuda)
        keys = torch.randn(1, kv, (k + 1) * T, hd, generator=g, device=dev, dtype=dtype, requires_grad=cuda)
        values = torch.randn(1, kv, (k + 1) * T, hd, generator=g, device=dev, dtype=dtype, requires_grad=cuda)
        ctx = TTTContext(torch.zeros(1, T, dtype=torch.long, device=dev), "flex")
        for j in range(k):
            ctx.record(keys[:, :, j * T : (j + 1) * T], values[:, :, j * T : (j + 1) * T])
            ctx.begin(j + 1)
        mask = ctx.mask()
        fwd_flop = 4 * heads * hd * (T * (T + 1) / 2 + k * T)
        cases = [(v, "flex", o) for v, o in FLEX_VARIANTS.items()]
        if cuda:  # the causal part alone (step 0's keys) through SDPA's fused kernels, for scale
            cases += [("sdpa-flash-causal", SDPBackend.FLASH_ATTENTION, None),
                      ("sdpa-cudnn-causal", SDPBackend.CUDNN_ATTENTION, None)]  # fmt: skip
        for variant, kind, opts in cases:
            res = {"bench": "ttt-attention", "dims": name, "variant": variant, "seq_len": T, "step": k,
                   "heads": heads, "kv_heads": kv, "head_dim": hd, "device": dev}  # fmt: skip
            try:
                t0 = time.perf_counter()
                if kind == "flex":
                    torch._dynamo.reset()  # each variant its own graphs (one code object: one cache, 8 entries)
                    fn = torch.compile(flex_attention, dynamic=False)

                    qs = q.detach().transpose(1, 2).contiguous().transpose(1, 2).requires_grad_(cuda)
                    qv = qs if variant == "flex-strided" else q

                    def fwd(fn=fn, opts=opts, qv=qv):
                        return fn(qv, keys, values, block_mask=mask, enable_gqa=heads > kv,
                                  kernel_options=opts or None)  # fmt: skip

                    flop = fwd_flop
                else:
                    k0, v0 = keys[:, :, :T], values[:, :, :T]
                    rep = heads // kv  # cuDNN takes no GQA: the repeated heads are part of its input

                    def fwd(kind=kind, k0=k0, v0=v0, rep=rep):
                        with sdpa_kernel([kind]):
                            if kind == SDPBackend.CUDNN_ATTENTION:
                                return F.scaled_dot_product_attention(q, k0.repeat_interleave(rep, 1),
                                                                      v0.repeat_interleave(rep, 1), is_causal=True)  # fmt: skip
                            return F.scaled_dot_product_attention(q, k0, v0, is_causal=True, enable_gqa=True)

                    flop = 4 * heads * hd * T * (T + 1) / 2
                out = fwd()
                if cuda:
                    grad = torch.randn_like(out)
                    out.backward(grad)
                res["compile_s"] = round(time.perf_counter() - t0, 1)
                with torch.no_grad():
                    res["fwd_ms"] = round(_time(fwd, a.iters, cuda), 3)
                if cuda:
                    fwd().backward(grad)  # a second warm-up round, so the timed backwards find everything built
                    outs = [fwd() for _ in range(a.iters)]
                    torch.cuda.synchronize()
                    t0 = time.perf_counter()
                    for o in outs:
                        o.backward(grad)
                    torch.cuda.synchronize()
                    res["bwd_ms"] = round(1e3 * (time.perf_counter() - t0) / a.iters, 3)
                    res["bwd_tflops"] = round(2.5 * flop / res["bwd_ms"] / 1e9, 1)
                res["fwd_tflops"] = round(flop / res["fwd_ms"] / 1e9, 1)
            except Exception as e:  # a backend this machine lacks: say so and go on
                res["error"] = f"{type(e).__name__}: {str(e)[:300]}"
            print(json.dumps(res), flush=True)


if __name__ == "__main__":
    main()
