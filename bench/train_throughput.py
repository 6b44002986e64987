"""eyas train on synthetic features at real draft dimensions: tokens/s, step-time breakdown, peak memory, MFU.

Runs the real ``eyas.stages.train.train`` (offline, from feature shards on disk, through its DataLoader) for ``--steps``
optimizer steps and prints one JSON line. Throughput is measured over the log windows after the first (which
pays for torch.compile); every ``--profile-every``-th step syncs at phase boundaries for the breakdown.

MFU counts the draft's matmul FLOPs per token (the work any EAGLE-3 trainer must do; the verifier-side target
logits and full-vocab argmax are not counted) against a measured bf16 peak (790 TFLOP/s on an H200: an 8192^3 bf16 matmul):

    fc (once, no input grad): 2 * 2 * 3H*H
    per TTT step, x3 for forward + backward: 2 * (2H*(heads + 2*kv)*hd + heads*hd*H + 3*H*I)
    lm_head per TTT step: 2 * H*N, x3 (x2 with --freeze-lm-head: no weight gradient)
    attention per TTT step, x3: 4 * heads*hd * (causal pairs per token (T+1)/2 + k diagonal keys)

    speculators' own setting (for a side-by-side run): --freeze-lm-head --no-full-vocab-accuracy

    python bench/train_throughput.py --preset llama8b --steps 50            # on the GPU
    torchrun --nproc-per-node 2 bench/train_throughput.py --preset llama8b  # DDP scaling; add --dist fsdp for FSDP2
    python bench/train_throughput.py --smoke                                # on CPU: proves it runs
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "src"))

import synthetic  # noqa: E402

PEAK_BF16 = 790e12  # measured bf16 dense matmul (8192^3) on one H200


def draft_flops_per_token(d: synthetic.Dims, *, steps: int, seq_len: int, frozen_head: bool = False) -> float:
    H, hd, I, N = d.hidden, d.head_dim, d.intermediate, d.draft_vocab
    per_step = 2 * (2 * H * (d.heads + 2 * d.kv_heads) * hd + d.heads * hd * H + 3 * H * I)
    attn = sum(4 * d.heads * hd * ((seq_len + 1) / 2 + k) for k in range(steps))
    head = steps * 2 * H * N * (2 if frozen_head else 3)  # a frozen head has no weight gradient to compute
    return 2 * 2 * 3 * H * H + 3 * (steps * per_step + attn) + head


def main(argv: list[str] | None = None) -> dict:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--preset", choices=sorted(synthetic.PRESETS), default="llama8b")
    p.add_argument("--steps", type=int, default=50)
    p.add_argument("--seq-len", type=int, default=2048)
    p.add_argument("--batch-tokens", type=int, default=None, help="tokens per step (default: one sequence)")
    p.add_argument("--ttt-steps", type=int, default=3)
    p.add_argument("--prompt-tokens", type=int, default=64,
                   help="tokens at the start of each synthetic row outside the loss mask (the loss skips what no "
                        "TTT step scores)")  # fmt: skip
    p.add_argument("--optimizer", choices=["adamw", "muon"], default="adamw")
    p.add_argument("--layout", choices=["eagle3", "speculators"], default="eagle3",
                   help="eagle3: all layout flags off (eyas' default); speculators: norm_before_residual, "
                        "norm_before_fc and norm_output on (speculators 0.9's defaults)")  # fmt: skip
    p.add_argument("--full-vocab-accuracy", action=argparse.BooleanOptionalAction, default=True)
    p.add_argument("--freeze-lm-head", action="store_true", help="as speculators 0.9 always does")
    p.add_argument("--gradient-checkpointing", action="store_true")
    p.add_argument(
        "--working-weights",
        action=argparse.BooleanOptionalAction,
        default=None,
        help="bf16 working copies cast once per step, fp32 weight gradients from the matmuls (default: on)",
    )
    p.add_argument("--keep-output", action="store_true",
                   help="keep the run's draft and checkpoints (by default removed after the measurement: a run of "
                        "real dims writes GiBs, enough to fill a GPU machine's 64 GiB disk)")  # fmt: skip
    p.add_argument(
        "--deferred-wgrad",
        action=argparse.BooleanOptionalAction,
        default=None,
        help="each layer weight's gradient accumulated over the TTT steps by its matmuls (default: on "
        "with working weights and without --gradient-checkpointing)",
    )
    p.add_argument(
        "--loader-embeddings",
        action=argparse.BooleanOptionalAction,
        default=None,
        help="the frozen embedding in host memory, looked up by the loader (default: on, offline on CUDA)",
    )
    p.add_argument("--compile", action=argparse.BooleanOptionalAction, default=None)
    p.add_argument("--torch-adamw", action="store_true",
                   help="A/B: torch's fused AdamW step and a separate working-copy refresh (eyas before commit "
                        "b44b6f7) instead of eyas' Triton step")  # fmt: skip
    p.add_argument("--num-workers", type=int, default=4)
    p.add_argument("--dist", choices=["ddp", "fsdp"], default="ddp", help="under torchrun")
    p.add_argument("--log-every", type=int, default=10)
    p.add_argument("--profile-every", type=int, default=20)
    p.add_argument("--workdir", type=Path, default=Path(tempfile.gettempdir()) / "eyas-bench")
    p.add_argument(
        "--torch-profile",
        type=int,
        default=0,
        metavar="K",
        help="run torch.profiler over K steps after the first 15 and print its tables (to stderr)",
    )
    p.add_argument("--smoke", action="store_true", help="tiny dims on CPU, a few steps")
    a = p.parse_args(argv)
    if a.smoke:
        a.preset, a.steps, a.seq_len, a.num_workers, a.log_every, a.profile_every = "smoke", 6, 64, 0, 2, 3
    import torch

    from eyas.stages.train import train

    import os

    if a.torch_adamw:  # FusedAdamW falls back to torch's step where its kernel does not apply; make that everywhere
        from eyas.training.precision import FusedAdamW

        FusedAdamW._fast = lambda self: False

    batch = a.batch_tokens or a.seq_len
    world, rank = int(os.environ.get("WORLD_SIZE", 1)), int(os.environ.get("RANK", 0))
    # one epoch is longer than the run: no validation, no epoch checkpoint inside the measurement
    rows = a.steps * batch * world // a.seq_len + 2
    t0 = time.perf_counter()
    if rank == 0:
        inp = synthetic.inputs(a.workdir, a.preset, rows=rows, seq_len=a.seq_len, prompt=a.prompt_tokens)
    else:  # under torchrun rank 0 writes the inputs; the others wait for them
        where = synthetic.features_dir(a.workdir, a.preset, rows=rows, seq_len=a.seq_len, prompt=a.prompt_tokens)
        while not (where / ".complete").is_file():
            time.sleep(1)
        inp = synthetic.inputs(a.workdir, a.preset, rows=rows, seq_len=a.seq_len, prompt=a.prompt_tokens)
    prep_s = time.perf_counter() - t0
    d = inp["dims"]
    out = (
        a.workdir
        / a.preset
        / f"eyas-{a.optimizer}-{a.layout}-{a.seq_len}x{batch}-w{world}-{os.environ.get('TORCHELASTIC_RUN_ID', int(time.time()))}"
    )
    layout = a.layout == "speculators"
    if torch.cuda.is_available():
        torch.cuda.reset_peak_memory_stats()
    prof = _profiler(a.torch_profile, wait=3 if a.smoke else 15) if a.torch_profile else None
    memory = _memory_probe(skip=2) if torch.cuda.is_available() else None
    t0 = time.perf_counter()
    res = train(verifier=str(inp["verifier"]), data=str(inp["features"]), vocab=str(inp["vocab"]), out=str(out),
                epochs=1, max_steps=a.steps, max_seq_len=a.seq_len, batch_tokens=batch, ttt_steps=a.ttt_steps,
                val_ratio=0.0, num_workers=a.num_workers, log_every=a.log_every, save_every=0,
                profile_every=a.profile_every, optimizer=a.optimizer, full_vocab_accuracy=a.full_vocab_accuracy,
                compile=a.compile, dist=a.dist, freeze_lm_head=a.freeze_lm_head,
                gradient_checkpointing=a.gradient_checkpointing, working_weights=a.working_weights, loader_embeddings=a.loader_embeddings,
                deferred_wgrad=a.deferred_wgrad, norm_before_residual=layout, norm_before_fc=layout, norm_output=layout)  # fmt: skip
    wall = time.perf_counter() - t0
    if prof is not None:
        prof.__exit__(None, None, None)
    flops = draft_flops_per_token(d, steps=a.ttt_steps, seq_len=a.seq_len, frozen_head=a.freeze_lm_head)
    tps = res["tokens_per_s"]
    result = {
        "bench": "eyas-train", "preset": a.preset, "dims": d.__dict__, "seq_len": a.seq_len, "world_size": world,
        "dist": a.dist if world > 1 else None,
        "tokens_per_step": batch * world,
        "ttt_steps": a.ttt_steps, "optimizer": a.optimizer, "layout": a.layout, "prompt_tokens": a.prompt_tokens,
        "full_vocab_accuracy": a.full_vocab_accuracy, "freeze_lm_head": a.freeze_lm_head,
        "gradient_checkpointing": a.gradient_checkpointing, "working_weights": res["working_weights"],
        "loader_embeddings": res["loader_embeddings"], "deferred_wgrad": res["deferred_wgrad"],
        "adamw": "torch" if a.torch_adamw else "eyas", "memory": memory, "steps": res["steps"], "tokens_per_s": round(tps, 1),
        "step_ms": round(1e3 * batch * world / tps, 2) if tps else None, "ms_per_step_profiled": res.get("ms_per_step"),
        "peak_memory_gib": round(max(res["peak_memory_bytes"], memory.pop("run_peak")[0] if memory else 0) / 2**30, 2)
        if "peak_memory_bytes" in res else None,
        "draft_gflop_per_token": round(flops / 1e9, 3), "tflops": round(tps * flops / 1e12, 1),
        "mfu_vs_790": round(tps * flops / (PEAK_BF16 * world), 4), "wall_s": round(wall, 1), "inputs_s": round(prep_s, 1),
        "device": torch.cuda.get_device_name() if torch.cuda.is_available() else "cpu",
        "torch": torch.__version__,
    }  # fmt: skip
    if rank == 0:
        if not a.keep_output:
            import shutil

            shutil.rmtree(out, ignore_errors=True)
        print(json.dumps(result))
    return result


def _memory_probe(*, skip: int) -> dict:
    """Where the peak goes: per optimizer step (after the first ``skip``), the memory held when the step starts
    (weights, optimizer state, the prefetched batch), the most the step adds on top (activations, gradients,
    temporaries), and in which phase of the step the peak falls (``peak_in_forward_gib`` etc.: the allocator's
    peak between the trainer's phase marks), filled in as the run goes; no device sync."""
    import torch

    from eyas.stages import train as train_mod

    found = {"at_step_start_gib": 0.0, "step_adds_gib": 0.0, "params_gib": 0.0, "optimizer_state_gib": 0.0}
    step, mark = train_mod.Trainer.train_step, train_mod._Timer.mark
    seen, run_peak, step_peak = [0], [0], [0]
    gib = lambda n: round(n / 2**30, 3)  # noqa: E731

    def take() -> int:
        """The allocator's peak since the last call (then reset), folded into the run's and the step's."""
        peak = torch.cuda.max_memory_allocated()
        run_peak[0], step_peak[0] = max(run_peak[0], peak), max(step_peak[0], peak)
        torch.cuda.reset_peak_memory_stats()
        return peak

    def probed_mark(self, name):
        peak = take()
        if seen[0] > skip:
            key = f"peak_in_{name}_gib"
            found[key] = max(found.get(key, 0.0), gib(peak))
        mark(self, name)

    def probed(self, item, timer):
        seen[0] += 1
        take()
        start, step_peak[0] = torch.cuda.memory_allocated(), 0
        step(self, item, timer)
        take()
        if seen[0] > skip:
            found["at_step_start_gib"] = max(found["at_step_start_gib"], gib(start))
            found["step_adds_gib"] = max(found["step_adds_gib"], gib(step_peak[0] - start))
            found["params_gib"] = gib(
                sum(
                    t.numel() * t.element_size() for t in (*self.model.parameters(), *self.model.buffers()) if t.is_cuda
                )
            )  # on the device (not a table the loader keeps on the host)
            found["optimizer_state_gib"] = gib(sum(t.numel() * t.element_size() for opt in self.optimizers
                                                   for st in opt.state.values() for t in st.values()
                                                   if torch.is_tensor(t)))  # fmt: skip

    train_mod.Trainer.train_step = probed
    train_mod._Timer.mark = probed_mark
    found["run_peak"] = run_peak
    return found


def _trace_events(prof) -> list[dict]:
    """The profiler's trace events (its Chrome trace, read back once for every analysis below)."""
    import os

    path = tempfile.mktemp(suffix=".json")
    prof.export_chrome_trace(path)
    try:
        with open(path) as f:
            return json.load(f)["traceEvents"]
    finally:
        os.unlink(path)


def _gpu_gaps(ev: list[dict], steps: int, *, min_us: float = 5.0, top: int = 25) -> dict:
    """From the profiler's trace events: GPU busy time per step (all streams), and the idle gaps on the busiest
    stream summed by the host operation that launched the kernel after each gap (innermost op and its two
    parents): where the host, not the GPU, set the pace."""
    import bisect
    import collections

    gpu = [e for e in ev if e.get("ph") == "X" and e.get("cat") in ("kernel", "gpu_memcpy", "gpu_memset")]
    busy, end = 0.0, -1.0
    for e in sorted(gpu, key=lambda e: e["ts"]):
        a, b = e["ts"], e["ts"] + e["dur"]
        busy += max(0.0, b - max(a, end))
        end = max(end, b)
    span = (max(e["ts"] + e["dur"] for e in gpu) - min(e["ts"] for e in gpu)) if gpu else 0.0
    per_stream = collections.Counter()
    for e in gpu:
        per_stream[e.get("tid")] += e["dur"]
    main = per_stream.most_common(1)[0][0] if per_stream else None
    ks = sorted((e for e in gpu if e.get("tid") == main), key=lambda e: e["ts"])
    launch = {
        e["args"]["correlation"]: e
        for e in ev
        if e.get("cat") in ("cuda_runtime", "cuda_driver") and "correlation" in e.get("args", {})
    }
    cpu = sorted((e for e in ev if e.get("ph") == "X" and e.get("cat") in ("cpu_op", "user_annotation")),
                 key=lambda e: e["ts"])  # fmt: skip
    starts = [e["ts"] for e in cpu]
    by_op: collections.Counter = collections.Counter()
    total = 0.0
    for prev, k in zip(ks, ks[1:]):
        gap = k["ts"] - (prev["ts"] + prev["dur"])
        if gap < min_us:
            continue
        total += gap
        ln = launch.get(k.get("args", {}).get("correlation"))
        chain = []
        if ln is not None:
            t, i = ln["ts"], bisect.bisect_right(starts, ln["ts"]) - 1
            while i >= 0 and len(chain) < 3 and t - cpu[i]["ts"] < 5e6:
                c = cpu[i]
                if (
                    c["ts"] + c["dur"] >= t
                    and c.get("tid") == ln.get("tid")
                    and not c["name"].startswith("ProfilerStep")
                ):
                    chain.append(c["name"][:60])
                i -= 1
        by_op[" < ".join(chain) or "?"] += gap
    return {
        "steps": steps,
        "gpu_busy_ms_per_step": round(busy / 1e3 / steps, 2),
        "gpu_span_ms_per_step": round(span / 1e3 / steps, 2),
        "idle_on_main_stream_ms_per_step": round(total / 1e3 / steps, 2),
        "idle_by_launching_op_ms_per_step": {k: round(v / 1e3 / steps, 3) for k, v in by_op.most_common(top)},
    }


def _host_ops(ev: list[dict], steps: int, *, top: int = 30) -> dict:
    """From the profiler's trace events: the operators the host dispatches itself per step, i.e. ATen ops not called
    from inside another ATen op or a compiled graph (on CUDA each is one or more kernel launches, and the
    step is host-bound), counted by name, and the compiled-graph calls; with the host's time per step. Runs on
    any device, so host work can be cut and counted on a CPU machine."""
    import collections

    ops = sorted((e for e in ev if e.get("ph") == "X" and e.get("cat") in ("cpu_op", "user_annotation")),
                 key=lambda e: (e["ts"], -e["dur"]))  # fmt: skip
    # inside these the host does not dispatch on its own (a loader without workers runs in this process: its
    # ops are the loader's, which runs in worker processes in a real run)
    outer = ("aten::", "prims::", "## Call CompiledFxGraph", "enumerate(DataLoader)")
    eager, graphs = collections.Counter(), 0
    stacks: dict = collections.defaultdict(list)  # per thread: the enclosing events
    for e in ops:
        st = stacks[e.get("tid")]
        while st and st[-1]["ts"] + st[-1]["dur"] <= e["ts"]:
            st.pop()
        name = e["name"]
        if not any(x["name"].startswith(outer) for x in st):
            if name.startswith("## Call CompiledFxGraph"):
                graphs += 1
            elif name.startswith("aten::"):
                eager[name] += 1
        st.append(e)
    host = [e["dur"] for e in ev if e.get("ph") == "X" and str(e.get("name", "")).startswith("ProfilerStep")]
    return {
        "steps": steps,
        "host_ms_per_step": round(sum(host) / 1e3 / max(len(host), 1), 2),
        "eager_ops_per_step": round(sum(eager.values()) / steps, 1),
        "compiled_graph_calls_per_step": round(graphs / steps, 1),
        "eager_ops_by_name_per_step": {k: round(v / steps, 1) for k, v in eager.most_common(top)},
    }


def _profiler(active: int, *, wait: int):
    """torch.profiler over ``active`` optimizer steps after ``wait + 2``, stepped by the trainer's own step
    (wrapped here, so eyas needs no profiling hooks); prints kernel and operator tables to stderr at the end."""
    import torch
    from torch.profiler import ProfilerActivity, profile, schedule

    from eyas.stages import train as train_mod

    acts = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if torch.cuda.is_available() else [])

    def report(p) -> None:
        ka = p.key_averages()
        dev = "cuda_time_total" if torch.cuda.is_available() else "cpu_time_total"
        print(f"=== torch.profiler: {active} steps, by {dev}", file=sys.stderr)
        print(ka.table(sort_by=dev, row_limit=45, max_name_column_width=70), file=sys.stderr)
        print("=== by cpu_time_total", file=sys.stderr)
        print(ka.table(sort_by="cpu_time_total", row_limit=25, max_name_column_width=70), file=sys.stderr)
        ev = _trace_events(p)
        if torch.cuda.is_available():
            print("=== where the GPU waits for the host", file=sys.stderr)
            print(json.dumps(_gpu_gaps(ev, active)), file=sys.stderr)
        print("=== what the host dispatches", file=sys.stderr)
        print(json.dumps(_host_ops(ev, active)), file=sys.stderr)

    prof = profile(activities=acts, schedule=schedule(wait=wait, warmup=2, active=active, repeat=1),
                   on_trace_ready=report)  # fmt: skip
    prof.__enter__()
    step = train_mod.Trainer.train_step

    def stepped(self, item, timer):
        step(self, item, timer)
        prof.step()

    train_mod.Trainer.train_step = stepped
    return prof


if __name__ == "__main__":
    main()
