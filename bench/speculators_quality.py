"""eyas' trainer head to head with speculators 0.9.0's, on the same regenerated answers: the same conversations,
prepared rows, draft vocab and verifier features, the same passes over them; both drafts measured by `eyas eval`
on the same prompts (K draft tokens, greedy, with the plain baseline).

Stages (each an eyas command or speculators' own trainer, in its own process; a stage whose output is complete
is skipped, so a call cut by a time limit continues where it stopped when run again):

1. ``eyas prepare`` of the regenerated conversations (``--max-samples``: a seeded sample of them);
2. ``eyas vocab`` over those rows;
3. ``eyas extract``: the verifier's aux and last hidden states, written also in speculators' offline layout
   (``--speculators-out``);
4. speculators' trainer (``speculators.train.cli``, its defaults: what its users get) on that layout, with the
   vocab's ``d2t.npy`` / ``t2d.npy`` and a head-only copy of the verifier (its embedding, head and final norm:
   all speculators' trainer reads of a verifier), for ``--epochs`` passes of ``--seq-len`` tokens a step;
5. ``eyas train`` offline on the same features, the same passes and held-out share, at ``--eyas-lr`` and
   ``--eyas-batch-tokens`` with EAGLE-3.1's norms (the recipe's settings: configs/smollm2-gpu.toml);
6. ``eyas eval`` of each draft.

One JSON line: tau, acceptance per position and speedup of each draft, eyas' tau over speculators', the data
(conversations, rows, tokens, loss-masked tokens) and seconds per stage. ``--smoke`` (CPU): a tiny random
verifier and conversations, speculators' ``--dry-run`` (its trainer runs on CUDA only: the initialised draft it
saves is what eval measures), a few eyas steps, two eval prompts.

speculators runs with ``--speculators-path`` on its PYTHONPATH (on the GPU machine the wheels of docs/BENCHMARKS.md
installed into /tmp/site, the default; on CPU `make setup` puts it in .venv/speculators-0.9.0), eyas itself never
imported by that process.
"""

from __future__ import annotations

import argparse
import functools
import json
import os
import shutil
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "src"))

from eyas.training.trainer import read_best  # noqa: E402 (the path above)

#: speculators' trainer, run as its CLI does (``speculators.train.cli.main`` over its resolved config)
SPECULATORS_MAIN = (
    "import sys; from speculators.train.cli import main; from speculators.train.config import TrainConfig; "
    "main(TrainConfig.resolve(sys.argv[1:]))"
)


def eyas(stage: str, *args: str, log: Path, weights: Path | None = None) -> None:
    """``eyas STAGE ARGS`` in its own process, its output appended to ``log``; a GGUF verifier's dequantized
    weights and tokenizer kept in ``weights`` for the next command (``EYAS_GGUF_WEIGHTS``)."""
    cmd = [sys.executable, "-m", "eyas.cli", stage, *args]
    env = {"PYTHONPATH": os.pathsep.join([str(ROOT / "src"), os.environ.get("PYTHONPATH", "")])}
    if weights is not None:
        env["EYAS_GGUF_WEIGHTS"] = str(weights)
    _run(cmd, log=log, env=env)


def _run(cmd: list[str], *, log: Path, env: dict[str, str]) -> None:
    with open(log, "a") as f:
        f.write(f"$ {' '.join(cmd)}\n")
        f.flush()
        r = subprocess.run(cmd, stdout=f, stderr=subprocess.STDOUT, env={**os.environ, **env}, cwd=ROOT)
    if r.returncode != 0:
        tail = log.read_text(errors="replace")[-3000:]
        raise SystemExit(f"{cmd[2:4] if cmd[1] == '-m' else cmd[:3]} failed (exit {r.returncode}); {log}:\n{tail}")


