"""`eyas regenerate`: batched answers equal one-at-a-time plain decoding, turn by turn; resume; prepare reads it."""

from __future__ import annotations

import json

import pytest

import eyas.engine.speculative as speculative
import eyas.data.chat as chat
from eyas.data.datasets import resolve_source
from eyas.core.errors import EyasError
from eyas.engine.generate import SequenceDecoder
from eyas.stages.regenerate import CONVERSATIONS, regenerate
from eyas.verifier.load import build_text_model, load_tokenizer, resolve

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
    real = chat.end_of_turn_ids(tok)
    first = speculative.plain_generate(SequenceDecoder(model, capacity=1024), chat.encode_prompt(tok, [{"role": "user", "content": TURNS[0][0]}]),
                              max_new_tokens=NEW, eos_ids=set()).tokens  # fmt: skip
    eos = real | {first[3]}
    monkeypatch.setattr(chat, "end_of_turn_ids", lambda _tok: eos)
    return {"path": str(t.path), "tok": tok, "model": model, "eos": eos}


def _reference(model, tok, eos, prompts: dict[str, list[str]], *, new: int, limit: int, after_cut: str = "end"):
    """Each prompt decoded alone with eval's plain decoding (one sequence, nothing batched), turn by turn, with
    regenerate's rules: a prompt past ``limit`` or an empty answer ends the conversation before that turn, a cut
    answer after it (with ``after_cut="continue"``, as eval: the next turn follows it)."""
    runner = SequenceDecoder(model, capacity=limit)
    out = {}
    for pid, turns in prompts.items():
        messages: list[dict[str, str]] = []
        for turn in turns:
            ids = chat.encode_prompt(tok, messages + [{"role": "user", "content": turn}])
            if len(ids) + new > limit:
                break
            toks = speculative.plain_generate(runner, ids, max_new_tokens=new, eos_ids=eos).tokens
            finished = toks[-1] in eos
            text = tok.decode(toks[:-1] if finished else toks, skip_special_tokens=True).strip()
            if not text:
                break
            messages += [{"role": "user", "content": turn}, {"role": "assistant", "content": text}]
            if not finished and after_cut == "end":
                break
        if messages:
            out[pid] = messages
    return out


def _tiny_reference(v, after_cut: str = "end") -> dict[str, list[dict[str, str]]]:
    return _reference(v["model"], v["tok"], v["eos"], {f"p{i}": t for i, t in enumerate(TURNS)}, new=NEW,
                      limit=1024, after_cut=after_cut)  # fmt: skip


def _read(out) -> dict[str, list[dict[str, str]]]:
    return {r["id"]: r["messages"] for r in map(json.loads, (out / CONVERSATIONS).read_text().splitlines())}


@pytest.mark.parametrize("verifier", ["llama", "qwen3", "kimi_like"], indirect=True)  # kimi_like: nested, MoE
def test_batched_answers_equal_plain_decoding_turn_by_turn(verifier, source, tmp_path):
    out = tmp_path / "regen"
    # two sequences decode at once: answers finish at different times and later turns take the free slots
    kw = dict(verifier=verifier["path"], data=str(source), out=str(out), max_new_tokens=NEW, batch_tokens=2048)
    m = regenerate(**kw)
    got, want = _read(out), _tiny_reference(verifier)
    assert got == want
    answers = [sum(msg["role"] == "assistant" for msg in c) for c in got.values()]
    assert max(answers) >= 2 and min(answers) == 1  # a second turn followed a finished answer; a cut one ended
    o = m["outputs"]
    assert o["prompts"] == 5 and o["conversations"] == len(want) == 4 and o["prompt_too_long"] == 1
    assert o["answers"] == sum(answers) and 0 < o["cut_at_max_new_tokens"] < o["answers"]
    # a rerun with the same inputs and settings skips itself
    assert regenerate(**kw)["created"] == m["created"]
    # other settings: the old manifest goes first, so a crash never leaves it vouching for new answers
    import eyas.stages.regenerate as rg

    def crash(*args, **kwargs):
        raise KeyboardInterrupt

    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(rg, "_converse", crash)
        with pytest.raises(KeyboardInterrupt):
            regenerate(**{**kw, "max_new_tokens": NEW + 1})
    assert not (out / "manifest.json").exists()
    with pytest.raises(EyasError, match="unfinished `eyas regenerate` output"):
        resolve_source(out)


