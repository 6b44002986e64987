"""Mixed precision for training the draft: working weights cast once per optimizer step, fp32 weight gradients
straight from the weight-gradient matmul.

Under ``torch.autocast`` each *use* of an fp32 weight casts it to bf16 (training-time test runs the layer
three times, so three casts, and a compiled region casts again in its backward), and each use's weight
gradient comes back as a bf16 matrix that is then cast to fp32: about 3.7 ms of the 35 ms step at
Llama-3.1-8B draft dims on an H200 (docs/BENCHMARKS.md, the profile recorded at commit 98edbcd). Here

- the bf16 working copy of a weight is refreshed in place, once, when the fp32 master changed (its version
  counter moved: the optimizer step, a checkpoint load), and shared by every TTT step, forward and backward;
- the weight gradient of each use is one matmul with an fp32 output (``torch.mm(..., out_dtype=)``), so no
  bf16-rounded partial gradient is formed or cast (Megatron-LM keeps its wgrad in fp32 the same way,
  Narayanan et al. 2021); autograd sums the uses into ``.grad`` as usual, so DDP's gradient hooks see them.

Forward values and input gradients are autocast's (the same bf16 weights and inputs); weight gradients are
at least as exact. The matmuls stay inside the compiled regions (the function is traceable); a compiled
region cannot see the master weight change, so :func:`refresh_working_weights` runs before every forward
(``eyas.training.trainer.TTTObjective`` calls it). FSDP2 casts its own gathered shards and does not use this.

Deferred weight gradients (:func:`begin_deferred_wgrad`; `eyas train`'s default where it applies): training-time
test uses each layer weight once per TTT step, and autograd forms one fp32 gradient per use and adds them (two
in-place adds of the whole layer's gradients per micro-batch: 3.2 ms of a 63 ms step at Kimi-K2.5 dims on an H200,
the profile recorded at commit d42f3e5), holding the running sum and the next use's gradient at once. Deferred,
each use's gradient is accumulated by its matmul into one fp32 buffer (``torch.addmm(..., out_dtype=)``, beta 1)
outside the compiled region, and autograd receives the finished sum once: no adds, no second gradient-sized
buffer (measured on an H200 at commit 912458c: 2.0 GiB less peak at Kimi-K2.5 dims, 0.97 GiB at Llama-3.1-8B
dims).
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import nn

from eyas.core.triton import interpreting


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
        self.x: list[torch.Tensor | None] = []  # what a forward writes: every use's input, or (staged) one slot
        self.kept: list[torch.Tensor | None] = self.x  # every use's input, read in backward
        self.current = 0  # staged: the use whose input slot 0 holds
        self.acc: torch.Tensor | None = None

    def begin(self, uses: int, *, staged: bool = False) -> None:
        """``staged``: a forward writes each use's input into slot 0 of ``x`` (:func:`stage_deferred_use` moves
        it to ``kept`` between uses), so a compiled use's code is the same for every use."""
        self.x[:] = [None] * (1 if staged else uses)  # the same list object: a compiled region writes into it
        self.kept = [None] * uses if staged else self.x
        self.current, self.acc = 0, None

    def stage(self, use: int | None) -> None:
        """Keep the staged input of the use that just ran; ``use`` runs next (None: the forward is done)."""
        if self.kept is not self.x and self.x[0] is not None:
            self.kept[self.current], self.x[0] = self.x[0], None
        if use is not None:
            self.current = use

    def add(self, use: int, g: torch.Tensor, dtype: torch.dtype) -> None:
        """Add use ``use``'s ``g^T x`` into the sum (in ``dtype``, by the matmul itself)."""
        x, self.kept[use] = self.kept[use], None
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
    _all_sinks: list[torch.Tensor]  # staged: every use's sink, the current one in _sinks[0]
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
            m._sinks, m._all_sinks, m._use = [], [], 0
            m.refresh()
            n += 1
    return n


