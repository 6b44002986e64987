"""``eyas vocab``: the draft's vocabulary, the ``N`` target tokens the assistant uses most.

EAGLE-3 drafts predict over a reduced vocabulary of ``N`` target tokens
(HASS/EAGLE-3 use 32000); the rest of the target vocab can never be drafted,
so the mapping must cover what the *assistant* writes. Tokens are counted over
the loss-masked positions of the prepared rows (``count="all"`` counts every
token), the top ``N`` by frequency are kept (ties to the lower id), and they
are sorted ascending. When fewer than ``N`` distinct tokens occur, the lowest
unused ids fill the rest, as speculators' ``build_vocab_mappings_from_distribution``
does (speculators ``src/speculators/data_generation/vocab_mapping.py``).

It writes ``d2t.npy`` and ``t2d.npy`` in speculators' layout, the format of :mod:`eyas.data.vocab_map`, and a
``manifest.json`` with the coverage report.
"""

from __future__ import annotations

import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Any, ClassVar, Literal

import numpy as np

from eyas.core import fields
from eyas.core.config import StageConfig, option, recorded_settings, stage_function
from eyas.core.errors import EyasError
from eyas.core.validate import AT_LEAST_1
from eyas.core.manifest import StageOutput
from eyas.data.prepared import PreparedReader
from eyas.data.vocab_map import D2T, T2D, mapping, write_vocab_map

DEFAULT_DRAFT_VOCAB = 32000


def count_tokens(ds, vocab_size: int, *, where: str) -> tuple[np.ndarray, np.ndarray]:
    """Token frequencies ``(over masked positions, over all positions)``, each int64 ``[vocab_size]``.

    Reads the Arrow columns chunk by chunk (flat values, no per-row Python).
    """
    from tqdm.auto import tqdm

    table = ds.data.table if hasattr(ds.data, "table") else ds.data
    masked = np.zeros(vocab_size, dtype=np.int64)
    every = np.zeros(vocab_size, dtype=np.int64)
    ids_col, mask_col = table.column("input_ids"), table.column("loss_mask")
    if [len(c) for c in ids_col.chunks] != [len(c) for c in mask_col.chunks]:
        ids_col, mask_col = ids_col.combine_chunks(), mask_col.combine_chunks()
        pairs = [(ids_col, mask_col)]
    else:
        pairs = list(zip(ids_col.chunks, mask_col.chunks))
    for ids_arr, mask_arr in tqdm(pairs, desc="vocab", unit="chunk", file=sys.stderr, disable=len(pairs) < 4):
        ids = ids_arr.flatten().to_numpy(zero_copy_only=False)
        mask = mask_arr.flatten().to_numpy(zero_copy_only=False)
        if len(ids) != len(mask):
            raise EyasError(f"{where}: input_ids and loss_mask differ in length; run `eyas prepare` again")
        if len(ids) and (ids.min() < 0 or ids.max() >= vocab_size):
            bad = int(ids.max()) if ids.max() >= vocab_size else int(ids.min())
            raise EyasError(
                f"{where}: token id {bad} is outside the verifier vocab of {vocab_size}; "
                "the rows were not tokenized for this verifier"
            )
        every += np.bincount(ids, minlength=vocab_size)
        masked += np.bincount(ids[mask.astype(bool)], minlength=vocab_size)
    return masked, every


def select_draft_vocab(counts: np.ndarray, n: int) -> np.ndarray:
    """The ``n`` most frequent ids (ties to the lower id), padded with the lowest unused ids, sorted."""
    order = np.lexsort((np.arange(len(counts)), -counts))  # by count descending, then id ascending
    seen = order[: min(n, int((counts > 0).sum()))]
    if len(seen) < n:
        unused = np.setdiff1d(np.arange(len(counts)), seen, assume_unique=True)
        seen = np.concatenate([seen, unused[: n - len(seen)]])
    return np.sort(seen)


