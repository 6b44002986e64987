"""Speculative decoding with `eyas eval`'s loop against plain decoding of the same prompts, in the same run.

Report tau and the speedup over the *fastest* plain decoding at batch size 1 on one H200 with
SmolLM2-135M-Instruct: plain decoding through the same engine as the speculative loop (eyas.engine.generate: slot
cache, CUDA graphs), and transformers' own `generate` with a static cache (which compiles itself on CUDA); the
speedup is taken against whichever is faster.

    # GPU, SmolLM2 GGUF, 8 MT-Bench questions (both turns), 256 new tokens, K=3; a random draft unless --draft:
    PYTHONPATH=src:/tmp/site python3 bench/eval_speedup.py --verifier /tmp/g/smol.gguf \\
        --prompts mt-bench --modes graphs,eager [--draft DIR]
    # anywhere (CPU, tiny random Llama): checks that the script works
    PYTHONPATH=src python3 bench/eval_speedup.py --smoke

Each mode (`graphs`: every fixed-shape forward a CUDA graph; `eager`: none) loads nothing again: one
verifier and one draft serve all of them. Prints one JSON line per mode and a final summary line.
"""

from __future__ import annotations

import argparse
import json
import platform
import sys
import tempfile
import time
import traceback
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
try:
    import eyas  # noqa: F401
except ImportError:  # run from a checkout without installing
    sys.path.insert(0, str(ROOT / "src"))

from eyas.stages.evaluate import setup  # noqa: E402
from eyas.evaluation.measure import Runners, as_prompts, conversation_bound, measure, summarize  # noqa: E402


def tiny_verifier(where: Path) -> Path:
    """A tiny random Llama with a ChatML tokenizer (tests/tiny.py), for --smoke."""
    sys.path.insert(0, str(ROOT / "tests"))
    import tiny

    tiny.llama(where)
    return where


def sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


