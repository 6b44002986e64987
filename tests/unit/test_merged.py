"""Merged projections (eyas.verifier.merged): a layer's q/k/v and gate/up stored as one weight each; eager
forwards unchanged to the bit, compiled ones one matmul a group (the same-matmul pass), outputs equal."""

from __future__ import annotations

import pytest
import torch
from inductor_code import matmuls, output_code
from torch import nn

from eyas.verifier.compile import COMPILE_OPTIONS
from eyas.verifier.load import build_text_model, resolve
from eyas.verifier.merged import MergedPart, merge_projections, unmerge_projections


def _matmuls(fn, *args) -> tuple[object, int]:
    """``fn(*args)`` compiled with eyas' inductor options -> (its output, the matmul kernels its code calls)."""
    out, codes = output_code(lambda: torch.compile(fn, options=dict(COMPILE_OPTIONS))(*args))
    return out, matmuls(codes)


@pytest.mark.parametrize("name", ["llama", "qwen3", "gemma"])  # GQA; q/k norms between q/k and RoPE; (1 + w) norms
def test_merged_layers_decode_the_same(make_tiny, name):
    t = make_tiny(name)
    model = build_text_model(resolve(t.path)).eval()
    ids = torch.randint(0, model.config.vocab_size, (1, 11), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        before = model(input_ids=ids).logits
        compiled_before, mm_before = _matmuls(model, ids)
    params = sum(p.numel() for p in model.parameters())
    original_keys = list(model.state_dict())
    layers = model.config.num_hidden_layers
    assert merge_projections(model) == 2 * layers
    assert merge_projections(model) == 0  # already merged
    assert sum(p.numel() for p in model.parameters()) == params  # the weights stored once, not copied
    keys = model.state_dict().keys()
    assert not any(k.endswith(("q_proj.weight", "k_proj.weight", "gate_proj.weight")) for k in keys)
    assert sum(k.endswith("merged_qkv_proj.weight") for k in keys) == layers
    attn = model.model.layers[0].self_attn
    assert isinstance(attn.k_proj, MergedPart) and attn.k_proj.weight.shape[0] == attn.k_proj.out_features
    with torch.no_grad():
        after = model(input_ids=ids).logits
        compiled_after, mm_after = _matmuls(model, ids)
    assert torch.equal(after, before)  # eager: each part multiplies by its own rows, as the Linear did
    # compiled: q/k/v one matmul, gate/up another (3 fewer a layer), the same logits
    assert mm_after == mm_before - 3 * layers, (mm_before, mm_after)
    torch.testing.assert_close(compiled_after.logits, compiled_before.logits, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(compiled_after.logits, before, rtol=1e-5, atol=1e-5)
    # undone (for code that compiles the model without eyas' options): plain Linears, the same weights and keys
    assert unmerge_projections(model) == 2 * layers and unmerge_projections(model) == 0
    assert type(attn.k_proj) is nn.Linear and not hasattr(attn, "merged_qkv_proj")
    assert set(model.state_dict()) == set(original_keys)
    assert sum(p.numel() for p in model.parameters()) == params
    with torch.no_grad():
        assert torch.equal(model(input_ids=ids).logits, before)
        assert matmuls(output_code(lambda: torch.compile(model)(ids))[1]) == mm_before


def test_merged_draft_attention_and_mlp(smollm2_path):
    """The draft's own layer (EAGLE-3: q/k/v over [embeddings, hidden]) merges the same way."""
    import sys
    from pathlib import Path

    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
    from drafts import random_draft

    draft = random_draft(smollm2_path, N=64)
    attn, mlp = draft.layers[0].self_attn, draft.layers[0].mlp
    x = torch.randn(1, 5, attn.q_proj.in_features)
    h = torch.randn(1, 5, mlp.gate_proj.in_features)
    pos = torch.arange(5)[None]
    cos, sin = draft.rotary_emb(x, pos)
    with torch.no_grad():
        q, k, v = attn.qkv(x, cos, sin)
        y = mlp(h)
        assert merge_projections(draft) == 2
        assert all(torch.equal(a, b) for a, b in zip(attn.qkv(x, cos, sin), (q, k, v))) and torch.equal(mlp(h), y)
        (q2, k2, v2), mm = _matmuls(attn.qkv, x, cos, sin)
    assert mm == 1
    for a, b in ((q2, q), (k2, k), (v2, v)):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-5)


def test_only_plain_linears_of_one_input_merge():
    """A quantized or hooked Linear (a subclass, or a forward set on the instance as accelerate's hooks do), or
    siblings of other input widths, stay as they are."""

    class Packed(nn.Linear):
        pass

    def block(q=nn.Linear, k_in=8):
        m = nn.Module()
        m.q_proj, m.k_proj, m.v_proj = q(8, 8), nn.Linear(k_in, 4), nn.Linear(8, 4)
        return m

    assert merge_projections(block()) == 1
    assert merge_projections(block(q=Packed)) == 0
    assert merge_projections(block(k_in=6)) == 0
    hooked = block()
    hooked.k_proj.forward = lambda x: x
    assert merge_projections(hooked) == 0
    with_hook = block()
    with_hook.v_proj.register_forward_hook(lambda *a: None)
    assert merge_projections(with_hook) == 0
