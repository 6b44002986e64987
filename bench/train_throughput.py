"""eyas train on synthetic features at real draft dimensions: tokens/s, step-time breakdown, peak memory, MFU.

Runs the real ``eyas.train.train`` (offline, from feature shards on disk, through its DataLoader) for ``--steps``
optimizer steps and prints one JSON line. Throughput is measured over the log windows after the first (which
pays for torch.compile); every ``--profile-every``-th step syncs at phase boundaries for the breakdown.

MFU counts the draft's matmul FLOPs per token (the work any EAGLE-3 trainer must do; the verifier-side target
logits and full-vocab argmax are not counted) against a measured bf16 peak (790 TFLOP/s on an H200, GPU.md):

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

PEAK_BF16 = 790e12  # measured bf16 dense matmul on one H200 (shared/GPU.md)


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
    p.add_argument("--optimizer", choices=["adamw", "muon"], default="adamw")
    p.add_argument("--layout", choices=["eagle3", "speculators"], default="eagle3",
                   help="eagle3: all layout flags off (eyas' default); speculators: norm_before_residual, "
                        "norm_before_fc and norm_output on (speculators 0.9's defaults)")  # fmt: skip
    p.add_argument("--full-vocab-accuracy", action=argparse.BooleanOptionalAction, default=True)
    p.add_argument("--freeze-lm-head", action="store_true", help="as speculators 0.9 always does")
    p.add_argument("--gradient-checkpointing", action="store_true")
    p.add_argument("--working-weights", action=argparse.BooleanOptionalAction, default=None,
                   help="eyas' working weights and in-matmul fp32 gradient accumulation (default: on in one process)")
    p.add_argument("--compile", action=argparse.BooleanOptionalAction, default=None)
    p.add_argument("--num-workers", type=int, default=4)
    p.add_argument("--dist", choices=["ddp", "fsdp"], default="ddp", help="under torchrun")
    p.add_argument("--log-every", type=int, default=10)
    p.add_argument("--profile-every", type=int, default=20)
    p.add_argument("--workdir", type=Path, default=Path(tempfile.gettempdir()) / "eyas-bench")
    p.add_argument("--torch-profile", type=int, default=0, metavar="K",
                   help="run torch.profiler over K steps after the first 15 and print its tables (to stderr)")
    p.add_argument("--smoke", action="store_true", help="tiny dims on CPU, a few steps")
    a = p.parse_args(argv)
    if a.smoke:
        a.preset, a.steps, a.seq_len, a.num_workers, a.log_every, a.profile_every = "smoke", 6, 64, 0, 2, 3
    import torch

    from eyas.train import train

    import os

    batch = a.batch_tokens or a.seq_len
    world, rank = int(os.environ.get("WORLD_SIZE", 1)), int(os.environ.get("RANK", 0))
    # one epoch is longer than the run: no validation, no epoch checkpoint inside the measurement
    rows = a.steps * batch * world // a.seq_len + 2
    t0 = time.perf_counter()
    if rank == 0:
        inp = synthetic.inputs(a.workdir, a.preset, rows=rows, seq_len=a.seq_len)
    else:  # under torchrun rank 0 writes the inputs; the others wait for them
        while not (a.workdir / a.preset / f"features-{rows}x{a.seq_len}" / ".complete").is_file():
            time.sleep(1)
        inp = synthetic.inputs(a.workdir, a.preset, rows=rows, seq_len=a.seq_len)
    prep_s = time.perf_counter() - t0
    d = inp["dims"]
    out = a.workdir / a.preset / f"eyas-{a.optimizer}-{a.layout}-{a.seq_len}x{batch}-w{world}-{os.environ.get('TORCHELASTIC_RUN_ID', int(time.time()))}"
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
                gradient_checkpointing=a.gradient_checkpointing, working_weights=a.working_weights,
                norm_before_residual=layout, norm_before_fc=layout, norm_output=layout)  # fmt: skip
    wall = time.perf_counter() - t0
    if prof is not None:
        prof.__exit__(None, None, None)
    flops = draft_flops_per_token(d, steps=a.ttt_steps, seq_len=a.seq_len, frozen_head=a.freeze_lm_head)
    tps = res["tokens_per_s"]
    result = {
        "bench": "eyas-train", "preset": a.preset, "dims": d.__dict__, "seq_len": a.seq_len, "world_size": world,
        "dist": a.dist if world > 1 else None,
        "tokens_per_step": batch * world,
        "ttt_steps": a.ttt_steps, "optimizer": a.optimizer, "layout": a.layout,
        "full_vocab_accuracy": a.full_vocab_accuracy, "freeze_lm_head": a.freeze_lm_head,
        "gradient_checkpointing": a.gradient_checkpointing, "working_weights": a.working_weights,
        "memory": memory, "steps": res["steps"], "tokens_per_s": round(tps, 1),
        "step_ms": round(1e3 * batch * world / tps, 2) if tps else None, "ms_per_step_profiled": res.get("ms_per_step"),
        "peak_memory_gib": round(max(res["peak_memory_bytes"], memory.pop("run_peak")[0] if memory else 0) / 2**30, 2)
        if "peak_memory_bytes" in res else None,
        "draft_gflop_per_token": round(flops / 1e9, 3), "tflops": round(tps * flops / 1e12, 1),
        "mfu_vs_790": round(tps * flops / (PEAK_BF16 * world), 4), "wall_s": round(wall, 1), "inputs_s": round(prep_s, 1),
        "device": torch.cuda.get_device_name() if torch.cuda.is_available() else "cpu",
        "torch": torch.__version__,
    }  # fmt: skip
    if rank == 0:
        print(json.dumps(result))
    return result


def _memory_probe(*, skip: int) -> dict:
    """Where the peak goes: per optimizer step (after the first ``skip``), the memory held when the step starts
    (weights, optimizer state, the prefetched batch) and the most the step adds on top (activations, gradients,
    temporaries), filled in as the run goes; no device sync."""
    import torch

    from eyas import train as train_mod

    found = {"at_step_start_gib": 0.0, "step_adds_gib": 0.0, "params_gib": 0.0, "optimizer_state_gib": 0.0}
    step, seen, run_peak = train_mod.Trainer.train_step, [0], [0]
    gib = lambda n: round(n / 2**30, 3)  # noqa: E731

    def probed(self, item, timer):
        seen[0] += 1
        start = torch.cuda.memory_allocated()
        run_peak[0] = max(run_peak[0], torch.cuda.max_memory_allocated())  # the run's peak survives the resets
        torch.cuda.reset_peak_memory_stats()
        step(self, item, timer)
        if seen[0] > skip:
            found["at_step_start_gib"] = max(found["at_step_start_gib"], gib(start))
            found["step_adds_gib"] = max(found["step_adds_gib"], gib(torch.cuda.max_memory_allocated() - start))
            found["params_gib"] = gib(sum(p.numel() * p.element_size() for p in self.model.parameters())
                                      + sum(b.numel() * b.element_size() for b in self.model.buffers()))
            found["optimizer_state_gib"] = gib(sum(t.numel() * t.element_size() for opt in self.optimizers
                                                   for st in opt.state.values() for t in st.values()
                                                   if torch.is_tensor(t)))  # fmt: skip

    train_mod.Trainer.train_step = probed
    found["run_peak"] = run_peak
    return found


def _profiler(active: int, *, wait: int):
    """torch.profiler over ``active`` optimizer steps after ``wait + 2``, stepped by the trainer's own step
    (wrapped here, so eyas needs no profiling hooks); prints kernel and operator tables to stderr at the end."""
    import torch
    from torch.profiler import ProfilerActivity, profile, schedule

    from eyas import train as train_mod

    acts = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if torch.cuda.is_available() else [])

    def report(p) -> None:
        ka = p.key_averages()
        dev = "cuda_time_total" if torch.cuda.is_available() else "cpu_time_total"
        print(f"=== torch.profiler: {active} steps, by {dev}", file=sys.stderr)
        print(ka.table(sort_by=dev, row_limit=45, max_name_column_width=70), file=sys.stderr)
        print("=== by cpu_time_total", file=sys.stderr)
        print(ka.table(sort_by="cpu_time_total", row_limit=25, max_name_column_width=70), file=sys.stderr)

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
