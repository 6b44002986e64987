"""``eyas vocab``: top-N over loss-masked tokens, ties to the lower id, padding with unused ids, the
speculators file layout, and the coverage report, against an independent Counter-based reference."""

from __future__ import annotations

import os
import subprocess
import sys
from collections import Counter

import numpy as np
import pytest
import tiny
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from eyas.cli import main as cli_main
from eyas.core.errors import EyasError
from eyas.core.manifest import read_manifest
from eyas.stages.vocab import select_draft_vocab, vocab


def reference(counts: Counter, n: int) -> list[int]:
    """speculators' rule, restated: sort by (-count, id), take n, pad with the lowest unused ids, sort."""
    chosen = [t for t, _ in sorted(counts.items(), key=lambda x: (-x[1], x[0]))[:n]]
    pad = (i for i in range(10**9) if i not in set(chosen))
    chosen += [next(pad) for _ in range(n - len(chosen))]
    return sorted(chosen)


def load(out):
    d2t = np.load(out / "d2t.npy", allow_pickle=False)
    t2d = np.load(out / "t2d.npy", allow_pickle=False)
    return d2t, t2d


ROWS = [
    # ids                     mask: the assistant's tokens are the 1s
    ([5, 7, 7, 9, 9, 9, 300], [0, 1, 1, 1, 1, 1, 1]),
    ([5, 5, 5, 5, 8, 8, 400], [0, 0, 0, 0, 1, 1, 1]),
    ([6, 300, 400, 8], [1, 1, 1, 1]),
]


@pytest.fixture(scope="module")
def prepared(make_tiny, tmp_path_factory):
    return tiny.write_prepared(tmp_path_factory.mktemp("rows"), ROWS, verifier=make_tiny("llama").path)


def test_top_n_over_masked_tokens_with_ties_to_the_lower_id(prepared, tmp_path):
    # masked counts: 9:3, 8:3, 7:2, 300:2, 400:2, 6:1 (5 is never masked)
    m = vocab(data=str(prepared), out=str(tmp_path / "v"), draft_vocab_size=4)
    d2t, t2d = load(tmp_path / "v")
    draft = np.arange(4) + d2t
    assert draft.tolist() == [7, 8, 9, 300]  # 7/300/400 tie at 2: the lower ids win
    assert np.flatnonzero(t2d).tolist() == draft.tolist()
    masked = Counter(i for ids, mask in ROWS for i, k in zip(ids, mask) if k)
    assert draft.tolist() == reference(masked, 4)
    o = m["outputs"]
    assert o["masked_tokens"] == sum(masked.values()) == 13
    assert o["masked_coverage"] == pytest.approx(10 / 13)  # 7,7,9,9,9,300,8,8,300,8
    assert o["left_out_tokens"] == 2 and o["padded"] == 0  # 400 and 6
    assert m["draft_vocab_size"] == 4 and m["vocab_size"] == tiny.VOCAB
    assert m["inputs"]["verifier"] == read_manifest(prepared)["inputs"]["verifier"]


def test_count_all_and_padding_with_lowest_unused_ids(prepared, tmp_path):
    vocab(data=str(prepared), out=str(tmp_path / "a"), draft_vocab_size=2, count="all")
    d2t, _ = load(tmp_path / "a")
    assert (np.arange(2) + d2t).tolist() == [5, 8]  # all positions: 5 (x5), then 8 and 9 tie at 3
    m = vocab(data=str(prepared), out=str(tmp_path / "p"), draft_vocab_size=10)
    d2t, t2d = load(tmp_path / "p")
    assert (np.arange(10) + d2t).tolist() == [0, 1, 2, 3, 6, 7, 8, 9, 300, 400]  # 6 seen + 4 lowest unused
    assert m["outputs"]["padded"] == 4 and m["outputs"]["masked_coverage"] == 1.0


def test_default_size_files_and_speculators_layout(prepared, tmp_path):
    m = vocab(data=str(prepared), out=str(tmp_path / "v"))
    d2t, t2d = load(tmp_path / "v")
    n = min(32000, tiny.VOCAB)  # the verifier vocab (512) is smaller than 32000
    assert m["draft_vocab_size"] == n and d2t.shape == (n,) and t2d.shape == (tiny.VOCAB,)
    assert d2t.dtype == np.int64 and t2d.dtype == np.bool_
    # speculators' train.py: torch.from_numpy(np.load(path)); its model maps draft -> target with d2t and
    # restricts verifier logits with t2d
    d2t_t, t2d_t = torch.from_numpy(d2t), torch.from_numpy(t2d)
    draft_ids = torch.arange(n)
    target_ids = draft_ids + d2t_t[draft_ids]
    assert torch.equal(target_ids, torch.nonzero(t2d_t).squeeze(1))
    # draft -> target -> draft is the identity
    back = torch.cumsum(t2d_t.long(), 0) - 1
    assert torch.equal(back[target_ids], draft_ids)


