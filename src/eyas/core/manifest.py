"""Stage output folders: manifests, the refusal of a folder a stage must not write, output locks and the check
of a finished output's files.

A stage's ``manifest.json`` says what was made, from what inputs, with which settings and versions; a stage whose
manifest already matches its inputs is skipped. Every stage that writes a folder (all but eval, whose report is
one file) goes through :class:`StageOutput`: the refusal of any folder that is not new, empty or the stage's own
(another stage's output, a verifier checkpoint, a user's files), the lock, the skip and the manifest, in that
order. eval's report replaces only an earlier report (:func:`check_report_out`). The files themselves are
written atomically by :mod:`eyas.core.files`.
"""

from __future__ import annotations

import contextlib
import datetime as _dt
import json
import os
import platform
from pathlib import Path
from typing import Any

from eyas import __version__
from eyas.core.errors import EyasError
from eyas.core.files import read_json, sha256_file, write_json

MANIFEST = "manifest.json"


def versions() -> dict[str, str]:
    """Versions of the software a result depends on, recorded in every manifest.

    Read from package metadata, so recording them never imports a heavy package.
    """
    from importlib.metadata import PackageNotFoundError, version

    out = {"eyas": __version__, "python": platform.python_version()}
    for name in ("torch", "transformers", "safetensors", "numpy", "datasets"):
        with contextlib.suppress(PackageNotFoundError):
            out[name] = version(name)
    return out


def write_manifest(
    out_dir: str | os.PathLike,
    *,
    stage: str,
    inputs: dict[str, Any],
    settings: dict[str, Any],
    outputs: dict[str, Any],
    **extra: Any,
) -> dict[str, Any]:
    """Write ``out_dir/manifest.json`` atomically and return it.

    ``inputs`` identify what the stage read (fingerprints and hashes, never
    secrets), ``settings`` the options that change the result, ``outputs`` what
    was made. :func:`manifest_matches` compares the first two.
    """
    manifest = {
        "stage": stage,
        "inputs": inputs,
        "settings": settings,
        "outputs": outputs,
        "versions": versions(),
        "created": _dt.datetime.now(_dt.timezone.utc).isoformat(timespec="seconds"),
        **extra,
    }
    write_json(Path(out_dir) / MANIFEST, manifest)
    return manifest


def read_manifest(out_dir: str | os.PathLike, *, stage: str | None = None) -> dict[str, Any]:
    """Read a stage's manifest; with ``stage``, check that it was written by that stage."""
    path = Path(out_dir) / MANIFEST
    if not path.is_file():
        made_by = f"`eyas {stage}`" if stage else "an eyas stage"
        raise EyasError(f"{path} not found: {out_dir} was not made by {made_by} (or it did not finish)")
    manifest = read_json(path, what="manifest")
    if not isinstance(manifest, dict):
        raise EyasError(f"{path} is a JSON {type(manifest).__name__}, not the object a manifest is: it is damaged; "
                        f"run `eyas {stage or 'STAGE'}` again into a new --out")  # fmt: skip
    if stage is not None and manifest.get("stage") != stage:
        raise EyasError(f"{path} was written by `eyas {manifest.get('stage')}`, not `eyas {stage}`")
    return manifest


def manifest_matches(
    out_dir: str | os.PathLike, *, stage: str, inputs: dict[str, Any], settings: dict[str, Any]
) -> bool:
    """True when ``out_dir`` holds a finished ``stage`` made from the same inputs and settings."""
    path = Path(out_dir) / MANIFEST
    if not path.is_file():
        return False
    try:
        m = json.loads(path.read_text())
    except (json.JSONDecodeError, UnicodeDecodeError):
        return False
    norm = lambda x: json.loads(json.dumps(x, sort_keys=True, default=str))  # noqa: E731 (tuples -> lists)
    return (m.get("stage") == stage and _by_content(m.get("inputs")) == _by_content(norm(inputs))
            and m.get("settings") == norm(settings))  # fmt: skip


