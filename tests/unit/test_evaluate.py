"""eyas eval: speculative decoding is lossless (greedy: token for token; sampling: in distribution), the caches
roll back exactly, the statistics mean what they say, and TTT predicts what decoding accepts."""

from __future__ import annotations

import copy
import dataclasses
import json

import pytest
import torch

import eyas.stages.evaluate as ev
import eyas.engine.speculative as speculative
from eyas.data.chat import encode_prompt, end_of_turn_ids
from eyas.stages.evaluate import random_draft
from eyas.engine.generate import SequenceDecoder
from eyas.training.loss import implied_tau
from eyas.evaluation.measure import _divergence
from eyas.evaluation.offline import offline_accuracy, ttt_chain_lengths
from eyas.engine.speculative import (
    DraftRunner,
    acceptance_stats,
    plain_generate,
    speculative_generate,
    verify_greedy,
    verify_sampled,
)
from eyas.verifier.load import build_text_model, forward_hidden_states, load_tokenizer, resolve

PROMPTS = ["Tell me about dogs.", "What is 2+2?", "Write some python code"]
K = 3


def _verifier(model, aux_layer_ids=None, capacity: int = 1024) -> SequenceDecoder:
    """eval's decoder of one sequence (slot cache; CUDA graphs where there is a GPU)."""
    return SequenceDecoder(model, capacity=capacity, aux_layer_ids=aux_layer_ids)


pytestmark = pytest.mark.usefixtures("one_thread")


def _chisq_pvalue(stat: float, df: int) -> float:
    """P(chi-square(df) >= stat): the regularized upper incomplete gamma function Q(df/2, stat/2)."""
    half = lambda x: torch.tensor(x / 2, dtype=torch.float64)  # noqa: E731
    return float(torch.special.gammaincc(half(df), half(stat)))


def _hf_greedy(model, ids: list[int], max_new_tokens: int, eos: set[int]) -> list[int]:
    """transformers' own greedy ``generate`` (the independent reference), new tokens only."""
    x = torch.tensor([ids])
    out = model.generate(x, attention_mask=torch.ones_like(x), do_sample=False, max_new_tokens=max_new_tokens,
                         eos_token_id=sorted(eos), pad_token_id=0)  # fmt: skip
    return out[0, len(ids) :].tolist()


def _fit(draft, seqs: torch.Tensor, aux: torch.Tensor, target: torch.Tensor, *, steps: int, lr: float, ttt: int,
         soft: bool = False):  # fmt: skip
    """A short TTT fit of ``draft`` to the verifier: hard targets (its greedy tokens) or soft ones (its
    distribution restricted to the draft vocab). Step k at index t predicts the verifier at t+1+k."""
    draft.train()
    opt = torch.optim.Adam([p for p in draft.parameters() if p.requires_grad], lr=lr)
    T = seqs.shape[1]
    for _ in range(steps):
        loss = 0.0
        for k, normed in enumerate(draft.ttt(seqs, aux, ttt_steps=ttt)):
            logq = torch.log_softmax(draft.compute_logits(normed[:, : T - 2 - k]), -1)
            tgt = target[:, 1 + k : T - 1]
            loss = loss - ((tgt * logq).sum(-1).mean() if soft else logq.gather(-1, tgt[..., None]).mean())
        opt.zero_grad()
        loss.backward()
        opt.step()
    return draft.eval()


# --------------------------------------------------------------------------- acceptance kernels


def test_verify_greedy_cases():
    V = 6
    logits = torch.full((3, 4, V), -1.0)
    greedy = torch.tensor([[1, 2, 3, 4], [1, 2, 3, 4], [1, 2, 3, 4]])
    logits.scatter_(-1, greedy[..., None], 1.0)
    drafts = torch.tensor([[1, 2, 3], [1, 5, 3], [0, 2, 3]])  # all accepted; second rejected; first rejected
    accepted, nxt = verify_greedy(logits, drafts)
    assert accepted.tolist() == [3, 1, 0]
    assert nxt.tolist() == [4, 2, 1]  # bonus token; the verifier's correction at the first mismatch


def _sampled_outputs(verify, p, q, drafts_gen, n):
    """First and second emitted token of n rounds with fixed p [K+1, V], q [K, V]; drafts sampled from q."""
    g = torch.Generator().manual_seed(0)
    Kp = q.shape[0]
    drafts = torch.stack([torch.multinomial(q[j], n, replacement=True, generator=drafts_gen) for j in range(Kp)], 1)
    accepted, nxt = verify(p.expand(n, -1, -1), q.expand(n, -1, -1), drafts, generator=g)
    first = torch.where(accepted >= 1, drafts[:, 0], nxt)
    second = torch.where(accepted >= 2, drafts[:, 1], nxt)[accepted >= 1]  # produced when the first was a draft
    return first, second


def _broken_resample_from_p(target_probs, draft_probs, draft_tokens, *, generator=None):
    """The classic bug: after a rejection, sample from p instead of norm(max(0, p - q))."""
    accepted, _ = verify_sampled(target_probs, draft_probs, draft_tokens, generator=generator)
    rows = torch.arange(target_probs.shape[0])
    return accepted, torch.multinomial(target_probs[rows, accepted], 1, generator=generator)[:, 0]


def test_verify_sampled_follows_the_target_distribution():
    """Rejection sampling emits tokens distributed as p (chi-square over 200k rounds), including tokens the
    draft cannot propose (q = 0 there); the same test rejects the classic resample-from-p bug."""
    torch.manual_seed(0)
    V, n = 5, 200_000
    p = torch.softmax(torch.randn(3, V, dtype=torch.float64) * 1.5, -1)  # positions 0..K for K = 2
    q = torch.softmax(torch.randn(2, V, dtype=torch.float64) * 1.5, -1)
    q[:, 3] = 0  # token 3 is outside the draft vocab
    q = q / q.sum(-1, keepdim=True)

    def pvalues(verify):
        first, second = _sampled_outputs(verify, p, q, torch.Generator().manual_seed(1), n)
        out = []
        for tokens, probs in ((first, p[0]), (second, p[1])):
            counts = torch.bincount(tokens, minlength=V).double()
            expected = probs * tokens.numel()
            out.append(_chisq_pvalue(float(((counts - expected) ** 2 / expected).sum()), V - 1))
        return out

    assert min(pvalues(verify_sampled)) > 1e-3
    assert max(pvalues(_broken_resample_from_p)) < 1e-9  # the test has the power to see a wrong residual


