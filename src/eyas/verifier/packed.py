"""compressed-tensors weights stay packed in memory and are decompressed one matmul at a time.

Why eyas carries this piece instead of calling transformers as is (read in transformers 5.17 and 5.24 with
compressed-tensors 0.20):

- ``CompressedTensorsHfQuantizer`` either dequantizes every weight while loading (``dequantize=True``: about
  2 TB for Kimi-K2.5's int4 release, more than an 8x H200 node holds) or leaves the weights packed and
  registers a forward pre-hook on the *top* module (compressed-tensors' ``ModelCompressor.compress_model``)
  that decompresses the whole model in place on its first forward: memory is dense again after one call, and
  a caller that runs only the backbone (``model.model``, as extraction does to skip the head) never fires the
  hook and meets Linears without a ``weight``.
- compressed-tensors no longer has a module that decompresses per forward (``CompressedLinear`` raises "no
  longer supported" in 0.20).
- transformers v5 fuses MoE experts into 3-D parameters (``experts.gate_up_proj`` ``[E, 2I, H]``) and, to
  merge a checkpoint's per-expert int4 tensors into them, dequantizes them first (the
  ``CompressedTensorsDequantize`` load op in 5.24, ``DecompressExperts`` in 5.17), whatever the flag: the
  routed experts, 98% of Kimi-K2.5's parameters, would always be dense (quantizers skipping fused experts:
  transformers PR #45699).

So :func:`register` adds one quantizer to transformers through its documented extension point
(``register_quantizer``), a subclass of the compressed-tensors one that:

1. replaces each fused experts module by :class:`PackedExperts`, per-expert gate/up/down Linears laid out as
   the checkpoint stores them (transformers does the same for Llama4 under compressed-tensors:
   ``SequentialLlama4TextExperts``);
2. lets compressed-tensors give every quantized Linear its compressed layout (``weight_packed``,
   ``weight_scale``, ``weight_shape``), as transformers does;
3. drops the converters that would merge (and so dequantize) the per-expert tensors;
4. turns each compressed Linear into a :class:`PackedLinear`, whose forward decompresses its weight with
   compressed-tensors' own compressor for that one matmul, and removes the whole-model decompression hook.
   No int4 matmul kernel is used: torch's (``_weight_int4pack_mm``, CUDA) wants its own tile layout and
   zero points, a conversion at load that is left for when the decompression's cost is measured.

Only the experts a token is routed to are decompressed in a forward. Under a ``device_map`` with CPU offload,
accelerate's hooks move the packed tensors to the GPU, a quarter of the dense bytes.
"""

from __future__ import annotations

from itertools import chain
from typing import Any

import torch
from torch import nn

#: The quant_method eyas writes into the text config it loads, so transformers picks :class:`PackedQuantizer`.
METHOD = "eyas-packed-compressed-tensors"


def packed_quantization_config(quantization_config: dict[str, Any], *, unfuse_experts: bool) -> dict[str, Any]:
    """The checkpoint's compressed-tensors ``quantization_config`` redirected to eyas' quantizer.

    ``unfuse_experts``: the checkpoint stores MoE experts one by one (``experts.N.gate_proj.weight_packed``),
    so fused expert modules are replaced by :class:`PackedExperts` and keep those tensors packed."""
    register()
    out = dict(quantization_config)
    out.pop("run_compressed", None)
    return {**out, "quant_method": METHOD, "dequantize": False, "eyas_unfuse_experts": bool(unfuse_experts)}


_REGISTERED: dict[str, type] = {}


