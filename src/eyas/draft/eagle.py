"""The EAGLE-3 layout SGLang serves (``sglang/srt/models/llama_eagle3.py``), also written by SpecForge and the
EAGLE repo: a plain Llama ``config.json`` with ``architectures: ["LlamaForCausalLMEagle3"]``,
``draft_vocab_size`` and ``eagle_config``; weights under ``midlayer.*`` instead of ``layers.0.*``. Read into
eyas' names the way SGLang serves it, and written from them (``eyas export``, :mod:`eyas.stages.export`).

Aux layer ids. eyas, vLLM and speculators write id ``i`` for the hidden state *entering* verifier layer ``i``;
SGLang captures ``id + 1`` for every id in ``eagle_config.eagle_aux_hidden_state_layer_ids``, so this layout
stores ``i - 1`` and reading it adds 1 back.
"""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any

import torch

from eyas import __version__
from eyas.draft.checkpoint import (
    CONFIG,
    Draft,
    check_tensors,
    decoder_layer_config,
    draft_config_from_dict,
    draft_files,
)
from eyas.core.errors import EyasError
from eyas.core.files import read_json
from eyas.draft.model import DraftConfig

EAGLE_ARCHITECTURE = "LlamaForCausalLMEagle3"  # SGLang's EntryClass (sglang/srt/models/llama_eagle3.py)


# --------------------------------------------------------------------------- reading

# SGLang's names for what vLLM and eyas call layers.0.* and fc_norm.{0,1,2} (llama_eagle3.py load_weights)
_EAGLE_ALIASES = {"midlayer.": "layers.0.", "aux_norm_low.": "fc_norm.0.", "aux_norm_mid.": "fc_norm.1.",
                  "aux_norm_high.": "fc_norm.2."}  # fmt: skip
# A decoder layer after the first: SGLang normalises its input with hidden_norm, vLLM and eyas with
# input_layernorm (sglang llama_eagle3.py LlamaDecoderLayer.forward; vllm llama_eagle3.py), so the EAGLE layout
# carries the weight under both names and each engine reads its own.
_LATER_INPUT_NORM = re.compile(r"layers\.([1-9][0-9]*)\.(hidden_norm|input_layernorm)\.weight")


def _eagle_to_eyas_key(key: str) -> str:
    for alias, name in _EAGLE_ALIASES.items():
        if key.startswith(alias):
            return name + key.removeprefix(alias)
    m = _LATER_INPUT_NORM.fullmatch(key)
    return f"layers.{m[1]}.input_layernorm.weight" if m else key


def _eyas_to_eagle_key(key: str) -> str:
    m = _LATER_INPUT_NORM.fullmatch(key)
    if m:
        return f"layers.{m[1]}.hidden_norm.weight"
    return "midlayer." + key.removeprefix("layers.0.") if key.startswith("layers.0.") else key


def read_eagle(path: str | Path, *, verifier: Any = None, tensors: bool = True) -> Draft:
    """An EAGLE-3 draft as the EAGLE repo, SpecForge or SGLang lay it out, read the way SGLang serves it.

    Config: a Llama config dict; ``eagle_config.eagle_aux_hidden_state_layer_ids`` in SGLang's convention
    (plus one gives ours), else the verifier's defaults ``[2, L//2, L-3]`` (SGLang's default capture, no
    shift: ``sglang/srt/models/llama.py`` ``set_eagle3_layers_to_capture``). Weights: ``midlayer.*`` or
    ``layers.0.*``. The residual is always the raw hidden state (``norm_before_residual`` false), as in
    SGLang's ``llama_eagle3.py`` decoder layer and EAGLE's ``cnets.py``, and the layers are Llama layers whatever
    ``model_type`` says (SGLang's ``LlamaForCausalLMEagle3`` builds no other). ``tensors=False`` reads the
    config only.
    """
    src = Path(path)
    where = str(src / CONFIG)
    c = read_json(src / CONFIG, what="EAGLE draft config")
    if not isinstance(c, dict):
        raise EyasError(f"{where} is not a JSON object")
    if "speculators_config" in c or "speculators_model_type" in c:
        raise EyasError(f"{where} is a speculators checkpoint, not an EAGLE one: use --from speculators")
    for key in ("hidden_size", "intermediate_size", "num_attention_heads", "vocab_size"):
        if key not in c:
            raise EyasError(f"{where}: {key} is missing")
    if c.get("bias"):
        raise EyasError(f"{where}: bias=true (an fc bias) is not supported by eyas")
    eagle = c.get("eagle_config") or {}
    if not isinstance(eagle, dict):
        raise EyasError(f"{where}: eagle_config is not an object")
    sglang_ids = eagle.get("eagle_aux_hidden_state_layer_ids")
    if sglang_ids:
        aux = [int(i) + 1 for i in sglang_ids]
    elif verifier is not None:
        aux = list(verifier.aux_layer_ids)
    else:
        raise EyasError(f"{where} has no eagle_config.eagle_aux_hidden_state_layer_ids; pass --verifier so eyas "
                        "uses the verifier's default aux layers [2, L//2, L-3], as SGLang does")  # fmt: skip
    # SGLang reads no layer_types (its draft window is a server flag), so neither do we.
    layer = {k: v for k, v in c.items() if k not in ("layer_types", "use_sliding_window")}
    layer["model_type"] = "llama"
    spec_like = {
        "speculators_model_type": "eagle3",
        "transformer_layer_config": layer,
        "draft_vocab_size": c.get("draft_vocab_size") or c["vocab_size"],
        "eagle_aux_hidden_state_layer_ids": aux,
        "target_hidden_size": c.get("target_hidden_size"),
        "norm_before_residual": False,
        "norm_before_fc": bool(eagle.get("norm_before_fc", c.get("norm_before_fc", False))),
        "fc_norm": bool(c.get("fc_norm") or c.get("use_aux_norm")),  # use_aux_norm: SGLang's older name
        "norm_output": bool(c.get("norm_output", False)),
    }
    cfg = draft_config_from_dict(spec_like, where=where)
    if not tensors:
        return Draft(cfg, {})
    weights = draft_files(src, "eagle")[0]
    return Draft(cfg, check_eagle_tensors(_load_weights(weights), cfg, where=str(weights)))


