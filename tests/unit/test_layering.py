"""The package's imports run one way, floor by floor: a module imports only modules of its own folder or of
a lower floor, never a folder beside it on the same floor, and no stage imports another stage.

Every ``eyas`` import is read from the source (module level and inside functions, ``from eyas.pkg import mod``
and the ``"eyas.pkg.mod:fn"`` targets the CLI and the pipeline import by name). A folder's place is in
``FLOORS``: a new module in an existing folder needs no edit here; a new folder does. docs/ARCHITECTURE.md
draws the same table.
"""

from __future__ import annotations

import ast
import re
import sys
from pathlib import Path

import pytest

PACKAGE = Path(__file__).resolve().parents[2] / "src" / "eyas"

#: Each folder's floor (``""``: the package's own ``__init__``; ``pipeline``, ``demo`` and ``cli``: the top modules).
FLOORS: dict[str, int] = {
    "": 0,
    "core": 0,
    "data": 1,
    "verifier": 1,
    "draft": 2,
    "training": 3,
    "engine": 3,
    "evaluation": 4,
    "stages": 5,
    "pipeline": 6,
    "demo": 6,
    "cli": 7,
}
#: Folders whose modules may not import each other: stages meet only through files on disk.
SEALED = {"stages"}

TARGET = re.compile(r"eyas\.([\w.]+):\w+")  # "eyas.stages.train:run": a stage function imported by name


def _modules() -> list[str]:
    """Every module as its dotted path below ``eyas`` (``stages.train``, ``cli``, ``__init__``)."""
    found = []
    for p in sorted(PACKAGE.rglob("*.py")):
        rel = p.relative_to(PACKAGE).with_suffix("")
        found.append(".".join(rel.parts))
    return found


def folder(module: str) -> str:
    """The folder that ranks a module: its package, or itself for the top modules."""
    parts = module.split(".")
    if len(parts) == 1:
        return "" if module == "__init__" else module
    return parts[0]


def _resolve(dotted: str) -> str:
    """``a.b`` (below ``eyas``) as a module of ours: ``a.b`` itself, or ``a.__init__`` for a package."""
    if (PACKAGE / Path(*dotted.split("."))).with_suffix(".py").is_file():
        return dotted
    if (PACKAGE / Path(*dotted.split(".")) / "__init__.py").is_file():
        return f"{dotted}.__init__"
    return dotted  # does not exist: reported by the test


def imports(module: str) -> dict[str, int]:
    """The eyas modules ``module`` imports, each with the first line that does."""
    path = (PACKAGE / Path(*module.split("."))).with_suffix(".py")
    tree = ast.parse(path.read_text())
    found: dict[str, int] = {}

    def add(name: str, line: int) -> None:
        found.setdefault(name, line)

    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            for alias in node.names:
                if alias.name.startswith("eyas."):
                    add(_resolve(alias.name.removeprefix("eyas.")), node.lineno)
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                raise AssertionError(f"{path.name}:{node.lineno}: a relative import; eyas imports absolutely")
            if node.module == "eyas" or (node.module or "").startswith("eyas."):
                base = node.module.removeprefix("eyas").removeprefix(".")
                for alias in node.names:  # `from eyas.core import dist` (a module) or a name from a module
                    sub = f"{base}.{alias.name}" if base else alias.name
                    is_module = (PACKAGE / Path(*sub.split("."))).with_suffix(".py").is_file()
                    add(sub if is_module else (_resolve(base) if base else "__init__"), node.lineno)
        elif isinstance(node, ast.Constant) and isinstance(node.value, str) and (m := TARGET.fullmatch(node.value)):
            add(_resolve(m.group(1)), node.lineno)
    found.pop(module, None)
    return found


def test_every_module_sits_in_a_ranked_folder():
    assert [m for m in _modules() if folder(m) not in FLOORS] == [], "give each new folder a floor in FLOORS"
    assert [f for f in FLOORS if f and not any(folder(m) == f for m in _modules())] == [], (
        "FLOORS names a folder that is gone"
    )


def test_no_upward_or_sideways_import():
    bad = []
    modules = set(_modules())
    for module in sorted(modules):
        mine = folder(module)
        for other, line in imports(module).items():
            theirs = folder(other)
            if other not in modules:
                bad.append(f"{module}:{line} imports eyas.{other}, which does not exist")
            elif theirs == mine:
                # (the package's __init__ lists its stages by name, as strings: STAGES imports none of them)
                if mine in SEALED and not other.endswith("__init__") and not module.endswith("__init__"):
                    bad.append(f"{module}:{line} imports eyas.{other}: stages meet only through files")
            elif FLOORS[theirs] >= FLOORS[mine] and theirs != "":
                bad.append(f"{module}:{line} (floor {FLOORS[mine]}, {mine}) imports eyas.{other} "
                           f"(floor {FLOORS[theirs]}, {theirs})")  # fmt: skip
    assert bad == []


def test_no_import_cycle():
    graph = {m: sorted(imports(m)) for m in _modules()}
    state: dict[str, int] = {}  # 1: on the current path, 2: done
    path: list[str] = []
    cycles = []

    def visit(m: str) -> None:
        state[m] = 1
        path.append(m)
        for n in graph.get(m, []):
            if state.get(n) == 1:
                cycles.append(" -> ".join(path[path.index(n) :] + [n]))
            elif n not in state:
                visit(n)
        path.pop()
        state[m] = 2

    for m in graph:
        if m not in state:
            visit(m)
    assert cycles == []


@pytest.mark.parametrize("source,expected", [
    ("from eyas.verifier.info import resolve\n", {"verifier.info"}),
    ("def f():\n    from eyas.core import dist as d\n    from eyas import __version__\n", {"core.dist", "__init__"}),
    ("import eyas.draft.model\n", {"draft.model"}),
    ("TARGETS = {'train': 'eyas.stages.train:train'}\n", {"stages.train"}),
])  # fmt: skip
def test_every_kind_of_import_is_seen(tmp_path, monkeypatch, source, expected):
    """The scan finds imports at module level and inside functions, by module and from a package, and the
    stage functions named as import targets."""
    (tmp_path / "probe.py").write_text(source)
    for name in ("core/dist", "verifier/info", "draft/model", "stages/train"):
        (tmp_path / f"{name}.py").parent.mkdir(exist_ok=True)
        (tmp_path / f"{name}.py").write_text("")
    monkeypatch.setattr(sys.modules[__name__], "PACKAGE", tmp_path)
    assert set(imports("probe")) == expected