def register() -> None:
    """Register eyas' config and quantizer classes with transformers (once per process)."""
    if _REGISTERED:
        return
    from transformers import CompressedTensorsConfig
    from transformers.quantizers.auto import (
        AUTO_QUANTIZATION_CONFIG_MAPPING,
        AUTO_QUANTIZER_MAPPING,
        register_quantization_config,
        register_quantizer,
    )
    from transformers.quantizers.quantizer_compressed_tensors import CompressedTensorsHfQuantizer

    class PackedConfig(CompressedTensorsConfig):
        """compressed-tensors' config, named for :class:`PackedQuantizer` (never dequantizes at load)."""

        def __init__(self, *args: Any, eyas_unfuse_experts: bool = False, **kwargs: Any) -> None:
            kwargs["quant_method"] = "compressed-tensors"  # compressed-tensors' own config validates the name
            kwargs["dequantize"], kwargs["run_compressed"] = False, None
            super().__init__(*args, **kwargs)
            self.unfuse_experts = eyas_unfuse_experts
            self.quant_method = METHOD

    class PackedQuantizer(CompressedTensorsHfQuantizer):
        """compressed-tensors' quantizer, keeping every compressed weight packed (see the module docstring)."""

        def _process_model_before_weight_loading(self, model, **kwargs: Any) -> None:
            if self.quantization_config.unfuse_experts:
                unfuse_experts(model)
            super()._process_model_before_weight_loading(model, **kwargs)
            self.compressor.remove_decompression_hook(model)
            for module in model.modules():
                if isinstance(module, nn.Linear) and getattr(module, "quantization_scheme", None) is not None:
                    PackedLinear.adopt(module)

        def update_weight_conversions(self, weight_conversions, *args: Any, **kwargs: Any):
            if self.quantization_config.unfuse_experts:
                weight_conversions = [c for c in weight_conversions if not _merges_experts(c)]
            return super().update_weight_conversions(weight_conversions, *args, **kwargs)

        def _process_model_after_weight_loading(self, model, **kwargs: Any):
            return model  # never decompress in place: PackedLinear decompresses per forward

    if METHOD not in AUTO_QUANTIZATION_CONFIG_MAPPING:
        register_quantization_config(METHOD)(PackedConfig)
    if METHOD not in AUTO_QUANTIZER_MAPPING:
        register_quantizer(METHOD)(PackedQuantizer)
    _REGISTERED.update(config=PackedConfig, quantizer=PackedQuantizer)


def _merges_experts(converter: Any) -> bool:
    """Whether a transformers weight converter merges per-expert tensors (``mlp.experts.*.gate_proj.weight``)."""
    from transformers.core_model_loading import WeightConverter

    if not isinstance(converter, WeightConverter):
        return False
    sources = getattr(converter, "_original_source_patterns", None) or converter.source_patterns
    sources = [sources] if isinstance(sources, str) else list(sources)
    return bool(sources) and all("experts" in s for s in sources)  # transformers 5.17's own test for them


# --------------------------------------------------------------------------- modules


class PackedLinear(nn.Linear):
    """A Linear whose weight stays compressed (``weight_packed``, ``weight_scale``, ``weight_shape``) and is
    decompressed, by compressed-tensors' compressor for its format, for each matmul."""

    _shape: tuple[int, ...] | None

    @classmethod
    def adopt(cls, module: nn.Linear) -> None:
        """Turn a Linear that compressed-tensors compressed into a PackedLinear, in place."""
        module.__dict__.pop("forward", None)  # compressed-tensors' fake-quant forward reads `.weight`
        module.__class__ = cls
        module._shape = None

    def _state(self) -> dict[str, torch.Tensor]:
        state = {n: t for n, t in chain(self._parameters.items(), self._buffers.items()) if t is not None}
        state.pop("bias", None)
        if "weight_shape" in state:
            if self._shape is None:  # read once (a host sync), not in every forward
                self._shape = tuple(int(x) for x in state["weight_shape"].tolist())
            state["weight_shape"] = torch.Size(self._shape)
        return state

    def dense_weight(self, dtype: torch.dtype | None = None) -> torch.Tensor:
        """The decompressed weight ``[out, in]`` (a temporary: nothing is kept)."""
        from compressed_tensors.compressors import BaseCompressor
        from compressed_tensors.config import CompressionFormat

        scheme = self.quantization_scheme
        compressor = BaseCompressor.get_value_from_registry(CompressionFormat(scheme.format).value)
        weight = compressor.decompress(self._state(), scheme)["weight"]
        return weight if dtype is None else weight.to(dtype)

    def forward(self, input: torch.Tensor) -> torch.Tensor:
        from compressed_tensors.quantization.lifecycle.forward import forward_quantize

        scheme = self.quantization_scheme
        if scheme.input_activations is not None:
            input = forward_quantize(self, input, "input", scheme.input_activations)
        out = nn.functional.linear(input, self.dense_weight(input.dtype), self.bias)
        if scheme.output_activations is not None:
            out = forward_quantize(self, out, "output", scheme.output_activations)
        return out

    def extra_repr(self) -> str:
        return f"{super().extra_repr()}, packed"


