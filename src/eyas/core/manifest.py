"""Atomic files, manifests, output locks and disk checks shared by every stage.

A stage writes its outputs through :func:`atomic_path` (write to a temporary
name in the same directory, fsync, rename), so a crash never leaves a
half-written file under its final name. Its ``manifest.json`` says what was
made, from what inputs, with which settings and versions; a stage whose
manifest already matches its inputs is skipped. Every stage that writes a
folder (all but eval, whose report is one file) goes through
:class:`StageOutput`: the refusal of another stage's folder, the lock, the
skip and the manifest, in that order.
"""

from __future__ import annotations

import contextlib
import datetime as _dt
import hashlib
import json
import os
import platform
import shutil
from pathlib import Path
from typing import Any, Iterator

from eyas import __version__
from eyas.core.errors import EyasError

MANIFEST = "manifest.json"
_UMASK = os.umask(0)
os.umask(_UMASK)  # read once: os.umask can only be read by setting it


def _fsync_dir(path: Path) -> None:
    with contextlib.suppress(OSError):  # not every filesystem lets a directory be opened
        fd = os.open(path, os.O_RDONLY)
        try:
            os.fsync(fd)
        finally:
            os.close(fd)


def _fsync_tree(path: Path) -> None:
    if path.is_file():
        with open(path, "rb+") as f:
            os.fsync(f.fileno())
        return
    for p in sorted(path.rglob("*")):
        if p.is_file():
            with open(p, "rb+") as f:
                os.fsync(f.fileno())
    _fsync_dir(path)


@contextlib.contextmanager
def atomic_path(path: str | os.PathLike, *, is_dir: bool = False) -> Iterator[Path]:
    """Yield a temporary path beside ``path``; on success fsync it and rename it into place.

    Works for files and, with ``is_dir=True``, for directories (an existing
    directory at ``path`` is replaced). On an exception the temporary is removed
    and ``path`` is left as it was.
    """
    final = Path(path)
    final.parent.mkdir(parents=True, exist_ok=True)
    tmp = final.with_name(f".{final.name}.tmp-{os.getpid()}")
    if tmp.exists():
        shutil.rmtree(tmp) if tmp.is_dir() else tmp.unlink()
    if is_dir:
        tmp.mkdir()
    try:
        yield tmp
        if tmp.is_file():  # some writers (safetensors) create 0600 files; give it a normal file's mode
            os.chmod(tmp, 0o666 & ~_UMASK)
        _fsync_tree(tmp)
        if is_dir and final.exists():
            old = final.with_name(f".{final.name}.old-{os.getpid()}")
            final.rename(old)
            tmp.rename(final)
            shutil.rmtree(old)
        else:
            os.replace(tmp, final)
        _fsync_dir(final.parent)
    except BaseException:
        if tmp.exists():
            shutil.rmtree(tmp) if tmp.is_dir() else tmp.unlink()
        raise


def write_bytes(path: str | os.PathLike, data: bytes) -> None:
    """Write ``data`` to ``path`` atomically."""
    with atomic_path(path) as tmp:
        tmp.write_bytes(data)


def write_json(path: str | os.PathLike, obj: Any) -> None:
    """Write ``obj`` as indented, key-sorted JSON to ``path`` atomically."""
    write_bytes(path, (json.dumps(obj, indent=2, sort_keys=True) + "\n").encode())


def read_json(path: str | os.PathLike, *, what: str = "JSON file") -> Any:
    """Read a JSON file, turning a missing or malformed file into a clear :class:`EyasError`."""
    p = Path(path)
    if not p.is_file():
        raise EyasError(f"{what} not found: {p}")
    try:
        return json.loads(p.read_text())
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise EyasError(f"{what} {p} is not valid JSON ({e}); fix or remove it") from e


def sha256_file(path: str | os.PathLike, *, chunk: int = 1 << 22) -> str:
    """The sha256 hex digest of a file, read in 4 MiB chunks."""
    h = hashlib.sha256()
    with open(path, "rb") as f:
        while block := f.read(chunk):
            h.update(block)
    return h.hexdigest()


def sha256_json(obj: Any) -> str:
    """A stable hash of a JSON-serialisable object (keys sorted)."""
    return hashlib.sha256(json.dumps(obj, sort_keys=True, default=str).encode()).hexdigest()


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
    return m.get("stage") == stage and m.get("inputs") == norm(inputs) and m.get("settings") == norm(settings)


