"""Tau against data: the SmolLM2 recipe's measured runs as one curve, ``bench/results/smollm2-curve.json``, a
table and ``docs/smollm2-curve.png``.

Each point is one run of the recipe on one GPU (``bench/gpu/quality.sh``; an H200 unless the point's ``gpu``
names another card), taken from the JSON
``bench/quality_results.py`` gathered for it, so no figure is typed by hand:

    python bench/quality_curve.py add RESULTS.json --note "ShareGPT + self-written, every turn, loops kept"
    python bench/quality_curve.py show            # the markdown table (docs/BENCHMARKS.md) and the PNG

A point records what the draft trained on (answers, new tokens the verifier wrote, loss-masked tokens kept after
the loop policy, steps, epochs) and what ``eyas eval`` measured (MT-Bench and HumanEval tau and speedup at K=3).
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
try:
    import eyas  # noqa: F401
except ImportError:  # run from a checkout without installing
    sys.path.insert(0, str(ROOT / "src"))

from eyas.core.files import write_json  # noqa: E402

CURVE = ROOT / "bench" / "results" / "smollm2-curve.json"
PNG = ROOT / "docs" / "smollm2-curve.png"
SETS = ("mt-bench", "humaneval")


def point(results: dict, note: str) -> dict:
    """One curve point from a ``bench/quality_results.py`` JSON."""
    regen, prep, runs = results["regenerate"], results["prepare"], results["train"]["runs"]
    run = runs[0]
    out = {
        "commit": results.get("commit"),
        "note": note,
        "complete": results.get("complete"),
        "prompts": regen.get("prompts"),
        "answers": regen.get("answers"),
        "max_turns": regen.get("max_turns"),
        "max_new_tokens": regen.get("max_new_tokens"),
        "loop_policy": regen.get("loop_policy"),
        "loop_copies": regen.get("loop_copies", 1),
        "topics": (results.get("prompts") or {}).get("topics"),
        "new_tokens": regen.get("new_tokens"),
        "regenerate_tokens_per_s": regen.get("new_tokens_per_s"),
        "masked_tokens": prep.get("masked_tokens"),
        "loop_tails": prep.get("loop_tails", "scored"),
        "epochs": run.get("epochs"),
        "steps": run.get("steps"),
        "val_tau": run.get("val_tau"),
        "train_tau": run.get("train_tau"),
        "device_minutes": results.get("minutes_total"),
        "gpu": (results.get("device") or {}).get("gpu"),
    }
    for s in SETS:
        m = (results.get("eval") or {}).get(s, {}).get("K=3")
        out[s] = None if m is None else {k: m.get(k) for k in ("tau", "speedup", "num_prompts", "lossless")}
    return out


def load(curve: Path) -> list[dict]:
    return json.loads(curve.read_text()) if curve.is_file() else []


def table(points: list[dict]) -> str:
    def f(x, spec):
        return "-" if x is None else format(x, spec)

    rows = ["| commit | data | answers | new tokens | loss-masked tokens | steps (epochs) | validation tau | "
            "MT-Bench tau (speedup) | HumanEval tau (speedup) |",
            "| --- | --- | --- | --- | --- | --- | --- | --- | --- |"]  # fmt: skip
    for p in sorted(points, key=lambda p: p["masked_tokens"] or 0):
        ev = [f"{f(p[s]['tau'], '.2f')} ({f(p[s]['speedup'], '.2f')}x)" if p.get(s) else "-" for s in SETS]
        rows.append(f"| {p['commit']} | {p['note']} | {f(p['answers'], ',')} | {f(p['new_tokens'], ',')} | "
                    f"{f(p['masked_tokens'], ',')} | {f(p['steps'], ',')} ({p['epochs']}) | {f(p['val_tau'], '.2f')} | "
                    f"{ev[0]} | {ev[1]} |")  # fmt: skip
    return "\n".join(rows)


def plot(points: list[dict], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    import matplotlib.ticker

    fig, ax = plt.subplots(figsize=(7, 4.2))
    pts = sorted((p for p in points if p["masked_tokens"]), key=lambda p: p["masked_tokens"])
    for key, label, marker in (("mt-bench", "MT-Bench (80, both turns)", "o"), ("humaneval", "HumanEval (164)", "s"),
                               ("val_tau", "validation (held-out rows)", "x")):  # fmt: skip
        xy = [(p["masked_tokens"] / 1e6, p[key] if key == "val_tau" else p[key]["tau"]) for p in pts if p.get(key)]
        if xy:
            ax.plot(*zip(*xy), marker=marker, label=label, linestyle=":" if key == "val_tau" else "-")
    ax.set_xscale("log")
    lo, hi = ax.get_xlim()
    ax.set_xticks([t for t in (0.25, 0.5, 1, 2, 4, 8, 16, 32, 64, 128) if lo <= t <= hi])
    ax.xaxis.set_major_formatter(matplotlib.ticker.FuncFormatter(lambda x, _: f"{x:g}"))
    ax.xaxis.set_minor_formatter(matplotlib.ticker.NullFormatter())
    ax.axhline(3.0, color="grey", linewidth=0.8, linestyle="--")
    ax.text(ax.get_xlim()[0], 3.0, " goal: MT-Bench tau 3.0", va="top", fontsize=8, color="grey")
    ax.set_ylim(top=max(3.15, ax.get_ylim()[1]))
    ax.set_xlabel("loss-masked training tokens (millions, log scale)")
    ax.set_ylabel("tau at K=3, T=0 (tokens per verifier forward)")
    ax.set_title("SmolLM2-135M-Instruct draft: tau against data (one H100 or H200)")
    ax.grid(True, alpha=0.3)
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--curve", default=str(CURVE), help="the curve's JSON")
    sub = ap.add_subparsers(dest="cmd", required=True)
    a = sub.add_parser(
        "add",
        help="add the point of one results JSON (replacing the point of the same commit and "
        "note: levers measured at one commit are points of their own)",
    )
    a.add_argument("results")
    a.add_argument("--note", required=True, help="what data the run trained on, for the table")
    s = sub.add_parser("show", help="print the table and write the PNG")
    s.add_argument("--png", default=str(PNG))
    args = ap.parse_args()
    curve = Path(args.curve)
    if args.cmd == "add":
        new = point(json.loads(Path(args.results).read_text()), args.note)
        same = ("commit", "note")
        points = [p for p in load(curve) if [p[k] for k in same] != [new[k] for k in same]] + [new]
        write_json(curve, points)
        print(json.dumps(new))
        return
    points = load(curve)
    if not points:
        sys.exit(f"no points in {curve}: add one first")
    print(table(points))
    plot(points, Path(args.png))
    print(f"wrote {args.png}")


if __name__ == "__main__":
    main()
