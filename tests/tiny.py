"""Tiny random verifiers built on the fly (nothing large is committed).

Each builder writes a real Hugging Face checkpoint directory (config.json,
safetensors, tokenizer) with transformers' own classes and returns a
:class:`Tiny` that can rebuild the reference model from the in-memory state
dict, independently of eyas's loading code.
"""

from __future__ import annotations

import json
import random
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable

import torch
from safetensors.torch import load_file, save_file

VOCAB = 512
HIDDEN = 64
LAYERS = 8  # default aux layers [2, 4, 5]

CHATML = (
    "{% for message in messages %}"
    "{{ '<|im_start|>' + message['role'] + '\n' + message['content'] + '<|im_end|>' + '\n' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}"
)

CORPUS = [
    "The quick brown fox jumps over the lazy dog. A speculative decoder drafts tokens that a verifier checks.",
    "def add(a, b):\n    return a + b\n\nprint(add(2, 3))",
    "Explain why the sky is blue in simple terms. Rayleigh scattering makes short wavelengths scatter more.",
    "User: hello there! Assistant: Hi, how can I help you today? 1 2 3 4 5 6 7 8 9 10",
    "Write a haiku about autumn leaves falling slowly onto a quiet pond at dusk.",
    'Numbers: 3.14159, 2.71828, 1.41421; lists [1, 2, 3]; dicts {\'a\': 1}; JSON {"key": "value"}.',
]


