"""The generation engine: continuous batching over slots equals transformers' own greedy ``generate`` token for
token (fp32), for every verifier layout; memory is fixed by the budget, not by the prompts; seeded sampling
follows the verifier's distribution and does not depend on which requests share a batch."""

from __future__ import annotations

import contextlib
import copy
import json
import random
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from eyas.engine.generate import BatchDecoder, Request, RequestQueue, decode_all, pick_tokens
from eyas.engine.slots import key_bucket
from eyas.verifier.load import build_text_model, resolve

pytestmark = pytest.mark.usefixtures("one_thread")

EOS = {2}  # the tiny tokenizer's <|im_end|>


def _hf_greedy(model, ids: list[int], new: int, eos: set[int]) -> list[int]:
    """transformers' own greedy ``generate`` of one prompt (the independent reference), new tokens only."""
    x = torch.tensor([ids])
    out = model.generate(x, attention_mask=torch.ones_like(x), do_sample=False, max_new_tokens=new,
                         eos_token_id=sorted(eos), pad_token_id=0)  # fmt: skip
    return out[0, len(ids) :].tolist()


def _prompts(n: int, *, seed: int = 0, longest: int = 60) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(3, 500) for _ in range(rng.randrange(1, longest))] for _ in range(n)]


@pytest.mark.parametrize("name", ["llama", "qwen3", "mistral", "gemma", "deepseek_v3", "kimi_like"])
def test_continuous_batching_equals_greedy_generate(make_tiny, name):
    """13 prompts through 4 slots of 96 positions: prompts packed into shared prefills, slots refilled as
    answers end (at an end-of-turn id, at max_new_tokens, or at the slot's capacity), the host reading tokens
    every 3 steps. Every answer equals transformers' generate of that prompt alone."""
    t = make_tiny(name)
    model = build_text_model(resolve(t.path))
    prompts = _prompts(13) + [[5] * 90]  # the last one fills its slot: cut at the capacity, 6 tokens in
    reference = t.reference()
    eos = EOS | {_hf_greedy(reference, prompts[0], 6, set())[4]}  # a token answers use: some end early, some not
    reqs = [Request(key=i, tokens=p, max_new_tokens=20) for i, p in enumerate(prompts)]
    got = decode_all(model, reqs, eos_ids=eos, max_len=96, batch_tokens=96 * 4, sync_every=3, prefill_tokens=100)
    for p, c in zip(prompts, got):
        want = _hf_greedy(reference, p, min(20, 96 - len(p)), eos)
        assert c.tokens == want, f"{name}: prompt of {len(p)} tokens"
        assert c.finished == (want[-1] in eos) and not c.too_long
    assert any(c.finished for c in got) and not all(c.finished for c in got)


def test_sliding_window_verifier(make_tiny):
    """A Mistral with an 8-token window: keys past the window are masked in prefill and in every step."""
    from transformers import MistralConfig, MistralForCausalLM

    torch.manual_seed(0)
    cfg = MistralConfig(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=3, num_attention_heads=4,
                        num_key_value_heads=2, head_dim=8, sliding_window=8, max_position_embeddings=256)  # fmt: skip
    model = MistralForCausalLM(cfg).eval()
    prompts = [[1, 5, 9, 3], [7, 2, 2, 40, 11, 3, 9, 9, 12, 14, 15, 16, 17], [4] * 30]
    got = decode_all(model, [Request(key=i, tokens=p, max_new_tokens=24) for i, p in enumerate(prompts)], eos_ids={0},
                     max_len=64, batch_tokens=128)  # fmt: skip
    for p, c in zip(prompts, got):
        x = torch.tensor([p])
        want = model.generate(x, attention_mask=torch.ones_like(x), do_sample=False, max_new_tokens=24, eos_token_id=0,
                              pad_token_id=0)[0, len(p) :].tolist()  # fmt: skip
        assert c.tokens == want


def test_a_prompt_that_does_not_fit_is_answered_as_too_long(make_tiny):
    model = build_text_model(resolve(make_tiny("llama").path))
    reqs = [Request(key="short", tokens=[5, 6, 7], max_new_tokens=4), Request(key="long", tokens=[5] * 64,
            max_new_tokens=4)]  # fmt: skip
    short, long = decode_all(model, reqs, eos_ids=EOS, max_len=64, batch_tokens=128)
    assert long.too_long and long.tokens == [] and not short.too_long and len(short.tokens) >= 1


def test_rows_are_capped_whatever_the_budget(make_tiny, monkeypatch):
    """Short sequences in a large budget make no more rows than MAX_ROWS (a step's sampling holds a few
    [rows, vocab] float32 copies), and the answers are what greedy decoding gives with fewer rows."""
    import eyas.engine.generate as generate

    model = build_text_model(resolve(make_tiny("llama").path))
    monkeypatch.setattr(generate, "MAX_ROWS", 3)
    dec = BatchDecoder(model, eos_ids=set(), max_len=16, batch_tokens=16 * 1000, cuda_graphs=False)
    assert dec.num_slots == 3 and dec.slots.k[0].shape[0] == 3
    reqs = [Request(key=i, tokens=[5 + i, 7, 9], max_new_tokens=6) for i in range(7)]
    capped = decode_all(model, reqs, eos_ids=set(), max_len=16, batch_tokens=16 * 1000, cuda_graphs=False)
    monkeypatch.setattr(generate, "MAX_ROWS", 4096)
    wide = decode_all(model, reqs, eos_ids=set(), max_len=16, batch_tokens=16 * 1000, cuda_graphs=False)
    assert [c.tokens for c in capped] == [c.tokens for c in wide] and all(len(c.tokens) == 6 for c in capped)


