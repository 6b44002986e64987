"""The generation engine: the verifier decodes, for `eyas regenerate` (many requests at once) and `eyas eval`
(one sequence at a time, speculatively, with rollback), through transformers' own model classes.

What eyas adds is only the attention and its key/value storage. An attention function registered through
transformers' ``AttentionInterface`` (the documented way to plug one in; the model, its weights, RoPE, norms,
MoE and head stay transformers') reads and writes per-sequence *slots*: one row of ``[slots, kv_heads,
capacity, head_dim]`` buffers per sequence. Each sequence keeps its own position, so a finished answer's slot
takes the next request at once (continuous batching), and rolling a sequence back is moving its position.

Why not transformers' generation as is (measured on one H200 with SmolLM2, docs/BENCHMARKS.md): ``generate``
with a static cache holds a batch until its longest answer ends and cannot take a new prompt mid-batch; its
continuous batching (``generate_batch``) packs the requests of a step into one attention over all of their keys
(``paged|sdpa``: a 4-D mask that grows with the square of the batch) unless the flash-attention kernels are
installed, and they are fetched from the hub, which the GPU machine cannot reach.

Memory is fixed by the settings, not by the data: the key/value buffers are allocated once (``batch_tokens``
positions in all), a prefill packs at most ``prefill_tokens`` tokens, and a prompt that does not fit a slot is
answered as too long instead of growing anything. On CUDA every fixed-shape decoding forward is recorded once
as a CUDA graph (per key length bucket) and replayed, so the host does not dispatch hundreds of kernels a token.
"""

from __future__ import annotations

import contextlib
import heapq
import itertools
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.nn.functional as F

from eyas.errors import EyasError

#: The name the slot attention is registered under in transformers' AttentionInterface.
ATTENTION = "eyas_slots"

#: The key lengths decoding graphs are recorded for: a step attends to the smallest one that covers every
#: sequence (steps of about 1.5x keep the number of graphs small and the wasted keys under a third).
_KEY_BUCKETS = (64, 128, 192, 256, 384, 512, 768, 1024, 1536, 2048, 3072, 4096, 6144, 8192, 12288, 16384)


