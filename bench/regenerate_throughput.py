"""Generation throughput: eyas's engine against transformers' own batched generation, on the same prompts in
the same run.

The prompts are the first user turns of a prompt set (ShareGPT by default) through the verifier's chat
template, greedy, stopped at the template's end-of-turn token; new tokens are counted up to each answer's own
end of turn (what a regenerated dataset keeps). Compared, each on the same prompts:

- ``engine``: `eyas.engine.generate.BatchDecoder` (continuous batching over a token budget, CUDA graphs);
  ``engine-flex`` / ``engine-sdpa`` the same with that slot attention named (``engine``: its default, flex on
  CUDA: a per-row block table, live keys only);
- ``hf-static``: transformers ``generate`` with a static cache (compiled by ``generate`` on CUDA), prompts
  sorted by length and left-padded in batches of ``--hf-batch``, each batch held until its longest answer ends;
- ``hf-cb``: transformers' continuous batching (``generate_batch``) with its defaults.

    # GPU, SmolLM2 GGUF, 2,048 ShareGPT first turns, 512 new tokens:
    PYTHONPATH=src:/tmp/site python3 bench/regenerate_throughput.py --verifier /tmp/g/smol.gguf \\
        --prompts .carry/sharegpt_prompts.jsonl.gz --num-prompts 2048 --max-new-tokens 512
    # anywhere (CPU, tiny random Llama): checks the script runs
    PYTHONPATH=src python3 bench/regenerate_throughput.py --smoke

Prints one JSON line per method and a summary line with the ratios.
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

from eyas.data.datasets import load_prompts  # noqa: E402
from eyas.data.chat import encode_prompt, end_of_turn_ids  # noqa: E402
from eyas.engine.generate import BatchDecoder, Request, RequestQueue, default_batch_tokens  # noqa: E402
from eyas.verifier.load import build_text_model, load_tokenizer, resolve  # noqa: E402


def sync(dev: torch.device) -> None:
    if dev.type == "cuda":
        torch.cuda.synchronize(dev)


def kept(tokens: list[int], eos: set[int]) -> int:
    """Tokens up to and including the first end-of-turn id."""
    return next((i + 1 for i, t in enumerate(tokens) if t in eos), len(tokens))


def run_engine(model, prompts: list[list[int]], *, eos, max_new_tokens: int, max_len: int, batch_tokens: int,
               graphs: bool, attention: str = "auto", compile_prefill: bool = False,
               cold: bool = False) -> dict:  # fmt: skip
    """``compile_prefill``: the prefills' layers compiled (the engine's default: eager); ``cold``: no warm-up, so
    the timing holds every compile and graph recording, as one `eyas regenerate` pays them."""
    dev = next(model.parameters()).device
    torch._dynamo.reset()  # each method compiles from nothing: an earlier one's compiled code is not reused
    t0 = time.perf_counter()
    dec = BatchDecoder(model, eos_ids=eos, max_len=max_len, batch_tokens=batch_tokens, cuda_graphs=graphs,
                       attention=attention, compile_prefill=compile_prefill)  # fmt: skip
    # warm-up outside the timing: every key length's graph (SDPA's buckets; FlexAttention has one) recorded on a
    # few prompts of each length class
    warm = [Request(key=-1, tokens=[1] * n, max_new_tokens=max_new_tokens) for n in (8, 256, 1024) if n < max_len]
    for _ in dec.run(RequestQueue([] if cold else warm)):
        pass
    sync(dev)
    setup_s = time.perf_counter() - t0
    before, recorded = dict(dec.stats), dec.graphs.record_seconds  # the warm-up's share, left out below
    reqs = [Request(key=i, tokens=p, max_new_tokens=max_new_tokens) for i, p in enumerate(prompts)]
    tokens, t0 = 0, time.perf_counter()
    for c in dec.run(RequestQueue(reqs)):
        tokens += kept(c.tokens, eos)
    sync(dev)
    s = time.perf_counter() - t0
    st = {k: v - before[k] for k, v in dec.stats.items()}
    record = dec.graphs.record_seconds - recorded
    return {
        "method": "engine"
        + ("" if graphs else "-eager")
        + ("" if attention == "auto" else f"-{attention}")
        + ("-compiled-prefill" if compile_prefill else ""),
        "cold": cold,
        "prefill_seconds": round(st["prefill_seconds"], 2),
        "decode_seconds": round(st["decode_seconds"] - record, 2),
        "record_seconds": round(record, 2),
        "attention": dec.slots.attention,
        "tokens": tokens,
        "seconds": round(s, 2),
        "tokens_per_s": tokens / s,
        "setup_s": round(setup_s, 1),
        "slots": dec.num_slots,
        "batch_tokens": batch_tokens,
        "kv_gib": round(dec.kv_bytes / 2**30, 2),
        "slot_use": round(st["slot_steps_used"] / max(st["steps"] * dec.num_slots, 1), 3),
        "prefill_forwards": st["prefills"],
        "steps": st["steps"],
        "peak_gib": round(torch.cuda.max_memory_allocated(dev) / 2**30, 2) if dev.type == "cuda" else None,
    }


def run_hf_static(model, prompts: list[list[int]], *, eos, pad: int, max_new_tokens: int, batch: int) -> dict:
    dev = next(model.parameters()).device
    order = sorted(range(len(prompts)), key=lambda i: len(prompts[i]))
    kw = dict(do_sample=False, max_new_tokens=max_new_tokens, eos_token_id=sorted(eos), pad_token_id=pad,
              cache_implementation="static")  # fmt: skip

    def one(idx: list[int]) -> int:
        # padded to a power of two (at least 128): a static cache recompiles for every new shape, so a few
        # bucketed lengths keep generate on its compiled graphs
        L = max(128, 1 << (max(len(prompts[i]) for i in idx) - 1).bit_length())
        ids = torch.full((len(idx), L), pad, dtype=torch.long)
        att = torch.zeros_like(ids)
        for b, i in enumerate(idx):
            ids[b, L - len(prompts[i]) :] = torch.tensor(prompts[i])
            att[b, L - len(prompts[i]) :] = 1
        out = model.generate(ids.to(dev), attention_mask=att.to(dev), **kw)[:, L:].tolist()
        return sum(kept(o, eos) for o in out)

    t0 = time.perf_counter()
    for a in range(0, len(order), batch):  # warm-up: generate compiles its forward for each padded length
        if a == 0 or max(map(len, (prompts[i] for i in order[a : a + batch]))) > max(
                len(prompts[i]) for i in order[a - batch : a]):  # fmt: skip
            one(order[a : a + batch][:8])
    sync(dev)
    warm = time.perf_counter() - t0
    tokens, t0 = 0, time.perf_counter()
    for a in range(0, len(order), batch):
        tokens += one(order[a : a + batch])
    sync(dev)
    s = time.perf_counter() - t0
    return {
        "method": "hf-static",
        "tokens": tokens,
        "seconds": round(s, 2),
        "tokens_per_s": tokens / s,
        "warmup_s": round(warm, 1),
        "batch": batch,
    }


def run_hf_cb(model, prompts: list[list[int]], *, eos, pad: int, max_new_tokens: int) -> dict:
    from transformers import GenerationConfig

    cfg = GenerationConfig(max_new_tokens=max_new_tokens, do_sample=False, eos_token_id=sorted(eos), pad_token_id=pad)
    dev = next(model.parameters()).device
    t0 = time.perf_counter()
    out = model.generate_batch(inputs=prompts, generation_config=cfg, progress_bar=False)
    sync(dev)
    s = time.perf_counter() - t0
    tokens = sum(kept(list(r.generated_tokens), eos) for r in out.values())
    return {"method": "hf-cb", "tokens": tokens, "seconds": round(s, 2), "tokens_per_s": tokens / s}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--verifier", default="smollm2")
    ap.add_argument("--prompts", default="sharegpt")
    ap.add_argument("--num-prompts", type=int, default=2048)
    ap.add_argument("--max-new-tokens", type=int, default=512)
    ap.add_argument("--max-seq-len", type=int, default=2048)
    ap.add_argument("--batch-tokens", type=int, default=None, help="the engine's budget (default: its own)")
    ap.add_argument("--hf-batch", type=int, default=256)
    ap.add_argument(
        "--max-prompt-len",
        type=int,
        default=None,
        help="keep prompts of at most this many tokens (one padded length: generate compiles once)",
    )
    ap.add_argument("--methods", help="engine, engine-eager (no CUDA graphs), engine-flex, engine-sdpa, "
                    "engine-compiled-prefill (prefills compiled with symbolic shapes), hf-static, hf-cb (default: "
                    "engine,hf-static,hf-cb; with --smoke engine,hf-static)")  # fmt: skip
    ap.add_argument("--cold", action="store_true", help="the engine's methods without their warm-up: compiling "
                    "and graph recording timed, as one `eyas regenerate` pays them")  # fmt: skip
    ap.add_argument("--dtype", default="bf16")
    ap.add_argument("--smoke", action="store_true", help="CPU, tiny random Llama, few prompts: checks it runs")
    args = ap.parse_args()
    dev = torch.device("cuda" if torch.cuda.is_available() and not args.smoke else "cpu")
    tmp = tempfile.TemporaryDirectory()
    if args.smoke:
        sys.path.insert(0, str(ROOT / "tests"))
        import tiny

        args.verifier = str(tiny.llama(Path(tmp.name) / "tiny").path)
        args.num_prompts, args.max_new_tokens, args.max_seq_len, args.hf_batch = 12, 8, 256, 4
        args.dtype, args.methods = "fp32", args.methods or "engine,hf-static"
        source = [["Tell me about dogs."], ["What is 2+2?"], ["Write some python code please"]] * 4
        texts = [t[0] for t in source]
        torch.set_num_threads(1)
    else:
        args.methods = args.methods or "engine,hf-static,hf-cb"
        ps, _ = load_prompts(args.prompts, max_samples=args.num_prompts, seed=0)
        texts = [p.turns[0] for p in ps]
    dtype = {"bf16": torch.bfloat16, "fp32": torch.float32, "fp16": torch.float16}[args.dtype]
    info = resolve(args.verifier)
    tok = load_tokenizer(info)
    model = build_text_model(info, dtype=dtype, device=dev)
    eos = end_of_turn_ids(tok)
    pad = tok.pad_token_id if tok.pad_token_id is not None else min(eos)
    prompts = [encode_prompt(tok, [{"role": "user", "content": t}]) for t in texts]
    prompts = [p for p in prompts if len(p) + args.max_new_tokens <= args.max_seq_len]  # regenerate's rule
    if args.max_prompt_len:
        prompts = [p for p in prompts if len(p) <= args.max_prompt_len]
    common = {"verifier": info.path, "prompts": args.prompts if not args.smoke else "smoke",
              "num_prompts": len(prompts), "prompt_tokens": sum(map(len, prompts)),
              "max_new_tokens": args.max_new_tokens, "max_seq_len": args.max_seq_len, "dtype": args.dtype,
              "device": torch.cuda.get_device_name(dev) if dev.type == "cuda" else platform.processor() or "cpu",
              "torch": torch.__version__}  # fmt: skip
    import transformers

    common["transformers"] = transformers.__version__
    budget = args.batch_tokens or default_batch_tokens(model, max_len=args.max_seq_len)
    rows = []
    for method in args.methods.split(","):
        try:
            if method in ("engine", "engine-eager", "engine-flex", "engine-sdpa", "engine-compiled-prefill"):
                row = run_engine(model, prompts, eos=eos, max_new_tokens=args.max_new_tokens,
                                 max_len=args.max_seq_len, batch_tokens=budget, graphs=method != "engine-eager",
                                 attention=method.removeprefix("engine-") if method.endswith(("flex", "sdpa"))
                                 else "auto", compile_prefill=method == "engine-compiled-prefill",
                                 cold=args.cold)  # fmt: skip
            elif method == "hf-static":
                row = run_hf_static(model, prompts, eos=eos, pad=pad, max_new_tokens=args.max_new_tokens,
                                    batch=args.hf_batch)  # fmt: skip
            elif method == "hf-cb":
                row = run_hf_cb(model, prompts, eos=eos, pad=pad, max_new_tokens=args.max_new_tokens)
            else:
                raise ValueError(f"unknown method {method}")
        except Exception as e:  # one method failing must not hide the others
            row = {"method": method, "error": f"{type(e).__name__}: {e}", "traceback": traceback.format_exc(limit=8)}
        row.update(common)
        rows.append(row)
        print(json.dumps(row), flush=True)
    ok = {r["method"]: r["tokens_per_s"] for r in rows if "tokens_per_s" in r}
    summary = {"summary": True, **common, "tokens_per_s": ok}
    if "engine" in ok:
        summary.update({f"engine_over_{k}": round(ok["engine"] / v, 2) for k, v in ok.items() if k != "engine"})
    print(json.dumps(summary), flush=True)


if __name__ == "__main__":
    main()
