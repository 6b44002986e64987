"""``eyas prepare``: exact loss masks through real chat templates (SmolLM2's ChatML, Llama-3.1, Qwen3 with
thinking), overflow handling, drops that are counted, resumability, and property tests over random chats.

The reference for "the assistant's tokens" is independent of eyas: what each real template writes for an
assistant turn, spelled out here in Python (ChatML: the content; Llama-3.1: the content ``|trim``-ed;
Qwen3: the answer, with the ``<think>`` block re-emitted only on the turn after the last user turn).
"""

from __future__ import annotations

import hashlib
import json
import os
import re
import shutil

import chat_templates as C
import numpy as np
import pytest
import tiny
from hypothesis import HealthCheck, assume, given, settings
from hypothesis import strategies as st

from eyas.stages import prepare as D
from eyas.data.chat import ChatTemplate
from eyas.cli import main as cli_main
from eyas.data.prepared import load_prepared
from eyas.core.errors import EyasError


def runs(ids, mask) -> list[list[int]]:
    """The token ids of each contiguous run of mask == 1."""
    mask = np.asarray(mask, dtype=np.int8)
    edges = np.diff(np.concatenate([[0], mask, [0]]))
    return [list(ids[a:b]) for a, b in zip(np.where(edges == 1)[0], np.where(edges == -1)[0])]


def decode(tok, ids) -> str:
    return tok.decode(list(map(int, ids)), skip_special_tokens=False, clean_up_tokenization_spaces=False)


def chatml_turns(msgs):
    return [m["content"] + "<|im_end|>" for m in msgs if m["role"] == "assistant"]


def llama31_turns(msgs):
    return [m["content"].strip() + "<|eot_id|>" for m in msgs if m["role"] == "assistant"]


def qwen3_turns(msgs):
    """What Qwen3's template writes for each assistant turn (its jinja, restated in Python)."""
    last_query = max(i for i, m in enumerate(msgs) if m["role"] == "user")
    out = []
    for i, m in enumerate(msgs):
        if m["role"] != "assistant":
            continue
        content, reasoning = m["content"], ""
        if "</think>" in content:
            reasoning = content.split("</think>")[0].rstrip("\n").split("<think>")[-1].lstrip("\n")
            content = content.split("</think>")[-1].lstrip("\n")
        if i > last_query and (i == len(msgs) - 1 or reasoning):
            out.append("<think>\n" + reasoning.strip("\n") + "\n</think>\n\n" + content.lstrip("\n") + "<|im_end|>")
        else:
            out.append(content + "<|im_end|>")
    return out


CONVS = [
    [{"role": "user", "content": "What is 2+2?"}, {"role": "assistant", "content": "4."}],
    [{"role": "system", "content": "You are terse."}, {"role": "user", "content": "Name a colour."},
     {"role": "assistant", "content": "Blue."}, {"role": "user", "content": "Another?"},
     {"role": "assistant", "content": "  Green, with spaces and\nnewlines.\n\n"}],
    [{"role": "user", "content": "Think first."},
     {"role": "assistant", "content": "<think>\nLet me see: 3*3.\n</think>\n\nNine."},
     {"role": "user", "content": "And 4*4?"},
     {"role": "assistant", "content": "<think>Easy.</think>Sixteen, naturally."}],
    [{"role": "user", "content": "Unicode: é 中文 🙂"}, {"role": "assistant", "content": "Ça va 🙂 — 好的"},
     {"role": "user", "content": "Code?"}, {"role": "assistant", "content": "def f(x):\n    return x * 2\n"}],
]  # fmt: skip


def write_jsonl(path, convs, layout="openai"):
    with open(path, "w") as f:
        for c in convs:
            if layout == "openai":
                f.write(json.dumps({"messages": c}) + "\n")
            else:
                roles = {"user": "human", "assistant": "gpt", "system": "system"}
                turns = [{"from": roles[m["role"]], "value": m["content"]} for m in c]
                f.write(json.dumps({"conversations": turns}) + "\n")
    return path


