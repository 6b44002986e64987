"""On a GPU: the generation engine's CUDA graphs decode exactly what its eager forwards decode (fp32, where
rounding cannot hide a wrong replay), for continuous batching and for eval's speculative loop.

    PYTHONPATH=src python3 -m pytest -q tests/gpu/test_generate_gpu.py
"""

from __future__ import annotations

import random
import sys
from pathlib import Path

import pytest
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from eyas.stages.evaluate import random_draft  # noqa: E402
from eyas.evaluation.measure import Runners  # noqa: E402
from eyas.engine.speculative import plain_generate, speculative_generate  # noqa: E402
from eyas.engine.generate import Request, decode_all  # noqa: E402
from eyas.verifier.load import build_text_model, resolve  # noqa: E402

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")


def _prompts(n: int, seed: int = 0) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(3, 500) for _ in range(rng.randrange(1, 200))] for _ in range(n)]


@pytest.mark.parametrize("name", ["llama", "qwen3", "gemma"])
def test_batched_graphs_equal_eager(make_tiny, name):
    """40 prompts through 8 slots of 512 positions (the default attention: FlexAttention, one key length for
    every position), graphs against the same decoder run eagerly, and against transformers' generate of each
    prompt alone."""
    t = make_tiny(name)
    model = build_text_model(resolve(t.path), device="cuda")
    prompts = _prompts(40)
    reqs = [Request(key=i, tokens=p, max_new_tokens=48) for i, p in enumerate(prompts)]
    kw = dict(eos_ids={2}, max_len=512, batch_tokens=512 * 8, sync_every=4)
    graphed = decode_all(model, reqs, cuda_graphs=True, **kw)
    eager = decode_all(model, reqs, cuda_graphs=False, **kw)
    assert [c.tokens for c in graphed] == [c.tokens for c in eager]
    for p, c in list(zip(prompts, graphed))[:8]:
        x = torch.tensor([p], device="cuda")
        want = model.generate(x, attention_mask=torch.ones_like(x), do_sample=False, max_new_tokens=48,
                              eos_token_id=2, pad_token_id=0)[0, len(p) :].tolist()  # fmt: skip
        assert c.tokens == want


@pytest.mark.parametrize("attention", ["flex", "sdpa"])
def test_row_count_graphs_equal_eager(make_tiny, monkeypatch, attention):
    """Steps over the busy rows only: graphs of 8 rows and of 2 or 4 (their layers compiled once, symbolic in
    the rows) decode what eager steps over every slot decode (fp32), and none fell back to eager or
    uncompiled."""
    from eyas.engine import generate
    from eyas.engine.generate import BatchDecoder, RequestQueue

    t = make_tiny("llama")
    model = build_text_model(resolve(t.path), device="cuda")
    # the longest answers have the shortest prompts: admitted and packed first, into the lowest slots, so the
    # rows above them drain and the row count falls
    prompts = sorted(_prompts(20, 6), key=len, reverse=True)
    reqs = [Request(key=i, tokens=p, max_new_tokens=8 + 4 * i, priority=i) for i, p in enumerate(prompts)]
    kw = dict(eos_ids=set(), max_len=512, batch_tokens=512 * 8, sync_every=4, attention=attention)
    eager = {c.key: c.tokens for c in BatchDecoder(model, cuda_graphs=False, **kw).run(RequestQueue(reqs))}
    monkeypatch.setattr(generate, "ROW_BUCKETS", (2, 4))
    dec = BatchDecoder(model, compile_prefill=True, **kw)
    graphed = {c.key: c.tokens for c in dec.run(RequestQueue(reqs))}
    assert graphed == eager
    assert dec.graphs.enabled and dec.graphs.compile_model is not None  # no fallback
    assert dec.compile_prefill  # the prefills ran compiled (symbolic shapes) all along, when asked
    rows = {k[1] for k in dec.graphs.graphs}
    assert 8 in rows and rows & {2, 4}, rows  # the row count fell as the slots drained