# --------------------------------------------------------------------------- statistics


def test_acceptance_stats_and_implied_tau():
    s = acceptance_stats([0, 3, 1, 3, 2, 0], 3)
    assert s["accepted_length_histogram"] == [2, 1, 1, 2]
    assert s["tau"] == pytest.approx((0 + 3 + 1 + 3 + 2 + 0 + 6) / 6)
    assert s["acceptance_per_position"] == pytest.approx([4 / 6, 3 / 6, 2 / 6])  # unconditional
    assert s["conditional_acceptance_per_position"] == pytest.approx([4 / 6, 3 / 4, 2 / 3])
    # tau = 1 + sum_k P(first k+1 accepted) = 1 + sum of the unconditional rates = implied_tau(conditional)
    assert implied_tau(s["conditional_acceptance_per_position"]) == pytest.approx(s["tau"])
    assert acceptance_stats([], 2)["tau"] == 0.0


# --------------------------------------------------------------------------- greedy losslessness on tiny verifiers


@pytest.fixture(scope="module")
def setups(make_tiny):
    """Per tiny verifier: model (loaded by eyas), tokenizer, encoded chat prompts, a random and a fitted draft."""
    cache = {}

    def get(name):
        if name in cache:
            return cache[name]
        t = make_tiny(name)
        info = resolve(t.path)
        model = build_text_model(info)
        tok = load_tokenizer(info)
        eos = end_of_turn_ids(tok)
        prompts = [encode_prompt(tok, [{"role": "user", "content": p}]) for p in PROMPTS]
        # Fitted draft: a short TTT fit on the verifier's own greedy answers to these prompts (their first 24
        # tokens), so acceptance is high there and falls off past them: rounds with 0, some and all K accepted.
        base = _verifier(model, None)
        rows = [ids + plain_generate(base, ids, max_new_tokens=24, eos_ids=set()).tokens for ids in prompts]
        L = min(map(len, rows))
        seqs = torch.tensor([r[:L] for r in rows])
        aux, _ = forward_hidden_states(model, seqs, layer_ids=info.aux_layer_ids)
        with torch.no_grad():
            target = model(seqs).logits.argmax(-1)
        fitted = _fit(random_draft(info, seed=1), seqs, aux, target, steps=100, lr=3e-3, ttt=K)
        cache[name] = (t, info, model, eos, prompts, {"random": random_draft(info, seed=0), "fitted": fitted})
        return cache[name]

    return get


@pytest.mark.parametrize("name", ["llama", "qwen3", "deepseek_v3", "kimi_like"])
def test_greedy_speculative_decoding_is_lossless(setups, name):
    t, info, model, eos, prompts, drafts = setups(name)
    reference = t.reference()  # transformers' own model from the in-memory weights, independent of eyas's loading
    base = _verifier(model, None)
    taus = {}
    for kind, draft in drafts.items():
        spec = _verifier(model, draft.config.aux_layer_ids)
        dr = DraftRunner(draft)
        accepted = []
        for ids in prompts:
            out = speculative_generate(spec, dr, ids, max_new_tokens=40, draft_tokens=K, eos_ids=eos)
            plain = plain_generate(base, ids, max_new_tokens=40, eos_ids=eos)
            assert out.tokens == plain.tokens, f"{name}/{kind}: speculative output differs from greedy"
            ref = _hf_greedy(reference, ids, 40, eos)
            assert plain.tokens == ref, f"{name}: our greedy loop differs from transformers generate"
            assert sum(out.produced) + 1 == len(out.tokens)  # every kept token came from a round (or the prefill)
            accepted += out.accepted
        taus[kind] = acceptance_stats(accepted, K)
    assert taus["random"]["tau"] < 1.3
    fitted = taus["fitted"]
    assert fitted["tau"] > 1.5, fitted
    hist = fitted["accepted_length_histogram"]
    assert hist[K] > 0 and hist[0] + sum(hist[1:K]) > 0, hist  # full acceptance (bonus) and rejections


@pytest.mark.parametrize("name", ["llama", "qwen3"])
def test_fused_greedy_rounds_equal_the_round_by_round_loop(setups, name):
    """Greedy rounds as one function each (GreedyRounds: the catch-up always over K + 1 positions, the position
    and the accepted count kept on the device, neither cache truncated) decode exactly what the round-by-round
    loop decodes and accept the same drafts, with rounds of 0, some and all K accepted; a decoder reused across
    prompts and across both loops stays right."""
    _, info, model, eos, prompts, drafts = setups(name)
    draft = drafts["fitted"]
    spec, dr = _verifier(model, draft.config.aux_layer_ids), DraftRunner(draft)
    hist = [0] * (K + 1)
    for ids in prompts:
        fused = speculative_generate(spec, dr, ids, max_new_tokens=40, draft_tokens=K, eos_ids=eos, fused=True)
        loop = speculative_generate(spec, dr, ids, max_new_tokens=40, draft_tokens=K, eos_ids=eos)
        assert (fused.tokens, fused.accepted, fused.produced) == (loop.tokens, loop.accepted, loop.produced)
        for a in fused.accepted:
            hist[a] += 1
    assert hist[K] > 0 and hist[0] + sum(hist[1:K]) > 0, hist


def test_tau_counts_only_the_tokens_kept(setups):
    """A turn's last round may accept drafts past ``max_new_tokens`` (or past the end-of-turn token): those are
    dropped from the output and not counted, so tau is exactly kept tokens per verification round."""
    _, info, model, eos, prompts, drafts = setups("llama")
    spec, dr = _verifier(model, drafts["fitted"].config.aux_layer_ids), DraftRunner(drafts["fitted"])
    cut = 0
    for new in range(2, 12):
        out = speculative_generate(spec, dr, prompts[0], max_new_tokens=new, draft_tokens=K, eos_ids=set())
        assert len(out.tokens) == new and sum(out.produced) + 1 == new
        assert all(p <= a + 1 and a <= p for a, p in zip(out.accepted, out.produced))
        cut += out.produced[-1] < out.accepted[-1] + 1 or out.accepted[-1] < K and out.produced[-1] == out.accepted[-1]
        stats = acceptance_stats(out.accepted, K, produced=out.produced)
        assert stats["tau"] == pytest.approx((new - 1) / len(out.accepted))
    assert cut > 0  # some last round did make more than it kept