def head_only_verifier(verifier: str, out: Path) -> Path:
    """The verifier as speculators' trainer reads it: a Llama-style ``config.json`` (its text config), its
    tokenizer (speculators takes the mask token from it) and a ``model.safetensors`` with the embedding, the
    output head and the final norm only (a tied head written out), in bf16. Read through eyas' own loader, so any
    checkpoint eyas runs (a GGUF included) can be compared."""
    import torch
    from safetensors.torch import save_file

    from eyas.verifier.info import resolve, transformers_text_config
    from eyas.verifier.load import load_head_tensors, load_tokenizer

    if (out / "model.safetensors").is_file():
        return out
    info = resolve(verifier)
    head = load_head_tensors(info, dtype=torch.bfloat16)
    cfg = transformers_text_config(info).to_dict()
    cfg.update(tie_word_embeddings=False, torch_dtype="bfloat16")
    cfg.pop("quantization_config", None)
    tmp = out.with_name(out.name + ".part")
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir(parents=True)
    load_tokenizer(info).save_pretrained(str(tmp))
    (tmp / "config.json").write_text(json.dumps(cfg, indent=2))
    save_file({"model.embed_tokens.weight": head.embed, "lm_head.weight": head.lm_head, "model.norm.weight": head.norm},
              str(tmp / "model.safetensors"), metadata={"format": "pt"})  # fmt: skip
    tmp.rename(out)
    return out


def speculators_train(a, out: Path, *, data: Path, vocab: Path, verifier: Path, draft_vocab_size: int,
                      log: Path) -> Path:  # fmt: skip
    """speculators' trainer over ``data`` -> the draft of its last epoch (the dry run's initialised draft)."""
    final = out / ("draft" if a.speculators_dry_run else str(a.epochs - 1))
    if (final / "config.json").is_file():
        return final
    argv = [
        "--speculator-type", "eagle3", "--verifier-name-or-path", str(verifier), "--data-path", str(data),
        "--save-path", str(out / "draft" if a.speculators_dry_run else out), "--log-dir", str(out / "logs"),
        "--total-seq-len", str(a.seq_len), "--epochs", str(a.epochs), "--ttt-steps", str(a.ttt_steps),
        "--d2t-path", str(vocab / "d2t.npy"), "--t2d-path", str(vocab / "t2d.npy"),
        "--draft-vocab-size", str(draft_vocab_size), "--on-missing", "raise", "--seed", "0",
        "--train-data-ratio", str(1 - a.val_ratio),  # as many rows as eyas trains on
        # its fused Triton loss fails to compile under torch 2.11 / triton 3.6 (docs/BENCHMARKS.md)
        "--loss-implementation", "eager",
        # its default draft layer attends a sliding window of 2048 keys, which eyas' draft does not load; rows of
        # at most 2048 tokens (prepare's --max-seq-len, checked in main) see every earlier key of their own row
        # either way (it packs rows with a mask per row), so full attention here trains the same numbers
        "--full-attention-indices", "0",
    ]  # fmt: skip
    if a.max_steps:
        argv += ["--max-steps", str(a.max_steps)]
    if a.speculators_dry_run:  # it trains on CUDA only
        argv += ["--dry-run", "--draft-attn-impl", "sdpa", "--hidden-states-dtype", "float32"]
    path = os.pathsep.join(x for x in (str(a.speculators_path), os.environ.get("PYTHONPATH")) if x)
    _run([sys.executable, "-c", SPECULATORS_MAIN, *argv], log=log, env={"PYTHONPATH": path})
    if not (final / "config.json").is_file():
        raise SystemExit(f"speculators' trainer left no draft in {final} (see {log})")
    return final


def parse_variant(text: str) -> tuple[str, list[str]]:
    """``NAME:FLAG=VALUE,FLAG,...`` -> ``(NAME, ["--FLAG", "VALUE", "--FLAG", ...])`` (no spaces: it passes
    through the suite's H2H_ARGS unquoted)."""
    name, sep, spec = text.partition(":")
    if not sep or not name or not spec or "/" in name:
        raise argparse.ArgumentTypeError(f"{text!r}: give NAME:FLAG=VALUE,... (e.g. eyas-8k:batch-tokens=8192)")
    flags: list[str] = []
    for item in spec.split(","):
        flag, eq, value = item.partition("=")
        flags += [f"--{flag.lstrip('-')}", *([value] if eq else [])]
    return name, flags