def test_after_cut_continue_answers_every_turn_as_eval_decodes(verifier, source, tmp_path):
    """``--after-cut continue``: the next user turn follows an answer cut at the token limit (as `eyas eval`
    decodes a multi-turn set), turn by turn equal to plain decoding alone; the setting is recorded only when
    set, so outputs made before it stay up to date."""
    out = tmp_path / "regen"
    m = regenerate(verifier=verifier["path"], data=str(source), out=str(out), max_new_tokens=NEW, batch_tokens=2048,
                   after_cut="continue")  # fmt: skip
    got, ended = _read(out), _tiny_reference(verifier)
    assert got == _tiny_reference(verifier, after_cut="continue")
    turns = lambda convs: sum(msg["role"] == "assistant" for c in convs.values() for msg in c)  # noqa: E731
    assert turns(got) > turns(ended) and m["settings"]["after_cut"] == "continue"
    assert m["outputs"]["cut_at_max_new_tokens"] > 0
    plain = regenerate(verifier=verifier["path"], data=str(source), out=str(tmp_path / "end"), max_new_tokens=NEW,
                       batch_tokens=2048)  # fmt: skip
    assert "after_cut" not in plain["settings"]


def test_killed_run_resumes_with_nothing_lost_or_repeated(make_tiny, tmp_path):
    """kill -9 in the middle of a run (in a subprocess, at a random moment once some conversations are
    journaled, with its last journal line cut as a kill in mid-write leaves it), then the same command: the
    conversations equal an uninterrupted run's (sampled, seeded per prompt and turn), each exactly once, and
    prepare reads them."""
    import os
    import signal
    import subprocess
    import sys
    import time
    from pathlib import Path

    from eyas.stages.prepare import prepare
    from eyas.data.prepared import load_prepared

    t = make_tiny("llama")
    src = tmp_path / "many.jsonl"
    n = 120
    src.write_text("".join(json.dumps({"id": f"q{i}", "turns": [f"Question {i}: " + "why " * (i % 9), "More?"]})
                           + "\n" for i in range(n)))  # fmt: skip
    kw = dict(verifier=str(t.path), data=str(src), max_new_tokens=12, temperature=0.8, seed=5, batch_tokens=4096,
              device="cpu")  # fmt: skip
    whole = regenerate(out=str(tmp_path / "whole"), **kw)
    out = tmp_path / "killed"
    code = f"from eyas.stages.regenerate import regenerate; regenerate(out={str(out)!r}, **{kw!r})"
    env = {**os.environ, "OMP_NUM_THREADS": "1", "HF_HUB_OFFLINE": "1",
           "PYTHONPATH": str(Path(rg_file()).parents[2]) + os.pathsep + os.environ.get("PYTHONPATH", "")}  # fmt: skip
    proc = subprocess.Popen([sys.executable, "-c", code], env=env, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
    deadline = time.time() + 120
    journal = None
    while time.time() < deadline and proc.poll() is None:
        found = list(out.glob(".parts/*/journal-rank*.jsonl"))
        if found and found[0].read_text().count("\n") >= 5:
            journal = found[0]
            break
        time.sleep(0.01)
    assert journal is not None and proc.poll() is None, "the run ended before it could be killed"
    os.kill(proc.pid, signal.SIGKILL)
    proc.wait()
    assert not (out / CONVERSATIONS).exists() and not (out / "manifest.json").exists()  # nothing looks finished
    with open(journal, "a") as f:
        f.write('{"i": 7, "record": {"id": "q7", "messa')  # a line the kill cut in the middle
    journaled = journal.read_text().count("\n")
    assert 5 <= journaled < n
    m = regenerate(out=str(out), **kw)
    assert m["timing"]["resumed_conversations"] == journaled
    assert (out / CONVERSATIONS).read_text() == (tmp_path / "whole" / CONVERSATIONS).read_text()
    assert m["outputs"] == whole["outputs"] and not (out / ".parts").exists()
    ids = [json.loads(line)["id"] for line in (out / CONVERSATIONS).read_text().splitlines()]
    assert ids == sorted(set(ids), key=lambda x: int(x[1:]))  # each once, in the prompts' order

    prepare(verifier=str(t.path), data=str(out), out=str(tmp_path / "prep"))
    ds, pm = load_prepared(tmp_path / "prep")
    assert pm["outputs"]["rows"] == m["outputs"]["conversations"]


def rg_file() -> str:
    import eyas.stages.regenerate as rg

    return rg.__file__


def test_bad_settings_are_refused_before_loading_anything(source, tmp_path):
    for kw, match in [({"max_new_tokens": 0}, "--max-new-tokens"), ({"concurrency": 0}, "--concurrency"),
                      ({"max_turns": 0}, "--max-turns"), ({"temperature": -1.0}, "--temperature"),
                      ({"dtype": "int8"}, "--dtype"), ({"max_new_tokens": 64, "max_seq_len": 64}, "no room"),
                      ({"batch_tokens": 100}, "--batch-tokens 100 holds no sequence")]:  # fmt: skip
        with pytest.raises(EyasError, match=match):
            regenerate(verifier="no/such/dir", data=str(source), out=str(tmp_path / "x"), **kw)


def test_torchrun_two_cpu_ranks_equal_one_process(make_tiny, tmp_path):
    """Under torchrun the prompts are dealt out to the ranks; the conversations are those one process writes."""
    import os
    import subprocess
    import sys
    from pathlib import Path

    import eyas.stages.regenerate as rg

    t = make_tiny("llama")
    src = tmp_path / "many.jsonl"
    n = 14
    src.write_text("".join(json.dumps({"turns": [f"Question {i}: " + "why " * (i % 7), "More?"]}) + "\n"
                           for i in range(n)))  # fmt: skip
    kw = {"max_new_tokens": 4, "batch_tokens": 8192, "device": "cpu"}
    one = regenerate(verifier=str(t.path), data=str(src), out=str(tmp_path / "one"), **kw)
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2", "-m", "eyas.cli",
           "regenerate", "--verifier", str(t.path), "--data", str(src), "--out", str(tmp_path / "two"),
           *[x for k, v in kw.items() for x in (f"--{k.replace('_', '-')}", str(v))]]  # fmt: skip
    env = {**os.environ, "OMP_NUM_THREADS": "1", "HF_HUB_OFFLINE": "1", "TOKENIZERS_PARALLELISM": "false",
           "PYTHONPATH": str(Path(rg.__file__).parents[2]) + os.pathsep + os.environ.get("PYTHONPATH", "")}  # fmt: skip
    r = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stdout[-2000:] + r.stderr[-4000:]
    two = json.loads((tmp_path / "two" / "manifest.json").read_text())
    assert two["timing"]["ranks"] == 2 and two["outputs"] == one["outputs"] and one["outputs"]["prompts"] == n
    assert (tmp_path / "two" / CONVERSATIONS).read_text() == (tmp_path / "one" / CONVERSATIONS).read_text()


