"""``eyas plan``: what training a draft for a verifier will take, from its config alone.

For a verifier, a token count and a machine (``--gpus K --gpu-memory G``), before anything is downloaded or
loaded: the verifier's memory packed (as eyas keeps compressed-tensors weights, :mod:`eyas.verifier.packed`) and
dequantized to bf16, how it splits over the GPUs, the features' bytes per token in bf16 and fp8, whether to
train offline (features on disk) or online (the verifier in the loop) and why, and the GPU-hours, estimated
from the throughputs in docs/BENCHMARKS.md (:data:`MEASURED`).

The parameters are counted on transformers' own model class built on the meta device from the text config
(no weights, no memory), so every architecture transformers knows is counted exactly; when the checkpoint's
safetensors are present, the packed size is read from their headers instead.
"""

from __future__ import annotations

import math
import re
import shutil
from dataclasses import dataclass
from pathlib import Path
from typing import Any, ClassVar

from eyas.core.config import StageConfig, option, stage_function
from eyas.core.errors import EyasError
from eyas.core.validate import ABOVE_0, AT_LEAST_0, AT_LEAST_1

#: Figures the estimate uses, each measured on one H200 (torch 2.11, transformers 5.17) and recorded in
#: docs/BENCHMARKS.md, each named by the commit that recorded it:
MEASURED = {
    # eyas extract at commit 4670df4, against the bare forward: SmolLM2-135M's bare backbone forward, bf16,
    # 32k-token batches: 548,028 tokens/s. Its backbone is 106.2M parameters (134.5M less the 28.3M embedding, which is
    # a lookup), 2 FLOP each per token: 0.212 GFLOP/token, so 116 TFLOP/s of useful work. A verifier's
    # forward is estimated at this rate over its *active* parameters (MoE: the experts a token is routed to).
    "verifier_flop_per_s": 548_028 * 2 * 106.2e6,
    # eyas extract at commit b9c9719: extraction (capture, copy to host, write) at 0.92x the bare forward in the
    # steady state, bf16 to RAM; a local disk took 1.24 GB/s with fsync, the bound when features are large.
    "extract_fraction": 0.92,
    "disk_bytes_per_s": 1.24e9,
    # eyas train at commit 2f32da3, Kimi-K2.5 draft dims (H 7168, vocab 163840, sequence 2048, TTT 3): 33,820
    # tokens/s on one H200; at commit d42f3e5, Llama-3.1-8B dims (H 4096): 64,910.
    "draft_tokens_per_s": 33_820,
    "draft_tokens_per_s_4096": 64_910,
    # eyas train at commit b9c9719: DDP over two H200s at Llama-3.1-8B dims, 87.6% scaling efficiency.
    "ddp_efficiency": 0.876,
    # int4 verifiers kept packed (eyas.verifier.packed), at commit 9234ca9 (`bash bench/gpu/extract.sh int4`, one H200,
    # torch 2.11, transformers 5.17): the backbone forward of a random int4 MoE verifier of Kimi-K2.5's layer
    # dims (4 layers, 128 experts), 8 x 2048 tokens, took 285.9 ms packed (stacked experts multiplied by eyas'
    # int4 grouped GEMM, eyas.verifier.int4_matmul) against 202.9 ms for the same model in bf16 (transformers'
    # grouped_mm experts): 80,757 over 57,308 tokens/s. At 4 x 1024 tokens it was 1.50x.
    "packed_forward_slowdown": 80_757 / 57_308,
}

#: The one public EAGLE-3 run at Kimi-K2.5's scale, beside which `eyas plan` prints its estimate: the
#: Kimi-K2.5 draft, about 6B tokens (600k regenerated samples) in about 1,500 H200-hours (docs/SCALING.md).
PUBLIC_KIMI_RUN = {"tokens": 6e9, "gpu_hours": 1500.0}

#: Share of a GPU's memory the verifier's weights may take; the rest is left to activations, the CUDA
#: context, and (online) the draft, which peaked at 12.97 GiB at Kimi-K2.5 dims (docs/BENCHMARKS.md, commit 912458c).
USABLE_FRACTION = 0.9