def _by_content(inputs: Any) -> Any:
    """``inputs`` as a stage's identity: an input recorded with its content's ``sha256`` is that content wherever
    it was read from, so its ``source`` (a path) does not count. A run folder moved or renamed, or answers
    carried to another machine, stay up to date."""
    if isinstance(inputs, dict):
        return {k: _by_content(v) for k, v in inputs.items() if not (k == "source" and "sha256" in inputs)}
    if isinstance(inputs, list):
        return [_by_content(v) for v in inputs]
    return inputs


#: What a stage leaves in its folder before its manifest is written (the work a rerun resumes), so that another
#: stage pointed at that folder knows it is taken.
UNFINISHED: dict[str, tuple[str, ...]] = {
    "prepare": (".parts/*/part-*.arrow",),
    "regenerate": (".parts/*/part-*.records",),
    "extract": (".progress-*.json",),
    "train": ("checkpoints/step-*",),
}

#: The mark a stage leaves in its folder from the moment it takes it until its manifest is written (a JSON object
#: naming the stage): a folder being written, or left by a run that stopped, is known as that stage's.
MARK = ".eyas-unfinished"
LOCK = ".eyas.lock"

#: What each stage writes at the top of its folder (besides its manifest, lock and mark): the names a folder eyas
#: did not write would lose.
WRITES: dict[str, tuple[str, ...]] = {
    "prepare": ("rows", ".parts"),
    "regenerate": ("conversations.jsonl", ".parts"),
    "vocab": ("d2t.npy", "t2d.npy"),
    "extract": ("rows_*.safetensors", ".progress-*.json"),
    "train": ("config.json", "model.safetensors", "checkpoints", "metrics.jsonl", "training_curves.png", "tensorboard"),
    "export": ("config.json", "model.safetensors"),
}
#: What a new folder may hold and still count as empty: the lock and mark of a run, temporaries a killed write left.
_EMPTY_ENOUGH = (LOCK, MARK, ".*.tmp-*", ".*.old-*")


def _json_stage(path: Path) -> str | None:
    """The ``stage`` a manifest or mark names ('' for one that is not eyas's: not JSON, not an object)."""
    try:
        stage = json.loads(path.read_text()).get("stage")
    except (OSError, ValueError, AttributeError):  # unreadable, not JSON, not an object
        stage = None
    return stage if isinstance(stage, str) else ""


def folder_stage(folder: str | os.PathLike) -> str | None:
    """The stage whose output ``folder`` holds: its manifest's stage ('' for a manifest.json eyas did not
    write), else the stage whose unfinished work is in it (its mark, or the parts it resumes from), else None (a
    new, empty or unrelated folder)."""
    p = Path(folder)
    if (p / MANIFEST).is_file():
        return _json_stage(p / MANIFEST)
    if (p / MARK).is_file() and (stage := _json_stage(p / MARK)):
        return stage
    return next((stage for stage, globs in UNFINISHED.items() if any(next(p.glob(g), None) for g in globs)), None)


def _names(paths: list[str], most: int = 4) -> str:
    return ", ".join(paths[:most]) + (f" and {len(paths) - most} more" if len(paths) > most else "")


def check_out(out_dir: str | os.PathLike, *, stage: str, what: str = "--out") -> None:
    """Refuse an output folder that a write of ``stage`` could damage: a file, a dangling link, a folder holding
    another stage's output, finished or not, or a folder holding anything eyas did not write (a verifier
    checkpoint, a user's files). A new or empty folder, and a folder of the same stage (its manifest or its
    unfinished work), are the stage's to write. ``what`` names the argument (``--out``, ``[train] out``)."""
    p = Path(out_dir)
    other = f"choose another {what.split()[-1]}"
    if p.is_symlink() and not p.exists():
        raise EyasError(f"{what} {p} is a link to {os.readlink(p)}, which does not exist: create that folder, or "
                        f"{other}")  # fmt: skip
    if p.exists() and not p.is_dir():
        raise EyasError(f"{what} {p} is a file, not a folder: {other}")
    owner = folder_stage(p)
    if owner is not None and owner != stage:
        held = f"the output of `eyas {owner}`" if owner else f"a {MANIFEST} that eyas did not write"
        raise EyasError(f"{what} {p} holds {held}; `eyas {stage}` would replace it: {other}")
    if owner is None and p.is_dir():
        foreign = sorted(e.name + ("/" if e.is_dir() else "") for e in p.iterdir()
                         if not any(e.match(g) for g in _EMPTY_ENOUGH))  # fmt: skip
        if foreign:
            hit = [n for n in foreign if any(Path(n.rstrip("/")).match(g) for g in WRITES.get(stage, ()))]
            does = f"would replace {_names(hit)}" if hit else "writes only into a new or empty folder"
            raise EyasError(f"{what} {p} holds files eyas did not write ({_names(foreign)}); `eyas {stage}` "
                            f"{does}: {other}")  # fmt: skip


