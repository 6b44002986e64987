"""The package's imports run one way: base modules, then stages, then the pipeline, then the CLI.

Every ``eyas`` import is read from the source (module level and inside functions, ``from eyas import x`` and the
``"eyas.x:fn"`` targets the CLI and the pipeline import by name), and the test fails on an import cycle, on a
module no layer names, and on any import that runs upward or sideways between stages: a base module importing
a stage, a stage importing another stage (they meet only through files on disk), the pipeline or the CLI, and
the pipeline importing the CLI.
"""

from __future__ import annotations

import ast
import re
import sys
from pathlib import Path

import pytest

PACKAGE = Path(__file__).resolve().parents[1] / "src" / "eyas"

BASE, STAGE, PIPELINE, CLI = 0, 1, 2, 3
NAMES = {BASE: "base", STAGE: "stage", PIPELINE: "pipeline", CLI: "cli"}

#: Each module's layer. A new module must be placed here (the test fails until it is).
LAYERS: dict[str, int] = {
    "__init__": BASE,
    "errors": BASE,
    "manifest": BASE,
    "config": BASE,
    "validate": BASE,
    "dist": BASE,
    "named_sets": BASE,
    "datasets": BASE,
    "remote": BASE,
    "locate": BASE,
    "verifier_info": BASE,
    "verifier": BASE,
    "chat": BASE,
    "packed": BASE,
    "attention": BASE,
    "model": BASE,
    "checkpoint": BASE,
    "eagle": BASE,
    "features": BASE,
    "precision": BASE,
    "loss": BASE,
    "batches": BASE,
    "optim": BASE,
    "train_log": BASE,
    "trainer": BASE,
    "slots": BASE,
    "graphs": BASE,
    "generate": BASE,
    "speculative": BASE,
    "measure": BASE,
    "offline": BASE,
    "extractor": BASE,
    "data": STAGE,
    "regenerate": STAGE,
    "extract": STAGE,
    "vocab": STAGE,
    "train": STAGE,
    "evaluate": STAGE,
    "export": STAGE,
    "plan": STAGE,
    "pipeline": PIPELINE,
    "cli": CLI,
}

TARGET = re.compile(r"eyas\.(\w+):\w+")  # "eyas.train:train": a stage function imported by name


def _modules() -> list[str]:
    return sorted(p.stem for p in PACKAGE.glob("*.py"))


def imports(module: str) -> dict[str, int]:
    """The eyas modules ``module`` imports, each with the first line that does."""
    tree = ast.parse((PACKAGE / f"{module}.py").read_text())
    found: dict[str, int] = {}

    def add(name: str, line: int) -> None:
        found.setdefault(name, line)

    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            for alias in node.names:
                if alias.name.startswith("eyas."):
                    add(alias.name.split(".")[1], node.lineno)
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                raise AssertionError(f"{module}.py:{node.lineno}: a relative import; eyas imports absolutely")
            if node.module == "eyas":  # `from eyas import dist` (a module) or `__version__` (the package)
                for alias in node.names:
                    add(alias.name if (PACKAGE / f"{alias.name}.py").is_file() else "__init__", node.lineno)
            elif node.module and node.module.startswith("eyas."):
                add(node.module.split(".")[1], node.lineno)
        elif isinstance(node, ast.Constant) and isinstance(node.value, str) and (m := TARGET.fullmatch(node.value)):
            add(m.group(1), node.lineno)
    found.pop(module, None)
    return found


def test_every_module_has_a_layer():
    modules = _modules()
    assert [m for m in modules if m not in LAYERS] == [], "place each new module in LAYERS"
    assert [m for m in LAYERS if m not in modules] == [], "LAYERS names modules that no longer exist"


def test_no_upward_or_sideways_import():
    bad = []
    for module in _modules():
        mine = LAYERS[module]
        for other, line in imports(module).items():
            theirs = LAYERS.get(other)
            if theirs is None:
                bad.append(f"{module}.py:{line} imports eyas.{other}, which does not exist")
            elif theirs > mine or (theirs == mine and mine != BASE):
                bad.append(f"{module}.py:{line} ({NAMES[mine]}) imports eyas.{other} ({NAMES[theirs]})")
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
    ("from eyas.verifier import resolve\n", {"verifier"}),
    ("def f():\n    from eyas import dist as d\n    from eyas import __version__\n", {"dist", "__init__"}),
    ("import eyas.model\n", {"model"}),
    ("TARGETS = {'train': 'eyas.train:train'}\n", {"train"}),
])  # fmt: skip
def test_every_kind_of_import_is_seen(tmp_path, monkeypatch, source, expected):
    """The scan finds imports at module level and inside functions, by module and from the package, and the
    stage functions named as import targets."""
    (tmp_path / "probe.py").write_text(source)
    for name in ("dist", "verifier", "model", "train"):
        (tmp_path / f"{name}.py").write_text("")
    monkeypatch.setattr(sys.modules[__name__], "PACKAGE", tmp_path)
    assert set(imports("probe")) == expected
