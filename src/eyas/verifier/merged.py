"""Linear layers that read one input, run as one matmul while decoding (vLLM's ``QKVParallelLinear`` and
``MergedColumnParallelLinear``, on one device): a Llama-style layer's q/k/v, and its MLP's gate/up.

Why eyas does it: at batch size 1 a decoding step is bound by how many kernels it launches, not by bytes or
FLOPs (SmolLM2-135M on an H200: 548 kernels a step, each matmul about 2.4 us whatever its size;
docs/BENCHMARKS.md). transformers' layers call ``q_proj``, ``k_proj`` and ``v_proj`` one by one, and inductor
joins matmuls that share an input only under freezing and only where the weights have one shape
(``check_concat_weights`` in torch/_inductor/fx_passes/freezing_patterns.py), so a grouped-query layer's
narrower k/v stay three matmuls, and gate/up two unless frozen. Here the weights are stored once, concatenated
(``[W_q; W_k; W_v]``, ``[W_gate; W_up]``), and each projection becomes a view of its rows:

- compiled (``torch.compiler.is_compiling()``), each part computes the whole merged matmul and keeps its
  columns: the parts' matmuls are the same operation on the same operands, which :class:`SameMatmulOnce`
  (an inductor post-grad custom pass, in :data:`eyas.verifier.compile.COMPILE_OPTIONS` of every eyas compile)
  computes once, with no weight copied per step (the merged weight is a parameter, not a concatenation inside
  the graph). AOT autograd's own common-subexpression pass runs on training graphs only: without this pass an
  inference graph computed the merged matmul once per part;
- eager, each part multiplies by its own rows only (a view of the merged weight): the same matmul as the
  Linear it replaces, so an eager prefill costs what it did.

Parts read the same input in every transformers decoder layer this applies to; were they given different
inputs, each would still compute its own rows correctly, only without the merge."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn
from torch._inductor.custom_graph_pass import CustomGraphPass, get_hash_for_files

#: sibling Linear names merged, in the order their rows are stored
GROUPS = {"merged_qkv_proj": ("q_proj", "k_proj", "v_proj"), "merged_gate_up_proj": ("gate_proj", "up_proj")}


class MergedLinear(nn.Module):
    """The concatenated weight (and bias) of several Linear layers of one input: ``weight [sum(out), in]``."""

    def __init__(self, linears: list[nn.Linear]) -> None:
        super().__init__()
        w = linears[0].weight
        self.weight = nn.Parameter(torch.cat([m.weight.detach() for m in linears]), requires_grad=w.requires_grad)
        has_bias = linears[0].bias is not None
        self.bias = nn.Parameter(torch.cat([m.bias.detach() for m in linears]), requires_grad=w.requires_grad) \
            if has_bias else None  # fmt: skip
        self.in_features = w.shape[1]
        self.out_features = self.weight.shape[0]


class MergedPart(nn.Module):
    """One Linear of a :class:`MergedLinear`: rows ``start:end`` of its weight. ``weight``/``bias`` are views,
    so code that reads a projection's weight or shape still finds it."""

    def __init__(self, merged: MergedLinear, start: int, end: int) -> None:
        super().__init__()
        # a reference, not a submodule: the merged weight is registered once, on the parent layer
        # (merge_projections), so parameters() and state_dict() hold it once
        self.__dict__["merged"] = merged
        self.start, self.end = start, end
        self.in_features, self.out_features = merged.in_features, end - start

    @property
    def weight(self) -> torch.Tensor:
        return self.merged.weight[self.start : self.end]

    @property
    def bias(self) -> torch.Tensor | None:
        b = self.merged.bias
        return None if b is None else b[self.start : self.end]

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if torch.compiler.is_compiling():  # the siblings' identical matmuls fold into one (module docstring)
            return F.linear(x, self.merged.weight, self.merged.bias)[..., self.start : self.end]
        return F.linear(x, self.weight, self.bias)

    def extra_repr(self) -> str:
        return f"in_features={self.in_features}, out_features={self.out_features}, rows {self.start}:{self.end}"


