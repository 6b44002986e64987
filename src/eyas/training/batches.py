"""Training batches: rows from feature shards (offline) or prepared rows (online), packed into sequences with
document ids, dealt into optimizer steps, and collated into padded tensors in DataLoader workers.

The packing order is a pure function of ``(seed, epoch)`` and every micro-batch of a step is known to every
rank, so the loss can be normalised by the loss-masked positions of the whole step without a collective, and
one process with ``G*W`` accumulation steps sees exactly the micro-batches ``W`` ranks with ``G`` see.
"""

from __future__ import annotations

import hashlib
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch

from eyas.core.errors import EyasError
from eyas.training.loss import CHUNK_TOKENS, scored_rows, target_rows

OPEN_BINS = 64  # sequences kept open while packing (best fit among them)


# --------------------------------------------------------------------------- rows in


@dataclass
class Row:
    input_ids: torch.Tensor  # int64 [T]
    loss_mask: torch.Tensor  # bool [T]
    aux: torch.Tensor | None = None  # [T, 3H] (offline)
    last: torch.Tensor | None = None  # [T, H] pre-norm (offline)


class FeatureRows:
    """Offline rows: an ``eyas extract`` output, read through :class:`eyas.data.features.FeatureReader`."""

    online = False

    def __init__(self, path: str | os.PathLike, *, dtype: torch.dtype) -> None:
        from eyas.data.features import FeatureReader

        self.reader = FeatureReader(path, dtype=dtype)
        self.path = Path(path)
        self.manifest = self.reader.manifest
        self.layer_ids = list(self.reader.layer_ids)
        self.hidden_size = self.reader.hidden_size
        self.lengths = np.asarray(self.reader.lengths, dtype=np.int64)

    def __len__(self) -> int:
        return len(self.lengths)

    def row(self, i: int) -> Row:
        from eyas.data.features import fp8_decode

        ids, mask, hs, scale = self.reader.raw(i)  # one read of the states (indexing the reader reads them twice)
        dtype = self.reader.dtype
        hs = hs.to(dtype) if scale is None else fp8_decode(hs, scale[None, :, None], dtype)  # [T, 4, H]
        T, _, H = hs.shape
        return Row(ids.to(torch.int64), mask.bool(), hs[:, :3].reshape(T, 3 * H), hs[:, 3])

    def masks(self) -> tuple[np.ndarray, np.ndarray]:
        """Every row's loss mask, flat, with row offsets (read shard by shard, states untouched)."""
        from safetensors import safe_open

        flat, offsets, base = [], [np.zeros(1, np.int64)], 0
        for s in self.reader.shards:
            with safe_open(str(self.path / s["file"]), framework="pt") as f:
                flat.append(f.get_tensor("loss_mask").numpy().astype(bool))
                offsets.append(f.get_tensor("cu_seqlens").numpy()[1:] + base)
            base += len(flat[-1])
        return np.concatenate(flat), np.concatenate(offsets)

    def identity(self) -> dict[str, Any]:
        from eyas.core.files import sha256_json

        return {"features": sha256_json([s["sha256"] for s in self.reader.shards]), "rows": len(self)}


class PreparedRows:
    """An ``eyas prepare`` output (a ``datasets`` dataset, memory-mapped): the one reader of prepared rows, for
    online training (a row at a time, every loss mask at once; features come from the verifier per batch) and
    for extraction (ranges of rows as arrays, :meth:`fetch`)."""

    online = True

    def __init__(self, path: str | os.PathLike) -> None:
        from eyas.data.datasets import load_prepared

        ds, self.manifest = load_prepared(path)
        self.path = Path(path)
        self._files = [f["filename"] for f in ds.cache_files]
        self._hashes: list[str] | None = None
        self.ds = ds.with_format("numpy")
        self.lengths = np.asarray(self.ds["seq_len"], dtype=np.int64)

    def __len__(self) -> int:
        return len(self.lengths)

    def row(self, i: int) -> Row:
        r = self.ds[int(i)]
        return Row(torch.from_numpy(np.asarray(r["input_ids"], np.int64)), torch.from_numpy(r["loss_mask"] != 0))

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
            from eyas.core.files import sha256_file

            self._hashes = [sha256_file(f) for f in self._files]
        return self._hashes

    def identity(self) -> dict[str, Any]:
        """What a draft trained online was trained on, as train's manifest records it."""
        return {"prepared": self.file_hashes(), "rows": len(self)}

    def extracted_from(self) -> dict[str, Any]:
        """What features extracted from these rows were made from, as extract's manifest records it: the same
        file hashes, as one digest (:func:`arrow_sha256`), with row and token counts. (Two records of one
        hashing, each in the form its stage's manifests have held since they were first written, so that
        outputs already on disk still match.)"""
        return {"rows": len(self), "tokens": int(self.lengths.sum()), "arrow_sha256": arrow_sha256(self.file_hashes())}