def test_short_prompts_fill_the_free_slots_in_one_prefill(make_tiny):
    """Short sequences (eyas prompts' user-turn prefixes): by default a prefill packs at least 32,768 tokens, so
    64 prompts of 20 tokens entering 64 free slots are one forward (with four sequences' worth, 160 tokens, they
    were eight), and the answers are what prefills of 8 prompts each give."""
    model = build_text_model(resolve(make_tiny("llama").path))
    reqs = [Request(key=i, tokens=[5 + i] + [7] * 19, max_new_tokens=4) for i in range(64)]
    kw = dict(eos_ids=set(), max_len=40, batch_tokens=40 * 64, cuda_graphs=False)
    one = BatchDecoder(model, **kw)
    assert one.prefill_tokens == 32768
    packed = {c.key: c.tokens for c in one.run(RequestQueue(reqs))}
    assert one.report()["prefills"] == 1
    eight = BatchDecoder(model, prefill_tokens=4 * 40, **kw)
    apart = {c.key: c.tokens for c in eight.run(RequestQueue(reqs))}
    assert eight.report()["prefills"] == 8 and packed == apart and all(len(t) == 4 for t in packed.values())


def test_requests_pushed_while_running_are_answered():
    """A caller pushes a follow-up request after each completion (a conversation's next turn); the loop
    answers them too and stops only when nothing is waiting or decoding."""
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    cfg = LlamaConfig(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
                      num_key_value_heads=2, max_position_embeddings=256)  # fmt: skip
    model = LlamaForCausalLM(cfg).eval()
    dec = BatchDecoder(model, eos_ids={0}, max_len=64, batch_tokens=128)
    q = RequestQueue([Request(key=(i, 0), tokens=[i + 3, 4], max_new_tokens=5) for i in range(5)])
    seen = []
    for c in dec.run(q):
        seen.append(c.key)
        i, turn = c.key
        if turn < 2:
            q.push(Request(key=(i, turn + 1), tokens=[i + 3, 4] + c.tokens + [9], max_new_tokens=5))
    assert sorted(seen) == [(i, t) for i in range(5) for t in range(3)]


def test_refills_wait_for_refill_slots_and_answer_the_same(make_tiny):
    """A refill starts once ``refill_slots`` slots are free (default an eighth of them), or at once when the
    queue is shorter than the free slots or every slot is free: waiting for more free slots makes fewer, larger
    prefills, and the answers do not depend on it (each prompt decodes from its own slot alone)."""
    model = build_text_model(resolve(make_tiny("llama").path))
    reqs = [Request(key=i, tokens=p, max_new_tokens=3 + i % 7) for i, p in enumerate(_prompts(40, seed=5, longest=30))]
    kw = dict(eos_ids=set(), max_len=48, batch_tokens=48 * 16, sync_every=2, cuda_graphs=False)
    assert BatchDecoder(model, **kw).refill_slots == 2  # 16 slots
    answers, prefills = {}, {}
    for n in (1, 8):
        dec = BatchDecoder(model, refill_slots=n, **kw)
        answers[n] = {c.key: c.tokens for c in dec.run(RequestQueue(reqs))}
        prefills[n] = dec.report()["prefills"]
    assert answers[1] == answers[8] and len(answers[1]) == 40
    assert prefills[8] < prefills[1], prefills


def test_key_buckets():
    assert key_bucket(1, 4096) == 64 and key_bucket(65, 4096) == 128 and key_bucket(1000, 4096) == 1024
    assert key_bucket(5000, 4096) == 4096 and key_bucket(40000, 65536) == 49152


def test_flex_attends_the_whole_buffer_at_every_position(make_tiny):
    """The key length a forward is recorded for: through FlexAttention the whole (block-rounded) buffer at any
    position, so one graph serves a whole answer; through SDPA, and for a forward too long for FlexAttention's
    query block, the bucket covering the positions."""
    from eyas.engine.slots import FLEX_MAX_NEW, Slots, layer_shapes

    model = build_text_model(resolve(make_tiny("llama").path))
    kw = dict(slots=1, capacity=300, layers=layer_shapes(model), dtype=torch.float32, device=torch.device("cpu"))
    flex, sdpa = Slots(attention="flex", **kw), Slots(attention="sdpa", **kw)
    assert flex.k[0].shape[2] == 384  # 300 rounded up to FlexAttention's 128-key blocks
    assert {flex.key_length(n, t) for n in (1, 65, 200, 300) for t in (1, 4)} == {384}
    assert flex.key_length(100, FLEX_MAX_NEW + 1) == 128  # a prompt: SDPA over its bucket
    assert [sdpa.key_length(n) for n in (1, 65, 200, 300)] == [64, 128, 256, 300]