def make_tokenizer(vocab_size: int = VOCAB):
    """A byte-level BPE tokenizer with ChatML special tokens and chat template (covers any text)."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=["<|endoftext|>", "<|im_start|>", "<|im_end|>"],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(CORPUS * 4, trainer)
    fast = PreTrainedTokenizerFast(
        tokenizer_object=tok,
        bos_token="<|im_start|>",
        eos_token="<|im_end|>",
        pad_token="<|endoftext|>",
        unk_token="<|endoftext|>",
    )
    fast.chat_template = CHATML
    return fast


@dataclass
class Tiny:
    """A tiny verifier on disk plus what is needed to rebuild its reference model in memory."""

    path: Path
    config: Any  # the transformers config of the text model
    model_cls: type
    state_dict: dict[str, torch.Tensor] = field(repr=False)

    def reference(self) -> torch.nn.Module:
        model = self.model_cls(self.config)
        model.load_state_dict(self.state_dict)
        return model.eval()


def _common(**over: Any) -> dict[str, Any]:
    base = dict(
        vocab_size=VOCAB,
        hidden_size=HIDDEN,
        intermediate_size=128,
        num_hidden_layers=LAYERS,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=1024,
        bos_token_id=1,
        eos_token_id=2,
        pad_token_id=0,
    )
    base.update(over)
    return base


def _build(config, model_cls, seed: int):
    torch.manual_seed(seed)
    model = model_cls(config).eval()
    with torch.no_grad():  # random norms, so a wrong norm cannot hide behind all-ones weights
        for name, p in model.named_parameters():
            if name.endswith("norm.weight"):
                p.copy_(1.0 + 0.1 * torch.randn_like(p))
    return model


def _save(model, tok, path: Path, config, model_cls) -> Tiny:
    path.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(path)
    tok.save_pretrained(path)
    sd = {k: v.clone() for k, v in model.state_dict().items()}
    return Tiny(path, config, model_cls, sd)


def llama(path: Path, *, tied: bool = False, seed: int = 0) -> Tiny:
    from transformers import LlamaConfig, LlamaForCausalLM

    cfg = LlamaConfig(**_common(tie_word_embeddings=tied))
    return _save(_build(cfg, LlamaForCausalLM, seed), make_tokenizer(), path, cfg, LlamaForCausalLM)


def qwen3(path: Path, *, seed: int = 1) -> Tiny:
    from transformers import Qwen3Config, Qwen3ForCausalLM

    cfg = Qwen3Config(**_common(head_dim=16, tie_word_embeddings=False))
    return _save(_build(cfg, Qwen3ForCausalLM, seed), make_tokenizer(), path, cfg, Qwen3ForCausalLM)


def mistral(path: Path, *, seed: int = 2) -> Tiny:
    from transformers import MistralConfig, MistralForCausalLM

    cfg = MistralConfig(**_common(head_dim=16, sliding_window=None))
    return _save(_build(cfg, MistralForCausalLM, seed), make_tokenizer(), path, cfg, MistralForCausalLM)


def gemma(path: Path, *, seed: int = 3) -> Tiny:
    """Gemma: tied head, ``(1 + w)`` RMSNorm, embeddings scaled by sqrt(H) inside the model."""
    from transformers import GemmaConfig, GemmaForCausalLM

    cfg = GemmaConfig(**_common(head_dim=16, tie_word_embeddings=True))
    return _save(_build(cfg, GemmaForCausalLM, seed), make_tokenizer(), path, cfg, GemmaForCausalLM)


def gemma2(path: Path, *, seed: int = 8) -> Tiny:
    """Gemma-2: its head softcaps the logits, ``cap * tanh(logits / cap)`` (a small cap, so it shows)."""
    from transformers import Gemma2Config, Gemma2ForCausalLM

    cfg = Gemma2Config(**_common(head_dim=16, tie_word_embeddings=True, final_logit_softcapping=2.0))
    return _save(_build(cfg, Gemma2ForCausalLM, seed), make_tokenizer(), path, cfg, Gemma2ForCausalLM)


def gemma3(path: Path, *, seed: int = 9) -> Tiny:
    """Gemma-3 (text): softcapping off by default in its config, set here."""
    from transformers import Gemma3ForCausalLM, Gemma3TextConfig

    cfg = Gemma3TextConfig(**_common(head_dim=16, tie_word_embeddings=True, final_logit_softcapping=3.0))
    return _save(_build(cfg, Gemma3ForCausalLM, seed), make_tokenizer(), path, cfg, Gemma3ForCausalLM)


def cohere(path: Path, *, seed: int = 10) -> Tiny:
    """Cohere: LayerNorm, tied head, logits multiplied by ``logit_scale``."""
    from transformers import CohereConfig, CohereForCausalLM

    cfg = CohereConfig(**_common(logit_scale=0.25))
    return _save(_build(cfg, CohereForCausalLM, seed), make_tokenizer(), path, cfg, CohereForCausalLM)


def granite(path: Path, *, seed: int = 11) -> Tiny:
    """Granite (muP): logits divided by ``logits_scaling``."""
    from transformers import GraniteConfig, GraniteForCausalLM

    cfg = GraniteConfig(**_common(logits_scaling=4.0))
    return _save(_build(cfg, GraniteForCausalLM, seed), make_tokenizer(), path, cfg, GraniteForCausalLM)


def _deepseek_config(**over: Any):
    from transformers import DeepseekV3Config

    return DeepseekV3Config(
        **_common(
            num_attention_heads=4,
            num_key_value_heads=4,
            moe_intermediate_size=32,
            n_routed_experts=4,
            num_experts_per_tok=2,
            n_shared_experts=1,
            first_k_dense_replace=1,
            q_lora_rank=32,
            kv_lora_rank=16,
            qk_rope_head_dim=8,
            qk_nope_head_dim=8,
            v_head_dim=16,
            n_group=1,
            topk_group=1,
            tie_word_embeddings=False,
        )
        | over
    )


def deepseek_v3(path: Path, *, seed: int = 4) -> Tiny:
    """DeepseekV3: MoE with MLA attention, as in Kimi-K2.5's text model."""
    from transformers import DeepseekV3ForCausalLM

    cfg = _deepseek_config()
    return _save(_build(cfg, DeepseekV3ForCausalLM, seed), make_tokenizer(), path, cfg, DeepseekV3ForCausalLM)


REMOTE_SENTINEL = "REMOTE_CODE_WAS_IMPORTED"
_REMOTE_MODULE = """
# Remote code that eyas must never import: importing it leaves a sentinel file and fails.
from pathlib import Path
Path(__file__).with_name({sentinel!r}).write_text("imported")
raise RuntimeError("eyas imported checkpoint code from " + __file__)
"""


