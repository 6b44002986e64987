"""The draft: TTT logits equal step-by-step inference; SDPA equals an eager reference; masks per backend."""

from __future__ import annotations

import pytest
import torch

from eyas.draft.attention import DraftCache, TTTContext
from eyas.draft.model import DraftConfig, Eagle3Draft, _positions_within_docs

H, V, N = 64, 512, 256
# Every layout variant vLLM and SGLang serve, one at a time, and all the ones that combine at once.
VARIANTS = {
    "eagle3": {},
    "norm_before_residual": {"norm_before_residual": True},
    "norm_before_fc": {"norm_before_fc": True},
    "fc_norm": {"fc_norm": True},
    "norm_output": {"norm_output": True},
    "qwen3": {"draft_arch": "qwen3"},
    "two_layers": {"num_hidden_layers": 2},
    "all": {
        "norm_before_residual": True,
        "fc_norm": True,
        "norm_output": True,
        "draft_arch": "qwen3",
        "num_hidden_layers": 3,
    },
}


def _config(**over) -> DraftConfig:
    base = dict(hidden_size=H, intermediate_size=128, num_attention_heads=4, num_key_value_heads=2, head_dim=16,
                vocab_size=V, draft_vocab_size=N, aux_layer_ids=[2, 4, 5], rms_norm_eps=1e-6,
                rope_parameters={"rope_type": "default", "rope_theta": 10000.0})  # fmt: skip
    base.update(over)
    return DraftConfig(**base)


def _draft(seed=0, impl="sdpa", **over) -> Eagle3Draft:
    torch.manual_seed(seed)
    m = Eagle3Draft(_config(**over), attn_implementation=impl).double().eval()
    with torch.no_grad():  # random norms so a misplaced norm shows
        for name, p in m.named_parameters():
            if name.endswith("norm.weight"):
                p.copy_(1 + 0.2 * torch.randn_like(p))
        m.embed_tokens.weight.normal_()
    return m


def _inference_logits(model: Eagle3Draft, ids, aux, t: int, k: int, offset: int = 0) -> list[torch.Tensor]:
    """Draft k+1 tokens after index t the way inference does, teacher-forcing the tokens.

    Step 0 runs over positions 0..t (tokens x_1..x_{t+1}, fused verifier states h_0..h_t) into a fresh cache;
    step j feeds token x_{t+1+j}, the previous step's pre-norm state at t, position t+j.
    ``offset`` is the index of the document's first token (positions restart there).
    """
    cache = model.new_cache(batch_size=1, max_len=64)
    sl = slice(offset, t + 1)
    pos = torch.arange(t + 1 - offset)[None]
    normed, prenorm = model.step(ids[:, offset + 1 : t + 2], model.fuse(aux[:, sl]), pos, cache)
    out = [model.compute_logits(normed[:, -1])]
    hidden = prenorm[:, -1:]
    for j in range(1, k + 1):
        normed, hidden = model.step(ids[:, t + 1 + j : t + 2 + j], hidden, pos[:, -1:] + j, cache)
        out.append(model.compute_logits(normed[:, -1]))
    return out


@pytest.mark.parametrize("cache_attention", ["sdpa", "matmul", "matmul-long-prefill"])
@pytest.mark.parametrize("variant", VARIANTS)
def test_ttt_equals_inference(variant, cache_attention, monkeypatch):
    """TTT (through SDPA) equals drafting step by step through the cache, whose attention is SDPA or "matmul"
    (grouped query heads folded into the query rows, two matmuls around a masked softmax; a block of more than
    MATMUL_MAX_QUERIES queries, the prompt's, through SDPA)."""
    import eyas.draft.attention as attention

    if cache_attention == "matmul-long-prefill":  # the first step's block through SDPA, the rest as matmuls
        monkeypatch.setattr(attention, "MATMUL_MAX_QUERIES", 2)
        calls = []
        real = attention.masked_attention
        monkeypatch.setattr(attention, "masked_attention", lambda *a: calls.append(a[-1]) or real(*a))
        cache_attention = "matmul"
    torch.manual_seed(1)
    T, steps = 20, 4
    model = _draft(**VARIANTS[variant])
    ids = torch.randint(0, V, (1, T))
    aux = torch.randn(1, T, 3 * H, dtype=torch.float64)
    with torch.no_grad():
        ttt = [model.compute_logits(h) for h in model.ttt(ids, aux, ttt_steps=steps)]
        model.attn_implementation = cache_attention  # read by the inference cache only (new_cache)
        assert model.new_cache(batch_size=1, max_len=8).impl == cache_attention
        assert TTTContext(torch.zeros(1, T, dtype=torch.long), cache_attention).impl == "sdpa"  # TTT: never matmul
        for t in (0, 3, 9, T - 2 - steps):
            inf = _inference_logits(model, ids, aux, t, steps - 1)
            for k in range(steps):
                torch.testing.assert_close(ttt[k][0, t], inf[k][0], rtol=1e-9, atol=1e-9, msg=f"step {k} t {t}")
    if attention.MATMUL_MAX_QUERIES == 2:
        assert {"sdpa", "matmul"} <= set(calls), calls