def test_sampling_follows_the_distribution_and_ignores_the_batch():
    """The inverse CDF at counter-based uniforms: over 4000 seeds the samples of softmax(l / T) pass a chi-square test,
    and a row's token depends only on its seed, position and logits, not on the rows beside it."""
    torch.manual_seed(0)
    logits = torch.randn(12) * 2
    T = 0.7
    n = 4000
    seeds = torch.arange(n)
    toks = pick_tokens(logits.expand(n, -1), temperature=T, seed=seeds, position=torch.full((n,), 11))
    counts = torch.bincount(toks, minlength=12).double()
    p = torch.softmax(logits.double() / T, -1)
    keep = p * n >= 5
    stat = float((((counts - p * n) ** 2) / (p * n))[keep].sum())
    df = int(keep.sum()) - 1
    assert float(torch.special.gammaincc(torch.tensor(df / 2.0), torch.tensor(stat / 2))) > 1e-3
    alone = pick_tokens(logits[None], temperature=T, seed=seeds[17:18], position=torch.tensor([11]))
    assert int(alone) == int(toks[17])
    moved = pick_tokens(logits.expand(3, -1), temperature=T, seed=torch.tensor([17, 17, 18]),
                        position=torch.tensor([11, 12, 11]))  # fmt: skip
    assert int(moved[0]) == int(toks[17]) and int(moved[2]) == int(toks[18])


def test_top_p_samples_only_the_nucleus_in_proportion():
    """Nucleus sampling: only the smallest set of most likely tokens whose probability reaches top_p is ever
    drawn (the token that crosses it included), in proportion to their probabilities; top_p 1 is plain sampling."""
    logits = torch.log(torch.tensor([0.05, 0.5, 0.02, 0.3, 0.13]))
    n = 4000
    seeds, pos = torch.arange(n), torch.full((n,), 3)
    toks = pick_tokens(logits.expand(n, -1), temperature=1.0, seed=seeds, position=pos, top_p=0.75)
    counts = torch.bincount(toks, minlength=5)
    assert set(toks.tolist()) == {1, 3}  # 0.5, then 0.3 crosses 0.75; 0.13 and below never
    assert abs(counts[1] / n - 0.5 / 0.8) < 0.03
    plain = pick_tokens(logits.expand(n, -1), temperature=1.0, seed=seeds, position=pos)
    assert torch.equal(plain, pick_tokens(logits.expand(n, -1), temperature=1.0, seed=seeds, position=pos, top_p=1.0))
    assert len(set(plain.tolist())) == 5


_PEAK = r"""
import json, sys, torch
sys.path.insert(0, {tests!r})
import tiny
from pathlib import Path
from eyas.engine.generate import BatchDecoder, Request, RequestQueue
from eyas.verifier.load import build_text_model, resolve
torch.set_num_threads(1)
model = build_text_model(resolve({path!r}))
lengths = {lengths!r}
reqs = [Request(key=i, tokens=[5 + i % 400] * n, max_new_tokens=8) for i, n in enumerate(lengths)]

def vm(key):
    return int(next(l for l in open("/proc/self/status") if l.startswith(key)).split()[1]) * 1024

open("/proc/self/clear_refs", "w").write("5")  # reset the peak: it now counts the decoder and decoding only
base = vm("VmRSS:")
dec = BatchDecoder(model, eos_ids=set(), max_len={max_len}, batch_tokens={budget}, prefill_tokens={prefill})
done = [c.too_long for c in dec.run(RequestQueue(reqs))]
print(json.dumps({{"growth": vm("VmHWM:") - base, "kv": dec.kv_bytes, "too_long": sum(done)}}))
"""


def _peak(t, lengths: list[int], *, max_len: int, budget: int, prefill: int) -> dict:
    code = _PEAK.format(tests=str(Path(__file__).parents[1]), path=str(t.path), lengths=lengths, max_len=max_len,
                        budget=budget, prefill=prefill)  # fmt: skip
    src = str(Path(__file__).parents[2] / "src")
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300,
                       env={"PYTHONPATH": src, "OMP_NUM_THREADS": "1", "HF_HUB_OFFLINE": "1",
                            "PATH": "/usr/bin:/bin"})  # fmt: skip
    assert r.returncode == 0, r.stderr[-3000:]
    return json.loads(r.stdout.strip().splitlines()[-1])


@pytest.mark.skipif(not Path("/proc/self/clear_refs").exists(), reason="peak memory is read from Linux's /proc")
def test_memory_follows_the_budget_not_the_prompts(make_tiny):
    """Peak memory while decoding (Linux's high-water mark, reset after the model loads) with one budget: 24
    short prompts, then 24 prompts filling their slots plus three of 100,000 tokens. The long ones cost no more
    than the settings allow (the key/value buffers, fixed at the start, plus a prefill of at most
    ``prefill_tokens``), and the prompts past the slots are refused, not decoded."""
    t = make_tiny("llama")
    kw = dict(max_len=1024, budget=16 * 1024, prefill=2048)
    short = _peak(t, [8] * 24, **kw)
    long = _peak(t, [1000] * 24 + [100_000] * 3, **kw)
    assert long["too_long"] == 3 and short["too_long"] == 0
    assert (
        long["kv"] == short["kv"] == 16 * 1024 * 8 * 2 * 2 * 16 * 4
    )  # slots x positions x layers x k,v x kvh x d x fp32
    # a prefill's own working set: 2048 tokens of hidden states, MLP and scores of at most 2 prompts of 1024
    prefill_bound = 2048 * (64 + 128 + 4 * 1024) * 4 * 4
    assert long["growth"] <= long["kv"] + prefill_bound + (48 << 20), long
    assert short["growth"] >= short["kv"]  # the buffers are real memory, allocated whatever the prompts


