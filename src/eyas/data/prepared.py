"""The prepared-rows format: what ``eyas prepare`` writes and ``vocab``, ``extract`` and online ``train`` read.

A prepared folder holds

- ``rows/``: a Hugging Face ``datasets`` Arrow dataset (``save_to_disk``) with columns ``input_ids`` (list of
  int32), ``loss_mask`` (list of int8, 1 on every token the assistant generates, end-of-turn token included),
  ``seq_len`` (int32) and ``row_id`` (int64, the row's number in the source): :data:`ROWS_SCHEMA`;
- ``manifest.json`` (stage ``prepare``) whose ``inputs.verifier`` is the verifier's fingerprint,
  ``inputs.chat_template_sha256`` the template hash, and ``outputs`` the row and token counts;
  ``verifier_path`` and ``vocab_size`` name the verifier it was tokenized for.

A row is addressed by its position (0-based) in ``rows/``: feature shards (:mod:`eyas.data.features`) and train's
held-out rows count the same way.

Identity. Three stages record which prepared rows they read, each in the form its manifests have held since they
were first written, so that outputs already on disk still match (:class:`PreparedReader` makes all three):

- online ``train``: :meth:`PreparedReader.identity`, the sha256 of each Arrow file of ``rows/`` with the row count;
- ``extract``: :meth:`PreparedReader.extracted_from`, the same file hashes as one digest (:func:`arrow_sha256`),
  with row and token counts, which ``eyas eval --offline`` compares with a draft's record of the first;
- ``vocab``: :meth:`PreparedReader.counted_from`, the sha256 of the manifest's record of what was prepared from
  what (its stage, inputs, settings and outputs), beside the verifier and template it names.
"""

from __future__ import annotations

import hashlib
import os
from pathlib import Path
from typing import Any

import numpy as np
import pyarrow as pa

from eyas.core.errors import EyasError
from eyas.core.files import atomic_path
from eyas.core.manifest import damaged_file, read_manifest

#: the dataset folder of a prepared output
PREPARED_ROWS = "rows"
PREPARED_COLUMNS = ("input_ids", "loss_mask", "seq_len", "row_id")
ROWS_SCHEMA = pa.schema([("input_ids", pa.list_(pa.int32())), ("loss_mask", pa.list_(pa.int8())),
                         ("seq_len", pa.int32()), ("row_id", pa.int64())])  # fmt: skip


# --------------------------------------------------------------------------- writing


def rows_table(ids: np.ndarray, mask: np.ndarray, lens: np.ndarray, rows: np.ndarray) -> pa.Table:
    """Prepared rows as an Arrow table: ragged rows as list arrays over flat values (no per-row Python)."""
    offsets = pa.array(np.concatenate([[0], np.cumsum(lens, dtype=np.int64)]).astype(np.int32))
    if offsets[-1].as_py() != len(ids):
        raise AssertionError("row lengths do not add up to the token count")
    return pa.table({
        "input_ids": pa.ListArray.from_arrays(offsets, pa.array(ids, type=pa.int32())),
        "loss_mask": pa.ListArray.from_arrays(offsets, pa.array(mask, type=pa.int8())),
        "seq_len": pa.array(lens, type=pa.int32()),
        "row_id": pa.array(rows, type=pa.int64()),
    }, schema=ROWS_SCHEMA)  # fmt: skip


def write_rows(folder: str | os.PathLike, table: pa.Table) -> None:
    """``folder/rows``, the dataset of ``table``, written atomically (without ``datasets``' own progress bar)."""
    import datasets
    from datasets.utils import logging as ds_logging

    with atomic_path(Path(folder) / PREPARED_ROWS, is_dir=True) as tmp:
        was = ds_logging.is_progress_bar_enabled()
        ds_logging.disable_progress_bar()
        try:
            datasets.Dataset(table).save_to_disk(str(tmp))
        finally:
            if was:
                ds_logging.enable_progress_bar()


# --------------------------------------------------------------------------- reading


def load_prepared(path: str | os.PathLike):
    """Open prepared rows: returns ``(datasets.Dataset, manifest)``; memory-mapped, nothing copied."""
    import datasets

    path = Path(path)
    manifest = read_manifest(path, stage="prepare")
    rows_dir = path / PREPARED_ROWS
    if not rows_dir.is_dir():
        raise EyasError(f"{rows_dir} is missing: {path} is not a finished `eyas prepare` output; run it again")
    if manifest.get("outputs", {}).get("rows") == 0:
        raise EyasError(f"{path} holds no rows: there is nothing to train on or count; prepare more data")
    # every file whole before Arrow maps it: Arrow trusts a memory-mapped file's offsets, and a damaged one read
    # past its buffers (a segmentation fault in `eyas vocab`, not an error)
    damaged = damaged_file(path, manifest)
    if damaged is not None:
        raise EyasError(f"{rows_dir} is damaged ({damaged}): run `eyas prepare` again")
    try:
        ds = datasets.load_from_disk(str(rows_dir))
    except Exception as e:  # noqa: BLE001 (Arrow, JSON and datasets' own errors all mean the same damaged folder)
        raise EyasError(f"{rows_dir} cannot be read ({type(e).__name__}: {e}); it is damaged: run `eyas prepare` "
                        "again") from e  # fmt: skip
    missing = [c for c in PREPARED_COLUMNS if c not in ds.column_names]
    if missing:
        raise EyasError(f"{rows_dir} lacks the column(s) {missing}; it was not written by `eyas prepare`")
    expected = manifest.get("outputs", {}).get("rows")
    if expected is not None and ds.num_rows != expected:  # an Arrow stream cut at a batch boundary reads short
        raise EyasError(f"{rows_dir} holds {ds.num_rows} rows, its manifest says {expected}; it is damaged: run "
                        "`eyas prepare` again")  # fmt: skip
    return ds, manifest


