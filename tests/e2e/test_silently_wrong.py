"""Nothing silently wrong: inputs that used to give a finished-looking but wrong or useless result (random
verifier layers, a corrupted feature shard, zero epochs or tokens, an aux layer the verifier does not have,
null final metrics) now stop with one line naming the file, key or flag."""

from __future__ import annotations

import json
import shutil

import pytest
import tiny
from safetensors.torch import load_file, save_file
from stage_outputs import refused, tree

from eyas.cli import main as cli_main
from eyas.core.errors import EyasError

pytestmark = pytest.mark.usefixtures("one_thread")


# --------------------------------------------------------------------------- missing verifier weights


def test_a_config_claiming_more_layers_than_the_weights_is_not_runnable(made, tmp_path, capsys):
    v = shutil.copytree(made.verifier, tmp_path / "v")
    cfg = json.loads((v / "config.json").read_text())
    cfg["num_hidden_layers"] = tiny.LAYERS + 2
    (v / "config.json").write_text(json.dumps(cfg))
    assert cli_main(["inspect", str(v), "--json"]) == 0
    summary = json.loads(capsys.readouterr().out)
    assert summary["runnable"] is False and any("model.layers.8." in r for r in summary["reasons"]), summary
    prepared = tiny.write_prepared(tmp_path / "prepared", tiny.random_rows(3, seed=0), verifier=v)
    before = tree(tmp_path)
    refused(capsys, ["extract", "--verifier", str(v), "--data", str(prepared), "--out", str(tmp_path / "f")],
            "model.layers.8.")  # fmt: skip
    assert {k: h for k, h in tree(tmp_path).items() if not k.startswith("f")} == before


def test_a_missing_weight_is_an_error_naming_the_first_missing_key(made, tmp_path):
    """The layers are all there but one tensor is not: transformers would initialise it at random."""
    from eyas.verifier.load import build_text_model, resolve

    v = shutil.copytree(made.verifier, tmp_path / "v")
    sd = load_file(v / "model.safetensors")
    gone = [k for k in sd if ".layers.3.mlp." in k or k.startswith("model.layers.5.self_attn.q_proj")]
    save_file({k: t for k, t in sd.items() if k not in gone}, str(v / "model.safetensors"), metadata={"format": "pt"})
    info = resolve(v)
    assert info.runnable  # every layer has weights: only loading can tell
    with pytest.raises(EyasError, match=r"lack 'model\.layers\.3\.mlp\.gate_proj\.weight' and 3 more"):
        build_text_model(info)


# --------------------------------------------------------------------------- feature shards checked by hash


def _damage_shard(features):
    """Flip eight bytes in the middle of the first shard (its hidden states), keeping its size: what
    `eyas extract --verify` calls corrupted, and what a size check cannot see."""
    shard = sorted(features.glob("rows_*.safetensors"))[0]
    data = bytearray(shard.read_bytes())
    mid = len(data) // 2
    data[mid : mid + 8] = bytes(b ^ 0xFF for b in data[mid : mid + 8])
    shard.write_bytes(bytes(data))
    return shard


def test_train_stops_at_a_shard_that_no_longer_matches_its_hash(made, tmp_path, capsys):
    feats = shutil.copytree(made.features, tmp_path / "features")
    shard = _damage_shard(feats)
    before = tree(tmp_path)
    refused(capsys, ["train", "--verifier", made.verifier, "--data", str(feats), "--out", str(tmp_path / "d"),
                     "--max-steps", "1", "--num-workers", "0", "--max-seq-len", "64"],
            shard.name, "eyas extract --verify")  # fmt: skip
    assert tree(tmp_path) == before  # stopped before the draft folder was made


def test_eval_offline_checks_the_shards_before_decoding(made, tmp_path, capsys, monkeypatch):
    import eyas.stages.evaluate as ev

    feats = shutil.copytree(made.features, tmp_path / "features")
    shard = _damage_shard(feats)
    prompts = tmp_path / "p.jsonl"
    prompts.write_text(json.dumps({"turns": ["Say hello."]}) + "\n")

    def decoding(*a, **k):
        raise AssertionError("decoding ran before the features were checked")

    monkeypatch.setattr(ev, "measure", decoding)
    before = tree(tmp_path)
    refused(capsys, ["eval", "--verifier", made.verifier, "--draft", str(made.draft), "--prompts", str(prompts),
                     "--offline", str(feats), "--out", str(tmp_path / "report.json"), "--max-new-tokens", "4"],
            shard.name)  # fmt: skip
    assert tree(tmp_path) == before


def test_a_shard_is_hashed_once_per_file_version(made, tmp_path, monkeypatch):
    import os

    from eyas.data import features as F

    feats = shutil.copytree(made.features, tmp_path / "features")
    hashed = []
    real = F.sha256_file
    monkeypatch.setattr(F, "sha256_file", lambda p, **k: hashed.append(p.name) or real(p, **k))
    n = len(list(feats.glob("rows_*.safetensors")))
    for _ in range(2):
        reader = F.FeatureReader(feats)
        assert len(reader.lengths) == len(reader) and reader[0].input_ids.numel()
    assert len(hashed) == n  # the second reader found every shard already checked
    shard = sorted(feats.glob("rows_*.safetensors"))[0]
    os.utime(shard, ns=(shard.stat().st_atime_ns, shard.stat().st_mtime_ns + 10**9))  # a new version of the file
    F.FeatureReader(feats)[0]
    assert hashed[n:] == [shard.name]


# --------------------------------------------------------------------------- finished-looking, useless outputs


