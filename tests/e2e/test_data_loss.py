"""Nothing lost: a stage pointed at a folder that is not its own refuses it, before any work, and leaves every
byte there as it was (the folder's other contents, another stage's output, an unrelated file)."""

from __future__ import annotations

import json
import os
import shutil

import pytest
from stage_outputs import refused, tree

from eyas.cli import main as cli_main
from eyas.core.errors import EyasError

pytestmark = pytest.mark.usefixtures("one_thread")


# --------------------------------------------------------------------------- extract --speculators-out


def test_speculators_out_never_replaces_a_folder_eyas_did_not_write_there(made, tmp_path, capsys):
    """A parent folder of the features (with an unrelated file), the features folder itself, an existing file:
    each is refused before anything runs; a rerun into its own earlier layout replaces that layout."""
    parent = tmp_path / "sp"
    (parent / "other").mkdir(parents=True)
    (parent / "other" / "k.txt").write_text("keep")
    feat = shutil.copytree(made.features, parent / "feat")
    (tmp_path / "file.bin").write_bytes(b"\x00keep")
    a = ["extract", "--verifier", made.verifier, "--data", str(made.prepared), "--device", "cpu", "--dtype", "fp32"]
    before = tree(tmp_path)
    refused(capsys, [*a, "--out", str(feat), "--speculators-out", str(parent)], str(parent))
    refused(capsys, [*a, "--out", str(feat), "--speculators-out", str(feat)], str(feat))
    refused(capsys, [*a, "--out", str(feat), "--speculators-out", str(tmp_path / "file.bin")], "file.bin")
    refused(capsys, [*a, "--out", str(tmp_path / "new"), "--speculators-out", str(parent)], str(parent))
    assert tree(tmp_path) == before  # not a byte moved, and no features were extracted into new/
    spec = tmp_path / "spec"
    for _ in range(2):  # written, then replaced by the rerun (it is the layout eyas wrote)
        assert cli_main([*a, "--out", str(feat), "--speculators-out", str(spec)]) == 0
        assert (spec / "hidden_states" / "hs_0.safetensors").is_file()
    (spec / "notes.txt").write_text("mine")  # a file of the user's inside it: no longer only eyas's layout
    before = tree(tmp_path)
    refused(capsys, [*a, "--out", str(feat), "--speculators-out", str(spec)], str(spec))
    assert tree(tmp_path) == before


def test_write_speculators_refuses_the_features_folder_in_python_too(made, tmp_path):
    from eyas.data.features import write_speculators

    feat = shutil.copytree(made.features, tmp_path / "feat")
    before = tree(tmp_path)
    for dst in (feat, tmp_path):
        with pytest.raises(EyasError, match="speculators"):
            write_speculators(feat, out=dst)
    assert tree(tmp_path) == before


# --------------------------------------------------------------------------- another stage's folder


def test_vocab_prepare_regenerate_export_refuse_another_stages_folder(made, tmp_path, capsys):
    """vocab into a prepared folder, prepare into a regenerated one (also as its own --data) or into features,
    regenerate and export into a prepared folder: each would have replaced that folder's manifest."""
    prepared = shutil.copytree(made.prepared, tmp_path / "prepared")
    regenerated = shutil.copytree(made.regenerated, tmp_path / "regen")
    features = shutil.copytree(made.features, tmp_path / "features")
    v = ["--verifier", made.verifier]
    before = tree(tmp_path)
    refused(capsys, ["vocab", "--data", str(prepared), "--out", str(prepared)], str(prepared), "eyas prepare")
    refused(capsys, ["prepare", *v, "--data", str(regenerated), "--out", str(regenerated), "--num-proc", "1"],
            str(regenerated), "eyas regenerate")  # fmt: skip
    refused(capsys, ["prepare", *v, "--data", str(made.conversations), "--out", str(features), "--num-proc", "1"],
            str(features), "eyas extract")  # fmt: skip
    refused(capsys, ["regenerate", *v, "--data", str(made.conversations), "--out", str(prepared),
                     "--max-new-tokens", "2"], str(prepared), "eyas prepare")  # fmt: skip
    refused(capsys, ["export", str(made.draft), "--out", str(prepared)], str(prepared), "eyas prepare")
    assert tree(tmp_path) == before