@pytest.mark.parametrize("variant", ["eagle3", "all"])
def test_ttt_packed_documents_equal_separate_inference(variant):
    torch.manual_seed(2)
    T, steps = 24, 3
    model = _draft(seed=3, **VARIANTS[variant])
    ids = torch.randint(0, V, (1, T))
    aux = torch.randn(1, T, 3 * H, dtype=torch.float64)
    doc_ids = torch.tensor([[0] * 10 + [1] * 9 + [-1] * 5])  # two documents and padding
    with torch.no_grad():
        ttt = [model.compute_logits(h) for h in model.ttt(ids, aux, ttt_steps=steps, doc_ids=doc_ids)]
        for offset, t in ((0, 2), (0, 10 - 2 - steps), (10, 10), (10, 19 - 2 - steps)):
            inf = _inference_logits(model, ids, aux, t, steps - 1, offset=offset)
            for k in range(steps):
                torch.testing.assert_close(ttt[k][0, t], inf[k][0], rtol=1e-9, atol=1e-9)


def test_variant_modules_and_what_excludes_what():
    """Each variant's modules, under the names vLLM loads: later layers read H (no embeddings, no hidden_norm),
    a Qwen3 layer norms q and k per head, fc_norm is one norm per aux state; two aux norms cannot combine."""
    sd = _draft(**VARIANTS["all"]).state_dict()
    assert sd["layers.0.self_attn.q_proj.weight"].shape == (4 * 16, 2 * H)
    assert sd["layers.2.self_attn.q_proj.weight"].shape == (4 * 16, H) and "layers.2.hidden_norm.weight" not in sd
    assert sd["layers.1.self_attn.k_norm.weight"].shape == (16,) and "layers.3.mlp.up_proj.weight" not in sd
    assert [sd[f"fc_norm.{i}.weight"].shape for i in range(3)] == [(H,)] * 3 and "input_norm.weight" not in sd
    assert not any("q_norm" in k or "fc_norm" in k or k.startswith("layers.1") for k in _draft().state_dict())
    with pytest.raises(ValueError, match="norm_before_fc and fc_norm exclude each other"):
        _config(norm_before_fc=True, fc_norm=True)
    with pytest.raises(ValueError, match="num_hidden_layers must be at least 1"):
        _config(num_hidden_layers=0)


def test_positions_within_docs():
    doc = torch.tensor([[0, 0, 0, 1, 1, 2, -1, -1]])
    assert _positions_within_docs(doc).tolist() == [[0, 1, 2, 0, 1, 0, 0, 1]]


def test_sdpa_equals_eager_forward_and_grad():
    torch.manual_seed(4)
    T, steps = 16, 3
    ids = torch.randint(0, V, (2, T))
    aux = torch.randn(2, T, 3 * H)
    doc_ids = torch.tensor([[0] * 7 + [1] * 9, [0] * 12 + [-1] * 4])
    results = {}
    for impl in ("sdpa", "eager"):
        model = _draft(seed=5, impl=impl).float().train()
        outs = model.ttt(ids, aux, ttt_steps=steps, doc_ids=doc_ids)
        loss = sum(model.compute_logits(o).logsumexp(-1).mean() for o in outs)
        loss.backward()
        results[impl] = ([o.detach() for o in outs], {n: p.grad.clone() for n, p in model.named_parameters()
                                                       if p.grad is not None})  # fmt: skip
    for a, b in zip(results["sdpa"][0], results["eager"][0]):
        torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-5)
        assert torch.isfinite(a).all()
    for name, g in results["sdpa"][1].items():
        torch.testing.assert_close(g, results["eager"][1][name], rtol=1e-3, atol=1e-5, msg=name)
    assert "embed_tokens.weight" not in results["sdpa"][1]  # frozen


