"""Damaged files get one line naming the file, never a traceback: sources that are not UTF-8 or cut short,
prepared rows cut short, drafts and feature shards cut or with a damaged header; and a property test that
damages each kind of input at random and runs every command that reads it."""

from __future__ import annotations

import gzip
import json
import os
import shutil
import tempfile
from pathlib import Path

import pytest
import tiny
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from stage_outputs import CONVERSATIONS, refused, tree

from eyas.cli import main as cli_main

pytestmark = pytest.mark.usefixtures("one_thread")


def _jsonl_bytes() -> list[bytes]:
    return [json.dumps(c).encode() for c in CONVERSATIONS]


# --------------------------------------------------------------------------- sources


def test_a_jsonl_line_that_is_not_utf8_is_one_malformed_row(made, tmp_path, capsys):
    """prepare and regenerate drop that row, count it and name its line; --strict stops at it in one line."""
    lines = _jsonl_bytes()
    lines[1] = lines[1].replace(b"plus", b"pl\xffus", 1)
    src = tmp_path / "c.jsonl"
    src.write_bytes(b"\n".join(lines) + b"\n")
    v = ["--verifier", made.verifier, "--data", str(src)]
    assert cli_main(["prepare", *v, "--out", str(tmp_path / "p"), "--num-proc", "1"]) == 0
    report = json.loads((tmp_path / "p" / "manifest.json").read_text())["report"]
    assert report["problems"]["malformed"]["rows"] == [1] and "c.jsonl:2 is not valid UTF-8" in str(report["details"])
    refused(capsys, ["prepare", *v, "--out", str(tmp_path / "q"), "--num-proc", "1", "--strict"],
            f"{src}: row 1", "not valid UTF-8")  # fmt: skip
    assert cli_main(["regenerate", *v, "--out", str(tmp_path / "r"), "--max-new-tokens", "2", "--max-turns", "1"]) == 0
    report = json.loads((tmp_path / "r" / "manifest.json").read_text())["report"]
    assert report["problems"]["malformed"]["rows"] == [1]


def test_regenerate_counts_and_names_the_rows_it_drops_and_reads_a_byte_order_mark(made, tmp_path, capsys):
    """Ten lines in: the first behind a UTF-8 byte-order mark (some editors write one; it used to be a malformed
    row), one not JSON, one not UTF-8, one with only a system turn. regenerate answers the seven prompts and says
    what it dropped, with row numbers, as prepare does (it used to print "9 prompts" and nothing else); a .json
    file behind a mark is read too."""
    lines = [json.dumps({"turns": [f"Say {i}."]}).encode() for i in range(10)]
    lines[0] = b"\xef\xbb\xbf" + lines[0]
    lines[3] = b'{"turns": ["cut'
    lines[5] = b'{"turns": ["caf\xe9"]}'
    lines[8] = json.dumps({"messages": [{"role": "system", "content": "Be brief."}]}).encode()
    src = tmp_path / "c.jsonl"
    src.write_bytes(b"\n".join(lines) + b"\n")
    capsys.readouterr()
    assert cli_main(["regenerate", "--verifier", made.verifier, "--data", str(src), "--out", str(tmp_path / "r"),
                     "--max-new-tokens", "2"]) == 0  # fmt: skip
    said = capsys.readouterr().out
    assert "10 rows in the source, 7 prompts" in said, said
    assert "malformed: 2 (" in said and "rows 3, 5" in said and "no_user_turn: 1 (" in said and "rows 8" in said
    report = json.loads((tmp_path / "r" / "manifest.json").read_text())["report"]
    assert report["problems"]["malformed"]["rows"] == [3, 5] and "c.jsonl:6 is not valid UTF-8" in str(report)
    from eyas.data.datasets import load_prompts

    (tmp_path / "c.json").write_bytes(b"\xef\xbb\xbf" + json.dumps([{"turns": ["Hi."]}]).encode())
    assert [p.turns for p in load_prompts(str(tmp_path / "c.json"))[0]] == [["Hi."]]


