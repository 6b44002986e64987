"""Gather a ``bench/gpu/quality.sh`` run folder into the one JSON ``bench/results/smollm2-quality.json`` holds.

Everything comes from the files the stages wrote (their manifests, the eval reports, ``logs/seconds.txt``), so
the results file is never typed by hand:

    python bench/quality_results.py /tmp/q --out bench/results/smollm2-quality.json

Per prompt set (``mt-bench``, ``humaneval``): tau, acceptance per position, speedup, num_prompts and lossless at
each K measured; the regenerate rate; the training runs' validation and training tau; minutes per stage (summed
over the calls a stage took); the device and versions eval recorded.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

#: eval report file (as quality.sh names them) -> its prompt set
REPORTS = {"eval_mtbench.json": "mt-bench", "eval_humaneval.json": "humaneval", "eval_mtbench_k57.json": "mt-bench"}


def _read(path: Path) -> dict | None:
    return json.loads(path.read_text()) if path.is_file() else None


def _by_k(report: dict) -> dict[str, dict]:
    """``{K: measurement}`` of one eval report (one K, or several under ``by_draft_tokens``)."""
    if "by_draft_tokens" in report:
        return dict(report["by_draft_tokens"])
    return {str(report["draft_tokens"]): report}


def _measurement(m: dict, report: dict) -> dict:
    keys = ("tau", "acceptance_per_position", "conditional_acceptance_per_position", "speedup", "tokens_per_s",
            "baseline_tokens_per_s", "lossless", "rounds", "generated_tokens", "num_turns")  # fmt: skip
    out = {k: m.get(k) for k in keys}
    out["num_prompts"] = report.get("num_prompts")
    out["mismatches"] = len(m.get("mismatches") or [])
    return out


def gather(run: Path) -> dict:
    """The results of the run folder ``run`` (``$R`` of quality.sh)."""
    regen, prep, vocab = (_read(run / d / "manifest.json") for d in ("regen", "prep", "vocab"))
    result: dict = {"what": "SmolLM2-135M-Instruct from nothing to a measured draft: bench/gpu/quality.sh"}
    if regen:
        o, t = regen["outputs"], regen.get("timing", {})
        result["regenerate"] = {**{k: regen["settings"].get(k) for k in ("max_samples", "max_turns", "max_new_tokens",
                                                                        "max_seq_len")},  # fmt: skip
                                **{k: o.get(k) for k in ("prompts", "conversations", "answers", "new_tokens",
                                                          "cut_at_max_new_tokens")},  # fmt: skip
                                "seconds": t.get("seconds"), "new_tokens_per_s": t.get("new_tokens_per_s")}
    if prep:
        result["prepare"] = {k: prep["outputs"].get(k) for k in ("rows", "tokens", "masked_tokens")}
    if vocab:
        result["vocab"] = {"draft_vocab_size": vocab["settings"]["draft_vocab_size"],
                           "masked_coverage": vocab["outputs"].get("masked_coverage")}
    runs = []
    for m in sorted(run.glob("draft_lr*/manifest.json")):
        d = json.loads(m.read_text())
        s, o = d["settings"], d["outputs"]
        runs.append({"draft": m.parent.name, "lr": s["lr"], "epochs": s["epochs"], "batch_tokens": s["batch_tokens"],
                     "steps": o.get("steps"), "val_tau": (o.get("val") or {}).get("tau"),
                     "val_acc": (o.get("val") or {}).get("acc"), "train_tau": (o.get("train") or {}).get("tau"),
                     "tokens_per_s": o.get("tokens_per_s")})  # fmt: skip
    if runs:
        result["train"] = {"mode": "online", "runs": runs}
    sets: dict[str, dict] = {}
    device = None
    for name, prompt_set in REPORTS.items():
        report = _read(run / name)
        if report is None:
            continue
        device = device or {k: report.get(k) for k in ("device", "dtype", "cuda_graphs", "compile", "versions")}
        for k, m in _by_k(report).items():
            sets.setdefault(prompt_set, {})[f"K={k}"] = _measurement(m, report)
    result["eval"] = sets
    result["device"] = device
    seconds: dict[str, float] = {}
    log = run / "logs" / "seconds.txt"
    if log.is_file():
        for line in log.read_text().splitlines():
            stage, s = line.split()
            seconds[stage] = seconds.get(stage, 0) + float(s)
    result["minutes_per_stage"] = {k: round(v / 60, 2) for k, v in seconds.items()}
    result["minutes_total"] = round(sum(seconds.values()) / 60, 2)
    done = {"regenerate", "prepare", "vocab", "train", "eval_mtbench", "eval_humaneval"}
    result["complete"] = all((run / "logs" / f"{s}.done").exists() for s in done)
    return result


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("run", type=Path, help="the quality.sh run folder ($R, default /tmp/q there)")
    p.add_argument("--out", type=Path, help="write the JSON here (default: print it)")
    a = p.parse_args(argv)
    if not a.run.is_dir():
        print(f"quality_results: {a.run} is not a folder", file=sys.stderr)
        return 2
    result = gather(a.run)
    text = json.dumps(result, indent=2) + "\n"
    if a.out:
        a.out.write_text(text)
        for s, ks in result["eval"].items():
            for k, m in ks.items():
                print(f"{s} {k}: tau {m['tau']:.3f}, speedup {m['speedup'] or float('nan'):.2f}x, "
                      f"{m['num_prompts']} prompts, lossless {m['lossless']}")
    else:
        print(text, end="")
    return 0


if __name__ == "__main__":
    sys.exit(main())
