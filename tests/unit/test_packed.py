"""compressed-tensors int4 verifiers stay packed in memory (eyas.verifier.packed) and compute what the dequantized
verifier computes: the backbone alone (extract, online training), and a forward with a KV cache (decoding)."""

from __future__ import annotations

import json
import re

import pytest
import torch
from safetensors import safe_open

import tiny
from eyas.verifier.packed import PackedExperts, PackedLinear, resident_bytes
from eyas.verifier.load import HiddenStateCapture, build_text_model, forward_hidden_states, resolve

pytestmark = pytest.mark.usefixtures("one_thread")

#: int4 group 32 with a bf16 scale is 0.5 + 2/32 bytes a weight against bf16's 2: 0.28x. Kimi-K2.5's int4
#: release, whose routed experts are 98.8% of its weights, is 0.29x (docs: eyas plan); 0.35x leaves room for
#: the bf16 layers a checkpoint keeps (attention, shared experts, embeddings).
PACKED_RATIO = 0.35


@pytest.fixture(scope="module")
def int4(tmp_path_factory):
    """The int4 fixtures, built once: an all-int4 Llama, the Kimi-like wrapper with int4 routed experts, and a
    Kimi-proportioned one (32 routed experts of width 128: the experts hold most weights, as in Kimi-K2.5)."""
    root = tmp_path_factory.mktemp("int4")
    built = {}

    def get(name: str) -> tiny.Tiny:
        if name not in built:
            build = {"llama_int4": tiny.llama_int4,
                     "kimi_int4": lambda p: tiny.kimi_like(p, int4=True),
                     "kimi_int4_wide": lambda p: tiny.kimi_like(p, int4=True, n_routed_experts=32,
                                                                moe_intermediate_size=128)}[name]  # fmt: skip
            built[name] = build(root / name)
        return built[name]

    return get


def _quantized_modules(t: tiny.Tiny) -> set[str]:
    """The modules whose weight the checkpoint stores packed, named as transformers names them."""
    index = t.path / "model.safetensors.index.json"
    if index.is_file():
        keys = json.loads(index.read_text())["weight_map"]
    else:
        with safe_open(str(t.path / "model.safetensors"), framework="pt") as f:
            keys = list(f.keys())
    return {re.sub(r"^language_model\.", "", k).removesuffix(".weight_packed") for k in keys
            if k.endswith(".weight_packed")}  # fmt: skip


@pytest.mark.parametrize("name", ["llama_int4", "kimi_int4"])
def test_every_int4_weight_stays_packed(int4, name):
    """Each module the checkpoint quantizes loads as a PackedLinear holding only its packed ints, scales and
    shape (no dense weight), at most 0.35x its bf16 bytes; the Kimi-like wrapper's fused MoE experts are
    per-expert modules, and a forward leaves everything packed."""
    t = int4(name)
    model = build_text_model(resolve(t.path), dtype=torch.bfloat16)
    packed = {n: m for n, m in model.named_modules() if isinstance(m, PackedLinear)}
    assert set(packed) == _quantized_modules(t) and packed
    for n, m in packed.items():
        assert "weight" not in m._parameters and m.weight_packed.dtype == torch.int32, n
        held = sum(t.numel() * t.element_size() for t in [*m.parameters(), *m.buffers()])  # views of a stack too
        assert held <= PACKED_RATIO * m.in_features * m.out_features * 2, n
    experts = [m for m in model.modules() if isinstance(m, PackedExperts)]
    assert len(experts) == (7 if name == "kimi_int4" else 0)  # layers 1..7 are MoE (first_k_dense_replace=1)
    before = resident_bytes(model)
    with torch.no_grad():
        model(torch.tensor([[5, 6, 7, 8]]))
    assert resident_bytes(model) == before


def test_kimi_proportioned_int4_verifier_is_at_most_035_of_its_bf16_size(int4):
    """What is really resident (every storage once) is at most 0.35x the bf16 size of the same weights; the
    dequantized load, eyas' behaviour before this, is not."""
    t = int4("kimi_int4_wide")
    info = resolve(t.path)
    bf16 = sum(p.numel() * 2 for p in t.reference().parameters())  # the dense weights, independently of eyas
    model = build_text_model(info, dtype=torch.bfloat16)
    assert resident_bytes(model)["cpu"] <= PACKED_RATIO * bf16
    dequantized = build_text_model(info, dtype=torch.bfloat16, packed=False)
    assert resident_bytes(dequantized)["cpu"] > 2 * PACKED_RATIO * bf16


def test_resident_bytes_counts_each_storage_once_and_no_meta_tensor():
    m = torch.nn.Sequential(torch.nn.Linear(8, 4, bias=False), torch.nn.Linear(4, 8, bias=False))
    m[1].weight = torch.nn.Parameter(m[0].weight.data.t())  # a view of the same storage, as tied weights are
    with torch.device("meta"):
        m.append(torch.nn.Linear(100, 100))
    assert resident_bytes(m) == {"cpu": 8 * 4 * 4}


