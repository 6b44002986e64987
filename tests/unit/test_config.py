"""Each stage is one typed config (`eyas.core.config`): the command's flags, an `eyas run` section and the Python keyword
function are all made from its fields, so they cannot drift apart, and a value is checked the same way wherever
it comes from."""

from __future__ import annotations

import argparse
import dataclasses
import inspect
import typing
from pathlib import Path

import pytest

from eyas.cli import COMMANDS, _load, build_parser, flag_names
from eyas.core.config import default_of, type_hints
from eyas.core.errors import EyasError
from eyas.core.validate import unwrap_optional
from eyas.pipeline import check
from eyas.stages import PIPELINE

CONFIGS = {name: _load(target) for name, (target, _, _) in COMMANDS.items()}


def _subparser(command: str) -> argparse.ArgumentParser:
    parser = build_parser(command)
    sub = next(a for a in parser._actions if isinstance(a, argparse._SubParsersAction))
    return sub.choices[command]


def test_comma_separated_flags_keep_the_spaces_inside_an_item():
    """A list flag splits at commas and strips each item: `--topics "creative writing, math"` is two topics,
    `--draft-tokens "3, 5"` two numbers."""
    args = _subparser("prompts").parse_args(["--verifier", "v", "--out", "o", "--topics", "creative writing, math,"])
    assert args.topics == ["creative writing", "math"]
    assert _subparser("eval").parse_args(["--verifier", "v", "--draft", "d", "--prompts", "p", "--draft-tokens", " 3, 5"]).draft_tokens \
        == [3, 5]  # fmt: skip
    sets = _subparser("run").parse_args(
        ["c.toml", "--set", 'prompts.topics=["math", "creative writing"],train.lr=2e-3']
    )
    assert sets.overrides == ['prompts.topics=["math", "creative writing"]', "train.lr=2e-3"]


@pytest.mark.parametrize("command", list(COMMANDS))
def test_flags_are_the_config_fields_each_with_help(command, monkeypatch):
    monkeypatch.setenv("COLUMNS", "100000")  # (argparse wraps at hyphens: one line a flag)
    config = CONFIGS[command]
    actions = [a for a in _subparser(command)._actions if not isinstance(a, argparse._HelpAction)]
    fields = dataclasses.fields(config)
    assert sorted({a.dest for a in actions}) == sorted(f.name for f in fields)
    for a in actions:
        assert a.help and len(a.help) > 10, (command, a.dest)
    flags = {s for a in actions for s in a.option_strings}
    for f in fields:
        assert set(flag_names(f)) <= flags, (command, f.name)
    help_text = " ".join(_subparser(command).format_help().split())
    for f in fields:  # every field's help, whole, on `eyas COMMAND --help`
        assert " ".join(f.metadata["help"].split()) in help_text, (command, f.name)


#: The Python function of each command.
FUNCTIONS = {"inspect": "eyas.stages.inspect:inspect", "plan": "eyas.stages.plan:plan",
             "prompts": "eyas.stages.prompts:prompts", "regenerate": "eyas.stages.regenerate:regenerate", "prepare": "eyas.stages.prepare:prepare", "vocab": "eyas.stages.vocab:vocab", "extract": "eyas.stages.extract:extract",
             "train": "eyas.stages.train:train", "export": "eyas.stages.export:export", "eval": "eyas.stages.evaluate:evaluate",
             "run": "eyas.pipeline:run", "demo": "eyas.demo:demo"}  # fmt: skip


@pytest.mark.parametrize("command", list(COMMANDS))
def test_python_function_is_made_from_the_config(command):
    """`eyas.stages.train.train(**kw)` and friends: their signatures and docs are the config's fields and defaults."""
    config, fn = CONFIGS[command], _load(FUNCTIONS[command])
    params = inspect.signature(fn).parameters
    assert list(params) == [f.name for f in sorted(dataclasses.fields(config),
                                                     key=lambda f: not f.metadata["positional"])]  # fmt: skip
    for f in dataclasses.fields(config):
        default = default_of(f)
        assert params[f.name].default == (inspect.Parameter.empty if default is dataclasses.MISSING else default)
        assert f"    {f.name}: {f.metadata['help']}" in fn.__doc__


def test_one_name_one_meaning():
    """A name shared by several stages has one range (declared on its field) and one type, except `--dtype`,
    which names a different thing in each stage (stored features, compute, exported weights) and says so in its
    help."""
    kinds: dict[str, set] = {}
    ranges: dict[str, set] = {}
    for config in CONFIGS.values():
        for f in dataclasses.fields(config):
            base = unwrap_optional(type_hints(config)[f.name])
            kinds.setdefault(f.name, set()).add(typing.get_origin(base) or base)
            ranges.setdefault(f.name, set()).add(f.metadata["range"])
    differ = {n: k for n, k in kinds.items() if len(k) > 1}
    assert set(differ) == {"dtype"}, differ
    assert {n: r for n, r in ranges.items() if len(r) > 1} == {}
    numeric = {n for n, k in kinds.items() if k <= {int, float}}
    for name in ("ttt_steps", "batch_tokens", "max_seq_len", "epochs", "seed", "max_samples", "max_new_tokens"):
        assert name in numeric and ranges[name] != {None}, name


