"""Training batches: rows from feature shards (offline) or prepared rows (online), packed into sequences with
document ids, dealt into optimizer steps, and collated into padded tensors in DataLoader workers.

The packing order is a pure function of ``(seed, epoch)`` and every micro-batch of a step is known to every
rank, so the loss can be normalised by the loss-masked positions of the whole step without a collective, and
one process with ``G*W`` accumulation steps sees exactly the micro-batches ``W`` ranks with ``G`` see.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch

from eyas.data.lengths import plan_batches
from eyas.data.prepared import PreparedReader
from eyas.training.loss import CHUNK_TOKENS, scored_rows, target_rows

OPEN_BINS = 64  # sequences kept open while packing (best fit among them)
# micro-batch tensors not copied to the device with the rest: the groups' bounds (read on the host), and each row
# alone (the online verifier's inputs row by row, which after the first micro-batch's check only a verifier whose
# attention ignores packing reads: the trainer copies them when it does)
HOST_KEYS = frozenset({"row_groups", "row_ids", "row_attn", "src", "dst"})


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


class PreparedRows(PreparedReader):
    """Online rows: an ``eyas prepare`` output (:class:`eyas.data.prepared.PreparedReader`), a row at a time;
    features come from the verifier per batch."""

    online = True

    def row(self, i: int) -> Row:
        r = self.ds[int(i)]
        return Row(torch.from_numpy(np.asarray(r["input_ids"], np.int64)), torch.from_numpy(r["loss_mask"] != 0))


def row_counts(flat: np.ndarray, offsets: np.ndarray, *, max_len: int, ttt_steps: int) -> tuple[np.ndarray, np.ndarray]:
    """Per row: its length after truncation to ``max_len``, and for each TTT step ``k`` how many positions step
    ``k`` scores (``loss_mask[t+2+k]`` with ``t+2+k`` inside the row): ``[R]``, ``[R, ttt_steps]``."""
    starts = offsets[:-1]
    lengths = np.minimum(np.diff(offsets), max_len)
    ends = starts + lengths
    cs = np.concatenate([[0], np.cumsum(flat, dtype=np.int64)])
    counts = np.stack([cs[ends] - cs[np.minimum(starts + 2 + k, ends)] for k in range(ttt_steps)], axis=1)
    return lengths, counts


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
        else:
            out.update(self._verifier_rows(rows))
        return out

    def _verifier_rows(self, rows: list[tuple[int, int, Row, int]]) -> dict[str, torch.Tensor]:
        """The online verifier's inputs: each row alone, right-padded, longest first, in groups of at most one
        micro-batch's tokens padded (:func:`eyas.data.lengths.plan_batches`), each group padded to its own longest
        row. Why groups: padded to the micro-batch's longest row, the verifier computed on up to 5x the real
        tokens (rows of 368 tokens on average beside one of 2,000 in SmolLM2's regenerated answers).

        ``row_ids``/``row_attn`` ``[n, Lmax]`` (rows in group order), ``row_groups`` ``[G, 3]`` (each group's
        first row, end and width; read on the host), ``src``: each real token's place in the groups' outputs
        flattened one after another, ``dst``: its place in the packed ``[B * S]`` batch."""
        lengths = np.array([L for *_, L in rows], dtype=np.int64)
        groups = plan_batches(lengths, self.B * self.S)
        order = [n for g in groups for n in g]
        Lmax = int(lengths[order[0]]) if order else 1
        ids = torch.zeros(len(order), Lmax, dtype=torch.long)
        attn = torch.zeros(len(order), Lmax, dtype=torch.long)
        bounds, src, dst = [], [], []
        k = flat = 0
        for g in groups:
            width = int(lengths[g[0]])
            bounds.append((k, k + len(g), width))
            for j, n in enumerate(g):
                b, off, r, L = rows[n]
                ids[k + j, :L] = r.input_ids[:L]
                attn[k + j, :L] = 1
                src.append(torch.arange(L) + flat + j * width)
                dst.append(torch.arange(L) + b * self.S + off)
            k += len(g)
            flat += len(g) * width
        return {"row_ids": ids, "row_attn": attn, "row_groups": torch.tensor(bounds, dtype=torch.long).reshape(-1, 3),
                "src": torch.cat(src) if src else torch.zeros(0, dtype=torch.long),
                "dst": torch.cat(dst) if dst else torch.zeros(0, dtype=torch.long)}  # fmt: skip
