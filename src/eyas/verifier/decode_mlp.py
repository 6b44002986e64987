"""A decoder layer's MLP block at decoding's few rows in two Triton kernels: the residual add, the post-attention
RMSNorm, gate/up and SiLU in one; down and the closing residual add in the other.

Why eyas writes these kernels: at batch size 1 a decoding step is bound by its launches, not its bytes
(docs/BENCHMARKS.md: SmolLM2-135M's step spends about 2.3 us a kernel, where its 270 MB of weights take 0.08 ms
to read). Compiled by inductor, a Llama-style MLP block is five kernels a layer: the residual add with the norm,
cuBLAS's gate/up matmul, SiLU times up, cuBLAS's down matmul, the closing add (with the next layer's norm,
:mod:`eyas.verifier.norm_ahead`). inductor fuses what surrounds a matmul into its Triton GEMM templates
(``max_autotune_gemm``), which at one row ran a third slower than cuBLAS (one H100, commit 7e8a688, 1.76 against
1.27 ms of GPU time a step), or, with ``coordinate_descent_tuning``, turns a one-row matmul into a reduction that
fuses with its neighbours (``mm`` in torch/_inductor/decomposition.py): for one row only, not a verification's
K + 1, and a norm's statistic over the whole row stays a kernel of its own either way
(``bash bench/gpu/generate.sh autotune`` measures both against these kernels). Here:

- ``_gate_up_kernel`` (:mod:`eyas.verifier.decode_mlp_kernels`): each program takes ``BLOCK_N`` rows of gate and
  of up and every input row (at most :data:`MAX_ROWS`): it sums the block's residual and attention output,
  computes their RMSNorm statistic over the whole hidden width itself (a few KB of activations, read from L2 by
  every program: cheaper than a launch), normalises as the norm does, multiplies by both weights (``tl.dot``, fp32
  accumulation) and writes ``silu(gate) * up``;
- ``_down_kernel``: ``down @ h``, plus the residual and the attention output: the layer's output.

Numerics are the eager layer's: every tensor eager rounds to the model's dtype (the residual sum, the normed
input, gate, up, SiLU, their product, down, the output) is rounded there too; only the matmuls' summation order
differs, as between any two GEMM kernels. Used where :func:`fits` says so: a module pair of the pattern
Llama, Mistral, Qwen2/3 and DeepSeek-V3's dense layers share (checked on their source), on CUDA (or Triton's CPU
interpreter), inside fixed-shape compiles of :mod:`eyas.verifier.norm_ahead` of forwards of at most
:data:`eyas.verifier.compile.DECODE_MLP_ROWS` rows (a plain step's one: at a verification's K + 1 rows the
``tl.dot`` tiles ran slower than cuBLAS). The ops are torch custom ops (``eyas::decode_gate_up``,
``eyas::decode_down``): inductor calls each as one opaque kernel, and a CUDA graph captures them.
"""

from __future__ import annotations

import functools

import torch

from eyas.core.triton import interpreting, pdl_capable, runs_kernels
from eyas.verifier.source import statements

#: the most rows (tokens) the kernels take: a decoding step's one, a verification's K + 1, FlexAttention's bound
MAX_ROWS = 16

#: LlamaRMSNorm.forward and LlamaMLP.forward, statement for statement (transformers' models copy them)
_NORM = (
    "input_dtype = hidden_states.dtype",
    "hidden_states = hidden_states.to(torch.float32)",
    "variance = hidden_states.pow(2).mean(-1, keepdim=True)",
    "hidden_states = hidden_states * torch.rsqrt(variance + self.variance_epsilon)",
    "return self.weight * hidden_states.to(input_dtype)",
)
_MLP = ("down_proj = self.down_proj(self.act_fn(self.gate_proj(x)) * self.up_proj(x))", "return down_proj")
_SILU = ("SiLU", "SiLUActivation")
_DTYPES = (torch.bfloat16, torch.float16, torch.float32)


@functools.cache
def _pattern(cls: type, body: tuple[str, ...]) -> bool:
    """Whether ``cls.forward`` is ``body``, statement for statement (read once per class)."""
    return tuple(statements(cls.forward) or ()) == body


def _plain_weight(linear) -> torch.Tensor | None:
    """A projection's weight, where it has no bias and is a plain matrix (a Linear, or a part of eyas' merged
    projections: :class:`eyas.verifier.merged.MergedPart`, whose weight is a view of rows); else None."""
    if getattr(linear, "bias", None) is not None or linear._forward_hooks or linear._forward_pre_hooks:
        return None
    w = getattr(linear, "weight", None)
    ok = type(w) in (torch.Tensor, torch.nn.Parameter) and w.dim() == 2 and w.stride(1) == 1
    return w if ok else None