def kimi_like(path: Path, *, seed: int = 5, shards: int = 3, int4: bool = False, **text_config: Any) -> Tiny:
    """A Kimi-K2.5-like wrapper: unknown top-level model_type, a deepseek_v3 ``text_config``, weights under
    ``language_model.model.*`` / ``language_model.lm_head.*`` beside a vision tower, split over shards with
    an index, and an ``auto_map`` naming modules whose import fails (and leaves a sentinel).

    With ``int4``, laid out as Kimi-K2.5's int4 release: every routed expert's ``gate/up/down_proj`` is
    compressed-tensors ``pack-quantized`` int4 (group 32; ``weight_packed``, ``weight_scale``, ``weight_shape``
    per expert), everything else stays dense, and ``text_config.quantization_config`` carries Kimi's ignore
    list. The reference then holds the dequantized experts, loaded by transformers from a dense copy.
    ``text_config`` overrides DeepseekV3 config values (more or wider experts, say)."""
    import tempfile

    from transformers import DeepseekV3ForCausalLM

    cfg = _deepseek_config(**text_config)
    model = _build(cfg, DeepseekV3ForCausalLM, seed)
    sd = {k: v.clone() for k, v in model.state_dict().items()}
    with tempfile.TemporaryDirectory() as tmp:
        model.save_pretrained(tmp)
        on_disk = load_file(str(Path(tmp) / "model.safetensors"))
        text_cfg = json.loads((Path(tmp) / "config.json").read_text())
        if int4:
            on_disk, dense = _pack_routed_experts(on_disk)
            save_file(dense, str(Path(tmp) / "model.safetensors"), metadata={"format": "pt"})
            ref = DeepseekV3ForCausalLM.from_pretrained(tmp, dtype=torch.float32)  # fuses experts its own way
            sd = {k: v.clone() for k, v in ref.state_dict().items()}
            text_cfg["quantization_config"] = KIMI_INT4_QUANTIZATION
    write_kimi_wrapper(path, on_disk, text_cfg, shards=shards, seed=seed)
    return Tiny(path, cfg, DeepseekV3ForCausalLM, sd)


def write_kimi_wrapper(path: Path, text_weights: dict[str, torch.Tensor], text_cfg: dict[str, Any], *,
                       shards: int = 3, seed: int = 5) -> None:  # fmt: skip
    """Write a Kimi-K2.5-like checkpoint dir around a text model's weights and config: the weights under
    ``language_model.`` beside a vision tower, split over ``shards`` files with an index, the wrapper config
    (``text_config`` inside, an ``auto_map`` to remote modules whose import fails) and a tokenizer."""
    weights = {f"language_model.{k}": v for k, v in text_weights.items()}
    g = torch.Generator().manual_seed(seed)
    H = int(text_cfg["hidden_size"])
    weights["vision_tower.patch_embed.proj.weight"] = torch.randn(32, 3, 2, 2, generator=g)
    weights["vision_tower.encoder.layers.0.norm.weight"] = torch.randn(32, generator=g)
    weights["multi_modal_projector.linear_1.weight"] = torch.randn(H, 32, generator=g)
    path.mkdir(parents=True, exist_ok=True)
    keys = sorted(weights)
    weight_map = {}
    for i in range(shards):
        name = f"model-{i + 1:05d}-of-{shards:05d}.safetensors"
        part = {k: weights[k].contiguous() for k in keys[i::shards]}
        save_file(part, str(path / name), metadata={"format": "pt"})
        weight_map.update({k: name for k in part})
    total = sum(v.numel() * v.element_size() for v in weights.values())
    (path / "model.safetensors.index.json").write_text(
        json.dumps({"metadata": {"total_size": total}, "weight_map": weight_map}, indent=2)
    )
    top = {
        "architectures": ["KimiK25ForConditionalGeneration"],
        "model_type": "kimi_k25",
        "auto_map": {
            "AutoConfig": "configuration_kimi_k25.KimiK25Config",
            "AutoModel": "modeling_kimi_k25.KimiK25ForConditionalGeneration",
            "AutoModelForCausalLM": "modeling_kimi_k25.KimiK25ForConditionalGeneration",
        },
        "text_config": text_cfg,
        "vision_config": {"model_type": "moonvit", "hidden_size": 32, "patch_size": 2},
        "media_placeholder_token_id": 3,
        "tie_word_embeddings": False,
    }
    (path / "config.json").write_text(json.dumps(top, indent=2))
    for mod in ("configuration_kimi_k25.py", "modeling_kimi_k25.py"):
        (path / mod).write_text(_REMOTE_MODULE.format(sentinel=REMOTE_SENTINEL))
    make_tokenizer().save_pretrained(path)


