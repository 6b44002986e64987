"""The EAGLE-3 draft: architecture only.

Geometry and weight names follow speculators' ``eagle3`` model, which vLLM
loads as is (``vllm/model_executor/models/llama_eagle3.py``)::

    fc            Linear(3*H_target -> H)     over the concatenated aux states
    layers.0      a Llama decoder layer whose q/k/v take 2H:
                  [input_layernorm(embed(token)), hidden_norm(hidden)]
    layers.1..    optional further decoder layers over the previous layer's output (q/k/v take H)
    norm          RMSNorm(H)
    lm_head       Linear(H -> draft_vocab)    initialised from the verifier head's draft-vocab rows
    embed_tokens  frozen copy of the verifier's embedding (vLLM shares the verifier's when absent)
    d2t, t2d      vocab maps: target_id = draft_id + d2t[draft_id]; t2d[target_id] is in the draft vocab

One function, :meth:`Eagle3Draft.step`, is the draft's forward for both
training-time test (TTT) and inference: what training optimises is exactly
what ``eyas eval`` measures. The key/value *context* it attends to is the only
difference, and the context object owns its mask (:mod:`eyas.draft.attention`:
:class:`~eyas.draft.attention.TTTContext` in training, :class:`~eyas.draft.attention.DraftCache`
at inference).

Variants that vLLM and SGLang serve (off by default: the plain EAGLE-3 layout loads everywhere):
``norm_before_residual``, ``norm_before_fc``, ``fc_norm`` and ``norm_output`` (EAGLE-3.1, speculators
#610/#670, vLLM #42764), a Qwen3-style layer (``draft_arch="qwen3"``: RMSNorm over each query and key head
before RoPE, vLLM #43132) and more than one decoder layer (vLLM #26164). Which engine release serves which
is :mod:`eyas.stages.export`'s business.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import asdict, dataclass, field, fields
from typing import Any, Literal

import torch
import torch.nn.functional as F
from torch import nn

from eyas.draft.attention import AttnImpl, DraftCache, TTTContext, masked_attention
from eyas.verifier.info import check_aux_layer_ids


@dataclass
class DraftConfig:
    """The draft's geometry and layout flags (names as in transformers' ``LlamaConfig`` and vLLM)."""

    hidden_size: int
    intermediate_size: int
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    vocab_size: int  # the verifier's (padded) vocab: rows of embed_tokens, length of t2d
    draft_vocab_size: int
    aux_layer_ids: list[int]
    target_hidden_size: int | None = None  # the verifier's hidden size, when it differs from the draft's
    rms_norm_eps: float = 1e-6
    rope_parameters: dict[str, Any] = field(default_factory=lambda: {"rope_type": "default", "rope_theta": 10000.0})
    max_position_embeddings: int = 8192
    hidden_act: str = "silu"
    initializer_range: float = 0.02
    # Layout flags, all written explicitly to config.json (vLLM's parser defaults a missing
    # norm_before_residual to true; SGLang always uses the un-normed residual). The plain EAGLE-3 layout that
    # every vLLM and SGLang release loads is all-false.
    norm_before_residual: bool = False  # residual = hidden_norm(h) instead of h (speculators' default: true)
    norm_before_fc: bool = False  # RMSNorm (`input_norm`) over the concatenated aux states before fc
    fc_norm: bool = False  # an RMSNorm (`fc_norm.i`) over each aux state before fc (the EAGLE-3.1 paper's)
    norm_output: bool = False  # feed the *normed* output to the next step (speculators' "Eagle 3.1")
    # The decoder layer: "llama", or "qwen3" (q_norm/k_norm: RMSNorm over each head of q and k before RoPE,
    # speculators' --draft-arch qwen3), and how many (speculators' --num-layers, transformers' name).
    draft_arch: Literal["llama", "qwen3"] = "llama"
    num_hidden_layers: int = 1

    def __post_init__(self) -> None:
        self.aux_layer_ids = check_aux_layer_ids(self.aux_layer_ids, what="aux_layer_ids")  # ascending
        if self.norm_before_fc and self.fc_norm:  # one norm over the concatenation, or one per state: not both
            raise ValueError("norm_before_fc and fc_norm exclude each other (speculators' Eagle3SpeculatorConfig)")
        if self.draft_arch not in ("llama", "qwen3"):
            raise ValueError(f"draft_arch must be 'llama' or 'qwen3', got {self.draft_arch!r}")
        if int(self.num_hidden_layers) < 1:
            raise ValueError(f"num_hidden_layers must be at least 1, got {self.num_hidden_layers}")
        self.num_hidden_layers = int(self.num_hidden_layers)
        if self.num_attention_heads % self.num_key_value_heads:
            raise ValueError("num_attention_heads must be a multiple of num_key_value_heads")
        if self.draft_vocab_size > self.vocab_size:
            raise ValueError(f"draft_vocab_size {self.draft_vocab_size} exceeds the verifier vocab {self.vocab_size}")

    @property
    def fc_in_features(self) -> int:
        return 3 * (self.target_hidden_size or self.hidden_size)

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> "DraftConfig":
        names = {f.name for f in fields(cls)}
        return cls(**{k: v for k, v in d.items() if k in names})

    def llama_config(self):
        """The decoder layer as a transformers ``LlamaConfig`` (for RoPE, and speculators' ``transformer_layer_config``)."""
        from transformers import LlamaConfig

        return LlamaConfig(
            vocab_size=self.vocab_size,
            hidden_size=self.hidden_size,
            intermediate_size=self.intermediate_size,
            num_hidden_layers=1,
            num_attention_heads=self.num_attention_heads,
            num_key_value_heads=self.num_key_value_heads,
            head_dim=self.head_dim,
            hidden_act=self.hidden_act,
            max_position_embeddings=self.max_position_embeddings,
            rms_norm_eps=self.rms_norm_eps,
            rope_parameters=dict(self.rope_parameters),
            initializer_range=self.initializer_range,
            tie_word_embeddings=False,
            attention_bias=False,
            mlp_bias=False,
        )

    @classmethod
    def from_verifier(cls, text_config: dict[str, Any], *, draft_vocab_size: int, aux_layer_ids: list[int],
                      **overrides: Any) -> "DraftConfig":  # fmt: skip
        """Derive the draft layer's shape from the verifier's text config.

        Attention heads, KV heads, MLP width, RoPE and norm epsilon follow the
        verifier. An MLA verifier (DeepseekV3, Kimi-K2.5) has no ordinary head
        geometry to copy (its ``qk_rope_head_dim`` is a RoPE slice, not a head),
        so the draft gets plain GQA: ``head_dim = H / heads`` and 8 KV heads
        (as community Kimi-K2 drafts use: 64 query / 8 KV heads). Anything can be
        overridden.
        """
        tc = text_config
        H = int(tc["hidden_size"])
        heads = int(tc["num_attention_heads"])
        mla = "kv_lora_rank" in tc or "qk_rope_head_dim" in tc
        if mla:
            head_dim = H // heads
            kv = 8 if heads % 8 == 0 and heads > 8 else heads
        else:
            head_dim = int(tc.get("head_dim") or H // heads)
            kv = int(tc.get("num_key_value_heads") or heads)
        rope = dict(tc.get("rope_parameters") or {})
        if not rope:
            rope = {"rope_type": "default", "rope_theta": float(tc.get("rope_theta", 10000.0))}
            if tc.get("rope_scaling"):
                rope.update(tc["rope_scaling"])
                rope["rope_type"] = rope.pop("type", rope.get("rope_type", "default"))
        rope = {k: v for k, v in rope.items() if k not in ("mscale", "mscale_all_dim")} if mla else rope
        params = dict(
            hidden_size=H,
            intermediate_size=int(tc.get("intermediate_size") or 4 * H),
            num_attention_heads=heads,
            num_key_value_heads=kv,
            head_dim=head_dim,
            vocab_size=int(tc["vocab_size"]),
            draft_vocab_size=draft_vocab_size,
            aux_layer_ids=list(aux_layer_ids),
            rms_norm_eps=float(tc.get("rms_norm_eps", 1e-6)),
            rope_parameters=rope,
            max_position_embeddings=int(tc.get("max_position_embeddings", 8192)),
        )
        params.update(overrides)
        return cls(**params)


class RotaryEmbedding(nn.Module):
    """RoPE cos/sin as transformers' Llama computes them, with the inverse frequencies kept in fp32.

    They are a plain attribute, not a buffer, so ``model.to(torch.bfloat16)``
    cannot round them (bf16 frequencies shift long-context angles).
    """

    def __init__(self, cfg: "DraftConfig") -> None:
        super().__init__()
        rope_type = cfg.rope_parameters.get("rope_type", "default")
        if rope_type == "default":
            base = float(cfg.rope_parameters.get("rope_theta", 10000.0))
            inv_freq = 1.0 / (base ** (torch.arange(0, cfg.head_dim, 2, dtype=torch.float) / cfg.head_dim))
            self.attention_scaling = 1.0
        else:
            from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

            if rope_type not in ROPE_INIT_FUNCTIONS:
                raise ValueError(f"unknown rope_type {rope_type!r}")
            inv_freq, self.attention_scaling = ROPE_INIT_FUNCTIONS[rope_type](cfg.llama_config(), "cpu")
        self._inv_freq = {torch.device("cpu"): inv_freq.float()}

    def forward(self, x: torch.Tensor, position_ids: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        inv = self._inv_freq.get(x.device)
        if inv is None:
            inv = self._inv_freq[x.device] = self._inv_freq[torch.device("cpu")].to(x.device)
        freqs = position_ids[..., None].float() * inv  # [B, T, d/2]
        emb = torch.cat((freqs, freqs), dim=-1)  # [B, T, d]
        return (emb.cos() * self.attention_scaling).to(x.dtype), (emb.sin() * self.attention_scaling).to(x.dtype)


class RMSNorm(nn.Module):
    """Llama's RMSNorm: normalise in fp32, scale in the input dtype (transformers ``LlamaRMSNorm``, vLLM's
    ``RMSNorm``). The weight is cast to the input's dtype first: an fp32 master weight under autocast would
    otherwise promote the output, and every activation after it, to fp32 (a bf16 model computes exactly this)."""

    def __init__(self, dim: int, eps: float) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        dtype = x.dtype
        x = x.float()
        x = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight.to(dtype) * x.to(dtype)


# --------------------------------------------------------------------------- modules


class Eagle3Attention(nn.Module):
    def __init__(self, cfg: DraftConfig, *, in_features: int) -> None:
        super().__init__()
        self.num_heads, self.num_kv_heads, self.head_dim = (
            cfg.num_attention_heads,
            cfg.num_key_value_heads,
            cfg.head_dim,
        )
        self.scale = 1.0 / math.sqrt(cfg.head_dim)
        # EAGLE-3: the first layer's q/k/v read [embeddings, hidden] concatenated, hence 2H inputs there.
        self.q_proj = nn.Linear(in_features, self.num_heads * self.head_dim, bias=False)
        self.k_proj = nn.Linear(in_features, self.num_kv_heads * self.head_dim, bias=False)
        self.v_proj = nn.Linear(in_features, self.num_kv_heads * self.head_dim, bias=False)
        self.o_proj = nn.Linear(self.num_heads * self.head_dim, cfg.hidden_size, bias=False)
        # Qwen3's attention: RMSNorm over each query and key head before RoPE (transformers Qwen3Attention,
        # vLLM qwen3_eagle3.py via Qwen3DecoderLayer); speculators #563 made it its default draft layer.
        qwen3 = cfg.draft_arch == "qwen3"
        self.q_norm = RMSNorm(cfg.head_dim, cfg.rms_norm_eps) if qwen3 else None
        self.k_norm = RMSNorm(cfg.head_dim, cfg.rms_norm_eps) if qwen3 else None

    def qkv(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor):
        """x [B, T, in_features] -> q [B, h, T, d] and k, v [B, kv, T, d], RoPE applied."""
        from transformers.models.llama.modeling_llama import apply_rotary_pos_emb

        B, T, _ = x.shape
        q = self.q_proj(x).view(B, T, self.num_heads, self.head_dim)  # [B, T, h, d]
        k = self.k_proj(x).view(B, T, self.num_kv_heads, self.head_dim)  # [B, T, kv, d]
        if self.q_norm is not None:
            q, k = self.q_norm(q), self.k_norm(k)
        q, k = q.transpose(1, 2), k.transpose(1, 2)  # [B, h, T, d], [B, kv, T, d]
        v = self.v_proj(x).view(B, T, self.num_kv_heads, self.head_dim).transpose(1, 2)
        q, k = apply_rotary_pos_emb(q, k, cos, sin)
        return q, k, v

    def output(self, attn: torch.Tensor) -> torch.Tensor:
        """attn [B, h, T, d] -> [B, T, H]."""
        B, _, T, _ = attn.shape
        return self.o_proj(attn.transpose(1, 2).reshape(B, T, self.num_heads * self.head_dim))


class Eagle3MLP(nn.Module):
    def __init__(self, cfg: DraftConfig) -> None:
        super().__init__()
        from transformers.activations import ACT2FN

        self.gate_proj = nn.Linear(cfg.hidden_size, cfg.intermediate_size, bias=False)
        self.up_proj = nn.Linear(cfg.hidden_size, cfg.intermediate_size, bias=False)
        self.down_proj = nn.Linear(cfg.intermediate_size, cfg.hidden_size, bias=False)
        self.act_fn = ACT2FN[cfg.hidden_act]

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(self.act_fn(self.gate_proj(x)) * self.up_proj(x))


class Eagle3DecoderLayer(nn.Module):
    """vLLM's ``llama_eagle3.LlamaDecoderLayer``. Layer 0: normed embeddings and normed hidden state,
    concatenated (embeddings first), feed attention; the residual is the hidden state (normed only with
    ``norm_before_residual``). A later layer is an ordinary pre-norm decoder layer over the previous layer's
    output (``input_layernorm``, no embeddings: vLLM #26164, speculators' plain decoder layers)."""

    def __init__(self, cfg: DraftConfig, *, layer_idx: int = 0) -> None:
        super().__init__()
        self.layer_idx = layer_idx
        self.norm_before_residual = cfg.norm_before_residual
        if layer_idx == 0:
            self.hidden_norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.self_attn = Eagle3Attention(cfg, in_features=(2 if layer_idx == 0 else 1) * cfg.hidden_size)
        self.mlp = Eagle3MLP(cfg)

    # The layer in two halves around attention: inference runs its cache's attention between them; training
    # runs all three as one function of tensors (ttt_forward), which it compiles as one region with the norm.
    def pre_attention(self, embeds, hidden, cos, sin):
        """-> q, k, v (RoPE applied) and the residual."""
        if self.layer_idx > 0:
            return *self.self_attn.qkv(self.input_layernorm(hidden), cos, sin), hidden
        normed = self.hidden_norm(hidden)
        residual = normed if self.norm_before_residual else hidden
        x = torch.cat([self.input_layernorm(embeds), normed], dim=-1)  # [B, T, 2H]
        return *self.self_attn.qkv(x, cos, sin), residual

    def post_attention(self, attn, residual) -> torch.Tensor:
        h = residual + self.self_attn.output(attn)
        return h + self.mlp(self.post_attention_layernorm(h))  # pre-norm output: vLLM's hidden_prenorm

    def ttt_forward(self, embeds, hidden, cos, sin, past_keys, past_values, mask, impl: AttnImpl):
        """One TTT step of the layer, attention included, as a function of tensors only.

        ``past_keys`` / ``past_values``: the earlier steps' ``[B, kv, T, d]``; ``mask`` and ``impl`` from the
        :class:`TTTContext`. Returns the pre-norm output ``[B, T, H]`` and this step's k, v ``[B, kv, T, d]``.
        """
        q, k, v, residual = self.pre_attention(embeds, hidden, cos, sin)
        # [B, kv, (step+1)*T, d], or [B, kv, S*T, d] with TTTContext's fixed_steps (its zeros in k's dtype)
        keys = torch.cat([*(p.to(k.dtype) for p in past_keys), k], dim=2)
        values = torch.cat([*(p.to(v.dtype) for p in past_values), v], dim=2)
        attn = masked_attention(q, keys, values, mask, self.self_attn.scale, impl)
        return self.post_attention(attn, residual), k, v

    def forward(self, embeds, hidden, cos, sin, position_ids, context) -> torch.Tensor:
        """Inference: the layer around its cache's attention (training runs :meth:`ttt_forward`)."""
        q, k, v, residual = self.pre_attention(embeds, hidden, cos, sin)
        attn = context.attend(q, k, v, self.self_attn.scale, position_ids, layer=self.layer_idx)
        return self.post_attention(attn, residual)


class Eagle3Draft(nn.Module):
    """The EAGLE-3 draft model (speculators ``eagle3`` layout; its state dict keys are the checkpoint's)."""

    def __init__(self, cfg: DraftConfig, *, attn_implementation: AttnImpl = "sdpa") -> None:
        super().__init__()
        self.config = cfg
        self.attn_implementation: AttnImpl = attn_implementation
        # Recompute each TTT step's decoder layer in backward instead of keeping its activations (transformers'
        # name for it): activations shrink to the steps' inputs and outputs, for about a third more layer compute.
        self.gradient_checkpointing = False
        # Every TTT step attends to ttt_steps blocks of keys (the steps not yet run as zeros it cannot see), so
        # each step has one shape and a compiled ttt_block compiles once for all of them (TTTContext's
        # fixed_steps); set by eyas.training.trainer.compile_draft.
        self.ttt_fixed_shapes = False
        self.embed_tokens = nn.Embedding(cfg.vocab_size, cfg.hidden_size)
        self.embed_tokens.weight.requires_grad_(False)  # frozen: the verifier's
        self.input_norm = RMSNorm(cfg.fc_in_features, cfg.rms_norm_eps) if cfg.norm_before_fc else None
        # EAGLE-3.1 (speculators #670, vLLM #42764): one RMSNorm per aux state, each over the verifier's width
        width = cfg.fc_in_features // 3
        self.fc_norm = nn.ModuleList([RMSNorm(width, cfg.rms_norm_eps) for _ in range(3)]) if cfg.fc_norm else None
        self.fc = nn.Linear(cfg.fc_in_features, cfg.hidden_size, bias=False)
        self.layers = nn.ModuleList([Eagle3DecoderLayer(cfg, layer_idx=i) for i in range(cfg.num_hidden_layers)])
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.lm_head = nn.Linear(cfg.hidden_size, cfg.draft_vocab_size, bias=False)
        self.register_buffer("d2t", torch.zeros(cfg.draft_vocab_size, dtype=torch.long))
        self.register_buffer("t2d", torch.zeros(cfg.vocab_size, dtype=torch.bool))
        self.rotary_emb = RotaryEmbedding(cfg)
        self.reset_parameters()

    def reset_parameters(self) -> None:
        """Llama's init: normal(0, initializer_range) for linears, ones for norms."""
        for m in self.modules():
            if isinstance(m, nn.Linear):
                nn.init.normal_(m.weight, std=self.config.initializer_range)
            elif isinstance(m, RMSNorm):
                nn.init.ones_(m.weight)

    def set_vocab(self, *, d2t: torch.Tensor, t2d: torch.Tensor) -> None:
        """Install the vocab maps (``target_id = draft_id + d2t[draft_id]``)."""
        self.d2t.copy_(d2t.to(torch.long))
        self.t2d.copy_(t2d.to(torch.bool))

    def draft_to_target(self, draft_ids: torch.Tensor) -> torch.Tensor:
        return draft_ids + self.d2t[draft_ids]

    def init_from_verifier(self, *, embed: torch.Tensor, lm_head_rows: torch.Tensor) -> None:
        """Copy the verifier's embedding (frozen) and its head's draft-vocab rows (the lm_head's start)."""
        with torch.no_grad():
            self.embed_tokens.weight.copy_(embed)
            self.lm_head.weight.copy_(lm_head_rows)

    # ------------------------------------------------------------------ forward

    def fuse(self, aux_hidden: torch.Tensor) -> torch.Tensor:
        """[B, T, 3*H_target] verifier aux states (ascending layer order) -> [B, T, H]."""
        if self.input_norm is not None:
            aux_hidden = self.input_norm(aux_hidden)
        if self.fc_norm is not None:
            states = aux_hidden.chunk(3, dim=-1)  # 3 x [B, T, H_target]
            aux_hidden = torch.cat([norm(h) for norm, h in zip(self.fc_norm, states)], dim=-1)
        return self.fc(aux_hidden)

    def step(self, input_ids: torch.Tensor | None, hidden: torch.Tensor, position_ids: torch.Tensor, context,
             inputs_embeds: torch.Tensor | None = None,
             position_embeddings: tuple[torch.Tensor, torch.Tensor] | None = None):  # fmt: skip
        """One draft forward: the same function in training-time test and in inference.

        ``input_ids [B, T]`` are the tokens *after* the positions whose states
        ``hidden [B, T, H]`` carry (fused verifier states, or the draft's own
        pre-norm output of the previous step); ``position_ids [B, T]``;
        ``inputs_embeds [B, T, H]``, when given, their embeddings (looked up
        elsewhere, e.g. in host memory by training's data loader; ``input_ids``
        may then be None); ``position_embeddings``, when given, the RoPE
        ``(cos, sin)`` of ``position_ids`` (transformers' name), computed by the caller.
        Returns ``(normed, next_hidden)``, both ``[B, T, H]``: logits come from
        :meth:`compute_logits` on ``normed``, and ``next_hidden`` is the state
        the next step consumes: the pre-norm output (vLLM's ``hidden_prenorm``),
        or ``normed`` with ``norm_output``.
        """
        embeds = (self.embed_tokens(input_ids) if inputs_embeds is None else inputs_embeds).to(hidden.dtype)
        cos, sin = position_embeddings if position_embeddings is not None else self.rotary_emb(hidden, position_ids)
        if isinstance(context, TTTContext):
            past_keys, past_values = context.past()
            normed, prenorm, k, v = self.ttt_block(embeds, hidden, cos, sin, past_keys, past_values, context.mask(),
                                                   context.impl)  # fmt: skip
            context.record(k, v)
        else:
            prenorm = hidden
            for layer in self.layers:
                prenorm = layer(embeds, prenorm, cos, sin, position_ids, context)
            normed = self.norm(prenorm)
        return normed, normed if self.config.norm_output else prenorm

    def ttt_block(self, embeds, hidden, cos, sin, past_keys, past_values, mask, impl: AttnImpl):
        """:meth:`step`'s layers and final norm in training-time test, as a function of tensors only
        (``eyas.training.trainer.compile_draft`` compiles it as one region: the host dispatches one graph per TTT step, not
        four). ``past_keys[i]`` / ``past_values[i]``: layer ``i``'s keys and values of the earlier steps.
        Returns ``(normed, prenorm, keys, values)``, ``keys[i]`` this step's of layer ``i``; see
        :meth:`Eagle3DecoderLayer.ttt_forward`."""
        keys, values = [], []
        for layer, layer_keys, layer_values in zip(self.layers, past_keys, past_values, strict=True):
            hidden, k, v = layer.ttt_forward(embeds, hidden, cos, sin, layer_keys, layer_values, mask, impl)
            keys.append(k)
            values.append(v)
        return self.norm(hidden), hidden, keys, values

    def compute_logits(self, normed: torch.Tensor) -> torch.Tensor:
        """Draft-vocab logits ``[..., draft_vocab]``."""
        return self.lm_head(normed)

    def ttt(self, input_ids: torch.Tensor, aux_hidden: torch.Tensor, *, ttt_steps: int,
            doc_ids: torch.Tensor | None = None, position_ids: torch.Tensor | None = None,
            inputs_embeds: torch.Tensor | None = None,
            before_step: Callable[[int | None], None] | None = None) -> list[torch.Tensor]:  # fmt: skip
        """Training-time test over whole sequences: the normed output ``[B, T, H]`` of each step.

        ``input_ids [B, T]`` are the verifier's tokens ``x_0..x_{T-1}`` and
        ``aux_hidden [B, T, 3H]`` its aux states ``h_t``. Step ``k`` at index
        ``t`` reads token ``x_{t+1+k}`` (teacher forcing), position ``pos_t + k``
        and, for ``k > 0``, the step ``k-1`` pre-norm output at ``t``; it
        predicts ``x_{t+2+k}`` (whose target is the verifier's distribution at
        ``t+1+k``). Tokens past the end read id 0; the caller masks their loss.
        ``inputs_embeds [B, T + ttt_steps, H]``, when given, are the embeddings of
        ``input_ids`` followed by ``ttt_steps`` tokens of id 0 (so each step reads
        a slice of them instead of looking its tokens up). ``before_step(k)``, when given, runs before step ``k``
        and ``before_step(None)`` after the last (the trainer's staged deferred weight gradients).
        """
        B, T = input_ids.shape
        if inputs_embeds is not None and tuple(inputs_embeds.shape[:2]) != (B, T + ttt_steps):
            raise ValueError(f"inputs_embeds must be [B, T + ttt_steps, H] = [{B}, {T + ttt_steps}, H], "
                             f"got {list(inputs_embeds.shape)}")  # fmt: skip
        if doc_ids is None:
            doc_ids = torch.zeros(B, T, dtype=torch.long, device=input_ids.device)
        if position_ids is None:
            position_ids = _positions_within_docs(doc_ids)
        hidden = self.fuse(aux_hidden)
        fixed = {}
        if self.ttt_fixed_shapes and ttt_steps > 1:
            # the zero keys of the steps not yet run: [B, kv, T, d] in the keys' dtype
            zeros = hidden.new_zeros(B, self.config.num_key_value_heads, T, self.config.head_dim)
            fixed = dict(fixed_steps=ttt_steps, zeros=zeros)
        context = TTTContext(doc_ids, self.attn_implementation, num_layers=len(self.layers), **fixed)
        # Every step's embeddings and RoPE at once (the host dispatches each operation once, not once per step):
        # step k reads the rows of x_{t+1+k} (ids past the end read id 0; their loss is masked) at position
        # pos_t + k.
        if inputs_embeds is None:
            inputs_embeds = self.embed_tokens(F.pad(input_ids, (0, ttt_steps)))  # [B, T + ttt_steps, H]
        offsets = torch.arange(ttt_steps, device=position_ids.device)[:, None, None]  # [ttt_steps, 1, 1]
        positions = position_ids + offsets  # [ttt_steps, B, T]: step k at position pos_t + k
        cos, sin = self.rotary_emb(hidden, positions)  # [ttt_steps, B, T, head_dim] each
        outputs = []
        for k in range(ttt_steps):
            # [B, T, H]: x_{t+1+k}; a contiguous copy, as a per-step lookup wrote: a compiled layer fed the strided
            # slice ran slower (CPU host time per step 3.8 vs 2.8 ms in bench/train_throughput.py --preset smoke)
            embeds = inputs_embeds[:, 1 + k : 1 + k + T].contiguous()

            def run(hidden, positions, embeds, cos, sin, k=k):
                context.begin(k)
                return self.step(None, hidden, positions, context, inputs_embeds=embeds, position_embeddings=(cos, sin))

            args = (hidden, positions[k], embeds, cos[k], sin[k])
            if before_step is not None:
                before_step(k)
            if self.gradient_checkpointing and torch.is_grad_enabled():
                from torch.utils.checkpoint import checkpoint

                normed, hidden = checkpoint(run, *args, use_reentrant=False)
            else:
                normed, hidden = run(*args)
            outputs.append(normed)
        if before_step is not None:
            before_step(None)
        return outputs

    def new_cache(self, *, batch_size: int, max_len: int, device=None, dtype=None) -> DraftCache:
        p = self.fc.weight
        return DraftCache(batch_size=batch_size, max_len=max_len, num_kv_heads=self.config.num_key_value_heads,
                          head_dim=self.config.head_dim, device=device or p.device, dtype=dtype or p.dtype,
                          attn_implementation=self.attn_implementation,
                          num_layers=self.config.num_hidden_layers)  # fmt: skip


def _positions_within_docs(doc_ids: torch.Tensor) -> torch.Tensor:
    """Position ids that restart at 0 at each document start. doc_ids [B, T] -> [B, T]."""
    B, T = doc_ids.shape
    idx = torch.arange(T, device=doc_ids.device).expand(B, T)
    start = torch.ones_like(doc_ids, dtype=torch.bool)
    start[:, 1:] = doc_ids[:, 1:] != doc_ids[:, :-1]
    first = torch.where(start, idx, torch.zeros_like(idx)).cummax(dim=1).values  # index of each doc's first token
    return idx - first
