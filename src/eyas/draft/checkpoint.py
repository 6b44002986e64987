"""The draft checkpoint on disk: speculators' ``eagle3`` format, which vLLM serves as is.

``config.json`` uses exactly the names vLLM's speculators parser reads
(``vllm/transformers_utils/configs/speculators/{base,algos}.py``):
``speculators_model_type``, ``transformer_layer_config`` (a Llama, or Qwen3,
config dict whose ``vocab_size`` is the verifier's padded vocab and whose
``num_hidden_layers`` counts the draft's decoder layers), ``draft_vocab_size``,
``eagle_aux_hidden_state_layer_ids`` (id ``i`` = the state *entering* verifier
layer ``i``), ``speculators_config.proposal_methods[0].speculative_tokens``,
``speculators_config.verifier.name_or_path``, and every layout flag written
explicitly (vLLM defaults a missing ``norm_before_residual`` to true).

``model.safetensors`` holds the module's own state-dict names (``fc.weight``,
``layers.N.*``, ``norm.weight``, ``lm_head.weight``, ``d2t``, ``t2d``), bf16
for floating tensors. ``embed_tokens.weight`` is left out by default (vLLM and
SGLang share the verifier's; for Kimi it is 2.35 GB), so loading takes the
verifier to fill it in. ``d2t``/``t2d`` are left out when the draft vocab is the
whole verifier vocab (identity maps): vLLM keeps its ``draft_id_to_target_id``
at zeros, the identity offset, when a checkpoint has no ``d2t``
(``llama_eagle3.py``, ``Eagle3LlamaForCausalLM.load_weights``).
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable

import torch

from eyas import __version__
from eyas.core.errors import EyasError
from eyas.core.files import atomic_path, read_json, write_bytes
from eyas.draft.model import DraftConfig, Eagle3Draft
from eyas.verifier.info import check_aux_layer_ids

CONFIG = "config.json"
WEIGHTS = "model.safetensors"
LAYOUT_FLAGS = ("norm_before_residual", "norm_before_fc", "fc_norm", "norm_output")


def decoder_layer_config(cfg: DraftConfig) -> dict[str, Any]:
    """The draft's decoder layers as a transformers ``LlamaConfig`` (or ``Qwen3Config``) dict (speculators'
    ``transformer_layer_config``, and the body of the EAGLE/SGLang config)."""
    rope = dict(cfg.rope_parameters)
    legacy_scaling = {k: v for k, v in rope.items() if k != "rope_theta"}
    qwen3 = cfg.draft_arch == "qwen3"
    # vLLM picks the draft class by this model_type (algos.py: qwen3 -> Eagle3Qwen3ForCausalLM), speculators
    # its decoder layer (models/eagle3/model_definitions.py)
    layer_kind = {"model_type": cfg.draft_arch, "architectures": ["Qwen3ForCausalLM" if qwen3 else "LlamaForCausalLM"]}
    if qwen3:  # Qwen3Config can build sliding layers; vLLM's qwen3_eagle3.py reads layer_types: all full
        layer_kind.update(use_sliding_window=False, layer_types=["full_attention"] * cfg.num_hidden_layers)
    return {
        **layer_kind,
        "hidden_size": cfg.hidden_size,
        "intermediate_size": cfg.intermediate_size,
        "num_hidden_layers": cfg.num_hidden_layers,
        "num_attention_heads": cfg.num_attention_heads,
        "num_key_value_heads": cfg.num_key_value_heads,
        "head_dim": cfg.head_dim,
        "hidden_act": cfg.hidden_act,
        "max_position_embeddings": cfg.max_position_embeddings,
        "rms_norm_eps": cfg.rms_norm_eps,
        "vocab_size": cfg.vocab_size,
        "initializer_range": cfg.initializer_range,
        "attention_bias": False,
        "mlp_bias": False,
        "tie_word_embeddings": False,
        # transformers >= 5 reads rope_parameters; older parsers (vLLM on transformers 4) read the legacy pair.
        "rope_parameters": rope,
        "rope_theta": rope.get("rope_theta", 10000.0),
        "rope_scaling": legacy_scaling if legacy_scaling.get("rope_type", "default") != "default" else None,
    }


def config_dict(cfg: DraftConfig, *, verifier_name_or_path: str, verifier_architectures: list[str],
                ttt_steps: int, dtype: str = "bfloat16") -> dict[str, Any]:  # fmt: skip
    """The speculators ``eagle3`` config.json for a draft; ``ttt_steps`` is written as vLLM's
    ``speculative_tokens``, the tokens it drafts per step."""
    out: dict[str, Any] = {
        "architectures": ["Eagle3DraftModel"],
        "speculators_model_type": "eagle3",
        "transformer_layer_config": decoder_layer_config(cfg),
        "draft_vocab_size": cfg.draft_vocab_size,
        "eagle_aux_hidden_state_layer_ids": list(cfg.aux_layer_ids),
        "norm_before_residual": cfg.norm_before_residual,
        "norm_before_fc": cfg.norm_before_fc,
        "fc_norm": cfg.fc_norm,
        "norm_output": cfg.norm_output,
        "embed_requires_grad": False,
        # SGLang ties lm_head to the embedding when this is true (SmolLM2 itself is tied).
        "tie_word_embeddings": False,
        "dtype": dtype,
        "speculators_config": {
            "algorithm": "eagle3",
            "default_proposal_method": "greedy",
            "proposal_methods": [
                {
                    "proposal_type": "greedy",
                    "speculative_tokens": int(ttt_steps),
                    "verifier_accept_k": 1,
                    "accept_tolerance": 0.0,
                },  # fmt: skip
            ],
            "verifier": {"name_or_path": verifier_name_or_path, "architectures": list(verifier_architectures)},
        },
        "eyas_version": __version__,
    }
    if cfg.target_hidden_size and cfg.target_hidden_size != cfg.hidden_size:
        out["target_hidden_size"] = cfg.target_hidden_size  # SGLang breaks on a null here: write it only when set
    return out


def draft_config_from_dict(d: dict[str, Any], *, where: str = CONFIG) -> DraftConfig:
    """Parse a speculators ``eagle3`` config.json into a :class:`DraftConfig`, naming any bad key."""
    if d.get("speculators_model_type") != "eagle3":
        raise EyasError(f"{where}: speculators_model_type is {d.get('speculators_model_type')!r}, not 'eagle3'")
    layer = d.get("transformer_layer_config")
    if not isinstance(layer, dict):
        raise EyasError(f"{where}: transformer_layer_config is missing or not an object")
    arch = layer.get("model_type", "llama")
    if arch not in ("llama", "qwen3"):
        raise EyasError(f"{where}: transformer_layer_config.model_type {arch!r} is not supported (llama or qwen3)")
    if layer.get("attention_bias") or layer.get("mlp_bias"):
        raise EyasError(f"{where}: transformer_layer_config has attention_bias or mlp_bias; eyas drafts have no biases")
    if layer.get("layer_types") and "sliding_attention" in layer["layer_types"]:
        raise EyasError(f"{where}: sliding-window draft layers are not supported by eyas")
    for key in ("hidden_size", "intermediate_size", "num_attention_heads", "vocab_size"):
        if key not in layer:
            raise EyasError(f"{where}: transformer_layer_config.{key} is missing")
    heads = int(layer["num_attention_heads"])
    rope = layer.get("rope_parameters")
    if not rope:
        rope = {"rope_type": "default", "rope_theta": float(layer.get("rope_theta", 10000.0))}
        if layer.get("rope_scaling"):
            rope.update(layer["rope_scaling"])
            rope["rope_type"] = rope.pop("type", rope.get("rope_type", "default"))
    aux = check_aux_layer_ids(
        d.get("eagle_aux_hidden_state_layer_ids"), what=f"{where}: eagle_aux_hidden_state_layer_ids"
    )
    try:
        return DraftConfig(
            hidden_size=int(layer["hidden_size"]),
            intermediate_size=int(layer["intermediate_size"]),
            num_attention_heads=heads,
            num_key_value_heads=int(layer.get("num_key_value_heads") or heads),
            head_dim=int(layer.get("head_dim") or int(layer["hidden_size"]) // heads),
            vocab_size=int(layer["vocab_size"]),
            draft_vocab_size=int(d.get("draft_vocab_size") or layer["vocab_size"]),
            aux_layer_ids=aux,
            target_hidden_size=d.get("target_hidden_size"),
            rms_norm_eps=float(layer.get("rms_norm_eps", 1e-6)),
            rope_parameters=rope,
            max_position_embeddings=int(layer.get("max_position_embeddings", 8192)),
            hidden_act=layer.get("hidden_act", "silu"),
            initializer_range=float(layer.get("initializer_range", 0.02)),
            # vLLM's parser defaults a missing norm_before_residual to true; read it the way vLLM serves it.
            norm_before_residual=bool(d.get("norm_before_residual", True)),
            norm_before_fc=bool(d.get("norm_before_fc", False)),
            fc_norm=bool(d.get("fc_norm", False)),
            norm_output=bool(d.get("norm_output", False)),
            draft_arch=arch,
            num_hidden_layers=int(layer.get("num_hidden_layers", 1)),
        )
    except ValueError as e:
        raise EyasError(f"{where}: {e}") from e


def write_checkpoint(out_dir: str | os.PathLike, tensors: dict[str, torch.Tensor], config: dict[str, Any]) -> Path:
    """Write ``model.safetensors`` then ``config.json``, each atomically (a dir with a config is whole).

    Byte-stable: the same tensors and config give the same bytes (keys sorted, one metadata key).
    """
    from safetensors.torch import save_file

    out = Path(out_dir)
    with atomic_path(out / WEIGHTS) as tmp:
        # One metadata key only: safetensors writes metadata in hash-map order, which would break byte-stable saves.
        save_file(tensors, str(tmp), metadata={"format": "pt"})
    write_bytes(out / CONFIG, (json.dumps(config, indent=2, sort_keys=True) + "\n").encode())
    return out


def save_tensors(out_dir: str | os.PathLike, cfg: DraftConfig, state_dict: dict[str, torch.Tensor], *,
                 verifier_name_or_path: str, verifier_architectures: list[str], ttt_steps: int,
                 dtype: torch.dtype = torch.bfloat16, include_embeddings: bool = False) -> Path:  # fmt: skip
    """Write a draft given as state-dict tensors (the module's names) in the native format."""
    tensors = {}
    for name, t in state_dict.items():
        if name.startswith("rotary_emb."):
            continue
        if name == "embed_tokens.weight" and not include_embeddings:
            continue
        if name in ("d2t", "t2d") and cfg.draft_vocab_size == cfg.vocab_size:
            continue
        tensors[name] = (t.to(dtype) if t.is_floating_point() else t).detach().cpu().contiguous()
    dname = str(dtype).removeprefix("torch.")
    conf = config_dict(cfg, verifier_name_or_path=verifier_name_or_path, verifier_architectures=verifier_architectures,
                       ttt_steps=ttt_steps, dtype=dname)  # fmt: skip
    return write_checkpoint(out_dir, tensors, conf)


def save_draft(out_dir: str | os.PathLike, model: Eagle3Draft, *, verifier_name_or_path: str,
               verifier_architectures: list[str], ttt_steps: int, dtype: torch.dtype = torch.bfloat16,
               include_embeddings: bool = False) -> Path:  # fmt: skip
    """Write ``config.json`` and ``model.safetensors`` atomically (weights first: a dir with a config is whole)."""
    return save_tensors(out_dir, model.config, model.state_dict(), verifier_name_or_path=verifier_name_or_path,
                        verifier_architectures=verifier_architectures, ttt_steps=ttt_steps,
                        dtype=dtype, include_embeddings=include_embeddings)  # fmt: skip


def expected_shapes(cfg: DraftConfig) -> dict[str, tuple[int, ...]]:
    H, hd = cfg.hidden_size, cfg.head_dim
    shapes: dict[str, tuple[int, ...]] = {"fc.weight": (H, cfg.fc_in_features)}
    for i in range(cfg.num_hidden_layers):
        p, width = f"layers.{i}.", (2 if i == 0 else 1) * H  # layer 0 reads [embeddings, hidden]
        if i == 0:
            shapes[p + "hidden_norm.weight"] = (H,)
        shapes.update({
            p + "input_layernorm.weight": (H,),
            p + "post_attention_layernorm.weight": (H,),
            p + "self_attn.q_proj.weight": (cfg.num_attention_heads * hd, width),
            p + "self_attn.k_proj.weight": (cfg.num_key_value_heads * hd, width),
            p + "self_attn.v_proj.weight": (cfg.num_key_value_heads * hd, width),
            p + "self_attn.o_proj.weight": (H, cfg.num_attention_heads * hd),
            p + "mlp.gate_proj.weight": (cfg.intermediate_size, H),
            p + "mlp.up_proj.weight": (cfg.intermediate_size, H),
            p + "mlp.down_proj.weight": (H, cfg.intermediate_size),
        })  # fmt: skip
        if cfg.draft_arch == "qwen3":
            shapes[p + "self_attn.q_norm.weight"] = shapes[p + "self_attn.k_norm.weight"] = (hd,)
    shapes.update({
        "norm.weight": (H,),
        "lm_head.weight": (cfg.draft_vocab_size, H),
        "d2t": (cfg.draft_vocab_size,),
        "t2d": (cfg.vocab_size,),
        "embed_tokens.weight": (cfg.vocab_size, H),
    })  # fmt: skip
    if cfg.norm_before_fc:
        shapes["input_norm.weight"] = (cfg.fc_in_features,)
    if cfg.fc_norm:
        shapes.update({f"fc_norm.{i}.weight": (cfg.fc_in_features // 3,) for i in range(3)})
    return shapes


def read_draft_config(path: str | os.PathLike) -> tuple[DraftConfig, dict[str, Any]]:
    """The draft's :class:`DraftConfig` and its raw config.json."""
    p = Path(path) / CONFIG
    raw = read_json(p, what="draft config")
    return draft_config_from_dict(raw, where=str(p)), raw


def read_tensors(wpath: str | os.PathLike, cfg: DraftConfig) -> dict[str, torch.Tensor]:
    """Every tensor of a native-format ``model.safetensors``, each key and shape checked against ``cfg``.

    Required: all but ``embed_tokens.weight`` (optional), and ``d2t``/``t2d`` when the draft vocab is the
    whole verifier vocab. A checkpoint for another verifier or a damaged file fails with the key named.
    """
    from safetensors import SafetensorError, safe_open

    wpath = Path(wpath)
    if not wpath.is_file():
        raise EyasError(f"{wpath} not found: {wpath.parent} is not a finished draft checkpoint")
    try:
        with safe_open(str(wpath), framework="pt") as f:
            tensors = {k: f.get_tensor(k) for k in f.keys()}
    except SafetensorError as e:  # a truncated file, a damaged header
        raise EyasError(f"{wpath} is not a readable safetensors file ({e}); the draft is damaged: train or export "
                        "it again") from e  # fmt: skip
    check_tensors(tensors, cfg, where=str(wpath))
    return tensors


def check_tensors(tensors: dict[str, Any], cfg: DraftConfig, *, where: str,
                  file_key: Callable[[str], str] = str) -> None:  # fmt: skip
    """Raise naming the key when a tensor (anything with a ``.shape``) is unexpected, misshapen, or missing.

    ``file_key`` maps an eyas key to the name the file uses (``midlayer.*`` in the EAGLE layout), so the
    message names what the user will find in the file.
    """
    shapes = expected_shapes(cfg)
    for key in tensors:
        if key not in shapes:
            raise EyasError(f"{where}: unexpected tensor {file_key(key)!r} (not part of an eagle3 draft for this "
                            "config)")  # fmt: skip
        if tuple(tensors[key].shape) != shapes[key]:
            raise EyasError(f"{where}: {file_key(key)!r} has shape {list(tensors[key].shape)}, the config implies "
                            f"{list(shapes[key])}")  # fmt: skip
    optional = {"embed_tokens.weight"} | ({"d2t", "t2d"} if cfg.draft_vocab_size == cfg.vocab_size else set())
    missing = [file_key(k) for k in shapes if k not in tensors and k not in optional]
    if missing:
        raise EyasError(f"{where} lacks {missing}; a draft over a partial vocab needs d2t and t2d")


def load_draft(path: str | os.PathLike, *, verifier: Any = None, device: str | torch.device = "cpu",
               dtype: torch.dtype = torch.float32, attn_implementation: str = "sdpa") -> Eagle3Draft:  # fmt: skip
    """Load a speculators-format draft; ``verifier`` (a path or VerifierInfo) supplies a missing embedding.

    Every tensor's presence and shape is checked against the config first, so a
    checkpoint for another verifier or a damaged file fails with the key named.
    """
    cfg, _ = read_draft_config(path)
    wpath = Path(path) / WEIGHTS
    tensors = read_tensors(wpath, cfg)
    model = Eagle3Draft(cfg, attn_implementation=attn_implementation)  # type: ignore[arg-type]
    if "d2t" not in tensors:
        tensors["d2t"] = torch.zeros(cfg.draft_vocab_size, dtype=torch.long)
        tensors["t2d"] = torch.ones(cfg.vocab_size, dtype=torch.bool)
    if "embed_tokens.weight" not in tensors:
        if verifier is None:
            raise EyasError(f"{wpath} has no embed_tokens.weight; pass the verifier so eyas can borrow its embedding")
        from eyas.verifier.load import load_head_tensors
        from eyas.verifier.info import VerifierInfo, resolve

        info = verifier if isinstance(verifier, VerifierInfo) else resolve(verifier)
        if (info.vocab_size, info.hidden_size) != (cfg.vocab_size, cfg.target_hidden_size or cfg.hidden_size):
            raise EyasError(
                f"{path} is a draft for a verifier with vocab {cfg.vocab_size} and hidden size "
                f"{cfg.target_hidden_size or cfg.hidden_size}, but {info.path} has vocab {info.vocab_size} and "
                f"hidden size {info.hidden_size}"
            )
        tensors["embed_tokens.weight"] = load_head_tensors(info).embed
    missing, unexpected = model.load_state_dict({k: v.float() if v.is_floating_point() else v
                                                 for k, v in tensors.items()}, strict=False)  # fmt: skip
    missing = [k for k in missing if not k.startswith("rotary_emb.")]
    if missing or unexpected:
        raise EyasError(f"{wpath}: could not load {missing or unexpected}")
    return model.to(device=device, dtype=dtype).eval()


# --------------------------------------------------------------------------- a draft read from disk

#: Where an EAGLE-layout draft keeps its weights (SpecForge, SGLang; the EAGLE repo's .bin).
EAGLE_WEIGHT_FILES = ("model.safetensors", "pytorch_model.bin")


@dataclass
class Draft:
    """A draft read from disk: its geometry, its tensors under eyas's names (``layers.0.*``), and what its
    config says about the verifier and its TTT steps (``speculative_tokens``; None where the layout has no say)."""

    cfg: DraftConfig
    tensors: dict[str, torch.Tensor]
    verifier_name: str | None = None
    verifier_architectures: list[str] = field(default_factory=list)
    ttt_steps: int | None = None


def draft_files(src: Path, from_format: str | None) -> list[Path]:
    """The files a draft consists of (weights first), or a clear error naming what is missing."""
    config = src / CONFIG
    if not config.is_file():
        raise EyasError(f"{config} not found: {src} is not a draft checkpoint")
    names = EAGLE_WEIGHT_FILES if from_format == "eagle" else (WEIGHTS,)
    for name in names:
        if (src / name).is_file():
            return [src / name, config]
    hint = " (sharded checkpoints are not supported)" if (src / f"{WEIGHTS}.index.json").is_file() else ""
    raise EyasError(f"{src} has no {' or '.join(names)}{hint}")


def read_native(path: str | Path, *, tensors: bool = True) -> Draft:
    """A draft in eyas's native layout, or as speculators saves it (its embed_tokens, flags, null target size).
    ``tensors=False`` reads the config only."""
    cfg, raw = read_draft_config(path)
    weights = read_tensors(Path(path) / WEIGHTS, cfg) if tensors else {}
    spec = raw.get("speculators_config") or {}
    methods = spec.get("proposal_methods") or [{}]
    ver = spec.get("verifier") or {}
    return Draft(cfg, weights, verifier_name=ver.get("name_or_path"),
                 verifier_architectures=list(ver.get("architectures") or []),
                 ttt_steps=methods[0].get("speculative_tokens"))  # fmt: skip
