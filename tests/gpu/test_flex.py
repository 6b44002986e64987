"""On CUDA: flex attention (BlockMask) equals SDPA (dense mask) in TTT, forward and gradients, within bf16
tolerance; the compiled draft equals the eager one; the fused bf16 loss equals an fp64 reference; a short
compiled training run on synthetic features works end to end. Skipped without CUDA.

    PYTHONPATH=src python3 -m pytest -q tests/gpu/test_flex.py
"""

from __future__ import annotations

import gc
import sys
from pathlib import Path

import pytest
import torch

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")

from eyas.draft.model import DraftConfig, Eagle3Draft  # noqa: E402

H, V, N = 256, 1024, 512
# every draft variant that combines: EAGLE-3.1's norms, a Qwen3-style layer, two layers
VARIANTS = {"fc_norm": True, "norm_output": True, "draft_arch": "qwen3", "num_hidden_layers": 2}


def _draft(impl: str, seed: int = 0, **over) -> Eagle3Draft:
    torch.manual_seed(seed)
    cfg = DraftConfig(hidden_size=H, intermediate_size=512, num_attention_heads=4, num_key_value_heads=2, head_dim=64,
                      vocab_size=V, draft_vocab_size=N, aux_layer_ids=[2, 4, 5], **over)  # fmt: skip
    m = Eagle3Draft(cfg, attn_implementation=impl)
    with torch.no_grad():
        for name, p in m.named_parameters():
            if name.endswith("norm.weight"):
                p.copy_(1 + 0.2 * torch.randn_like(p))
        m.embed_tokens.weight.normal_()
    return m.cuda()


def _run(model: Eagle3Draft, ids, aux, doc, steps: int):
    with torch.autocast("cuda", dtype=torch.bfloat16):
        outs = model.ttt(ids, aux, ttt_steps=steps, doc_ids=doc)
        loss = sum(model.compute_logits(o).float().logsumexp(-1).mean() for o in outs)
    loss.backward()
    grads = {n: p.grad.float().clone() for n, p in model.named_parameters() if p.grad is not None}
    model.zero_grad(set_to_none=True)
    return [o.float().detach() for o in outs], grads