def key_bucket(n: int, capacity: int) -> int:
    """The smallest key length of :data:`_KEY_BUCKETS` (or a multiple of the largest) covering ``n``, at most
    ``capacity``."""
    for b in _KEY_BUCKETS:
        if b >= n:
            return min(b, capacity)
    top = _KEY_BUCKETS[-1]
    return min(-(-n // top) * top, capacity)


# --------------------------------------------------------------------------- key/value slots and the attention


class Slots:
    """Key/value buffers for ``slots`` sequences of at most ``capacity`` positions, one pair per layer, plus
    what the next forward needs to know: where each row's new tokens go.

    A forward runs in one of two layouts:

    - ``rows``: input ``[S, T]``, row ``s`` feeding ``T`` new tokens at positions ``start[s] .. start[s]+T-1``
      into slot ``s``; each query sees its slot's keys up to its own position (decoding, verification, and a
      single sequence's prompt);
    - ``packed``: input ``[1, B * Tp]``, ``B`` prompts right-padded to ``Tp`` tokens, prompt ``b`` filling slot
      ``targets[b]`` from position 0 (prefill of new requests; causal within each prompt).
    """

    def __init__(self, *, slots: int, capacity: int, layers: list[tuple[int, int, int, torch.device]],
                 dtype: torch.dtype, device: torch.device) -> None:  # fmt: skip
        self.num_slots, self.capacity = slots, capacity
        # layers[i] = (kv_heads, key_dim, value_dim, device) of decoder layer i: a layer's slots live where it
        # runs (a device map spreads layers over GPUs)
        self.k = [torch.zeros(slots, h, capacity, dk, dtype=dtype, device=at) for h, dk, _, at in layers]
        self.v = [torch.zeros(slots, h, capacity, dv, dtype=dtype, device=at) for h, _, dv, at in layers]
        self.rows = torch.arange(slots, device=device)
        self.layout = "rows"
        self.start = torch.zeros(slots, dtype=torch.long, device=device)  # rows layout: first new position
        self.keys = capacity  # rows layout: key length attended (a bucket >= every query's position + 1)
        self.targets: torch.Tensor | None = None  # packed layout: the slot of each prompt [B]
        self.prompt_len = 0  # packed layout: Tp
        self._masks: dict[int | None, torch.Tensor] = {}
        self._moved: dict[tuple[int, torch.device], torch.Tensor] = {}

    @staticmethod
    def bytes_per_token(layers: list[tuple[int, int, int, torch.device]], dtype: torch.dtype) -> int:
        """Key and value bytes one position of one sequence holds over all layers."""
        return sum(h * (dk + dv) for h, dk, dv, _ in layers) * torch.finfo(dtype).bits // 8

    def begin(self) -> None:
        """Before each forward: masks (and index tensors other devices need) are built once per forward, on
        first use."""
        self._masks, self._moved = {}, {}

    def on(self, t: torch.Tensor, device: torch.device) -> torch.Tensor:
        """``t`` on ``device``, copied there at most once per forward (the layers of a device map)."""
        if t.device == device:
            return t
        key = (id(t), device)
        if key not in self._moved:
            self._moved[key] = t.to(device)
        return self._moved[key]

    def _mask(self, T: int, window: int | None) -> torch.Tensor:
        """rows layout: ``[S, 1, T, keys]`` bool, key ``j`` visible to new token ``t`` of row ``s`` when
        ``j <= start[s] + t`` (and, with a sliding window ``W``, ``j > start[s] + t - W``, transformers'
        ``sliding_window_overlay``)."""
        if window not in self._masks:
            j = torch.arange(self.keys, device=self.start.device)
            q = self.start[:, None] + torch.arange(T, device=self.start.device)  # [S, T]
            m = j[None, None, :] <= q[:, :, None]  # [S, T, keys]
            if window is not None:
                m = m & (j[None, None, :] > q[:, :, None] - window)
            self._masks[window] = m[:, None]
        return self._masks[window]


#: The slots the registered attention reads and writes during a forward (set by :func:`slot_attention`).
_ACTIVE: Slots | None = None


def _attention(module, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, attention_mask,
               scaling: float | None = None, dropout: float = 0.0, sliding_window: int | None = None,
               softcap: float | None = None, **kwargs: Any) -> tuple[torch.Tensor, None]:  # fmt: skip
    """transformers' attention-function interface: ``query [B, H, T, dk]`` and ``key [B, kvh, T, dk]``,
    ``value [B, kvh, T, dv]`` (RoPE applied) of the new tokens -> ``[B, T, H, dv]``. Writes the new keys and
    values into their slots and attends to the slot's keys (see :class:`Slots`)."""
    slots = _ACTIVE
    if slots is None:
        raise EyasError("internal: the eyas slot attention ran outside eyas.generate.slot_attention")
    if kwargs.get("s_aux") is not None:  # attention sinks (gpt-oss): another softmax
        raise EyasError("the eyas generation engine does not support attention sinks (s_aux)")
    layer = module.layer_idx
    K, V = slots.k[layer], slots.v[layer]
    H, kvh = query.shape[1], key.shape[1]
    G = H // kvh
    if slots.layout == "packed":
        B, Tp = slots.targets.shape[0], slots.prompt_len
        q = query[0].reshape(H, B, Tp, -1).transpose(0, 1)  # [B, H, Tp, dk]
        k = key[0].reshape(kvh, B, Tp, -1).transpose(0, 1)  # [B, kvh, Tp, dk]
        v = value[0].reshape(kvh, B, Tp, -1).transpose(0, 1)  # [B, kvh, Tp, dv]
        targets = slots.on(slots.targets, K.device)
        K[targets, :, :Tp] = k.to(K.dtype)
        V[targets, :, :Tp] = v.to(V.dtype)
        k, v = k.repeat_interleave(G, dim=1), v.repeat_interleave(G, dim=1)  # [B, H, Tp, d]
        mask = None
        if sliding_window is not None:
            i = torch.arange(Tp, device=q.device)
            mask = (i[None, :] <= i[:, None]) & (i[None, :] > i[:, None] - sliding_window)  # [Tp, Tp]
        out = _sdpa(q, k, v, mask=mask, causal=mask is None, scale=scaling, softcap=softcap)  # [B, H, Tp, dv]
        return out.transpose(1, 2).reshape(1, B * Tp, H, -1), None
    S, _, T, _ = query.shape
    start, rows = slots.on(slots.start, K.device), slots.on(slots.rows, K.device)
    pos = (start[:, None] + torch.arange(T, device=K.device)).clamp(max=slots.capacity - 1)  # [S, T]
    K[rows[:, None], :, pos] = key.transpose(1, 2).to(K.dtype)  # [S, T, kvh, dk] into the slots
    V[rows[:, None], :, pos] = value.transpose(1, 2).to(V.dtype)
    n = slots.keys
    mask = slots.on(slots._mask(T, sliding_window), K.device)  # [S, 1, T, n]
    # Grouped-query attention without copying keys: the G query heads that share a key head become G*T query
    # rows of it ([S, H, T, d] -> [S, kvh, G*T, d]), each row g*T + t with the mask of token t.
    q = query.reshape(S, kvh, G * T, -1)
    if T > 1:
        mask = mask[:, :, None].expand(S, 1, G, T, n).reshape(S, 1, G * T, n)
    out = _sdpa(q, K[:, :, :n].to(q.dtype), V[:, :, :n].to(q.dtype), mask=mask, causal=False, scale=scaling,
                softcap=softcap)  # [S, kvh, G*T, dv]
    return out.reshape(S, H, T, -1).transpose(1, 2), None


def _sdpa(q, k, v, *, mask, causal: bool, scale: float | None, softcap: float | None) -> torch.Tensor:
    """Scaled dot-product attention; with ``softcap`` (Gemma-2's ``attn_logit_softcapping``: ``c * tanh(s /
    c)`` on the scores before the softmax, which SDPA cannot do) written out."""
    if softcap is None:
        return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, is_causal=causal, scale=scale)
    s = (q @ k.transpose(-1, -2)) * (scale if scale is not None else q.shape[-1] ** -0.5)
    s = softcap * torch.tanh(s / softcap)
    if causal:
        n = q.shape[-2]
        mask = torch.ones(n, n, dtype=torch.bool, device=q.device).tril()
    if mask is not None:
        s = s.masked_fill(~mask, float("-inf"))
    return torch.softmax(s.float(), -1).to(v.dtype) @ v


def _register() -> None:
    from transformers import AttentionInterface

    # never traced by torch.compile: its Python reads the slots' current layout and key length
    AttentionInterface.register(ATTENTION, torch.compiler.disable(_attention))


@contextlib.contextmanager
def slot_attention(model, slots: Slots) -> Iterator[None]:
    """Run ``model``'s attention through ``slots`` inside the block (transformers' ``set_attn_implementation``;
    the model's own implementation comes back after)."""
    global _ACTIVE
    _register()
    before = model.config._attn_implementation
    if not model._can_set_attn_implementation():
        raise EyasError(f"{type(model).__name__} does not run its attention through transformers' "
                        "AttentionInterface; the eyas generation engine cannot drive it")  # fmt: skip
    model.set_attn_implementation(ATTENTION)
    _ACTIVE = slots
    try:
        yield
    finally:
        _ACTIVE = None
        model.set_attn_implementation(before)


def layer_shapes(model) -> list[tuple[int, int, int, torch.device]]:
    """``(kv_heads, key_dim, value_dim, device)`` per decoder layer, read off one forward of one token (so every
    attention variant transformers implements, MLA's wider keys included, is sized by what it really stores,
    and placed where a device map runs the layer)."""
    seen: dict[int, tuple[int, int, int, torch.device]] = {}

    def probe(module, query, key, value, attention_mask, **kwargs):
        seen[module.layer_idx] = (key.shape[1], key.shape[-1], value.shape[-1], key.device)
        B, H, T, _ = query.shape
        return query.new_zeros(B, T, H, value.shape[-1]), None

    from transformers import AttentionInterface

    AttentionInterface.register("eyas_probe", probe)
    before = model.config._attn_implementation
    model.set_attn_implementation("eyas_probe")
    try:
        dev = next(model.parameters()).device
        with torch.no_grad():
            model.base_model(input_ids=torch.zeros(1, 1, dtype=torch.long, device=dev), use_cache=False)
    finally:
        model.set_attn_implementation(before)
    if sorted(seen) != list(range(len(seen))):
        raise EyasError(f"internal: attention layers {sorted(seen)} are not numbered 0..n-1")
    return [seen[i] for i in range(len(seen))]


# --------------------------------------------------------------------------- CUDA graphs


class Graphs:
    """Fixed-shape forwards recorded once as CUDA graphs and replayed (on CUDA; elsewhere, or with
    ``enabled=False``, they run eagerly).

    ``run(key, fn)`` calls ``fn`` (which reads and writes only tensors that live as long as this object) the
    first time a key is seen: twice eagerly on a side stream (lazy initialisation must not happen inside a
    capture), then once under capture. ``fn`` must be idempotent for the state it is called in (it writes the
    same keys and values each time), which the decoders guarantee by updating their state outside ``fn``.
    A model whose forward cannot be captured (host synchronisation inside, as MoE routing in some
    transformers versions does) is run eagerly from then on, after one note.

    With ``compile_model``, the warm-up and capture run that model's decoder layers compiled
    (:func:`compiled_layers`): the graph then replays fused kernels. At batch size 1 a decoding step is
    launch-bound (about 50 small kernels a layer eagerly), so fusing them is what makes a step fast.
    """

    def __init__(self, device: torch.device, *, enabled: bool = True, compile_model=None) -> None:
        self.enabled = enabled and device.type == "cuda"
        self.compile_model = compile_model if self.enabled else None
        self.graphs: dict[Any, tuple[Any, Any]] = {}

    def run(self, key: Any, fn: Callable[[], Any]) -> Any:
        if not self.enabled:
            return fn()
        if key not in self.graphs:
            with contextlib.ExitStack() as stack:
                if self.compile_model is not None:
                    stack.enter_context(compiled_layers(self.compile_model))
                try:
                    self.graphs[key] = self._capture(fn)
                except Exception as e:  # e.g. "operation not permitted when stream is capturing", a compiler error
                    import sys

                    torch.cuda.synchronize()
                    if self.compile_model is not None:
                        print(f"eyas: decoding without torch.compile ({type(e).__name__}: "
                              f"{str(e).splitlines()[0][:160]})", file=sys.stderr)  # fmt: skip
                        self.compile_model = None
                        return self.run(key, fn)
                    print(f"eyas: decoding without CUDA graphs (the verifier's forward cannot be captured: "
                          f"{str(e).splitlines()[0][:160]})", file=sys.stderr)  # fmt: skip
                    self.enabled = False
                    return fn()
        graph, out = self.graphs[key]
        graph.replay()
        return out

    @staticmethod
    def _capture(fn: Callable[[], Any]) -> tuple[Any, Any]:
        stream = torch.cuda.Stream()
        stream.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(stream):
            for _ in range(2):
                fn()
        torch.cuda.current_stream().wait_stream(stream)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            out = fn()
        return graph, out


@contextlib.contextmanager
def compiled_layers(model) -> Iterator[None]:
    """Inside the block, every decoder layer of ``model`` runs its forward through ``torch.compile``
    (regional compilation: the layers share one compiled function, so compiling costs one layer, not the whole
    model; PyTorch's "regional compilation" recipe). The slot attention stays eager (a graph break: it is
    registered through ``torch.compiler.disable``), so the compiled code does not depend on key lengths and
    a shape compiles once. Forward hooks (hidden-state capture) run outside the compiled code."""
    layers = model.base_model.layers
    cfg = torch._dynamo.config
    for name in ("recompile_limit", "cache_size_limit"):  # a few shapes (one per decoding length) per layer
        if hasattr(cfg, name):
            setattr(cfg, name, max(getattr(cfg, name), 64))
    for layer in layers:
        if "_eyas_compiled" not in layer.__dict__:
            layer._eyas_compiled = torch.compile(layer.forward, dynamic=False)
        layer.forward = layer._eyas_compiled  # an instance attribute: shadows the class's forward
    try:
        yield
    finally:
        for layer in layers:
            layer.__dict__.pop("forward", None)


# --------------------------------------------------------------------------- one sequence (eval)


class SequenceDecoder:
    """The verifier over one sequence with a cache that rolls back: ``forward(ids, start)`` feeds tokens at
    positions ``start..`` (after rolling back to ``start``) and returns their logits; ``aux_layer_ids`` also
    returns the hidden states entering those layers (what an EAGLE-3 draft reads), captured as they pass.

    This is what speculative decoding needs at batch size 1: a verification forward over ``K + 1`` tokens, a
    plain decoding step over one, each a CUDA graph per key-length bucket (its layers compiled with
    ``compile``); a prompt of any length runs eagerly.
    """

    def __init__(self, model, *, capacity: int, aux_layer_ids: list[int] | None = None,
                 graph_lengths: Iterable[int] = (1,), cuda_graphs: bool = True,
                 compile: bool = True) -> None:  # fmt: skip
        from eyas.verifier import HiddenStateCapture

        self.model = model
        p = next(model.parameters())
        self.device = p.device
        self.slots = Slots(slots=1, capacity=capacity, layers=layer_shapes(model), dtype=p.dtype, device=p.device)
        self.capture = HiddenStateCapture(model, aux_layer_ids) if aux_layer_ids else None
        if self.capture is not None:
            self.capture.remove()  # attached only during this decoder's forwards
        self.graph_lengths = set(graph_lengths)
        self.graphs = Graphs(self.device, enabled=cuda_graphs, compile_model=model if compile else None)
        self._ids: dict[int, torch.Tensor] = {}  # static inputs per graphed length
        self._pos: dict[int, torch.Tensor] = {}

    @property
    def capacity(self) -> int:
        return self.slots.capacity

    def _forward(self, ids: torch.Tensor, pos: torch.Tensor, keep: int):
        """ids, pos ``[1, T]`` -> logits ``[T', V]`` (``keep`` last, 0 = all), aux ``[T, 3H]`` or None."""
        self.slots.begin()
        out = self.model(input_ids=ids, position_ids=pos, use_cache=False, logits_to_keep=keep)
        aux = self.capture.aux()[0] if self.capture is not None else None
        return out.logits[0], aux

    @torch.no_grad()
    def forward(self, input_ids: torch.Tensor, start: int, *, last_only: bool = False):
        """``input_ids [T]`` at positions ``start..start+T-1`` -> (logits ``[T or 1, V]`` float32, aux
        ``[T, 3H]`` or None). Positions ``>= start`` from earlier calls are forgotten (rolled back)."""
        from eyas.verifier import varying_shape_attention

        T = input_ids.shape[0]
        if start + T > self.capacity:
            raise EyasError(f"internal: {start + T} positions exceed the verifier cache of {self.capacity}")
        slots = self.slots
        slots.start.fill_(start)
        slots.keys = key_bucket(start + T, self.capacity)
        with slot_attention(self.model, slots), varying_shape_attention(self.device), \
                contextlib.ExitStack() as stack:  # fmt: skip
            if self.capture is not None:
                stack.enter_context(self.capture)
            if T in self.graph_lengths and not last_only and self.graphs.enabled:
                if T not in self._ids:
                    self._ids[T] = torch.zeros(1, T, dtype=torch.long, device=self.device)
                    self._pos[T] = torch.zeros(1, T, dtype=torch.long, device=self.device)
                self._ids[T].copy_(input_ids[None])
                self._pos[T].copy_(torch.arange(start, start + T, device=self.device)[None])
                logits, aux = self.graphs.run((T, slots.keys), lambda: self._forward(self._ids[T], self._pos[T], 0))
                # graph outputs live in its pool and the next replay overwrites them: copy what the caller keeps
                return logits.float(), None if aux is None else aux.clone()
            pos = torch.arange(start, start + T, device=self.device)[None]
            logits, aux = self._forward(input_ids[None], pos, 1 if last_only else 0)
            return logits.float(), aux


# --------------------------------------------------------------------------- many requests (regenerate)


@dataclass(order=True)
class Request:
    """A prompt to answer: ``tokens`` (ids, chat template applied), at most ``max_new_tokens`` new ones.
    ``key`` is the caller's, returned with the answer; ``seed`` makes sampling of this request independent of
    which others share its batch."""

    sort: int = field(init=False, repr=False)
    key: Any = field(compare=False)
    tokens: list[int] = field(compare=False)
    max_new_tokens: int = field(compare=False)
    seed: int = field(default=0, compare=False)

    def __post_init__(self) -> None:
        if not self.tokens:
            raise ValueError("a request needs at least one prompt token")
        self.sort = len(self.tokens)


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
    """Requests waiting for a slot, shortest prompt first (similar lengths decode together, so the key length a
    step attends to stays close to what its sequences need); requests may be added while the engine runs."""

    def __init__(self, requests: Iterable[Request] = ()) -> None:
        self._heap: list[tuple[int, int, Request]] = []
        self._n = itertools.count()
        for r in requests:
            self.push(r)

    def push(self, request: Request) -> None:
        heapq.heappush(self._heap, (request.sort, next(self._n), request))

    def pop(self) -> Request:
        return heapq.heappop(self._heap)[2]

    def peek(self) -> Request:
        return self._heap[0][2]

    def __len__(self) -> int:
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
                position: torch.Tensor | None = None) -> torch.Tensor:  # fmt: skip
    """The next token of each row of ``logits [S, V]``: argmax at ``T = 0``; otherwise a sample of
    ``softmax(logits / T)`` by the Gumbel-max trick (argmax of ``logits / T - log(-log(u))``), ``u`` from
    :func:`_uniform` of each row's seed and position."""
    if temperature == 0:
        return logits.argmax(-1)
    u = _uniform(seed, position, logits.shape[-1])
    return (logits.float() / temperature - torch.log(-torch.log(u)).float()).argmax(-1)