@pytest.mark.parametrize(("impl", "variant"), [("sdpa", "eagle3"), ("eager", "eagle3"), ("sdpa", "all")])
def test_gradient_checkpointing_gives_the_same_outputs_and_gradients(impl, variant):
    """Recomputing each TTT step in backward (its attention re-run over the earlier steps' keys) changes nothing:
    outputs and every gradient equal the stored-activation run's, in float64."""
    torch.manual_seed(7)
    T, steps = 16, 3
    ids = torch.randint(0, V, (2, T))
    aux = torch.randn(2, T, 3 * H, dtype=torch.float64)
    doc_ids = torch.tensor([[0] * 7 + [1] * 9, [0] * 12 + [-1] * 4])
    results = {}
    for ckpt in (False, True):
        model = _draft(seed=8, impl=impl, **VARIANTS[variant]).train()
        model.gradient_checkpointing = ckpt
        outs = model.ttt(ids, aux, ttt_steps=steps, doc_ids=doc_ids)
        loss = sum((k + 1) * model.compute_logits(o).logsumexp(-1).mean() for k, o in enumerate(outs))
        loss.backward()
        results[ckpt] = ([o.detach() for o in outs], {n: p.grad.clone() for n, p in model.named_parameters()
                                                      if p.grad is not None})  # fmt: skip
    for a, b in zip(results[True][0], results[False][0]):
        torch.testing.assert_close(a, b, rtol=0, atol=0)
    assert results[True][1].keys() == results[False][1].keys() and len(results[True][1]) > 5
    for name, g in results[True][1].items():
        torch.testing.assert_close(g, results[False][1][name], rtol=1e-12, atol=1e-14, msg=name)


@pytest.mark.parametrize("ckpt", [False, True])
def test_ttt_reads_embeddings_looked_up_elsewhere(ckpt):
    """inputs_embeds (the rows of the ids and of `steps` pad ids, as training's loader gathers them from host
    memory) give exactly the outputs and gradients of looking the ids up in the model; a wrong length is refused."""
    torch.manual_seed(3)
    T, steps = 16, 3
    ids = torch.randint(0, V, (2, T))
    aux = torch.randn(2, T, 3 * H, dtype=torch.float64)
    doc_ids = torch.tensor([[0] * 7 + [1] * 9, [0] * 12 + [-1] * 4])
    results = []
    for looked_up in (False, True):
        model = _draft(seed=4).train()
        model.gradient_checkpointing = ckpt
        embeds = model.embed_tokens.weight.detach()[torch.nn.functional.pad(ids, (0, steps))] if looked_up else None
        outs = model.ttt(ids, aux, ttt_steps=steps, doc_ids=doc_ids, inputs_embeds=embeds)
        sum((k + 1) * model.compute_logits(o).logsumexp(-1).mean() for k, o in enumerate(outs)).backward()
        results.append(
            ([o.detach() for o in outs], {n: p.grad for n, p in model.named_parameters() if p.grad is not None})
        )
    for a, b in zip(results[0][0], results[1][0]):
        torch.testing.assert_close(a, b, rtol=0, atol=0)
    for name, g in results[0][1].items():
        torch.testing.assert_close(results[1][1][name], g, rtol=0, atol=0, msg=name)
    with pytest.raises(ValueError, match="inputs_embeds"):
        _draft().ttt(ids, aux, ttt_steps=steps, inputs_embeds=torch.zeros(2, T, H, dtype=torch.float64))


def test_context_builds_its_own_mask():
    """The SDPA context only ever builds dense boolean masks; flex is reserved to its own path."""
    ctx = TTTContext(torch.zeros(1, 5, dtype=torch.long), "sdpa")
    m = ctx._dense_mask(2)
    assert m.dtype == torch.bool and m.shape == (1, 1, 5, 15)
    assert m[0, 0, 3].tolist() == [True] * 4 + [False] + [False, False, False, True, False] * 2
    cache = DraftCache(batch_size=1, max_len=8, num_kv_heads=2, head_dim=16, attn_implementation="flex")
    assert cache.impl == "sdpa"