def test_one_decoder_serves_every_prompt(setups):
    """A decoder reused across prompts (each prompt rolls it back to position 0) decodes exactly what a fresh
    decoder per prompt does, speculatively and plainly."""
    _, info, model, eos, prompts, drafts = setups("llama")
    draft = drafts["fitted"]
    shared = (_verifier(model, draft.config.aux_layer_ids), _verifier(model, None), DraftRunner(draft))
    for ids in prompts + prompts[::-1]:
        fresh = (_verifier(model, draft.config.aux_layer_ids), _verifier(model, None), DraftRunner(draft))
        got = []
        for spec, base, dr in (shared, fresh):
            out = speculative_generate(spec, dr, ids, max_new_tokens=40, draft_tokens=K, eos_ids=eos)
            assert out.tokens == plain_generate(base, ids, max_new_tokens=40, eos_ids=eos).tokens
            got.append((out.tokens, out.accepted))
        assert got[0] == got[1]


def test_the_baseline_runs_on_the_bare_model(setups):
    """The plain baseline's forwards carry no hidden-state capture, whichever decoder ran before it (both
    orders), while every speculative forward has its hooks attached: the speedup's baseline pays for nothing
    it does not use."""
    from eyas.evaluation.measure import Runners

    _, _, model, eos, prompts, drafts = setups("llama")
    draft = drafts["fitted"]
    norm = model.base_model.norm  # the capture always hooks it (the last hidden state is its input)
    seen: list[tuple[str, int]] = []  # (which decoder, pre-hooks on the final norm beside this probe)
    which = ["none"]
    probe = norm.register_forward_pre_hook(lambda m, a: seen.append((which[0], len(m._forward_pre_hooks) - 1)))
    try:
        r = Runners.build(model, draft, draft_tokens=[K], max_len=256, cuda_graphs=False, compile=False)
        ids = prompts[0]
        for order in (("base", "spec"), ("spec", "base")):
            for name in order:
                seen.clear()
                which[0] = name
                if name == "base":
                    plain_generate(r.base, ids, max_new_tokens=8, eos_ids=eos)
                else:
                    speculative_generate(r.spec, r.draft, ids, max_new_tokens=8, draft_tokens=K, eos_ids=eos)
                hooks = {n for _, n in seen}
                assert seen and hooks == ({0} if name == "base" else {1}), (order, name, hooks)
    finally:
        probe.remove()


def test_sliding_window_verifier_rolls_back():
    """A sliding-window verifier (Mistral, window 8 < the sequence): the slot attention masks keys past the
    window, rolls back across it, and speculative decoding stays lossless, equal to transformers' generate."""
    from transformers import MistralConfig, MistralForCausalLM

    from eyas.draft.model import DraftConfig, Eagle3Draft

    torch.manual_seed(0)
    cfg = MistralConfig(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=4, num_attention_heads=4,
                        num_key_value_heads=2, head_dim=8, sliding_window=8, max_position_embeddings=256)  # fmt: skip
    model = MistralForCausalLM(cfg).eval()
    dcfg = DraftConfig(hidden_size=32, intermediate_size=64, num_attention_heads=4, num_key_value_heads=2, head_dim=8,
                       vocab_size=64, draft_vocab_size=64, aux_layer_ids=[1, 2, 3])  # fmt: skip
    draft = Eagle3Draft(dcfg)
    draft.t2d.fill_(True)
    with torch.no_grad():
        draft.embed_tokens.weight.copy_(model.model.embed_tokens.weight)
    prompts = [[1, 5, 9, 3], [7, 2, 2, 40, 11]]
    base = _verifier(model, None)
    rows = [p + plain_generate(base, p, max_new_tokens=30, eos_ids=set()).tokens for p in prompts]
    seqs = torch.tensor([r[:34] for r in rows])
    aux, _ = forward_hidden_states(model, seqs, layer_ids=[1, 2, 3])
    with torch.no_grad():
        target = model(seqs).logits.argmax(-1)
    _fit(draft, seqs, aux, target, steps=100, lr=1e-2, ttt=K)
    spec = _verifier(model, [1, 2, 3])
    accepted = []
    for p in prompts:
        out = speculative_generate(spec, DraftRunner(draft), p, max_new_tokens=50, draft_tokens=K, eos_ids=set())
        plain = plain_generate(base, p, max_new_tokens=50, eos_ids=set())
        assert out.tokens == plain.tokens == _hf_greedy(model, p, 50, {0})
        accepted += out.accepted
    hist = acceptance_stats(accepted, K)["accepted_length_histogram"]
    assert sum(hist[:K]) > 0 and hist[K] > 0, hist  # rejections (rollbacks past the window) and full acceptances


def test_rollback_equals_a_fresh_run(setups):
    """After a rejection, the draft's next proposals equal those of a fresh run from the same prefix, and the
    draft cache holds exactly what a fresh pass over the verifier's states of the final sequence computes."""
    _, info, model, eos, prompts, drafts = setups("qwen3")
    draft = drafts["fitted"]
    spec = _verifier(model, draft.config.aux_layer_ids)
    dr = DraftRunner(draft)
    ids = prompts[2]
    out = speculative_generate(spec, dr, ids, max_new_tokens=40, draft_tokens=K, eos_ids=set())
    rounds = [r for r in range(1, len(out.accepted)) if out.accepted[r - 1] < K]  # rounds right after a rejection
    assert rounds, out.accepted
    emitted = 1  # tokens emitted before round r: the prefill's token, then a + 1 per round
    starts = []
    for a in out.accepted:
        starts.append(emitted)
        emitted += a + 1
    fresh_spec = _verifier(model, draft.config.aux_layer_ids)
    fresh_dr = DraftRunner(draft)
    for r in rounds[:4]:
        prefix = ids + out.tokens[: starts[r] - 1]  # a fresh run re-emits token starts[r]-1 from its prefill
        fresh = speculative_generate(fresh_spec, fresh_dr, prefix, max_new_tokens=2, draft_tokens=K, eos_ids=set())
        assert fresh.tokens[0] == out.tokens[starts[r] - 1]
        assert fresh.proposals[0] == out.proposals[r], f"round {r}"
    # The cache after the run: positions 0..m-1 valid, each computed from the verifier's state there (past the last
    # round's start, its catch-up and the drafts queued behind it, which the next round would overwrite).
    seq = torch.tensor(ids + out.tokens)
    m = len(ids) + starts[-1] - 1  # the last round's start
    assert dr.cache.valid[0, :m].all()
    aux, _ = forward_hidden_states(model, seq[None], layer_ids=draft.config.aux_layer_ids)
    cache = draft.new_cache(batch_size=1, max_len=dr.cache.max_len)
    with torch.no_grad():
        draft.step(seq[None, 1 : m + 1], draft.fuse(aux[:, :m]), torch.arange(m)[None], cache)
    torch.testing.assert_close(dr.cache.k[:, :, :m], cache.k[:, :, :m], rtol=1e-4, atol=1e-5)
    torch.testing.assert_close(dr.cache.v[:, :, :m], cache.v[:, :, :m], rtol=1e-4, atol=1e-5)