def begin_deferred_wgrad(module: nn.Module, *, uses: int, lead_shape: tuple[int, ...], staged: bool = False) -> int:
    """Before a forward (with gradients) that calls each kept-copy :class:`WorkingLinear` under ``module``
    exactly ``uses`` times on inputs ``[*lead_shape, in]`` (training-time test: once per step): each use's
    weight gradient will be accumulated into one fp32 buffer by its matmul and handed to autograd once, after
    the last use's backward. Not with activation checkpointing (a recomputed forward would use them again).
    ``staged``: each use reads its sink from, and writes its input to, slot 0, and :func:`stage_deferred_use`
    before each use (and after the last) puts them in place, so a compiled region that holds one use (a TTT step
    with fixed shapes) runs one compiled version for every use, not one per use index.
    Returns how many linears defer."""
    n = 0
    for m in module.modules():
        if isinstance(m, WorkingLinear) and m._deferred is not None:
            m._deferred.begin(uses, staged=staged)
            anchor = _Collect.apply(m.weight, m._deferred)
            sinks = [_Sink.apply(anchor, m._deferred, k, (*lead_shape, m.out_features), m.working_dtype)
                     for k in range(uses)]  # fmt: skip
            m._all_sinks = sinks
            m._sinks[:] = sinks[:1] if staged else sinks  # the same list object: a compiled region reads it
            m._use = 0
            n += 1
    return n


def stage_deferred_use(module: nn.Module, use: int | None) -> None:
    """Between the uses of a staged :func:`begin_deferred_wgrad` forward: keep each linear's input of the use
    that ran, and put use ``use``'s sink in slot 0 (None: after the last use)."""
    for m in module.modules():
        if isinstance(m, WorkingLinear) and m._deferred is not None and m._sinks:
            m._deferred.stage(use)
            if use is not None:
                m._sinks[0] = m._all_sinks[use]
                m._use = 0


def end_deferred_wgrad(module: nn.Module) -> None:
    """Back to per-use weight gradients through autograd (for forwards not prepared by
    :func:`begin_deferred_wgrad`)."""
    for m in module.modules():
        if isinstance(m, WorkingLinear) and m.keep_working:
            m._sinks.clear()
            m._all_sinks = []
            m._use = 0


# --------------------------------------------------------------------------- the optimizer step


_adamw_kernel = None


def _triton_adamw():
    """The Triton kernel of :class:`FusedAdamW`, built on first use (Triton is only imported on CUDA)."""
    global _adamw_kernel
    if _adamw_kernel is not None:
        return _adamw_kernel
    import triton
    import triton.language as tl

    @triton.jit
    def adamw(p_ptr, g_ptr, m_ptr, v_ptr, w_ptr, step_ptr, scale_ptr, n, lr, beta1, beta2, log2_beta1,
              log2_beta2, eps, weight_decay, HAS_WORKING: tl.constexpr, HAS_SCALE: tl.constexpr,
              BLOCK: tl.constexpr):  # fmt: skip
        offs = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
        mask = offs < n
        p = tl.load(p_ptr + offs, mask=mask)
        g = tl.load(g_ptr + offs, mask=mask)
        m = tl.load(m_ptr + offs, mask=mask)
        v = tl.load(v_ptr + offs, mask=mask)
        if HAS_SCALE:  # the clip factor (clip_gradients), as torch's fused kernel divides by grad_scale
            g = g / tl.load(scale_ptr)
        step = tl.load(step_ptr)  # already counted for this step, as torch keeps it: a float32 on the device
        p = p - lr * weight_decay * p  # decoupled weight decay (Loshchilov & Hutter 2019), before the update
        m = beta1 * m + (1.0 - beta1) * g
        v = beta2 * v + (1.0 - beta2) * g * g
        bias1 = 1.0 - tl.exp2(step * log2_beta1)  # 1 - beta1^step
        bias2 = 1.0 - tl.exp2(step * log2_beta2)
        p = p - (lr / bias1) * m / (tl.sqrt(v) / tl.sqrt(bias2) + eps)
        tl.store(p_ptr + offs, p, mask=mask)
        tl.store(m_ptr + offs, m, mask=mask)
        tl.store(v_ptr + offs, v, mask=mask)
        if HAS_WORKING:
            tl.store(w_ptr + offs, p.to(w_ptr.dtype.element_ty, fp_downcast_rounding="rtne"), mask=mask)

    _adamw_kernel = adamw
    return adamw


