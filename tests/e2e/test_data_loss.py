"""Nothing lost: a stage pointed at a folder that is not its own refuses it, before any work, and leaves every
byte there as it was (the folder's other contents, another stage's output, an unrelated file)."""

from __future__ import annotations

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
