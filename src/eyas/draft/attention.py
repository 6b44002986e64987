"""The draft's attention contexts: what a decoder layer's queries attend to, and the mask for it, built by the
context for the kernel it runs (so a mask in the wrong format for a kernel, a ``BlockMask`` in SDPA, cannot be
built).

- :class:`TTTContext` (training): step 0 is causal over the sequence (and within one document when rows are
  packed); step ``k`` queries attend to the step-0 keys at or before their index plus their own diagonal keys
  from steps ``1..k`` (EAGLE-3, Li et al. 2025, sec. 3.2 "training-time test").
- :class:`DraftCache` (inference): a KV cache indexed by position, rolled back by truncation after a
  verification round.

Each decoder layer keeps its own keys and values in both contexts.
"""

from __future__ import annotations

from typing import Any, Literal

import torch
import torch.nn.functional as F

AttnImpl = Literal["eager", "sdpa", "flex", "matmul"]


def default_attn_implementation(device: torch.device | str) -> AttnImpl:
    """Flex attention with a ``BlockMask`` on CUDA, SDPA with an explicit boolean mask elsewhere."""
    return "flex" if torch.device(device).type == "cuda" else "sdpa"


def decode_attn_implementation(device: torch.device | str) -> AttnImpl:
    """The draft cache's attention in decoding: two matmuls around a masked softmax (:func:`_matmul_attention`) on
    CUDA, where a speculative round of SmolLM2's draft took 0.07 ms less GPU time than with SDPA (1.45 against 1.52
    ms busy, 1.84 against 1.93 ms a round; one H100, docs/BENCHMARKS.md); SDPA elsewhere."""
    return "matmul" if torch.device(device).type == "cuda" else "sdpa"


# The most queries a "matmul" cache attention takes: its fp32 scores are [B, kv, G*T, S]; a longer block (the
# prompt's first draft step) goes through SDPA, which never holds them, so memory stays bounded by the cache.
MATMUL_MAX_QUERIES = 16


def _eager_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor, scale: float):
    """Reference attention: explicit scores, mask, fp32 softmax. q [B,h,T,d], k/v [B,h,S,d], mask [B,1,T,S]."""
    scores = torch.matmul(q.float(), k.float().transpose(-1, -2)) * scale  # [B, h, T, S]
    scores = scores.masked_fill(~mask, float("-inf"))
    return torch.matmul(torch.softmax(scores, dim=-1), v.float()).to(q.dtype)


def _matmul_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor, scale: float):
    """Decoding's attention as two batched matmuls around a masked fp32 softmax, the query heads that share a
    key head folded into the query rows (no repeated keys). q [B,h,T,d], k/v [B,kv,S,d], mask [B,1,T,S].

    Why: SDPA's memory-efficient kernel, the one that takes a mask, runs a program per block of 64 queries and
    head, each walking every key, so a draft step's one to K+1 queries against its whole cache run as a few
    programs (the draft's attention took 0.17 ms of a 1.52 ms busy round on an H100, docs/BENCHMARKS.md). As
    matmuls inside the draft's compiled step, each GEMM spreads the keys over the GPU and the mask fuses into
    the softmax. Numerically :func:`_eager_attention` (fp32 scores and softmax)."""
    B, h, T, d = q.shape
    kv, S = k.shape[1], k.shape[2]
    G = h // kv
    f = torch.promote_types(q.dtype, torch.float32)  # fp32 at least (float64 stays)
    qg = q.reshape(B, kv, G * T, d).to(f)  # [B, kv, G*T, d]: query head i reads key head i // G
    scores = torch.matmul(qg, k.to(f).transpose(-1, -2)) * scale  # [B, kv, G*T, S]
    scores = scores.view(B, kv, G, T, S).masked_fill(~mask[:, :, None], float("-inf"))  # mask [B, 1, 1, T, S]
    probs = torch.softmax(scores, dim=-1).view(B, kv, G * T, S)
    return torch.matmul(probs, v.to(f)).view(B, h, T, -1).to(q.dtype)  # [B, kv, G*T, d] -> [B, h, T, d]


def _repeat_kv(x: torch.Tensor, groups: int) -> torch.Tensor:
    # [B, kv, S, d] -> [B, kv*groups, S, d]
    return x if groups == 1 else x.repeat_interleave(groups, dim=1)


