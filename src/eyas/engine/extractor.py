"""The extraction engine: a loaded verifier run over windows of shards of rows, its aux and pre-norm last hidden
states written as feature shards (:mod:`eyas.data.features`). ``eyas extract`` drives it; so does the benchmark, with
a preloaded model.

Inside a window of shards rows are sorted by length and packed into batches under a token budget (each shard is
still written on its own, when its window is done). Batches are right-padded and run with a causal mask only: a
real token never attends to a later position, so padding cannot reach a stored row, and SDPA takes its fastest
(``is_causal``) path. Forward pre-hooks (:class:`eyas.verifier.load.HiddenStateCapture`) keep exactly the real tokens'
states; ``model.model`` runs, never the head, so no logits are materialised. On CUDA the gathered states go to
pinned host memory on a side stream while the next batch computes, and writer threads hash and write each shard
while the following window computes.
"""

from __future__ import annotations

import contextlib
import os
import queue
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, Container, Protocol

import numpy as np
import torch

from eyas.data import features
from eyas.core.errors import EyasError
from eyas.data.features import NUM_STATES, STORAGE_DTYPES, shard_name
from eyas.data.lengths import plan_batches
from eyas.verifier.load import HiddenStateCapture, input_device, varying_shape_attention

# Shards whose rows are sorted and batched together. Padding falls with the rows sorted at once (the benchmark's
# ShareGPT-like lengths at 32,768 tokens per batch: 13% of the forward's tokens are padding in one 1 GiB shard,
# 4.7% across four), while each shard is still written on its own. A window's shards sit in host memory until
# its last batch, so this bounds memory too: window + writer threads shards per rank.
WINDOW_SHARDS = 4
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


# --------------------------------------------------------------------------- rows and batches


class RowSource(Protocol):
    """What the extractor reads: per-row lengths, and rows ``[start, end)`` as (ids, loss mask) arrays."""

    lengths: np.ndarray

    def fetch(self, start: int, end: int) -> list[tuple[np.ndarray, np.ndarray]]: ...


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