@pytest.fixture(scope="module")
def verifiers(make_tiny, tmp_path_factory):
    base = make_tiny("llama").path
    root = tmp_path_factory.mktemp("templated")
    return {
        "llama31": C.verifier_with(C.llama31_tokenizer(), base, root / "llama31"),
        "qwen3": C.verifier_with(C.qwen3_tokenizer(), base, root / "qwen3"),
    }


@pytest.fixture(scope="module")
def smollm2_tok():
    from eyas.verifier.load import load_tokenizer

    return load_tokenizer("smollm2")


def check_masks(out, tok, convs, expected_turns):
    """Every masked run decodes to exactly its turn's text plus the end-of-turn token; the whole row
    decodes to the template's rendering; never two BOS tokens at the start."""
    ds, manifest = load_prepared(out)
    assert ds.num_rows == len(convs)
    for r in ds:
        ids, mask = np.asarray(r["input_ids"]), np.asarray(r["loss_mask"])
        msgs = convs[r["row_id"]]
        assert [decode(tok, x) for x in runs(ids, mask)] == expected_turns(msgs)
        assert decode(tok, ids) == tok.apply_chat_template(msgs, tokenize=False)
        if tok.bos_token:
            assert not ids[0] == ids[1] == tok.convert_tokens_to_ids(tok.bos_token)
        assert r["seq_len"] == len(ids)
    return ds, manifest


def test_smollm2_chatml_masks_are_exact(tmp_path, smollm2_tok):
    src = write_jsonl(tmp_path / "chats.jsonl", CONVS, layout="sharegpt")
    manifest = D.prepare(verifier="smollm2", data=str(src), out=str(tmp_path / "out"), num_proc=1)
    ds, _ = check_masks(tmp_path / "out", smollm2_tok, CONVS, chatml_turns)
    row = next(iter(ds))
    text = decode(smollm2_tok, np.asarray(row["input_ids"])[np.asarray(row["loss_mask"]) == 0])
    assert "You are a helpful AI assistant named SmolLM" in text  # the template's default system prompt: unmasked
    assert manifest["outputs"]["masked_tokens"] == sum(sum(r["loss_mask"]) for r in ds)
    assert manifest["end_of_turn"] == {"token": "<|im_end|>", "id": 2}
    from eyas.data.chat import chat_template_hash

    assert manifest["inputs"]["chat_template_sha256"] == chat_template_hash(smollm2_tok)


def test_llama31_masks_are_exact_and_bos_is_not_doubled(tmp_path, verifiers):
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(verifiers["llama31"])
    bos = tok.convert_tokens_to_ids("<|begin_of_text|>")
    assert tok("hi").input_ids[0] == bos  # the tokenizer itself would add a BOS to plain text
    D.prepare(verifier=str(verifiers["llama31"]), data=str(write_jsonl(tmp_path / "c.jsonl", CONVS)),
              out=str(tmp_path / "out"), num_proc=1)  # fmt: skip
    ds, _ = check_masks(tmp_path / "out", tok, CONVS, llama31_turns)
    for r in ds:
        assert r["input_ids"][0] == bos and r["input_ids"].count(bos) == 1


def test_qwen3_thinking_masks_are_exact(tmp_path, verifiers):
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(verifiers["qwen3"])
    D.prepare(verifier=str(verifiers["qwen3"]), data=str(write_jsonl(tmp_path / "c.jsonl", CONVS)),
              out=str(tmp_path / "out"), num_proc=1)  # fmt: skip
    ds, _ = check_masks(tmp_path / "out", tok, CONVS, qwen3_turns)
    think = next(r for r in ds if r["row_id"] == 2)
    turns = [decode(tok, x) for x in runs(np.asarray(think["input_ids"]), think["loss_mask"])]
    # the earlier turn's reasoning is stripped by the template (so it is neither in the text nor in the mask);
    # the last turn's reasoning is rendered and masked
    assert turns == ["Nine.<|im_end|>", "<think>\nEasy.\n</think>\n\nSixteen, naturally.<|im_end|>"]