def check_eagle_tensors(tensors: dict[str, Any], cfg: DraftConfig, *, where: str) -> dict[str, Any]:
    """EAGLE-named tensors (or anything with a ``.shape``) under eyas's names, each key and shape checked.

    A later layer's input norm counts as SGLang reads it (``hidden_norm``); a copy under ``input_layernorm``
    (what vLLM reads) must hold the same values, so that both engines run one draft."""
    tensors = dict(tensors)
    for key in [k for k in tensors if (m := _LATER_INPUT_NORM.fullmatch(k)) and m[2] == "input_layernorm"]:
        sglang = key.replace(".input_layernorm.", ".hidden_norm.")
        if sglang not in tensors:
            raise EyasError(f"{where} has {key!r} but no {sglang!r}, the input norm SGLang reads for that layer; "
                            "SGLang would run it with another norm than vLLM")  # fmt: skip
        a, b = tensors.pop(key), tensors[sglang]
        if isinstance(a, torch.Tensor) and isinstance(b, torch.Tensor) and not torch.equal(a, b):
            raise EyasError(f"{where}: {key!r} and {sglang!r} differ; vLLM reads the first, SGLang the second")
    renamed = {_eagle_to_eyas_key(k): v for k, v in tensors.items()}
    if len(renamed) != len(tensors):
        raise EyasError(f"{where}: holds both midlayer.* and layers.0.* (or aux_norm_* and fc_norm.*) copies of "
                        "the same tensor")  # fmt: skip
    file_names = {_eagle_to_eyas_key(k): k for k in tensors}
    check_tensors(renamed, cfg, where=where, file_key=lambda k: file_names.get(k, _eyas_to_eagle_key(k)))
    return renamed


def _load_weights(path: Path) -> dict[str, torch.Tensor]:
    """Tensors from safetensors, or from a ``.bin`` with ``torch.load(weights_only=True)`` (no pickled code)."""
    if path.suffix == ".safetensors":
        from safetensors import SafetensorError, safe_open

        try:
            with safe_open(str(path), framework="pt") as f:
                return {k: f.get_tensor(k) for k in f.keys()}
        except SafetensorError as e:
            raise EyasError(f"{path} is not a readable safetensors file ({e})") from e
    try:
        sd = torch.load(path, map_location="cpu", weights_only=True)
    except Exception as e:  # noqa: BLE001 (any unpickling failure is the same bad file to the user)
        raise EyasError(f"{path} is not a readable PyTorch weights file ({e})") from e
    if not isinstance(sd, dict) or not all(isinstance(v, torch.Tensor) for v in sd.values()):
        raise EyasError(f"{path} does not hold a flat dict of tensors")
    return sd


# --------------------------------------------------------------------------- writing


def eagle_config_dict(cfg: DraftConfig, *, dtype: str = "bfloat16") -> dict[str, Any]:
    """The EAGLE/SGLang config.json: a Llama config plus what ``sglang/srt/models/llama_eagle3.py`` reads."""
    conf = decoder_layer_config(cfg)
    conf.update({
        "architectures": [EAGLE_ARCHITECTURE],
        "model_type": "llama",
        "draft_vocab_size": cfg.draft_vocab_size,
        # SGLang ties lm_head to embed_tokens when this is true (llama_eagle3.py, LlamaForCausalLMEagle3).
        "tie_word_embeddings": False,
        "eagle_config": {
            "eagle_aux_hidden_state_layer_ids": [i - 1 for i in cfg.aux_layer_ids],  # SGLang adds one back
            "use_aux_hidden_state": True,
        },
        "norm_before_residual": False,  # what SGLang runs; vLLM's EAGLE path reads it with default false
        "norm_before_fc": cfg.norm_before_fc,
        "fc_norm": cfg.fc_norm,
        "norm_output": cfg.norm_output,
        "dtype": dtype,
        "eyas_version": __version__,
    })  # fmt: skip
    if cfg.target_hidden_size and cfg.target_hidden_size != cfg.hidden_size:
        conf["target_hidden_size"] = cfg.target_hidden_size  # SGLang's hasattr() check breaks on a null here
    return conf


def eagle_tensors(cfg: DraftConfig, tensors: dict[str, torch.Tensor], *, dtype: torch.dtype) -> dict[str, torch.Tensor]:
    """Tensors under EAGLE names (``midlayer.*``; a later layer's input norm under both the name SGLang reads
    and the one vLLM reads), floating ones cast to ``dtype``; ``d2t``/``t2d`` always present (SpecForge's
    ``to_sglang`` export requires them; SGLang turns d2t into its hot-token ids)."""
    tensors = dict(tensors)
    if "d2t" not in tensors:  # a full-vocab draft: identity maps
        tensors["d2t"] = torch.zeros(cfg.draft_vocab_size, dtype=torch.long)
        tensors["t2d"] = torch.ones(cfg.vocab_size, dtype=torch.bool)
    out = {}
    for k, v in tensors.items():
        v = (v.to(dtype) if v.is_floating_point() else v).contiguous()
        out[_eyas_to_eagle_key(k)] = v
        if _LATER_INPUT_NORM.fullmatch(k):
            out[k] = v.clone()  # its own storage: safetensors refuses two names for one buffer
    return out
