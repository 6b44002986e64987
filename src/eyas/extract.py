"""``eyas extract``: run the verifier over prepared rows and store the hidden states offline training reads.

The verifier's text backbone runs with plain transformers (any layout
:mod:`eyas.verifier` resolves: wrappers, MoE/MLA, GGUF, compressed-tensors
int4) on CPU or GPU. Forward pre-hooks on the three aux decoder layers and on
the final norm capture exactly what EAGLE-3 needs (the state *entering* each
aux layer, and the last state *before* the norm); ``model.model`` runs, never
the head, so no logits are materialised.

Rows are cut into shards of contiguous rows (about 1 GiB each); inside a window
of four shards they are sorted by length and packed into batches under a token
budget (each shard is still written on its own, when its window is done). Batches
are right-padded and run with a causal mask only: a real token never attends
to a later position, so padding cannot reach a stored row, and SDPA takes its
fastest (``is_causal``) path. On CUDA the gathered states go to pinned host
memory on a side stream while the next batch computes, and writer threads
hash and write each shard while the following window computes.

Resumable: each rank records finished shards (with sha256) in
``.progress-rank{r}.json`` after each shard; a rerun keeps the shards whose
hash still matches and redoes the rest (a partly written window is computed
again whole), byte for byte the same. The manifest is written last. Under
``torchrun`` whole windows are dealt out to ranks, so every rank forms the
batches one process would and the output is identical to a one-process run
(an extraction of fewer windows than ranks leaves some ranks idle). The format
is :mod:`eyas.features`.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import os
import queue
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, Container, Literal, Protocol, Sequence

import numpy as np
import torch

from eyas import features
from eyas.errors import EyasError
from eyas.features import FORMAT, NUM_STATES, STAGE, STORAGE_DTYPES, bytes_per_token, shard_name
from eyas.verifier import HiddenStateCapture, input_device, varying_shape_attention

# Target shard size on disk. Rows are sorted by length and batched inside a window of shards, which must hold
# many batches for little padding: 256 MiB shards, one per window, padded 32% of the forward's tokens on
# SmolLM2 (4.6 KB per token in bf16; H200 run in docs/BENCHMARKS.md), 1 GiB ones 13%.
SHARD_BYTES = 1 << 30
# Shards whose rows are sorted and batched together. Padding falls with the rows sorted at once (the benchmark's
# ShareGPT-like lengths at 32,768 tokens per batch: 13% of the forward's tokens are padding in one 1 GiB shard,
# 4.7% across four), while each shard is still written on its own. A window's shards sit in host memory until
# its last batch, so this bounds memory too: window + writer threads shards per rank.
WINDOW_SHARDS = 4
BATCH_TOKENS = {"cuda": 32768, "cpu": 8192}  # default token budget per forward (padding included)
#: Shard writers on CPU: there the forward is the bottleneck and more threads would compete with it.
CPU_WRITER_THREADS = 1


def default_writer_threads(cuda: bool) -> int:
    """Shard writer threads: on a GPU, half this process's share of the host's cores (at most 8). A small
    verifier makes features faster than one thread can write and hash them (SmolLM2 on an H200: about 3 GB/s
    in bf16, where one thread writes and hashes 1-2 GB/s)."""
    if not cuda:
        return CPU_WRITER_THREADS
    local = int(os.environ.get("LOCAL_WORLD_SIZE", "1"))  # ranks sharing this host under torchrun
    return max(2, min(8, (os.cpu_count() or 8) // (2 * local)))
PAD_ID = 0  # right padding: its value never reaches a stored row (causal attention)
PROGRESS_GLOB = ".progress-*.json"
MERGED_PROGRESS = ".progress-merged.json"


# --------------------------------------------------------------------------- rows in


class RowSource(Protocol):
    """What the extractor reads: per-row lengths, and rows ``[start, end)`` as (ids, loss mask) arrays."""

    lengths: np.ndarray

    def fetch(self, start: int, end: int) -> list[tuple[np.ndarray, np.ndarray]]: ...


class PreparedRows:
    """Rows of an ``eyas prepare`` output (a ``datasets`` dataset, memory-mapped)."""

    def __init__(self, ds, where: str | Path) -> None:
        self.where = str(where)
        self._files = [f["filename"] for f in ds.cache_files]
        self.ds = ds.with_format("numpy")
        self.lengths = np.asarray(self.ds["seq_len"], dtype=np.int64)

    def fetch(self, start: int, end: int) -> list[tuple[np.ndarray, np.ndarray]]:
        part = self.ds[start:end]
        out = []
        for r, (ids, mask) in enumerate(zip(part["input_ids"], part["loss_mask"])):
            ids, mask = np.asarray(ids, np.int64), np.asarray(mask).astype(bool)
            if not len(ids) == len(mask) == self.lengths[start + r]:
                raise EyasError(
                    f"{self.where}: row {start + r} has {len(ids)} input_ids, {len(mask)} loss_mask values and "
                    f"seq_len {self.lengths[start + r]}; they must agree: run `eyas prepare` again"
                )
            out.append((ids, mask))
        return out

    def identity(self) -> dict[str, Any]:
        """What the features were made from: row and token counts and a hash of the Arrow files."""
        from eyas.manifest import sha256_file

        h = hashlib.sha256()
        for f in self._files:
            h.update(sha256_file(f).encode())
        return {"rows": len(self.lengths), "tokens": int(self.lengths.sum()), "arrow_sha256": h.hexdigest()}


class InMemoryRows:
    """Rows given as a list of (ids, loss mask): for benchmarks and tests that need no prepared directory."""

    def __init__(self, rows: Sequence[tuple[Sequence[int], Sequence[int]]]) -> None:
        self.rows = [(np.asarray(i, np.int64), np.asarray(m).astype(bool)) for i, m in rows]
        self.lengths = np.array([len(i) for i, _ in self.rows], dtype=np.int64)

    def fetch(self, start: int, end: int) -> list[tuple[np.ndarray, np.ndarray]]:
        return self.rows[start:end]


# --------------------------------------------------------------------------- planning


def check_layer_ids(ids: Sequence[int], num_layers: int) -> list[int]:
    """Exactly three distinct aux layer ids in ``1..L-1``, returned ascending (the order both engines
    concatenate them in). Id 0 is refused: vLLM captures ``hidden_states + residual`` and the residual does
    not exist before layer 0, and SGLang's export writes ``id - 1``."""
    ids = [int(i) for i in ids]
    if len(ids) != 3 or len(set(ids)) != 3:
        raise EyasError(f"--layers needs exactly three distinct layer ids (EAGLE-3's fc fuses 3 states), got {ids}")
    bad = [i for i in ids if not 1 <= i <= num_layers - 1]
    if bad:
        raise EyasError(
            f"layer id(s) {bad} out of range for a verifier with {num_layers} layers: use ids 1..{num_layers - 1} "
            "(id i is the hidden state entering decoder layer i)"
        )
    return sorted(ids)


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


