"""Gather an ``eyas run`` folder (``bench/gpu/quality.sh``'s run) into the one JSON
``bench/results/smollm2-quality.json`` holds.

Everything comes from the files the stages wrote (their manifests, the eval reports under ``eval/``,
``run_log.jsonl``), so the results file is never typed by hand:

    python bench/quality_results.py /tmp/q --out bench/results/smollm2-quality.json

Per prompt set (``mt-bench``, ``humaneval``): tau, acceptance per position, speedup, num_prompts and lossless at
each K measured; the regenerate rate; the training runs' validation and training tau; minutes per stage (summed
over the calls a stage took); the device and versions eval recorded.
"""

from __future__ import annotations

import argparse
import json
import sys
from collections.abc import Sequence
from pathlib import Path

#: eval report file (``eyas run`` names an ``[[eval]]`` entry's report after its prompts) -> its prompt set
REPORTS = {"mt-bench.json": "mt-bench", "mt_bench.json": "mt-bench", "humaneval.json": "humaneval",
           "HumanEval.json": "humaneval"}  # fmt: skip


def _read(path: Path) -> dict | None:
    return json.loads(path.read_text()) if path.is_file() else None


def _by_k(report: dict) -> dict[str, dict]:
    """``{K: measurement}`` of one eval report (one K, or several under ``by_draft_tokens``)."""
    if "by_draft_tokens" in report:
        return dict(report["by_draft_tokens"])
    return {str(report["draft_tokens"]): report}


def _measurement(m: dict, report: dict) -> dict:
    keys = ("tau", "acceptance_per_position", "conditional_acceptance_per_position", "speedup", "tokens_per_s",
            "baseline_tokens_per_s", "lossless", "rounds", "generated_tokens", "num_turns", "tau_by_turn",
            "tau_by_category")  # fmt: skip
    out = {k: m.get(k) for k in keys}
    out["num_prompts"] = report.get("num_prompts")
    out["mismatches"] = len(m.get("mismatches") or [])
    return out


def _val_curve(draft: Path) -> list[dict]:
    """Validation tau at each point train validated (each epoch's end): what the epochs are chosen by."""
    path = draft / "metrics.jsonl"
    rows = [json.loads(x) for x in path.read_text().splitlines() if x.strip()] if path.is_file() else []
    return [{"step": r["step"], "epoch": r["epoch"], "tau": r["tau"]} for r in rows if r.get("split") == "val"]