#: Fields of these names that their stage declares itself, not `eyas.core.fields`: another thing under the name.
OWN = {("plan", "verifier"), ("run", "verifier"), ("eval", "out"), ("run", "out"), ("demo", "out"),
       ("extract", "dtype"), ("export", "dtype")}  # fmt: skip


@pytest.mark.parametrize("name", ["verifier", "trust_remote_code", "chat_template", "out", "device", "device_map",
                                  "dtype"])  # fmt: skip
def test_a_shared_argument_is_declared_once(name):
    """`--verifier`, `--out`, `--chat-template` and the placement flags are each one declaration in
    `eyas.core.fields` (its help, default and range), which every stage taking them uses; a stage adds words to
    the help, or makes the argument optional."""
    from eyas.core import fields

    shared = getattr(fields, name)()
    takers = [(command, f) for command, config in CONFIGS.items() for f in dataclasses.fields(config)
              if f.name == name and (command, name) not in OWN]  # fmt: skip
    assert len(takers) >= 2, takers
    for command, f in takers:
        assert f.metadata["help"].startswith(shared.metadata["help"].removesuffix(".")), (command, f.metadata["help"])
        assert f.metadata["range"] == shared.metadata["range"], command
        assert default_of(f) in (default_of(shared), None), command


def test_python_api_values_are_checked_as_flags_are(make_tiny, tmp_path):
    from eyas.stages.train import TrainConfig, train

    with pytest.raises(EyasError, match=r"^--epochs must be at least 1, got 0$"):
        TrainConfig(verifier="v", data="d", out="o", epochs=0)
    with pytest.raises(EyasError, match=r"^--ttt-steps must be a whole number, got '3' \(a string\)$"):
        train(verifier="v", data="d", out=str(tmp_path / "o"), ttt_steps="3")
    with pytest.raises(TypeError, match="epoch"):
        train(verifier="v", data="d", out="o", epoch=1)
    c = TrainConfig(verifier="v", data="d", out=Path("o"), lr=1)  # a path is a string; an int where a float goes
    assert c.out == "o" and c.lr == 1.0 and isinstance(c.lr, float)
    assert not (tmp_path / "o").exists()


def _baseline(stage: str) -> dict[str, object]:
    """The least a section needs to pass the check (the pipeline wires data and out)."""
    return {"prepare": {"data": "sharegpt"}, "regenerate": {"data": "mt-bench"}, "eval": {"prompts": "mt-bench"}}.get(
        stage, {}
    )


def _wrong(tp) -> object:
    """A value of the wrong type for a field annotated ``tp``."""
    base = unwrap_optional(tp)
    if base is bool:
        return "yes"
    if base in (int, float) or typing.get_origin(base) in (list, tuple):
        return "many"
    if typing.get_origin(base) is typing.Literal:
        return "none-of-these"
    return 7  # a string (or a path, or a dict) field given a number


def _toml(value) -> str:
    return f'"{value}"' if isinstance(value, str) else str(value).lower()


def _section_cases():
    for stage in (s.name for s in PIPELINE):
        config = CONFIGS[stage]
        yield stage, "not_a_field", 1, f"[{stage}] not_a_field is not an argument of `eyas {stage}`"
        for name, tp in type_hints(config).items():
            yield stage, name, _wrong(tp), f"[{stage}] {name} must be "


@pytest.mark.parametrize("stage, key, value, message", list(_section_cases()))
def test_a_section_key_unknown_or_of_the_wrong_type_is_refused_by_name(tmp_path, stage, key, value, message):
    body = "".join(f"{k} = {_toml(v)}\n" for k, v in {**_baseline(stage), key: value}.items())
    cfg = tmp_path / "run.toml"
    cfg.write_text(f'out = "{tmp_path / "out"}"\nverifier = "smollm2"\n[{stage}]\n{body}')
    with pytest.raises(EyasError) as e:
        check(str(cfg))
    assert str(e.value).startswith(f"{cfg}: {message}") and "\n" not in str(e.value), str(e.value)
    assert not (tmp_path / "out").exists()


def test_a_good_section_is_its_stage_config(tmp_path):
    """What `eyas run` hands each stage is the same config the command line makes."""
    from eyas.stages.train import TrainConfig, run

    cfg = tmp_path / "run.toml"
    cfg.write_text(f'out = "{tmp_path / "out"}"\nverifier = "smollm2"\n[train]\nepochs = 2\nlayers = [1, 2, 3]\n')
    (tmp_path / "out" / "features").mkdir(parents=True)  # its input, wired by default (checked before any stage)
    _, root, [(name, stage, config)] = check(str(cfg))
    assert (name, stage) == ("train", run) and isinstance(config, TrainConfig)
    assert (config.epochs, config.layers, config.data, config.verifier) == (2, [1, 2, 3], str(root / "features"),
                                                                              "smollm2")  # fmt: skip


