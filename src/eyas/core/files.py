"""Files written whole or not at all, their hashes, and the journal a resumable stage appends to.

A stage writes its outputs through :func:`atomic_path` (write to a temporary name in the same directory, fsync,
rename), so a crash never leaves a half-written file under its final name; a write that fails for want of room
says what ran out (:func:`out_of_room`). :class:`Journal` is the append-only record of finished work items a
killed run resumes from. What a stage's folder holds, and who may write it, is :mod:`eyas.core.manifest`'s.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import os
import shutil
import time
from pathlib import Path
from typing import Any, Iterator

from eyas.core.errors import EyasError

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
    except BaseException as e:
        if tmp.exists():
            shutil.rmtree(tmp) if tmp.is_dir() else tmp.unlink()
        ran_out = out_of_room(e)
        if ran_out:
            raise EyasError(f"writing {final}: {ran_out}; nothing was left half-written, and the same command "
                            "resumes once there is room") from e  # fmt: skip
        raise


def out_of_room(e: BaseException) -> str | None:
    """What ran out, when ``e`` is a write that failed for want of room: a full disk, a quota, the file-size limit
    (``ulimit -f``), as an OSError or as the message of a library that wraps it (safetensors' SafetensorError)."""
    import errno

    import resource

    code = e.errno if isinstance(e, OSError) else None
    text = str(e)
    if isinstance(e, RuntimeError) and "unexpected pos" in text:  # torch.save's zip writer after a short write
        limited = resource.getrlimit(resource.RLIMIT_FSIZE)[0] != resource.RLIM_INFINITY
        code = errno.EFBIG if limited else errno.ENOSPC
    if code in (errno.ENOSPC, errno.EDQUOT) or "No space left" in text or "StorageFull" in text:
        return "the disk is full (no space left on the device); free some space or choose another --out"
    if code == errno.EFBIG or "FileTooLarge" in text or "File too large" in text:
        return "a file grew past the file-size limit of this process; raise it (`ulimit -f`)"
    return None


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


class Journal:
    """An append-only file of finished work items, one JSON line each (each with its index ``"i"``): a stage's
    record of what it finished, so a run killed at any moment resumes with nothing lost or done twice.

    A line is written and flushed as soon as its item is done, and the file is fsynced every few seconds, so a
    killed run loses at most the item in flight; a line cut by the kill is removed when the file is opened
    again. One writer per file (each rank has its own).
    """

    def __init__(self, path: Path, *, fsync_every: float = 5.0) -> None:
        self.path, self.fsync_every = path, fsync_every
        self._f = None
        self._synced = time.monotonic()

    def __enter__(self) -> "Journal":
        if self.path.is_file():  # drop a last line a kill cut short
            data = self.path.read_bytes()
            end = data.rfind(b"\n") + 1
            if end < len(data):
                with open(self.path, "r+b") as f:
                    f.truncate(end)
        self._f = open(self.path, "a", encoding="utf-8")
        return self

    def append(self, entry: dict[str, Any]) -> None:
        self._f.write(json.dumps(entry, ensure_ascii=False) + "\n")
        self._f.flush()
        if time.monotonic() - self._synced > self.fsync_every:
            os.fsync(self._f.fileno())
            self._synced = time.monotonic()

    def __exit__(self, *exc: object) -> None:
        self._f.flush()
        os.fsync(self._f.fileno())
        self._f.close()


def read_journal(path: Path) -> dict[int, dict[str, Any]]:
    """The entries of a :class:`Journal` file by index (the first of each), {} when there is none; a last line
    cut by a kill is ignored, a damaged line elsewhere is an error naming it."""
    out: dict[int, dict[str, Any]] = {}
    if not path.is_file():
        return out
    lines = path.read_text(encoding="utf-8").split("\n")
    for n, line in enumerate(lines, 1):
        if not line:
            continue
        try:
            entry = json.loads(line)
        except json.JSONDecodeError:
            if n == len(lines):  # the last line, without its newline: cut by a kill
                continue
            raise EyasError(f"{path} line {n} is damaged; remove {path.parent} and run again") from None
        out.setdefault(int(entry["i"]), entry)
    return out
