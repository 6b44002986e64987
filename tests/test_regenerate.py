"""`eyas regenerate`: batched answers equal one-at-a-time plain decoding, turn by turn; resume; prepare reads it."""

from __future__ import annotations

import json

import pytest

import eyas.evaluate as ev
from eyas.datasets import resolve_source
from eyas.errors import EyasError
from eyas.regenerate import CONVERSATIONS, regenerate
from eyas.verifier import build_text_model, load_tokenizer, resolve

pytestmark = pytest.mark.usefixtures("one_thread")

TURNS = [
    ["Hello there", "And then?", "Why?"],
    ["Write a long story about a dog who learns to fly over the sea and back home", "Shorter, please"],
    ["Hi"],
    ["What is two plus two, and what is three plus three?", "Thanks", "Bye now"],
    ["x " * 600],  # past the tiny verifier's 1024 positions once the answer is added: skipped and counted
]
NEW = 10


@pytest.fixture
def source(tmp_path):
    path = tmp_path / "prompts.jsonl"
    path.write_text("".join(json.dumps({"id": f"p{i}", "turns": t}) + "\n" for i, t in enumerate(TURNS)))
    return path


@pytest.fixture
def verifier(make_tiny, monkeypatch, request):
    """A tiny verifier (the Llama unless the test names another layout), with one more end-of-turn id: a token
    its greedy answers use early, so that some answers finish (and a second turn follows) while others are cut
    at the token limit."""
    t = make_tiny(getattr(request, "param", "llama"))
    info = resolve(t.path)
    tok = load_tokenizer(info)
    model = build_text_model(info)
    real = ev.end_of_turn_ids(tok)
    runner = ev.VerifierRunner(model, aux_layer_ids=None, static=False)
    first = ev.plain_generate(runner, ev.encode_prompt(tok, [{"role": "user", "content": TURNS[0][0]}]),
                              max_new_tokens=NEW, eos_ids=set()).tokens  # fmt: skip
    eos = real | {first[3]}
    monkeypatch.setattr(ev, "end_of_turn_ids", lambda _tok: eos)
    return {"path": str(t.path), "tok": tok, "model": model, "eos": eos}


def _reference(model, tok, eos, prompts: dict[str, list[str]], *, new: int, limit: int):
    """Each prompt decoded alone with eval's plain decoding (its own KV cache, no padding), turn by turn, with
    regenerate's rules: a prompt past ``limit`` or an empty answer ends the conversation before that turn, a cut
    answer after it."""
    runner = ev.VerifierRunner(model, aux_layer_ids=None, static=False)
    out = {}
    for pid, turns in prompts.items():
        messages: list[dict[str, str]] = []
        for turn in turns:
            ids = ev.encode_prompt(tok, messages + [{"role": "user", "content": turn}])
            if len(ids) + new > limit:
                break
            toks = ev.plain_generate(runner, ids, max_new_tokens=new, eos_ids=eos).tokens
            finished = toks[-1] in eos
            text = tok.decode(toks[:-1] if finished else toks, skip_special_tokens=True).strip()
            if not text:
                break
            messages += [{"role": "user", "content": turn}, {"role": "assistant", "content": text}]
            if not finished:
                break
        if messages:
            out[pid] = messages
    return out


def _tiny_reference(v) -> dict[str, list[dict[str, str]]]:
    return _reference(v["model"], v["tok"], v["eos"], {f"p{i}": t for i, t in enumerate(TURNS)}, new=NEW,
                      limit=1024)  # fmt: skip


def _read(out) -> dict[str, list[dict[str, str]]]:
    return {r["id"]: r["messages"] for r in map(json.loads, (out / CONVERSATIONS).read_text().splitlines())}