@pytest.mark.parametrize("variant", ["eagle3", "all"])
def test_cache_truncate_rolls_back(variant):
    torch.manual_seed(6)
    model = _draft(seed=6, **VARIANTS[variant])
    ids = torch.randint(0, V, (1, 12))
    aux = torch.randn(1, 12, 3 * H, dtype=torch.float64)
    with torch.no_grad():
        ref = _inference_logits(model, ids, aux, 6, 2)
        cache = model.new_cache(batch_size=1, max_len=64)
        pos = torch.arange(7)[None]
        # draft three garbage tokens, reject them all, then redo: results must not depend on the rejected ones
        normed, prenorm = model.step(ids[:, 1:8], model.fuse(aux[:, :7]), pos, cache)
        h = prenorm[:, -1:]
        for j in range(1, 4):
            _, h = model.step(torch.tensor([[j]]), h, pos[:, -1:] + j, cache)
        cache.truncate(7)
        normed, prenorm = model.step(ids[:, 7:8], model.fuse(aux[:, 6:7]), pos[:, -1:], cache)
        torch.testing.assert_close(model.compute_logits(normed[:, -1]), ref[0][0:1])
        _, h = model.step(ids[:, 8:9], prenorm[:, -1:], pos[:, -1:] + 1, cache)


def test_config_from_verifier_mla_gets_gqa():
    text = {"hidden_size": 7168, "num_attention_heads": 64, "num_key_value_heads": 64, "kv_lora_rank": 512,
            "qk_rope_head_dim": 64, "intermediate_size": 18432, "vocab_size": 163840, "rope_theta": 50000.0,
            "rope_scaling": {"type": "yarn", "factor": 32.0, "original_max_position_embeddings": 4096,
                             "mscale": 1.0, "mscale_all_dim": 1.0, "beta_fast": 1, "beta_slow": 1}}  # fmt: skip
    cfg = DraftConfig.from_verifier(text, draft_vocab_size=32000, aux_layer_ids=[2, 30, 58])
    assert (cfg.num_attention_heads, cfg.num_key_value_heads, cfg.head_dim) == (64, 8, 112)
    assert cfg.intermediate_size == 18432 and cfg.rope_parameters["rope_type"] == "yarn"
    cfg = DraftConfig.from_verifier(text, draft_vocab_size=32000, aux_layer_ids=[2, 30, 58], head_dim=128)
    assert cfg.head_dim == 128
    llama = {"hidden_size": 576, "num_attention_heads": 9, "num_key_value_heads": 3, "intermediate_size": 1536,
             "vocab_size": 49152, "rope_theta": 100000.0}  # fmt: skip
    cfg = DraftConfig.from_verifier(llama, draft_vocab_size=8192, aux_layer_ids=[2, 15, 27])
    assert (cfg.num_attention_heads, cfg.num_key_value_heads, cfg.head_dim) == (9, 3, 64)
    assert cfg.rope_parameters == {"rope_type": "default", "rope_theta": 100000.0}


def test_rope_matches_transformers_and_stays_fp32():
    from transformers.models.llama.modeling_llama import LlamaRotaryEmbedding

    rope = {"rope_type": "llama3", "rope_theta": 500000.0, "factor": 8.0, "low_freq_factor": 1.0,
            "high_freq_factor": 4.0, "original_max_position_embeddings": 64}  # fmt: skip
    for params in ({"rope_type": "default", "rope_theta": 10000.0}, rope):
        cfg = _config(rope_parameters=params, max_position_embeddings=512)
        model = Eagle3Draft(cfg)
        ref = LlamaRotaryEmbedding(cfg.llama_config())
        x = torch.zeros(1, dtype=torch.float32)
        pos = torch.arange(300)[None]
        for a, b in zip(model.rotary_emb(x, pos), ref(x, pos)):
            torch.testing.assert_close(a, b, rtol=0, atol=0)
        model.to(torch.bfloat16)
        cos, _ = model.rotary_emb(x, pos)
        torch.testing.assert_close(cos, ref(x, pos)[0], rtol=0, atol=0)  # frequencies were not rounded