def prepared_verifier(manifest: dict[str, Any]) -> dict[str, Any]:
    """The verifier fingerprint a prepared set was tokenized with (compare it with the one in use)."""
    return manifest.get("inputs", {}).get("verifier", {})


class PreparedReader:
    """An ``eyas prepare`` output (a ``datasets`` dataset, memory-mapped): ranges of rows as arrays
    (:meth:`fetch`, for extraction), every loss mask at once (:meth:`masks`), and the records of its identity.
    :class:`eyas.training.batches.PreparedRows` adds a row at a time for online training."""

    def __init__(self, path: str | os.PathLike) -> None:
        ds, self.manifest = load_prepared(path)
        self.path = Path(path)
        self._files = [f["filename"] for f in ds.cache_files]
        self._hashes: list[str] | None = None
        self.ds = ds.with_format("numpy")
        self.lengths = np.asarray(self.ds["seq_len"], dtype=np.int64)

    def __len__(self) -> int:
        return len(self.lengths)

    def fetch(self, start: int, end: int) -> list[tuple[np.ndarray, np.ndarray]]:
        """Rows ``[start, end)`` as ``(input_ids int64, loss_mask bool)`` arrays, each checked against its
        ``seq_len``."""
        part = self.ds[start:end]
        out = []
        for r, (ids, mask) in enumerate(zip(part["input_ids"], part["loss_mask"])):
            ids, mask = np.asarray(ids, np.int64), np.asarray(mask).astype(bool)
            if not len(ids) == len(mask) == self.lengths[start + r]:
                raise EyasError(
                    f"{self.path}: row {start + r} has {len(ids)} input_ids, {len(mask)} loss_mask values and "
                    f"seq_len {self.lengths[start + r]}; they must agree: run `eyas prepare` again"
                )
            out.append((ids, mask))
        return out

    def masks(self) -> tuple[np.ndarray, np.ndarray]:
        col = self.ds.data.column("loss_mask").combine_chunks()
        offsets = np.asarray(col.offsets, dtype=np.int64)
        flat = np.asarray(col.values, dtype=np.int8) != 0
        if len(offsets) - 1 != len(self.lengths) or not np.array_equal(np.diff(offsets), self.lengths):
            raise EyasError(f"{self.path}: loss_mask lengths disagree with seq_len; run `eyas prepare` again")
        return flat, offsets

    def file_hashes(self) -> list[str]:
        """The sha256 of each of the dataset's Arrow files, in order (read once)."""
        if self._hashes is None:
            from eyas.core.manifest import sha256_cached

            self._hashes = [sha256_cached(Path(f)) for f in self._files]  # hashed once, by load_prepared's check
        return self._hashes

    def identity(self) -> dict[str, Any]:
        """What a draft trained online was trained on, as train's manifest records it."""
        return {"prepared": self.file_hashes(), "rows": len(self)}

    def extracted_from(self) -> dict[str, Any]:
        """What features extracted from these rows were made from, as extract's manifest records it: the file
        hashes of :meth:`identity` as one digest, with row and token counts."""
        return {"rows": len(self), "tokens": int(self.lengths.sum()), "arrow_sha256": arrow_sha256(self.file_hashes())}

    def counted_from(self) -> dict[str, Any]:
        """What a vocab counted, as vocab's manifest records it: the prepared manifest's record of what was made
        from what, hashed, with the verifier and chat template it names."""
        from eyas.core.files import sha256_json

        made = {k: self.manifest.get(k) for k in ("stage", "inputs", "settings", "outputs")}
        return {
            "prepared_sha256": sha256_json(made),
            "verifier": self.manifest.get("inputs", {}).get("verifier"),
            "chat_template_sha256": self.manifest.get("inputs", {}).get("chat_template_sha256"),
        }


def arrow_sha256(file_hashes: list[str]) -> str:
    """One digest of a prepared dataset's Arrow files: sha256 over their sha256 hex digests, in order."""
    return hashlib.sha256("".join(file_hashes).encode()).hexdigest()
