"""Nothing silently wrong: inputs that used to give a finished-looking but wrong or useless result (random
verifier layers, a corrupted feature shard, zero epochs or tokens, an aux layer the verifier does not have,
null final metrics) now stop with one line naming the file, key or flag."""

from __future__ import annotations

import json
import shutil

import pytest
import tiny
from safetensors.torch import load_file, save_file
from stage_outputs import Outputs, tree

from eyas.cli import main as cli_main
from eyas.errors import EyasError

pytestmark = pytest.mark.usefixtures("one_thread")


@pytest.fixture(scope="module")
def made(make_tiny, tmp_path_factory):
    return Outputs(tmp_path_factory.mktemp("made"), make_tiny("llama").path)


def _one_line_error(capsys, argv: list[str], *names: str) -> str:
    """``eyas ARGV`` exits with the usage-error code, its last stderr line the error naming each of ``names``."""
    capsys.readouterr()
    assert cli_main(argv) == 2
    err = capsys.readouterr().err
    assert "Traceback" not in err, err
    last = err.rstrip("\n").split("\n")[-1].split("\r")[-1]
    assert last.startswith(f"eyas {argv[0]}: error: "), err
    for name in names:
        assert name in last, last
    return last


# --------------------------------------------------------------------------- missing verifier weights


def _copy_verifier(src, dst):
    shutil.copytree(src, dst)
    return dst


def test_a_config_claiming_more_layers_than_the_weights_is_not_runnable(made, tmp_path, capsys):
    v = _copy_verifier(made.verifier, tmp_path / "v")
    cfg = json.loads((v / "config.json").read_text())
    cfg["num_hidden_layers"] = tiny.LAYERS + 2
    (v / "config.json").write_text(json.dumps(cfg))
    assert cli_main(["inspect", str(v), "--json"]) == 0
    summary = json.loads(capsys.readouterr().out)
    assert summary["runnable"] is False and any("model.layers.8." in r for r in summary["reasons"]), summary
    prepared = tiny.write_prepared(tmp_path / "prepared", tiny.random_rows(3, seed=0), verifier=v)
    before = tree(tmp_path)
    _one_line_error(capsys, ["extract", "--verifier", str(v), "--data", str(prepared), "--out", str(tmp_path / "f")],
                    "model.layers.8.")  # fmt: skip
    assert {k: h for k, h in tree(tmp_path).items() if not k.startswith("f")} == before


def test_a_missing_weight_is_an_error_naming_the_first_missing_key(made, tmp_path):
    """The layers are all there but one tensor is not: transformers would initialise it at random."""
    from eyas.verifier import build_text_model, resolve

    v = _copy_verifier(made.verifier, tmp_path / "v")
    sd = load_file(v / "model.safetensors")
    gone = [k for k in sd if ".layers.3.mlp." in k or k.startswith("model.layers.5.self_attn.q_proj")]
    save_file({k: t for k, t in sd.items() if k not in gone}, str(v / "model.safetensors"), metadata={"format": "pt"})
    info = resolve(v)
    assert info.runnable  # every layer has weights: only loading can tell
    with pytest.raises(EyasError, match=r"lack 'model\.layers\.3\.mlp\.gate_proj\.weight' and 3 more"):
        build_text_model(info)
