"""`eyas extract` throughput against the bare verifier forward, measured in the same process on the same batches.

Goal (issue 4): extraction at >= 0.9x the tokens/s of the bare forward (`model.model` on the same
length-sorted, right-padded batches, same dtype, no hooks, nothing kept). Both runs use one loaded model.

    # on a GPU, SmolLM2-135M-Instruct's GGUF, synthetic ShareGPT-like rows:
    PYTHONPATH=src python3 bench/extract_throughput.py --verifier /path/SmolLM2-135M-Instruct.Q4_1.gguf
    # with real prepared rows, and features written to RAM instead of disk:
    PYTHONPATH=src python3 bench/extract_throughput.py --verifier ... --data runs/demo/prepared --out /dev/shm/x
    # anywhere (CPU, tiny random Llama), to check that the script works:
    PYTHONPATH=src python3 bench/extract_throughput.py --smoke

Runs, in order: first passes of the bare forward over unseen batch shapes (torch's default attention backends,
then the order extraction uses), warm-up, bare forward, capture only (forward + hooks + gather + device-to-host copy, nothing
written; bf16 and fp8), extract bf16 and fp8 into each --out, bare forward again. The batches are those `eyas
extract` forms (rows sorted by length inside windows of shards), run with extraction's attention backend order,
and each dtype is compared with the bare forward
on its own batches (fp8 shards hold twice the tokens, so its windows pad less). Prints one JSON line: tokens/s of
each, the ratios against the mean of the two bare runs, bytes per token as written, the write bandwidth, and
where the time went (waits for a free writer, the final drain). Two extraction rates: end to end, and over the
forward loop only (waits for writers included): the steady state of a long run, whose one fixed cost, writing
the last window's shards after the last forward (``drain_s``), does not grow with the data.
"""

from __future__ import annotations

import argparse
import contextlib
import hashlib
import json
import platform
import shutil
import sys
import tempfile
import time
from pathlib import Path

import numpy as np
import torch

try:
    import eyas  # noqa: F401
except ImportError:  # run from a checkout without installing
    sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "src"))

from eyas.data.lengths import plan_batches
from eyas.stages.extract import (
    WINDOW_SHARDS,
    Extractor,
    InMemoryRows,
    default_shard_tokens,
    plan_shards,
    plan_windows,
)
from eyas.training.batches import PreparedRows
from eyas.verifier.info import check_aux_layer_ids as check_layer_ids
from eyas.verifier.load import HiddenStateCapture, build_text_model, resolve, varying_shape_attention