def test_compiled_layers_equal_eager(make_tiny):
    """Regional compilation (what the engine records into its CUDA graphs on a GPU): the decoder layers
    compiled, the slot attention a graph break, hidden-state capture hooks outside: the same logits and the
    same captured states as eager layers, for a decoding step of 3 rows at different positions."""
    from eyas.verifier.compile import compiled_layers
    from eyas.engine.slots import Slots, layer_shapes, slot_attention
    from eyas.verifier.load import HiddenStateCapture

    t = make_tiny("qwen3")
    model = build_text_model(resolve(t.path))
    slots = Slots(slots=3, capacity=64, layers=layer_shapes(model), dtype=torch.float32, device=torch.device("cpu"))
    ids = torch.tensor([[5], [9], [11]])
    slots.start = torch.tensor([0, 3, 7])
    slots.keys = 64
    outs = []
    for compiled in (False, True):
        with slot_attention(model, slots), HiddenStateCapture(model, [1, 4]) as cap, torch.no_grad():
            ctx = compiled_layers(model) if compiled else torch.enable_grad()  # (a no-op context under no_grad)
            with ctx, torch.no_grad():
                slots.begin()
                logits = model(input_ids=ids, position_ids=slots.start[:, None], use_cache=False).logits
            outs.append((logits, cap.aux()))
    torch.testing.assert_close(outs[1][0], outs[0][0], rtol=1e-4, atol=1e-5)
    torch.testing.assert_close(outs[1][1], outs[0][1], rtol=1e-4, atol=1e-5)
    assert "forward" not in model.base_model.layers[0].__dict__  # the eager forward is back after the block


@pytest.mark.parametrize("name", ["llama", "qwen3", "mistral", "gemma", "deepseek_v3", "gemma2", "cohere"])
def test_prenorm_layers_are_found_by_their_source(make_tiny, name):
    """The layers whose forward is the pre-norm pattern, statement for statement, run their closing add with the
    next layer's norm (eyas.verifier.norm_ahead); Gemma-2's extra norms and Cohere's parallel block are other
    kinds of layer and keep their own forward."""
    from eyas.verifier.norm_ahead import prenorm_signature

    model = build_text_model(resolve(make_tiny(name).path))
    sig = prenorm_signature(type(model.base_model.layers[0]))
    assert (sig is not None) == (name not in ("gemma2", "cohere")), name
    if sig is not None:
        assert next(iter(sig.parameters)) == "hidden_states"


def test_norm_ahead_hands_each_norm_to_the_next_layer(make_tiny):
    """Compiled at fixed shapes, each layer computes the next layer's input norm (the final norm after the
    last): a forward reads every norm but the first from the layer before and gives eager's logits and captured
    states; a hook that hands a layer a new tensor gets that tensor's own norm (a different result, as eagerly)."""
    from eyas.engine.slots import Slots, layer_shapes, slot_attention
    from eyas.verifier.compile import compiled_layers
    from eyas.verifier.load import HiddenStateCapture

    model = build_text_model(resolve(make_tiny("llama").path))
    layers = model.base_model.layers
    slots = Slots(slots=1, capacity=32, layers=layer_shapes(model), dtype=torch.float32, device=torch.device("cpu"))
    slots.start, slots.keys = torch.tensor([0]), 32
    ids, pos = torch.tensor([[5, 9, 11]]), torch.tensor([[0, 1, 2]])

    def forward(compiled: bool):
        with slot_attention(model, slots), HiddenStateCapture(model, [1, 2]) as cap, torch.no_grad():
            with compiled_layers(model) if compiled else contextlib.nullcontext():
                slots.begin()
                return model(input_ids=ids, position_ids=pos, use_cache=False).logits, cap.aux()

    want = forward(False)
    got = forward(True)
    (ahead,) = model.base_model.__dict__["_eyas_norm_ahead"].values()
    assert ahead.handed == len(layers)  # every layer's input norm but the first, and the final norm
    for a, b in zip(got, want):
        torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-5)
    assert all("forward" not in m.__dict__ for m in (*layers, model.base_model.norm))  # eager again

    hook = layers[1].register_forward_pre_hook(lambda m, args: (args[0] * 2, *args[1:]))
    try:
        want2, got2 = forward(False), forward(True)
    finally:
        hook.remove()
    assert ahead.handed == 2 * len(layers) - 1  # layer 1's input was not layer 0's output
    assert not torch.allclose(want2[0], want[0])
    for a, b in zip(got2, want2):
        torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-5)