def test_smollm2_answers_both_turns_and_ends_each_itself(smollm2_path, smollm2_model, tmp_path):
    """The real SmolLM2 through its GGUF and chat template: short answers end at its own <|im_end|>, so the
    second turn follows the first; batched answers equal eval's plain decoding of each alone."""
    src = tmp_path / "q.jsonl"
    turns = [["What is 2 + 2? Reply with just the number.", "And 3 + 3? Reply with just the number."],
             ["What is 5 + 5? Reply with just the number.", "And 1 + 1? Reply with just the number."]]  # fmt: skip
    src.write_text("".join(json.dumps({"turns": t}) + "\n" for t in turns))
    m = regenerate(verifier="smollm2", data=str(src), out=str(tmp_path / "out"), max_new_tokens=24)
    assert m["outputs"]["answers"] == 4 and m["outputs"]["cut_at_max_new_tokens"] == 0
    got = _read(tmp_path / "out")
    tok = load_tokenizer(resolve(smollm2_path))
    want = _reference(smollm2_model, tok, chat.end_of_turn_ids(tok), {str(i): t for i, t in enumerate(turns)},
                      new=24, limit=2048)  # fmt: skip
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


def test_base_verifier_answers_through_a_chat_template_file(make_tiny, source, tmp_path):
    """A verifier without a chat template is refused with the way forward; with --chat-template it answers
    through that template, and the manifest records the template's hash and where it came from."""
    import hashlib

    from chat_templates import COMPLETION, without_template

    base = without_template(make_tiny("llama").path, tmp_path / "base")
    kw = dict(verifier=str(base), data=str(source), max_new_tokens=4, max_samples=2)
    with pytest.raises(EyasError, match="has no chat template; .* give --chat-template FILE"):
        regenerate(out=str(tmp_path / "refused"), **kw)
    m = regenerate(out=str(tmp_path / "out"), chat_template=str(COMPLETION), **kw)
    assert m["inputs"]["chat_template_sha256"] == hashlib.sha256(COMPLETION.read_bytes()).hexdigest()
    assert m["chat_template"] == str(COMPLETION) and m["outputs"]["conversations"] > 0