def test_reasoning_content_field_is_rendered_by_qwen3(tmp_path, verifiers):
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(verifiers["qwen3"])
    rec = {"messages": [{"role": "user", "content": "Q"},
                        {"role": "assistant", "content": "A.", "reasoning_content": "Because."}]}  # fmt: skip
    (tmp_path / "r.jsonl").write_text(json.dumps(rec) + "\n")
    D.prepare(verifier=str(verifiers["qwen3"]), data=str(tmp_path / "r.jsonl"), out=str(tmp_path / "o"), num_proc=1)
    (row,) = load_prepared(tmp_path / "o")[0]
    assert [decode(tok, x) for x in runs(np.asarray(row["input_ids"]), row["loss_mask"])] == [
        "<think>\nBecause.\n</think>\n\nA.<|im_end|>"
    ]


def test_token_straddling_a_turn_start_is_split_exactly(tmp_path, make_tiny):
    corpus = ["<|im_start|>assistant\nHello world, hello there.<|im_end|>\n"] * 20 + tiny.CORPUS
    tok = C.chat_tokenizer(C.QWEN3_SPECIALS, bos=None, eos="<|im_end|>", template=tiny.CHATML, use_regex=False,
                           corpus=corpus)  # fmt: skip
    assert "ĊHello" in "".join(tok.tokenize("assistant\nHello"))  # BPE merges across the header's newline
    ver = C.verifier_with(tok, make_tiny("llama").path, tmp_path / "merging")
    convs = [[{"role": "user", "content": "Say hi"}, {"role": "assistant", "content": "Hello world, hello there."}]]
    m = D.prepare(verifier=str(ver), data=str(write_jsonl(tmp_path / "c.jsonl", convs)), out=str(tmp_path / "o"),
                  num_proc=1)  # fmt: skip
    assert m["outputs"]["rows_split_at_turn_boundaries"] == 1
    check_masks(tmp_path / "o", tok, convs, chatml_turns)


def test_template_without_end_of_turn_is_refused(tmp_path, make_tiny):
    plain = "{% for m in messages %}{{ m['role'] }}: {{ m['content'] }}\n{% endfor %}"
    tok = C.chat_tokenizer(C.QWEN3_SPECIALS, bos=None, eos="<|im_end|>", template=plain)
    ver = C.verifier_with(tok, make_tiny("llama").path, tmp_path / "plain")
    with pytest.raises(EyasError, match="cannot tell where an assistant turn ends"):
        D.prepare(verifier=str(ver), data=str(write_jsonl(tmp_path / "c.jsonl", CONVS)), out=str(tmp_path / "o"))


def test_template_that_cannot_be_split_is_refused(tmp_path, make_tiny):
    # the generation prompt says "bot" but a finished assistant turn says "assistant": no prefix to split at
    odd = tiny.CHATML.replace("'<|im_start|>assistant\n'", "'<|im_start|>bot\n'")
    assert odd != tiny.CHATML
    tok = C.chat_tokenizer(C.QWEN3_SPECIALS, bos=None, eos="<|im_end|>", template=odd)
    ver = C.verifier_with(tok, make_tiny("llama").path, tmp_path / "odd")
    with pytest.raises(EyasError, match="cannot be split at turn boundaries"):
        D.prepare(verifier=str(ver), data=str(write_jsonl(tmp_path / "c.jsonl", CONVS)), out=str(tmp_path / "o"))


