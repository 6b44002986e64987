"""Why a batch shape's first forward is slow (GPU diagnostic for issue 4; prints JSON lines).

A random model of SmolLM2-135M's architecture runs batches of ``[B, T]`` tokens (B = 32768 // T): every shape
twice in a row (first call, then warm), for lengths all distinct and for lengths rounded up to a multiple of
64; then the same first/second timing for one bare matmul of each new M, and for causal SDPA; then a profile of
one cold forward.
"""

import json
import sys
import time
from pathlib import Path

import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from extract_throughput import random_smollm2  # noqa: E402


def timed(fn) -> float:
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    fn()
    torch.cuda.synchronize()
    return (time.perf_counter() - t0) * 1e3


def main() -> None:
    from transformers import AutoModelForCausalLM

    path = random_smollm2(Path("/tmp/cold-smollm2"))
    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.bfloat16).cuda().eval()
    backbone = model.model
    budget = 32768

    def fwd(T):
        ids = torch.randint(1, 49000, (budget // T, T), device="cuda")
        return lambda: backbone(input_ids=ids, use_cache=False)

    with torch.inference_mode():
        for _ in range(3):
            fwd(1024)()  # context, allocator
        for label, Ts in (
            ("distinct", range(701, 741)),
            ("round64", [((t + 63) // 64) * 64 for t in range(1501, 1541)]),
        ):
            first, second = [], []
            for T in Ts:
                f = fwd(T)
                first.append(timed(f))
                second.append(timed(f))
            print(
                json.dumps(
                    {
                        "forward": label,
                        "shapes": len(set(Ts)),
                        "first_ms_mean": sum(first) / len(first),
                        "second_ms_mean": sum(second) / len(second),
                        "first_ms": [round(x, 1) for x in first[:12]],
                    }
                )
            )
        W = torch.randn(1536, 576, device="cuda", dtype=torch.bfloat16)
        first, second = [], []
        for M in range(30001, 30041):
            x = torch.randn(M, 576, device="cuda", dtype=torch.bfloat16)
            first.append(timed(lambda: x @ W.t()))
            second.append(timed(lambda: x @ W.t()))
        print(json.dumps({"matmul_M_new": 40, "first_ms_mean": sum(first) / 40, "second_ms_mean": sum(second) / 40}))
        first, second = [], []
        for T in range(801, 841):
            q = torch.randn(budget // T, 9, T, 64, device="cuda", dtype=torch.bfloat16)
            k = torch.randn(budget // T, 3, T, 64, device="cuda", dtype=torch.bfloat16)
            f = lambda: F.scaled_dot_product_attention(q, k, k, is_causal=True, enable_gqa=True)  # noqa: E731
            first.append(timed(f))
            second.append(timed(f))
        print(json.dumps({"sdpa_T_new": 40, "first_ms_mean": sum(first) / 40, "second_ms_mean": sum(second) / 40}))
        from torch.profiler import ProfilerActivity, profile

        f = fwd(901)
        with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as p:
            f()
            torch.cuda.synchronize()
        print(p.key_averages().table(sort_by="cpu_time_total", row_limit=25, max_name_column_width=60), file=sys.stderr)
        print(
            p.key_averages().table(sort_by="cuda_time_total", row_limit=15, max_name_column_width=60), file=sys.stderr
        )
        with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as p:
            f()
            torch.cuda.synchronize()
        print("=== warm", file=sys.stderr)
        print(p.key_averages().table(sort_by="cpu_time_total", row_limit=15, max_name_column_width=60), file=sys.stderr)


if __name__ == "__main__":
    main()