@torch.no_grad()
def hf_generate(model, turn_ids: list[list[int]], *, max_new_tokens: int, eos_ids: set[int], bound: int) -> dict:
    """transformers' `generate`, greedy, static cache (compiled by generate itself on CUDA), one prompt at a time,
    on the very prompts the loops decoded. Warmed up on the longest prompt first (the cache is sized once)."""
    from transformers import GenerationConfig

    dev = next(model.parameters()).device
    extra = {"max_cache_len": bound} if hasattr(GenerationConfig(), "max_cache_len") else {}
    kw = dict(do_sample=False, max_new_tokens=max_new_tokens, eos_token_id=sorted(eos_ids), pad_token_id=min(eos_ids),
              cache_implementation="static", **extra)  # fmt: skip

    def run(ids: list[int]) -> int:
        x = torch.tensor([ids], device=dev)
        out = model.generate(x, attention_mask=torch.ones_like(x), **kw)[0, len(ids) :].tolist()
        return next((i + 1 for i, t in enumerate(out) if t in eos_ids), len(out))

    t0 = time.perf_counter()
    longest = max(turn_ids, key=len)
    for _ in range(3):
        run(longest)
    sync(dev)
    warm = time.perf_counter() - t0
    tokens, t0 = 0, time.perf_counter()
    for ids in turn_ids:
        tokens += run(ids)
    sync(dev)
    seconds = time.perf_counter() - t0
    return {"baseline": "transformers generate (static cache)", "tokens": tokens, "seconds": seconds,
            "tokens_per_s": tokens / seconds, "warmup_s": warm}  # fmt: skip


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--verifier", default="smollm2")
    ap.add_argument("--draft", default="random", help="a draft checkpoint dir; default: an untrained (random) draft")
    ap.add_argument("--prompts", default="mt-bench", help="mt-bench, humaneval or a JSON/JSONL file")
    ap.add_argument("--num-prompts", type=int, default=8)
    ap.add_argument("--max-new-tokens", type=int, default=256)
    ap.add_argument("--draft-tokens", type=int, default=3)
    ap.add_argument("--modes", default="graphs,eager", help="comma-separated: graphs, eager")
    ap.add_argument("--attention", default="auto", help="the slot attention, comma-separated: auto (flex on "
                    "CUDA), sdpa, flex (each a run of every mode)")  # fmt: skip
    ap.add_argument("--hf-generate", action=argparse.BooleanOptionalAction, default=True)
    ap.add_argument("--fused-rounds", action="store_true", help="each greedy round as one graph (GreedyRounds)")
    ap.add_argument("--device", default=None)
    ap.add_argument("--dtype", default="auto")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--smoke", action="store_true", help="CPU, tiny random Llama, few tokens: checks the script runs")
    args = ap.parse_args()
    tmp = tempfile.TemporaryDirectory()
    prompts = args.prompts
    if args.smoke:
        args.verifier, args.device = str(tiny_verifier(Path(tmp.name) / "tiny")), "cpu"
        args.max_new_tokens, args.modes = 16, "graphs,eager"
        prompts = ["Tell me about dogs.", ["What is 2+2?", "And 3+3?"]]
        torch.set_num_threads(1)

    t0 = time.perf_counter()
    env = setup(verifier=args.verifier, draft=args.draft, device=args.device, dtype=args.dtype, seed=args.seed)
    plist, source, _ = as_prompts(prompts, num_prompts=args.num_prompts, seed=args.seed)
    load_s = time.perf_counter() - t0
    K, tok, dev = args.draft_tokens, env["tokenizer"], env["device"]
    bound = conversation_bound(plist, tok, max_new_tokens=args.max_new_tokens, draft_tokens=K)
    common = {"verifier": env["info"].path, "draft": args.draft, "draft_is_random": args.draft == "random",
              "prompts": source, "num_prompts": len(plist), "max_new_tokens": args.max_new_tokens, "draft_tokens": K,
              "batch_size": 1, "device": str(dev), "dtype": str(env["dtype"]).removeprefix("torch."),
              "gpu": torch.cuda.get_device_name(dev) if dev.type == "cuda" else platform.processor() or "cpu",
              "torch": torch.__version__, "load_s": round(load_s, 1)}  # fmt: skip
    results, turn_ids = [], None
    for mode, attention in [(m, a) for a in args.attention.split(",") for m in args.modes.split(",")]:
        row = {"mode": mode, "attention": attention, **common}
        try:
            t0 = time.perf_counter()
            runners = Runners.build(env["model"], env["draft"], draft_tokens=[K], max_len=bound,
                                    cuda_graphs=mode == "graphs", attention=attention,
                                    fused_rounds=args.fused_rounds)  # fmt: skip
            row["warmup_s"] = round(time.perf_counter() - t0, 1)
            m = measure(plist, tok, runners, max_new_tokens=args.max_new_tokens, eos_ids=env["eos_ids"],
                        seed=args.seed, desc=f"mode {mode}")  # fmt: skip
            turn_ids = m.turn_ids
            s = summarize(m, draft_tokens=K, temperature=0.0, baseline=True)
            row.update(s)
            row["baseline"] = "eyas plain loop, same engine"
        except Exception as e:  # one mode failing (e.g. a compiler error) must not hide the others
            row["error"] = f"{type(e).__name__}: {e}"
            row["traceback"] = traceback.format_exc(limit=6)
        results.append(row)
        print(json.dumps(row), flush=True)
    hf = None
    if args.hf_generate and turn_ids:
        from eyas.verifier.merged import unmerge_projections

        # transformers' generate compiles the model itself, without eyas' same-matmul pass: merged parts would
        # each compute the whole merged matmul there
        unmerge_projections(env["model"])
        try:
            hf = hf_generate(env["model"], turn_ids, max_new_tokens=args.max_new_tokens, eos_ids=env["eos_ids"],
                             bound=bound)  # fmt: skip
        except Exception as e:
            hf = {"baseline": "transformers generate (static cache)", "error": f"{type(e).__name__}: {e}"}
        print(json.dumps(hf), flush=True)
    ok = [r for r in results if "error" not in r]
    baselines = [(r["baseline_tokens_per_s"], f"eyas plain loop, mode {r['mode']}, {r['attention']}") for r in ok]
    if hf and "tokens_per_s" in hf:
        baselines.append((hf["tokens_per_s"], hf["baseline"]))
    summary = {"summary": True, **common}
    if ok and baselines:
        best_spec = max(ok, key=lambda r: r["tokens_per_s"])
        best_base = max(baselines)
        summary.update({"tau": best_spec["tau"], "lossless": all(r["lossless"] for r in ok),
                        "tokens_per_s": best_spec["tokens_per_s"], "spec_mode": best_spec["mode"],
                        "baseline_tokens_per_s": best_base[0], "baseline": best_base[1],
                        "speedup": best_spec["tokens_per_s"] / best_base[0]})  # fmt: skip
    print(json.dumps(summary), flush=True)


if __name__ == "__main__":
    main()
