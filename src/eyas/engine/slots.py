"""Per-sequence key/value *slots* and the attention that reads and writes them, plugged into transformers'
models through its ``AttentionInterface`` (the documented way to plug one in; the model, its weights, RoPE,
norms, MoE and head stay transformers').

A slot is one row of ``[slots, kv_heads, capacity, head_dim]`` buffers per decoder layer. Each sequence keeps
its own position, so a finished answer's slot takes the next request at once (continuous batching), and rolling
a sequence back is moving its position. The decoders of :mod:`eyas.engine.generate` drive them.
"""

from __future__ import annotations

import contextlib
import functools
import inspect
from collections.abc import Iterator
from typing import Any, NamedTuple

import torch
import torch.nn.functional as F

from eyas.core.errors import EyasError, brief

#: The name the slot attention is registered under in transformers' AttentionInterface.
ATTENTION = "eyas_slots"

#: The key lengths decoding graphs are recorded for: a step attends to the smallest one that covers every
#: sequence (steps of about 1.5x keep the number of graphs small and the wasted keys under a third).
KEY_BUCKETS = (64, 128, 192, 256, 384, 512, 768, 1024, 1536, 2048, 3072, 4096, 6144, 8192, 12288, 16384)


#: The key block of the flex attention (FlexAttention's default block size).
FLEX_BLOCK = 128
#: The most new tokens a row may feed for a forward to go through FlexAttention (one query block).
FLEX_MAX_NEW = 16
#: Query rows below which inductor runs FlexAttention through its split-key decoding kernel
#: (``_use_flex_decoding``): the grouped query heads are folded into the query length only below it.
FLEX_DECODE_ROWS = 128