class TTTContext:
    """Keys and values of the steps run so far in training-time test, and the mask for the current step.

    Rows may be packed: ``doc_ids [B, T]`` (``-1`` for padding) keeps step-0
    attention inside one document. Key layout at step ``k``: ``k + 1`` blocks of
    ``T`` (block 0: step-0 keys, block ``j``: step-``j`` keys), so kv index
    ``j*T + s`` is step ``j``, sequence index ``s``. Query ``t`` sees block 0 at
    ``s <= t`` in its document, and blocks ``1..k`` at ``s == t`` only. Each of
    the ``num_layers`` decoder layers attends to its own keys under that one mask.

    With ``fixed_steps=S`` (the number of TTT steps) every step attends to ``S`` blocks instead, so each step
    has the same shapes and a compiled step (``eyas.training.trainer.compile_draft``) compiles once, not once a
    step: blocks ``0..k-1`` hold the earlier steps' keys, blocks ``k..S-2`` zeros (``zeros``, ``[B, kv, T, d]``)
    that no query sees, block ``S-1`` the current step's own. FlexAttention skips the unseen blocks (its block
    table lists only the visible ones), so only the dense mask pays for them.
    """

    def __init__(self, doc_ids: torch.Tensor, attn_implementation: AttnImpl, *, num_layers: int = 1,
                 fixed_steps: int | None = None, zeros: torch.Tensor | None = None) -> None:  # fmt: skip
        if fixed_steps is not None and fixed_steps > 1 and zeros is None:
            raise ValueError("fixed_steps needs the zero keys that stand for the steps not yet run")
        self.doc_ids = doc_ids
        # "matmul" is decoding's (a few queries against the cache); a whole row's TTT step through it would hold
        # its fp32 scores, [B, kv, G*T, (k+1)*T]: SDPA's kernels never do
        self.impl = "sdpa" if attn_implementation == "matmul" else attn_implementation
        self.num_layers = num_layers
        self.fixed_steps = fixed_steps
        self.zeros = zeros
        self.keys: list[list[torch.Tensor]] = []  # [step][layer] -> [B, kv, T, d]
        self.values: list[list[torch.Tensor]] = []
        self._block_masks: dict[int, Any] = {}
        self._dense: tuple[torch.Tensor, torch.Tensor] | None = None  # (causal, diagonal) blocks, [B, T, T] each
        self.step = 0  # the TTT step the next layer call belongs to

    def begin(self, step: int) -> None:
        """Start TTT step ``step``. With activation checkpointing a step is run again during backward: its
        :meth:`record` then replaces that step's keys and values (equal to the first run's) instead of
        appending, and :meth:`past` gives the same earlier steps it gave the first time."""
        if step > len(self.keys):
            raise ValueError(f"TTT step {step} begun before step {len(self.keys)}")
        self.step = step

    def _dense_mask(self, k: int) -> torch.Tensor:
        if self._dense is None:  # built once per context and shared by every step
            B, T = self.doc_ids.shape
            idx = torch.arange(T, device=self.doc_ids.device)
            same_doc = (self.doc_ids[:, :, None] == self.doc_ids[:, None, :]) & (self.doc_ids[:, :, None] >= 0)
            diag = torch.eye(T, dtype=torch.bool, device=idx.device).expand(B, T, T)
            # A padding query (doc -1) sees only itself: no fully masked row, so SDPA never yields NaN.
            causal = (same_doc & (idx[None, None, :] <= idx[None, :, None])) | diag  # [B, T, T]
            self._dense = (causal, diag)
        causal, diag = self._dense
        n = self._key_blocks(k)
        earlier = [causal] + [diag] * (k - 1) if k > 0 else []  # blocks 0..k-1: the steps before
        unseen = [torch.zeros_like(diag)] * (n - 1 - k) if n - 1 > k else []  # blocks k..n-2 (fixed_steps): zeros
        return torch.cat([*earlier, *unseen, causal if k == 0 else diag], dim=-1)[:, None]  # [B, 1, T, n*T]

    def _key_blocks(self, k: int) -> int:
        """How many blocks of T keys step ``k`` attends to: its own last, after the steps before it (and with
        ``fixed_steps``, the zeros of the steps not yet run)."""
        return self.fixed_steps or k + 1

    def _block_mask(self, k: int):
        from torch.nn.attention.flex_attention import create_block_mask

        if k not in self._block_masks:
            B, T = self.doc_ids.shape
            docs = self.doc_ids

            last = self._key_blocks(k) - 1
            # the step as a tensor the mask reads, not a constant it is built for: with fixed_steps, one compile
            # for every step
            current = torch.full((), k, dtype=torch.long, device=docs.device)

            def mask_mod(b, h, q_idx, kv_idx):
                block, s = kv_idx // T, kv_idx % T
                step = torch.where(block == last, current, block)  # whose keys: the last block is this step's
                causal = ((s <= q_idx) & (docs[b, s] == docs[b, q_idx]) & (docs[b, q_idx] >= 0)) | (s == q_idx)
                # blocks between the earlier steps' and this step's (fixed_steps' zeros) are seen by no query
                return torch.where(step == 0, causal, s == q_idx) & ((block < current) | (block == last))

            kv_len = (last + 1) * T
            # Compiled, create_block_mask builds the mask block by block in one fused kernel instead of
            # materialising [B, T, (k+1)T] booleans; torch >= 2.11 deprecates its `_compile` flag for this.
            build = _compiled_create_block_mask() if docs.device.type == "cuda" else create_block_mask
            self._block_masks[k] = build(mask_mod, B, None, T, kv_len, device=docs.device)
        return self._block_masks[k]

    def past(self) -> tuple[list[list[torch.Tensor]], list[list[torch.Tensor]]]:
        """Per layer, the keys and values ``[B, kv, T, d]`` of the steps before the current one (with
        ``fixed_steps``, then zeros for the steps after it: ``S - 1`` in all)."""
        keys = [[step[i] for step in self.keys[: self.step]] for i in range(self.num_layers)]
        values = [[step[i] for step in self.values[: self.step]] for i in range(self.num_layers)]
        if self.fixed_steps is not None:  # the steps not yet run as zeros, which the mask hides
            # each its own tensor, and needing a gradient when the real ones do: a compiled step guards on its
            # inputs' aliasing and requires_grad, and would compile again for each step's pattern of them
            def unseen():
                return [self.zeros.clone().requires_grad_(torch.is_grad_enabled())
                        for _ in range(self.fixed_steps - 1 - self.step)]  # fmt: skip

            keys, values = [k + unseen() for k in keys], [v + unseen() for v in values]
        return keys, values

    def mask(self):
        """The current step's mask, in the format its attention takes: a ``BlockMask`` for flex, a dense
        ``[B, 1, T, (step+1)*T]`` boolean otherwise (``[B, 1, T, S*T]`` with ``fixed_steps``)."""
        return self._block_mask(self.step) if self.impl == "flex" else self._dense_mask(self.step)

    def record(self, keys: list[torch.Tensor], values: list[torch.Tensor]) -> None:
        """Keep the current step's keys and values ``[B, kv, T, d]`` (one per layer) for the steps after it."""
        del self.keys[self.step :], self.values[self.step :]  # a recomputed step drops its first run's (equal) keys
        if self.fixed_steps is not None:
            # in the zeros' (contiguous) layout: a compiled step guards on its inputs' strides, and its outputs'
            # are inductor's choice (a size-1 batch dimension's stride included)
            keys = [k.clone(memory_format=torch.contiguous_format) for k in keys]
            values = [v.clone(memory_format=torch.contiguous_format) for v in values]
        self.keys.append(list(keys))
        self.values.append(list(values))