@pytest.mark.parametrize("verifier", ["llama", "qwen3", "kimi_like"], indirect=True)  # kimi_like: nested, MoE
def test_batched_answers_equal_plain_decoding_turn_by_turn(verifier, source, tmp_path):
    out = tmp_path / "regen"
    m = regenerate(verifier=verifier["path"], data=str(source), out=str(out), max_new_tokens=NEW, batch_size=2)
    got, want = _read(out), _tiny_reference(verifier)
    assert got == want
    answers = [sum(msg["role"] == "assistant" for msg in c) for c in got.values()]
    assert max(answers) >= 2 and min(answers) == 1  # a second turn followed a finished answer; a cut one ended
    o = m["outputs"]
    assert o["prompts"] == 5 and o["conversations"] == len(want) == 4 and o["prompt_too_long"] == 1
    assert o["answers"] == sum(answers) and 0 < o["cut_at_max_new_tokens"] < o["answers"]
    # a rerun with the same inputs and settings skips itself
    assert regenerate(verifier=verifier["path"], data=str(source), out=str(out), max_new_tokens=NEW,
                      batch_size=2)["created"] == m["created"]  # fmt: skip
    # other settings: the old manifest goes first, so a crash never leaves it vouching for new answers
    import eyas.regenerate as rg

    def crash(*args, **kwargs):
        raise KeyboardInterrupt

    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(rg, "_answer", crash)
        with pytest.raises(KeyboardInterrupt):
            regenerate(verifier=verifier["path"], data=str(source), out=str(out), max_new_tokens=NEW + 1)
    assert not (out / "manifest.json").exists()
    with pytest.raises(EyasError, match="unfinished `eyas regenerate` output"):
        resolve_source(out)


def test_interrupted_run_resumes_and_prepare_reads_the_answers(verifier, source, tmp_path, monkeypatch):
    import eyas.regenerate as rg
    from eyas.data import prepare
    from eyas.datasets import load_prepared

    monkeypatch.setattr(rg, "PART", 2)  # three parts of work
    kw = dict(verifier=verifier["path"], data=str(source), max_new_tokens=NEW, batch_size=3, temperature=0.8, seed=5)
    regenerate(out=str(tmp_path / "whole"), **kw)
    calls, answer = [], rg._answer

    def crash_on_third_part(prompts, *args, **kwargs):
        calls.append(len(prompts))
        if len(calls) == 3:
            raise KeyboardInterrupt
        return answer(prompts, *args, **kwargs)

    monkeypatch.setattr(rg, "_answer", crash_on_third_part)
    out = tmp_path / "resumed"
    with pytest.raises(KeyboardInterrupt):
        regenerate(out=str(out), **kw)
    assert not (out / CONVERSATIONS).exists()  # nothing that looks finished
    with pytest.raises(EyasError, match="unfinished `eyas regenerate` output .*; run the same command again"):
        prepare(verifier=verifier["path"], data=str(out), out=str(tmp_path / "prep"))
    calls.clear()
    monkeypatch.setattr(rg, "_answer", answer)
    m = regenerate(out=str(out), **kw)
    assert m["timing"]["resumed_parts"] == 2
    assert _read(out) == _read(tmp_path / "whole")  # sampled, seeded per part: the same answers
    assert not (out / ".parts").exists()

    prepare(verifier=verifier["path"], data=str(out), out=str(tmp_path / "prep"))
    ds, pm = load_prepared(tmp_path / "prep")
    assert pm["outputs"]["rows"] == m["outputs"]["conversations"]
    tok = verifier["tok"]
    lines = [json.loads(line) for line in (out / CONVERSATIONS).read_text().splitlines()]
    for row in ds:
        ids = [t for t, keep in zip(row["input_ids"], row["loss_mask"]) if keep]
        said = "".join(msg["content"] for msg in lines[row["row_id"]]["messages"] if msg["role"] == "assistant")
        # the masked tokens are the verifier's answers, each closed by its end-of-turn token
        assert tok.decode(ids, skip_special_tokens=True).replace(" ", "") == said.replace(" ", "")


def test_bad_settings_are_refused_before_loading_anything(source, tmp_path):
    for kw, match in [({"max_new_tokens": 0}, "--max-new-tokens"), ({"batch_size": 0}, "--batch-size"),
                      ({"max_turns": 0}, "--max-turns"), ({"temperature": -1.0}, "--temperature"),
                      ({"dtype": "int8"}, "--dtype")]:  # fmt: skip
        with pytest.raises(EyasError, match=match):
            regenerate(verifier="no/such/dir", data=str(source), out=str(tmp_path / "x"), **kw)


