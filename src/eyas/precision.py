"""Mixed precision for training the draft: working weights cast once per optimizer step, fp32 weight gradients
straight from the weight-gradient matmul.

Under ``torch.autocast`` each *use* of an fp32 weight casts it to bf16 (training-time test runs the layer
three times, so three casts, and a compiled region casts again in its backward), and each use's weight
gradient comes back as a bf16 matrix that is then cast to fp32: about 3.7 ms of the 35 ms step at
Llama-3.1-8B draft dims on an H200 (BENCHMARKS.md, fourth session's profile). Here

- the bf16 working copy of a weight is refreshed in place, once, when the fp32 master changed (its version
  counter moved: the optimizer step, a checkpoint load), and shared by every TTT step, forward and backward;
- the weight gradient of each use is one matmul with an fp32 output (``torch.mm(..., out_dtype=)``), so no
  bf16-rounded partial gradient is formed or cast (Megatron-LM keeps its wgrad in fp32 the same way,
  Narayanan et al. 2021); autograd sums the uses into ``.grad`` as usual, so DDP's gradient hooks see them.

Forward values and input gradients are autocast's (the same bf16 weights and inputs); weight gradients are
at least as exact. The matmuls stay inside the compiled regions (the function is traceable); a compiled
region cannot see the master weight change, so :func:`refresh_working_weights` runs before every forward
(``eyas.train.TTTObjective`` calls it). FSDP2 casts its own gathered shards and does not use this.
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


def matmul_to(a: torch.Tensor, b: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """``a @ b`` returned in ``dtype``: for bf16 inputs on CUDA one cuBLAS call with an fp32 output."""
    if a.dtype == dtype:
        return a @ b
    if a.is_cuda and hasattr(torch.ops.aten.mm, "dtype"):
        return torch.mm(a, b, out_dtype=dtype)
    return (a @ b).to(dtype)


class _WorkingLinear(torch.autograd.Function):
    """``y = x W^T`` on the working copy of ``W``; the weight's gradient is formed in the master's dtype."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, weight: nn.Parameter, working: torch.Tensor) -> torch.Tensor:
        xw = x.to(working.dtype)
        # the weight only serves the input's gradient: fc's input (the verifier's states) needs none
        ctx.save_for_backward(xw, working if ctx.needs_input_grad[0] else None)
        ctx.x_dtype, ctx.w_dtype = x.dtype, weight.dtype
        return F.linear(xw, working)

    @staticmethod
    def backward(ctx, grad_out: torch.Tensor):
        xw, working = ctx.saved_tensors
        g = grad_out.to(xw.dtype)  # the working dtype
        grad_x = (g @ working).to(ctx.x_dtype) if ctx.needs_input_grad[0] else None
        # [..., out]^T [..., in] -> [out, in], in fp32 from the matmul itself
        grad_w = matmul_to(g.reshape(-1, g.shape[-1]).t(), xw.reshape(-1, xw.shape[-1]), ctx.w_dtype) \
            if ctx.needs_input_grad[1] else None  # fmt: skip
        return grad_x, grad_w, None


class WorkingLinear(nn.Linear):
    """An ``nn.Linear`` (same parameters and state-dict keys) that computes with a working copy of its weight
    in ``working_dtype``, refreshed by :meth:`refresh`; with ``keep_working`` false (a weight used once per
    forward, like ``fc``) the copy is cast at each call instead and never outlives it."""

    working_dtype: torch.dtype
    keep_working: bool
    _working: torch.Tensor | None
    _working_key: tuple | None

    def refresh(self) -> None:
        """Bring the working copy up to date with the master weight (in place, so a compiled region that
        holds it sees the new values); nothing to do when the master has not changed."""
        if not self.keep_working:
            return
        w = self.weight
        key = (w._version, w.data_ptr(), w.device)
        if self._working_key == key:
            return
        if w.dtype == self.working_dtype:  # float32 on CPU: the master itself, no copy (one alias per storage)
            if self._working is None or self._working.data_ptr() != w.data_ptr():
                self._working = w.detach()
        elif self._working is None or self._working.shape != w.shape or self._working.device != w.device:
            self._working = w.detach().to(self.working_dtype)
        else:
            self._working.copy_(w.detach())
        self._working_key = key

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.bias is not None:
            raise NotImplementedError("WorkingLinear has no bias path (the draft's linears have none)")
        if not self.keep_working:
            return _WorkingLinear.apply(x, self.weight, self.weight.detach().to(self.working_dtype))
        if not torch.compiler.is_compiling():  # eager calls check for themselves; compiled ones rely on the caller
            self.refresh()
        return _WorkingLinear.apply(x, self.weight, self._working)


def refresh_working_weights(module: nn.Module) -> None:
    """Refresh every :class:`WorkingLinear` under ``module``: call before each forward that may be compiled."""
    for m in module.modules():
        if isinstance(m, WorkingLinear):
            m.refresh()


def use_working_weights(module: nn.Module, dtype: torch.dtype, *, skip: tuple[nn.Module, ...] = (),
                        cast_per_call: tuple[nn.Module, ...] = ()) -> int:  # fmt: skip
    """Turn every bias-free ``nn.Linear`` under ``module`` (except ``skip``) into a :class:`WorkingLinear`
    computing in ``dtype``, in place (parameters and state-dict keys unchanged, as FSDP2's ``fully_shard``
    swaps a module's class). Those in ``cast_per_call`` keep no copy between calls. Returns how many were
    converted."""
    n = 0
    for m in module.modules():
        if type(m) is nn.Linear and m.bias is None and not any(m is s for s in skip):
            m.__class__ = WorkingLinear
            m.working_dtype, m._working, m._working_key = dtype, None, None
            m.keep_working = not any(m is c for c in cast_per_call)
            m.refresh()
            n += 1
    return n