def masked_attention(q: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, mask, scale: float,
                     impl: AttnImpl) -> torch.Tensor:  # fmt: skip
    """Attention under a context's mask, in the context's implementation. q [B,h,T,d]; keys/values [B,kv,S,d];
    ``mask``: a ``BlockMask`` for flex, a dense ``[B, 1, T, S]`` boolean otherwise. Returns [B,h,T,d]."""
    groups = q.shape[1] // keys.shape[1]
    if impl == "matmul":
        return _matmul_attention(q, keys, values, mask, scale)
    if impl == "flex":
        return _flex_attention(q, keys, values, block_mask=mask, scale=scale, enable_gqa=groups > 1)
    keys, values = _repeat_kv(keys, groups), _repeat_kv(values, groups)
    if impl == "eager":
        return _eager_attention(q, keys, values, mask, scale)
    return F.scaled_dot_product_attention(q, keys, values, attn_mask=mask, scale=scale)


_compiled_flex = None
_compiled_block_mask = None


def _compiled_create_block_mask():
    """``torch.compile(create_block_mask)``, built once per process."""
    global _compiled_block_mask
    if _compiled_block_mask is None:
        from torch.nn.attention.flex_attention import create_block_mask

        _compiled_block_mask = torch.compile(create_block_mask)
    return _compiled_block_mask


