"""Feature shards: the on-disk format of the verifier hidden states that offline training reads.

``eyas extract`` writes them (through :func:`write_shard`), ``eyas train`` reads
them (through :class:`FeatureReader`, the one reader), ``eyas extract --verify``
checks them (:func:`verify`), and :func:`write_speculators` re-writes them in
speculators' offline layout for a side-by-side run of both trainers.

Directory layout (version ``eyas-features/1``)::

    DIR/
      manifest.json                          written LAST: a directory without it is unfinished
      rows_{start:09d}-{end:09d}.safetensors rows [start, end) of the prepared set (half-open), in row order
      .progress-rank{r}.json                 only while unfinished: shards rank r finished, with sha256
      .eyas.lock                             only while a writer runs

Rows are the prepared set's rows by position (0-based index into
``eyas.data.prepared.PreparedReader(data)``, the one reader of prepared rows). Shards are contiguous, cover every row
exactly once, and their row ranges are listed in the manifest.

One shard is one safetensors file. With ``N`` the tokens of its rows,
``R = end - start`` and ``H`` the verifier's hidden size::

    input_ids            int32   [N]        token ids of rows start..end-1, concatenated in row order
    loss_mask            bool    [N]        true where the token is trained on (assistant tokens)
    cu_seqlens           int64   [R + 1]    row start+r is tokens cu_seqlens[r]:cu_seqlens[r+1] (cu_seqlens[0] = 0)
    hidden_states        DTYPE   [N, 4, H]  per token: the 3 aux states in ascending layer-id order, then the
                                            verifier's last hidden state BEFORE its final norm
    hidden_states_scale  float32 [R, 4]     only when DTYPE is float8_e4m3fn: value = float(stored) * scale[r, k]

``DTYPE`` is float32, bfloat16, float16 or float8_e4m3fn (``--dtype fp32 / bf16 /
fp16 / fp8``). Aux state ``k`` for layer id ``i`` is the hidden state *entering*
decoder layer ``i`` (transformers' ``output_hidden_states[i]``, vLLM's
``hidden_states + residual`` before layer ``i``). The shard's safetensors
metadata has one entry, ``eyas_features``: a JSON object repeating ``format``,
``rows`` ([start, end]), ``layer_ids`` and ``dtype``.

fp8 (e4m3) keeps one float32 scale per (row, layer): ``scale = amax / 448``
over the row's tokens of that layer (448 is e4m3's largest finite value), so
no value saturates; a row whose layer is all zeros gets scale 1. Measured on
SmolLM2 chat rows (``bench/fp8_error.py``), where the first token's activations
reach 300x the median token's, the per-token relative error is 2.5-2.6% median
against 2.2% for a per-token scale, which would cost 16 more bytes per token.

``manifest.json`` (stage ``extract``) holds, besides ``inputs`` (the verifier
fingerprint, the prepared rows' hashes, the chat-template sha256 they were
rendered with) and ``settings``: ``format``,
``layer_ids``, ``last_hidden_normed`` (always false), ``dtype``,
``hidden_size``, ``num_rows``, and ``outputs.shards``: a list of
``{"file", "rows": [start, end], "tokens", "bytes", "sha256"}`` in row order.
"""

from __future__ import annotations

import bisect
import hashlib
import json
import os
from collections import OrderedDict
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Iterator

import numpy as np
import torch

from eyas.core.errors import EyasError
from eyas.core.files import atomic_path, sha256_file
from eyas.core.manifest import MANIFEST, folder_stage, read_manifest, write_manifest

FORMAT = "eyas-features/1"
STAGE = "extract"
NUM_STATES = 4  # 3 aux + last
METADATA_KEY = "eyas_features"  # the one safetensors metadata entry: a JSON object

#: ``--dtype`` names and the dtype stored on disk.
STORAGE_DTYPES: dict[str, torch.dtype] = {
    "fp32": torch.float32,
    "bf16": torch.bfloat16,
    "fp16": torch.float16,
    "fp8": torch.float8_e4m3fn,
}
FP8_MAX = 448.0  # torch.finfo(torch.float8_e4m3fn).max

