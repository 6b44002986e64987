"""Atomic writes, manifests, the output lock and the disk check."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from eyas.core.errors import EyasError
from eyas.core.files import atomic_path, check_free_disk, write_json
from eyas.core.manifest import OutputLock, StageOutput, manifest_matches, read_manifest, write_manifest


def test_atomic_file_survives_failure(tmp_path):
    target = tmp_path / "a.json"
    write_json(target, {"x": 1})
    with pytest.raises(RuntimeError), atomic_path(target) as tmp:
        tmp.write_text("half")
        raise RuntimeError("crash mid-write")
    assert target.read_text().strip().startswith("{") and list(tmp_path.iterdir()) == [target]


def test_atomic_dir_replaces(tmp_path):
    target = tmp_path / "d"
    for n in (1, 2):
        with atomic_path(target, is_dir=True) as tmp:
            (tmp / "f").write_text(str(n))
    assert (target / "f").read_text() == "2" and sorted(p.name for p in tmp_path.iterdir()) == ["d"]


def test_manifest_roundtrip_and_match(tmp_path):
    write_manifest(tmp_path, stage="vocab", inputs={"data": "abc"}, settings={"n": (1, 2)}, outputs={"f": 1})
    assert read_manifest(tmp_path, stage="vocab")["outputs"] == {"f": 1}
    assert manifest_matches(tmp_path, stage="vocab", inputs={"data": "abc"}, settings={"n": (1, 2)})
    assert not manifest_matches(tmp_path, stage="vocab", inputs={"data": "abd"}, settings={"n": (1, 2)})
    # an input known by its content's sha256 matches wherever it is read from; by its path alone it does not
    write_manifest(tmp_path, stage="vocab", inputs={"data": {"source": "/a/rows", "sha256": "f0"}, "v": "/a/m"},
                   settings={}, outputs={})  # fmt: skip
    assert manifest_matches(tmp_path, stage="vocab", inputs={"data": {"source": "/b/rows", "sha256": "f0"},
                                                             "v": "/a/m"}, settings={})  # fmt: skip
    assert not manifest_matches(tmp_path, stage="vocab", inputs={"data": {"source": "/a/rows", "sha256": "f1"},
                                                                 "v": "/a/m"}, settings={})  # fmt: skip
    assert not manifest_matches(tmp_path, stage="vocab", inputs={"data": {"source": "/a/rows", "sha256": "f0"},
                                                                 "v": "/b/m"}, settings={})  # fmt: skip
    with pytest.raises(EyasError, match="written by `eyas vocab`, not `eyas extract`"):
        read_manifest(tmp_path, stage="extract")
    with pytest.raises(EyasError, match="not made by `eyas train`"):
        read_manifest(tmp_path / "nothing", stage="train")


def test_lock_one_writer(tmp_path):
    sleeper = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    try:
        (tmp_path / ".eyas.lock").write_text(str(sleeper.pid))
        with pytest.raises(EyasError, match=f"pid {sleeper.pid}"):
            with OutputLock(tmp_path):
                pass
    finally:
        sleeper.kill()
        sleeper.wait()
    with OutputLock(tmp_path):  # the holder died: its lock is stale and taken over
        assert (tmp_path / ".eyas.lock").read_text() == str(os.getpid())
    assert not (tmp_path / ".eyas.lock").exists()


def test_disk_check(tmp_path):
    check_free_disk(tmp_path, needed=1, what="a tiny write")
    with pytest.raises(EyasError, match=r"needs about .* free"):
        check_free_disk(tmp_path / "sub", needed=1 << 60, what="features")


def test_atomic_file_gets_a_normal_mode(tmp_path):
    """safetensors writes 0600 files; a checkpoint another user's server must read gets the umask's mode."""
    from safetensors.torch import save_file
    import torch

    with atomic_path(tmp_path / "w.safetensors") as tmp:
        save_file({"a": torch.zeros(1)}, str(tmp))
    umask = os.umask(0)
    os.umask(umask)
    assert (tmp_path / "w.safetensors").stat().st_mode & 0o777 == 0o666 & ~umask


def test_stage_output_skips_a_finished_output_and_redoes_its_own(tmp_path):
    """finish writes the manifest that up_to_date finds on the next run (with its files there); other settings
    or a missing file mean work, which unfinish marks; with ``other`` such a folder is refused instead; the lock
    is held only inside, and a folder the run created and left empty is removed again."""
    out = tmp_path / "o"
    with pytest.raises(EyasError, match="boom"), StageOutput(out, stage="vocab") as o:
        assert (out / ".eyas.lock").read_text() == str(os.getpid())
        raise EyasError("boom")
    assert not out.exists()  # created by the failed run, empty: removed
    inputs, settings = {"data": "x"}, {"n": 1}
    with StageOutput(out, stage="vocab") as o:
        assert o.up_to_date(inputs=inputs, settings=settings, files=("d2t.npy",)) is None
        (out / "d2t.npy").write_bytes(b"d")
        made = o.finish(outputs={"rows": 3})
    assert not (out / ".eyas.lock").exists() and made["inputs"] == inputs
    with StageOutput(out, stage="vocab") as o:
        assert o.up_to_date(inputs=inputs, settings=settings, files=("d2t.npy",)) == made
        assert o.up_to_date(inputs=inputs, settings=settings, files=("t2d.npy",)) is None  # a file is missing
        assert o.up_to_date(inputs=inputs, settings={"n": 2}) is None
        with pytest.raises(EyasError, match=f"{out} holds a vocab made from other inputs or settings"):
            o.up_to_date(inputs=inputs, settings={"n": 2}, other="a vocab")
        o.unfinish()
        assert not (out / "manifest.json").exists() and (out / "d2t.npy").is_file()


def test_stage_output_refuses_another_stages_folder_before_locking_it(tmp_path):
    write_manifest(tmp_path, stage="prepare", inputs={}, settings={}, outputs={})
    with pytest.raises(EyasError, match="holds the output of `eyas prepare`; `eyas vocab` would replace it"):
        with StageOutput(tmp_path, stage="vocab"):
            pass
    assert sorted(p.name for p in tmp_path.iterdir()) == ["manifest.json"]
    with pytest.raises(AssertionError, match="before up_to_date"), StageOutput(tmp_path / "v", stage="vocab") as o:
        o.finish(outputs={})


def test_a_full_disk_during_a_write_is_one_line_and_leaves_nothing(tmp_path):
    """/dev/full answers every write with ENOSPC, as a full disk does."""
    target = tmp_path / "a.bin"
    with pytest.raises(EyasError, match=rf"writing {target}: the disk is full .* resumes once there is room"):
        with atomic_path(target) as tmp, open("/dev/full", "wb") as full:
            tmp.write_bytes(b"x")
            full.write(b"x" * 65536)
            full.flush()
    assert list(tmp_path.iterdir()) == []


def test_a_file_size_limit_during_a_write_is_one_line(made, tmp_path):
    """`ulimit -f` below the size of the weights: export's safetensors write (SafetensorError) and prepare's Arrow
    part (OSError) used to end in a traceback; the message says what ran out, the output stays consistent."""
    import resource

    import eyas

    draft = made.draft
    env = {**os.environ, "PYTHONPATH": str(Path(eyas.__file__).parents[1]), "PYTHONDONTWRITEBYTECODE": "1"}
    limit = lambda: resource.setrlimit(resource.RLIMIT_FSIZE, (2048, resource.RLIM_INFINITY))  # noqa: E731
    for argv in (["export", str(draft), "--out", str(tmp_path / "e"), "--dtype", "float32"],
                 ["prepare", "--verifier", made.verifier, "--data", str(made.conversations), "--out",
                  str(tmp_path / "p"), "--num-proc", "1"]):  # fmt: skip
        r = subprocess.run([sys.executable, "-c", "import sys; from eyas.cli import main; sys.exit(main(sys.argv[1:]))",
                            *argv], env=env, preexec_fn=limit, capture_output=True, text=True, timeout=300)  # fmt: skip
        assert r.returncode == 2 and "Traceback" not in r.stderr, r.stderr
        assert "file-size limit of this process" in r.stderr.splitlines()[-1], r.stderr
    assert not (tmp_path / "e").exists() and not (tmp_path / "p" / "manifest.json").exists()