@pytest.mark.parametrize("name", ["llama_int4", "kimi_int4"])
def test_packed_backbone_states_equal_the_dequantized_verifier(int4, name):
    """What online training runs (the backbone only, through forward_hidden_states, padded rows with an
    attention mask) gives the states of a reference built from independently dequantized weights."""
    t = int4(name)
    model, ref = build_text_model(resolve(t.path)), t.reference()
    ids = torch.randint(3, tiny.VOCAB, (2, 19), generator=torch.Generator().manual_seed(0))
    mask = torch.ones_like(ids)
    mask[1, 13:] = 0
    aux, last = forward_hidden_states(model, ids, layer_ids=[2, 4, 5], attention_mask=mask)
    with torch.no_grad(), HiddenStateCapture(ref, [2, 4, 5]) as cap:
        ref(input_ids=ids, attention_mask=mask)
    torch.testing.assert_close(aux, cap.aux(), rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(last, cap.last, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("name", ["llama_int4", "kimi_int4"])
def test_packed_decoding_with_a_kv_cache_equals_the_dequantized_verifier(int4, name):
    """Decoding as eval and regenerate do (eyas's generation engine: a prefill, then one token per forward over
    its key/value slots): the logits and the captured aux states of every step equal the dequantized
    reference's, in fp32 and in bf16."""
    from eyas.engine.generate import SequenceDecoder

    t = int4(name)
    info = resolve(t.path)
    prompt = torch.randint(3, tiny.VOCAB, (11,), generator=torch.Generator().manual_seed(1))
    for dtype, tol in ((torch.float32, 1e-5), (torch.bfloat16, 2e-2)):
        runs = []
        for model in (build_text_model(info, dtype=dtype), build_text_model(info, dtype=dtype, packed=False)):
            dec = SequenceDecoder(model, capacity=64, aux_layer_ids=[2, 4, 5])
            ids, start, steps = prompt, 0, []
            for _ in range(4):
                logits, aux = dec.forward(ids, start)
                steps.append((logits[-1], aux[-1].float()))
                start += ids.shape[0]
                ids = logits[-1].argmax(-1, keepdim=True)
            runs.append(steps)
        for (la, aa), (lb, ab) in zip(*runs):
            torch.testing.assert_close(la, lb, rtol=tol, atol=tol)
            torch.testing.assert_close(aa, ab, rtol=tol, atol=tol)


def test_layers_offloaded_to_host_memory_get_the_asked_dtype(int4):
    """transformers 5.17 loads a wrapped quantized checkpoint in its own dtype; eyas casts the parameters, and
    those of layers a device_map leaves in host memory where accelerate's hooks hold them (here accelerate's
    cpu_offload puts every layer there: the same hooks and weights map)."""
    from accelerate import cpu_offload

    from eyas.verifier.load import cast_floating

    model = int4("llama_int4").reference()  # fp32, as the fixtures are stored
    cpu_offload(model, execution_device="cpu")
    assert all(p.device.type == "meta" for p in model.parameters())
    cast_floating(model, torch.bfloat16)
    held = model.model.embed_tokens._hf_hook.weights_map.dataset  # what host memory holds, for every layer
    assert {t.dtype for t in held.values()} == {torch.bfloat16}
    with torch.no_grad():
        assert model(torch.tensor([[5, 6, 7]])).logits.dtype == torch.bfloat16


def test_experts_in_another_layout_are_refused_with_the_way_out():
    """Fused experts eyas cannot compute per expert (a bias, as GPT-OSS has) are refused by name, before any
    weight loads, instead of silently computing something else."""
    from eyas.core.errors import EyasError
    from eyas.verifier.packed import unfuse_experts

    class BiasedExperts(torch.nn.Module):
        has_bias = True

        def __init__(self) -> None:
            super().__init__()
            self.gate_up_proj = torch.nn.Parameter(torch.zeros(4, 16, 8))
            self.down_proj = torch.nn.Parameter(torch.zeros(4, 8, 8))
            self.act_fn = torch.nn.SiLU()

    model = torch.nn.Module()
    model.mlp = torch.nn.Module()
    model.mlp.experts = BiasedExperts()
    with pytest.raises(EyasError, match=r"mlp\.experts \(BiasedExperts\).*packed=False"):
        unfuse_experts(model)


@pytest.mark.parametrize("tokens,dequant_bytes", [(5, 2 << 30), (5, 1), (40, 2 << 30), (40, 1)],
                         ids=["routed-experts-gathered", "gathered-one-at-a-time", "grouped",
                              "grouped-in-expert-groups"])  # fmt: skip
def test_stacked_experts_compute_what_each_expert_computes(int4, tokens, dequant_bytes, monkeypatch):
    """The stacked experts' grouped forward (fewer rows than experts: the routed experts gathered; more: all
    dequantized and a grouped GEMM; a layer over the dequantization budget: groups of experts) equals the
    per-expert forward (compressed-tensors' own decompression), expert-parallel sentinels included; the
    stacked tensors are the experts' own storage, not a copy."""
    model = build_text_model(resolve(int4("kimi_int4_wide").path), dtype=torch.float32)
    experts = [m for m in model.modules() if isinstance(m, PackedExperts)]
    assert experts and all(m.stacked for m in experts)
    m = experts[0]
    assert m[3].up_proj.weight_packed.untyped_storage().data_ptr() == m.gate_up_packed.untyped_storage().data_ptr()
    g = torch.Generator().manual_seed(2)
    x = torch.randn(tokens, m.hidden, generator=g)
    index = torch.randint(0, m.num_experts, (tokens, 2), generator=g)
    index[1, 0] = m.num_experts  # an expert held by another rank contributes nothing
    weights = torch.rand(tokens, 2, generator=g)
    monkeypatch.setattr(PackedExperts, "dequant_bytes", dequant_bytes)
    with torch.no_grad():
        torch.testing.assert_close(m(x, index, weights), m._per_expert(x, index, weights), rtol=1e-5, atol=1e-5)


def test_int4_dequantization_matches_compressed_tensors(int4):
    """eyas' int4 dequantization (shifts, fused on the GPU) reads compressed-tensors' packing as its own
    decompressor does, for whole stacks of experts at once."""
    from eyas.verifier.packed import dequantize_int4

    model = build_text_model(resolve(int4("kimi_int4_wide").path), dtype=torch.float32)
    m = next(m for m in model.modules() if isinstance(m, PackedExperts))
    dense = dequantize_int4(m.gate_up_packed, m.gate_up_scale, m.group_size, torch.float32)
    for e in (0, 7, m.num_experts - 1):
        want = torch.cat([m[e].gate_proj.dense_weight(torch.float32), m[e].up_proj.dense_weight(torch.float32)])
        torch.testing.assert_close(dense[e], want, rtol=0, atol=0)


def test_int4_dequantization_compiled_form_equals_the_eager_one():
    """The shifts that torch.compile fuses on the GPU read the words as compressed-tensors' unpacking does."""
    from eyas.verifier.packed import _dequantize_int4, _dequantize_int4_eager

    g = torch.Generator().manual_seed(3)
    packed = torch.randint(0, 256, (3, 16, 24 * 4), dtype=torch.uint8, generator=g).view(torch.int32)  # [3,16,24]
    scale = torch.rand(3, 16, 24 * 8 // 32, generator=g, dtype=torch.bfloat16)
    want = _dequantize_int4_eager(packed, scale, 32, torch.float32)
    torch.testing.assert_close(_dequantize_int4(packed, scale, 32, torch.float32), want, rtol=0, atol=0)
    assert want.shape == (3, 16, 192) and want.abs().max() > 0


def test_a_moved_or_cast_model_stacks_its_experts_again(int4):
    """``model.to(...)`` copies each expert's views on its own; the layer stacks them again, so the grouped
    forward reads the moved weights and nothing is held twice."""
    model = build_text_model(resolve(int4("kimi_int4_wide").path), dtype=torch.float32)
    before = resident_bytes(model)["cpu"]
    model.to(torch.float64)
    m = next(m for m in model.modules() if isinstance(m, PackedExperts))
    assert m.stacked and m.gate_up_scale.dtype == torch.float64
    assert m[5].down_proj.weight_scale.untyped_storage().data_ptr() == m.down_scale.untyped_storage().data_ptr()
    assert resident_bytes(model)["cpu"] > before  # the float tensors doubled in width, the int4 words did not
    g = torch.Generator().manual_seed(4)
    x = torch.randn(40, m.hidden, generator=g, dtype=torch.float64)
    index, weights = torch.randint(0, m.num_experts, (40, 2), generator=g), torch.rand(40, 2, generator=g)
    with torch.no_grad():
        torch.testing.assert_close(m(x, index, weights.double()), m._per_expert(x, index, weights.double()))


def test_packed_verifiers_are_never_frozen(int4, make_tiny, monkeypatch):
    """Batch-1 decoding compiles a verifier's layers frozen (weights as constants: q/k/v and gate/up concatenated)
    only where that is cheap and the weights are plain: a dense Llama where its layers' bytes times the shapes
    compiled stay under a tenth of the free memory, not past it; an int4 one never, whatever the memory (its
    matmul is eyas' own, over the packed ints)."""
    from eyas.engine import graphs

    dense = build_text_model(resolve(make_tiny("llama").path)).base_model.layers
    packed = build_text_model(resolve(int4("llama_int4").path)).base_model.layers
    size = sum(t.numel() * t.element_size() for t in [*dense.parameters(), *dense.buffers()])
    monkeypatch.setattr(graphs, "_free_bytes", lambda device: 30 * size + 1)  # 3 shapes of it: a tenth, just
    assert graphs.freeze_fits(dense)
    assert not graphs.freeze_fits(dense, shapes=4)
    monkeypatch.setattr(graphs, "_free_bytes", lambda device: 1 << 50)
    assert not graphs.freeze_fits(packed)
    monkeypatch.setattr(graphs, "_free_bytes", lambda device: None)  # not on CUDA
    assert not graphs.freeze_fits(dense)