def _mergeable(linears: list[nn.Module]) -> bool:
    """Plain ``nn.Linear`` layers (not a quantized or hooked subclass) of one input width, dtype and device, all
    with a bias or none, on real memory."""
    if not all(type(m) is nn.Linear for m in linears):
        return False
    w = [m.weight for m in linears]
    return (
        len({(t.shape[1], t.dtype, t.device) for t in w}) == 1
        and len({m.bias is None for m in linears}) == 1
        and all(type(t) is nn.Parameter and t.device.type != "meta" for t in w)
        # hooks, or a forward set on the instance (accelerate's device-map hooks), would not see the merged matmul
        and not any(m._forward_hooks or m._forward_pre_hooks or "forward" in m.__dict__ for m in linears)
    )


def merge_projections(model: nn.Module) -> int:
    """Merge every group of :data:`GROUPS` found as plain Linear siblings in ``model``'s modules, in place
    (the merged Linear registered on their parent under the group's key) -> how many groups were merged (0 where
    none qualifies, e.g. an int4 verifier's packed Linears, or one already merged). The merged weights replace
    the originals (no memory is added once those are freed); the outputs are the same, eager and compiled."""
    merged = 0
    for module in list(model.modules()):
        for key, names in GROUPS.items():
            linears = [getattr(module, n, None) for n in names]
            if any(m is None for m in linears) or not _mergeable(linears):
                continue
            group = MergedLinear(linears)
            module.add_module(key, group)
            start = 0
            for name, m in zip(names, linears):
                setattr(module, name, MergedPart(group, start, start + m.out_features))
                start += m.out_features
            merged += 1
    return merged


def unmerge_projections(model: nn.Module) -> int:
    """Undo :func:`merge_projections` in place (each part a plain Linear again, holding a copy of its rows) -> how
    many groups were split. For a model handed to code that compiles it without eyas' options (transformers'
    ``generate`` with a static cache compiles itself): there each part would compute the whole merged matmul."""
    split = 0
    for module in list(model.modules()):
        for key, names in GROUPS.items():
            group = getattr(module, key, None)
            if not isinstance(group, MergedLinear):
                continue
            for name in names:
                part = getattr(module, name)
                linear = nn.Linear(part.in_features, part.out_features, bias=part.bias is not None,
                                   device=group.weight.device, dtype=group.weight.dtype)  # fmt: skip
                with torch.no_grad():
                    linear.weight.copy_(part.weight)
                    if part.bias is not None:
                        linear.bias.copy_(part.bias)
                linear.requires_grad_(group.weight.requires_grad)  # weight and bias, as merging kept them
                setattr(module, name, linear)
            delattr(module, key)
            split += 1
    return split


_aten = torch.ops.aten
#: pure, deterministic ops :class:`SameMatmulOnce` may compute once: a linear's decomposition and a part's slice
_ONCE = {_aten.view.default, _aten._unsafe_view.default, _aten.reshape.default, _aten.permute.default,
         _aten.t.default, _aten.transpose.int, _aten.mm.default, _aten.addmm.default, _aten.slice.Tensor}  # fmt: skip


def _hashable(value):
    if isinstance(value, (list, tuple)):
        return tuple(_hashable(v) for v in value)
    if isinstance(value, dict):
        return tuple(sorted((k, _hashable(v)) for k, v in value.items()))
    return value


class SameMatmulOnce(CustomGraphPass):
    """Inductor post-grad pass: a matmul (and the views and slices around it) that repeats an earlier one on the
    same operands is replaced by it. The parts of a :class:`MergedLinear` each compute its whole matmul (so
    eager and compiled forwards share one module), which this folds into one a group."""

    def __call__(self, graph: torch.fx.Graph) -> None:
        seen: dict = {}
        for node in list(graph.nodes):
            if node.op != "call_function" or node.target not in _ONCE:
                continue
            try:
                key = (node.target, _hashable(node.args), _hashable(node.kwargs))
                first = seen.setdefault(key, node)
            except TypeError:  # an argument that cannot be compared by value
                continue
            if first is not node:
                node.replace_all_uses_with(first)
                graph.erase_node(node)

    def uuid(self) -> bytes:
        return get_hash_for_files((__file__,))


#: the one instance inductor options name (its uuid keys inductor's cache of compiled graphs)
SAME_MATMUL_ONCE = SameMatmulOnce()
