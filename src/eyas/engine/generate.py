"""The generation engine: the verifier decodes, for `eyas regenerate` (many requests at once) and `eyas eval`
(one sequence at a time, speculatively, with rollback), through transformers' own model classes.

What eyas adds is only the attention and its key/value storage (:mod:`eyas.engine.slots`): an attention function
registered through transformers' ``AttentionInterface`` reads and writes per-sequence *slots*, so a finished
answer's slot takes the next request at once (continuous batching), and rolling a sequence back is moving its
position.

Why not transformers' generation as is (measured on one H200 with SmolLM2, docs/BENCHMARKS.md): ``generate``
with a static cache holds a batch until its longest answer ends and cannot take a new prompt mid-batch; its
continuous batching (``generate_batch``) packs the requests of a step into one attention over all of their keys
(``paged|sdpa``: a 4-D mask that grows with the square of the batch) unless the flash-attention kernels are
installed, and they are fetched from the hub, which the GPU machine cannot reach.

Memory is fixed by the settings, not by the data: the key/value buffers are allocated once (``batch_tokens``
positions in all), a prefill packs at most ``prefill_tokens`` tokens, and a prompt that does not fit a slot is
answered as too long instead of growing anything. On CUDA every fixed-shape decoding forward is recorded once
as a CUDA graph (one per key length: a single one through FlexAttention) and replayed (:mod:`eyas.engine.graphs`), so the host does not dispatch
hundreds of kernels a token.
"""

from __future__ import annotations

import bisect
import contextlib
import functools
import heapq
import itertools
import time
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass, field
from typing import Any

import torch

from eyas.core.errors import EyasError
from eyas.core.memory import free_memory
from eyas.engine.graphs import Graphs, freeze_fits
from eyas.engine.slots import Slots, layer_shapes, slot_attention
from eyas.verifier.compile import compile_options, compile_work, run_dynamic


# --------------------------------------------------------------------------- one sequence (eval)