def _flex_attention(q, k, v, **kwargs):
    """flex_attention compiled once per process (uncompiled it materialises the scores); inside a compiled
    region (the training layer) it is traced as part of that region."""
    if torch.compiler.is_compiling():
        from torch.nn.attention.flex_attention import flex_attention

        return flex_attention(q, k, v, **kwargs)
    global _compiled_flex
    if _compiled_flex is None:
        from torch.nn.attention.flex_attention import flex_attention

        _compiled_flex = torch.compile(flex_attention, dynamic=False)
    return _compiled_flex(q, k, v, **kwargs)


class DraftCache:
    """Inference KV cache indexed by position: slot ``p`` holds the key of position ``p``.

    A query at position ``p`` sees every valid slot ``<= p``. After a
    verification round, :meth:`truncate` drops rejected positions; accepted
    ones are then recomputed from the verifier's hidden states (as vLLM does),
    simply by running :meth:`Eagle3Draft.step` over them again. ``k``/``v``
    hold every decoder layer's slots, ``[B, num_layers * kv, max_len, d]``:
    layer ``i``'s heads are ``i*kv .. (i+1)*kv - 1``, so dim 2 is the position
    whatever the layer count.
    """

    def __init__(self, *, batch_size: int, max_len: int, num_kv_heads: int, head_dim: int,
                 device: torch.device | str = "cpu", dtype: torch.dtype = torch.float32,
                 attn_implementation: AttnImpl = "sdpa", num_layers: int = 1) -> None:  # fmt: skip
        if attn_implementation == "flex":
            attn_implementation = "sdpa"  # decoding a few tokens: a dense mask is cheaper than a BlockMask
        # "matmul" (_matmul_attention) reads the whole cache as SDPA does, in GEMMs spread over the keys
        self.impl = attn_implementation
        self.num_kv_heads = num_kv_heads
        shape = (batch_size, num_layers * num_kv_heads, max_len, head_dim)
        self.k = torch.zeros(shape, device=device, dtype=dtype)
        self.v = torch.zeros(shape, device=device, dtype=dtype)
        self.valid = torch.zeros(batch_size, max_len, dtype=torch.bool, device=device)

    @property
    def max_len(self) -> int:
        return self.k.shape[2]

    def truncate(self, lengths: torch.Tensor | int) -> None:
        """Forget every position ``>= lengths`` (per row)."""
        if isinstance(lengths, int):  # one length for all rows: a slice, not a host->device copy (a stream sync)
            self.valid[:, lengths:] = False
            return
        lengths = torch.as_tensor(lengths, device=self.valid.device).reshape(-1, 1)
        slots = torch.arange(self.max_len, device=self.valid.device)
        self.valid &= slots[None, :] < lengths

    def attend(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float,
               position_ids: torch.Tensor, *, layer: int = 0) -> torch.Tensor:  # fmt: skip
        """Write decoder layer ``layer``'s k/v ``[B,kv,T,d]`` into the slots of ``position_ids [B,T]``; attend to
        every valid slot of that layer at or before each query's position."""
        pos = position_ids
        # The bound check reads a device value (once per step: every layer writes the same positions); a compiled
        # or graph-captured decoding loop sizes its cache itself and skips it.
        checked = layer == 0 and not torch.compiler.is_compiling()
        if (
            checked
            and not (pos.is_cuda and torch.cuda.is_current_stream_capturing())
            and int(pos.max()) >= self.max_len
        ):
            raise ValueError(f"positions exceed the draft cache of {self.max_len} slots")
        B, _, T, _ = k.shape
        rows = torch.arange(B, device=pos.device)[:, None].expand(B, T)
        heads = slice(layer * self.num_kv_heads, (layer + 1) * self.num_kv_heads)
        keys, values = self.k[:, heads], self.v[:, heads]  # [B, kv, S, d] views: writes land in the cache
        keys[rows, :, pos] = k.transpose(1, 2).to(keys.dtype)  # [B, T, kv, d] into slots
        values[rows, :, pos] = v.transpose(1, 2).to(values.dtype)
        # shared by the layers (every layer writes the same positions); a device scalar, not a host one: a CUDA graph
        # cannot record a copy from pageable host memory
        self.valid[rows, pos] = torch.ones((), dtype=torch.bool, device=pos.device)
        slots = torch.arange(self.max_len, device=pos.device)
        mask = (self.valid[:, None, :] & (slots[None, None, :] <= pos[:, :, None]))[:, None]  # [B,1,T,S]
        impl = "sdpa" if self.impl == "matmul" and T > MATMUL_MAX_QUERIES else self.impl
        return masked_attention(q, keys.to(q.dtype), values.to(q.dtype), mask, scale, impl)
