"""What eyas knows about a verifier before loading it: :class:`VerifierInfo`, learnt by :func:`resolve` from the
checkpoint's config and weight headers alone (or GGUF metadata), so resolving a 600 GB checkpoint takes seconds.

The text model is found inside nested multimodal wrappers (Kimi-K2.5's ``text_config``), the embedding, output
head and final norm by suffix and shape across sharded indexes; :func:`fingerprint` is the verifier's cheap
identity in manifests and :func:`inspect` (``eyas inspect``) prints what was found. Nothing here imports code
from a checkpoint.
"""

from __future__ import annotations

import contextlib
import hashlib
import importlib.util
import os
import re
import struct
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any, Sequence

from eyas.core.errors import EyasError
from eyas.verifier.gguf_header import gguf_header
from eyas.verifier.locate import (TensorRef, config_for, known_causal_lm, locate_checkpoint, read_config, text_model_type,
                         weight_refs)  # fmt: skip

EMBED_SUFFIXES = ("embed_tokens.weight", "tok_embeddings.weight", "word_embeddings.weight", "wte.weight")
HEAD_SUFFIXES = ("lm_head.weight", "output.weight")
NORM_NAMES = ("norm.weight", "final_layernorm.weight", "ln_f.weight", "norm_f.weight")

_GGUF_ARCH = {"llama": "llama", "mistral": "mistral", "qwen2": "qwen2", "qwen3": "qwen3", "gemma2": "gemma2",
              "gemma3": "gemma3", "phi3": "phi3", "qwen2moe": "qwen2_moe", "qwen3moe": "qwen3_moe"}  # fmt: skip


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


def check_aux_layer_ids(
    ids: Sequence[int], num_layers: int | None = None, *, what: str = "--layers", final: bool = False
) -> list[int]:
    """The one check of aux layer ids, wherever they come from (``--layers``, a features manifest, a draft's
    config): exactly three distinct ids (EAGLE-3's ``fc`` fuses three states), returned ascending (the order
    both engines concatenate them in). ``what`` names them in the error.

    With the verifier's layer count ``num_layers`` (L) each id must be a state the verifier has: ``1..L-1``.
    Id 0 is refused: vLLM captures ``hidden_states + residual`` and the residual does not exist before layer 0,
    and SGLang's export writes ``id - 1``. ``final=True`` also admits L, the final hidden state, which a draft
    made elsewhere may read (vLLM serves it; SGLang never captures it).
    """
    try:
        checked = [int(i) for i in ids]
    except (TypeError, ValueError):
        raise EyasError(f"{what} must list three layer ids, got {ids!r}") from None
    if len(checked) != 3 or len(set(checked)) != 3:
        raise EyasError(f"{what} must list three distinct layer ids (EAGLE-3's fc fuses 3 states), got {checked}")
    if num_layers is not None:
        top = num_layers if final else num_layers - 1
        bad = [i for i in checked if not 1 <= i <= top]
        if bad:
            raise EyasError(f"{what}: layer id(s) {bad} out of range for a verifier with {num_layers} layers: use "
                            f"ids 1..{top} (id i is the hidden state entering decoder layer i)")  # fmt: skip
    return sorted(checked)


def transformers_text_config(info: VerifierInfo):
    """The text config as a transformers config object (its class from transformers, never remote code)."""
    from transformers import AutoConfig

    if info.gguf_file:
        return AutoConfig.from_pretrained(info.checkpoint_dir, gguf_file=info.gguf_file)
    return config_for(info.text_model_type, info.text_config)


# --------------------------------------------------------------------------- resolve


def resolve(path: str | os.PathLike) -> VerifierInfo:
    """Learn a verifier's layout from its config and weight headers alone.

    ``path`` is a checkpoint directory, a ``.gguf`` file, ``"smollm2"`` (the demo
    verifier), or a hub id when online. Raises :class:`EyasError` naming the
    file and key for any input eyas cannot use.
    """
    ckpt, gguf_name = locate_checkpoint(path)
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
    refs = weight_refs(ckpt)
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
    return [
        f"{cfg_path} says num_hidden_layers={num_layers} but the weights hold no {prefix}layers.{absent[0]}.* "
        f"({len(absent)} of the {num_layers} layers are absent); the checkpoint is incomplete or its config does "
        "not belong to it"
    ]


def _runnable_reasons(text_type: str, quantization: str) -> list[str]:
    reasons = []
    if not known_causal_lm(text_type):
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

    header = gguf_header(ckpt / name)

    def field_value(key: str, default: Any = None) -> Any:
        v = header.fields.get(key)
        return default if v is None else v

    arch = field_value("general.architecture")
    if arch is None:
        raise EyasError(f"{ckpt / name}: GGUF file without general.architecture")
    H = int(field_value(f"{arch}.embedding_length"))
    L = int(field_value(f"{arch}.block_count"))
    tensors = header.tensors

    def ref(tname: str) -> TensorRef:
        t = tensors[tname]
        shape = tuple(reversed(t.dims))  # GGUF lists dims innermost first
        return TensorRef(tname, name, f"gguf:{gguf.GGMLQuantizationType(t.ggml_type).name}", shape)

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
    for name in sorted({r.file for r in weight_refs(ckpt).values()}):
        p = ckpt / name
        with open(p, "rb") as f:
            (n,) = struct.unpack("<Q", f.read(8))
            files[name] = {"size": p.stat().st_size, "header_sha256": hashlib.sha256(f.read(n)).hexdigest()}
    out["files"] = files
    return out