def test_torchrun_two_cpu_ranks_equal_one_process(make_tiny, tmp_path):
    """Under torchrun the parts are dealt out to the ranks; the conversations are those one process writes."""
    import os
    import subprocess
    import sys
    from pathlib import Path

    import eyas.regenerate as rg

    t = make_tiny("llama")
    src = tmp_path / "many.jsonl"
    n = rg.PART + 6  # two parts: one for each rank
    src.write_text("".join(json.dumps({"turns": [f"Question {i}: " + "why " * (i % 7), "More?"]}) + "\n"
                           for i in range(n)))  # fmt: skip
    kw = {"max_new_tokens": 4, "batch_size": 8, "device": "cpu"}
    one = regenerate(verifier=str(t.path), data=str(src), out=str(tmp_path / "one"), **kw)
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2", "-m", "eyas.cli",
           "regenerate", "--verifier", str(t.path), "--data", str(src), "--out", str(tmp_path / "two"),
           *[x for k, v in kw.items() for x in (f"--{k.replace('_', '-')}", str(v))]]  # fmt: skip
    env = {**os.environ, "OMP_NUM_THREADS": "1", "HF_HUB_OFFLINE": "1", "TOKENIZERS_PARALLELISM": "false",
           "PYTHONPATH": str(Path(rg.__file__).parents[1]) + os.pathsep + os.environ.get("PYTHONPATH", "")}  # fmt: skip
    r = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stdout[-2000:] + r.stderr[-4000:]
    two = json.loads((tmp_path / "two" / "manifest.json").read_text())
    assert two["timing"]["ranks"] == 2 and two["outputs"] == one["outputs"] and one["outputs"]["prompts"] == n
    assert (tmp_path / "two" / CONVERSATIONS).read_text() == (tmp_path / "one" / CONVERSATIONS).read_text()


def test_smollm2_answers_both_turns_and_ends_each_itself(smollm2_path, smollm2_model, tmp_path):
    """The real SmolLM2 through its GGUF and chat template: short answers end at its own <|im_end|>, so the
    second turn follows the first; batched (left-padded) answers equal eval's plain decoding of each alone."""
    src = tmp_path / "q.jsonl"
    turns = [["What is 2 + 2? Reply with just the number.", "And 3 + 3? Reply with just the number."],
             ["What is 5 + 5? Reply with just the number.", "And 1 + 1? Reply with just the number."]]  # fmt: skip
    src.write_text("".join(json.dumps({"turns": t}) + "\n" for t in turns))
    m = regenerate(verifier="smollm2", data=str(src), out=str(tmp_path / "out"), max_new_tokens=24, batch_size=2)
    assert m["outputs"]["answers"] == 4 and m["outputs"]["cut_at_max_new_tokens"] == 0
    got = _read(tmp_path / "out")
    tok = load_tokenizer(resolve(smollm2_path))
    want = _reference(smollm2_model, tok, ev.end_of_turn_ids(tok), {str(i): t for i, t in enumerate(turns)},
                      new=24, limit=smollm2_model.config.max_position_embeddings)  # fmt: skip
    assert got == want
    for conv, numbers in zip(want.values(), (["4", "6"], ["10", "2"])):  # both turns answered, and rightly
        said = [m["content"] for m in conv if m["role"] == "assistant"]
        assert len(said) == 2 and all(n in a for n, a in zip(numbers, said))


def test_no_answer_at_all_is_an_error_and_writes_nothing(make_tiny, source, tmp_path):
    """The tiny random Gemma answers with special tokens only: every answer is empty (one prompt is too long)."""
    out = tmp_path / "none"
    with pytest.raises(EyasError, match=r"answered none of the 5 prompts .* empty \(4\) or its prompt too long \(1\)"):
        regenerate(verifier=str(make_tiny("gemma").path), data=str(source), out=str(out), max_new_tokens=NEW)
    assert not (out / CONVERSATIONS).exists() and not (out / "manifest.json").exists()
    assert not list(out.glob(".*.tmp-*"))  # nor a temporary beside them
