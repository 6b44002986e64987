"""The vocab map format: what ``eyas vocab`` writes and ``eyas train --vocab`` reads, in speculators' layout (its
``train.py`` reads the files with ``torch.from_numpy(np.load(path))``).

A vocab folder holds

- ``d2t.npy``: int64 ``[N]`` offsets, ``target_id = draft_id + d2t[draft_id]``;
- ``t2d.npy``: bool ``[V_target]``, True on the target ids in the draft vocab;
- ``manifest.json`` (stage ``vocab``): the coverage report, ``draft_vocab_size``, ``vocab_size`` (the target's),
  and the prepared rows it counted as input (:meth:`eyas.data.prepared.PreparedReader.counted_from`).

A trained draft records the map it was trained with by the files' sha256 (:func:`load_vocab`); the draft
checkpoint holds ``d2t`` and ``t2d`` as tensors of its own (:mod:`eyas.draft.checkpoint`).
"""

from __future__ import annotations

import os
from pathlib import Path

import numpy as np
import torch

from eyas.core.errors import EyasError
from eyas.core.files import atomic_path, read_json, sha256_file

D2T, T2D = "d2t.npy", "t2d.npy"


def mapping(selected: np.ndarray, vocab_size: int) -> tuple[np.ndarray, np.ndarray]:
    """``(d2t, t2d)`` for sorted draft ids ``selected``: int64 offsets ``[N]`` and a bool mask ``[V]``."""
    d2t = selected.astype(np.int64) - np.arange(len(selected), dtype=np.int64)
    t2d = np.zeros(vocab_size, dtype=bool)
    t2d[selected] = True
    return d2t, t2d


def write_vocab_map(folder: str | os.PathLike, d2t: np.ndarray, t2d: np.ndarray) -> None:
    """``folder/d2t.npy`` and ``folder/t2d.npy``, each written atomically as a plain (unpickled) array."""
    for name, arr in ((D2T, d2t), (T2D, t2d)):
        with atomic_path(Path(folder) / name) as tmp, open(tmp, "wb") as f:
            np.save(f, arr, allow_pickle=False)


def load_vocab(path: str | os.PathLike | None, *, vocab_size: int) -> tuple[torch.Tensor, torch.Tensor, dict]:
    """``d2t`` (int64 offsets, ``target = draft + d2t[draft]``) and ``t2d`` (bool ``[V]``) from an ``eyas vocab``
    directory, checked against the verifier; without a path, the whole verifier vocab."""
    if path is None:
        return torch.zeros(vocab_size, dtype=torch.long), torch.ones(vocab_size, dtype=torch.bool), {"full": vocab_size}
    p = Path(path)
    arrays = {}
    for name, file in (("d2t", D2T), ("t2d", T2D)):
        f = p / file
        if not f.is_file():
            raise EyasError(f"{f} not found: --vocab must be a directory written by `eyas vocab`")
        try:
            arrays[name] = np.load(f, allow_pickle=False)
        except ValueError as e:
            raise EyasError(f"{f} is not a plain .npy array ({e}); run `eyas vocab` again") from e
    d2t, t2d = arrays["d2t"], arrays["t2d"]
    if (p / "manifest.json").is_file():
        m = read_json(p / "manifest.json", what="vocab manifest")
        if m.get("stage") != "vocab":
            raise EyasError(f"{p / 'manifest.json'} was written by `eyas {m.get('stage')}`, not `eyas vocab`")
        if m.get("vocab_size", vocab_size) != vocab_size:
            raise EyasError(f"{p} was made for a target vocab of {m['vocab_size']} tokens but the verifier's has "
                            f"{vocab_size}: the vocab mapping was made for another tokenizer")  # fmt: skip
        if m.get("draft_vocab_size", len(d2t)) != len(d2t):
            raise EyasError(f"{p}: d2t.npy has {len(d2t)} entries but its manifest says draft_vocab_size "
                            f"{m['draft_vocab_size']}; run `eyas vocab` again")  # fmt: skip
    if t2d.ndim != 1 or t2d.shape[0] != vocab_size:
        raise EyasError(f"{p / 't2d.npy'} covers {t2d.shape[0] if t2d.ndim == 1 else t2d.shape} target tokens but the "
                        f"verifier's vocab has {vocab_size}: the vocab mapping was made for another tokenizer; "
                        "run `eyas vocab` on rows prepared for this verifier")  # fmt: skip
    t2d = t2d.astype(bool)
    used = np.flatnonzero(t2d)
    if d2t.ndim != 1 or len(d2t) != len(used) or not np.array_equal(np.arange(len(d2t)) + d2t, used):
        raise EyasError(f"{p}: d2t ({d2t.shape[0]} draft tokens) does not map onto the {len(used)} tokens t2d marks "
                        "(target_id = draft_id + d2t[draft_id] must list them in ascending order); run `eyas vocab` again")  # fmt: skip
    identity = {"d2t_sha256": sha256_file(p / D2T), "t2d_sha256": sha256_file(p / T2D)}
    return torch.from_numpy(d2t.astype(np.int64)), torch.from_numpy(t2d), identity