def test_errors_and_skip(prepared, tmp_path, make_tiny, capsys):
    with pytest.raises(EyasError, match="between 1 and the verifier vocab size 512"):
        vocab(data=str(prepared), out=str(tmp_path / "v"), draft_vocab_size=513)
    empty = tiny.write_prepared(tmp_path / "empty", [], verifier=make_tiny("llama").path)
    with pytest.raises(EyasError, match="holds no rows"):
        vocab(data=str(empty), out=str(tmp_path / "e"))
    unmasked = tiny.write_prepared(tmp_path / "unmasked", [([1, 2, 3], [0, 0, 0])], verifier=make_tiny("llama").path)
    with pytest.raises(EyasError, match="no loss-masked tokens"):
        vocab(data=str(unmasked), out=str(tmp_path / "u"))
    with pytest.raises(EyasError, match="not found"):
        vocab(data=str(tmp_path / "nothing"), out=str(tmp_path / "n"))
    assert cli_main(["vocab", "--data", str(prepared), "--out", str(tmp_path / "c"), "--draft-vocab-size", "8"]) == 0
    assert "covers" in capsys.readouterr().out
    assert cli_main(["vocab", "--data", str(prepared), "--out", str(tmp_path / "c"), "--draft-vocab-size", "8"]) == 0
    assert "up to date" in capsys.readouterr().out


@settings(max_examples=200, deadline=None)
@given(st.lists(st.integers(0, 40), max_size=200), st.integers(1, 48))
def test_selection_matches_the_reference(tokens, n):
    counts = np.bincount(np.asarray(tokens, dtype=np.int64), minlength=48)
    got = select_draft_vocab(counts, n)
    assert got.tolist() == reference(Counter(tokens), n)


SPECULATORS_VOCAB = """
import sys, numpy as np, torch, datasets
from speculators.train.vocab_mapping import build_vocab_mappings_from_distribution, save_token_frequency_distribution
rows, v, out, *sizes = sys.argv[1:]
save_token_frequency_distribution(datasets.load_from_disk(rows).with_format("torch"), out + "/freq.pt")
for n in sizes:
    d2t, t2d = build_vocab_mappings_from_distribution(torch.load(out + "/freq.pt", weights_only=True), int(n), int(v))
    np.save(f"{out}/d2t-{n}.npy", d2t.numpy())
    np.save(f"{out}/t2d-{n}.npy", t2d.numpy())
"""


def test_same_files_as_speculators_own_builder(make_tiny, tmp_path, speculators_dir):
    """speculators 0.9.0 counts the masked tokens of the same prepared rows with its own code
    (``train/vocab_mapping.py``) and builds d2t/t2d: the files are identical, dtype included."""
    rng = np.random.default_rng(0)
    rows = [((rng.zipf(1.3, size=n) % tiny.VOCAB).tolist(), rng.integers(0, 2, size=n).tolist())
            for n in rng.integers(5, 80, 40)]  # fmt: skip
    prepared = tiny.write_prepared(tmp_path / "rows", rows, verifier=make_tiny("llama").path)
    env = {**os.environ, "PYTHONPATH": str(speculators_dir), "HF_HUB_OFFLINE": "1", "TRANSFORMERS_VERBOSITY": "error"}
    sizes = (40, 300)  # fewer and more than the distinct masked tokens: padding is exercised
    cmd = [sys.executable, "-c", SPECULATORS_VOCAB, str(prepared / "rows"), str(tiny.VOCAB), str(tmp_path),
           *map(str, sizes)]  # fmt: skip
    r = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=600)
    assert r.returncode == 0, r.stderr[-4000:]
    for n in sizes:
        vocab(data=str(prepared), out=str(tmp_path / f"ours{n}"), draft_vocab_size=n)
        for name in ("d2t", "t2d"):
            theirs = np.load(tmp_path / f"{name}-{n}.npy", allow_pickle=False)
            ours = np.load(tmp_path / f"ours{n}" / f"{name}.npy", allow_pickle=False)
            assert ours.dtype == theirs.dtype and np.array_equal(ours, theirs), (n, name)