def test_ttt_predicts_the_accepted_length_of_every_round(setups):
    """The draft's TTT over the decoded sequence accepts, at each round's start, exactly what decoding accepted:
    eval measures the function training optimises."""
    _, info, model, eos, prompts, drafts = setups("llama")
    draft = drafts["fitted"]
    spec = _verifier(model, draft.config.aux_layer_ids)
    dr = DraftRunner(draft)
    checked = set()
    for ids in prompts:
        out = speculative_generate(spec, dr, ids, max_new_tokens=40, draft_tokens=K, eos_ids=set())
        seq = torch.tensor(ids + out.tokens)
        aux, _ = forward_hidden_states(model, seq[None], layer_ids=draft.config.aux_layer_ids)
        with torch.no_grad():
            greedy = model(seq[None]).logits[0].argmax(-1)
        lengths = ttt_chain_lengths(draft, seq, aux[0], greedy, ttt_steps=K)
        m = len(ids)  # position of the last emitted token at the start of round 0
        for a in out.accepted:
            if m - 1 < lengths.shape[0]:  # the sequence covers this round's K + 1 positions
                assert int(lengths[m - 1]) == a
                checked.add(a)
            m += a + 1
    assert 0 in checked and K in checked, checked


# --------------------------------------------------------------------------- sampling losslessness