def synthetic_rows(n: int, vocab: int, *, median: int, max_len: int, seed: int = 0) -> InMemoryRows:
    """ShareGPT-like rows: log-normal lengths (median ``median``, clipped to [16, max_len]), random ids, loss
    mask on the second half."""
    rng = np.random.default_rng(seed)
    lengths = np.clip(rng.lognormal(np.log(median), 0.8, n).astype(int), 16, max_len)
    return InMemoryRows([(rng.integers(0, vocab, t), np.arange(t) >= t // 2) for t in lengths])


def tiny_verifier(where: Path) -> Path:
    from transformers import LlamaConfig, LlamaForCausalLM

    cfg = LlamaConfig(vocab_size=512, hidden_size=64, intermediate_size=128, num_hidden_layers=8,
                      num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=1024)  # fmt: skip
    torch.manual_seed(0)
    LlamaForCausalLM(cfg).save_pretrained(where)
    return where


def random_smollm2(where: Path) -> Path:
    """A randomly initialised verifier of SmolLM2-135M-Instruct's exact architecture (its config.json values:
    30 layers, H 576, 9/3 heads, MLP 1536, vocab 49152, tied), saved in bf16: the same work per token as the
    real model, without carrying its GGUF to the machine."""
    from transformers import LlamaConfig, LlamaForCausalLM

    cfg = LlamaConfig(vocab_size=49152, hidden_size=576, intermediate_size=1536, num_hidden_layers=30,
                      num_attention_heads=9, num_key_value_heads=3, max_position_embeddings=8192, rms_norm_eps=1e-5,
                      rope_theta=100000.0, tie_word_embeddings=True, bos_token_id=1, eos_token_id=2)  # fmt: skip
    torch.manual_seed(0)
    LlamaForCausalLM(cfg).to(torch.bfloat16).save_pretrained(where)
    return where


def sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def batches(source, windows):
    """The batches `Extractor.window` runs: each window's rows sorted by length and packed together."""
    for w in windows:
        rows = source.fetch(w[0][0], w[-1][1])
        for batch in plan_batches(np.array([len(i) for i, _ in rows]), EX.batch_tokens):
            yield rows, batch


@torch.inference_mode()
def bare(source, windows, attention: str = "eyas") -> tuple[float, float]:
    """tokens/s of the backbone alone on the same padded batches (ids built the same way), and the fraction of
    the tokens it ran that were padding. ``attention``: "eyas" runs SDPA with the backend order extraction uses
    (:func:`eyas.verifier.load.varying_shape_attention`), "default" with torch's own."""
    tokens, forward_tokens, t0 = 0, 0, time.perf_counter()
    for rows, batch in batches(source, windows):
        ids = EX.padded(rows, batch)
        with varying_shape_attention(EX.device) if attention == "eyas" else contextlib.nullcontext():
            EX.backbone(input_ids=ids, use_cache=False)
        tokens += sum(len(rows[r][0]) for r in batch)
        forward_tokens += ids.numel()
    sync(EX.device)
    return tokens / (time.perf_counter() - t0), 1 - tokens / max(forward_tokens, 1)


def capture_only(extractor: Extractor, source, windows) -> float:
    """Everything but the writing: forward, capture, gather, and the copies into the shards' host buffers."""
    cap = HiddenStateCapture(extractor.model, extractor.layer_ids)
    tokens, t0 = 0, time.perf_counter()
    try:
        for w in windows:
            for job in extractor.window(cap, source, w, skip=()):
                for ev in job.ready:
                    ev.synchronize()
                extractor.buffers.release(job.buffer)
            tokens += int(source.lengths[w[0][0] : w[-1][1]].sum())
    finally:
        cap.remove()
    return tokens / (time.perf_counter() - t0)


def extract_run(extractor: Extractor, source, windows, out: Path) -> dict:
    """One extraction into ``out``; each shard is deleted as soon as it is durably written (its bytes
    counted), so a long run fits in RAM or on a small disk. Returns the run's figures."""
    shutil.rmtree(out, ignore_errors=True)
    out.mkdir(parents=True)
    cuda = extractor.device.type == "cuda"
    host_stats = getattr(torch.cuda, "host_memory_stats", dict)  # (absent from older torch: no host figures)
    before = (torch.cuda.memory_stats(extractor.device), host_stats()) if cuda else None
    extractor.run(source, windows, out, progress=False, on_shard=lambda e: (out / e["file"]).unlink())
    st = extractor.stats
    allocs = {}
    if cuda:  # allocations made during the run: device segments (cudaMalloc), pinned host blocks
        dev, host = torch.cuda.memory_stats(extractor.device), host_stats()
        allocs = {"device_mallocs": dev.get("num_device_alloc", 0) - before[0].get("num_device_alloc", 0),
                  "host_allocs": host.get("num_host_alloc", 0) - before[1].get("num_host_alloc", 0),
                  "host_alloc_ms": (host.get("host_alloc_time.total", 0)
                                    - before[1].get("host_alloc_time.total", 0)) / 1e3,
                  "pinned_GiB": host.get("allocated_bytes.current", 0) / 2**30}  # fmt: skip
    shutil.rmtree(out, ignore_errors=True)
    return {"tokens_per_s": st.tokens / st.seconds, "loop_tokens_per_s": st.loop_tokens_per_s,
            "bytes_per_token": st.bytes / st.tokens, "seconds": st.seconds, "waited_s": st.waited_s,
            "drain_s": st.drain_s, "padding": st.padding, "write_GBps_per_thread": st.write_GBps_per_thread,
            "write_GBps": st.bytes / st.seconds / 1e9, "slowest_window_s": max(st.window_loop_s),
            "median_window_s": float(np.median(st.window_loop_s)), **allocs}  # fmt: skip


def hash_GBps(nbytes: int = 256 << 20) -> float:
    """One thread's sha256 rate on this host (the writers hash every byte they write)."""
    data = memoryview(np.random.default_rng(0).integers(0, 255, nbytes, dtype=np.uint8)).cast("B")
    t0 = time.perf_counter()
    hashlib.sha256(data).digest()
    return nbytes / (time.perf_counter() - t0) / 1e9


def main() -> None:
    global EX
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument(
        "--verifier",
        default="smollm2",
        help="checkpoint dir, .gguf file, 'smollm2' (the installed GGUF) or 'random-smollm2' (its "
        "architecture, random weights)",
    )
    ap.add_argument("--data", help="prepared rows (`eyas prepare` output); default: synthetic rows")
    ap.add_argument("--rows", type=int, default=4000, help="synthetic rows (default 4000, about 2.5M tokens)")
    ap.add_argument("--median-len", type=int, default=450)
    ap.add_argument("--max-len", type=int, default=2048)
    ap.add_argument("--batch-tokens", type=int, default=None, help="default: eyas extract's (32768 on CUDA)")
    ap.add_argument("--writer-threads", type=int, default=None)
    ap.add_argument(
        "--out",
        action="append",
        default=None,
        help="where shards are written (each deleted once written); repeat to measure several places "
        "(RAM, local disk) in one run; default: a temp dir",
    )
    ap.add_argument("--device", default=None)
    ap.add_argument("--no-capture-only", action="store_true", help="skip the capture-only pass (shorter long runs)")
    ap.add_argument("--order", default="bf16,fp8", help="the dtypes extracted, in this order")
    ap.add_argument("--passes", type=int, default=1, help="extract each dtype this many times (first-pass effects)")
    ap.add_argument("--smoke", action="store_true", help="CPU, tiny random Llama, few rows: checks the script runs")
    args = ap.parse_args()

    tmp = Path(tempfile.mkdtemp(prefix="eyas-bench-"))
    try:
        if args.smoke:
            args.verifier, args.device, args.rows, args.median_len = str(tiny_verifier(tmp / "tiny")), "cpu", 48, 40
        if args.verifier == "random-smollm2":
            args.verifier = str(random_smollm2(tmp / "random-smollm2"))
        device = torch.device(args.device or ("cuda" if torch.cuda.is_available() else "cpu"))
        info = resolve(args.verifier)
        if args.data:
            source = PreparedRows(args.data)
        else:
            source = synthetic_rows(args.rows, info.vocab_size, median=args.median_len, max_len=args.max_len)
        compute = torch.bfloat16 if device.type == "cuda" else torch.float32
        t0 = time.perf_counter()
        model = build_text_model(info, dtype=compute, device=device)
        load_s = time.perf_counter() - t0
        batch_tokens = args.batch_tokens or (32768 if device.type == "cuda" else 8192)
        layer_ids = check_layer_ids(info.aux_layer_ids, info.num_hidden_layers)

        def make(dtype):
            return Extractor(
                model, layer_ids=layer_ids, dtype=dtype, batch_tokens=batch_tokens, writer_threads=args.writer_threads
            )

        EX = make("bf16")
        per_shard = {d: default_shard_tokens(source.lengths, info.hidden_size, d) for d in ("bf16", "fp8")}
        windows = {
            d: plan_windows(plan_shards(source.lengths, per_shard[d])) for d in ("bf16", "fp8")
        }  # fmt: skip  (windows of shards, as `eyas extract` runs them)
        outs = [Path(o) for o in args.out] if args.out else [tmp / "features"]
        # First passes over batch shapes never seen: what one pass over a dataset meets. With torch's default
        # backends an H200 runs cuDNN attention, which plans every new shape (bench/gpu/cold_shapes.py); the
        # order extraction uses has no per-shape setup. The first also warms the CUDA context and allocator.
        first = {"default": bare(source, windows["bf16"], "default")[0], "eyas": bare(source, windows["fp8"])[0]}
        bare(source, windows["bf16"])  # warm-up of the order extraction uses on bf16's shapes
        ex8 = make("fp8")
        ex8.buffers = EX.buffers
        capture_only(EX, source, windows["bf16"][:1])
        capture_only(ex8, source, windows["fp8"][:1])  # (fp8's first pass allocates its small pinned scale blocks)
        # warm-up of the writer path: as many (pinned) shard buffers as can be in flight, allocated once
        extract_run(EX, source, windows["bf16"][: -(-(EX.writer_threads + WINDOW_SHARDS) // WINDOW_SHARDS)], outs[0])
        # each dtype against the bare forward on its own batches: fp8 shards hold twice the tokens, so its windows
        # sort more rows together and pad less
        bare1 = {d: bare(source, w)[0] for d, w in windows.items()}
        cap = {} if args.no_capture_only else {"bf16": capture_only(EX, source, windows["bf16"]),
                                                "fp8": capture_only(ex8, source, windows["fp8"])}  # fmt: skip
        extractors = {"bf16": EX, "fp8": ex8}
        order = args.order.split(",")
        runs = {str(o): {f"{d}#{p}" if args.passes > 1 else d: extract_run(extractors[d], source, windows[d], o)
                         for p in range(1, args.passes + 1) for d in order} for o in outs}  # fmt: skip
        bare2, padding = {}, {}
        for d, w in windows.items():
            bare2[d], padding[d] = bare(source, w)
        base = {d: (bare1[d] + bare2[d]) / 2 for d in windows}
        default_warm = bare(source, windows["bf16"], "default")[0]  # its shapes seen once, in the first pass
        for where in runs.values():
            for name, r in where.items():
                d = name.split("#")[0]
                r["ratio"] = round(r["tokens_per_s"] / base[d], 3)
                r["ratio_loop"] = round(r["loop_tokens_per_s"] / base[d], 3)
                for k, v in r.items():
                    r[k] = round(v, 3) if isinstance(v, float) and v < 100 else round(v)
        result = {
            "bench": "extract_throughput",
            "verifier": info.path,
            "hidden_size": info.hidden_size,
            "layers": layer_ids,
            "device": torch.cuda.get_device_name(device) if device.type == "cuda" else platform.processor() or "cpu",
            "compute_dtype": str(compute).removeprefix("torch."),
            "rows": len(source.lengths),
            "tokens": int(source.lengths.sum()),
            "padding_fraction": {d: round(p, 4) for d, p in padding.items()},
            "batch_tokens": batch_tokens,
            "writer_threads": EX.writer_threads,
            "shards": {d: sum(len(w) for w in v) for d, v in windows.items()},
            "window_shards": WINDOW_SHARDS,
            "model_load_s": round(load_s, 1),
            "sha256_GBps_one_thread": round(hash_GBps(), 2),
            "bare_tokens_per_s": {d: [round(bare1[d]), round(bare2[d])] for d in windows},
            "bare_first_pass_tokens_per_s": {k: round(v) for k, v in first.items()},  # default: bf16's, eyas: fp8's
            "bare_default_attention_warm_bf16": round(default_warm),
            "capture_only_tokens_per_s": {d: round(v) for d, v in cap.items()},
            "ratio_capture_only": {d: round(v / base[d], 3) for d, v in cap.items()},
            "extract": runs,  # per output dir and dtype; "ratio" end to end, "ratio_loop" the steady state
            "torch": torch.__version__,
            "smoke": args.smoke,
        }
        print(json.dumps(result))
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


EX: Extractor

if __name__ == "__main__":
    main()