#: Keep at most this many shard files open (memory-mapped) per reader.
_OPEN_SHARDS = 16

#: Shards whose sha256 this process has checked against their manifest, by (path, size, mtime, expected sha256):
#: a shard is hashed once, when a reader first opens it, and again only if its file changes. Loader workers
#: forked after the trainer opened every shard (to read the row lengths) inherit the entries.
_VERIFIED: set[tuple[str, int, int, str]] = set()
_HASH_THREADS = 8  # hashlib releases the GIL: shards hash in parallel, bound by the disk


def shard_name(start: int, end: int) -> str:
    """The file name of the shard holding rows ``[start, end)``."""
    return f"rows_{start:09d}-{end:09d}.safetensors"


def bytes_per_token(hidden_size: int, dtype: str) -> int:
    """Bytes one token costs on disk: 4 states of ``hidden_size`` plus its id and mask (row overheads aside)."""
    return NUM_STATES * hidden_size * STORAGE_DTYPES[dtype].itemsize + 4 + 1


# --------------------------------------------------------------------------- fp8


def fp8_scale(amax: torch.Tensor) -> torch.Tensor:
    """The float32 scale for values whose absolute maximum is ``amax`` (1 where ``amax`` is 0)."""
    amax = amax.float()
    return torch.where(amax > 0, amax / FP8_MAX, torch.ones_like(amax))