def plan_batches(lengths: np.ndarray, batch_tokens: int) -> list[list[int]]:
    """Positions of non-empty rows in batches: longest first, each batch padded to its first row's length and
    holding as many rows as fit in ``batch_tokens`` (a longer row runs alone)."""
    order = sorted((i for i in range(len(lengths)) if lengths[i] > 0), key=lambda i: (-lengths[i], i))
    batches: list[list[int]] = []
    for i in order:
        if batches and (len(batches[-1]) + 1) * lengths[batches[-1][0]] <= batch_tokens:
            batches[-1].append(i)
        else:
            batches.append([i])
    return batches


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


# --------------------------------------------------------------------------- capture


class _HostBuffers:
    """Reusable host buffers, one per shard in flight, pinned when the verifier is on a GPU so that the
    device-to-host copies land in them directly (DMA) and the writer streams them to disk as they are. Pinned
    memory is slow to allocate (``cudaHostAlloc`` runs at a few GB/s and takes a driver lock the compute stream
    waits on), so buffers are kept and reused rather than allocated per batch."""

    GRAIN = 64 << 20  # sizes round up to this, so shards of slightly different sizes share buffers

    def __init__(self, *, pinned: bool, keep: int) -> None:
        self.pinned, self.keep = pinned, keep
        self._free: list[torch.Tensor] = []
        self._lock = threading.Lock()

    def acquire(self, nbytes: int) -> torch.Tensor:
        with self._lock:  # (buffers are told apart by identity: `list.remove` would compare tensors' values)
            fits = [i for i, b in enumerate(self._free) if b.numel() >= nbytes]
            if fits:
                return self._free.pop(min(fits, key=lambda i: self._free[i].numel()))
        size = max(self.GRAIN, -(-nbytes // self.GRAIN) * self.GRAIN)
        return torch.empty(size, dtype=torch.uint8, pin_memory=self.pinned)

    def release(self, buf: torch.Tensor) -> None:
        with self._lock:
            self._free.append(buf)
            while len(self._free) > self.keep:  # keep the largest
                self._free.pop(min(range(len(self._free)), key=lambda i: self._free[i].numel()))


@dataclass
class _ShardJob:
    """One shard on its way to disk: its rows, and the host buffer the batches' states are copied into at each
    row's place in the file (so the file is written from it as is)."""

    start: int
    end: int
    rows: list[tuple[np.ndarray, np.ndarray]]
    buffer: torch.Tensor  # uint8, from _HostBuffers
    hidden: torch.Tensor  # [N, 4, H] storage dtype: a view of `buffer`
    offsets: np.ndarray  # [R + 1] token offset of each row in `hidden`
    scales: torch.Tensor | None  # fp8: [R, 4] float32, filled from `pending` by the writer
    ready: list[Any] = field(default_factory=list)  # CUDA: events recorded after each batch's copies
    # fp8: (this shard's rows, their positions in the batch, the batch's host scales [B, 4])
    pending: list[tuple[list[int], list[int], torch.Tensor]] = field(default_factory=list)


@dataclass
class RunStats:
    """Where the time of one :meth:`Extractor.run` went."""

    tokens: int
    seconds: float  # the whole run, until the last shard is durably written
    loop_s: float  # the forward loop, waits for a free writer included
    waited_s: float  # of loop_s, blocked because every writer was busy (the disk was the bound)
    drain_s: float  # after the loop, writing the shards still in flight (the last window's, at least)
    write_s: float  # writer threads' busy time, summed (hashing, writing, fsync)
    bytes: int
    window_loop_s: list[float]  # the forward loop's time on each window (its wait for writers included)
    forward_tokens: int  # tokens the forward passes ran, padding included

    @property
    def padding(self) -> float:
        """The fraction of the forward's tokens that were padding."""
        return 1 - self.tokens / max(self.forward_tokens, 1)

    @property
    def loop_tokens_per_s(self) -> float:
        """Throughput while the loop runs: the steady-state rate of a long run, whose fixed end cost (writing
        the last window's shards, ``drain_s``) does not grow with the data."""
        return self.tokens / max(self.loop_s, 1e-9)

    @property
    def write_GBps_per_thread(self) -> float:
        return self.bytes / max(self.write_s, 1e-9) / 1e9


class Extractor:
    """Runs a loaded verifier over shards of rows and writes feature shards (the stage's engine; the benchmark
    drives it directly with a preloaded model). ``stats`` describes the last run."""

    def __init__(self, model: torch.nn.Module, *, layer_ids: list[int], dtype: str, batch_tokens: int,
                 writer_threads: int | None = None) -> None:  # fmt: skip
        self.model = model
        self.backbone = model.base_model  # the decoder stack: `model.model` for every *ForCausalLM
        self.device = input_device(model)
        self.layer_ids = layer_ids
        self.dtype = dtype
        self.batch_tokens = batch_tokens
        self.cuda = self.device.type == "cuda"
        self.writer_threads = writer_threads or default_writer_threads(self.cuda)
        self._copy_stream = torch.cuda.Stream(self.device) if self.cuda else None
        # kept across runs: a second run (the benchmark's, or the next rank's shards) reuses them
        self.buffers = _HostBuffers(pinned=self.cuda, keep=self.writer_threads + WINDOW_SHARDS + 1)
        # every shard buffer of a run has the size of its largest shard: buffers sized per shard (shards differ by
        # up to a row) left the pool holding some a grain too small, and pinning 1 GiB anew takes about 0.25 s
        self.buffer_bytes = 0
        self.stats: RunStats | None = None

    def padded(self, rows: list[tuple[np.ndarray, np.ndarray]], batch: list[int]) -> torch.Tensor:
        """The batch's ids, right-padded to its longest row: ``[B, T]`` int64 on the model's device."""
        T = len(rows[batch[0]][0])
        ids = torch.full((len(batch), T), PAD_ID, dtype=torch.int64, pin_memory=self.cuda)
        for b, r in enumerate(batch):
            ids[b, : len(rows[r][0])] = torch.from_numpy(rows[r][0])
        return ids.to(self.device, non_blocking=True)

    @torch.inference_mode()
    def _run_batch(self, cap: HiddenStateCapture, rows: list[tuple[np.ndarray, np.ndarray]],
                   batch: list[int]) -> tuple[torch.Tensor, torch.Tensor | None]:  # fmt: skip
        """The batch's states ``[N, 4, H]`` (real tokens only, rows in batch order) in the storage dtype, on
        the device, and for fp8 their scales ``[B, 4]``."""
        ids = self.padded(rows, batch)
        B, T = ids.shape
        lengths = [len(rows[r][0]) for r in batch]
        index = torch.cat([torch.arange(n) + b * T for b, n in enumerate(lengths)])
        cap.index = index.pin_memory().to(self.device, non_blocking=True) if self.cuda else index
        cap.clear()
        with varying_shape_attention(self.device):  # (no per-shape setup: every batch has a new shape)
            self.backbone(input_ids=ids, use_cache=False)
        # With --device-map the layers sit on several GPUs: bring every state to the embedding's device, whose
        # streams order the copy to the host below.
        hidden = cap.stacked(self.device)  # [N, 4, H]
        if self.dtype != "fp8":
            return hidden.to(STORAGE_DTYPES[self.dtype]), None
        row_of = cap.index.to(hidden.device) // T  # [N]: the batch row of each real token (no host sync)
        token_amax = hidden.abs().amax(-1).float()  # [N, 4]
        amax = torch.zeros(B, NUM_STATES, device=hidden.device).scatter_reduce(
            0, row_of[:, None].expand(-1, NUM_STATES), token_amax, "amax"
        )  # [B, 4]
        scale = features.fp8_scale(amax)
        return features.fp8_encode(hidden, scale[row_of][:, :, None]), scale

    def _states_bytes(self, tokens: int, H: int) -> int:
        """Bytes of ``tokens`` tokens' states ``[N, 4, H]`` in the storage dtype: a shard buffer's size."""
        return tokens * NUM_STATES * H * STORAGE_DTYPES[self.dtype].itemsize

    def _new_job(self, start: int, end: int, rows: list[tuple[np.ndarray, np.ndarray]], H: int) -> _ShardJob:
        offsets = np.concatenate([[0], np.cumsum([len(ids) for ids, _ in rows])]).astype(np.int64)
        N = int(offsets[-1])
        nbytes = self._states_bytes(N, H)
        buf = self.buffers.acquire(max(nbytes, self.buffer_bytes))
        hidden = buf[:nbytes].view(STORAGE_DTYPES[self.dtype]).view(N, NUM_STATES, H)
        scales = torch.ones(len(rows), NUM_STATES) if self.dtype == "fp8" else None
        return _ShardJob(start, end, rows, buf, hidden, offsets, scales)

    def _stage(self, jobs: dict[int, _ShardJob], owner: np.ndarray, local: np.ndarray, lengths: np.ndarray,
               batch: list[int], hidden: torch.Tensor, scale: torch.Tensor | None) -> None:  # fmt: skip
        """Copy each row of a batch's states to its place in its shard's host buffer (rows of shards that are
        not written, ``owner`` -1, are dropped); on a GPU the copies run on a side stream, so the next batch's
        forward overlaps them."""
        if self.cuda:
            self._copy_stream.wait_stream(torch.cuda.current_stream(self.device))
        with torch.cuda.stream(self._copy_stream) if self.cuda else contextlib.nullcontext():
            off = 0
            placed: dict[int, tuple[list[int], list[int]]] = {}  # shard -> (its rows, their batch positions)
            for b, r in enumerate(batch):
                n, k = int(lengths[r]), int(owner[r])
                if k >= 0:
                    job, i = jobs[k], int(local[r])
                    job.hidden[job.offsets[i] : job.offsets[i + 1]].copy_(hidden[off : off + n], non_blocking=self.cuda)
                    rows_b = placed.setdefault(k, ([], []))
                    rows_b[0].append(i)
                    rows_b[1].append(b)
                off += n
            if scale is not None and placed:
                host = torch.empty(scale.shape, dtype=scale.dtype, pin_memory=self.cuda)
                host.copy_(scale, non_blocking=self.cuda)
                for k, (rows_k, pos) in placed.items():
                    jobs[k].pending.append((rows_k, pos, host))
            if self.cuda:
                for t in (hidden, scale):
                    if t is not None:
                        t.record_stream(self._copy_stream)  # keep the device memory alive until the copies are done
                ready = torch.cuda.Event()
                ready.record(self._copy_stream)
                for k in placed:
                    jobs[k].ready.append(ready)

    def window(self, cap: HiddenStateCapture, source: RowSource, window: list[tuple[int, int]], skip: Container[str],
               on_batch: Callable[[int, int], None] | None = None) -> list[_ShardJob]:  # fmt: skip
        """Run one window: its rows sorted by length and batched together, each row's states staged in its
        shard's buffer. Returns the jobs of the shards not in ``skip`` (rows of skipped shards are computed, so
        that every batch is the one an uninterrupted run forms, and dropped)."""
        w0, w1 = window[0][0], window[-1][1]
        rows = source.fetch(w0, w1)
        H = self.backbone.get_input_embeddings().embedding_dim
        vocab = self.backbone.get_input_embeddings().num_embeddings
        for r, (ids, _) in enumerate(rows):
            if len(ids) and (ids.min() < 0 or ids.max() >= vocab):
                raise EyasError(f"row {w0 + r} has token id {int(ids.max())} outside the verifier's vocabulary "
                                f"of {vocab}: the prepared rows do not belong to this verifier")  # fmt: skip
        owner = np.full(len(rows), -1, dtype=np.int64)  # window row -> its shard's position in `window`, -1: dropped
        local = np.zeros(len(rows), dtype=np.int64)  # window row -> its row in that shard
        jobs: dict[int, _ShardJob] = {}
        for k, (s, e) in enumerate(window):
            local[s - w0 : e - w0] = np.arange(e - s)
            if shard_name(s, e) not in skip:
                owner[s - w0 : e - w0] = k
                jobs[k] = self._new_job(s, e, rows[s - w0 : e - w0], H)
        lengths = np.array([len(ids) for ids, _ in rows], dtype=np.int64)
        try:
            for batch in plan_batches(lengths, self.batch_tokens):
                self._stage(jobs, owner, local, lengths, batch, *self._run_batch(cap, rows, batch))
                if on_batch is not None:  # (tokens, tokens with padding)
                    on_batch(int(lengths[batch].sum()), len(batch) * int(lengths[batch[0]]))
        except BaseException:
            for job in jobs.values():  # nothing will write them
                for ev in job.ready:
                    ev.synchronize()
                self.buffers.release(job.buffer)
            raise
        return [jobs[k] for k in sorted(jobs)]

    def run(
        self,
        source: RowSource,
        windows: list[list[tuple[int, int]]],
        out: str | Path,
        *,
        skip: Container[str] = frozenset(),
        on_shard: Callable[[dict[str, Any]], None] | None = None,
        progress: bool = True,
    ) -> list[dict[str, Any]]:
        """Extract the shards (row ranges) of ``windows`` (see :func:`plan_windows`) into ``out``, but for the
        shards named in ``skip`` (already written); returns their manifest entries in order of completion.
        ``on_shard`` is called (on a writer thread) after each shard is durably written."""
        from tqdm.auto import tqdm

        entries: list[dict[str, Any]] = []

        def done(entry: dict[str, Any]) -> None:
            entries.append(entry)
            if on_shard is not None:
                on_shard(entry)

        windows = [w for w in windows if any(shard_name(*sh) not in skip for sh in w)]
        total = int(sum(source.lengths[w[0][0] : w[-1][1]].sum() for w in windows))
        H = self.backbone.get_input_embeddings().embedding_dim
        self.buffer_bytes = max((self._states_bytes(int(source.lengths[s:e].sum()), H) for w in windows for s, e in w),
                                default=0)  # fmt: skip
        writer = _Writer(Path(out), self.layer_ids, done, buffers=self.buffers, threads=self.writer_threads,
                         window=max((len(w) for w in windows), default=1))  # fmt: skip
        cap = HiddenStateCapture(self.model, self.layer_ids)
        bar = tqdm(total=total, unit="tok", unit_scale=True, desc="extract", disable=not progress, smoothing=0.1)
        t0, waited, per_window, forward_tokens = time.perf_counter(), 0.0, [], 0

        def on_batch(tokens: int, padded: int) -> None:
            nonlocal forward_tokens
            forward_tokens += padded
            bar.update(tokens)

        try:
            for window in windows:
                tw = time.perf_counter()
                for sh in window:
                    if shard_name(*sh) not in skip:
                        writer.reserve()  # blocks while every writer is busy: the disk is the bound
                waited += time.perf_counter() - tw
                for job in self.window(cap, source, window, skip, on_batch=on_batch):
                    writer.submit(job)
                per_window.append(time.perf_counter() - tw)
            if self.cuda:  # the forward loop ends when its last copies are done, not when they are queued
                self._copy_stream.synchronize()
            t_loop = time.perf_counter()
            writer.close()
            end_t = time.perf_counter()
            self.stats = RunStats(tokens=total, seconds=end_t - t0, loop_s=t_loop - t0, waited_s=waited,
                                  drain_s=end_t - t_loop, write_s=writer.busy_s, bytes=writer.bytes,
                                  window_loop_s=per_window, forward_tokens=forward_tokens)  # fmt: skip
        finally:
            cap.remove()
            bar.close()
            writer.abort()
        return entries


class _Writer:
    """Writes finished shards on background threads (writing and hashing release the GIL, so they overlap the
    forward passes and each other). At most ``threads + window`` shards are in flight (a window being filled,
    the rest being written), which bounds host memory and makes compute wait when the disk is the bottleneck."""

    def __init__(self, out: Path, layer_ids: list[int], done: Callable[[dict[str, Any]], None], *,
                 buffers: _HostBuffers, threads: int = 1, window: int = 1) -> None:  # fmt: skip
        self.out, self.layer_ids, self.done, self.buffers = out, layer_ids, done, buffers
        self._jobs: queue.Queue[_ShardJob | None] = queue.Queue()
        self.busy_s, self.bytes = 0.0, 0  # summed over threads
        self._stat_lock = threading.Lock()
        self._slots = threading.Semaphore(threads + window)
        self.error: BaseException | None = None
        self._threads = [threading.Thread(target=self._loop, name=f"eyas-shard-writer-{i}", daemon=True)
                         for i in range(threads)]  # fmt: skip
        for t in self._threads:
            t.start()

    def _check(self) -> None:
        if self.error is not None:
            raise self.error

    def reserve(self) -> None:
        while not self._slots.acquire(timeout=0.5):
            self._check()
        self._check()

    def submit(self, job: _ShardJob) -> None:
        self._check()
        self._jobs.put(job)

    def close(self) -> None:
        for _ in self._threads:
            self._jobs.put(None)
        for t in self._threads:
            t.join()
        self._check()

    def abort(self) -> None:
        for t in self._threads:
            if t.is_alive():
                self._jobs.put(None)

    def _loop(self) -> None:
        while (job := self._jobs.get()) is not None:
            try:
                if self.error is None:
                    t0 = time.perf_counter()
                    entry = self._write(job)
                    with self._stat_lock:
                        self.busy_s += time.perf_counter() - t0
                        self.bytes += entry["bytes"]
                    self.done(entry)
            except BaseException as e:  # handed to the main thread at its next call
                self.error = e
            finally:
                self._slots.release()

    def _write(self, job: _ShardJob) -> dict[str, Any]:
        try:
            for ev in job.ready:
                ev.synchronize()
            for rows, pos, host in job.pending:
                job.scales[rows] = host[pos]
            tensors = features.shard_tensors(
                [torch.from_numpy(i) for i, _ in job.rows],
                [torch.from_numpy(m) for _, m in job.rows],
                [job.hidden],  # one piece: the rows are already in file order
                list(job.scales) if job.scales is not None else None,
            )
            return features.write_shard(self.out, start=job.start, end=job.end, tensors=tensors,
                                        layer_ids=self.layer_ids)  # fmt: skip
        finally:
            self.buffers.release(job.buffer)


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
        from eyas.manifest import write_json

        write_json(self.path, {"plan": self.plan, "shards": self.shards})


def _still_good(out: Path, entry: dict[str, Any] | None) -> bool:
    from eyas.manifest import sha256_file

    if entry is None:
        return False
    p = out / entry["file"]
    return p.is_file() and p.stat().st_size == entry["bytes"] and sha256_file(p) == entry["sha256"]


# --------------------------------------------------------------------------- the stage


def extract(
    *,
    verifier: str | None = None,
    data: str | None = None,
    out: str | None = None,
    layers: list[int] | None = None,
    batch_tokens: int | None = None,
    dtype: Literal["bf16", "fp16", "fp32", "fp8"] = "bf16",
    device: str | None = None,
    device_map: str | None = None,
    shard_tokens: int | None = None,
    speculators_out: str | None = None,
    verify: str | None = None,
) -> dict[str, Any]:
    """Run the verifier over prepared rows and store its aux and last hidden states as feature shards.

    Resumable (rerun the same command), distributed with
    ``torchrun --nproc-per-node N -m eyas.cli extract ...``, and checkable with ``--verify DIR``.

    Args:
        verifier: the verifier checkpoint (dir, .gguf, 'smollm2'); the prepared rows must be for it.
        data: a directory written by `eyas prepare`.
        out: the output directory for the feature shards.
        layers: three aux layer ids (id i = the state entering decoder layer i); default [2, L//2, L-3].
        batch_tokens: tokens per forward, padding included (default 32768 on CUDA, 8192 on CPU).
        dtype: stored dtype; fp8 is e4m3 with a scale per row and layer (half of bf16's bytes).
        device: cpu, cuda or cuda:N (default: cuda when there is one); under torchrun each rank takes its own GPU.
        device_map: 'auto' spreads a verifier larger than one GPU over all of them (one process only).
        shard_tokens: tokens per shard (default: shards of at most 1 GiB).
        speculators_out: also write the features in speculators' offline layout to this directory.
        verify: check the shards of this finished output against its manifest (hashes) and exit.
    """
    if verify is not None:
        summary = features.verify(verify)
        print(f"{verify}: ok, {summary['shards']} shards, {summary['rows']} rows, {summary['tokens']} tokens, "
              f"every sha256 matches the manifest")  # fmt: skip
        return summary
    missing = [f"--{n}" for n, v in (("verifier", verifier), ("data", data), ("out", out)) if v is None]
    if missing:
        raise EyasError(f"eyas extract needs {', '.join(missing)} (or --verify DIR)")
    if speculators_out is not None:  # before any work: the layout is written last, over what is there
        features.check_speculators_out(speculators_out, features=out)
    from eyas import dist as _dist

    if device_map is not None and device is not None:
        raise EyasError("give either --device or --device-map, not both")
    kind = "cuda" if (device or ("cuda" if torch.cuda.is_available() else "cpu")).startswith("cuda") else "cpu"
    with _dist.init(device_type=kind) as d:
        return _extract(d, verifier=str(verifier), data=str(data), out=Path(out), layers=layers,
                        batch_tokens=batch_tokens, dtype=dtype, device=device, device_map=device_map,
                        shard_tokens=shard_tokens, speculators_out=speculators_out)  # fmt: skip


def _extract(d, *, verifier, data, out: Path, layers, batch_tokens, dtype, device, device_map, shard_tokens,
             speculators_out) -> dict[str, Any]:  # fmt: skip
    from eyas.datasets import load_prepared, prepared_verifier
    from eyas.manifest import (MANIFEST, OutputLock, check_free_disk, human_bytes, manifest_matches, sha256_json,
                               write_json, write_manifest)
    from eyas.verifier import build_text_model
    from eyas.verifier_info import fingerprint, resolve

    if dtype not in STORAGE_DTYPES:
        raise EyasError(f"--dtype {dtype!r} is not one of {', '.join(STORAGE_DTYPES)}")
    info = resolve(verifier)
    ds, pmanifest = load_prepared(data)
    fp = fingerprint(info)
    if prepared_verifier(pmanifest) != fp:
        raise EyasError(
            f"the prepared rows in {data} were tokenized for another verifier "
            f"({pmanifest.get('verifier_path', 'unknown')}), not {info.path}; run `eyas prepare` with this "
            "--verifier, or pass the verifier they were made for"
        )
    layer_ids = check_layer_ids(layers if layers is not None else info.aux_layer_ids, info.num_hidden_layers)
    if device_map is not None:
        if d.active:
            raise EyasError("--device-map spreads one verifier over all GPUs in one process; do not use it under "
                            "torchrun (or run one process)")  # fmt: skip
        where: torch.device | None = None
        on_cuda = torch.cuda.is_available()
    else:
        where = d.device(device)
        on_cuda = where.type == "cuda"
        if on_cuda and not torch.cuda.is_available():
            raise EyasError(f"--device {device} asked for CUDA but torch sees no GPU (torch {torch.__version__})")
    # bf16 on GPUs, as the verifier is served; fp32 on CPU (and when fp32 is asked for), where it is exact.
    compute_dtype = torch.bfloat16 if on_cuda and dtype != "fp32" else torch.float32
    batch_tokens = batch_tokens or BATCH_TOKENS["cuda" if on_cuda else "cpu"]
    source = PreparedRows(ds, data)
    H = info.hidden_size
    shard_tokens = shard_tokens or default_shard_tokens(source.lengths, H, dtype)
    shards = plan_shards(source.lengths, shard_tokens)
    # the template the rows were rendered with travels on, so train records it and eval can compare it
    inputs = {"verifier": fp, "data": source.identity(),
              "chat_template_sha256": (pmanifest.get("inputs") or {}).get("chat_template_sha256")}  # fmt: skip
    settings = {"format": FORMAT, "layer_ids": layer_ids, "dtype": dtype, "last_hidden_normed": False,
                "compute_dtype": str(compute_dtype).removeprefix("torch."), "shard_tokens": shard_tokens,
                "window_shards": WINDOW_SHARDS}  # fmt: skip
    plan = sha256_json({"inputs": inputs, "settings": settings})

    with contextlib.ExitStack() as stack:

        def open_out() -> dict[str, Any] | None:
            if manifest_matches(out, stage=STAGE, inputs=inputs, settings=settings):
                return None
            if (out / MANIFEST).exists():
                raise EyasError(f"{out} holds features made from other inputs or settings; choose another --out "
                                "or remove it")  # fmt: skip
            stack.enter_context(OutputLock(out))
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
                if speculators_out:
                    features.write_speculators(out, out=speculators_out)
            return manifest
        d.barrier("start of extraction")
        windows = plan_windows(shards)
        mine = [windows[k] for k in assign_shards([int(source.lengths[w[0][0] : w[-1][1]].sum()) for w in windows],
                                                  d.world_size)[d.rank]]  # fmt: skip
        kept = {shard_name(*sh): known[shard_name(*sh)] for w in mine for sh in w
                if _still_good(out, known.get(shard_name(*sh)))}  # fmt: skip
        todo = [sh for w in mine for sh in w if shard_name(*sh) not in kept]
        need = int(sum(source.lengths[s:e].sum() for s, e in todo)) * bytes_per_token(H, dtype)
        total_need = sum(d.all_gather(need))
        check_free_disk(out, needed=total_need, what=f"extracting {len(shards)} shard(s) of {dtype} features")
        record = _Progress(out / f".progress-rank{d.rank}.json", plan, kept)
        tokens_done, elapsed, forward_tokens = 0, 0.0, 0
        if todo:
            model = build_text_model(info, dtype=compute_dtype, device=where, device_map=device_map)
            extractor = Extractor(model, layer_ids=layer_ids, dtype=dtype, batch_tokens=batch_tokens)
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
            m = write_manifest(
                out, stage=STAGE, inputs=inputs, settings=settings,
                outputs={"rows": len(source.lengths), "tokens": tokens, "bytes": nbytes,
                         "bytes_per_token": nbytes / max(tokens, 1), "shards": ordered},
                format=FORMAT, layer_ids=layer_ids, last_hidden_normed=False, dtype=dtype, hidden_size=H,
                num_rows=len(source.lengths), verifier_path=info.path, data_path=str(data),
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
              f"{human_bytes(nbytes)}, {nbytes / max(tokens, 1):.0f} bytes/token ({dtype}), layers {layer_ids}"
              + (f"; {done_tokens} tokens this run at {rate:,.0f} tokens/s ({padding:.0%} of the forward's tokens "
                 "were padding)" if done_tokens else ""))  # fmt: skip
        if speculators_out:
            path = features.write_speculators(out, out=speculators_out)
            print(f"speculators' offline layout written to {path}")
    return manifest

