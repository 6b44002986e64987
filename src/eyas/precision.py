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

Deferred weight gradients (:func:`begin_deferred_wgrad`; `eyas train`'s default where it applies): training-time
test uses each layer weight once per TTT step, and autograd forms one fp32 gradient per use and adds them (two
in-place adds of the whole layer's gradients per micro-batch: 3.2 ms of a 63 ms step at Kimi-K2.5 dims on an H200,
seventh session's profile), holding the running sum and the next use's gradient at once. Deferred, each use's
gradient is accumulated by its matmul into one fp32 buffer (``torch.addmm(..., out_dtype=)``, beta 1) outside the
compiled region, and autograd receives the finished sum once: no adds, no second gradient-sized buffer (measured on
an H200, eighth session: 2.0 GiB less peak at Kimi-K2.5 dims, 0.97 GiB at Llama-3.1-8B dims).
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


class _DeferredLinear(torch.autograd.Function):
    """``y = x W^T + sink`` on the working copy: the input's gradient here, the weight's left to ``sink``'s node
    (:class:`_Sink`), which autograd hands ``y``'s gradient."""

    @staticmethod
    def forward(ctx, xw: torch.Tensor, working: torch.Tensor, sink: torch.Tensor) -> torch.Tensor:
        ctx.save_for_backward(working)
        return F.linear(xw, working) + sink

    @staticmethod
    def backward(ctx, grad_out: torch.Tensor):
        (working,) = ctx.saved_tensors
        g = grad_out.to(working.dtype)
        return g @ working, None, g


_zeros: dict[tuple[torch.dtype, torch.device], torch.Tensor] = {}


def _zero(dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """One zero scalar per dtype and device, viewed by every sink (no fill kernel per use)."""
    key = (dtype, device)
    if key not in _zeros:
        _zeros[key] = torch.zeros((), dtype=dtype, device=device)
    return _zeros[key]


class _DeferredGrad:
    """One weight's deferred gradient over one forward's uses: each use's input, kept by the layer's forward,
    and the fp32 sum its sinks build in backward. One object per weight for the whole run (a compiled region
    holds it), reset by :meth:`begin`."""

    def __init__(self) -> None:
        self.x: list[torch.Tensor | None] = []
        self.acc: torch.Tensor | None = None

    def begin(self, uses: int) -> None:
        self.x[:] = [None] * uses  # the same list object: a compiled region writes into it
        self.acc = None

    def add(self, use: int, g: torch.Tensor, dtype: torch.dtype) -> None:
        """Add use ``use``'s ``g^T x`` into the sum (in ``dtype``, by the matmul itself)."""
        x, self.x[use] = self.x[use], None
        if x is None:
            raise RuntimeError(f"deferred weight gradient: use {use} has no input (a forward ran without "
                               "begin_deferred_wgrad, or was recomputed)")  # fmt: skip
        g2, x2 = g.reshape(-1, g.shape[-1]), x.reshape(-1, x.shape[-1])  # [tokens, out], [tokens, in]
        if self.acc is None:
            self.acc = matmul_to(g2.t(), x2, dtype)  # [out, in]
        else:
            add_matmul(self.acc, g2.t(), x2)

    def finish(self) -> torch.Tensor | None:
        acc, self.acc = self.acc, None
        return acc


class _Collect(torch.autograd.Function):
    """The one node between a deferred weight and its sinks: autograd runs its backward after every sink's (it
    depends on all of them), and it hands the finished sum to the weight, once, so the weight's gradient hooks
    (DDP's) fire once per backward as usual."""

    @staticmethod
    def forward(ctx, weight: torch.Tensor, state: _DeferredGrad) -> torch.Tensor:
        ctx.state = state
        ctx.set_materialize_grads(False)  # the sinks send no gradient back: no zeros to make for nothing
        return _zero(weight.dtype, weight.device).view(())

    @staticmethod
    def backward(ctx, _unused: torch.Tensor | None):
        return ctx.state.finish(), None


class _Sink(torch.autograd.Function):
    """One deferred use's gradient port: zeros shaped like the use's output (added to it, so the output's
    gradient arrives here); backward adds that use's share of the weight gradient to the sum."""

    @staticmethod
    def forward(ctx, anchor: torch.Tensor, state: _DeferredGrad, use: int, shape: tuple[int, ...],
                dtype: torch.dtype) -> torch.Tensor:  # fmt: skip
        ctx.state, ctx.use, ctx.w_dtype = state, use, anchor.dtype
        return _zero(dtype, anchor.device).expand(shape)  # stride 0: nothing to read

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        ctx.state.add(ctx.use, grad, ctx.w_dtype)
        return None, None, None, None, None


class WorkingLinear(nn.Linear):
    """An ``nn.Linear`` (same parameters and state-dict keys) that computes with a working copy of its weight
    in ``working_dtype``, refreshed by :meth:`refresh`; with ``keep_working`` false (a weight used once per
    forward, like ``fc``) the copy is cast at each call instead and never outlives it."""

    working_dtype: torch.dtype
    keep_working: bool
    _working: torch.Tensor | None
    _working_key: tuple | None
    _deferred: _DeferredGrad | None  # set when deferred weight gradients are possible (use_working_weights)
    _sinks: list[torch.Tensor]  # this forward's sinks, one per use (begin_deferred_wgrad); empty: not deferred
    _use: int  # the next use's index within this forward

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
        if self._sinks and torch.is_grad_enabled():
            use = self._use
            self._use = use + 1
            xw = x.to(self.working_dtype)
            self._deferred.x[use] = xw  # for this use's sink, in backward
            return _DeferredLinear.apply(xw, self._working, self._sinks[use])
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
            m._deferred = _DeferredGrad() if m.keep_working else None
            m._sinks, m._use = [], 0
            m.refresh()
            n += 1
    return n


def begin_deferred_wgrad(module: nn.Module, *, uses: int, lead_shape: tuple[int, ...]) -> int:
    """Before a forward (with gradients) that calls each kept-copy :class:`WorkingLinear` under ``module``
    exactly ``uses`` times on inputs ``[*lead_shape, in]`` (training-time test: once per step): each use's
    weight gradient will be accumulated into one fp32 buffer by its matmul and handed to autograd once, after
    the last use's backward. Not with activation checkpointing (a recomputed forward would use them again).
    Returns how many linears defer."""
    n = 0
    for m in module.modules():
        if isinstance(m, WorkingLinear) and m._deferred is not None:
            m._deferred.begin(uses)
            anchor = _Collect.apply(m.weight, m._deferred)
            sinks = [_Sink.apply(anchor, m._deferred, k, (*lead_shape, m.out_features), m.working_dtype)
                     for k in range(uses)]  # fmt: skip
            m._sinks[:] = sinks  # the same list object: a compiled region reads it
            m._use = 0
            n += 1
    return n


def end_deferred_wgrad(module: nn.Module) -> None:
    """Back to per-use weight gradients through autograd (for forwards not prepared by
    :func:`begin_deferred_wgrad`)."""
    for m in module.modules():
        if isinstance(m, WorkingLinear) and m.keep_working:
            m._sinks.clear()
            m._use = 0
