"""Tests of eyas' Triton kernels on CPU, through Triton's interpreter (``TRITON_INTERPRET=1``).

`make setup` installs Triton in a dir of its own, which only a child process puts on its path: torch in the test
process never sees Triton without a GPU (it would take Triton's presence for a GPU's). A test calls
:func:`in_child` first: in the test process it runs the test again in a child with Triton on its path and the
interpreter on, asserts that it passed, and returns True (the test then returns); in the child it returns False
and the test runs."""

from __future__ import annotations

import importlib.util
import os
import subprocess
import sys
from pathlib import Path

import pytest

TRITON_DIR = Path(sys.prefix) / "triton-3.6.0"


def in_child(request, monkeypatch) -> bool:
    if importlib.util.find_spec("triton") is not None:  # the child, or a machine with Triton installed
        monkeypatch.setenv("TRITON_INTERPRET", "1")
        return False
    if not TRITON_DIR.is_dir():
        pytest.skip(f"Triton is not installed ({TRITON_DIR}: `make setup` puts it there)")
    env = {
        **os.environ,
        "PYTHONPATH": os.pathsep.join(filter(None, [str(TRITON_DIR), os.environ.get("PYTHONPATH")])),
        "TRITON_INTERPRET": "1",
    }
    r = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", request.node.nodeid],
                       cwd=request.config.rootpath, env=env, capture_output=True, text=True, timeout=900)  # fmt: skip
    assert r.returncode == 0 and " passed" in r.stdout, r.stdout[-4000:] + r.stderr[-2000:]
    return True