class _ExpertMLP(nn.Module):
    """One routed expert as the checkpoint stores it: ``down(act(gate(x)) * up(x))``."""

    def __init__(self, hidden: int, intermediate: int, act_fn: nn.Module, dtype: torch.dtype) -> None:
        super().__init__()
        self.gate_proj = nn.Linear(hidden, intermediate, bias=False, dtype=dtype)
        self.up_proj = nn.Linear(hidden, intermediate, bias=False, dtype=dtype)
        self.down_proj = nn.Linear(intermediate, hidden, bias=False, dtype=dtype)
        self.act_fn = act_fn

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(self.act_fn(self.gate_proj(x)) * self.up_proj(x))


class PackedExperts(nn.ModuleList):
    """Per-expert modules in place of transformers' fused experts (``gate_up_proj [E, 2I, H]``,
    ``down_proj [E, H, I]``), computing what their eager forward computes: for each token, the sum over its
    top-k experts of ``weight * down(act(gate(x)) * up(x))``. Children are named ``0..E-1`` as in the
    checkpoint (``experts.N.gate_proj``), so compressed-tensors compresses them like any Linear."""

    def __init__(self, fused: nn.Module) -> None:
        E, two_i, H = fused.gate_up_proj.shape
        dtype = fused.gate_up_proj.dtype
        super().__init__(_ExpertMLP(H, two_i // 2, fused.act_fn, dtype) for _ in range(E))
        self.num_experts = E

    @staticmethod
    def replaces(module: nn.Module) -> bool:
        """Whether ``module`` is fused experts in the standard layout: gate and up concatenated, not
        transposed, no bias, the default gate (the layout of DeepseekV3, Qwen-MoE, Mixtral)."""
        gate_up, down = getattr(module, "gate_up_proj", None), getattr(module, "down_proj", None)
        if not isinstance(gate_up, torch.Tensor) or not isinstance(down, torch.Tensor) or gate_up.dim() != 3:
            return False
        E, two_i, H = gate_up.shape
        standard = (getattr(module, "has_gate", True) and not getattr(module, "has_bias", False)
                    and not getattr(module, "is_transposed", False) and getattr(module, "is_concatenated", True)
                    and getattr(getattr(module, "_apply_gate", None), "__name__", "_default_apply_gate")
                    == "_default_apply_gate")  # fmt: skip
        return standard and tuple(down.shape) == (E, H, two_i // 2) and hasattr(module, "act_fn")

    def forward(self, hidden_states: torch.Tensor, top_k_index: torch.Tensor, top_k_weights: torch.Tensor):
        # hidden_states [N, H]; top_k_index, top_k_weights [N, K]
        out = torch.zeros_like(hidden_states)
        for e in top_k_index.unique().tolist():  # only the experts some token was routed to are decompressed
            if not 0 <= e < self.num_experts:
                continue  # an expert-parallel sentinel for experts held elsewhere
            token, slot = torch.where(top_k_index == e)
            y = self[e](hidden_states[token]) * top_k_weights[token, slot, None]  # [n, H]
            out.index_add_(0, token, y.to(out.dtype))
        return out


def unfuse_experts(model: nn.Module) -> int:
    """Replace every fused experts module of ``model`` (on the meta device, before weights load) by
    :class:`PackedExperts`; return how many were replaced."""
    from eyas.core.errors import EyasError

    targets = [(name, m) for name, m in model.named_modules() if getattr(m, "gate_up_proj", None) is not None]
    for name, module in targets:
        if not PackedExperts.replaces(module):
            raise EyasError(f"the MoE experts {name} ({type(module).__name__}) are not in the gate/up/down layout "
                            "eyas keeps packed (concatenated gate and up, no bias, not transposed); load this "
                            "verifier dequantized: build_text_model(info, packed=False)")  # fmt: skip
        parent, _, child = name.rpartition(".")
        with torch.device("meta"):
            model.get_submodule(parent).register_module(child, PackedExperts(module))
    return len(targets)


# --------------------------------------------------------------------------- memory


def resident_bytes(model: nn.Module) -> dict[str, int]:
    """Bytes the model's parameters and buffers really hold, per device (``"cpu"``, ``"cuda:0"``, ...), each
    storage counted once (tied weights) and meta tensors (offloaded or never materialised) not at all."""
    seen: set[tuple[str, int]] = set()
    out: dict[str, int] = {}
    for t in chain(model.parameters(), model.buffers()):
        if t.device.type == "meta":
            continue
        storage = t.untyped_storage()
        key = (str(t.device), storage.data_ptr())
        if key in seen:
            continue
        seen.add(key)
        out[str(t.device)] = out.get(str(t.device), 0) + storage.nbytes()
    return out
