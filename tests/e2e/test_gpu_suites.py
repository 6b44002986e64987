"""The GPU suites' own logic on a CPU: `DRY_RUN=1 bash bench/gpu/SUITE.sh MODE` (bench/gpu/common.sh) writes each
command a mode would run instead of running it, so every mode of generate.sh, train.sh and extract.sh is checked
here the way a GPU call would run it: the mode exists and runs something, each bench it calls accepts the
arguments it is given (parsed by the bench's own parser), and each GPU test selection selects tests.
quality.sh runs for real at toy scale (tests/e2e/test_bench.py)."""

from __future__ import annotations

import json
import os
import re
import shlex
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
SUITES = ("generate", "train", "extract")

# run in one process for every bench command: the bench's own parser reads the arguments, then it stops
PARSE_ONLY = r"""
import argparse, contextlib, io, json, runpy, sys

class Parsed(Exception):
    pass

real = argparse.ArgumentParser.parse_args

def parse_args(self, args=None, namespace=None):
    real(self, args, namespace)
    raise Parsed

argparse.ArgumentParser.parse_args = parse_args
bad = []
for script, args in json.load(sys.stdin):
    sys.argv = [script, *args]
    err = io.StringIO()
    try:
        with contextlib.redirect_stderr(err), contextlib.redirect_stdout(io.StringIO()):
            runpy.run_path(script, run_name="__main__")
        bad.append([script, args, "ran without parsing arguments"])
    except Parsed:
        pass
    except SystemExit as e:
        bad.append([script, args, f"exit {e.code}: {err.getvalue()[-400:]}"])
print(json.dumps(bad))
"""


def modes(suite: str) -> list[str]:
    """The modes a suite's `case "$mode" in` accepts (train.sh's `ab` with each of its presets)."""
    text = (ROOT / "bench" / "gpu" / f"{suite}.sh").read_text()
    first = re.search(r'case "\$mode" in\n\s*([\w|-]+)\) ;;', text)
    assert first, f"{suite}.sh: no mode list"
    out = first.group(1).split("|")
    ab = re.search(r"\n\s*ab\) (.*) \|\| mode= ;;", text)
    if ab:
        out += [f"ab {p}" for p in re.findall(r"= (\w+) \]", ab.group(1))]
    return out


def dry_run(suite: str, mode: str, out: Path) -> tuple[subprocess.CompletedProcess, list[list[str]]]:
    env = {**os.environ, "DRY_RUN": "1", "OUT": str(out)}
    done = subprocess.run(["bash", f"bench/gpu/{suite}.sh", *mode.split()], cwd=ROOT, env=env, text=True,
                          capture_output=True, stdin=subprocess.DEVNULL, timeout=120)  # fmt: skip
    listed = out / "commands.txt"
    commands = [shlex.split(line) for line in listed.read_text().splitlines()] if listed.is_file() else []
    return done, commands


@pytest.mark.parametrize("suite", SUITES)
def test_gpu_suite_modes_run_what_they_say(suite, tmp_path):
    """Every mode of the suite runs at least one command (`part0` only keeps files), every bench accepts its
    arguments, and every GPU test selection selects tests; a call without a mode prints the usage and exits 2."""
    usage = subprocess.run(["bash", f"bench/gpu/{suite}.sh"], cwd=ROOT, capture_output=True, text=True,
                           env={**os.environ, "DRY_RUN": "1", "OUT": str(tmp_path / "usage")}, timeout=60)  # fmt: skip
    assert usage.returncode == 2 and "bash bench/gpu/" in usage.stderr, usage.stderr
    benches, selections = [], []
    names = modes(suite)
    assert len(names) >= 6, names
    for mode in names:
        done, commands = dry_run(suite, mode, tmp_path / mode.replace(" ", "-"))
        assert done.returncode == 0, f"{suite}.sh {mode}: {done.stdout[-2000:]}{done.stderr[-2000:]}"
        if mode == "part0":
            assert commands == [] and "nothing kept" in done.stdout, done.stdout
            continue
        assert commands, f"{suite}.sh {mode} runs nothing: {done.stdout[-2000:]}"
        for cmd in commands:
            if cmd[:3] == ["python3", "-m", "pytest"]:
                selections.append((mode, cmd[3:]))
            elif cmd[0] in ("python3", "torchrun"):
                script = next(a for a in cmd[1:] if a.endswith(".py"))
                benches.append([script, cmd[cmd.index(script) + 1 :]])
            else:
                assert cmd[0] == "dd", f"{suite}.sh {mode}: unexpected command {cmd}"
    for script, args in benches:
        assert (ROOT / script).is_file(), script
    checked = [[s, a] for s, a in benches if "parse_args" in (ROOT / s).read_text()]
    for script, args in benches:  # a script without a parser takes no arguments
        assert [script, args] in checked or args == [], (script, args)
    parsed = subprocess.run([sys.executable, "-c", PARSE_ONLY], cwd=ROOT, input=json.dumps(checked), text=True,
                            capture_output=True, timeout=600,
                            env={**os.environ, "PYTHONPATH": str(ROOT / "src")})  # fmt: skip
    assert parsed.returncode == 0, parsed.stderr[-3000:]
    assert json.loads(parsed.stdout.splitlines()[-1]) == [], parsed.stdout
    for mode, args in selections:
        tests = [a for a in args if a.startswith("tests/")]
        k = args[args.index("-k") + 1] if "-k" in args else None
        got = subprocess.run([sys.executable, "-m", "pytest", "--collect-only", "-q", "-p", "no:cacheprovider",
                              *tests, *(["-k", k] if k else [])], cwd=ROOT, capture_output=True, text=True,
                             timeout=300)  # fmt: skip
        collected = re.search(r"(\d+)(?:/\d+)? tests? collected", got.stdout)
        assert got.returncode == 0 and collected and int(collected.group(1)) > 0, (suite, mode, got.stdout[-1500:])