class SequenceDecoder:
    """The verifier over one sequence with a cache that rolls back: ``forward(ids, start)`` feeds tokens at
    positions ``start..`` (after rolling back to ``start``) and returns their logits; ``aux_layer_ids`` also
    returns the hidden states entering those layers (what an EAGLE-3 draft reads), captured as they pass.
    ``decode(token, start, count)`` runs plain decoding on the device, the host reading the new tokens every
    ``sync_every`` steps.

    This is what speculative decoding needs at batch size 1: a verification forward over ``K + 1`` tokens, a
    plain decoding step over one, each a CUDA graph per key length (:meth:`Slots.key_length`; its layers compiled with
    ``compile``); a prompt of any length runs its layers compiled with symbolic shapes where those compile
    (:func:`eyas.verifier.compile.run_dynamic`), else eagerly. ``freeze`` compiles the layers with their weights as
    constants, so gate/up are one matmul, and q/k/v another where they have one shape
    (:func:`eyas.verifier.compile.compile_frozen`); ``None``
    freezes where that is cheap in memory (:func:`eyas.engine.graphs.freeze_fits`: plain weights, and their copies for
    the few shapes compiled a small part of the free GPU memory). ``merge`` (where the layers compile) stores each
    layer's q/k/v and gate/up as one weight each, in the model itself, so that compiled they are one matmul
    each, grouped-query attention included, with no copy of the weights (:mod:`eyas.verifier.merged`).

    The model's attention is switched to the slots (``set_attn_implementation``, which walks every module:
    0.7 ms of host time on SmolLM2) only where Python runs the forward: eager forwards and graph captures, or
    once for a whole turn inside :meth:`session`; a graph replay needs none of it.
    """

    #: greedy plain decoding's pick and state updates compiled with the layers (bench/decode_profile.py --outer off
    #: turns it off to measure what it saves)
    compile_tail: bool = True

    def __init__(self, model, *, capacity: int, aux_layer_ids: list[int] | None = None,
                 graph_lengths: Iterable[int] = (1,), cuda_graphs: bool = True,
                 compile: bool = True, sync_every: int = 16, attention: str = "auto",
                 freeze: bool | None = False, merge: bool = True) -> None:  # fmt: skip
        from eyas.verifier.load import HiddenStateCapture
        from eyas.verifier.merged import merge_projections

        self.model = model
        p = next(model.parameters())
        self.device = p.device
        self.slots = Slots(slots=1, capacity=capacity, layers=layer_shapes(model), dtype=p.dtype, device=p.device,
                           attention=attention)  # fmt: skip
        self.capture = HiddenStateCapture(model, aux_layer_ids) if aux_layer_ids else None
        if self.capture is not None:
            self.capture.remove()  # attached only during this decoder's forwards
        self.graph_lengths = set(graph_lengths)
        if freeze is None:  # a few shapes at batch size 1 (one token, K + 1): frozen where their copies are cheap
            shapes = max(3, len(self.graph_lengths | {1}))
            freeze = compile and cuda_graphs and freeze_fits(model.base_model.layers, shapes=shapes)
        self.graphs = Graphs(self.device, enabled=cuda_graphs, compile_model=model if compile else None,
                             freeze=freeze)  # fmt: skip
        if merge and self.graphs.compile_model is not None:  # q/k/v and gate/up one matmul each, compiled
            merge_projections(model)
        # prompts' forwards compiled too (symbolic shapes, one compile for every length) where the graphs compile
        self.compile_prompts = self.graphs.compile_model is not None
        self._ids: dict[int, torch.Tensor] = {}  # static inputs per graphed length
        self._pos: dict[int, torch.Tensor] = {}
        # plain decoding's state on the device: the token fed next, its position (the slot's start: a view),
        # the sampling seed, and a ring of the last `sync_every` new tokens (token fed at p -> ring[p % N])
        self.sync_every = max(1, sync_every)
        self._tok = torch.zeros(1, 1, dtype=torch.long, device=self.device)
        self._at = torch.zeros(1, 1, dtype=torch.long, device=self.device)
        self._seed = torch.zeros(1, dtype=torch.long, device=self.device)
        self._ring = torch.zeros(self.sync_every, dtype=torch.long, device=self.device)
        self.slots.start = self._at[:, 0]
        self._engaged = False
        self._advance_compiled = torch.compile(self._advance, dynamic=False, options=compile_options(False))

    @property
    def capacity(self) -> int:
        return self.slots.capacity

    @contextlib.contextmanager
    def session(self) -> Iterator[None]:
        """Inside the block the model attends through this decoder's slots (and captures aux states): forwards
        run in it do not switch the attention each time. Re-entering is free."""
        if self._engaged:
            yield
            return
        from eyas.verifier.load import varying_shape_attention

        # eager forwards see a new shape every time: flash / memory-efficient attention, no per-shape cuDNN plans
        with slot_attention(self.model, self.slots), varying_shape_attention(self.device), \
                contextlib.ExitStack() as stack:  # fmt: skip
            if self.capture is not None:
                stack.enter_context(self.capture)
            self._engaged = True
            try:
                yield
            finally:
                self._engaged = False

    def _engage(self, fn):
        """``fn`` run inside :meth:`session` (what a graph runs when it is recorded, or eagerly)."""

        def run():
            with self.session():
                return fn()

        return run

    def _forward(self, ids: torch.Tensor, pos: torch.Tensor, keep: int):
        """ids, pos ``[1, T]`` -> logits ``[T', V]`` (``keep`` last, 0 = all), aux ``[T, 3H]`` or None."""
        self.slots.begin(ids.shape[1])
        out = self.model(input_ids=ids, position_ids=pos, use_cache=False, logits_to_keep=keep)
        aux = self.capture.aux()[0] if self.capture is not None else None
        return out.logits[0], aux

    @torch.no_grad()
    def forward(self, input_ids: torch.Tensor, start: int, *, last_only: bool = False):
        """``input_ids [T]`` at positions ``start..start+T-1`` -> (logits ``[T or 1, V]`` float32, aux
        ``[T, 3H]`` or None). Positions ``>= start`` from earlier calls are forgotten (rolled back)."""
        T = input_ids.shape[0]
        if start + T > self.capacity:
            raise EyasError(f"internal: {start + T} positions exceed the verifier cache of {self.capacity}")
        slots = self.slots
        slots.start.fill_(start)
        slots.keys = slots.key_length(start + T, T)
        if T in self.graph_lengths and not last_only and self.graphs.enabled:
            if T not in self._ids:
                self._ids[T] = torch.zeros(1, T, dtype=torch.long, device=self.device)
                self._pos[T] = torch.zeros(1, T, dtype=torch.long, device=self.device)
            self._ids[T].copy_(input_ids[None])
            self._pos[T].copy_(torch.arange(start, start + T, device=self.device)[None])
            logits, aux = self.graphs.run(
                (T, slots.keys), self._engage(lambda: self._forward(self._ids[T], self._pos[T], 0))
            )
            # graph outputs live in its pool and the next replay overwrites them: copy what the caller keeps
            return logits.float(), None if aux is None else aux.clone()
        pos = torch.arange(start, start + T, device=self.device)[None]
        with self.session():
            # a prompt through layers compiled with symbolic shapes, where the graphs compile; one as short as
            # FlexAttention's decoding shapes stays eager (a compiled layer would trace its attention)
            short = slots.flex_runs(T)
            (logits, aux), compiled = run_dynamic(
                self.model, lambda: self._forward(input_ids[None], pos, 1 if last_only else 0),
                compile=self.compile_prompts and not short)  # fmt: skip
            if not short:
                self.compile_prompts = compiled
        return logits.float(), aux

    def _decode_step(self, temperature: float) -> None:
        """One plain decoding step on the device: feed ``_tok`` at ``_at``, pick the next token (argmax, or a
        sample at a uniform keyed by seed and position: no generator state, so it replays in a graph), store it
        in the ring, advance. The whole step is one CUDA graph per key length."""
        self.slots.begin(1)
        logits = self.model(input_ids=self._tok, position_ids=self._at, use_cache=False).logits[:, -1]  # [1, V]
        # greedy, compiled where the layers are: the argmax and the state's updates are then one or two kernels,
        # not six; sampling stays eager, so a graphed step draws exactly what an eager one does (a compiled
        # softmax and cumsum may round otherwise, and move a draw that lands on a boundary)
        compiled = self.compile_tail and temperature == 0 and self.graphs.compile_model is not None
        advance = self._advance_compiled if compiled else self._advance
        advance(logits, temperature)

    def _advance(self, logits: torch.Tensor, temperature: float) -> None:
        """The step's tail: pick the next token from ``logits [1, V]``, store it in the ring, feed it next."""
        nxt = pick_tokens(logits, temperature=temperature, seed=self._seed, position=self._at[:, 0] + 1)  # [1]
        self._ring.index_copy_(0, self._at[:, 0] % self.sync_every, nxt)
        self._tok.copy_(nxt[:, None])
        self._at.add_(1)

    @torch.no_grad()
    def decode(self, token: torch.Tensor, start: int, count: int, *, temperature: float = 0.0,
               seed: torch.Tensor | None = None) -> Iterator[list[int]]:  # fmt: skip
        """Plain decoding: feed ``token [1]`` (on the device) at ``start`` and make ``count`` new tokens, yielded
        in blocks of at most ``sync_every`` (one device->host read a block; the caller stops consuming at an
        end of turn, so at most ``sync_every - 1`` steps past it are wasted). ``seed`` (a device ``[1]``) keys
        sampling at ``temperature > 0``."""
        if start + count > self.capacity:
            raise EyasError(f"internal: {start + count} positions exceed the verifier cache of {self.capacity}")
        N = self.sync_every
        self._tok.copy_(token.reshape(1, 1))
        self._at.fill_(start)
        if seed is not None:
            self._seed.copy_(seed.reshape(1))
        step = self._engage(lambda: self._decode_step(temperature))
        p = start
        while count > 0:
            k = min(N, count)
            for j in range(k):
                self.slots.keys = self.slots.key_length(p + j + 1)
                # recording a graph runs the step three times: the token and position are put back after it
                self.graphs.run(("decode", temperature, self.slots.keys), step, state=(self._tok, self._at))
            ring = self._ring.tolist()  # the block's one device->host sync
            yield [ring[(p + j) % N] for j in range(k)]
            p += k
            count -= k