#: Keys every `eyas eval` report holds: what tells a report eval may replace from any other JSON file.
REPORT_KEYS = ("tau", "accepted_length_histogram", "draft_tokens", "draft", "verifier", "versions")


def is_eval_report(path: str | os.PathLike) -> bool:
    """True when ``path`` is a report an earlier `eyas eval` wrote (recognised by its content)."""
    try:
        report = json.loads(Path(path).read_text())
    except (OSError, ValueError):
        return False
    return isinstance(report, dict) and all(k in report for k in REPORT_KEYS)


def report_paths(out: str | os.PathLike) -> tuple[Path, Path]:
    """eval's ``--out report.json`` names the report (the histogram goes beside it); any other path is a
    directory that gets ``report.json`` and ``accepted_lengths.png``."""
    p = Path(out)
    if p.suffix == ".json":
        return p, p.with_name(p.stem + "_accepted_lengths.png")
    return p / "report.json", p / "accepted_lengths.png"


def check_report_out(out: str | os.PathLike, *, what: str = "--out") -> None:
    """Refuse an eval ``--out`` whose report or plot would replace a file that is not an earlier eval report (and
    the plot beside it), or that lies in a stage's folder (its manifest names the files that are its own)."""
    json_path, png_path = report_paths(out)
    for p in (Path(out), json_path, png_path):
        if p.is_symlink() and not p.exists():
            raise EyasError(f"{what} {p} is a link to {os.readlink(p)}, which does not exist: choose another path")
    if Path(out).suffix != ".json" and Path(out).exists() and not Path(out).is_dir():
        raise EyasError(f"{what} {out} is a file, not a folder or a .json report: choose another")
    owner = folder_stage(json_path.parent)
    if owner is not None:
        held = f"the output of `eyas {owner}`" if owner else f"a {MANIFEST} that eyas did not write"
        raise EyasError(f"{what} {out}: {json_path.parent} holds {held}; write the report outside it")
    earlier = json_path.is_file() and is_eval_report(json_path)
    if json_path.exists() and not earlier:
        raise EyasError(f"{what} {out}: {json_path} exists and is not an `eyas eval` report; eval replaces only its "
                        "own earlier report: choose a new path")  # fmt: skip
    if png_path.exists() and not earlier:
        raise EyasError(f"{what} {out}: {png_path} exists and is not the plot of an earlier `eyas eval` report "
                        f"({json_path}); eval would replace it: choose a new path")  # fmt: skip


def _pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


