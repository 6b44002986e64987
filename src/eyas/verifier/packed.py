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
5. stacks each MoE layer's packed experts into one tensor per projection (the per-expert parameters become
   views of it, so nothing is held twice) and computes the layer with grouped matmuls that read the packed
   words inside the matmul (:func:`eyas.verifier.int4_matmul.int4_grouped_mm`, a Triton kernel: the module
   says why eyas carries it), with no host synchronisation, so a decoding step is captured in a CUDA graph.
   Without Triton or CUDA (the CPU), the experts are dequantized (compressed-tensors' unpacking) and multiplied
   by torch's grouped GEMM (``torch.nn.functional.grouped_mm``, the kernel transformers' own ``grouped_mm``
   experts use); below one row per expert only the routed experts are dequantized (gathered by index).

Measured on one H200 (docs/BENCHMARKS.md, "int4 verifiers", commit 9234ca9): the backbone forward at 0.71x
bf16's tokens/s on 16k-token batches of Kimi-K2.5's layer dims and 0.67x on 4k-token ones (dequantizing every
expert first: 0.65x and 0.30x), decoding with CUDA graphs at 0.94x bf16's tokens/s. torch's int4 kernel
(``_weight_int4pack_mm``, tinygemm, what torchao's int4 weight-only layout runs on CUDA) beats a bf16 matmul
at 1-16 rows but runs 4x and 23x slower than it at 128 and 1,024 rows, so it does not serve the grouped path;
compiling the dequantization (``COMPILE_DEQUANT``) measured slower than the eager unpacking.

Under a ``device_map`` with CPU offload, accelerate's hooks move the packed tensors to the GPU, a quarter of the
dense bytes; such a layer's experts are not stacked and run one expert at a time (compressed-tensors'
decompression per matmul, only the experts a token is routed to).
"""

from __future__ import annotations

from itertools import chain
from typing import Any

import torch
from torch import nn

from eyas.core.errors import brief
from eyas.verifier.int4_matmul import int4_grouped_mm, supported

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
            stack_experts(model)
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
    checkpoint (``experts.N.gate_proj``), so compressed-tensors compresses them like any Linear.

    Once loaded, :meth:`stack` gathers the children's packed int4 tensors into one tensor per projection and
    the forward runs grouped (:meth:`_grouped`); a layer that cannot be stacked (offloaded by a device_map,
    another format) runs one expert at a time (:meth:`_per_expert`)."""

    #: Most bytes of experts dequantized at once (a temporary per forward); a layer larger than this runs its
    #: experts in groups of this size, with one host synchronisation a layer (not in a CUDA graph).
    dequant_bytes: int = 2 << 30
    #: "int4" (stacked int4 multiplied by :func:`eyas.verifier.int4_matmul.int4_grouped_mm`, which reads the
    #: packed words inside the matmul, where it runs: CUDA with Triton; "grouped" elsewhere), "grouped" (stacked
    #: int4 dequantized, then torch's grouped GEMM) or "per-expert" (compressed-tensors' decompression, one
    #: expert at a time); bench/int4_memory.py measures each.
    kernel: str = "int4"

    def __init__(self, fused: nn.Module) -> None:
        E, two_i, H = fused.gate_up_proj.shape
        dtype = fused.gate_up_proj.dtype
        super().__init__(_ExpertMLP(H, two_i // 2, fused.act_fn, dtype) for _ in range(E))
        self.num_experts = E
        self.stacked = False

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

    # ------------------------------------------------------------------ stacking

    def stack(self) -> bool:
        """Gather the experts' packed tensors into ``gate_up_packed [E, 2I, H/8]``, ``gate_up_scale
        [E, 2I, H/g]``, ``down_packed [E, H, I/8]``, ``down_scale [E, H, I/g]`` (buffers, not saved) and make
        each expert's parameters views of them; return whether the layer is now stacked. Only symmetric int4
        groups (compressed-tensors ``pack-quantized``, no zero point, no activation ordering) on one real device
        are stacked."""
        projections = ("gate_proj", "up_proj", "down_proj")
        linears = [getattr(m, n) for m in self for n in projections]
        if not linears or not all(isinstance(m, PackedLinear) and _stackable(m) for m in linears):
            return False
        tensors = [t for m in linears for t in (m.weight_packed, m.weight_scale)]
        devices = {t.device for t in tensors}
        if len(devices) != 1 or next(iter(devices)).type == "meta":
            return False
        group = int(linears[0].quantization_scheme.weights.group_size)
        if any(int(m.quantization_scheme.weights.group_size) != group for m in linears):
            return False
        with torch.no_grad():
            for name, parts in (("gate_up", ("gate_proj", "up_proj")), ("down", ("down_proj",))):
                for kind in ("packed", "scale"):
                    whole = torch.stack([torch.cat([getattr(getattr(m, n), "weight_" + kind) for n in parts])
                                         for m in self])  # fmt: skip
                    self.register_buffer(f"{name}_{kind}", whole, persistent=False)
                    for e, m in enumerate(self):
                        row = 0
                        for n in parts:
                            linear = getattr(m, n)
                            rows = linear.out_features
                            view = whole[e, row : row + rows]
                            if isinstance(linear._parameters.get("weight_" + kind), nn.Parameter):
                                linear._parameters["weight_" + kind] = nn.Parameter(view, requires_grad=False)
                            else:
                                linear._buffers["weight_" + kind] = view
                            row += rows
        self.group_size = group
        self.hidden, self.intermediate = linears[0].in_features, linears[0].out_features
        self.stacked = True
        return True

    def _apply(self, fn, recurse: bool = True):
        # A move (``model.to(device)``) copies each view on its own: stack again from the moved experts.
        out = super()._apply(fn, recurse)
        if self.stacked:
            for name in ("gate_up_packed", "gate_up_scale", "down_packed", "down_scale"):
                self._buffers.pop(name, None)
            self.stacked = False
            self.stack()
        return out

    # ------------------------------------------------------------------ forward

    def forward(self, hidden_states: torch.Tensor, top_k_index: torch.Tensor, top_k_weights: torch.Tensor):
        # hidden_states [N, H]; top_k_index, top_k_weights [N, K]
        if self.stacked and self.kernel in ("int4", "grouped"):
            return self._grouped(hidden_states, top_k_index, top_k_weights)
        return self._per_expert(hidden_states, top_k_index, top_k_weights)

    def _per_expert(self, hidden_states: torch.Tensor, top_k_index: torch.Tensor, top_k_weights: torch.Tensor):
        out = torch.zeros_like(hidden_states)
        for e in top_k_index.unique().tolist():  # only the experts some token was routed to are decompressed
            if not 0 <= e < self.num_experts:
                continue  # an expert-parallel sentinel for experts held elsewhere
            token, slot = torch.where(top_k_index == e)
            y = self[e](hidden_states[token]) * top_k_weights[token, slot, None]  # [n, H]
            out.index_add_(0, token, y.to(out.dtype))
        return out

    def _dense(self, name: str, index: slice | torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
        """Experts ``index`` of projection ``name`` ("gate_up" or "down") dequantized: ``[e, out, in]``."""
        packed, scale = self._buffers[name + "_packed"][index], self._buffers[name + "_scale"][index]
        return dequantize_int4(packed, scale, self.group_size, dtype)

    def _act(self, gate_up: torch.Tensor) -> torch.Tensor:
        gate, up = gate_up.chunk(2, dim=-1)
        return self[0].act_fn(gate) * up

    def _grouped(self, x: torch.Tensor, top_k_index: torch.Tensor, top_k_weights: torch.Tensor) -> torch.Tensor:
        N, K = top_k_index.shape
        E, H, I = self.num_experts, self.hidden, self.intermediate
        ids = top_k_index.reshape(-1)
        valid = (ids >= 0) & (ids < E)  # experts held elsewhere (expert-parallel sentinels) contribute nothing
        weights = torch.where(valid, top_k_weights.reshape(-1), 0)
        per_expert = 3 * H * I * x.element_size()
        S = ids.numel()
        # the packed words read inside the matmul: no dense weights, so neither the routed-expert gather below
        # nor the groups of experts bounded by dequant_bytes
        fused = self.kernel == "int4" and supported(x, H, self.group_size) and supported(x, I, self.group_size)
        if S < E and not fused:  # fewer rows than experts (decoding): dequantize only the routed experts, by index
            ids = torch.where(valid, ids, 0)
            rows = x.repeat_interleave(K, dim=0)  # row j is token j // K
            chunk = max(1, self.dequant_bytes // per_expert)
            parts = []
            for a in range(0, S, chunk):  # a static split: S is known when a graph is captured
                sel = ids[a : a + chunk]
                h = torch.bmm(self._dense("gate_up", sel, x.dtype), rows[a : a + chunk, :, None])[..., 0]
                parts.append(torch.bmm(self._dense("down", sel, x.dtype), self._act(h)[..., None])[..., 0])
            y = torch.cat(parts) if len(parts) > 1 else parts[0]
            y = y * weights[:, None].to(y.dtype)
            return y.view(N, K, H).sum(dim=1).to(x.dtype)
        # Rows sorted by expert, as transformers' grouped_mm experts do (histc, not bincount: no host sync)
        ids = torch.where(valid, ids, E)  # sentinels sort last and fall outside every group
        sorted_ids, perm = torch.sort(ids)
        rows = x[perm // K]
        counts = torch.histc(sorted_ids.float() if x.device.type == "cpu" else sorted_ids.int(),
                             bins=E, min=0, max=E - 1)  # fmt: skip
        offsets = torch.cumsum(counts, dim=0, dtype=torch.int32)
        chunk = max(1, self.dequant_bytes // per_expert)
        if fused:
            h = int4_grouped_mm(rows, self.gate_up_packed, self.gate_up_scale, offsets, self.group_size)
            y = int4_grouped_mm(self._act(h), self.down_packed, self.down_scale, offsets, self.group_size)
        elif chunk >= E:
            y = self._grouped_mlp(rows, slice(0, E), offsets)
        else:  # a layer too large to dequantize at once: groups of experts, their row ranges read on the host
            bounds = [0, *offsets.tolist()]
            parts = []
            for a in range(0, E, chunk):
                b = min(E, a + chunk)
                r0, r1 = bounds[a], bounds[b]
                if r1 > r0:
                    parts.append(self._grouped_mlp(rows[r0:r1], slice(a, b), offsets[a:b] - r0))
            if bounds[E] < S:
                parts.append(rows.new_zeros(S - bounds[E], H))
            y = torch.cat(parts) if parts else rows.new_zeros(S, H)
        y = torch.where(valid[perm][:, None], y * weights[perm][:, None].to(y.dtype), 0)  # rows past the groups: unset
        out = torch.empty_like(y)
        out[perm] = y
        return out.view(N, K, H).sum(dim=1).to(x.dtype)

    def _grouped_mlp(self, rows: torch.Tensor, experts: slice, offsets: torch.Tensor) -> torch.Tensor:
        """``down(act(gate(x)) * up(x))`` for rows sorted by expert, expert ``experts.start + i`` taking rows
        ``offsets[i-1]:offsets[i]``."""
        h = grouped_mm(rows, self._dense("gate_up", experts, rows.dtype).transpose(-2, -1), offsets)
        return grouped_mm(self._act(h), self._dense("down", experts, rows.dtype).transpose(-2, -1), offsets)


def _stackable(linear: PackedLinear) -> bool:
    """Whether a compressed Linear is symmetric int4 in groups, packed as compressed-tensors' ``pack-quantized``
    (what :func:`dequantize_int4` reads)."""
    scheme = getattr(linear, "quantization_scheme", None)
    w = getattr(scheme, "weights", None)
    if w is None or getattr(scheme, "format", None) != "pack-quantized" or scheme.input_activations is not None:
        return False
    strategy = getattr(w.strategy, "value", w.strategy)
    order = getattr(w, "actorder", None)
    return (w.num_bits == 4 and w.symmetric and strategy == "group" and not order
            and getattr(linear, "weight_g_idx", None) is None and getattr(linear, "weight_zero_point", None) is None
            and linear.in_features % int(w.group_size) == 0 and linear.in_features % 8 == 0)  # fmt: skip


def _dequantize_int4(packed: torch.Tensor, scale: torch.Tensor, group: int, dtype: torch.dtype) -> torch.Tensor:
    # compressed-tensors' pack-quantized int4: weight j of a row is bits 4*(j % 8).. of int32 word j // 8, stored
    # as value + 8 (compressed_tensors.compressors.pack_quantized.helpers.pack_to_int32); the weight is
    # value * scale of its group. compressed-tensors' unpack_from_int32 (used eagerly, below) splits bytes
    # through a dtype view, which torch.compile does not fuse; these shifts are the same arithmetic and compile
    # into one kernel that reads the int4 words once and writes the dense weights once.
    shifts = torch.arange(0, 32, 4, device=packed.device, dtype=torch.int32)
    q = ((packed[..., None] >> shifts) & 0xF).flatten(-2) - 8  # [..., out, in]
    w = q.to(scale.dtype).unflatten(-1, (-1, group)) * scale[..., None]
    return w.flatten(-2).to(dtype)


def _dequantize_int4_eager(packed: torch.Tensor, scale: torch.Tensor, group: int, dtype: torch.dtype) -> torch.Tensor:
    """The same through compressed-tensors' own unpacking (fewer bytes moved than the shifts run op by op)."""
    try:
        from compressed_tensors.compressors.pack_quantized.helpers import unpack_from_int32
    except ImportError:  # another compressed-tensors layout: the same arithmetic, op by op
        return _dequantize_int4(packed, scale, group, dtype)
    words = packed.shape[-1]
    flat = packed.reshape(-1, words)
    q = unpack_from_int32(flat, 4, torch.Size((flat.shape[0], 8 * words))).view(*packed.shape[:-1], 8 * words)
    w = q.to(scale.dtype).unflatten(-1, (-1, group)) * scale[..., None]
    return w.flatten(-2).to(dtype)


#: Whether dequantization on CUDA runs compiled by torch.compile. Off: on one H200, compiled with dynamic shapes,
#: it measured slower than compressed-tensors' eager unpacking (the forward at 0.47x bf16 against 0.64x, commit
#: d8c6450, docs/BENCHMARKS.md); bench/int4_memory.py measures both.
COMPILE_DEQUANT = False
_COMPILED: dict[str, Any] = {}


def dequantize_int4(packed: torch.Tensor, scale: torch.Tensor, group: int, dtype: torch.dtype) -> torch.Tensor:
    """Dense weights ``[..., out, in]`` from compressed-tensors pack-quantized int4 ``packed [..., out, in/8]``
    (int32) and ``scale [..., out, in/group]``: compressed-tensors' unpacking; inside a caller's compiled code,
    the shifts, which that compilation fuses; with ``COMPILE_DEQUANT`` on CUDA, the shifts compiled on their own
    (eager from the first time compiling fails, after one note)."""
    if torch.compiler.is_compiling():
        return _dequantize_int4(packed, scale, group, dtype)
    if packed.device.type != "cuda" or not COMPILE_DEQUANT or _COMPILED.get("failed"):
        return _dequantize_int4_eager(packed, scale, group, dtype)
    if "fn" not in _COMPILED:
        # Static shapes (a few a model: each projection's expert groups, the gathered routed experts): compiled
        # with dynamic shapes it measured slower than eager in the model (commit d8c6450), where symbolic sizes
        # turn the index arithmetic into divisions; the static form is the one `extract.sh int4` measures next.
        _COMPILED["fn"] = torch.compile(_dequantize_int4, dynamic=False)
    try:
        return _COMPILED["fn"](packed, scale, group, dtype)
    except Exception as e:  # a compiler error on some machine: correct, if slower, without it
        import sys

        _COMPILED["failed"] = True
        print(f"eyas: int4 dequantization without torch.compile ({brief(e)})", file=sys.stderr)
        return _dequantize_int4_eager(packed, scale, group, dtype)


_GROUPED_MM: dict[str, Any] = {}


def grouped_mm(rows: torch.Tensor, weights: torch.Tensor, offsets: torch.Tensor) -> torch.Tensor:
    """``rows [S, in] @ weights [E, in, out]`` per group: rows ``offsets[i-1]:offsets[i]`` with ``weights[i]``
    (rows past ``offsets[-1]`` are left unset). torch's grouped GEMM (``torch.nn.functional.grouped_mm``, or
    ``torch._grouped_mm`` before torch 2.10); where it refuses the shapes or dtype, one matmul per group."""
    fn = getattr(torch.nn.functional, "grouped_mm", None) or getattr(torch, "_grouped_mm", None)
    key = (rows.device.type, rows.dtype)
    if fn is not None and not _GROUPED_MM.get(key):
        try:
            return fn(rows, weights, offs=offsets)
        except (RuntimeError, NotImplementedError, TypeError):
            _GROUPED_MM[key] = True  # unsupported here: the loop from now on
    out = rows.new_zeros(rows.shape[0], weights.shape[-1])
    start = 0
    for i, end in enumerate(offsets.tolist()):
        if end > start:
            out[start:end] = rows[start:end] @ weights[i]
        start = end
    return out


def stack_experts(model: nn.Module) -> int:
    """Stack every :class:`PackedExperts` of ``model`` that can be (:meth:`PackedExperts.stack`); return how many
    were stacked. A layer whose experts no longer view its stacked tensors (a cast after loading replaced them,
    as eyas' own cast of renamed quantized weights does under transformers 5.17) is stacked again, so nothing
    is held twice."""
    n = 0
    for m in model.modules():
        if not isinstance(m, PackedExperts):
            continue
        if m.stacked and not _views_intact(m):
            for name in ("gate_up_packed", "gate_up_scale", "down_packed", "down_scale"):
                m._buffers.pop(name, None)
            m.stacked = False
        if not m.stacked:
            n += m.stack()
    return n


def _views_intact(m: PackedExperts) -> bool:
    """Whether every expert's packed weight and scale still share storage with the layer's stacked tensors."""
    for name, parts in (("gate_up", ("gate_proj", "up_proj")), ("down", ("down_proj",))):
        for kind in ("packed", "scale"):
            whole = m._buffers.get(f"{name}_{kind}")
            if whole is None:
                return False
            ptr = whole.untyped_storage().data_ptr()
            for expert in m:
                for n in parts:
                    t = getattr(getattr(expert, n), "weight_" + kind)
                    if t.dtype != whole.dtype or t.untyped_storage().data_ptr() != ptr:
                        return False
    return True


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