def arrow_sha256(file_hashes: list[str]) -> str:
    """One digest of a prepared dataset's Arrow files: sha256 over their sha256 hex digests, in order."""
    return hashlib.sha256("".join(file_hashes).encode()).hexdigest()


def row_counts(flat: np.ndarray, offsets: np.ndarray, *, max_len: int, ttt_steps: int) -> tuple[np.ndarray, np.ndarray]:
    """Per row: its length after truncation to ``max_len``, and for each TTT step ``k`` how many positions step
    ``k`` scores (``loss_mask[t+2+k]`` with ``t+2+k`` inside the row): ``[R]``, ``[R, ttt_steps]``."""
    starts = offsets[:-1]
    lengths = np.minimum(np.diff(offsets), max_len)
    ends = starts + lengths
    cs = np.concatenate([[0], np.cumsum(flat, dtype=np.int64)])
    counts = np.stack([cs[ends] - cs[np.minimum(starts + 2 + k, ends)] for k in range(ttt_steps)], axis=1)
    return lengths, counts


def load_vocab(path: str | os.PathLike | None, *, vocab_size: int) -> tuple[torch.Tensor, torch.Tensor, dict]:
    """``d2t`` (int64 offsets, ``target = draft + d2t[draft]``) and ``t2d`` (bool ``[V]``) from an ``eyas vocab``
    directory, checked against the verifier; without a path, the whole verifier vocab."""
    if path is None:
        return torch.zeros(vocab_size, dtype=torch.long), torch.ones(vocab_size, dtype=torch.bool), {"full": vocab_size}
    from eyas.core.files import read_json, sha256_file

    p = Path(path)
    arrays = {}
    for name in ("d2t", "t2d"):
        f = p / f"{name}.npy"
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
    identity = {"d2t_sha256": sha256_file(p / "d2t.npy"), "t2d_sha256": sha256_file(p / "t2d.npy")}
    return torch.from_numpy(d2t.astype(np.int64)), torch.from_numpy(t2d), identity


# --------------------------------------------------------------------------- packing


@dataclass
class Step:
    """One optimizer step for all ranks: ``micro_batches[j]`` is a list of sequences (lists of row indices)."""

    micro_batches: list[list[list[int]]]
    denom: np.ndarray  # [steps] scored positions per TTT step over the whole step (all ranks)
    tokens: int


def pack_rows(order: np.ndarray, lengths: np.ndarray, max_len: int) -> list[list[int]]:
    """Pack rows (in ``order``) into sequences of at most ``max_len`` tokens: best fit among the last
    :data:`OPEN_BINS` open sequences, deterministic."""
    free = np.empty(0, dtype=np.int64)
    bins: list[list[int]] = []
    out: list[list[int]] = []
    for i in order:
        L = int(lengths[i])
        fits = np.flatnonzero(free >= L)
        if len(fits):
            j = int(fits[np.argmin(free[fits])])
            bins[j].append(int(i))
            free[j] -= L
            if free[j] == 0:
                out.append(bins.pop(j))
                free = np.delete(free, j)
            continue
        if len(bins) == OPEN_BINS:
            j = int(np.argmin(free))
            out.append(bins.pop(j))
            free = np.delete(free, j)
        bins.append([int(i)])
        free = np.append(free, max_len - L)
    return out + bins


def plan_epoch(rows: np.ndarray, lengths: np.ndarray, counts: np.ndarray, *, seed: int, epoch: int, shuffle: bool,
               max_len: int, seqs_per_micro_batch: int, micro_batches_per_step: int) -> list[Step]:  # fmt: skip
    """The epoch's optimizer steps. The last step is filled with empty micro-batches so every rank runs the
    same number of forwards (DDP/FSDP collectives need that)."""
    order = np.random.default_rng([seed, epoch]).permutation(rows) if shuffle else np.asarray(rows)
    seqs = pack_rows(order, lengths, max_len)
    mbs = [seqs[i : i + seqs_per_micro_batch] for i in range(0, len(seqs), seqs_per_micro_batch)]
    n = micro_batches_per_step
    mbs += [[] for _ in range(-len(mbs) % n)]
    steps = []
    for i in range(0, len(mbs), n):
        group = mbs[i : i + n]
        ids = [r for mb in group for seq in mb for r in seq]
        steps.append(Step(group, counts[ids].sum(0) if ids else np.zeros(counts.shape[1], np.int64),
                          int(lengths[ids].sum()) if ids else 0))  # fmt: skip
    return steps