def test_chat_template_flag_for_a_base_verifier(tmp_path, make_tiny, capsys):
    """A verifier without a chat template is refused with the way forward; --chat-template FILE masks through
    that template (configs/completion.jinja: prompt, then the answer closed by EOS) and records its hash; a
    checkpoint given instead lends its own template, hash and all."""
    from eyas.data.chat import chat_template_hash
    from eyas.verifier.load import load_tokenizer

    base_verifier = C.without_template(make_tiny("llama").path, tmp_path / "base")
    COMPLETION = str(C.COMPLETION)
    src = str(write_jsonl(tmp_path / "c.jsonl", CONVS[:2]))
    with pytest.raises(EyasError, match="has no chat template; .* give --chat-template FILE"):
        D.prepare(verifier=str(base_verifier), data=src, out=str(tmp_path / "refused"), num_proc=1)
    m = D.prepare(verifier=str(base_verifier), data=src, out=str(tmp_path / "o"), chat_template=COMPLETION,
                  num_proc=1)  # fmt: skip
    text = C.COMPLETION.read_text()
    assert m["inputs"]["chat_template_sha256"] == hashlib.sha256(text.encode()).hexdigest()
    assert m["chat_template"] == COMPLETION and m["end_of_turn"]["token"] == "<|im_end|>"
    tok = load_tokenizer(str(base_verifier), chat_template=COMPLETION)
    check_masks(tmp_path / "o", tok, CONVS[:2], chatml_turns)  # each answer and its EOS, nothing else
    assert decode(tok, load_prepared(tmp_path / "o")[0][0]["input_ids"]) == "<|im_start|>What is 2+2?\n\n4.<|im_end|>"

    llama = make_tiny("llama").path
    m = D.prepare(verifier=str(base_verifier), data=src, out=str(tmp_path / "o2"), chat_template=str(llama),
                  num_proc=1)  # fmt: skip
    assert m["inputs"]["chat_template_sha256"] == chat_template_hash(load_tokenizer(str(llama)))
    check_masks(tmp_path / "o2", load_tokenizer(str(llama)), CONVS[:2], chatml_turns)

    assert cli_main(["prepare", "--verifier", str(base_verifier), "--data", src, "--out", str(tmp_path / "o3"),
                     "--num-proc", "1", "--chat-template", str(tmp_path / "missing.jinja")]) == 2  # fmt: skip
    assert "--chat-template" in capsys.readouterr().err and not (tmp_path / "o3").exists()
    assert cli_main(["prepare", "--verifier", str(base_verifier), "--data", src, "--out", str(tmp_path / "o4"),
                     "--num-proc", "1", "--chat-template", COMPLETION]) == 0  # fmt: skip


def test_overflow_truncates_at_a_turn_boundary_or_drops(tmp_path, verifiers):
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(verifiers["qwen3"])
    long = [{"role": "user", "content": "Tell me."}, {"role": "assistant", "content": "Short answer."},
            {"role": "user", "content": "More?"}, {"role": "assistant", "content": "word " * 200}]  # fmt: skip
    huge = [{"role": "user", "content": "x " * 300}, {"role": "assistant", "content": "ok"}]
    src = write_jsonl(tmp_path / "c.jsonl", [CONVS[0], long, huge])
    full = len(tok.apply_chat_template(long, tokenize=True)["input_ids"])
    m = D.prepare(verifier=str(verifiers["qwen3"]), data=str(src), out=str(tmp_path / "t"), max_seq_len=100, num_proc=1)
    assert full > 100
    assert m["outputs"]["truncated_rows"] == 1 and m["outputs"]["dropped_by_reason"] == {"too_long": 1}
    assert m["report"]["problems"]["too_long"]["rows"] == [2]
    ds, _ = load_prepared(tmp_path / "t")
    cut = next(r for r in ds if r["row_id"] == 1)
    assert cut["seq_len"] <= 100 and cut["input_ids"][-1] == tok.convert_tokens_to_ids("<|im_end|>")
    assert [decode(tok, x) for x in runs(np.asarray(cut["input_ids"]), cut["loss_mask"])] == ["Short answer.<|im_end|>"]
    m = D.prepare(verifier=str(verifiers["qwen3"]), data=str(src), out=str(tmp_path / "d"), max_seq_len=100,
                  on_overflow="drop", num_proc=1)  # fmt: skip
    assert m["outputs"]["rows"] == 1 and m["outputs"]["dropped_by_reason"] == {"too_long": 2}