def _inputs(B: int, T: int, seed: int = 1):
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(0, V, (B, T), generator=g).cuda()
    aux = torch.randn(B, T, 3 * H, generator=g).cuda()
    doc = torch.zeros(B, T, dtype=torch.long)
    doc[0, T // 3 :] = 1
    doc[0, T - T // 5 :] = -1  # padding at the end of row 0
    doc[1, : T // 2] = 0
    doc[1, T // 2 :] = 1
    return ids, aux, doc.cuda()


def _close(a, b, what):
    for x, y in zip(a, b):
        err = (x - y).norm() / y.norm().clamp(min=1e-6)
        assert err < 2e-2, f"{what}: relative error {err:.3g}"


@pytest.mark.parametrize("T", [256, 200])  # a multiple of flex's 128-token block, and a ragged one
@pytest.mark.parametrize("layout", [{}, {"norm_before_residual": True, "norm_output": True}, VARIANTS])
def test_flex_equals_sdpa_forward_and_grad(T, layout):
    ids, aux, doc = _inputs(2, T)
    out_f, g_f = _run(_draft("flex", **layout), ids, aux, doc, steps=3)
    out_s, g_s = _run(_draft("sdpa", **layout), ids, aux, doc, steps=3)
    keep = (doc >= 0)[..., None]  # padding queries differ by design (flex: -inf row; sdpa: sees itself)
    _close([o * keep for o in out_f], [o * keep for o in out_s], "outputs")
    for name in g_s:
        _close([g_f[name]], [g_s[name]], f"grad {name}")


def test_compiled_draft_equals_eager():
    from eyas.training.trainer import compile_draft

    ids, aux, doc = _inputs(2, 256)
    eager = _run(_draft("flex"), ids, aux, doc, steps=3)
    model = _draft("flex")
    compile_draft(model)
    for _ in range(2):  # the second call runs the cached graphs
        compiled = _run(model, ids, aux, doc, steps=3)
    _close(compiled[0], eager[0], "outputs")
    for name in eager[1]:
        _close([compiled[1][name]], [eager[1][name]], f"grad {name}")


def test_gradient_checkpointing_compiled_flex_equals_stored():
    """Recomputing each TTT step in backward, with the compiled layer and compiled flex attention, gives the
    stored-activation run's outputs and gradients."""
    from eyas.training.trainer import compile_draft

    ids, aux, doc = _inputs(2, 256)
    ref = _run(_draft("flex"), ids, aux, doc, steps=3)
    model = _draft("flex")
    compile_draft(model)
    model.gradient_checkpointing = True
    for _ in range(2):
        got = _run(model, ids, aux, doc, steps=3)
    _close(got[0], ref[0], "outputs")
    for name in ref[1]:
        _close([got[1][name]], [ref[1][name]], f"grad {name}")


@pytest.mark.parametrize(
    ("mode", "layout"), [("plain", {}), ("checkpointing", {}), ("deferred", {}), ("deferred", VARIANTS)]
)
def test_working_weights_compiled_equal_autocast(mode, layout):
    """Training's working weights (bf16 copies cast once, fp32 weight gradients accumulated by the matmuls),
    compiled, against plain autocast: the same outputs and gradients within bf16 tolerance; and both against an
    fp64 run, where the working weights' gradients must be at least as close as autocast's (fp32 accumulation).
    deferred: each layer weight's gradient summed over the TTT steps by its matmuls (--deferred-wgrad)."""
    import copy

    from eyas.training.precision import begin_deferred_wgrad, use_working_weights
    from eyas.training.trainer import compile_draft

    ids, aux, doc = _inputs(2, 256)
    doc = doc.clamp(min=0)  # no padding queries: flex and the fp64 SDPA reference treat those differently
    ref = _run(_draft("flex", **layout), ids, aux, doc, steps=3)
    model = _draft("flex", **layout)
    exact = copy.deepcopy(model).double()
    # as train() sets it up: fc runs once per forward, not once per TTT step, so it keeps no copy and never defers
    use_working_weights(model, torch.bfloat16, skip=(model.lm_head,), cast_per_call=(model.fc,))
    compile_draft(model)
    model.gradient_checkpointing = mode == "checkpointing"
    for _ in range(2):
        if mode == "deferred":
            layers = model.config.num_hidden_layers  # q k v o gate up down in each
            assert begin_deferred_wgrad(model, uses=3, lead_shape=tuple(ids.shape)) == 7 * layers
        got = _run(model, ids, aux, doc, steps=3)
    _close(got[0], ref[0], "outputs")
    exact.attn_implementation = "sdpa"
    outs = exact.ttt(ids, aux.double(), ttt_steps=3, doc_ids=doc)
    sum(exact.compute_logits(o).logsumexp(-1).mean() for o in outs).backward()
    for name, p in exact.named_parameters():
        if name in ref[1]:
            _close([got[1][name]], [ref[1][name]], f"grad {name}")
            err = lambda g: float((g.double() - p.grad.float().double()).norm() / p.grad.norm())  # noqa: E731
            assert err(got[1][name]) <= 1.25 * err(ref[1][name]) + 1e-4, name


@pytest.mark.parametrize("aligned", [False, True])
def test_fused_loss_bf16_matches_fp64_reference(aligned):
    """The compiled bf16 loss against fp64 on the CPU; ``aligned`` (--aligned-loss) with the first step right by a
    wide margin at a third of the positions and the second at a sixth, so that the later steps' masks do not hang
    on bf16 rounding."""
    from eyas.training.loss import Targets, ttt_loss

    torch.manual_seed(3)
    S, M, Hd, Nv = 3, 3000, 512, 4096
    W = torch.randn(Nv, Hd, device="cuda") * 0.05
    normed = [torch.randn(M, Hd, device="cuda") for _ in range(S)]
    tl = torch.randn(M + S, Nv, device="cuda") * 2
    normed[0][: M // 3] = W[tl[1 : M // 3 + 1].argmax(-1)] * 400  # logit margins far above bf16's resolution
    normed[1][: M // 6] = W[tl[2 : M // 6 + 2].argmax(-1)] * 400  # and the second step at half of those
    t = Targets(tl.bfloat16(), tl.argmax(-1), torch.ones(M + S, dtype=torch.bool, device="cuda"))
    valid = torch.rand(S, M, device="cuda") > 0.2
    scale = torch.full((S,), 1.0 / M, device="cuda")
    res = {}
    for name, dtype, compiled, dev in (("bf16", torch.bfloat16, True, "cuda"), ("fp64", torch.float64, False, "cpu")):
        # fresh leaves each round (`.to` may return the same tensor, which the first round made require grad)
        w = W.detach().to(dev, torch.float64 if dev == "cpu" else torch.float32).clone().requires_grad_()
        hs = [h.detach().to(dev, w.dtype).clone().requires_grad_() for h in normed]
        tt = Targets(t.logits.to(dev, torch.float64 if dev == "cpu" else torch.bfloat16), t.argmax.to(dev),
                     t.in_vocab.to(dev))  # fmt: skip
        loss, stats = ttt_loss(hs, w, tt, valid.to(dev), scale.to(dev, w.dtype), compute_dtype=dtype,
                               chunk_tokens=1024, compiled=compiled, aligned=aligned)  # fmt: skip
        loss.backward()
        res[name] = (loss.double().cpu(), w.grad.double().cpu(), [h.grad.double().cpu() for h in hs])
        assert stats[0, 4] > M // 4  # the first step right where it was made right
    assert abs(res["bf16"][0] - res["fp64"][0]) / res["fp64"][0] < 1e-2
    _close([res["bf16"][1]], [res["fp64"][1]], "lm_head grad")
    _close(res["bf16"][2], res["fp64"][2], "hidden grads")


def test_compiled_training_run_end_to_end(tmp_path):
    sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "bench"))
    import synthetic

    from eyas.draft.checkpoint import load_draft
    from eyas.stages.train import train

    inp = synthetic.inputs(tmp_path, "smoke", rows=24, seq_len=256)
    out = tmp_path / "run"
    kw = dict(
        verifier=str(inp["verifier"]),
        data=str(inp["features"]),
        vocab=str(inp["vocab"]),
        epochs=2,
        max_seq_len=256,
        batch_tokens=512,
        val_ratio=0.1,
        num_workers=2,
        log_every=2,
        profile_every=3,
        lr=1e-3,
    )
    res = train(out=str(out), **kw)
    assert res["train"]["finite"] and res["tokens_per_s"] > 0 and res["peak_memory_bytes"] > 0
    assert res["ms_per_step"]["forward"] > 0
    load_draft(out, verifier=str(inp["verifier"]), device="cuda")
    # speculators' setting, in the low-memory mode: the same losses (the features arrive through the prefetch
    # stream in both runs)
    a = train(out=str(tmp_path / "a"), freeze_lm_head=True, **kw)
    b = train(out=str(tmp_path / "b"), freeze_lm_head=True, gradient_checkpointing=True, **kw)
    assert a["train"]["loss_total"] == pytest.approx(b["train"]["loss_total"], rel=2e-2)


def test_loader_embeddings_keep_the_table_off_the_device(tmp_path, monkeypatch):
    """--loader-embeddings must leave the frozen embedding in host memory: the peak drops by about its size.
    (Before commit 936a0af the trainer's blanket ``.to(device)`` copied it to the device anyway; an A/B at
    Llama-3.1-8B dims showed the same peak both ways.)"""
    sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "bench"))
    import synthetic

    from eyas.stages.train import train

    # a wide vocab on a narrow model, so the table (8 MiB in bf16) outweighs everything that differs between the
    # two runs (the looked-up rows travel with each batch: about 70 kB)
    wide = synthetic.Dims(hidden=64, layers=8, heads=4, kv_heads=2, head_dim=16, intermediate=128, vocab=65536,
                          draft_vocab=256)  # fmt: skip
    monkeypatch.setitem(synthetic.PRESETS, "wide-vocab", wide)
    inp = synthetic.inputs(tmp_path, "wide-vocab", rows=12, seq_len=256)
    kw = dict(verifier=str(inp["verifier"]), data=str(inp["features"]), vocab=str(inp["vocab"]), epochs=1,
              max_seq_len=256, batch_tokens=512, val_ratio=0.0, num_workers=2, log_every=2, lr=1e-3,
              freeze_lm_head=True)  # fmt: skip
    runs = {}
    for on_host in (False, True):
        gc.collect()  # the first run's trainer, freed before the second's peak is measured
        torch.cuda.reset_peak_memory_stats()
        runs[on_host] = train(out=str(tmp_path / f"run-{on_host}"), loader_embeddings=on_host, **kw)
    table = wide.vocab * wide.hidden * 2
    saved = runs[False]["peak_memory_bytes"] - runs[True]["peak_memory_bytes"]
    assert saved > 0.75 * table, f"peak {runs[False]['peak_memory_bytes']} vs {runs[True]['peak_memory_bytes']}"
    assert runs[True]["train"]["loss_total"] == pytest.approx(runs[False]["train"]["loss_total"], rel=1e-2)


def test_fused_adamw_kernel_equals_torch_fused_adamw():
    """eyas' Triton AdamW step (which also writes the bf16 working copies) against torch's fused CUDA AdamW on an
    identical copy: five steps with weight decay on one group, the clip as grad_scale, a moving lr."""
    import copy

    from eyas.training.precision import FusedAdamW, WorkingLinear, use_working_weights
    from eyas.training.optim import build_optimizers, clip_gradients

    ours = _draft("flex")
    use_working_weights(ours, torch.bfloat16, skip=(ours.lm_head,), cast_per_call=(ours.fc,))
    ref = copy.deepcopy(ours)
    (opt,) = build_optimizers(ours, name="adamw", lr=1e-3, weight_decay=0.1, fused=True)
    assert isinstance(opt, FusedAdamW) and opt.attach_working(ours) == 7 and opt._fast()
    ref_opt = torch.optim.AdamW([{"params": g["params"], "weight_decay": g["weight_decay"]} for g in [
        {"params": [q for q in ref.parameters() if q.requires_grad and q.ndim >= 2], "weight_decay": 0.1},
        {"params": [q for q in ref.parameters() if q.requires_grad and q.ndim < 2], "weight_decay": 0.0}]],
        lr=1e-3, betas=(0.9, 0.95), eps=1e-8, fused=True)  # fmt: skip
    g = torch.Generator(device="cuda").manual_seed(3)
    for step in range(5):
        for p, q in zip(ours.parameters(), ref.parameters()):
            if p.requires_grad:
                p.grad = (10.0 if step % 2 else 0.001) * torch.randn(p.shape, generator=g, device="cuda")
                q.grad = p.grad.clone()
        for o in (opt, ref_opt):
            for grp in o.param_groups:
                grp["lr"] = 1e-3 * (step + 1) / 5
        clip_gradients([p for p in ours.parameters() if p.requires_grad], [opt], 1.0)
        clip_gradients([q for q in ref.parameters() if q.requires_grad], [ref_opt], 1.0)
        opt.step()
        ref_opt.step()
    for (n, p), (_, q) in zip(ours.named_parameters(), ref.named_parameters()):
        torch.testing.assert_close(p, q, rtol=1e-5, atol=1e-7, msg=n)
        if p.requires_grad:
            # exp_avg may cancel to near zero, where torch's lerp and the kernel's multiply-add differ by an ulp
            for key, atol in (("exp_avg", 1e-9), ("exp_avg_sq", 1e-12), ("step", 0)):
                torch.testing.assert_close(opt.state[p][key], ref_opt.state[q][key], rtol=1e-5, atol=atol,
                                           msg=lambda m, n=n, key=key: f"{n} {key}: {m}")  # fmt: skip
    for m in ours.modules():
        if isinstance(m, WorkingLinear) and m.keep_working:
            assert torch.equal(m._working, m.weight.detach().to(torch.bfloat16))


def test_fused_loss_on_scored_rows_equals_all_rows_compiled():
    """The compiled bf16 loss on the positions some TTT step scores (eyas.training.loss.scored_rows) against the same loss
    on every position: the same loss, statistics and gradients within bf16 rounding."""
    from eyas.training.loss import Targets, scored_rows, step_masks, ttt_loss

    S, B, T, Hd, Nv, chunk = 3, 2, 1024, 256, 4096, 256
    g = torch.Generator(device="cuda").manual_seed(4)
    loss_mask = torch.zeros(B, T, dtype=torch.bool, device="cuda")
    loss_mask[0, 300:700], loss_mask[0, 900:], loss_mask[1, 600:] = True, True, True  # prompts before each answer
    doc = torch.zeros(B, T, dtype=torch.long, device="cuda")
    doc[0, 750:] = 1
    valid = step_masks(loss_mask, doc, S).flatten(1)
    rows = scored_rows(loss_mask.cpu(), doc.cpu(), S, chunk=chunk)
    assert rows is not None and rows.numel() < B * T
    W = (0.05 * torch.randn(Nv, Hd, generator=g, device="cuda")).requires_grad_()
    tlogits = (3 * torch.randn(B * T + S, Nv, generator=g, device="cuda")).bfloat16()
    targets = Targets(tlogits, tlogits.argmax(-1), torch.ones(B * T + S, dtype=torch.bool, device="cuda"))
    scale = torch.tensor([1.0, 0.5, 0.25], device="cuda") / valid.sum(1).clamp(min=1)
    outs = []
    for r in (None, rows.cuda()):
        normed = [torch.randn(B * T, Hd, generator=torch.Generator(device="cuda").manual_seed(k), device="cuda")
                  .bfloat16().requires_grad_() for k in range(S)]  # fmt: skip
        loss, stats = ttt_loss(normed, W, targets, valid, scale, compute_dtype=torch.bfloat16, chunk_tokens=chunk,
                               compiled=True, rows=r)  # fmt: skip
        loss.backward()
        outs.append((loss.detach(), stats, W.grad.clone(), [h.grad.float() for h in normed]))
        W.grad = None
    (la, sa, wa, ha), (lb, sb, wb, hb) = outs
    torch.testing.assert_close(lb, la, rtol=1e-3, atol=1e-5)
    torch.testing.assert_close(sb[:, 1:3], sa[:, 1:3])  # the positions counted: exact
    torch.testing.assert_close(sb[:, 3:], sa[:, 3:], rtol=0, atol=3)  # argmax may flip at a bf16 near-tie
    torch.testing.assert_close(wb, wa, rtol=2e-2, atol=1e-5)
    for x, y in zip(hb, ha):
        torch.testing.assert_close(x, y, rtol=2e-2, atol=1e-5)
    assert not hb[0][~valid.any(0)].any()  # nothing reaches a position no step scores
