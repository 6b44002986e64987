"""Verifier resolution for every checkpoint layout, head tensors, the text backbone, and bad input."""

from __future__ import annotations

import json
import shutil
import struct

import pytest
import torch

import tiny
from eyas.core.errors import EyasError
from eyas.verifier.load import build_final_norm, build_text_model, load_head_tensors, load_tokenizer, resolve
from eyas.verifier.info import check_aux_layer_ids, fingerprint

ALL = list(tiny.BUILDERS)


@pytest.mark.parametrize("name", ALL)
def test_resolve_every_layout(make_tiny, name):
    t = make_tiny(name)
    info = resolve(t.path)
    assert info.hidden_size == tiny.HIDDEN
    assert info.num_hidden_layers == tiny.LAYERS
    assert info.vocab_size == tiny.VOCAB
    assert info.aux_layer_ids == [2, 4, 5]
    assert info.runnable, info.reasons
    assert info.tied_embeddings == (name in ("llama_tied", "gemma", "gemma2", "gemma3", "cohere"))
    assert info.quantization == "none"
    if name == "kimi_like":
        assert info.model_type == "kimi_k25" and info.text_model_type == "deepseek_v3"
        assert info.text_config_key == "text_config"
        assert info.embed_key == "language_model.model.embed_tokens.weight"
        assert info.lm_head_key == "language_model.lm_head.weight"
        assert info.norm_key == "language_model.model.norm.weight"
        assert info.embed.file.startswith("model-0000") and info.has_remote_code
    else:
        assert info.embed_key == "model.embed_tokens.weight" and info.norm_key == "model.norm.weight"
        assert info.lm_head_key == (None if info.tied_embeddings else "lm_head.weight")
    assert info.embed.shape == (tiny.VOCAB, tiny.HIDDEN) and info.norm.shape == (tiny.HIDDEN,)
    s = info.summary()
    for key in ("model_type", "text_model_type", "hidden_size", "num_hidden_layers", "vocab_size", "embed_key",
                "lm_head_key", "tied_embeddings", "norm_key", "aux_layer_ids", "quantization", "runnable"):  # fmt: skip
        assert key in s
    json.dumps(s)


@pytest.mark.parametrize("name", ALL)
def test_head_tensors_bit_equal(make_tiny, name):
    t = make_tiny(name)
    ref = t.reference()
    info = resolve(t.path)
    rows = torch.tensor([0, 5, 17, tiny.VOCAB - 1])
    h = load_head_tensors(info, rows=rows)
    assert torch.equal(h.embed, ref.get_input_embeddings().weight)
    assert torch.equal(h.lm_head, ref.get_output_embeddings().weight[rows])
    assert torch.equal(h.norm, ref.model.norm.weight)
    assert load_head_tensors(info, dtype=torch.bfloat16).embed.dtype == torch.bfloat16