#: What a stage leaves in its folder before its manifest is written (the work a rerun resumes), so that another
#: stage pointed at that folder knows it is taken.
UNFINISHED: dict[str, tuple[str, ...]] = {
    "prepare": (".parts/*/part-*.arrow",),
    "regenerate": (".parts/*/part-*.records",),
    "extract": (".progress-*.json",),
    "train": ("checkpoints/step-*",),
}


def folder_stage(folder: str | os.PathLike) -> str | None:
    """The stage whose output ``folder`` holds: its manifest's stage ('' for a manifest.json eyas did not
    write), else the stage whose unfinished work is in it, else None (a new, empty or unrelated folder)."""
    p = Path(folder)
    if (p / MANIFEST).is_file():
        try:
            stage = json.loads((p / MANIFEST).read_text()).get("stage")
        except (OSError, ValueError, AttributeError):  # unreadable, not JSON, not an object
            stage = None
        return stage if isinstance(stage, str) else ""
    return next((stage for stage, globs in UNFINISHED.items() if any(next(p.glob(g), None) for g in globs)), None)


def check_out(out_dir: str | os.PathLike, *, stage: str) -> None:
    """Refuse an output folder that is a file, or that holds another stage's output, finished or not: writing
    ``stage``'s output there would replace that stage's manifest or remove its work. A folder of the same stage
    is the stage's own to redo."""
    p = Path(out_dir)
    if p.exists() and not p.is_dir():
        raise EyasError(f"--out {p} is a file, not a folder: choose another --out")
    owner = folder_stage(p)
    if owner is not None and owner != stage:
        what = f"the output of `eyas {owner}`" if owner else f"a {MANIFEST} that eyas did not write"
        raise EyasError(f"--out {p} holds {what}; `eyas {stage}` would replace it: choose another --out")


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
        self.path = self.dir / ".eyas.lock"
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

    Entering refuses a folder that is a file or holds another stage's output, finished or not (:func:`check_out`),
    and takes the folder's lock (:class:`OutputLock`): on rank 0 only when ``d`` (an :class:`eyas.core.dist.Dist`) is
    given, a refusal reaching every rank. Under the lock, :meth:`up_to_date` tells whether a finished output of
    the same inputs and settings is there (the stage skips itself), :meth:`unfinish` removes an older manifest
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

    def __enter__(self) -> "StageOutput":
        if self._d is None:
            self._take()
        else:
            self._d.run_on_main(self._take)
        return self

    def __exit__(self, *exc: object) -> None:
        if self._main():
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
            return read_manifest(self.dir, stage=self.stage)
        if other is not None and (self.dir / MANIFEST).exists():
            raise EyasError(f"{self.dir} holds {other} made from other inputs or settings; choose another --out "
                            "or remove it")  # fmt: skip
        return None

    def unfinish(self) -> None:
        """Remove the manifest of an earlier output of this stage before new work begins, so that a crash part
        way leaves a folder that reads as unfinished, not as the earlier output."""
        (self.dir / MANIFEST).unlink(missing_ok=True)

    def finish(self, *, outputs: dict[str, Any], **extra: Any) -> dict[str, Any]:
        """Write the manifest (the inputs and settings given to :meth:`up_to_date`, ``outputs``, ``extra``),
        atomically and after every other file: the output is finished."""
        if self.inputs is None or self.settings is None:
            raise AssertionError("StageOutput.finish before up_to_date: the manifest would record no inputs")
        return write_manifest(self.dir, stage=self.stage, inputs=self.inputs, settings=self.settings,
                              outputs=outputs, **extra)  # fmt: skip


def check_free_disk(path: str | os.PathLike, *, needed: int, what: str) -> None:
    """Stop before a long write that cannot fit: ``needed`` bytes (an estimate) at ``path``."""
    p = Path(path)
    while not p.exists():
        p = p.parent
    free = shutil.disk_usage(p).free
    if needed > free:
        raise EyasError(
            f"{what} needs about {human_bytes(needed)} but {p} has {human_bytes(free)} free; "
            "free space, choose another --out, or write fewer bytes (e.g. --dtype fp8)"
        )


def human_bytes(n: float) -> str:
    """1536 -> '1.5 KiB'."""
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if abs(n) < 1024 or unit == "TiB":
            return f"{n:.1f} {unit}" if unit != "B" else f"{int(n)} B"
        n /= 1024
    raise AssertionError
