"""Where batch-1 decoding's time goes: one plain step and one speculative round (eval's loops, eyas.engine.speculative;
the round both round by round and as one graph, ``fused``) timed over whole answers with the host's clock, and
one of each profiled (kernel count and GPU time, top kernels), per slot-attention implementation. The draft is untrained unless --draft: a round then accepts about
nothing, so what it measures is the cost of a round; the speedup at a given tau is ``tau * step / round``.

    # GPU (a random-weight SmolLM2 from bench/gpu/generate.sh random, or the GGUF):
    PYTHONPATH=src:/tmp/site python3 bench/decode_profile.py --verifier /tmp/smol-random --attention sdpa,flex
    # anywhere: checks the script runs (tiny random Llama, CPU)
    PYTHONPATH=src python3 bench/decode_profile.py --smoke

With ``--freeze off,on`` each attention runs twice, the verifier's layers and the draft compiled without and with
inductor's freezing (weights as constants: q/k/v and gate/up one matmul each; eyas.verifier.compile.compile_frozen),
then a line of on/off ratios (time, kernels, the memory its build took); ``auto`` (the default) is what eval does.

With ``--merge off,on`` each attention (and freeze) runs twice, the verifier's and the draft's q/k/v and gate/up
as separate matmuls and merged into one each (eval's default where the layers compile: eyas.verifier.merged; the
merged run on copies of both models, so the unmerged ones stay as loaded), then a line of on/off ratios.

With ``--draft-attention sdpa,matmul`` each attention runs once per draft-cache attention: SDPA (eval's) or two
matmuls around a masked softmax (whether a step's few queries read the draft's whole cache faster as GEMMs).

With ``--inductor "default;max_autotune_gemm=True"`` (variants split by ``;``, each ``key=value`` settings of
``torch._inductor.config`` split by ``,``) each attention and freeze runs once per variant, everything compiled
again under that variant's settings (``torch._dynamo.reset()`` between them): e.g. whether inductor's Triton GEMM
templates, whose epilogues fuse the residual adds and activations that follow a matmul, beat cuBLAS's kernels at
one row, where a step is bound by its kernel count. Each row names its variant. A variant's settings apply over
eyas' own for its fixed-shape compiles too (eyas.verifier.compile.FIXED_SHAPE_OPTIONS): ``default`` is eyas as
it runs, ``combo_kernels=False`` eyas without inductor's combo kernels.

With ``--blas default,cublaslt`` each variant runs once per BLAS library of its matmuls
(``torch.backends.cuda.preferred_blas_library``): whether cuBLASLt's heuristics pick faster kernels than
cuBLAS' for a one-row GEMM, about half of a step's GPU time at batch 1 (docs/BENCHMARKS.md).

With ``--norm-ahead off,on`` each variant runs twice: each verifier layer's closing residual add in its own
kernel, then computed with the next layer's input norm (eyas' default at fixed shapes: eyas.verifier.norm_ahead),
each row naming which.

With ``--decode-mlp off,on,all`` each variant runs three times: each verifier layer's MLP block (the residual add,
the norm, gate/up, SiLU, down, the closing add) as inductor compiles it, then as eyas' two Triton kernels in a
plain step's one row (eyas' default: eyas.verifier.compile.DECODE_MLP_ROWS), then in a verification's K + 1 rows
too (eyas.verifier.decode_mlp; with the norm handed ahead only, where they run), each row naming which; ``nopdl``
is ``on`` with the kernels launched without programmatic dependent launch.

With ``--outer off,on`` each variant runs twice: the verifier's modules outside its decoder layers (the rotary
table and the final norm: eyas.verifier.compile.OUTER_MODULES) and plain decoding's pick and state updates
run eagerly, then compiled with the layers (eyas' default), each row naming which. With ``--norm-ahead on`` the
final norm is computed with the last layer either way (only the rotary table and the pick then differ).

With ``--batched ROWS,...`` it profiles instead the batched step of ``eyas regenerate``
(:class:`eyas.engine.generate.BatchDecoder`): every slot busy at each position ``--live`` lists, one step
replayed as a graph, timed and profiled per row count and live length: what a step costs as
the batch and the keys grow, and where that time goes.

    PYTHONPATH=src:/tmp/site python3 bench/decode_profile.py --verifier /tmp/smol-random --batched 256,1024,2048 \
        --live 256,1024

With ``--prefill TOKENS,...`` it profiles instead a prefill of ``eyas regenerate`` (``BatchDecoder._prefill``:
prompts of ``--prefill-len`` tokens each, as many as fill TOKENS, right-padded and packed into one eager forward):
milliseconds and tokens/s by the host's clock beside the GPU's busy time and kernel count, so a prefill's cost
reads as host-bound (busy time far below the wall time: fewer, larger prefills pay) or as the GPU's own work.

    PYTHONPATH=src:/tmp/site python3 bench/decode_profile.py --verifier /tmp/smol-random --prefill 2048,8192,32768 \
        --prefill-len 256

Prints one JSON line per attention implementation (or per row count and live length, or per prefill size).
"""

