"""A module's forward recognised by its source: the statements of a function, as ``ast.unparse`` writes them, so
that code which restates a transformers layer (:mod:`eyas.verifier.norm_ahead`, :mod:`eyas.verifier.decode_mlp`)
runs only where the layer's own forward is the pattern it restates, statement for statement."""

from __future__ import annotations

import ast
import inspect
import textwrap
from typing import Any


def function_ast(fn: Any) -> ast.FunctionDef | None:
    """The parsed definition of ``fn`` (past decorators that wrap it with ``functools.wraps``); None where its
    source cannot be read."""
    try:
        tree = ast.parse(textwrap.dedent(inspect.getsource(inspect.unwrap(fn))))
    except (OSError, TypeError, SyntaxError):
        return None
    f = tree.body[0] if tree.body else None
    return f if isinstance(f, ast.FunctionDef) else None


def body(f: ast.FunctionDef) -> list[ast.stmt]:
    """``f``'s statements, its docstring (and any other bare constant) left out."""
    return [s for s in f.body if not (isinstance(s, ast.Expr) and isinstance(s.value, ast.Constant))]


def statements(fn: Any) -> list[str] | None:
    """``fn``'s statements unparsed (comments and the docstring aside); None where its source cannot be read."""
    f = function_ast(fn)
    return None if f is None else [ast.unparse(s) for s in body(f)]