def test_an_unfinished_regenerate_folder_is_not_prepared_over(made, tmp_path, capsys):
    """A regenerate run that was stopped has parts and no manifest yet; prepare shares the `.parts` folder name
    and used to delete every part that was not its own."""
    regen = tmp_path / "regen"
    (regen / ".parts" / "0123456789abcdef").mkdir(parents=True)
    (regen / ".parts" / "0123456789abcdef" / "part-00000.records").write_text('{"records": []}')
    before = tree(tmp_path)
    refused(capsys, ["prepare", "--verifier", made.verifier, "--data", str(made.conversations), "--out", str(regen),
                     "--num-proc", "1"], str(regen), "eyas regenerate")  # fmt: skip
    assert tree(tmp_path) == before


def test_an_own_folder_is_still_rewritten(made, tmp_path):
    """Refusing other stages' folders leaves a stage free to redo its own with other settings."""
    from eyas.stages.vocab import vocab

    out = shutil.copytree(made.vocab, tmp_path / "vocab")
    m = vocab(data=str(made.prepared), out=str(out), draft_vocab_size=32)
    assert m["draft_vocab_size"] == 32


def test_prepare_takes_its_lock_before_reading_the_source(made, tmp_path):
    """Two prepares into one --out: the second stops at once (its source is not even read), instead of both
    finishing and the later one replacing the other's rows. A source that cannot be read shows the order."""
    from eyas.stages.prepare import prepare

    out = shutil.copytree(made.prepared, tmp_path / "prepared")
    (out / ".eyas.lock").write_text(str(os.getppid()))  # a live process holds it
    before = tree(tmp_path)
    with pytest.raises(EyasError, match="another eyas process"):
        prepare(verifier=made.verifier, data=str(tmp_path / "no-such.jsonl"), out=str(out), num_proc=1)
    assert tree(tmp_path) == before


def test_a_refused_run_leaves_no_empty_folder(made, tmp_path):
    """An --out that did not exist is not left behind, empty, by a run that stopped with an error."""
    from eyas.stages.prepare import prepare

    with pytest.raises(EyasError, match="data not found"):
        prepare(verifier=made.verifier, data=str(tmp_path / "no-such.jsonl"), out=str(tmp_path / "o"), num_proc=1)
    assert not (tmp_path / "o").exists()


# --------------------------------------------------------------------------- every stage's folder, one protocol


def _run_stage(stage: str, made, out) -> None:
    """``stage`` into ``out`` with the arguments its output in ``made`` was made with (a rerun of it)."""
    v, out = made.verifier, str(out)
    if stage == "prepare":
        from eyas.stages.prepare import prepare

        prepare(verifier=v, data=str(made.conversations), out=out, max_seq_len=128, num_proc=1)
    elif stage == "regenerate":
        from eyas.stages.regenerate import regenerate

        regenerate(verifier=v, data=str(made.conversations), out=out, max_new_tokens=4, max_turns=1)
    elif stage == "vocab":
        from eyas.stages.vocab import vocab

        vocab(data=str(made.prepared), out=out, draft_vocab_size=64)
    elif stage == "extract":
        from eyas.stages.extract import extract

        extract(verifier=v, data=str(made.prepared), out=out, dtype="fp32")
    elif stage == "train":
        from eyas.stages.train import train

        train(**made.train_args(out))
    else:
        from eyas.stages.export import export

        export(draft=str(made.draft), out=out)


def _own_output(stage: str, made, tmp_path):
    """A copy of ``stage``'s finished output (export's is made here: no other test needs one)."""
    if stage == "export":
        _run_stage("export", made, tmp_path / "made-export")
        return shutil.copytree(tmp_path / "made-export", tmp_path / "own")
    made_as = {"prepare": made.prepared, "regenerate": made.regenerated, "vocab": made.vocab,
               "extract": made.features, "train": made.draft}  # fmt: skip
    return shutil.copytree(made_as[stage], tmp_path / "own")


STAGES = ("prepare", "regenerate", "vocab", "extract", "train", "export")