def fits(norm, mlp, x: torch.Tensor) -> bool:
    """Whether :func:`decode_mlp` computes ``s + mlp(norm(s))`` (``s = residual + attn``) for ``norm``, ``mlp``
    and a residual like ``x``:
    Llama's RMSNorm and gated SiLU MLP (by their source), weights without bias of ``x``'s dtype on its device,
    at most :data:`MAX_ROWS` rows, on CUDA or under Triton's interpreter."""
    rows = x.numel() // x.shape[-1]
    if not runs_kernels(x) or rows > MAX_ROWS or x.dtype not in _DTYPES:
        return False
    if not (_pattern(type(norm), _NORM) and _pattern(type(mlp), _MLP)):
        return False
    if type(mlp.act_fn).__name__ not in _SILU or getattr(norm, "weight", None) is None:
        return False
    weights = [_plain_weight(getattr(mlp, n, None)) for n in ("gate_proj", "up_proj", "down_proj")]
    if any(w is None for w in weights):
        return False
    g, u, d = weights
    H = x.shape[-1]
    shapes = g.shape == u.shape and g.shape[1] == H and tuple(d.shape) == (H, g.shape[0])
    return shapes and all(w.dtype == x.dtype and w.device == x.device for w in (*weights, norm.weight))


def _launch(name: str, args: tuple, M: int, N: int, K: int) -> None:
    """Kernel ``name`` over ``M`` rows, ``N`` outputs a row and ``K`` inputs (a compile-time constant: the
    reduction's trip count, and Triton's interpreter cannot step a loop by a runtime bound under NumPy 2). One row
    and up to :data:`FEW_ROWS` take the kernels' sum-of-products form (``BLOCK_M`` the rows' next power of two),
    more rows ``tl.dot`` tiles of :data:`MAX_ROWS`."""
    import triton

    from eyas.verifier.decode_mlp_kernels import KERNELS, TUNED, TUNED_FEW, TUNED_ROW

    ieee = args[0].dtype == torch.float32  # fp32 models multiply in fp32, not TF32

    def grid(meta):
        return (triton.cdiv(N, meta["BLOCK_N"]),)

    if M == 1:
        block_m, tuned = 1, TUNED_ROW
    elif M <= FEW_ROWS:
        block_m, tuned = triton.next_power_of_2(M), TUNED_FEW
    else:
        block_m, tuned = MAX_ROWS, TUNED
    if interpreting():  # the CPU interpreter: one tile, no timing
        KERNELS[name][grid](*args, K=K, IEEE=ieee, PDL=False, BLOCK_M=block_m, BLOCK_N=16, BLOCK_K=64)
    else:
        pdl = PDL and pdl_capable(args[0].device)
        tuned[name][grid](*args, K=K, IEEE=ieee, PDL=pdl, BLOCK_M=block_m, launch_pdl=pdl)


#: the most rows summed as products, as one row is (a verification's K + 1 up to K = 7); more rows take ``tl.dot``
#: tiles of 16 (at a verification's 4 rows those tiles, 12 of 16 rows padding, ran slower than cuBLAS: the round
#: 2.315 against 2.089 ms on an H100, docs/BENCHMARKS.md)
FEW_ROWS = 8


#: launch the kernels with programmatic dependent launch where the GPU has it (Hopper on): each starts while the
#: kernel before it ends and reads its weights meanwhile (about a microsecond of a launch's latency each, where a
#: decoding step is launch-bound); off: launched as any kernel
PDL = True


@torch.library.custom_op("eyas::decode_gate_up", mutates_args=())
def _decode_gate_up(residual: torch.Tensor, attn: torch.Tensor, norm_weight: torch.Tensor, eps: float,
                    gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:  # fmt: skip
    M, K = residual.shape
    N = gate.shape[0]
    h = residual.new_empty(M, N)
    args = (residual, attn, norm_weight, gate, up, h, M, N, eps, residual.stride(0), gate.stride(0), h.stride(0))
    _launch("gate_up", args, M, N, K)
    return h


@_decode_gate_up.register_fake
def _(residual, attn, norm_weight, eps, gate, up):
    return residual.new_empty(residual.shape[0], gate.shape[0])


@torch.library.custom_op("eyas::decode_down", mutates_args=())
def _decode_down(h: torch.Tensor, down: torch.Tensor, residual: torch.Tensor, attn: torch.Tensor) -> torch.Tensor:
    M, K = h.shape
    N = down.shape[0]
    out = residual.new_empty(M, N)
    _launch("down", (h, down, residual, attn, out, M, N, h.stride(0), down.stride(0), residual.stride(0)), M, N, K)
    return out


@_decode_down.register_fake
def _(h, down, residual, attn):
    return residual.new_empty(residual.shape)


def decode_mlp(norm, mlp, residual: torch.Tensor, attn: torch.Tensor) -> torch.Tensor:
    """A pre-norm layer's second half, ``s + mlp(norm(s))`` with ``s = residual + attn``, in two kernels
    (:func:`fits` must hold for ``norm``, ``mlp`` and ``residual``). ``residual``, ``attn``: ``[..., H]``."""
    shape = residual.shape
    H = shape[-1]
    res, att = residual.reshape(-1, H).contiguous(), attn.reshape(-1, H).contiguous()  # [M, H]
    h = _decode_gate_up(res, att, norm.weight, float(norm.variance_epsilon), mlp.gate_proj.weight, mlp.up_proj.weight)
    return _decode_down(h, mlp.down_proj.weight, res, att).reshape(shape)  # [M, H] -> [..., H]