def test_norm_ahead_fuses_the_closing_add_with_the_next_norm(make_tiny, monkeypatch):
    """In inductor's output code for a decoding step (fixed shapes, FlexAttention traced in), a layer compiled
    with the norm handed ahead has one kernel fewer than the layer compiled alone: its closing residual add and
    the next norm are one kernel (an add and a mean in one), and the final norm is not compiled on its own."""
    from inductor_code import kernels as kernel_names
    from inductor_code import output_code

    import eyas.verifier.compile as compile_
    from eyas.engine.slots import Slots, layer_shapes, slot_attention

    model = build_text_model(resolve(make_tiny("llama").path))
    slots = Slots(slots=1, capacity=200, layers=layer_shapes(model), dtype=torch.float32,
                  device=torch.device("cpu"), attention="flex")  # fmt: skip

    def step():
        slots.start, slots.keys = torch.tensor([5]), slots.key_length(6, 1)
        slots.begin(1, 1)
        return model(input_ids=torch.tensor([[7]]), position_ids=torch.tensor([[5]]), use_cache=False).logits

    kernels, logits = {}, {}
    for ahead in (False, True):
        monkeypatch.setattr(compile_, "NORM_AHEAD", ahead)
        with slot_attention(model, slots), torch.no_grad(), compile_.compiled_layers(model):
            logits[ahead], codes = output_code(step)
        layer_codes = [c for c in codes if "flex_attention" in c]
        kernels[ahead] = {tuple(kernel_names(c)) for c in layer_codes}
        kernels[ahead, "all"] = [len(kernel_names(c)) for c in codes]
    torch.testing.assert_close(logits[True], logits[False], rtol=1e-4, atol=1e-5)
    (alone,), (ahead,) = kernels[False], kernels[True]  # one compiled version of the layers each
    assert len(ahead) == len(alone) - 1, (alone, ahead)
    assert "add" in ahead[-1] and "mean" in ahead[-1] and "mean" not in alone[-1], (alone, ahead)
    # apart from the layers: the rotary table, and the final norm (alone) or the first layer's norm (ahead)
    assert sum(kernels[True, "all"]) < sum(kernels[False, "all"]), kernels


def test_compiled_layers_keep_an_instance_forward(make_tiny):
    """A forward set on a layer instance (accelerate's device-map hooks put theirs there) runs compiled inside
    ``compiled_layers`` (the hook still called) and is the layer's forward again after the block."""
    from accelerate.hooks import ModelHook, add_hook_to_module

    from eyas.verifier.compile import compiled_layers
    from eyas.engine.slots import Slots, layer_shapes, slot_attention

    class Count(ModelHook):
        calls = 0

        def pre_forward(self, module, *args, **kwargs):
            Count.calls += 1
            return args, kwargs

    model = build_text_model(resolve(make_tiny("llama").path))
    slots = Slots(slots=1, capacity=32, layers=layer_shapes(model), dtype=torch.float32, device=torch.device("cpu"))
    layer = model.base_model.layers[1]
    add_hook_to_module(layer, Count())
    hooked = layer.__dict__["forward"]
    slots.keys = 32
    with slot_attention(model, slots), torch.no_grad(), compiled_layers(model):
        slots.begin(1)
        model(input_ids=torch.tensor([[5]]), position_ids=torch.tensor([[0]]), use_cache=False)
    assert Count.calls == 1 and layer.__dict__["forward"] is hooked
    assert "forward" not in model.base_model.layers[0].__dict__


def test_frozen_layers_fuse_qkv_and_gate_up(make_tiny):
    """``compiled_layers(freeze=True)``: the decoder layers compiled with their weights as constants (inductor's
    freezing) give eager's logits (fp32) through the slot attention, and inductor's output code holds 4 matmuls a
    layer (q/k/v one, o, gate/up one, down), one compiled version per layer, where unfrozen it holds Llama's 7 in
    one version shared by the layers."""
    from inductor_code import matmuls, output_code

    from eyas.verifier.compile import compiled_layers
    from eyas.engine.slots import Slots, layer_shapes, slot_attention

    t = make_tiny("llama")
    config = copy.deepcopy(t.config)
    config.num_hidden_layers = 2  # two layers (the tiny Llama's first two): a frozen compile each
    model = t.model_cls(config).eval()
    assert not model.load_state_dict(t.state_dict, strict=False).missing_keys
    slots = Slots(slots=1, capacity=32, layers=layer_shapes(model), dtype=torch.float32, device=torch.device("cpu"))
    slots.start, slots.keys = torch.tensor([4]), 32
    ids, pos = torch.tensor([[5, 9, 11]]), torch.tensor([[4, 5, 6]])  # a verification of 3 tokens at 4..6

    def forward():
        slots.begin()
        return model(input_ids=ids, position_ids=pos, use_cache=False).logits

    counts = {}
    with slot_attention(model, slots), torch.no_grad():
        want = forward()
        for freeze in (False, True):
            with compiled_layers(model, freeze=freeze):
                got, codes = output_code(forward)
            torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-6)
            counts[freeze] = matmuls(codes)
    assert counts == {False: 7, True: 4 * 2}, counts


