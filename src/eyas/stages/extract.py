"""``eyas extract``: run the verifier over prepared rows and store the hidden states offline training reads.

The verifier's text backbone runs with plain transformers (any layout
:mod:`eyas.verifier.load` resolves: wrappers, MoE/MLA, GGUF, compressed-tensors
int4) on CPU or GPU. Forward pre-hooks on the three aux decoder layers and on
the final norm capture exactly what EAGLE-3 needs (the state *entering* each
aux layer, and the last state *before* the norm); ``model.model`` runs, never
the head, so no logits are materialised.

Resumable: each rank records finished shards (with sha256) in
``.progress-rank{r}.json`` after each shard; a rerun keeps the shards whose
hash still matches and redoes the rest (a partly written window is computed
again whole), byte for byte the same. The manifest is written last. Under
``torchrun`` whole windows are dealt out to ranks, so every rank forms the
batches one process would and the output is identical to a one-process run
(an extraction of fewer windows than ranks leaves some ranks idle). The format
is :mod:`eyas.data.features`.
"""

from __future__ import annotations

import json
import threading
from dataclasses import dataclass
from pathlib import Path
from typing import Any, ClassVar, Literal, Sequence

import numpy as np
import torch

from eyas.data import features
from eyas.data.prepared import PreparedReader, prepared_verifier
from eyas.core import fields
from eyas.core.config import StageConfig, option, recorded_settings, stage_function
from eyas.core.errors import EyasError
from eyas.core.validate import TOKENS
from eyas.engine.extractor import WINDOW_SHARDS, Extractor
from eyas.data.features import FORMAT, STAGE, STORAGE_DTYPES, bytes_per_token, shard_name

# Target shard size on disk. Rows are sorted by length and batched inside a window of shards, which must hold
# many batches for little padding: 256 MiB shards, one per window, padded 32% of the forward's tokens on
# SmolLM2 (4.6 KB per token in bf16; H200 run in docs/BENCHMARKS.md), 1 GiB ones 13%.
SHARD_BYTES = 1 << 30
BATCH_TOKENS = {"cuda": 32768, "cpu": 8192}  # default token budget per forward (padding included)
PROGRESS_GLOB = ".progress-*.json"
MERGED_PROGRESS = ".progress-merged.json"


# --------------------------------------------------------------------------- rows in


class InMemoryRows:
    """Rows given as a list of (ids, loss mask): for benchmarks and tests that need no prepared directory."""

    def __init__(self, rows: Sequence[tuple[Sequence[int], Sequence[int]]]) -> None:
        self.rows = [(np.asarray(i, np.int64), np.asarray(m).astype(bool)) for i, m in rows]
        self.lengths = np.array([len(i) for i, _ in self.rows], dtype=np.int64)

    def fetch(self, start: int, end: int) -> list[tuple[np.ndarray, np.ndarray]]:
        return self.rows[start:end]


# --------------------------------------------------------------------------- planning