from __future__ import annotations

import argparse
import contextlib
import copy
import functools
import itertools
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

from eyas.stages.evaluate import random_draft, setup  # noqa: E402
from eyas.evaluation.measure import Runners  # noqa: E402
from eyas.verifier.load import varying_shape_attention  # noqa: E402
from eyas.engine.generate import BatchDecoder  # noqa: E402
from eyas.engine.slots import slot_attention  # noqa: E402
from eyas.engine.speculative import plain_generate, speculative_generate  # noqa: E402
from eyas.verifier.compile import OUTER_MODULES as _OUTER  # noqa: E402
from eyas.verifier.decode_mlp import MAX_ROWS as _MLP_MAX_ROWS  # noqa: E402


#: the longest wait between two kernels of a graph counted as launch latency, not as the GPU waiting on the host
SHORT_GAP_US = 5.0


def kernels(fn, steps: int, top: int = 5) -> dict:
    """``fn`` under torch's profiler: GPU kernels and their time per step, the top five by time, the kernels by
    how many a step launches (what fusing would take away: a step is bound by its kernel count), and every kernel
    a step launches fewer than one a layer of (the work outside the layers' compiled code: what compiling or
    caching it would save, named); and where the GPU waits between kernels: the gaps of its timeline summed per
    step, those of at most :data:`SHORT_GAP_US` (a kernel's launch latency inside a graph) apart from the longer
    ones (the GPU waiting on the host: a sync, a graph's launch), and the host's time in ``cudaGraphLaunch``."""
    from torch.profiler import ProfilerActivity, profile

    acts = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if torch.cuda.is_available() else [])
    with profile(activities=acts) as prof:
        fn()
    ev = [e for e in prof.events() if e.device_type == torch.autograd.DeviceType.CUDA]
    by: dict[str, float] = {}
    count: dict[str, int] = {}
    for e in ev:
        by[e.name] = by.get(e.name, 0.0) + e.device_time
        count[e.name] = count.get(e.name, 0) + 1
    most = sorted(count.items(), key=lambda x: -x[1])[:12]
    top = sorted(by.items(), key=lambda x: -x[1])[:top]
    # a kernel launched a few times a step, not once per layer (SmolLM2 has 30): the rotary table, final norm,
    # head, pick, block masks and position bookkeeping around the layers
    few = sorted((k, n) for k, n in count.items() if n / steps < 8)
    spans = sorted((e.time_range.start, e.time_range.end) for e in ev)  # us
    gaps = [max(0.0, b[0] - a[1]) for a, b in zip(spans, spans[1:])]
    launch = sum(e.cpu_time_total for e in prof.events() if e.name.startswith("cudaGraphLaunch"))
    return {"kernels_per_step": len(ev) / steps, "gpu_ms_per_step": sum(by.values()) / 1e3 / steps,
            "short_gaps_ms_per_step": round(sum(g for g in gaps if g <= SHORT_GAP_US) / 1e3 / steps, 4),
            "long_gaps_ms_per_step": round(sum(g for g in gaps if g > SHORT_GAP_US) / 1e3 / steps, 4),
            "graph_launch_ms_per_step": round(launch / 1e3 / steps, 4),
            "top_kernels_ms_per_step": {k[:80]: round(v / 1e3 / steps, 4) for k, v in top},
            "most_launched_per_step": {k[:80]: round(n / steps, 1) for k, n in most},
            "few_per_step": {k[:100]: round(n / steps, 2) for k, n in few}}  # fmt: skip