@pytest.mark.parametrize("stage", STAGES)
def test_a_second_run_into_a_locked_folder_is_refused(stage, made, tmp_path):
    """While another process writes an --out (its lock names a live pid), a run of any stage into it stops,
    naming the lock, and changes nothing: into a new folder, and into the stage's own finished output, which the
    writer may be redoing (a rerun that only found it up to date would read it half rewritten)."""
    fresh = tmp_path / "fresh"
    fresh.mkdir()
    for out in (fresh, _own_output(stage, made, tmp_path)):
        lock = out / ".eyas.lock"
        lock.write_text(str(os.getppid()))  # a live process holds it
        before = tree(tmp_path)
        with pytest.raises(EyasError, match="another eyas process") as e:
            _run_stage(stage, made, out)
        assert str(lock) in str(e.value)
        assert tree(tmp_path) == before


@pytest.mark.parametrize("stage", STAGES)
def test_another_stages_folder_is_refused_by_every_stage(stage, made, tmp_path):
    """Any stage pointed at another stage's folder, finished or stopped part way, refuses it by name and leaves
    every byte there as it was."""
    other, finished = ("vocab", made.vocab) if stage == "prepare" else ("prepare", made.prepared)
    foreign = shutil.copytree(finished, tmp_path / "finished")
    unfinished = tmp_path / "unfinished"  # a stopped extraction (a stopped regenerate, for extract itself)
    stopped = "regenerate" if stage == "extract" else "extract"
    left = unfinished / (".parts/0123456789abcdef/part-00000.records" if stopped == "regenerate" else
                         ".progress-rank0.json")  # fmt: skip
    left.parent.mkdir(parents=True)
    left.write_text('{"plan": "p", "shards": {}}')
    for out, owner in ((foreign, other), (unfinished, stopped)):
        before = tree(tmp_path)
        with pytest.raises(EyasError, match=f"holds the output of `eyas {owner}`") as e:
            _run_stage(stage, made, out)
        assert str(out) in str(e.value) and f"`eyas {stage}` would replace it" in str(e.value)
        assert tree(tmp_path) == before


# --------------------------------------------------------------------------- files eyas did not write


@pytest.mark.parametrize("stage", STAGES)
def test_every_stage_refuses_a_verifier_folder_and_a_users_files(stage, made, tmp_path):
    """A copy of the verifier checkpoint as --out (a typo of one argument for another), and a folder holding a
    user's file: no manifest in either, so nothing there is the stage's; each is refused, naming the files, and
    left byte for byte as it was (train and export used to replace the verifier's config.json and weights)."""
    verifier = shutil.copytree(made.verifier, tmp_path / "verifier")
    users = tmp_path / "mine"
    users.mkdir()
    (users / "notes.txt").write_text("keep")
    for out, named in ((verifier, "config.json"), (users, "notes.txt")):
        before = tree(tmp_path)
        with pytest.raises(EyasError, match="holds files eyas did not write") as e:
            _run_stage(stage, made, out)
        assert str(out) in str(e.value) and named in str(e.value) and "\n" not in str(e.value)
        if stage in ("train", "export") and out == verifier:
            assert f"`eyas {stage}` would replace config.json, model.safetensors" in str(e.value)
        assert tree(tmp_path) == before


def test_train_on_the_command_line_refuses_the_verifier_before_any_work(made, tmp_path, capsys):
    """The command line checks --out with the other arguments: one line, exit 2, nothing read or written."""
    verifier = shutil.copytree(made.verifier, tmp_path / "verifier")
    before = tree(tmp_path)
    refused(capsys, ["train", "--verifier", made.verifier, "--data", str(made.features), "--vocab", str(made.vocab),
                     "--out", str(verifier), "--max-steps", "1", "--num-workers", "0"],
            "--out", str(verifier), "config.json", "model.safetensors")  # fmt: skip
    assert tree(tmp_path) == before