@pytest.mark.parametrize("name", ALL)
def test_text_backbone_matches_reference(make_tiny, name):
    t = make_tiny(name)
    ref = t.reference()
    model = build_text_model(resolve(t.path))
    ids = torch.randint(0, tiny.VOCAB, (2, 13), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        torch.testing.assert_close(model(ids).logits, ref(ids).logits, rtol=0, atol=1e-5)
    norm = build_final_norm(resolve(t.path))
    x = torch.randn(3, tiny.HIDDEN)
    torch.testing.assert_close(norm(x), ref.model.norm(x), rtol=0, atol=0)


def test_remote_code_never_imported(make_tiny):
    t = make_tiny("kimi_like")
    info = resolve(t.path)
    build_text_model(info)
    load_tokenizer(info)
    assert not (t.path / tiny.REMOTE_SENTINEL).exists()


def test_aux_layer_ids_one_check():
    """Every source of aux layer ids (--layers, a features manifest, a draft's config, a draft against its
    verifier) goes through one check: three distinct ids, ascending; with the verifier's L, each in 1..L-1, or
    1..L for a draft that reads the final hidden state."""
    assert check_aux_layer_ids([5, 2, 4], 8) == [2, 4, 5]
    assert check_aux_layer_ids(["0", 1, 2]) == [0, 1, 2]  # no verifier to bound them: the shape only
    assert check_aux_layer_ids([2, 4, 8], 8, final=True) == [2, 4, 8]
    for ids, match in (([2, 4], "--layers must list three distinct"), ([2, 2, 4], "must list three distinct"),
                       ([0, 2, 4], r"\[0\] out of range .* 8 layers: use ids 1..7"), ([2, 4, 8], r"\[8\] out of range"),
                       (None, "must list three layer ids, got None")):  # fmt: skip
        with pytest.raises(EyasError, match=match):
            check_aux_layer_ids(ids, 8)
    with pytest.raises(EyasError, match=r"^the manifest: layer id\(s\) \[9\] .* use ids 1..8"):
        check_aux_layer_ids([2, 4, 9], 8, final=True, what="the manifest")


def test_fingerprint_is_cheap_and_changes_with_weights(make_tiny, tmp_path):
    t = make_tiny("llama")
    copy = tmp_path / "llama"
    shutil.copytree(t.path, copy)
    fp = fingerprint(resolve(copy))
    assert fp == fingerprint(resolve(t.path))
    cfg = json.loads((copy / "config.json").read_text())
    cfg["rms_norm_eps"] = 1e-3
    (copy / "config.json").write_text(json.dumps(cfg))
    assert fingerprint(resolve(copy)) != fp


def _write_gguf(path, *, endian=None, alignment=None):
    """A small GGUF through the gguf package's writer: scalar fields of every kind, string and number arrays (a
    tokenizer's kind), an array of arrays, and F32, F16 and Q8_0 tensors."""
    import gguf
    import numpy as np

    w = gguf.GGUFWriter(path, "llama", **({"endianess": endian} if endian is not None else {}))
    if alignment:
        w.add_custom_alignment(alignment)
    w.add_uint32("llama.block_count", 2)
    w.add_int64("x.i64", -3)
    w.add_float32("llama.rope.freq_base", 10000.0)
    w.add_float64("x.f64", 0.1)
    w.add_bool("x.bool", True)
    w.add_string("x.name", "naïve")
    w.add_array("tokenizer.ggml.tokens", [f"tok{i}" * (i % 5 + 1) for i in range(300)])
    w.add_array("tokenizer.ggml.scores", [float(i) for i in range(300)])
    w.add_array("x.nested", [[1, 2], [3]])
    rng = np.random.default_rng(0)
    w.add_tensor("a.f32", rng.standard_normal((3, 5)).astype(np.float32))
    w.add_tensor("b.f16", rng.standard_normal((4, 8)).astype(np.float16))
    q = rng.standard_normal((2, 64)).astype(np.float32)
    w.add_tensor(
        "c.q8", gguf.quants.quantize(q, gguf.GGMLQuantizationType.Q8_0), raw_dtype=gguf.GGMLQuantizationType.Q8_0
    )
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return path


@pytest.mark.parametrize("alignment", [None, 64])
def test_gguf_header_reads_what_gguf_reader_reads(tmp_path, alignment):
    """eyas' GGUF header reader walks past the arrays (a tokenizer's 100k strings took gguf.GGUFReader seconds)
    and gives the scalar fields, the tensor table and every tensor's values that gguf.GGUFReader gives; a
    big-endian file is left to gguf.GGUFReader; a file that is not GGUF, or is cut short, is refused by name."""
    import gguf
    import numpy as np

    from eyas.verifier.gguf_header import _read_with_gguf_reader, gguf_header, read_gguf_header, read_gguf_tensor

    path = _write_gguf(tmp_path / "m.gguf", alignment=alignment)
    got, want = read_gguf_header(path), _read_with_gguf_reader(path)
    assert got.fields == want.fields and got.fields["x.name"] == "naïve"
    assert got.fields["tokenizer.ggml.tokens"] is None and got.fields["x.nested"] is None  # arrays: not read
    assert got.tensors == want.tensors
    for name in want.tensors:
        np.testing.assert_array_equal(read_gguf_tensor(got, name), read_gguf_tensor(want, name))
    big = _write_gguf(tmp_path / "big.gguf", endian=gguf.GGUFEndian.BIG)
    assert read_gguf_header(big) is None and gguf_header(big).reader is not None
    assert gguf_header(big).fields["llama.block_count"] == 2
    (tmp_path / "not.gguf").write_bytes(b"GGML" + bytes(64))
    with pytest.raises(EyasError, match="not.gguf is not a GGUF file"):
        read_gguf_header(tmp_path / "not.gguf")
    (tmp_path / "empty.gguf").write_bytes(b"")
    with pytest.raises(EyasError, match="empty.gguf is not a GGUF file"):
        read_gguf_header(tmp_path / "empty.gguf")
    (tmp_path / "cut.gguf").write_bytes(path.read_bytes()[:200])
    with pytest.raises(EyasError, match="cut.gguf is not a readable GGUF file"):
        read_gguf_header(tmp_path / "cut.gguf")


def test_smollm2_gguf_header_equals_gguf_reader(smollm2_path):
    """On SmolLM2's GGUF (its tokenizer in arrays, Q4_1 and F32 tensors): the fields, the tensor table and the
    values of the tensors a draft borrows equal gguf.GGUFReader's."""
    import numpy as np

    from eyas.verifier.gguf_header import _read_with_gguf_reader, read_gguf_header, read_gguf_tensor

    got, want = read_gguf_header(smollm2_path), _read_with_gguf_reader(smollm2_path)
    assert got.fields == want.fields and got.tensors == want.tensors
    for name in ("token_embd.weight", "output_norm.weight", "blk.0.attn_q.weight"):
        np.testing.assert_array_equal(read_gguf_tensor(got, name), read_gguf_tensor(want, name))


def test_smollm2_gguf(smollm2_path, smollm2_model):
    info = resolve("smollm2")
    assert (info.num_hidden_layers, info.hidden_size, info.vocab_size) == (30, 576, 49152)
    assert info.tied_embeddings and info.lm_head_key is None
    assert info.quantization.startswith("gguf")
    assert info.aux_layer_ids == [2, 15, 27]
    assert info.runnable
    rows = torch.arange(0, 49152, 97)
    h = load_head_tensors(info, rows=rows)
    assert torch.equal(h.embed, smollm2_model.get_input_embeddings().weight)
    assert torch.equal(h.lm_head, smollm2_model.get_output_embeddings().weight[rows])
    assert torch.equal(h.norm, smollm2_model.model.norm.weight)
    assert resolve(smollm2_path).path == info.path


# --------------------------------------------------------------------------- bad input


def _copy(make_tiny, name, tmp_path):
    dst = tmp_path / name
    shutil.copytree(make_tiny(name).path, dst)
    return dst


def test_no_config(tmp_path):
    (tmp_path / "model.safetensors").write_bytes(b"")
    with pytest.raises(EyasError, match=r"no config.json in .*"):
        resolve(tmp_path)
    with pytest.raises(EyasError, match="verifier not found"):
        resolve(tmp_path / "nope")


def test_config_without_text_model(make_tiny, tmp_path):
    d = _copy(make_tiny, "kimi_like", tmp_path)
    cfg = json.loads((d / "config.json").read_text())
    cfg["text_config"] = {"model_type": "deepseek_v3"}
    (d / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(EyasError, match=r"config.json: no text model found"):
        resolve(d)


def test_index_names_missing_shard(make_tiny, tmp_path):
    d = _copy(make_tiny, "kimi_like", tmp_path)
    (d / "model-00002-of-00003.safetensors").unlink()
    with pytest.raises(EyasError, match=r"model.safetensors.index.json names the shard model-00002-of-00003"):
        resolve(d)


def test_index_shard_outside_dir(make_tiny, tmp_path):
    d = _copy(make_tiny, "kimi_like", tmp_path)
    idx = json.loads((d / "model.safetensors.index.json").read_text())
    key = next(iter(idx["weight_map"]))
    idx["weight_map"][key] = "../evil.safetensors"
    (d / "model.safetensors.index.json").write_text(json.dumps(idx))
    with pytest.raises(EyasError, match="outside"):
        resolve(d)
    idx["weight_map"][key] = "link.safetensors"
    (d / "model.safetensors.index.json").write_text(json.dumps(idx))
    (tmp_path / "elsewhere.safetensors").write_bytes(b"x")
    (d / "link.safetensors").symlink_to(tmp_path / "elsewhere.safetensors")
    with pytest.raises(EyasError, match="link that leaves"):
        resolve(d)


def test_truncated_safetensors(make_tiny, tmp_path):
    d = _copy(make_tiny, "llama", tmp_path)
    f = d / "model.safetensors"
    data = f.read_bytes()
    f.write_bytes(data[: len(data) // 2])
    with pytest.raises(EyasError, match=r"model.safetensors is truncated: tensor '.*'"):
        resolve(d)
    f.write_bytes(data[:20])
    with pytest.raises(EyasError, match="truncated"):
        resolve(d)


def test_header_over_cap(make_tiny, tmp_path):
    d = _copy(make_tiny, "llama", tmp_path)
    (d / "model.safetensors").write_bytes(struct.pack("<Q", 1 << 40) + b"{}")
    with pytest.raises(EyasError, match="exceeds"):
        resolve(d)


def test_embedding_shape_disagrees_with_config(make_tiny, tmp_path):
    d = _copy(make_tiny, "llama", tmp_path)
    cfg = json.loads((d / "config.json").read_text())
    cfg["vocab_size"] = 1000
    (d / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(
        EyasError, match=r"embedding 'model.embed_tokens.weight' in model.safetensors has shape \[512, 64\]"
    ):
        resolve(d)


def test_untied_without_head(make_tiny, tmp_path):
    from safetensors.torch import load_file, save_file

    d = _copy(make_tiny, "llama", tmp_path)
    sd = load_file(str(d / "model.safetensors"))
    del sd["lm_head.weight"]
    save_file(sd, str(d / "model.safetensors"))
    with pytest.raises(EyasError, match="not tied"):
        resolve(d)


def test_unknown_text_model_is_not_runnable(make_tiny, tmp_path):
    d = _copy(make_tiny, "llama", tmp_path)
    cfg = json.loads((d / "config.json").read_text())
    cfg["model_type"] = "mystery"
    cfg.pop("architectures")
    (d / "config.json").write_text(json.dumps(cfg))
    info = resolve(d)
    assert not info.runnable and "mystery" in info.reasons[0]
    with pytest.raises(EyasError, match="cannot run"):
        build_text_model(info)


def test_text_model_type_transformers_does_not_know_falls_back_to_its_architectures(make_tiny, tmp_path):
    """A Kimi-K2 text config names itself `kimi_k2` (remote code) and `DeepseekV3ForCausalLM`: eyas runs it as
    transformers' DeepseekV3, and computes what the reference computes."""
    t = make_tiny("kimi_like")
    d = _copy(make_tiny, "kimi_like", tmp_path)
    cfg = json.loads((d / "config.json").read_text())
    cfg["text_config"] |= {"model_type": "kimi_k2", "architectures": ["DeepseekV3ForCausalLM"]}
    (d / "config.json").write_text(json.dumps(cfg))
    info = resolve(d)
    assert info.text_model_type == "deepseek_v3" and info.runnable
    ids = torch.tensor([[5, 9, 17, 33]])
    with torch.no_grad():
        torch.testing.assert_close(build_text_model(info)(ids).logits, t.reference()(ids).logits)


@pytest.mark.parametrize("name", ["llama", "qwen3", "gemma", "deepseek_v3", "kimi_like"])
def test_capture_equals_output_hidden_states(make_tiny, name):
    from eyas.verifier.load import HiddenStateCapture, forward_hidden_states

    t = make_tiny(name)
    info = resolve(t.path)
    model = build_text_model(info)
    ids = torch.randint(0, tiny.VOCAB, (2, 11), generator=torch.Generator().manual_seed(1))
    aux, last = forward_hidden_states(model, ids, layer_ids=info.aux_layer_ids)
    ref = t.reference()
    with torch.no_grad():
        out = ref(ids, output_hidden_states=True)
    want = torch.cat([out.hidden_states[i] for i in info.aux_layer_ids], dim=-1)
    assert torch.equal(aux, want)
    # the last output_hidden_states entry is normed; the captured one is the norm's input
    assert torch.equal(ref.model.norm(last), out.hidden_states[-1])
    # capture during a full forward with logits (as decoding does) sees the same states
    with torch.no_grad(), HiddenStateCapture(model, info.aux_layer_ids) as cap:
        model(ids)
    assert torch.equal(cap.aux(), want)


def test_varying_shape_attention_orders_sdpa_backends_on_cuda_only():
    """Extraction and online features run every batch at a new shape: on CUDA, SDPA must try flash and
    memory-efficient attention (no per-shape setup) before cuDNN (a plan per shape), with nothing disabled,
    and the previous order must come back after. Off CUDA nothing changes."""
    from torch.nn.attention import SDPBackend, _cur_sdpa_kernel_backends, sdpa_kernel

    from eyas.verifier.load import varying_shape_attention

    # cuDNN first, as torch orders them on an H200
    h200 = [SDPBackend.CUDNN_ATTENTION, SDPBackend.FLASH_ATTENTION, SDPBackend.EFFICIENT_ATTENTION, SDPBackend.MATH]
    with sdpa_kernel(h200, set_priority=True):
        before = _cur_sdpa_kernel_backends(with_priority=True)
        assert before[0] == SDPBackend.CUDNN_ATTENTION
        with varying_shape_attention("cuda"):
            inside = _cur_sdpa_kernel_backends(with_priority=True)
        assert inside[:2] == [SDPBackend.FLASH_ATTENTION, SDPBackend.EFFICIENT_ATTENTION]
        assert inside.index(SDPBackend.CUDNN_ATTENTION) > 1 and SDPBackend.MATH in inside
        assert _cur_sdpa_kernel_backends(with_priority=True) == before
        with varying_shape_attention("cpu"):
            assert _cur_sdpa_kernel_backends(with_priority=True) == before


def test_gguf_weights_cache_loads_the_same_model(smollm2_path, tmp_path):
    """Inside gguf_weights_cache (what `eyas run` and the demo wrap their stages in), SmolLM2's GGUF is
    dequantized once: the next load reads the kept safetensors copy and gives the same weights, tied head
    included, and the same logits; outside the block nothing is kept."""
    from eyas.verifier.load import gguf_weights_cache

    info = resolve(str(smollm2_path))
    with gguf_weights_cache(tmp_path / "cache"):
        first = build_text_model(info, dtype=torch.bfloat16)  # from the GGUF, then kept
        (kept,) = (tmp_path / "cache").iterdir()  # one whole copy, no temporary folder left
        again = build_text_model(info, dtype=torch.bfloat16)  # from the copy
    assert sorted(p.name for p in kept.iterdir()) == ["config.json", "model.safetensors"]
    a, b = first.state_dict(), again.state_dict()
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)
    assert again.lm_head.weight.data_ptr() == again.model.embed_tokens.weight.data_ptr()  # still tied
    x = torch.tensor([[1, 504, 3067, 314, 2030, 28]])
    with torch.no_grad():
        assert torch.equal(first(x).logits, again(x).logits)
    build_text_model(info, dtype=torch.float16)  # another dtype is another copy, but only inside the block
    assert len(list((tmp_path / "cache").iterdir())) == 1


def test_gguf_tokenizer_is_kept_beside_the_weights(smollm2_path, tmp_path, monkeypatch):
    """Inside gguf_weights_cache, SmolLM2's tokenizer is built from the GGUF once and kept: a later process (the
    in-process cache emptied) loads the copy without reading the GGUF, with the same ids, chat template and
    end-of-turn ids; outside the block nothing is kept."""
    import json as _json

    import transformers

    from eyas.data.chat import end_of_turn_ids
    from eyas.verifier import load
    from eyas.verifier.load import gguf_weights_cache, load_tokenizer

    texts = ["Hello, café ☕", "def f(x):\n    return x  # tabs\tand\nlines", "<|im_start|>user\nhi<|im_end|>"]
    chat = [{"role": "system", "content": "s"}, {"role": "user", "content": "q"}, {"role": "assistant", "content": "a"}]
    load._TOKENIZERS.clear()
    with gguf_weights_cache(tmp_path / "cache"):
        first = load_tokenizer(str(smollm2_path))
        (kept,) = (tmp_path / "cache").iterdir()  # one whole copy, no temporary folder left
        load._TOKENIZERS.clear()
        real = transformers.AutoTokenizer.from_pretrained

        def no_gguf(*args, **kwargs):
            assert "gguf_file" not in kwargs, "read the GGUF again"
            return real(*args, **kwargs)

        monkeypatch.setattr(transformers.AutoTokenizer, "from_pretrained", no_gguf)
        again = load_tokenizer(str(smollm2_path))
    assert kept.name.startswith("tokenizer-") and _json.loads((kept / "tokenizer_config.json").read_text())
    assert first(texts)["input_ids"] == again(texts)["input_ids"]
    assert first.apply_chat_template(chat, tokenize=False) == again.apply_chat_template(chat, tokenize=False)
    assert end_of_turn_ids(first) == end_of_turn_ids(again)
    load._TOKENIZERS.clear()
    monkeypatch.undo()
    load_tokenizer(str(smollm2_path))  # outside the block: from the GGUF, nothing kept
    assert len(list((tmp_path / "cache").iterdir())) == 1


def test_any_command_keeps_gguf_weights_where_the_environment_says(smollm2_path, tmp_path, monkeypatch):
    """With EYAS_GGUF_WEIGHTS set, a command outside `eyas run` (here `eyas prepare`, which loads the tokenizer)
    keeps what it built from the GGUF in that folder, for the next command; without it, nothing is kept."""
    import json as _json

    from eyas.cli import GGUF_WEIGHTS_ENV, main
    from eyas.verifier import load

    data = tmp_path / "chats.jsonl"
    data.write_text(_json.dumps({"messages": [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "hello"}]}) + "\n")  # fmt: skip
    load._TOKENIZERS.clear()
    monkeypatch.setenv(GGUF_WEIGHTS_ENV, str(tmp_path / "kept"))
    assert main(["prepare", "--verifier", str(smollm2_path), "--data", str(data), "--out", str(tmp_path / "p")]) == 0
    assert [p.name.split("-")[0] for p in (tmp_path / "kept").iterdir()] == ["tokenizer"]
    assert load._GGUF_CACHE is None  # only for the command's own run
    load._TOKENIZERS.clear()
    monkeypatch.delenv(GGUF_WEIGHTS_ENV)
    assert main(["prepare", "--verifier", str(smollm2_path), "--data", str(data), "--out", str(tmp_path / "q")]) == 0
    assert len(list((tmp_path / "kept").iterdir())) == 1