def test_bf16_batched_graphs_run(make_tiny):
    """bf16 with graphs: every request answered, the graphs recorded once per row count and key length and
    replayed."""
    t = make_tiny("llama")
    model = build_text_model(resolve(t.path), dtype=torch.bfloat16, device="cuda")
    reqs = [Request(key=i, tokens=p, max_new_tokens=64) for i, p in enumerate(_prompts(100, seed=1))]
    got = decode_all(model, reqs, eos_ids={2}, max_len=512, batch_tokens=512 * 32)
    assert all(len(c.tokens) >= 1 and not c.too_long for c in got)


@pytest.mark.parametrize("fused", [False, True])
def test_speculative_graphs_equal_eager(make_tiny, fused):
    """eval's loop with every fixed-shape forward a CUDA graph (verifier 1 and K+1 tokens per key length, draft
    catch-ups and steps; with ``fused`` each greedy round one graph) decodes and accepts exactly as eagerly, at
    K = 2 and 4 in one build."""
    t = make_tiny("llama")
    info = resolve(t.path)
    model = build_text_model(info, device="cuda")
    draft = random_draft(info, seed=0, device="cuda")
    draft.t2d.fill_(True)
    out = {}
    for graphs in (True, False):
        r = Runners.build(model, draft, draft_tokens=[2, 4], max_len=700, cuda_graphs=graphs, fused_rounds=fused)
        assert r.base.graphs.enabled == r.spec.graphs.enabled == r.draft.graphs.enabled == graphs  # none fell back
        runs = []
        for p in _prompts(4, seed=3):
            for K in (2, 4):
                s = speculative_generate(r.spec, r.draft, p, max_new_tokens=96, draft_tokens=K, eos_ids={2},
                                         fused=fused)  # fmt: skip
                b = plain_generate(r.base, p, max_new_tokens=96, eos_ids={2})
                assert s.tokens == b.tokens
                runs.append((s.tokens, s.accepted))
        out[graphs] = runs
        # every decoder still on its graphs after the run (a failed capture falls back to eager with a note), and
        # the prompts' forwards still compiled (symbolic shapes) where the graphs are
        assert r.base.graphs.enabled == r.spec.graphs.enabled == r.draft.graphs.enabled == graphs
        assert r.base.compile_prompts == r.spec.compile_prompts == graphs
        assert all(g.graphs.enabled == graphs for g in r.draft._rounds.values())
    assert out[True] == out[False]


def test_plain_decode_graph_equals_eager_and_generate(make_tiny):
    """Plain decoding as one graph per step (forward, pick and position advance; tokens read a block at a
    time) across positions: greedy equals eager and transformers' generate (fp32), and seeded sampling at
    T = 1 replays exactly what the eager step draws."""
    from eyas.engine.generate import SequenceDecoder

    t = make_tiny("llama")
    model = build_text_model(resolve(t.path), device="cuda")
    graphed = SequenceDecoder(model, capacity=400, cuda_graphs=True, sync_every=16)
    eager = SequenceDecoder(model, capacity=400, cuda_graphs=False, sync_every=16)
    for p in _prompts(3, seed=5):
        got = plain_generate(graphed, p, max_new_tokens=150, eos_ids=set()).tokens
        assert got == plain_generate(eager, p, max_new_tokens=150, eos_ids=set()).tokens
        x = torch.tensor([p], device="cuda")
        want = model.generate(x, attention_mask=torch.ones_like(x), do_sample=False, max_new_tokens=150,
                              eos_token_id=None, pad_token_id=0)[0, len(p) :].tolist()  # fmt: skip
        assert got == want
        eos = {got[37]}  # an end of turn inside a block: the loop stops there
        assert plain_generate(graphed, p, max_new_tokens=150, eos_ids=eos).tokens == got[: got.index(got[37]) + 1]
        g1, g2 = (torch.Generator(device="cuda").manual_seed(7) for _ in range(2))
        s1 = plain_generate(graphed, p, max_new_tokens=100, eos_ids=set(), temperature=1.0, generator=g1).tokens
        s2 = plain_generate(eager, p, max_new_tokens=100, eos_ids=set(), temperature=1.0, generator=g2).tokens
        assert s1 == s2
    assert graphed.graphs.enabled and any(k[0] == "decode" for k in graphed.graphs.graphs)
    assert graphed.graphs.compile_model is not None  # compiled all along: no compiler error sent it to eager
    # each layer's closing add computed with the next layer's norm in the graphs (eyas.verifier.norm_ahead)
    assert any(a.handed for a in model.base_model.__dict__["_eyas_norm_ahead"].values())


