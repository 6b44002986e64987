"""Arguments are checked once, at the boundary, before any stage runs: flags (`eyas.cli`) and `eyas run` configs
(`eyas.pipeline`) alike, by `eyas.core.validate` from the stage configs' fields and the ranges declared on them. Each
bad value is one line naming the flag or key, with the usage-error exit code, and nothing is written."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from stage_outputs import refused, tree

import eyas
from eyas.core.errors import EyasError
from eyas.pipeline import check
from eyas.core.validate import Range, check_arguments

pytestmark = pytest.mark.usefixtures("one_thread")
SRC = str(Path(eyas.__file__).parents[1])  # the eyas under test, for the processes a test starts


# --------------------------------------------------------------------------- flags


def _train(made, out, *extra):
    return ["train", "--verifier", made.verifier, "--data", str(made.features), "--vocab", str(made.vocab),
            "--out", str(out), "--max-seq-len", "64", "--num-workers", "0", *extra]  # fmt: skip


TRAIN_FLAGS = [("--epochs", "0"), ("--max-steps", "0"), ("--lr", "-1"), ("--lr", "0"), ("--grad-accum", "0"),
               ("--log-every", "0"), ("--num-workers", "-1"), ("--head-dim", "0"), ("--intermediate-size", "0"),
               ("--clip", "-1"), ("--warmup-steps", "-1"), ("--save-every", "-1"), ("--keep-checkpoints", "0"),
               ("--val-ratio", "1"), ("--seed", "-1")]  # fmt: skip


def test_train_flags_out_of_range_are_one_line_each(made, tmp_path, capsys):
    made.draft  # every input exists: only the flag is wrong
    before = tree(made.root)
    import dataclasses

    from eyas.stages.train import TrainConfig

    ranges = {f.name: f.metadata["range"] for f in dataclasses.fields(TrainConfig)}
    for flag, value in TRAIN_FLAGS:
        err = refused(capsys, _train(made, tmp_path / "draft", flag, value), flag, value)
        assert str(ranges[flag[2:].replace("-", "_")]) in err
    assert tree(made.root) == before and not (tmp_path / "draft").exists()


def test_eval_max_new_tokens_zero_and_other_stages_flags(made, tmp_path, capsys):
    prompts = tmp_path / "p.jsonl"
    prompts.write_text(json.dumps({"turns": ["Hi"]}) + "\n")
    refused(capsys, ["eval", "--verifier", made.verifier, "--draft", "random", "--prompts", str(prompts),
                     "--max-new-tokens", "0", "--out", str(tmp_path / "r.json")],
            "--max-new-tokens", "at least 1")  # fmt: skip
    refused(capsys, ["vocab", "--data", str(made.prepared), "--out", str(tmp_path / "v"), "--draft-vocab-size", "0"],
            "--draft-vocab-size")  # fmt: skip
    refused(capsys, ["prepare", "--verifier", made.verifier, "--data", str(made.conversations), "--out",
                     str(tmp_path / "p"), "--num-proc", "0"], "--num-proc")  # fmt: skip
    refused(capsys, ["export", "random", "--out", str(tmp_path / "e"), "--speculative-tokens", "0"],
            "--speculative-tokens")  # fmt: skip
    assert sorted(p.name for p in tmp_path.iterdir()) == ["p.jsonl"]


@pytest.mark.skipif(torch.cuda.is_available(), reason="this machine has a GPU")
def test_device_cuda_without_a_gpu(made, tmp_path, capsys):
    prompts = tmp_path / "p.jsonl"
    prompts.write_text(json.dumps({"turns": ["Hi"]}) + "\n")
    refused(capsys, _train(made, tmp_path / "d", "--device", "cuda"), "--device cuda", "no CUDA GPU")
    refused(capsys, ["eval", "--verifier", made.verifier, "--draft", "random", "--prompts", str(prompts),
                     "--device", "cuda:0"], "--device cuda:0", "no CUDA GPU")  # fmt: skip
    refused(capsys, _train(made, tmp_path / "d", "--device", "tpu7"), "--device 'tpu7'")
    for device_map in ("cuda", "cuda:0"):  # a device map naming a device: AssertionError from torch before
        refused(capsys, ["extract", "--verifier", made.verifier, "--data", str(made.prepared), "--out",
                         str(tmp_path / "f"), "--device-map", device_map], f"--device-map {device_map}",
                "no CUDA GPU")  # fmt: skip
    assert sorted(p.name for p in tmp_path.iterdir()) == ["p.jsonl"]


@pytest.mark.skipif(torch.backends.mps.is_available(), reason="this machine has an Apple GPU")
def test_device_mps_without_one(made, tmp_path, capsys):
    refused(capsys, ["extract", "--verifier", made.verifier, "--data", str(made.prepared), "--out",
                     str(tmp_path / "f"), "--device", "mps"], "--device mps", "no Apple GPU")  # fmt: skip
    assert list(tmp_path.iterdir()) == []


def test_nan_and_huge_numbers_are_one_line(made, tmp_path, capsys):
    """NaN passes every comparison (--lr nan reached the optimizer's ValueError); a count past int64 ended in
    OverflowError, and a --max-seq-len past 32 bits in a tensor size that overflowed."""
    for flag, value, said in (("--lr", "nan", "finite"), ("--clip", "inf", "finite"), ("--step-loss-decay", "nan",
                              "finite"), ("--max-seq-len", str(10**20), "at most 2147483647"),
                              ("--batch-tokens", str(2**40), "at most 2147483647"), ("--seed", str(10**20),
                              "too large")):  # fmt: skip
        refused(capsys, _train(made, tmp_path / "d", flag, value), flag, said)
    refused(capsys, ["regenerate", "--verifier", made.verifier, "--data", str(made.conversations), "--out",
                     str(tmp_path / "r"), "--max-seq-len", str(10**20)], "--max-seq-len")  # fmt: skip
    assert list(tmp_path.iterdir()) == []


def test_a_nul_character_in_a_path_is_one_line(made, tmp_path, capsys):
    """A NUL in a path (a config's `out = "\\u0000"`) reached the OS's path functions, which raise a bare
    ValueError ("embedded null byte"); it is refused in one line naming the key, from a flag or from `eyas run`."""
    refused(capsys, _train(made, tmp_path / "d\x00"), "--out", "NUL character")
    (tmp_path / "run.toml").write_text('out = "\\u0000"\nverifier = "%s"\n\n[vocab]\ndata = "%s"\n'
                                       % (made.verifier, made.prepared))  # fmt: skip
    refused(capsys, ["run", str(tmp_path / "run.toml")], "[vocab] out", "NUL character")
    assert [p.name for p in tmp_path.iterdir()] == ["run.toml"]


def test_a_batch_that_cannot_fit_in_memory_is_refused_before_it_is_allocated(made, tmp_path, capsys):
    """`train --max-seq-len 1000000000` is refused in one line (unchecked, the kernel kills it at 23 GB silently)."""
    refused(capsys, _train(made, tmp_path / "d", "--max-seq-len", "1000000000"),  # (the later flag wins)
            "--max-seq-len 1000000000", "of host memory", "lower --max-seq-len")  # fmt: skip
    assert list(tmp_path.iterdir()) == []


@pytest.mark.parametrize("template, line, said", [
    ("{{ messages | nosuchfilter }}", 1, "No filter named 'nosuchfilter'"),
    ("{% for m in messages %}\n{{ m.content }\n{% endfor %}", 2, "TemplateSyntaxError"),
    ("{% for m in messages %}\n{{ m.content }}\n{% if m.role == 'user' %}{{ raise_exception('no system role') }}"
     "{% endif %}{% endfor %}", 3, "no system role"),
])  # fmt: skip
def test_a_chat_template_file_that_fails_names_its_line(made, tmp_path, capsys, template, line, said):
    """A Jinja syntax error, an unknown filter, a raise_exception: prepare, regenerate and eval used to end in a
    jinja2 traceback."""
    t = tmp_path / "t.jinja"
    t.write_text(template)
    v = ["--verifier", made.verifier, "--chat-template", str(t)]
    for argv in (
        ["prepare", *v, "--data", str(made.conversations), "--out", str(tmp_path / "p"), "--num-proc", "1"],
        ["regenerate", *v, "--data", str(made.conversations), "--out", str(tmp_path / "r")],
        ["eval", *v, "--draft", "random", "--prompts", str(made.conversations), "--max-new-tokens", "2"],
    ):
        refused(capsys, argv, f"--chat-template {t}, line {line}", said, alone=False)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["t.jinja"]


# --------------------------------------------------------------------------- places


def _writing_commands(made, out: str) -> list[list[str]]:
    v = ["--verifier", made.verifier]
    return [
        ["prepare", *v, "--data", str(made.conversations), "--out", out, "--num-proc", "1"],
        ["regenerate", *v, "--data", str(made.conversations), "--out", out, "--max-new-tokens", "2"],
        ["vocab", "--data", str(made.prepared), "--out", out],
        ["extract", *v, "--data", str(made.prepared), "--out", out],
        _train(made, out),
        ["export", str(made.draft), "--out", out],
        ["eval", *v, "--draft", "random", "--prompts", str(made.conversations), "--out", out],
    ]


def test_out_naming_an_existing_file_in_every_writing_stage(made, tmp_path, capsys):
    f = tmp_path / "taken.txt"
    f.write_text("keep")
    before = tree(tmp_path)
    for argv in _writing_commands(made, str(f)):
        refused(capsys, argv, "--out", str(f), "is a file")
    refused(capsys, ["extract", "--verifier", made.verifier, "--data", str(made.prepared), "--out",
                     str(tmp_path / "x"), "--speculators-out", str(f)], "--speculators-out")  # fmt: skip
    assert tree(tmp_path) == before


def test_eval_out_may_name_its_report_file(made, tmp_path):
    """An earlier report (recognised by its keys) may be replaced; any other JSON file may not."""
    from eyas.stages.evaluate import EvalConfig
    from eyas.core.manifest import REPORT_KEYS

    report = tmp_path / "report.json"
    report.write_text("{}")
    args = {"verifier": made.verifier, "draft": "random", "prompts": "p", "out": str(report)}
    with pytest.raises(EyasError, match="is not an `eyas eval` report"):
        check_arguments(EvalConfig, args)
    report.write_text(json.dumps(dict.fromkeys(REPORT_KEYS, 1)))
    assert check_arguments(EvalConfig, args).out == str(report)


def _without_root_powers() -> None:
    """In the child before it runs: drop root's power to write where permissions forbid it (CAP_DAC_OVERRIDE,
    CAP_DAC_READ_SEARCH, from the bounding set: gone after exec), so a read-only folder is read-only to it."""
    import ctypes

    libc = ctypes.CDLL(None, use_errno=True)
    for cap in (1, 2):
        if libc.prctl(24, cap, 0, 0, 0):  # PR_CAPBSET_DROP
            raise OSError(ctypes.get_errno(), "prctl(PR_CAPBSET_DROP)")


def test_out_in_a_read_only_folder(made, tmp_path):
    """Named at once, where the stage used to run and then fail to write with a traceback."""
    prompts = tmp_path / "p.jsonl"
    prompts.write_text(json.dumps({"turns": ["Hi"]}) + "\n")
    ro = tmp_path / "ro"
    ro.mkdir()
    ro.chmod(0o555)
    env = {**os.environ, "PYTHONPATH": SRC}
    drop = {"preexec_fn": _without_root_powers} if os.geteuid() == 0 else {}
    try:
        for argv in (["vocab", "--data", str(made.prepared), "--out", str(ro / "v")],
                     ["eval", "--verifier", made.verifier, "--draft", "random", "--prompts", str(prompts),
                      "--max-new-tokens", "2", "--out", str(ro / "report.json")]):  # fmt: skip
            r = subprocess.run([sys.executable, "-m", "eyas.cli", *argv], capture_output=True, text=True, env=env,
                               timeout=120, **drop)  # fmt: skip
            assert r.returncode == 2 and "Traceback" not in r.stderr, r.stderr
            assert r.stderr.count("\n") == 1 and str(ro) in r.stderr and "read-only" in r.stderr, r.stderr
        assert not any(ro.iterdir())
    finally:
        ro.chmod(0o755)


# --------------------------------------------------------------------------- eyas run configs


def _config(tmp_path, made, body: str) -> Path:
    cfg = tmp_path / "run.toml"
    cfg.write_text(f'out = "{tmp_path / "out"}"\nverifier = "{made.verifier}"\n' + body)
    return cfg


@pytest.mark.parametrize("body, key", [
    ('[prepare]\nmax_seq_len = 128\n', "[prepare] data"),  # no data, no [regenerate] to read from
    ('[prepare]\ndata = "DATA"\n[train]\nepochs = "1"\n', "[train] epochs"),
    ('[prepare]\ndata = "DATA"\nmax_seq_len = "128"\n', "[prepare] max_seq_len"),
    ('[prepare]\ndata = "DATA"\n[vocab]\ndraft_vocab_size = 64.5\n', "[vocab] draft_vocab_size"),
    ('[prepare]\ndata = "DATA"\n[train]\nepochs = 0\n', "[train] epochs"),
    ('[prepare]\ndata = "DATA"\n[train]\nlayers = [2, "4", 5]\n', "[train] layers[1]"),
    ('[prepare]\ndata = "DATA"\n[extract]\ndtype = "int8"\n', "[extract] dtype"),
    ('[prepare]\ndata = "DATA"\n[train]\nonline = "yes"\n', "[train] online"),
    ('[prepare]\ndata = "DATA"\n[vocab]\nout = "OUT/prepared"\n', "both write"),
    ('[prepare]\ndata = "DATA"\n[eval]\nprompts = "p"\nnum_prompts = 0\n', "[eval] num_prompts"),
])  # fmt: skip
def test_config_values_are_checked_before_any_stage_runs(made, tmp_path, capsys, body, key):
    cfg = _config(tmp_path, made, body.replace("DATA", str(made.conversations)).replace("OUT", str(tmp_path / "out")))
    with pytest.raises(EyasError) as e:
        check(str(cfg))
    assert key in str(e.value) and str(cfg) in str(e.value) and "\n" not in str(e.value), str(e.value)
    refused(capsys, ["run", str(cfg)], key)
    assert not (tmp_path / "out").exists()  # [prepare] never ran


def test_config_without_a_verifier(made, tmp_path, capsys):
    cfg = tmp_path / "run.toml"
    cfg.write_text(f'out = "{tmp_path / "out"}"\n[prepare]\ndata = "{made.conversations}"\n')
    refused(capsys, ["run", str(cfg)], "[prepare] verifier")


def test_config_numbers_are_normalised(made, tmp_path):
    """An int where a float belongs is taken (TOML's `lr = 1` is 1.0); the plan holds the checked values."""
    cfg = _config(
        tmp_path, made, f'[prepare]\ndata = "{made.conversations}"\n[train]\nonline = true\nlr = 1\nepochs = 2\n'
    )
    _, _, plan = check(str(cfg))
    train = dict((n, c) for n, _, c in plan)["train"]
    assert train.lr == 1.0 and isinstance(train.lr, float) and train.epochs == 2


def test_range_reads_as_it_checks():
    assert str(Range(1)) == "at least 1" and 0 not in Range(1) and 1 in Range(1)
    assert str(Range(0, low_open=True)) == "above 0" and 0 not in Range(0, low_open=True)
    r = Range(0, 1, high_open=True)
    assert str(r) == "at least 0 and below 1" and 0 in r and 0.5 in r and 1 not in r


# --------------------------------------------------------------------------- checkpoints eyas plan and inspect read


@pytest.mark.parametrize("value", ['"64"', "-64", "NaN", "1e400", "true"])
def test_plan_and_inspect_on_a_config_with_a_bad_size(made, tmp_path, capsys, value):
    """hidden_size a string, negative, NaN, infinite: plan and inspect used to end in TypeError, RuntimeError or
    ValueError."""
    v = shutil.copytree(made.verifier, tmp_path / "v")
    text = (v / "config.json").read_text()
    (v / "config.json").write_text(text.replace('"hidden_size": 64', f'"hidden_size": {value}'))
    for argv in (["plan", str(v), "--tokens", "1000"], ["inspect", str(v)]):
        refused(capsys, argv, str(v / "config.json"), "hidden_size is", "at least 1")


def test_plan_on_a_file(made, tmp_path, capsys):
    """A GGUF file (plan reads config.json and headers) or the config.json itself: NotADirectoryError before."""
    gguf = tmp_path / "m.gguf"
    gguf.write_bytes(b"GGUF")
    refused(capsys, ["plan", str(gguf), "--tokens", "1000"], str(gguf), "GGUF file")
    refused(capsys, ["plan", str(Path(made.verifier) / "config.json"), "--tokens", "1000"], "config.json",
            "checkpoint directory")  # fmt: skip
