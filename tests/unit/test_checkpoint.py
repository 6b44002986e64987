"""The speculators-format checkpoint: round trip, byte-stable re-save, and bad input naming the key."""

from __future__ import annotations

import json

import pytest
import torch
from safetensors.torch import load_file, save_file

import tiny
from eyas.draft.checkpoint import load_draft, read_draft_config, save_draft
from eyas.core.errors import EyasError
from eyas.draft.model import DraftConfig, Eagle3Draft
from eyas.verifier.load import load_head_tensors, resolve


def _draft(verifier, N=128, **over) -> Eagle3Draft:
    info = resolve(verifier)
    cfg = DraftConfig.from_verifier(info.text_config, draft_vocab_size=N, aux_layer_ids=info.aux_layer_ids, **over)
    torch.manual_seed(0)
    m = Eagle3Draft(cfg)
    ids = torch.arange(0, tiny.VOCAB, tiny.VOCAB // N)[:N]
    t2d = torch.zeros(tiny.VOCAB, dtype=torch.bool)
    t2d[ids] = True
    m.set_vocab(d2t=ids - torch.arange(N), t2d=t2d)
    heads = load_head_tensors(info, rows=ids)
    m.init_from_verifier(embed=heads.embed, lm_head_rows=heads.lm_head)
    return m


def _save(m, path, **kw):
    return save_draft(path, m, verifier_name_or_path="org/tiny", verifier_architectures=["LlamaForCausalLM"],
                      ttt_steps=3, **kw)  # fmt: skip


def test_roundtrip_logits_and_stable_resave(make_tiny, tmp_path):
    v = make_tiny("llama").path
    m = _draft(v).to(torch.bfloat16).float()  # what survives a bf16 save...
    with torch.no_grad():  # ...except the embedding, which is not saved: it comes from the verifier
        m.embed_tokens.weight.copy_(load_head_tensors(resolve(v)).embed)
    _save(m, tmp_path / "a")
    loaded = load_draft(tmp_path / "a", verifier=v)
    ids = torch.randint(0, tiny.VOCAB, (1, 9))
    aux = torch.randn(1, 9, 3 * tiny.HIDDEN)
    with torch.no_grad():
        for a, b in zip(m.ttt(ids, aux, ttt_steps=2), loaded.ttt(ids, aux, ttt_steps=2)):
            torch.testing.assert_close(m.compute_logits(a), loaded.compute_logits(b), rtol=0, atol=0)
    _save(loaded, tmp_path / "b")
    for name in ("config.json", "model.safetensors"):
        assert (tmp_path / "a" / name).read_bytes() == (tmp_path / "b" / name).read_bytes(), name
    cfg = json.loads((tmp_path / "a" / "config.json").read_text())
    assert cfg["norm_before_residual"] is False and cfg["tie_word_embeddings"] is False
    assert cfg["speculators_config"]["proposal_methods"][0]["speculative_tokens"] == 3
    assert cfg["transformer_layer_config"]["vocab_size"] == tiny.VOCAB
    keys = set(load_file(str(tmp_path / "a" / "model.safetensors")))
    assert "embed_tokens.weight" not in keys and {"d2t", "t2d", "fc.weight", "lm_head.weight"} <= keys


def test_full_vocab_draft_omits_maps(make_tiny, tmp_path):
    v = make_tiny("llama_tied").path
    _save(_draft(v, N=tiny.VOCAB), tmp_path / "d", include_embeddings=True)
    keys = set(load_file(str(tmp_path / "d" / "model.safetensors")))
    assert "d2t" not in keys and "t2d" not in keys and "embed_tokens.weight" in keys
    m = load_draft(tmp_path / "d")
    assert torch.equal(m.draft_to_target(torch.arange(tiny.VOCAB)), torch.arange(tiny.VOCAB))


def test_bad_checkpoints_name_the_key(make_tiny, tmp_path):
    v = make_tiny("llama").path
    _save(_draft(v), tmp_path / "c")
    w = tmp_path / "c" / "model.safetensors"
    sd = load_file(str(w))
    with pytest.raises(EyasError, match="no embed_tokens.weight; pass the verifier"):
        load_draft(tmp_path / "c")
    save_file({k: t for k, t in sd.items() if k != "d2t"}, str(w))
    with pytest.raises(EyasError, match=r"lacks \['d2t'\]"):
        load_draft(tmp_path / "c", verifier=v)
    bad = dict(sd)
    bad["fc.weight"] = torch.zeros(3, 3)
    save_file(bad, str(w))
    with pytest.raises(EyasError, match=r"'fc.weight' has shape \[3, 3\]"):
        load_draft(tmp_path / "c", verifier=v)
    save_file(sd, str(w))
    with pytest.raises(EyasError, match="vocab 512 and hidden size 64, but .* has vocab 49152"):
        load_draft(tmp_path / "c", verifier="smollm2")
    c = tmp_path / "c" / "config.json"
    raw = json.loads(c.read_text())
    for bad in ([1, 2], [2, 2, 4], None):  # the one check of aux ids (eyas.verifier.info.check_aux_layer_ids)
        raw["eagle_aux_hidden_state_layer_ids"] = bad
        c.write_text(json.dumps(raw))
        with pytest.raises(EyasError, match="eagle_aux_hidden_state_layer_ids must list three"):
            read_draft_config(tmp_path / "c")


def test_missing_norm_before_residual_reads_as_vllm_serves_it(make_tiny, tmp_path):
    _save(_draft(make_tiny("llama").path), tmp_path / "e")
    c = tmp_path / "e" / "config.json"
    raw = json.loads(c.read_text())
    del raw["norm_before_residual"]
    c.write_text(json.dumps(raw))
    cfg, _ = read_draft_config(tmp_path / "e")
    assert isinstance(cfg, DraftConfig) and cfg.norm_before_residual is True