def test_decode_mlp_kernels_decode_as_eager(make_tiny, monkeypatch):
    """With each layer's MLP block as eyas' two Triton kernels (eyas.verifier.decode_mlp) in every forward they fit
    (``DECODE_MLP_ROWS`` at their most; eyas' default runs them in one-row forwards only): the kernels give the
    eager block in bf16 to its rounding, and plain decoding's graphs and speculative rounds (by parts and as one
    graph; a verification's K + 1 rows) decode what eager forwards decode (fp32), with the kernels in the
    graphs."""
    import eyas.verifier.compile as compile_
    from eyas.engine.generate import SequenceDecoder
    from eyas.verifier.decode_mlp import MAX_ROWS, decode_mlp, fits

    t = make_tiny("llama")
    info = resolve(t.path)
    bf16 = build_text_model(info, dtype=torch.bfloat16, device="cuda")
    layer = bf16.base_model.layers[0]
    for rows in (1, 4, 16):
        residual, attn = (torch.randn(1, rows, bf16.config.hidden_size, device="cuda", dtype=torch.bfloat16)
                          for _ in range(2))  # fmt: skip
        assert fits(layer.post_attention_layernorm, layer.mlp, residual)
        with torch.no_grad():
            s = residual + attn
            want = s + layer.mlp(layer.post_attention_layernorm(s))
            got = decode_mlp(layer.post_attention_layernorm, layer.mlp, residual, attn)
        torch.testing.assert_close(got, want, rtol=2**-7, atol=2**-7)
    monkeypatch.setattr(compile_, "DECODE_MLP_ROWS", MAX_ROWS)
    model = build_text_model(info, device="cuda")
    graphed = SequenceDecoder(model, capacity=400, cuda_graphs=True)
    eager = SequenceDecoder(model, capacity=400, cuda_graphs=False)
    draft = random_draft(info, seed=0, device="cuda")
    draft.t2d.fill_(True)
    r = Runners.build(model, draft, draft_tokens=[3], max_len=600, fused_rounds=True)
    for p in _prompts(3, seed=11):
        want = plain_generate(eager, p, max_new_tokens=120, eos_ids=set()).tokens
        assert plain_generate(graphed, p, max_new_tokens=120, eos_ids=set()).tokens == want
        for fused in (False, True):
            s = speculative_generate(r.spec, r.draft, p, max_new_tokens=120, draft_tokens=3, eos_ids=set(),
                                     fused=fused)  # fmt: skip
            assert s.tokens == want
    assert graphed.graphs.enabled and graphed.graphs.compile_model is not None  # no fallback
    ahead = [a for a in model.base_model.__dict__["_eyas_norm_ahead"].values() if a.mlp_rows]
    assert ahead and all(any(a._fits.values()) for a in ahead)  # the kernels ran in the compiled layers


