"""Data sources: named sets, local conversation files, and the prepared-rows format every later stage reads.

Prepared rows (written by ``eyas prepare``, read by ``extract``, ``vocab`` and
online ``train``) are a directory holding

- ``rows/``: a Hugging Face ``datasets`` Arrow dataset (``save_to_disk``) with
  columns ``input_ids`` (list of int32), ``loss_mask`` (list of int8, 1 on every
  token the assistant generates, end-of-turn token included), ``seq_len``
  (int32) and ``row_id`` (int64, the row's number in the source);
- ``manifest.json`` (stage ``prepare``) whose ``inputs.verifier`` is the
  verifier's fingerprint, ``inputs.chat_template_sha256`` the template hash,
  and ``outputs`` the row and token counts; ``verifier_path`` and
  ``vocab_size`` name the verifier it was tokenized for.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

from eyas.errors import EyasError
from eyas.manifest import read_manifest

PREPARED_ROWS = "rows"
PREPARED_COLUMNS = ("input_ids", "loss_mask", "seq_len", "row_id")


def load_prepared(path: str | os.PathLike):
    """Open prepared rows: returns ``(datasets.Dataset, manifest)``; memory-mapped, nothing copied."""
    import datasets

    path = Path(path)
    manifest = read_manifest(path, stage="prepare")
    rows_dir = path / PREPARED_ROWS
    if not rows_dir.is_dir():
        raise EyasError(f"{rows_dir} is missing: {path} is not a finished `eyas prepare` output; run it again")
    ds = datasets.load_from_disk(str(rows_dir))
    missing = [c for c in PREPARED_COLUMNS if c not in ds.column_names]
    if missing:
        raise EyasError(f"{rows_dir} lacks the column(s) {missing}; it was not written by `eyas prepare`")
    return ds, manifest


def prepared_verifier(manifest: dict[str, Any]) -> dict[str, Any]:
    """The verifier fingerprint a prepared set was tokenized with (compare it with the one in use)."""
    return manifest.get("inputs", {}).get("verifier", {})