def test_loop_policy_keeps_trims_or_drops_an_answer_cut_in_a_loop(smollm2_path):
    """An answer cut at the limit that ends repeating one line: kept whole, trimmed to the text before the loop
    and one copy of it, or dropped; each counted. An answer with no loop is left as it is."""
    from eyas.stages.regenerate import _COUNTS, LoopPolicy
    from eyas.engine.remote import Answer

    tok = load_tokenizer(resolve(str(smollm2_path)))
    intro = "Here are some tips for staying healthy during the winter months."
    looped = Answer(intro + "\n- Drink plenty of water every day." * 12, False, 512)
    plain = Answer("The capital of France is Paris, a city on the Seine known for its museums.", False, 512)
    for mode in ("keep", "trim", "drop"):
        counts = dict.fromkeys(_COUNTS, 0)
        policy = LoopPolicy(mode, tok)
        assert policy(plain, counts) is plain and counts["loops"] == 0
        got = policy(looped, counts)
        assert counts["loops"] == 1 and counts["loop_tokens"] > 50
        if mode == "keep":
            assert got is looped
        elif mode == "trim":
            assert got.text.startswith(intro) and got.text.count("Drink plenty of water") == 1
            assert 40 < counts["trimmed_tokens"] < counts["loop_tokens"]
        else:
            assert got is None and counts["dropped_answers"] == 1
        # the engine's own ids (what eyas' decoder hands over beside the text) find the same loop
        ids = tok(looped.text, add_special_tokens=False)["input_ids"]
        with_ids = dict.fromkeys(_COUNTS, 0)
        again = LoopPolicy(mode, tok)(Answer(looped.text, False, 512, ids=ids), with_ids)
        assert with_ids == counts and (again is None) == (got is None)
        assert again is None or again.text == got.text
    # --loop-copies 3: the text before the loop and three copies, so the draft sees the loop go on
    counts = dict.fromkeys(_COUNTS, 0)
    three = LoopPolicy("trim", tok, copies=3)(looped, counts)
    assert three.text.startswith(intro) and three.text.count("Drink plenty of water") == 3
    assert 0 < counts["trimmed_tokens"] < counts["loop_tokens"] - 2 * 8