def test_regenerate_on_system_only_rows_says_they_have_no_user_turn(made, tmp_path, capsys):
    """It used to say the records lacked 'turns' or 'messages', which they have."""
    src = tmp_path / "s.jsonl"
    src.write_text(json.dumps({"messages": [{"role": "system", "content": "Be brief."}]}) + "\n")
    refused(capsys, ["regenerate", "--verifier", made.verifier, "--data", str(src), "--out", str(tmp_path / "r")],
            str(src), "1 no_user_turn (row 0: only system turns)", alone=False)  # fmt: skip


def test_a_json_file_that_is_not_utf8(made, tmp_path, capsys):
    src = tmp_path / "c.json"
    src.write_bytes(b"[" + b",".join(_jsonl_bytes()).replace(b"Blue", b"Bl\xe9ue") + b"]")
    refused(capsys, ["prepare", "--verifier", made.verifier, "--data", str(src), "--out", str(tmp_path / "p"),
                     "--num-proc", "1"], str(src), "not valid UTF-8")  # fmt: skip
    assert sorted(p.name for p in tmp_path.iterdir()) == ["c.json"]


def test_a_gzipped_jsonl_cut_short(made, tmp_path, capsys):
    packed = gzip.compress(b"\n".join(_jsonl_bytes() * 20) + b"\n")
    src = tmp_path / "c.jsonl.gz"
    src.write_bytes(packed[: len(packed) * 2 // 3])
    v = ["--verifier", made.verifier, "--data", str(src)]
    refused(capsys, ["prepare", *v, "--out", str(tmp_path / "p"), "--num-proc", "1"], str(src), "cut short")
    refused(capsys, ["regenerate", *v, "--out", str(tmp_path / "r"), "--max-new-tokens", "2"], str(src), "cut short",
            alone=False)  # fmt: skip
    assert not (tmp_path / "p").exists() and src.read_bytes() == packed[: len(packed) * 2 // 3]


# --------------------------------------------------------------------------- prepared rows


def test_prepared_rows_cut_short(made, tmp_path, capsys):
    """Cut inside a record batch: Arrow's error, in one line naming the folder, for every stage that reads it."""
    prepared = shutil.copytree(made.prepared, tmp_path / "prepared")
    arrow = next((prepared / "rows").glob("*.arrow"))
    arrow.write_bytes(arrow.read_bytes()[: arrow.stat().st_size // 2])
    before = tree(tmp_path)
    rows = str(prepared / "rows")
    refused(capsys, ["vocab", "--data", str(prepared), "--out", str(tmp_path / "v")], rows, "damaged")
    refused(capsys, ["extract", "--verifier", made.verifier, "--data", str(prepared), "--out", str(tmp_path / "f")],
            rows, "damaged")  # fmt: skip
    refused(capsys, ["train", "--verifier", made.verifier, "--data", str(prepared), "--online", "--out",
                     str(tmp_path / "d"), "--max-seq-len", "64", "--num-workers", "0"], rows, "damaged")  # fmt: skip
    assert tree(tmp_path) == before


def test_prepared_rows_cut_at_a_batch_boundary_read_short(made, tmp_path, capsys):
    """Arrow's stream format has no footer: cut after a whole record batch it reads fewer rows without a word."""
    import pyarrow as pa

    prepared = tiny.write_prepared(tmp_path / "prepared", [([5, 6, 7, 8], [0, 0, 1, 1])] * 1100,
                                   verifier=Path(made.verifier))  # fmt: skip
    arrow = next((prepared / "rows").glob("*.arrow"))
    with pa.memory_map(str(arrow)) as mm:
        pa.ipc.open_stream(mm).read_next_batch()  # the first 1000 rows (datasets writes batches of 1000)
        cut = mm.tell()
    arrow.write_bytes(arrow.read_bytes()[:cut])
    refused(capsys, ["vocab", "--data", str(prepared), "--out", str(tmp_path / "v")], "1000 rows", "says 1100")


# --------------------------------------------------------------------------- drafts and features


def _cut(path: Path) -> None:
    path.write_bytes(path.read_bytes()[: path.stat().st_size // 2])


def _bad_header(path: Path) -> None:
    data = bytearray(path.read_bytes())
    data[9:17] = b"\xff" * 8  # inside the JSON header, after its 8-byte length
    path.write_bytes(bytes(data))


@pytest.mark.parametrize("damage", [_cut, _bad_header])
def test_a_damaged_draft(made, tmp_path, capsys, damage):
    draft = shutil.copytree(made.draft, tmp_path / "draft")
    damage(draft / "model.safetensors")
    prompts = tmp_path / "p.jsonl"
    prompts.write_text(json.dumps({"turns": ["Hi"]}) + "\n")
    before = tree(tmp_path)
    weights = str(draft / "model.safetensors")
    refused(capsys, ["export", str(draft), "--out", str(tmp_path / "e")], weights, "damaged")
    refused(capsys, ["eval", "--verifier", made.verifier, "--draft", str(draft), "--prompts", str(prompts),
                     "--max-new-tokens", "2"], weights, "damaged")  # fmt: skip
    assert tree(tmp_path) == before


@pytest.mark.parametrize("damage", [_cut, _bad_header])
def test_a_damaged_feature_shard(made, tmp_path, capsys, damage):
    feats = shutil.copytree(made.features, tmp_path / "features")
    shard = sorted(feats.glob("rows_*.safetensors"))[0]
    damage(shard)
    before = tree(tmp_path)
    refused(capsys, ["train", "--verifier", made.verifier, "--data", str(feats), "--out", str(tmp_path / "d"),
                     "--max-seq-len", "64", "--num-workers", "0"], shard.name)  # fmt: skip
    assert tree(tmp_path) == before


# --------------------------------------------------------------------------- random damage, every reader

#: One damage to one file: cut at a fraction of its length, bytes inverted or overwritten at a fraction of it,
#: emptied, or deleted.
DAMAGE = st.one_of(
    st.tuples(st.just("cut"), st.floats(0, 1)),
    st.tuples(st.just("invert"), st.floats(0, 1), st.integers(1, 64)),
    st.tuples(st.just("overwrite"), st.floats(0, 1), st.binary(min_size=1, max_size=64)),
    st.tuples(st.just("delete")),
)
PROPERTY = settings(max_examples=8, deadline=None,
                    suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow])  # fmt: skip


def _damage(path: Path, how: tuple) -> None:
    if how[0] == "delete":
        path.unlink()
        return
    data = bytearray(path.read_bytes())
    at = min(int(len(data) * how[1]), max(len(data) - 1, 0))
    if how[0] == "cut":
        del data[at:]
    elif how[0] == "invert":
        data[at : at + how[2]] = bytes(b ^ 0xFF for b in data[at : at + how[2]])
    else:
        data[at : at + len(how[2])] = how[2]
    path.write_bytes(bytes(data))


def _files(folder: Path) -> list[str]:
    return sorted(str(p.relative_to(folder)) for p in folder.rglob("*") if p.is_file())


def _each_succeeds_or_says_why(capsys, root: Path, commands: list[tuple[list[str], str | None]]) -> None:
    """Every command exits 0, or 2 with its error (no traceback: any other exception fails the test here);
    nothing under ``root`` but its own output (``out``, relative to ``root``) changes."""
    for argv, out in commands:
        keep = lambda rel, out=out: out is None or not (rel == out or rel.startswith(out + os.sep))  # noqa: E731
        before = {k: h for k, h in tree(root).items() if keep(k)}
        capsys.readouterr()
        code = cli_main(argv)
        err = capsys.readouterr().err
        assert "Traceback" not in err, err
        if code == 2:  # the error starts a line of its own (only `extract --verify` goes on to list problems)
            assert err.count(f"eyas {argv[0]}: error: ") == 1, err
            assert f"\neyas {argv[0]}: error: " in "\n" + err.replace("\r", "\n"), err
        else:
            assert code == 0, (code, err)
        assert {k: h for k, h in tree(root).items() if keep(k)} == before, argv


@pytest.fixture
def scratch(tmp_path):
    """A fresh folder for each Hypothesis example (the test's tmp_path is shared by all of them)."""

    def make() -> Path:
        return Path(tempfile.mkdtemp(dir=tmp_path))

    return make


def _damaged_copy(src: Path, root: Path, data, how: tuple, files: list[str] | None = None) -> Path:
    """A copy of the folder ``src`` in ``root`` with one of its files (drawn from ``files``, default all of them)
    damaged by ``how``."""
    dst = Path(shutil.copytree(src, root / src.name))
    _damage(dst / data.draw(st.sampled_from(files or _files(dst))), how)
    return dst


@PROPERTY
@given(data=st.data(), how=DAMAGE)
def test_damaged_prepared_rows(made, scratch, capsys, data, how):
    root = scratch()
    prepared = _damaged_copy(made.prepared, root, data, how)
    _each_succeeds_or_says_why(capsys, root, [
        (["vocab", "--data", str(prepared), "--out", str(root / "v"), "--draft-vocab-size", "64"], "v"),
        (["extract", "--verifier", made.verifier, "--data", str(prepared), "--out", str(root / "f"), "--dtype",
          "fp32"], "f"),
    ])  # fmt: skip


def _foreign_outs(root: Path, made) -> list[Path]:
    """--out targets no stage may write into: a copy of the verifier checkpoint, a folder with a user's file."""
    mine = root / "mine"
    mine.mkdir()
    (mine / "notes.txt").write_text("keep")
    return [Path(shutil.copytree(made.verifier, root / "verifier")), mine]


@PROPERTY
@given(data=st.data(), how=DAMAGE)
def test_damaged_features(made, scratch, capsys, data, how):
    root = scratch()
    feats = _damaged_copy(made.features, root, data, how)
    train = ["train", "--verifier", made.verifier, "--data", str(feats), "--vocab", str(made.vocab), "--max-steps",
             "1", "--max-seq-len", "64", "--num-workers", "0"]  # fmt: skip
    _each_succeeds_or_says_why(capsys, root, [
        (["extract", "--verify", str(feats)], None),
        *[([*train, "--out", str(out)], None) for out in _foreign_outs(root, made)],  # refused: nothing changes
        ([*train, "--out", str(root / "d")], "d"),
    ])  # fmt: skip


@pytest.mark.parametrize("damage", ["[]", "no shards", "no layer_ids", "a shard without its file"])
def test_a_features_manifest_of_the_wrong_shape_is_one_line(made, tmp_path, capsys, damage):
    """A features manifest that is a JSON list, or lacks a key its readers take: train, extract --verify and eval
    --offline used to end in AttributeError or KeyError."""
    feats = shutil.copytree(made.features, tmp_path / "features")
    m = json.loads((feats / "manifest.json").read_text())
    if damage == "[]":
        m = []
    elif damage == "no shards":
        del m["outputs"]["shards"]
    elif damage == "no layer_ids":
        del m["layer_ids"]
    else:
        del m["outputs"]["shards"][0]["file"]
    (feats / "manifest.json").write_text(json.dumps(m))
    prompts = tmp_path / "p.jsonl"
    prompts.write_text(json.dumps({"turns": ["Hi"]}) + "\n")
    named = "JSON list" if damage == "[]" else "outputs.shards" if damage != "no layer_ids" else "layer_ids"
    before = tree(tmp_path)
    for argv in (["extract", "--verify", str(feats)],
                 ["train", "--verifier", made.verifier, "--data", str(feats), "--vocab", str(made.vocab), "--out",
                  str(tmp_path / "d"), "--max-steps", "1", "--num-workers", "0"],
                 ["eval", "--verifier", made.verifier, "--draft", str(made.draft), "--prompts", str(prompts),
                  "--offline", str(feats), "--max-new-tokens", "2"]):  # fmt: skip
        refused(capsys, argv, str(feats / "manifest.json"), named)
    assert tree(tmp_path) == before


@PROPERTY
@given(data=st.data(), how=DAMAGE)
def test_damaged_draft(made, scratch, capsys, data, how):
    root = scratch()
    draft = _damaged_copy(made.draft, root, data, how, files=["config.json", "model.safetensors"])
    prompts = root / "p.jsonl"
    prompts.write_text(json.dumps({"turns": ["Hi"]}) + "\n")
    _each_succeeds_or_says_why(capsys, root, [
        *[(["export", str(draft), "--out", str(out), "--verifier", made.verifier], None)
          for out in _foreign_outs(root, made)],  # refused: nothing changes
        (["eval", "--verifier", made.verifier, "--draft", str(draft), "--prompts", str(prompts), "--max-new-tokens",
          "2", "--out", str(root / "verifier" / "config.json")], None),
        (["export", str(draft), "--out", str(root / "e"), "--format", "eagle", "--verifier", made.verifier], "e"),
        (["eval", "--verifier", made.verifier, "--draft", str(draft), "--prompts", str(prompts), "--max-new-tokens",
          "2", "--out", str(root / "r")], "r"),
    ])  # fmt: skip


#: Values a config key may be changed to: any TOML type, in range or not.
VALUES = st.one_of(st.integers(-3, 70), st.floats(-2, 2, allow_nan=False), st.booleans(), st.text(max_size=6),
                   st.lists(st.integers(-1, 9), max_size=4), st.none())  # fmt: skip
KEYS = ["out", "verifier", "vocab.data", "vocab.draft_vocab_size", "vocab.count", "export.draft", "export.format",
        "export.dtype", "export.speculative_tokens", "export.typo", "extra"]  # fmt: skip


def _toml(cfg: dict) -> str:
    """A small TOML writer for what the test generates (strings, numbers, booleans, lists, one level of
    tables); JSON's string and number syntax is TOML's for these."""

    def value(v):
        return "[" + ", ".join(map(value, v)) + "]" if isinstance(v, list) else \
            ("true" if v else "false") if isinstance(v, bool) else json.dumps(v)  # fmt: skip

    top = [f"{k} = {value(v)}" for k, v in cfg.items() if not isinstance(v, dict)]
    tables = [f"[{k}]\n" + "".join(f"{kk} = {value(vv)}\n" for kk, vv in v.items())
              for k, v in cfg.items() if isinstance(v, dict)]  # fmt: skip
    return "\n".join(top) + "\n\n" + "\n".join(tables)


@settings(max_examples=20, deadline=None,
          suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow])  # fmt: skip
@given(changes=st.lists(st.tuples(st.sampled_from(KEYS), VALUES), max_size=3), how=st.none() | DAMAGE)
def test_damaged_config(made, scratch, capsys, monkeypatch, changes, how):
    """`eyas run` on a config with keys changed to any value (or removed), its text damaged or not. It runs
    from a scratch folder, so a relative `out` lands there; the folder of its inputs never changes."""
    root = scratch()
    monkeypatch.chdir(root)
    cfg = {"out": str(root / "run"), "verifier": made.verifier,
           "vocab": {"data": str(made.prepared), "draft_vocab_size": 64},
           "export": {"draft": str(made.draft), "format": "speculators"}}  # fmt: skip
    for key, v in changes:
        *table, name = key.split(".")
        where = cfg.setdefault(table[0], {}) if table else cfg
        if v is None:
            where.pop(name, None)
        else:
            where[name] = v
    path = root / "run.toml"
    path.write_text(_toml(cfg))
    if how is not None:
        _damage(path, how)
    _each_succeeds_or_says_why(capsys, made.root, [(["run", str(path)], None)])  # the inputs: all unchanged