def test_loop_tails_unscored_keep_the_text_and_score_one_copy(tmp_path, verifiers):
    """``--loop-tails unscored``: the same tokens; an assistant turn ending in a repetition loop scores the text
    before the loop, its first copy and the end of turn, and nothing of the other copies; a turn without a loop
    scores as before; the manifest counts what it unscored, and the default records nothing new (outputs made
    before the option stay up to date)."""
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(verifiers["qwen3"])
    loop = "Here is my answer. " + "The product is a product that can be sold to clients. " * 12
    conv = [{"role": "user", "content": "Tell me."}, {"role": "assistant", "content": "Short answer."},
            {"role": "user", "content": "More?"}, {"role": "assistant", "content": loop}]  # fmt: skip
    src = write_jsonl(tmp_path / "c.jsonl", [conv, CONVS[0]])
    kw = dict(verifier=str(verifiers["qwen3"]), data=str(src), max_seq_len=512, num_proc=1)
    scored = D.prepare(out=str(tmp_path / "s"), **kw)
    unscored = D.prepare(out=str(tmp_path / "u"), loop_tails="unscored", **kw)
    assert "loop_tails" not in scored["settings"] and unscored["settings"]["loop_tails"] == "unscored"
    (a, _), (b, _) = load_prepared(tmp_path / "s"), load_prepared(tmp_path / "u")
    assert [r["input_ids"] for r in a] == [r["input_ids"] for r in b]
    assert a[1]["loss_mask"] == b[1]["loss_mask"]  # no loop: unchanged
    turns = [decode(tok, x) for x in runs(np.asarray(b[0]["input_ids"]), b[0]["loss_mask"])]
    # the first turn whole; the looping one up to one copy of the loop; its end of turn still scored
    assert turns[0] == "Short answer.<|im_end|>" and turns[-1] == "<|im_end|>" and len(turns) == 3, turns
    assert "Here is my answer. " in turns[1] and turns[1].count("sold to clients") == 1, turns
    lost = sum(a[0]["loss_mask"]) - sum(b[0]["loss_mask"])
    assert lost > 100 and unscored["outputs"]["loop_tokens_unscored"] == lost
    assert unscored["outputs"]["loop_rows"] == 1 and "loop_rows" not in scored["outputs"]


def test_bad_rows_are_counted_and_strict_stops(tmp_path, verifiers):
    lines = [
        json.dumps({"conversations": [{"from": "human", "value": "hi"}, {"from": "gpt", "value": "hello"}]}),
        "{not json",
        json.dumps({"conversations": [{"from": "human", "value": "only a question"}]}),
        json.dumps({"conversations": [{"from": "human", "value": "q"}, {"from": "gpt", "value": "a <|im_end|> b"}]}),
        json.dumps({"conversations": [{"from": "human", "value": "q"}, {"from": "gpt", "value": "a"},
                                      {"from": "wizard", "value": "?"}]}),
    ]  # fmt: skip
    (tmp_path / "c.jsonl").write_text("\n".join(lines) + "\n")
    m = D.prepare(verifier=str(verifiers["qwen3"]), data=str(tmp_path / "c.jsonl"), out=str(tmp_path / "o"), num_proc=1)
    o, problems = m["outputs"], m["report"]["problems"]
    assert (o["rows_in"], o["rows"]) == (5, 2)
    assert o["dropped_by_reason"] == {"malformed": 1, "no_assistant": 1, "control_token_in_text": 1}
    assert problems["malformed"]["rows"] == [1] and problems["no_assistant"]["rows"] == [2]
    assert problems["control_token_in_text"]["rows"] == [3] and problems["unknown_role"]["rows"] == [4]
    assert sorted(load_prepared(tmp_path / "o")[0]["row_id"]) == [0, 4]
    with pytest.raises(EyasError, match=r"c\.jsonl: row 1 .*malformed"):
        D.prepare(verifier=str(verifiers["qwen3"]), data=str(tmp_path / "c.jsonl"), out=str(tmp_path / "s"),
                  strict=True)  # fmt: skip


def test_rerun_skips_and_pool_matches_in_process(tmp_path, verifiers, capsys):
    convs = [CONVS[i % len(CONVS)] for i in range(3 * D.CHUNK)]
    src = str(write_jsonl(tmp_path / "c.jsonl", convs))
    ver = str(verifiers["llama31"])
    D.prepare(verifier=ver, data=src, out=str(tmp_path / "one"), num_proc=1)
    D.prepare(verifier=ver, data=src, out=str(tmp_path / "two"), num_proc=2)
    a, b = load_prepared(tmp_path / "one")[0], load_prepared(tmp_path / "two")[0]
    assert a.to_dict() == b.to_dict() and a.num_rows == len(convs)
    stamp = os.stat(tmp_path / "two" / "rows").st_mtime_ns
    capsys.readouterr()
    D.prepare(verifier=ver, data=src, out=str(tmp_path / "two"), num_proc=2)
    assert "up to date" in capsys.readouterr().out
    assert os.stat(tmp_path / "two" / "rows").st_mtime_ns == stamp
    moved = shutil.copy(src, tmp_path / "moved.jsonl")  # the same data read from elsewhere: still up to date
    D.prepare(verifier=ver, data=str(moved), out=str(tmp_path / "two"), num_proc=2)
    assert "up to date" in capsys.readouterr().out
    assert os.stat(tmp_path / "two" / "rows").st_mtime_ns == stamp
    short = min(a["seq_len"])
    m = D.prepare(verifier=ver, data=src, out=str(tmp_path / "two"), max_seq_len=short, num_proc=1)  # a new setting
    assert m["settings"]["max_seq_len"] == short and 0 < m["outputs"]["rows"] < len(convs)