def main(argv: list[str] | None = None) -> dict:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--verifier", default="smollm2")
    p.add_argument("--conversations", type=Path, help="an `eyas regenerate` output (its conversations.jsonl)")
    p.add_argument("--out", type=Path, default=Path("runs/headtohead"))
    p.add_argument("--max-samples", type=int, default=None, help="a seeded sample of this many conversations")
    p.add_argument("--max-seq-len", type=int, default=2048)
    p.add_argument("--epochs", type=int, default=3)
    p.add_argument("--seq-len", type=int, default=8192, help="tokens speculators packs into a step (its default)")
    p.add_argument("--ttt-steps", type=int, default=3)
    p.add_argument("--eyas-lr", type=float, default=2e-3)
    p.add_argument("--eyas-batch-tokens", type=int, default=32768)
    p.add_argument("--prompts", default="mt-bench")
    p.add_argument("--num-prompts", type=int, default=None)
    p.add_argument("--max-new-tokens", type=int, default=256)
    p.add_argument("--draft-tokens", type=int, default=3)
    p.add_argument("--speculators-path", type=Path, default=Path("/tmp/site"))
    p.add_argument(
        "--speculators-dry-run",
        action="store_true",
        help="speculators' trainer saves its initialised draft and stops (CPU: it trains on CUDA only)",
    )
    p.add_argument("--max-steps", type=int, default=None, help="stop both trainers after this many steps")
    p.add_argument(
        "--val-ratio",
        type=float,
        default=0.02,
        help="rows held out from training, both trainers (eyas' default; speculators' is 0.1)",
    )
    p.add_argument(
        "--eyas-variant",
        action="append",
        default=[],
        type=parse_variant,
        metavar="NAME:FLAG=VALUE,...",
        help="one more eyas draft trained on the same features with these `eyas train` flags changed (e.g. "
        "'eyas-8k:batch-tokens=8192' trains as many steps as speculators; a flag without '=' is a switch), "
        "measured without a second plain baseline (the first eyas draft's eval measures it); repeatable",
    )
    p.add_argument(
        "--eval-variants",
        choices=("all", "best", "top"),
        default="all",
        help="which eyas drafts eval measures: every one; the recipe's and the --eyas-variant draft with the "
        "highest validation tau (the draft its `eyas train` kept best) where that beats the recipe's; or only the "
        "eyas draft with the highest validation tau (levers ranked by validation, the winner by eval)",
    )
    p.add_argument("--smoke", action="store_true", help="CPU: a tiny verifier and data, the dry run, 4 steps")
    p.add_argument("--commit", default=None, help="the commit measured, recorded in the result")
    from eyas.core.files import atomic_path
    from eyas.core.manifest import read_manifest

    a = p.parse_args(argv)
    if a.max_seq_len > 2048:
        p.error("--max-seq-len is at most 2048, speculators' sliding window (see speculators_train in this file)")
    out = a.out.resolve()
    out.mkdir(parents=True, exist_ok=True)
    log = out / "headtohead.log"
    # each stage's seconds in the call that finished it, kept across calls: a run cut by a time limit and called
    # again reports what every stage cost, not the few seconds a finished stage takes to find itself done
    seconds_file = out / "seconds.json"
    seconds: dict[str, float] = json.loads(seconds_file.read_text()) if seconds_file.is_file() else {}

    def stage(name: str, fn, *args, **kwargs):
        t0 = time.perf_counter()
        r = fn(*args, **kwargs)
        took = round(time.perf_counter() - t0, 1)
        print(f"[{name}] {took} s", file=sys.stderr, flush=True)
        if name not in seconds:
            seconds[name] = took
            with atomic_path(seconds_file) as tmp:
                tmp.write_text(json.dumps(seconds, indent=1))
        return r

    if a.smoke:
        a = smoke_inputs(a, out)
    conversations = a.conversations.resolve()
    # a GGUF verifier dequantized and its tokenizer built once for every command here, as `eyas run` does
    run_eyas = functools.partial(eyas, weights=out / ".verifier-weights")
    common = ["--verifier", str(a.verifier)]
    stage("prepare", run_eyas, "prepare", *common, "--data", str(conversations), "--out", str(out / "prepared"),
          "--max-seq-len", str(a.max_seq_len), *(["--max-samples", str(a.max_samples)] if a.max_samples else []),
          log=log)  # fmt: skip
    stage("vocab", run_eyas, "vocab", "--data", str(out / "prepared"), "--out", str(out / "vocab"), log=log)
    stage("extract", run_eyas, "extract", *common, "--data", str(out / "prepared"), "--out", str(out / "features"),
          "--speculators-out", str(out / "speculators-data"), log=log)  # fmt: skip
    draft_vocab = int(read_manifest(out / "vocab", stage="vocab")["draft_vocab_size"])
    head = stage("head", head_only_verifier, str(a.verifier), out / "verifier-head")
    drafts = {"speculators": stage("train speculators", speculators_train, a, out / "speculators",
                                   data=out / "speculators-data", vocab=out / "vocab", verifier=head,
                                   draft_vocab_size=draft_vocab, log=log)}  # fmt: skip
    train = ["--data", str(out / "features"), "--vocab", str(out / "vocab"),
             "--epochs", str(a.epochs), "--lr", str(a.eyas_lr), "--batch-tokens", str(a.eyas_batch_tokens),
             "--max-seq-len", str(a.max_seq_len), "--ttt-steps", str(a.ttt_steps),
             # the recipe's draft layout (configs/smollm2-gpu.toml: EAGLE-3.1's norms), as speculators runs its own
             # defaults' (norm_before_residual, norm_before_fc, norm_output)
             "--fc-norm", "--norm-output"]  # fmt: skip
    if a.max_steps:
        train += ["--max-steps", str(a.max_steps)]
    train += ["--val-ratio", str(a.val_ratio)]
    variants = [("eyas", [])] + a.eyas_variant
    if len({name for name, _ in variants} | {"speculators"}) != len(variants) + 1:
        p.error("--eyas-variant names must differ from each other and from 'eyas' and 'speculators'")
    for name, flags in variants:  # a later flag overrides an earlier one (argparse)
        stage(f"train {name}", run_eyas, "train", *common, *train, *flags, "--out", str(out / name), log=log)
        drafts[name] = out / name
    # each draft's best validation tau (none without held-out rows)
    val_tau = {name: (read_best(out / name) or {}).get("tau") for name, _ in variants}
    if a.eval_variants != "all" and a.eyas_variant:
        ranked = {name: val_tau[name] or 0.0 for name, _ in variants}
        top = max((name for name, _ in a.eyas_variant), key=ranked.__getitem__)
        keep = {top} if ranked[top] > ranked["eyas"] else {"eyas"}
        if a.eval_variants == "best":
            keep.add("eyas")
        drafts = {name: draft for name, draft in drafts.items() if name in keep | {"speculators"}}
    # the plain baseline once per prompt set beside speculators': with the first eyas draft measured
    with_baseline = {"speculators", next(name for name in drafts if name != "speculators")}
    reports = {}
    for name, draft in drafts.items():
        report = out / f"eval-{name}.json"
        baseline = [] if name in with_baseline else ["--no-baseline"]
        # eval writes its report last, whole: one of this draft is this stage done
        if not report.is_file() or json.loads(report.read_text()).get("draft") != str(draft):
            stage(f"eval {name}", run_eyas, "eval", *common, "--draft", str(draft), "--prompts", str(a.prompts),
                  "--out", str(report), "--max-new-tokens", str(a.max_new_tokens), "--draft-tokens",
                  str(a.draft_tokens), *(["--num-prompts", str(a.num_prompts)] if a.num_prompts else []),
                  *baseline, log=log)  # fmt: skip
        reports[name] = json.loads(report.read_text())
    prepared, features = read_manifest(out / "prepared", stage="prepare"), read_manifest(out / "features")
    result = {
        "bench": "speculators-quality", "smoke": a.smoke, "verifier": str(a.verifier), "commit": a.commit,
        "device": reports[next(iter(reports))].get("gpu") or "cpu",
        "data": {"conversations": str(conversations), "max_samples": a.max_samples,
                 "rows": prepared["outputs"].get("rows"), "tokens": prepared["outputs"].get("tokens"),
                 "masked_tokens": prepared["outputs"].get("masked_tokens"),
                 "feature_tokens": features["outputs"].get("tokens"), "draft_vocab_size": draft_vocab},
        "training": {"epochs": a.epochs, "max_steps": a.max_steps, "speculators_dry_run": a.speculators_dry_run,
                     "seq_len": a.seq_len, "ttt_steps": a.ttt_steps, "eyas_lr": a.eyas_lr,
                     "eyas_batch_tokens": a.eyas_batch_tokens, "val_ratio": a.val_ratio,
                     "eyas": "the recipe's settings (EAGLE-3.1's fc_norm and norm_output), offline on the features",
                     "speculators": "its defaults (Muon, its norm flags), the eager loss, full attention (the same "
                                    "as its 2048-key window on rows of at most 2048 tokens)"},
        "eval": {name: {key: r.get(key) for key in ("tau", "acceptance_per_position", "speedup", "num_prompts",
                                                       "num_turns", "lossless", "tokens_per_s",
                                                       "baseline_tokens_per_s")} for name, r in reports.items()},
        "seconds": seconds,
    }  # fmt: skip
    result["training"]["eyas_variants"] = {name: " ".join(flags) for name, flags in a.eyas_variant}
    result["training"]["eyas_validation_tau"] = val_tau  # pooled over the held-out rows, each draft's best
    taus = {name: result["eval"][name]["tau"] for name in reports}
    # each eyas draft measured against speculators'
    result["over_speculators"] = {name: round(taus[name] / taus["speculators"], 3) if taus["speculators"] else None
                                  for name, _ in variants if name in taus}  # fmt: skip
    # the criterion: the best eyas draft measured (the recipe's, or the variant that becomes it)
    result["eyas_draft"] = max(result["over_speculators"], key=lambda n: result["over_speculators"][n] or 0.0)
    result["eyas_over_speculators"] = result["over_speculators"][result["eyas_draft"]]
    (out / "headtohead.json").write_text(json.dumps(result, indent=2))
    print(json.dumps(result))
    return result


