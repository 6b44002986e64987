"""`eyas prompts`: the verifier writes user turns from its template's user-turn prefix (Magpie); they are
filtered, deduplicated, journaled (a killed run resumes) and read by `eyas regenerate`, alone or mixed."""

from __future__ import annotations

import json

import pytest

from eyas.core.errors import EyasError
from eyas.data.datasets import load_prompts
from eyas.data.repetition import find_loop, normalized
from eyas.stages.prompts import PROMPTS, prompts, unique_in_order, user_turn_prefix, verdict
from eyas.verifier.load import load_tokenizer, resolve

pytestmark = pytest.mark.usefixtures("one_thread")


def test_smollm2_user_turn_prefix_is_chatml_up_to_the_user_content(smollm2_path):
    tok = load_tokenizer(resolve(str(smollm2_path)))
    prefix, end = user_turn_prefix(tok)
    assert prefix.startswith("<|im_start|>system\n") and prefix.endswith("<|im_end|>\n<|im_start|>user\n")
    assert end == "<|im_end|>"
    own, _ = user_turn_prefix(tok, system="Be brief.")
    assert own == "<|im_start|>system\nBe brief.<|im_end|>\n<|im_start|>user\n"


def test_verdicts_refuse_what_is_not_a_prompt():
    ids = list(range(12))
    assert verdict("What is the capital of France?", ids, finished=True, min_words=3) == "kept"
    assert verdict("Tell me about the sea", ids, finished=False, min_words=3) == "unfinished"
    assert verdict("", [], finished=True, min_words=3) == "empty"
    assert verdict("Hello there", ids[:2], finished=True, min_words=3) == "too_short"
    assert verdict("a b c d " * 10, [1, 2, 3, 4] * 10, finished=True, min_words=3) == "repetitive"
    assert normalized("  Hello,   World! ") == "hello world"
    entries = {2: {"verdict": "kept", "text": "what is the CAPITAL of france"}, 0: {"verdict": "too_short", "text": "Hi"},
               1: {"verdict": "kept", "text": "What is the capital of France?"}}  # fmt: skip
    assert unique_in_order(entries) == ([1], {"too_short": 1, "kept": 1, "duplicate": 1})  # the first one stays


def test_loops_are_found_with_their_first_copy_and_changing_counters():
    prefix = [900 + i for i in range(40)]
    unit = [5, 6, 7, 8, 9, 10, 11]
    loop = find_loop(prefix + unit * 9 + unit[:3])
    assert (loop.start, loop.period) == (40, 7) and loop.trimmed_length() == 47
    numbered = prefix + sum(([1, 2, 3, 100 + i, 4, 5, 6, 7, 8, 9] for i in range(6)), [])  # "1. item", "2. item"
    assert find_loop(numbered).start == 40
    assert find_loop(prefix) is None and find_loop([1] * 20) is None  # too short to call a loop


