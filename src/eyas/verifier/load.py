"""Load and run a verifier's parts: the few tensors a draft borrows, the text backbone, the tokenizer.

Nothing here imports code from a checkpoint. :func:`load_head_tensors` reads only the embedding, the output head
and the final norm; :func:`build_text_model` builds the text backbone with transformers' own classes from the
*text* config, remapping weight prefixes (``language_model.model.*`` -> ``model.*``), so a wrapper class
transformers does not know (Kimi-K2.5's ``KimiK25Config`` around ``DeepseekV3Config``) still runs;
:class:`HiddenStateCapture` reads the aux and pre-norm last hidden states off any forward of it. What a
checkpoint holds is learnt first, without loading it, by :func:`eyas.verifier.info.resolve`.
"""

from __future__ import annotations

import contextlib
import copy
import json
import os
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Iterator

import torch
from torch import nn

from eyas.core.errors import EyasError
from eyas.core.files import atomic_path
from eyas.verifier.locate import DEMO_VERIFIER, locate_checkpoint, weight_refs
from eyas.verifier.info import TensorRef, VerifierInfo, resolve, transformers_text_config

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
        from eyas.verifier.gguf_header import gguf_header, read_gguf_tensor

        arr = read_gguf_tensor(gguf_header(Path(info.path)), ref.key)
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
    (:mod:`eyas.verifier.packed`) unless ``packed`` is false, when transformers dequantizes them while loading."""
    cfg = json.loads((info.checkpoint_dir / "config.json").read_text())
    q = copy.deepcopy(cfg.get("quantization_config") or info.text_config.get("quantization_config"))
    if q and q.get("quant_method") == "compressed-tensors":
        if packed:
            from eyas.verifier.packed import packed_quantization_config

            per_expert = any(_PER_EXPERT_KEY.search(k) for k in weight_refs(info.checkpoint_dir))
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
    decompressed per matmul (:mod:`eyas.verifier.packed`), or, with ``packed=False``,
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
            model, loading = _from_gguf(info, kwargs, cache=device_map is None)
        else:
            cfg = transformers_text_config(info)
            q = _text_quantization_config(info, packed=packed)
            if q:
                cfg.quantization_config = q
            model, loading = AutoModelForCausalLM.from_pretrained(
                info.checkpoint_dir, config=cfg, key_mapping=key_mapping(info), **kwargs
            )
            if q:
                cast_floating(model, dtype)
                if packed:  # the cast replaces tensors the stacked MoE experts viewed: stack those again
                    from eyas.verifier.packed import stack_experts

                    stack_experts(model)
    check_loaded(model, loading, where=info.path)
    if device is not None and device_map is None:
        model = model.to(device)
    return model.eval()


#: Where dequantized GGUF weights are kept for the next load in this process (set by :func:`gguf_weights_cache`).
_GGUF_CACHE: Path | None = None


@contextlib.contextmanager
def gguf_weights_cache(folder: str | os.PathLike) -> Iterator[None]:
    """Inside the block, a GGUF verifier's weights are dequantized once and kept in ``folder`` as safetensors
    (one copy per file and dtype), which later loads read instead. `eyas run` keeps them in its run folder: each
    of its stages loads the verifier, and transformers' GGUF loader takes about 20 s for SmolLM2-135M (it parses
    the file twice and builds a tensor-name map per tensor), where the safetensors copy loads in about 1 s. No
    copy is kept where the disk has less than twice its size free. The GGUF's tokenizer is kept there too
    (:func:`_gguf_tokenizer`)."""
    global _GGUF_CACHE
    before, _GGUF_CACHE = _GGUF_CACHE, Path(folder)
    try:
        yield
    finally:
        _GGUF_CACHE = before


def _from_gguf(info: VerifierInfo, kwargs: dict[str, Any], *, cache: bool):
    """``from_pretrained`` of a GGUF verifier, through :data:`_GGUF_CACHE` when one is set and ``cache``."""
    import hashlib
    import shutil

    from transformers import AutoModelForCausalLM

    folder = None
    if cache and _GGUF_CACHE is not None:
        st = (Path(info.checkpoint_dir) / info.gguf_file).stat()
        key = json.dumps([str(Path(info.path).resolve()), st.st_size, st.st_mtime_ns, str(kwargs["dtype"])])
        folder = _GGUF_CACHE / hashlib.sha256(key.encode()).hexdigest()[:16]
        if (folder / "model.safetensors").is_file():
            return AutoModelForCausalLM.from_pretrained(folder, **kwargs)
    model, loading = AutoModelForCausalLM.from_pretrained(info.checkpoint_dir, gguf_file=info.gguf_file, **kwargs)
    if folder is not None:
        from safetensors.torch import save_model

        size = sum(t.numel() * t.element_size() for t in {p.data_ptr(): p for p in model.parameters()}.values())
        folder.parent.mkdir(parents=True, exist_ok=True)
        if shutil.disk_usage(folder.parent).free < 2 * size:  # a copy must not fill the disk a run writes to
            return model, loading
        config = model.config.to_dict()
        config.pop("quantization_config", None)  # the copy holds plain weights
        with atomic_path(folder, is_dir=True) as tmp:  # whole or not at all
            (tmp / "config.json").write_text(json.dumps(config, indent=2))
            save_model(model, str(tmp / "model.safetensors"))  # tied weights once, as transformers reads them back
    return model, loading


def cast_floating(model, dtype: torch.dtype) -> None:
    """Give a quantized model's floating parameters ``dtype`` in place, where transformers' ``.to(dtype)`` and
    ``.float()`` refuse any model loaded through a quantizer (a GGUF verifier's dequantized one included).

    Used while loading, because transformers 5.17 loads every
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
    info = path_or_info if isinstance(path_or_info, VerifierInfo) else resolve(path_or_info)
    # one load per checkpoint and process, a copy each call (a stage may change its tokenizer): building
    # SmolLM2's from its GGUF takes 4-6 s, and `eyas run` loads it in every stage, skipped ones included
    key = (_tokenizer_stamp(info), trust_remote_code)
    if key not in _TOKENIZERS:
        _TOKENIZERS.clear()  # one checkpoint at a time is what a process uses
        _TOKENIZERS[key] = _load_tokenizer(info, trust_remote_code=trust_remote_code)
    try:
        tok = copy.deepcopy(_TOKENIZERS[key])
    except Exception:  # a remote-code tokenizer that does not copy: load it again
        tok = _load_tokenizer(info, trust_remote_code=trust_remote_code)
    if chat_template is not None:
        tok.chat_template = read_chat_template(chat_template)
        check_template_renders(tok, where=f"--chat-template {chat_template}")
    return tok


_TOKENIZERS: dict[tuple, Any] = {}


def _tokenizer_stamp(info: VerifierInfo) -> tuple:
    """What a cached tokenizer of ``info`` was built from: the GGUF file, or the checkpoint folder's files other
    than weights, each by name, size and modification time (a file rewritten in place is a new tokenizer)."""
    folder = Path(info.checkpoint_dir)
    if info.gguf_file:
        files = [folder / info.gguf_file]
    else:
        weights = (".safetensors", ".bin", ".pt", ".pth", ".gguf", ".h5", ".msgpack")
        files = sorted(p for p in folder.iterdir() if p.is_file() and not p.name.endswith(weights)) \
            if folder.is_dir() else []  # fmt: skip
    stamp = []
    for p in files:
        st = p.stat()
        stamp.append((str(p), st.st_size, st.st_mtime_ns))
    return tuple(stamp) or (str(folder),)


def _load_tokenizer(info: VerifierInfo, *, trust_remote_code: bool):
    from transformers import AutoTokenizer

    with _quiet_transformers():
        try:
            if info.gguf_file:
                tok = _gguf_tokenizer(info)
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
    return tok


def _gguf_tokenizer(info: VerifierInfo):
    """A GGUF verifier's tokenizer, through :data:`_GGUF_CACHE` when one is set: transformers builds it from the
    GGUF's metadata in 3.7 s for SmolLM2 (2-core CPU), a saved copy loads in 0.24 s (the same ids for 2,000
    ShareGPT texts, the same template and special tokens), and every call of a resumed `eyas run` loads it."""
    import hashlib

    from transformers import AutoTokenizer

    if _GGUF_CACHE is None:
        return AutoTokenizer.from_pretrained(info.checkpoint_dir, gguf_file=info.gguf_file)
    key = json.dumps([str(Path(info.path).resolve()), *map(list, _tokenizer_stamp(info))])
    folder = _GGUF_CACHE / f"tokenizer-{hashlib.sha256(key.encode()).hexdigest()[:16]}"
    if (folder / "tokenizer_config.json").is_file():
        return AutoTokenizer.from_pretrained(folder)
    tok = AutoTokenizer.from_pretrained(info.checkpoint_dir, gguf_file=info.gguf_file)
    with atomic_path(folder, is_dir=True) as tmp:  # whole or not at all
        tok.save_pretrained(tmp)
    return tok


def check_template_renders(tok, *, where: str) -> None:
    """Render a one-exchange conversation: a template with a Jinja syntax error, an unknown filter or test, or a
    ``raise_exception`` on a plain user/assistant exchange is one line naming ``where`` and the template line."""
    import jinja2

    probe = [{"role": "user", "content": "a question?"}, {"role": "assistant", "content": "an answer."}]
    try:
        tok.apply_chat_template(probe, tokenize=False)
    except jinja2.TemplateError as e:
        line = getattr(e, "lineno", None)
        tb = e.__traceback__
        while tb is not None:  # a runtime error: the deepest frame jinja maps back to the template
            if tb.tb_frame.f_code.co_filename == "<template>":
                line = tb.tb_lineno
            tb = tb.tb_next
        at = f", line {line}" if line else ""
        raise EyasError(f"{where}{at}: the chat template fails on a plain user/assistant exchange "
                        f"({type(e).__name__}: {e}); fix the template") from None  # fmt: skip


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
                ckpt, gguf_file = locate_checkpoint(source)
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
    from eyas.core.files import sha256_file

    return {p.name: sha256_file(p) for p in sorted(info.checkpoint_dir.glob("*.py"))}


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