def test_features_naming_an_aux_layer_the_verifier_lacks_are_refused(made, tmp_path, capsys):
    """Layer 99 of an 8-layer verifier: training used to write a draft with that id, which engines then run."""
    feats = shutil.copytree(made.features, tmp_path / "features")
    m = json.loads((feats / "manifest.json").read_text())
    m["layer_ids"] = [2, 4, 99]
    (feats / "manifest.json").write_text(json.dumps(m))
    before = tree(tmp_path)
    refused(capsys, ["train", "--verifier", made.verifier, "--data", str(feats), "--out", str(tmp_path / "d"),
                     "--max-seq-len", "64", "--num-workers", "0"],
            str(feats / "manifest.json"), "99", "1..7")  # fmt: skip
    assert tree(tmp_path) == before


def test_a_kill_during_the_final_write_keeps_the_final_metrics(made, tmp_path):
    """Killed after its last checkpoint and before its manifest: the rerun has no step left to take, and used to
    write a manifest whose final train and val metrics were null."""
    from eyas.stages.train import train

    draft = shutil.copytree(made.draft, tmp_path / "draft")
    first = json.loads((draft / "manifest.json").read_text())["outputs"]
    for name in ("manifest.json", "model.safetensors", "config.json"):
        (draft / name).unlink()  # the final write, cut before any of it landed
    result = train(**made.train_args(draft))
    again = json.loads((draft / "manifest.json").read_text())["outputs"]
    assert first["train"] and first["val"]
    assert again["train"] == first["train"] and again["val"] == first["val"] and result["val"] == first["val"]
    assert again["steps"] == first["steps"] == 2 and (draft / "model.safetensors").is_file()


# --------------------------------------------------------------------------- a damaged output is not up to date


@pytest.mark.parametrize("stage", ["prepare", "regenerate", "vocab", "extract", "train", "export"])
def test_a_rerun_redoes_its_own_damaged_output_instead_of_skipping_it(stage, made, tmp_path, capsys):
    """Cut a file of a finished output short and rerun the same command: it used to say "up to date; skipping"
    while the next stage called the file damaged (a loop with no way out). The manifest records every file's size
    and sha256; the rerun names the damaged file and does the work again, leaving a whole output."""
    from test_data_loss import _own_output, _run_stage

    from eyas.core.manifest import damaged_file

    out = _own_output(stage, made, tmp_path)
    manifest = json.loads((out / "manifest.json").read_text())
    name = max(manifest["files"], key=lambda f: manifest["files"][f]["bytes"])  # the weights, the rows, the shard
    whole = (out / name).read_bytes()
    (out / name).write_bytes(whole[: len(whole) // 2])
    capsys.readouterr()
    _run_stage(stage, made, out)
    said = capsys.readouterr().out
    assert f"{out} is damaged ({name} has {len(whole) // 2} bytes" in said and "skipping" not in said, said
    again = json.loads((out / "manifest.json").read_text())
    assert damaged_file(out, again) is None and set(again["files"]) == set(manifest["files"])
    assert (out / name).stat().st_size == len(whole)


def test_export_without_verifier_checks_the_aux_layers_against_the_one_the_draft_records(made, tmp_path, capsys):
    """Aux layer 99 for an 8-layer verifier: export without --verifier used to write it for an engine to run. The
    draft's training manifest records the verifier's layer count; without it, the verifier folder its config
    names is read."""
    draft = shutil.copytree(made.draft, tmp_path / "draft")
    cfg = json.loads((draft / "config.json").read_text())
    cfg["eagle_aux_hidden_state_layer_ids"] = [2, 4, 99]
    (draft / "config.json").write_text(json.dumps(cfg))
    before = tree(tmp_path)
    refused(capsys, ["export", str(draft), "--out", str(tmp_path / "e")], "config.json", "[99]", "8 layers",
            "manifest.json records")  # fmt: skip
    (draft / "manifest.json").unlink()
    refused(capsys, ["export", str(draft), "--out", str(tmp_path / "e")], "[99]", "8 layers", made.verifier)
    assert {k: v for k, v in tree(tmp_path).items() if k != "draft/manifest.json"} == \
        {k: v for k, v in before.items() if k != "draft/manifest.json"}  # fmt: skip


class _CutWhileReading:
    """Rows of a features folder whose shard is cut short by the reading worker itself, between two reads: the
    second read touches pages past the new end of the memory-mapped file (SIGBUS), as a shard truncated under a
    running train does."""

    def __init__(self, rows, shard):
        self.rows, self.shard = rows, shard

    def __len__(self):
        return 1

    def __getitem__(self, i):
        self.rows.row(0)
        with open(self.shard, "r+b") as f:
            f.truncate(4096)
        return self.rows.row(len(self.rows) - 1).aux.sum()


def test_a_shard_cut_short_under_a_running_train_is_named_not_blamed_on_shared_memory(made, tmp_path):
    """The DataLoader says its worker was "killed by signal: Bus error" and suggests shared memory; train names the
    shard whose size no longer matches its manifest."""
    import torch

    from eyas.training.batches import FeatureRows
    from eyas.training.trainer import loader_error

    feats = shutil.copytree(made.features, tmp_path / "features")
    shard = sorted(feats.glob("rows_*.safetensors"))[0]
    rows = FeatureRows(str(feats), dtype=torch.float32)
    loader = torch.utils.data.DataLoader(_CutWhileReading(rows, shard), batch_size=None, num_workers=1)
    with pytest.raises(RuntimeError, match="DataLoader worker") as e:  # "killed by signal: Bus error", or "exited"
        list(loader)
    err = loader_error(rows, e.value)
    assert isinstance(err, EyasError)
    assert f"feature shard {shard} changed while training read it (4096 bytes" in str(err)
    assert loader_error(rows, RuntimeError("CUDA out of memory")).args == ("CUDA out of memory",)