@pytest.mark.parametrize("stage, section, message", [
    ("train", "max_seq_len = 4\nttt_steps = 3", "--max-seq-len >= ttt_steps + 2"),
    ("train", "max_seq_len = 64\nbatch_tokens = 100", "--batch-tokens 100 must be a multiple of --max-seq-len 64"),
    ("train", "drop_out_of_vocab = true\nfull_vocab_accuracy = false", "--drop-out-of-vocab needs"),
    ("train", "layers = [2, 2, 5]", "--layers must list three distinct layer ids"),
    ("extract", "layers = [1, 2]", "--layers must list three distinct layer ids"),
    ("extract", 'device = "cpu"\ndevice_map = "auto"', "give either --device or --device-map"),
    ("regenerate", 'data = "mt-bench"\nmax_new_tokens = 64\nmax_seq_len = 64', "leaves no room for a prompt"),
    ("regenerate", 'data = "mt-bench"\nserver = "http://h/v1"\ndevice_map = "auto"', "--device-map loads"),
])  # fmt: skip
def test_rules_between_fields_refuse_a_section_before_any_stage_runs(tmp_path, stage, section, message):
    """A config's rules between its fields hold wherever it is made: in a section they stop `eyas run` before
    the first stage, naming the file and the section."""
    cfg = tmp_path / "run.toml"
    cfg.write_text(f'out = "{tmp_path / "out"}"\nverifier = "smollm2"\n[{stage}]\n{section}\n')
    with pytest.raises(EyasError) as e:
        check(str(cfg))
    assert str(e.value).startswith(f"{cfg}: [{stage}] ") and message in str(e.value), str(e.value)
    assert not (tmp_path / "out").exists()


#: The fields each stage's manifest records as settings (beside what the stage resolves or derives: train's draft
#: shape and world size, extract's layer ids): earlier manifests hold these names, so an unchanged command run
#: again is still up to date. Every other field is marked `recorded=False`: a run control or an input.
RECORDED = {
    "prompts": {"num_prompts", "temperature", "top_p", "max_new_tokens", "min_words", "system", "topics",
                "max_attempts", "seed"},
    "regenerate": {"max_new_tokens", "max_seq_len", "max_samples", "max_turns", "temperature", "loops", "loop_copies",
                   "after_cut",
                   "repetition_penalty", "seed", "strict"},
    "prepare": {"max_seq_len", "max_samples", "seed", "strict", "on_overflow", "loop_tails"},
    "vocab": {"draft_vocab_size", "count"},
    "extract": {"dtype", "shard_tokens"},
    "train": {"online", "epochs", "lr", "max_seq_len", "batch_tokens", "grad_accum", "ttt_steps", "step_loss_decay",
              "val_ratio", "warmup_steps", "schedule", "weight_decay", "clip", "seed", "optimizer", "freeze_lm_head",
              "drop_out_of_vocab", "aligned_loss", "full_vocab_accuracy", "dist", "verifier_name", "max_steps"},
    "export": {"format", "from_format", "verifier_name", "speculative_tokens", "include_embeddings", "dtype"},
}  # fmt: skip


#: of those, the settings recorded only at another value than their default (``recorded="when set"``): options
#: added after outputs were made, which stay up to date
WHEN_SET = {"prompts": {"topics": ["math"]}, "regenerate": {"loop_copies": 3, "after_cut": "continue"},
            "prepare": {"loop_tails": "unscored"}, "train": {"aligned_loss": True}}  # fmt: skip


@pytest.mark.parametrize("stage", list(RECORDED))
def test_a_manifest_records_the_fields_not_marked_otherwise(stage):
    from eyas.core.config import recorded_settings

    config = CONFIGS[stage]
    assert {f.name for f in dataclasses.fields(config) if f.metadata["recorded"]} == RECORDED[stage]
    assert {f.name for f in dataclasses.fields(config) if f.metadata["recorded"] == "when set"} == set(
        WHEN_SET.get(stage, {}))  # fmt: skip
    required = {f.name: "x" for f in dataclasses.fields(config)
                if default_of(f) is dataclasses.MISSING or f.name in ("verifier", "data", "out")}  # fmt: skip
    c = config(**required)
    always = RECORDED[stage] - set(WHEN_SET.get(stage, {}))
    assert recorded_settings(c, world_size=1, seed=7) == {
        **{name: getattr(c, name) for name in always}, "world_size": 1, "seed": 7}  # fmt: skip
    if stage in WHEN_SET:  # set to another value, they are recorded
        c = config(**required, **WHEN_SET[stage])
        assert recorded_settings(c) == {name: getattr(c, name) for name in RECORDED[stage]}
