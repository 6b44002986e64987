"""Working weights with fp32 weight gradients from the matmul (eyas.training.precision) against plain autograd, and the
clip folded into the fused AdamW against ``clip_grad_norm_``."""

from __future__ import annotations

import copy

import pytest
import torch
from triton_interpreter import in_child

from eyas.draft.model import DraftConfig, Eagle3Draft
from eyas.training.precision import WorkingLinear, use_working_weights
from eyas.training.optim import clip_gradients

H = 32


def _draft(**over) -> Eagle3Draft:
    torch.manual_seed(0)
    cfg = DraftConfig(hidden_size=H, intermediate_size=64, num_attention_heads=4, num_key_value_heads=2, head_dim=8,
                      vocab_size=200, draft_vocab_size=80, aux_layer_ids=[1, 2, 3], **over)  # fmt: skip
    return Eagle3Draft(cfg)


def _micro_batches(n: int = 2, T: int = 24):
    g = torch.Generator().manual_seed(1)
    return [(torch.randint(0, 200, (2, T), generator=g), torch.randn(2, T, 3 * H, generator=g, dtype=torch.float64))
            for _ in range(n)]  # fmt: skip


def _grads(model: Eagle3Draft, batches) -> dict[str, torch.Tensor]:
    """Two micro-batches, each three TTT steps, gradients accumulated over both."""
    model.zero_grad(set_to_none=True)
    for i, (ids, aux) in enumerate(batches):
        outs = model.ttt(ids, aux.to(model.fc.weight.dtype), ttt_steps=3)
        loss = sum((k + 1 + i) * model.compute_logits(o).logsumexp(-1).mean() for k, o in enumerate(outs))
        loss.backward()
    return {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}


@pytest.mark.parametrize("checkpointing", [False, True])
def test_working_weights_train_like_autograd(checkpointing):
    """float64: every gradient (summed over TTT steps and micro-batches) equals plain autograd's."""
    ref = _draft().double()
    work = copy.deepcopy(ref)
    # fc + q, k, v, o + gate, up, down; fc (used once per forward) casts per call and keeps no copy
    assert use_working_weights(work, torch.float64, skip=(work.lm_head,), cast_per_call=(work.fc,)) == 8
    ref.gradient_checkpointing = work.gradient_checkpointing = checkpointing
    batches = _micro_batches()
    g_ref, g_work = _grads(ref, batches), _grads(work, batches)
    assert g_ref.keys() == g_work.keys()
    for name in g_ref:
        torch.testing.assert_close(g_work[name], g_ref[name], rtol=1e-12, atol=1e-12, msg=name)
    assert set(ref.state_dict()) == set(work.state_dict())  # the checkpoint's keys are unchanged
    assert work.fc._working is None and work.layers[0].mlp.up_proj._working is not None


def test_working_copy_follows_the_master_weight():
    """The working copy is refreshed in place when the master changes (an optimizer step, a loaded state), by
    an eager call or by refresh_working_weights (what a compiled caller relies on), and only then."""
    from eyas.training.precision import refresh_working_weights

    model = _draft()
    use_working_weights(model, torch.bfloat16, skip=(model.lm_head,))
    lin: WorkingLinear = model.layers[0].self_attn.q_proj
    x = torch.randn(3, 2 * H)
    exact = lambda: torch.nn.functional.linear(x.bfloat16(), lin.weight.bfloat16())  # noqa: E731
    torch.testing.assert_close(lin(x), exact(), rtol=0, atol=0)
    working = lin._working
    key = lin._working_key
    lin(x)
    assert lin._working_key == key  # unchanged master: no recast
    opt = torch.optim.AdamW(model.parameters(), lr=0.1)
    lin(x).float().sum().backward()
    assert lin.weight.grad.dtype == torch.float32
    opt.step()
    refresh_working_weights(model)
    assert lin._working is working  # in place: a compiled region holding it sees the new values
    torch.testing.assert_close(working, lin.weight.detach().bfloat16(), rtol=0, atol=0)
    torch.testing.assert_close(lin(x), exact(), rtol=0, atol=0)
    state = {k: torch.randn_like(v) if v.is_floating_point() else v for k, v in model.state_dict().items()}
    model.load_state_dict(state)
    torch.testing.assert_close(lin(x), exact(), rtol=0, atol=0)
    torch.testing.assert_close(working, state["layers.0.self_attn.q_proj.weight"].bfloat16(), rtol=0, atol=0)


def test_bf16_working_weights_accumulate_in_fp32():
    """bf16 compute, fp32 master: the gradient of three uses is the fp32 sum of the three bf16 products."""
    torch.manual_seed(0)
    lin = torch.nn.Linear(16, 8, bias=False)
    use_working_weights(lin, torch.bfloat16)
    xs = [torch.randn(5, 16) for _ in range(3)]
    sum(lin(x).float().pow(2).sum() for x in xs).backward()
    w = lin.weight.detach().bfloat16()
    # each use: grad_out = 2y in bf16, its product with x in bf16 (CPU has no fp32-output bf16 matmul), summed in
    # fp32 by autograd
    expected = sum(((2 * (x.bfloat16() @ w.t())).t() @ x.bfloat16()).float() for x in xs)
    assert lin.weight.grad.dtype == torch.float32
    torch.testing.assert_close(lin.weight.grad, expected, rtol=1e-6, atol=1e-6)