class StepData(torch.utils.data.Dataset):
    """Item ``j``: this rank's micro-batches of step ``j`` as padded tensors (built in DataLoader workers)."""

    def __init__(self, source, steps: list[Step], *, rank: int, grad_accum: int, max_len: int, seqs: int,
                 lengths: np.ndarray, embed: torch.Tensor | None = None, ttt_steps: int = 0,
                 chunk: int = CHUNK_TOKENS) -> None:  # fmt: skip
        """``embed`` (the frozen ``[vocab, H]`` table, in host memory): each micro-batch also carries
        ``inputs_embeds [B, max_len + ttt_steps, H]``, the rows of its ids followed by ``ttt_steps`` of id 0
        (what :meth:`eyas.draft.model.Eagle3Draft.ttt` reads), so the table never has to be on the device. With
        ``ttt_steps``, a micro-batch also carries ``scored_rows`` (:func:`eyas.training.loss.scored_rows` for the loss'
        ``chunk``) when skipping the positions no step scores saves a chunk of the loss, and ``target_rows``
        (:func:`eyas.training.loss.target_rows`) when some positions' targets are read by no step."""
        self.source, self.steps, self.rank, self.G = source, steps, rank, grad_accum
        self.S, self.B, self.lengths = max_len, seqs, lengths
        self.embed, self.ttt_steps, self.chunk = embed, ttt_steps, chunk

    def __len__(self) -> int:
        return len(self.steps)

    def __getitem__(self, j: int) -> dict[str, Any]:
        st = self.steps[j]
        mine = st.micro_batches[self.rank * self.G : (self.rank + 1) * self.G]
        return {"micro_batches": [self.collate(mb) for mb in mine], "denom": torch.from_numpy(st.denom.astype(np.float64)),
                "tokens": st.tokens}  # fmt: skip

    def collate(self, seqs: list[list[int]]) -> dict[str, torch.Tensor]:
        B, S = self.B, self.S
        ids = torch.zeros(B, S, dtype=torch.long)
        mask = torch.zeros(B, S, dtype=torch.bool)
        doc = torch.full((B, S), -1, dtype=torch.long)
        pos = torch.zeros(B, S, dtype=torch.long)
        rows: list[tuple[int, int, Row, int]] = []
        for b, seq in enumerate(seqs):
            off = 0
            for d, i in enumerate(seq):
                r = self.source.row(i)
                L = int(self.lengths[i])
                ids[b, off : off + L] = r.input_ids[:L]
                mask[b, off : off + L] = r.loss_mask[:L]
                doc[b, off : off + L] = d
                pos[b, off : off + L] = torch.arange(L)
                rows.append((b, off, r, L))
                off += L
        out = {"input_ids": ids, "loss_mask": mask, "doc_ids": doc, "position_ids": pos}
        if self.ttt_steps:  # the positions the loss scores and those whose targets it reads, when not all
            scored = scored_rows(mask, doc, self.ttt_steps, chunk=self.chunk)
            if scored is not None:
                out["scored_rows"] = scored
            needed = target_rows(mask, doc, self.ttt_steps)
            if needed is not None:
                out["target_rows"] = needed
        if self.embed is not None:
            padded = torch.nn.functional.pad(ids, (0, self.ttt_steps))  # [B, S + steps], id 0 past the end
            out["inputs_embeds"] = self.embed[padded]  # [B, S + steps, H]
        if not self.source.online:
            H = self.source.hidden_size
            dtype = self.source.reader.dtype
            aux, last = torch.zeros(B, S, 3 * H, dtype=dtype), torch.zeros(B, S, H, dtype=dtype)
            for b, off, r, L in rows:
                aux[b, off : off + L] = r.aux[:L]
                last[b, off : off + L] = r.last[:L]
            out.update(aux=aux, last=last)
        else:  # the verifier runs on each row alone (right-padded), then its states are scattered into place
            Lmax = max((L for *_, L in rows), default=1)
            out["row_ids"] = torch.zeros(len(rows), Lmax, dtype=torch.long)
            out["row_attn"] = torch.zeros(len(rows), Lmax, dtype=torch.long)
            src, dst = [], []
            for n, (b, off, r, L) in enumerate(rows):
                out["row_ids"][n, :L] = r.input_ids[:L]
                out["row_attn"][n, :L] = 1
                src.append(torch.arange(L) + n * Lmax)
                dst.append(torch.arange(L) + b * S + off)
            out["src"] = torch.cat(src) if src else torch.zeros(0, dtype=torch.long)
            out["dst"] = torch.cat(dst) if dst else torch.zeros(0, dtype=torch.long)
        return out