def _compiled_like_eager(model, slots, run, *, seed: int, **compile_kw) -> list[str]:
    """``run()`` (forwards through ``slots``, their logits returned) eagerly and then in layers compiled with
    ``compile_kw``, each from the same random keys and values at the earlier positions: asserts no graph break
    and eager's logits and final caches, and returns inductor's output code of the compiled run."""
    from inductor_code import output_code

    from eyas.verifier.compile import compiled_layers
    from eyas.engine.slots import slot_attention

    g = torch.Generator().manual_seed(seed)
    for buf in slots.k + slots.v:  # earlier positions: whatever a prompt left there
        buf.copy_(torch.randn(buf.shape, generator=g))
    kept = [b.clone() for b in slots.k + slots.v]
    with slot_attention(model, slots), torch.no_grad():
        want = run()
        want_kv = [b.clone() for b in slots.k + slots.v]
        for b, k in zip(slots.k + slots.v, kept):
            b.copy_(k)
        torch._dynamo.utils.counters.clear()
        with compiled_layers(model, **compile_kw):
            got, codes = output_code(run)
    assert not torch._dynamo.utils.counters["graph_break"], dict(torch._dynamo.utils.counters["graph_break"])
    for a, b in zip(got + slots.k + slots.v, want + want_kv):
        torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-5)
    return codes


@pytest.mark.filterwarnings("ignore:flex_attention called without torch.compile:UserWarning")  # the eager reference
@pytest.mark.parametrize(("name", "rows", "freeze"), [("llama", 1, False), ("llama", 3, False), ("llama", 1, True),
                                                      ("gemma2", 3, False)])  # fmt: skip
def test_flex_decoding_traced_into_the_compiled_layers(make_tiny, name, rows, freeze):
    """Decoding and verification through FlexAttention inside the compiled layers: the key/value writes and the
    attention are part of each layer's compiled code (no graph break), the layers share it (a compiled version
    per shape, not per layer: their buffers are inputs), and two steps and a 4-token verification, each reading
    what the one before wrote, give eager's logits and leave eager's keys and values, at one sequence and at 3
    rows at different positions; frozen too (the buffers stay inputs, not constants), and for Gemma-2 (sliding
    and global layers, an attention softcap)."""
    from eyas.engine.slots import Slots, layer_shapes

    t = make_tiny(name)
    model = build_text_model(resolve(t.path))
    if name == "gemma2":
        assert {x.window for x in layer_shapes(model)} == {None, model.config.sliding_window}
        for layer in model.base_model.layers:
            layer.self_attn.attn_logit_softcapping = 0.02
    slots = Slots(slots=rows, capacity=200, layers=layer_shapes(model), dtype=torch.float32,
                  device=torch.device("cpu"), attention="flex")  # fmt: skip
    first = torch.tensor([0, 37, 130][:rows])  # the third row's keys past the first 128-key block

    def forward(T: int, at: torch.Tensor):
        slots.start = at
        slots.keys = slots.key_length(int(at.max()) + T, T)
        slots.begin(T, rows)
        ids = (at[:, None] * 7 + torch.arange(T)) % 500 + 3  # [rows, T]
        return model(input_ids=ids, position_ids=at[:, None] + torch.arange(T), use_cache=False).logits

    def run():
        return [forward(1, first), forward(1, first + 1), forward(4, first + 2)]

    codes = _compiled_like_eager(model, slots, run, seed=0, freeze=freeze)
    traced = [c for c in codes if "flex_attention" in c and "index_" in c]
    assert traced, "no compiled code holds both the cache writes and the attention"
    layers = len(model.base_model.layers)
    # the layers' versions (the others: the rotary table's and the final norm's, compiled on their own): two
    # shapes (one token, four), a version each (two for Gemma-2's two kinds of layer), a few recompiles at most;
    # frozen, a version per layer and shape
    n = len(traced)
    assert n >= (2 * layers if freeze else 2) and (freeze or n < layers), n
    assert len(codes) > n  # the rotary table and the final norm compiled too, each on its own


@pytest.mark.filterwarnings("ignore:flex_attention called without torch.compile:UserWarning")  # the eager reference
def test_flex_decoding_traced_with_symbolic_rows(make_tiny):
    """regenerate's batched steps: the layers compiled with the row count symbolic (``dynamic=None``) and the
    slot attention inside, steps over 4, then 3, then 2 of 4 slots (as the busy rows drain) give eager's logits
    and cache, with no graph break and no compile per row count past the second."""
    from eyas.engine.slots import Slots, layer_shapes

    model = build_text_model(resolve(make_tiny("qwen3").path))
    slots = Slots(slots=4, capacity=160, layers=layer_shapes(model), dtype=torch.float32,
                  device=torch.device("cpu"), attention="flex")  # fmt: skip
    slots.start = torch.tensor([5, 140, 60, 9])
    slots.keys = slots.key_length(160)

    def run():
        first, out = slots.start.clone(), []
        for R in (4, 3, 2):
            slots.begin(1, R)
            ids = (slots.start[:R, None] * 3 + R) % 500 + 3
            out.append(model(input_ids=ids, position_ids=slots.start[:R, None], use_cache=False).logits)
            slots.start[:R] += 1
        slots.start.copy_(first)
        return out

    codes = _compiled_like_eager(model, slots, run, seed=1, dynamic=None)
    layer = [c for c in codes if "flex_attention" in c]
    assert [c for c in layer if "index_put" in c]
    assert len(layer) <= 3, len(layer)  # 4 rows, then symbolic rows (and one more, a transformers guard at most)
    assert len(codes) == len(layer)  # the rotary table and the final norm compiled at fixed shapes only