def test_clip_folded_into_fused_adamw_equals_clip_grad_norm():
    torch.manual_seed(0)
    a = [torch.nn.Parameter(torch.randn(20, 10)) for _ in range(3)]
    b = [torch.nn.Parameter(p.detach().clone()) for p in a]
    opt_a, opt_b = torch.optim.AdamW(a, lr=1e-2, fused=True), torch.optim.AdamW(b, lr=1e-2, fused=True)
    for scale in (10.0, 0.01, 10.0):  # clipped, not clipped (the scale must fall back to 1), clipped
        grads = [scale * torch.randn(20, 10) for _ in a]
        for p, q, g in zip(a, b, grads):
            p.grad, q.grad = g.clone(), g.clone()
        na = clip_gradients(a, [opt_a], 1.0)
        nb = torch.nn.utils.clip_grad_norm_(b, 1.0)
        opt_a.step()
        opt_b.step()
        torch.testing.assert_close(na, nb)
        for p, q in zip(a, b):
            torch.testing.assert_close(p, q, rtol=1e-6, atol=1e-6)


def _deferred_grads(model: Eagle3Draft, batches, steps: int = 3) -> dict[str, torch.Tensor]:
    """As :func:`_grads`, each micro-batch's forward prepared for deferred weight gradients."""
    from eyas.training.precision import begin_deferred_wgrad

    model.zero_grad(set_to_none=True)
    for i, (ids, aux) in enumerate(batches):
        assert begin_deferred_wgrad(model, uses=steps, lead_shape=tuple(ids.shape)) == 7  # q k v o gate up down
        outs = model.ttt(ids, aux.to(model.fc.weight.dtype), ttt_steps=steps)
        down = model.layers[0].mlp.down_proj  # the deferred path ran (compiled too): every use kept its input
        assert down._use == steps and all(torch.is_tensor(x) for x in down._deferred.x)
        loss = sum((k + 1 + i) * model.compute_logits(o).logsumexp(-1).mean() for k, o in enumerate(outs))
        loss.backward()
        assert down._deferred.x == [None] * steps  # released by the backward
    return {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}


def test_deferred_weight_gradients_equal_autograd():
    """float64: with each use's weight gradient accumulated into one buffer by its matmul, every gradient
    (summed over TTT steps and micro-batches) equals plain autograd's; the layer's inputs kept for it are
    released by the backward."""
    ref = _draft().double()
    work = copy.deepcopy(ref)
    use_working_weights(work, torch.float64, skip=(work.lm_head,), cast_per_call=(work.fc,))
    batches = _micro_batches()
    g_ref, g_work = _grads(ref, batches), _deferred_grads(work, batches)
    assert g_ref.keys() == g_work.keys()
    for name in g_ref:
        torch.testing.assert_close(g_work[name], g_ref[name], rtol=1e-12, atol=1e-12, msg=name)
    up = work.layers[0].mlp.up_proj
    assert up._deferred.x == [None] * 3 and up._deferred.acc is None
    # without gradients (validation) and after end_deferred_wgrad the plain path runs
    from eyas.training.precision import end_deferred_wgrad

    end_deferred_wgrad(work)
    torch.testing.assert_close(_grads(work, batches)["layers.0.mlp.up_proj.weight"],
                               g_ref["layers.0.mlp.up_proj.weight"], rtol=1e-12, atol=1e-12)  # fmt: skip


def test_deferred_weight_gradients_compiled_equal_eager():
    """The compiled TTT regions with deferred weight gradients (the sinks and kept inputs cross the region's
    boundary) give eager autograd's gradients, and a second batch reuses the compiled graphs."""
    from eyas.training.trainer import compile_draft

    ref = _draft()
    work = copy.deepcopy(ref)
    use_working_weights(work, torch.float32, skip=(work.lm_head,), cast_per_call=(work.fc,))
    compile_draft(work)
    g_ref = _grads(ref, _micro_batches(1))
    g_work = _deferred_grads(work, _micro_batches(1))
    for name in g_ref:
        torch.testing.assert_close(g_work[name], g_ref[name], rtol=1e-4, atol=1e-5, msg=name)
    with torch._dynamo.config.patch(error_on_recompile=True):
        _deferred_grads(work, _micro_batches(2)[1:])