def timed(run, n: int) -> tuple[float, float, dict]:
    """``run(k)`` (k repeats of one operation, synchronised) once cold, then ``n`` times timed and ``n`` times
    profiled -> (the cold run's seconds, milliseconds per repeat, :func:`kernels` per repeat)."""
    t0 = time.perf_counter()
    run(1)
    warmup = time.perf_counter() - t0
    t0 = time.perf_counter()
    run(n)
    ms = 1e3 * (time.perf_counter() - t0) / n
    return warmup, ms, kernels(lambda: run(n), n, top=8)


def batched(model, rows: int, live: int, *, attention: str, steps: int = 20) -> dict:
    """One step of :class:`BatchDecoder` with ``rows`` busy slots each at position ``live`` (keys of earlier
    positions are whatever the buffers hold: the cost does not depend on them), replayed as its graph."""
    dev = next(model.parameters()).device
    dec = BatchDecoder(model, eos_ids=set(), max_len=live + 64, batch_tokens=rows * (live + 64), attention=attention)
    dec.pos.fill_(live)
    dec.tok.random_(0, model.config.vocab_size)
    dec.slots.keys = dec.slots.key_length(live + 2)
    sync = torch.cuda.synchronize if dev.type == "cuda" else (lambda: None)

    R = dec.num_slots  # every row busy: the step over all of them
    step = functools.partial(dec._step, R)

    def run(n: int) -> None:
        for _ in range(n):
            dec.graphs.run(("step", R, dec.slots.keys), step)
        sync()

    with torch.no_grad(), slot_attention(model, dec.slots), varying_shape_attention(dev):
        warmup, ms, prof = timed(run, steps)
        # the step's tokens against one eager SDPA step from the same state (random weights: near ties may flip)
        got = dec.graphs.run(("step", R, dec.slots.keys), step).clone()
        used, dec.slots.attention = dec.slots.attention, "sdpa"
        agree = (got == step()).float().mean().item()
        dec.slots.attention = used
    return {"rows": rows, "live": live, "attention": dec.slots.attention, "warmup_s": round(warmup, 1),
            "ms_per_step": round(ms, 3), "tokens_per_s": round(rows / ms * 1e3), "kv_gib": round(dec.kv_bytes / 2**30, 2),
            "agree_with_sdpa": round(agree, 4), "step_profile": prof}  # fmt: skip