@dataclass(kw_only=True, frozen=True)
class VocabConfig(StageConfig):
    """Choose the draft vocabulary from prepared rows and write d2t.npy / t2d.npy in speculators' layout."""

    stage: ClassVar[str] = "vocab"

    data: str = option(recorded=False, help="an `eyas prepare` output directory.")
    out: str = fields.out()
    draft_vocab_size: int | None = option(
        None, range=AT_LEAST_1, help="tokens in the draft vocab (default: 32000, or the verifier vocab when smaller)."
    )
    count: Literal["masked", "all"] = option(
        "masked", help="count tokens at loss-masked positions only (masked), or at every position (all)."
    )


def run(c: VocabConfig) -> dict[str, Any]:
    """Run `eyas vocab` as ``c`` describes (see :class:`VocabConfig`)."""
    source = PreparedReader(c.data)
    prepared = source.manifest
    V = int(prepared.get("vocab_size") or 0)
    if V <= 0:
        raise EyasError(f"{Path(c.data) / 'manifest.json'} has no vocab_size; run `eyas prepare` again")
    n = c.draft_vocab_size if c.draft_vocab_size is not None else min(DEFAULT_DRAFT_VOCAB, V)
    if not 1 <= n <= V:
        raise EyasError(
            f"--draft-vocab-size {n} must be between 1 and the verifier vocab size {V} "
            f"(the draft vocab is a subset of the verifier's)"
        )
    if len(source) == 0:
        raise EyasError(f"{c.data} holds no rows: there is nothing to count; prepare more data")
    inputs = source.counted_from()
    settings = recorded_settings(c, draft_vocab_size=n)
    out_dir = Path(c.out)
    with StageOutput(out_dir, stage="vocab") as output:
        manifest = output.up_to_date(inputs=inputs, settings=settings, files=(D2T, T2D))
        if manifest is not None:
            print(f"vocab: {out_dir} is up to date (draft vocab {n}); skipping")
            return manifest
        masked, every = count_tokens(source.ds, V, where=str(c.data))
        counts = masked if c.count == "masked" else every
        if counts.sum() == 0:
            raise EyasError(f"{c.data} has no {'loss-masked ' if c.count == 'masked' else ''}tokens to count")
        selected = select_draft_vocab(counts, n)
        d2t, t2d = mapping(selected, V)
        write_vocab_map(out_dir, d2t, t2d)
        outputs = _coverage(masked, every, t2d, counts)
        manifest = output.finish(outputs=outputs, draft_vocab_size=n, vocab_size=V, data_path=str(c.data))
    print(
        f"vocab: draft vocab {n:,} of {V:,} target tokens -> {out_dir}\n"
        f"  covers {outputs['masked_coverage']:.2%} of {outputs['masked_tokens']:,} masked tokens "
        f"({outputs['all_coverage']:.2%} of all {outputs['all_tokens']:,}); "
        f"{outputs['left_out_tokens']:,} target tokens seen in the counted positions are left out"
        + (f"; {outputs['padded']:,} unused ids fill the vocab" if outputs["padded"] else "")
    )
    return manifest


vocab = stage_function(VocabConfig, run, "vocab")


def _coverage(masked: np.ndarray, every: np.ndarray, t2d: np.ndarray, counts: np.ndarray) -> dict[str, Any]:
    """How much of the data the draft vocab can express."""
    return {
        "masked_tokens": int(masked.sum()),
        "masked_coverage": float(masked[t2d].sum() / max(masked.sum(), 1)),
        "all_tokens": int(every.sum()),
        "all_coverage": float(every[t2d].sum() / max(every.sum(), 1)),
        "distinct_tokens": int((counts > 0).sum()),
        "left_out_tokens": int(((counts > 0) & ~t2d).sum()),
        "left_out_share": float(counts[~t2d].sum() / max(counts.sum(), 1)),
        "padded": int((t2d & (counts == 0)).sum()),
    }