def smoke_inputs(a, out: Path):
    """CPU: a tiny random Llama verifier (tests/tiny.py) and a few conversations for it (its own greedy answers
    to random prompts), eval over two of those prompts."""
    sys.path.insert(0, str(ROOT / "tests"))
    import tiny

    verifier = out / "verifier"
    if not (verifier / "config.json").is_file():
        tiny.llama(verifier)
    conv = out / "conversations"
    if not (conv / "conversations.jsonl").is_file():
        conv.mkdir(parents=True, exist_ok=True)
        words = tiny.CORPUS
        rows = [{"conversations": [{"from": "human", "value": words[i % len(words)]},
                                   {"from": "gpt", "value": words[(i + 1) % len(words)] * 2}]} for i in range(24)]  # fmt: skip
        (conv / "conversations.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
        (out / "prompts.jsonl").write_text("".join(json.dumps({"turns": [w]}) + "\n" for w in words[:2]))
    a.verifier, a.conversations, a.prompts = str(verifier), conv / "conversations.jsonl", str(out / "prompts.jsonl")
    a.epochs, a.seq_len, a.eyas_batch_tokens, a.max_seq_len, a.max_new_tokens = 1, 256, 256, 256, 8
    a.speculators_dry_run, a.max_steps, a.val_ratio = True, 4, 0.2
    if a.speculators_path == Path("/tmp/site"):
        a.speculators_path = Path(sys.prefix) / "speculators-0.9.0"
    return a


if __name__ == "__main__":
    main()