class FusedAdamW(torch.optim.AdamW):
    """torch's fused AdamW, whose CUDA step also writes each weight's working copy: one Triton kernel per
    parameter reads the fp32 weight, gradient and moments once and writes the weight, the moments and the bf16
    working copy (:class:`WorkingLinear`), where torch's fused step and the copies' refresh read the updated
    weights a second time (3.5 GB a step at Kimi-K2.5 draft dims). The same update as torch's (decoupled weight
    decay, bias corrections from the step count kept on the device, gradients divided by ``grad_scale`` as
    :func:`eyas.training.optim.clip_gradients` sets it), the same state and state dict, so checkpoints of either resume in
    the other. Elsewhere (CPU, Triton missing, ``amsgrad``/``maximize``) it is torch's step."""

    def __init__(self, params, **kwargs) -> None:
        super().__init__(params, **{**kwargs, "fused": True})
        self._working: dict[int, WorkingLinear] = {}

    def attach_working(self, module: nn.Module) -> int:
        """Write the working copies of ``module``'s kept-copy :class:`WorkingLinear` layers at each step;
        returns how many."""
        self._working = {id(m.weight): m for m in module.modules() if isinstance(m, WorkingLinear) and m.keep_working}
        return len(self._working)

    def _fast(self) -> bool:
        ps = [p for g in self.param_groups for p in g["params"]]
        # under Triton's interpreter (TRITON_INTERPRET=1) the kernel runs on CPU tensors too: the CPU tests use it
        anywhere = interpreting()
        if not ps or not all((p.is_cuda or anywhere) and p.dtype == torch.float32 and p.is_contiguous() for p in ps):
            return False
        if any(
            g["amsgrad"] or g["maximize"] or g["differentiable"] or torch.is_tensor(g["lr"]) for g in self.param_groups
        ):
            return False
        try:
            _triton_adamw()
        except ImportError:
            return False
        return True

    @torch.no_grad()
    def step(self, closure=None):
        if closure is not None or not self._fast():
            return super().step(closure)
        kernel = _triton_adamw()
        scale = getattr(self, "grad_scale", None)
        work = []  # (param, grad, state, group)
        for group in self.param_groups:
            for p in group["params"]:
                if p.grad is None:
                    continue
                state = self.state[p]
                if not state:  # torch's fused AdamW's initial state
                    state["step"] = torch.zeros((), dtype=torch.float32, device=p.device)
                    state["exp_avg"] = torch.zeros_like(p, memory_format=torch.preserve_format)
                    state["exp_avg_sq"] = torch.zeros_like(p, memory_format=torch.preserve_format)
                work.append((p, p.grad, state, group))
        if not work:
            return None
        torch._foreach_add_([s["step"] for _, _, s, _ in work], 1.0)
        BLOCK = 4096
        for p, g, state, group in work:
            if not g.is_contiguous():
                g = g.contiguous()
            lin = self._working.get(id(p))
            w = lin._working if lin is not None else None
            has_w = w is not None and w.dtype != p.dtype and w.shape == p.shape and w.is_contiguous() \
                and w.device == p.device  # fmt: skip
            beta1, beta2 = group["betas"]
            n = p.numel()
            kernel[(-(-n // BLOCK),)](  # one program per BLOCK elements
                p, g, state["exp_avg"], state["exp_avg_sq"], w if has_w else p, state["step"],
                scale if scale is not None else state["step"], n, float(group["lr"]), beta1, beta2,
                math.log2(beta1), math.log2(beta2), group["eps"], group["weight_decay"],
                HAS_WORKING=has_w, HAS_SCALE=scale is not None, BLOCK=BLOCK, num_warps=8)  # fmt: skip
            # the kernel wrote through raw pointers: count the in-place update as torch's own step does
            torch.autograd.graph.increment_version(p)
            if has_w:  # the copy is the new weights': its refresh has nothing to do until the master moves again
                lin._working_key = (p._version, p.data_ptr(), p.device)
        return None