# --------------------------------------------------------------------------- many requests (regenerate)


@dataclass(order=True)
class Request:
    """A prompt to answer: ``tokens`` (ids, chat template applied), at most ``max_new_tokens`` new ones.
    ``key`` is the caller's, returned with the answer; ``seed`` makes sampling of this request independent of
    which others share its batch. ``priority``: requests of a higher one are admitted first (a conversation's
    turns still to come after this one: the longest chains of turns start first, so they do not make the
    run's tail)."""

    sort: tuple[int, int] = field(init=False, repr=False)
    key: Any = field(compare=False)
    tokens: list[int] = field(compare=False)
    max_new_tokens: int = field(compare=False)
    seed: int = field(default=0, compare=False)
    priority: int = field(default=0, compare=False)

    def __post_init__(self) -> None:
        if not self.tokens:
            raise ValueError("a request needs at least one prompt token")
        self.sort = (-self.priority, len(self.tokens))


@dataclass
class Completion:
    """An answered request: the new ``tokens`` (the end-of-turn id last when ``finished``); ``finished`` says
    the verifier ended it itself, else it was cut at ``max_new_tokens`` or at the slot capacity; ``too_long``:
    the prompt did not fit a slot and nothing was generated."""

    key: Any
    tokens: list[int]
    finished: bool
    too_long: bool = False


class RequestQueue:
    """Requests waiting for a slot, highest priority first, then shortest prompt first (similar lengths decode
    together, so the key length a step attends to stays close to what its sequences need); requests may be
    added while the engine runs.

    ``feed``, when given, is called before the queue is read and returns the requests made since: a caller
    can gather what it submits (regenerate's next turns) and tokenize it in one batch there, which the engine
    does while its GPU runs a block of steps (:meth:`fill`)."""

    def __init__(
        self, requests: Iterable[Request] = (), *, feed: Callable[[], Iterable[Request]] | None = None
    ) -> None:
        self._heap: list[tuple[tuple[int, int], int, Request]] = []
        self._n = itertools.count()
        self._feed = feed
        for r in requests:
            self.push(r)

    def push(self, request: Request) -> None:
        heapq.heappush(self._heap, (request.sort, next(self._n), request))

    def fill(self) -> None:
        """The requests ``feed`` has ready, into the queue."""
        if self._feed is not None:
            for r in self._feed():
                self.push(r)

    def pop(self) -> Request:
        self.fill()
        return heapq.heappop(self._heap)[2]

    def peek(self) -> Request:
        self.fill()
        return self._heap[0][2]

    def __len__(self) -> int:
        self.fill()
        return len(self._heap)