def fp8_encode(x: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """``x / scale`` in e4m3; ``scale`` broadcasts against ``x``."""
    return (x.float() / scale).clamp_(-FP8_MAX, FP8_MAX).to(torch.float8_e4m3fn)


def fp8_decode(q: torch.Tensor, scale: torch.Tensor, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """Undo :func:`fp8_encode` (computed in float32, returned in ``dtype``)."""
    return (q.float() * scale).to(dtype)


# --------------------------------------------------------------------------- writing


def shard_tensors(
    input_ids: list[torch.Tensor],
    loss_mask: list[torch.Tensor],
    hidden_states: list[torch.Tensor],
    scales: list[torch.Tensor] | None = None,
) -> dict[str, list[torch.Tensor]]:
    """One shard's tensors from its rows in order, as pieces to be concatenated along dim 0 on write: per row
    ids ``[T]``, mask ``[T]``, states ``[T, 4, H]`` (already in the storage dtype) and, for fp8, its scales
    ``[4]``. The states are not copied here: :func:`write_shard` streams each row's slice to the file."""
    lengths = torch.tensor([0] + [len(t) for t in input_ids], dtype=torch.int64)
    out = {
        "input_ids": [torch.cat(input_ids).to(torch.int32)],
        "loss_mask": [torch.cat(loss_mask).to(torch.bool)],
        "cu_seqlens": [torch.cumsum(lengths, 0)],
        "hidden_states": list(hidden_states),  # R pieces [T_r, 4, H] -> [N, 4, H]
    }
    if scales is not None:
        out["hidden_states_scale"] = [torch.stack(scales).to(torch.float32)]  # [R, 4]
    return out


#: safetensors' names of the dtypes a shard holds.
_ST_DTYPES = {torch.float32: "F32", torch.bfloat16: "BF16", torch.float16: "F16", torch.float8_e4m3fn: "F8_E4M3",
              torch.int32: "I32", torch.int64: "I64", torch.bool: "BOOL"}  # fmt: skip


_WRITE_CHUNK = 4 << 20


def _bytes_of(t: torch.Tensor) -> memoryview:
    """The raw bytes of a CPU tensor, without a copy when it is contiguous."""
    return memoryview(t.detach().contiguous().view(torch.uint8).numpy()).cast("B")


def write_safetensors(path: Path, tensors: dict[str, list[torch.Tensor]], metadata: dict[str, str]) -> str:
    """Write a safetensors file from tensors given as pieces (concatenated along dim 0 in the file) and return
    its sha256, computed from the same buffers as they are written: one pass over the data, no concatenated
    copy and no re-read (``safetensors.save_file`` needs one contiguous tensor each, and hashing after it reads
    the file back). Tensors go in order of decreasing item size, then name, so every one is aligned to its item
    size (the header is padded to 8 bytes, as safetensors pads it); the output is deterministic."""
    header: dict[str, Any] = {"__metadata__": metadata}
    order = sorted(tensors, key=lambda k: (-tensors[k][0].dtype.itemsize, k))
    offset = 0
    for name in order:
        pieces = tensors[name]
        rest = tuple(pieces[0].shape[1:])
        if any(tuple(p.shape[1:]) != rest or p.dtype != pieces[0].dtype for p in pieces):
            raise ValueError(f"{name}: pieces of different trailing shapes or dtypes")
        shape = [sum(p.shape[0] for p in pieces), *rest]
        nbytes = int(np.prod(shape)) * pieces[0].dtype.itemsize
        header[name] = {"dtype": _ST_DTYPES[pieces[0].dtype], "shape": shape, "data_offsets": [offset, offset + nbytes]}
        offset += nbytes
    head = json.dumps(header, separators=(",", ":")).encode()
    head += b" " * (-len(head) % 8)
    h = hashlib.sha256()
    with open(path, "wb", buffering=0) as f:
        for chunk in (len(head).to_bytes(8, "little"), head):
            f.write(chunk)
            h.update(chunk)
        for name in order:
            for piece in tensors[name]:
                if not piece.numel():
                    continue
                data = _bytes_of(piece)
                # In chunks that stay in the CPU cache between hashing and writing, so the data is read from
                # memory once, not twice (about 30% faster, measured on a 1 GiB shard). hashlib and unbuffered writes
                # release the GIL: writer threads overlap each other and the forward passes.
                for i in range(0, len(data), _WRITE_CHUNK):
                    mv = data[i : i + _WRITE_CHUNK]
                    h.update(mv)
                    while mv:  # a raw write may be partial
                        mv = mv[f.write(mv) :]
    return h.hexdigest()


def write_shard(
    out_dir: str | os.PathLike,
    *,
    start: int,
    end: int,
    tensors: dict[str, list[torch.Tensor]],
    layer_ids: list[int],
) -> dict[str, Any]:
    """Write one shard (pieces as :func:`shard_tensors` returns them) atomically and return its manifest
    entry, with the sha256 of the file as written."""
    R = sum(len(c) for c in tensors["cu_seqlens"]) - 1
    if R != end - start or not tensors["hidden_states"]:
        raise ValueError(f"shard rows [{start}, {end}) but {R} rows of data")
    dtype = next(k for k, v in STORAGE_DTYPES.items() if v == tensors["hidden_states"][0].dtype)
    info = {"format": FORMAT, "rows": [start, end], "layer_ids": layer_ids, "dtype": dtype}
    name = shard_name(start, end)
    with atomic_path(Path(out_dir) / name) as tmp:
        digest = write_safetensors(tmp, tensors, {METADATA_KEY: json.dumps(info, sort_keys=True)})
        size = tmp.stat().st_size
    return {"file": name, "rows": [start, end], "tokens": int(tensors["cu_seqlens"][-1][-1]), "bytes": size,
            "sha256": digest}  # fmt: skip


# --------------------------------------------------------------------------- reading


@dataclass
class FeatureRow:
    """One row as training wants it."""

    input_ids: torch.Tensor  # int64 [T]
    loss_mask: torch.Tensor  # bool [T]
    aux_hidden_states: torch.Tensor  # [T, 3*H], layer ids ascending
    last_hidden_state: torch.Tensor  # [T, H], before the verifier's final norm


class FeatureReader:
    """Random access to the rows of a finished ``eyas extract`` output, cast to ``dtype`` on load.

    ``reader[i]`` is row ``i`` of the prepared set as a :class:`FeatureRow`; fp8
    shards are decoded with their scales. Shard files are memory-mapped lazily
    and re-opened after a fork (DataLoader workers each get their own handles).
    Opening the reader checks that every shard is there with its recorded size;
    opening a shard checks its sha256 against the manifest, once per process
    and file version (so a shard damaged after extraction stops training with
    its name instead of training on it). :func:`verify` checks a whole folder.
    """

    def __init__(self, path: str | os.PathLike, *, dtype: torch.dtype = torch.float32) -> None:
        self.path = Path(path)
        self.dtype = dtype
        self.manifest = read_features_manifest(self.path)
        self.shards: list[dict[str, Any]] = self.manifest["outputs"]["shards"]
        self.layer_ids: list[int] = list(self.manifest["layer_ids"])
        self.hidden_size: int = int(self.manifest["hidden_size"])
        self.storage_dtype: str = self.manifest["dtype"]
        self._starts = [s["rows"][0] for s in self.shards]
        self.num_rows = int(self.manifest["num_rows"])
        for s in self.shards:
            p = self.path / s["file"]
            if not p.is_file():
                raise EyasError(f"feature shard {p} is missing; run `eyas extract` again to redo it")
            if p.stat().st_size != s["bytes"]:
                raise EyasError(
                    f"feature shard {p} has {p.stat().st_size} bytes, the manifest says {s['bytes']}; "
                    "it was changed after extraction: run `eyas extract --verify` and extract again"
                )
        self._handles: OrderedDict[int, Any] = OrderedDict()
        self._cu: dict[int, torch.Tensor] = {}
        self._pid = os.getpid()
        self._lengths: np.ndarray | None = None

    def __len__(self) -> int:
        return self.num_rows

    def _handle(self, k: int):
        from safetensors import safe_open

        if self._pid != os.getpid():  # forked: mmaps and handles are not shared
            self._handles.clear()
            self._pid = os.getpid()
        f = self._handles.get(k)
        if f is None:
            self.check_shards([k])
            f = safe_open(str(self.path / self.shards[k]["file"]), framework="pt")
            self._handles[k] = f
            if len(self._handles) > _OPEN_SHARDS:
                self._handles.popitem(last=False)
        else:
            self._handles.move_to_end(k)
        if k not in self._cu:
            self._cu[k] = f.get_tensor("cu_seqlens")
        return f

    def check_shards(self, shards: list[int] | None = None) -> None:
        """Hash the shards ``shards`` (default: all) not yet checked in this process, in parallel, and raise
        naming the first whose sha256 differs from the manifest."""
        from concurrent.futures import ThreadPoolExecutor

        todo = []
        for k in range(len(self.shards)) if shards is None else shards:
            s, p = self.shards[k], self.path / self.shards[k]["file"]
            st = p.stat()
            key = (str(p.resolve()), st.st_size, st.st_mtime_ns, s["sha256"])
            if key not in _VERIFIED:
                todo.append((p, key))
        with ThreadPoolExecutor(min(_HASH_THREADS, len(todo) or 1)) as pool:
            digests = list(pool.map(lambda t: sha256_file(t[0]), todo))
        for (p, key), digest in zip(todo, digests):
            if digest != key[3]:
                raise EyasError(f"feature shard {p} has sha256 {digest[:16]}..., its manifest says {key[3][:16]}...: "
                                f"it was changed or damaged after extraction; run `eyas extract --verify {self.path}` "
                                "and extract the damaged shards again")  # fmt: skip
            _VERIFIED.add(key)

    def _locate(self, i: int) -> tuple[int, int]:
        if not 0 <= i < self.num_rows:
            raise IndexError(f"row {i} out of range: {self.path} holds {self.num_rows} rows")
        k = bisect.bisect_right(self._starts, i) - 1
        return k, i - self._starts[k]

    def shards_of(self, rows: list[int]) -> list[int]:
        """The shards holding ``rows``, ascending."""
        return sorted({self._locate(i)[0] for i in rows})

    @property
    def lengths(self) -> np.ndarray:
        """Tokens per row, int64 ``[num_rows]`` (read from each shard's ``cu_seqlens``)."""
        if self._lengths is None:
            self.check_shards()  # every shard is opened below: hash them all at once, in parallel
            parts = []
            for k in range(len(self.shards)):
                self._handle(k)
                parts.append(torch.diff(self._cu[k]).numpy())
            self._lengths = np.concatenate(parts) if parts else np.zeros(0, np.int64)
        return self._lengths

    def raw(self, i: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor | None]:
        """Row ``i`` as stored: ids int32 ``[T]``, mask bool ``[T]``, states ``[T, 4, H]``, fp8 scale ``[4]`` or None."""
        k, r = self._locate(i)
        f = self._handle(k)
        a, b = (int(x) for x in self._cu[k][r : r + 2])
        ids = f.get_slice("input_ids")[a:b]
        mask = f.get_slice("loss_mask")[a:b]
        hs = f.get_slice("hidden_states")[a:b]
        scale = f.get_slice("hidden_states_scale")[r : r + 1][0] if self.storage_dtype == "fp8" else None
        return ids, mask, hs, scale

    def states(self, i: int, dtype: torch.dtype | None = None) -> torch.Tensor:
        """Row ``i``'s ``[T, 4, H]`` states decoded to ``dtype`` (default: the reader's)."""
        _, _, hs, scale = self.raw(i)
        dtype = dtype or self.dtype
        return hs.to(dtype) if scale is None else fp8_decode(hs, scale[None, :, None], dtype)

    def __getitem__(self, i: int) -> FeatureRow:
        ids, mask, _, _ = self.raw(i)
        hs = self.states(i)  # [T, 4, H]
        T, H = hs.shape[0], hs.shape[2]
        return FeatureRow(
            input_ids=ids.to(torch.int64),
            loss_mask=mask,
            aux_hidden_states=hs[:, :3].reshape(T, 3 * H),  # [T, 3*H], ascending layer ids
            last_hidden_state=hs[:, 3].contiguous(),  # [T, H]
        )

    def __iter__(self) -> Iterator[FeatureRow]:
        for i in range(self.num_rows):
            yield self[i]


def read_features_manifest(path: str | os.PathLike) -> dict[str, Any]:
    """The manifest of a finished ``eyas extract`` output, checked for the format this module reads."""
    path = Path(path)
    if not (path / MANIFEST).is_file() and any(path.glob(".progress-rank*.json")):
        raise EyasError(f"{path} is an unfinished `eyas extract` output (no manifest.json); run the same "
                        "`eyas extract` command again to finish it")  # fmt: skip
    m = read_manifest(path, stage=STAGE)
    if m.get("format") != FORMAT:
        raise EyasError(f"{path / MANIFEST} has format {m.get('format')!r}; this eyas reads {FORMAT!r}")
    _check_shape(m, path / MANIFEST)
    return m


def _check_shape(m: dict[str, Any], where: Path) -> None:
    """The keys every reader of features takes from the manifest, each of its type: a damaged or hand-edited
    manifest is one line naming the key, not a KeyError where it is first read."""
    ints = lambda v: isinstance(v, int) and not isinstance(v, bool)  # noqa: E731
    shard = {"file": lambda v: isinstance(v, str) and "/" not in v and v not in ("", ".", ".."), "bytes": ints,
             "sha256": lambda v: isinstance(v, str), "tokens": ints,
             "rows": lambda v: isinstance(v, list) and len(v) == 2 and all(map(ints, v))}  # fmt: skip
    top = {"hidden_size": ints, "num_rows": ints, "dtype": lambda v: v in STORAGE_DTYPES,
           "layer_ids": lambda v: isinstance(v, list)}  # fmt: skip
    bad = next((k for k, ok in top.items() if not ok(m.get(k))), None)
    shards = (m.get("outputs") or {}).get("shards") if isinstance(m.get("outputs"), dict) else None
    if bad is None and not isinstance(shards, list):
        bad = "outputs.shards"
    if bad is None:
        bad = next((f"outputs.shards[{i}].{k}" for i, s in enumerate(shards) for k, ok in shard.items()
                    if not isinstance(s, dict) or not ok(s.get(k))), None)  # fmt: skip
    if bad is not None:
        raise EyasError(f"{where}: {bad} is missing or of the wrong type; the manifest is damaged: run `eyas "
                        "extract` again into a new --out")  # fmt: skip


# --------------------------------------------------------------------------- checking


def verify(path: str | os.PathLike) -> dict[str, Any]:
    """Check every shard of a finished extraction against the manifest (presence, size, sha256, rows).

    Returns a summary; raises :class:`EyasError` naming every missing or
    corrupted shard (and any file the manifest does not know).
    """
    path = Path(path)
    m = read_features_manifest(path)
    shards = m["outputs"]["shards"]
    problems: list[str] = []
    expected_start = 0
    for s in shards:
        p = path / s["file"]
        if s["rows"][0] != expected_start:
            problems.append(f"{s['file']}: starts at row {s['rows'][0]}, expected {expected_start} (a gap or overlap)")
        expected_start = s["rows"][1]
        if not p.is_file():
            problems.append(f"{s['file']}: missing")
            continue
        size = p.stat().st_size
        if size != s["bytes"]:
            problems.append(f"{s['file']}: {size} bytes, the manifest says {s['bytes']} (truncated or rewritten)")
            continue
        digest = sha256_file(p)
        if digest != s["sha256"]:
            problems.append(f"{s['file']}: sha256 {digest[:16]}... differs from the manifest's {s['sha256'][:16]}... "
                            "(corrupted)")  # fmt: skip
    if expected_start != m["num_rows"]:
        problems.append(f"the shards cover rows [0, {expected_start}) but the manifest says {m['num_rows']} rows")
    known = {s["file"] for s in shards}
    strays = sorted(p.name for p in path.glob("rows_*.safetensors") if p.name not in known)
    problems += [f"{name}: not in the manifest (left from another run?)" for name in strays]
    if problems:
        raise EyasError(f"{path}: {len(problems)} problem(s) found:\n  " + "\n  ".join(problems)
                        + "\nrun the same `eyas extract` command again into a fresh --out to redo them")  # fmt: skip
    tokens = sum(s["tokens"] for s in shards)
    nbytes = sum(s["bytes"] for s in shards)
    return {"path": str(path), "shards": len(shards), "rows": m["num_rows"], "tokens": tokens, "bytes": nbytes,
            "ok": True}  # fmt: skip


# --------------------------------------------------------------------------- speculators' layout

#: The stage recorded in the manifest of a folder :func:`write_speculators` wrote (only such a folder is replaced).
SPECULATORS_STAGE = "extract --speculators-out"
#: What that folder holds: ``datasets``' ``save_to_disk`` files, the per-row states, the manifest.
_SPECULATORS_ENTRIES = ("hidden_states", "state.json", "dataset_info.json", "data-*.arrow", MANIFEST)


def check_speculators_out(out: str | os.PathLike, *, features: str | os.PathLike) -> None:
    """Refuse a ``--speculators-out`` that writing would destroy: a file, the features folder or a folder
    around it, or a folder holding anything but the layout an earlier run wrote there (the write replaces the
    whole folder)."""
    out = Path(out)
    if out.exists() and not out.is_dir():
        raise EyasError(f"--speculators-out {out} is a file, not a folder: choose another --speculators-out")
    here, feats = out.resolve(), Path(features).resolve()
    if here == feats or here in feats.parents:
        raise EyasError(f"--speculators-out {out} would replace the features in {features}: give speculators' "
                        "layout a folder of its own")  # fmt: skip
    if not out.is_dir() or not any(out.iterdir()):
        return
    strays = [p.name for p in sorted(out.iterdir()) if not any(p.match(g) for g in _SPECULATORS_ENTRIES)]
    if folder_stage(out) != SPECULATORS_STAGE or strays:
        raise EyasError(f"--speculators-out {out} holds files eyas did not write there ({(strays or [MANIFEST])[0]}, "
                        "...); the write replaces the whole folder: choose a new or empty one")  # fmt: skip


def write_speculators(features: str | os.PathLike, *, out: str | os.PathLike) -> Path:
    """Re-write finished features in speculators' offline layout (speculators 0.9.0, ``train/data.py``).

    ``out`` becomes what speculators' ``ArrowDataset(datapath=out)`` reads: a
    ``datasets`` dataset saved with ``save_to_disk`` (columns ``input_ids``,
    ``loss_mask``, ``seq_len``, torch format; speculators takes the loss mask
    from here, not from the hidden-state files) and ``hidden_states/hs_{i}.safetensors``
    for row ``i`` with ``hidden_states`` ``[T, 4, H]`` (3 aux + last, as vLLM
    writes them) and ``token_ids`` int64 ``[T]``. fp8 features are decoded to
    bfloat16 (speculators' fp8 files use a per-token scale that ours do not
    have); other dtypes are kept. A ``manifest.json`` marks the folder as this layout, which a rerun replaces
    (:func:`check_speculators_out` refuses any other folder).
    """
    import datasets

    check_speculators_out(out, features=features)
    reader = FeatureReader(features)
    dtype = torch.bfloat16 if reader.storage_dtype == "fp8" else STORAGE_DTYPES[reader.storage_dtype]
    out = Path(out)
    from safetensors.torch import save_file

    ids_col, mask_col, len_col = [], [], []
    with atomic_path(out, is_dir=True) as tmp:
        (tmp / "hidden_states").mkdir()
        for i in range(len(reader)):
            ids, mask, _, _ = reader.raw(i)
            hs = reader.states(i, dtype)
            save_file({"hidden_states": hs.contiguous(), "token_ids": ids.to(torch.int64)},
                      str(tmp / "hidden_states" / f"hs_{i}.safetensors"))  # fmt: skip
            ids_col.append(ids.to(torch.int64).tolist())
            mask_col.append(mask.to(torch.int64).tolist())
            len_col.append(len(ids))
        ds = datasets.Dataset.from_dict(
            {"input_ids": ids_col, "loss_mask": mask_col, "seq_len": len_col},
            features=datasets.Features(
                {
                    "input_ids": datasets.Sequence(datasets.Value("int64")),
                    "loss_mask": datasets.Sequence(datasets.Value("int64")),
                    "seq_len": datasets.Value("int64"),
                }
            ),  # fmt: skip
        )
        ds.set_format("torch")
        ds.save_to_disk(str(tmp))
        write_manifest(tmp, stage=SPECULATORS_STAGE, inputs=_speculators_inputs(features),
                       settings={"dtype": str(dtype).removeprefix("torch.")},
                       outputs={"rows": len(reader)})  # fmt: skip
    return out


def _speculators_inputs(features: str | os.PathLike) -> dict[str, str]:
    """What a speculators layout was written from: the features' folder and their manifest's hash (which holds
    every shard's hash)."""
    return {"features": str(features), "features_manifest_sha256": sha256_file(Path(features) / MANIFEST)}


def speculators_up_to_date(out: str | os.PathLike, *, features: str | os.PathLike) -> bool:
    """Whether ``out`` holds the speculators layout of exactly these finished ``features`` (a rerun of `eyas
    extract --speculators-out` then writes nothing)."""
    if folder_stage(out) != SPECULATORS_STAGE:
        return False
    try:
        return read_manifest(out).get("inputs") == _speculators_inputs(features)
    except EyasError:
        return False
