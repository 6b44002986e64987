"""Mixed precision for training the draft: working weights cast once per optimizer step, fp32 weight gradients
accumulated by the weight-gradient matmul itself.

Under ``torch.autocast`` each *use* of an fp32 weight casts it to bf16 (training-time test runs the layer
three times, so three casts, and a compiled region casts again in its backward), and each use's weight
gradient comes back as a bf16 matrix that is cast to fp32 and added to ``.grad``: per step about 4 ms of the
35 ms step at Llama-3.1-8B draft dims on an H200 (BENCHMARKS.md, fourth session's profile). Here

- the bf16 working copy of a weight is made once, when the fp32 master changed (its version counter moved:
  the optimizer step, a checkpoint load), and shared by every TTT step, forward and backward;
- the weight gradient of every use is written straight into the fp32 ``.grad`` by one matmul,
  ``grad += g^T x`` with an fp32 output (cuBLAS beta = 1), so no bf16-rounded partial gradient is formed
  and nothing is cast or added afterwards (Megatron-LM's "gradient accumulation fusion", Narayanan et al.
  2021, does the same into its ``main_grad``).

The forward values and input gradients are those of autocast (the same bf16 weights and inputs); the weight
gradients are at least as exact (fp32 across TTT steps and micro-batches, where autocast rounded each
step's share to bf16). Because ``.grad`` is written outside autograd's ``AccumulateGrad``, DDP's and FSDP's
gradient hooks would not see it: :func:`use_working_weights` is for a single process.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn


def add_matmul(acc: torch.Tensor, a: torch.Tensor, b: torch.Tensor) -> None:
    """``acc += a @ b`` accumulated in ``acc``'s dtype: for bf16 inputs on CUDA one cuBLAS call with an fp32
    output (``torch.addmm(..., out_dtype=)``), so no bf16-rounded partial product is ever formed."""
    if a.dtype == acc.dtype:
        acc.addmm_(a, b)
    elif a.is_cuda and hasattr(torch.ops.aten.addmm, "dtype_out"):
        torch.addmm(acc, a, b, out_dtype=acc.dtype, out=acc)
    else:
        acc += (a @ b).to(acc.dtype)


def accumulate_grad(param: torch.Tensor, a: torch.Tensor, b: torch.Tensor) -> None:
    """``param.grad += a @ b`` in the parameter's dtype (the first contribution allocates ``.grad``)."""
    if param.grad is None:
        if a.dtype == param.dtype:
            param.grad = a @ b
        elif a.is_cuda and hasattr(torch.ops.aten.mm, "dtype"):
            param.grad = torch.mm(a, b, out_dtype=param.dtype)
        else:
            param.grad = (a @ b).to(param.dtype)
    else:
        add_matmul(param.grad, a, b)


class _WorkingLinear(torch.autograd.Function):
    """``y = x W^T`` on the working copy of ``W``; backward returns the input gradient and adds the weight
    gradient (fp32) to ``weight.grad`` itself, so autograd gets ``None`` for the weight."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, weight: nn.Parameter, working: torch.Tensor) -> torch.Tensor:
        xw = x.to(working.dtype)
        ctx.save_for_backward(xw, working)
        ctx.weight, ctx.x_dtype = weight, x.dtype
        return F.linear(xw, working)

    @staticmethod
    def backward(ctx, grad_out: torch.Tensor):
        xw, working = ctx.saved_tensors
        g = grad_out.to(working.dtype)
        grad_x = (g @ working).to(ctx.x_dtype) if ctx.needs_input_grad[0] else None
        if ctx.needs_input_grad[1]:
            # [..., out]^T [..., in] -> [out, in], accumulated in fp32 over TTT steps and micro-batches
            accumulate_grad(ctx.weight, g.reshape(-1, g.shape[-1]).t(), xw.reshape(-1, xw.shape[-1]))
        return grad_x, None, None


class WorkingLinear(nn.Linear):
    """An ``nn.Linear`` (same parameters and state-dict keys) that computes with a working copy of its weight
    in ``working_dtype``, recast only when the master weight has changed."""

    working_dtype: torch.dtype
    _working: torch.Tensor | None
    _working_key: tuple | None

    def working_weight(self) -> torch.Tensor:
        w = self.weight
        key = (w._version, w.data_ptr(), w.device, self.working_dtype)
        if self._working_key != key:
            self._working = w.detach().to(self.working_dtype)
            self._working_key = key
        return self._working

    # A compiled region around this call breaks the graph here: its backward writes `.grad`, which a traced
    # backward graph cannot, and the matmuls gain nothing from being traced.
    @torch.compiler.disable
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.bias is not None:
            raise NotImplementedError("WorkingLinear has no bias path (the draft's linears have none)")
        return _WorkingLinear.apply(x, self.weight, self.working_weight())


def use_working_weights(module: nn.Module, dtype: torch.dtype, *, skip: tuple[nn.Module, ...] = ()) -> int:
    """Turn every bias-free ``nn.Linear`` under ``module`` (except ``skip``) into a :class:`WorkingLinear`
    computing in ``dtype``, in place (parameters and state-dict keys unchanged, as FSDP2's ``fully_shard``
    swaps a module's class). Returns how many were converted."""
    n = 0
    for m in module.modules():
        if type(m) is nn.Linear and m.bias is None and not any(m is s for s in skip):
            m.__class__ = WorkingLinear
            m.working_dtype, m._working, m._working_key = dtype, None, None
            n += 1
    return n