class OutputLock:
    """One writer per output directory: ``.eyas.lock`` holds the writer's pid.

    A lock left by a dead process (kill -9) is taken over; a live one is an
    error that names the pid. With ``stage``, a folder holding another stage's
    output is refused once the lock is held (:func:`check_out`). A directory the
    lock created is removed again when the writer leaves it empty (a run that
    stopped at an error). Use as a context manager.
    """

    def __init__(self, out_dir: str | os.PathLike, *, stage: str | None = None) -> None:
        self.dir = Path(out_dir)
        self.path = self.dir / LOCK
        self.stage = stage
        self._held = False
        self._created = False

    def __enter__(self) -> "OutputLock":
        if self.stage is not None:
            check_out(self.dir, stage=self.stage)  # before creating anything (a file there is refused here)
        self._created = not self.dir.exists()
        self.dir.mkdir(parents=True, exist_ok=True)
        try:
            self._take()
            if self.stage is not None:
                check_out(self.dir, stage=self.stage)  # again under the lock: nobody writes it meanwhile
        except BaseException:
            self.__exit__()
            raise
        return self

    def _take(self) -> None:
        for _ in range(2):
            try:
                fd = os.open(self.path, os.O_CREAT | os.O_EXCL | os.O_WRONLY, 0o644)
            except FileExistsError:
                try:
                    pid = int(self.path.read_text().strip() or 0)
                except (OSError, ValueError):
                    pid = 0
                if pid and pid != os.getpid() and _pid_alive(pid):
                    raise EyasError(
                        f"another eyas process (pid {pid}) is writing {self.dir}; wait for it to finish "
                        f"or stop it (if no such process runs, remove {self.path})"
                    ) from None
                with contextlib.suppress(FileNotFoundError):
                    self.path.unlink()  # stale: its writer died
                continue
            with os.fdopen(fd, "w") as f:
                f.write(str(os.getpid()))
            self._held = True
            return
        raise EyasError(f"could not take the lock {self.path}; remove it if no eyas process is running")

    def __exit__(self, *exc: object) -> None:
        if self._held:
            with contextlib.suppress(FileNotFoundError):
                self.path.unlink()
            self._held = False
        if self._created:
            with contextlib.suppress(OSError):  # not empty: the run wrote something, which stays
                self.dir.rmdir()
            self._created = False


class StageOutput:
    """A stage's output folder from its lock to its manifest: the one way every stage writes its folder.

    Entering refuses a folder that is a file, holds another stage's output, finished or not, or holds files eyas
    did not write (:func:`check_out`), takes the folder's lock (:class:`OutputLock`) and marks a new folder as the
    stage's (:data:`MARK`, removed by :meth:`finish`, or on leaving when nothing was written): on rank 0 only when
    ``d`` (an :class:`eyas.core.dist.Dist`) is given, a refusal reaching every rank. Under the lock, :meth:`up_to_date`
    tells whether a finished output of the same inputs and settings is there and whole (the stage skips itself;
    a damaged one is done again), :meth:`unfinish` removes an older manifest
    that a crash during the new work would leave vouching for it, and :meth:`finish` writes the manifest,
    atomically and last, so that a folder without one is unfinished. The partial work a stage resumes from
    (prepare's and regenerate's parts, extract's progress, train's checkpoints) stays the stage's own; the lock
    makes the stage its only writer.
    """

    def __init__(self, out_dir: str | os.PathLike, *, stage: str, d: Any = None) -> None:
        self.dir = Path(out_dir)
        self.stage = stage
        self.inputs: dict[str, Any] | None = None
        self.settings: dict[str, Any] | None = None
        self._d = d
        self._lock = OutputLock(self.dir, stage=stage)

    def _main(self) -> bool:
        return self._d is None or self._d.is_main

    def _take(self) -> None:
        self._lock.__enter__()
        try:
            if folder_stage(self.dir) is None:  # new or empty: the stage's from now on, until its manifest says so
                self._mark()
        except BaseException:
            self._lock.__exit__()
            raise

    def _mark(self) -> None:
        write_json(self.dir / MARK, {"stage": self.stage})

    def __enter__(self) -> "StageOutput":
        if self._d is None:
            self._take()
        else:
            self._d.run_on_main(self._take)
        return self

    def __exit__(self, *exc: object) -> None:
        if self._main():
            if (self.dir / MARK).is_file() and {p.name for p in self.dir.iterdir()} <= {MARK, LOCK}:
                (self.dir / MARK).unlink()  # nothing was written: the folder is as new again
            self._lock.__exit__(*exc)

    def up_to_date(
        self,
        *,
        inputs: dict[str, Any],
        settings: dict[str, Any],
        files: tuple[str, ...] = (),
        other: str | None = None,
    ) -> dict[str, Any] | None:
        """The manifest of a finished output made from ``inputs`` with ``settings`` whose ``files`` are all
        there (the stage has nothing to do), else None; :meth:`finish` records these inputs and settings.

        With ``other`` (what the folder holds, e.g. ``"features"``), a finished output of other inputs or
        settings is refused rather than redone: the stage does not replace work it could not resume.
        """
        self.inputs, self.settings = inputs, settings
        if all((self.dir / f).exists() for f in files) and manifest_matches(
            self.dir, stage=self.stage, inputs=inputs, settings=settings
        ):
            manifest = read_manifest(self.dir, stage=self.stage)
            damaged = damaged_file(self.dir, manifest)
            if damaged is None:
                return manifest
            print(f"{self.stage}: {self.dir} is damaged ({damaged}); doing the work again")
            self.unfinish()
            return None
        if other is not None and (self.dir / MANIFEST).exists():
            raise EyasError(f"{self.dir} holds {other} made from other inputs or settings; choose another --out "
                            "or remove it")  # fmt: skip
        return None

    def unfinish(self) -> None:
        """Remove the manifest of an earlier output of this stage before new work begins, so that a crash part
        way leaves a folder that reads as unfinished, not as the earlier output."""
        self._mark()
        (self.dir / MANIFEST).unlink(missing_ok=True)

    def finish(self, *, outputs: dict[str, Any], hashed: dict[str, str] | None = None, **extra: Any) -> dict[str, Any]:
        """Write the manifest (the inputs and settings given to :meth:`up_to_date`, ``outputs``, ``extra``, and
        the size and sha256 of every file the stage wrote, for :meth:`up_to_date` to check: ``hashed`` gives the
        sha256 of files the stage hashed as it wrote them), atomically and after every other file: the output is
        finished."""
        if self.inputs is None or self.settings is None:
            raise AssertionError("StageOutput.finish before up_to_date: the manifest would record no inputs")
        manifest = write_manifest(self.dir, stage=self.stage, inputs=self.inputs, settings=self.settings,
                                  outputs=outputs, files=_inventory(self.dir, hashed or {}), **extra)  # fmt: skip
        (self.dir / MARK).unlink(missing_ok=True)
        return manifest