def test_sampled_speculative_decoding_follows_the_verifier():
    """At T = 1 the tokens the loop emits follow the verifier's conditional distributions: the martingale
    chi-square statistic sum_t (onehot(x_t) - p_t), with covariance sum_t diag(p_t) - p_t p_t^T, is
    chi-square(V - 1) under the null. The draft vocab (6 of 8 tokens) forces resampling outside it, and the
    same run with the resample-from-p bug is rejected, so the test has power."""
    from transformers import LlamaConfig, LlamaForCausalLM

    from eyas.draft.model import DraftConfig, Eagle3Draft

    V = 8
    torch.manual_seed(0)
    cfg = LlamaConfig(vocab_size=V, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
                      num_key_value_heads=2, max_position_embeddings=512, initializer_range=0.5)  # fmt: skip
    model = LlamaForCausalLM(cfg).eval()
    with torch.no_grad():  # weak attention: the next token depends mostly (not only) on the current one
        for layer in model.model.layers:
            layer.self_attn.o_proj.weight.mul_(0.2)
    dcfg = DraftConfig(hidden_size=32, intermediate_size=64, num_attention_heads=4, num_key_value_heads=2, head_dim=8,
                       vocab_size=V, draft_vocab_size=6, aux_layer_ids=[0, 1, 2], initializer_range=0.5)  # fmt: skip
    draft = Eagle3Draft(dcfg)
    used = torch.tensor([0, 1, 2, 4, 5, 7])
    t2d = torch.zeros(V, dtype=torch.bool)
    t2d[used] = True
    draft.set_vocab(d2t=used - torch.arange(6), t2d=t2d)
    with torch.no_grad():
        draft.embed_tokens.weight.copy_(model.model.embed_tokens.weight)
        prompts = torch.randint(0, V, (48, 3))
        seqs = model.generate(prompts, attention_mask=torch.ones_like(prompts), do_sample=True, top_k=0, top_p=1.0,
                              max_new_tokens=100, pad_token_id=0)  # fmt: skip
        p_all = torch.softmax(model(seqs).logits, -1)[..., used]
    aux, _ = forward_hidden_states(model, seqs, layer_ids=[0, 1, 2])
    _fit(draft, seqs, aux, p_all, steps=200, lr=3e-3, ttt=2, soft=True)

    def pvalue() -> tuple[float, dict]:
        g = torch.Generator().manual_seed(0)
        spec, dr = _verifier(model, [0, 1, 2]), DraftRunner(draft)
        D = torch.zeros(V, dtype=torch.float64)
        C = torch.zeros(V, V, dtype=torch.float64)
        accepted = []
        for r in range(16):
            prompt = [r % V, (r // V) % V, 5]
            out = speculative_generate(spec, dr, prompt, max_new_tokens=100, draft_tokens=2, eos_ids=set(),
                                       temperature=1.0, generator=g)  # fmt: skip
            accepted += out.accepted
            with torch.no_grad():
                p = torch.softmax(model(torch.tensor([prompt + out.tokens])).logits[0, 2:-1].double(), -1)  # [n, V]
            D += (torch.nn.functional.one_hot(torch.tensor(out.tokens), V).double() - p).sum(0)
            C += torch.diag_embed(p).sum(0) - p.T @ p
        stat = float(D @ torch.linalg.pinv(C) @ D)
        return _chisq_pvalue(stat, V - 1), acceptance_stats(accepted, 2)

    p_ok, stats = pvalue()
    assert p_ok > 1e-3, (p_ok, stats)
    assert 0.15 < stats["acceptance_per_position"][0] < 0.9  # partial acceptance: both branches are exercised
    orig = speculative.verify_sampled
    speculative.verify_sampled = _broken_resample_from_p
    try:
        p_bad, _ = pvalue()
    finally:
        speculative.verify_sampled = orig
    assert p_bad < 1e-5, p_bad


# --------------------------------------------------------------------------- the real model


def test_smollm2_greedy_is_lossless(smollm2_path, smollm2_model):
    info = resolve(smollm2_path)
    tok = load_tokenizer(info)
    eos = end_of_turn_ids(tok)
    assert tok.convert_tokens_to_ids("<|im_end|>") in eos
    ids = encode_prompt(tok, [{"role": "user", "content": "What is the capital of France?"}])
    draft = random_draft(info, seed=0)
    spec = _verifier(smollm2_model, draft.config.aux_layer_ids)
    base = _verifier(smollm2_model, None)
    out = speculative_generate(spec, DraftRunner(draft), ids, max_new_tokens=16, draft_tokens=K, eos_ids=eos)
    plain = plain_generate(base, ids, max_new_tokens=16, eos_ids=eos)
    assert out.tokens == plain.tokens
    assert plain.tokens == _hf_greedy(smollm2_model, ids, 16, eos)
    assert "Paris" in tok.decode(out.tokens)


def test_recheck_in_fp32_on_a_gguf_verifier(smollm2_path, monkeypatch):
    """A difference the logit gap calls real is decoded again in fp32 without being asked, on a GGUF verifier in
    bf16 too (transformers marks the dequantized model quantized and refuses its `.float()`): a loop that accepts
    every draft stays real."""

    def accept_all(target_logits, draft_tokens):
        return torch.full(draft_tokens.shape[:1], draft_tokens.shape[1]), target_logits[:, -1].argmax(-1)

    monkeypatch.setattr(speculative, "verify_greedy", accept_all)
    report = ev.evaluate(verifier=str(smollm2_path), draft="random", prompts=[PROMPTS[1]], max_new_tokens=8,
                         dtype="bfloat16")  # fmt: skip
    (bad,) = report["mismatches"]
    assert bad["fp32"] == "differ" and bad["kind"] == "real" and report["dtype"] == "bfloat16"


# --------------------------------------------------------------------------- the stage


def test_eval_stage_writes_report_and_histogram(setups, tmp_path, capsys):
    from eyas.draft.checkpoint import save_draft

    t, info, model, eos, prompts, drafts = setups("llama")
    draft_dir = save_draft(tmp_path / "draft", drafts["fitted"], verifier_name_or_path=str(t.path),
                           verifier_architectures=["LlamaForCausalLM"], ttt_steps=K,
                           dtype=torch.float32)  # fmt: skip
    prompts = [{"turns": [PROMPTS[0]], "category": "writing"}, {"turns": PROMPTS[1:], "category": "math"}]
    report = ev.evaluate(verifier=str(t.path), draft=str(draft_dir), prompts=prompts, max_new_tokens=24,
                         out=str(tmp_path / "r.json"))  # fmt: skip
    printed = capsys.readouterr().out
    assert "tau" in printed and "lossless" in printed
    saved = json.loads((tmp_path / "r.json").read_text())
    assert saved["lossless"] is True and saved["num_prompts"] == 2 and saved["num_turns"] == 3
    # tau by turn number and by category: each a partition of the rounds, so their rounds add up to the whole and
    # their tau, weighted by rounds, is the whole tau
    for groups in (saved["tau_by_turn"], saved["tau_by_category"]):
        assert sum(g["rounds"] for g in groups.values()) == saved["rounds"]
        mean = sum(g["tau"] * g["rounds"] for g in groups.values()) / saved["rounds"]
        assert mean == pytest.approx(saved["tau"])
    assert set(saved["tau_by_turn"]) == {"1", "2"} and set(saved["tau_by_category"]) == {"math", "writing"}
    assert saved["tau_by_turn"]["2"]["rounds"] < saved["tau_by_category"]["math"]["rounds"]  # math's turn 1 too
    assert "tau by turn" in printed and "tau by category" in printed
    assert saved["draft_tokens"] == K and len(saved["acceptance_per_position"]) == K
    assert saved["tau"] == pytest.approx(report["tau"]) and saved["tau"] > 1.5
    assert saved["baseline_tokens_per_s"] > 0 and saved["tokens_per_s"] > 0
    t = saved["seconds"]  # where the time went: the loops' own clocks inside the decoding, inside the total
    assert t["decode_plain"] + t["decode_speculative"] <= t["decode"] + 0.02 and t["decode"] <= t["total"]  # rounded
    assert t["decode_plain"] > 0
    assert t["load"] + t["build"] + t["decode"] <= t["total"] + 0.05 and "time" in printed
    assert saved["compiles"] >= 0 and 0 <= t["compile"] <= t["total"]  # torch.compile's share (none on CPU here)
    assert (tmp_path / "r_accepted_lengths.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_a_turn_past_max_seq_len_is_skipped_with_its_later_turns(setups, tmp_path, capsys):
    """A prompt longer than --max-seq-len allows does not size the decoders nor stop the run: that turn and its
    prompt's later turns are skipped and listed, and every other turn is measured exactly as in a run of those
    turns alone; when nothing fits, the error says so; a --max-new-tokens that leaves no room is refused."""
    from eyas.core.errors import EyasError
    from eyas.core.files import sha256_json

    t, info, model, eos, prompts, drafts = setups("llama")
    long = " ".join(["dogs and cats"] * 60)  # far more tokens than 80
    kw = dict(verifier=str(t.path), draft="random", max_new_tokens=8, max_seq_len=80)
    report = ev.evaluate(prompts=[{"id": "a", "turns": [PROMPTS[0]]}, {"id": "b", "turns": [long, PROMPTS[1]]},
                                  {"id": "c", "turns": [PROMPTS[2], long, PROMPTS[1]]}], **kw)  # fmt: skip
    printed = capsys.readouterr().out
    assert [(x["prompt"], x["turn"]) for x in report["skipped_turns"]] == [("b", 1), ("c", 2)]
    assert all(x["prompt_tokens"] > 80 for x in report["skipped_turns"]) and report["max_seq_len"] == 80
    assert "skipped (too long)" in printed and "b turn 1" in printed
    alone = ev.evaluate(prompts=[{"id": "a", "turns": [PROMPTS[0]]}, {"id": "c", "turns": [PROMPTS[2]]}], **kw)
    assert report["num_turns"] == alone["num_turns"] == 2 and alone["skipped_turns"] == []
    for key in ("rounds", "tau", "accepted_length_histogram", "generated_tokens", "lossless"):
        assert report[key] == alone[key], key
    # the option recorded only when set: a report of the default settings is the one made before it existed
    out = tmp_path / "r.json"
    first = ev.evaluate(prompts=[PROMPTS[0]], out=str(out), **{**kw, "max_seq_len": 4096})
    c = ev.EvalConfig(prompts=[PROMPTS[0]], out=str(out), **{**kw, "max_seq_len": 4096})
    settings = {k: v for k, v in dataclasses.asdict(c).items() if k not in ("out", "max_seq_len")}
    assert first["measured_sha256"] == sha256_json({"settings": settings, "draft": "random",
                                                    "prompts": [{"id": "0", "turns": [PROMPTS[0]], "system": None,
                                                                 "category": None}]})  # fmt: skip
    with pytest.raises(EyasError, match="longer than --max-seq-len 80"):
        ev.evaluate(prompts=[long], **kw)
    with pytest.raises(EyasError, match="--max-new-tokens 76 leaves no room"):
        ev.evaluate(prompts=[PROMPTS[0]], **{**kw, "max_new_tokens": 76})


def test_mt_bench_prompts_keep_their_categories():
    """The report's tau by category reads MT-Bench's own eight categories, ten questions each."""
    from collections import Counter

    from eyas.evaluation.measure import as_prompts

    plist, _, dropped = as_prompts("mt-bench", num_prompts=None, seed=0)
    assert dropped == []
    assert Counter(p.category for p in plist) == dict.fromkeys(
        ("writing", "roleplay", "reasoning", "math", "coding", "extraction", "stem", "humanities"), 10)  # fmt: skip


def test_offline_prediction_from_features(setups, tmp_path):
    """``offline_accuracy`` over `eyas extract` features equals the same chain computed from the live verifier
    (its own logits, not the stored pre-norm state through norm and head), and eval reports it beside tau."""
    import tiny

    from eyas.stages.extract import extract

    t, info, model, eos, prompts, drafts = setups("llama")
    draft = drafts["fitted"]
    base = _verifier(model, None)
    rows = []
    for ids in prompts:
        answer = plain_generate(base, ids, max_new_tokens=40, eos_ids=eos).tokens
        rows.append((ids + answer, [0] * len(ids) + [1] * len(answer)))
    prep = tiny.write_prepared(tmp_path / "prep", rows, verifier=t.path)
    feats = tmp_path / "features"
    extract(verifier=str(t.path), data=str(prep), out=str(feats), dtype="fp32", device="cpu")
    off = offline_accuracy(draft, info, feats, ttt_steps=K)
    reached, right = [0] * K, [0] * K
    for ids, mask in rows:
        seq = torch.tensor(ids)
        aux, _ = forward_hidden_states(model, seq[None], layer_ids=draft.config.aux_layer_ids)
        with torch.no_grad():
            greedy = model(seq[None]).logits[0].argmax(-1)
        lengths = ttt_chain_lengths(draft, seq, aux[0], greedy, ttt_steps=K).tolist()
        for t_, n in enumerate(lengths):
            for k in range(K):
                if mask[t_ + 2 + k]:
                    reached[k] += n >= k
                    right[k] += n > k
    assert off["positions"] == reached[0] and off["rows"] == len(rows)
    assert off["conditional_accuracy"] == pytest.approx([r / n for r, n in zip(right, reached)])
    assert off["predicted_tau"] == pytest.approx(implied_tau(off["conditional_accuracy"]))
    assert off["predicted_tau"] > 1.5
    # the walk over the same turns is exact: real decoding of these prompts makes the same rounds
    spec, dr = _verifier(model, draft.config.aux_layer_ids), DraftRunner(draft)
    accepted, produced = [], []
    for ids in prompts:
        out = speculative_generate(spec, dr, ids, max_new_tokens=40, draft_tokens=K, eos_ids=eos)
        accepted += out.accepted
        produced += out.produced
    real = acceptance_stats(accepted, K, produced=produced)
    walk = offline_accuracy(draft, info, feats, ttt_steps=K, max_new_tokens=40)["walk"]
    assert walk["rounds"] == real["rounds"] and walk["tau"] == pytest.approx(real["tau"])
    assert walk["acceptance_per_position"] == pytest.approx(real["acceptance_per_position"])
    # at a smaller max_new_tokens the walk stops where eval would: fewer rounds
    assert offline_accuracy(draft, info, feats, ttt_steps=K, max_new_tokens=8)["walk"]["rounds"] < real["rounds"]
    report = ev.evaluate(verifier=str(t.path), draft="random", prompts=[PROMPTS[0]], max_new_tokens=8,
                         offline=str(feats))  # fmt: skip
    assert report["offline"]["rows"] == len(rows) and "predicted_tau" in report


def test_offline_prediction_uses_the_rows_train_held_out(make_tiny, tmp_path, capsys):
    """eval --offline predicts tau from exactly the validation rows the train stage held out (offline training on
    those features, or online training on the prepared rows they came from), says so in the report and the
    printed table, and takes the first rows of features the draft never trained on."""
    import tiny

    from eyas.stages.extract import extract
    from eyas.stages.train import train

    t = make_tiny("llama")
    prep = tiny.write_prepared(tmp_path / "prep", tiny.random_rows(24, seed=3, lo=12, hi=30), verifier=t.path)
    feats = tmp_path / "features"
    extract(verifier=str(t.path), data=str(prep), out=str(feats), dtype="fp32", device="cpu")
    kw = dict(verifier=str(t.path), epochs=1, max_steps=1, max_seq_len=64, num_workers=0, val_ratio=0.25, seed=5)
    drafts = {"offline": (feats, tmp_path / "draft"), "online": (prep, tmp_path / "draft-online")}
    for how, (data, out) in drafts.items():
        train(data=str(data), out=str(out), online=how == "online", **kw)
        held_out = json.loads((out / "manifest.json").read_text())["outputs"]["val_rows"]
        assert len(held_out) == 6 and held_out != list(range(6))
        capsys.readouterr()
        report = ev.evaluate(verifier=str(t.path), draft=str(out), prompts=[PROMPTS[0]], max_new_tokens=4,
                             offline=str(feats), offline_rows=100)  # fmt: skip
        assert report["offline"]["row_ids"] == held_out and report["offline"]["rows_from"] == "validation", how
        assert report["offline"]["rows"] == 6
        assert "validation rows train held out (6 recorded)" in capsys.readouterr().out

    other = tiny.write_prepared(tmp_path / "other", tiny.random_rows(5, seed=8, lo=12, hi=30), verifier=t.path)
    extract(verifier=str(t.path), data=str(other), out=str(tmp_path / "other-features"), dtype="fp32", device="cpu")
    report = ev.evaluate(verifier=str(t.path), draft=str(tmp_path / "draft"), prompts=[PROMPTS[0]], max_new_tokens=4,
                         offline=str(tmp_path / "other-features"), offline_rows=3)  # fmt: skip
    assert report["offline"]["row_ids"] == [0, 1, 2] and report["offline"]["rows_from"] == "unseen"


def test_template_warning_fires_for_an_offline_draft(make_tiny, tmp_path):
    """The chat-template hash travels prepare -> extract -> train (offline), so eval warns when the verifier's
    template is not the one the draft's rows were rendered with, and stays quiet when it is (its own, or the
    draft's given with --chat-template)."""
    import tiny
    from chat_templates import verifier_with

    from eyas.stages.prepare import prepare
    from eyas.stages.extract import extract
    from eyas.stages.train import train
    from eyas.data.chat import chat_template_hash

    t = make_tiny("llama")
    data = tmp_path / "convs.jsonl"
    data.write_text("".join(json.dumps({"messages": [{"role": "user", "content": f"Question {i}?"},
                                                     {"role": "assistant", "content": f"Answer {i}. " * 3}]}) + "\n"
                            for i in range(8)))  # fmt: skip
    prepared = prepare(verifier=str(t.path), data=str(data), out=str(tmp_path / "prep"), num_proc=1)
    sha = prepared["inputs"]["chat_template_sha256"]
    assert sha == chat_template_hash(load_tokenizer(str(t.path)))
    feats = extract(verifier=str(t.path), data=str(tmp_path / "prep"), out=str(tmp_path / "feats"), dtype="fp32")
    assert feats["inputs"]["chat_template_sha256"] == sha
    train(verifier=str(t.path), data=str(tmp_path / "feats"), out=str(tmp_path / "draft"), epochs=1, max_steps=1,
          max_seq_len=64, num_workers=0)  # fmt: skip
    assert json.loads((tmp_path / "draft" / "manifest.json").read_text())["inputs"]["chat_template_sha256"] == sha

    tok = tiny.make_tokenizer()
    tok.chat_template = tiny.CHATML.replace("assistant\n", "assistant\n\n")
    other = verifier_with(tok, t.path, tmp_path / "other-template")  # the same weights, another template
    kw = dict(draft=str(tmp_path / "draft"), prompts=[PROMPTS[0]], max_new_tokens=4)
    assert "warning" not in ev.evaluate(verifier=str(t.path), **kw)
    assert ev.evaluate(verifier=str(other), **kw)["warning"].startswith(
        "the draft was trained on data rendered with another chat template"
    )
    assert "warning" not in ev.evaluate(verifier=str(other), chat_template=str(t.path), **kw)  # the draft's template


def test_base_verifier_needs_a_chat_template(make_tiny, tmp_path):
    """eval renders prompts through a chat template: a verifier without one is refused with the way forward, and
    runs with --chat-template, whose hash and source the report records."""
    import hashlib

    from chat_templates import COMPLETION, without_template

    from eyas.core.errors import EyasError

    base = without_template(make_tiny("llama").path, tmp_path / "base")
    kw = dict(verifier=str(base), draft="random", prompts=[PROMPTS[0]], max_new_tokens=4)
    with pytest.raises(EyasError, match="has no chat template; eyas eval renders prompts through it: give"):
        ev.evaluate(**kw)
    report = ev.evaluate(chat_template=str(COMPLETION), **kw)
    assert report["chat_template_sha256"] == hashlib.sha256(COMPLETION.read_bytes()).hexdigest()
    assert report["chat_template"] == str(COMPLETION) and report["lossless"] is True
    assert report["draft_attention"] == "sdpa"  # the draft cache's on CPU ("matmul" on CUDA)


def test_lossless_check_catches_a_wrong_loop(setups, monkeypatch):
    """The lossless check is not vacuous: a loop that accepts every draft token is reported, with the place and
    the verifier's logit gap there (large: not a near-tie)."""
    t, *_ = setups("llama")

    def accept_all(target_logits, draft_tokens):
        return torch.full(draft_tokens.shape[:1], draft_tokens.shape[1]), target_logits[:, -1].argmax(-1)

    monkeypatch.setattr(speculative, "verify_greedy", accept_all)
    report = ev.evaluate(verifier=str(t.path), draft="random", prompts=[PROMPTS[0]], max_new_tokens=12,
                         recheck_fp32=True)  # fmt: skip
    # 12 tokens: the prefill's, then 3 rounds of K + 1 of which the last keeps 3
    assert report["lossless"] is False and report["tau"] == pytest.approx(11 / 3)
    (bad,) = report["mismatches"]
    assert bad["first_difference"] == 1  # the first token comes from the prefill; the first draft is wrong
    assert bad["logit_gap"] > 0.01 and bad["plain_token"] != bad["spec_token"]
    assert bad["kind"] == "real" and bad["fp32"] == "differ"  # not a near-tie: fp32 decoding differs as well


def test_a_near_tie_is_told_from_a_real_difference(setups):
    """The logit gap at a first difference is judged against the compute dtype's resolution: bf16 rounds a
    gap of a few hundredths at logits near 10 away, fp32 does not."""
    _, info, model, eos, prompts, drafts = setups("llama")
    ids = prompts[0]
    plain = plain_generate(_verifier(model, None), ids, max_new_tokens=4, eos_ids=set()).tokens
    with torch.no_grad():
        logits = model(input_ids=torch.tensor([ids]), use_cache=False).logits[0, -1]
    runner_up = int(logits.topk(2).indices[1])
    assert _divergence(model, ids, plain, [runner_up], 0)["kind"] == "real"  # fp32: any clear gap is real
    wide = _divergence(model.to(torch.bfloat16), ids, plain, [runner_up], 0)
    gap = abs(wide["logit_gap"])
    tolerance = 2 * 2**-7 * max(abs(float(logits[plain[0]])), abs(float(logits[runner_up])), 1.0)
    assert wide["kind"] == ("near-tie" if gap <= tolerance else "real")
    model.float()


def test_eval_cli(make_tiny, tmp_path, capsys):
    from eyas.cli import main

    t = make_tiny("llama")
    src = tmp_path / "prompts.jsonl"
    # rows that are not prompts (no turns; a line that is not JSON) are left out, and the report says which
    src.write_text(json.dumps({"question_id": 7, "turns": ["Hi there.", "And again?"]}) + "\n"
                   + json.dumps({"question_id": 8, "turns": []}) + '\n{"question_id": 9,\n')  # fmt: skip
    assert main(["eval", "--verifier", str(t.path), "--draft", "random", "--prompts", str(src), "--max-new-tokens",
                 "6", "--draft-tokens", "2,4", "--out", str(tmp_path / "rep")]) == 0  # fmt: skip
    report = json.loads((tmp_path / "rep" / "report.json").read_text())
    assert report["num_prompts"] == 1 and report["num_turns"] == 2
    assert report["draft_tokens"] == 2 and report["lossless"] is True
    dropped = report["prompts_dropped_or_cut"]
    assert len(dropped) == 1 and dropped[0].startswith("malformed: 2") and "rows 1, 2" in dropped[0]
    assert "rows dropped or cut" in capsys.readouterr().out
    by_k = report["by_draft_tokens"]
    assert (
        set(by_k) == {"2", "4"} and by_k["2"]["tau"] == report["tau"] and len(by_k["4"]["acceptance_per_position"]) == 4
    )
    assert (tmp_path / "rep" / "accepted_lengths.png").is_file()
    assert main(["eval", "--verifier", str(t.path), "--draft", str(tmp_path / "nope"), "--prompts", str(src)]) == 2
    assert "nope" in capsys.readouterr().err
    assert main(["eval", "--verifier", str(t.path), "--draft", "random", "--prompts", str(src),
                 "--draft-tokens", "0"]) == 2  # fmt: skip


@pytest.mark.parametrize("freeze", [False, True])
def test_compiled_draft_decodes_what_the_eager_one_does(setups, freeze):
    """The draft's fixed-shape forwards through torch.compile (``DraftRunner(compile=True)``, on by default under
    CUDA graphs) propose and accept exactly the drafts of the eager forward, round by round and with each round
    as one function (its catch-up and acceptance compiled too), and its compiled catch-up over
    the verifier's aux states (fused inside) gives the eager logits; the cache writes land in the cache. Also
    compiled frozen (eval's draft, weights as constants). Either way a layer's q/k/v are one matmul in inductor's
    code and gate/up another (merged by the compiled runner, in place: a copy here, the fixture's draft is
    shared)."""
    import copy

    from inductor_code import matmuls, output_code

    _, info, model, eos, prompts, drafts = setups("llama")
    draft = drafts["fitted"]
    spec = _verifier(model, draft.config.aux_layer_ids)
    eager, compiled = DraftRunner(draft), DraftRunner(copy.deepcopy(draft), compile=True, freeze=freeze)
    assert hasattr(compiled.draft.layers[0].self_attn, "merged_qkv_proj")
    for ids in prompts[:2]:
        want = speculative_generate(spec, eager, ids, max_new_tokens=24, draft_tokens=K, eos_ids=eos)
        for fused in (False, True):  # rounds by parts, and each round as one function
            got = speculative_generate(spec, compiled, ids, max_new_tokens=24, draft_tokens=K, eos_ids=eos,
                                       fused=fused)  # fmt: skip
            assert (got.tokens, got.accepted, got.proposals) == (want.tokens, want.accepted, want.proposals)
    assert compiled.compiled_forward.compiled is not None and compiled.outcome.compiled is not None  # none fell back
    aux = torch.randn(1, 2, 3 * info.hidden_size, generator=torch.Generator().manual_seed(5))
    ids, pos = torch.tensor([[5, 7]]), torch.tensor([[3, 4]])
    for dr in (eager, compiled):
        dr.reset(64)
    with torch.no_grad():
        want = eager._forward(ids, aux, pos, fuse=True)
        got, codes = output_code(lambda: compiled._run(ids, aux, pos, fuse=True))
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
    # fc and the head, then a layer's q/k/v, o, gate/up and down
    assert matmuls(codes) == 2 + len(draft.layers) * 4
    # the positions written (elsewhere: what earlier decoding left, rounds as one function past the accepted)
    torch.testing.assert_close(compiled.cache.k[:, :, 3:5], eager.cache.k[:, :, 3:5], rtol=1e-5, atol=1e-5)
    assert bool(compiled.cache.valid[0, 3:5].all()) and not bool(compiled.cache.valid[0, 5:].any())


def test_the_compiled_acceptance_equals_the_eager_one():
    """A greedy round's acceptance compiled (what eval's rounds run) gives what it gives eagerly, ties between the
    verifier's logits included (the lowest token wins), for every accepted count from 0 to K, in fewer kernels
    than its eager operations."""
    from inductor_code import kernels, output_code

    from eyas.engine.speculative import greedy_outcome

    g = torch.Generator().manual_seed(0)
    compiled = torch.compile(greedy_outcome, dynamic=False)
    seen = set()
    for trial in range(24):
        logits = torch.randint(0, 4, (K + 1, 50), generator=g).float()  # many ties
        proposal = logits[:K].argmax(-1)
        a = trial % (K + 1)
        if a < K:  # reject draft a: another token than the verifier's first top one
            proposal[a] = (proposal[a] + 1) % 50
        want = greedy_outcome(logits, proposal)
        if trial == 0:
            got, codes = output_code(lambda: compiled(logits, proposal))
            # eagerly: argmax, slice, eq, cast, cumprod, sum, gather, cat, cat, index_copy
            assert 1 <= sum(len(kernels(c)) for c in codes) <= 3, codes
        else:
            got = compiled(logits, proposal)
        for x, y in zip(got, want, strict=True):
            assert torch.equal(x, y)
        seen.add(int(want[0]))
    assert seen == set(range(K + 1))


def test_a_draft_that_fails_to_compile_decodes_eagerly(setups, capsys):
    """A compiler error (on some machine) costs speed, not the run: one note, then the eager forward."""
    _, info, model, eos, prompts, drafts = setups("llama")
    draft = drafts["fitted"]
    spec = _verifier(model, draft.config.aux_layer_ids)
    broken = DraftRunner(copy.deepcopy(draft), compile=True)  # a copy: compiling merges its projections in place

    def fail(*args):
        raise RuntimeError("inductor: no C++ compiler found\nmore detail")

    broken.compiled_forward.compiled = broken.outcome.compiled = fail
    want = speculative_generate(spec, DraftRunner(draft), prompts[0], max_new_tokens=16, draft_tokens=K, eos_ids=eos)
    got = speculative_generate(spec, broken, prompts[0], max_new_tokens=16, draft_tokens=K, eos_ids=eos)
    assert (got.tokens, got.accepted) == (want.tokens, want.accepted)
    assert broken.compiled_forward.compiled is None and broken.outcome.compiled is None
    err = capsys.readouterr().err
    for what in ("the draft's forward", "a round's acceptance"):
        assert err.count(f"{what} without torch.compile (RuntimeError: inductor: no C++ compiler found)") == 1