BUILDERS: dict[str, Callable[..., Tiny]] = {
    "llama": llama,
    "llama_tied": lambda p: llama(p, tied=True, seed=6),
    "qwen3": qwen3,
    "mistral": mistral,
    "gemma": gemma,
    "gemma2": gemma2,
    "gemma3": gemma3,
    "cohere": cohere,
    "granite": granite,
    "deepseek_v3": deepseek_v3,
    "kimi_like": kimi_like,
}


def random_rows(n: int, seed: int, lo: int = 3, hi: int = 40) -> list[tuple[list[int], list[int]]]:
    """``n`` rows of ``lo..hi`` random token ids (never the special ids 0-2), the second half of each row in the
    loss mask."""
    rng = random.Random(seed)
    rows = []
    for _ in range(n):
        t = rng.randint(lo, hi)
        ids = [rng.randrange(3, VOCAB) for _ in range(t)]
        rows.append((ids, [0] * (t // 2) + [1] * (t - t // 2)))
    return rows


def write_prepared(path: Path, rows: list[tuple[list[int], list[int]]], *, verifier: Path) -> Path:
    """Write prepared rows in the ``eyas prepare`` format (see ``eyas.data.prepared``) without a chat template,
    for tests of later stages that need exact, hand-made token ids and loss masks."""
    import datasets

    from eyas.data.prepared import PREPARED_ROWS
    from eyas.core.files import atomic_path
    from eyas.core.manifest import write_manifest
    from eyas.verifier.info import fingerprint, resolve

    info = resolve(verifier)
    ds = datasets.Dataset.from_dict(
        {
            "input_ids": [list(map(int, ids)) for ids, _ in rows],
            "loss_mask": [list(map(int, m)) for _, m in rows],
            "seq_len": [len(ids) for ids, _ in rows],
            "row_id": list(range(len(rows))),
        },
        features=datasets.Features(
            {
                "input_ids": datasets.Sequence(datasets.Value("int32")),
                "loss_mask": datasets.Sequence(datasets.Value("int8")),
                "seq_len": datasets.Value("int32"),
                "row_id": datasets.Value("int64"),
            }
        ),
    )
    path.mkdir(parents=True, exist_ok=True)
    with atomic_path(path / PREPARED_ROWS, is_dir=True) as tmp:
        ds.save_to_disk(str(tmp))
    write_manifest(
        path,
        stage="prepare",
        inputs={"verifier": fingerprint(info), "chat_template_sha256": None, "source": "tests.tiny.write_prepared"},
        settings={},
        outputs={
            "rows": len(rows),
            "tokens": sum(len(i) for i, _ in rows),
            "masked_tokens": sum(sum(m) for _, m in rows),
        },  # fmt: skip
        verifier_path=str(info.path),
        vocab_size=info.vocab_size,
    )
    return path


#: The weight quantization of Kimi-K2.5's int4 release (compressed-tensors ``pack-quantized``: symmetric int4,
#: one scale per group of 32 input columns).
INT4_GROUP = 32
_INT4_WEIGHTS = {"num_bits": 4, "type": "int", "symmetric": True, "strategy": "group", "group_size": INT4_GROUP,
                 "dynamic": False, "observer": "minmax"}  # fmt: skip
#: Kimi-K2.5 int4's ``quantization_config`` (inside ``text_config``): only routed experts are int4; attention,
#: shared experts, the dense first MLP and the head stay in bf16.
KIMI_INT4_QUANTIZATION = {
    "config_groups": {"group_0": {"targets": ["Linear"], "input_activations": None, "output_activations": None,
                                  "weights": _INT4_WEIGHTS}},
    "format": "pack-quantized",
    "ignore": ["lm_head", "re:.*self_attn.*", "re:.*shared_experts.*", "re:.*mlp\\.(gate|up|gate_up|down)_proj.*"],
    "kv_cache_scheme": None,
    "quant_method": "compressed-tensors",
    "quantization_status": "compressed",
}  # fmt: skip


def _int4_quantize(model: torch.nn.Module, ignore: list[str]) -> dict[str, torch.Tensor]:
    """Attach int4 group-32 quantization to ``model``'s Linears (compressed-tensors), set each scale from the
    weights, and return the dequantized weights, computed here: ``clamp(round(w / s), -8, 7) * s``."""
    from compressed_tensors.quantization import QuantizationConfig, apply_quantization_config
    from compressed_tensors.quantization.utils import calculate_qparams

    qcfg = QuantizationConfig.model_validate({
        "config_groups": {"group_0": {"targets": ["Linear"], "weights": _INT4_WEIGHTS}},
        "format": "pack-quantized", "ignore": ignore, "quantization_status": "initialized",
    })  # fmt: skip
    apply_quantization_config(model, qcfg, show_progress=False)
    dequantized = {}
    for name, module in model.named_modules():
        scheme = getattr(module, "quantization_scheme", None)
        if scheme is None:
            continue
        w = module.weight.data
        groups = w.reshape(w.shape[0], -1, INT4_GROUP)  # [out, in/32, 32]
        scale, _ = calculate_qparams(groups.amin(-1), groups.amax(-1), scheme.weights)
        module.weight_scale.data.copy_(scale.to(module.weight_scale.dtype))
        s = module.weight_scale.data.float()[..., None]
        dequantized[name + ".weight"] = (torch.clamp(torch.round(groups / s), -8, 7) * s).reshape(w.shape)
    return dequantized


def _compress(model: torch.nn.Module):
    from compressed_tensors.compressors import ModelCompressor

    compressor = ModelCompressor.from_pretrained_model(model, quantization_format="pack-quantized")
    compressor.compress_model(model)
    return compressor


def int4_pack(weights: dict[str, torch.Tensor]) -> tuple[dict[str, torch.Tensor], dict[str, torch.Tensor]]:
    """Quantize each ``[out, in]`` weight to int4 (group 32, symmetric) and pack it with compressed-tensors, on
    the weights' device, all in one pass (one holder module with a Linear per weight). Returns the packed
    tensors (``<key without "weight">weight_packed`` / ``weight_scale`` / ``weight_shape``) and the dequantized
    weights per key."""
    keys = list(weights)
    holder = torch.nn.ModuleList(torch.nn.Linear(weights[k].shape[1], weights[k].shape[0], bias=False,
                                                 device=weights[k].device) for k in keys)  # fmt: skip
    for linear, key in zip(holder, keys):
        linear.weight.data.copy_(weights[key])
    dequantized = _int4_quantize(holder, ignore=[])
    _compress(holder)
    packed = {}
    for i, key in enumerate(keys):
        base = key.removesuffix("weight")
        packed.update({base + k: v.clone() for k, v in holder[i].state_dict().items()})
    return packed, {key: dequantized[f"{i}.weight"] for i, key in enumerate(keys)}


def _pack_routed_experts(on_disk: dict[str, torch.Tensor]) -> tuple[dict[str, torch.Tensor], dict[str, torch.Tensor]]:
    """Replace every routed expert weight (``...mlp.experts.N.{gate,up,down}_proj.weight``) by its packed int4
    tensors; also return the checkpoint with those weights dequantized instead (for the reference)."""
    import re

    experts = {k: w for k, w in on_disk.items() if re.search(r"\.mlp\.experts\.\d+\.(gate|up|down)_proj\.weight$", k)}
    packed, dequantized = int4_pack(experts)
    return {**{k: v for k, v in on_disk.items() if k not in experts}, **packed}, {**on_disk, **dequantized}


def llama_int4(path: Path, *, seed: int = 7) -> Tiny:
    """A Llama whose Linear weights (all but the head) are compressed-tensors int4 (``pack-quantized``, group
    size 32), quantized and packed with the ``compressed-tensors`` package itself. The returned reference model
    holds the *dequantized* weights, computed independently of the package's decompression."""
    from transformers import LlamaConfig, LlamaForCausalLM

    cfg = LlamaConfig(**_common())
    model = _build(cfg, LlamaForCausalLM, seed)
    sd = {k: v.clone() for k, v in model.state_dict().items()}
    sd.update(_int4_quantize(model, ignore=["lm_head"]))
    compressor = _compress(model)
    path.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(path)
    compressor.update_config(str(path))
    make_tokenizer().save_pretrained(path)
    return Tiny(path, cfg, LlamaForCausalLM, sd)