def gather(run: Path, *, expect: Sequence[str] = ("mt-bench", "humaneval"), gpu: str | None = None) -> dict:
    """The results of the run folder ``run`` (``$R`` of quality.sh)."""
    selfp, regen, prep, vocab = (_read(run / d / "manifest.json") for d in ("prompts", "regenerated", "prepared",
                                                                           "vocab"))  # fmt: skip
    result: dict = {"what": "SmolLM2-135M-Instruct from nothing to a measured draft: eyas run "
                            "configs/smollm2-gpu.toml (bench/gpu/quality.sh)"}  # fmt: skip
    if selfp:
        result["prompts"] = {
            **{
                k: selfp["settings"].get(k) for k in ("num_prompts", "temperature", "top_p", "max_new_tokens", "topics")
            },  # fmt: skip
            **selfp["outputs"],
            **selfp.get("timing", {}),
        }
    if regen:
        o, t = regen["outputs"], regen.get("timing", {})
        result["regenerate"] = {
            **{
                k: regen["settings"].get(k) for k in ("max_samples", "max_turns", "max_new_tokens", "max_seq_len")
            },  # fmt: skip
            "data": regen["inputs"]["data"]["source"],
            "loop_policy": regen["settings"].get("loops"),
            "loop_copies": regen["settings"].get("loop_copies", 1),  # recorded only when set
            "repetition_penalty": regen["settings"].get("repetition_penalty"),
            **{
                k: o.get(k)
                for k in (
                    "prompts",
                    "conversations",
                    "answers",
                    "new_tokens",
                    "cut_at_max_new_tokens",
                    "loops",
                    "loop_tokens",
                    "trimmed_tokens",
                    "dropped_answers",
                )
            },  # fmt: skip
            "seconds": t.get("seconds"),
            "new_tokens_per_s": t.get("new_tokens_per_s"),
            "engine": t.get("engine"),  # where its time went: steps, prefills, recording, the caller's work
        }
    if prep:
        result["prepare"] = {k: prep["outputs"].get(k) for k in ("rows", "tokens", "masked_tokens")}
        # --loop-tails (recorded only when set: scored otherwise) and what it took out of the loss
        result["prepare"]["loop_tails"] = prep["settings"].get("loop_tails", "scored")
        result["prepare"]["loop_tokens_unscored"] = prep["outputs"].get("loop_tokens_unscored", 0)
    if vocab:
        result["vocab"] = {
            "draft_vocab_size": vocab["settings"]["draft_vocab_size"],
            "masked_coverage": vocab["outputs"].get("masked_coverage"),
        }
    runs = []
    for m in sorted(run.glob("draft*/manifest.json")):
        d = json.loads(m.read_text())
        if d.get("stage") != "train":  # (the exported copies beside it)
            continue
        s, o = d["settings"], d["outputs"]
        runs.append({"draft": m.parent.name, "lr": s["lr"], "epochs": s["epochs"], "batch_tokens": s["batch_tokens"],
                     "optimizer": s.get("optimizer"), "compiles": o.get("compiles"),
                     "compile_seconds": o.get("compile_seconds"),
                     "steps": o.get("steps"), "val_tau": (o.get("val") or {}).get("tau"),
                     "val_acc": (o.get("val") or {}).get("acc"), "train_tau": (o.get("train") or {}).get("tau"),
                     "val_covers": {k: v for k, v in ((o.get("val") or {}).get("covers") or {}).items() if k != "what"},
                     "tokens_per_s": o.get("tokens_per_s"), "val_curve": _val_curve(m.parent),
                     "best": o.get("best"), "ms_per_step": o.get("ms_per_step")})  # fmt: skip
    if runs:
        result["train"] = {"mode": "online", "runs": runs}
    sets: dict[str, dict] = {}
    eval_seconds: dict[str, dict] = {}
    device = None
    for name, prompt_set in REPORTS.items():
        report = _read(run / "eval" / name)
        if report is None:
            continue
        device = device or {k: report.get(k) for k in ("device", "gpu", "dtype", "cuda_graphs", "compile", "versions")}
        for k, m in _by_k(report).items():
            sets.setdefault(prompt_set, {})[f"K={k}"] = _measurement(m, report)
        if report.get("seconds"):  # where the eval's time went: load, graphs, decoding (each loop's own clock)
            eval_seconds[prompt_set] = report["seconds"]
    result["eval"] = sets
    if eval_seconds:
        result["eval_seconds"] = eval_seconds
    if device is not None and gpu:  # a report of an eval that did not record its card yet
        device["gpu"] = device.get("gpu") or gpu
    result["device"] = device
    seconds: dict[str, float] = {}
    finished: set[str] = set()
    log = run / "run_log.jsonl"  # one line per stage per call (eyas run), a stage cut by a time limit included
    for line in log.read_text().splitlines() if log.is_file() else ():
        e = json.loads(line)
        key = e["stage"] if e["stage"] != "eval" else f"eval {Path(e['out']).stem}"
        seconds[key] = seconds.get(key, 0) + float(e["seconds"])
        if e["finished"]:
            finished.add(key)
    result["minutes_per_stage"] = {k: round(v / 60, 2) for k, v in seconds.items()}
    result["minutes_total"] = round(sum(seconds.values()) / 60, 2)
    # complete: every stage that ran finished, and every prompt set the recipe measures has its report (a call
    # killed by its time limit logs nothing for the stage it cut)
    result["missing"] = [s for s in expect if s not in sets]
    result["complete"] = bool(seconds) and set(seconds) == finished and not result["missing"]
    return result


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("run", type=Path, help="the quality.sh run folder ($R, default /tmp/q there)")
    p.add_argument("--out", type=Path, help="write the JSON here (default: print it)")
    p.add_argument("--commit", help="the eyas commit the run ran (the GPU machine's copy has no git)")
    p.add_argument("--sets", default="mt-bench,humaneval", help="the prompt sets a complete run measured")
    p.add_argument("--gpu", help="the card, for a run whose eval reports do not name it (quality.sh's status.txt "
                   "has nvidia-smi's name)")  # fmt: skip
    a = p.parse_args(argv)
    if not a.run.is_dir():
        print(f"quality_results: {a.run} is not a folder", file=sys.stderr)
        return 2
    result = gather(a.run, expect=[x for x in a.sets.split(",") if x], gpu=a.gpu)
    if a.commit:
        result["commit"] = a.commit
    text = json.dumps(result, indent=2) + "\n"
    if a.out:
        a.out.write_text(text)
        for s, ks in result["eval"].items():
            for k, m in ks.items():
                print(
                    f"{s} {k}: tau {m['tau']:.3f}, speedup {m['speedup'] or float('nan'):.2f}x, "
                    f"{m['num_prompts']} prompts, lossless {m['lossless']}"
                )
    else:
        print(text, end="")
    return 0


if __name__ == "__main__":
    sys.exit(main())