def test_frozen_layers_decode_as_eager(make_tiny):
    """Batch-1 decoding with the verifier's layers and the draft compiled frozen (weights as constants; `eyas
    eval --freeze`, where the copies are cheap): plain decoding and speculative rounds (round by round and each
    round one graph) decode what eager forwards decode (fp32), nothing fell back, and every compiled version of
    a layer in the plain step holds 4 matmuls where an unmerged layer has 7. A layer may
    compile more than one version: the `kernels` package's context variable, which transformers' attention
    forward sets, changes value after the first compiled call and fails its guard once (12 versions for 8
    layers on an H100)."""
    from inductor_code import MATMUL, output_code

    from eyas.engine.generate import SequenceDecoder
    from eyas.engine.graphs import freeze_fits

    t = make_tiny("llama")
    info = resolve(t.path)
    model = build_text_model(info, device="cuda")
    layers = model.base_model.layers
    assert freeze_fits(layers) and SequenceDecoder(model, capacity=64, freeze=None).graphs.freeze  # fits here
    frozen = SequenceDecoder(model, capacity=400, freeze=True)
    # the prompt's forward stays eager here: compiled, it adds versions of 7 matmuls (prompts compile unfrozen,
    # with symbolic shapes; test_speculative_graphs_equal_eager covers them), which this count is not about
    frozen.compile_prompts = False
    eager = SequenceDecoder(model, capacity=400, cuda_graphs=False)
    prompts = _prompts(3, seed=9)
    got, codes = output_code(lambda: plain_generate(frozen, prompts[0], max_new_tokens=100, eos_ids=set()).tokens)
    per_version = [len(MATMUL.findall(c)) for c in codes if MATMUL.search(c)]  # the one-token step's layers
    # q/k/v and gate/up are merged (SequenceDecoder's merge, eyas.verifier.merged): one matmul each, o and down
    # the others, grouped-query attention or not (frozen without merging: 6 under GQA on an H100, inductor's
    # check_concat_weights wanting equal weight shapes)
    assert set(per_version) == {4} and len(per_version) >= len(layers), per_version
    assert got == plain_generate(eager, prompts[0], max_new_tokens=100, eos_ids=set()).tokens
    draft = random_draft(info, seed=0, device="cuda")
    draft.t2d.fill_(True)
    out = {}
    for graphs in (True, False):  # frozen graphs, then eager forwards
        r = Runners.build(model, draft, draft_tokens=[3], max_len=600, cuda_graphs=graphs, freeze=graphs,
                          fused_rounds=True)  # fmt: skip
        runs = []
        for p in prompts:
            base = plain_generate(r.base, p, max_new_tokens=96, eos_ids={2}).tokens
            for fused in (False, True):
                s = speculative_generate(r.spec, r.draft, p, max_new_tokens=96, draft_tokens=3, eos_ids={2},
                                         fused=fused)  # fmt: skip
                assert s.tokens == base
                runs.append((s.tokens, s.accepted))
        out[graphs] = runs
        assert r.base.graphs.freeze == r.spec.graphs.freeze == r.draft.frozen == graphs
        assert r.base.graphs.enabled == r.draft.graphs.enabled == graphs  # no fallback, to eager or uncompiled
        assert (r.base.graphs.compile_model is not None) == graphs and (
            r.draft.compiled_forward.compiled is not None
        ) == graphs
    assert out[True] == out[False]