def test_compiled_greedy_tail_advances_as_eager(make_tiny):
    """Plain decoding's greedy tail as the graphs compile it (``SequenceDecoder._advance_compiled``, what a CUDA
    step records): the argmax, the ring write, the next token and the position advance leave the decoder's state
    as the eager tail does, step after step, across the ring's wrap."""
    from eyas.engine.generate import SequenceDecoder
    from eyas.verifier.compile import compile_work

    model = build_text_model(resolve(make_tiny("llama").path))
    decs = [SequenceDecoder(model, capacity=64, sync_every=3) for _ in range(2)]
    logits = torch.randn(7, 1, 500, generator=torch.Generator().manual_seed(0))
    for d in decs:
        d._at.fill_(5)
    before = compile_work()[0]
    for step in logits:
        decs[0]._advance(step, 0.0)
        decs[1]._advance_compiled(step, 0.0)
        for name in ("_tok", "_at", "_ring"):
            assert torch.equal(getattr(decs[0], name), getattr(decs[1], name)), name
    # positions 5..11 fed: the last three wrote ring slots 9 % 3, 10 % 3, 11 % 3 = 0, 1, 2
    assert decs[1]._at.item() == 12 and decs[1]._ring.tolist() == [int(x.argmax()) for x in logits[-3:]]
    assert decs[1]._tok.item() == int(logits[-1].argmax())
    assert compile_work()[0] > before  # compiled, not run eagerly


def test_plain_decode_blocks_equal_greedy_generate(make_tiny):
    """eval's plain loop: the step advances its own token and position on the device and the host reads tokens
    in blocks of `sync_every`; answers equal transformers' generate, cut at an end of turn inside a block and
    at max_new_tokens that is no multiple of the block."""
    from eyas.engine.generate import SequenceDecoder
    from eyas.engine.speculative import plain_generate

    t = make_tiny("llama")
    model = build_text_model(resolve(t.path))
    dec = SequenceDecoder(model, capacity=128, sync_every=3)
    for p in _prompts(3, seed=4):
        want = _hf_greedy(t.reference(), p, 20, set())
        assert plain_generate(dec, p, max_new_tokens=20, eos_ids=set()).tokens == want
        eos = {want[7]}
        assert plain_generate(dec, p, max_new_tokens=20, eos_ids=eos).tokens == want[: want.index(want[7]) + 1]


# on CPU, FlexAttention runs its unfused reference (what CUDA compiles): the same numbers, torch says so once
@pytest.mark.filterwarnings("ignore:flex_attention called without torch.compile:UserWarning")
@pytest.mark.parametrize("name", ["llama", "mistral", "gemma2"])
def test_flex_attention_equals_sdpa(make_tiny, name):
    """The FlexAttention path (a block table per row, FlexAttention's reference implementation on CPU) decodes
    what the SDPA path decodes, batched and at batch 1 (a 4-token verification forward included); Gemma-2's
    attention softcap (a cap of 0.02 here, so that it bends the tiny model's small scores) as FlexAttention's score_mod
    equals SDPA's written-out one."""
    from eyas.engine.generate import SequenceDecoder

    t = make_tiny(name)
    model = build_text_model(resolve(t.path))
    if name == "gemma2":
        model.config.attn_logit_softcapping = 0.02
        for layer in model.base_model.layers:
            layer.self_attn.attn_logit_softcapping = 0.02
    prompts = _prompts(6, seed=2, longest=150)  # keys past one 128-key block
    reqs = [Request(key=i, tokens=p, max_new_tokens=12) for i, p in enumerate(prompts)]
    kw = dict(eos_ids=EOS, max_len=200, batch_tokens=200 * 3, sync_every=4)
    flex = decode_all(model, reqs, attention="flex", **kw)
    assert [c.tokens for c in flex] == [c.tokens for c in decode_all(model, reqs, **kw)]
    ids = torch.tensor(prompts[0] + flex[0].tokens[:4])
    got = []
    for attention in ("flex", "sdpa"):
        dec = SequenceDecoder(model, capacity=300, attention=attention)
        dec.forward(ids[:-4], 0)  # the prompt: SDPA either way
        got.append(dec.forward(ids[-4:], len(ids) - 4)[0])
    torch.testing.assert_close(got[0], got[1], rtol=1e-4, atol=1e-4)


@pytest.mark.filterwarnings("ignore:flex_attention called without torch.compile:UserWarning")
@pytest.mark.parametrize("attention", ["sdpa", "flex"])
def test_steps_over_the_busy_rows_only_equal_greedy_generate(make_tiny, monkeypatch, attention):
    """With row counts of 1 and 2 recorded, a step runs over the first slots only (as many as the highest busy
    one needs) while the answers of 6 slots drain: every answer still equals transformers' generate of its
    prompt alone, and the steps ran over fewer rows than the slots."""
    from eyas.engine import generate

    monkeypatch.setattr(generate, "ROW_BUCKETS", (1, 2))
    t = make_tiny("llama")
    model = build_text_model(resolve(t.path))
    prompts = sorted(_prompts(9, seed=4, longest=40), key=len, reverse=True)
    # the longest answers have the shortest prompts: admitted first (priority) and packed first (length), into
    # the lowest slots, so the rows above them drain early
    reqs = [Request(key=i, tokens=p, max_new_tokens=4 + 3 * i, priority=i) for i, p in enumerate(prompts)]
    dec = BatchDecoder(model, eos_ids=set(), max_len=80, batch_tokens=80 * 6, sync_every=2, attention=attention)
    got = {c.key: c.tokens for c in dec.run(RequestQueue(reqs))}
    reference = t.reference()
    for r in reqs:
        assert got[r.key] == _hf_greedy(reference, r.tokens, r.max_new_tokens, set()), f"request {r.key}"
    report = dec.report()
    assert report["steps"] * dec.num_slots > dec.stats["row_steps"] >= dec.stats["slot_steps_used"] > 0
    assert report["row_use"] > report["slot_use"]


