"""`eyas run CONFIG`: every stage a config lists, wired through files, on a tiny verifier; bad configs fail first."""

from __future__ import annotations

import json

import pytest

from eyas.core.errors import EyasError
from eyas.pipeline import run

CONVERSATIONS = [
    [{"from": "human", "value": f"Question {i}: what is {i} + {i}?"},
     {"from": "gpt", "value": f"The answer is {2 * i}. " * (1 + i % 3)},
     {"from": "human", "value": "And times two?"},
     {"from": "gpt", "value": f"That is {4 * i}."}]
    for i in range(12)
]  # fmt: skip


def _config(tmp_path, verifier, body: str):
    data = tmp_path / "convs.jsonl"
    data.write_text("".join(json.dumps({"conversations": c}) + "\n" for c in CONVERSATIONS))
    prompts = tmp_path / "prompts.jsonl"
    prompts.write_text(json.dumps({"turns": ["What is 2 + 2?"]}) + "\n")
    cfg = tmp_path / "run.toml"
    cfg.write_text(f'out = "{tmp_path / "out"}"\nverifier = "{verifier}"\n' +
                   body.replace("DATA", str(data)).replace("PROMPTS", str(prompts)))  # fmt: skip
    return cfg


def test_run_wires_every_stage(make_tiny, tmp_path):
    t = make_tiny("llama")
    cfg = _config(
        tmp_path,
        t.path,
        """
[prepare]
data = "DATA"
max_seq_len = 128
num_proc = 1
[vocab]
draft_vocab_size = 128
[extract]
dtype = "fp32"
[train]
epochs = 1
max_steps = 2
max_seq_len = 128
num_workers = 0
val_ratio = 0.1
[export]
format = "eagle"
[eval]
prompts = "PROMPTS"
max_new_tokens = 8
""",
    )
    res = run(str(cfg))
    out = tmp_path / "out"
    for d in ("prepared", "vocab", "features", "draft", "draft-eagle", "eval"):
        assert (out / d).is_dir(), d
    assert json.loads((out / "draft-eagle" / "config.json").read_text())["architectures"] == ["LlamaForCausalLMEagle3"]
    assert res["eval"]["lossless"] is True and "predicted_tau" in res["eval"]


@pytest.mark.parametrize("body, message", [
    ("[prepare]\ndata = 'x'\n[fly]\nx = 1\n", r"unknown key\(s\) \['fly'\]"),
    ("[vocab]\ndraft_vocab = 3\n", r"\[vocab\] draft_vocab is not an argument of `eyas vocab`"),
    ("speed = 3\n[vocab]\n", r"unknown key\(s\) \['speed'\]"),
    ("", "no stage section"),
    ("[prepare]\ndata = 'DATA'\n[eval]\nprompts = 'PROMPTS.missing'\n",
     r"\[eval\] prompts .*prompts.jsonl.missing not found \(and no section writes it\)"),
    ("[vocab]\ndata = 'nowhere/prepared'\n", r"\[vocab\] data nowhere/prepared not found"),
    ("[regenerate]\ndata = 'sharegpt,DATA,nowhere/x.jsonl'\n", r"\[regenerate\] data nowhere/x.jsonl not found"),
])  # fmt: skip
def test_bad_config_fails_before_any_stage(make_tiny, tmp_path, body, message):
    cfg = _config(tmp_path, make_tiny("llama").path, body)
    with pytest.raises(EyasError, match=message):
        run(str(cfg))
    assert not (tmp_path / "out").exists()


def test_run_given_a_folder_is_one_line(tmp_path, capsys):
    from stage_outputs import refused

    refused(capsys, ["run", str(tmp_path)], str(tmp_path), "is a folder")


def test_regenerate_section_feeds_prepare(make_tiny, tmp_path):
    """With a [regenerate] section, prepare reads the verifier's own answers (not the source's) by default."""
    cfg = _config(
        tmp_path,
        make_tiny("llama").path,
        """
[regenerate]
data = "DATA"
max_new_tokens = 6
max_samples = 4
[prepare]
max_seq_len = 256
num_proc = 1
""",
    )
    res = run(str(cfg))
    out = tmp_path / "out"
    assert res["prepare"]["inputs"]["data"]["source"] == f"{out / 'regenerated'} (eyas regenerate)"
    assert res["prepare"]["outputs"]["rows"] == res["regenerate"]["outputs"]["conversations"] > 0
    said = [json.loads(line) for line in (out / "regenerated" / "conversations.jsonl").read_text().splitlines()]
    original = {turn["value"].strip() for c in CONVERSATIONS for turn in c if turn["from"] == "gpt"}
    answers = [m["content"] for r in said for m in r["messages"] if m["role"] == "assistant"]
    assert answers and not original & set(answers)


def test_base_verifier_runs_with_a_chat_template_file(make_tiny, tmp_path):
    """A verifier without a chat template runs the whole pipeline when the sections that render chats
    (regenerate, prepare, eval) take --chat-template: every manifest and the eval report record that template's
    hash, eval finds it equal to the draft's (no warning), and predicts tau from the rows train held out."""
    import hashlib

    from chat_templates import COMPLETION as template
    from chat_templates import without_template

    base = without_template(make_tiny("llama").path, tmp_path / "base")
    sha = hashlib.sha256(template.read_text().encode()).hexdigest()
    cfg = _config(
        tmp_path,
        base,
        f"""
[regenerate]
data = "DATA"
max_new_tokens = 6
chat_template = "{template}"
[prepare]
max_seq_len = 128
num_proc = 1
chat_template = "{template}"
[extract]
dtype = "fp32"
[train]
epochs = 1
max_steps = 1
max_seq_len = 128
num_workers = 0
val_ratio = 0.25
[eval]
prompts = "PROMPTS"
max_new_tokens = 6
chat_template = "{template}"
""",
    )
    res = run(str(cfg))
    out = tmp_path / "out"
    for stage in ("regenerated", "prepared", "features", "draft"):
        assert json.loads((out / stage / "manifest.json").read_text())["inputs"]["chat_template_sha256"] == sha, stage
    assert res["regenerate"]["chat_template"] == str(template) and res["prepare"]["chat_template"] == str(template)
    report = res["eval"]
    assert report["chat_template_sha256"] == sha and report["chat_template"] == str(template)
    assert "warning" not in report and report["offline"]["rows_from"] == "validation"


def test_shipped_configs_check():
    """Every config in configs/ names known stages and arguments (checked, nothing run)."""
    from pathlib import Path

    from eyas.pipeline import check

    configs = sorted((Path(__file__).resolve().parents[2] / "configs").glob("*.toml"))
    assert len(configs) >= 3
    for c in configs:
        _, _, plan = check(str(c))
        assert plan, c
    _, root, plan = check(str(configs[0].parent / "smollm2-gpu.toml"))
    stages = {name: config for name, _, config in plan}
    assert stages["prepare"].data == str(root / "regenerated") and "regenerate" in stages