@pytest.mark.parametrize("variant", ["eagle3", "all"])
def test_compiled_draft_equals_eager_on_cpu(variant):
    """compile_draft (each TTT step's layer, attention included, and final norm as one compiled region) computes
    what the eager draft computes, forward and gradients, with and without gradient checkpointing; a new batch's
    documents (a new context, mask and key lists) reuse the compiled graphs instead of recompiling."""
    from eyas.training.trainer import compile_draft

    torch.manual_seed(12)
    B, T, steps = 2, 24, 3
    ids, aux = torch.randint(0, V, (B, T)), torch.randn(B, T, 3 * H)
    docs = [torch.tensor([[0] * 10 + [1] * 14, [0] * 20 + [-1] * 4]), torch.tensor([[0] * 5 + [1] * 19, [0] * 24])]

    def run(model, doc, checkpointing=False):
        model.gradient_checkpointing = checkpointing
        outs = model.ttt(ids, aux, ttt_steps=steps, doc_ids=doc)
        sum(model.compute_logits(o).logsumexp(-1).mean() for o in outs).backward()
        grads = {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}
        model.zero_grad(set_to_none=True)
        return [o.detach() for o in outs], grads

    eager, compiled = _draft(seed=12, **VARIANTS[variant]).float(), _draft(seed=12, **VARIANTS[variant]).float()
    compile_draft(compiled)
    for i, doc in enumerate(docs):
        with torch._dynamo.config.patch(error_on_recompile=i > 0):
            for checkpointing in (False, True):
                (want, want_g), (got, got_g) = run(eager, doc), run(compiled, doc, checkpointing)
                for a, b in zip(got, want):
                    torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-5)
                assert got_g.keys() == want_g.keys()
                for name, g in want_g.items():
                    torch.testing.assert_close(got_g[name], g, rtol=1e-4, atol=1e-5, msg=name)


@pytest.mark.parametrize("impl", ["sdpa", "flex"])
def test_ttt_steps_share_one_compiled_shape(impl):
    """With fixed shapes (compile_draft's: every step attends to ttt_steps blocks, the steps not yet run as zeros
    it cannot see) the compiled TTT block compiles once for every step with gradients and once more without
    (validation), where the growing layout compiles once a step each way; both give the same outputs."""
    from eyas.verifier.compile import compile_work

    torch.manual_seed(5)
    B, T, steps = 2, 16, 3
    ids, aux = torch.randint(0, V, (B, T)), torch.randn(B, T, 3 * H)
    doc = torch.tensor([[0] * 6 + [1] * 10, [0] * 13 + [-1] * 3])
    outs = {}
    for fixed in (False, True):
        torch._dynamo.reset()
        m = _draft(seed=5, impl=impl, num_hidden_layers=2).float()
        m.ttt_fixed_shapes = fixed
        m.ttt_block = torch.compile(m.ttt_block, backend="eager", dynamic=False)
        before = compile_work()[0]
        with torch.set_grad_enabled(impl == "sdpa"):  # torch has no flex backward on CPU
            outs[fixed] = m.ttt(ids, aux, ttt_steps=steps, doc_ids=doc)
        with torch.no_grad():
            m.ttt(ids, aux, ttt_steps=steps, doc_ids=doc)
        compiles = compile_work()[0] - before
        assert compiles == ((1 if impl == "sdpa" else 0) + 1 if fixed else steps * (2 if impl == "sdpa" else 1)), (
            compiles
        )
    for a, b in zip(outs[True], outs[False], strict=True):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6)


def test_flex_in_the_compiled_layer_equals_sdpa_on_cpu():
    """Flex attention traced inside the compiled layer region (forward: torch has no flex backward on CPU; the
    GPU tests check gradients) equals SDPA with the dense mask, across two batches without recompiling."""
    from eyas.training.trainer import compile_draft

    torch.manual_seed(13)
    B, T, steps = 2, 32, 3
    ids, aux = torch.randint(0, V, (B, T)), torch.randn(B, T, 3 * H)
    sdpa, flex = _draft(seed=13).float(), _draft(seed=13, impl="flex").float()
    compile_draft(flex)
    for i, doc in enumerate(
        [torch.tensor([[0] * 12 + [1] * 20, [0] * 28 + [-1] * 4]), torch.zeros(B, T, dtype=torch.long)]
    ):
        with torch.no_grad(), torch._dynamo.config.patch(error_on_recompile=i > 0):
            want = sdpa.ttt(ids, aux, ttt_steps=steps, doc_ids=doc)
            got = flex.ttt(ids, aux, ttt_steps=steps, doc_ids=doc)
        for a, b in zip(got, want):
            torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-5)