def test_prompt_only_sets_and_remote_code(tmp_path, make_tiny):
    with pytest.raises(EyasError, match="prompt-only"):
        D.prepare(verifier=str(make_tiny("llama").path), data="mt-bench", out=str(tmp_path / "o"))
    ver = tmp_path / "remote"
    shutil.copytree(make_tiny("llama").path, ver)
    (ver / "helper.py").write_text("X = 1\n")  # checkpoint code, recorded by hash when allowed
    src = write_jsonl(tmp_path / "c.jsonl", CONVS[:1])
    m = D.prepare(verifier=str(ver), data=str(src), out=str(tmp_path / "r"), trust_remote_code=True, num_proc=1)
    assert list(m["inputs"]["remote_code"]) == ["helper.py"]
    m = D.prepare(verifier=str(ver), data=str(src), out=str(tmp_path / "n"), num_proc=1)
    assert "remote_code" not in m["inputs"]


def test_cli_prepare(tmp_path, verifiers, capsys):
    src = write_jsonl(tmp_path / "c.jsonl", CONVS)
    assert cli_main(["prepare", "--verifier", str(verifiers["qwen3"]), "--data", str(src), "--out",
                     str(tmp_path / "o"), "--max-seq-len", "512", "--num-proc", "1"]) == 0  # fmt: skip
    assert re.search(r"4 rows written", capsys.readouterr().out)
    assert cli_main(["prepare", "--verifier", str(verifiers["qwen3"]), "--data", str(tmp_path / "nope.jsonl"),
                     "--out", str(tmp_path / "o2")]) == 2  # fmt: skip
    assert "data not found" in capsys.readouterr().err


# --------------------------------------------------------------------------- property tests

# Any character of the Basic Multilingual Plane, plus control-token and <think> fragments now and then.
CHARS = st.characters(max_codepoint=0xFFFF, blacklist_categories=("Cs",))
TEXT = st.text(CHARS, max_size=40)
FRAGMENTS = st.sampled_from(["<|im_end|>", "<|eot_id|>", "<think>"])
BODY = st.one_of(*[st.text(CHARS, min_size=1, max_size=60)] * 5, FRAGMENTS)
CONTENT = st.builds(lambda pre, body, post: pre + body + post,
                    st.sampled_from(["", " ", "\n", "\n\n", "  \t"]), BODY.filter(str.strip),
                    st.sampled_from(["", " ", "\n", "\n\n"]))  # fmt: skip
THINKING = st.one_of(CONTENT, st.builds(lambda r, a: f"<think>{r}</think>{a}", TEXT, CONTENT))


@st.composite
def conversations(draw, content=CONTENT):
    msgs = [{"role": "system", "content": draw(CONTENT)}] if draw(st.booleans()) else []
    for _ in range(draw(st.integers(1, 4))):
        msgs.append({"role": "user", "content": draw(CONTENT)})
        msgs.append({"role": "assistant", "content": draw(content)})
    return msgs


def encode_one(template, msgs):
    D._init_worker(D._Job(template, 1 << 20, "truncate"))
    res = D._encode_chunk([(0, msgs)])
    return res["ids"], res["mask"], res["notes"]


@pytest.fixture(scope="module")
def templates(smollm2_tok):
    return {
        "chatml": ChatTemplate(smollm2_tok, where="smollm2"),
        "llama31": ChatTemplate(C.llama31_tokenizer(), where="llama31"),
        "qwen3": ChatTemplate(C.qwen3_tokenizer(), where="qwen3"),
    }