def key_bucket(n: int, capacity: int) -> int:
    """The smallest key length of :data:`KEY_BUCKETS` (or a multiple of the largest) covering ``n``, at most
    ``capacity``."""
    for b in KEY_BUCKETS:
        if b >= n:
            return min(b, capacity)
    top = KEY_BUCKETS[-1]
    return min(-(-n // top) * top, capacity)


# --------------------------------------------------------------------------- key/value slots and the attention


class LayerShape(NamedTuple):
    """What one decoder layer's attention stores and how it attends (read off a forward: :func:`layer_shapes`)."""

    kv_heads: int
    key_dim: int
    value_dim: int
    device: torch.device
    groups: int = 1  # query heads per key head (grouped-query attention)
    window: int | None = None  # the sliding window, if the layer has one


class Slots:
    """Key/value buffers for ``slots`` sequences of at most ``capacity`` positions, one pair per layer, plus
    what the next forward needs to know: where each row's new tokens go.

    A forward runs in one of two layouts:

    - ``rows``: input ``[S, T]``, row ``s`` feeding ``T`` new tokens at positions ``start[s] .. start[s]+T-1``
      into slot ``s``; each query sees its slot's keys up to its own position (decoding, verification, and a
      single sequence's prompt). ``S`` may be less than ``slots``: the forward is then over the first ``S``
      slots only (a batched step replays a graph of as many rows as its busy slots need);
    - ``packed``: input ``[1, B * Tp]``, ``B`` prompts right-padded to ``Tp`` tokens, prompt ``b`` filling slot
      ``targets[b]`` from position 0 (prefill of new requests; causal within each prompt).
    """

    def __init__(self, *, slots: int, capacity: int, layers: list[LayerShape], dtype: torch.dtype,
                 device: torch.device, attention: str = "auto") -> None:  # fmt: skip
        if attention not in ("auto", "sdpa", "flex"):
            raise EyasError(f"the slot attention is auto, sdpa or flex, got {attention!r}")
        if attention == "auto":  # flex where it compiles to a fused kernel (decoding 1.2x faster: BENCHMARKS.md)
            attention = "flex" if torch.device(device).type == "cuda" else "sdpa"
        self.num_slots, self.capacity, self.attention = slots, capacity, attention
        # a layer's slots live where it runs (a device map spreads layers over GPUs); flex reads whole key blocks,
        # so the buffers are rounded up to one (the positions past the capacity are never visible)
        layers = [LayerShape(*x) for x in layers]
        alloc = -(-capacity // FLEX_BLOCK) * FLEX_BLOCK if attention == "flex" else capacity
        self.k = [torch.zeros(slots, x.kv_heads, alloc, x.key_dim, dtype=dtype, device=x.device) for x in layers]
        self.v = [torch.zeros(slots, x.kv_heads, alloc, x.value_dim, dtype=dtype, device=x.device) for x in layers]
        self.alloc = alloc
        self.kinds = sorted({(x.groups, x.window) for x in layers}, key=str)  # the block masks a forward needs
        self.rows = torch.arange(slots, device=device)
        self.layout = "rows"
        self.start = torch.zeros(slots, dtype=torch.long, device=device)  # rows layout: first new position
        # FlexAttention runs where a layer's slots live with the positions (a device map's other GPUs: SDPA)
        self._flex_everywhere = all(torch.device(x.device) == self.start.device for x in layers)
        self.keys = capacity  # rows layout: key length attended (>= every query's position + 1; key_length)
        self.targets: torch.Tensor | None = None  # packed layout: the slot of each prompt [B]
        self.prompt_len = 0  # packed layout: Tp
        self._masks: dict[Any, Any] = {}
        self._moved: dict[tuple[int, torch.device], torch.Tensor] = {}
        self._pos: torch.Tensor | None = None
        self.flex_masks: dict[tuple[int, int | None], Any] = {}  # this forward's, by (groups, window): begin()
        self._constants: dict[tuple[int, int, torch.dtype], torch.Tensor] = {}  # _arange's, kept across forwards

    def flex_runs(self, new: int) -> bool:
        """Whether a rows-layout forward of ``new`` tokens a row attends through FlexAttention."""
        return self.attention == "flex" and new <= FLEX_MAX_NEW and self._flex_everywhere

    def key_length(self, n: int, new: int = 1) -> int:
        """The key length a rows-layout forward of ``new`` tokens a row attends when its queries reach position
        ``n - 1``: what ``keys`` is set to before the forward, and what its CUDA graph is recorded for.

        Through FlexAttention the whole buffer, whatever ``n``: its block table lists each row's live key blocks
        and its decoding kernel divides those blocks, not the key length, among its programs
        (``TILE_KV_OG`` in torch/_inductor/kernel/flex/templates/flex_decode.py.jinja), so attending the whole
        buffer reads what a shorter length reads, and one graph (and one compiled kernel) serves every position
        instead of one per bucket. Through SDPA, which reads every key it is given, the bucket covering ``n``."""
        if self.flex_runs(new):
            return self.alloc
        return key_bucket(n, self.capacity)

    @staticmethod
    def bytes_per_token(layers: list[tuple[int, int, int, torch.device]], dtype: torch.dtype) -> int:
        """Key and value bytes one position of one sequence holds over all layers."""
        return sum(x[0] * (x[1] + x[2]) for x in layers) * torch.finfo(dtype).bits // 8

    def begin(self, T: int | None = None, S: int | None = None) -> None:
        """Before each forward: masks (and index tensors other devices need) are built once per forward, on
        first use. Given the rows layout's new tokens a row ``T`` and rows ``S`` (default all), the write
        positions and FlexAttention's block masks are built here, before the first layer: a compiled layer
        then reads them (:func:`_attention` traced into the layer's compiled code) instead of building them."""
        self._masks, self._moved, self._pos, self.flex_masks = {}, {}, None, {}
        if T is None or self.layout != "rows":
            return
        S = self.num_slots if S is None else S
        self._positions(T, S)
        if self.flex_runs(T):
            for G, window in self.kinds:
                self.flex_masks[(G, window)] = self._block_mask(T, window, G if G * T < FLEX_DECODE_ROWS else 1, S)

    def _positions(self, T: int, S: int) -> torch.Tensor:
        """rows layout: ``[S, T]`` the slot position each new token of the first ``S`` rows is written to (built
        once per forward, not once per layer: three small kernels a layer are 90 kernel launches a step on a
        30-layer model)."""
        if self._pos is None or self._pos.shape != (S, T):
            start = self.start[:S]
            self._pos = (start[:, None] + self._arange(T)).clamp(max=self.capacity - 1)
        return self._pos

    def _arange(self, n: int, rows: int = 0, dtype: torch.dtype = torch.long) -> torch.Tensor:
        """``arange(n)`` on the slots' device (with ``rows``, ``[rows, 1, 1, n]`` copies of it), made once: a
        forward's index tensors that do not depend on the positions are not remade (a kernel or two each) at
        every decoding step."""
        key = (n, rows, dtype)
        if key not in self._constants:
            t = torch.arange(n, dtype=dtype, device=self.start.device)
            self._constants[key] = t.repeat(rows, 1, 1, 1) if rows else t
        return self._constants[key]

    def on(self, t: torch.Tensor, device: torch.device) -> torch.Tensor:
        """``t`` on ``device``, copied there at most once per forward (the layers of a device map)."""
        if t.device == device:
            return t
        key = (id(t), device)
        if key not in self._moved:
            self._moved[key] = t.to(device)
        return self._moved[key]

    def _mask(self, T: int, window: int | None, G: int = 1, dtype: torch.dtype | None = None,
              S: int | None = None) -> torch.Tensor:  # fmt: skip
        """rows layout, the first ``S`` rows (default all): ``[S, 1, G*T, keys]``, key ``j`` visible to new token ``t`` of row ``s`` (query row
        ``g*T + t``: grouped-query attention, see :func:`_attention`) when ``j <= start[s] + t`` (and, with a
        sliding window ``W``, ``j > start[s] + t - W``, transformers' ``sliding_window_overlay``). Bool, or
        with ``dtype`` additive (0 / -inf: what SDPA turns a bool mask into in every call, here once per
        forward for all layers)."""
        S = self.num_slots if S is None else S
        key = (T, window, G, dtype, S)
        if key not in self._masks:
            j = torch.arange(self.keys, device=self.start.device)
            q = self.start[:S, None] + torch.arange(T, device=self.start.device)  # [S, T]
            m = j[None, None, :] <= q[:, :, None]  # [S, T, keys]
            if window is not None:
                m = m & (j[None, None, :] > q[:, :, None] - window)
            m = m[:, None, None].expand(-1, 1, G, T, self.keys).reshape(-1, 1, G * T, self.keys)
            if dtype is not None:
                m = torch.zeros(m.shape, dtype=dtype, device=m.device).masked_fill_(~m, float("-inf"))
            self._masks[key] = m
        return self._masks[key]

    def _block_mask(self, T: int, window: int | None, G: int = 1, S: int | None = None):
        """rows layout, for FlexAttention (the first ``S`` rows, default all): a block table listing, per row, the key blocks up to its last new
        token (the keys it can see), so attention reads each row's live keys only, not the whole key length of
        the step; within a block the mask of :meth:`_mask`, over ``G*T`` query rows (row ``g*T + t`` is new
        token ``t``: the grouped query heads folded into the query length, see :func:`_attention`). Built from
        ``start`` on the device (it records into a graph and follows the positions at each replay)."""
        from torch.nn.attention.flex_attention import BlockMask

        S = self.num_slots if S is None else S
        key = ("flex", T, window, G, S)
        if key not in self._masks:
            start = self.start[:S]
            n = -(-self.keys // FLEX_BLOCK) * FLEX_BLOCK
            nb = n // FLEX_BLOCK
            live = ((start + T - 1) // FLEX_BLOCK + 1).clamp(1, nb).to(torch.int32)  # [S] blocks a row reads
            table = self._arange(nb, S, torch.int32)  # [S, 1, 1, nb]: each row's blocks in order

            def mask_mod(b, h, q_idx, kv_idx):
                p = start[b] + q_idx % T
                ok = kv_idx <= p
                if window is not None:
                    ok = ok & (kv_idx > p - window)
                return ok

            extra = {}
            if "compute_q_blocks" in inspect.signature(BlockMask.from_kv_blocks).parameters:
                extra["compute_q_blocks"] = False  # only a backward pass reads them
            self._masks[key] = (
                BlockMask.from_kv_blocks(
                    live[:, None, None],
                    table,
                    BLOCK_SIZE=FLEX_BLOCK,
                    mask_mod=mask_mod,
                    seq_lengths=(G * T, n),
                    **extra,
                ),
                n,
            )
        return self._masks[key]


#: The slots the registered attention reads and writes during a forward (set by :func:`slot_attention`).
_ACTIVE: Slots | None = None


def _attention(module, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, attention_mask,
               scaling: float | None = None, dropout: float = 0.0, sliding_window: int | None = None,
               softcap: float | None = None, **kwargs: Any) -> tuple[torch.Tensor, None]:  # fmt: skip
    """transformers' attention-function interface: ``query [B, H, T, dk]`` and ``key [B, kvh, T, dk]``,
    ``value [B, kvh, T, dv]`` (RoPE applied) of the new tokens -> ``[B, T, H, dv]``. Writes the new keys and
    values into their slots and attends to the slot's keys (see :class:`Slots`).

    Inside a compiled decoder layer (:func:`eyas.verifier.compile.compiled_layers`) a decoding or verification
    forward through FlexAttention is traced into the layer's compiled code: the key/value writes fuse with RoPE
    and the attention with the projections around it, one region a layer instead of two with the attention
    between them (about 6 kernels a layer fewer). That code does not depend on the position: the key length is
    the whole buffer (:meth:`Slots.key_length`), the layer's buffers are attributes of its attention module (so
    every layer shares one compiled version), and the write positions and block masks were built before the
    first layer (:meth:`Slots.begin`). Every other forward (prompts, SDPA's key buckets) runs eagerly, a graph
    break."""
    slots = _ACTIVE
    if torch.compiler.is_compiling():
        G = query.shape[1] // key.shape[1]
        if (slots is not None and slots.layout == "rows" and kwargs.get("s_aux") is None
                and (G, sliding_window) in slots.flex_masks and hasattr(module, "_eyas_k")):  # fmt: skip
            K, V = module._eyas_k, module._eyas_v
            _write_rows(slots, K, V, key, value)
            return _flex_rows(_flex_traced(), slots.flex_masks[(G, sliding_window)], query, K, V,
                              scaling=scaling, score_mod=_softcap_score_mod(softcap)), None  # fmt: skip
    return _eager_attention(module, query, key, value, attention_mask, scaling=scaling, sliding_window=sliding_window,
                            softcap=softcap, **kwargs)  # fmt: skip


@torch.compiler.disable  # its Python reads the slots' current layout and key length: a graph break when traced
def _eager_attention(module, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, attention_mask,
                     scaling: float | None = None, sliding_window: int | None = None, softcap: float | None = None,
                     **kwargs: Any) -> tuple[torch.Tensor, None]:  # fmt: skip
    """:func:`_attention` run by Python: any layout, FlexAttention or SDPA."""
    slots = _ACTIVE
    if slots is None:
        raise EyasError("internal: the eyas slot attention ran outside eyas.engine.slots.slot_attention")
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
        # a tensor of its own, not a view: a compiled prefill's layer resumes with it, and a view's base sizes
        # would be guarded (B = 1 against B > 1), a compile each
        packed = out.new_empty(1, B * Tp, H, out.shape[-1])
        packed.view(B, Tp, H, -1).copy_(out.transpose(1, 2))
        return packed, None
    S, _, T, _ = query.shape  # S <= slots.num_slots: the forward runs over the first S slots
    _write_rows(slots, K, V, key, value)
    n = slots.keys
    # decoding and verification (a few new tokens a row) through FlexAttention; a prompt's forward (any length:
    # one compile each) through SDPA
    if slots.attention == "flex" and T <= FLEX_MAX_NEW and K.device == slots.start.device:
        fold = G * T < FLEX_DECODE_ROWS
        masks = slots.flex_masks.get((G, sliding_window)) or slots._block_mask(T, sliding_window, G if fold else 1, S)
        try:
            return _flex_rows(_flex(), masks, query, K, V, scaling=scaling, score_mod=_softcap_mod(softcap)), None
        except Exception as e:  # a compiler error: the SDPA path from then on, after one note
            import sys

            print(f"eyas: slot attention through SDPA, FlexAttention failed ({brief(e)})", file=sys.stderr)
            slots.attention = "sdpa"
    # SDPA takes a bool mask as is only where softcap is written out; elsewhere an additive one, built once
    dtype = None if softcap is not None else query.dtype
    mask = slots.on(slots._mask(T, sliding_window, G, dtype, S), K.device)  # [S, 1, G*T, n]
    # Grouped-query attention without copying keys: the G query heads that share a key head become G*T query
    # rows of it ([S, H, T, d] -> [S, kvh, G*T, d]), each row g*T + t with the mask of token t.
    q = query.reshape(S, kvh, G * T, -1)
    out = _sdpa(
        q, K[:S, :, :n].to(q.dtype), V[:S, :, :n].to(q.dtype), mask=mask, causal=False, scale=scaling, softcap=softcap
    )  # [S, kvh, G*T, dv]
    return out.reshape(S, H, T, -1).transpose(1, 2), None


def _write_rows(slots: Slots, K: torch.Tensor, V: torch.Tensor, key: torch.Tensor, value: torch.Tensor) -> None:
    """rows layout: the new keys ``[S, kvh, T, dk]`` and values of the first ``S`` rows into their slots, at the
    positions :meth:`Slots.begin` built (in place: traced, inductor writes into the buffers, no copy of them)."""
    S, _, T, _ = key.shape
    pos = slots.on(slots._positions(T, S), K.device)  # [S, T]
    if slots.num_slots == 1:  # one sequence (eval): a plain copy along the positions, one kernel
        K.index_copy_(2, pos[0], key.to(K.dtype))
        V.index_copy_(2, pos[0], value.to(V.dtype))
    else:
        rows = slots.on(slots.rows[:S], K.device)  # [S]
        K[rows[:, None], :, pos] = key.transpose(1, 2).to(K.dtype)  # [S, T, kvh, dk] into the slots
        V[rows[:, None], :, pos] = value.transpose(1, 2).to(V.dtype)


def _flex_rows(flex, masks, query: torch.Tensor, K: torch.Tensor, V: torch.Tensor, *, scaling: float | None,
               score_mod) -> torch.Tensor:  # fmt: skip
    """rows layout through FlexAttention: ``query [S, H, T, dk]`` over the first ``S`` slots of ``K``, ``V``
    with ``masks`` (:meth:`Slots._block_mask`: the block mask and its key length) -> ``[S, T, H, dv]``.

    The G query heads that share a key head are folded into the query length where the mask was built so
    (``[S, H, T, d] -> [S, kvh, G*T, d]``, as for SDPA): inductor's split-key decoding kernel takes grouped-query
    attention only at a power-of-two G (torch/_inductor/kernel/flex/flex_decoding.py, ``_use_flex_decoding``)
    and otherwise falls back to its prefill kernel, which tiles the one query row a head has into a block of 128
    (SmolLM2, G = 3: 2.4x slower than SDPA per batched step, bench/decode_profile.py --batched)."""
    block_mask, nf = masks
    S, H, T, _ = query.shape
    kvh = K.shape[1]
    G = H // kvh
    fold = block_mask.seq_lengths[0] == G * T and G > 1
    q = query.reshape(S, kvh, G * T, -1) if fold else query
    out = flex(q, K[:S, :, :nf].to(query.dtype), V[:S, :, :nf].to(query.dtype), block_mask=block_mask,
               score_mod=score_mod, scale=scaling, enable_gqa=G > 1 and not fold)  # fmt: skip  # [S, kvh, G*T, dv] / [S, H, T, dv]
    return out.reshape(S, H, T, -1).transpose(1, 2)


def _flex_traced():
    """torch's ``flex_attention`` itself: what a traced forward calls (the layer's compile compiles it)."""
    from torch.nn.attention.flex_attention import flex_attention

    return flex_attention


@functools.cache
def _flex():
    """FlexAttention (torch's block-sparse attention: a decoding kernel that splits the keys, reading only the
    blocks a row's table lists), compiled on CUDA; elsewhere its reference implementation."""
    from torch.nn.attention.flex_attention import flex_attention

    if not torch.cuda.is_available():
        return flex_attention
    cfg = torch._dynamo.config
    for name in ("recompile_limit", "cache_size_limit"):  # a shape per (new tokens, rows) before it turns dynamic
        if hasattr(cfg, name):
            setattr(cfg, name, max(getattr(cfg, name), 64))
    # shapes left to torch.compile's default: the key length is always the whole buffer (Slots.key_length); the
    # row count, which a batched step varies, is made dynamic at its first change instead of a compile each
    return torch.compile(flex_attention)


def _softcap_score_mod(softcap: float | None):
    """FlexAttention's ``score_mod`` for Gemma-2's ``attn_logit_softcapping`` (``c * tanh(s / c)`` on the scaled
    scores, as transformers' eager attention does); None without it."""
    if softcap is None:
        return None

    def score_mod(score, b, h, q_idx, kv_idx):
        return softcap * torch.tanh(score / softcap)

    return score_mod


#: :func:`_softcap_score_mod`, one function per cap: the separately compiled FlexAttention of an eager forward
#: then sees the same ``score_mod`` at every call and compiles once (a traced forward makes its own)
_softcap_mod = functools.cache(_softcap_score_mod)


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

    # traced by torch.compile only where it decodes through FlexAttention (see _attention); eager elsewhere
    AttentionInterface.register(ATTENTION, _attention)


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
    # each attention module holds its own layer's buffers, which a compiled layer reads as inputs: read through
    # the layer index instead, the index would be a constant of the compiled code, a compile per layer
    tagged = [m for m in model.modules() if isinstance(getattr(m, "layer_idx", None), int)
              and 0 <= m.layer_idx < len(slots.k)]  # fmt: skip
    for m in tagged:
        m._eyas_k, m._eyas_v = slots.k[m.layer_idx], slots.v[m.layer_idx]
    _ACTIVE = slots
    try:
        yield
    finally:
        _ACTIVE = None
        for m in tagged:
            m.__dict__.pop("_eyas_k", None)
            m.__dict__.pop("_eyas_v", None)
        model.set_attn_implementation(before)


def layer_shapes(model) -> list[LayerShape]:
    """Each decoder layer's :class:`LayerShape`, read off one forward of one token (so every attention variant
    transformers implements, MLA's wider keys included, is sized by what it really stores, and placed where a
    device map runs the layer)."""
    seen: dict[int, LayerShape] = {}

    def probe(module, query, key, value, attention_mask, **kwargs):
        seen[module.layer_idx] = LayerShape(key.shape[1], key.shape[-1], value.shape[-1], key.device,
                                            query.shape[1] // key.shape[1], kwargs.get("sliding_window"))  # fmt: skip
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
