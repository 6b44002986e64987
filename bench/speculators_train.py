"""speculators 0.9.0's own trainer on the same synthetic features as bench/train_throughput.py, for a side-by-side.

The eyas feature shards are re-written in speculators' offline layout (``eyas.data.features.write_speculators``:
``hidden_states/hs_{i}.safetensors`` + an Arrow dataset), the same head-only verifier and draft vocab are passed,
and ``speculators.train.cli.main`` runs in this process for ``--steps`` optimizer steps. Two modes (DESIGN.md,
"Known traps"):

- ``defaults``: what its users get (Muon, norm_before_residual / norm_before_fc / norm_output, sliding window
  2048), only ``--loss-implementation eager`` changed: its fused Triton loss crashes under torch 2.11 / triton 3.6
  (dynamo: "ListVariable ... already tracked for mutation" in its kernel configs);
- ``matched``: eyas' settings: AdamW (lr 1e-4, no decay), all layout flags off, full attention.

Throughput is read the way eyas' is: tokens between its metric records (one device sync each, every
``--log-freq`` steps) over the wall time between them, skipping the first window (compilation). Peak memory is
``torch.cuda.max_memory_allocated``. One JSON line is printed.

Needs speculators on the path: on the GPU machine install the wheels listed in docs/BENCHMARKS.md with
``pip install --no-index --no-deps --target /tmp/site .whl/*.whl`` and run with ``PYTHONPATH=/tmp/site:src``.
``--smoke`` (CPU) only builds the inputs and runs speculators' ``--dry-run`` (it trains on CUDA only).
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


def main(argv: list[str] | None = None) -> dict:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--preset", choices=sorted(synthetic.PRESETS), default="llama8b")
    p.add_argument("--mode", choices=["defaults", "matched"], default="matched")
    p.add_argument("--steps", type=int, default=50)
    p.add_argument("--seq-len", type=int, default=2048)
    p.add_argument("--ttt-steps", type=int, default=3)
    p.add_argument("--log-freq", type=int, default=10)
    p.add_argument("--workdir", type=Path, default=Path(tempfile.gettempdir()) / "eyas-bench")
    p.add_argument("--smoke", action="store_true")
    p.add_argument("--keep-output", action="store_true",
                   help="keep the run's checkpoints (by default removed after the measurement: a run of real dims "
                        "writes GiBs, enough to fill a GPU machine's 64 GiB disk)")  # fmt: skip
    a = p.parse_args(argv)
    if a.smoke:
        a.preset, a.steps, a.seq_len = "smoke", 6, 64
    import torch

    from eyas.data.features import write_speculators

    rows = a.steps + 2  # same inputs as bench/train_throughput.py at one sequence per step
    inp = synthetic.inputs(a.workdir, a.preset, rows=rows, seq_len=a.seq_len)
    d = inp["dims"]
    spec_data = inp["features"].parent / f"speculators-{rows}x{a.seq_len}"
    if not (spec_data / ".complete").is_file():
        write_speculators(inp["features"], out=spec_data)
        (spec_data / ".complete").write_text("")
    out = a.workdir / a.preset / f"speculators-{a.mode}-{int(time.time())}"
    argv_spec = [
        "--speculator-type", "eagle3", "--verifier-name-or-path", str(inp["verifier"]), "--data-path", str(spec_data),
        "--save-path", str(out / "checkpoints"), "--log-dir", str(out / "logs"), "--total-seq-len", str(a.seq_len),
        "--epochs", "1", "--max-steps", str(a.steps), "--log-freq", str(a.log_freq), "--ttt-steps", str(a.ttt_steps),
        "--d2t-path", str(inp["vocab"] / "d2t.npy"), "--t2d-path", str(inp["vocab"] / "t2d.npy"),
        "--draft-vocab-size", str(d.draft_vocab), "--on-missing", "raise", "--loss-implementation", "eager",
        "--train-data-ratio", str((rows - 1) / rows), "--seed", "0", "--mask-token-id", "0",  # no tokenizer here
    ]  # fmt: skip
    if a.mode == "matched":
        argv_spec += ["--optimizer", "adamw", "--lr", "1e-4", "--weight-decay", "0", "--no-norm-before-residual",
                      "--no-norm-before-fc", "--no-norm-output", "--full-attention-indices", "0",
                      "--num-workers", "4"]  # fmt: skip
    if a.smoke:
        argv_spec += ["--dry-run", "--draft-attn-impl", "sdpa", "--hidden-states-dtype", "float32"]

    from speculators.train import trainer as spec_trainer
    from speculators.train.cli import main as spec_main
    from speculators.train.config import TrainConfig

    records: list[tuple[float, dict]] = []
    info = spec_trainer.metric_logger.info

    def capture(msg, *args, **kwargs):
        if isinstance(msg, dict) and "train" in msg:
            records.append((time.perf_counter(), msg))
        return info(msg, *args, **kwargs)

    spec_trainer.metric_logger.info = capture
    if torch.cuda.is_available():
        torch.cuda.reset_peak_memory_stats()
    t0 = time.perf_counter()
    spec_main(TrainConfig.resolve(argv_spec))
    wall = time.perf_counter() - t0
    tokens_per_step = a.seq_len  # every row is seq_len long and one row fills a batch
    windows = [(records[i][1]["global_step"] - records[i - 1][1]["global_step"], records[i][0] - records[i - 1][0])
               for i in range(2, len(records))]  # fmt: skip
    steps_w, secs_w = sum(s for s, _ in windows), sum(t for _, t in windows)
    profiles = [r["profile"] for _, r in records[1:] if r.get("profile")]
    med = lambda k: sorted(p[k] for p in profiles)[len(profiles) // 2] if profiles else None  # noqa: E731
    result = {
        "bench": "speculators-train", "version": __import__("importlib.metadata").metadata.version("speculators"), "mode": a.mode,
        "preset": a.preset, "seq_len": a.seq_len, "tokens_per_step": tokens_per_step, "ttt_steps": a.ttt_steps,
        "steps": records[-1][1]["global_step"] + 1 if records else 0,
        "tokens_per_s": round(steps_w * tokens_per_step / secs_w, 1) if secs_w else None,
        "profiled_tokens_per_s_median": med("tokens_per_s"),
        "ms_per_step_profiled": {k: med(f"{k}_ms") for k in ("fetch", "fwd", "bwd", "opt", "step")},
        "peak_memory_gib": round(torch.cuda.max_memory_allocated() / 2**30, 2) if torch.cuda.is_available() else None,
        "wall_s": round(wall, 1), "argv": argv_spec, "torch": torch.__version__,
    }  # fmt: skip
    if a.smoke:  # speculators trains on CUDA only: check that its dataset reads our layout, row by row
        from speculators.train.data import ArrowDataset

        ds = ArrowDataset(max_len=a.seq_len, datapath=spec_data, on_missing="raise", train_ratio=(rows - 1) / rows,
                          hidden_states_dtype=torch.float32)  # fmt: skip
        item = ds[0]
        assert item["hidden_states"].shape == (a.seq_len, 3 * d.hidden), item["hidden_states"].shape
        assert item["verifier_last_hidden_states"].shape == (a.seq_len, d.hidden)
        assert int(item["loss_mask"].sum()) == a.seq_len - min(64, a.seq_len // 8)
        result["dry_run_checkpoint"] = sorted(p.name for p in (out / "checkpoints").iterdir())
        result["dataset_row_ok"] = True
    if not a.keep_output:
        import shutil

        shutil.rmtree(out, ignore_errors=True)
    print(json.dumps(result))
    return result


if __name__ == "__main__":
    main()