def test_repetition_penalty_changes_answers_and_is_recorded(make_tiny, source, tmp_path):
    """`--repetition-penalty` in the local engine: recorded in the manifest; the answers differ from unpenalised
    greedy ones (the tiny verifier repeats tokens), and a server is refused it."""
    t = make_tiny("llama")
    kw = dict(verifier=str(t.path), data=str(source), max_new_tokens=NEW, batch_tokens=2048)
    plain = regenerate(**kw, out=str(tmp_path / "a"))
    pen = regenerate(**kw, out=str(tmp_path / "b"), repetition_penalty=1.5, loops="trim")
    assert pen["settings"]["repetition_penalty"] == 1.5 and pen["settings"]["loops"] == "trim"
    assert _read(tmp_path / "a") != _read(tmp_path / "b")
    assert plain["outputs"]["loops"] >= 0 and "dropped_answers" in pen["outputs"]
    with pytest.raises(EyasError, match="--repetition-penalty"):
        regenerate(**kw, out=str(tmp_path / "c"), repetition_penalty=1.2, server="http://127.0.0.1:1/v1")


def test_prompts_encoded_in_batches_equal_one_by_one(smollm2_path):
    """encode_prompts (regenerate's first turns, tokenized in batches) gives what encode_prompt gives each
    conversation, for SmolLM2's template over one- and three-message conversations, across chunk boundaries."""
    from eyas.data.chat import encode_prompt, encode_prompts
    from eyas.verifier.load import load_tokenizer, resolve

    tok = load_tokenizer(resolve(str(smollm2_path)))
    convs = [[{"role": "user", "content": f"Question {i}: why is the sky blue? " * (i % 4 + 1)}] for i in range(5)]
    convs += [
        [
            {"role": "system", "content": "Be brief."},
            {"role": "user", "content": "Hi, café ☕"},
            {"role": "assistant", "content": "Hello!\n\n```py\nprint(1)\n```"},
            {"role": "user", "content": "More"},
        ]
    ]
    assert encode_prompts(tok, convs, chunk=4) == [encode_prompt(tok, m) for m in convs]
    assert encode_prompts(tok, []) == []


def test_next_turns_are_tokenized_in_one_batch_per_block(make_tiny, monkeypatch):
    """The next turns submitted for a block's answers wait untokenized until the engine reads its queue, then are
    tokenized in one batch: four conversations whose answers end in the same block give one batch of four
    second turns, and each answer is what plain decoding of its conversation alone gives."""
    from eyas.stages.regenerate import LocalBackend, _conversation
    from eyas.data.datasets import Prompt

    t = make_tiny("llama")
    info = resolve(t.path)
    tok, model = load_tokenizer(info), build_text_model(info)
    batches = []
    real = chat.encode_prompts
    monkeypatch.setattr(
        chat, "encode_prompts", lambda tok, convs, **kw: batches.append(len(convs)) or real(tok, convs, **kw)
    )
    backend = LocalBackend(model, tok, max_new_tokens=6, max_seq_len=256, batch_tokens=4 * 256, temperature=0.0, seed=0)
    prompts = [Prompt(f"p{i}", ["Hello there", "And then?"]) for i in range(4)]
    backend.submit_many([(i, 0, _conversation(p, []), 1) for i, p in enumerate(prompts)])
    got: dict[int, list] = {i: [] for i in range(4)}
    for i, a in backend.results():
        got[i].append(a)
        if len(got[i]) == 1:
            backend.submit(i, 1, _conversation(prompts[i], got[i]))
    assert batches == [4, 4]  # the first turns, then the four second turns together
    runner = SequenceDecoder(model, capacity=256)
    for i, answers in got.items():
        for turn, a in enumerate(answers):
            ids = chat.encode_prompt(tok, _conversation(prompts[i], answers[:turn]))
            want = speculative.plain_generate(runner, ids, max_new_tokens=6, eos_ids=backend.eos_ids).tokens
            assert a.ids == (want[:-1] if want[-1] in backend.eos_ids else want)
