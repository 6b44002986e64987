"""eyas' MLP-block kernels for decoding (eyas.verifier.decode_mlp) against the eager layer, through Triton's
interpreter on CPU: the kernels alone, which modules they take, and a decoding step compiled with them."""

from __future__ import annotations

import pytest
import torch
from inductor_code import kernels as kernel_names
from inductor_code import output_code
from triton_interpreter import in_child

import eyas.verifier.compile as compile_
from eyas.engine.slots import Slots, layer_shapes, slot_attention
from eyas.verifier.decode_mlp import MAX_ROWS, decode_mlp, fits
from eyas.verifier.load import build_text_model, resolve
from eyas.verifier.merged import merge_projections


def _second_half(layer, residual, attn):
    """The eager layer's second half: what the kernels replace."""
    s = residual + attn
    return s + layer.mlp(layer.post_attention_layernorm(s))


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
def test_the_kernels_equal_the_eager_mlp_block(make_tiny, monkeypatch, request, dtype):
    """The residual add, the norm, gate/up, SiLU, down and the closing add in two kernels give the eager layer's
    output for 1, 3 and 4 rows (sums of products) and 16 (``tl.dot`` tiles), over plain and merged projections:
    in fp16 bit for bit (every rounding eager makes is made; the interpreter's matmul sums in eager's order at
    these sizes), in fp32 to rounding."""
    if in_child(request, monkeypatch):
        return
    for name in ("llama", "qwen3"):
        model = build_text_model(resolve(make_tiny(name).path), dtype=dtype)
        H = model.config.hidden_size
        for merged in (False, True):
            if merged:
                assert merge_projections(model) > 0
            layer = model.base_model.layers[-1]
            for rows in (1, 3, 4, MAX_ROWS):
                g = torch.Generator().manual_seed(rows)
                residual, attn = (torch.randn(1, rows, H, generator=g).to(dtype) for _ in range(2))
                assert fits(layer.post_attention_layernorm, layer.mlp, residual)
                with torch.no_grad():
                    want = _second_half(layer, residual, attn)
                    got = decode_mlp(layer.post_attention_layernorm, layer.mlp, residual, attn)
                assert got.shape == want.shape and got.dtype == dtype
                if dtype == torch.float16:
                    assert torch.equal(got, want), (name, merged, rows, (got - want).abs().max())
                else:
                    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-6)


def test_the_kernels_take_only_the_pattern_they_restate(make_tiny, monkeypatch, request):
    """Llama's and Qwen3's norm and MLP fit; Gemma's norm (a weight of 1 + w) does not, nor an MLP with another
    activation, more rows than the kernels take, a Linear with a bias, or a tensor off CUDA without the
    interpreter."""
    if in_child(request, monkeypatch):
        return
    model = build_text_model(resolve(make_tiny("llama").path))
    layer = model.base_model.layers[0]
    norm, mlp = layer.post_attention_layernorm, layer.mlp
    x = torch.zeros(1, 4, model.config.hidden_size)
    assert fits(norm, mlp, x)
    assert not fits(norm, mlp, torch.zeros(1, MAX_ROWS + 1, x.shape[-1]))
    gemma = build_text_model(resolve(make_tiny("gemma").path)).base_model.layers[0]
    assert not fits(gemma.post_attention_layernorm, mlp, x)
    silu, mlp.act_fn = mlp.act_fn, torch.nn.GELU()
    assert not fits(norm, mlp, x)
    mlp.act_fn = silu
    mlp.down_proj.bias = torch.nn.Parameter(torch.zeros(mlp.down_proj.out_features))
    assert not fits(norm, mlp, x)
    mlp.down_proj.bias = None
    assert fits(norm, mlp, x)
    monkeypatch.delenv("TRITON_INTERPRET")
    assert not fits(norm, mlp, x)  # a CPU tensor, no interpreter


def test_a_decoding_step_compiled_with_the_kernels_equals_one_without(make_tiny, monkeypatch, request):
    """A decoding step at fixed shapes (FlexAttention traced in, the norm handed ahead) with the kernels gives the
    step's logits without them (fp32), for one token and a verification's four; in inductor's output code every
    layer calls both kernels, and its own kernels for the MLP block are gone (the layer's code has fewer). With
    ``DECODE_MLP_ROWS`` 1 (eyas' default) the one-token step runs them and the verification does not."""
    if in_child(request, monkeypatch):
        return
    model = build_text_model(resolve(make_tiny("llama").path))
    merge_projections(model)
    slots = Slots(slots=1, capacity=200, layers=layer_shapes(model), dtype=torch.float32,
                  device=torch.device("cpu"), attention="flex")  # fmt: skip

    def step(T):
        slots.start, slots.keys = torch.tensor([5]), slots.key_length(5 + T, T)
        slots.begin(T, 1)
        ids, pos = torch.arange(7, 7 + T)[None], torch.arange(5, 5 + T)[None]
        return model(input_ids=ids, position_ids=pos, use_cache=False).logits

    for T in (1, 4):
        logits, kernels = {}, {}
        for rows in (0, 1, MAX_ROWS):
            monkeypatch.setattr(compile_, "DECODE_MLP_ROWS", rows)
            with slot_attention(model, slots), torch.no_grad(), compile_.compiled_layers(model):
                logits[rows], codes = output_code(lambda: step(T))
            layer_codes = [c for c in codes if "flex_attention" in c]
            (kernels[rows],) = {len(kernel_names(c)) for c in layer_codes}
            for op in ("decode_gate_up", "decode_down"):  # once in each layer's code, or nowhere
                assert {c.count(f"torch.ops.eyas.{op}.default(") for c in layer_codes} == {int(T <= rows)}, op
        torch.testing.assert_close(logits[MAX_ROWS], logits[0], rtol=1e-5, atol=1e-5)
        assert kernels[MAX_ROWS] < kernels[0], kernels
        assert kernels[1] == (kernels[MAX_ROWS] if T == 1 else kernels[0]), kernels
    assert len(model.base_model.__dict__["_eyas_norm_ahead"]) == 3  # the norm handed ahead, per row setting