#: What a manifest's ``files`` leaves out: the bookkeeping, and work a rerun resumes or adds to (parts,
#: checkpoints, TensorBoard's event files).
_NOT_RECORDED = (MANIFEST, LOCK, MARK, ".parts", "checkpoints", "tensorboard")
#: sha256 of files this process has hashed, by (path, size, mtime): a folder checked once is not read again.
_HASHED: dict[tuple[str, int, int], str] = {}


def sha256_cached(p: Path) -> str:
    """The sha256 of the file ``p``, read once per process while its size and modification time stay."""
    st = p.stat()
    key = (str(p.resolve()), st.st_size, st.st_mtime_ns)
    if key not in _HASHED:
        _HASHED[key] = sha256_file(p)
    return _HASHED[key]


def _inventory(folder: Path, hashed: dict[str, str]) -> dict[str, dict[str, Any]]:
    """Every file of a finished output (but :data:`_NOT_RECORDED` and hidden temporaries): its size and sha256."""
    files = {}
    for p in sorted(folder.rglob("*")):
        rel = p.relative_to(folder)
        if rel.parts[0] in _NOT_RECORDED or any(part.startswith(".") for part in rel.parts) or not p.is_file():
            continue
        files[rel.as_posix()] = {"bytes": p.stat().st_size, "sha256": hashed.get(rel.as_posix()) or sha256_cached(p)}
    return files


def damaged_file(folder: str | os.PathLike, manifest: dict[str, Any]) -> str | None:
    """What is wrong with the first file of ``folder`` that differs from its manifest's record (missing, another
    size, another sha256), or None when every recorded file is whole. A manifest from before the record has
    nothing to check."""
    files = manifest.get("files")
    if not isinstance(files, dict):
        return None
    for rel, want in files.items():
        p = Path(folder) / rel
        if not p.is_file():
            return f"{rel} is missing"
        size = p.stat().st_size
        if size != want.get("bytes"):
            return f"{rel} has {size} bytes, not the {want.get('bytes')} its manifest records"
        if sha256_cached(p) != want.get("sha256"):
            return f"{rel} is not the file its manifest records (another sha256)"
    return None