def _uniform(seed: torch.Tensor, position: torch.Tensor, n: int) -> torch.Tensor:
    """``[S, n]`` uniforms in (0, 1) from a counter-based hash of (request seed, position, token id): the same
    numbers whichever other requests share the batch, so seeded sampling does not depend on scheduling."""
    M = 0xFFFFFFFF

    def mix(x):  # a 32-bit integer hash (low 32 bits kept in int64; products wrap, their low bits stay right)
        x = ((x ^ (x >> 16)) * 0x45D9F3B) & M
        x = ((x ^ (x >> 16)) * 0x45D9F3B) & M
        return x ^ (x >> 16)

    row = mix(mix(seed & M) ^ (position & M))  # [S]
    x = mix((row[:, None] * 0x9E3779B1 + torch.arange(n, device=seed.device)[None]) & M)  # [S, n]
    return (x.to(torch.float64) + 0.5) / 4294967296.0


def pick_tokens(logits: torch.Tensor, *, temperature: float, seed: torch.Tensor | None = None,
                position: torch.Tensor | None = None, top_p: float = 1.0) -> torch.Tensor:  # fmt: skip
    """The next token of each row of ``logits [S, V]``: argmax at ``T = 0``; otherwise a sample of
    ``softmax(logits / T)`` by inverting its cumulative distribution at one uniform ``u`` per row, from
    :func:`_uniform` of the row's seed and position; with ``top_p < 1`` only from the smallest set of tokens
    whose probability reaches ``top_p`` (nucleus sampling, Holtzman et al. 2019), taken in descending order.

    One uniform a row rather than one a token (the Gumbel-max trick): the noise for ``[S, V]`` was a 64-bit
    integer hash of every element, which with the nucleus's sort made sampling most of a batched step when
    ``eyas prompts`` samples thousands of short rows at once (on a 2-core CPU, 512 rows of SmolLM2's 49,152
    tokens: 1.17 s with the hash, 0.11 s without it; with top-p 0.95, 2.41 s and 1.19 s, the rest the sort)."""
    if temperature == 0:
        return logits.argmax(-1)
    probs = (logits.float() / temperature).softmax(-1)  # [S, V]
    order = None
    if top_p < 1.0:
        probs, order = probs.sort(-1, descending=True)
        before = probs.cumsum(-1) - probs  # probability of the tokens ranked above
        probs = probs.masked_fill(before >= top_p, 0.0)  # [S, V]: 0 outside the nucleus
    cdf = probs.cumsum(-1)  # [S, V]
    u = _uniform(seed, position, 1)  # [S, 1] in (0, 1)
    target = (u * cdf[:, -1:].double()).float()  # a point inside the kept mass
    # the first token whose cumulative probability reaches it: a token of probability 0 is never it
    picked = torch.searchsorted(cdf, target).clamp_(max=logits.shape[-1] - 1)  # [S, 1]
    return (picked if order is None else order.gather(-1, picked))[:, 0]


#: The most rows a batched step decodes. A step's work past about 2,048 rows buys little (one H200, SmolLM2, a
#: step at 256 live keys: 114k tokens/s at 512 rows, 163k at 2,048; bench/decode_profile.py --batched), while
#: its sampling holds a few ``[rows, vocab]`` float32 copies (top-p sorts them): short sequences in a large
#: budget (eyas prompts' user turns) would otherwise make tens of thousands of rows and run out of memory there.
MAX_ROWS = 4096

#: The row counts a batched step is recorded for: a step replays the graph of the smallest one that holds every
#: busy row (rows are filled lowest first), so a run's tail of a few long answers does not pay for every slot.
#: A step of 64 rows costs about what one of 1 does (it is bound by kernel launches, not by rows).
ROW_BUCKETS = (64, 256, 1024, 4096)


def row_bucket(n: int, num_slots: int) -> int:
    """The rows a step over slots ``0..n-1`` runs: the smallest of :data:`ROW_BUCKETS` covering ``n``, at most
    ``num_slots``."""
    return min(next((b for b in ROW_BUCKETS if b >= n), num_slots), num_slots)


def engine_summary(report: dict[str, Any], *, caller: str) -> str:
    """One line of a :meth:`BatchDecoder.report`: where a batched run's time went (``caller``: what the caller's
    own work beside the steps was)."""
    r = report
    return (f"{r['steps']:,} steps over {r['slots']:,} slots (slot use {r['slot_use']:.2f}, {r['row_use']:.2f} of "
            f"the rows stepped), decoding {r['decode_seconds']:.1f} s, prefills {r['prefill_seconds']:.1f} s "
            f"({r['prefills']:,}), graph recording {r['record_seconds']:.1f} s, {caller} {r['caller_seconds']:.1f} s "
            f"beside the steps" + (f"; {r['compiles']} compiles took {r['compile_seconds']:.1f} s of those"
                                   if r["compiles"] else ""))  # fmt: skip