def _loop_by_every_period(t, *, max_period=256, min_repeats=3.0, min_tokens=32, mismatch=0.1):
    """find_loop's definition checked period by period, in plain Python: the reference for its numpy version."""
    n, best = len(t), None
    for p in range(1, min(max_period, n // 2) + 1):
        bad, tail = 0, 0
        for k in range(n - p):  # position n - 1 - k against the one p before it
            bad += t[n - 1 - k] != t[n - 1 - k - p]
            if bad <= mismatch * (k + 1):
                tail = k + 1
        if t[n - 1] != t[n - 1 - p] or tail + p < max(min_repeats * p, min_tokens):
            continue
        if best is None or tail + p > best[0] + best[1]:  # the longest span; the smallest period among equals
            best = (tail, p)
    if best is None:
        return None
    tail, p = best
    while tail and t[n - tail] != t[n - tail - p]:  # a tail starts on a repeat, not on a mismatch it allowed
        tail -= 1
    return n - tail - p, p


def test_find_loop_equals_trying_every_period():
    """find_loop tries only the periods at which the last token recurs: the loops it finds are the ones trying
    every period finds, on random text with loops of any period whose copies change a token now and then."""
    import random

    rng = random.Random(0)
    for _ in range(300):
        unit = [rng.randrange(50) for _ in range(rng.randrange(1, 40))]
        tail = sum(
            ([x if rng.random() > 0.05 else rng.randrange(50) for x in unit] for _ in range(rng.randrange(8))), []
        )
        seq = ([rng.randrange(50) for _ in range(rng.randrange(0, 120))] + tail)[:384]
        loop = find_loop(seq)
        assert (None if loop is None else (loop.start, loop.period)) == _loop_by_every_period(seq), seq


def test_tiny_verifier_prompts_resume_and_feed_regenerate(make_tiny, tmp_path):
    """A run on a tiny verifier writes what its manifest counts; a run stopped part way (its journal kept, the
    last line cut as a kill leaves it) finishes with the same prompts; regenerate answers a mix with another
    source."""
    from eyas.stages.regenerate import regenerate

    t = make_tiny("llama")
    kw = dict(verifier=str(t.path), out=str(tmp_path / "p"), num_prompts=6, max_new_tokens=12, min_words=1,
              batch_tokens=2048, max_attempts=60)  # fmt: skip
    m = prompts(**kw)
    rows = [json.loads(x) for x in (tmp_path / "p" / PROMPTS).read_text().split("\n") if x]
    o = m["outputs"]
    assert len(rows) == o["prompts"] > 0 and o["samples"] == o["prompts"] + sum(o["refused"].values())
    assert len({normalized(r["turns"][0]) for r in rows}) == len(rows)  # no duplicates
    engine = m["timing"]["engine"]  # where the sampling's time went, as regenerate records it
    assert engine["steps"] > 0 and engine["prefills"] > 0 and engine["decode_seconds"] >= 0, engine
    assert prompts(**kw)["created"] == m["created"]  # up to date: skipped

    # killed part way (after a few samples were journaled, the last line cut as a kill in mid-write leaves it):
    # the same command resumes and writes exactly what the uninterrupted run wrote
    import eyas.stages.prompts as sp

    again, calls, real = tmp_path / "again", [], sp.verdict

    def killed_after_five(*a, **k):
        calls.append(1)
        if len(calls) > 5:
            raise KeyboardInterrupt
        return real(*a, **k)

    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(sp, "verdict", killed_after_five)
        with pytest.raises(KeyboardInterrupt):
            prompts(**{**kw, "out": str(again)})
    assert not (again / "manifest.json").exists()
    (journal,) = (again / ".parts").glob("journal-*.jsonl")
    assert journal.read_text().count("\n") == 5
    with open(journal, "a") as f:
        f.write('{"i": 99, "verdict": "ke')
    m2 = prompts(**{**kw, "out": str(again)})
    assert (again / PROMPTS).read_text() == (tmp_path / "p" / PROMPTS).read_text() and m2["outputs"] == o

    prompts_file = tmp_path / "other.jsonl"
    prompts_file.write_text(json.dumps({"id": "o1", "turns": ["Hello there, who are you?"]}) + "\n")
    loaded, _ = load_prompts(f"{prompts_file},{tmp_path / 'p'}")
    assert [p.id for p in loaded] == ["o1"] + [r["id"] for r in rows]
    r = regenerate(verifier=str(t.path), data=f"{prompts_file},{tmp_path / 'p'}", out=str(tmp_path / "r"),
                   max_new_tokens=6, batch_tokens=2048)  # fmt: skip
    assert r["outputs"]["prompts"] == 1 + len(rows)


def test_topics_steer_each_sample_by_its_index(make_tiny, tmp_path, monkeypatch):
    """--topics: sample i is drawn after the system message of topic i mod n (the engine is asked for exactly
    that prefix, and draws the same text, by its seed, as a run with that one system message draws for index
    i), each prompt records its topic as its category, and the manifest counts them; --topics with --system, or
    a topic named twice, is refused."""
    from eyas.engine import generate
    from eyas.stages.prompts import TOPIC_SYSTEM

    asked: dict[int, list[int]] = {}

    class Spy(generate.Request):
        def __init__(self, **kw):
            super().__init__(**kw)
            asked[kw["key"]] = kw["tokens"]

    monkeypatch.setattr(generate, "Request", Spy)
    t = make_tiny("llama")
    tok = load_tokenizer(resolve(str(t.path)))
    # more prompts than the random model finishes in 150 samples: both runs draw every one of the 150
    kw = dict(verifier=str(t.path), num_prompts=60, max_new_tokens=48, min_words=1, batch_tokens=4096,
              max_attempts=150)  # fmt: skip
    topics = ["math", "coding", "poems"]
    m = prompts(**kw, out=str(tmp_path / "t"), topics=topics)
    rows = [json.loads(x) for x in (tmp_path / "t" / PROMPTS).read_text().split("\n") if x]
    assert [r["category"] for r in rows] == [topics[int(r["id"].split("-")[1]) % 3] for r in rows]
    assert m["outputs"]["prompts_by_topic"] == {k: sum(r["category"] == k for r in rows) for k in topics}
    assert len(m["user_turn_prefix"]) == 3 and all(k in p for k, p in zip(topics, m["user_turn_prefix"]))
    assert sorted(asked) == list(range(150))
    for i, ids in asked.items():
        assert tok.decode(ids) == user_turn_prefix(tok, system=TOPIC_SYSTEM.format(topic=topics[i % 3]))[0], i
    prompts(**kw, out=str(tmp_path / "one"), system=TOPIC_SYSTEM.format(topic="coding"))
    by_id = {r["id"]: r["turns"] for r in map(json.loads, (tmp_path / "one" / PROMPTS).read_text().split("\n")[:-1])}
    coding = [r for r in rows if r["category"] == "coding" and r["id"] in by_id]
    assert coding and all(by_id[r["id"]] == r["turns"] for r in coding)
    loaded, _ = load_prompts(str(tmp_path / "t"))
    assert [p.category for p in loaded] == [r["category"] for r in rows]
    with pytest.raises(EyasError, match="--topics and --system"):
        prompts(**kw, out=str(tmp_path / "x"), topics=topics, system="Be brief.")
    with pytest.raises(EyasError, match="twice"):
        prompts(**kw, out=str(tmp_path / "x"), topics=["math", "Math"])


def test_smollm2_writes_real_prompts(smollm2_path, tmp_path):
    """The real SmolLM2 at a few prompts: each kept prompt is a user request in words, none repeated."""
    m = prompts(verifier=str(smollm2_path), out=str(tmp_path / "p"), num_prompts=3, max_new_tokens=48,
                batch_tokens=4096)  # fmt: skip
    rows = [json.loads(x)["turns"][0] for x in (tmp_path / "p" / PROMPTS).read_text().split("\n") if x]
    assert len(rows) == m["outputs"]["prompts"] == 3
    assert all(len(r.split()) >= 3 and "<|im" not in r for r in rows)
    assert m["user_turn_prefix"].endswith("<|im_start|>user\n")
