"""Real outputs of every stage on the tiny Llama, each made once on first use, for tests of what a stage does
when it is pointed at another stage's folder or at a damaged copy of one (the ``made`` fixture); :func:`tree`,
a folder's contents by hash, to show that a refused command left a folder byte for byte as it was; and
:func:`refused`, a command's one-line error."""

from __future__ import annotations

import functools
import hashlib
import json
from pathlib import Path

CONVERSATIONS = [
    {"conversations": [{"from": "human", "value": "Say hello in three words."},
                       {"from": "gpt", "value": "Hello there, friend."}]},
    {"messages": [{"role": "user", "content": "What is two plus two?"}, {"role": "assistant", "content": "Four."},
                  {"role": "user", "content": "And three plus three?"}, {"role": "assistant", "content": "Six."}]},
    {"conversations": [{"from": "human", "value": "Name a colour."}, {"from": "gpt", "value": "Blue, like the sky."}]},
    {"messages": [{"role": "user", "content": "def add(a, b):"},
                  {"role": "assistant", "content": "    return a + b\n\nprint(add(2, 3))"}]},
]  # fmt: skip


def tree(root: Path) -> dict[str, str]:
    """Every file and folder under ``root`` (hidden ones included): relative path -> sha256 of its bytes, or
    'dir'."""
    out = {}
    for p in sorted(Path(root).rglob("*")):
        rel = str(p.relative_to(root))
        out[rel] = "dir" if p.is_dir() else hashlib.sha256(p.read_bytes()).hexdigest()
    return out


def refused(capsys, argv: list[str], *names: str, alone: bool = True) -> str:
    """Run ``eyas ARGV`` in this process: it exits with the usage-error code (2), no traceback, its error one line
    naming each of ``names``; with ``alone``, that line is all it printed (a refusal before any work).
    Returns the line."""
    from eyas.cli import main

    capsys.readouterr()
    assert main(argv) == 2
    err = capsys.readouterr().err
    assert "Traceback" not in err, err
    line = err.rstrip("\n").split("\n")[-1].split("\r")[-1]
    assert line.startswith(f"eyas {argv[0]}: error: ") and (not alone or err == line + "\n"), err
    for name in names:
        assert name in line, line
    return line


class Outputs:
    """Each stage's output under ``root``, made by the stage itself on the tiny Llama the first time it is
    asked for (one thread: the runs are small)."""

    def __init__(self, root: Path, verifier: Path) -> None:
        self.root, self.verifier = Path(root), str(verifier)

    @functools.cached_property
    def conversations(self) -> Path:
        p = self.root / "conversations.jsonl"
        p.write_text("".join(json.dumps(c) + "\n" for c in CONVERSATIONS))
        return p

    @functools.cached_property
    def prepared(self) -> Path:
        from eyas.stages.prepare import prepare

        prepare(verifier=self.verifier, data=str(self.conversations), out=str(self.root / "prepared"),
                max_seq_len=128, num_proc=1)  # fmt: skip
        return self.root / "prepared"

    @functools.cached_property
    def regenerated(self) -> Path:
        from eyas.stages.regenerate import regenerate

        regenerate(verifier=self.verifier, data=str(self.conversations), out=str(self.root / "regenerated"),
                   max_new_tokens=4, max_turns=1)  # fmt: skip
        return self.root / "regenerated"

    @functools.cached_property
    def vocab(self) -> Path:
        from eyas.stages.vocab import vocab

        vocab(data=str(self.prepared), out=str(self.root / "vocab"), draft_vocab_size=64)
        return self.root / "vocab"

    @functools.cached_property
    def features(self) -> Path:
        from eyas.stages.extract import extract

        extract(verifier=self.verifier, data=str(self.prepared), out=str(self.root / "features"), dtype="fp32")
        return self.root / "features"

    def train_args(self, out: Path) -> dict:
        """The arguments :attr:`draft` was trained with, into ``out``: two steps on the features."""
        return dict(
            verifier=self.verifier,
            data=str(self.features),
            vocab=str(self.vocab),
            out=str(out),
            epochs=1,
            max_steps=2,
            max_seq_len=64,
            num_workers=0,
            log_every=1,
            warmup_steps=1,
            val_ratio=0.25,
        )

    @functools.cached_property
    def draft(self) -> Path:
        from eyas.stages.train import train

        train(**self.train_args(self.root / "draft"))
        return self.root / "draft"