def test_a_stopped_run_keeps_its_folder_and_a_clean_failure_leaves_it_as_new(made, tmp_path):
    """A stage marks a new folder as its own while it works (a run stopped before its manifest can be rerun,
    and another stage is refused there); a run that fails before writing anything leaves the folder empty."""
    from eyas.core.manifest import MARK, StageOutput, check_out

    out = tmp_path / "o"
    out.mkdir()
    with pytest.raises(EyasError, match="boom"), StageOutput(out, stage="vocab"):
        raise EyasError("boom")
    assert list(out.iterdir()) == []  # as it was: nothing written
    with pytest.raises(KeyboardInterrupt), StageOutput(out, stage="vocab"):
        (out / "d2t.npy").write_bytes(b"half of the work")
        raise KeyboardInterrupt  # stopped after its first file, before its manifest
    assert json.loads((out / MARK).read_text()) == {"stage": "vocab"}
    check_out(out, stage="vocab")  # its own: a rerun finishes it
    with pytest.raises(EyasError, match="holds the output of `eyas vocab`"):
        check_out(out, stage="prepare")
    _run_stage("vocab", made, out)
    assert not (out / MARK).exists() and (out / "manifest.json").is_file()


def test_a_dangling_link_as_out_is_one_line(made, tmp_path, capsys):
    (tmp_path / "link").symlink_to(tmp_path / "gone")
    refused(capsys, ["vocab", "--data", str(made.prepared), "--out", str(tmp_path / "link")], "link", "gone")
    with pytest.raises(EyasError, match="does not exist"):
        _run_stage("vocab", made, tmp_path / "link")


# --------------------------------------------------------------------------- eval's report


def test_eval_replaces_only_its_own_earlier_report(made, tmp_path, capsys):
    """`eyas eval --out FILE` used to replace whatever FILE was: a verifier's config.json, a features manifest
    (orphaning every shard), the draft's own config. Now those, a JSON file of the user's, a plot of the user's
    where the histogram goes, and a report inside a stage's folder are refused before any decoding; a new path
    is written and an earlier report (and its plot) replaced."""
    verifier = shutil.copytree(made.verifier, tmp_path / "verifier")
    features = shutil.copytree(made.features, tmp_path / "features")
    draft = shutil.copytree(made.draft, tmp_path / "draft")
    (tmp_path / "mine.json").write_text('{"tau": 3}')
    (tmp_path / "r_accepted_lengths.png").write_bytes(b"a plot of mine")
    prompts = tmp_path / "p.jsonl"
    prompts.write_text('{"turns": ["Say hi."]}\n')
    a = ["eval", "--verifier", made.verifier, "--draft", str(draft), "--prompts", str(prompts), "--max-new-tokens",
         "3", "--device", "cpu"]  # fmt: skip
    before = tree(tmp_path)
    for out, named in ((verifier / "config.json", "not an `eyas eval` report"),
                       (features / "manifest.json", "holds the output of `eyas extract`"),
                       (draft / "config.json", "holds the output of `eyas train`"), (features, "eyas extract"),
                       (tmp_path / "mine.json", "not an `eyas eval` report"),
                       (tmp_path / "r.json", "r_accepted_lengths.png")):  # fmt: skip
        refused(capsys, [*a, "--out", str(out)], str(out), named)
    assert tree(tmp_path) == before
    with pytest.raises(EyasError, match="not an `eyas eval` report"):  # the Python call checks it too
        from eyas.stages.evaluate import evaluate

        evaluate(verifier=made.verifier, draft=str(draft), prompts=str(prompts), max_new_tokens=3, device="cpu",
                 out=str(verifier / "config.json"))  # fmt: skip
    assert tree(tmp_path) == before
    for _ in range(2):  # a new path, then the same path again: its own earlier report and plot
        assert cli_main([*a, "--out", str(tmp_path / "new.json")]) == 0
    assert json.loads((tmp_path / "new.json").read_text())["histogram_png"].endswith("new_accepted_lengths.png")
    assert {k: v for k, v in tree(tmp_path).items() if not k.startswith("new")} == before


def test_run_refuses_an_eval_report_inside_another_sections_folder(make_tiny, tmp_path):
    from eyas.pipeline import check

    cfg = tmp_path / "run.toml"
    cfg.write_text(f'out = "{tmp_path / "o"}"\nverifier = "{make_tiny("llama").path}"\n[vocab]\n'
                   f'[eval]\nprompts = "mt-bench"\nout = "{tmp_path / "o" / "vocab" / "report.json"}"\n')  # fmt: skip
    with pytest.raises(EyasError, match=r"\[eval\] out .*report.json is inside .*vocab, the folder \[vocab\] writes"):
        check(str(cfg))
    assert not (tmp_path / "o").exists()