class BatchDecoder:
    """Continuous batching over slots: up to ``num_slots`` sequences decode together, one token each per
    step; a finished answer's slot takes the next waiting request (shortest prompt first) at once.

    Memory is fixed by ``batch_tokens`` (key/value positions in all: ``num_slots = batch_tokens // max_len``
    slots of ``max_len`` positions each) and ``prefill_tokens`` (new prompts are prefilled together,
    right-padded, at most that many tokens a forward). The host reads the new tokens every ``sync_every``
    steps (an answer that ends inside such a block costs at most ``sync_every - 1`` discarded steps of its
    slot); the steps themselves are CUDA graphs on CUDA, their layers compiled with ``compile``.
    """

    def __init__(self, model, *, eos_ids: set[int], max_len: int, batch_tokens: int, temperature: float = 0.0,
                 prefill_tokens: int | None = None, sync_every: int = 8, pad_id: int = 0,
                 cuda_graphs: bool = True, compile: bool = True) -> None:  # fmt: skip
        if batch_tokens < max_len:
            raise EyasError(f"--batch-tokens {batch_tokens} holds no sequence of --max-seq-len {max_len}; give "
                            f"at least {max_len}")  # fmt: skip
        self.model = model
        p = next(model.parameters())
        self.device, self.dtype = p.device, p.dtype
        self.eos_ids, self.temperature, self.pad_id = set(eos_ids), temperature, pad_id
        self.max_len = max_len
        self.num_slots = batch_tokens // max_len
        self.prefill_tokens = max(prefill_tokens or 4 * max_len, max_len)
        self.sync_every = max(1, sync_every)
        self.slots = Slots(slots=self.num_slots, capacity=max_len, layers=layer_shapes(model), dtype=p.dtype,
                           device=p.device)  # fmt: skip
        S, dev = self.num_slots, self.device
        self.tok = torch.full((S, 1), pad_id, dtype=torch.long, device=dev)  # the token each row feeds next
        self.pos = torch.zeros(S, 1, dtype=torch.long, device=dev)  # its position
        self.seed = torch.zeros(S, dtype=torch.long, device=dev)
        self.slots.start = self.pos[:, 0]  # a view: the rows' positions as the step graphs read them
        self.graphs = Graphs(dev, enabled=cuda_graphs, compile_model=model if compile else None)
        self.stats = {"steps": 0, "prefills": 0, "prefill_tokens": 0, "slot_steps_used": 0}

    @property
    def kv_bytes(self) -> int:
        """Bytes of key/value buffers held (fixed for the decoder's life)."""
        return sum(t.numel() * t.element_size() for t in self.slots.k + self.slots.v)

    # ------------------------------------------------------------------ forwards

    def _step(self) -> torch.Tensor:
        """One decoding step of every row (idempotent: the state moves outside): the next token ``[S]``."""
        self.slots.begin()
        logits = self.model(input_ids=self.tok, position_ids=self.pos, use_cache=False).logits[:, -1]  # [S, V]
        return pick_tokens(logits, temperature=self.temperature, seed=self.seed, position=self.pos[:, 0] + 1)

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
            logits = self.model(input_ids=ids.view(1, -1).to(self.device), position_ids=pos.to(self.device),
                                use_cache=False, logits_to_keep=ends).logits[0]  # fmt: skip  # [B, V]
        finally:
            slots.layout, slots.targets = "rows", None
        lengths = torch.tensor([len(r.tokens) for _, r in batch], device=self.device)
        seeds = torch.tensor([r.seed for _, r in batch], device=self.device)
        first = pick_tokens(logits, temperature=self.temperature, seed=seeds, position=lengths)
        self.tok[targets, 0] = first
        self.pos[targets, 0] = lengths
        self.seed[targets] = seeds
        self.stats["prefills"] += 1
        self.stats["prefill_tokens"] += B * Tp
        return first.tolist()

    # ------------------------------------------------------------------ the loop

    @torch.no_grad()
    def run(self, queue: RequestQueue) -> Iterator[Completion]:
        """Answer every request of ``queue``, yielding each as it completes (in completion order). The caller
        may push more requests between completions (a conversation's next turn); the loop ends when the queue
        is empty and every slot is free."""
        import numpy as np

        from eyas.verifier import varying_shape_attention

        S, N = self.num_slots, self.sync_every
        active: list[Request | None] = [None] * S
        made: list[list[int]] = [[] for _ in range(S)]
        at = np.zeros(S, dtype=np.int64)  # the position of each active row's next fed token (host copy of self.pos)
        room = np.zeros(S, dtype=np.int64)  # new tokens each active row may still take
        eos = np.array(sorted(self.eos_ids), dtype=np.int64)
        block = torch.empty(N, S, dtype=torch.long, device=self.device)
        # prefills see a new shape every time: flash / memory-efficient attention, no per-shape cuDNN plans
        with slot_attention(self.model, self.slots), varying_shape_attention(self.device):
            while True:
                free = [s for s in range(S) if active[s] is None]
                # refill: at once when idle, else once a sixteenth of the slots is free (a prefill is one eager
                # forward; batching them keeps its cost per prompt low)
                if queue and free and (len(free) == S or len(free) >= max(1, S // 16) or len(queue) < len(free)):
                    yield from self._admit(queue, free, active, made, at, room)
                busy = np.array([s for s in range(S) if active[s] is not None], dtype=np.int64)
                if not len(busy):
                    if not queue:
                        return
                    continue
                self.slots.keys = key_bucket(int(at[busy].max()) + N + 1, self.max_len)
                for i in range(N):
                    nxt = self.graphs.run(("step", self.slots.keys), self._step)
                    block[i] = nxt
                    self.tok[:, 0] = nxt
                    self.pos.add_(1).clamp_(max=self.max_len - 1)
                self.stats["steps"] += N
                self.stats["slot_steps_used"] += N * len(busy)
                host = block[:, busy].cpu().numpy()  # [N, busy]: the block's one device->host sync
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
                    yield Completion(r.key, toks, finished=toks[-1] in self.eos_ids)
                if done:  # a free row keeps decoding padding from position 0 until it is refilled
                    idx = torch.tensor(done, device=self.device)
                    self.pos[idx] = 0
                    self.tok[idx] = self.pad_id

    def _limit(self, r: Request) -> int:
        return min(r.max_new_tokens, self.max_len - len(r.tokens))

    def _admit(self, queue: RequestQueue, free: list[int], active, made, at, room) -> Iterator[Completion]:
        """Prefill waiting requests into free slots (as many as fit ``prefill_tokens`` per forward)."""
        while queue and free:
            batch: list[tuple[int, Request]] = []
            while queue and free:
                r = queue.peek()
                if len(r.tokens) + 1 > self.max_len:
                    queue.pop()
                    yield Completion(r.key, [], finished=False, too_long=True)
                    continue
                width = max([len(r.tokens)] + [len(x.tokens) for _, x in batch])
                if batch and width * (len(batch) + 1) > self.prefill_tokens:
                    break
                batch.append((free.pop(0), queue.pop()))
            if not batch:
                continue
            firsts = self._prefill(batch)
            for (s, r), t in zip(batch, firsts):
                if t in self.eos_ids or self._limit(r) <= 1:
                    self.pos[s] = 0
                    self.tok[s] = self.pad_id
                    free.append(s)
                    yield Completion(r.key, [t], finished=t in self.eos_ids)
                    continue
                active[s], made[s], at[s], room[s] = r, [t], len(r.tokens), self._limit(r) - 1


def default_batch_tokens(model, *, max_len: int, fraction: float = 0.4, cpu_tokens: int = 16384) -> int:
    """A token budget for :class:`BatchDecoder`: on CUDA, the key/value positions ``fraction`` of the free GPU
    memory holds; on CPU ``cpu_tokens``; never below one sequence of ``max_len``."""
    p = next(model.parameters())
    if p.device.type != "cuda":
        return max(cpu_tokens, max_len)
    free, _ = torch.cuda.mem_get_info(p.device)
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


# --------------------------------------------------------------------------- prompts, stops and settings


def encode_prompt(tokenizer, messages: list[dict[str, str]]) -> list[int]:
    """The chat template applied as the verifier's tokenizer ships it (no second BOS: the template writes it),
    ending with the generation prompt: the ids a decoder continues."""
    text = tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    return tokenizer(text, add_special_tokens=False)["input_ids"]


def end_of_turn_ids(tokenizer) -> set[int]:
    """The ids that end an assistant turn: the control token the chat template writes right after an
    assistant message (``<|im_end|>`` in ChatML) plus the tokenizer's EOS.

    Passed explicitly to every decoding loop: on the GPU machine, ``generate`` on the GGUF SmolLM2 ran past
    ``<|im_end|>`` when left to its defaults.
    """
    from eyas.verifier import end_of_turn_token

    ids = {tokenizer.eos_token_id} if tokenizer.eos_token_id is not None else set()
    answer = "eyas probe answer"
    with contextlib.suppress(Exception):  # a template that cannot render the probe still leaves the EOS
        probe = [{"role": "user", "content": "q"}, {"role": "assistant", "content": answer}]
        eot = end_of_turn_token(tokenizer, tokenizer.apply_chat_template(probe, tokenize=False), answer)
        if eot is not None:
            ids.add(tokenizer.convert_tokens_to_ids(eot))
    if not ids:
        raise EyasError("the verifier's tokenizer has no EOS token and its chat template no end-of-turn token")
    return ids


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