def test_deferred_weight_gradients_bf16_working_copies_equal_per_use():
    """bf16 working copies and fp32 masters (the GPU's dtypes; on CPU each bf16 product is rounded before the
    fp32 sum on both paths): deferred and per-use weight gradients are identical eager; compiled they agree to
    bf16 rounding (the deferred graph materialises other bf16 intermediates than the per-use one)."""
    from eyas.training.trainer import compile_draft

    for compiled in (False, True):
        ref = _draft()
        work = copy.deepcopy(ref)
        for m in (ref, work):
            use_working_weights(m, torch.bfloat16, skip=(m.lm_head,), cast_per_call=(m.fc,))
            if compiled:
                compile_draft(m)
        batches = [(ids, aux.float()) for ids, aux in _micro_batches(1)]
        with torch.autocast("cpu", dtype=torch.bfloat16):  # as training runs it (the head stays fp32 here)
            g_ref, g_work = _grads(ref, batches), _deferred_grads(work, batches)
        for name in g_ref:
            assert g_work[name].dtype == torch.float32, name
            if compiled:
                err = float((g_work[name] - g_ref[name]).norm() / g_ref[name].norm().clamp(min=1e-12))
                assert err < 1e-2, (name, err)
            else:
                torch.testing.assert_close(g_work[name], g_ref[name], rtol=0, atol=0, msg=name)


def _fused_adamw_run(monkeypatch, *, interpret: bool):
    """Three steps of FusedAdamW over a draft with bf16 working copies (two groups, a changed lr, the clip as
    grad_scale), beside torch's AdamW on an identical copy; returns both."""
    from eyas.training.precision import FusedAdamW
    from eyas.training.optim import build_optimizers

    if interpret:
        monkeypatch.setenv("TRITON_INTERPRET", "1")
    ours = _draft()
    use_working_weights(ours, torch.bfloat16, skip=(ours.lm_head,), cast_per_call=(ours.fc,))
    ref = copy.deepcopy(ours)
    (opt,) = build_optimizers(ours, name="adamw", lr=3e-3, weight_decay=0.1, fused=True)
    assert isinstance(opt, FusedAdamW) and opt.attach_working(ours) == 7
    (ref_opt,) = build_optimizers(ref, name="adamw", lr=3e-3, weight_decay=0.1, fused=False)
    g = torch.Generator().manual_seed(5)
    for step, scale in enumerate((30.0, 0.01, 30.0)):
        for (_, p), (_, q) in zip(ours.named_parameters(), ref.named_parameters()):
            if p.requires_grad:
                p.grad = scale * torch.randn(p.shape, generator=g)
                q.grad = p.grad.clone()
        for o in (opt, ref_opt):
            for grp in o.param_groups:
                grp["lr"] = 3e-3 * (step + 1) / 3  # a warmup schedule moves lr between steps
        clip_gradients([p for p in ours.parameters() if p.requires_grad], [opt], 1.0)
        torch.nn.utils.clip_grad_norm_([q for q in ref.parameters() if q.requires_grad], 1.0)
        opt.step()
        ref_opt.step()
    return ours, opt, ref, ref_opt


def test_fused_adamw_kernel_equals_torch_adamw_and_writes_the_working_copies(monkeypatch, request):
    if in_child(request, monkeypatch):  # Triton's interpreter, in a child process (tests/triton_interpreter.py)
        return
    ours, opt, ref, ref_opt = _fused_adamw_run(monkeypatch, interpret=True)
    for (n, p), (_, q) in zip(ours.named_parameters(), ref.named_parameters()):
        torch.testing.assert_close(p, q, rtol=1e-5, atol=1e-7, msg=n)
        if p.requires_grad:
            s, r = opt.state[p], ref_opt.state[q]
            assert float(s["step"]) == float(r["step"]) == 3.0
            torch.testing.assert_close(s["exp_avg"], r["exp_avg"], rtol=1e-5, atol=1e-9, msg=n)
            torch.testing.assert_close(s["exp_avg_sq"], r["exp_avg_sq"], rtol=1e-5, atol=1e-12, msg=n)
    for m in ours.modules():
        if isinstance(m, WorkingLinear) and m.keep_working:  # written by the kernel, and refresh knows it
            # Triton's interpreter truncates to bf16 where the GPU rounds to nearest even (tests/gpu: exact)
            torch.testing.assert_close(m._working.float(), m.weight.detach(), rtol=2**-7, atol=0)
            assert m._working_key == (m.weight._version, m.weight.data_ptr(), m.weight.device)
    # the same state dict as torch's: each optimizer resumes from the other's
    fresh = copy.deepcopy(ref_opt.state_dict())
    opt.load_state_dict(fresh)
    assert torch.equal(opt.state[opt.param_groups[0]["params"][0]]["exp_avg"], fresh["state"][0]["exp_avg"])


def test_fused_adamw_without_triton_is_torch_fused_adamw(monkeypatch):
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)  # on CPU: torch's fused step
    ours, opt, ref, _ = _fused_adamw_run(monkeypatch, interpret=False)
    for (n, p), (_, q) in zip(ours.named_parameters(), ref.named_parameters()):
        torch.testing.assert_close(p, q, rtol=1e-5, atol=1e-7, msg=n)