FEATURE_STATES = 4  # three aux states and the last, as eyas extract stores them


@dataclass
class Tensor:
    """One checkpoint tensor as plan counts it: its module, its dense element count, its bytes as stored."""

    name: str
    numel: int
    stored_bytes: int
    layer: int | None  # the decoder layer it belongs to (None: embedding, head, final norm)
    active_share: float = 1.0  # share of tokens that use it (a routed expert: top_k / experts)


# --------------------------------------------------------------------------- quantization


def _matches(name: str, module_class: str, patterns: list[str]) -> bool:
    """compressed-tensors' target/ignore matching (``compressed_tensors.utils.match``): ``re:`` patterns match
    the module name from its start (``re.match``), others the exact name or the module's class name. Written
    out so plan runs without compressed-tensors installed; tests/unit/test_plan.py checks it against the library."""
    for p in patterns:
        if p.startswith("re:"):
            if re.match(p[3:], name):
                return True
        elif p in (name, module_class):
            return True
    return False


@dataclass
class Scheme:
    """A compressed-tensors weight scheme: bits, strategy, group size, symmetry, and the format it packs to."""

    num_bits: int
    strategy: str
    group_size: int | None
    symmetric: bool
    format: str
    targets: list[str]

    def stored_bytes(self, out_features: int, in_features: int, scale_bytes: int) -> int:
        """Bytes of one ``[out, in]`` weight as stored: the values, the scales, the zero points and the shape."""
        if self.format == "pack-quantized":  # num_bits values packed densely into int32 words per row
            values = out_features * math.ceil(in_features * self.num_bits / 32) * 4
        else:  # naive- and float-quantized: one byte per value
            values = out_features * in_features * max(1, self.num_bits // 8)
        groups = {"group": math.ceil(in_features / (self.group_size or in_features)), "channel": 1,
                  "tensor": 0}.get(self.strategy, 1)  # fmt: skip
        scales = (out_features * groups if groups else 1) * scale_bytes
        zero_points = 0 if self.symmetric else scales
        shape = 2 * 8 if self.format == "pack-quantized" else 0  # weight_shape: two int64
        return values + scales + zero_points + shape


def _schemes(q: dict[str, Any] | None) -> tuple[list[Scheme], list[str]]:
    if not q or q.get("quant_method") != "compressed-tensors":
        return [], []
    schemes = []
    for group in (q.get("config_groups") or {}).values():
        w = group.get("weights")
        if not w:
            continue
        schemes.append(Scheme(num_bits=int(w["num_bits"]), strategy=str(w.get("strategy", "tensor")),
                              group_size=w.get("group_size"), symmetric=bool(w.get("symmetric", True)),
                              format=str(group.get("format") or q.get("format", "dense")),
                              targets=list(group.get("targets", []))))  # fmt: skip
    return schemes, list(q.get("ignore") or [])


# --------------------------------------------------------------------------- counting


def _layer_of(name: str) -> int | None:
    m = re.search(r"\.layers\.(\d+)\.", name)
    return int(m.group(1)) if m else None


def count_tensors(text_model_type: str, text_config: dict[str, Any], quantization: dict[str, Any] | None, *,
                  prefix: str = "") -> list[Tensor]:  # fmt: skip
    """Every checkpoint tensor of the text model, counted on transformers' class built on the meta device.
    Fused MoE experts (``experts.gate_up_proj [E, 2I, H]``) count as the per-expert Linears a checkpoint
    stores; a Linear that the quantization config targets (and does not ignore) counts at its packed size.
    ``prefix``: the text model's prefix in the checkpoint (``language_model.``), stripped from ignore names."""
    import torch
    from transformers import AutoModelForCausalLM

    from eyas.verifier.locate import config_for

    cfg = config_for(text_model_type, text_config)
    with torch.device("meta"):
        skeleton = AutoModelForCausalLM.from_config(cfg)
    schemes, ignore = _schemes(quantization)
    ignore = [i.removeprefix(prefix) for i in ignore]
    scale_bytes = 2  # checkpoints keep scales in their dtype: bf16 for every release this is for
    top_k = int(text_config.get("num_experts_per_tok") or 0)
    out, seen = [], set()

    def linear(name: str, shape: tuple[int, int], module_class: str, share: float = 1.0) -> Tensor:
        n = shape[0] * shape[1]
        scheme = next((s for s in schemes if _matches(name, module_class, s.targets)), None)
        if scheme is not None and not _matches(name, module_class, ignore):
            return Tensor(name, n, scheme.stored_bytes(shape[0], shape[1], scale_bytes), _layer_of(name), share)
        return Tensor(name, n, 2 * n, _layer_of(name), share)

    for key, t in skeleton.state_dict(keep_vars=True).items():
        if id(t) in seen:
            continue  # a tied head
        seen.add(id(t))
        module_name, _, param = key.rpartition(".")
        module = skeleton.get_submodule(module_name)
        if t.dim() == 3 and param in ("gate_up_proj", "down_proj"):  # fused experts [E, out, in]
            E, o, i = t.shape
            share = min(1.0, top_k / E) if top_k else 1.0
            projs = ("gate_proj", "up_proj") if param == "gate_up_proj" else ("down_proj",)
            for proj in projs:  # expert 0 decides for all: quantization configs name experts by pattern
                one = linear(f"{module_name}.0.{proj}", (o // len(projs), i), "Linear", share)
                out.append(Tensor(f"{module_name}.*.{proj}", one.numel * E, one.stored_bytes * E, one.layer, share))
        elif param == "weight" and t.dim() == 2 and isinstance(module, torch.nn.Linear):
            out.append(linear(module_name, tuple(t.shape), type(module).__name__))
        else:
            out.append(Tensor(key, t.numel(), 2 * t.numel() if t.is_floating_point() else t.numel() * t.element_size(),
                              _layer_of(key)))  # fmt: skip
    return out


_DTYPE_BYTES = {"float64": 8, "float32": 4, "float16": 2, "bfloat16": 2, "float8_e4m3fn": 1, "float8_e5m2": 1,
                "int64": 8, "int32": 4, "int16": 2, "int8": 1, "uint8": 1, "bool": 1}  # fmt: skip
_COMPANION = re.compile(r"\.(weight_(scale|shape|zero_point|global_scale)|input_(scale|global_scale))$")


def header_bytes(path: Path, top: str, num_bits: int) -> tuple[int, int] | None:
    """(bytes as stored, bytes in bf16) of the text model's tensors from the safetensors headers, or None when
    the checkpoint has no weights. Only keys under ``top`` (a wrapper's ``language_model.``) count, so a vision
    tower is left out. A ``weight_packed`` int32 tensor holds ``32 / num_bits`` weights per element; its
    scales and shape are companions with no dense counterpart."""
    from eyas.verifier.locate import weight_refs

    try:
        refs = weight_refs(path)
    except EyasError:
        return None
    stored = bf16 = 0
    for ref in refs.values():
        if not ref.key.startswith(top):
            continue
        n = math.prod(ref.shape)
        stored += n * _DTYPE_BYTES.get(ref.dtype, 2)
        if ref.key.endswith(".weight_packed"):
            bf16 += 2 * n * (32 // num_bits)
        elif not _COMPANION.search(ref.key):
            bf16 += n * (2 if ref.dtype.startswith(("float", "bfloat")) else _DTYPE_BYTES.get(ref.dtype, 2))
    return stored, bf16


# --------------------------------------------------------------------------- the plan


def verifier_memory(verifier: str | Path) -> dict[str, Any]:
    """The verifier's weights: bytes packed and in bf16, parameters, active parameters per token, and the
    packed bytes per decoder layer (for the split over GPUs)."""
    from eyas.verifier.locate import locate_checkpoint, read_config, text_model_type

    path, gguf = locate_checkpoint(verifier)  # (a file or a missing path is one line there)
    if gguf:
        raise EyasError(f"{path / gguf} is a GGUF file: `eyas plan` reads a config.json and safetensors headers; "
                        "give the checkpoint directory (`eyas inspect` reads GGUF files)")  # fmt: skip
    cfg, key, text = read_config(path)
    text_type = text_model_type(text, cfg)
    q = cfg.get("quantization_config") or text.get("quantization_config")
    prefix = "language_model." if key else ""
    tensors = count_tensors(str(text_type), text, q, prefix=prefix)
    packed = sum(t.stored_bytes for t in tensors)
    bf16 = sum(2 * t.numel for t in tensors)
    source = "config"
    schemes, _ = _schemes(q)
    from_headers = header_bytes(path, prefix, schemes[0].num_bits if schemes else 16)
    if from_headers is not None:
        packed, bf16 = from_headers
        source = "safetensors headers"
    L = int(text["num_hidden_layers"])

    def items(size) -> list[int]:  # the embedding, each layer, then the final norm and the head
        per = [0] * (L + 2)
        for t in tensors:
            per[0 if "embed_tokens" in t.name else L + 1 if t.layer is None else t.layer + 1] += size(t)
        return per

    backbone = [t for t in tensors if "lm_head" not in t.name and "embed_tokens" not in t.name]
    return {
        "path": str(path), "text_model_type": text_type, "hidden_size": int(text["hidden_size"]),
        "num_hidden_layers": L, "vocab_size": int(text.get("vocab_size") or cfg.get("vocab_size")),
        "quantization": (q or {}).get("quant_method", "none"), "source": source,
        "parameters": sum(t.numel for t in tensors),
        "active_backbone_parameters": round(sum(t.numel * t.active_share for t in backbone)),
        "packed_bytes": packed, "bf16_bytes": bf16,
        "placement_items": items(lambda t: t.stored_bytes), "placement_items_bf16": items(lambda t: 2 * t.numel),
    }  # fmt: skip


def place(items: list[int], cap: float) -> list[int] | None:
    """Bytes per GPU when ``items`` (the embedding, the layers in order, the final norm and head) fill GPUs one
    after another, each up to ``cap`` bytes, an item never cut (as a ``device_map`` places whole layers); None
    when one item alone is over ``cap``."""
    if max(items) > cap:
        return None
    out = [0]
    for b in items:
        if out[-1] + b > cap:
            out.append(0)
        out[-1] += b
    return out


def split(items: list[int], gpus: int, cap: float) -> list[int]:
    """The most even placement of ``items`` over ``gpus`` GPUs of ``cap`` bytes each: the smallest per-GPU
    budget under which :func:`place` needs no more GPUs (found by bisection)."""
    lo, hi = max(max(items), sum(items) / gpus), cap
    for _ in range(60):
        mid = (lo + hi) / 2
        fits = place(items, mid)
        lo, hi = (lo, mid) if fits is not None and len(fits) <= gpus else (mid, hi)
    out = place(items, hi) or []
    return out + [0] * (gpus - len(out))


def choose_mode(*, tokens: int, feature_bytes: dict[str, int], disk_bytes: int, needed: int | None, gpus: int,
                gpu_memory: float) -> tuple[str, str]:  # fmt: skip
    """``offline`` or ``online``, and why. Offline when the features fit the disk in fp8 (the verifier then runs
    once, every epoch reads them), online otherwise (the verifier recomputes them every epoch, nothing is
    stored). A verifier that does not fit the machine cannot run in the loop: its hidden states must come from a
    serving engine, offline."""
    tb = lambda n: f"{n / 1e12:.1f} TB"  # noqa: E731
    fp8, bf16 = tb(feature_bytes["fp8"]), tb(feature_bytes["bf16"])
    if needed is None or needed > gpus:
        return "offline", (f"the packed verifier needs {needed or 'more than ' + str(gpus)} GPUs of {gpu_memory:g} "
                           f"GB and the machine has {gpus}: serve it tensor-parallel in vLLM or SGLang and train "
                           f"from its hidden states ({fp8} in fp8 for {tokens:,} tokens, written and read in slices "
                           f"the {tb(disk_bytes)} disk holds; docs/SCALING.md)")  # fmt: skip
    if feature_bytes["fp8"] <= disk_bytes:
        return "offline", (f"the features of {tokens:,} tokens take {fp8} in fp8 ({bf16} in bf16), within the "
                           f"{tb(disk_bytes)} disk: the verifier runs once and every epoch reads them")  # fmt: skip
    why = (f"the features of {tokens:,} tokens would take {fp8} even in fp8, more than the {tb(disk_bytes)} disk: "
           "the verifier computes them in the training loop, every epoch")  # fmt: skip
    if needed > 1:
        why += (
            f"; spread over {needed} GPUs by a device_map its layers run one GPU at a time, so at this size a "
            "tensor-parallel serving engine is the faster source of hidden states (docs/SCALING.md)"
        )
    return "online", why


def draft_tokens_per_s(hidden_size: int) -> float:
    """eyas train's tokens/s on one H200 for a draft of ``hidden_size``: a power law through the two sizes
    measured (:data:`MEASURED`: 64,910 at 4096, 33,820 at 7168; exponent 1.165)."""
    a = math.log(MEASURED["draft_tokens_per_s_4096"] / MEASURED["draft_tokens_per_s"]) / math.log(7168 / 4096)
    return MEASURED["draft_tokens_per_s"] * (7168 / hidden_size) ** a


def estimate_cost(mem: dict[str, Any], *, mode: str, tokens: int, epochs: int, gpus: int, verifier_gpus: int,
                  feature_bytes_per_token: int) -> dict[str, Any]:  # fmt: skip
    """Wall hours and GPU-hours at :data:`MEASURED`'s rates. A device_map'd verifier runs its layers one GPU at
    a time, so it goes at one GPU's rate and holds ``verifier_gpus``; offline, extraction goes at the slower of
    the verifier and the disk, then the draft trains data-parallel on every GPU; online, the draft trains in the
    verifier's process, a step after each verifier forward."""
    verifier_tps = MEASURED["verifier_flop_per_s"] / (2 * mem["active_backbone_parameters"])
    if mem["quantization"] == "compressed-tensors":
        verifier_tps /= MEASURED["packed_forward_slowdown"]
    draft_tps = draft_tokens_per_s(mem["hidden_size"])
    if mode == "offline":
        extract_tps = min(verifier_tps * MEASURED["extract_fraction"],
                          MEASURED["disk_bytes_per_s"] / feature_bytes_per_token)  # fmt: skip
        verifier_h = tokens / extract_tps / 3600
        train_h = epochs * tokens / (draft_tps * gpus * (MEASURED["ddp_efficiency"] if gpus > 1 else 1.0)) / 3600
        hours = {"verifier": verifier_h * verifier_gpus, "draft": train_h * gpus}
    else:
        verifier_h = epochs * tokens / verifier_tps / 3600
        train_h = epochs * tokens / draft_tps / 3600
        hours = {"verifier": verifier_h * verifier_gpus, "draft": train_h * verifier_gpus}
    hours = {k: round(v, 1) for k, v in hours.items()}
    return {
        "verifier_tokens_per_s": round(verifier_tps),
        "draft_tokens_per_s": round(draft_tps),
        "wall_hours": round(verifier_h + train_h, 1),
        "gpu_hours": hours | {"total": round(sum(hours.values()), 1)},
    }


@dataclass(kw_only=True, frozen=True)
class PlanConfig(StageConfig):
    """Plan a draft's training for a verifier from its config alone: memory, split over GPUs, features, mode, cost.

    Reads config.json (and the safetensors headers when the weights are there); loads nothing."""

    stage: ClassVar[str] = "plan"

    verifier: str = option(
        positional=True,
        aliases=(),
        help="a checkpoint directory (config.json is enough; positional, or --verifier as in every other stage).",
    )
    tokens: int = option(range=AT_LEAST_1, help="training tokens (the prepared rows' tokens).")
    gpus: int = option(8, range=AT_LEAST_1, help="GPUs on the machine.")
    gpu_memory: float = option(141.0, range=ABOVE_0, help="memory of each GPU in GB (1e9 bytes; an H200 has 141).")
    epochs: int = option(1, range=AT_LEAST_1, help="passes over the tokens.")
    disk: float | None = option(
        None, range=AT_LEAST_0, help="disk for features in GB (default: the free space of the current directory)."
    )
    json_out: bool = option(False, help="print one JSON object instead of a table.")


def run(c: PlanConfig) -> dict[str, Any]:
    """Run `eyas plan` as ``c`` describes (see :class:`PlanConfig`)."""
    import json

    mem = verifier_memory(c.verifier)
    usable = USABLE_FRACTION * c.gpu_memory * 1e9
    items = mem["placement_items"]
    placed, placed_bf16 = place(items, usable), place(mem["placement_items_bf16"], usable)
    needed = len(placed) if placed else None  # None: one layer alone is larger than a GPU
    fits = needed is not None and needed <= c.gpus
    per_token = {"bf16": FEATURE_STATES * mem["hidden_size"] * 2, "fp8": FEATURE_STATES * mem["hidden_size"] * 1}
    feature_bytes = {k: v * c.tokens for k, v in per_token.items()}
    disk_bytes = int(c.disk * 1e9) if c.disk is not None else shutil.disk_usage(".").free
    mode, why = choose_mode(tokens=c.tokens, feature_bytes=feature_bytes, disk_bytes=disk_bytes, needed=needed,
                            gpus=c.gpus, gpu_memory=c.gpu_memory)  # fmt: skip
    feature_dtype = "bf16" if feature_bytes["bf16"] <= disk_bytes else "fp8"  # offline: eyas extract --dtype
    cost = estimate_cost(
        mem,
        mode=mode,
        tokens=c.tokens,
        epochs=c.epochs,
        gpus=c.gpus,
        verifier_gpus=needed if fits else c.gpus,
        feature_bytes_per_token=per_token[feature_dtype],
    )
    out = {
        **{k: mem[k] for k in ("path", "text_model_type", "hidden_size", "num_hidden_layers", "vocab_size",
                                "quantization", "source", "parameters", "active_backbone_parameters")},
        "verifier_bytes_packed": mem["packed_bytes"], "verifier_bytes_bf16": mem["bf16_bytes"],
        "gpus": c.gpus, "gpu_memory_bytes": int(c.gpu_memory * 1e9), "gpus_needed": needed,
        "gpus_needed_bf16": len(placed_bf16) if placed_bf16 else None, "verifier_fits": fits,
        "split_bytes": split(items, needed, usable) if fits else None,
        "feature_bytes_per_token": per_token, "tokens": c.tokens, "feature_bytes": feature_bytes,
        "disk_bytes": disk_bytes, "mode": mode, "why": why,
        "feature_dtype": feature_dtype if mode == "offline" else None, "epochs": c.epochs, **cost, "measured": MEASURED,
    }  # fmt: skip
    out["versus_public_kimi_run"] = versus_public_run(out, verifier_gpus=needed if fits else c.gpus)
    if c.json_out:
        print(json.dumps(out, indent=2))
    else:
        _print_table(out)
    return out


plan = stage_function(PlanConfig, run, "plan")


def versus_public_run(p: dict[str, Any], *, verifier_gpus: int) -> dict[str, Any]:
    """The estimate at the public Kimi-K2.5 run's token count (:data:`PUBLIC_KIMI_RUN`), how many times its
    GPU-hours that is, and what would close the difference: each factor the estimate carries that a serving
    engine's prefill would not (a device_map runs the verifier's layers one GPU at a time while it holds
    ``verifier_gpus``; int4 experts slower than bf16, :data:`MEASURED`), and the GPU-hours without
    them. Whatever is left is the verifier's rate, measured on a small model (SmolLM2-135M)."""
    hours = p["gpu_hours"]
    scale = PUBLIC_KIMI_RUN["tokens"] / (p["tokens"] * p["epochs"])
    ours = hours["total"] * scale
    factors = []
    if verifier_gpus > 1:
        factors.append({"what": f"a device_map runs the verifier's layers one GPU at a time on {verifier_gpus} "
                                "GPUs (a tensor-parallel serving engine keeps them all busy, docs/SCALING.md)",
                        "factor": float(verifier_gpus)})  # fmt: skip
    if p["quantization"] == "compressed-tensors" and MEASURED["packed_forward_slowdown"] > 1:
        factors.append({"what": "int4 experts through eyas' Triton int4 grouped GEMM, slower than bf16 (measured, "
                                "docs/BENCHMARKS.md); a tuned int4 MoE GEMM such as vLLM's Marlin MoE reads a "
                                "quarter of bf16's bytes and can match it",
                        "factor": round(MEASURED["packed_forward_slowdown"], 2)})  # fmt: skip
    without = hours["verifier"] * scale
    for f in factors:
        without /= f["factor"]
    without += hours["draft"] * scale / (verifier_gpus if p["mode"] == "online" else 1)
    return {"gpu_hours": round(ours, 1), "times": round(ours / PUBLIC_KIMI_RUN["gpu_hours"], 2),
            "factors": factors, "gpu_hours_without": round(without, 1),
            "times_without": round(without / PUBLIC_KIMI_RUN["gpu_hours"], 2)}  # fmt: skip


def _print_table(p: dict[str, Any]) -> None:
    gb = lambda n: f"{n / 1e9:,.1f} GB"  # noqa: E731
    tb = lambda n: f"{n / 1e12:,.1f} TB"  # noqa: E731
    hours = p["gpu_hours"]
    rows = [
        ("verifier", f"{p['path']} ({p['text_model_type']}, {p['parameters'] / 1e9:,.1f}B parameters, "
                     f"{p['active_backbone_parameters'] / 1e9:,.1f}B active per token)"),
        ("weights packed", f"{gb(p['verifier_bytes_packed'])} ({p['quantization']}; from the {p['source']})"),
        ("weights in bf16", gb(p["verifier_bytes_bf16"])),
        ("GPUs needed", f"{p['gpus_needed']} packed, {p['gpus_needed_bf16']} in bf16, of "
                        f"{gb(p['gpu_memory_bytes'])} ({p['gpus']} on this machine)"),
        ("split", ", ".join(gb(b) for b in p["split_bytes"]) if p["split_bytes"] else "does not fit"),
        ("features per token", f"{p['feature_bytes_per_token']['bf16']:,} B in bf16, "
                               f"{p['feature_bytes_per_token']['fp8']:,} B in fp8"),
        ("features in all", f"{tb(p['feature_bytes']['bf16'])} in bf16, {tb(p['feature_bytes']['fp8'])} in fp8"),
        ("mode", f"{p['mode']}: {p['why']}"),
        ("estimate", f"{p['wall_hours']:,} h wall, {hours['total']:,} GPU-hours (verifier {hours['verifier']:,}, "
                     f"draft {hours['draft']:,}) at the rates of docs/BENCHMARKS.md"),
    ]  # fmt: skip
    v = p["versus_public_kimi_run"]
    public = PUBLIC_KIMI_RUN
    rows.append(("public Kimi run", f"Kimi-K2.5's EAGLE-3 draft took about {public['gpu_hours']:,.0f} H200-hours for "
                                    f"{public['tokens'] / 1e9:g}B tokens; this plan at {public['tokens'] / 1e9:g}B "
                                    f"tokens: {v['gpu_hours']:,} GPU-hours ({v['times']}x)"))  # fmt: skip
    if v["factors"]:
        rows.append(("what closes it", "; ".join(f"{f['factor']:g}x: {f['what']}" for f in v["factors"])
                     + f"; without these, {v['gpu_hours_without']:,} GPU-hours ({v['times_without']}x) at the "
                       "verifier rate measured on SmolLM2-135M (docs/SCALING.md)"))  # fmt: skip
    width = max(len(k) for k, _ in rows)
    for k, v in rows:
        print(f"{k:<{width}}  {v}")
