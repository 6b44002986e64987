"""Where batch-1 decoding's time goes: one plain step and one speculative round (eval's loops, eyas.engine.speculative;
the round both round by round and as one graph, ``fused``) timed over whole answers with the host's clock, and
one of each profiled (kernel count and GPU time, top kernels), per slot-attention implementation. The draft is untrained unless --draft: a round then accepts about
nothing, so what it measures is the cost of a round; the speedup at a given tau is ``tau * step / round``.

    # GPU (a random-weight SmolLM2 from bench/gpu/generate.sh random, or the GGUF):
    PYTHONPATH=src:/tmp/site python3 bench/decode_profile.py --verifier /tmp/smol-random --attention sdpa,flex
    # anywhere: checks the script runs (tiny random Llama, CPU)
    PYTHONPATH=src python3 bench/decode_profile.py --smoke

Prints one JSON line per attention implementation.
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
try:
    import eyas  # noqa: F401
except ImportError:  # run from a checkout without installing
    sys.path.insert(0, str(ROOT / "src"))

from eyas.stages.evaluate import setup  # noqa: E402
from eyas.evaluation.measure import Runners  # noqa: E402
from eyas.engine.speculative import plain_generate, speculative_generate  # noqa: E402


def kernels(fn, steps: int) -> dict:
    """``fn`` under torch's profiler: GPU kernels and their time per step, the top five by time."""
    from torch.profiler import ProfilerActivity, profile

    acts = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if torch.cuda.is_available() else [])
    with profile(activities=acts) as prof:
        fn()
    ev = [e for e in prof.events() if e.device_type == torch.autograd.DeviceType.CUDA]
    by: dict[str, float] = {}
    for e in ev:
        by[e.name] = by.get(e.name, 0.0) + e.device_time
    top = sorted(by.items(), key=lambda x: -x[1])[:5]
    return {"kernels_per_step": len(ev) / steps, "gpu_ms_per_step": sum(by.values()) / 1e3 / steps,
            "top_kernels_ms_per_step": {k[:80]: round(v / 1e3 / steps, 4) for k, v in top}}  # fmt: skip


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--verifier", default="smollm2")
    ap.add_argument("--draft", default="random")
    ap.add_argument("--attention", default="sdpa,flex")
    ap.add_argument("--prompt-len", type=int, default=200)
    ap.add_argument("--new-tokens", type=int, default=256)
    ap.add_argument("--draft-tokens", type=int, default=3)
    ap.add_argument("--smoke", action="store_true")
    args = ap.parse_args()
    tmp = tempfile.TemporaryDirectory()
    device = None
    if args.smoke:
        sys.path.insert(0, str(ROOT / "tests"))
        import tiny

        tiny.llama(Path(tmp.name) / "tiny")
        args.verifier, device = str(Path(tmp.name) / "tiny"), "cpu"
        args.prompt_len, args.new_tokens = 20, 16
    env = setup(verifier=args.verifier, draft=args.draft, device=device, dtype="auto", seed=0)
    dev, K, n = env["device"], args.draft_tokens, args.new_tokens
    prompt = torch.randint(100, 20000 if not args.smoke else 400, (args.prompt_len,), generator=torch.Generator()
                           .manual_seed(0)).tolist()  # fmt: skip
    for attention in args.attention.split(","):
        row = {"attention": attention, "gpu": torch.cuda.get_device_name(dev) if dev.type == "cuda" else "cpu",
               "torch": torch.__version__, "prompt_len": len(prompt), "new_tokens": n, "draft_tokens": K}  # fmt: skip
        try:
            t0 = time.perf_counter()
            r = Runners.build(env["model"], env["draft"], draft_tokens=[K], max_len=len(prompt) + n + K + 2,
                              attention=attention, fused_rounds=True)  # fmt: skip  # both loops' graphs
            row["warmup_s"] = round(time.perf_counter() - t0, 1)
            m = min(32, n)
            for _ in range(2):  # the second run is timed
                plain = plain_generate(r.base, prompt, max_new_tokens=n, eos_ids=set())
            row["plain_tokens_per_s"] = len(plain.tokens) / plain.seconds
            row["plain_ms_per_token"] = 1e3 * plain.seconds / len(plain.tokens)
            row["plain_step_profile"] = kernels(lambda: plain_generate(r.base, prompt, max_new_tokens=m,
                                                                       eos_ids=set()), m)  # fmt: skip
            # the round-by-round loop, then each greedy round as one graph (speculative.GreedyRounds)
            for name, fused in (("spec", False), ("spec_fused", True)):
                kw = dict(draft_tokens=K, eos_ids=set(), fused=fused)
                for _ in range(2):
                    spec = speculative_generate(r.spec, r.draft, prompt, max_new_tokens=n, **kw)
                row[f"{name}_lossless"] = plain.tokens == spec.tokens
                rounds = len(spec.accepted)
                row[f"{name}_ms_per_round"] = 1e3 * spec.seconds / rounds
                row[f"{name}_tau"] = len(spec.tokens) / rounds
                for tau in (1.68, 1.86):
                    row[f"{name}_speedup_at_tau_{tau}"] = tau * row["plain_ms_per_token"] / row[f"{name}_ms_per_round"]
                rounds = len(speculative_generate(r.spec, r.draft, prompt, max_new_tokens=m, **kw).accepted)
                row[f"{name}_round_profile"] = kernels(
                    lambda: speculative_generate(  # noqa: B023
                        r.spec, r.draft, prompt, max_new_tokens=m, **kw
                    ),
                    rounds,
                )
        except Exception as e:  # one implementation failing must not hide the other
            import traceback

            row["error"] = f"{type(e).__name__}: {e}"
            row["traceback"] = traceback.format_exc(limit=8)
        print(json.dumps(row), flush=True)


if __name__ == "__main__":
    main()