def prefill(model, tokens: int, length: int, *, repeats: int = 5) -> dict:
    """One prefill of :class:`BatchDecoder` (its ``_prefill``, eager as ``eyas regenerate`` runs it): ``tokens //
    length`` random prompts of ``length`` tokens into as many slots, timed over ``repeats`` by the host's clock
    (synchronised) and profiled. Each repeat writes the same keys and values into the same slots."""
    from eyas.engine.generate import Request

    dev = next(model.parameters()).device
    B = max(1, tokens // length)
    dec = BatchDecoder(model, eos_ids=set(), max_len=length + 8, batch_tokens=B * (length + 8),
                       prefill_tokens=B * length)  # fmt: skip
    vocab = model.get_input_embeddings().num_embeddings
    g = torch.Generator().manual_seed(0)
    ids = torch.randint(min(100, vocab // 4), vocab, (B, length), generator=g).tolist()
    batch = [(s, Request(key=s, tokens=ids[s], max_new_tokens=1)) for s in range(B)]
    sync = torch.cuda.synchronize if dev.type == "cuda" else (lambda: None)

    def run(n: int) -> None:
        for _ in range(n):
            dec._prefill(batch)
        sync()

    with torch.no_grad(), slot_attention(model, dec.slots), varying_shape_attention(dev):
        warmup, ms, prof = timed(run, repeats)
    busy = prof["gpu_ms_per_step"]
    return {"prefill_tokens": B * length, "prompts": B, "prompt_len": length, "warmup_s": round(warmup, 2),
            "ms_per_prefill": round(ms, 3), "tokens_per_s": round(B * length / ms * 1e3),
            "gpu_busy_ms": round(busy, 3), "gpu_busy_share": round(busy / ms, 3) if ms else None,
            "prefill_profile": prof}  # fmt: skip


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--verifier", default="smollm2")
    ap.add_argument("--draft", default="random")
    ap.add_argument("--attention", default="sdpa,flex")
    ap.add_argument("--prompt-len", type=int, default=200)
    ap.add_argument("--new-tokens", type=int, default=256)
    ap.add_argument("--draft-tokens", type=int, default=3)
    ap.add_argument("--max-len", type=int, default=0,
                    help="positions the caches hold (default, and at least: the prompt, the new tokens and a round); "
                    "eval sizes them to its longest conversation, 986 on MT-Bench at 256 new tokens, and the "
                    "draft's cache attention reads all of them")  # fmt: skip
    ap.add_argument("--draft-layers", default="1", help="random drafts of these layer counts (comma-separated): "
                    "what a layer more costs a round (train --num-layers)")  # fmt: skip
    ap.add_argument("--batched", default="", help="row counts: profile the batched step instead")
    ap.add_argument("--live", default="256", help="with --batched: each row's position (comma-separated)")
    ap.add_argument("--prefill", default="", help="prompt tokens a prefill (comma-separated): profile "
                    "regenerate's prefill instead")  # fmt: skip
    ap.add_argument("--prefill-len", type=int, default=256, help="with --prefill: each prompt's length")
    ap.add_argument("--freeze", default="auto", help="off, on, auto, or several (off,on): compile frozen or not")
    ap.add_argument("--merge", default="on", help="off, on, or both (off,on): q/k/v and gate/up merged or not")
    ap.add_argument(
        "--draft-attention",
        default="sdpa",
        help="the draft cache's attention (comma-separated): "
        "sdpa (eval's), matmul (eyas.draft.attention._matmul_attention)",
    )
    ap.add_argument("--inductor", default="default", help="inductor settings to compare: 'default;KEY=VALUE,...;...'")
    ap.add_argument("--outer", default="on", help="off, on, or both (off,on): the verifier's rotary table, final "
                    "norm and plain step's pick compiled with its layers or run eagerly")  # fmt: skip
    ap.add_argument(
        "--norm-ahead",
        default="on",
        help="off, on, or both (off,on): each layer's closing residual "
        "add computed with the next layer's norm (eyas.verifier.norm_ahead), or in its own kernel",
    )
    ap.add_argument("--decode-mlp", default="on", help="off, on, all, nopdl, or several (off,on): each layer's "
                    "MLP block as inductor compiles it, or as eyas' two Triton kernels (eyas.verifier.decode_mlp) "
                    "in one-row forwards (on, eyas' default) or in verifications too (all), launched with "
                    "programmatic dependent launch where the GPU has it, or without (nopdl: one row)")  # fmt: skip
    ap.add_argument("--blas", default="default", help="the BLAS library of the matmuls (comma-separated): default "
                    "(torch's: cuBLAS), cublaslt, cublas (torch.backends.cuda.preferred_blas_library)")  # fmt: skip
    ap.add_argument("--smoke", action="store_true")
    args = ap.parse_args()
    if unknown := set(args.decode_mlp.split(",")) - set(DECODE_MLP_ROWS):
        ap.error(f"--decode-mlp takes {', '.join(DECODE_MLP_ROWS)}, got {', '.join(sorted(unknown))}")
    tmp = tempfile.TemporaryDirectory()
    device = None
    if args.smoke:
        sys.path.insert(0, str(ROOT / "tests"))
        import tiny

        tiny.llama(Path(tmp.name) / "tiny")
        args.verifier, device = str(Path(tmp.name) / "tiny"), "cpu"
        args.prompt_len, args.new_tokens = 20, 16
        if args.batched:
            args.batched, args.live = "4", "20"
        if args.prefill:
            args.prefill, args.prefill_len = "40,80", 20
    if args.prefill:
        env = setup(verifier=args.verifier, draft="random", device=device, dtype="auto", seed=0)
        for tokens in map(int, args.prefill.split(",")):
            try:
                row = prefill(env["model"], tokens, args.prefill_len)
            except Exception as e:  # one size failing (memory) must not hide the others
                row = {"prefill_tokens": tokens, "prompt_len": args.prefill_len, "error": f"{type(e).__name__}: {e}"}
            row["gpu"] = torch.cuda.get_device_name() if torch.cuda.is_available() else "cpu"
            print(json.dumps(row), flush=True)
            torch.cuda.empty_cache() if torch.cuda.is_available() else None
        return
    if args.batched:
        env = setup(verifier=args.verifier, draft="random", device=device, dtype="auto", seed=0)
        for attention in args.attention.split(","):
            for rows in map(int, args.batched.split(",")):
                for live in map(int, args.live.split(",")):
                    try:
                        row = batched(env["model"], rows, live, attention=attention)
                    except Exception as e:  # one shape failing (memory) must not hide the others
                        row = {"rows": rows, "live": live, "attention": attention, "error": f"{type(e).__name__}: {e}"}
                    print(json.dumps(row), flush=True)
                    torch.cuda.empty_cache() if torch.cuda.is_available() else None
        return
    env = setup(verifier=args.verifier, draft=args.draft, device=device, dtype="auto", seed=0)
    K, n = args.draft_tokens, args.new_tokens
    vocab = env["model"].get_input_embeddings().num_embeddings  # a small verifier's too (tests' tiny ones)
    prompt = torch.randint(min(100, vocab // 4), min(20000, vocab), (args.prompt_len,),
                           generator=torch.Generator().manual_seed(0)).tolist()  # fmt: skip
    freezes = {"off": False, "on": True, "auto": None}
    layer_counts = [int(x) for x in args.draft_layers.split(",")]
    if args.draft != "random" and layer_counts != [1]:
        raise SystemExit("--draft-layers builds random drafts: leave --draft at random")
    merges = args.merge.split(",")
    # merging is in place: both ways on one model need a copy merged, taken before anything compiles (a compiled
    # layer's forward stays bound to the layer it was compiled from, which a deep copy does not rebind)
    both = {"off", "on"} <= set(merges)

    def to_merge(m):  # the model (or draft) the merged runs use
        return copy.deepcopy(m) if both else m

    merged_model = to_merge(env["model"])
    merged_draft = to_merge(env["draft"]) if args.draft != "random" else None  # random drafts: one a layer count
    blas_default = torch.backends.cuda.preferred_blas_library().name.lower()  # "cublas" on CUDA builds
    for (variant, settings), outer, blas, ahead, mlp in itertools.product(
            inductor_variants(args.inductor), args.outer.split(","), args.blas.split(","),
            args.norm_ahead.split(","), args.decode_mlp.split(",")):  # fmt: skip
        torch._dynamo.reset()  # every compiled layer and draft forward compiles again, under these settings
        try:  # a setting this torch does not have is one row saying so, not the end of the others
            with torch._inductor.config.patch(settings):
                pass
        except Exception as e:
            print(json.dumps({"inductor": variant, "error": f"{type(e).__name__}: {e}"}), flush=True)
            continue
        # a matmul's library is picked when it runs, not when it compiles (at::cuda::blas::gemm); graphs recorded
        # under another library are recorded again (profile_loops builds its loops anew)
        want = blas_default if blas == "default" else blas.lower()
        if torch.backends.cuda.preferred_blas_library().name.lower() != want:
            try:
                torch.backends.cuda.preferred_blas_library(want)
            except RuntimeError as e:  # a library this build lacks (cuBLASLt on a CPU build)
                print(json.dumps({"inductor": variant, "blas": blas, "error": f"{type(e).__name__}: {e}"}), flush=True)
                continue
        set_outer(outer == "on")
        set_norm_ahead(ahead == "on", decode_mlp=mlp, pdl=mlp != "nopdl")
        with torch._inductor.config.patch(settings), fixed_shape_options(settings):
            for layers in layer_counts:
                if args.draft == "random":
                    env["draft"] = random_draft(env["info"], seed=0, device=env["device"], dtype=env["dtype"],
                                                num_layers=layers)  # fmt: skip
                    merged_draft = to_merge(env["draft"])
                for attention, draft_attention in itertools.product(
                    args.attention.split(","), args.draft_attention.split(",")
                ):
                    for d in filter(None, (env["draft"], merged_draft)):  # the cache eval's rounds make reads it
                        d.attn_implementation = draft_attention
                    tag = {"inductor": variant, "outer": outer, "blas": blas, "norm_ahead": ahead,
                           "decode_mlp": mlp, "draft_layers": layers, "draft_attention": draft_attention}  # fmt: skip
                    rows = {}
                    for freeze in args.freeze.split(","):
                        for merge in merges:
                            on = merge == "on"
                            rows[freeze, merge] = profile_loops(
                                env, prompt, attention=attention, n=n, K=K, freeze=freezes[freeze], merge=on,
                                model=merged_model if on else None, draft=merged_draft if on else None,
                                max_len=args.max_len)  # fmt: skip
                            print(json.dumps({**tag, "freeze": freeze, "merge": merge, **rows[freeze, merge]}),
                                  flush=True)  # fmt: skip
                        if {(freeze, "off"), (freeze, "on")} <= rows.keys():
                            print(json.dumps({**tag, "freeze": freeze,
                                              **on_off_ratios(rows[freeze, "off"], rows[freeze, "on"], "merge")}),
                                  flush=True)  # fmt: skip
                    for merge in merges:
                        if {("off", merge), ("on", merge)} <= rows.keys():
                            print(json.dumps({**tag, "merge": merge,
                                              **on_off_ratios(rows["off", merge], rows["on", merge], "freeze")}),
                                  flush=True)  # fmt: skip


def set_outer(on: bool) -> None:
    """What ``--outer`` compares: the verifier's modules outside its layers (eyas.verifier.compile.OUTER_MODULES)
    and plain decoding's pick compiled with the layers (eyas' default), or run eagerly."""
    import eyas.verifier.compile as compile_
    from eyas.engine.generate import SequenceDecoder

    compile_.OUTER_MODULES = _OUTER if on else ()
    SequenceDecoder.compile_tail = on


def set_norm_ahead(on: bool, *, decode_mlp: str = "on", pdl: bool = True) -> None:
    """What ``--norm-ahead`` compares: each verifier layer's closing add computed with the next layer's norm
    (eyas' default, eyas.verifier.norm_ahead), or in its own kernel; and ``--decode-mlp``: with the norm ahead,
    each layer's MLP block as eyas' two kernels (eyas.verifier.decode_mlp) in no forward (``off``), in one-row
    forwards (``on``, ``nopdl``) or in every forward they fit (``all``), launched with programmatic dependent launch
    (``pdl``, where the GPU has it) or without."""
    import eyas.verifier.compile as compile_
    import eyas.verifier.decode_mlp as decode_mlp_

    compile_.NORM_AHEAD = on
    compile_.DECODE_MLP_ROWS = DECODE_MLP_ROWS[decode_mlp]
    decode_mlp_.PDL = pdl


#: --decode-mlp's settings: the most rows a forward may have for its layers to run eyas' MLP kernels
DECODE_MLP_ROWS = {"off": 0, "on": 1, "all": _MLP_MAX_ROWS, "nopdl": 1}


@contextlib.contextmanager
def fixed_shape_options(settings: dict):
    """A variant's settings over eyas' own for its fixed-shape compiles (eyas.verifier.compile.FIXED_SHAPE_OPTIONS,
    which ``torch.compile(options=...)`` applies over the global config the variant patches): ``default`` is
    eyas' settings, ``combo_kernels=False`` one of them undone."""
    import eyas.verifier.compile as compile_

    before = compile_.FIXED_SHAPE_OPTIONS
    compile_.FIXED_SHAPE_OPTIONS = {**before, **settings}
    try:
        yield
    finally:
        compile_.FIXED_SHAPE_OPTIONS = before


def inductor_variants(spec: str) -> list[tuple[str, dict]]:
    """``--inductor``'s variants -> ``[(name, torch._inductor.config settings)]``; ``default``: none."""
    import ast

    out = []
    for variant in filter(None, (v.strip() for v in spec.split(";"))):
        settings = {}
        for item in variant.split(","):
            if item.strip() == "default":
                continue
            key, _, value = item.partition("=")
            if not value:
                raise SystemExit(f"--inductor: give KEY=VALUE, got {item!r}")
            settings[key.strip()] = ast.literal_eval(value.strip())
        out.append((variant, settings))
    return out


def on_off_ratios(off: dict, on: dict, what: str) -> dict:
    """``what`` (freeze or merge) on against off, one attention: on / off of each time, kernel count and the
    memory the build took."""
    out = {"compare": f"{what} on/off", "attention": on["attention"], "frozen": on.get("frozen"),
           "draft_frozen": on.get("draft_frozen"), "merged": on.get("merged")}  # fmt: skip
    for key in ("plain_ms_per_token", "spec_ms_per_round", "spec_fused_ms_per_round", "warmup_s", "build_mib"):
        if key in on and key in off and off[key]:
            out[key] = round(on[key] / off[key], 4)
    for key in ("plain_step_profile", "spec_round_profile", "spec_fused_round_profile"):
        if key in on and key in off:
            for k in ("kernels_per_step", "gpu_ms_per_step"):
                out[f"{key}_{k}"] = round(on[key][k] / off[key][k], 4) if off[key][k] else None
                out[f"{key}_{k}_off_on"] = [off[key][k], on[key][k]]
    out["build_mib_off_on"] = [off.get("build_mib"), on.get("build_mib")]
    out["same_plain_tokens"] = off.get("plain_tokens_hash") == on.get("plain_tokens_hash")
    return out


def profile_loops(env, prompt: list[int], *, attention: str, freeze: bool | None, n: int, K: int,
                  merge: bool = True, model=None, draft=None, max_len: int = 0) -> dict:  # fmt: skip
    """One attention's plain step and speculative rounds (round by round and fused), timed and profiled, on
    ``model`` and ``draft`` (default: ``env``'s)."""
    dev = env["device"]
    model, draft = model if model is not None else env["model"], draft if draft is not None else env["draft"]
    row = {"attention": attention, "gpu": torch.cuda.get_device_name(dev) if dev.type == "cuda" else "cpu",
           "torch": torch.__version__, "prompt_len": len(prompt), "new_tokens": n, "draft_tokens": K,
           "max_len": max(max_len, len(prompt) + n + K + 2)}  # fmt: skip
    try:
        if dev.type == "cuda":  # what the build holds on the GPU: caches, graphs, and frozen copies of weights
            import gc

            gc.collect()
            torch.cuda.empty_cache()
            before = torch.cuda.memory_allocated(dev)
        t0 = time.perf_counter()
        r = Runners.build(model, draft, draft_tokens=[K], max_len=row["max_len"],
                          attention=attention, fused_rounds=True, freeze=freeze, merge=merge)  # fmt: skip  # both loops' graphs
        row["warmup_s"] = round(time.perf_counter() - t0, 1)
        row["frozen"], row["draft_frozen"] = r.base.graphs.freeze, r.draft.frozen
        row["merged"] = hasattr(model.base_model.layers[0].self_attn, "merged_qkv_proj")
        if dev.type == "cuda":
            row["build_mib"] = round((torch.cuda.memory_allocated(dev) - before) / 2**20, 1)
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
    return row


if __name__ == "__main__":
    main()