def default_shard_tokens(lengths: np.ndarray, hidden_size: int, dtype: str) -> int:
    """Tokens per shard for shards of at most ``SHARD_BYTES`` (a shard closes at the row that reaches its token
    count, so room is left for the longest row). The bound matters on a GPU: PyTorch's pinned-memory allocator
    rounds every block up to a power of two (``CachingHostAllocator::allocate``, ATen/core/CachingHostAllocator.h,
    unless ``pinned_max_round_threshold`` is set), so a shard's buffer just over 1 GiB would pin 2 GiB."""
    longest = int(lengths.max()) if len(lengths) else 0
    per_token = bytes_per_token(hidden_size, dtype)
    return max(1, (SHARD_BYTES - longest * per_token) // per_token)


def plan_shards(lengths: np.ndarray, shard_tokens: int) -> list[tuple[int, int]]:
    """Cut rows into contiguous shards ``[start, end)`` of at least ``shard_tokens`` tokens (the last may be
    smaller); a row is never split. Depends only on the lengths, so every rank computes the same plan."""
    shards, start, acc = [], 0, 0
    for i, n in enumerate(lengths.tolist()):
        acc += n
        if acc >= shard_tokens:
            shards.append((start, i + 1))
            start, acc = i + 1, 0
    if start < len(lengths) or not shards:
        shards.append((start, len(lengths)))
    return shards


def plan_windows(shards: list[tuple[int, int]], window: int = WINDOW_SHARDS) -> list[list[tuple[int, int]]]:
    """Consecutive groups of ``window`` shards, batched together. Fixed by the shard plan alone, so a resumed or
    distributed run forms the same batches (on a GPU the numerics of a row depend on its batch's shape)."""
    return [shards[i : i + window] for i in range(0, len(shards), window)]


def assign_shards(tokens: Sequence[int], world_size: int) -> list[list[int]]:
    """Deal shards (or windows of them) to ranks, each to the rank with the fewest tokens so far (ties: lowest
    rank)."""
    load = [0] * world_size
    out: list[list[int]] = [[] for _ in range(world_size)]
    for k, n in enumerate(tokens):
        r = min(range(world_size), key=lambda j: (load[j], j))
        out[r].append(k)
        load[r] += n
    return out


# --------------------------------------------------------------------------- progress


def _read_progress(out: Path, plan: str) -> dict[str, dict[str, Any]]:
    """Every shard any earlier run recorded as finished (merged file first, then the per-rank files)."""
    entries: dict[str, dict[str, Any]] = {}
    files = sorted(out.glob(PROGRESS_GLOB), key=lambda p: (p.name != MERGED_PROGRESS, p.name))
    for p in files:
        try:
            d = json.loads(p.read_text())
        except (OSError, json.JSONDecodeError):
            continue  # written atomically, so this is not ours; its shards are simply redone
        if d.get("plan") != plan:
            raise EyasError(
                f"{out} holds an unfinished extraction made with other inputs or settings ({p.name}); "
                "run the command that made it again to finish it, or choose another --out"
            )
        entries.update(d.get("shards", {}))
    return entries


class _Progress:
    """This rank's record of finished shards, rewritten atomically after each one."""

    def __init__(self, path: Path, plan: str, initial: dict[str, dict[str, Any]]) -> None:
        self.path, self.plan, self.shards = path, plan, dict(initial)
        self._lock = threading.Lock()
        self._save()

    def add(self, entry: dict[str, Any]) -> None:
        with self._lock:
            self.shards[entry["file"]] = entry
            self._save()

    def _save(self) -> None:
        from eyas.core.files import write_json

        write_json(self.path, {"plan": self.plan, "shards": self.shards})


def _still_good(out: Path, entry: dict[str, Any] | None) -> bool:
    from eyas.core.files import sha256_file

    if entry is None:
        return False
    p = out / entry["file"]
    return p.is_file() and p.stat().st_size == entry["bytes"] and sha256_file(p) == entry["sha256"]


# --------------------------------------------------------------------------- the stage


@dataclass(kw_only=True, frozen=True)
class ExtractConfig(StageConfig):
    """Run the verifier over prepared rows and store its aux and last hidden states as feature shards.

    Resumable (rerun the same command), distributed with
    ``torchrun --nproc-per-node N -m eyas.cli extract ...``, and checkable with ``--verify DIR``."""

    stage: ClassVar[str] = "extract"

    verifier: str | None = fields.verifier("; the prepared rows must be for it.", default=None)
    data: str | None = option(None, recorded=False, help="a directory written by `eyas prepare`.")
    out: str | None = fields.out(" for the feature shards.", default=None)
    layers: list[int] | None = option(
        None,
        recorded=False,
        help="three aux layer ids (id i = the state entering decoder layer i); default [2, L//2, L-3].",
    )
    batch_tokens: int | None = option(
        None,
        recorded=False,
        range=TOKENS,
        help="tokens per forward, padding included (default 32768 on CUDA, 8192 on CPU).",
    )
    dtype: Literal["bf16", "fp16", "fp32", "fp8"] = option(
        "bf16", help="stored dtype; fp8 is e4m3 with a scale per row and layer (half of bf16's bytes)."
    )
    device: str | None = fields.device("; under torchrun each rank takes its own GPU.")
    device_map: str | dict[str, Any] | None = fields.device_map()
    shard_tokens: int | None = option(None, range=TOKENS, help="tokens per shard (default: shards of at most 1 GiB).")
    speculators_out: str | None = option(
        None, recorded=False, help="also write the features in speculators' offline layout to this directory."
    )
    verify: str | None = option(
        None, recorded=False, help="check the shards of this finished output against its manifest (hashes) and exit."
    )

    def check(self) -> None:
        from eyas.verifier.info import check_aux_layer_ids

        if self.verify is None:
            missing = [f"--{n}" for n, v in (("verifier", self.verifier), ("data", self.data), ("out", self.out))
                       if v is None]  # fmt: skip
            if missing:
                raise EyasError(f"eyas extract needs {', '.join(missing)} (or --verify DIR)")
        if self.device_map is not None and self.device is not None:
            raise EyasError("give either --device or --device-map, not both")
        if self.layers is not None:  # (the verifier's layer count is checked when it is read)
            check_aux_layer_ids(self.layers)


def run(c: ExtractConfig) -> dict[str, Any]:
    """Run `eyas extract` as ``c`` describes (see :class:`ExtractConfig`)."""
    if c.verify is not None:
        summary = features.verify(c.verify)
        print(f"{c.verify}: ok, {summary['shards']} shards, {summary['rows']} rows, {summary['tokens']} tokens, "
              f"every sha256 matches the manifest")  # fmt: skip
        return summary
    if c.speculators_out is not None:  # before any work: the layout is written last, over what is there
        features.check_speculators_out(c.speculators_out, features=c.out)
    from eyas.core import dist as _dist

    kind = "cuda" if (c.device or ("cuda" if torch.cuda.is_available() else "cpu")).startswith("cuda") else "cpu"
    with _dist.init(device_type=kind) as d:
        return _extract(d, c)


extract = stage_function(ExtractConfig, run, "extract")


def _extract(d, c: ExtractConfig) -> dict[str, Any]:
    from eyas.core.files import check_free_disk, human_bytes, sha256_json, write_json
    from eyas.core.manifest import StageOutput
    from eyas.verifier.load import build_text_model
    from eyas.verifier.info import check_aux_layer_ids, fingerprint, resolve

    out = Path(c.out)
    if c.dtype not in STORAGE_DTYPES:
        raise EyasError(f"--dtype {c.dtype!r} is not one of {', '.join(STORAGE_DTYPES)}")
    info = resolve(c.verifier)
    source = PreparedReader(c.data)
    pmanifest = source.manifest
    fp = fingerprint(info)
    if prepared_verifier(pmanifest) != fp:
        raise EyasError(
            f"the prepared rows in {c.data} were tokenized for another verifier "
            f"({pmanifest.get('verifier_path', 'unknown')}), not {info.path}; run `eyas prepare` with this "
            "--verifier, or pass the verifier they were made for"
        )
    layer_ids = check_aux_layer_ids(c.layers if c.layers is not None else info.aux_layer_ids, info.num_hidden_layers)
    if c.device_map is not None:
        if d.active:
            raise EyasError("--device-map spreads one verifier over all GPUs in one process; do not use it under "
                            "torchrun (or run one process)")  # fmt: skip
        where: torch.device | None = None
        on_cuda = torch.cuda.is_available()
    else:
        where = d.device(c.device)
        on_cuda = where.type == "cuda"
        if on_cuda and not torch.cuda.is_available():
            raise EyasError(f"--device {c.device} asked for CUDA but torch sees no GPU (torch {torch.__version__})")
    # bf16 on GPUs, as the verifier is served; fp32 on CPU (and when fp32 is asked for), where it is exact.
    compute_dtype = torch.bfloat16 if on_cuda and c.dtype != "fp32" else torch.float32
    batch_tokens = c.batch_tokens or BATCH_TOKENS["cuda" if on_cuda else "cpu"]
    H = info.hidden_size
    shard_tokens = c.shard_tokens or default_shard_tokens(source.lengths, H, c.dtype)
    shards = plan_shards(source.lengths, shard_tokens)
    # the template the rows were rendered with travels on, so train records it and eval can compare it
    inputs = {"verifier": fp, "data": source.extracted_from(),
              "chat_template_sha256": (pmanifest.get("inputs") or {}).get("chat_template_sha256")}  # fmt: skip
    settings = recorded_settings(c, format=FORMAT, layer_ids=layer_ids, last_hidden_normed=False,
                                 compute_dtype=str(compute_dtype).removeprefix("torch."), shard_tokens=shard_tokens,
                                 window_shards=WINDOW_SHARDS)  # fmt: skip
    plan = sha256_json({"inputs": inputs, "settings": settings})

    with StageOutput(out, stage=STAGE, d=d) as output:

        def open_out() -> dict[str, Any] | None:  # on rank 0: None when finished, else the shards done so far
            if output.up_to_date(inputs=inputs, settings=settings, other="features") is not None:
                return None
            for tmp in out.glob(".*.tmp-*"):  # left by a killed run; the lock says no writer is alive
                if tmp.is_file():
                    tmp.unlink()
            entries = _read_progress(out, plan)
            write_json(out / MERGED_PROGRESS, {"plan": plan, "shards": entries})
            for p in out.glob(".progress-rank*.json"):
                p.unlink()
            return entries

        known = d.run_on_main(open_out)
        if known is None:
            manifest = features.read_features_manifest(out)
            if d.is_main:
                print(f"{out}: already extracted ({manifest['num_rows']} rows); nothing to do")
                if c.speculators_out and features.speculators_up_to_date(c.speculators_out, features=out):
                    print(f"{c.speculators_out}: speculators' layout of these features, up to date")
                elif c.speculators_out:
                    features.write_speculators(out, out=c.speculators_out)
            return manifest
        d.barrier("start of extraction")
        windows = plan_windows(shards)
        mine = [windows[k] for k in assign_shards([int(source.lengths[w[0][0] : w[-1][1]].sum()) for w in windows],
                                                  d.world_size)[d.rank]]  # fmt: skip
        kept = {shard_name(*sh): known[shard_name(*sh)] for w in mine for sh in w
                if _still_good(out, known.get(shard_name(*sh)))}  # fmt: skip
        todo = [sh for w in mine for sh in w if shard_name(*sh) not in kept]
        need = int(sum(source.lengths[s:e].sum() for s, e in todo)) * bytes_per_token(H, c.dtype)
        total_need = sum(d.all_gather(need))
        check_free_disk(out, needed=total_need, what=f"extracting {len(shards)} shard(s) of {c.dtype} features")
        record = _Progress(out / f".progress-rank{d.rank}.json", plan, kept)
        tokens_done, elapsed, forward_tokens = 0, 0.0, 0
        if todo:
            model = build_text_model(info, dtype=compute_dtype, device=where, device_map=c.device_map)
            extractor = Extractor(model, layer_ids=layer_ids, dtype=c.dtype, batch_tokens=batch_tokens)
            extractor.run(source, mine, out, skip=kept, on_shard=record.add, progress=d.is_main)
            st = extractor.stats
            # (a partly written window is computed whole, so these count its kept shards' tokens too)
            tokens_done, elapsed, forward_tokens = st.tokens, st.seconds, st.forward_tokens
            if st.waited_s > 0.1 * st.seconds:
                print(f"rank {d.rank}: writing was the bound: the verifier waited {st.waited_s:.0f} s of "
                      f"{st.seconds:.0f} s for its {extractor.writer_threads} writer thread(s) "
                      f"({st.write_GBps_per_thread:.2f} GB/s each, {st.bytes / st.seconds / 1e9:.2f} GB/s in all "
                      f"to {out}); a faster disk or --dtype fp8 (half the bytes) would go faster")  # fmt: skip
        rates = d.all_gather((tokens_done, elapsed, forward_tokens))
        d.barrier("end of extraction")

        def finish() -> dict[str, Any]:
            entries: dict[str, dict[str, Any]] = {}
            for r in range(d.world_size):
                p = out / f".progress-rank{r}.json"
                entries.update(json.loads(p.read_text())["shards"])
            ordered = []
            for s, e in shards:
                entry = entries.get(shard_name(s, e))
                if entry is None:
                    raise EyasError(f"{out}: shard {shard_name(s, e)} was not recorded by any rank; run again")
                ordered.append(entry)
            tokens, nbytes = sum(x["tokens"] for x in ordered), sum(x["bytes"] for x in ordered)
            m = output.finish(
                outputs={"rows": len(source.lengths), "tokens": tokens, "bytes": nbytes,
                         "bytes_per_token": nbytes / max(tokens, 1), "shards": ordered},
                hashed={x["file"]: x["sha256"] for x in ordered},  # hashed as they were written
                format=FORMAT, layer_ids=layer_ids, last_hidden_normed=False, dtype=c.dtype, hidden_size=H,
                num_rows=len(source.lengths), verifier_path=info.path, data_path=str(c.data),
            )  # fmt: skip
            for p in out.glob(PROGRESS_GLOB):  # the manifest is written: the run is finished
                p.unlink()
            return m

        manifest = d.run_on_main(finish)
    if d.is_main:
        tokens, nbytes = manifest["outputs"]["tokens"], manifest["outputs"]["bytes"]
        done_tokens = sum(t for t, _, _ in rates)
        rate = done_tokens / max(max(e for _, e, _ in rates), 1e-9)
        padding = 1 - done_tokens / max(sum(f for _, _, f in rates), 1)
        print(f"extracted {manifest['num_rows']} rows, {tokens} tokens into {len(shards)} shard(s) in {out}: "
              f"{human_bytes(nbytes)}, {nbytes / max(tokens, 1):.0f} bytes/token ({c.dtype}), layers {layer_ids}"
              + (f"; {done_tokens} tokens this run at {rate:,.0f} tokens/s ({padding:.0%} of the forward's tokens "
                 "were padding)" if done_tokens else ""))  # fmt: skip
        if c.speculators_out:
            path = features.write_speculators(out, out=c.speculators_out)
            print(f"speculators' offline layout written to {path}")
    return manifest