def test_the_queue_admits_the_longest_chains_first():
    """A request with more turns to come is admitted before shorter prompts with fewer; among equals, the
    shortest prompt first."""
    q = RequestQueue([Request(key="a", tokens=[1] * 5, max_new_tokens=1),
                      Request(key="b", tokens=[1] * 50, max_new_tokens=1, priority=3),
                      Request(key="c", tokens=[1] * 9, max_new_tokens=1, priority=3),
                      Request(key="d", tokens=[1] * 2, max_new_tokens=1, priority=1)])  # fmt: skip
    assert [q.pop().key for _ in range(4)] == ["c", "b", "d", "a"]


@pytest.mark.parametrize("name", ["llama", "gemma"])  # gemma: softcapped, sliding-window attention
def test_compiled_prefills_equal_greedy_generate(make_tiny, name):
    """Prefills with their layers compiled (symbolic shapes, the packed attention eager between the layer's two
    compiled halves): 13 prompts packed into prefills of many lengths answer what transformers' generate answers
    each prompt alone, with one compile for every length (no recompile after the first prefill)."""
    from torch._dynamo.utils import counters

    t = make_tiny(name)
    model = build_text_model(resolve(t.path))
    prompts = _prompts(13, seed=7)
    reqs = [Request(key=i, tokens=p, max_new_tokens=5) for i, p in enumerate(prompts)]
    torch._dynamo.reset()
    dec = BatchDecoder(model, eos_ids=set(), max_len=96, batch_tokens=96 * 4, sync_every=2, prefill_tokens=100,
                       compile_prefill=True)  # fmt: skip
    seen: list[int] = []
    compiles: list[int] = []
    real = dec._prefill_forward

    def counting(ids, pos, ends):
        out = real(ids, pos, ends)
        seen.append(counters["stats"]["unique_graphs"])
        compiles.append(dec.report()["compiles"])
        return out

    dec._prefill_forward = counting
    got = {c.key: c.tokens for c in dec.run(RequestQueue(reqs))}
    assert dec.compile_prefill  # no compiler error sent it back to eager
    reference = t.reference()
    for r in reqs:
        assert got[r.key] == _hf_greedy(reference, r.tokens, 5, set()), f"{name}: request {r.key}"
    assert dec.stats["prefills"] >= 4 and len(set(seen)) == 1 and seen[0] > 0  # compiled once, at the first
    # the report counts the compiles (regenerate's manifest keeps it): the first prefill's, none after
    rep = dec.report()
    assert len(set(compiles)) == 1 and rep["compiles"] == compiles[0] > 0 and rep["compile_seconds"] > 0, compiles
    assert BatchDecoder(model, eos_ids=set(), max_len=96, batch_tokens=96 * 4).report()["compiles"] == 0


@pytest.mark.filterwarnings("ignore:flex_attention called without torch.compile:UserWarning")  # the short prompt
def test_compiled_prompt_forwards_equal_eager(make_tiny):
    """A single sequence's prompt forwards (eval's turns) with the layers compiled with symbolic shapes give eager's
    logits and aux hidden states over prompts of several lengths, compiling once for all of them; a prompt as
    short as FlexAttention's decoding shapes stays eager."""
    from torch._dynamo.utils import counters

    from eyas.engine.generate import SequenceDecoder
    from eyas.engine.slots import FLEX_MAX_NEW

    t = make_tiny("llama")
    model = build_text_model(resolve(t.path))
    eager = SequenceDecoder(model, capacity=256, aux_layer_ids=[0, 1, 2], cuda_graphs=False)
    compiled = SequenceDecoder(model, capacity=256, aux_layer_ids=[0, 1, 2], cuda_graphs=False, attention="flex")
    compiled.compile_prompts = True  # as on CUDA with graphs on
    torch._dynamo.reset()
    seen = []
    for n in (40, 57, 23, 90, FLEX_MAX_NEW):
        ids = torch.tensor(_prompts(1, seed=n, longest=200)[0][:1] * n)
        want, want_aux = eager.forward(ids, 0)
        got, got_aux = compiled.forward(ids, 0)
        torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-5)
        torch.testing.assert_close(got_aux, want_aux, rtol=1e-4, atol=1e-5)
        seen.append(counters["stats"]["unique_graphs"])
    # one compile for the four long ones (the short one compiles FlexAttention's own kernel, eagerly called)
    assert compiled.compile_prompts and seen[0] > 0 and len(set(seen[:4])) == 1, seen