class BatchDecoder:
    """Continuous batching over slots: up to ``num_slots`` sequences decode together, one token each per
    step; a finished answer's slot takes the next waiting request (shortest prompt first) at once.

    Memory is fixed by ``batch_tokens`` (key/value positions in all: ``num_slots = batch_tokens // max_len``
    slots of ``max_len`` positions each, at most :data:`MAX_ROWS`) and ``prefill_tokens`` (new prompts are
    prefilled together, right-padded, at most that many tokens a forward). The host reads the new tokens every ``sync_every``
    steps (an answer that ends inside such a block costs at most ``sync_every - 1`` discarded steps of its
    slot); the steps themselves are CUDA graphs on CUDA, their layers compiled with ``compile``. A step runs
    over the first slots only, as many as :func:`row_bucket` says the highest busy one needs (a free slot
    takes the lowest free index), one graph per row count and key length.
    ``attention="flex"`` (the default on CUDA) attends through FlexAttention with a per-row block table (each
    row reads its own live keys, not the step's whole key length: :meth:`eyas.engine.slots.Slots._block_mask`);
    ``"sdpa"`` (the default elsewhere) through SDPA over the step's key length.
    """

    def __init__(self, model, *, eos_ids: set[int], max_len: int, batch_tokens: int, temperature: float = 0.0,
                 prefill_tokens: int | None = None, sync_every: int = 8, pad_id: int = 0,
                 cuda_graphs: bool = True, compile: bool = True, attention: str = "auto", top_p: float = 1.0,
                 repetition_penalty: float = 1.0, compile_prefill: bool = False,
                 refill_slots: int | None = None) -> None:  # fmt: skip
        if batch_tokens < max_len:
            raise EyasError(f"--batch-tokens {batch_tokens} holds no sequence of --max-seq-len {max_len}; give "
                            f"at least {max_len}")  # fmt: skip
        self.model = model
        p = next(model.parameters())
        self.device, self.dtype = p.device, p.dtype
        self.eos_ids, self.temperature, self.pad_id = set(eos_ids), temperature, pad_id
        self.top_p, self.repetition_penalty = top_p, repetition_penalty
        self.max_len = max_len
        self.num_slots = min(batch_tokens // max_len, MAX_ROWS)
        # default: four sequences' worth, at least 32,768 tokens, so a refill's free slots (an eighth of them, see
        # run) take one forward, not one per 4 * max_len: an eager prefill of a small model costs its kernels'
        # launches more than its tokens (SmolLM2-135M's 1,480 prefills of 5.7k tokens on average took 38.3 of
        # regenerate's 128.9 s on an H100 at 3877c1d, about 26 ms each)
        self.prefill_tokens = max(prefill_tokens or max(4 * max_len, 32768), max_len)
        # free slots that start a refill while others decode: fewer, larger prefills against slots left idle
        # until then (half of them on average). Over a run of A answers, refills cost A / refill_slots prefills'
        # fixed cost, and the idle slots refill_slots / (2 * num_slots) of the steps' time: with the run above
        # (44,577 answers, 47 s of steps over 710 slots, ~20 ms a prefill by the estimate) the sum is least near
        # a quarter of the slots; an eighth takes most of the gain (the estimate: 16 against 28 s at a
        # sixteenth, 12 at a quarter) while the idle slots' cost, which is sure, stays small
        self.refill_slots = max(1, refill_slots or self.num_slots // 8)
        self.sync_every = max(1, sync_every)
        self.slots = Slots(slots=self.num_slots, capacity=max_len, layers=layer_shapes(model), dtype=p.dtype,
                           device=p.device, attention=attention)  # fmt: skip
        S, dev = self.num_slots, self.device
        self.tok = torch.full((S, 1), pad_id, dtype=torch.long, device=dev)  # the token each row feeds next
        self.pos = torch.zeros(S, 1, dtype=torch.long, device=dev)  # its position
        self.seed = torch.zeros(S, dtype=torch.long, device=dev)
        self.slots.start = self.pos[:, 0]  # a view: the rows' positions as the step graphs read them
        # tokens each row has written so far, for the repetition penalty (allocated only when one is asked for)
        self.seen = torch.zeros(S, model.config.vocab_size, dtype=torch.bool, device=dev) \
            if repetition_penalty != 1.0 else None  # fmt: skip
        # dynamic=None: the row counts' graphs share one compiled layer (a second shape compiles it symbolic); not
        # frozen, which would compile a version per layer and row count, each with its copy of the weights
        self.graphs = Graphs(dev, enabled=cuda_graphs, compile_model=model if compile else None, dynamic=None)
        # Prefills run eagerly unless ``compile_prefill``. Compiled with symbolic shapes (one compile for every
        # prefill's length) they measured faster only warm, on random weights (60.7k against 54.5k tokens/s at
        # 4,096 prompts, the compile in an untimed warm-up); as a run pays it, cold on the real SmolLM2 and 7,941
        # ShareGPT first turns (one H200, `bash bench/gpu/generate.sh costs`), the prefills took 16.9 s compiled
        # against 4.4 s eager and the whole run 57.5k against 128.9k tokens/s, and in the recipe's regenerate
        # (33,384 prompts, every turn) 147.7 s against 52.4 s eager. The packed attention is a graph break in the
        # middle of each layer (its Python reads the slots' layout), so compiling buys little per forward.
        self.compile_prefill = compile_prefill
        self._compiled_before = compile_work()  # dynamo's compiles so far: the report counts this decoder's
        self.stats = {"steps": 0, "prefills": 0, "prefill_tokens": 0, "slot_steps_used": 0, "row_steps": 0,
                      "decode_seconds": 0.0, "prefill_seconds": 0.0, "caller_seconds": 0.0}  # fmt: skip

    def report(self) -> dict[str, Any]:
        """What the decoder did so far: steps, how full they were, and where the time went by the host's clock:
        ``decode_seconds`` launching steps and waiting for them (each block ends in a device sync), graph
        recording apart (``compiles`` and ``compile_seconds``: torch.compile's work inside both, the steps' and
        the prefills' layers; a shape compiling again and again shows here); ``caller_seconds`` the caller's own
        work on answers, done while steps ran (past the steps' time, it is what holds the loop back)."""
        st = self.stats
        compiles, compile_seconds = compile_work()
        return {"slots": self.num_slots, "steps": st["steps"], "prefills": st["prefills"],
                "prefill_tokens": st["prefill_tokens"],
                "slot_use": round(st["slot_steps_used"] / max(st["steps"] * self.num_slots, 1), 3),
                "row_use": round(st["slot_steps_used"] / max(st["row_steps"], 1), 3),
                "decode_seconds": round(st["decode_seconds"] - self.graphs.record_seconds, 2),
                "prefill_seconds": round(st["prefill_seconds"], 2), "caller_seconds": round(st["caller_seconds"], 2),
                "record_seconds": round(self.graphs.record_seconds, 2),
                "compiles": compiles - self._compiled_before[0],
                "compile_seconds": round(compile_seconds - self._compiled_before[1], 2)}  # fmt: skip

    @property
    def kv_bytes(self) -> int:
        """Bytes of key/value buffers held (fixed for the decoder's life)."""
        return sum(t.numel() * t.element_size() for t in self.slots.k + self.slots.v)

    # ------------------------------------------------------------------ forwards

    def _step(self, R: int) -> torch.Tensor:
        """One decoding step of the first ``R`` rows (idempotent: the state moves outside): their next tokens
        ``[R]``."""
        self.slots.begin(1, R)
        tok, pos = self.tok[:R], self.pos[:R]
        logits = self.model(input_ids=tok, position_ids=pos, use_cache=False).logits[:, -1]  # [R, V]
        logits = self._penalize(logits, None if self.seen is None else self.seen[:R], tok[:, 0])
        return pick_tokens(logits, temperature=self.temperature, seed=self.seed[:R], position=pos[:, 0] + 1,
                           top_p=self.top_p)  # fmt: skip

    def _penalize(self, logits: torch.Tensor, seen: torch.Tensor | None, fed: torch.Tensor) -> torch.Tensor:
        """The repetition penalty of CTRL (Keskar et al. 2019, as transformers applies it): the logit of every
        token the answer already holds is divided by the penalty when positive, multiplied when negative.
        ``fed [rows]`` (the token just fed) joins ``seen [rows, V]`` first."""
        if seen is None:
            return logits
        seen.scatter_(1, fed[:, None], True)
        p = self.repetition_penalty
        return torch.where(seen, torch.where(logits > 0, logits / p, logits * p), logits)

    def _prefill(self, batch: list[tuple[int, Request]]) -> list[int]:
        """Prompts into their slots (right-padded to one length, packed into one row) -> each one's first new
        token."""
        B = len(batch)
        Tp = max(len(r.tokens) for _, r in batch)
        ids = torch.full((B, Tp), self.pad_id, dtype=torch.long)
        for b, (_, r) in enumerate(batch):
            ids[b, : len(r.tokens)] = torch.tensor(r.tokens)
        ends = torch.tensor([b * Tp + len(r.tokens) - 1 for b, (_, r) in enumerate(batch)], device=self.device)
        pos = torch.arange(Tp).repeat(B)[None]  # [1, B*Tp]: each prompt from position 0
        targets = torch.tensor([s for s, _ in batch], device=self.device)
        slots = self.slots
        slots.layout, slots.targets, slots.prompt_len = "packed", targets, Tp
        slots.begin()
        try:
            logits = self._prefill_forward(ids.view(1, -1).to(self.device), pos.to(self.device), ends)  # [B, V]
        finally:
            slots.layout, slots.targets = "rows", None
        lengths = torch.tensor([len(r.tokens) for _, r in batch], device=self.device)
        seeds = torch.tensor([r.seed for _, r in batch], device=self.device)
        if self.seen is not None:  # a new answer: only its own tokens are penalised (the prompt's are not)
            self.seen[targets] = False
        first = pick_tokens(logits, temperature=self.temperature, seed=seeds, position=lengths, top_p=self.top_p)
        self.tok[targets, 0] = first
        self.pos[targets, 0] = lengths
        self.seed[targets] = seeds
        self.stats["prefills"] += 1
        self.stats["prefill_tokens"] += B * Tp
        return first.tolist()

    def _prefill_forward(self, ids: torch.Tensor, pos: torch.Tensor, ends: torch.Tensor) -> torch.Tensor:
        """The packed prompts' forward ``ids [1, B*Tp]`` -> the logits at ``ends`` ``[B, V]``; its layers
        compiled where :attr:`compile_prefill` (:func:`eyas.verifier.compile.run_dynamic`)."""
        out, self.compile_prefill = run_dynamic(
            self.model, lambda: self.model(input_ids=ids, position_ids=pos, use_cache=False, logits_to_keep=ends),
            compile=self.compile_prefill)  # fmt: skip
        return out.logits[0]

    # ------------------------------------------------------------------ the loop

    @torch.no_grad()
    def run(self, queue: RequestQueue) -> Iterator[Completion]:
        """Answer every request of ``queue``, yielding each as it completes (in completion order; handed over
        while the next block of steps runs, so the caller's work overlaps it). The caller may push more
        requests between completions (a conversation's next turn); the loop ends when the queue
        is empty and every slot is free."""
        import numpy as np

        from eyas.verifier.load import varying_shape_attention

        S, N = self.num_slots, self.sync_every
        active: list[Request | None] = [None] * S
        made: list[list[int]] = [[] for _ in range(S)]
        at = np.zeros(S, dtype=np.int64)  # the position of each active row's next fed token (host copy of self.pos)
        room = np.zeros(S, dtype=np.int64)  # new tokens each active row may still take
        eos = np.array(sorted(self.eos_ids), dtype=np.int64)
        block = torch.empty(N, S, dtype=torch.long, device=self.device)
        pending: list[Completion] = []  # answers of the last block, handed over while the next one runs
        # prefills see a new shape every time: flash / memory-efficient attention, no per-shape cuDNN plans
        with slot_attention(self.model, self.slots), varying_shape_attention(self.device):
            while True:
                free = [s for s in range(S) if active[s] is None]
                # refill: at once when idle, else once refill_slots are free (a prefill is one eager forward;
                # batching them keeps its cost per prompt low)
                if queue and free and (len(free) == S or len(free) >= self.refill_slots or len(queue) < len(free)):
                    t0 = time.perf_counter()
                    for c in self._admit(queue, free, active, made, at, room):
                        self.stats["prefill_seconds"] += time.perf_counter() - t0
                        yield c
                        t0 = time.perf_counter()
                    self.stats["prefill_seconds"] += time.perf_counter() - t0
                busy = np.array([s for s in range(S) if active[s] is not None], dtype=np.int64)
                if not len(busy):
                    if pending:  # the caller's work on them may queue more requests
                        yield from pending
                        pending = []
                    elif not queue:
                        return
                    continue
                t0 = time.perf_counter()
                self.slots.keys = self.slots.key_length(int(at[busy].max()) + N + 1)
                R = row_bucket(int(busy[-1]) + 1, S)  # rows past R are free: they stay where they are
                step = functools.partial(self._step, R)
                for i in range(N):
                    nxt = self.graphs.run(("step", R, self.slots.keys), step)
                    block[i, :R] = nxt
                    self.tok[:R, 0] = nxt
                    self.pos[:R].add_(1).clamp_(max=self.max_len - 1)
                self.stats["steps"] += N
                self.stats["row_steps"] += N * R
                self.stats["slot_steps_used"] += N * len(busy)
                # The last block's answers go to the caller while the GPU runs this block: what the caller does
                # with them on the host (decoding the text, the next turn's chat template and tokens) overlaps
                # the steps instead of following them.
                t1 = time.perf_counter()
                yield from pending
                pending = []
                queue.fill()  # what the caller submitted for them (next turns), readied while the steps run
                t2 = time.perf_counter()
                host = block[:, busy].cpu().numpy()  # [N, busy]: the block's one device->host sync
                self.stats["caller_seconds"] += t2 - t1
                self.stats["decode_seconds"] += time.perf_counter() - t0 - (t2 - t1)
                at[busy] += N
                # per row: tokens up to its first end-of-turn id or its remaining room, whichever comes first
                hit = np.isin(host, eos)
                first_eos = np.where(hit.any(0), hit.argmax(0) + 1, N + 1)  # 1-based; N + 1: none
                take = np.minimum(np.minimum(first_eos, room[busy]), N)
                ends = (first_eos <= take) | (take >= room[busy])
                done = []
                for j, s in enumerate(busy.tolist()):
                    made[s].extend(host[: take[j], j].tolist())
                    room[s] -= take[j]
                    if ends[j]:
                        done.append(s)
                for s in done:
                    r, toks = active[s], made[s]
                    active[s], made[s] = None, []
                    pending.append(Completion(r.key, toks, finished=toks[-1] in self.eos_ids))
                if done:  # a free row keeps decoding padding from position 0 until it is refilled
                    idx = torch.tensor(done, device=self.device)
                    self.pos[idx] = 0
                    self.tok[idx] = self.pad_id

    def _limit(self, r: Request) -> int:
        return min(r.max_new_tokens, self.max_len - len(r.tokens))

    def _admit(self, queue: RequestQueue, free: list[int], active, made, at, room) -> Iterator[Completion]:
        """Prefill waiting requests into free slots: as many as there are free slots, taken in the queue's order,
        then packed by length into forwards of at most ``prefill_tokens`` (right-padded to each forward's longest
        prompt: packing similar lengths together pads least)."""
        while queue and free:
            take: list[Request] = []
            while queue and len(take) < len(free):
                r = queue.pop()
                if len(r.tokens) + 1 > self.max_len:
                    yield Completion(r.key, [], finished=False, too_long=True)
                    continue
                take.append(r)
            take.sort(key=lambda r: len(r.tokens))
            i = 0
            while i < len(take):
                batch: list[tuple[int, Request]] = []
                # ascending lengths: the request added last is the forward's longest
                while i < len(take) and not (batch and len(take[i].tokens) * (len(batch) + 1) > self.prefill_tokens):
                    batch.append((free.pop(0), take[i]))
                    i += 1
                firsts = self._prefill(batch)
                for (s, r), t in zip(batch, firsts):
                    if t in self.eos_ids or self._limit(r) <= 1:
                        self.pos[s] = 0
                        self.tok[s] = self.pad_id
                        bisect.insort(free, s)  # lowest first: the busy rows stay packed at the low slots
                        yield Completion(r.key, [t], finished=t in self.eos_ids)
                        continue
                    active[s], made[s], at[s], room[s] = r, [t], len(r.tokens), self._limit(r) - 1


def default_batch_tokens(model, *, max_len: int, fraction: float = 0.4, cpu_tokens: int = 16384) -> int:
    """A token budget for :class:`BatchDecoder`: on CUDA, the key/value positions ``fraction`` of the free GPU
    memory holds; on CPU ``cpu_tokens``; never below one sequence of ``max_len``."""
    p = next(model.parameters())
    if p.device.type != "cuda":
        return max(cpu_tokens, max_len)
    free = free_memory(p.device)
    per_token = Slots.bytes_per_token(layer_shapes(model), p.dtype)
    return max(int(free * fraction) // per_token, max_len)


def decode_all(model, requests: Iterable[Request], **kwargs: Any) -> list[Completion]:
    """Answer ``requests`` with a :class:`BatchDecoder` (``kwargs`` are its settings); completions in request
    order."""
    requests = list(requests)
    order = {id(r): i for i, r in enumerate(requests)}
    keyed = [Request(key=id(r), tokens=r.tokens, max_new_tokens=r.max_new_tokens, seed=r.seed) for r in requests]
    out: list[Completion | None] = [None] * len(requests)
    for c in BatchDecoder(model, **kwargs).run(RequestQueue(keyed)):
        i = order[c.key]
        out[i] = Completion(requests[i].key, c.tokens, c.finished, c.too_long)
    return out  # type: ignore[return-value]


# --------------------------------------------------------------------------- settings


_DTYPES = {"fp32": torch.float32, "float32": torch.float32, "bf16": torch.bfloat16, "bfloat16": torch.bfloat16,
           "fp16": torch.float16, "float16": torch.float16}  # fmt: skip


def device_and_dtype(device: str | None, dtype: str) -> tuple[torch.device, torch.dtype]:
    """``--device`` (default: cuda when there is one) and ``--dtype`` (auto: bf16 on a GPU, fp32 on CPU)."""
    dev = torch.device(device or ("cuda" if torch.cuda.is_available() else "cpu"))
    if dtype == "auto":
        return dev, torch.bfloat16 if dev.type == "cuda" else torch.float32
    if dtype not in _DTYPES:
        raise EyasError(f"--dtype must be auto, fp32, bf16 or fp16, got {dtype!r}")
    return dev, _DTYPES[dtype]