def test_merged_projections_decode_as_eager(make_tiny):
    """Batch-1 decoding with q/k/v and gate/up merged (SequenceDecoder's default where its layers compile;
    eyas.verifier.merged), not frozen: every compiled version of a layer in the plain step holds 4 matmuls
    (7 unmerged), and plain decoding and speculative rounds decode what eager forwards of the unmerged model
    decode (fp32)."""
    import copy

    from inductor_code import MATMUL, output_code

    from eyas.engine.generate import SequenceDecoder

    t = make_tiny("llama")
    info = resolve(t.path)
    model = build_text_model(info, device="cuda")
    plain_model = copy.deepcopy(model)
    eager = SequenceDecoder(plain_model, capacity=400, cuda_graphs=False)
    unmerged = SequenceDecoder(copy.deepcopy(model), capacity=400, merge=False)
    unmerged.compile_prompts = False
    merged = SequenceDecoder(model, capacity=400)
    merged.compile_prompts = False  # the prompt's forward stays eager: the count is the one-token step's
    assert hasattr(model.base_model.layers[0].self_attn, "merged_qkv_proj")
    prompts = _prompts(3, seed=11)
    want = plain_generate(eager, prompts[0], max_new_tokens=100, eos_ids=set()).tokens
    counts = {}
    for name, dec in (("unmerged", unmerged), ("merged", merged)):
        got, codes = output_code(lambda: plain_generate(dec, prompts[0], max_new_tokens=100, eos_ids=set()).tokens)
        counts[name] = {len(MATMUL.findall(c)) for c in codes if MATMUL.search(c)}
        assert got == want, name
    assert counts == {"unmerged": {7}, "merged": {4}}, counts
    draft = random_draft(info, seed=0, device="cuda")
    draft.t2d.fill_(True)
    r = Runners.build(model, draft, draft_tokens=[3], max_len=600, fused_rounds=True)
    assert hasattr(draft.layers[0].self_attn, "merged_qkv_proj")  # the compiled draft merged too
    for p in prompts:
        base = plain_generate(eager, p, max_new_tokens=96, eos_ids={2}).tokens
        assert plain_generate(r.base, p, max_new_tokens=96, eos_ids={2}).tokens == base
        for fused in (False, True):
            s = speculative_generate(r.spec, r.draft, p, max_new_tokens=96, draft_tokens=3, eos_ids={2}, fused=fused)
            assert s.tokens == base, fused


def test_flex_attention_graphs_equal_sdpa(make_tiny):
    """FlexAttention (compiled, a block table per row) under CUDA graphs decodes what the SDPA path decodes
    (fp32), batched and in eval's loops, where each shape's one graph serves every position (the whole buffer
    as its key length); neither falls back."""
    from eyas.engine.slots import Slots

    t = make_tiny("llama")
    info = resolve(t.path)
    model = build_text_model(info, device="cuda")
    reqs = [Request(key=i, tokens=p, max_new_tokens=48) for i, p in enumerate(_prompts(24, seed=6))]
    kw = dict(eos_ids={2}, max_len=512, batch_tokens=512 * 8, sync_every=4)
    assert [c.tokens for c in decode_all(model, reqs, attention="flex", **kw)] == \
        [c.tokens for c in decode_all(model, reqs, attention="sdpa", **kw)]  # fmt: skip
    draft = random_draft(info, seed=0, device="cuda")
    draft.t2d.fill_(True)
    torch._dynamo.utils.counters.clear()
    r = Runners.build(model, draft, draft_tokens=[3], max_len=600)  # flex: the default on CUDA
    # the prompts' forwards stay eager here: compiled (symbolic shapes), their slot attention is a graph break by
    # design (its Python reads the packed layout, eyas.engine.slots._eager_attention); the count below is about
    # the decoding steps
    r.base.compile_prompts = r.spec.compile_prompts = False
    for p in _prompts(3, seed=8):
        s = speculative_generate(r.spec, r.draft, p, max_new_tokens=96, draft_tokens=3, eos_ids={2})
        assert s.tokens == plain_generate(r.base, p, max_new_tokens=96, eos_ids={2}).tokens
    assert r.base.slots.attention == r.spec.slots.attention == "flex" and r.base.graphs.enabled
    assert isinstance(r.base.slots, Slots)
    # prompts of up to 200 tokens and 96 new ones cross several of SDPA's key buckets: one key length here
    assert {key[-1] for key in r.base.graphs.graphs} == {r.base.slots.alloc}, list(r.base.graphs.graphs)
    # the slot attention compiled inside the layers (and the draft whole): nothing broke a compiled region
    assert not torch._dynamo.utils.counters["graph_break"], dict(torch._dynamo.utils.counters["graph_break"])
