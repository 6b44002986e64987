"""``eyas export``: the config fields vLLM and SGLang read (each with the file that reads it), lossless and
byte-stable round trips through both layouts, imports of EAGLE/SpecForge layouts, and bad input.

Line numbers cite vLLM 0.33.0 (``vllm/``) and SGLang 0.5.23 (``sglang/srt/``) as published on PyPI.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

import tiny
from drafts import LAYOUTS, random_draft, save
from eyas.draft.checkpoint import load_draft, save_draft
from eyas.cli import main
from eyas.core.errors import EyasError
from eyas.stages.export import MIN_RELEASE, export
from eyas.draft.model import Eagle3Draft
from eyas.verifier.load import load_head_tensors, resolve


def logits(m: Eagle3Draft, ids, aux, steps=2, **kw) -> list[torch.Tensor]:
    with torch.no_grad():
        return [m.compute_logits(h) for h in m.ttt(ids, aux, ttt_steps=steps, **kw)]


def get(d: dict, dotted: str):
    for part in dotted.split("."):
        d = d[int(part)] if isinstance(d, list) else d[part]
    return d


# Every field vLLM's speculators path reads from our config.json, where it reads it, and what it must be.
# Top-level keys are read by vllm/transformers_utils/configs/speculators/{base,algos}.py; update_eagle3 then
# copies them onto transformer_layer_config, which becomes the draft's hf_config that
# model_executor/models/llama_eagle3.py and llama.py read.
VLLM_FIELDS = [
    ("speculators_model_type", lambda v, c: v == "eagle3",
     "base.py:51-56 (SUPPORTED_SPECULATORS_TYPES), :130 (method); algos.py:15 registers 'eagle3'"),
    ("transformer_layer_config", lambda v, c: isinstance(v, dict), "base.py:59, :88-94 (must be a dict)"),
    ("speculators_config.proposal_methods.0.speculative_tokens", lambda v, c: isinstance(v, int) and v >= 1,
     "base.py:79-82, :116-126 (num_speculative_tokens)"),
    ("speculators_config.verifier.name_or_path", lambda v, c: isinstance(v, str) and v,
     "base.py:83; transformers_utils/config.py:855-872 (`vllm serve DRAFT` serves this model)"),
    ("draft_vocab_size", lambda v, c: v == c.draft_vocab_size, "algos.py:30; llama_eagle3.py:314-345 (lm_head rows)"),
    ("norm_before_residual", lambda v, c: v is c.norm_before_residual,
     "algos.py:33-35 (a missing key means true); llama_eagle3.py:101-104"),
    ("norm_before_fc", lambda v, c: v is c.norm_before_fc, "algos.py:36; llama_eagle3.py:184-188, :223-229"),
    ("fc_norm", lambda v, c: v is c.fc_norm, "algos.py:37; llama_eagle3.py:231-240"),
    ("norm_output", lambda v, c: v is c.norm_output, "algos.py:38; llama_eagle3.py:252, :286"),
    ("eagle_aux_hidden_state_layer_ids", lambda v, c: v == c.aux_layer_ids,
     "algos.py:47-50 (copied as is); v1/worker/gpu_model_runner.py:5207 (captured with no shift)"),
    ("transformer_layer_config.model_type", lambda v, c: v == c.draft_arch,
     "algos.py:39-46 (llama -> Eagle3LlamaForCausalLM, qwen3 -> Eagle3Qwen3ForCausalLM)"),
    ("transformer_layer_config.hidden_size", lambda v, c: v == c.hidden_size, "llama_eagle3.py:98, :194; llama.py:265"),
    ("transformer_layer_config.num_hidden_layers", lambda v, c: v == c.num_hidden_layers,
     "llama_eagle3.py:206 (layers built; layer 0 reads 2H, later ones H)"),
    ("transformer_layer_config.vocab_size", lambda v, c: v == c.vocab_size,
     "llama_eagle3.py:174, :193 (embed_tokens rows: the verifier's vocab)"),
    ("transformer_layer_config.rms_norm_eps", lambda v, c: v == c.rms_norm_eps, "llama_eagle3.py:98, :226, :255"),
    ("transformer_layer_config.num_attention_heads", lambda v, c: v == c.num_attention_heads, "llama.py:288"),
    ("transformer_layer_config.num_key_value_heads", lambda v, c: v == c.num_key_value_heads, "llama.py:289-291"),
    ("transformer_layer_config.head_dim", lambda v, c: v == c.head_dim, "llama.py:158"),
    ("transformer_layer_config.intermediate_size", lambda v, c: v == c.intermediate_size, "llama.py:302"),
    ("transformer_layer_config.hidden_act", lambda v, c: v == c.hidden_act, "llama.py:303"),
    ("transformer_layer_config.mlp_bias", lambda v, c: v is False, "llama.py:305"),
    ("transformer_layer_config.attention_bias", lambda v, c: v is False, "llama.py:268; llama_eagle3.py:85"),
    ("transformer_layer_config.max_position_embeddings", lambda v, c: v == c.max_position_embeddings, "llama.py:266"),
    ("transformer_layer_config.rope_parameters", lambda v, c: v == c.rope_parameters and "rope_theta" in v,
     "llama.py:246 -> layers/rotary_embedding/__init__.py:63-65 (rope_theta, rope_type)"),
]  # fmt: skip
# Keys whose absence matters: a top-level model_type would stop vLLM detecting the speculators format
# (transformers_utils/config.py:360-367); layer_types would give the draft a sliding window (llama.py:186-204);
# num_aux_hidden_states / eagle_config would size fc other than by our 3 ids (llama_eagle3.py:209-216);
# a null target_hidden_size is skipped by vLLM (algos.py:31) but breaks SGLang's hasattr (llama_eagle3.py:151).
# A Qwen3 layer config lists its layer_types instead, all full attention (qwen3_eagle3.py reads them).
VLLM_ABSENT = ["model_type", "eagle_config", "target_hidden_size", "transformer_layer_config.layer_types",
               "transformer_layer_config.sliding_window", "transformer_layer_config.num_aux_hidden_states"]  # fmt: skip


@pytest.mark.parametrize("layout", LAYOUTS)
def test_vllm_reads_every_field_and_resave_is_byte_identical(make_tiny, tmp_path, layout):
    v = make_tiny("llama").path
    m = random_draft(v, **LAYOUTS[layout])
    save(m, tmp_path / "trained", v)
    export(draft=str(tmp_path / "trained"), out=str(tmp_path / "a"), verifier=str(v), verifier_name="org/tiny")
    conf = json.loads((tmp_path / "a" / "config.json").read_text())
    for path, ok, where in VLLM_FIELDS:
        assert ok(get(conf, path), m.config), f"{path} = {get(conf, path)!r} is not what vLLM needs ({where})"
    for path in VLLM_ABSENT:
        if path.endswith("layer_types") and m.config.draft_arch == "qwen3":
            assert get(conf, path) == ["full_attention"] * m.config.num_hidden_layers
            continue
        with pytest.raises((KeyError, IndexError)):
            get(conf, path)
    assert conf["speculators_config"]["verifier"]["name_or_path"] == "org/tiny"
    # save -> load -> save: the export of an export is the same bytes, and so is a re-save of the loaded model
    export(draft=str(tmp_path / "a"), out=str(tmp_path / "b"), from_format="speculators")
    loaded = load_draft(tmp_path / "a", verifier=v)
    save_draft(tmp_path / "c", loaded, verifier_name_or_path="org/tiny", verifier_architectures=["LlamaForCausalLM"],
               ttt_steps=3)  # fmt: skip
    for name in ("config.json", "model.safetensors"):
        first = (tmp_path / "a" / name).read_bytes()
        assert first == (tmp_path / "b" / name).read_bytes() == (tmp_path / "c" / name).read_bytes(), name
    ids, aux = torch.randint(0, tiny.VOCAB, (2, 11)), torch.randn(2, 11, 3 * tiny.HIDDEN)
    for a, b in zip(logits(m, ids, aux), logits(loaded, ids, aux)):
        torch.testing.assert_close(a, b, rtol=0, atol=0)


# Every field SGLang's EAGLE-3 draft reads (sglang/srt/models/llama_eagle3.py unless named).
SGLANG_FIELDS = [
    ("architectures", lambda v, c: v == ["LlamaForCausalLMEagle3"], "llama_eagle3.py:387 (EntryClass)"),
    ("model_type", lambda v, c: v == "llama", "the HF config class SGLang builds the draft config with"),
    ("draft_vocab_size", lambda v, c: v == c.draft_vocab_size, ":305-314 (lm_head rows; null = full vocab)"),
    ("tie_word_embeddings", lambda v, c: v is False, ":303-304 (true ties lm_head to embed_tokens)"),
    ("vocab_size", lambda v, c: v == c.vocab_size, ":144-149 (embed_tokens)"),
    ("hidden_size", lambda v, c: v == c.hidden_size, ":86, :154, :163-167"),
    ("num_hidden_layers", lambda v, c: v == c.num_hidden_layers, ":199-204 (layer 0 reads 2H, later ones H)"),
    ("intermediate_size", lambda v, c: v == c.intermediate_size, ":77-84"),
    ("hidden_act", lambda v, c: v == c.hidden_act, ":82-84"),
    ("rms_norm_eps", lambda v, c: v == c.rms_norm_eps, ":86, :206"),
    ("num_attention_heads", lambda v, c: v == c.num_attention_heads, "models/llama.py:345"),
    ("num_key_value_heads", lambda v, c: v == c.num_key_value_heads, "models/llama.py:346"),
    ("head_dim", lambda v, c: v == c.head_dim, "models/llama.py LlamaAttention (head_dim, else H/heads)"),
    ("rope_parameters", lambda v, c: v == c.rope_parameters, ":132-136; models/llama.py:322-328"),
    ("max_position_embeddings", lambda v, c: v == c.max_position_embeddings, "models/llama.py:336"),
    ("attention_bias", lambda v, c: v is False, "models/llama.py:339-340"),
    ("eagle_config.eagle_aux_hidden_state_layer_ids", lambda v, c: v == [i - 1 for i in c.aux_layer_ids],
     "model_runner_components/spec_aux_hidden_state.py:185-196 reads it; models/llama.py:929-941 captures id+1"),
    ("eagle_config.use_aux_hidden_state", lambda v, c: v is True, "spec_aux_hidden_state.py:189-191"),
    ("norm_before_fc", lambda v, c: v is c.norm_before_fc, ":169-181 (input_norm)"),
    ("fc_norm", lambda v, c: v is c.fc_norm, ":184-196"),
    ("norm_output", lambda v, c: v is c.norm_output, ":207, :263-269"),
]  # fmt: skip
SGLANG_ABSENT = ["target_hidden_size", "num_aux_hidden_states", "bias", "speculators_config", "layer_types"]


EAGLE_LAYOUTS = {"eagle3": {}, "norm_before_fc_and_output": {"norm_before_fc": True, "norm_output": True},
                 "eagle31_two_layers": {"fc_norm": True, "norm_output": True, "num_hidden_layers": 2}}  # fmt: skip


@pytest.mark.parametrize("layout", EAGLE_LAYOUTS)
def test_eagle_export_has_what_sglang_reads_and_round_trips(make_tiny, tmp_path, layout):
    v = make_tiny("llama").path
    flags = EAGLE_LAYOUTS[layout]
    m = random_draft(v, aux_layer_ids=[1, 3, 6], **flags)  # non-default ids, so the shift is visible
    save(m, tmp_path / "trained", v)
    export(draft=str(tmp_path / "trained"), out=str(tmp_path / "sgl"), format="eagle", verifier=str(v))
    conf = json.loads((tmp_path / "sgl" / "config.json").read_text())
    for path, ok, where in SGLANG_FIELDS:
        assert ok(get(conf, path), m.config), f"{path} = {get(conf, path)!r} is not what SGLang needs ({where})"
    for key in SGLANG_ABSENT:
        assert key not in conf, key
    assert conf["eagle_config"]["eagle_aux_hidden_state_layer_ids"] == [0, 2, 5]
    w = load_file(str(tmp_path / "sgl" / "model.safetensors"))
    assert all(t.dtype == torch.bfloat16 for k, t in w.items() if k not in ("d2t", "t2d"))
    assert w["d2t"].dtype == torch.int64 and w["t2d"].dtype == torch.bool
    assert not any(k.startswith("layers.0.") for k in w) and "midlayer.self_attn.q_proj.weight" in w
    assert "embed_tokens.weight" not in w and ("input_norm.weight" in w) == flags.get("norm_before_fc", False)
    assert ("fc_norm.2.weight" in w) == flags.get("fc_norm", False)
    if flags.get("num_hidden_layers"):  # a later layer's input norm under SGLang's name and vLLM's, one value
        assert w["layers.1.self_attn.q_proj.weight"].shape[1] == tiny.HIDDEN and "midlayer.hidden_norm.weight" in w
        assert torch.equal(w["layers.1.hidden_norm.weight"], w["layers.1.input_layernorm.weight"])
    # SGLang's hot-token ids (d2t + arange, llama_eagle3.py:350-353) are the draft's target ids
    assert torch.equal(w["d2t"] + torch.arange(len(w["d2t"])), m.draft_to_target(torch.arange(96)))
    # back to the native layout: the very bytes eyas train wrote; and eagle -> eagle is stable too
    export(draft=str(tmp_path / "sgl"), out=str(tmp_path / "back"), from_format="eagle", verifier=str(v))
    export(draft=str(tmp_path / "sgl"), out=str(tmp_path / "sgl2"), from_format="eagle", format="eagle")
    for name in ("config.json", "model.safetensors"):
        assert (tmp_path / "back" / name).read_bytes() == (tmp_path / "trained" / name).read_bytes(), name
        assert (tmp_path / "sgl2" / name).read_bytes() == (tmp_path / "sgl" / name).read_bytes(), name
    ids, aux = torch.randint(0, tiny.VOCAB, (1, 13)), torch.randn(1, 13, 3 * tiny.HIDDEN)
    for a, b in zip(logits(m, ids, aux), logits(load_draft(tmp_path / "back", verifier=v), ids, aux)):
        torch.testing.assert_close(a, b, rtol=0, atol=0)
    manifest = json.loads((tmp_path / "back" / "manifest.json").read_text())
    assert manifest["stage"] == "export" and manifest["settings"]["from_format"] == "eagle"
    assert manifest["outputs"]["aux_layer_ids"] == [1, 3, 6] and manifest["outputs"]["serve_with"] == "vLLM"


def test_refuses_what_sglang_cannot_run(make_tiny, tmp_path):
    v = make_tiny("llama").path
    save(random_draft(v, norm_before_residual=True), tmp_path / "d", v)
    with pytest.raises(EyasError, match=r"norm_before_residual=true.*sglang/srt/models/llama_eagle3.py"):
        export(draft=str(tmp_path / "d"), out=str(tmp_path / "o"), format="eagle")
    assert not (tmp_path / "o" / "config.json").exists()
    # the verifier's final state (id L) is fine for vLLM but never captured by SGLang
    save(random_draft(v, aux_layer_ids=[2, 4, 8]), tmp_path / "last", v)
    export(draft=str(tmp_path / "last"), out=str(tmp_path / "vllm"), verifier=str(v))
    with pytest.raises(EyasError, match="aux layer 8 is the verifier's final hidden state, which SGLang never"):
        export(draft=str(tmp_path / "last"), out=str(tmp_path / "o"), format="eagle", verifier=str(v))


# (layout, vLLM's first release that serves it as trained, SGLang's): read in the published wheels, see
# eyas.stages.export.MIN_RELEASE. None: any release that serves EAGLE-3; "never": refused.
REQUIRES = [
    ({}, None, None),
    ({"norm_before_residual": True}, None, "never"),
    ({"norm_before_fc": True}, "0.19.0", "0.5.17"),
    ({"norm_before_fc": True, "norm_output": True}, "0.25.0", "0.5.17"),
    ({"fc_norm": True}, "0.25.0", "0.5.12"),
    ({"num_hidden_layers": 2}, "0.11.1", "0.5.12"),
    ({"draft_arch": "qwen3"}, "0.24.0", "never"),
]


@pytest.mark.parametrize(("layout", "vllm", "sglang"), REQUIRES, ids=lambda x: None if isinstance(x, dict) else str(x))
def test_export_records_the_engine_release_each_variant_needs(make_tiny, tmp_path, capsys, layout, vllm, sglang):
    """Both layouts record in their manifest the oldest engine release that runs the draft as trained (older ones
    ignore norm_before_fc / norm_output / fc_norm weights or flags without a word) and say it; SGLang refuses
    what none of its releases runs, naming the setting."""
    v = make_tiny("llama").path
    save(random_draft(v, **layout), tmp_path / "d", v)
    for fmt, engine, want in (("speculators", "vLLM", vllm), ("eagle", "SGLang", sglang)):
        out = tmp_path / fmt
        if want == "never":
            bad = next(f"{k}=true" if val is True else f"{k}={val}" for k, val in layout.items())
            with pytest.raises(EyasError, match=rf"{bad}, but no {engine} release runs this draft as trained"):
                export(draft=str(tmp_path / "d"), out=str(out), format=fmt)
            assert not out.exists() or not (out / "config.json").exists()
            continue
        capsys.readouterr()
        export(draft=str(tmp_path / "d"), out=str(out), format=fmt)
        req = json.loads((out / "manifest.json").read_text())["outputs"]["requires"]
        assert req["engine"] == engine and req["min_version"] == want
        assert (f"needs {engine} >= {want}" in capsys.readouterr().out) == bool(want)
        named = {"num_hidden_layers>1" if k == "num_hidden_layers" else k if val is True else f"{k}={val}"
                 for k, val in layout.items() if k != "norm_before_residual"}  # fmt: skip
        assert req["variants"] == {k: MIN_RELEASE[engine][k] for k in named}


def test_eagle_multi_layer_import_guards(make_tiny, tmp_path):
    """A later layer's input norm: SGLang reads hidden_norm, vLLM input_layernorm. An EAGLE checkpoint whose two
    disagree, or that has only vLLM's, would run differently in SGLang: refused. SGLang's older names of the
    per-aux norms (aux_norm_low/mid/high) import as fc_norm.0/1/2."""
    v = make_tiny("llama").path
    m = random_draft(v, num_hidden_layers=2, fc_norm=True)
    save(m, tmp_path / "d", v)
    export(draft=str(tmp_path / "d"), out=str(tmp_path / "sgl"), format="eagle")

    def variant(name, fn):
        (tmp_path / name).mkdir()
        (tmp_path / name / "config.json").write_bytes((tmp_path / "sgl" / "config.json").read_bytes())
        sd = load_file(str(tmp_path / "sgl" / "model.safetensors"))
        fn(sd)
        save_file(sd, str(tmp_path / name / "model.safetensors"))
        return str(tmp_path / name)

    legacy = variant("legacy", lambda sd: [sd.update({new: sd.pop(f"fc_norm.{i}.weight")})
                                           for i, new in enumerate(("aux_norm_low.weight", "aux_norm_mid.weight",
                                                                    "aux_norm_high.weight"))])  # fmt: skip
    export(draft=legacy, out=str(tmp_path / "back"), from_format="eagle", verifier=str(v))
    assert (tmp_path / "back" / "model.safetensors").read_bytes() == (tmp_path / "d" / "model.safetensors").read_bytes()
    only_vllm = variant("only_vllm", lambda sd: sd.pop("layers.1.hidden_norm.weight"))
    with pytest.raises(EyasError, match=r"has 'layers.1.input_layernorm.weight' but no 'layers.1.hidden_norm.weight'"):
        export(draft=only_vllm, out=str(tmp_path / "x"), from_format="eagle", verifier=str(v))
    differ = variant("differ", lambda sd: sd["layers.1.hidden_norm.weight"].mul_(2))
    with pytest.raises(EyasError, match=r"'layers.1.input_layernorm.weight' and 'layers.1.hidden_norm.weight' differ"):
        export(draft=differ, out=str(tmp_path / "x"), from_format="eagle", verifier=str(v))
    only_sglang = variant("only_sglang", lambda sd: sd.pop("layers.1.input_layernorm.weight"))
    export(draft=only_sglang, out=str(tmp_path / "ok"), from_format="eagle", verifier=str(v))
    ids, aux = torch.randint(0, tiny.VOCAB, (1, 9)), torch.randn(1, 9, 3 * tiny.HIDDEN)
    for a, b in zip(logits(m, ids, aux), logits(load_draft(tmp_path / "ok", verifier=v), ids, aux)):
        torch.testing.assert_close(a, b, rtol=0, atol=0)


def _specforge_dir(path: Path, m: Eagle3Draft, *, bin_file: bool, ids_in_config: bool) -> Path:
    """A draft laid out as SpecForge / the EAGLE repo write it: a plain Llama config (no rope fields, fp16,
    SpecForge's configs/llama3-8B-eagle3.json shape), midlayer.* or layers.0.* keys, no embedding."""
    c = m.config
    path.mkdir(parents=True)
    conf = {"architectures": ["LlamaForCausalLMEagle3" if not bin_file else "LlamaForCausalLM"],
            "bos_token_id": 1, "eos_token_id": 2, "hidden_act": "silu", "hidden_size": c.hidden_size,
            "initializer_range": 0.02, "intermediate_size": c.intermediate_size,
            "max_position_embeddings": c.max_position_embeddings, "model_type": "llama",
            "num_attention_heads": c.num_attention_heads, "num_hidden_layers": 1,
            "num_key_value_heads": c.num_key_value_heads, "pad_token_id": 0, "rms_norm_eps": c.rms_norm_eps,
            "tie_word_embeddings": False, "torch_dtype": "float16", "transformers_version": "4.28.1",
            "use_cache": True, "vocab_size": c.vocab_size, "draft_vocab_size": c.draft_vocab_size}  # fmt: skip
    if ids_in_config:
        conf["eagle_config"] = {"eagle_aux_hidden_state_layer_ids": [i - 1 for i in c.aux_layer_ids]}
    (path / "config.json").write_text(json.dumps(conf))
    sd = {(k.replace("layers.0.", "midlayer.") if bin_file else k): (t.half() if t.is_floating_point() else t)
          for k, t in m.state_dict().items() if k != "embed_tokens.weight"}  # fmt: skip
    if bin_file:
        torch.save(sd, path / "pytorch_model.bin")
    else:
        save_file(sd, str(path / "model.safetensors"))
    return path


@pytest.mark.parametrize("bin_file", [True, False], ids=["eagle_repo_bin", "specforge_safetensors"])
def test_import_eagle_and_specforge_layouts(make_tiny, tmp_path, bin_file):
    v = make_tiny("llama").path
    m = random_draft(v)
    src = _specforge_dir(tmp_path / "src", m, bin_file=bin_file, ids_in_config=not bin_file)
    if bin_file:  # the EAGLE repo's config names no aux layers: SGLang then captures the defaults
        with pytest.raises(EyasError, match="no eagle_config.eagle_aux_hidden_state_layer_ids; pass --verifier"):
            export(draft=str(src), out=str(tmp_path / "x"), from_format="eagle", verifier_name="org/tiny")
    assert main(["export", "--from", "eagle", str(src), "--out", str(tmp_path / "o"), "--verifier", str(v),
                 "--dtype", "float32"]) == 0  # fmt: skip
    got = load_draft(tmp_path / "o", verifier=v)
    assert got.config.aux_layer_ids == m.config.aux_layer_ids == [2, 4, 5]
    assert got.config.norm_before_residual is False and got.fc.weight.dtype == torch.float32
    ids, aux = torch.randint(0, tiny.VOCAB, (1, 10)), torch.randn(1, 10, 3 * tiny.HIDDEN)
    with torch.no_grad():  # the fp16 file holds fp16-rounded weights; the embedding comes from the verifier
        for name, p in m.named_parameters():
            p.copy_(p if name == "embed_tokens.weight" else p.half().float())
    for a, b in zip(logits(m, ids, aux), logits(got, ids, aux)):
        torch.testing.assert_close(a, b, rtol=0, atol=0)


def test_full_vocab_and_embeddings(make_tiny, tmp_path):
    v = make_tiny("llama_tied").path
    m = random_draft(v, N=tiny.VOCAB)
    save(m, tmp_path / "d", v)
    export(draft=str(tmp_path / "d"), out=str(tmp_path / "e"), format="eagle", include_embeddings=True, verifier=str(v))
    w = load_file(str(tmp_path / "e" / "model.safetensors"))
    assert torch.equal(w["d2t"], torch.zeros(tiny.VOCAB, dtype=torch.long)) and bool(w["t2d"].all())
    assert torch.equal(w["embed_tokens.weight"].float(), load_head_tensors(resolve(v)).embed.to(torch.bfloat16).float())
    export(draft=str(tmp_path / "e"), out=str(tmp_path / "n"), from_format="eagle", verifier=str(v))
    assert not {"d2t", "t2d", "embed_tokens.weight"} & set(load_file(str(tmp_path / "n" / "model.safetensors")))
    with pytest.raises(EyasError, match="--include-embeddings: the draft has no embed_tokens.weight; pass --verifier"):
        export(draft=str(tmp_path / "n"), out=str(tmp_path / "z"), include_embeddings=True)


def test_rerun_is_skipped_and_cli_forms(make_tiny, tmp_path, capsys):
    v = make_tiny("llama").path
    save(random_draft(v), tmp_path / "d", v)
    assert main(["export", "--draft", str(tmp_path / "d"), "--out", str(tmp_path / "o"), "--format", "eagle"]) == 0
    first = (tmp_path / "o" / "manifest.json").read_bytes()
    assert main(["export", str(tmp_path / "d"), "--out", str(tmp_path / "o"), "--format", "eagle"]) == 0
    assert "up to date" in capsys.readouterr().out and (tmp_path / "o" / "manifest.json").read_bytes() == first
    with pytest.raises(SystemExit):
        main(["export", "--out", str(tmp_path / "o")])
    assert "give DRAFT (or --draft)" in capsys.readouterr().err
    # a refused export into the same dir leaves the previous one whole
    save(random_draft(v, norm_before_residual=True), tmp_path / "nbr", v)
    assert main(["export", str(tmp_path / "nbr"), "--out", str(tmp_path / "o"), "--format", "eagle"]) == 2
    assert "norm_before_residual=true" in capsys.readouterr().err
    assert (tmp_path / "o" / "manifest.json").read_bytes() == first and (tmp_path / "o" / "config.json").is_file()


def _corrupt(path: Path, fn) -> None:
    w = path / "model.safetensors"
    sd = load_file(str(w))
    fn(sd)
    save_file(sd, str(w))


def test_bad_input_names_the_key_and_file(make_tiny, tmp_path):
    v = make_tiny("llama").path
    save(random_draft(v), tmp_path / "good", v)
    export(draft=str(tmp_path / "good"), out=str(tmp_path / "sgl"), format="eagle")

    def fails(src, match, **kw):
        with pytest.raises(EyasError, match=match):
            export(draft=str(src), out=str(tmp_path / "out"), **kw)

    # an EAGLE config names no verifier, which the speculators layout must record
    fails(tmp_path / "sgl", r"sgl/config.json does not name its verifier; pass --verifier PATH or --verifier-name",
          from_format="eagle")  # fmt: skip
    # a checkpoint without d2t / t2d, in either layout
    for name, layout, key in (("nod2t", "good", "d2t"), ("not2d", "sgl", "t2d")):
        (tmp_path / name).mkdir()
        for f in ("config.json", "model.safetensors"):
            (tmp_path / name / f).write_bytes((tmp_path / layout / f).read_bytes())
        _corrupt(tmp_path / name, lambda sd, key=key: sd.pop(key))
        fails(tmp_path / name, rf"{name}/model.safetensors lacks \['{key}'\]",
              from_format="eagle" if layout == "sgl" else None)  # fmt: skip
    # a tensor of the wrong shape, named as the file names it
    _corrupt(tmp_path / "sgl", lambda sd: sd.update({"midlayer.self_attn.q_proj.weight": torch.zeros(64, 64)}))
    fails(tmp_path / "sgl", r"sgl/model.safetensors: 'midlayer.self_attn.q_proj.weight' has shape \[64, 64\], "
          r"the config implies \[64, 128\]", from_format="eagle")  # fmt: skip
    # a draft made for another verifier: vocab, then hidden size
    fails(tmp_path / "good", r"good/config.json: vocab_size 512 .* verifier .* whose vocab is 49152",
          verifier="smollm2")  # fmt: skip
    from transformers import LlamaConfig, LlamaForCausalLM

    wide_cfg = LlamaConfig(**tiny._common(hidden_size=96, num_attention_heads=4, num_key_value_heads=2))
    wide = tiny._save(tiny._build(wide_cfg, LlamaForCausalLM, 7), tiny.make_tokenizer(), tmp_path / "v96",
                      wide_cfg, LlamaForCausalLM).path  # fmt: skip
    fails(tmp_path / "good", r"good/config.json: fc.weight reads aux states of hidden size 64 .* has hidden size 96",
          verifier=str(wide))  # fmt: skip
    conf = json.loads((tmp_path / "good" / "config.json").read_text())
    conf["transformer_layer_config"]["vocab_size"] = 49152
    conf["transformer_layer_config"]["hidden_size"] = 576
    (tmp_path / "wide").mkdir()
    (tmp_path / "wide" / "config.json").write_text(json.dumps(conf))
    (tmp_path / "wide" / "model.safetensors").write_bytes((tmp_path / "good" / "model.safetensors").read_bytes())
    fails(tmp_path / "wide", r"wide/model.safetensors: 'fc.weight' has shape \[64, 192\], the config implies "
          r"\[576, 1728\]")  # fmt: skip
    # vocab maps that disagree: vLLM/SGLang (d2t) and speculators (t2d) would use different tokens
    _corrupt(tmp_path / "good", lambda sd: sd["t2d"].copy_(sd["t2d"].roll(1)))
    fails(tmp_path / "good", r"good/model.safetensors: d2t and t2d disagree")
    _corrupt(tmp_path / "good", lambda sd: sd["d2t"].__setitem__(0, -1))
    fails(tmp_path / "good", "d2t maps draft ids outside the verifier vocab")
    # the wrong --from, a missing weights file, two aux norms that exclude each other
    fails(tmp_path / "nod2t", "is a speculators checkpoint, not an EAGLE one: use --from speculators",
          from_format="eagle")  # fmt: skip
    (tmp_path / "nod2t" / "model.safetensors").unlink()
    fails(tmp_path / "nod2t", r"nod2t has no model.safetensors")
    conf = json.loads((tmp_path / "not2d" / "config.json").read_text())
    (tmp_path / "not2d" / "config.json").write_text(json.dumps({**conf, "fc_norm": True, "norm_before_fc": True}))
    fails(tmp_path / "not2d", r"not2d/config.json: norm_before_fc and fc_norm exclude each other", from_format="eagle")
    assert not (tmp_path / "out" / "config.json").exists()


def test_demo_ship_step_on_smollm2(tmp_path, capsys):
    """The demo's export step on the real SmolLM2 verifier (GGUF: no config.json to take architectures from)."""
    from eyas.demo import ship

    m = random_draft("smollm2", N=1024)
    save_draft(tmp_path / "draft", m, verifier_name_or_path="HuggingFaceTB/SmolLM2-135M-Instruct",
               verifier_architectures=["LlamaForCausalLM"], ttt_steps=3)  # fmt: skip
    ship(out=str(tmp_path))
    conf = json.loads((tmp_path / "draft-sglang" / "config.json").read_text())
    assert m.config.aux_layer_ids == [2, 15, 27]  # SmolLM2 has 30 layers: [2, L//2, L-3]
    assert conf["eagle_config"]["eagle_aux_hidden_state_layer_ids"] == [1, 14, 26]
    assert (conf["vocab_size"], conf["draft_vocab_size"], conf["hidden_size"]) == (49152, 1024, 576)
    assert "speculative-draft-model-path" in capsys.readouterr().out
    export(draft=str(tmp_path / "draft-sglang"), out=str(tmp_path / "vllm"), from_format="eagle", verifier="smollm2")
    spec = json.loads((tmp_path / "vllm" / "config.json").read_text())["speculators_config"]
    assert spec["verifier"]["architectures"] == ["LlamaForCausalLM"] and spec["verifier"]["name_or_path"]