EXPECTED = {"chatml": chatml_turns, "llama31": llama31_turns, "qwen3": qwen3_turns}


@pytest.mark.parametrize("name", ["chatml", "llama31", "qwen3"])
@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(data=st.data())
def test_masks_align_with_turns_on_random_chats(templates, name, data):
    t = templates[name]
    msgs = data.draw(conversations(THINKING if name == "qwen3" else CONTENT))
    # a tokenizer without some byte in its vocab cannot spell every character: not what is tested here
    assume(all(decode(t.tok, t.tok.encode(m["content"], add_special_tokens=False)) == m["content"] for m in msgs))
    ids, mask, notes = encode_one(t, msgs)
    if any(t.control_re.search(m["content"]) for m in msgs):
        assert [n[0] for n in notes] == ["control_token_in_text"] and len(ids) == 0
        return
    assert notes == []
    assert [decode(t.tok, x) for x in runs(ids, mask)] == EXPECTED[name](msgs)
    assert decode(t.tok, ids) == t.render(msgs)


@pytest.mark.parametrize(("on_overflow", "max_len"), [("truncate", 64), ("drop", 200)])
def test_long_rows_tokenized_by_prefix_match_whole_rows(templates, monkeypatch, on_overflow, max_len):
    """The prefix shortcut for long rows (cut after an end-of-turn token) gives exactly what tokenizing the
    whole row gives, whether the prefix already overflows or has to be redone in full."""
    t = templates["qwen3"]
    spaces = "x" + " " * 300  # many characters per token: the prefix under-fills and is redone
    chats = [CONVS[1], CONVS[3]] + [
        [m for i in range(k) for m in ({"role": "user", "content": f"question {i} " * (k + 1)},
                                       {"role": "assistant", "content": (f"answer {i} " * 9) if k % 2 else spaces})]
        for k in range(1, 9)
    ]  # fmt: skip
    chunk = list(enumerate(chats))

    def run(cap):
        monkeypatch.setattr(D, "CHARS_PER_TOKEN_CAP", cap)
        D._init_worker(D._Job(t, max_len, on_overflow))
        res = D._encode_chunk(chunk)
        return res["ids"].tolist(), res["mask"].tolist(), res["rows"].tolist(), [n[:2] for n in res["notes"]]

    whole = run(10**9)
    assert whole[2] and len(whole[3]) > 2  # some rows kept, several truncated or dropped
    for cap in (1, 2, 4, 8):
        assert run(cap) == whole


def test_interrupted_run_resumes_from_finished_parts(tmp_path, verifiers, monkeypatch):
    monkeypatch.setattr(D, "CHUNK", 2)
    monkeypatch.setattr(D, "PART", 1)
    convs = [CONVS[i % len(CONVS)] for i in range(9)]
    src, ver = str(write_jsonl(tmp_path / "c.jsonl", convs)), str(verifiers["qwen3"])
    clean = D.prepare(verifier=ver, data=src, out=str(tmp_path / "clean"), num_proc=1)
    real, calls = D._encode_chunk, []

    def dies_on_the_third_chunk(chunk):
        calls.append(1)
        if len(calls) == 3:
            raise KeyboardInterrupt
        return real(chunk)

    monkeypatch.setattr(D, "_encode_chunk", dies_on_the_third_chunk)
    with pytest.raises(KeyboardInterrupt):
        D.prepare(verifier=ver, data=src, out=str(tmp_path / "o"), num_proc=1)
    assert not (tmp_path / "o" / "rows").exists() and not (tmp_path / "o" / "manifest.json").exists()
    assert len(list((tmp_path / "o" / ".parts").rglob("*.arrow"))) == 2
    monkeypatch.setattr(D, "_encode_chunk", real)
    calls.clear()
    resumed = D.prepare(verifier=ver, data=src, out=str(tmp_path / "o"), num_proc=1)
    assert resumed["timing"]["resumed_parts"] == 2 and not (tmp_path / "o" / ".parts").exists()
    assert resumed["outputs"] == clean["outputs"] and resumed["report"] == clean["report"]
    assert load_prepared(tmp_path / "o")[0].to_dict() == load_prepared(tmp_path / "clean")[0].to_dict()
